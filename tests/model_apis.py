"""Local fakes of the model APIs the real agent CLIs call (../shared/AGENTS.md), one per
wire protocol, on one small server base, for tests that drive the real CLIs offline:

- ``AnthropicAPI``: Messages (``POST /v1/messages``, SSE), for Claude Code;
- ``ResponsesAPI``: OpenAI Responses (``POST /v1/responses``, SSE), for Codex;
- ``GeminiAPI``: ``POST /v1beta/models/{m}:streamGenerateContent?alt=sse`` (and
  ``:generateContent`` for helper calls), for Gemini CLI;
- ``ChatAPI``: OpenAI Chat Completions (``POST /v1/chat/completions``, SSE), for opencode
  and aider.

What the model "says" is steered by directives in the prompt (the text of the last
user message that is not a tool result), so a test reads as what it does:

- ``[[bash:CMD]]``: the model calls its shell tool with ``CMD``; several run one after
  another (the next after the previous one's result came back), then it says "done.";
- ``[[bash_bg:CMD]]`` (Anthropic only): the same with ``run_in_background: true``;
- ``[[bash_ask:CMD]]`` (Responses; elsewhere a plain ``bash``): the same, the model asking
  to run it outside the sandbox (``sandbox_permissions: "require_escalated"`` with a
  ``justification``), which Codex's ``-a on-request`` puts to the person (and to its
  ``PermissionRequest`` hook, SPEC Q);
- ``[[error:STATUS]]`` (``[[error400]]`` is ``[[error:400]]``): the API answers that HTTP
  status with the protocol's error body;
- ``[[slow:SECONDS]]``: the text reply streams in small pieces over that long;
- anything else: one text reply, ``"ok: <the prompt's first line, 40 characters>"``.

A message Claude Code took into a running turn (SPEC C9, ``steer_notes``) is the prompt
from then on, directives and all, as a model would follow it.

``api.requests`` lists ``(path, body)`` of every request received, in order.
"""
from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

DIRECTIVE = re.compile(r"\[\[(bash|bash_bg|bash_ask|error|error400|slow)(?::(.*?))?\]\]", re.S)
SLOW_PIECES = 10


@dataclass
class Step:
    """What the model does next: ``kind`` is ``text``, ``tool`` or ``error``."""

    kind: str
    text: str = ""
    command: str = ""
    background: bool = False
    escalate: bool = False
    status: int = 200
    slow_s: float = 0.0


def plan(prompt: str, tools_done: int) -> Step:
    """The next step for a conversation whose last user prompt is ``prompt`` and which has
    had ``tools_done`` tool results since it (module docstring for the directives)."""
    tools, slow_s = [], 0.0
    for name, arg in DIRECTIVE.findall(prompt):
        if name in ("error", "error400"):
            return Step("error", status=int(arg or 400) if name == "error" else 400)
        if name == "slow":
            slow_s = float(arg or 1)
        else:
            tools.append((arg or "true", name == "bash_bg", name == "bash_ask"))
    if tools_done < len(tools):
        command, background, escalate = tools[tools_done]
        return Step("tool", command=command, background=background, escalate=escalate)
    first_line = (DIRECTIVE.sub("", prompt).strip().splitlines() or [""])[0]
    text = "done." if tools else f"ok: {first_line[:40]}"
    return Step("text", text=text, slow_s=slow_s)


