"""The read-side rules of markers and jobs (SPEC M3, S3, S4, S7), each written once: as a
predicate on one row and as the equivalent queryset filter. Pure; no writes, no events.
Used by the services (S1), the wire shapes (``running``, ``counts``) and the board."""
from datetime import datetime, timedelta

from django.conf import settings
from django.db.models import Q

from sessions_app.models import Job, JobMode, Marker, MarkerState


def marker_grace() -> timedelta:
    return timedelta(seconds=settings.RUNSTEAD_MARKER_GRACE_S)


def marker_is_running(marker: Marker, now: datetime) -> bool:
    """M3, the one reader rule: RUNNING only while ``state == running`` and
    ``now < expires_at + grace`` (``RUNSTEAD_MARKER_GRACE_S``, 60 s). Pure; used by S1, the
    API and the board snapshot."""
    return marker.state == MarkerState.RUNNING and now < marker.expires_at + marker_grace()


def running_markers_q(now: datetime) -> Q:
    """M3 as a queryset filter on Marker (same rule as ``marker_is_running``)."""
    return Q(state=MarkerState.RUNNING, expires_at__gt=now - marker_grace())


def counting_jobs_q(now: datetime) -> Q:
    """S3, S4, S7 as a queryset filter on Job: held, not cancelled, younger than
    ``RUNSTEAD_JOB_HOLD_MAX_S``, and unfinished or finished with ``wakes`` and not yet
    consumed by a wake turn."""
    return (
        Q(mode=JobMode.HELD, cancelled_at__isnull=True)
        & Q(created_at__gt=now - timedelta(seconds=settings.RUNSTEAD_JOB_HOLD_MAX_S))
        & (Q(finished_at__isnull=True) | Q(wakes=True, consumed_at__isnull=True))
    )


def job_counts(job: Job, now: datetime) -> bool:
    """Whether one job keeps its session busy now (S3, S4, S7); same rule as
    ``counting_jobs_q``."""
    if job.mode != JobMode.HELD or job.cancelled_at is not None:
        return False
    if now >= job.created_at + timedelta(seconds=settings.RUNSTEAD_JOB_HOLD_MAX_S):
        return False
    return job.finished_at is None or (bool(job.wakes) and job.consumed_at is None)
