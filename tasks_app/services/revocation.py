"""Grants, grant revocation and machine unpairing (SPEC P1, P3)."""
from datetime import datetime

from django.db import IntegrityError, transaction

from core.deadlocks import retry_on_deadlock
from core.errors import ApplicationError
from tasks_app.auth import machine_tokens_changed
from tasks_app.models import NEVER_LEASED_STATES, Grant, Machine, Task, TaskState
from tasks_app.services.folders import normalize_folder
from tasks_app.services.locking import lock_budget
from tasks_app.services.pairing import machine_publish
from tasks_app.services.transitions import followers_settle, task_finalize

# P3, G8: what a revocation ends at once: tasks never leased, and queued follow-ups
# (which would otherwise be refused only when their turn came).
NOT_STARTED_ON_REVOCATION = tuple(sorted(NEVER_LEASED_STATES | {TaskState.QUEUED}))


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
    """End ``tasks`` (never leased, or queued) ``not_started`` for ``reason``; then a
    follow-up queued behind one of them that this revocation did not reach (another
    folder's grant) gets what G8 gives a follow-up of a task without a session."""
    ended = []
    for task in tasks:
        ended.append(task_finalize(task, from_states=NOT_STARTED_ON_REVOCATION, to=TaskState.NOT_STARTED,
                                   charge_s=0, reason=reason, actor=actor, now=now, settle_followers=False))
    for task in ended:
        followers_settle(task, actor=actor, now=now)
    return len(ended)


@retry_on_deadlock
def grant_revoke(*, grant: Grant, actor: str, now: datetime) -> Grant:
    """P1: ``FOR UPDATE`` on the grant row, so no acceptance depending on it commits after
    this; P3: its never-leased tasks and queued follow-ups (G8) become ``not_started`` at once; lease grants and
    renewals for its tasks are refused from now on (``revoked``)."""
    with transaction.atomic():
        grant = Grant.objects.select_for_update().get(pk=grant.pk)
        if grant.revoked_at is None:
            grant.revoked_at = now
            grant.save(update_fields=["revoked_at"])
            lock_budget(grant.owner_id)
            tasks = Task.objects.filter(grant=grant, state__in=NOT_STARTED_ON_REVOCATION).order_by("pk").select_for_update()
            _not_start(tasks, reason="grant revoked (P3)", actor=actor, now=now)
        return grant


@retry_on_deadlock
def machine_unpair(*, machine: Machine, actor: str, now: datetime) -> Machine:
    """P1/P3 for a whole machine: ``FOR UPDATE`` on its row, token invalidated (any token
    then answers 401 ``token_revoked``), never-leased tasks and queued follow-ups (G8)
    ``not_started``."""
    with transaction.atomic():
        machine = Machine.objects.select_for_update().get(pk=machine.pk)
        if machine.paired:
            machine_tokens_changed()  # K1: its token, cached anywhere, is refused
            Machine.objects.filter(pk=machine.pk).update(paired=False, token_hash="", unpaired_at=now)
            lock_budget(machine.owner_id)
            tasks = Task.objects.filter(machine=machine, state__in=NOT_STARTED_ON_REVOCATION).order_by("pk").select_for_update()
            _not_start(tasks, reason="machine unpaired (P3)", actor=actor, now=now)
            machine.refresh_from_db()
            machine_publish(machine, now=now)
        return machine
