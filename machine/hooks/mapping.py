"""From one agent CLI hook payload to the RunStead writes it implies (SPEC I2-I4, I6).

Pure functions, no I/O and no Django: ``identify`` names the agent session a payload
belongs to, ``handle`` turns the payload plus that session's local state (kept by the
hook between calls, see ``store.Outbox.session_state``) into an ordered list of writes
``{"method", "path", "body"}`` for the sender, updating the state in place.

Local state per agent session: ``created`` (the session create was queued), ``titled``
(the first prompt set the title), ``turn`` (the open turn's id, kept until its ``ended``
is queued, I2), ``turn_at`` (when its ``running`` was queued, the hook's wall clock in
seconds) and ``turn_origin`` (the agent's own id of a turn that I7 continued under a
fresh id), ``jobs`` (background job ids known to the service as held, I3),
``attention`` (a permission prompt was reported, I6), ``ended`` (the last turn ids
whose ``ended`` was queued, so a Codex ``notify`` after its ``Stop`` hook adds nothing),
``approvals`` (ids of approvals a waiting ``PermissionRequest`` hook asked for and has
not seen answered, Q4) and ``asks`` (the turn's count of permission requests per tool
input digest, for Q1's key; ``machine.hooks.approval``).
"""

from machine.hooks import AGENTS, DEFAULT_MARKER_CLASS_S, Record, uuid5

TITLE_MAX = 80  # I3: the title from the first prompt
MESSAGE_MAX = 500  # attention message shown on the board
ENDED_KEEP = 20
# Claude Code background task statuses that mean "no longer running" (finished ones
# usually drop out of the list; a listed finished one counts as gone).
FINISHED_STATUSES = {"completed", "failed", "killed", "stopped", "cancelled", "canceled", "done", "error"}
WAKE_PROMPT_PREFIX = "<task-notification>"


class BadInput(Exception):
    """A payload the hook cannot use: logged as one line, nothing queued (I1)."""


class Event(Record):
    """One hook call: the CLI, its session id, the hook event's name. A ``Record``, not a
    dataclass: ``dataclasses`` imports ``inspect``, 9 ms of every tool hook (I7)."""

    __slots__ = ("agent", "agent_session_id", "name")

    @property
    def key(self) -> str:
        return f"{self.agent}:{self.agent_session_id}"


def safe_id(value: str, longest: int) -> bool:
    """Whether the API takes ``value`` as an id as it is: 1 to ``longest`` characters, no
    slash and no whitespace (``re`` imported on first use: a tool hook with nothing due
    never needs it, I7)."""
    import re

    return re.match(rf"^[^/\s]{{1,{longest}}}$", value) is not None


def session_uuid(agent: str, agent_session_id: str) -> str:
    """I2: ``uuid5(RUNSTEAD_NAMESPACE, "<agent>:<agent session id>")``."""
    return uuid5(f"{agent}:{agent_session_id}")


def device_id(hostname: str, agent: str, agent_session_id: str) -> str:
    """I2, M5: ``<hostname>:<agent>:<agent session id>``, one per app instance (whitespace
    and slashes, which the API refuses in a device id, become ``-``)."""
    import re

    return re.sub(r"[/\s]", "-", f"{hostname}:{agent}:{agent_session_id}")[:200]


def turn_token(value) -> str | None:
    """An agent's own turn id (Claude ``prompt_id``, Codex ``turn-id``) as a marker
    ``turn_id``: kept when the API accepts it, else a stable uuid5 of it."""
    if not isinstance(value, str) or not value:
        return None
    return value if safe_id(value, 100) else uuid5(value)


def job_token(value) -> str | None:
    if not isinstance(value, (str, int)) or value == "":
        return None
    value = str(value)
    return value if safe_id(value, 200) else uuid5(value)


def _text(payload: dict, name: str) -> str:
    value = payload.get(name)
    return value if isinstance(value, str) else ""


