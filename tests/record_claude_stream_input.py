"""Records how the real Claude Code CLI behaves in streaming-input mode, offline
(docs/claude-stream-input.md), into tests/fixtures/claude_stream_input/.

    .venv/bin/python tests/record_claude_stream_input.py [scenario ...]

Each scenario starts one long-lived

    claude -p --input-format stream-json --output-format stream-json --verbose \
        --permission-mode bypassPermissions

(``--replay-user-messages`` added for the ``replay_*`` scenarios, SPEC C9) against the
local fake Messages API (tests.model_apis.AnthropicAPI), with ``claude_env``
(tests/claude_cli.py), writes lines to its stdin at set moments and reads its stdout line
by line. Written per scenario:

- ``<scenario>.jsonl``: the raw stdout lines, in order (made stable as
  tests/record_agent_fixtures.py does: the temporary HOME becomes ``/home/dev``, the work
  folder ``/home/dev/project``, the session id ``SESSION_ID``);
- ``<scenario>_hooks.jsonl`` (scenario ``hooks`` only): the hook inputs, one per line;

and for all scenarios together ``stdin.jsonl`` (``{"scenario", "at_s", "line"}`` per line
written, ``line`` the exact text without its newline, ``"<EOF>"`` for closing stdin) and
``timeline.jsonl`` (``{"scenario", "at_s", "stream": "in"|"out"|"err"|"exit", "line"}``:
stdin, stdout and stderr interleaved as they happened, with the exit code last).
"""
from __future__ import annotations

import json
import os
import queue
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
if str(BASE_DIR) not in sys.path:
    sys.path.insert(0, str(BASE_DIR))

from tests.agent_clis import CLI_DIR, DEFAULT_BINS  # noqa: E402
from tests.claude_cli import claude_env  # noqa: E402
from tests.model_apis import AnthropicAPI  # noqa: E402

FIXTURES = BASE_DIR / "tests" / "fixtures" / "claude_stream_input"
SESSION_ID = "b6e66952-929c-4f1e-a0e0-91664c71fa14"
ARGS = ["-p", "--input-format", "stream-json", "--output-format", "stream-json", "--verbose",
        "--permission-mode", "bypassPermissions"]
# A tool call that runs for 30 s. The CLI itself refuses `sleep 30` (and `sleep 30 && ...`)
# as a Bash command: "Blocked: standalone sleep 30. To wait for a condition, use Monitor...".
LONG_TOOL = '[[bash:python3 -c "import time; time.sleep(30)"; echo slept]] long tool'
LONG_TOOL_MARK = "time.sleep(30)"
HOOK_EVENTS = ("SessionStart", "UserPromptSubmit", "Stop", "SessionEnd")


def user(content) -> dict:
    """A user message line: ``content`` a string or a list of content blocks."""
    return {"type": "user", "message": {"role": "user", "content": content}}


def interrupt(request_id: str) -> dict:
    return {"type": "control_request", "request_id": request_id, "request": {"subtype": "interrupt"}}


def is_result(event: dict) -> bool:
    return event.get("type") == "result"


def is_tool_use(event: dict) -> bool:
    content = (event.get("message") or {}).get("content") if event.get("type") == "assistant" else None
    return isinstance(content, list) and any(b.get("type") == "tool_use" for b in content)


def is_control_response(event: dict) -> bool:
    return event.get("type") == "control_response"


def processes_matching(mark: str) -> list[str]:
    """``ps`` lines of the processes whose command line contains ``mark``."""
    out = subprocess.run(["ps", "-eo", "pid,ppid,etimes,args"], capture_output=True, text=True).stdout
    return [line.strip() for line in out.splitlines()[1:] if mark in line and "ps -eo" not in line]


