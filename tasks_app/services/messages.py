"""The worker's outbox pull and acknowledgement (SPEC W2, D1, H)."""
import logging
import threading
import time
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F

from config import clock
from config.errors import ApplicationError
from tasks_app.models import Machine, MessageKind, OutboxMessage, Task, TaskState
from tasks_app.protocol import LONG_POLL_MAX_S
from tasks_app.services.transitions import TransitionConflict, task_transition
from tasks_app.wakeups import machine_notify

POLL_SLICE_S = 0.2
BATCH = 20

log = logging.getLogger("runstead.messages")


# Set when the server begins to stop (config/server_hooks.py): waiting pulls return.
server_stopping = threading.Event()


def messages_pull(*, machine: Machine, wait_s: float) -> list[OutboxMessage]:
    """Long-poll in the calling thread (WSGI, the test client) for up to ``wait_s``
    seconds (at most ``LONG_POLL_MAX_S``, 25): first the machine's delivered but unacknowledged messages (a new pull
    means the previous connection is gone, D1), then visible ones, polling every
    POLL_SLICE_S without holding a transaction; returns early (empty) when the server
    stops. Under daphne, ``tasks_app.longpoll`` waits without a thread instead. Each
    returned message becomes invisible for RUNSTEAD_MESSAGE_VISIBILITY_S seconds and is
    delivered again if not acknowledged by then (W2)."""
    deadline = time.monotonic() + max(0.0, min(wait_s, LONG_POLL_MAX_S))
    new_pull = True
    while True:
        claimed = messages_take(machine_id=machine.pk, now=clock.now(), new_pull=new_pull)
        new_pull = False
        if claimed or time.monotonic() >= deadline or server_stopping.wait(POLL_SLICE_S):
            return claimed


def messages_take(*, machine_id, now: datetime, new_pull: bool) -> list[OutboxMessage]:
    """Take up to BATCH of the machine's unacknowledged messages, oldest first: the
    visible ones, and with ``new_pull`` also those delivered to an earlier pull and not
    acknowledged (one poller per machine: that pull's connection is gone, D1). Each taken
    message is hidden for RUNSTEAD_MESSAGE_VISIBILITY_S seconds (W2). Compare-and-set per
    message, so two concurrent pulls never both take one delivery."""
    visible_until = now + timedelta(seconds=settings.RUNSTEAD_MESSAGE_VISIBILITY_S)
    pending = OutboxMessage.objects.filter(machine_id=machine_id, acked_at__isnull=True)
    if not new_pull:
        pending = pending.filter(visible_at__lte=now)
    candidates = list(pending.order_by("created_at", "id").values_list("id", "visible_at")[:BATCH])
    if not candidates:
        return []
    claimed = []
    with transaction.atomic():
        for message_id, seen_visible_at in candidates:
            if OutboxMessage.objects.filter(pk=message_id, visible_at=seen_visible_at, acked_at__isnull=True).update(
                visible_at=visible_until, deliveries=F("deliveries") + 1
            ):
                claimed.append(message_id)
    return list(OutboxMessage.objects.filter(pk__in=claimed).order_by("created_at", "id"))


def messages_release(*, machine_id, message_ids, now: datetime | None = None) -> int:
    """Make messages that a pull took but could not hand over (its client disconnected)
    visible again at once, and wake the machine's pulls (D1). Returns how many."""
    now = now or clock.now()
    released = OutboxMessage.objects.filter(machine_id=machine_id, pk__in=list(message_ids), acked_at__isnull=True).update(
        visible_at=now
    )
    if released:
        machine_notify(machine_id)
    return released


def machines_with_visible_messages(machine_ids) -> set[str]:
    """Of ``machine_ids``, those with a visible unacknowledged message now: the long-poll's
    one safety re-check for all waiting pulls of a process (D1). One query per 500 ids."""
    now = clock.now()
    ids = list(machine_ids)
    found = set()
    for start in range(0, len(ids), 500):
        found.update(
            str(m)
            for m in OutboxMessage.objects.filter(
                machine_id__in=ids[start : start + 500], acked_at__isnull=True, visible_at__lte=now
            ).values_list("machine_id", flat=True).distinct()
        )
    return found


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