def identify(agent: str, payload) -> Event:
    """The agent session and event name of a payload. Raises BadInput for an unknown
    agent, a payload that is not a JSON object, or one without a session id or event."""
    if agent not in AGENTS:
        raise BadInput(f"unknown agent {agent!r}")
    if not isinstance(payload, dict):
        raise BadInput("payload is not a JSON object")
    if agent == "codex" and "hook_event_name" not in payload:
        name, session = payload.get("type"), payload.get("thread-id")
    elif agent == "opencode":
        name = payload.get("type")
        props = payload.get("properties") if isinstance(payload.get("properties"), dict) else {}
        info = props.get("info") if isinstance(props.get("info"), dict) else {}
        session = props.get("sessionID") or info.get("id")
    else:
        name, session = payload.get("hook_event_name"), payload.get("session_id")
    if not isinstance(name, str) or not name:
        raise BadInput("payload names no event")
    if not isinstance(session, str) or not session:
        raise BadInput(f"{name}: payload carries no session id")
    if name not in HANDLERS[agent]:
        raise BadInput(f"unknown event {name!r}")
    return Event(agent, session, name)


def continuation_due(state: dict, *, now: float, class_s: float) -> bool:
    """I7: the open turn's marker is past half of its class (``class_s`` seconds, M2),
    measured on the hook's own clock from when its ``running`` was queued (``now``: wall
    seconds); a turn with no start time recorded (before I7) counts as due."""
    if not state.get("turn"):
        return False
    started = state.get("turn_at")
    return not isinstance(started, (int, float)) or now - started >= class_s / 2


