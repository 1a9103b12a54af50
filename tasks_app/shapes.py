"""Wire shapes of the tasks app (SPEC H, B1, B2, B7): the JSON that the task API answers
and that ``task`` and ``machine`` board events carry, written once.

Plain functions of model rows, no DRF: views, services (transitions, pairing, leases)
and the board snapshot all render through them (healthchecks' ``Check.to_dict``). Times
are ISO-8601 UTC strings from ``core.wire.iso``; durations are seconds. Input validation stays in
``tasks_app/api/serializers.py``.

Each shape is declared once, as the ``TypedDict`` (``*Shape``, board events ``*BoardEvent``)
that its builder returns, written with ``core.wire``; the OpenAPI schema is generated
from it (``core.schema.shape``), and ``tests/test_api_schema.py`` validates every
builder's real output against that schema.
"""
from datetime import datetime, timedelta
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from django.conf import settings
from django.core.exceptions import ObjectDoesNotExist
from django.db.models import F, Q

from core.wire import BoardEvent, Doc, Time, Url, Uuid, iso
from machine.protocol.shapes import AnyPayload
from tasks_app.models import (
    LEASED_STATES,
    NEVER_LEASED_STATES,
    ConversationMessage,
    ConversationMessageState,
    IntegrationAction,
    IntegrationOutcome,
    TaskState,
)

# GET /api/tasks/{id}/ lists at most this many receipts, newest last (H).
DETAIL_RECEIPTS = 50


# --- machines (B7) ----------------------------------------------------------------------


def machine_offline_at(last_heard_at: datetime | None) -> datetime | None:
    """B7: the instant after which a machine last heard at ``last_heard_at`` counts as
    offline (``RUNSTEAD_MACHINE_OFFLINE_S`` later); None when never heard (offline)."""
    if last_heard_at is None:
        return None
    return last_heard_at + timedelta(seconds=settings.RUNSTEAD_MACHINE_OFFLINE_S)


def machine_is_offline(last_heard_at: datetime | None, now: datetime) -> bool:
    """B7, the one rule: offline when never heard, or not heard from for more than
    ``RUNSTEAD_MACHINE_OFFLINE_S`` seconds at ``now``."""
    offline_at = machine_offline_at(last_heard_at)
    return offline_at is None or now > offline_at


class ProfileShape(TypedDict):
    """A worker profile as the machine reported it (B10, G1)."""

    name: str
    preset: str | None
    isolation: NotRequired[Annotated[Literal["none", "worktree"], Doc("G7; absent in reports of older workers")]]
    conversation: NotRequired[Annotated[Literal["live", "resume", "none"],
                                        Doc("C1: how the profile holds a conversation; absent in older reports")]]


class ProfilesShape(TypedDict):
    """Answer of ``PUT /api/worker/profiles/``: the stored list (B10)."""

    profiles: list[ProfileShape]


def profiles_dict(machine) -> ProfilesShape:
    """``{"profiles": [{name, preset}]}`` as stored on ``machine`` (B10)."""
    return {"profiles": machine.profiles}


class MachineShape(TypedDict):
    """A machine as ``GET /api/machines/`` lists it and ``machine`` events carry it (B7)."""

    id: Uuid
    name: str
    generation: int
    paired: bool
    last_heard_at: Time | None
    offline: Annotated[bool, Doc("not heard from within RUNSTEAD_MACHINE_OFFLINE_S (B7)")]
    offline_at: Annotated[Time | None, Doc("when it turns offline unless heard from before; null: never heard (B7)")]
    profiles: Annotated[list[ProfileShape], Doc("as last reported by PUT /api/worker/profiles/ (B10)")]
    version: int


def machine_dict(machine, *, now: datetime) -> MachineShape:
    """Machine of ``GET /api/machines/``, of ``machine`` events and of the board snapshot
    (``profiles``: what the worker reported, B10). ``offline`` is B7 at ``now``; ``offline_at`` is when it turns offline if nothing is
    heard meanwhile (null: never heard), so the board re-evaluates B7 on its own timer
    without holding the threshold (B3 does the same for markers)."""
    return {
        "id": str(machine.id),
        "name": machine.name,
        "generation": machine.generation,
        "paired": machine.paired,
        "last_heard_at": iso(machine.last_heard_at),
        "offline": machine_is_offline(machine.last_heard_at, now),
        "offline_at": iso(machine_offline_at(machine.last_heard_at)),
        "profiles": machine.profiles,
        "version": machine.version,
    }


