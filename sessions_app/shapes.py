"""Wire shapes of the sessions app (SPEC H, M, S, B2, B4): the JSON that the sessions API
answers, that ``session.status`` / ``marker`` board events carry and that the board
snapshot is made of, written once.

Plain functions of model rows, no DRF (healthchecks' ``Check.to_dict``): views, services
and the board all render through them. Times are ISO-8601 UTC strings (``iso`` of
``tasks_app.shapes``); ``now`` is the service clock of the answer (M3 ``running`` and
S3/S4/S7 ``counts`` are evaluated at it). The ``*Out`` serializers in
``sessions_app/api/serializers.py`` only describe these shapes for the OpenAPI schema.
"""
from datetime import datetime

from sessions_app.rules import job_counts, marker_is_running
from tasks_app.shapes import iso


def marker_dict(marker, *, now: datetime) -> dict:
    """One marker (M1-M8): ``{session_id, device_id, device_name, turn_id, state,
    deep_research, started_at, expires_at, ended_at, version, running}``; ``running`` is
    M3 at ``now`` (the board re-evaluates it on its own timer, B3)."""
    return {
        "session_id": str(marker.session_id),
        "device_id": marker.device_id,
        "device_name": marker.device_name,
        "turn_id": marker.turn_id,
        "state": marker.state,
        "deep_research": marker.deep_research,
        "started_at": iso(marker.started_at),
        "expires_at": iso(marker.expires_at),
        "ended_at": iso(marker.ended_at),
        "version": marker.version,
        "running": marker_is_running(marker, now),
    }


def marker_event(marker, *, now: datetime) -> dict:
    """The ``marker`` board event (B2): the marker with ``type``; ``server_time`` is added
    by the broadcast."""
    return {"type": "marker", **marker_dict(marker, now=now)}


def session_info(session) -> dict:
    """I6, what a board shows of a session besides its status: ``{agent, title, cwd,
    attention, attention_message, attention_since}``."""
    return {
        "agent": session.agent,
        "title": session.title,
        "cwd": session.cwd,
        "attention": session.attention,
        "attention_message": session.attention_message,
        "attention_since": iso(session.attention_since),
    }


def session_dict(session, *, markers, now: datetime) -> dict:
    """One session with its markers (all of them, ended ones too, so a board can order
    later events by version, B2): ``{id, title, agent, cwd, attention,
    attention_message, attention_since, status, status_since, version, created_at,
    markers: [marker]}``."""
    return {
        "id": str(session.id),
        **session_info(session),
        "status": session.status,
        "status_since": iso(session.status_since),
        "version": session.version,
        "created_at": iso(session.created_at),
        "markers": [marker_dict(m, now=now) for m in markers],
    }


def session_status_event(session) -> dict:
    """The ``session.status`` board event (S2, I6): ``{type, session_id, status, version,
    agent, title, cwd, attention, attention_message, attention_since}``; ``server_time``
    is added by the broadcast."""
    return {
        "type": "session.status", "session_id": str(session.pk), "status": session.status, "version": session.version,
        **session_info(session),
    }


def session_deleted_event(session_id, *, version: int) -> dict:
    """The ``session.deleted`` board event: open boards drop the session."""
    return {"type": "session.deleted", "session_id": str(session_id), "version": version}


def active_sessions_dict(sessions, *, now: datetime) -> dict:
    """``GET /api/sessions/active/`` (S6): ``{"sessions": [{id, status, since}], "server_time"}``."""
    return {
        "sessions": [{"id": str(s.id), "status": s.status, "since": iso(s.status_since)} for s in sessions],
        "server_time": iso(now),
    }


def marker_write_dict(result, *, now: datetime) -> dict:
    """Answer of ``PUT /api/sessions/{id}/marker/``: ``{outcome, reason?, marker}``."""
    body = {"outcome": result.outcome, "marker": marker_dict(result.marker, now=now) if result.marker else None}
    if result.reason:
        body["reason"] = result.reason
    return body


def job_dict(job, *, now: datetime) -> dict:
    """One job (S3, S4, S7): ``{job_id, mode, auto_backgrounded, created_at, finished_at,
    wakes, consumed_at, cancelled_at, version, counts}``; ``counts`` is whether it keeps
    the session busy at ``now``."""
    return {
        "job_id": job.job_id,
        "mode": job.mode,
        "auto_backgrounded": job.auto_backgrounded,
        "created_at": iso(job.created_at),
        "finished_at": iso(job.finished_at),
        "wakes": job.wakes,
        "consumed_at": iso(job.consumed_at),
        "cancelled_at": iso(job.cancelled_at),
        "version": job.version,
        "counts": job_counts(job, now),
    }


def stop_dict(result) -> dict:
    """Answer of ``POST /api/sessions/{id}/stop/`` (S5)."""
    return {
        "markers_closed": result.markers_closed,
        "jobs_cancelled": result.jobs_cancelled,
        "tasks_cancelled": result.tasks_cancelled,
        "status": result.session.status,
        "version": result.session.version,
    }
