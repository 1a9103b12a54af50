"""Leases on the service side (SPEC L1, L2, L5, L6, J5, L10).

A lease is granted at most once per operation, ever. Every check compares ``expires_at``
with the service clock inside its own transaction, so correctness never depends on the
sweep (L6).
"""
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import F

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


def _not_found() -> ApplicationError:
    return ApplicationError("not_found", "no such operation or lease for this machine", status_code=404)


def _machine_task(machine: Machine, operation_id) -> Task:
    task = Task.objects.filter(machine=machine, operation__id=operation_id).select_related("grant").first()
    if task is None:
        raise _not_found()
    return task


# The task columns a renewal reads (of 56; a busy machine renews every interval, issue 44):
# those ``_standing_refusals`` checks, and under lock those ``leases_renew`` checks.
STANDING_TASK_FIELDS = ("grant_id", "owner_id", "reserved_s")
RENEWAL_TASK_FIELDS = ("id", "state", "cancel_requested_at", "max_runtime_s", "output_tail")


def _standing_refusals(machine: Machine, tasks: list[Task]) -> dict:
    """L2 checks shared by grant and renewal, for ``tasks`` of ``machine`` (rows read before
    the transaction): paired at this generation, the folder still granted (both rows locked
    FOR KEY SHARE, P1, grants by primary key), the budget reservation in place. Returns
    ``{task id: L5 reason or None}``; must run inside the transaction that acts on it."""
    if not tasks:
        return {}
    rows = for_key_share(Machine.objects.filter(pk=machine.pk).only("id", "paired", "generation"))
    if not rows or not rows[0].paired or rows[0].generation != machine.generation:
        return dict.fromkeys((task.pk for task in tasks), "unpaired")
    live = {grant.pk for grant in for_key_share(Grant.objects.filter(
        pk__in={task.grant_id for task in tasks}, revoked_at__isnull=True).order_by("pk").only("id"))}
    budgets = {budget.owner_id: budget for budget in Budget.objects.filter(owner_id__in={t.owner_id for t in tasks})}
    refusals = {}
    for task in tasks:
        budget = budgets[task.owner_id]
        if task.grant_id not in live:
            refusals[task.pk] = "revoked"
        elif task.reserved_s <= 0 or budget.reserved_s + budget.spent_s > budget.limit_s:
            refusals[task.pk] = "budget"
        else:
            refusals[task.pk] = None
    return refusals


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
    task = _machine_task(machine, operation_id)
    with transaction.atomic():
        refusal = _standing_refusals(machine, [task])[task.pk]
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


def lease_renew(*, machine: Machine, lease_id, output_tail: str | None, now: datetime) -> Lease:
    """Renew one lease (``POST /api/worker/leases/<id>/renew/``): ``leases_renew`` with one
    item. Returns the renewed Lease; raises its refusal (404 ``not_found``, LeaseRefused)."""
    (answer,) = leases_renew(machine=machine, items=[{"lease_id": lease_id, "output_tail": output_tail}], now=now)
    if isinstance(answer, ApplicationError):
        raise answer
    return answer


@retry_on_deadlock
def leases_renew(*, machine: Machine, items: list[dict], now: datetime) -> list:
    """Renew the leases ``items`` (``[{"lease_id", "output_tail"?}]``) of one machine for
    ``duration_s`` from ``now`` (L2), storing each agent's last output lines (L10), all in
    one transaction: a renewal sync costs about as much with 2 leases as with 1 (issue 44).
    Returns, in the order given, the renewed Lease or the refusal (not raised): an
    ApplicationError 404 ``not_found`` (not this machine's lease) or a LeaseRefused with an
    L5 reason. A refusal is final for the lease (kept on it) and changes nothing for the
    others. A lease found past ``expires_at`` expires here and its task becomes ``unknown``
    (L6). Locks in the P2 order (machine, grants, tasks, leases; each kind by primary key);
    the budget row is read, not locked, as for a single renewal."""
    by_id = {str(lease.pk): lease for lease in
             Lease.objects.filter(pk__in={str(i["lease_id"]) for i in items}, task__machine=machine)
             .select_related("task").only("id", "task", *(f"task__{name}" for name in STANDING_TASK_FIELDS))}
    answers: list = [None] * len(items)
    with transaction.atomic():
        tasks = {lease.task_id: lease.task for lease in by_id.values()}
        standing = _standing_refusals(machine, list(tasks.values()))
        locked_tasks = {task.pk: task for task in Task.objects.select_for_update().filter(pk__in=tasks)
                        .order_by("pk").only(*RENEWAL_TASK_FIELDS)}
        locked = {str(lease.pk): lease for lease in
                  Lease.objects.select_for_update().filter(pk__in=by_id).order_by("pk")}
        renewed, tails = {}, {}
        for index, item in enumerate(items):
            lease = locked.get(str(item["lease_id"]))
            if lease is None:
                answers[index] = _not_found()
                continue
            task, refusal = locked_tasks[lease.task_id], standing[lease.task_id]
            if lease.ended_at is None and lease.expires_at <= now:
                lease_expire(lease, now=now)  # L6 without waiting for the sweep
                lease.ended_at = now
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
                if refusal != "expired" and lease.refused_reason != refusal:
                    lease.refused_reason = refusal
                    Lease.objects.filter(pk=lease.pk).update(refused_reason=refusal)
                answers[index] = LeaseRefused(refusal)
                continue
            lease.expires_at = now + timedelta(seconds=lease.duration_s)
            lease.renewals += 1
            lease.last_renewed_at = now
            renewed[lease.pk] = lease
            answers[index] = lease
            if item.get("output_tail") is not None:
                tails[task.pk] = item["output_tail"][-OUTPUT_TAIL_MAX_CHARS:]
        # One plain UPDATE per new expiry (one per lease length, usually one): bulk_update's
        # CASE per row and field cost more CPU than the renewal's checks.
        by_expiry: dict[datetime, list] = {}
        for lease in renewed.values():
            by_expiry.setdefault(lease.expires_at, []).append(lease.pk)
        for expires_at, pks in by_expiry.items():
            Lease.objects.filter(pk__in=pks).update(expires_at=expires_at, renewals=F("renewals") + 1,
                                                    last_renewed_at=now)
        for task_id, tail in tails.items():
            task = locked_tasks[task_id]
            if tail != task.output_tail:
                Task.objects.filter(pk=task_id).update(output_tail=tail)
                task_publish(task, now=now)
    return answers


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
