"""The one place where a Task changes state (SPEC 2).

Every transition is a compare-and-set on the current state, appends a TaskEvent (old
state, new state, reason, actor, time), bumps ``version``, moves the task's conversation
messages along (``message_states.messages_follow_task``, C3), sends ``task_changed``
(``tasks_app/signals.py``: what hears it in the other apps is listed in
``sessions_app/receivers.py``) and broadcasts the task after commit (B2). Callers hold the
transaction.
"""
import uuid
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import F

from core.broadcast import broadcast
from core.longpoll import notify_after_commit
from machine.protocol.shapes import check_message
from tasks_app.models import (
    FINAL_STATES,
    Budget,
    Grant,
    Machine,
    MessageKind,
    OutboxMessage,
    Task,
    TaskEvent,
    TaskState,
)
from tasks_app.services.folders import folder_lock_holder
from tasks_app.services.message_states import messages_follow_task
from tasks_app.services.payloads import BUILDERS
from tasks_app.shapes import task_event
from tasks_app.signals import task_changed


class TransitionConflict(Exception):
    """The task was no longer in an expected state: someone else won the compare-and-set."""


def task_record(task: Task, *, reason: str, actor: str, now: datetime) -> None:
    """Append a history row that changes no state (receipts that do not apply, decisions)."""
    TaskEvent.objects.create(
        task=task, old_state=task.state, new_state=task.state, reason=reason[:300], actor=actor, at=now
    )


def task_created(task: Task, *, actor: str, now: datetime) -> None:
    """History and broadcast of a newly accepted task: its first state, ``accepted``
    with its ``start`` message, or ``queued`` behind the task it follows (G8: no message
    until its turn)."""
    if task.state == TaskState.QUEUED:
        reason = f"queued behind {task.queued_behind_id} (G8)"
    else:
        reason = "accepted"
    TaskEvent.objects.create(task=task, old_state="", new_state=task.state, reason=reason, actor=actor, at=now)
    if task.state != TaskState.QUEUED:
        message_send(task, kind=MessageKind.START, now=now)
    messages_follow_task(task, now=now)  # C3
    task_changed.send(sender=Task, task=task, now=now)  # the other apps (sessions_app/receivers.py)
    _announce(task)


def task_publish(task: Task, *, now: datetime) -> None:
    """Bump ``version`` of a task whose visible fields changed without a state change, and
    broadcast it after commit. ``task`` may have been read with some columns deferred
    (``.only``): the whole row is read again here."""
    Task.objects.filter(pk=task.pk).update(version=F("version") + 1, updated_at=now)
    task.refresh_from_db(fields=[field.name for field in Task._meta.concrete_fields])  # also those a narrow read left out
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
    if to == TaskState.UNKNOWN:
        # N1, U2: the worker's record gets the first word; the owner only after the bound.
        updates["decision_due_at"] = unknown_ask_deadline(now)
    if to in FINAL_STATES:
        updates["final_at"] = now
        updates["attention"] = ""  # Q5: its pending approvals are withdrawn (sessions_app.receivers)
    changed = Task.objects.filter(pk=task.pk, state__in=from_states).update(**updates)
    if changed != 1:
        raise TransitionConflict(f"task {task.pk} is not in {sorted(from_states)}")
    old_state = task.state
    task.refresh_from_db()
    TaskEvent.objects.create(task=task, old_state=old_state, new_state=to, reason=reason[:300], actor=actor, at=now)
    if to == TaskState.UNKNOWN:
        message_send(task, kind=MessageKind.QUERY, now=now, query_id=str(uuid.uuid4()))  # U1
    messages_follow_task(task, now=now)  # C3
    task_changed.send(sender=Task, task=task, now=now)  # the other apps (sessions_app/receivers.py)
    _announce(task)
    return task


def unknown_ask_deadline(now: datetime) -> datetime:
    """N1, U2: an ``unknown`` task whose query (sent at ``now``) has no report by this
    instant is put to its owner (``RUNSTEAD_UNKNOWN_ASK_S`` later)."""
    return now + timedelta(seconds=settings.RUNSTEAD_UNKNOWN_ASK_S)


