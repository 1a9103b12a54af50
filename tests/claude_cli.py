"""The real Claude Code CLI, offline, for tests (../shared/AGENTS.md "Running the real
Claude Code offline").

``scripts/install_agent_clis.sh`` (run by ``.ci/run``) installs the pinned CLI into
``var/agent-clis``. The CLI talks to ``FakeModelAPI``, a local stand-in for the Messages
API that answers ``POST /v1/messages`` with the standard SSE sequence. What the model
"says" is steered by directives in the prompt, so a test reads as what it does:

- ``[[bash:CMD]]``: the model calls the ``Bash`` tool with ``CMD`` (then says "done.");
- ``[[bash_bg:CMD]]``: the same with ``run_in_background: true`` (a background task);
- ``[[error400]]``: the API answers 400 ``invalid_request_error`` (the agent ends with
  ``is_error: true``);
- anything else: one text reply, ``"ok: <the prompt's first 40 characters>"``.

Usage::

    from tests.claude_cli import claude_bin, fake_model_api, claude_env  # noqa: F401

    def test_x(fake_model_api, tmp_path):
        env = claude_env(home=tmp_path / "home", api=fake_model_api)
        subprocess.run([claude_bin(), "-p", "say hi", "--output-format", "stream-json",
                        "--verbose"], env=env, ...)

``claude_bin()`` skips the test when the CLI is not installed, except under ``CI=true``,
where a missing CLI fails the test (CI installs it).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

BASE_DIR = Path(__file__).resolve().parent.parent
DEFAULT_BIN = BASE_DIR / "var" / "agent-clis" / "node_modules" / ".bin" / "claude"
MODEL = "claude-sonnet-4-5"


def claude_bin() -> str:
    """Absolute path of the installed ``claude`` binary (``$RUNSTEAD_CLAUDE_BIN`` or the
    one ``scripts/install_agent_clis.sh`` installed). Skips the calling test when it is
    missing, fails it under ``CI=true``."""
    path = os.environ.get("RUNSTEAD_CLAUDE_BIN") or str(DEFAULT_BIN)
    if os.access(path, os.X_OK):
        return path
    message = f"Claude Code is not installed at {path}: run scripts/install_agent_clis.sh"
    if os.environ.get("CI") == "true":
        pytest.fail(message)
    pytest.skip(message)


def claude_env(*, home: Path, api: FakeModelAPI, extra: dict | None = None) -> dict:
    """Environment for running the real CLI offline against ``api`` with ``home`` as
    ``$HOME`` (created; its ``.claude.json`` skips the first-run screens). Returns a new
    dict based on ``os.environ`` without any RunStead or Anthropic secrets."""
    home = Path(home)
    (home / ".claude").mkdir(parents=True, exist_ok=True)
    state = home / ".claude.json"
    if not state.exists():
        state.write_text(json.dumps({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE_", "RUNSTEAD_"))}
    env.update(
        HOME=str(home),
        ANTHROPIC_BASE_URL=api.url,
        ANTHROPIC_API_KEY="sk-test-offline",
        CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
        DISABLE_AUTOUPDATER="1",
        DISABLE_TELEMETRY="1",
        # Claude Code refuses to bypass permissions as root unless it is told it is sandboxed.
        IS_SANDBOX="1",
        **(extra or {}),
    )
    return env


def _sse(events: list[dict]) -> bytes:
    return b"".join(f"event: {e['type']}\ndata: {json.dumps(e)}\n\n".encode() for e in events)


def _message(blocks: list[dict], stop_reason: str, n: int) -> bytes:
    events = [
        {
            "type": "message_start",
            "message": {
                "id": f"msg_fake_{n}", "type": "message", "role": "assistant", "model": MODEL,
                "content": [], "stop_reason": None, "stop_sequence": None,
                "usage": {"input_tokens": 12, "output_tokens": 1},
            },
        }
    ]
    for i, block in enumerate(blocks):
        if block["type"] == "text":
            events.append({"type": "content_block_start", "index": i, "content_block": {"type": "text", "text": ""}})
            events.append({"type": "content_block_delta", "index": i, "delta": {"type": "text_delta", "text": block["text"]}})
        else:
            start = {"type": "tool_use", "id": block["id"], "name": block["name"], "input": {}}
            events.append({"type": "content_block_start", "index": i, "content_block": start})
            events.append({
                "type": "content_block_delta", "index": i,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            })
        events.append({"type": "content_block_stop", "index": i})
    events.append({
        "type": "message_delta", "delta": {"stop_reason": stop_reason, "stop_sequence": None},
        "usage": {"output_tokens": 7},
    })
    events.append({"type": "message_stop"})
    return _sse(events)


def _last_user(body: dict) -> tuple[str, bool]:
    """(text of the last user message, whether it carries a tool_result)."""
    for message in reversed(body.get("messages") or []):
        if message.get("role") != "user":
            continue
        content = message.get("content")
        if isinstance(content, str):
            return content, False
        # The CLI puts <system-reminder> blocks before the prompt: the prompt is the last text.
        texts = [b.get("text", "") for b in content if b.get("type") == "text" and not b.get("text", "").startswith("<system-reminder>")]
        has_result = any(b.get("type") == "tool_result" for b in content)
        return (texts[-1] if texts else ""), has_result
    return "", False


DIRECTIVE = re.compile(r"\[\[(bash|bash_bg|error400)(?::(.*?))?\]\]", re.S)


class FakeModelAPI:
    """A local stand-in for Anthropic's Messages API (streaming). ``url`` is the base URL
    for ``ANTHROPIC_BASE_URL``; ``requests`` lists the JSON bodies received, in order."""

    def __init__(self):
        self.requests: list[dict] = []
        self._lock = threading.Lock()
        self._n = 0
        api = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
                with api._lock:
                    api.requests.append(body)
                    api._n += 1
                    n = api._n
                if not self.path.startswith("/v1/messages") or self.path.startswith("/v1/messages/count_tokens"):
                    return self._json(200, {"input_tokens": 12})
                status, payload = api.reply(body, n)
                if status != 200:
                    return self._json(status, payload)
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def do_GET(self):
                self._json(404, {"type": "error", "error": {"type": "not_found_error", "message": "fake"}})

            def _json(self, status, obj):
                data = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    def reply(self, body: dict, n: int) -> tuple[int, bytes | dict]:
        """The answer to one ``/v1/messages`` request: (status, SSE bytes or error JSON)."""
        text, after_tool = _last_user(body)
        if after_tool:
            return 200, _message([{"type": "text", "text": "done."}], "end_turn", n)
        match = DIRECTIVE.search(text)
        if match and match.group(1) == "error400":
            return 400, {"type": "error", "error": {"type": "invalid_request_error", "message": "fake refusal"}}
        if match:
            tool_input = {"command": match.group(2) or "true", "description": "run a command"}
            if match.group(1) == "bash_bg":
                tool_input["run_in_background"] = True
            block = {"type": "tool_use", "id": f"toolu_fake_{n}", "name": "Bash", "input": tool_input}
            return 200, _message([{"type": "text", "text": "Running it."}, block], "tool_use", n)
        return 200, _message([{"type": "text", "text": f"ok: {text.strip()[:40]}"}], "end_turn", n)

    def start(self) -> FakeModelAPI:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def fake_model_api():
    """A running FakeModelAPI for one test."""
    api = FakeModelAPI().start()
    yield api
    api.stop()


def which_node() -> str | None:
    """The ``node`` the CLI needs (it is a Node.js program)."""
    return shutil.which("node")