class Session:
    """One running CLI: ``send`` a line, ``wait_for`` an output event, ``close`` stdin."""

    def __init__(self, name: str, api: AnthropicAPI, home: Path, work: Path):
        self.name = name
        self.timeline: list[dict] = []
        self.stdout: list[str] = []
        self._events: queue.Queue = queue.Queue()
        env = claude_env(home=home, api=api)
        self.t0 = time.monotonic()
        args = [*ARGS, "--replay-user-messages"] if name in REPLAY else ARGS
        self.proc = subprocess.Popen([str(DEFAULT_BINS["claude"]), *args], cwd=work, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self._readers = [threading.Thread(target=self._read, args=(self.proc.stdout, "out"), daemon=True),
                         threading.Thread(target=self._read, args=(self.proc.stderr, "err"), daemon=True)]
        for reader in self._readers:
            reader.start()

    def at(self) -> float:
        return round(time.monotonic() - self.t0, 2)

    def note(self, stream: str, line) -> None:
        self.timeline.append({"scenario": self.name, "at_s": self.at(), "stream": stream, "line": line})
        shown = line if not isinstance(line, str) or len(line) < 300 else line[:300] + "..."
        print(f"  [{self.at():6.2f}] {stream:4} {shown}", file=sys.stderr, flush=True)

    def _read(self, pipe, stream: str) -> None:
        for raw in pipe:
            line = raw.decode(errors="replace").rstrip("\n")
            self.note(stream, line)
            if stream == "out":
                self.stdout.append(line)
                try:
                    event = json.loads(line)
                except ValueError:
                    continue
                if isinstance(event, dict):
                    self._events.put(event)

    def send(self, line) -> None:
        text = line if isinstance(line, str) else json.dumps(line)
        self.note("in", text)
        self.proc.stdin.write((text + "\n").encode())
        self.proc.stdin.flush()

    def wait_for(self, predicate, timeout: float = 60) -> dict | None:
        """The next stdout event for which ``predicate`` holds (earlier ones are passed)."""
        end = time.monotonic() + timeout
        while (left := end - time.monotonic()) > 0:
            try:
                event = self._events.get(timeout=left)
            except queue.Empty:
                break
            if predicate(event):
                return event
        self.note("note", f"timed out after {timeout}s")
        return None

    def settle(self, seconds: float) -> None:
        time.sleep(seconds)

    def close(self, timeout: float = 60) -> int | None:
        self.note("in", "<EOF>")
        self.proc.stdin.close()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.note("note", f"still running {timeout}s after EOF: killed")
            self.proc.kill()
            code = self.proc.wait()
        for reader in self._readers:
            reader.join(5)
        self.note("exit", code)
        return code


# --- scenarios: each gets a fresh HOME and a running Session ------------------------------------


def two_turns(s: Session) -> None:
    """Three messages, each sent after the previous turn's result: a string content, a list
    of text blocks, and one with the SDK's extra ``session_id``/``parent_tool_use_id``."""
    s.send(user("first hello"))
    s.wait_for(is_result)
    s.settle(1)
    s.send(user([{"type": "text", "text": "second as blocks"}]))
    s.wait_for(is_result)
    s.send({**user("third with sdk fields"), "session_id": "", "parent_tool_use_id": None})
    s.wait_for(is_result)
    s.settle(1)
    s.close()


def queued_during_turn(s: Session) -> None:
    """Two messages written at once while a 3 s turn streams."""
    s.send(user("[[slow:3]] first slow"))
    s.settle(1)
    s.send(user("queued A"))
    s.send(user("queued B"))
    s.wait_for(is_result)
    s.wait_for(is_result, 10)
    s.wait_for(is_result, 5)  # a third result would mean separate turns
    s.close()


def queued_during_tool(s: Session) -> None:
    """A message written while a tool call runs (3 s), then one more after that result."""
    s.send(user('[[bash:python3 -c "import time; time.sleep(3)"]] tool first'))
    s.wait_for(is_tool_use)
    s.settle(1)
    s.send(user("queued during tool"))
    s.wait_for(is_result, 30)
    s.wait_for(is_result, 10)
    s.close()


def interrupt_scenario(s: Session) -> None:
    """Interrupt while idle, then during a 30 s tool call, then the next message."""
    s.send(interrupt("req_idle_1"))
    s.wait_for(is_control_response, 10)
    s.send(user(LONG_TOOL))
    s.wait_for(is_tool_use)
    s.settle(2)
    s.note("note", f"processes before interrupt: {processes_matching(LONG_TOOL_MARK)}")
    s.send(interrupt("req_int_1"))
    s.wait_for(is_result, 40)
    s.settle(1)
    s.note("note", f"processes 1 s after the result: {processes_matching(LONG_TOOL_MARK)}")
    s.send(user("after interrupt"))
    s.wait_for(is_result)
    s.send(interrupt("req_idle_2"))
    s.wait_for(is_control_response, 10)
    s.close()


def interrupt_queued(s: Session) -> None:
    """Interrupt while the model streams (5 s) with two messages queued behind the turn."""
    s.send(user("[[slow:5]] slow text"))
    s.settle(1)
    s.send(user("queued X"))
    s.send(user("queued Y"))
    s.settle(1)
    s.send(interrupt("req_int_q"))
    s.wait_for(is_result, 20)
    s.wait_for(is_result, 8)
    s.wait_for(is_result, 4)
    s.close()


def eof_idle(s: Session) -> None:
    """One turn, then stdin closed while idle."""
    s.send(user("only turn"))
    s.wait_for(is_result)
    s.settle(1)
    s.close()


def eof_during_turn(s: Session) -> None:
    """stdin closed 1 s into a 3 s turn."""
    s.send(user("[[slow:3]] closing mid turn"))
    s.settle(1)
    s.close()


def eof_during_tool(s: Session) -> None:
    """stdin closed while a 30 s tool call runs."""
    s.send(user(LONG_TOOL))
    s.wait_for(is_tool_use)
    s.settle(1)
    s.close(timeout=60)
    s.note("note", f"processes after exit: {processes_matching(LONG_TOOL_MARK)}")


def bad_input(s: Session) -> None:
    """Lines it cannot use, each followed by a good message."""
    s.send("not json")
    s.settle(2)
    if s.proc.poll() is None:
        s.send({"type": "user"})
        s.settle(2)
    if s.proc.poll() is None:
        s.send(user("after bad lines"))
        s.wait_for(is_result, 20)
    s.close()


def hooks(s: Session) -> None:
    """Two turns with SessionStart/UserPromptSubmit/Stop/SessionEnd hooks registered."""
    s.send(user("hooked one"))
    s.wait_for(is_result)
    s.settle(1)
    s.send(user("hooked two"))
    s.wait_for(is_result)
    s.settle(1)
    s.close()


# --- steer (C9): --replay-user-messages, lines written mid-turn ---------------------------------


def replay_idle(s: Session) -> None:
    """``--replay-user-messages``: one message while idle, then one carrying its own
    ``uuid`` (does the echo keep it?)."""
    s.send(user("replayed hello"))
    s.wait_for(is_result)
    s.send({**user("replayed with uuid"), "uuid": "00000000-0000-4000-8000-00000000c9c9"})
    s.wait_for(is_result)
    s.settle(1)
    s.close()


def replay_during_tool(s: Session) -> None:
    """``--replay-user-messages``: two lines written while one 4 s tool call runs."""
    s.send(user('[[bash:python3 -c "import time; time.sleep(4)"]] tool first'))
    s.wait_for(is_tool_use)
    s.settle(1)
    s.send(user("steer during tool A"))
    s.settle(0.5)
    s.send(user("steer during tool B"))
    s.wait_for(is_result, 30)
    s.wait_for(is_result, 10)  # a second result would mean a turn of their own
    s.close()


def replay_during_text(s: Session) -> None:
    """``--replay-user-messages``: a line written while a 4 s text reply streams."""
    s.send(user("[[slow:4]] slow text"))
    s.settle(1.5)
    s.send(user("steer during text"))
    s.wait_for(is_result, 30)
    s.wait_for(is_result, 10)
    s.close()


def replay_at_turn_end(s: Session) -> None:
    """``--replay-user-messages``: a line written the moment the turn's last assistant
    message (after its tool call) arrives, just before its ``result``."""
    s.send(user('[[bash:echo hi]] quick tool'))
    s.wait_for(is_tool_use)
    s.wait_for(lambda e: e.get("type") == "assistant" and not is_tool_use(e))
    s.send(user("steer at turn end"))
    s.wait_for(is_result, 30)
    s.wait_for(is_result, 10)
    s.close()


REPLAY = {"replay_idle", "replay_during_tool", "replay_during_text", "replay_at_turn_end"}

SCENARIOS = {
    "two_turns": two_turns,
    "queued_during_turn": queued_during_turn,
    "queued_during_tool": queued_during_tool,
    "interrupt": interrupt_scenario,
    "interrupt_queued": interrupt_queued,
    "eof_idle": eof_idle,
    "eof_during_turn": eof_during_turn,
    "eof_during_tool": eof_during_tool,
    "bad_input": bad_input,
    "hooks": hooks,
    "replay_idle": replay_idle,
    "replay_during_tool": replay_during_tool,
    "replay_during_text": replay_during_text,
    "replay_at_turn_end": replay_at_turn_end,
}


def write_hooks(home: Path) -> Path:
    """``$HOME/.claude/settings.json`` with one command hook per ``HOOK_EVENTS`` entry that
    appends its stdin (one JSON object) as a line to the returned log."""
    log = home / "hooks.jsonl"
    script = home / "hook.sh"
    script.write_text(f'#!/bin/sh\n{{ cat; echo; }} >> "{log}"\n')
    script.chmod(0o755)
    entry = [{"hooks": [{"type": "command", "command": str(script), "timeout": 20}]}]
    (home / ".claude").mkdir(parents=True, exist_ok=True)
    (home / ".claude" / "settings.json").write_text(json.dumps({"hooks": {e: entry for e in HOOK_EVENTS}}))
    return log


def normalise(text: str, *, home: Path, session: str | None) -> str:
    for path, stable in ((home.resolve(), "/home/dev"), (home, "/home/dev"), (CLI_DIR.resolve(), "/opt/agent-clis")):
        text = text.replace(str(path), stable)
    if session:
        text = text.replace(session, SESSION_ID)
    return re.sub(r"/home/dev/work\b", "/home/dev/project", text)


def session_of(lines: list[str]) -> str | None:
    for line in lines:
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and isinstance(event.get("session_id"), str) and event["session_id"]:
            return event["session_id"]
    return None


def record(name: str) -> list[dict]:
    print(f"recording {name}", file=sys.stderr)
    home = Path(tempfile.mkdtemp(prefix="stream-input-"))
    try:
        work = home / "work"
        work.mkdir()
        log = write_hooks(home) if name == "hooks" else None
        with AnthropicAPI() as api:
            session = Session(name, api, home, work)
            try:
                SCENARIOS[name](session)
            finally:
                if session.proc.poll() is None:
                    session.proc.kill()
                    session.proc.wait()
        sid = session_of(session.stdout)
        (FIXTURES / f"{name}.jsonl").write_text(
            normalise("\n".join(session.stdout), home=home, session=sid) + "\n")
        if log is not None and log.exists():
            hook_lines = [line for line in log.read_text().splitlines() if line.strip()]
            (FIXTURES / f"{name}_hooks.jsonl").write_text(
                normalise("\n".join(hook_lines), home=home, session=sid) + "\n")
        return [json.loads(normalise(json.dumps(item), home=home, session=sid)) for item in session.timeline]
    finally:
        shutil.rmtree(home, ignore_errors=True)


def merge(path: Path, names: list[str], fresh: list[dict]) -> None:
    """Replace the rows of ``names`` in the JSON-lines file ``path`` with ``fresh``."""
    kept = []
    if path.exists():
        kept = [row for row in map(json.loads, path.read_text().splitlines()) if row["scenario"] not in names]
    order = list(SCENARIOS)
    rows = sorted(kept + fresh, key=lambda row: order.index(row["scenario"]) if row["scenario"] in order else 99)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def main(names: list[str]) -> None:
    names = names or list(SCENARIOS)
    if not os.access(DEFAULT_BINS["claude"], os.X_OK):
        sys.exit(f"claude is not installed at {DEFAULT_BINS['claude']}: run scripts/install_agent_clis.sh")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    timeline = []
    for name in names:
        timeline += record(name)
    merge(FIXTURES / "timeline.jsonl", names, timeline)
    stdin = [{"scenario": r["scenario"], "at_s": r["at_s"], "line": r["line"]} for r in timeline if r["stream"] == "in"]
    merge(FIXTURES / "stdin.jsonl", names, stdin)


if __name__ == "__main__":
    main(sys.argv[1:])
