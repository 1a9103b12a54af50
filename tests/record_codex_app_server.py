"""Records how the real Codex CLI's ``codex app-server`` behaves on stdio, offline
(docs/codex-app-server.md), into tests/fixtures/codex_app_server/.

    .venv/bin/python tests/record_codex_app_server.py [scenario ...]

Each scenario starts one long-lived ``codex app-server`` (JSON-RPC 2.0 messages, one JSON
object per line, without the ``"jsonrpc"`` member) against the local fake Responses API
(tests.model_apis.ResponsesAPI) with ``tests.agent_clis.offline("codex", ...)``, writes
requests to its stdin at set moments and reads its stdout line by line. Every scenario
opens the same way (``handshake``): ``initialize``, the ``initialized`` notification,
``thread/start`` (the work folder, ``approvalPolicy: "never"``, ``sandbox:
"workspace-write"``), except ``bad_input`` which starts with lines it cannot use.

Written per scenario: ``<scenario>.jsonl``, the raw stdout lines in order, made stable:
the temporary HOME becomes ``/home/dev`` (the work folder ``/home/dev/project``), the
thread id ``THREAD_1``, turn ids ``TURN_1``, ``TURN_2``... in order of appearance,
``installationId`` ``INSTALLATION_ID``. For all scenarios together ``stdin.jsonl``
(``{"scenario", "at_s", "line"}``, ``"<EOF>"`` for closing stdin) and ``timeline.jsonl``
(``{"scenario", "at_s", "stream": "in"|"out"|"err"|"note"|"exit", "line"}``: stdin,
stdout, stderr and notes interleaved as they happened, the exit code last).
The protocol's JSON Schema (``codex app-server generate-json-schema --out DIR``) is not
kept (about 2 MB); ``schema_methods.json`` lists its method names per direction.
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

from tests.agent_clis import CLI_DIR, DEFAULT_BINS, offline  # noqa: E402
from tests.model_apis import ResponsesAPI  # noqa: E402

FIXTURES = BASE_DIR / "tests" / "fixtures" / "codex_app_server"
LONG_TOOL = '[[bash:python3 -c "import time; time.sleep(30)"; echo slept]] long tool'
LONG_TOOL_MARK = "time.sleep(30)"
TOOL_4S = '[[bash:python3 -c "import time; time.sleep(4)"; echo slept]] tool first'


def text_input(text: str) -> list[dict]:
    return [{"type": "text", "text": text}]


def method_is(name: str):
    return lambda event: event.get("method") == name


def answer_to(request_id):
    return lambda event: "method" not in event and event.get("id") == request_id


def item_started(item_type: str):
    return lambda e: e.get("method") == "item/started" and (e["params"].get("item") or {}).get("type") == item_type


def processes_matching(mark: str) -> list[str]:
    """``pid ppid etimes comm`` of the processes whose command line contains ``mark``
    (the sandbox wrapper's own command line is long: its name says what it is)."""
    out = subprocess.run(["ps", "-eo", "pid=,ppid=,etimes=,comm=,args="], capture_output=True, text=True).stdout
    return [" ".join(line.split()[:4]) for line in out.splitlines() if mark in line and "ps -eo" not in line]


class Session:
    """One running ``codex app-server``: ``request`` / ``notify`` write a line, ``wait_for``
    an output event, ``close`` stdin. ``thread_id`` and ``turn_id`` are the last seen."""

    def __init__(self, name: str, api: ResponsesAPI, home: Path, work: Path):
        self.name, self.work = name, work
        self.timeline: list[dict] = []
        self.stdout: list[str] = []
        self._events: queue.Queue = queue.Queue()
        self._next_id = 0
        self.thread_id: str | None = None
        self.turn_id: str | None = None
        env = offline("codex", home, api).process_env()
        self.t0 = time.monotonic()
        self.proc = subprocess.Popen([str(DEFAULT_BINS["codex"]), "app-server"], cwd=work, env=env,
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
            if stream != "out":
                continue
            self.stdout.append(line)
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if isinstance(event, dict):
                turn = (event.get("params") or {}).get("turn") or (event.get("result") or {}).get("turn")
                if isinstance(turn, dict) and turn.get("id"):
                    self.turn_id = turn["id"]
                self._events.put(event)

    def send(self, line) -> None:
        text = line if isinstance(line, str) else json.dumps(line)
        self.note("in", text)
        try:
            self.proc.stdin.write((text + "\n").encode())
            self.proc.stdin.flush()
        except (BrokenPipeError, ValueError):
            self.note("note", "stdin is closed: the line was not written")

    def request(self, method: str, params: dict | None = None) -> int:
        self._next_id += 1
        self.send({"id": self._next_id, "method": method, **({"params": params} if params is not None else {})})
        return self._next_id

    def call(self, method: str, params: dict | None = None, timeout: float = 30) -> dict | None:
        """A request and its answer (a ``result`` or an ``error`` object)."""
        return self.wait_for(answer_to(self.request(method, params)), timeout)

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

    def handshake(self) -> None:
        self.call("initialize", {"clientInfo": {"name": "runstead-recorder", "version": "0"}})
        self.send({"method": "initialized"})
        answer = self.call("thread/start", {"cwd": str(self.work), "approvalPolicy": "never",
                                            "sandbox": "workspace-write"})
        self.thread_id = answer["result"]["thread"]["id"]

    def turn(self, text: str, **extra) -> dict | None:
        """``turn/start`` with ``text``; its answer."""
        return self.call("turn/start", {"threadId": self.thread_id, "input": text_input(text), **extra})

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

TURN_DONE = method_is("turn/completed")


def three_turns(s: Session) -> None:
    """Three messages in one thread, each after the previous ``turn/completed``; the
    second carries a ``clientUserMessageId``; then stdin closed while idle."""
    s.handshake()
    s.turn("first hello")
    s.wait_for(TURN_DONE)
    s.turn("second hello", clientUserMessageId="rs-msg-2")
    s.wait_for(TURN_DONE)
    s.turn("third hello")
    s.wait_for(TURN_DONE)
    s.settle(1)
    s.close()


def tool_turn(s: Session) -> None:
    """One turn whose model runs a shell command (``echo hi``)."""
    s.handshake()
    s.turn("[[bash:echo hi]] quick tool")
    s.wait_for(TURN_DONE)
    s.settle(0.5)
    s.close()


def interrupt_tool(s: Session) -> None:
    """``turn/interrupt`` during a 30 s command, the next message in the same thread, then
    ``turn/interrupt`` of that finished turn (nothing running)."""
    s.handshake()
    s.turn(LONG_TOOL)
    started = s.wait_for(item_started("commandExecution"))
    s.settle(2)
    s.note("note", f"processes before interrupt: {processes_matching(LONG_TOOL_MARK)}")
    turn_id = (started or {}).get("params", {}).get("turnId") or s.turn_id
    s.call("turn/interrupt", {"threadId": s.thread_id, "turnId": turn_id})
    s.wait_for(TURN_DONE, 40)
    s.settle(1)
    s.note("note", f"processes 1 s after turn/completed: {processes_matching(LONG_TOOL_MARK)}")
    s.turn("after interrupt")
    s.wait_for(TURN_DONE)
    s.call("turn/interrupt", {"threadId": s.thread_id, "turnId": s.turn_id}, timeout=10)
    s.settle(5)
    s.note("note", f"processes 7 s after turn/completed: {processes_matching(LONG_TOOL_MARK)}")
    s.close()
    s.note("note", f"processes after exit: {processes_matching(LONG_TOOL_MARK)}")


def interrupt_text(s: Session) -> None:
    """``turn/interrupt`` while a 4 s text reply streams."""
    s.handshake()
    s.turn("[[slow:4]] slow text")
    s.wait_for(method_is("item/agentMessage/delta"))
    s.call("turn/interrupt", {"threadId": s.thread_id, "turnId": s.turn_id})
    s.wait_for(TURN_DONE, 20)
    s.turn("after interrupt")
    s.wait_for(TURN_DONE)
    s.close()


def steer_during_tool(s: Session) -> None:
    """``turn/steer`` (with ``expectedTurnId`` and a ``clientUserMessageId``) while a 4 s
    command runs."""
    s.handshake()
    s.turn(TOOL_4S)
    s.wait_for(item_started("commandExecution"))
    s.settle(1)
    s.call("turn/steer", {"threadId": s.thread_id, "expectedTurnId": s.turn_id,
                          "input": text_input("steer during tool"), "clientUserMessageId": "rs-steer-1"})
    s.wait_for(TURN_DONE, 30)
    s.wait_for(TURN_DONE, 8)  # a second turn/completed would mean a turn of its own
    s.close()


def steer_during_text(s: Session) -> None:
    """``turn/steer`` while a 4 s text reply streams (no tool call in the turn)."""
    s.handshake()
    s.turn("[[slow:4]] slow text")
    s.wait_for(method_is("item/agentMessage/delta"))
    s.settle(1)
    s.call("turn/steer", {"threadId": s.thread_id, "expectedTurnId": s.turn_id,
                          "input": text_input("steer during text"), "clientUserMessageId": "rs-steer-2"})
    s.wait_for(TURN_DONE, 30)
    s.wait_for(TURN_DONE, 8)
    s.close()


def steer_refused(s: Session) -> None:
    """``turn/steer`` with no turn running, then with a wrong ``expectedTurnId`` while one
    runs."""
    s.handshake()
    s.turn("first hello")
    s.wait_for(TURN_DONE)
    s.call("turn/steer", {"threadId": s.thread_id, "expectedTurnId": s.turn_id, "input": text_input("steer idle")})
    s.turn("[[slow:3]] slow text")
    s.wait_for(method_is("item/agentMessage/delta"))
    s.call("turn/steer", {"threadId": s.thread_id, "expectedTurnId": "not-the-turn",
                          "input": text_input("steer wrong turn")})
    s.wait_for(TURN_DONE, 20)
    s.wait_for(TURN_DONE, 5)
    s.close()


def steer_then_interrupt(s: Session) -> None:
    """``turn/steer`` accepted during a 30 s command, then ``turn/interrupt`` before the
    command ends (the steer was never taken into a model request), then a ``turn/start``:
    where the accepted steer goes (C9: never lost, never twice)."""
    s.handshake()
    s.turn(LONG_TOOL)
    s.wait_for(item_started("commandExecution"))
    s.settle(1)
    turn_id = s.turn_id
    s.call("turn/steer", {"threadId": s.thread_id, "expectedTurnId": turn_id,
                          "input": text_input("steer before interrupt"), "clientUserMessageId": "rs-steer-3"})
    s.settle(1)
    s.call("turn/interrupt", {"threadId": s.thread_id, "turnId": turn_id})
    s.wait_for(TURN_DONE, 40)
    s.wait_for(TURN_DONE, 5)  # a turn of its own for the pending steer?
    s.turn("after interrupt", clientUserMessageId="rs-after")
    s.wait_for(TURN_DONE, 30)
    s.close()


def start_during_turn(s: Session) -> None:
    """A second ``turn/start`` while a 3 s text turn streams."""
    s.handshake()
    s.turn("[[slow:3]] slow text")
    s.wait_for(method_is("item/agentMessage/delta"))
    s.turn("started during turn")
    s.wait_for(TURN_DONE, 20)
    s.wait_for(TURN_DONE, 10)
    s.close()


def eof_during_turn(s: Session) -> None:
    """stdin closed 1 s into a 3 s text turn."""
    s.handshake()
    s.turn("[[slow:3]] closing mid turn")
    s.settle(1)
    s.close()


def eof_during_tool(s: Session) -> None:
    """stdin closed while a 30 s command runs."""
    s.handshake()
    s.turn(LONG_TOOL)
    s.wait_for(item_started("commandExecution"))
    s.settle(1)
    s.close(timeout=45)
    s.note("note", f"processes after exit: {processes_matching(LONG_TOOL_MARK)}")


def bad_input(s: Session) -> None:
    """A request before ``initialize``, a line that is not JSON, an unknown method, then
    the handshake and a turn."""
    s.call("thread/start", {}, timeout=5)
    s.send("not json")
    s.settle(1)
    if s.proc.poll() is None:
        s.call("no/such/method", {}, timeout=5)
    if s.proc.poll() is None:
        s.handshake()
        s.turn("after bad lines")
        s.wait_for(TURN_DONE, 20)
    s.close()


SCENARIOS = {
    "three_turns": three_turns,
    "tool_turn": tool_turn,
    "interrupt_tool": interrupt_tool,
    "interrupt_text": interrupt_text,
    "steer_during_tool": steer_during_tool,
    "steer_during_text": steer_during_text,
    "steer_refused": steer_refused,
    "steer_then_interrupt": steer_then_interrupt,
    "start_during_turn": start_during_turn,
    "eof_during_turn": eof_during_turn,
    "eof_during_tool": eof_during_tool,
    "bad_input": bad_input,
}


class Stable:
    """Makes a scenario's lines stable (module docstring)."""

    def __init__(self, home: Path):
        self.home = home
        self.names: dict[str, str] = {}

    def name(self, value: str, prefix: str) -> str:
        if value not in self.names:
            count = sum(1 for v in self.names.values() if v.startswith(prefix + "_"))
            self.names[value] = f"{prefix}_{count + 1}"
        return self.names[value]

    def learn(self, lines: list[str]) -> None:
        for line in lines:
            for match in re.finditer(r'"(threadId|turnId|rootTurnId|id|installationId)":\s*"([0-9a-f-]{36})"', line):
                key, value = match.groups()
                if key == "installationId":
                    self.names.setdefault(value, "INSTALLATION_ID")
                elif key == "threadId" or (key == "id" and f'"thread":{{"id":"{value}"' in line.replace(" ", "")):
                    self.name(value, "THREAD")
                elif key in ("turnId", "rootTurnId") or (key == "id" and f'"turn":{{"id":"{value}"' in line.replace(" ", "")):
                    self.name(value, "TURN")

    def __call__(self, text: str) -> str:
        for path, stable in ((self.home.resolve(), "/home/dev"), (self.home, "/home/dev"),
                             (CLI_DIR.resolve(), "/opt/agent-clis")):
            text = text.replace(str(path), stable)
        for value, stable in self.names.items():
            text = text.replace(value, stable)
        return re.sub(r"/home/dev/work\b", "/home/dev/project", text)


def record(name: str) -> list[dict]:
    print(f"recording {name}", file=sys.stderr)
    home = Path(tempfile.mkdtemp(prefix="codex-app-server-"))
    try:
        work = home / "work"
        work.mkdir()
        with ResponsesAPI() as api:
            session = Session(name, api, home, work)
            try:
                SCENARIOS[name](session)
            finally:
                if session.proc.poll() is None:
                    session.proc.kill()
                    session.proc.wait()
        stable = Stable(home)
        stable.learn(session.stdout)
        (FIXTURES / f"{name}.jsonl").write_text(stable("\n".join(session.stdout)) + "\n")
        return [json.loads(stable(json.dumps(item))) for item in session.timeline]
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


def schema_methods() -> dict:
    """The method names ``generate-json-schema`` lists, per direction."""
    out = Path(tempfile.mkdtemp(prefix="codex-schema-"))
    try:
        subprocess.run([str(DEFAULT_BINS["codex"]), "app-server", "generate-json-schema", "--out", str(out)],
                       check=True, capture_output=True)
        methods = {}
        for kind in ("ClientRequest", "ClientNotification", "ServerRequest", "ServerNotification"):
            schema = json.loads((out / f"{kind}.json").read_text())
            methods[kind] = [v["properties"]["method"]["enum"][0] for v in schema.get("oneOf", [])
                             if v.get("properties", {}).get("method", {}).get("enum")]
        return methods
    finally:
        shutil.rmtree(out, ignore_errors=True)


def main(names: list[str]) -> None:
    names = names or list(SCENARIOS)
    if not os.access(DEFAULT_BINS["codex"], os.X_OK):
        sys.exit(f"codex is not installed at {DEFAULT_BINS['codex']}: run scripts/install_agent_clis.sh")
    FIXTURES.mkdir(parents=True, exist_ok=True)
    (FIXTURES / "schema_methods.json").write_text(json.dumps(schema_methods(), indent=1) + "\n")
    timeline = []
    for name in names:
        timeline += record(name)
    merge(FIXTURES / "timeline.jsonl", names, timeline)
    stdin = [{"scenario": r["scenario"], "at_s": r["at_s"], "line": r["line"]} for r in timeline if r["stream"] == "in"]
    merge(FIXTURES / "stdin.jsonl", names, stdin)


if __name__ == "__main__":
    main(sys.argv[1:])
