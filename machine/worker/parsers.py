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

And the run as a person reads it (G4, B9), ``entries``: transcript entries ``{n, kind,
text, tool?, status?, call?, usage?, seq?}`` numbered from 1 (the prompt, when the parser
was given it), kinds ``prompt`` (a user turn), ``message`` (assistant text, line breaks
kept), ``tool_call`` (``tool`` and its command or path as ``text``), ``tool_result``
(``status`` ``ok``/``error``, the output as ``text``, ``call``: the ``n`` of its call)
and ``error``; a ``message`` or ``tool_call`` that opens a model turn carries that turn's
``usage`` ``{input_tokens, output_tokens}`` where the CLI reports it per turn. Each
``text`` is at most ``ENTRY_TEXT_MAX_BYTES`` of UTF-8 (cut ones end with
``ENTRY_CUT_MARK``), valid UTF-8 without NUL; the last ``ENTRIES_KEPT`` are held. The
numbering depends only on the stream, so re-parsing an output file (X3) numbers it alike.

A live conversation (C1) hands the parser each message in the order the agent is given
them (``turn_prompt(seq, text)``, at placement: before the agent can read it), and the
stream's own turn ends (``turn_ended``: Claude Code's ``result``) say where each turn
starts: the k-th message's ``prompt`` entry, with its ``seq``, comes right before the
first entry after the (k-1)-th turn end (or at the k-th turn end, for a turn that made
no entry). Given the same messages, a re-parse (X3) places them alike.

``version`` increases whenever one of these changes (G4 sends progress only on change).

Token counts: ``input_tokens`` counts every input token the model read, cached or not
(Claude and opencode report cache reads/writes apart from ``input_tokens``; Codex and
Gemini report cached tokens as a part of it), so the figure means the same for every CLI.
"""
from __future__ import annotations

import json
import re
from collections import deque

from machine.protocol import ENTRIES_KEPT, ENTRY_CUT_MARK, ENTRY_TEXT_MAX_BYTES, ENTRY_TOOL_MAX_CHARS

MAX_LINE_BYTES = 1 << 20
MESSAGE_BYTES = 4096


def cap(text: str, limit: int = MESSAGE_BYTES) -> str:
    """``text`` cut to at most ``limit`` bytes of UTF-8, never inside a character."""
    data = text.encode("utf-8", errors="replace")
    if len(data) <= limit:
        return text
    return data[:limit].decode("utf-8", errors="ignore")


CALLS_KEPT = 1000  # tool call ids remembered for pairing results with their calls
# Keys of a tool's input that name what it works on, in the order they are looked for.
TOOL_TEXT_KEYS = ("command", "cmd", "file_path", "filePath", "notebook_path", "path", "pattern", "url", "query",
                  "description", "prompt")


def entry_text(text: str) -> str:
    """G4: ``text`` as an entry carries it: valid UTF-8 (lone surrogates replaced), NUL
    shown as U+2400, at most ``ENTRY_TEXT_MAX_BYTES``; a cut one ends with the mark."""
    data = text.replace("\x00", "\u2400").encode("utf-8", errors="replace")
    if len(data) <= ENTRY_TEXT_MAX_BYTES:
        return data.decode("utf-8")
    mark = ENTRY_CUT_MARK.encode("utf-8")
    return data[:ENTRY_TEXT_MAX_BYTES - len(mark)].decode("utf-8", errors="ignore") + ENTRY_CUT_MARK


def tool_text(value) -> str:
    """What a tool call works on, for one line: its command, path, pattern, URL or query;
    else its input as compact JSON."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return " ".join(value)
    if isinstance(value, dict):
        for key in TOOL_TEXT_KEYS:
            found = value.get(key)
            if isinstance(found, str) and found:
                return found
            if isinstance(found, list) and found and all(isinstance(v, str) for v in found):
                return " ".join(found)
        return json.dumps(value, ensure_ascii=False, separators=(",", ":")) if value else ""
    return ""


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


def _plus(a: int | None, b: int | None) -> int | None:
    """A sum of counts where None is "not reported": None only when both are."""
    return b if a is None else a if b is None else a + b


