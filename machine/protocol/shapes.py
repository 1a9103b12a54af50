"""The messages and receipts of the service <-> worker contract (SPEC H, W2, J1, U1, G7,
C2-C5), one ``TypedDict`` per message kind's payload and per receipt kind's facts, and the
one strict check both sides call (STYLE 18).

The service builds each outbox payload (``tasks_app/services/payloads.py``) and checks it
before it is written; the worker checks each message where it receives it (the poller)
and each receipt where it builds it (``machine/worker/wire.py``); ``InMemoryService``
checks what it is given and sent; the OpenAPI ``MessageShape`` describes its payload as
``oneOf`` these shapes. Values stay plain dicts: a shape names the keys and their types,
``check_shape`` enforces the names (an unknown key or a missing required one), not the
types, which the service's input serializers validate.

Standard library only (the worker may ship alone), and kept out of
``machine/protocol/__init__.py``: a hook imports that and must start in milliseconds
(I7), without ``typing``. No ``from __future__ import annotations`` here: Python 3.11
sees ``NotRequired`` only in evaluated annotations.
"""
from typing import Any, Literal, NotRequired, TypedDict, get_args


class ProtocolError(ValueError):
    """A message or receipt that is not its shape; the text names the shape and the
    unknown or missing fields."""


def check_shape(shape: type, value):
    """``value`` itself when it is a dict with every required key of the ``TypedDict``
    ``shape`` and no key the shape does not name; else ``ProtocolError`` naming them.
    Only the top level is checked (``check_message``/``check_receipt`` go deeper where a
    kind says which shape is inside)."""
    if not isinstance(value, dict):
        raise ProtocolError(f"{shape.__name__}: an object expected, not {type(value).__name__}")
    unknown = sorted(set(value) - set(shape.__annotations__))
    missing = sorted(shape.__required_keys__ - set(value))
    if unknown or missing:
        problems = [f"unknown field(s) {', '.join(unknown)}"] if unknown else []
        problems += [f"missing field(s) {', '.join(missing)}"] if missing else []
        raise ProtocolError(f"{shape.__name__}: {'; '.join(problems)}")
    return value


# --- messages: service -> worker, the payload of each outbox message kind (W2) ------------------------


class StartPayload(TypedDict):
    """``start`` (H, W2-W4): run the task's agent. ``isolation`` is what acceptance decided
    (G7); a live conversation (C1, C5) adds ``mode``, ``idle_s`` (seconds) and
    ``prompt_message_id``; a follow-up (G6) adds ``agent_session_id``, and ``worktree_of``
    (the followed task's operation id) when it runs in that task's worktree (G7, G8)."""

    operation_id: str
    task_id: str
    folder: str
    grant_root: str
    agent: str
    prompt: str
    max_runtime_s: int
    session_id: str | None
    deep_research: bool
    isolation: Literal["none", "worktree"]
    mode: NotRequired[Literal["conversation"]]
    idle_s: NotRequired[float]
    prompt_message_id: NotRequired[str | None]
    agent_session_id: NotRequired[str | None]
    worktree_of: NotRequired[str]


class CancelPayload(TypedDict):
    """``cancel`` (J7): stop the operation's agent."""

    operation_id: str


class QueryPayload(TypedDict):
    """``query`` (U1): answer with a ``report`` receipt carrying ``query_id``."""

    operation_id: str
    query_id: str


class IntegratePayload(TypedDict):
    """``integrate`` (G7): merge or discard a worktree task's branch; ``base``,
    ``base_branch`` and ``head`` (commit ids, branch name) from its final git evidence."""

    operation_id: str
    integration_id: str
    action: str  # merge, discard (a Literal here would be a second enum of the name in the schema)
    branch: str
    base: str | None
    base_branch: str | None
    head: str | None


class MessagePayload(TypedDict):
    """``message`` (C2, C3): the owner's message number ``seq`` (from 1) for the live agent;
    ``delivery`` (C9) ``steer``: write it into the running turn now (absent: ``queue``,
    its own turn after the current one)."""

    operation_id: str
    message_id: str
    seq: int
    text: str
    delivery: NotRequired[Literal["queue", "steer"]]


class InterruptPayload(TypedDict):
    """``interrupt`` (C4): stop the agent's current turn."""

    operation_id: str
    interrupt_id: str


class EndPayload(TypedDict):
    """``end`` (C5): close the agent's input after message ``last_seq``; ``reason``:
    who ended it (``owner``)."""

    operation_id: str
    reason: str
    last_seq: int


