"""Tolerant parsers of agent CLI output streams (SPEC G2, G3, G4).

One parser per stream format, fed the agent's output as it arrives (bytes in any
chunking, or whole lines). A line that is not JSON, or JSON of no known shape, is kept
as plain output (counted, its text available to the tail) and never fails anything:
``feed`` never raises on input. Memory is bounded whatever the stream's length: a line
longer than ``MAX_LINE_BYTES`` is skipped up to its newline, no event is stored, and
every kept text is capped (``MESSAGE_BYTES``).

What a parser keeps (``facts()``), the shapes of H's Task JSON:

- ``agent_session_id``: the agent's own session / thread id (str or None);
- ``agent_result``: ``{"is_error": bool, "subtype": str, "summary": str}`` or None when
  the agent never said how it ended;
- ``usage``: ``{"turns", "tool_calls", "input_tokens", "output_tokens", "cost_usd"}``,
  each None where the CLI does not report it, or None when nothing was recognised;
- ``last_message``: the last assistant message, at most 4 KiB of UTF-8 (its head).

``version`` increases whenever one of these changes (G4 sends progress only on change).

Token counts: ``input_tokens`` counts every input token the model read, cached or not
(Claude and opencode report cache reads/writes apart from ``input_tokens``; Codex and
Gemini report cached tokens as a part of it), so the figure means the same for every CLI.
"""
from __future__ import annotations

import json
import re

MAX_LINE_BYTES = 1 << 20
MESSAGE_BYTES = 4096


def cap(text: str, limit: int = MESSAGE_BYTES) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, never inside a character."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


def _int(value) -> int | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return int(value)


def _num(value) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def _dict(value) -> dict:
    return value if isinstance(value, dict) else {}


class TextParser:
    """Plain output (profiles without a stream format): nothing structured is kept."""

    name = "text"
    cost_reported = False
    tools_reported = False

    def __init__(self) -> None:
        self._buffer = bytearray()
        self._skipping = False
        self.lines = 0
        self.text_lines = 0
        self.unknown_events = 0
        self.version = 0
        self.agent_session_id: str | None = None
        self.result: dict | None = None
        self.last_message: str | None = None
        self.turns = 0
        self.tool_calls = 0
        self.input_tokens: int | None = None
        self.output_tokens: int | None = None
        self.cost_usd: float | None = None
        self.recognised = False

    # --- input -------------------------------------------------------------------------

    def feed(self, data: bytes) -> None:
        """Any chunk of the stream; complete lines are parsed at once, a partial one waits."""
        start = 0
        while True:
            nl = data.find(b"\n", start)
            if nl == -1:
                rest = data[start:]
                if self._skipping:
                    return
                if len(self._buffer) + len(rest) > MAX_LINE_BYTES:
                    self._overlong()
                    return
                self._buffer += rest
                return
            piece = data[start:nl]
            start = nl + 1
            if self._skipping:
                self._skipping = False
                continue
            if len(self._buffer) + len(piece) > MAX_LINE_BYTES:
                self._overlong()
                self._skipping = False
                continue
            if self._buffer:
                self._buffer += piece
                line, self._buffer = bytes(self._buffer), bytearray()
            else:
                line = piece
            self.feed_line(line.decode("utf-8", errors="replace"))

    def close(self) -> None:
        """The stream ended: a last line without a newline (often truncated) is parsed too."""
        if self._buffer and not self._skipping:
            line, self._buffer = bytes(self._buffer), bytearray()
            self.feed_line(line.decode("utf-8", errors="replace"))
        self._buffer = bytearray()
        self._skipping = False

    def _overlong(self) -> None:
        self._buffer = bytearray()
        self._skipping = True
        self.lines += 1
        self.text_lines += 1

    def feed_line(self, line: str) -> None:
        """One line of output (without its newline). Never raises on content."""
        self.lines += 1
        stripped = line.strip()
        event = None
        if stripped.startswith("{"):
            try:
                event = json.loads(stripped)
            except ValueError:
                event = None
        before = self._snapshot()
        try:
            known = isinstance(event, dict) and self.on_event(event)
        except Exception:  # a shape we did not foresee: plain output, never a failure
            known = False
        if isinstance(event, dict):
            if known:
                self.recognised = True
            else:
                self.unknown_events += 1
        else:
            self.text_lines += 1
            if stripped:
                self.on_text(stripped)
        if self._snapshot() != before:
            self.version += 1

    # --- per format ----------------------------------------------------------------------

    def on_event(self, event: dict) -> bool:
        """Handle one JSON object; False when it is of no known shape."""
        return False

    def on_text(self, line: str) -> None:
        """A non-JSON line."""

    # --- output ------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        result = tuple(sorted(self.result.items())) if self.result else None
        return (self.agent_session_id, result, self.last_message, self.turns, self.tool_calls,
                self.input_tokens, self.output_tokens, self.cost_usd, self.recognised)

    def set_message(self, text: str) -> None:
        self.last_message = cap(text)

    def append_message(self, text: str) -> None:
        current = self.last_message or ""
        if len(current.encode("utf-8")) >= MESSAGE_BYTES:
            return
        self.last_message = cap(current + text)

    def set_result(self, *, is_error: bool, subtype: str, summary: str | None) -> None:
        self.result = {"is_error": bool(is_error), "subtype": str(subtype)[:100], "summary": cap(summary or "")}

    def usage(self) -> dict | None:
        if not self.recognised:
            return None
        return {
            "turns": self.turns,
            "tool_calls": self.tool_calls if self.tools_reported else None,
            "input_tokens": self.input_tokens,
            "output_tokens": self.output_tokens,
            "cost_usd": round(self.cost_usd, 6) if self.cost_usd is not None else None,
        }

    def facts(self) -> dict:
        """G3: what the final facts carry (module docstring for the shapes)."""
        return {
            "agent_session_id": self.agent_session_id,
            "agent_result": dict(self.result) if self.result else None,
            "usage": self.usage(),
            "last_message": self.last_message,
        }

    def progress(self) -> dict:
        """G4: ``{"last_message", "usage"}`` for a progress post."""
        return {"last_message": self.last_message, "usage": self.usage()}

    def _add_tokens(self, input_tokens: int | None, output_tokens: int | None) -> None:
        if input_tokens is not None:
            self.input_tokens = (self.input_tokens or 0) + input_tokens
        if output_tokens is not None:
            self.output_tokens = (self.output_tokens or 0) + output_tokens


