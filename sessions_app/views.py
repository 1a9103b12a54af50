"""The board (SPEC B1-B8): the page at ``/`` and its snapshot ``GET /api/board/``.

The page is rendered by Django with the owner's snapshot embedded (``json_script``), so it
shows the board before the WebSocket opens; ``static/board.js`` then keeps it live from
``/ws/board/`` events and re-hydrates from ``/api/board/`` on every (re)connect and every
60 s (B4).
"""
from datetime import datetime

from django.conf import settings
from django.contrib.auth.decorators import login_required
from django.shortcuts import render
from rest_framework.response import Response
from rest_framework.views import APIView

from config import clock

# Bounds of one snapshot: every unfinished task is a live concern (capped defensively);
# finished tasks and idle sessions are history, so only the most recent ones are shown.
SNAPSHOT_UNFINISHED_TASKS = 200
SNAPSHOT_FINISHED_TASKS = 50
SNAPSHOT_IDLE_SESSIONS = 50
SNAPSHOT_BUSY_SESSIONS = 200


def _iso(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _marker_dict(marker, now: datetime) -> dict:
    """One marker as in the ``marker`` event (H), plus ``running`` by M3 on the service
    clock (the board recomputes it on its own timer, B3)."""
    from sessions_app.services import marker_is_running

    return {
        "session_id": str(marker.session_id),
        "device_id": marker.device_id,
        "device_name": getattr(marker, "device_name", "") or "",
        "turn_id": str(marker.turn_id),
        "state": marker.state,
        "deep_research": bool(getattr(marker, "deep_research", False)),
        "started_at": _iso(marker.started_at),
        "expires_at": _iso(marker.expires_at),
        "ended_at": _iso(getattr(marker, "ended_at", None)),
        "version": marker.version,
        "running": marker_is_running(marker, now),
    }


def _markers_by_session(session_ids, now: datetime) -> dict:
    """All markers (one per session and device, M7) of the given sessions, ended ones
    included so the board can order later events against their versions (B2)."""
    try:
        from sessions_app.models import Marker
    except ImportError:  # markers not built yet
        return {}
    grouped: dict = {}
    for marker in Marker.objects.filter(session_id__in=session_ids).order_by("started_at"):
        grouped.setdefault(marker.session_id, []).append(_marker_dict(marker, now))
    return grouped


def _session_rows(owner):
    from sessions_app.models import Session, SessionStatus

    busy = list(Session.objects.filter(owner=owner, status=SessionStatus.BUSY).order_by("-status_since")[:SNAPSHOT_BUSY_SESSIONS])
    idle = list(
        Session.objects.filter(owner=owner).exclude(status=SessionStatus.BUSY).order_by("-status_since")[:SNAPSHOT_IDLE_SESSIONS]
    )
    return busy + idle


def _task_rows(owner):
    from tasks_app.models import FINAL_STATES, Task

    base = Task.objects.filter(owner=owner).select_related("machine")
    unfinished = list(base.exclude(state__in=FINAL_STATES).order_by("-created_at")[:SNAPSHOT_UNFINISHED_TASKS])
    finished = list(base.filter(state__in=FINAL_STATES).order_by("-final_at", "-created_at")[:SNAPSHOT_FINISHED_TASKS])
    return unfinished + finished


def _serializers():
    """The lead's task and machine serializers (the shapes of GET and of the events);
    a minimal stand-in until tasks_app/api/serializers.py lands."""
    try:
        from tasks_app.api.serializers import serialize_machine, serialize_task
    except ImportError:
        fields = ("state", "state_reason", "folder", "agent", "prompt", "exit_code", "signal", "stop_reason",
                  "runtime_s", "slept_s", "output_tail", "survivors", "max_runtime_s")

        def serialize_task(t):
            return {"id": str(t.id), "machine": str(t.machine_id), "session": t.session_id and str(t.session_id),
                    "created_at": _iso(t.created_at), "updated_at": _iso(t.updated_at), "final_at": _iso(t.final_at),
                    "cancel_requested_at": _iso(t.cancel_requested_at), **{f: getattr(t, f) for f in fields}}

        def serialize_machine(m):
            return {"id": str(m.id), "name": m.name, "generation": m.generation, "paired": m.paired,
                    "last_heard_at": _iso(m.last_heard_at)}

    return serialize_task, serialize_machine


def board_snapshot(*, owner, now: datetime) -> dict:
    """The owner's board in one read (B4):
    ``{"sessions": [{id, title, status, status_since, version, markers: [...]}],
    "tasks": [task as GET /api/tasks/{id}/], "machines": [...], "grants": [{id, machine,
    path}], "server_time", "marker_grace_s", "machine_offline_s"}``. Times ISO-8601 UTC,
    thresholds in seconds. Only ``owner``'s rows (K2)."""
    from tasks_app.models import Grant, Machine

    serialize_task, serialize_machine = _serializers()

    sessions = _session_rows(owner)
    markers = _markers_by_session([s.id for s in sessions], now)
    return {
        "sessions": [
            {
                "id": str(s.id),
                "title": s.title,
                "status": s.status,
                "status_since": _iso(s.status_since),
                "version": s.version,
                "markers": markers.get(s.id, []),
            }
            for s in sessions
        ],
        "tasks": [{**serialize_task(t), "version": t.version} for t in _task_rows(owner)],
        "machines": [
            {**serialize_machine(m), "version": m.version}
            for m in Machine.objects.filter(owner=owner).order_by("name", "created_at")
        ],
        "grants": [
            {"id": str(g.id), "machine": str(g.machine_id), "path": g.path}
            for g in Grant.objects.filter(owner=owner, revoked_at__isnull=True).order_by("path")
        ],
        "server_time": now.isoformat(),
        "marker_grace_s": settings.RUNSTEAD_MARKER_GRACE_S,
        "machine_offline_s": settings.RUNSTEAD_MACHINE_OFFLINE_S,
    }


class BoardSnapshotView(APIView):
    """``GET /api/board/``: the requesting owner's snapshot (B4, K2). Owners only (token or
    browser session); machine tokens get 403."""

    def get(self, request):
        return Response(board_snapshot(owner=request.user, now=clock.now()))


@login_required
def board_page(request):
    """The board page (B1): server-rendered with the snapshot embedded for the JS."""
    return render(request, "board.html", {"snapshot": board_snapshot(owner=request.user, now=clock.now())})
