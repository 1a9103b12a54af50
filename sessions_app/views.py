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
from sessions_app.api.serializers import SessionOut
from sessions_app.models import Marker, Session, SessionStatus
from sessions_app.shapes import session_dict
from tasks_app.api.outputs import BoardTaskOut, GrantOut, MachineOut
from tasks_app.models import FINAL_STATES, Grant, Machine, Task
from tasks_app.shapes import board_task_dict, grant_dict, iso, machine_dict

# Bounds of one snapshot: every unfinished task is a live concern (capped defensively);
# finished tasks and idle sessions are history, so only the most recent ones are shown.
SNAPSHOT_UNFINISHED_TASKS = 200
SNAPSHOT_FINISHED_TASKS = 50
SNAPSHOT_IDLE_SESSIONS = 50
SNAPSHOT_BUSY_SESSIONS = 200


def _markers_by_session(session_ids) -> dict:
    """All markers (one per session and device, M7) of the given sessions, ended ones
    included so the board can order later events against their versions (B2)."""
    grouped: dict = {}
    for marker in Marker.objects.filter(session_id__in=session_ids).order_by("started_at"):
        grouped.setdefault(marker.session_id, []).append(marker)
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


def board_snapshot(*, owner, now: datetime) -> dict:
    """The owner's board in one read (B4):
    ``{"sessions": [session (sessions_app.shapes)], "tasks": [task as in ``task`` events,
    plus ``started_at``], "machines": [machine, with ``offline`` and ``offline_at`` (B7)],
    "grants": [active grant], "server_time", "marker_grace_s"}``. Times ISO-8601 UTC,
    the threshold in seconds. Only ``owner``'s rows (K2)."""
    sessions = _session_rows(owner)
    markers = _markers_by_session([s.id for s in sessions])
    return {
        "sessions": [session_dict(s, markers=markers.get(s.id, []), now=now) for s in sessions],
        "tasks": [board_task_dict(t) for t in _task_rows(owner)],
        "machines": [
            machine_dict(m, now=now) for m in Machine.objects.filter(owner=owner).order_by("name", "created_at")
        ],
        "grants": [
            grant_dict(g) for g in Grant.objects.filter(owner=owner, revoked_at__isnull=True).order_by("path")
        ],
        "server_time": iso(now),
        "marker_grace_s": settings.RUNSTEAD_MARKER_GRACE_S,
    }


_SNAPSHOT_SHAPE = inline_serializer(
    "BoardSnapshot",
    {
        "sessions": SessionOut(many=True),
        "tasks": BoardTaskOut(many=True, help_text="tasks as in task events, plus started_at"),
        "machines": MachineOut(many=True, help_text="machines as GET /api/machines/"),
        "grants": GrantOut(many=True, help_text="active grants as GET /api/grants/"),
        "server_time": serializers.DateTimeField(),
        "marker_grace_s": serializers.FloatField(),
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