def _claude_input(usage: dict) -> int | None:
    parts = [_int(usage.get(k)) for k in ("input_tokens", "cache_creation_input_tokens", "cache_read_input_tokens")]
    if all(p is None for p in parts):
        return None
    return sum(p for p in parts if p is not None)


class ClaudeParser(TextParser):
    """Claude Code ``--output-format stream-json --verbose``: ``system/init`` (session id),
    ``assistant`` messages (text and ``tool_use`` blocks; one event per block, sharing the
    message id), ``user`` tool results, and a final ``result`` (``subtype``, ``is_error``,
    ``num_turns``, ``total_cost_usd``, ``usage``, ``result``)."""

    name = "claude"
    cost_reported = True
    tools_reported = True

    def __init__(self) -> None:
        super().__init__()
        self._message_id = None
        self._tool_ids: set[str] = set()

    def on_event(self, event: dict) -> bool:
        kind = event.get("type")
        session = event.get("session_id")
        if isinstance(session, str) and session and kind in ("system", "assistant", "user", "result"):
            self.agent_session_id = session
        if kind == "system":
            return True
        if kind == "assistant":
            message = event.get("message")
            if not isinstance(message, dict):
                return False
            message_id = message.get("id")
            new_message = message_id is None or message_id != self._message_id
            if new_message:
                self._message_id = message_id
                self._tool_ids.clear()
                self.turns += 1
                usage = _dict(message.get("usage"))
                self._add_tokens(_claude_input(usage), _int(usage.get("output_tokens")))
            texts = []
            for block in message.get("content") or []:
                block = _dict(block)
                if block.get("type") == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                elif block.get("type") in ("tool_use", "server_tool_use", "mcp_tool_use"):
                    tool_id = block.get("id")
                    if tool_id is None or tool_id not in self._tool_ids:
                        self.tool_calls += 1
                        if isinstance(tool_id, str) and len(self._tool_ids) < 1000:
                            self._tool_ids.add(tool_id)
            if texts:
                if new_message or self.last_message is None:
                    self.set_message("".join(texts))
                else:
                    self.append_message("".join(texts))
            return True
        if kind == "user":
            return True
        if kind == "result":
            is_error = bool(event.get("is_error"))
            subtype = event.get("subtype") if isinstance(event.get("subtype"), str) else ("error" if is_error else "success")
            if is_error and subtype == "success":
                # Seen with an API error: subtype "success" and is_error true. Name the cause.
                terminal = event.get("terminal_reason")
                subtype = terminal if isinstance(terminal, str) and terminal else "error"
            summary = event.get("result")
            if not isinstance(summary, str) or not summary:
                errors = event.get("errors")
                summary = "; ".join(str(e) for e in errors[:5]) if isinstance(errors, list) else ""
            self.set_result(is_error=is_error, subtype=subtype, summary=summary)
            turns = _int(event.get("num_turns"))
            if turns is not None:
                self.turns = turns
            cost = _num(event.get("total_cost_usd"))
            if cost is not None:
                self.cost_usd = cost
            usage = _dict(event.get("usage"))
            if usage:
                total_in = _claude_input(usage)
                if total_in is not None:
                    self.input_tokens = total_in
                out = _int(usage.get("output_tokens"))
                if out is not None:
                    self.output_tokens = out
            return True
        return kind == "stream_event"