def pieces(text: str, slow_s: float) -> list[str]:
    """The text reply in the pieces it streams in (one piece unless ``slow_s``)."""
    if slow_s <= 0 or len(text) < 2:
        return [text]
    size = max(1, len(text) // SLOW_PIECES)
    return [text[i:i + size] for i in range(0, len(text), size)]


@dataclass
class Reply:
    """An HTTP answer: ``chunks`` are written one by one, ``gap_s`` apart (a slow stream)."""

    status: int = 200
    content_type: str = "text/event-stream"
    chunks: list[bytes] = field(default_factory=list)
    gap_s: float = 0.0

    @classmethod
    def json(cls, status: int, obj) -> Reply:
        return cls(status, "application/json", [json.dumps(obj).encode()])


def sse(events: list[dict], *, named: bool = False) -> list[bytes]:
    """Server-sent events, one chunk each (``named``: with an ``event:`` line of its type)."""
    out = []
    for event in events:
        head = f"event: {event['type']}\n" if named else ""
        out.append(f"{head}data: {json.dumps(event)}\n\n".encode())
    return out


class FakeAPI:
    """The server base: a threaded HTTP server on 127.0.0.1 (port chosen by the OS) that
    logs each request and answers with ``self.reply(path, body) -> Reply``. ``url`` is its
    base URL; use as a context manager or ``start()`` / ``stop()``."""

    def __init__(self):
        self.requests: list[tuple[str, dict]] = []
        self._lock = threading.Lock()
        self._n = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.0"  # close after each answer: a stream needs no length

            def log_message(self, *args):
                pass

            def do_POST(self):
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                except ValueError:
                    body = {"_raw": raw.decode(errors="replace")}
                with api._lock:
                    api.requests.append((self.path, body))
                    api._n += 1
                    n = api._n
                self.answer(api.reply(self.path, body, n))

            def do_GET(self):
                with api._lock:
                    api.requests.append((self.path, {}))
                self.answer(api.get(self.path))

            def answer(self, reply: Reply) -> None:
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                if not reply.gap_s:
                    self.send_header("Content-Length", str(sum(len(c) for c in reply.chunks)))
                self.end_headers()
                try:
                    for i, chunk in enumerate(reply.chunks):
                        if i and reply.gap_s:
                            time.sleep(reply.gap_s)  # the fake model typing slowly, not a test wait
                        self.wfile.write(chunk)
                        self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the client went away (a killed agent)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.port = self._server.server_address[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def reply(self, path: str, body: dict, n: int) -> Reply:
        raise NotImplementedError

    def get(self, path: str) -> Reply:
        return Reply.json(404, {"error": {"message": f"fake API: no GET {path}"}})

    def start(self) -> FakeAPI:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    @staticmethod
    def text_reply(step: Step, events_for) -> Reply:
        """A text step as a Reply: ``events_for(piece, first, last)`` gives each piece's
        SSE chunks; a slow step spreads them over ``step.slow_s``."""
        parts = pieces(step.text, step.slow_s)
        chunks = []
        for i, piece in enumerate(parts):
            chunks.append(b"".join(events_for(piece, i == 0, i == len(parts) - 1)))
        return Reply(chunks=chunks, gap_s=step.slow_s / max(1, len(parts) - 1) if step.slow_s else 0.0)


# --- Anthropic Messages (Claude Code) ------------------------------------------------------


STEER_NOTE = "The user sent a new message while you were working:\n"
STEER_NOTE_END = "\n\nThis is how Claude Code surfaces messages the user sends mid-turn"


def steer_notes(message: dict) -> list[str]:
    """The texts a Messages request's ``message`` carries as messages the user sent while
    the turn ran (Claude Code 2.1.328 with stream-json input: a system-role message after
    the tool result, one note per text: ``STEER_NOTE`` + text + ``STEER_NOTE_END`` ...)."""
    content = message.get("content")
    blocks = [{"type": "text", "text": content}] if isinstance(content, str) else content or []
    notes = []
    for block in blocks:
        for part in (block.get("text") or "").split(STEER_NOTE)[1:] if block.get("type") == "text" else ():
            notes.append(part.split(STEER_NOTE_END)[0])
    return notes


class AnthropicAPI(FakeAPI):
    """``POST /v1/messages?beta=true`` with ``stream: true``: message_start,
    content_block_start/delta/stop per block, message_delta (stop_reason, usage),
    message_stop. Other POSTs (token counting) get ``{"input_tokens": 12}``."""

    model = "claude-sonnet-4-5"

    @staticmethod
    def conversation(body: dict) -> tuple[str, int]:
        """(the last user prompt, tool results since it). In ``-p`` mode the last message
        can be a system-role block and the CLI puts ``<system-reminder>`` texts before the
        prompt: the prompt is the last other text of a user message. A message the user
        sent mid-turn (Claude Code's steer, SPEC C9) comes as a system-role message after
        the tool result it was taken with (``steer_notes``): the last of them is then the
        prompt, as a model would follow it."""
        tools_done = 0
        for message in reversed(body.get("messages") or []):
            if message.get("role") == "system" and (notes := steer_notes(message)):
                return notes[-1], tools_done
            if message.get("role") != "user":
                continue
            content = message.get("content")
            if isinstance(content, str):
                return content, tools_done
            texts = [b.get("text", "") for b in content if b.get("type") == "text"
                     and not b.get("text", "").startswith("<system-reminder>")]
            tools_done += sum(1 for b in content if b.get("type") == "tool_result")
            if texts:
                return texts[-1], tools_done
        return "", tools_done

    def reply(self, path: str, body: dict, n: int) -> Reply:
        if not path.startswith("/v1/messages") or path.startswith("/v1/messages/count_tokens"):
            return Reply.json(200, {"input_tokens": 12})
        step = plan(*self.conversation(body))
        if step.kind == "error":
            return Reply.json(step.status, {"type": "error", "error": {
                "type": "invalid_request_error" if step.status < 500 else "api_error", "message": "fake refusal"}})
        start = [{"type": "message_start", "message": {
            "id": f"msg_fake_{n}", "type": "message", "role": "assistant", "model": self.model, "content": [],
            "stop_reason": None, "stop_sequence": None, "usage": {"input_tokens": 12, "output_tokens": 1}}}]

        def end(stop_reason):
            return [{"type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
                     "usage": {"output_tokens": 7}}, {"type": "message_stop"}]

        if step.kind == "tool":
            tool_input = {"command": step.command, "description": "run a command"}
            if step.background:
                tool_input["run_in_background"] = True
            events = start + [
                {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
                {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Running it."}},
                {"type": "content_block_stop", "index": 0},
                {"type": "content_block_start", "index": 1, "content_block": {
                    "type": "tool_use", "id": f"toolu_fake_{n}", "name": "Bash", "input": {}}},
                {"type": "content_block_delta", "index": 1, "delta": {
                    "type": "input_json_delta", "partial_json": json.dumps(tool_input)}},
                {"type": "content_block_stop", "index": 1},
            ] + end("tool_use")
            return Reply(chunks=[b"".join(sse(events, named=True))])

        def events_for(piece, first, last):
            events = []
            if first:
                events += start + [{"type": "content_block_start", "index": 0,
                                    "content_block": {"type": "text", "text": ""}}]
            events.append({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}})
            if last:
                events += [{"type": "content_block_stop", "index": 0}] + end("end_turn")
            return sse(events, named=True)

        return self.text_reply(step, events_for)


# --- OpenAI Responses (Codex) --------------------------------------------------------------


class ResponsesAPI(FakeAPI):
    """``POST /v1/responses`` (``stream: true``): response.created, output items (a
    ``message`` with ``output_text``, or a ``function_call`` of ``exec_command``), and
    response.completed with usage. An error is the status with ``{"error": {...}}``."""

    model = "gpt-test"
    shell_tool = "exec_command"

    @staticmethod
    def conversation(body: dict) -> tuple[str, int]:
        tools_done = 0
        for item in reversed(body.get("input") or []):
            if item.get("type") == "function_call_output":
                tools_done += 1
            elif item.get("type") == "message" and item.get("role") == "user":
                texts = [c.get("text", "") for c in item.get("content") or [] if c.get("type") == "input_text"]
                text = texts[-1] if texts else ""
                if not text.startswith("<environment_context>"):
                    return text, tools_done
        return "", tools_done

    def reply(self, path: str, body: dict, n: int) -> Reply:
        if not path.startswith("/v1/responses"):
            return Reply.json(404, {"error": {"message": f"fake API: no {path}"}})
        step = plan(*self.conversation(body))
        if step.kind == "error":
            return Reply.json(step.status, {"error": {
                "type": "invalid_request_error", "code": "fake_refusal", "message": "fake refusal", "param": None}})
        rid = f"resp_fake_{n}"
        usage = {"input_tokens": 20, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 5,
                 "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 25}
        created = {"type": "response.created", "response": {"id": rid, "object": "response", "status": "in_progress",
                                                             "model": self.model, "output": []}}

        def completed(output):
            return {"type": "response.completed", "response": {
                "id": rid, "object": "response", "status": "completed", "model": self.model, "output": output,
                "usage": usage}}

        if step.kind == "tool":
            arguments = {"cmd": step.command}
            if step.escalate:
                arguments.update(sandbox_permissions="require_escalated", justification="the test asks to run it")
            item = {"type": "function_call", "id": f"fc_fake_{n}", "call_id": f"call_fake_{n}",
                    "name": self.shell_tool, "arguments": json.dumps(arguments), "status": "completed"}
            events = [created, {"type": "response.output_item.added", "output_index": 0, "item": item},
                      {"type": "response.output_item.done", "output_index": 0, "item": item}, completed([item])]
            return Reply(chunks=[b"".join(sse(events))])
        item_id = f"msg_fake_{n}"

        def events_for(piece, first, last):
            events = []
            if first:
                events += [created, {"type": "response.output_item.added", "output_index": 0, "item": {
                    "type": "message", "id": item_id, "role": "assistant", "status": "in_progress", "content": []}}]
            events.append({"type": "response.output_text.delta", "item_id": item_id, "output_index": 0,
                           "content_index": 0, "delta": piece})
            if last:
                item = {"type": "message", "id": item_id, "role": "assistant", "status": "completed",
                        "content": [{"type": "output_text", "text": step.text, "annotations": []}]}
                events += [{"type": "response.output_item.done", "output_index": 0, "item": item}, completed([item])]
            return sse(events)

        return self.text_reply(step, events_for)


# --- Gemini (Gemini CLI) -------------------------------------------------------------------


class GeminiAPI(FakeAPI):
    """``:streamGenerateContent?alt=sse``: ``data: {"candidates": [...], "usageMetadata"}``
    chunks (text parts, or a ``run_shell_command`` functionCall); ``:generateContent``
    (router, titles) gets a short JSON answer; an error is ``{"error": {code, message,
    status}}``."""

    shell_tool = "run_shell_command"

    @staticmethod
    def conversation(body: dict) -> tuple[str, int]:
        tools_done = 0
        for content in reversed(body.get("contents") or []):
            if content.get("role") != "user":
                continue
            parts = content.get("parts") or []
            tools_done += sum(1 for p in parts if "functionResponse" in p)
            texts = [p["text"] for p in parts if isinstance(p.get("text"), str)]
            if texts and not any("functionResponse" in p for p in parts):
                return texts[-1], tools_done
        return "", tools_done

    def reply(self, path: str, body: dict, n: int) -> Reply:
        usage = {"promptTokenCount": 30, "candidatesTokenCount": 6, "totalTokenCount": 36}
        step = plan(*self.conversation(body))
        if step.kind == "error":
            return Reply.json(step.status, {"error": {"code": step.status, "message": "fake refusal",
                                                      "status": "INVALID_ARGUMENT" if step.status < 500 else "INTERNAL"}})
        if ":generateContent" in path:  # helper calls: the router's JSON answer, a title
            text = json.dumps({"reasoning": "fake", "model_choice": "flash"}) if "responseJsonSchema" in json.dumps(
                body.get("generationConfig") or {}) else "Fake title"
            return Reply.json(200, {"candidates": [{"content": {"role": "model", "parts": [{"text": text}]},
                                                    "finishReason": "STOP"}], "usageMetadata": usage})
        if ":streamGenerateContent" not in path:
            return Reply.json(404, {"error": {"code": 404, "message": f"fake API: no {path}", "status": "NOT_FOUND"}})
        if step.kind == "tool":
            call = {"functionCall": {"name": self.shell_tool, "args": {"command": step.command,
                                                                       "description": "run a command"}}}
            chunk = {"candidates": [{"content": {"role": "model", "parts": [call]}, "finishReason": "STOP"}],
                     "usageMetadata": usage}
            return Reply(chunks=[f"data: {json.dumps(chunk)}\n\n".encode()])

        def events_for(piece, first, last):
            chunk = {"candidates": [{"content": {"role": "model", "parts": [{"text": piece}]}}]}
            if last:
                chunk["candidates"][0]["finishReason"] = "STOP"
                chunk["usageMetadata"] = usage
            return [f"data: {json.dumps(chunk)}\n\n".encode()]

        return self.text_reply(step, events_for)


# --- OpenAI Chat Completions (opencode, aider) ---------------------------------------------


class ChatAPI(FakeAPI):
    """``POST /v1/chat/completions`` (stream, with a usage chunk when asked): text deltas,
    or a ``tool_calls`` delta of the request's shell tool (``bash``) when the request
    offers tools; ``data: [DONE]`` last. An error is the status with ``{"error": {...}}``.
    A request without tools (a title call, aider) never gets a tool call."""

    model = "gpt-test"
    shell_tool = "bash"

    @staticmethod
    def conversation(body: dict) -> tuple[str, int]:
        tools_done = 0
        for message in reversed(body.get("messages") or []):
            if message.get("role") == "tool":
                tools_done += 1
            elif message.get("role") == "user":
                content = message.get("content")
                if isinstance(content, list):
                    texts = [c.get("text", "") for c in content if isinstance(c, dict) and c.get("type") == "text"]
                    content = texts[-1] if texts else ""
                return (content if isinstance(content, str) else ""), tools_done
        return "", tools_done

    def reply(self, path: str, body: dict, n: int) -> Reply:
        if not path.startswith("/v1/chat/completions"):
            return Reply.json(404, {"error": {"message": f"fake API: no {path}"}})
        tools = [t.get("function", {}).get("name") for t in body.get("tools") or []]
        step = plan(*self.conversation(body))
        if step.kind == "error":
            return Reply.json(step.status, {"error": {"message": "fake refusal", "type": "invalid_request_error",
                                                      "code": "fake_refusal", "param": None}})
        if step.kind == "tool" and self.shell_tool not in tools:
            step = Step("text", text=f"ok: {step.command[:40]}")  # no tools offered (a title call, aider)
        base = {"id": f"chatcmpl-fake-{n}", "object": "chat.completion.chunk", "created": int(time.time()),
                "model": self.model}
        usage = {"prompt_tokens": 40, "completion_tokens": 8, "total_tokens": 48}

        def chunk(delta, finish=None):
            return {**base, "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}

        def tail(finish):
            out = [chunk({}, finish)]
            if (body.get("stream_options") or {}).get("include_usage"):
                out.append({**base, "choices": [], "usage": usage})
            return [f"data: {json.dumps(c)}\n\n".encode() for c in out] + [b"data: [DONE]\n\n"]

        if step.kind == "tool":
            call = {"index": 0, "id": f"call_fake_{n}", "type": "function", "function": {
                "name": self.shell_tool, "arguments": json.dumps({"command": step.command,
                                                                  "description": "run a command"})}}
            head = [f"data: {json.dumps(chunk({'role': 'assistant', 'content': None, 'tool_calls': [call]}))}\n\n"
                    .encode()]
            return Reply(chunks=[b"".join(head + tail("tool_calls"))])

        def events_for(piece, first, last):
            delta = {"role": "assistant", "content": piece} if first else {"content": piece}
            out = [f"data: {json.dumps(chunk(delta))}\n\n".encode()]
            return out + (tail("stop") if last else [])

        return self.text_reply(step, events_for)


def _fixture(cls):
    @pytest.fixture
    def running():
        with cls() as api:
            yield api
    running.__doc__ = f"A running {cls.__name__} for one test."
    return running


anthropic_api = _fixture(AnthropicAPI)
responses_api = _fixture(ResponsesAPI)
gemini_api = _fixture(GeminiAPI)
chat_api = _fixture(ChatAPI)