class MachineBoardEvent(BoardEvent):
    """The ``machine`` board event (B2, B7)."""

    type: Literal["machine"]
    machine: MachineShape
    version: int


def machine_event(machine, *, now: datetime) -> MachineBoardEvent:
    """The ``machine`` board event (B2, B7); ``server_time`` is added by the broadcast."""
    return {"type": "machine", "machine": machine_dict(machine, now=now), "version": machine.version}


class WorkerPairShape(TypedDict):
    """Answer of ``POST /api/worker/pair/`` (K1)."""

    machine_id: Uuid
    token: Annotated[str, Doc("the machine token, shown once")]
    generation: int
    name: str


def paired_dict(machine, token: str) -> WorkerPairShape:
    """Answer of ``POST /api/worker/pair/`` with the new machine ``token``."""
    return {"machine_id": str(machine.id), "token": token, "generation": machine.generation, "name": machine.name}


class PairingCodeShape(TypedDict):
    """Answer of ``POST /api/machines/pairing-codes/`` (K1)."""

    code: str
    expires_at: Time


def pairing_code_dict(code: str, row) -> PairingCodeShape:
    """Answer of ``POST /api/machines/pairing-codes/`` with the plain ``code``."""
    return {"code": code, "expires_at": iso(row.expires_at)}


# --- grants and budget ------------------------------------------------------------------


class GrantShape(TypedDict):
    """A grant of ``GET/POST /api/grants/`` and of the board snapshot."""

    id: Uuid
    machine: Uuid
    path: str
    created_at: Time
    revoked_at: Time | None


def grant_dict(grant) -> GrantShape:
    """Grant of ``GET/POST /api/grants/`` and of the board snapshot."""
    return {
        "id": str(grant.id),
        "machine": str(grant.machine_id),
        "path": grant.path,
        "created_at": iso(grant.created_at),
        "revoked_at": iso(grant.revoked_at),
    }


class PoolShape(TypedDict):
    """An owner-named machine pool (C8) of ``/api/pools/`` and of the board snapshot."""

    id: Uuid
    name: Annotated[str, Doc('what a task names as its "machine" to run on one of these machines')]
    machines: Annotated[list[Uuid], Doc("the pool's machine ids, sorted")]
    created_at: Time
    updated_at: Time
    version: Annotated[int, Doc("rises on every change (B2)")]


def pool_dict(pool) -> PoolShape:
    """Pool of ``/api/pools/``, of the board snapshot and of ``pool`` events (C8)."""
    return {
        "id": str(pool.id),
        "name": pool.name,
        "machines": sorted(str(m.pk) for m in pool.machines.all()),
        "created_at": iso(pool.created_at),
        "updated_at": iso(pool.updated_at),
        "version": pool.version,
    }


class PoolBoardEvent(BoardEvent):
    """The ``pool`` board event (B2, C8): a pool was created, renamed or given other
    machines; the board's task form offers the owner's pools by name."""

    type: Literal["pool"]
    pool: PoolShape
    version: int


def pool_event(pool) -> PoolBoardEvent:
    """The ``pool`` board event of ``pool`` as it is now (C8: on create and every change);
    ``server_time`` is added by the broadcast."""
    return {"type": "pool", "pool": pool_dict(pool), "version": pool.version}


class PoolDeletedBoardEvent(BoardEvent):
    """The ``pool.deleted`` board event (B2, C8): open boards drop the pool from the task
    form. ``version`` is one above the pool's last ``pool`` event."""

    type: Literal["pool.deleted"]
    pool_id: Uuid
    version: int


def pool_deleted_event(pool_id, *, version: int) -> PoolDeletedBoardEvent:
    """The ``pool.deleted`` board event; ``server_time`` is added by the broadcast."""
    return {"type": "pool.deleted", "pool_id": str(pool_id), "version": version}


class BudgetShape(TypedDict):
    """``GET /api/budget/``, in seconds."""

    limit_s: float
    reserved_s: float
    spent_s: float