class TextParser:
    """Plain output (profiles without a stream format): nothing structured is kept."""

    name = "text"
    cost_reported = False
    tools_reported = False
    structured = False  # a JSON-lines stream: it makes transcript entries (G4)

    def __init__(self, prompt: str | None = None) -> None:
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
        self.entries: deque[dict] = deque(maxlen=ENTRIES_KEPT)
        self.entry_n = 0
        self._pending: dict | None = None  # a message still growing (deltas) or awaiting its turn's usage
        self._turn_usage: dict | None = None  # usage of the model turn whose first entry is not out yet
        self._calls: dict = {}  # tool call id -> (n, tool), the last CALLS_KEPT
        self._turn_prompts: deque[tuple[int, str]] = deque()  # C1: messages given, prompt entry not yet out
        self._turns_opened = 0  # live-conversation turns whose prompt entry is out
        self._turns_ended = 0  # ... and that ended (``turn_ended``)
        if prompt:
            self.add_entry("prompt", prompt)

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
        before = self.entry_n
        self.flush_message()
        if self.entry_n != before:
            self.version += 1

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

    def feed_record(self, data: bytes) -> None:
        """The agent's own run record (JSON lines, a preset's ``record`` file), read when
        the agent ended; each JSON object goes to ``on_record``. Never raises on content."""
        before = self._snapshot()
        for line in data.decode("utf-8", errors="replace").splitlines():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                try:
                    self.on_record(event)
                except Exception:  # a shape we did not foresee: ignored, never a failure
                    pass
        self.on_record_end()
        if self._snapshot() != before:
            self.version += 1

    def on_record(self, event: dict) -> None:
        """One event of the run record (only parsers of CLIs that write one use it)."""

    def on_record_end(self) -> None:
        """The whole run record was read."""

    # --- output ------------------------------------------------------------------------

    def _snapshot(self) -> tuple:
        result = tuple(sorted(self.result.items())) if self.result else None
        return (self.agent_session_id, result, self.last_message, self.turns, self.tool_calls,
                self.input_tokens, self.output_tokens, self.cost_usd, self.recognised, self.entry_n)

    # --- transcript (G4) -----------------------------------------------------------------

    def turn_prompt(self, seq: int, text: str) -> None:
        """C1, G4: a live conversation's message ``seq`` is given to the agent after those
        handed before it; its ``prompt`` entry opens its turn (module docstring)."""
        self._turn_prompts.append((seq, text))

    def turn_ended(self) -> None:
        """The agent ended a turn of a live conversation (before the turn's own result
        entries): a turn that made no entry still shows its prompt."""
        self._open_turns()
        self._turns_ended += 1

    def _open_turns(self) -> None:
        """The prompt entries of the turns that have begun (the k-th once k-1 ended)."""
        while self._turn_prompts and self._turns_opened <= self._turns_ended:
            seq, text = self._turn_prompts.popleft()
            self._turns_opened += 1
            self.add_entry("prompt", text, seq=seq)

    def add_entry(self, kind: str, text: str, **fields) -> int | None:
        """Number and keep one entry (a pending message, then the prompt of a turn that
        has begun, go first); ``fields`` among ``tool``, ``status``, ``call``, ``usage``,
        ``seq`` (None values left out). A ``prompt`` repeating the entry just before it
        (a CLI echoing the prompt) is not kept twice. Returns the entry's ``n`` (None when
        skipped)."""
        self.flush_message()
        if "seq" not in fields:
            self._open_turns()
        text = entry_text(text if isinstance(text, str) else "")
        if kind == "prompt" and self.entries and self.entries[-1]["kind"] == "prompt" \
                and self.entries[-1]["text"] == text:
            return None
        if kind in ("message", "tool_call") and self._turn_usage is not None and fields.get("usage") is None:
            fields["usage"], self._turn_usage = self._turn_usage, None
        self.entry_n += 1
        entry = {"n": self.entry_n, "kind": kind, "text": text}
        for key, value in fields.items():
            if value is not None:
                entry[key] = entry_text(value)[:ENTRY_TOOL_MAX_CHARS] if key == "tool" else value
        self.entries.append(entry)
        return self.entry_n

    def message_part(self, text: str, *, mode: str = "new") -> None:
        """Assistant text that may grow (deltas) or wait for its turn's usage: kept
        pending until the next entry, ``flush_message`` or the end of the stream.
        ``mode``: ``new`` (a new message), ``append`` (a delta of the pending one) or
        ``replace`` (the pending one's whole text)."""
        if not isinstance(text, str):
            return
        if mode == "new":
            self.flush_message()
        if self._pending is None or mode == "replace":
            self._pending = {"text": ""}
        current = self._pending["text"]
        if len(current) <= ENTRY_TEXT_MAX_BYTES:  # beyond that it is cut anyway: memory stays bounded
            self._pending["text"] = current + text[:ENTRY_TEXT_MAX_BYTES + 1]

    def flush_message(self, usage: dict | None = None) -> None:
        """The pending message, if any, becomes an entry (with ``usage`` when given)."""
        pending, self._pending = self._pending, None
        if pending is not None and pending["text"]:
            self.add_entry("message", pending["text"], usage=usage)

    def turn_usage(self, input_tokens: int | None, output_tokens: int | None) -> None:
        """The usage of a model turn that starts now: the turn's first entry carries it."""
        if input_tokens is not None or output_tokens is not None:
            self._turn_usage = {"input_tokens": input_tokens, "output_tokens": output_tokens}

    def call_started(self, call_id, tool: str, text: str) -> int | None:
        """A ``tool_call`` entry; ``call_id`` (the CLI's id, may be None) pairs its result."""
        n = self.add_entry("tool_call", text, tool=tool or "tool")
        if isinstance(call_id, str) and n is not None:
            if len(self._calls) >= CALLS_KEPT:
                self._calls.pop(next(iter(self._calls)))
            self._calls[call_id] = (n, tool or "tool")
        return n

    def call_result(self, call_id, *, ok: bool, text: str, tool: str | None = None) -> None:
        """A ``tool_result`` entry for the call ``call_id`` (paired when it is known)."""
        n, known_tool = self._calls.pop(call_id, (None, None)) if isinstance(call_id, str) else (None, None)
        self.add_entry("tool_result", text, tool=tool or known_tool, status="ok" if ok else "error", call=n)

    def entries_since(self, n: int) -> list[dict]:
        """The kept entries numbered above ``n``, in order (copies)."""
        return [dict(e) for e in self.entries if e["n"] > n]

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
    structured = True
    cost_reported = True
    tools_reported = True

    def __init__(self, prompt: str | None = None) -> None:
        super().__init__(prompt)
        self._message_id = None
        self._tool_ids: set[str] = set()
        # G2 over every turn of a live conversation (C1): one ``result`` per turn, whose
        # ``num_turns`` and ``usage`` are that turn's alone (recorded with 2.1.328 in
        # tests/fixtures/claude_stream_input/), are added up; ``total_cost_usd`` already
        # counts the whole process, so the last one is the cost.
        self._ended = [0, None, None]  # turns, input, output tokens of the turns whose result was read
        self._running = [0, None, None]  # the same of the turn running now, from its assistant messages

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
                usage = _dict(message.get("usage"))
                self._running = [self._running[0] + 1, _plus(self._running[1], _claude_input(usage)),
                                 _plus(self._running[2], _int(usage.get("output_tokens")))]
                self._count_turns()
                self.turn_usage(_claude_input(usage), _int(usage.get("output_tokens")))
            texts, run = [], []
            for block in message.get("content") or []:
                block = _dict(block)
                if block.get("type") == "text" and isinstance(block.get("text"), str):
                    texts.append(block["text"])
                    run.append(block["text"])
                elif block.get("type") in ("tool_use", "server_tool_use", "mcp_tool_use"):
                    tool_id = block.get("id")
                    if tool_id is None or tool_id not in self._tool_ids:
                        self.tool_calls += 1
                        if isinstance(tool_id, str) and len(self._tool_ids) < 1000:
                            self._tool_ids.add(tool_id)
                        if run:
                            self.add_entry("message", "".join(run))
                            run = []
                        self.call_started(tool_id, str(block.get("name") or "tool"), tool_text(block.get("input")))
            if run:
                self.add_entry("message", "".join(run))
            if texts:
                if new_message or self.last_message is None:
                    self.set_message("".join(texts))
                else:
                    self.append_message("".join(texts))
            return True
        if kind == "user":
            self._claude_user(event)
            return True
        if kind == "result":
            self.turn_ended()
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
            if is_error:
                self.add_entry("error", summary or subtype)
            # The result's figures are the turn's own (where it gives them, else what its
            # assistant messages said); a later turn adds to them (G2).
            usage = _dict(event.get("usage"))
            turns, total_in, out = _int(event.get("num_turns")), _claude_input(usage), _int(usage.get("output_tokens"))
            running, self._running = self._running, [0, None, None]
            self._ended = [self._ended[0] + (turns if turns is not None else running[0]),
                           _plus(self._ended[1], total_in if total_in is not None else running[1]),
                           _plus(self._ended[2], out if out is not None else running[2])]
            self._count_turns()
            cost = _num(event.get("total_cost_usd"))
            if cost is not None:
                self.cost_usd = cost
            return True
        return kind == "stream_event"

    def _count_turns(self) -> None:
        self.turns = self._ended[0] + self._running[0]
        self.input_tokens = _plus(self._ended[1], self._running[1])
        self.output_tokens = _plus(self._ended[2], self._running[2])

    def _claude_user(self, event: dict) -> None:
        """Tool results (paired with their calls by ``tool_use_id``) and user text: a
        prompt (a resumed session's, a wake turn's); a sub-agent's prompt is left out."""
        content = _dict(event.get("message")).get("content")
        if isinstance(content, str):
            if not event.get("parent_tool_use_id"):
                self.add_entry("prompt", content)
            return
        for block in content if isinstance(content, list) else []:
            block = _dict(block)
            if block.get("type") == "tool_result":
                self.call_result(block.get("tool_use_id"), ok=not block.get("is_error"),
                                 text=_claude_result_text(block.get("content")))
            elif block.get("type") == "text" and isinstance(block.get("text"), str) \
                    and not event.get("parent_tool_use_id"):
                self.add_entry("prompt", block["text"])


