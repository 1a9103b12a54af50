"""Records how the real opencode terminal UI's local server takes a prompt (1.18.33,
offline), for SPEC T4 ``native`` (docs/opencode-server.md), into
tests/fixtures/opencode_server/steps.json.

    .venv/bin/python tests/record_opencode_server.py

The real TUI runs in tmux (tests/tmux.py) with ``--port PORT`` against the fake Chat
Completions API (tests.model_apis.ChatAPI), offline (tests.agent_clis.offline). One turn
is typed at its prompt; then, in order, through its server:

- ``idle``: ``POST /session/{id}/prompt_async`` while idle;
- ``busy``: two ``prompt_async`` while a slow turn typed at the prompt streams;
- ``abort``: a slow turn sent by ``prompt_async``, ``POST /session/{id}/abort`` while it
  streams, then one more ``prompt_async``.

Recorded per step: each request (method, path, body, status, answer, seconds), the
prompts the model was asked since the step began (opencode's title calls left out), the
session's messages (role, text) as ``GET /session/{id}/message`` lists them at its end,
and ``GET /session/status``. Paths become ``/home/dev``, the session id ``SESSION_ID``.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import httpx

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BASE_DIR))

from tests.agent_clis import cli_bin, offline  # noqa: E402
from tests.model_apis import ChatAPI  # noqa: E402
from tests.tmux import Terminal  # noqa: E402
from tests.wait import wait_for  # noqa: E402

OUT = BASE_DIR / "tests" / "fixtures" / "opencode_server"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Run:
    def __init__(self, tmp: Path, api: ChatAPI):
        self.tmp, self.api = tmp, api
        self.home, self.work = tmp / "home", tmp / "work"
        self.work.mkdir(parents=True)
        setup = offline("opencode", self.home, api)
        env = {**setup.env, "PATH": os.environ["PATH"], "TERM": "xterm-256color"}
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.term = Terminal(tmp / "tmux.sock", [cli_bin("opencode"), "--port", str(self.port)], env=env, cwd=self.work)
        self.term.wait_for("Ask anything", timeout=120)
        self.session = ""
        self.calls: list[dict] = []

    def call(self, method: str, path: str, body: dict | None = None) -> httpx.Response:
        started = time.monotonic()
        answer = httpx.request(method, self.base + path.replace("SESSION_ID", self.session), json=body, timeout=60)
        self.calls.append({"method": method, "path": path, "body": body, "status": answer.status_code,
                           "answer": self.clean(answer.text[:2000]), "seconds": round(time.monotonic() - started, 2)})
        return answer

    def prompt(self, text: str) -> httpx.Response:
        return self.call("POST", "/session/SESSION_ID/prompt_async", {"parts": [{"type": "text", "text": text}]})

    def asked(self) -> list[str]:
        return [ChatAPI.conversation(body)[0] for path, body in self.api.requests
                if path.startswith("/v1/chat") and body.get("tools")]  # a title call offers no tools

    def messages(self) -> list[dict]:
        rows = httpx.get(f"{self.base}/session/{self.session}/message", timeout=30).json()
        out = []
        for row in rows:
            info, parts = row.get("info", {}), row.get("parts", [])
            out.append({"role": info.get("role"), "text": " ".join(p.get("text", "") for p in parts
                                                                      if p.get("type") == "text"),
                        "error": (info.get("error") or {}).get("name")})
        return out

    def clean(self, text: str) -> str:
        text = text.replace(str(self.home), "/home/dev").replace(str(self.work), "/home/dev/project")
        return text.replace(self.session, "SESSION_ID") if self.session else text

    def answered(self, text: str) -> bool:
        return any(m["role"] == "assistant" and m["text"] == f"ok: {text}" for m in self.messages())


def record() -> list[dict]:
    tmp = Path(tempfile.mkdtemp(prefix="opencode-server-"))
    steps = []
    try:
        with ChatAPI() as api:
            run = Run(tmp, api)
            try:
                run.term.submit("first turn", accepted=lambda: "ok: first turn" in run.term.screen(), settle_s=20)
                run.session = httpx.get(f"{run.base}/session", timeout=30).json()[0]["id"]

                def step(name, doc, act):
                    run.calls, before = [], len(run.asked())
                    act()
                    steps.append({"step": name, "doc": doc, "calls": run.calls, "asked": run.asked()[before:],
                                  "messages": run.messages(),
                                  "status": json.loads(run.clean(httpx.get(f"{run.base}/session/status").text))})

                def idle():
                    run.prompt("from the server while idle")
                    wait_for(lambda: run.answered("from the server while idle"), timeout_s=30)

                def busy():
                    run.term.submit("[[slow:5]] a slow turn", accepted=lambda: "a slow turn" in json.dumps(
                        run.api.requests[-1][1]), settle_s=10)
                    run.prompt("during the turn A")
                    run.prompt("during the turn B")
                    wait_for(lambda: run.answered("during the turn B") or run.answered("during the turn A"),
                             timeout_s=40)
                    time.sleep(4)  # a second turn, if any

                def abort():
                    run.prompt("[[slow:8]] to be aborted")
                    wait_for(lambda: "to be aborted" in json.dumps(run.api.requests[-1][1]), timeout_s=20)
                    run.call("POST", "/session/SESSION_ID/abort")
                    time.sleep(1)
                    run.prompt("after the abort")
                    wait_for(lambda: run.answered("after the abort"), timeout_s=30)

                step("idle", "prompt_async while idle", idle)
                step("busy", "two prompt_async while a typed slow turn streams", busy)
                step("abort", "abort during a slow turn, then one more prompt", abort)
                steps[-1]["screen"] = [run.clean(line.rstrip()) for line in run.term.screen().splitlines() if line.strip()]
            finally:
                run.term.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return steps


if __name__ == "__main__":
    OUT.mkdir(parents=True, exist_ok=True)
    result = record()
    (OUT / "steps.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
    for s in result:
        print(s["step"], s["asked"], [(m["role"], m["text"][:40], m["error"]) for m in s["messages"]][-6:])
