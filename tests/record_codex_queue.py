"""Records how the real Codex CLI's ``codex queue`` behaves (0.169.0, offline), for SPEC T4
``native`` (docs/codex-queue.md), into tests/fixtures/codex_queue/<scenario>.json.

    .venv/bin/python tests/record_codex_queue.py [scenario ...]

Each scenario runs the real Codex terminal UI in tmux (tests/tmux.py) against the fake
Responses API (tests.model_apis.ResponsesAPI) with a temporary ``CODEX_HOME``, has one turn
typed at its prompt (the thread then exists; its id is the rollout file's), and runs

    codex queue --thread THREAD_ID --message TEXT

at a set moment. Recorded per scenario: each ``queue`` run (exit code, stdout, stderr,
seconds), the prompts the model was asked in order (Codex's own title requests left out),
and the terminal's screen at the end (the logo art left out). Paths become ``/home/dev``,
ids ``THREAD_ID`` / ``QUEUED_ID``. The TUI's background app-server (started by the TUI in
its default mode, outliving it) is stopped at the end of each scenario.
"""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(BASE_DIR))

from tests.agent_clis import cli_bin, offline  # noqa: E402
from tests.model_apis import ResponsesAPI  # noqa: E402
from tests.tmux import Terminal  # noqa: E402
from tests.wait import wait_for  # noqa: E402

OUT = BASE_DIR / "tests" / "fixtures" / "codex_queue"
UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
TITLE_CALL = "Generate a concise, single-line task title"


class Run:
    def __init__(self, tmp: Path, api: ResponsesAPI, tui_args: list[str]):
        self.tmp, self.api = tmp, api
        self.home, self.work = tmp / "home", tmp / "work"
        self.work.mkdir(parents=True)
        setup = offline("codex", self.home, api)
        self.env = {**setup.env, "PATH": os.environ["PATH"], "TERM": "xterm-256color"}
        self.term = Terminal(tmp / "tmux.sock", [cli_bin("codex"), *tui_args], env=self.env, cwd=self.work)
        self.queued: list[dict] = []
        self.thread = ""
        self.term.wait_for("Ask Codex", timeout=60)

    def turn(self, text: str) -> None:
        self.term.submit(text, accepted=lambda: f"ok: {text}" in self.term.screen(), settle_s=10)
        if not self.thread:
            rollout = glob.glob(str(self.home / ".codex" / "sessions" / "**" / "rollout-*.jsonl"), recursive=True)
            self.thread = re.search(rf"({UUID})\.jsonl$", rollout[0]).group(1)

    def queue(self, text: str, *extra: str) -> dict:
        started = time.monotonic()
        done = subprocess.run([cli_bin("codex"), "queue", "--thread", self.thread, "--message", text, *extra],
                              env=self.env, cwd=self.work, capture_output=True, text=True, timeout=60,
                              stdin=subprocess.DEVNULL)
        row = {"message": text, "args": list(extra), "exit": done.returncode, "stdout": self.clean(done.stdout),
               "stderr": self.clean(done.stderr), "seconds": round(time.monotonic() - started, 2)}
        self.queued.append(row)
        return row

    def prompts(self) -> list[str]:
        asked = [ResponsesAPI.conversation(body)[0] for path, body in self.api.requests if path.startswith("/v1/responses")]
        return [p for p in asked if not p.startswith(TITLE_CALL)]

    def screen(self) -> list[str]:
        return [self.clean(line.rstrip()) for line in self.term.screen().splitlines()
                if line.strip() and not re.search("[\u2800-\u28ff]", line)]

    def clean(self, text: str) -> str:
        text = text.replace(str(self.home), "/home/dev").replace(str(self.work), "/home/dev/project")
        text = text.replace(self.thread, "THREAD_ID") if self.thread else text
        text = re.sub(r"\d{1,2}:\d{2} [AP]M", "HH:MM", text)
        return re.sub(UUID, "QUEUED_ID", text)

    def close(self) -> None:
        self.term.close()
        for entry in Path("/proc").iterdir():  # the TUI's app-server, started in our CODEX_HOME
            if entry.name.isdigit():
                try:
                    environ = (entry / "environ").read_bytes().split(b"\0")
                except OSError:
                    continue
                if f"CODEX_HOME={self.home / '.codex'}".encode() in environ:
                    try:
                        os.kill(int(entry.name), signal.SIGTERM)
                    except OSError:
                        pass


def wait_prompt(run: Run, text: str, timeout: float = 30) -> None:
    wait_for(lambda: f"ok: {text}" in run.term.screen(), timeout_s=timeout, what=f"{text!r} answered")


def idle(run: Run) -> None:
    """Queued while the TUI is idle at its prompt."""
    run.queue("queued while idle")
    wait_prompt(run, "queued while idle")


def busy(run: Run) -> None:
    """Two messages queued while a slow turn streams its answer."""
    run.term.submit("[[slow:5]] a slow turn", accepted=lambda: "Working" in run.term.screen(), settle_s=10)
    run.queue("queued during the turn A")
    run.queue("queued during the turn B")
    wait_for(lambda: "ok: queued during the turn B" in run.term.screen() or
             "ok: queued during the turn A" in run.term.screen(), timeout_s=40, what="a queued message answered")
    time.sleep(4)  # let a second turn, if any, run


def twice(run: Run) -> None:
    """The same text queued twice (a retried command): two turns or one?"""
    run.queue("queued twice")
    run.queue("queued twice")
    wait_prompt(run, "queued twice")
    time.sleep(4)


def typed_draft(run: Run) -> None:
    """The person has a half-typed line in the composer when a message is queued."""
    run.term.type("half typed")
    run.term.wait_for("half typed")
    run.queue("queued over a draft")
    time.sleep(6)


def no_daemon(run: Run) -> None:
    """The TUI run with ``--no-daemon``: is the thread reachable?"""
    run.queue("queued to a no-daemon tui")
    time.sleep(6)


def after_exit(run: Run) -> None:
    """The TUI ended (Ctrl-C twice): the message queued, then ``codex resume THREAD``."""
    run.term.key("C-c")
    run.term.key("C-c")
    wait_for(lambda: "<no screen" in run.term.screen(), timeout_s=20, what="the TUI ended")
    run.queue("queued after exit")
    run.term = Terminal(run.tmp / "tmux2.sock", [cli_bin("codex"), "resume", run.thread], env=run.env, cwd=run.work)
    time.sleep(10)


SCENARIOS = {"idle": ([], idle), "busy": ([], busy), "twice": ([], twice), "typed_draft": ([], typed_draft),
             "no_daemon": (["--no-daemon"], no_daemon), "after_exit": ([], after_exit)}


def record(name: str) -> dict:
    tui_args, steps = SCENARIOS[name]
    tmp = Path(tempfile.mkdtemp(prefix=f"codex-queue-{name}-"))
    try:
        with ResponsesAPI() as api:
            run = Run(tmp, api, tui_args)
            try:
                run.turn("first turn")
                steps(run)
                return {"scenario": name, "doc": steps.__doc__, "tui_args": tui_args, "queued": run.queued,
                        "prompts": run.prompts(), "screen": run.screen()}
            finally:
                run.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def main(names: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    for name in names or list(SCENARIOS):
        result = record(name)
        (OUT / f"{name}.json").write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n")
        print(name, json.dumps({k: result[k] for k in ("queued", "prompts")}, ensure_ascii=False)[:1500])


if __name__ == "__main__":
    main(sys.argv[1:])
