"""The worker's outbox pull and acknowledgement (SPEC W2, W5, D1, H)."""
import logging
import random
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F

from core import clock
from core.deadlocks import retry_on_deadlock
from core.errors import ApplicationError
from core.longpoll import Wait, notify
from tasks_app.models import Machine, MessageKind, OutboxMessage, Task, TaskState
from machine.protocol import LONG_POLL_MAX_S, PULL_END_JITTER
from tasks_app.services.pairing import machines_heard
from tasks_app.services.transitions import TransitionConflict, outbox_key, task_transition

BATCH = 20

log = logging.getLogger("runstead.messages")


def messages_wait(*, machine: Machine, wait_s: float) -> Wait:
    """The worker's long-poll ``GET /api/worker/messages/?wait=S`` as a ``core.longpoll.Wait``
    on ``outbox_key(machine.pk)``, for ``take_or_wait`` (ASGI) or ``take_or_wait_sync``
    (WSGI); its result is a list of ``OutboxMessage`` (empty after ``wait_s`` seconds,
    at most ``LONG_POLL_MAX_S``, 25, less a random share of up to ``PULL_END_JITTER``
    so that pulls begun together end apart). The pull's start records the machine heard
    (P2) and makes the first take, which also takes the machine's delivered but
    unacknowledged messages; under ASGI the starts of an event loop are checked together
    first (``messages_starts``). The wait is exclusive: a new pull means the previous
    connection is gone (one poller per machine, W5, D1). Woken after the commit that
    makes a message visible (``transitions.message_send``, ``messages_release``); the
    safety re-check is ``outbox_ready``; what a pull took for a client that went away or
    that a newer pull superseded while its take ran is released (``messages_release``)."""

    def take(first: bool) -> list[OutboxMessage]:
        now = clock.now()
        if first:
            machines_heard([machine], now=now)  # a no-op after messages_starts
        return messages_take(machine_id=machine.pk, now=now, new_pull=first)

    def release(taken: list[OutboxMessage]) -> None:
        messages_release(machine_id=machine.pk, taken=taken)

    return Wait(
        key=outbox_key(machine.pk), take=take,
        timeout_s=min(wait_s, LONG_POLL_MAX_S) * (1 - PULL_END_JITTER * random.random()),
        exclusive=True, ready=outbox_ready, release=release, empty=[],
        starts=messages_starts, subject=machine,
    )


def messages_starts(waits: list[Wait]) -> set[str]:
    """The starts of ``waits`` (``messages_wait``'s, ``subject`` their machine) that began
    together on one event loop (D1; issue 22: idle pulls cost no transaction each): records
    their machines heard (``pairing.machines_heard``, one UPDATE) and returns the keys of
    those whose first take would find something, that is with an unacknowledged message,
    visible or delivered to an earlier pull (one SELECT per 500 machines), all in one
    transaction. The others begin waiting without a first take."""
    machines = {wait.subject.pk: wait.subject for wait in waits}
    with transaction.atomic():
        machines_heard(list(machines.values()), now=clock.now())
        found = _machines_with_messages(list(machines))
    return {outbox_key(machine_id) for machine_id in found}


def _machines_with_messages(ids: list, **filters) -> set:
    """Of machine ``ids``, those with an unacknowledged message matching ``filters``: one
    query per 500 machines."""
    found = set()
    for start in range(0, len(ids), 500):
        found.update(
            OutboxMessage.objects.filter(machine_id__in=ids[start : start + 500], acked_at__isnull=True, **filters)
            .values_list("machine_id", flat=True).distinct()
        )
    return found


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


def messages_release(*, machine_id, taken: list[OutboxMessage], now: datetime | None = None) -> int:
    """Make messages that a pull took (``taken``, as ``messages_take`` returned them) but
    could not hand over (its client disconnected, a newer pull superseded it) visible
    again at once, and wake the machine's pulls (D1). A message that another pull has
    taken since (its ``visible_at`` moved on) or that was acknowledged stays as it is, so
    nothing is delivered twice for it. Returns how many were released."""
    now = now or clock.now()
    released = 0
    with transaction.atomic():
        for message in taken:
            released += OutboxMessage.objects.filter(
                machine_id=machine_id, pk=message.pk, visible_at=message.visible_at, acked_at__isnull=True
            ).update(visible_at=now)
    if released:
        notify(outbox_key(machine_id))
    return released


def outbox_ready(keys: list[str]) -> set[str]:
    """Of ``keys`` (``outbox_key`` of machines), those whose machine has a visible
    unacknowledged message now: the long-poll's one safety re-check for all waiting
    pulls of an event loop (D1). One query per 500 machines."""
    by_id = {key.removeprefix(outbox_key("")): key for key in keys}
    return {by_id[str(m)] for m in _machines_with_messages(list(by_id), visible_at__lte=clock.now())}


@retry_on_deadlock
def message_ack(*, machine: Machine, message_id, now: datetime) -> None:
    """Acknowledge a message (idempotent, W2). Acknowledging a ``start`` moves its task
    from ``accepted`` to ``delivered``. Raises ApplicationError 404 for another machine's
    message. P2: the task row is locked before the message row, as ``task_cancel`` does
    (which acknowledges a cancelled task's ``start`` itself)."""
    with transaction.atomic():
        message = OutboxMessage.objects.select_related("operation__task").filter(pk=message_id, machine=machine).first()
        if message is None:
            raise ApplicationError("not_found", "no such message", status_code=404)
        if message.acked_at is not None:
            return
        if message.kind == MessageKind.START:
            task: Task = message.operation.task
            try:
                task_transition(
                    task, from_states=[TaskState.ACCEPTED], to=TaskState.DELIVERED, reason="start message acknowledged",
                    actor=f"machine:{machine.name}", now=now,
                )
            except TransitionConflict:
                pass  # already further along (a lease can come before the ack)
        OutboxMessage.objects.filter(pk=message.pk, acked_at__isnull=True).update(acked_at=now)