def task_ask_owner(task: Task, *, reason: str, actor: str, now: datetime) -> bool:
    """N1, U2: the facts could not settle this ``unknown`` task (the worker's report had
    no final facts, or the final facts leave the outcome unknown, J6 row 2, or no report
    came within ``RUNSTEAD_UNKNOWN_ASK_S`` of the query): its owner decides now. A
    compare-and-set on (``unknown``, not yet asked) sets ``decision_asked_at``, records
    ``reason``, bumps ``version``, sends ``task_changed`` (the owner's ``unknown``
    notification, ``sessions_app/receivers.py``) and broadcasts the task (listed first on
    the board, B1). Returns False, changing nothing, when the task is no longer
    ``unknown`` or its owner was already asked. Call inside the caller's transaction."""
    changed = Task.objects.filter(pk=task.pk, state=TaskState.UNKNOWN, decision_asked_at__isnull=True).update(
        decision_asked_at=now, updated_at=now, version=F("version") + 1)
    if changed != 1:
        return False
    task.refresh_from_db()
    task_record(task, reason=f"needs the owner's decision: {reason}", actor=actor, now=now)
    task_changed.send(sender=Task, task=task, now=now)  # N1 (sessions_app/receivers.py)
    _announce(task)
    return True


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
    settle_followers: bool = True,
    **fields,
) -> Task:
    """Move a task to a final state and settle its budget (J4): ``charge_s`` (capped at the
    reservation, 0 = full release) is spent and the rest of the reservation released; the
    folder lock is released unless ``keep_lock`` (survivors, L8). Then, in the same
    transaction, the follow-up queued behind it gets its turn (G8, ``followers_settle``;
    ``settle_followers=False`` only for the ends of a chain, which settle it themselves).

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
    if settle_followers:
        followers_settle(task, actor=actor, now=now)
    return task


# --- G8: queued follow-ups --------------------------------------------------------------

RESUME_UNAVAILABLE = "resume_unavailable"


def queued_follower(task: Task) -> Task | None:
    """The follow-up queued behind ``task`` (G8), locked ``FOR UPDATE``, or None. Its
    id first: every final task asks, and most have none (the row with its joins only then)."""
    pk = (Task.objects.select_for_update().filter(queued_behind=task, state=TaskState.QUEUED)
          .order_by("created_at", "pk").values_list("pk", flat=True).first())
    return None if pk is None else Task.objects.select_related("continued_from", "grant").get(pk=pk)


def followers_settle(task: Task, *, actor: str, now: datetime) -> None:
    """G8, when ``task`` has just become final: its queued follow-up is cancelled with
    its chain when ``task`` was cancelled; refused with its chain (``not_started``,
    ``refused_reason: resume_unavailable``) when ``task`` has no agent session id to
    resume; else promoted (``task_promote``). An ``unknown`` task is not final: its
    follow-ups stay queued."""
    follower = queued_follower(task)
    if follower is None:
        return
    if task.state == TaskState.CANCELLED:
        queue_end(follower, to=TaskState.CANCELLED, reason=f"the task it follows ({task.pk}) was cancelled",
                  actor=actor, now=now)
    elif not task.agent_session_id:
        queue_end(follower, to=TaskState.NOT_STARTED, code=RESUME_UNAVAILABLE,
                  reason=f"the task it follows ({task.pk}) ended without an agent session id to resume",
                  actor=actor, now=now)
    else:
        task_promote(follower, actor=actor, now=now)


def followers_cancel(task: Task, *, actor: str, now: datetime) -> int:
    """J7, G8: cancel the follow-ups queued behind ``task`` (its whole chain) at once.
    Returns how many were cancelled."""
    follower = queued_follower(task)
    if follower is None:
        return 0
    return queue_end(follower, to=TaskState.CANCELLED, reason=f"the task it follows ({task.pk}) was cancelled",
                     actor=actor, now=now)


def queue_end(first: Task, *, to: str, reason: str, actor: str, now: datetime, code: str = "") -> int:
    """End the queued task ``first`` and every follow-up queued behind it, in order, as
    ``to`` (``cancelled`` or ``not_started`` with H's ``refused_reason`` ``code``). A
    queued task holds no budget and no lock, so nothing is released. Returns how many."""
    done, task = 0, first
    while task is not None:
        fields = {"state_reason": f"{code}: {reason}" if code else reason}
        if code:
            fields["facts"] = {"process_started": False, "refused_reason": code}
        task_finalize(task, from_states=[TaskState.QUEUED], to=to, charge_s=0, reason=reason, actor=actor, now=now,
                      settle_followers=False, **fields)
        done += 1
        task = queued_follower(task)
    return done


def budget_reserve(budget: Budget | None, seconds: float) -> bool:
    """A5: reserve ``seconds`` of the owner's budget row ``budget`` (locked FOR UPDATE by
    the caller), or return False, changing nothing, when fewer are left (or no row)."""
    if budget is None or budget.limit_s - budget.reserved_s - budget.spent_s < seconds:
        return False
    Budget.objects.filter(pk=budget.pk).update(reserved_s=F("reserved_s") + seconds)
    return True


def task_promote(task: Task, *, actor: str, now: datetime) -> Task:
    """G8: the queued ``task``'s turn has come (the task it follows is final, with an
    agent session id). A5-A8 apply now as at acceptance: the machine still paired, the
    grant not revoked, the folder lock (unless a worktree task) and the budget; then
    ``queued -> accepted`` with the reservation, the lock and its ``start`` message
    (which carries the followed task's agent session id as it is now, G6), and its J5
    start window opens (``accepted_at``). A refusal ends it ``not_started`` with the
    A6 code as its reason, and the follow-ups behind it ``resume_unavailable``.

    The caller holds the owner's budget row and the followed task's row (P2)."""
    refusal = None
    holds_lock = task.exclusive and task.isolation != "worktree"
    budget = Budget.objects.select_for_update().filter(owner_id=task.owner_id).first()
    if not Machine.objects.filter(pk=task.machine_id, paired=True).exists():
        refusal = ("machine_unpaired", "the machine is not paired")
    elif not Grant.objects.filter(pk=task.grant_id, revoked_at__isnull=True).exists():
        refusal = ("folder_not_granted", "the grant for its folder was revoked")
    elif holds_lock and (holder := folder_lock_holder(task.machine_id, task.folder)) is not None:
        refusal = ("folder_locked", f"task {holder.pk} holds its folder, an ancestor or a descendant")
    elif not budget_reserve(budget, float(task.max_runtime_s)):
        refusal = ("budget_exhausted", "not enough budget left for max_runtime_s")
    if refusal is not None:
        code, detail = refusal
        return task_finalize(task, from_states=[TaskState.QUEUED], to=TaskState.NOT_STARTED, charge_s=0,
                             reason=f"refused when its turn came: {code} ({detail})", actor=actor, now=now,
                             state_reason=f"{code}: {detail}", facts={"process_started": False, "refused_reason": code})
    reserve = float(task.max_runtime_s)
    task = task_transition(task, from_states=[TaskState.QUEUED], to=TaskState.ACCEPTED,
                           reason=f"its turn: {task.queued_behind_id} is final (G8)", actor=actor, now=now,
                           reserved_s=reserve, holds_lock=holds_lock, accepted_at=now)
    message_send(task, kind=MessageKind.START, now=now)
    return task


def outbox_key(machine_id) -> str:
    """The ``core.longpoll`` key of a machine's outbox: its long-poll waits on it, and
    whatever makes one of its messages visible notifies it (D1)."""
    return f"machine.{machine_id}"


def message_send(task: Task, *, kind: str, now: datetime, **extra) -> OutboxMessage:
    """Queue an outbox message of ``kind`` for the task's machine in the current
    transaction (W2). Its payload is built by the kind's builder (``payloads.BUILDERS``,
    called with ``extra``) and checked against the kind's shape in
    ``machine.protocol.shapes`` (``ProtocolError`` on a field the shape does not name)."""
    payload = check_message(kind, BUILDERS[kind](task, **extra))
    message = OutboxMessage.objects.create(
        machine_id=task.machine_id, operation=task.operation, kind=kind, payload=payload, created_at=now,
        visible_at=now,
    )
    notify_after_commit(outbox_key(task.machine_id))  # D1: wake the machine's waiting pull
    return message


def start_window_deadline(now: datetime) -> datetime:
    """Tasks accepted (``accepted_at``) before this instant without a lease are past their
    start window (J5)."""
    return now - timedelta(seconds=settings.RUNSTEAD_START_WINDOW_S)


def _announce(task: Task) -> None:
    broadcast(task.owner_id, task_event(task))