class Writes:
    """Builds the writes of one hook call for one session. ``now`` is the hook's wall
    clock (seconds) and ``class_s`` the marker class the service last answered with (I7)."""

    def __init__(self, event: Event, state: dict, hostname: str, *, now: float = 0.0,
                 class_s: float = DEFAULT_MARKER_CLASS_S):
        self.event = event
        self.state = state
        self.hostname = hostname
        self.now = now
        self.class_s = class_s
        self.session_id = session_uuid(event.agent, event.agent_session_id)
        self.device_id = device_id(hostname, event.agent, event.agent_session_id)
        self.items: list[dict] = []
        self.binding: dict = {}

    def add(self, method: str, path: str, body: dict | None) -> None:
        self.items.append({"method": method, "path": path, "body": body})

    def ensure_session(self, *, cwd: str, title: str = "") -> None:
        """``POST /api/sessions/`` once per session (idempotent on ``id`` on the service)."""
        if self.state.get("created"):
            if self.binding and self.state.get("bound") != self.binding:  # T1: re-bind
                self.add("POST", "/api/sessions/", {"id": self.session_id, **self.binding})
                self.state["bound"] = dict(self.binding)
            return
        folder_name = cwd.rstrip("/").rsplit("/", 1)[-1] if cwd else ""
        self.add("POST", "/api/sessions/", {
            "id": self.session_id, "title": (title or folder_name)[:TITLE_MAX], "agent": self.event.agent,
            "cwd": cwd, **self.binding,
        })
        self.state["created"] = True
        if self.binding:
            self.state["bound"] = dict(self.binding)
        if title:
            self.state["titled"] = True

    def sweep(self) -> None:
        """M5: close every running marker of this app instance (a crash left them open)."""
        from urllib.parse import quote  # not at the top: a tool hook never needs it (I7)

        self.add("POST", f"/api/devices/{quote(self.device_id, safe=':')}/sweep/", None)
        for key in ("turn", "turn_at", "turn_origin"):
            self.state.pop(key, None)

    def title_from_prompt(self, prompt: str) -> None:
        if self.state.get("titled"):
            return
        title = " ".join(prompt.split())[:TITLE_MAX]
        if not title or prompt.startswith(WAKE_PROMPT_PREFIX):
            return
        self.add("PATCH", f"/api/sessions/{self.session_id}/", {"title": title})
        self.state["titled"] = True

    def marker(self, turn_id: str, state: str, reply: str = "") -> None:
        body = {"turn_id": turn_id, "device_id": self.device_id, "device_name": self.hostname, "state": state}
        if reply:
            body["reply"] = reply
        self.add("PUT", f"/api/sessions/{self.session_id}/marker/", body)

    def running(self, turn_id: str | None = None) -> str:
        """M1: ``running`` for a new turn (the agent's own id, or a fresh uuid4, I2)."""
        if not turn_id:
            import uuid  # not at the top: see ``machine.hooks.uuid5``

            turn_id = str(uuid.uuid4())
        self.marker(turn_id, "running")
        self.state["turn"] = turn_id
        self.state["turn_at"] = self.now
        self.state.pop("turn_origin", None)
        return turn_id

    def continue_turn(self) -> None:
        """I7: the open turn goes on past half of its marker's class: one ``running`` with
        a fresh turn id on the same device (M7: it replaces the marker, so the session
        never drops to idle), kept as the turn ``Stop`` ends; the agent's own id of the
        turn stays known (``turn_origin``), so its end by that id ends this one."""
        if not continuation_due(self.state, now=self.now, class_s=self.class_s):
            return
        origin = self.state.get("turn_origin") or self.state["turn"]
        self.running()
        self.state["turn_origin"] = origin

    def ended(self, turn_id: str | None = None, reply: str = "") -> None:
        """M1: ``ended`` for the open turn (or ``turn_id``; the agent's own id of a
        continued turn means the open one); nothing when no turn is open. ``reply``: the
        turn's last assistant message (T6), cut to ``TURN_REPLY_MAX_CHARS``."""
        if turn_id is not None and turn_id == self.state.get("turn_origin"):
            turn_id = self.state.get("turn")
        turn_id = turn_id or self.state.get("turn")
        if not turn_id or turn_id in self.state.get("ended", []):
            return
        from machine.protocol import TURN_REPLY_MAX_CHARS  # import-free module (I7)

        self.marker(turn_id, "ended", reply.replace("\x00", "")[:TURN_REPLY_MAX_CHARS])  # a NUL: 400, lost ended
        done = [turn_id]
        if self.state.get("turn") == turn_id:
            origin = self.state.pop("turn_origin", None)
            done += [origin] if origin else []
            self.state.pop("turn", None)
            self.state.pop("turn_at", None)
        self.state["ended"] = (self.state.get("ended", []) + done)[-ENDED_KEEP:]

    def job_start(self, job_id: str) -> None:
        self.add("POST", f"/api/sessions/{self.session_id}/jobs/", {"job_id": job_id, "mode": "held"})
        self.state["jobs"] = sorted(set(self.state.get("jobs", [])) | {job_id})

    def job_finish(self, job_id: str) -> None:
        from urllib.parse import quote

        self.add("POST", f"/api/sessions/{self.session_id}/jobs/{quote(job_id, safe='')}/finish/", {"wakes": False})
        self.state["jobs"] = sorted(set(self.state.get("jobs", [])) - {job_id})

    def finish_all_jobs(self) -> None:
        for job_id in list(self.state.get("jobs", [])):
            self.job_finish(job_id)

    def attention(self, message: str) -> None:
        """I6: the session needs its owner (a permission prompt)."""
        self.add("PATCH", f"/api/sessions/{self.session_id}/", {
            "attention": "permission", "attention_message": message[:MESSAGE_MAX],
        })
        self.state["attention"] = True

    def answered_in_terminal(self) -> None:
        """Q4: the session moved on (a tool ran or was refused, another permission request,
        a stop, the end), so the approvals its waiting hook asked for and still counts as
        pending were answered in the terminal: one ``POST .../terminal/`` each (a repeat
        for one already decided changes nothing on the service)."""
        for approval_id in self.state.pop("approvals", None) or []:
            if isinstance(approval_id, str) and safe_id(approval_id, 100):
                self.add("POST", f"/api/approvals/{approval_id}/terminal/", {})

    def clear_attention(self) -> None:
        if self.state.pop("attention", None):
            self.add("PATCH", f"/api/sessions/{self.session_id}/", {"attention": ""})


# --- Claude Code (I3), also Codex hooks (I4) --------------------------------------------


def claude_session_start(w: Writes, p: dict) -> None:
    w.ensure_session(cwd=_text(p, "cwd"))
    # `clear` and `compact` can come mid-turn: no sweep then (I3).
    if p.get("source") in ("startup", "resume"):
        w.sweep()


def claude_prompt(w: Writes, p: dict) -> None:
    w.answered_in_terminal()  # a new prompt: no dialog of the last turn is open any more (Q4)
    w.ensure_session(cwd=_text(p, "cwd"))
    w.clear_attention()
    w.running(turn_token(p.get("prompt_id")) or turn_token(p.get("turn_id")))
    w.title_from_prompt(_text(p, "prompt"))


