"""The one place where a Task changes state (SPEC 2).

Every transition is a compare-and-set on the current state, appends a TaskEvent (old
state, new state, reason, actor, time), bumps ``version``, sends ``task_changed``
(``tasks_app/signals.py``: the sessions app re-evaluates the session's busy/idle there,
S1) and broadcasts the task after commit (B2). Callers hold the transaction.
"""
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F

from config.broadcast import broadcast
from tasks_app.models import (
    FINAL_STATES,
    Budget,
    MessageKind,
    OutboxMessage,
    Task,
    TaskEvent,
    TaskState,
)
from tasks_app.shapes import task_event
from tasks_app.signals import task_changed
from tasks_app.wakeups import machine_notify_after_commit


class TransitionConflict(Exception):
    """The task was no longer in an expected state: someone else won the compare-and-set."""


def task_record(task: Task, *, reason: str, actor: str, now: datetime) -> None:
    """Append a history row that changes no state (receipts that do not apply, decisions)."""
    TaskEvent.objects.create(
        task=task, old_state=task.state, new_state=task.state, reason=reason[:300], actor=actor, at=now
    )


def task_created(task: Task, *, actor: str, now: datetime) -> None:
    """History and broadcast of a newly accepted task (its first state, ``accepted``)."""
    TaskEvent.objects.create(task=task, old_state="", new_state=task.state, reason="accepted", actor=actor, at=now)
    message_send(task, kind=MessageKind.START, now=now)
    task_changed.send(sender=Task, task=task, now=now)
    _announce(task)


def task_publish(task: Task, *, now: datetime) -> None:
    """Bump ``version`` of a task whose visible fields changed without a state change, and
    broadcast it after commit."""
    Task.objects.filter(pk=task.pk).update(version=F("version") + 1, updated_at=now)
    task.refresh_from_db()
    _announce(task)


def task_transition(
    task: Task,
    *,
    from_states,
    to: str,
    reason: str,
    actor: str,
    now: datetime,
    **fields,
) -> Task:
    """Compare-and-set ``task.state`` from one of ``from_states`` to ``to``, also writing
    ``fields``. Returns the refreshed task. Raises TransitionConflict when the current state
    is not in ``from_states`` (a final state never changes again)."""
    from_states = set(from_states) - FINAL_STATES
    updates = {"state": to, "updated_at": now, "version": F("version") + 1, **fields}
    if to in FINAL_STATES:
        updates["final_at"] = now
    changed = Task.objects.filter(pk=task.pk, state__in=from_states).update(**updates)
    if changed != 1:
        raise TransitionConflict(f"task {task.pk} is not in {sorted(from_states)}")
    old_state = task.state
    task.refresh_from_db()
    TaskEvent.objects.create(task=task, old_state=old_state, new_state=to, reason=reason[:300], actor=actor, at=now)
    if to == TaskState.UNKNOWN:
        message_send(task, kind=MessageKind.QUERY, now=now, query_id=str(uuid.uuid4()))  # U1
    task_changed.send(sender=Task, task=task, now=now)
    _announce(task)
    return task


def task_finalize(
    task: Task,
    *,
    from_states,
    to: str,
    charge_s: float,
    reason: str,
    actor: str,
    now: datetime,
    keep_lock: bool = False,
    **fields,
) -> Task:
    """Move a task to a final state and settle its budget (J4): ``charge_s`` (capped at the
    reservation, 0 = full release) is spent and the rest of the reservation released; the
    folder lock is released unless ``keep_lock`` (survivors, L8).

    Lock order P2: the budget row is locked before the task row is written.
    """
    assert to in FINAL_STATES
    budget = Budget.objects.select_for_update().get(owner_id=task.owner_id)
    charge = max(0.0, min(float(charge_s or 0), task.reserved_s))
    task = task_transition(
        task,
        from_states=from_states,
        to=to,
        reason=reason,
        actor=actor,
        now=now,
        charged_s=charge,
        holds_lock=task.holds_lock and keep_lock,
        **fields,
    )
    Budget.objects.filter(pk=budget.pk).update(
        reserved_s=F("reserved_s") - task.reserved_s, spent_s=F("spent_s") + charge
    )
    return task


def message_send(task: Task, *, kind: str, now: datetime, **extra) -> OutboxMessage:
    """Queue an outbox message for the task's machine in the current transaction (W2)."""
    operation = task.operation
    payload = {"operation_id": str(operation.id), **extra}
    if kind == MessageKind.START:
        payload.update(
            task_id=str(task.id),
            folder=task.folder,
            grant_root=task.grant.path,
            agent=task.agent,
            prompt=task.prompt,
            max_runtime_s=task.max_runtime_s,
            session_id=str(task.session_id) if task.session_id else None,
            deep_research=task.deep_research,
        )
        if task.continued_from_id:  # G6: the agent session this follow-up continues
            payload["agent_session_id"] = task.continued_from.agent_session_id
    message = OutboxMessage.objects.create(
        machine_id=task.machine_id, operation=operation, kind=kind, payload=payload, created_at=now, visible_at=now
    )
    machine_notify_after_commit(task.machine_id)  # D1: wake the machine's waiting pull
    return message


def start_window_deadline(now: datetime) -> datetime:
    """Tasks created before this instant without a lease are past their start window (J5)."""
    return now - timedelta(seconds=settings.RUNSTEAD_START_WINDOW_S)


def _announce(task: Task) -> None:
    broadcast(task.owner_id, task_event(task))
