"""Leases on the service side (SPEC L1, L2, L5, L6, J5, L10).

A lease is granted at most once per operation, ever. Every check compares ``expires_at``
with the service clock inside its own transaction, so correctness never depends on the
sweep (L6).
"""
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction

from core.actors import ACTOR_SERVICE, actor_machine
from core.deadlocks import retry_on_deadlock
from core.errors import ApplicationError
from tasks_app.models import FINAL_STATES, NEVER_LEASED_STATES, Budget, Grant, Lease, Machine, Task, TaskState
from tasks_app.services.approvals import task_credential_issue
from tasks_app.services.locking import for_key_share, lock_budget
from tasks_app.services.transitions import (
    start_window_deadline,
    task_finalize,
    task_publish,
    task_transition,
)
from machine.protocol import OUTPUT_TAIL_MAX_CHARS



class LeaseRefused(ApplicationError):
    """409 with an L5 reason (``revoked``, ``unpaired``, ``cancelled``, ``max_runtime``,
    ``budget``, ``expired``) or an L1 reason (``final``, ``unknown``, ``start_window``; ``queued``, G8)."""

    status_code = 409

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(reason, detail or f"lease refused: {reason}")


@dataclass(frozen=True)
class LeaseTimings:
    duration_s: float
    renew_every_s: float
    margin_s: float
    kill_grace_s: float

    @classmethod
    def from_settings(cls) -> "LeaseTimings":
        return cls(
            settings.RUNSTEAD_LEASE_DURATION_S,
            settings.RUNSTEAD_LEASE_RENEW_S,
            settings.RUNSTEAD_LEASE_MARGIN_S,
            settings.RUNSTEAD_KILL_GRACE_S,
        )


def _machine_task(machine: Machine, *, operation_id=None, lease_id=None) -> Task:
    qs = Task.objects.filter(machine=machine)
    qs = qs.filter(operation__id=operation_id) if operation_id else qs.filter(leases__id=lease_id)
    task = qs.select_related("grant").first()
    if task is None:
        raise ApplicationError("not_found", "no such operation or lease for this machine", status_code=404)
    return task


def _standing_refusal(machine: Machine, task: Task) -> str | None:
    """L2 checks shared by grant and renewal: paired at this generation, the folder still
    granted (both rows locked FOR KEY SHARE, P1), the budget reservation in place."""
    rows = for_key_share(Machine.objects.filter(pk=machine.pk))
    if not rows or not rows[0].paired or rows[0].generation != machine.generation:
        return "unpaired"
    if not for_key_share(Grant.objects.filter(pk=task.grant_id, revoked_at__isnull=True)):
        return "revoked"
    budget = Budget.objects.get(owner_id=task.owner_id)
    if task.reserved_s <= 0 or budget.reserved_s + budget.spent_s > budget.limit_s:
        return "budget"
    return None


def lease_grant_answer(*, machine: Machine, operation_id, approval_credential: bool,
                       now: datetime) -> tuple[Lease, bool, dict | None]:
    """``POST /api/worker/leases/`` (L1, L2, Q5): ``lease_grant`` -> (lease, created,
    approval). With ``approval_credential`` (a profile with ``approvals = "ask"``),
    ``approval`` is ``{"credential": str, "wait_s": float}``: a fresh per-task approval
    credential (``task_credential_issue``: only its digest is stored, and each answer
    replaces the previous one, so a retried grant whose first answer was lost leaves
    exactly one usable secret) and the service's ``approval_wait_s`` in seconds (the
    hook's timeout goes above it). Else None. The credential travels only in this
    answer: never in the start message (stored in the outbox and delivered again, W2),
    never in a renewal."""
    lease, created = lease_grant(machine=machine, operation_id=operation_id, now=now)
    if not approval_credential:
        return lease, created, None
    credential = task_credential_issue(lease.task)
    return lease, created, {"credential": credential, "wait_s": settings.RUNSTEAD_APPROVAL_WAIT_S}


