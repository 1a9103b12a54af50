"""The board's snapshot (SPEC B4): what ``GET /api/board/`` answers and the board page
embeds, the one shape that spans both apps' rows. Declared once as ``BoardSnapshotShape``
(see ``tasks_app/shapes.py``); no DRF."""
from datetime import datetime
from typing import Annotated, TypedDict

from django.conf import settings

from core.wire import Doc, Time
from core.wire import iso
from sessions_app.models import Approval, ApprovalState, Marker, Session, SessionStatus
from sessions_app.shapes import ApprovalShape, SessionShape, approval_dict, session_dict
from tasks_app.models import FINAL_STATES, Grant, Machine, Pool, Task
from tasks_app.shapes import (
    BoardTaskShape,
    GrantShape,
    MachineShape,
    PoolShape,
    board_task_dict,
    grant_dict,
    machine_dict,
    pool_dict,
)

# Bounds of one snapshot: every unfinished task is a live concern (capped defensively);
# finished tasks and idle sessions are history, so only the most recent ones are shown.
SNAPSHOT_UNFINISHED_TASKS = 200
SNAPSHOT_FINISHED_TASKS = 50
SNAPSHOT_IDLE_SESSIONS = 50
SNAPSHOT_BUSY_SESSIONS = 200
SNAPSHOT_PENDING_APPROVALS = 200
SNAPSHOT_POOLS = 100


def _markers_by_session(session_ids) -> dict:
    """All markers (one per session and device, M7) of the given sessions, ended ones
    included so the board can order later events against their versions (B2)."""
    grouped: dict = {}
    for marker in Marker.objects.filter(session_id__in=session_ids).order_by("started_at", "pk"):
        grouped.setdefault(marker.session_id, []).append(marker)
    return grouped


def _session_rows(owner):
    busy = list(Session.objects.filter(owner=owner, status=SessionStatus.BUSY).order_by("-status_since", "-pk")[:SNAPSHOT_BUSY_SESSIONS])
    idle = list(
        Session.objects.filter(owner=owner).exclude(status=SessionStatus.BUSY).order_by("-status_since", "-pk")[:SNAPSHOT_IDLE_SESSIONS]
    )
    return busy + idle


def _task_rows(owner):
    base = Task.objects.filter(owner=owner).select_related("integration__decided_by").prefetch_related("leases")
    unfinished = list(base.exclude(state__in=FINAL_STATES).order_by("-created_at", "-pk")[:SNAPSHOT_UNFINISHED_TASKS])
    finished = list(base.filter(state__in=FINAL_STATES).order_by("-final_at", "-created_at", "-pk")[:SNAPSHOT_FINISHED_TASKS])
    return unfinished + finished


def _pending_approvals(owner) -> list:
    """Q6: every pending approval of the owner, oldest first (the inbox's order)."""
    pending = Approval.objects.filter(owner=owner, state=ApprovalState.PENDING).select_related("session", "task")
    return list(pending.order_by("created_at", "id")[:SNAPSHOT_PENDING_APPROVALS])


class BoardSnapshotShape(TypedDict):
    """``GET /api/board/`` and the board page's embedded snapshot (B4)."""

    approvals: Annotated[list[ApprovalShape], Doc("pending approvals, oldest first (Q6)")]
    sessions: list[SessionShape]
    tasks: Annotated[list[BoardTaskShape], Doc("tasks as in task events, plus started_at")]
    machines: Annotated[list[MachineShape], Doc("machines as GET /api/machines/")]
    grants: Annotated[list[GrantShape], Doc("active grants as GET /api/grants/")]
    pools: Annotated[list[PoolShape], Doc("machine pools as GET /api/pools/, by name (C8)")]
    server_time: Time
    marker_grace_s: Annotated[float, Doc("seconds (B3)")]


def board_snapshot(*, owner, now: datetime) -> BoardSnapshotShape:
    """The owner's board in one read (B4):
    ``{"approvals": [pending approval (sessions_app.shapes), oldest first], "sessions":
    [session (sessions_app.shapes)], "tasks": [task as in ``task`` events, plus
    ``started_at``], "machines": [machine, with ``offline`` and ``offline_at`` (B7)],
    "grants": [active grant], "pools": [machine pool, by name (C8)], "server_time",
    "marker_grace_s"}``. Times ISO-8601 UTC,
    the threshold in seconds. Only ``owner``'s rows (K2). A pending approval past its
    expiry is listed until the sweep (or a read of it) expires it, which sends its
    ``approval`` event."""
    sessions = _session_rows(owner)
    markers = _markers_by_session([s.id for s in sessions])
    return {
        "approvals": [approval_dict(a) for a in _pending_approvals(owner)],
        "sessions": [session_dict(s, markers=markers.get(s.id, []), now=now) for s in sessions],
        "tasks": [board_task_dict(t) for t in _task_rows(owner)],
        "machines": [
            machine_dict(m, now=now) for m in Machine.objects.filter(owner=owner).order_by("name", "created_at", "pk")
        ],
        "grants": [
            grant_dict(g) for g in Grant.objects.filter(owner=owner, revoked_at__isnull=True).order_by("path", "pk")
        ],
        "pools": [pool_dict(p) for p in Pool.objects.filter(owner=owner).order_by("name", "pk")
                  .prefetch_related("machines")[:SNAPSHOT_POOLS]],
        "server_time": iso(now),
        "marker_grace_s": settings.RUNSTEAD_MARKER_GRACE_S,
    }