def reconcile_background_tasks(w: Writes, tasks) -> None:
    """I3, S3: a running task not yet known -> a held job; a known job no longer listed
    as running -> finished with ``wakes: false`` (the turn that just ended was the short
    turn its completion started)."""
    if not isinstance(tasks, list):
        return  # an older CLI that does not report background work: leave jobs alone
    running = []
    for task in tasks:
        if not isinstance(task, dict):
            continue
        status = task.get("status")
        if isinstance(status, str) and status.lower() in FINISHED_STATUSES:
            continue
        job_id = job_token(task.get("id"))
        if job_id and job_id not in running:
            running.append(job_id)
    known = set(w.state.get("jobs", []))
    for job_id in running:
        if job_id not in known:
            w.job_start(job_id)
    for job_id in sorted(known - set(running)):
        w.job_finish(job_id)


def claude_stop(w: Writes, p: dict) -> None:
    w.answered_in_terminal()
    w.ensure_session(cwd=_text(p, "cwd"))
    w.clear_attention()
    # Jobs first, then `ended`, so the session never drops to idle in between (S3).
    reconcile_background_tasks(w, p.get("background_tasks"))
    w.ended(reply=_text(p, "last_assistant_message"))


def tool_activity(w: Writes, p: dict) -> None:
    """I7: a tool hook (Claude Code and Codex ``PreToolUse`` / ``PostToolUse``, Gemini
    ``BeforeTool`` / ``AfterTool``): the agent is working, so a turn past half of its
    marker's class is continued; otherwise nothing (the hook command returns before it
    opens the outbox for writing, ``__main__``). A pending approval of the session that
    its asking hook still waits for was answered in the terminal (Q4)."""
    w.answered_in_terminal()
    w.continue_turn()


# T5: the event RunStead's terminal wrapper reports itself (the CLIs fire none for it).
INTERRUPTED = "RunsteadInterrupted"


def terminal_interrupted(w: Writes, p: dict) -> None:
    """T5: the terminal wrapper sent the CLI's interrupt key (or the person pressed it)
    and the CLI went still: the turn is over, though Claude Code 2.1.328 fires no hook
    when a turn is interrupted (no ``Stop``). The wrapper runs the hook with
    ``{"hook_event_name": "RunsteadInterrupted", "session_id": <the agent's id>}``."""
    w.answered_in_terminal()
    w.clear_attention()
    w.ended()


def claude_permission_request(w: Writes, p: dict) -> None:
    """Q3, Q4: an earlier approval still pending here was answered in the terminal (the
    service does the same when it creates the new one); the agent works on (I7). The
    approval itself is asked synchronously by ``machine.hooks.approval``."""
    w.answered_in_terminal()
    w.continue_turn()


def claude_notification(w: Writes, p: dict) -> None:
    if p.get("notification_type") != "permission_prompt":
        return
    w.ensure_session(cwd=_text(p, "cwd"))
    w.attention(_text(p, "message") or "permission needed")


def claude_session_end(w: Writes, p: dict) -> None:
    w.answered_in_terminal()
    w.ensure_session(cwd=_text(p, "cwd"))
    w.clear_attention()
    w.ended()
    w.finish_all_jobs()


# --- Codex notify (I4) ------------------------------------------------------------------

# Codex 0.169's terminal UI names a thread by running a hidden, ephemeral thread of its own
# after a user message, until a title is set (tui/src/app/thread_title.rs): no hook fires
# for it, only ``notify``, whose first input message is this request (observed offline).
CODEX_TITLE_REQUEST = "Generate a concise, single-line task title"


def codex_title_thread(event: Event, payload: dict) -> bool:
    """Whether ``payload`` is the ``notify`` of Codex's title-generation thread: not a
    session of the user's (T1: not on the board, not the one the terminal wrapper runs,
    T3), so the hook writes nothing for it."""
    return (event.agent, event.name) == ("codex", "agent-turn-complete") \
        and _first_input(payload).startswith(CODEX_TITLE_REQUEST)


