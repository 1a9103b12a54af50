"""The task steps of the periodic sweep (SPEC L6, J5, N1/U2, A7), safe with several processes (O2).

Each step claims rows with ``select_for_update(skip_locked=True)`` (PostgreSQL) and
changes them by compare-and-set, so two sweepers never process a row twice. Correctness
never depends on the sweep: lease checks compare ``expires_at`` themselves (L6).

The pass that runs them with the session steps (S7), its loop and ``manage.py sweep``
live in ``board/sweep.py``, the layer that sees both apps.
"""
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Q

from core.actors import ACTOR_SWEEP
from tasks_app.models import NEVER_LEASED_STATES, IdempotencyRecord, Lease, Task, TaskState
from tasks_app.services.leases import lease_expire
from tasks_app.services.locking import lock_budget
from tasks_app.services.transitions import TransitionConflict, start_window_deadline, task_ask_owner, task_finalize

BATCH = 100


def expire_leases(*, now: datetime) -> int:
    """L6: leases past ``expires_at`` end and their tasks become ``unknown``. Returns how
    many this call expired."""
    done = 0
    # Uses the partial index lease_live_expiry.
    due = Lease.objects.filter(ended_at__isnull=True, expires_at__lte=now).values_list("id", "task_id")[:BATCH]
    for lease_id, task_id in due:
        with transaction.atomic():
            # Lock order P2 (task, then lease), as renewals and receipts take them; a row
            # another process holds is skipped and seen again on the next pass.
            if Task.objects.select_for_update(skip_locked=True).filter(pk=task_id).first() is None:
                continue
            lease = Lease.objects.select_for_update(skip_locked=True).filter(pk=lease_id, ended_at__isnull=True).first()
            if lease is not None and lease_expire(lease, now=now):
                done += 1
    return done


def expire_start_windows(*, now: datetime) -> int:
    """J5: tasks with no lease within the start window (from ``accepted_at``) become
    ``not_started`` with a full release; the grant decides by the same compare-and-set, so exactly one wins."""
    done = 0
    deadline = start_window_deadline(now)
    # Uses the index task_state_accepted (a promoted follow-up's window opens at its
    # promotion, G8).
    for task_id, owner_id in Task.objects.filter(state__in=NEVER_LEASED_STATES, accepted_at__lte=deadline).values_list(
        "id", "owner_id"
    )[:BATCH]:
        with transaction.atomic():
            lock_budget(owner_id)
            task = Task.objects.select_for_update(skip_locked=True).filter(pk=task_id, state__in=NEVER_LEASED_STATES).first()
            if task is None or task.leases.exists():
                continue
            try:
                task_finalize(
                    task, from_states=NEVER_LEASED_STATES, to=TaskState.NOT_STARTED, charge_s=0,
                    reason="start window passed (J5)", actor=ACTOR_SWEEP, now=now,
                )
                done += 1
            except TransitionConflict:
                pass
    return done


def ask_owners_of_unsettled_tasks(*, now: datetime) -> int:
    """N1, U2: an ``unknown`` task whose query had no report by its ``decision_due_at``
    (``RUNSTEAD_UNKNOWN_ASK_S`` after the query) is put to its owner
    (``transitions.task_ask_owner``: notified, listed first). Returns how many owners
    this call asked."""
    done = 0
    # Uses the partial index task_decision_due.
    due = Task.objects.filter(state=TaskState.UNKNOWN, decision_asked_at__isnull=True,
                              decision_due_at__lte=now).values_list("id", flat=True)[:BATCH]
    for task_id in due:
        with transaction.atomic():
            task = Task.objects.select_for_update(skip_locked=True).filter(pk=task_id).first()
            if task is not None and task_ask_owner(
                    task, reason=f"no report from the worker within {settings.RUNSTEAD_UNKNOWN_ASK_S:g} s of the query",
                    actor=ACTOR_SWEEP, now=now):
                done += 1
    return done


def cleanup_idempotency_records(*, now: datetime) -> int:
    """A7: delete idempotency records whose operation has been final for longer than
    RUNSTEAD_IDEMPOTENCY_RETENTION_S, and records tied to no task (a session approval's
    decision, Q2: final when written) older than that. A plain DELETE: two processes at
    once delete each row once."""
    cutoff = now - timedelta(seconds=settings.RUNSTEAD_IDEMPOTENCY_RETENTION_S)
    expired = Q(task__final_at__lt=cutoff) | Q(task__isnull=True, created_at__lt=cutoff)
    deleted, _ = IdempotencyRecord.objects.filter(expired).delete()
    return deleted


def tasks_sweep(*, now: datetime) -> dict:
    """The task steps of one sweep pass, in order; returns how much each found (a step
    that finds nothing costs one indexed query). ``board.sweep`` composes them
    with the session steps."""
    return {
        "leases_expired": expire_leases(now=now),
        "start_windows": expire_start_windows(now=now),
        "owners_asked": ask_owners_of_unsettled_tasks(now=now),
        "idempotency_deleted": cleanup_idempotency_records(now=now),
    }
