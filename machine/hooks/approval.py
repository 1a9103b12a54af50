"""The waiting ``PermissionRequest`` hook (SPEC Q1, Q3, Q4), without Django.

Claude Code runs ``python -m machine.hooks claude`` on ``PermissionRequest`` and
shows its own dialog meanwhile; Codex (0.169.0, its TUI with ``-a on-request``) runs
``... codex`` the same way but shows "Running hook" and opens its dialog only once the
hook returned without a decision. Unlike every other hook (I1: queue and return), this
one asks the service itself and waits for the owner's answer:

1. ``prepare`` (inside the hook's outbox transaction, with the session's local state):
   the request body of ``POST /api/approvals/`` with Q1's key
   ``<agent>:<agent session id>:<prompt id>:<tool input digest>:<n>`` (the prompt id of
   the payload, else of the open turn, else ``-``), ``n`` counting
   the requests with that input in that turn (kept in the local state, so a retried
   request makes no second row and a second identical request in the turn makes one);
2. ``ask_and_wait``: creates the approval (authenticated with the owner token of the
   state directory's ``config.json``, ``Authorization: Token``, as the sender does),
   records its id in the session's local state (``approvals``: what the session's next
   ``PreToolUse``, ``PostToolUse``, ``PermissionRequest``, ``Stop``, ``SessionEnd`` or
   ``UserPromptSubmit`` resolves ``answered_in_terminal`` through the outbox, Q4), then
   long-polls
   ``GET /api/approvals/{id}/?wait=S`` (S <= 25, repeated) for at most
   ``approval_wait_s``;
3. the answer (``decision_output``): allowed -> ``{"hookSpecificOutput":
   {"hookEventName": "PermissionRequest", "decision": {"behavior": "allow"}}}`` (with
   ``updatedPermissions``, the request's ``permission_suggestions`` for the session, for
   scope ``session``); denied -> ``behavior: "deny"`` with the owner's ``message``;
   anything else (expired, withdrawn, answered in the terminal, the wait over, the
   service unreachable for ``unreachable_s``, a refusal) -> nothing, so the terminal's
   own dialog decides (headless: the CLI denies).

Settings (environment first, then ``config.json``, then the default):
``RUNSTEAD_HOOK_APPROVAL_WAIT_S`` / ``approval_wait_s`` (600 s; ``install_hooks`` sets the
CLI's hook ``timeout`` above it), ``RUNSTEAD_HOOK_UNREACHABLE_S`` (10 s, fractional: how
long the service may fail before the hook gives up), ``RUNSTEAD_HOOK_APPROVAL_POLL_S``
(25 s, each long-poll's ``wait``). The variables are read strictly
(``machine.settings``): a bad value is an error in ``hook.log`` and the terminal decides.
The tool input is never logged (Q7).
"""
import http.client
import json
import os
import re
import ssl
import time
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit

from machine.hooks import store, uuid5
from machine.protocol import APPROVAL_INPUT_MAX_BYTES, APPROVAL_WAIT_MAX_S, cut_json, json_digest
from machine.settings import env_float

DEFAULT_WAIT_S = 600.0
DEFAULT_UNREACHABLE_S = 10.0
SUGGESTIONS_MAX = 50  # the service keeps at most this many (and 16 KiB of them)
SUGGESTIONS_MAX_BYTES = 16 * 1024
READ_SLACK_S = 10.0  # a long-poll's read timeout is its wait plus this
CONNECT_TIMEOUT_S = 5.0
EARLY_PAUSE_S = 0.5  # a pending answer that came back early (the server stops, no long-poll): look again after this
RETRY_PAUSE_S = (0.1, 0.25, 0.5, 1.0)  # after a failed request, by consecutive failures
KEY_PART = re.compile(r"^[\x21-\x7e]{1,100}$")
DECIDED = ("allowed", "denied")
QUIET = ("expired", "withdrawn", "answered_in_terminal")
DENY_DEFAULT_MESSAGE = "The owner denied this from RunStead."
HOOK_EVENT = "PermissionRequest"


@dataclass(frozen=True)
class Settings:
    """``wait_s``: the longest the hook waits for an answer; ``unreachable_s``: how long
    the service may fail in a row before the hook gives up; ``poll_s``: each long-poll's
    ``wait`` (at most 25). Seconds."""

    wait_s: float
    unreachable_s: float
    poll_s: float


def _number(value, default: float) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        return default
    return number if number == number and number >= 0 else default  # not NaN, not negative