@retry_on_deadlock
def lease_grant(*, machine: Machine, operation_id, now: datetime) -> tuple[Lease, bool]:
    """Grant the operation's lease (L1, L2), or return the live one again.

    Returns (lease, created). Raises LeaseRefused (409) for a refused grant; a refusal
    because the start window passed also moves the task to ``not_started`` (J5), by
    compare-and-set against the sweep.
    """
    task = _machine_task(machine, operation_id=operation_id)
    with transaction.atomic():
        refusal = _standing_refusal(machine, task)
        lock_budget(task.owner_id)
        # of=("self",): a join would also lock the grant row FOR UPDATE, against the
        # FOR KEY SHARE other grants and acceptances hold on it (P1), and deadlock.
        task = Task.objects.select_for_update(of=("self",)).select_related("grant").get(pk=task.pk)
        lease = Lease.objects.select_for_update().filter(task=task).first()
        if refusal:
            pass
        elif task.state in FINAL_STATES:
            refusal = "final"
        elif task.state == TaskState.UNKNOWN:
            refusal = "unknown"
        elif task.state == TaskState.QUEUED:
            refusal = "queued"  # G8: no start before its turn (no start message was sent either)
        elif task.cancel_requested_at:
            refusal = "cancelled"  # J7: even while its lease is live
        elif lease is not None:
            # An operation never gets a second lease (L1).
            if lease.ended_at is None and lease.expires_at <= now:
                lease_expire(lease, now=now)  # L6 without waiting for the sweep
                refusal = lease.refused_reason or "expired"
            elif lease.refused_reason:
                refusal = lease.refused_reason  # L5: a refusal is final for the lease
            elif lease.ended_at is None and lease.generation == machine.generation:
                return lease, False
            elif lease.ended_at is None:
                refusal = "unpaired"  # granted under an earlier pairing (L2)
            else:
                refusal = "expired"
        elif (task.accepted_at or task.created_at) <= start_window_deadline(now):
            refusal = "start_window"
            task_finalize(
                task,
                from_states=NEVER_LEASED_STATES,
                to=TaskState.NOT_STARTED,
                charge_s=0,
                reason="start window passed (J5)",
                actor=ACTOR_SERVICE,
                now=now,
            )
        else:
            timings = LeaseTimings.from_settings()
            lease = Lease.objects.create(
                operation=task.operation,
                task=task,
                granted_at=now,
                expires_at=now + timedelta(seconds=timings.duration_s),
                generation=machine.generation,
                duration_s=timings.duration_s,
                renew_every_s=timings.renew_every_s,
                margin_s=timings.margin_s,
                kill_grace_s=timings.kill_grace_s,
            )
            task_transition(
                task,
                from_states=NEVER_LEASED_STATES,
                to=TaskState.STARTING,
                reason="lease granted",
                actor=actor_machine(machine),
                now=now,
            )
            return lease, True
    raise LeaseRefused(refusal)


@retry_on_deadlock
def lease_renew(*, machine: Machine, lease_id, output_tail: str | None, now: datetime) -> Lease:
    """Renew a lease for ``duration_s`` from ``now`` (L2), storing the agent's last output
    lines (L10). Raises LeaseRefused with an L5 reason; a refusal is final for the lease
    (kept on it). A lease found past ``expires_at`` expires here and its task becomes
    ``unknown`` (L6)."""
    task = _machine_task(machine, lease_id=lease_id)
    with transaction.atomic():
        refusal = _standing_refusal(machine, task)
        task = Task.objects.select_for_update().get(pk=task.pk)
        lease = Lease.objects.select_for_update().get(pk=lease_id)
        if lease.ended_at is None and lease.expires_at <= now:
            lease_expire(lease, now=now)  # L6 without waiting for the sweep
            refusal = lease.refused_reason or "expired"
        elif lease.refused_reason:
            refusal = lease.refused_reason  # L5: a refusal is final for the lease
        elif lease.ended_at is not None:
            refusal = "expired"
        elif refusal:
            pass
        elif lease.generation != machine.generation:
            refusal = "unpaired"  # L2: paired at this generation, the lease's own
        elif task.cancel_requested_at or task.state in FINAL_STATES:
            refusal = "cancelled"
        elif (now - lease.granted_at).total_seconds() >= task.max_runtime_s:
            refusal = "max_runtime"
        if refusal:
            if refusal != "expired":
                Lease.objects.filter(pk=lease.pk).update(refused_reason=refusal)
        else:
            lease.expires_at = now + timedelta(seconds=lease.duration_s)
            lease.renewals += 1
            lease.last_renewed_at = now
            lease.save(update_fields=["expires_at", "renewals", "last_renewed_at"])
            tail = (output_tail or "")[-OUTPUT_TAIL_MAX_CHARS:]
            if output_tail is not None and tail != task.output_tail:
                Task.objects.filter(pk=task.pk).update(output_tail=tail)
                task_publish(task, now=now)
            return lease
    raise LeaseRefused(refusal)


def lease_expire(lease: Lease, *, now: datetime) -> bool:
    """L6: end a lease past ``expires_at`` and move its task from starting/running to
    ``unknown`` (which queues a ``query``, U1). Budget and folder lock stay. Returns
    whether this call did it (compare-and-set; safe with several sweepers)."""
    if lease.expires_at > now:
        return False
    if not Lease.objects.filter(pk=lease.pk, ended_at__isnull=True).update(ended_at=now, end_reason="expired"):
        return False
    task = Task.objects.get(pk=lease.task_id)
    if task.state in (TaskState.STARTING, TaskState.RUNNING):
        task_transition(
            task,
            from_states=(TaskState.STARTING, TaskState.RUNNING),
            to=TaskState.UNKNOWN,
            reason="lease expired (L6)",
            actor=ACTOR_SERVICE,
            now=now,
        )
    return True
