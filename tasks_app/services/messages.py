"""The worker's outbox pull and acknowledgement (SPEC W2, H)."""
import threading
import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F

from config import clock
from config.errors import ApplicationError
from tasks_app.models import Machine, MessageKind, OutboxMessage, Task, TaskState
from tasks_app.services.transitions import TransitionConflict, task_transition

MAX_WAIT_S = 25
POLL_SLICE_S = 0.2
BATCH = 20


# Set when the server begins to stop (config/server_hooks.py): waiting pulls return.
server_stopping = threading.Event()


def messages_pull(*, machine: Machine, wait_s: float) -> list[OutboxMessage]:
    """Long-poll for up to ``wait_s`` seconds (<= 25) for the machine's visible,
    unacknowledged messages, holding no transaction while waiting; returns early (empty)
    when the server stops. Each returned message becomes invisible for
    RUNSTEAD_MESSAGE_VISIBILITY_S seconds and is delivered again if not acknowledged by
    then (W2)."""
    deadline = time.monotonic() + max(0.0, min(wait_s, MAX_WAIT_S))
    while True:
        claimed = _claim(machine, now=clock.now())
        if claimed or time.monotonic() >= deadline or server_stopping.wait(POLL_SLICE_S):
            return claimed


def _claim(machine: Machine, *, now: datetime) -> list[OutboxMessage]:
    visible_until = now + timedelta(seconds=settings.RUNSTEAD_MESSAGE_VISIBILITY_S)
    candidates = list(
        OutboxMessage.objects.filter(machine=machine, acked_at__isnull=True, visible_at__lte=now).values_list(
            "id", "visible_at"
        )[:BATCH]
    )
    claimed = []
    for message_id, seen_visible_at in candidates:
        # Compare-and-set, so two concurrent pulls never both take one delivery.
        if OutboxMessage.objects.filter(pk=message_id, visible_at=seen_visible_at, acked_at__isnull=True).update(
            visible_at=visible_until, deliveries=F("deliveries") + 1
        ):
            claimed.append(message_id)
    return list(OutboxMessage.objects.filter(pk__in=claimed).order_by("created_at", "id"))


def message_ack(*, machine: Machine, message_id, now: datetime) -> None:
    """Acknowledge a message (idempotent, W2). Acknowledging a ``start`` moves its task
    from ``accepted`` to ``delivered``. Raises ApplicationError 404 for another machine's
    message."""
    with transaction.atomic():
        message = OutboxMessage.objects.select_related("operation__task").filter(pk=message_id, machine=machine).first()
        if message is None:
            raise ApplicationError("not_found", "no such message", status_code=404)
        if message.acked_at is not None:
            return
        OutboxMessage.objects.filter(pk=message.pk, acked_at__isnull=True).update(acked_at=now)
        if message.kind == MessageKind.START:
            task: Task = message.operation.task
            try:
                task_transition(
                    task, from_states=[TaskState.ACCEPTED], to=TaskState.DELIVERED, reason="start message acknowledged",
                    actor=f"machine:{machine.name}", now=now,
                )
            except TransitionConflict:
                pass  # already further along (a lease can come before the ack)
