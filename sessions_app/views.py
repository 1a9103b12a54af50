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
from drf_spectacular.utils import extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from config import clock
from config.schema import errors
from config.strict import NoQuery, valid_query
from sessions_app.models import Marker, Session, SessionStatus
from sessions_app.services import marker_is_running
from tasks_app.api.outputs import BoardGrantOut, BoardTaskOut, MachineOut
from tasks_app.api.serializers import serialize_machine, serialize_task
from tasks_app.models import FINAL_STATES, Grant, Machine, Task

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
    return {
        "session_id": str(marker.session_id),
        "device_id": marker.device_id,
        "device_name": marker.device_name,
        "turn_id": marker.turn_id,
        "state": marker.state,
        "deep_research": marker.deep_research,
        "started_at": _iso(marker.started_at),
        "expires_at": _iso(marker.expires_at),
        "ended_at": _iso(marker.ended_at),
        "version": marker.version,
        "running": marker_is_running(marker, now),
    }


def _markers_by_session(session_ids, now: datetime) -> dict:
    """All markers (one per session and device, M7) of the given sessions, ended ones
    included so the board can order later events against their versions (B2)."""
    grouped: dict = {}
    for marker in Marker.objects.filter(session_id__in=session_ids).order_by("started_at"):
        grouped.setdefault(marker.session_id, []).append(_marker_dict(marker, now))
    return grouped


def _session_rows(owner):
    busy = list(Session.objects.filter(owner=owner, status=SessionStatus.BUSY).order_by("-status_since")[:SNAPSHOT_BUSY_SESSIONS])
    idle = list(
        Session.objects.filter(owner=owner).exclude(status=SessionStatus.BUSY).order_by("-status_since")[:SNAPSHOT_IDLE_SESSIONS]
    )
    return busy + idle


def _task_rows(owner):
    base = Task.objects.filter(owner=owner).prefetch_related("leases")
    unfinished = list(base.exclude(state__in=FINAL_STATES).order_by("-created_at")[:SNAPSHOT_UNFINISHED_TASKS])
    finished = list(base.filter(state__in=FINAL_STATES).order_by("-final_at", "-created_at")[:SNAPSHOT_FINISHED_TASKS])
    return unfinished + finished


def _task_started_at(task) -> str | None:
    """When the task's lease was granted (its run began), for the board's live runtime."""
    granted = [lease.granted_at for lease in task.leases.all()]
    return _iso(min(granted)) if granted else None


def board_snapshot(*, owner, now: datetime) -> dict:
    """The owner's board in one read (B4):
    ``{"sessions": [{id, title, status, status_since, version, markers: [...]}],
    "tasks": [task as in ``task`` events, plus ``started_at``], "machines": [...], "grants": [{id, machine,
    path}], "server_time", "marker_grace_s", "machine_offline_s"}``. Times ISO-8601 UTC,
    thresholds in seconds. Only ``owner``'s rows (K2)."""
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
        "tasks": [{**serialize_task(t), "started_at": _task_started_at(t)} for t in _task_rows(owner)],
        "machines": [
            serialize_machine(m, now=now)
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


_MARKER_SHAPE = inline_serializer(
    "BoardMarker",
    {
        "session_id": serializers.UUIDField(),
        "device_id": serializers.CharField(),
        "device_name": serializers.CharField(),
        "turn_id": serializers.CharField(),
        "state": serializers.ChoiceField(["running", "ended"]),
        "deep_research": serializers.BooleanField(),
        "started_at": serializers.DateTimeField(),
        "expires_at": serializers.DateTimeField(),
        "ended_at": serializers.DateTimeField(allow_null=True),
        "version": serializers.IntegerField(),
        "running": serializers.BooleanField(help_text="M3 on the service clock at server_time"),
    },
    many=True,
)
_SNAPSHOT_SHAPE = inline_serializer(
    "BoardSnapshot",
    {
        "sessions": inline_serializer(
            "BoardSession",
            {
                "id": serializers.UUIDField(),
                "title": serializers.CharField(),
                "status": serializers.ChoiceField(["busy", "idle"]),
                "status_since": serializers.DateTimeField(),
                "version": serializers.IntegerField(),
                "markers": _MARKER_SHAPE,
            },
            many=True,
        ),
        "tasks": BoardTaskOut(many=True, help_text="tasks as in task events, plus started_at"),
        "machines": MachineOut(many=True, help_text="machines as GET /api/machines/"),
        "grants": BoardGrantOut(many=True, help_text="active grants"),
        "server_time": serializers.DateTimeField(),
        "marker_grace_s": serializers.FloatField(),
        "machine_offline_s": serializers.FloatField(),
    },
)


class BoardSnapshotView(APIView):
    """``GET /api/board/``: the requesting owner's snapshot (B4, K2). Owners only (token or
    browser session); machine tokens get 403."""

    @extend_schema(responses={200: _SNAPSHOT_SHAPE, **errors()}, summary="The owner's board snapshot (B4)")
    def get(self, request):
        valid_query(NoQuery, request)
        return Response(board_snapshot(owner=request.user, now=clock.now()))


@login_required
def board_page(request):
    """The board page (B1): server-rendered with the snapshot embedded for the JS."""
    return render(request, "board.html", {"snapshot": board_snapshot(owner=request.user, now=clock.now())})
