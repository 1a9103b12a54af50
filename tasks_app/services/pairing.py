"""Pairing codes and machine tokens (SPEC K1)."""
import secrets
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F, Q

from core.errors import ApplicationError
from core.broadcast import broadcast, broadcast_all
from tasks_app.auth import machine_tokens_changed, token_digest
from tasks_app.models import Machine, PairingAttempt, PairingCode
from tasks_app.shapes import machine_event, machine_is_offline

CODE_ALPHABET = "ABCDEFGHJKLMNPQRSTUVWXYZ23456789"  # 32 symbols, no look-alikes
CODE_LENGTH = 12  # 60 bits (K1 asks for at least 40)
MAX_FAILED_ATTEMPTS_PER_MINUTE = 30
# P2, B7: ``last_heard_at`` is written at most this often per machine (seconds). An idle
# worker is heard at each pull start (every ~25 s) whatever this is; a busy one also at each
# renewal sync (every ~15 s), and at 5 s every request of it wrote, a transaction of its
# own: 1,000 busy machines, about 65 a second (issue 44). "Offline" begins 90 s after.
LAST_HEARD_WRITE_EVERY_S = 20


def pairing_code_create(*, owner, name: str = "", machine_id=None, now: datetime) -> tuple[str, PairingCode]:
    """A one-time code for a new machine (``name``) or to re-pair ``machine_id``; expires in
    RUNSTEAD_PAIRING_CODE_TTL_S seconds (600). Returns (code, row); only the hash is stored.
    Raises ApplicationError 404 for a machine that is not the owner's."""
    machine = None
    if machine_id is not None:
        machine = Machine.objects.filter(pk=machine_id, owner=owner).first()
        if machine is None:
            raise ApplicationError("not_found", "no such machine", status_code=404)
    code = "".join(secrets.choice(CODE_ALPHABET) for _ in range(CODE_LENGTH))
    row = PairingCode.objects.create(
        owner=owner,
        machine=machine,
        name=name or (machine.name if machine else ""),
        code_hash=token_digest(code),
        expires_at=now + timedelta(seconds=settings.RUNSTEAD_PAIRING_CODE_TTL_S),
    )
    return code, row


def _normalize_code(code: str) -> str:
    return code.strip().upper().replace("-", "").replace(" ", "")


def machine_pair(*, code: str, name: str = "", client: str = "", now: datetime) -> tuple[Machine, str]:
    """Exchange a pairing code for a machine token (single use, unexpired). A re-pair bumps
    the machine's generation so the old token answers 401 ``token_revoked``. Attempts are
    counted in the database per ``client`` (its address); too many failures from one
    client in a minute answer 429. Returns
    (machine, token). Raises ApplicationError 400 ``pairing_code_invalid`` or 429."""
    recent_failures = PairingAttempt.objects.filter(client=client, at__gte=now - timedelta(minutes=1), ok=False).count()
    if recent_failures >= MAX_FAILED_ATTEMPTS_PER_MINUTE:
        raise ApplicationError("too_many_attempts", "too many pairing attempts, wait a minute", status_code=429,
                               headers={"Retry-After": "60"}, retry_after_s=60)
    with transaction.atomic():
        row = (
            PairingCode.objects.select_for_update()
            .filter(code_hash=token_digest(_normalize_code(code)), used_at__isnull=True, expires_at__gt=now)
            .first()
        )
        if row is not None:
            PairingCode.objects.filter(pk=row.pk).update(attempts=F("attempts") + 1, used_at=now)
            token = secrets.token_urlsafe(32)
            if row.machine_id:
                machine = Machine.objects.select_for_update().get(pk=row.machine_id)
                machine_tokens_changed()  # K1: the old token, cached anywhere, is refused
                machine.generation += 1
                machine.version += 1
            else:
                machine = Machine(owner_id=row.owner_id, name=row.name or "machine", generation=1)
            if name:
                machine.name = name
            machine.token_hash = token_digest(token)
            machine.paired = True
            machine.unpaired_at = None
            machine.last_heard_at = now
            machine.save()
            machine_publish(machine, now=now)
        PairingAttempt.objects.create(at=now, client=client, ok=row is not None)
    if row is None:
        raise ApplicationError("pairing_code_invalid", "unknown, used or expired pairing code", status_code=400)
    return machine, token


def machine_publish(machine: Machine, *, now: datetime) -> None:
    """Broadcast a machine's state (B7 at ``now``) to its owner's boards (B2) after commit."""
    broadcast(machine.owner_id, machine_event(machine, now=now))


def machines_heard(machines: list[Machine], *, now: datetime) -> None:
    """Record that the service heard from each of ``machines`` at ``now`` (UTC), outside
    business transactions (P2), at most every LAST_HEARD_WRITE_EVERY_S (20) seconds per
    machine: one UPDATE for all that are due (the pull starts of an event loop come here
    together, ``messages.messages_starts``). A write that brings an offline machine back
    is broadcast (B7). A ``machine.last_heard_at`` may be older than its row's (the pull's
    machine comes from ``tasks_app.auth.MachineTokenCache``, and other processes write
    too): each write is conditional on the row's own value, and ``machine.last_heard_at``
    is set to what was written."""
    due = [m for m in machines
           if m.last_heard_at is None or (now - m.last_heard_at).total_seconds() >= LAST_HEARD_WRITE_EVERY_S]
    if not due:
        return
    never = Q(last_heard_at__isnull=True)
    back = [m.pk for m in due if machine_is_offline(m.last_heard_at, now)]
    offline_since = now - timedelta(seconds=settings.RUNSTEAD_MACHINE_OFFLINE_S)
    with transaction.atomic(savepoint=False):
        if back:  # those that really come back, by their rows, are announced
            back = list(Machine.objects.select_for_update().filter(pk__in=back).order_by("pk")
                        .filter(never | Q(last_heard_at__lt=offline_since)).values_list("pk", flat=True))
        Machine.objects.filter(pk__in=[m.pk for m in due]).filter(
            never | Q(last_heard_at__lte=now - timedelta(seconds=LAST_HEARD_WRITE_EVERY_S))
        ).update(last_heard_at=now, version=F("version") + 1)
        if back:
            broadcast_all([(m.owner_id, machine_event(m, now=now)) for m in Machine.objects.filter(pk__in=back).order_by("pk")])
    for machine in due:
        machine.last_heard_at = now
