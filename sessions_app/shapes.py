"""Wire shapes of the sessions app (SPEC H, M, S, B2, B4): the JSON that the sessions API
answers, that ``session.status`` / ``marker`` board events carry and that the board
snapshot is made of, written once.

Plain functions of model rows, no DRF (healthchecks' ``Check.to_dict``): views, services
and the board all render through them. Times are ISO-8601 UTC strings (``iso`` of
``tasks_app.shapes``); ``now`` is the service clock of the answer (M3 ``running`` and
S3/S4/S7 ``counts`` are evaluated at it). Each shape is declared once, as the
``TypedDict`` its builder returns; the OpenAPI schema is generated from it (see
``tasks_app/shapes.py``).
"""
from datetime import datetime
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from core.wire import BoardEvent, Doc, Time, Uuid
from core.wire import iso
from sessions_app.models import ApprovalState, Channel, JobMode, MarkerState, SessionMessageState, SessionStatus
from sessions_app.rules import job_counts, marker_is_running


class MarkerShape(TypedDict):
    """One device's marker of its current turn in a session (M1-M8)."""

    session_id: Uuid
    device_id: str
    device_name: str
    turn_id: str
    state: MarkerState
    deep_research: bool
    started_at: Time
    expires_at: Time
    ended_at: Time | None
    version: int
    running: Annotated[bool, Doc("M3 on the service clock at the time of the answer")]


def marker_dict(marker, *, now: datetime) -> MarkerShape:
    """One marker (M1-M8); ``running`` is M3 at ``now`` (the board re-evaluates it on its own timer, B3)."""
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


class MarkerBoardEvent(BoardEvent, MarkerShape):
    """The ``marker`` board event (B2): the marker with ``type``."""

    type: Literal["marker"]


def marker_event(marker, *, now: datetime) -> MarkerBoardEvent:
    """The ``marker`` board event (B2): the marker with ``type``; ``server_time`` is added
    by the broadcast."""
    return {"type": "marker", **marker_dict(marker, now=now)}


class SessionInfoPart(TypedDict):
    """I6: what a board shows of a session besides its status."""

    agent: str
    title: str
    cwd: str
    attention: Annotated[str, Doc('I6: "", "permission" (needs you) or "approval" (Q3: one of its approvals is pending)')]
    attention_message: str
    attention_since: Time | None
    machine: Annotated[Uuid | None, Doc("T1: the paired machine the session runs on")]
    channel: Annotated[Channel, Doc("T1: how a message reaches it")]
    reach: Annotated[str, Doc("T1: in words, when a message sent now will arrive")]


# T1: the board's words for each channel.
REACH_WORDS = {
    Channel.TERMINAL: "now, at the prompt",
    Channel.HOOK: "when this turn ends",
    Channel.NATIVE: "through the CLI's own queue",
}


def session_reach(session) -> str:
    """T1: when a message sent now reaches the session, in words."""
    if session.machine_id is None or session.channel not in REACH_WORDS:
        return f"cannot reach this session: start it with `runstead-term {session.agent or 'claude'}`"
    return REACH_WORDS[session.channel]


def session_info(session) -> SessionInfoPart:
    """I6, T1: what a board shows of a session besides its status."""
    return {
        "agent": session.agent,
        "title": session.title,
        "cwd": session.cwd,
        "attention": session.attention,
        "attention_message": session.attention_message,
        "attention_since": iso(session.attention_since),
        "machine": None if session.machine_id is None else str(session.machine_id),
        "channel": session.channel,
        "reach": session_reach(session),
    }


class SessionMessageShape(TypedDict):
    """One owner message to a terminal session (T2)."""

    id: Uuid
    session_id: Uuid
    seq: Annotated[int, Doc("from 1, in acceptance order")]
    text: str
    state: SessionMessageState
    channel: Annotated[Channel, Doc("the channel it was sent through")]
    created_at: Time
    delivered_at: Time | None
    answered_at: Time | None
    reply: Annotated[str, Doc("the last assistant message of the turn that answered it, where the agent's hook "
                              "reports it (Claude Code's Stop: T6); empty otherwise")]
    version: int


def session_message_dict(message) -> SessionMessageShape:
    """One session message (T2)."""
    return {
        "id": str(message.id),
        "session_id": str(message.session_id),
        "seq": message.seq,
        "text": message.text,
        "state": message.state,
        "channel": message.channel,
        "created_at": iso(message.created_at),
        "delivered_at": iso(message.delivered_at),
        "answered_at": iso(message.answered_at),
        "reply": message.reply,
        "version": message.version,
    }