class SessionMessagePayload(TypedDict):
    """``session_message`` (T2): the owner's message number ``seq`` (from 1) for the
    terminal session ``session_id`` on this machine (agent session id: ``agent`` and
    the session's own id as the hooks name it). ``channel`` says who hands it to the
    agent: the terminal wrapper (``terminal``, T3) or the session's Stop hook (``hook``,
    T4); the worker records it before it acknowledges (W2) and puts it where that one
    takes it once (``machine/inbox.py``)."""

    session_id: str
    message_id: str
    seq: int
    text: str
    channel: str  # terminal, hook, native (a Literal here would be a second enum of the name in the schema)


class SessionInterruptPayload(TypedDict):
    """``session_interrupt`` (T5): the terminal wrapper of ``session_id`` sends its CLI's
    interrupt key once."""

    session_id: str
    interrupt_id: str


# The payload shape of each message kind, in the order of ``MessageKind``.
PAYLOADS: dict[str, type] = {
    "start": StartPayload,
    "cancel": CancelPayload,
    "query": QueryPayload,
    "integrate": IntegratePayload,
    "message": MessagePayload,
    "interrupt": InterruptPayload,
    "end": EndPayload,
    "session_message": SessionMessagePayload,
    "session_interrupt": SessionInterruptPayload,
}
AnyPayload = (StartPayload | CancelPayload | QueryPayload | IntegratePayload | MessagePayload | InterruptPayload
              | EndPayload | SessionMessagePayload | SessionInterruptPayload)


def check_message(kind: str, payload):
    """``payload`` itself when it is the shape of message ``kind`` (``PAYLOADS``); else
    ``ProtocolError`` (an unknown kind included). Called by the service before it writes
    an outbox message, so it never sends a field the shape does not name."""
    shape = PAYLOADS.get(kind)
    if shape is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    return check_shape(shape, payload)


def read_message(kind: str, payload) -> tuple[dict, list[str]]:
    """The worker's reading of a message: ``(payload without the fields its shape does not
    name, those fields' names)``. A field a newer service added is left out, not a reason
    to refuse the message (an older worker keeps working through a rolling upgrade); an
    unknown kind, a payload that is not an object or one missing a required field raises
    ``ProtocolError``."""
    shape = PAYLOADS.get(kind)
    if shape is None:
        raise ProtocolError(f"unknown message kind {kind!r}")
    if not isinstance(payload, dict):
        raise ProtocolError(f"{shape.__name__}: an object expected, not {type(payload).__name__}")
    unknown = sorted(set(payload) - set(shape.__annotations__))
    known = {key: value for key, value in payload.items() if key not in unknown}
    return check_shape(shape, known), unknown


# --- receipts: worker -> service, POST /api/worker/receipts/ (H, R1) ---------------------------------

RECEIPTS_PATH = "/api/worker/receipts/"

ReceiptKind = Literal["starting", "running", "final", "unknown", "report", "integrated", "message"]
RECEIPT_KINDS: tuple[str, ...] = get_args(ReceiptKind)

# J1: why the process ended, as the worker reports it.
StopReason = Literal["exit", "cancel", "deadline", "renewal_refused", "max_runtime", "worker_shutdown",
                     "worker_restart", "refused"]
STOP_REASONS: tuple[str, ...] = get_args(StopReason)


class ReceiptBody(TypedDict):
    """A receipt (H, R1): ``event_id`` is its idempotency key, ``generation`` the machine
    token's (K1), ``slept_s`` the seconds the machine slept since the lease was granted
    (L7), ``facts`` the shape of its ``kind`` (``RECEIPT_FACTS``)."""

    event_id: str
    generation: int
    operation_id: str
    kind: ReceiptKind
    slept_s: NotRequired[float | None]
    facts: NotRequired[dict[str, Any]]


SYNC_PATH = "/api/worker/sync/"
SYNC_ITEMS_MAX = 100  # leases to renew, and receipts, in one ``POST /api/worker/sync/`` (each list)
# The receipts' bodies a sync carries, in bytes: under the service's default body limit
# (256 KiB) with room for the envelope; a larger receipt (a worktree task's diff, G7) goes
# alone to RECEIPTS_PATH, which takes more.
SYNC_RECEIPT_BYTES_MAX = 192 * 1024


class SyncRenewal(TypedDict):
    """One lease to renew in a sync (L2, L10): the lease and, optionally, the agent's last
    output lines."""

    lease_id: str
    output_tail: NotRequired[str]


