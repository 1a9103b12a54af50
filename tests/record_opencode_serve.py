"""Records what the real ``opencode serve`` (1.18.33, offline) prints through RunStead's
bridge (machine/opencode_bridge.py), for SPEC C11 (docs/opencode-server.md), into
tests/fixtures/opencode_serve/*.jsonl (the bridge's stdout, one JSON object a line).

    .venv/bin/python tests/record_opencode_serve.py [NAME ...]   (default: all of them)

The bridge runs the real server against the fake Chat Completions API (tests.model_apis.
ChatAPI), offline (tests.agent_clis.offline). Written to its stdin, one at a time, each
after the previous turn's end (a terminal assistant ``message.updated``):

- ``three_turns.jsonl``: "first", a tool call (``[[bash:echo hi]]``), "third";
- ``abort.jsonl``: a long tool call, ``{"abort": true}`` while it runs, then "after";
- ``refused.jsonl``: a prompt the fake API refuses (``[[error:400]]``);
- ``permission_rejected.jsonl``: opencode's bash asks for permission
  (``OPENCODE_CONFIG_CONTENT`` ``{"permission": {"bash": "ask"}}``), a tool call
  (``[[bash:echo hi]]``), which the bridge (no task credential) rejects, then "after".

``listing.json`` (``GET /session/{id}/message`` after one answered prompt "hi", what the
bridge prints again after its event stream came back) was taken by hand the same way.

Paths become ``/home/dev``; ids stay as the server made them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BASE_DIR))

from machine.worker.live_agents import OpencodeServe  # noqa: E402
from tests.agent_clis import cli_bin, offline  # noqa: E402
from tests.model_apis import ChatAPI  # noqa: E402
from tests.wait import wait_for  # noqa: E402

BRIDGE = BASE_DIR / "machine" / "opencode_bridge.py"
OUT = BASE_DIR / "tests" / "fixtures" / "opencode_serve"


class Bridge:
    def __init__(self, home: Path, folder: Path, api: ChatAPI, env: dict | None = None):
        env = {**os.environ, **offline("opencode", home, api).env, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, "-I", str(BRIDGE), cli_bin("opencode")], cwd=folder, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self.lines: list[str] = []
        self.adapter = OpencodeServe()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        wait_for(lambda: any('"bridge.ready"' in line for line in self.lines), timeout_s=90, what="the session")

    def _read(self):
        for raw in self.proc.stdout:
            line = raw.decode().rstrip("\n")
            self.adapter.see(line)
            self.lines.append(line)

    def write(self, item: dict) -> None:
        self.proc.stdin.write((json.dumps(item) + "\n").encode())
        self.proc.stdin.flush()

    def turn(self, text: str, *, then=None) -> None:
        ended = self.adapter.turns_ended
        self.write({"prompt": text})
        if then:
            then(self)
        wait_for(lambda: self.adapter.turns_ended > ended, timeout_s=60, what=f"the turn of {text!r}")

    def close(self, name: str, folder: Path) -> None:
        self.proc.stdin.close()
        self.proc.wait(30)
        self.reader.join(10)  # the bridge's last lines read (its stdout ended with it)
        text = "\n".join(self.lines) + "\n"
        OUT.mkdir(parents=True, exist_ok=True)
        (OUT / name).write_text(text.replace(str(folder), "/home/dev"))


def main(names: list[str]) -> None:
    def wanted(name: str) -> bool:
        return not names or name in names

    with tempfile.TemporaryDirectory() as tmp, ChatAPI() as api:
        home, folder = Path(tmp) / "home", Path(tmp) / "dev"
        folder.mkdir()
        if wanted("three_turns"):
            bridge = Bridge(home, folder, api)
            for text in ("first", "[[bash:echo hi]] a tool", "third"):
                bridge.turn(text)
            bridge.close("three_turns.jsonl", folder)

        if wanted("abort"):
            bridge = Bridge(home, folder, api)

            def abort_when_running(b):
                wait_for(lambda: any('"status":"running"' in line and "sleep 30" in line for line in b.lines),
                         timeout_s=60, what="the long command runs")
                b.write({"abort": True})

            bridge.turn("[[bash:sleep 30]] long", then=abort_when_running)
            bridge.turn("after")
            bridge.close("abort.jsonl", folder)

        if wanted("refused"):
            bridge = Bridge(home, folder, api)
            bridge.turn("[[error:400]] refused")
            bridge.close("refused.jsonl", folder)

        if wanted("permission_rejected"):
            bridge = Bridge(home, folder, api, {"OPENCODE_CONFIG_CONTENT": json.dumps({"permission": {"bash": "ask"}})})
            bridge.turn("[[bash:echo hi]] a tool")
            bridge.turn("after")
            bridge.close("permission_rejected.jsonl", folder)


if __name__ == "__main__":
    main(sys.argv[1:])