class SessionMessagesShape(TypedDict):
    """``GET /api/sessions/{id}/messages/`` (T2): the latest 500, in ``seq`` order."""

    results: list[SessionMessageShape]


class SessionMessageBoardEvent(BoardEvent, SessionMessageShape):
    """The ``session.message`` board event (B2, T6): a session message was sent or changed state."""

    type: Literal["session.message"]


def session_message_event(message) -> SessionMessageBoardEvent:
    return {"type": "session.message", **session_message_dict(message)}


class SessionShape(SessionInfoPart):
    """A session with all its markers (S1, S2, I6)."""

    id: Uuid
    status: SessionStatus
    status_since: Time
    version: int
    created_at: Time
    markers: list[MarkerShape]


def session_dict(session, *, markers, now: datetime) -> SessionShape:
    """One session with its markers (all of them, ended ones too, so a board can order
    later events by version, B2)."""
    return {
        "id": str(session.id),
        **session_info(session),
        "status": session.status,
        "status_since": iso(session.status_since),
        "version": session.version,
        "created_at": iso(session.created_at),
        "markers": [marker_dict(m, now=now) for m in markers],
    }


class SessionStatusBoardEvent(BoardEvent, SessionInfoPart):
    """The ``session.status`` board event (S2, I6)."""

    type: Literal["session.status"]
    session_id: Uuid
    status: SessionStatus
    version: int
    announced: Annotated[bool, Doc("N1, B5: a change to idle that was announced (an end was observed); "
                                   "false for an idle by expiry and for every other change")]


def session_status_event(session, *, announced: bool = False) -> SessionStatusBoardEvent:
    """The ``session.status`` board event (S2, I6); ``server_time`` is added by the
    broadcast. ``announced``: this change to idle was announced (N1: an end was
    observed), so the board plays B5's sound; an idle by expiry is not."""
    return {
        "type": "session.status", "session_id": str(session.pk), "status": session.status, "version": session.version,
        "announced": announced, **session_info(session),
    }


class SessionDeletedBoardEvent(BoardEvent):
    """The ``session.deleted`` board event: open boards drop the session."""

    type: Literal["session.deleted"]
    session_id: Uuid
    version: int


def session_deleted_event(session_id, *, version: int) -> SessionDeletedBoardEvent:
    """The ``session.deleted`` board event: open boards drop the session."""
    return {"type": "session.deleted", "session_id": str(session_id), "version": version}


class ActiveSessionShape(TypedDict):
    """A busy session of S6."""

    id: Uuid
    status: str
    since: Time


class ActiveSessionsShape(TypedDict):
    """``GET /api/sessions/active/`` (S6)."""

    sessions: list[ActiveSessionShape]
    server_time: Time


def active_sessions_dict(sessions, *, now: datetime) -> ActiveSessionsShape:
    """``GET /api/sessions/active/`` (S6) at ``now``."""
    return {
        "sessions": [{"id": str(s.id), "status": s.status, "since": iso(s.status_since)} for s in sessions],
        "server_time": iso(now),
    }


class MarkerWriteShape(TypedDict):
    """Answer of ``PUT /api/sessions/{id}/marker/`` (M2, M4)."""

    outcome: Literal["applied", "not_applied"]
    reason: NotRequired[str]
    marker: MarkerShape | None


def marker_write_dict(result, *, now: datetime) -> MarkerWriteShape:
    """Answer of ``PUT /api/sessions/{id}/marker/`` (``reason`` only when not applied)."""
    body: MarkerWriteShape = {"outcome": result.outcome, "marker": marker_dict(result.marker, now=now) if result.marker else None}
    if result.reason:
        body["reason"] = result.reason
    return body


class JobShape(TypedDict):
    """Background work a session owns (S3, S4, S7)."""

    job_id: str
    mode: JobMode
    auto_backgrounded: bool
    created_at: Time
    finished_at: Time | None
    wakes: bool | None
    consumed_at: Time | None
    cancelled_at: Time | None
    version: int
    counts: Annotated[bool, Doc("whether it keeps the session busy now (S3, S4, S7)")]


def job_dict(job, *, now: datetime) -> JobShape:
    """One job (S3, S4, S7); ``counts`` is whether it keeps the session busy at ``now``."""
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


class StopShape(TypedDict):
    """Answer of ``POST /api/sessions/{id}/stop/`` (S5)."""

    markers_closed: int
    jobs_cancelled: int
    tasks_cancelled: int
    status: str
    version: int


def stop_dict(result) -> StopShape:
    """Answer of ``POST /api/sessions/{id}/stop/`` (S5)."""
    return {
        "markers_closed": result.markers_closed,
        "jobs_cancelled": result.jobs_cancelled,
        "tasks_cancelled": result.tasks_cancelled,
        "status": result.session.status,
        "version": result.session.version,
    }


