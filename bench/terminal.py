#!/usr/bin/env python
"""Terminal sessions (SPEC T3, T4, I1): two figures.

1. The Claude Code ``Stop`` hook's own time (``install_hooks``' command, a fresh
   interpreter, the payload on stdin, until it exited), in turn with ``python -S -c pass``
   (the same interpreter doing nothing), ``-n`` times each:

   - ``stop, nothing waits``: the common Stop (I1): one ``listdir`` of the session's inbox,
     then the usual marker write; its ``config.json`` names a server that accepts and
     never answers, so a network call on that path would cost at least the claim timeout
     (1 s) and show in every figure;
   - ``stop, a message waits``: a message recorded in the inbox before each run (as the
     worker records it); the hook takes it, claims it by HTTP from a local stand-in that
     answers at once (so the figure is the hook's own work plus one loopback round trip,
     not the service's claim), and prints the block.

2. With ``--sessions N`` (default 50): ``N`` terminal wrappers (``python -m
   machine.terminal``), each around a stand-in terminal UI (``tests/agents/raw_agent.py``)
   in its own pseudo-terminal, all idle; then ``-m`` messages, one at a time to a session
   picked in turn: from the worker's record in the inbox (``machine.inbox.record``, what
   the worker does when a message arrives, before its ack) to the Enter after the paste
   reaching the agent. The service -> worker leg is the pull's (bench/README.md).

Usage::

    .venv/bin/python bench/terminal.py [-n 100] [--sessions 50] [-m 200] [--out FILE]
"""
import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.harness import lat, report_save, report_start  # noqa: E402
from machine import inbox  # noqa: E402
from machine.hooks import install, launch, store  # noqa: E402
from machine.hooks.mapping import session_uuid  # noqa: E402

STOP = json.loads((ROOT / "tests" / "fixtures" / "hooks" / "claude" / "stop.json").read_text())
RAW_AGENT = ROOT / "tests" / "agents" / "raw_agent.py"