def _claude_result_text(content) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content if isinstance(content, list) else []:
        block = _dict(block)
        if block.get("type") == "text" and isinstance(block.get("text"), str):
            parts.append(block["text"])
        elif block.get("type") == "image":
            parts.append("[image]")
    return "\n".join(parts)


CODEX_TOOL_ITEMS = {"command_execution", "file_change", "mcp_tool_call", "web_search", "local_shell_call",
                    "function_call", "custom_tool_call"}


class CodexParser(TextParser):
    """Codex ``exec --json``: ``thread.started{thread_id}``, ``turn.started``,
    ``turn.completed{usage}``, ``turn.failed{error}``, ``item.started|updated|completed``
    (``agent_message`` text, tool items, an ``error`` item for a warning), ``error{message}``
    (retries). Codex has no final result event: the last turn's ending is the result.
    ``usage`` is the thread's total so far: for a resumed thread it counts the earlier
    runs' tokens too (observed with 0.169.0)."""

    name = "codex"
    structured = True
    tools_reported = True

    def __init__(self, prompt: str | None = None) -> None:
        super().__init__(prompt)
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
            # The thread's running total (0.169.0: a resumed thread's first turn reports
            # the earlier turns too), so the last one stands rather than a sum.
            usage = _dict(event.get("usage"))
            self.input_tokens = _int(usage.get("input_tokens"))
            self.output_tokens = _int(usage.get("output_tokens"))
            self.set_result(is_error=False, subtype="completed", summary=self.last_message)
            self.flush_message(usage={"input_tokens": _int(usage.get("input_tokens")),
                                      "output_tokens": _int(usage.get("output_tokens"))} if usage else None)
            return True
        if kind == "turn.failed":
            error = _dict(event.get("error"))
            self.set_result(is_error=True, subtype="turn_failed", summary=str(error.get("message") or ""))
            self.add_entry("error", str(error.get("message") or "turn failed"))
            return True
        if kind == "error":
            # transient (retries, reconnects); a fatal one ends with turn.failed
            self.add_entry("error", str(event.get("message") or "error"))
            return True
        if kind in ("item.started", "item.updated", "item.completed"):
            item = _dict(event.get("item"))
            item_type = item.get("type") or item.get("item_type")
            if item_type in ("agent_message", "assistant_message"):
                if kind == "item.completed" and isinstance(item.get("text"), str):
                    self.set_message(item["text"])
                    self.message_part(item["text"])  # its turn's usage comes with turn.completed
            elif item_type in CODEX_TOOL_ITEMS:
                item_id = item.get("id")
                if item_id is None:
                    if kind == "item.completed":
                        self.tool_calls += 1
                elif item_id not in self._tool_ids:
                    self.tool_calls += 1
                    if len(self._tool_ids) < 10000:
                        self._tool_ids.add(item_id)
                self._codex_tool(kind, item_type, item)
            elif item_type == "error" and kind == "item.completed":
                self.add_entry("error", str(item.get("message") or "error"))
            return True
        return False

    def _codex_tool(self, kind: str, item_type: str, item: dict) -> None:
        item_id = item.get("id")
        started = isinstance(item_id, str) and item_id in self._calls
        if kind == "item.updated" or (kind == "item.started" and started):
            return
        if not started:
            tool, text = _codex_call(item_type, item)
            self.call_started(item_id, tool, text)
        if kind != "item.completed":
            return
        status = item.get("status")
        if item_type in ("command_execution", "local_shell_call"):
            code = item.get("exit_code")
            ok = status not in ("failed", "declined") and (code is None or code == 0)
            output = item.get("aggregated_output")
        else:
            ok = status not in ("failed", "declined", "error")
            output = item.get("result") if item.get("result") is not None else item.get("error")
        if output is not None and not isinstance(output, str):
            output = json.dumps(output, ensure_ascii=False, separators=(",", ":"))
        self.call_result(item_id, ok=ok, text=output or "")


