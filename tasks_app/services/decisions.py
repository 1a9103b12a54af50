"""Owner decisions on ``unknown`` tasks (SPEC U3). Nothing is retried automatically."""
import uuid
from datetime import datetime

from django.db import transaction

from core.actors import actor_owner
from core.errors import ApplicationError
from tasks_app.models import MessageKind, Task, TaskState
from tasks_app.services.locking import lock_budget
from tasks_app.services.transitions import message_send, task_finalize, task_record

DECISIONS = {
    "succeeded": TaskState.SUCCEEDED,
    "failed": TaskState.FAILED,
    "abandoned": TaskState.ABANDONED,
}


def task_decide(*, task: Task, decision: str, user, now: datetime) -> Task:
    """Settle an ``unknown`` task by the owner's decision: ``succeeded`` or ``failed``
    charge ``runtime_s`` if known, else the whole reservation; ``abandoned`` ("it never
    ran") releases it in full. Releases the folder lock, even one kept for survivors, and
    records who and when. Raises ApplicationError 409 ``not_unknown``."""
    if decision not in DECISIONS:
        raise ApplicationError("invalid", f"unknown decision {decision!r}")
    with transaction.atomic():
        lock_budget(task.owner_id)
        task = Task.objects.select_for_update().get(pk=task.pk)
        if task.state != TaskState.UNKNOWN:
            raise ApplicationError("not_unknown", f"the task is {task.state}, not unknown", status_code=409)
        charge = 0 if decision == "abandoned" else (task.runtime_s if task.runtime_s is not None else task.reserved_s)
        return task_finalize(
            task,
            from_states=[TaskState.UNKNOWN],
            to=DECISIONS[decision],
            charge_s=charge,
            reason=f"owner decision: {decision}",
            actor=actor_owner(user),
            now=now,
            decided_by=user,
            decided_at=now,
            state_reason=f"decided by {user.get_username()}",
        )


def task_ask_again(*, task: Task, user, now: datetime) -> None:
    """Send the worker another ``query`` for an ``unknown`` task (U1, U3)."""
    with transaction.atomic():
        task = Task.objects.select_for_update().get(pk=task.pk)
        if task.state != TaskState.UNKNOWN:
            raise ApplicationError("not_unknown", f"the task is {task.state}, not unknown", status_code=409)
        message_send(task, kind=MessageKind.QUERY, now=now, query_id=str(uuid.uuid4()))
        task_record(task, reason="owner asked the worker again", actor=actor_owner(user), now=now)


def task_clear_survivor_lock(*, task: Task, user, now: datetime) -> None:
    """Release the folder lock a final task kept for its survivors (L8)."""
    with transaction.atomic():
        if Task.objects.filter(pk=task.pk, holds_lock=True, final_at__isnull=False).update(holds_lock=False):
            task_record(task, reason="owner cleared the survivors' folder lock", actor=actor_owner(user), now=now)