def load_settings(config: dict, env=os.environ) -> Settings:
    """The hook's settings from ``env`` and the state directory's ``config`` (see the
    module docstring): a variable that is set must hold a number of seconds, at least 0
    (``machine.settings.SettingError`` otherwise); an unusable ``approval_wait_s`` in the
    config falls back to the default."""
    wait_s = env_float("RUNSTEAD_HOOK_APPROVAL_WAIT_S", _number(config.get("approval_wait_s"), DEFAULT_WAIT_S),
                       environ=env, minimum=0)
    unreachable_s = env_float("RUNSTEAD_HOOK_UNREACHABLE_S", DEFAULT_UNREACHABLE_S, environ=env, minimum=0)
    poll_s = min(env_float("RUNSTEAD_HOOK_APPROVAL_POLL_S", APPROVAL_WAIT_MAX_S, environ=env, minimum=0),
                 APPROVAL_WAIT_MAX_S)
    return Settings(wait_s=wait_s, unreachable_s=unreachable_s, poll_s=max(poll_s, 0.1))


def _key_part(value) -> str:
    """An id as a key part: kept when it is 1-100 printable ASCII without spaces, else a
    stable uuid5 of it (``-`` when absent)."""
    if not isinstance(value, str) or not value:
        return "-"
    return value if KEY_PART.match(value) else uuid5(value)


def approval_key(agent: str, agent_session_id: str, prompt_id, digest: str, count: int) -> str:
    """Q1's key: ``<agent>:<agent session id>:<prompt id>:<digest>:<count>`` (at most
    about 250 printable ASCII characters, the API's 255)."""
    return f"{agent}:{_key_part(agent_session_id)}:{_key_part(prompt_id)}:{digest}:{count}"


def _suggestions(payload: dict) -> list[dict]:
    """The CLI's ``permission_suggestions`` as the service takes them: the objects only,
    at most 50 and 16 KiB (the rest left off)."""
    raw = payload.get("permission_suggestions")
    kept = [s for s in raw if isinstance(s, dict)][:SUGGESTIONS_MAX] if isinstance(raw, list) else []
    while kept and len(json.dumps(kept, ensure_ascii=False, separators=(",", ":")).encode()) > SUGGESTIONS_MAX_BYTES:
        kept.pop()
    return kept


def prepare(*, agent: str, agent_session_id: str, session_id: str, payload: dict, state: dict) -> dict:
    """The body of ``POST /api/approvals/`` for one ``PermissionRequest`` payload (Q1),
    counting it in ``state`` (the agent session's local state, changed in place: its
    ``asks`` holds the turn's prompt id and a count per tool input digest)."""
    tool_input = payload.get("tool_input")
    if not isinstance(tool_input, dict):
        tool_input = {"value": tool_input}
    digest = json_digest(tool_input)
    # Claude Code 2.1.328 sends no prompt_id with PermissionRequest: the turn's own id
    # (UserPromptSubmit's prompt_id, kept as the open turn, I2) stands for it.
    prompt_id = (payload.get("prompt_id") or payload.get("turn_id")  # Codex: turn_id
                 or state.get("turn_origin") or state.get("turn"))
    asks = state.get("asks") if isinstance(state.get("asks"), dict) else {}
    if asks.get("turn") != prompt_id:
        asks = {"turn": prompt_id, "counts": {}}
    counts = asks.setdefault("counts", {})
    counts[digest] = int(counts.get(digest, 0)) + 1
    state["asks"] = asks
    sent_input, _ = cut_json(tool_input, APPROVAL_INPUT_MAX_BYTES - 1024)
    cwd = payload.get("cwd") if isinstance(payload.get("cwd"), str) else ""
    tool_name = payload.get("tool_name") if isinstance(payload.get("tool_name"), str) else ""
    return {
        "key": approval_key(agent, agent_session_id, prompt_id, digest, counts[digest]),
        "session": session_id,
        "agent": agent,
        "tool_name": (tool_name or "unknown")[:200],
        "tool_input": sent_input,
        "cwd": cwd[:1024] if cwd.startswith("/") else "",
        "suggestions": _suggestions(payload),
    }


