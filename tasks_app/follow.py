"""Following a task from a terminal (``manage.py submit_task --follow``; SPEC B2, B4, G4, H).

``Follower`` is an API client of the service, as any terminal client would be (httpx for
``GET /api/tasks/{id}/`` and ``GET /api/tasks/{id}/entries/?after=N``, the owner's board
socket ``/ws/board/`` with ``Authorization: Token``): it prints the task's state changes
and its transcript lines as they arrive, and ends when the task is final or ``unknown``.

- Events are best effort (B2): on every (re)connect, and every ``recheck_s`` as a safety
  net, it re-reads the task and the transcript after the last entry it printed (B4), so a
  lost event delays a line, never loses it. Entries print once each, in number order.
- On a terminal (``tty``) a spinner line with the state, usage and elapsed time stays at
  the bottom and is redrawn in place; when piped, plain lines only, no control characters.
  Whatever the agent or the owner wrote (prompts, messages, tool output, reasons) is
  printed through ``printable`` either way: no escape sequence, C0 or C1 control
  character but newline and tab, DEL or bidi control of theirs reaches the terminal or the
  pipe (a prompt's ``ESC ]0;TITLE BEL`` would retitle a terminal, a U+202E reverse what
  follows); the spinner's own CR ``ESC [2K`` is the only control output, and only on a tty.
- ``json_mode``: one JSON object a line instead: ``{"type": "state", "state", "reason"}``,
  ``{"type": "entry", ...entry}``, and last ``{"type": "final", "task": {...}}``; the data
  is kept whole, with every control character (DEL and the bidi controls too) escaped as
  ``\\uXXXX``.
- ``run()`` returns the exit status: 0 for ``succeeded``, 1 for any other final state,
  2 for ``unknown`` (the service does not know what happened: it never guesses, U).
"""
from __future__ import annotations

import json
import re
import time
from collections.abc import Callable

import httpx
from websockets.exceptions import WebSocketException
from websockets.sync.client import connect

from core.text import CONTROL  # what may not reach a terminal (C0 but tab and newline, DEL, C1, bidi)
from machine.protocol import Backoff

FINAL_STATES = frozenset({"succeeded", "failed", "failed_lease_lost", "cancelled", "not_started", "abandoned"})
RECHECK_S = 5.0  # the safety re-read while events flow (B4's net, shorter: a person is watching)
TICK_S = 0.1  # the spinner's frame and how often the socket is looked at
RECONNECT_BASE_S = 0.5
SPINNER = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
LINE_MAX = 2000  # characters of one printed entry (entries are at most 2 KiB anyway)

# ECMA-48 sequences as terminals read them: CSI (ESC [ ... final byte), OSC, DCS, SOS, PM
# and APC strings (up to BEL or ST), and the two-byte ESC sequences.
ESCAPE_SEQUENCE = re.compile(r"\x1b\[[0-?]*[ -/]*[@-~]?|\x1b[\]PX^_][^\x07\x1b]*(?:\x07|\x1b\\)?|\x1b[ -~]?")


def printable(text: str) -> str:
    """``text`` with every escape sequence and control character removed (module
    docstring), newlines and tabs kept; a CR LF becomes a newline."""
    return CONTROL.sub("", ESCAPE_SEQUENCE.sub("", text.replace("\r\n", "\n")))


def json_line(obj) -> str:
    """``obj`` as one JSON line, non-ASCII text kept readable but every control character
    escaped (``json.dumps`` leaves DEL, C1 and the bidi controls raw)."""
    return CONTROL.sub(lambda m: f"\\u{ord(m.group()):04x}", json.dumps(obj, ensure_ascii=False))