CODEX_TOOL_ITEMS = {"command_execution", "file_change", "mcp_tool_call", "web_search", "local_shell_call",
                    "function_call", "custom_tool_call"}


class CodexParser(TextParser):
    """Codex ``exec --json``: ``thread.started{thread_id}``, ``turn.started``,
    ``turn.completed{usage}``, ``turn.failed{error}``, ``item.started|updated|completed``
    (``agent_message`` text, tool items), ``error{message}``. Codex has no final result
    event: the last turn's ending is the result."""

    name = "codex"
    tools_reported = True

    def __init__(self) -> None:
        super().__init__()
        self._tool_ids: set[str] = set()

    def on_event(self, event: dict) -> bool:
        kind = event.get("type")
        if kind == "thread.started":
            if isinstance(event.get("thread_id"), str):
                self.agent_session_id = event["thread_id"]
            return True
        if kind == "turn.started":
            self.turns += 1
            return True
        if kind == "turn.completed":
            usage = _dict(event.get("usage"))
            self._add_tokens(_int(usage.get("input_tokens")), _int(usage.get("output_tokens")))
            self.set_result(is_error=False, subtype="completed", summary=self.last_message)
            return True
        if kind == "turn.failed":
            error = _dict(event.get("error"))
            self.set_result(is_error=True, subtype="turn_failed", summary=str(error.get("message") or ""))
            return True
        if kind == "error":
            return True  # transient (retries, reconnects); a fatal one ends with turn.failed
        if kind in ("item.started", "item.updated", "item.completed"):
            item = _dict(event.get("item"))
            item_type = item.get("type") or item.get("item_type")
            if item_type in ("agent_message", "assistant_message"):
                if kind == "item.completed" and isinstance(item.get("text"), str):
                    self.set_message(item["text"])
            elif item_type in CODEX_TOOL_ITEMS:
                item_id = item.get("id")
                if item_id is None:
                    if kind == "item.completed":
                        self.tool_calls += 1
                elif item_id not in self._tool_ids:
                    self.tool_calls += 1
                    if len(self._tool_ids) < 10000:
                        self._tool_ids.add(item_id)
            return True
        return False


class GeminiParser(TextParser):
    """Gemini CLI ``--output-format stream-json``: ``init{session_id, model}``,
    ``message{role, content, delta?}``, ``tool_use``, ``tool_result``, ``error`` (non-fatal)
    and ``result{status, error?, stats{input_tokens, output_tokens, tool_calls, ...}}``
    (google-gemini/gemini-cli packages/core/src/output/types.ts)."""

    name = "gemini"
    tools_reported = True

    def __init__(self) -> None:
        super().__init__()
        self._in_reply = False

    def on_event(self, event: dict) -> bool:
        kind = event.get("type")
        if kind == "init":
            if isinstance(event.get("session_id"), str):
                self.agent_session_id = event["session_id"]
            return True
        if kind == "message":
            content = event.get("content")
            if event.get("role") == "assistant" and isinstance(content, str):
                if not self._in_reply:
                    self.turns += 1
                    self.set_message(content)
                    self._in_reply = True
                elif event.get("delta"):
                    self.append_message(content)
                else:
                    self.set_message(content)
            else:
                self._in_reply = False
            return True
        if kind in ("tool_use", "tool_result", "error"):
            self._in_reply = False
            if kind == "tool_use":
                self.tool_calls += 1
            return True
        if kind == "result":
            self._in_reply = False
            stats = _dict(event.get("stats"))
            if stats:
                self.input_tokens = _int(stats.get("input_tokens"))
                self.output_tokens = _int(stats.get("output_tokens"))
                tools = _int(stats.get("tool_calls"))
                if tools is not None:
                    self.tool_calls = tools
            status = event.get("status")
            error = _dict(event.get("error"))
            is_error = status == "error" or bool(error)
            subtype = str(error.get("type") or status or ("error" if is_error else "success"))
            summary = str(error.get("message") or "") if is_error else (self.last_message or "")
            self.set_result(is_error=is_error, subtype=subtype, summary=summary)
            return True
        return False