def decision_output(approval: dict, payload: dict, agent: str = "claude") -> str | None:
    """Q3: the hook's stdout for a decided ``approval`` (the API's shape), or None (print
    nothing) when it was not decided from RunStead. ``payload``: the request, whose
    ``permission_suggestions`` an allow with scope ``session`` applies for the session
    (Claude Code; Codex 0.169.0 refuses ``updatedPermissions`` and sends no suggestions,
    so its allow is the call's only)."""
    state = approval.get("state")
    if state == "allowed":
        decision = {"behavior": "allow"}
        if approval.get("scope") == "session" and agent == "claude":
            decision["updatedPermissions"] = [{**s, "destination": "session"} for s in _suggestions(payload)]
    elif state == "denied":
        decision = {"behavior": "deny", "message": approval.get("message") or DENY_DEFAULT_MESSAGE}
    else:
        return None
    return json.dumps({"hookSpecificOutput": {"hookEventName": HOOK_EVENT, "decision": decision}})


# --- HTTP (the standard library's: a hook starts fast) ------------------------------------


class Unreachable(Exception):
    """The service did not answer usefully (connection, timeout, 429, 5xx): try again."""


class Refused(Exception):
    """The service refused the request for good (4xx other than 429): give up."""


def request(server: str, token: str, method: str, path: str, body: dict | None, *, timeout_s: float,
            scheme: str = "Token") -> dict:
    """One JSON request to ``server`` (``http(s)://host[:port]``) with ``Authorization:
    <scheme> <token>`` (``Task`` for a headless task's credential, Q5); returns the JSON
    body of a 2xx answer. Raises ``Unreachable`` or ``Refused``."""
    parts = urlsplit(server)
    host, port = parts.hostname or "", parts.port
    base = parts.path.rstrip("/")
    connect_s = min(CONNECT_TIMEOUT_S, max(timeout_s, 0.1))
    if parts.scheme == "https":
        conn = http.client.HTTPSConnection(host, port, timeout=connect_s, context=ssl.create_default_context())
    else:
        conn = http.client.HTTPConnection(host, port, timeout=connect_s)
    headers = {"Authorization": f"{scheme} {token}", "Accept": "application/json"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        headers["Content-Type"] = "application/json"
    try:
        conn.connect()
        conn.sock.settimeout(max(timeout_s, 0.1))
        conn.request(method, base + path, body=data, headers=headers)
        response = conn.getresponse()
        raw = response.read()
        status = response.status
    except (OSError, http.client.HTTPException) as error:
        raise Unreachable(f"{method} {path}: {error!r}") from None
    finally:
        conn.close()
    if status == 429 or status >= 500:
        raise Unreachable(f"{method} {path}: HTTP {status}")
    if status >= 300:
        raise Refused(f"{method} {path}: HTTP {status} {raw[:200].decode(errors='replace')}")
    try:
        answer = json.loads(raw)
    except ValueError:
        raise Unreachable(f"{method} {path}: HTTP {status} with a body that is not JSON") from None
    if not isinstance(answer, dict):
        raise Unreachable(f"{method} {path}: HTTP {status} with a body that is not a JSON object")
    return answer


class Asker:
    """One ``PermissionRequest``: create the approval, then wait for its answer (Q3).
    ``clock`` and ``sleep`` are ``time.monotonic`` and ``time.sleep`` unless a test
    passes others; ``send(method, path, body, timeout_s) -> dict`` defaults to
    ``request`` with the config's server and token."""

    def __init__(self, state_dir: Path, *, server: str, token: str, settings: Settings, session_key: str,
                 send=None, clock=time.monotonic, sleep=time.sleep, agent: str = "claude"):
        self.state_dir, self.server, self.token, self.agent = state_dir, server, token, agent
        self.settings, self.session_key = settings, session_key
        self._send = send
        self.clock, self.sleep = clock, sleep
        self.start = clock()
        self.deadline = self.start + settings.wait_s
        self.failing_since: float | None = None
        self.failures = 0

    def log(self, message: str) -> None:
        store.log_line(self.state_dir, store.HOOK_LOG, f"{self.agent}: PermissionRequest: {message}")

    def send(self, method: str, path: str, body: dict | None, timeout_s: float) -> dict:
        if self._send is not None:
            return self._send(method, path, body, timeout_s)
        return request(self.server, self.token, method, path, body, timeout_s=timeout_s)

    def call(self, method: str, path: str, body: dict | None, wait_s: float = 0.0) -> dict | None:
        """One request, retried while the service fails; None once it has failed for
        ``unreachable_s`` in a row, or the wait is over. Raises ``Refused``."""
        while True:
            now = self.clock()
            if now >= self.deadline:
                return None
            timeout_s = min(wait_s + READ_SLACK_S, max(self.deadline - now, 0.1))
            if self.failing_since is not None:  # never wait past the unreachable window
                timeout_s = min(timeout_s, max(self.failing_since + self.settings.unreachable_s - now, 0.1))
            try:
                answer = self.send(method, path, body, timeout_s)
            except Unreachable as error:
                now = self.clock()
                if self.failing_since is None:
                    self.failing_since = now
                    self.log(f"{error}; retrying for {self.settings.unreachable_s:g} s")
                if now - self.failing_since >= self.settings.unreachable_s:
                    self.log(f"the service failed for {now - self.failing_since:.1f} s; the terminal decides")
                    return None
                pause = RETRY_PAUSE_S[min(self.failures, len(RETRY_PAUSE_S) - 1)]
                self.failures += 1
                self.sleep(max(0.0, min(pause, self.failing_since + self.settings.unreachable_s - now)))
                continue
            self.failing_since, self.failures = None, 0
            return answer

    def create(self, body: dict) -> dict | None:
        """``POST /api/approvals/`` (idempotent on the key: a retry makes no second row)."""
        return self.call("POST", "/api/approvals/", body)

    def wait(self, approval: dict) -> dict | None:
        """Long-poll the approval until it is no longer pending; returns it, or None when
        the wait is over or the service stayed unreachable."""
        path = f"/api/approvals/{approval['id']}/"
        while approval.get("state") == "pending":
            remaining = self.deadline - self.clock()
            if remaining <= 0:
                self.log(f"approval {approval['id']}: no answer within {self.settings.wait_s:g} s; the terminal decides")
                return None
            wait_s = max(0.0, min(self.settings.poll_s, remaining))
            asked_at = self.clock()
            answer = self.call("GET", f"{path}?wait={_seconds(wait_s)}", None, wait_s)
            if answer is None:
                return None
            approval = answer
            if approval.get("state") == "pending" and self.clock() - asked_at < wait_s / 2:
                # Answered early while still pending (the server is stopping, or holds no
                # long-poll): look again shortly, never in a tight loop.
                self.sleep(max(0.0, min(EARLY_PAUSE_S, self.deadline - self.clock())))
        return approval


def _seconds(value: float) -> str:
    """Seconds as a query value: up to 3 decimals, no trailing zeros (``25``, ``0.5``)."""
    return f"{value:.3f}".rstrip("0").rstrip(".")


def remember(state_dir: Path, session_key: str, approval_id: str) -> None:
    """Q4: the session's next tool, permission, stop, end or prompt hook resolves this approval
    ``answered_in_terminal`` unless the hook that asked forgets it first."""
    with store.Outbox(state_dir) as outbox, outbox.transaction():
        state = outbox.session_state(session_key)
        ids = [i for i in state.get("approvals", []) if i != approval_id]
        state["approvals"] = ids + [approval_id]
        outbox.save_session_state(session_key, state)


def forget(state_dir: Path, session_key: str, approval_id: str) -> None:
    """The asking hook knows how its approval ended: nothing is left for Q4 to resolve."""
    with store.Outbox(state_dir) as outbox, outbox.transaction():
        state = outbox.session_state(session_key)
        ids = state.get("approvals", [])
        if approval_id in ids:
            state["approvals"] = [i for i in ids if i != approval_id]
            if not state["approvals"]:
                state.pop("approvals")
            outbox.save_session_state(session_key, state)


def ask_and_wait(state_dir: Path, *, session_key: str, body: dict, payload: dict, env=os.environ,
                 agent: str = "claude") -> str | None:
    """Q3 for one prepared request (``prepare``): the hook's stdout, or None to print
    nothing. Never raises for what the network or the service does."""
    config = store.read_config(state_dir)
    server, token = config.get("server"), config.get("token")
    if not server or not token:
        store.log_line(state_dir, store.HOOK_LOG, f"{agent}: PermissionRequest: no server or token configured "
                                                  "(run manage.py install_hooks); the terminal decides")
        return None
    asker = Asker(state_dir, server=server, token=token, settings=load_settings(config, env), session_key=session_key,
                  agent=agent)
    try:
        approval = asker.create(body)
        if approval is None or not isinstance(approval.get("id"), str):
            return None
        remember(state_dir, session_key, approval["id"])
        final = asker.wait(approval)
    except Refused as error:
        asker.log(f"{error}; the terminal decides")
        return None
    if final is None:
        # Gave up while it is pending on the service: the terminal decides now, and the
        # session's next hook tells the service so (Q4).
        return None
    forget(state_dir, session_key, approval["id"])
    if final.get("state") in QUIET:
        asker.log(f"approval {approval['id']}: {final.get('state')}; the terminal decides")
    return decision_output(final, payload, agent)