def budget_dict(budget) -> BudgetShape:
    """``GET /api/budget/``, in seconds."""
    return {"limit_s": budget.limit_s, "reserved_s": budget.reserved_s, "spent_s": budget.spent_s}


# --- tasks ------------------------------------------------------------------------------


class SurvivorShape(TypedDict):
    """A process left after the stop (L8), as the worker named it."""

    pid: int
    process_start_time: Annotated[float | None, Doc("seconds since the epoch")]
    name: NotRequired[str]
    cmdline: NotRequired[Annotated[str, Doc("at most 200 characters")]]


class AgentResultShape(TypedDict):
    """G3: the agent's own verdict."""

    is_error: bool
    subtype: str
    summary: Annotated[str, Doc("at most 4 KiB")]


class UsageShape(TypedDict):
    """G3: what the agent reported using; each null where the CLI does not say."""

    turns: int | None
    tool_calls: int | None
    input_tokens: Annotated[int | None, Doc("every input token read, cached or not")]
    output_tokens: int | None
    cost_usd: float | None


class TurnUsageShape(TypedDict):
    """G4: the tokens of one model turn, as the CLI reported them with it."""

    input_tokens: int | None
    output_tokens: int | None


class EntryShape(TypedDict):
    """G4, B9: one transcript entry as the worker numbered it (from 1 per task)."""

    n: int
    kind: Literal["prompt", "message", "tool_call", "tool_result", "error"]
    text: Annotated[str, Doc("at most 2 KiB of UTF-8; a cut one ends with an ellipsis")]
    tool: NotRequired[Annotated[str, Doc("the tool of a tool_call or tool_result")]]
    status: NotRequired[Annotated[Literal["ok", "error"], Doc("a tool_result's status")]]
    call: NotRequired[Annotated[int, Doc("a tool_result's call: the n of its tool_call")]]
    usage: NotRequired[Annotated[TurnUsageShape, Doc("the model turn this entry opens, where the CLI reports it")]]
    seq: NotRequired[Annotated[int, Doc("a live conversation's prompt entry: the seq of the message whose turn it "
                                        "opens (C2)")]]


class EntriesPageShape(TypedDict):
    """G4, B9: a page of ``GET /api/tasks/{id}/entries/``, in reading order."""

    results: list[EntryShape]
    next: Annotated[Url | None, Doc("the page beyond, in the direction asked (earlier, or later with after)")]


class ProgressShape(TypedDict):
    """G4: the latest live progress of a running task."""

    seq: int
    at: Time
    last_message: str | None
    output_tail: str
    usage: UsageShape | None
    entries: Annotated[list[EntryShape], Doc("the transcript entries this progress added")]


class DiffFileShape(TypedDict):
    """G7: one file of a worktree task's diff (base..branch)."""

    path: str
    old_path: NotRequired[Annotated[str, Doc("a rename's or copy's source")]]
    status: Annotated[str, Doc("git's letter: A, M, D, R, C, T, U, X, B")]
    insertions: Annotated[int | None, Doc("null for a binary file")]
    deletions: int | None


class GitEvidenceShape(TypedDict):
    """G5: what changed in the folder's git work tree since the task started; G7, for a
    worktree task, its branch, base and diff."""

    start_head: str | None
    end_head: str | None
    commits: int | None
    subjects: Annotated[list[str], Doc("up to 20, newest first")]
    files_changed: int | None
    insertions: int | None
    deletions: int | None
    dirty: Annotated[list[str], Doc("up to 50 paths")]
    dirty_count: int | None
    start_dirty: int | None
    branch: NotRequired[Annotated[str, Doc("G7: the task's branch")]]
    base: NotRequired[Annotated[str, Doc("G7: the commit its branch was made from")]]
    base_branch: NotRequired[Annotated[str | None, Doc("G7: the branch that commit was on (null: detached HEAD)")]]
    files: NotRequired[Annotated[list[DiffFileShape], Doc("G7: at most 500; only in the full task shape")]]
    diff: NotRequired[Annotated[str, Doc("G7: unified, at most 256 KiB, whole files; only in the full task shape")]]
    truncated: NotRequired[Annotated[bool, Doc("G7: diff (or files) cut")]]