def _codex_call(item_type: str, item: dict) -> tuple[str, str]:
    """(tool, what it works on) of a Codex tool item."""
    if item_type in ("command_execution", "local_shell_call"):
        return "shell", tool_text(item.get("command") or _dict(item.get("action")).get("command"))
    if item_type == "file_change":
        changes = [_dict(c) for c in item.get("changes") or [] if isinstance(c, dict)]
        return "edit", ", ".join(f"{c.get('kind') or 'change'} {c.get('path') or '?'}" for c in changes[:20])
    if item_type == "mcp_tool_call":
        name = ".".join(str(p) for p in (item.get("server"), item.get("tool")) if p)
        return name or "mcp", tool_text(item.get("arguments"))
    if item_type == "web_search":
        return "web_search", tool_text(item.get("query"))
    return str(item.get("name") or item_type), tool_text(item.get("arguments") or item.get("input"))


class CodexAppServerParser(TextParser):
    """Codex ``app-server`` on stdio (a live conversation, C11; docs/codex-app-server.md):
    JSON-RPC lines. The thread's id from the ``thread/start`` answer or ``thread/started``;
    ``turn/started`` counts a turn; ``item/completed`` of an ``agentMessage`` is assistant
    text, ``commandExecution`` / ``fileChange`` / other tool items are tool calls (their
    ``item/started`` opens the call); ``thread/tokenUsage/updated`` carries the thread's
    running ``total`` (it stands, not a sum) and the model request's ``last`` (the pending
    message's usage); ``turn/completed`` ends a turn (``turn_ended``) and is the verdict so
    far: ``completed`` -> success, ``interrupted`` (C4) -> no error, ``failed`` -> error with
    ``turn.error.message``; ``error`` notifications are error entries. No cost is reported.
    The user's messages are the conversation's (``turn_prompt``), not read from the stream."""

    name = "codex_app_server"
    structured = True
    tools_reported = True

    def on_event(self, event: dict) -> bool:
        method, params = event.get("method"), _dict(event.get("params"))
        if method is None:  # an answer: the thread's id comes with thread/start's
            thread = _dict(_dict(event.get("result")).get("thread"))
            if isinstance(thread.get("id"), str):
                self.agent_session_id = thread["id"]
            return "result" in event or "error" in event
        if method == "thread/started":
            thread = _dict(params.get("thread"))
            if isinstance(thread.get("id"), str):
                self.agent_session_id = thread["id"]
        elif method == "turn/started":
            self.turns += 1
        elif method == "turn/completed":
            self.turn_ended()
            turn = _dict(params.get("turn"))
            status = turn.get("status")
            if status == "failed":
                message = str(_dict(turn.get("error")).get("message") or "turn failed")
                self.set_result(is_error=True, subtype="turn_failed", summary=message)
                self.add_entry("error", message)
            else:
                self.set_result(is_error=False, subtype="interrupted" if status == "interrupted" else "completed",
                                summary=self.last_message)
            self.flush_message()
        elif method == "thread/tokenUsage/updated":
            usage = _dict(params.get("tokenUsage"))
            total, last = _dict(usage.get("total")), _dict(usage.get("last"))
            self.input_tokens = _int(total.get("inputTokens"))
            self.output_tokens = _int(total.get("outputTokens"))
            self.flush_message(usage={"input_tokens": _int(last.get("inputTokens")),
                                      "output_tokens": _int(last.get("outputTokens"))} if last else None)
        elif method == "error":
            self.add_entry("error", str(_dict(params.get("error")).get("message") or "error"))
        elif method in ("item/started", "item/completed"):
            self._item(method == "item/completed", _dict(params.get("item")))
        else:
            return method in CODEX_APP_SERVER_QUIET
        return True

    def _item(self, completed: bool, item: dict) -> None:
        kind, item_id = item.get("type"), item.get("id")
        if kind == "agentMessage":
            if completed and isinstance(item.get("text"), str) and item["text"]:
                self.set_message(item["text"])
                self.message_part(item["text"])  # its usage comes with thread/tokenUsage/updated
            return
        if kind in ("userMessage", "reasoning", "plan", "hookPrompt", "contextCompaction") or kind is None:
            return
        if not (isinstance(item_id, str) and item_id in self._calls):
            self.tool_calls += 1
            if kind == "commandExecution":
                tool, text = "shell", tool_text(item.get("command"))
            elif kind == "fileChange":
                changes = [_dict(c) for c in item.get("changes") or [] if isinstance(c, dict)]
                tool, text = "edit", ", ".join(f"{_dict(c.get('kind')).get('type') or c.get('kind') or 'change'} "
                                               f"{c.get('path') or '?'}" for c in changes[:20])
            elif kind == "mcpToolCall":
                tool, text = ".".join(str(p) for p in (item.get("server"), item.get("tool")) if p) or "mcp", \
                    tool_text(item.get("arguments"))
            elif kind == "webSearch":
                tool, text = "web_search", tool_text(item.get("query"))
            else:
                tool, text = str(item.get("tool") or kind), tool_text(item.get("arguments") or item.get("path"))
            self.call_started(item_id, tool, text)
        if not completed:
            return
        status = item.get("status")
        code = item.get("exitCode")
        ok = status not in ("failed", "declined") and (code is None or code == 0)
        output = item.get("aggregatedOutput") if kind == "commandExecution" else item.get("result")
        if output is not None and not isinstance(output, str):
            output = json.dumps(output, ensure_ascii=False, separators=(",", ":"))
        self.call_result(item_id, ok=ok, text=output or "")