class Claims(BaseHTTPRequestHandler):
    """The service's claim, answered at once: 200 with the message."""

    def log_message(self, *args):
        pass

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        body = json.dumps({"seq": 1, "state": "delivered", "text": "bench message"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def stop_hook(n: int) -> dict:
    tmp = Path(tempfile.mkdtemp(prefix="term-bench-"))
    silent = socket.socket()  # accepts (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(64)
    claims = ThreadingHTTPServer(("127.0.0.1", 0), Claims)
    threading.Thread(target=claims.serve_forever, daemon=True).start()
    idle_dir, busy_dir = tmp / "idle", tmp / "waiting"
    store.write_config(idle_dir, server=f"http://127.0.0.1:{silent.getsockname()[1]}", token="t")
    store.write_config(busy_dir, server=f"http://127.0.0.1:{claims.server_address[1]}", token="t")
    install.compile_hook_modules()
    agent_session = str(uuid.uuid4())
    session_id = session_uuid("claude", agent_session)
    bare, idle, waiting = [], [], []
    try:
        for i in range(n):
            payload = json.dumps({**STOP, "session_id": agent_session, "prompt_id": f"p{i}"}).encode()
            inbox.record(str(busy_dir), {"session_id": session_id, "message_id": str(uuid.uuid4()), "seq": i + 1,
                                         "text": "bench message", "channel": "hook"})
            runs = (([sys.executable, "-S", "-c", "pass"], None, bare, b""),
                    (install.hook_argv("claude", idle_dir), idle_dir, idle, b""),
                    (install.hook_argv("claude", busy_dir), busy_dir, waiting, b'"decision": "block"'))
            for argv, state_dir, times, expect in runs:
                env = {**os.environ, "PYTHONPATH": str(ROOT)}
                if state_dir:
                    env["RUNSTEAD_HOOK_DIR"] = str(state_dir)
                start = time.perf_counter()
                result = subprocess.run(argv, input=payload if state_dir else b"", env=env, cwd="/", capture_output=True)
                times.append(time.perf_counter() - start)
                assert result.returncode == 0 and expect in result.stdout and (expect or not result.stdout), result
    finally:
        for state_dir in (idle_dir, busy_dir):
            pid = launch.sender_pid(state_dir)
            if pid:
                os.kill(pid, signal.SIGTERM)
        claims.shutdown()
        silent.close()
    return {"python -S -c pass": lat(bare), "stop, nothing waits": lat(idle), "stop, a message waits": lat(waiting),
            "own share, nothing waits (p50 difference ms)": round((sorted(idle)[n // 2] - sorted(bare)[n // 2]) * 1000, 1),
            "own share, a message waits (p50 difference ms)":
                round((sorted(waiting)[n // 2] - sorted(bare)[n // 2]) * 1000, 1)}


def typed_latency(sessions: int, messages: int, quiet_s: float) -> dict:
    from ptyprocess import PtyProcess

    tmp = Path(tempfile.mkdtemp(prefix="term-bench-"))
    hook_dir = tmp / "hooks"
    wrappers = []
    try:
        for i in range(sessions):
            session_id, log = str(uuid.uuid4()), tmp / f"agent{i}.log"
            env = {**os.environ, "PYTHONPATH": str(ROOT), "RUNSTEAD_HOOK_DIR": str(hook_dir), "TERM": "xterm-256color",
                   "RUNSTEAD_TERMINAL_QUIET_S": str(quiet_s), "RAW_AGENT_LOG": str(log),
                   "RAW_AGENT_SESSION": session_id}
            proc = PtyProcess.spawn([sys.executable, "-m", "machine.terminal", sys.executable, str(RAW_AGENT)], env=env)
            wrappers.append((proc, session_id, log))
        drain = threading.Event()

        def drain_all():  # read every pty so no wrapper blocks on its output
            while not drain.is_set():
                for proc, _, _ in wrappers:
                    try:
                        os.set_blocking(proc.fd, False)
                        os.read(proc.fd, 65536)
                    except (BlockingIOError, OSError):
                        pass
                time.sleep(0.01)

        threading.Thread(target=drain_all, daemon=True).start()
        deadline = time.monotonic() + 60
        while not all(log.exists() for _, _, log in wrappers):
            assert time.monotonic() < deadline, "the agents did not start"
            time.sleep(0.05)
        times = []
        for k in range(messages):
            _, session_id, log = wrappers[k % sessions]
            before = log.stat().st_size
            start = time.perf_counter()
            inbox.record(str(hook_dir), {"session_id": session_id, "message_id": str(uuid.uuid4()), "seq": k + 1,
                                         "text": f"message {k}", "channel": "terminal"})
            deadline = time.monotonic() + 10
            while True:
                with open(log, "rb") as handle:
                    handle.seek(before)
                    if b"b'\\r'" in handle.read():
                        break
                assert time.monotonic() < deadline, f"message {k} not typed"
                time.sleep(0.002)
            times.append(time.perf_counter() - start)
        drain.set()
        return {"sessions": sessions, "recorded -> Enter typed": lat(times)}
    finally:
        for proc, _, _ in wrappers:
            try:
                proc.terminate(force=True)
            except Exception:  # noqa: BLE001
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", type=int, default=100, help="Stop hook runs per case")
    parser.add_argument("--sessions", type=int, default=50)
    parser.add_argument("-m", "--messages", type=int, default=200)
    parser.add_argument("--quiet-s", type=float, default=0.0, help="RUNSTEAD_TERMINAL_QUIET_S of the wrappers")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "terminal.json")
    args = parser.parse_args()
    report = report_start("terminal", n=args.n)
    if args.n:
        report["stop_hook"] = stop_hook(args.n)
        print(json.dumps(report["stop_hook"], indent=2))
    if args.sessions:
        report["typed"] = typed_latency(args.sessions, args.messages, args.quiet_s)
        print(json.dumps(report["typed"], indent=2))
    print(report_save(report, args.out))


if __name__ == "__main__":
    main()