def _first_input(p: dict) -> str:
    """A Codex notify's first ``input-messages`` entry (the turn's prompt), or ""."""
    messages = p.get("input-messages")
    return messages[0] if isinstance(messages, list) and messages and isinstance(messages[0], str) else ""


def codex_notify(w: Writes, p: dict) -> None:
    """``agent-turn-complete``: ``ended`` for its ``turn-id``, preceded by ``running`` when
    that turn was never started (no trusted hooks), carrying ``last-assistant-message``
    (T6: kept on the messages the turn answered)."""
    w.ensure_session(cwd=_text(p, "cwd"), title=" ".join(_first_input(p).split())[:TITLE_MAX])
    reply = _text(p, "last-assistant-message")
    turn_id = turn_token(p.get("turn-id"))
    if turn_id is None:
        w.ended(reply=reply)
        return
    if turn_id in w.state.get("ended", []):
        return
    if turn_id not in (w.state.get("turn"), w.state.get("turn_origin")):
        w.running(turn_id)
    w.ended(turn_id, reply=reply)


def codex_stop(w: Writes, p: dict) -> None:
    """Codex's ``Stop`` hook: the turn ended, with ``last_assistant_message`` (T6; the
    same as its ``notify``'s, whichever comes first ends the turn)."""
    w.answered_in_terminal()
    w.ensure_session(cwd=_text(p, "cwd"))
    w.ended(reply=_text(p, "last_assistant_message"))


# --- Gemini CLI (I4) --------------------------------------------------------------------


def gemini_before_agent(w: Writes, p: dict) -> None:
    w.ensure_session(cwd=_text(p, "cwd"))
    w.clear_attention()
    w.running()
    w.title_from_prompt(_text(p, "prompt"))


def gemini_after_agent(w: Writes, p: dict) -> None:
    w.ensure_session(cwd=_text(p, "cwd"))
    w.clear_attention()
    w.ended()


# What Gemini CLI's ToolPermission ``details`` name, per confirmation type (0.61.0 sends
# a message without it: "Tool Confirm Shell Command requires execution").
GEMINI_DETAIL_KEYS = {"exec": ("command",), "edit": ("fileName", "filePath"), "mcp": ("toolDisplayName", "toolName")}


def gemini_notification(w: Writes, p: dict) -> None:
    """I4, I6: ``Notification`` with ``notification_type: ToolPermission`` (interactive
    only, sent when the approval dialog shows) -> the session's attention; the message is
    the CLI's, followed by what it asks about (``details``: the command, the file, the
    MCP tool), so the owner sees what is waiting."""
    if p.get("notification_type") != "ToolPermission":
        return
    w.ensure_session(cwd=_text(p, "cwd"))
    message = _text(p, "message") or "permission needed"
    details = p.get("details") if isinstance(p.get("details"), dict) else {}
    for key in GEMINI_DETAIL_KEYS.get(details.get("type"), ()):
        subject = details.get(key)
        if isinstance(subject, str) and subject.strip():
            message = f"{message}: {subject.strip()}"
            break
    w.attention(message)


# --- opencode (I4; events forwarded by integrations/opencode/runstead.js) ----------------


def _props(p: dict) -> dict:
    return p.get("properties") if isinstance(p.get("properties"), dict) else {}


def _opencode_cwd(p: dict) -> str:
    info = _props(p).get("info") if isinstance(_props(p).get("info"), dict) else {}
    for value in (info.get("directory"), p.get("directory")):
        if isinstance(value, str) and value:
            return value
    return ""


def opencode_created(w: Writes, p: dict) -> None:
    w.ensure_session(cwd=_opencode_cwd(p))


def opencode_busy(w: Writes, p: dict) -> None:
    """``busy`` starts a turn, and, repeated while it works, is opencode's tool hook (I7)."""
    if w.state.get("turn"):
        w.continue_turn()
        return
    w.ensure_session(cwd=_opencode_cwd(p))
    w.running()


def opencode_idle(w: Writes, p: dict) -> None:
    w.ensure_session(cwd=_opencode_cwd(p))
    w.clear_attention()
    w.ended()