class EvidenceShape(TypedDict):
    """G5: the evidence a worker reported with its final receipt (``{}`` before)."""

    git: NotRequired[GitEvidenceShape]


class TaskAgentPart(TypedDict):
    """The G2-G6 fields of the task shape (H "Task JSON"); a ``*Part`` is merged into
    shapes and has no component of its own."""

    agent_session_id: Annotated[str | None, Doc("the agent's own session id (G2, G6)")]
    agent_result: AgentResultShape | None
    usage: UsageShape | None
    progress: ProgressShape | None
    evidence: EvidenceShape
    continue_task: Annotated[Uuid | None, Doc("the task this follow-up continues (G6)")]
    queued_behind: Annotated[Uuid | None, Doc("G8: the task a queued follow-up waits for (kept once it ran)")]


class IntegrationShape(TypedDict):
    """G7: the owner's one decision on a worktree task's branch and, once the worker
    reported it, its outcome."""

    id: Uuid
    action: IntegrationAction
    outcome: Annotated[IntegrationOutcome | None, Doc("null until the worker reports it")]
    commit: Annotated[str | None, Doc("merged: the base branch's new head")]
    paths: Annotated[list[str], Doc("conflict, base_dirty: the paths concerned")]
    detail: Annotated[str, Doc("for people: what was kept and why")]
    decided_by: Annotated[str | None, Doc("the owner's username")]
    decided_at: Time
    reported_at: Time | None


def integration_dict(task) -> IntegrationShape | None:
    """G7: the task's ``integration``, or None while undecided (or not a worktree task)."""
    try:
        row = task.integration
    except ObjectDoesNotExist:
        return None
    return {
        "id": str(row.id), "action": row.action, "outcome": row.outcome or None, "commit": row.commit or None,
        "paths": row.paths, "detail": row.detail,
        "decided_by": row.decided_by.get_username() if row.decided_by else None,
        "decided_at": iso(row.decided_at), "reported_at": iso(row.reported_at),
    }


class ApprovalCountsShape(TypedDict):
    """Q5: how many approvals a task asked for, and how many its owner allowed or denied."""

    asked: int
    allowed: int
    denied: int


class TaskApprovalsPart(TypedDict):
    """The Q5 fields of the task shape."""

    attention: Annotated[str, Doc('Q5: "approval" while one of its approvals is pending, else ""')]
    approvals: ApprovalCountsShape


class TaskShape(TaskAgentPart, TaskApprovalsPart):
    """A task as ``GET /api/tasks/`` lists it and ``task`` board events carry it (H, B1)."""

    id: Uuid
    state: TaskState
    state_reason: str
    needs_decision: Annotated[bool, Doc("N1, U2: unknown, and the worker's record could not settle it (its report had "
                                        "no final facts, or none came in time): its owner decides (U3)")]
    decision_asked_at: Annotated[Time | None, Doc("when its owner was asked to decide (N1)")]
    machine: Uuid
    machine_choice: Annotated[str | None, Doc('"any", or the name of the owner\'s pool the task named: acceptance '
                                              'picked the machine and its folder (C8); null: the owner named the machine')]
    folder: str
    agent: str
    prompt: str
    session: Uuid | None
    deep_research: bool
    max_runtime_s: Annotated[int, Doc("seconds")]
    exclusive: bool
    isolation: Annotated[Literal["none", "worktree"], Doc("G7: worktree = a branch and worktree of its own")]
    created_at: Time
    updated_at: Time
    final_at: Time | None
    cancel_requested_at: Time | None
    reserved_s: Annotated[float, Doc("budget seconds reserved")]
    charged_s: Annotated[float | None, Doc("budget seconds charged")]
    pid: int | None
    exit_code: int | None
    signal: int | None
    stop_reason: str
    runtime_s: float | None
    slept_s: float | None
    survivors: list[SurvivorShape]
    output_tail: str
    holds_lock: Annotated[bool, Doc("whether it holds its folder lock (A8)")]
    integration: Annotated[IntegrationShape | None, Doc("G7: merge or discard of a worktree task's branch")]
    mode: Annotated[Literal["task", "conversation"], Doc("C1")]
    conversation: Annotated[Literal["live", "resume"] | None,
                            Doc("C1: live (the agent stays open) or resume (a follow-up per message); null: a task")]
    conversation_ended_at: Annotated[Time | None, Doc("C5: when the owner ended the conversation")]
    messages_sent: Annotated[int, Doc("C2: the conversation's messages so far (the last seq)")]
    turn: Annotated[Literal["open", "waiting"] | None,
                    Doc('C6: an unfinished live conversation\'s turn: "open" while one of its messages is sent '
                        'or with the agent, "waiting" (for its owner) between turns; null otherwise')]
    version: int