def usage_text(usage: dict | None) -> str:
    """"3 turns · 2 tool calls · 12000 in / 450 out · $0.0123" (what is known of it)."""
    if not usage:
        return ""
    parts = []
    for key, word in (("turns", "turn"), ("tool_calls", "tool call")):
        if usage.get(key) is not None:
            parts.append(f"{usage[key]} {word}{'' if usage[key] == 1 else 's'}")
    if usage.get("input_tokens") is not None or usage.get("output_tokens") is not None:
        parts.append(f"{usage.get('input_tokens') if usage.get('input_tokens') is not None else '?'} in / "
                     f"{usage.get('output_tokens') if usage.get('output_tokens') is not None else '?'} out")
    if usage.get("cost_usd") is not None:
        parts.append(f"${usage['cost_usd']:.4f}")
    return " · ".join(parts)


def entry_lines(entry: dict) -> list[str]:
    """How one transcript entry reads in a terminal (G4): the prompt after ``>``, a message
    as its lines, a tool call on one line after ``$``, its result as ``↳ ok`` or
    ``↳ error: <first line>``, an error after ``!``."""
    text = printable((entry.get("text") or "")[:LINE_MAX])  # a CR inside a line neither splits nor returns it
    kind = entry.get("kind")
    if kind == "prompt":
        return [f"> {line}" for line in text.splitlines() or [""]]
    if kind == "tool_call":
        return [f"$ {entry.get('tool') or 'tool'}: {' '.join(text.split())}"]
    if kind == "tool_result":
        first = next((line.strip() for line in text.splitlines() if line.strip()), "")
        status = entry.get("status") or "done"
        return [f"  ↳ {status}" + (f": {first[:200]}" if status == "error" and first else "")]
    if kind == "error":
        return [f"! error: {line}" for line in text.splitlines() or [""]]
    return text.splitlines() or [""]


def exit_status(state: str) -> int:
    """0 succeeded, 2 unknown, 1 any other final state."""
    return 0 if state == "succeeded" else 2 if state == "unknown" else 1


