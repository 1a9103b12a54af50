#!/usr/bin/env python
"""Hook latency (SPEC I1: under 300 ms median whatever the network does).

Times ``python -m machine.hooks claude`` end to end as an agent CLI runs it (a fresh
interpreter, the payload on stdin, until the process has exited), over a realistic
mix of Claude Code payloads (a turn: UserPromptSubmit, Stop; every 10th turn with a
background task), in three conditions, each with a fresh hook state directory:

- ``up``: ``--server URL --token T`` of a running RunStead (the sender delivers while
  the hooks run);
- ``down``: a closed port on this host (connection refused at once; the sender retries);
- ``unreachable``: a non-routable address (10.255.255.1: connects hang until timeout).

Prints median, p99 and max in milliseconds per condition, and (up) how long after the
last hook the sender had delivered every write.

Then the tool hooks of I7 (``PreToolUse`` / ``PostToolUse`` of a session whose turn is
open and not yet past half of its marker class: nothing due, so the hook only reads its
local state: no outbox write, no network, no sender) beside the same interpreter doing
nothing (``python -c pass``, and ``python -S -c pass``: the hook command runs with
``-S``), run in turn so all see the same load: p50 and p99 of each and of the
differences, the hook's own share, which I7 bounds at 50 ms. The hooks run as
``install_hooks`` writes them (``install.hook_argv``), their bytecode written first. Usage::

    .venv/bin/python bench/hook_latency.py --server http://127.0.0.1:8000 --token TOKEN [-n 200]

Without ``--server`` only ``down`` and ``unreachable`` run. Senders it started are
stopped at the end.
"""
import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from machine.hooks import install, launch, store  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "hooks" / "claude"


def payloads(n: int):
    prompt = json.loads((FIXTURES / "user_prompt_submit.json").read_text())
    stop = json.loads((FIXTURES / "stop.json").read_text())
    stop_bg = json.loads((FIXTURES / "stop_background_running.json").read_text())
    session = str(uuid.uuid4())
    for i in range(n):
        if i % 2 == 0:
            yield {**prompt, "session_id": session, "prompt_id": f"p{i}"}
        else:
            yield {**(stop_bg if i % 20 == 1 else stop), "session_id": session, "prompt_id": f"p{i - 1}"}


def measure(server: str, token: str, n: int, drain: bool) -> tuple[list[float], float | None]:
    with tempfile.TemporaryDirectory(prefix="hook-bench-") as tmp:
        state_dir = Path(tmp) / "hooks"
        store.write_config(state_dir, server=server, token=token)
        env = {**os.environ, "RUNSTEAD_HOOK_DIR": str(state_dir), "PYTHONPATH": str(ROOT)}
        argv = install.hook_argv("claude", state_dir)
        times = []
        try:
            for payload in payloads(n):
                data = json.dumps(payload).encode()
                start = time.perf_counter()
                result = subprocess.run(argv, input=data, env=env, cwd="/", capture_output=True)
                times.append((time.perf_counter() - start) * 1000)
                assert result.returncode == 0 and result.stdout == b"", result
            drained_s = None
            if drain:  # the service is up: how long until the sender delivered everything
                last = time.perf_counter()
                with store.Outbox(state_dir) as outbox:
                    while outbox.pending() and time.perf_counter() - last < 60:
                        time.sleep(0.01)
                    if not outbox.pending():
                        drained_s = time.perf_counter() - last
        finally:
            pid = launch.sender_pid(state_dir)
            if pid:
                os.kill(pid, signal.SIGTERM)
        return times, drained_s