def task_dict(task, *, full: bool = False) -> TaskShape:
    """Task of the API and of ``task`` board events (H, B1). Lists, events and the board
    snapshot leave out a worktree task's ``evidence.git.files`` and ``.diff`` (up to
    256 KiB each task, G7); ``full`` (``GET /api/tasks/{id}/``, the task page) keeps them."""
    return {
        "id": str(task.id),
        "state": task.state,
        "state_reason": task.state_reason,
        "needs_decision": task.state == TaskState.UNKNOWN and task.decision_asked_at is not None,
        "decision_asked_at": iso(task.decision_asked_at),
        "machine": str(task.machine_id),
        "machine_choice": task.machine_choice or None,
        "folder": task.folder,
        "agent": task.agent,
        "prompt": task.prompt,
        "session": str(task.session_id) if task.session_id else None,
        "deep_research": task.deep_research,
        "max_runtime_s": task.max_runtime_s,
        "exclusive": task.exclusive,
        "isolation": task.isolation,
        "created_at": iso(task.created_at),
        "updated_at": iso(task.updated_at),
        "final_at": iso(task.final_at),
        "cancel_requested_at": iso(task.cancel_requested_at),
        "reserved_s": task.reserved_s,
        "charged_s": task.charged_s,
        "pid": task.pid,
        "exit_code": task.exit_code,
        "signal": task.signal,
        "stop_reason": task.stop_reason,
        "runtime_s": task.runtime_s,
        "slept_s": task.slept_s,
        "survivors": task.survivors,
        "output_tail": task.output_tail,
        "holds_lock": task.holds_lock,
        "integration": integration_dict(task),
        "mode": task.mode,
        "conversation": task.conversation or None,
        "conversation_ended_at": iso(task.conversation_ended_at),
        "messages_sent": task.message_seq,
        "turn": conversation_turn(task),
        **agent_dict(task, full=full),
        **approvals_of_task(task),
        "version": task.version,
    }


# C3: the states of a message whose turn has not ended (sent: it waits for the agent).
TURN_OPEN_STATES = (ConversationMessageState.SENT, ConversationMessageState.DELIVERED)
# C9: a ``consumed`` message that opened a turn of its own keeps it open until ``answered``.
TURN_OPEN = Q(state__in=TURN_OPEN_STATES) | Q(state=ConversationMessageState.CONSUMED, turn_seq=F("seq"))


def conversation_turn(task) -> Literal["open", "waiting"] | None:
    """C6, B1: ``"open"`` while a live conversation's message is sent or delivered (its
    turn runs, or is about to), or consumed as the opener of its own turn (C9: a steer
    that became the next turn, until answered), ``"waiting"`` between turns (the agent waits for its
    owner); None for anything else: a plain task, a resume conversation, a final or
    ``unknown`` task, an ended conversation with nothing open. Reads the task's messages
    only for an unfinished live conversation (one query; the few such tasks a list has).
    Every change of a message's state republishes its task (``conversation``), so a
    ``task`` event carries the turn as it is."""
    if task.conversation != "live" or task.state not in NEVER_LEASED_STATES | LEASED_STATES:
        return None
    if ConversationMessage.objects.filter(TURN_OPEN, task_id=task.pk).exists():
        return "open"
    return None if task.conversation_ended_at else "waiting"


BULKY_GIT_KEYS = ("files", "diff")  # G7: only in the full task shape


