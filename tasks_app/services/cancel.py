"""Cancel (SPEC J7)."""
from datetime import datetime

from django.db import transaction

from core.deadlocks import retry_on_deadlock
from core.errors import ApplicationError
from tasks_app.models import FINAL_STATES, NEVER_LEASED_STATES, MessageKind, OutboxMessage, Task, TaskState
from tasks_app.services.locking import lock_budget
from tasks_app.services.transitions import (
    TransitionConflict,
    followers_cancel,
    message_send,
    queue_end,
    task_finalize,
    task_publish,
    task_record,
)


@retry_on_deadlock
def task_cancel(*, task: Task, actor: str, now: datetime) -> Task:
    """J7. A task never leased becomes ``cancelled`` at once with a full release (its
    unacknowledged ``start`` message is withdrawn). A leased or ``unknown`` task gets
    ``cancel_requested_at`` and a ``cancel`` message; its state waits for the facts (or
    lease expiry / the owner). G8: a ``queued`` task is cancelled at once, and every
    cancel cancels the follow-ups queued behind the task at once (the whole chain), so
    none of them runs whatever the task's facts turn out to be. Raises ApplicationError
    409 ``already_final``."""
    with transaction.atomic():
        lock_budget(task.owner_id)
        task = Task.objects.select_for_update().get(pk=task.pk)
        if task.state in FINAL_STATES:
            raise ApplicationError("already_final", f"the task is already {task.state}", status_code=409)
        if task.state == TaskState.QUEUED:
            queue_end(task, to=TaskState.CANCELLED, reason="cancelled while queued", actor=actor, now=now)
            return Task.objects.get(pk=task.pk)
        followers_cancel(task, actor=actor, now=now)
        if task.state in NEVER_LEASED_STATES:
            try:
                task = task_finalize(
                    task, from_states=NEVER_LEASED_STATES, to=TaskState.CANCELLED, charge_s=0,
                    reason="cancelled before any lease", actor=actor, now=now,
                )
            except TransitionConflict:  # pragma: no cover - the row lock above prevents it
                raise ApplicationError("conflict", "the task changed state, retry", status_code=409)
            OutboxMessage.objects.filter(operation__task=task, kind=MessageKind.START, acked_at__isnull=True).update(
                acked_at=now
            )
            return task
        if task.cancel_requested_at is None:
            Task.objects.filter(pk=task.pk).update(cancel_requested_at=now)
            task_record(task, reason="cancel requested", actor=actor, now=now)
            message_send(task, kind=MessageKind.CANCEL, now=now)
            task_publish(task, now=now)
        return task