class OpencodeParser(TextParser):
    """opencode ``run --format json``: every event ``{type, timestamp, sessionID, ...}``;
    ``step_start``, ``text{part.text}``, ``tool_use{part.tool, part.state}``,
    ``step_finish{part.reason, part.cost, part.tokens{input, output, reasoning,
    cache{read, write}}}``, ``reasoning``, ``error{error{name, data.message}}``
    (sst/opencode packages/opencode/src/cli/cmd/run.ts)."""

    name = "opencode"
    cost_reported = True
    tools_reported = True

    def on_event(self, event: dict) -> bool:
        kind = event.get("type")
        if kind not in ("step_start", "step_finish", "text", "tool_use", "reasoning", "error"):
            return False
        if isinstance(event.get("sessionID"), str):
            self.agent_session_id = event["sessionID"]
        part = _dict(event.get("part"))
        if kind == "step_start":
            self.turns += 1
        elif kind == "text" and isinstance(part.get("text"), str):
            self.set_message(part["text"])
        elif kind == "tool_use":
            self.tool_calls += 1
        elif kind == "step_finish":
            tokens = _dict(part.get("tokens"))
            cache = _dict(tokens.get("cache"))
            ins = [_int(tokens.get("input")), _int(cache.get("read")), _int(cache.get("write"))]
            outs = [_int(tokens.get("output")), _int(tokens.get("reasoning"))]
            self._add_tokens(None if all(v is None for v in ins) else sum(v or 0 for v in ins),
                             None if all(v is None for v in outs) else sum(v or 0 for v in outs))
            cost = _num(part.get("cost"))
            if cost is not None:
                self.cost_usd = (self.cost_usd or 0.0) + cost
            reason = part.get("reason")
            if reason not in ("tool-calls", "tool_calls") and not (self.result and self.result["is_error"]):
                self.set_result(is_error=False, subtype=str(reason or "stop"), summary=self.last_message)
        elif kind == "error":
            error = _dict(event.get("error"))
            data = _dict(error.get("data"))
            self.set_result(is_error=True, subtype=str(error.get("name") or "error"),
                            summary=str(data.get("message") or error.get("message") or ""))
        return True


_AIDER_TOKENS = re.compile(r"^Tokens:\s+(?P<sent>[\d.,]+)(?P<su>[kKmM]?) sent\b.*?(?P<recv>[\d.,]+)(?P<ru>[kKmM]?) received\.")
_AIDER_COST = re.compile(r"Cost:\s+\$(?P<msg>[\d.,]+) message,\s+\$(?P<session>[\d.,]+) session")
_SCALE = {"": 1, "k": 1_000, "m": 1_000_000}


def _aider_count(number: str, unit: str) -> int:
    return int(round(float(number.replace(",", "")) * _SCALE[unit.lower()]))


class AiderParser(TextParser):
    """aider prints plain text; after each model reply a line like ``Tokens: 12k sent,
    1.2k received. Cost: $0.04 message, $0.09 session.`` That line gives turns, tokens
    and cost; the last other non-empty line is the last message. No session id, no
    tool calls, no verdict: aider's exit status judges."""

    name = "aider"
    cost_reported = True

    def on_text(self, line: str) -> None:
        match = _AIDER_TOKENS.match(line)
        if not match:
            self.set_message(line)
            return
        self.recognised = True
        self.turns += 1
        self._add_tokens(_aider_count(match["sent"], match["su"]), _aider_count(match["recv"], match["ru"]))
        cost = _AIDER_COST.search(line)
        if cost:
            self.cost_usd = float(cost["session"].replace(",", ""))


PARSERS = {
    "text": TextParser,
    "claude": ClaudeParser,
    "codex": CodexParser,
    "gemini": GeminiParser,
    "opencode": OpencodeParser,
    "aider": AiderParser,
}


def make_parser(name: str) -> TextParser:
    """A fresh parser for ``name`` (a key of ``PARSERS``; unknown -> plain text)."""
    return PARSERS.get(name, TextParser)()