def evidence_dict(evidence: dict | None, *, full: bool) -> EvidenceShape:
    """``evidence`` (G5, G7) as stored, without ``BULKY_GIT_KEYS`` unless ``full``."""
    evidence = evidence or {}
    git = evidence.get("git")
    if full or not git or not any(key in git for key in BULKY_GIT_KEYS):
        return evidence
    return {**evidence, "git": {k: v for k, v in git.items() if k not in BULKY_GIT_KEYS}}


def agent_dict(task, *, full: bool = False) -> TaskAgentPart:
    """The G2-G6 part of the task shape (H "Task JSON"): ``agent_session_id``,
    ``agent_result``, ``usage``, ``progress`` (G4, the latest), ``evidence`` (G5, G7; see
    ``evidence_dict``), ``continue_task`` (G6, the task this follow-up continues) and
    ``queued_behind`` (G8, the task a queued follow-up waits for)."""
    return {
        "agent_session_id": task.agent_session_id or None,
        "agent_result": task.agent_result,
        "usage": task.usage,
        "progress": task.progress,
        "evidence": evidence_dict(task.evidence, full=full),
        "continue_task": str(task.continued_from_id) if task.continued_from_id else None,
        "queued_behind": str(task.queued_behind_id) if task.queued_behind_id else None,
    }


def approvals_of_task(task) -> TaskApprovalsPart:
    """The Q5 part of the task shape: ``attention`` (``""``, or ``"approval"`` while one
    of its approvals is pending) and ``approvals`` (``{asked, allowed, denied}``, counts)."""
    return {
        "attention": task.attention,
        "approvals": {"asked": task.approvals_asked, "allowed": task.approvals_allowed,
                      "denied": task.approvals_denied},
    }


class TaskBoardEvent(BoardEvent):
    """The ``task`` board event (B2)."""

    type: Literal["task"]
    task: TaskShape
    version: int


def task_event(task) -> TaskBoardEvent:
    """The ``task`` board event (B2); ``server_time`` is added by the broadcast."""
    return {"type": "task", "task": task_dict(task), "version": task.version}


class ConversationMessageShape(TypedDict):
    """A message into a conversation task (C2, C3)."""

    id: Uuid
    task: Uuid
    seq: Annotated[int, Doc("C2: per task from 1, in acceptance order (the task's prompt is message 0)")]
    text: str
    state: Annotated[Literal["sent", "delivered", "consumed", "answered", "undelivered", "withdrawn"],
                     Doc("C3, C9, C10")]
    delivery: Annotated[Literal["queue", "steer"],
                        Doc('C9: "queue" (its own turn after the current one) or "steer" (into the running turn)')]
    turn_seq: Annotated[int | None, Doc("C9: where it landed: the seq of the message whose agent turn took it (its own "
                                        "when it opened a turn; an earlier one's when it joined that running turn); "
                                        "null until the agent showed it took it")]
    carrier: Annotated[Uuid | None, Doc("a resume conversation: the follow-up task that carries it (G6)")]
    created_at: Time
    delivered_at: Time | None
    consumed_at: Annotated[Time | None, Doc("C9: when the agent showed it took the message")]
    answered_at: Time | None
    version: int


def conversation_message_dict(message) -> ConversationMessageShape:
    """One conversation message (C2, C3) as the API and ``message`` events carry it."""
    return {"id": str(message.id), "task": str(message.task_id), "seq": message.seq, "text": message.text,
            "state": message.state, "delivery": message.delivery, "turn_seq": message.turn_seq,
            "carrier": str(message.carrier_id) if message.carrier_id else None,
            "created_at": iso(message.created_at), "delivered_at": iso(message.delivered_at),
            "consumed_at": iso(message.consumed_at), "answered_at": iso(message.answered_at),
            "version": message.version}


class ConversationMessagesShape(TypedDict):
    """``GET /api/tasks/{id}/messages/``: the conversation's messages in ``seq`` order
    (the latest 500)."""

    results: list[ConversationMessageShape]


class MessageBoardEvent(BoardEvent):
    """The ``message`` board event (C3, B2): on a message's acceptance and every change."""

    type: Literal["message"]
    message: ConversationMessageShape
    version: int


def message_event(message) -> MessageBoardEvent:
    """The ``message`` board event; ``server_time`` is added by the broadcast."""
    return {"type": "message", "message": conversation_message_dict(message), "version": message.version}