# Notifications of no interest to the facts (known shapes, so not counted as unknown).
CODEX_APP_SERVER_QUIET = frozenset((
    "thread/status/changed", "item/agentMessage/delta", "item/commandExecution/outputDelta", "warning",
    "configWarning", "account/rateLimits/updated", "remoteControl/status/changed", "turn/diff/updated",
    "turn/plan/updated", "item/reasoning/summaryTextDelta", "item/reasoning/summaryPartAdded",
    "item/reasoning/textDelta", "item/fileChange/outputDelta", "serverRequest/resolved", "mcpServer/startupStatus/updated",
))


class GeminiParser(TextParser):
    """Gemini CLI ``--output-format stream-json``: ``init{session_id, model}``,
    ``message{role, content, delta?}``, ``tool_use``, ``tool_result``, ``error`` (non-fatal)
    and ``result{status, error?, stats{input_tokens, output_tokens, tool_calls, ...}}``
    (google-gemini/gemini-cli packages/core/src/output/types.ts). An API error has no line
    of its own: it is ``result{status: "error", error{type: "unknown", message: "[API
    Error: ...]"}}`` (0.61.0), named ``api_error`` here."""

    name = "gemini"
    structured = True
    tools_reported = True

    def __init__(self, prompt: str | None = None) -> None:
        super().__init__(prompt)
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
                    self.message_part(content)
                    self._in_reply = True
                elif event.get("delta"):
                    self.append_message(content)
                    self.message_part(content, mode="append")
                else:
                    self.set_message(content)
                    self.message_part(content, mode="replace")
            else:
                self._in_reply = False
                if event.get("role") == "user" and isinstance(content, str):
                    self.add_entry("prompt", content)
            return True
        if kind in ("tool_use", "tool_result", "error"):
            self._in_reply = False
            if kind == "tool_use":
                self.tool_calls += 1
                self.call_started(event.get("tool_id"), str(event.get("tool_name") or "tool"),
                                  tool_text(event.get("parameters")))
            elif kind == "tool_result":
                error = _dict(event.get("error"))
                output = event.get("output") if isinstance(event.get("output"), str) else str(error.get("message") or "")
                self.call_result(event.get("tool_id"), ok=event.get("status") == "success", text=output)
            else:
                self.add_entry("error", str(event.get("message") or "error"))
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
            if subtype == "unknown" and "API Error" in str(error.get("message")):
                subtype = "api_error"  # 0.61.0 types a model API refusal "unknown"
            summary = str(error.get("message") or "") if is_error else (self.last_message or "")
            self.set_result(is_error=is_error, subtype=subtype, summary=summary)
            self.flush_message()
            if is_error:
                self.add_entry("error", summary or subtype)
            return True
        return False