class SweepShape(TypedDict):
    """Answer of ``POST /api/devices/{device_id}/sweep/`` (M5): how many markers it closed."""

    closed: int


# --- approvals (Q1, Q6) -------------------------------------------------------------------


def approval_title(approval) -> str:
    """What the approval is about, for a list: its session's title, or the first line of
    its task's prompt (80 characters at most)."""
    if approval.session_id is not None:
        return approval.session.title
    prompt = (approval.task.prompt or "").strip()
    return prompt.splitlines()[0][:80] if prompt else ""


class PermissionRuleShape(TypedDict):
    """A rule of a Claude Code permission update (``Bash(npm test)``)."""

    toolName: str
    ruleContent: NotRequired[str]


class SuggestionShape(TypedDict):
    """One of the CLI's ``permission_suggestions`` as it sent it (Claude Code's permission
    updates: ``addRules`` with ``rules`` and ``behavior``, ``addDirectories`` with
    ``directories``, ``setMode`` with ``mode``; each with a ``destination``)."""

    type: str
    destination: NotRequired[Annotated[str, Doc("session, localSettings, projectSettings, userSettings, ...")]]
    rules: NotRequired[list[PermissionRuleShape]]
    behavior: NotRequired[str]
    directories: NotRequired[list[str]]
    mode: NotRequired[str]


class ApprovalShape(TypedDict):
    """A tool call an agent asked its owner to approve (Q1)."""

    id: Uuid
    session: Annotated[Uuid | None, Doc("the interactive session that asks (or null: a task)")]
    task: Annotated[Uuid | None, Doc("the headless task that asks (or null: a session)")]
    machine: Annotated[Uuid | None, Doc("the task's machine")]
    agent: str
    title: Annotated[str, Doc("the session's title or the first line of the task's prompt")]
    cwd: str
    tool_name: str
    tool_input: Annotated[dict[str, Any], Doc("the tool's input as asked, cut to 4 KiB: show it as text, "
                                              "never as markup")]
    tool_input_digest: Annotated[str, Doc("SHA-256 of the whole tool input's canonical JSON")]
    tool_input_truncated: bool
    suggestions: Annotated[list[SuggestionShape], Doc("the CLI's permission_suggestions, as it sent them")]
    state: ApprovalState
    scope: Annotated[str, Doc('an allow\'s scope, "once" or "session"; "" otherwise')]
    message: Annotated[str, Doc("a deny's instruction to the agent")]
    created_at: Time
    expires_at: Time
    decided_at: Time | None
    decided_by: Annotated[str, Doc('"owner:<username>", "terminal", "timeout", "system", or "" while pending')]
    version: int


def approval_dict(approval) -> ApprovalShape:
    """One approval (Q1) as the approvals API answers it, ``approval`` board events carry
    it and the board snapshot lists the pending ones (B4): ``session`` or ``task`` is set
    (ids; ``machine`` is the task's); ``tool_input`` is the JSON as asked, cut to 4 KiB
    (``tool_input_truncated``); ``decided_by`` is ``owner:<username>``, ``terminal``,
    ``timeout``, ``system`` or ``""`` while pending."""
    return {
        "id": str(approval.id),
        "session": str(approval.session_id) if approval.session_id else None,
        "task": str(approval.task_id) if approval.task_id else None,
        "machine": str(approval.machine_id) if approval.machine_id else None,
        "agent": approval.agent,
        "title": approval_title(approval),
        "cwd": approval.cwd,
        "tool_name": approval.tool_name,
        "tool_input": approval.tool_input,
        "tool_input_digest": approval.tool_input_digest,
        "tool_input_truncated": approval.tool_input_truncated,
        "suggestions": approval.suggestions,
        "state": approval.state,
        "scope": approval.scope,
        "message": approval.message,
        "created_at": iso(approval.created_at),
        "expires_at": iso(approval.expires_at),
        "decided_at": iso(approval.decided_at),
        "decided_by": approval.decided_by,
        "version": approval.version,
    }


class ApprovalBoardEvent(BoardEvent):
    """The ``approval`` board event (Q6, B2): on create and on every change."""

    type: Literal["approval"]
    approval: ApprovalShape
    version: int


def approval_event(approval) -> ApprovalBoardEvent:
    """The ``approval`` board event (Q6, B2): ``{type, approval, version}``, on create and
    on every change; ``server_time`` is added by the broadcast."""
    return {"type": "approval", "approval": approval_dict(approval), "version": approval.version}