class Follower:
    """Follows ``task`` (the task JSON that accepted it) on ``server`` with owner
    ``token`` (see the module docstring); ``write(text)`` receives every piece of output."""

    def __init__(self, *, server: str, token: str, task: dict, write: Callable[[str], None], tty: bool = False,
                 json_mode: bool = False, recheck_s: float = RECHECK_S, monotonic=time.monotonic):
        self.server = server.rstrip("/")
        self.token = token
        self.task_id = task["id"]
        self.write = write
        self.tty = tty and not json_mode
        self.json_mode = json_mode
        self.recheck_s = recheck_s
        self.monotonic = monotonic
        self.http = httpx.Client(base_url=self.server, headers={"Authorization": f"Token {token}"}, timeout=15)
        self.state: str | None = None
        self.version = 0
        self.task: dict = {}
        self.usage: dict | None = None
        self.last_n = 0
        self.started = monotonic()
        self.frame = 0
        self.status_shown = False
        self.on_task(task)  # the answer that accepted it: its first state prints at once

    # --- output ------------------------------------------------------------------------

    def _emit(self, lines: list[str]) -> None:
        if self.status_shown:
            self.write("\r\x1b[2K")
            self.status_shown = False
        for line in lines:
            self.write(printable(line) + "\n")

    def _json(self, obj: dict) -> None:
        self.write(json_line(obj) + "\n")

    def _spin(self) -> None:
        if not self.tty:
            return
        self.frame = (self.frame + 1) % len(SPINNER)
        parts = [self.state or "…", usage_text(self.usage), f"{int(self.monotonic() - self.started)}s"]
        self.write("\r\x1b[2K" + SPINNER[self.frame] + " " + printable(" · ".join(p for p in parts if p)))
        self.status_shown = True

    # --- what arrives ------------------------------------------------------------------

    def on_task(self, task: dict) -> None:
        if task.get("id") != self.task_id or task.get("version", 0) <= self.version:
            return
        self.version = task["version"]
        self.task = task
        if task.get("usage"):
            self.usage = task["usage"]
        if task["state"] != self.state:
            self.state = task["state"]
            reason = task.get("state_reason") or ""
            if task["state"] == "queued" and task.get("queued_behind"):
                reason = reason or f"will run after {task['queued_behind']}"
            if self.json_mode:
                self._json({"type": "state", "state": task["state"], "reason": reason})
            else:
                self._emit([f"[{task['state']}]" + (f" {reason}" if reason else "")])

    def on_entries(self, entries: list[dict]) -> None:
        for entry in sorted(entries, key=lambda e: e["n"]):
            if entry["n"] <= self.last_n:
                continue
            self.last_n = entry["n"]
            if self.json_mode:
                self._json({"type": "entry", **entry})
            else:
                self._emit(entry_lines(entry))

    def on_event(self, event: dict) -> None:
        if event.get("type") == "task":
            self.on_task(event.get("task") or {})
        elif event.get("type") == "task.progress" and event.get("task_id") == self.task_id:
            progress = event.get("progress") or {}
            if progress.get("usage"):
                self.usage = progress["usage"]
            entries = progress.get("entries") or []
            if entries and entries[0]["n"] > self.last_n + 1:
                self.sync_entries()  # a lost event: read the gap first
            self.on_entries(entries)

    def sync(self) -> None:
        """Re-read the task and the transcript after the last printed entry (B4)."""
        response = self.http.get(f"/api/tasks/{self.task_id}/")
        response.raise_for_status()
        self.sync_entries()
        self.on_task(response.json())

    def sync_entries(self) -> None:
        url = f"/api/tasks/{self.task_id}/entries/?after={self.last_n}"
        while url:
            page = self.http.get(url)
            page.raise_for_status()
            body = page.json()
            self.on_entries(body["results"])
            url = body["next"]

    # --- the loop ----------------------------------------------------------------------

    def done(self) -> bool:
        return self.state in FINAL_STATES or self.state == "unknown"

    def finish(self) -> int:
        self.sync_entries()  # the final receipt brings the transcript's last entries
        task = self.task
        if self.json_mode:
            self._json({"type": "final", "task": task})
        else:
            facts = [f"exit code {task['exit_code']}" if task.get("exit_code") is not None else "",
                     f"signal {task['signal']}" if task.get("signal") is not None else "",
                     usage_text(task.get("usage"))]
            lines = ["result: " + (" · ".join(f for f in facts if f) or self.state)]
            result = task.get("agent_result")
            if result and result.get("summary"):
                lines.append(("agent error: " if result.get("is_error") else "agent: ") + result["summary"][:LINE_MAX])
            if self.state == "unknown":
                lines.append("outcome unknown: the service will not guess; decide on the task page")
            self._emit(lines)
        return exit_status(self.state)

    def run(self) -> int:
        """Follow until the task is final or unknown; returns the exit status."""
        url = self.server.replace("https://", "wss://").replace("http://", "ws://") + "/ws/board/"
        backoff, attempt = Backoff(RECONNECT_BASE_S, cap_s=10.0), 0
        try:
            while True:
                try:
                    with connect(url, additional_headers={"Authorization": f"Token {self.token}"},
                                 open_timeout=10) as socket:
                        attempt = 0
                        self.sync()  # after connecting: nothing sent before is missed
                        checked = self.monotonic()
                        while not self.done():
                            try:
                                self.on_event(json.loads(socket.recv(timeout=TICK_S)))
                            except TimeoutError:
                                self._spin()
                            except ValueError:
                                continue
                            if self.monotonic() - checked >= self.recheck_s:
                                self.sync()
                                checked = self.monotonic()
                        return self.finish()
                except (OSError, WebSocketException, httpx.HTTPError):
                    # The service or the network went away: read over HTTP when it can, retry the socket.
                    end = self.monotonic() + backoff.delay(attempt)
                    attempt += 1
                    try:
                        self.sync()
                    except httpx.HTTPError:
                        pass
                    if self.done():
                        return self.finish()
                    while self.monotonic() < end:
                        self._spin()
                        time.sleep(TICK_S)
        finally:
            if self.status_shown:
                self.write("\r\x1b[2K")
            self.http.close()