def opencode_status(w: Writes, p: dict) -> None:
    status = _props(p).get("status")
    kind = status.get("type") if isinstance(status, dict) else status
    if kind == "busy":
        opencode_busy(w, p)
    elif kind == "idle":
        opencode_idle(w, p)
    # `retry`: still the same busy turn, nothing to write.


def opencode_permission(w: Writes, p: dict) -> None:
    w.ensure_session(cwd=_opencode_cwd(p))
    props = _props(p)
    message = props.get("title") or props.get("permission") or props.get("type") or "permission needed"
    w.attention(message if isinstance(message, str) else "permission needed")


def opencode_permission_replied(w: Writes, p: dict) -> None:
    w.clear_attention()


def opencode_deleted(w: Writes, p: dict) -> None:
    w.ended()
    w.clear_attention()


HANDLERS = {
    "claude": {
        "SessionStart": claude_session_start,
        "UserPromptSubmit": claude_prompt,
        "Stop": claude_stop,
        "Notification": claude_notification,
        "SessionEnd": claude_session_end,
        "PreToolUse": tool_activity,
        "PostToolUse": tool_activity,
        "PermissionRequest": claude_permission_request,
        INTERRUPTED: terminal_interrupted,
    },
    "codex": {
        "agent-turn-complete": codex_notify,
        "SessionStart": claude_session_start,
        "UserPromptSubmit": claude_prompt,
        "Stop": codex_stop,
        "PreToolUse": tool_activity,
        "PostToolUse": tool_activity,
        "PermissionRequest": claude_permission_request,
        INTERRUPTED: terminal_interrupted,
    },
    "gemini": {
        "SessionStart": claude_session_start,
        "BeforeAgent": gemini_before_agent,
        "AfterAgent": gemini_after_agent,
        "BeforeTool": tool_activity,
        "AfterTool": tool_activity,
        "Notification": gemini_notification,
        "SessionEnd": claude_session_end,
    },
    "opencode": {
        "session.created": opencode_created,
        "session.status": opencode_status,
        "session.idle": opencode_idle,
        "session.execution.started": opencode_busy,
        "session.execution.succeeded": opencode_idle,
        "session.execution.failed": opencode_idle,
        "session.execution.interrupted": opencode_idle,
        "permission.asked": opencode_permission,
        "permission.updated": opencode_permission,
        "permission.replied": opencode_permission_replied,
        "session.deleted": opencode_deleted,
    },
}


# I7: events that only say "the agent is working": with no continuation due they write
# nothing, and the hook command decides that from a read of the local state alone.
TOOL_EVENTS = {"PreToolUse", "PostToolUse", "BeforeTool", "AfterTool"}


def is_activity(event: Event, payload: dict) -> bool:
    """Whether ``event`` is a tool hook (or opencode's repeated ``busy``) of I7."""
    if event.agent == "opencode":
        status = _props(payload).get("status")
        return event.name == "session.status" and (status.get("type") if isinstance(status, dict) else status) == "busy"
    return event.name in TOOL_EVENTS


def nothing_due(event: Event, payload: dict, state: dict, *, now: float, class_s: float) -> bool:
    """I7: an activity event that would write nothing for this session state: no turn to
    continue, or one not yet past half of its class (opencode's ``busy`` with no turn
    open starts one, so it is never "nothing"), and no approval asked by a waiting hook
    (Q4: the tool hook resolves it)."""
    if event.agent == "opencode" and not state.get("turn"):
        return False
    if state.get("approvals"):
        return False  # Q4: a waiting approval to resolve as answered in the terminal
    return not continuation_due(state, now=now, class_s=class_s)


def handle(event: Event, payload: dict, state: dict, *, hostname: str, now: float = 0.0,
           class_s: float = DEFAULT_MARKER_CLASS_S, binding: dict | None = None) -> list[dict]:
    """The writes one hook call implies, in delivery order; updates ``state`` in place.
    ``now``: the hook's wall clock (seconds); ``class_s``: the marker class (I7);
    ``binding``: T1's ``{"machine", "channel"}`` of the session, sent with its create and
    again whenever it changes (the session started again under the wrapper)."""
    writes = Writes(event, state, hostname, now=now, class_s=class_s)
    writes.binding = binding or {}
    HANDLERS[event.agent][event.name](writes, payload)
    return writes.items