class SyncBody(TypedDict):
    """``POST /api/worker/sync/``: one request per machine that renews every lease listed
    in ``renew`` and carries a batch of its ``receipts`` (each a ``ReceiptBody``, applied
    once per ``event_id``, R1), at most ``SYNC_ITEMS_MAX`` of each, in the order queued.
    The answer has one item per renewal and per receipt, in the same order, each as its
    single request would have answered (``tasks_app.shapes.SyncAnswerShape``)."""

    renew: NotRequired[list[SyncRenewal]]
    receipts: NotRequired[list[ReceiptBody]]


class StartingFacts(TypedDict):
    """``starting`` (X1): the lease under which the agent is about to be spawned."""

    lease_id: str | None


class RunningFacts(TypedDict):
    """``running`` (X1): the spawned launcher, its process group and start time (seconds
    since the epoch, as the OS reports it)."""

    pid: int
    pgid: NotRequired[int | None]
    process_start_time: NotRequired[float | None]


class FinalFacts(TypedDict):
    """``final`` (J1): how the agent ended, judged by J6; ``process_started`` is true, false
    or ``"unknown"``; ``runtime_s`` wall seconds from spawn; ``survivors`` the processes
    still alive after the stop (``{pid, ...}``). The agent's facts (G1-G5, G7) are optional:
    ``agent_result``, ``usage``, ``agent_session_id``, ``evidence``, ``entries`` (G4) and
    ``refused_reason`` (a refused start's H code)."""

    process_started: bool | Literal["unknown"]
    exit_code: int | None
    signal: int | None
    lease_id: str | None
    ended_within_lease: bool | None
    runtime_s: float | None
    stop_reason: StopReason
    survivors: list[dict[str, Any]]
    output_tail: str
    agent_result: NotRequired[dict[str, Any] | None]
    usage: NotRequired[dict[str, Any] | None]
    agent_session_id: NotRequired[str | None]
    evidence: NotRequired[dict[str, Any]]
    entries: NotRequired[list[dict[str, Any]]]
    refused_reason: NotRequired[str]


class UnknownFacts(TypedDict):
    """``unknown`` (X3): the worker lost track of the operation (``reason``:
    ``worker_restart``)."""

    reason: str


class ReportRecord(TypedDict):
    """The worker's local record of an operation in a ``report`` (U1)."""

    local_state: str
    pid: int | None
    lease_id: str | None
    final: FinalFacts | None


class ReportFacts(TypedDict):
    """``report`` (U1): the answer to query ``query_id``, ``record: null`` when the worker
    has none."""

    query_id: str
    record: ReportRecord | None


class IntegratedFacts(TypedDict):
    """``integrated`` (G7): what became of integration ``integration_id``: ``outcome``
    (``merged`` with its ``commit``, ``conflict``/``base_dirty`` with ``paths``, ...)."""

    integration_id: str
    outcome: str
    commit: NotRequired[str]
    paths: NotRequired[list[str]]
    detail: NotRequired[str]


class MessageFacts(TypedDict):
    """``message`` (C3): message ``message_id`` was ``delivered``, ``answered`` or
    ``undelivered``; ``claimed`` (C10): the worker claims its delivery before it writes it
    (answered before it writes: applied, or not_applied ``stale``/``withdrawn``/``undelivered``);
    ``consumed`` (C9): the agent showed it took the message into the turn of message
    ``turn_seq`` (its own seq: it opened that turn)."""

    message_id: str
    state: Literal["claimed", "delivered", "consumed", "answered", "undelivered"]
    turn_seq: NotRequired[int]


RECEIPT_FACTS: dict[str, type] = {
    "starting": StartingFacts,
    "running": RunningFacts,
    "final": FinalFacts,
    "unknown": UnknownFacts,
    "report": ReportFacts,
    "integrated": IntegratedFacts,
    "message": MessageFacts,
}


def check_receipt(body):
    """``body`` itself when it is a ``ReceiptBody`` of a known kind whose facts are that
    kind's shape (a report's record and its final facts included); else
    ``ProtocolError``. Called where the worker builds a receipt and by ``InMemoryService``."""
    check_shape(ReceiptBody, body)
    shape = RECEIPT_FACTS.get(body["kind"])
    if shape is None:
        raise ProtocolError(f"unknown receipt kind {body['kind']!r}")
    facts = check_shape(shape, body.get("facts", {}))
    if shape is ReportFacts and facts["record"] is not None:
        record = check_shape(ReportRecord, facts["record"])
        if record["final"] is not None:
            check_shape(FinalFacts, record["final"])
    return body