def percentile(times: list[float], q: float) -> float:
    """The ``q`` quantile (0-1) of ``times`` by nearest rank."""
    ordered = sorted(times)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def measure_tool_hooks(n: int) -> tuple[list[float], list[float], list[float]]:
    """I7: ``n`` tool hook calls with nothing due, ``n`` runs of ``python -c pass`` and
    ``n`` of ``python -S -c pass`` (the hook command's own flag), in turn; returns the
    three lists of milliseconds. Fails if a tool hook queued a write."""
    with tempfile.TemporaryDirectory(prefix="hook-bench-") as tmp:
        state_dir = Path(tmp) / "hooks"
        store.write_config(state_dir, server="http://127.0.0.1:9", token="bench")
        session = str(uuid.uuid4())
        with store.Outbox(state_dir) as outbox:  # a turn opened just now (due after 10 min)
            with outbox.transaction():
                outbox.save_session_state(f"claude:{session}", {"created": True, "turn": "p0", "turn_at": time.time()})
            queued = len(outbox.rows())
        env = {**os.environ, "RUNSTEAD_HOOK_DIR": str(state_dir), "PYTHONPATH": str(ROOT)}
        hook = install.hook_argv("claude", state_dir)
        baselines = ([sys.executable, "-c", "pass"], [sys.executable, "-S", "-c", "pass"])
        tool, bare, bare_s = [], [], []
        for i in range(n):
            payload = {"session_id": session, "hook_event_name": "PostToolUse" if i % 2 else "PreToolUse",
                       "tool_name": "Bash", "tool_input": {"command": "ls"}, "tool_use_id": f"toolu_{i}",
                       "cwd": "/tmp", "transcript_path": "/tmp/t.jsonl", "permission_mode": "default"}
            data = json.dumps(payload).encode()
            for argv, times, stdin in ((hook, tool, data), (baselines[0], bare, b""), (baselines[1], bare_s, b"")):
                start = time.perf_counter()
                result = subprocess.run(argv, input=stdin, env=env, cwd="/", capture_output=True)
                times.append((time.perf_counter() - start) * 1000)
                assert result.returncode == 0 and result.stdout == b"", result
        with store.Outbox(state_dir) as outbox:
            assert len(outbox.rows()) == queued, "a tool hook with nothing due queued a write"
        assert launch.sender_pid(state_dir) is None, "a tool hook with nothing due started the sender"
        return tool, bare, bare_s


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--server")
    parser.add_argument("--token", default="bench")
    parser.add_argument("-n", type=int, default=200)
    args = parser.parse_args()
    install.compile_hook_modules()  # as install_hooks does
    conditions = []
    if args.server:
        conditions.append(("up", args.server))
    conditions += [("down", "http://127.0.0.1:9"), ("unreachable", "http://10.255.255.1:8000")]
    print(f"load average at start: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")
    print(f"{'condition':<12} {'n':>5} {'median ms':>10} {'p99 ms':>8} {'max ms':>8}  delivered")
    for name, server in conditions:
        times, drained_s = measure(server, args.token, args.n, drain=name == "up")
        times.sort()
        p99 = times[min(len(times) - 1, int(round(0.99 * (len(times) - 1))))]
        tail = f"all {drained_s:.2f} s after the last hook" if drained_s is not None else "-"
        print(f"{name:<12} {len(times):>5} {statistics.median(times):>10.1f} {p99:>8.1f} {times[-1]:>8.1f}  {tail}")
    tool, bare, bare_s = measure_tool_hooks(args.n)
    own = [t - b for t, b in zip(tool, bare)]
    own_s = [t - b for t, b in zip(tool, bare_s)]
    print(f"\nI7 tool hook, nothing due (n={len(tool)}, load average now {os.getloadavg()[0]:.1f})")
    print(f"{'':<26} {'p50 ms':>8} {'p99 ms':>8} {'max ms':>8}")
    for name, times in (("tool hook", tool), ("python -c pass", bare), ("python -S -c pass", bare_s),
                        ("own share (vs -c pass)", own), ("own share (vs -S -c pass)", own_s)):
        print(f"{name:<26} {percentile(times, 0.5):>8.1f} {percentile(times, 0.99):>8.1f} {max(times):>8.1f}")


if __name__ == "__main__":
    main()