class OpencodeParser(TextParser):
    """opencode ``run --format json``: every event ``{type, timestamp, sessionID, ...}``;
    ``step_start``, ``text{part.text}``, ``tool_use{part.tool, part.state}``,
    ``step_finish{part.reason, part.cost, part.tokens{input, output, reasoning,
    cache{read, write}}}``, ``reasoning``, ``error{error{name, data.message}}``
    (sst/opencode packages/opencode/src/cli/cmd/run.ts)."""

    name = "opencode"
    structured = True
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
            self.message_part(part["text"])  # its step's usage comes with step_finish
        elif kind == "tool_use":
            self.tool_calls += 1
            state = _dict(part.get("state"))
            self.call_started(part.get("callID"), str(part.get("tool") or "tool"), tool_text(state.get("input")))
            if state.get("status") in ("completed", "error"):
                output = state.get("output") if state.get("status") == "completed" else state.get("error")
                self.call_result(part.get("callID"), ok=state.get("status") == "completed",
                                 text=output if isinstance(output, str) else "")
        elif kind == "step_finish":
            tokens = _dict(part.get("tokens"))
            cache = _dict(tokens.get("cache"))
            ins = [_int(tokens.get("input")), _int(cache.get("read")), _int(cache.get("write"))]
            outs = [_int(tokens.get("output")), _int(tokens.get("reasoning"))]
            step_in = None if all(v is None for v in ins) else sum(v or 0 for v in ins)
            step_out = None if all(v is None for v in outs) else sum(v or 0 for v in outs)
            self._add_tokens(step_in, step_out)
            self.flush_message(usage={"input_tokens": step_in, "output_tokens": step_out} if tokens else None)
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
            self.add_entry("error", self.result["summary"] or self.result["subtype"])
        return True


