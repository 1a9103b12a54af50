"""Grants, grant revocation and machine unpairing (SPEC P1, P3)."""
from datetime import datetime

from django.db import IntegrityError, transaction

from config.errors import ApplicationError
from tasks_app.models import NEVER_LEASED_STATES, Grant, Machine, Task, TaskState
from tasks_app.services.acceptance import normalize_folder
from tasks_app.services.locking import lock_budget, retry_on_deadlock
from tasks_app.services.pairing import machine_publish
from tasks_app.services.transitions import task_finalize


def grant_create(*, owner, machine_id, path: str, now: datetime) -> tuple[Grant, bool]:
    """Let one of the owner's machines work in ``path`` (absolute) and below. Idempotent:
    an active grant of the same machine and path is returned again (a database constraint
    keeps one), so a single revocation always ends the permission. Returns
    (grant, created). Raises ApplicationError 403 ``machine_forbidden`` for a machine that
    is not the owner's."""
    path = normalize_folder(path)
    machine = Machine.objects.filter(pk=machine_id, owner=owner).first()
    if machine is None:
        raise ApplicationError("machine_forbidden", "no such machine among yours", status_code=403)
    try:
        with transaction.atomic():
            return Grant.objects.create(owner=owner, machine=machine, path=path), True
    except IntegrityError:  # grant_one_active_per_path: a concurrent or earlier grant
        return Grant.objects.get(machine=machine, path=path, revoked_at__isnull=True), False


def _not_start(tasks, *, reason: str, actor: str, now: datetime) -> int:
    count = 0
    for task in tasks:
        task_finalize(task, from_states=NEVER_LEASED_STATES, to=TaskState.NOT_STARTED, charge_s=0, reason=reason, actor=actor, now=now)
        count += 1
    return count


@retry_on_deadlock
def grant_revoke(*, grant: Grant, actor: str, now: datetime) -> Grant:
    """P1: ``FOR UPDATE`` on the grant row, so no acceptance depending on it commits after
    this; P3: its never-leased tasks become ``not_started`` at once; lease grants and
    renewals for its tasks are refused from now on (``revoked``)."""
    with transaction.atomic():
        grant = Grant.objects.select_for_update().get(pk=grant.pk)
        if grant.revoked_at is None:
            grant.revoked_at = now
            grant.save(update_fields=["revoked_at"])
            lock_budget(grant.owner_id)
            tasks = Task.objects.filter(grant=grant, state__in=NEVER_LEASED_STATES).order_by("pk").select_for_update()
            _not_start(tasks, reason="grant revoked (P3)", actor=actor, now=now)
        return grant


@retry_on_deadlock
def machine_unpair(*, machine: Machine, actor: str, now: datetime) -> Machine:
    """P1/P3 for a whole machine: ``FOR UPDATE`` on its row, token invalidated (any token
    then answers 401 ``token_revoked``), never-leased tasks ``not_started``."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update().get(pk=machine.pk)
        if machine.paired:
            Machine.objects.filter(pk=machine.pk).update(paired=False, token_hash="", unpaired_at=now)
            lock_budget(machine.owner_id)
            tasks = Task.objects.filter(machine=machine, state__in=NEVER_LEASED_STATES).order_by("pk").select_for_update()
            _not_start(tasks, reason="machine unpaired (P3)", actor=actor, now=now)
            machine.refresh_from_db()
            machine_publish(machine, now=now)
        return machine