class TaskProgressBoardEvent(BoardEvent):
    """The ``task.progress`` board event (G4, B2): the task's latest progress."""

    type: Literal["task.progress"]
    task_id: Uuid
    progress: ProgressShape
    version: int


def task_progress_event(task_id, progress: ProgressShape, version: int) -> TaskProgressBoardEvent:
    """The ``task.progress`` board event (G4, B2) of ``progress`` as stored on the task."""
    return {"type": "task.progress", "task_id": str(task_id), "progress": progress, "version": version}


def task_started_at(task) -> str | None:
    """When the task's lease was granted (its run began), for the board's live runtime."""
    granted = [lease.granted_at for lease in task.leases.all()]
    return iso(min(granted)) if granted else None


class BoardTaskShape(TaskShape):
    """A task on the board snapshot (B4): as in ``task`` events, plus when its run began."""

    started_at: Annotated[Time | None, Doc("when its lease was granted")]


def board_task_dict(task) -> BoardTaskShape:
    """A task in the board snapshot (B4): as in ``task`` events, plus ``started_at``."""
    return {**task_dict(task), "started_at": task_started_at(task)}


class LeaseSummaryShape(TypedDict):
    """A task's lease as its detail shows it (U4)."""

    id: Uuid
    granted_at: Time
    expires_at: Time
    renewals: int
    last_renewed_at: Time | None
    refused_reason: str
    ended_at: Time | None
    end_reason: str


def lease_history_dict(lease) -> LeaseSummaryShape:
    """The lease timeline of a task (U4): grant, renewals, end."""
    return {
        "id": str(lease.id),
        "granted_at": iso(lease.granted_at),
        "expires_at": iso(lease.expires_at),
        "renewals": lease.renewals,
        "last_renewed_at": iso(lease.last_renewed_at),
        "refused_reason": lease.refused_reason,
        "ended_at": iso(lease.ended_at),
        "end_reason": lease.end_reason,
    }


class TaskEventRowShape(TypedDict):
    """One row of a task's history (append-only)."""

    old_state: str
    new_state: str
    reason: str
    actor: str
    at: Time


def task_event_row_dict(event) -> TaskEventRowShape:
    """One TaskEvent (history, append-only)."""
    return {"old_state": event.old_state, "new_state": event.new_state, "reason": event.reason, "actor": event.actor, "at": iso(event.at)}


class ReceiptRecordShape(TypedDict):
    """One stored receipt with the answer the worker got (R1)."""

    event_id: str
    kind: str
    generation: int
    body: Annotated[dict[str, Any], Doc("the receipt as the worker sent it")]
    answer: Annotated[str, Doc("the exact answer body the service returned (R1)")]
    received_at: Time


def receipt_dict(receipt) -> ReceiptRecordShape:
    """One stored receipt with the answer the worker got (R1)."""
    return {
        "event_id": receipt.event_id, "kind": receipt.kind, "generation": receipt.generation, "body": receipt.body,
        "answer": receipt.response_body, "received_at": iso(receipt.received_at),
    }


class TaskDetailShape(TaskShape):
    """``GET /api/tasks/{id}/``: the task with its lease, events and last 50 receipts."""

    lease: LeaseSummaryShape | None
    events: list[TaskEventRowShape]
    receipts: list[ReceiptRecordShape]


def task_detail_dict(task) -> TaskDetailShape:
    """``GET /api/tasks/{id}/``: the task with its lease, events and last
    ``DETAIL_RECEIPTS`` receipts."""
    lease = task.leases.first()
    return {
        **task_dict(task, full=True),
        "lease": None if lease is None else lease_history_dict(lease),
        "events": [task_event_row_dict(e) for e in task.events.all()],
        "receipts": [receipt_dict(r) for r in task.receipts.all()[:DETAIL_RECEIPTS]],
    }


# --- worker protocol --------------------------------------------------------------------


class LeaseApprovalShape(TypedDict):
    """Q5: what a run that asks its owner needs (only in a grant asked with
    ``approval_credential``)."""

    credential: Annotated[str, Doc("the task's approval credential (Authorization: Task <credential>): creates "
                                   "approvals of this task and reads them, nothing else; stops when the task is final")]
    wait_s: Annotated[float, Doc("the service's approval_wait_s: an approval expires this long after it was asked")]