class OpencodeServeParser(OpencodeParser):
    """opencode ``serve``'s event stream through RunStead's bridge (a live conversation,
    C11; ``machine/opencode_bridge.py``, docs/opencode-server.md): lines ``{type,
    properties}``. ``bridge.ready`` names the session; ``message.part.updated`` parts become
    ``run --format json``'s events as ``run`` itself makes them (a ``text`` part once it has
    ``time.end``, a ``tool`` part once ``completed`` or ``error``, each ``step-finish`` with
    its tokens and cost; each part once: its updates repeat); a turn is an assistant
    ``message.updated`` answering a user message not seen before (its ``parentID``), and
    it ends at the first terminal one (``time.completed`` and a ``finish`` other than
    ``tool-calls``, or an ``error``; the same rule as ``live_agents.OpencodeServe``), the
    verdict so far: an error ``MessageAbortedError`` (C4) -> ``interrupted``, no error;
    another error -> ``is_error`` with its name and message; else success (``finish``).
    A turn whose loop stopped after a tool call (a rejected permission, Q5: the last
    assistant message completed with ``finish`` ``tool-calls`` and no other follows) ends
    when the session goes idle (``session.status`` idle or ``session.idle``), its verdict
    success with that ``finish``.
    ``session.error`` events are error entries (but for the abort); a prompt the server
    refused (``bridge.error``) ends its turn as an error. The user's messages are the
    conversation's (``turn_prompt``), not read from the stream."""

    name = "opencode_serve"

    def __init__(self, prompt: str | None = None) -> None:
        super().__init__(prompt)
        self._seen: dict = {}  # part ids and turn keys already handled, the last CALLS_KEPT
        self._last: dict = {}  # the latest assistant message's info (a turn the session's idle ends)

    def _once(self, key) -> bool:
        if not isinstance(key, str) or key in self._seen:
            return False
        if len(self._seen) >= CALLS_KEPT:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = True
        return True

    def on_event(self, event: dict) -> bool:
        kind, props = event.get("type"), _dict(event.get("properties"))
        if not isinstance(kind, str):
            return False
        if kind == "bridge.ready":
            if isinstance(props.get("sessionID"), str):
                self.agent_session_id = props["sessionID"]
            return True
        if kind == "bridge.error":
            if props.get("request") == "prompt":
                message = f"opencode refused the prompt ({props.get('status')}): {props.get('body') or ''}"
                self.turn_ended()
                self.set_result(is_error=True, subtype="prompt_refused", summary=message)
                self.add_entry("error", message)
            return True
        if kind == "message.part.updated":
            part = _dict(props.get("part"))
            ptype, pid = part.get("type"), part.get("id")
            done = {"text": bool(_dict(part.get("time")).get("end")),
                    "tool": _dict(part.get("state")).get("status") in ("completed", "error"),
                    "step-finish": True}.get(ptype, False)
            if done and self._once(pid):
                run_kind = {"text": "text", "tool": "tool_use", "step-finish": "step_finish"}[ptype]
                super().on_event({"type": run_kind, "sessionID": self.agent_session_id, "part": part})
            return True
        if kind == "message.updated":
            self._assistant(_dict(props.get("info")))
            return True
        if kind in ("session.idle", "session.status"):
            if kind == "session.idle" or _dict(props.get("status")).get("type") == "idle":
                self._idle()
            return True
        if kind == "session.error":
            error = _dict(props.get("error"))
            if error.get("name") != "MessageAbortedError":
                self.add_entry("error", str(_dict(error.get("data")).get("message") or error.get("name") or "error"))
            return True
        return kind.startswith(("session.", "message.", "permission.", "todo.", "file.", "lsp.", "command."))

    def _assistant(self, info: dict) -> None:
        parent = info.get("parentID")
        if info.get("role") != "assistant" or not isinstance(parent, str):
            return
        if self._once(f"turn:{parent}"):
            self.turns += 1
        self._last = info
        terminal = _dict(info.get("time")).get("completed") and (
            info.get("error") or info.get("finish") not in ("tool-calls", "tool_calls", None))
        if not terminal or not self._once(f"end:{parent}"):
            return
        self.turn_ended()
        error = _dict(info.get("error"))
        if error.get("name") == "MessageAbortedError":
            self.set_result(is_error=False, subtype="interrupted", summary=self.last_message)
        elif error:
            self.set_result(is_error=True, subtype=str(error.get("name") or "error"),
                            summary=str(_dict(error.get("data")).get("message") or ""))
        else:
            self.set_result(is_error=False, subtype=str(info.get("finish") or "stop"), summary=self.last_message)
        self.flush_message()

    def _idle(self) -> None:
        """The session went idle: a turn whose last assistant message completed without a
        terminal ``finish`` (the loop stopped after a tool call) ends here."""
        info, self._last = self._last, {}
        parent = info.get("parentID")
        if not _dict(info.get("time")).get("completed") or not self._once(f"end:{parent}"):
            return
        self.turn_ended()
        self.set_result(is_error=False, subtype=str(info.get("finish") or "stop"), summary=self.last_message)
        self.flush_message()