class LeaseShape(TypedDict):
    """A lease grant or renewal answer (L1, L2); all durations in seconds."""

    lease_id: Uuid
    expires_at: Time
    duration_s: float
    renew_every_s: float
    margin_s: float
    kill_grace_s: float
    approval: NotRequired[LeaseApprovalShape]


def lease_dict(lease, *, approval: dict | None = None) -> LeaseShape:
    """Answer of a lease grant or renewal (H, L2); ``approval`` (Q5) only when given."""
    out: LeaseShape = {
        "lease_id": str(lease.id),
        "expires_at": iso(lease.expires_at),
        "duration_s": lease.duration_s,
        "renew_every_s": lease.renew_every_s,
        "margin_s": lease.margin_s,
        "kill_grace_s": lease.kill_grace_s,
    }
    if approval is not None:
        out["approval"] = approval
    return out


class MessageShape(TypedDict):
    """One outbox message (W2)."""

    id: Uuid
    kind: Literal["start", "cancel", "query", "integrate", "message", "interrupt", "end", "session_message",
                  "session_interrupt"]
    operation_id: Annotated[Uuid | None, Doc("null for the session kinds (T2, T5)")]
    payload: Annotated[AnyPayload, Doc("the shape of its kind (machine.protocol.shapes): start, cancel, query, "
                                       "integrate (G7), message, interrupt, end (C2-C5), session_message, "
                                       "session_interrupt (T2, T5)")]


def message_dict(message) -> MessageShape:
    """One outbox message of ``GET /api/worker/messages/`` (W2)."""
    return {"id": str(message.id), "kind": message.kind, "operation_id": None if message.operation_id is None else str(message.operation_id),
            "payload": message.payload}


class MessagesShape(TypedDict):
    """Answer of ``GET /api/worker/messages/`` (W2)."""

    messages: list[MessageShape]


def messages_dict(messages) -> MessagesShape:
    """Answer of the long-poll (H, W2)."""
    return {"messages": [message_dict(m) for m in messages]}


class AckShape(TypedDict):
    """Answer of ``POST /api/worker/messages/{id}/ack/`` (W2)."""

    acked: bool


class ReceiptAnswerShape(TypedDict):
    """R3: ``{"outcome": "applied"}`` or ``{"outcome": "not_applied", "reason"}``."""

    outcome: Literal["applied", "not_applied"]
    reason: NotRequired[str]


class SyncLeaseAnswerShape(TypedDict):
    """One renewal's answer in a sync, in the order sent, as
    ``POST /api/worker/leases/{id}/renew/`` would answer it: ``status`` 200 with ``lease``,
    or 404/409 with ``error`` (L5's reason, or ``not_found``) and ``detail``. It does not
    repeat the lease id asked for (a refused id is the caller's input, K2)."""

    status: int
    lease: NotRequired[LeaseShape]
    error: NotRequired[str]
    detail: NotRequired[str]


class SyncReceiptAnswerShape(TypedDict):
    """One receipt's answer in a sync, as ``POST /api/worker/receipts/`` would answer it
    (R1: a second delivery, alone or in a sync, gets the first one's answer): ``status``
    and ``answer`` (``ReceiptAnswerShape``, or the error shape of a 404)."""

    event_id: str
    status: int
    answer: Annotated[dict, Doc('{"outcome", "reason"?} (R3), or {"error", "detail"} with a 404 status')]


class SyncAnswerShape(TypedDict):
    """``POST /api/worker/sync/``: one item per renewal and per receipt, in the order sent."""

    leases: list[SyncLeaseAnswerShape]
    receipts: list[SyncReceiptAnswerShape]


class ProgressAnswerShape(TypedDict):
    """Answer of ``POST /api/worker/progress/`` (G4): ``{"outcome": "applied"}``, or
    ``not_applied`` with ``reason`` ``stale_seq`` or ``final``."""

    outcome: Literal["applied", "not_applied"]
    reason: NotRequired[Literal["stale_seq", "final"]]


class TokenShape(TypedDict):
    """Answer of ``POST /api/token/rotate/`` (K1): the new owner token."""

    token: str