_AIDER_TOKENS = re.compile(r"^Tokens:\s+(?P<sent>[\d.,]+)(?P<su>[kKmM]?) sent\b.*?(?P<recv>[\d.,]+)(?P<ru>[kKmM]?) received\.")
_AIDER_COST = re.compile(r"Cost:\s+\$(?P<msg>[\d.,]+) message,\s+\$(?P<session>[\d.,]+) session")
_SCALE = {"": 1, "k": 1_000, "m": 1_000_000}


def _aider_count(number: str, unit: str) -> int:
    return int(round(float(number.replace(",", "")) * _SCALE[unit.lower()]))


_AIDER_NOISE = re.compile(r"^(Warning: Input is not a terminal|[\u2500-\u257f]+$)")
_AIDER_ERROR = re.compile(r"^(litellm\.)?\w*(Error|Exception)\b.*?:")


class AiderParser(TextParser):
    """aider prints plain text; after each model reply a line like ``Tokens: 12k sent,
    1.2k received. Cost: $0.04 message, $0.09 session.`` That line gives turns, tokens
    and cost while it runs; the last other non-empty line is the last message. No session
    id, no tool calls.

    It exits 0 whatever happened (0.86.2), so its verdict comes from its run record, the
    ``--analytics-log`` JSON lines (``launched``, ``message_send_starting``,
    ``message_send{prompt_tokens, completion_tokens, cost, total_cost}``, ``exit{reason}``),
    read when it ended: a ``message_send_starting`` with no ``message_send`` after it is a
    message that never got an answer (an API error): ``is_error`` with the error line it
    printed (``litellm.BadRequestError: ...``) as summary; an ``exit`` with no message sent
    at all is ``is_error`` too (``nothing_sent``). The record's figures replace the text's.
    No record (killed, or an older aider): no verdict, the exit status judges."""

    name = "aider"
    cost_reported = True

    def __init__(self, prompt: str | None = None) -> None:
        super().__init__(prompt)
        self.error_line: str | None = None
        self._record: dict | None = None

    def on_text(self, line: str) -> None:
        if _AIDER_NOISE.match(line):
            return
        match = _AIDER_TOKENS.match(line)
        if not match:
            if _AIDER_ERROR.match(line):
                self.error_line = cap(line, 500)
            self.set_message(line)
            return
        self.recognised = True
        self.turns += 1
        self._add_tokens(_aider_count(match["sent"], match["su"]), _aider_count(match["recv"], match["ru"]))
        cost = _AIDER_COST.search(line)
        if cost:
            self.cost_usd = float(cost["session"].replace(",", ""))

    def on_record(self, event: dict) -> None:
        record = self._record = self._record or {"sends": 0, "pending": False, "exit": None, "in": 0, "out": 0,
                                                 "cost": None}
        kind = event.get("event")
        props = _dict(event.get("properties"))
        if kind == "message_send_starting":
            record["pending"] = True
        elif kind == "message_send":
            record["pending"] = False
            record["sends"] += 1
            record["in"] += _int(props.get("prompt_tokens")) or 0
            record["out"] += _int(props.get("completion_tokens")) or 0
            cost = _num(props.get("total_cost"))
            if cost is not None:
                record["cost"] = cost
        elif kind == "exit":
            record["exit"] = str(props.get("reason") or "exit")

    def on_record_end(self) -> None:
        record = self._record
        if record is None:
            return
        self.recognised = True
        self.turns = record["sends"]
        if record["sends"]:
            self.input_tokens, self.output_tokens = record["in"], record["out"]
        if record["cost"] is not None:
            self.cost_usd = record["cost"]
        if record["pending"]:
            self.set_result(is_error=True, subtype="api_error",
                            summary=self.error_line or "aider sent a message and got no answer")
        elif record["exit"] is not None and not record["sends"]:
            self.set_result(is_error=True, subtype="nothing_sent",
                            summary=self.error_line or f"aider ended ({record['exit']}) without sending the message")
        elif record["exit"] is not None:
            self.set_result(is_error=False, subtype="success", summary=self.last_message)


PARSERS = {
    "text": TextParser,
    "claude": ClaudeParser,
    "codex": CodexParser,
    "codex_app_server": CodexAppServerParser,
    "gemini": GeminiParser,
    "opencode": OpencodeParser,
    "opencode_serve": OpencodeServeParser,
    "aider": AiderParser,
}


def make_parser(name: str, prompt: str | None = None) -> TextParser:
    """A fresh parser for ``name`` (a key of ``PARSERS``; unknown -> plain text). A
    structured one given ``prompt`` opens its transcript with it (entry 1)."""
    parser = PARSERS.get(name, TextParser)
    return parser(prompt if parser.structured else None)
