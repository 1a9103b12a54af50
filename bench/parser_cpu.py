#!/usr/bin/env python3
"""Measures the worker's CPU cost of following and parsing a fast agent stream (G2).

Not a test: prints figures. Two measurements with Claude stream-json events (~1 KiB
each, a text block and a tool call, like a busy agent):

1. throughput: parse a pre-written file as fast as possible (CPU seconds per MB);
2. a live agent: a child process writes ``--rate`` events per second for ``--seconds``
   into an output file while an ``AgentObserver`` polls it 5 times a second (as the
   worker's watch loop does); prints this process's CPU use (user + system) as a
   percentage of one core over the run;
3. the whole worker: an in-process ``Worker`` (all its threads: poller, runner with
   the watch loop and parser, renewer, progress sender, outbox sender) against
   ``InMemoryService`` runs a profile (``parser = "claude"``) whose agent prints the same
   stream on stdout; CPU of this process only (the agent is a child, not counted).

Usage: ``.venv/bin/python bench/parser_cpu.py [--rate 2000] [--seconds 10]``
"""
import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from machine.worker.observe import AgentObserver  # noqa: E402
from machine.worker.parsers import make_parser  # noqa: E402

WRITER = r"""
import json, sys, time
rate, seconds, path = float(sys.argv[1]), float(sys.argv[2]), sys.argv[3]
event = {"type": "assistant", "message": {"id": "", "content": [{"type": "text", "text": "x" * 700},
         {"type": "tool_use", "id": "", "name": "Bash", "input": {"command": "ls"}}],
         "usage": {"input_tokens": 10, "output_tokens": 5}}}
start = time.monotonic(); n = 0
with open(path, "ab", buffering=0) as f:
    while time.monotonic() - start < seconds:
        due = int((time.monotonic() - start) * rate)
        batch = []
        while n < due:
            event["message"]["id"] = f"m{n}"; event["message"]["content"][1]["id"] = f"t{n}"
            batch.append(json.dumps(event)); n += 1
        if batch:
            f.write(("\n".join(batch) + "\n").encode())
        time.sleep(0.01)
    f.write(b'{"type":"result","subtype":"success","is_error":false,"num_turns":%d}\n' % n)
print(n)
"""


def cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def throughput(mb: int) -> tuple[float, float]:
    event = {"type": "assistant", "message": {"id": "m", "content": [{"type": "text", "text": "x" * 700},
             {"type": "tool_use", "id": "t", "name": "Bash", "input": {"command": "ls"}}],
             "usage": {"input_tokens": 10, "output_tokens": 5}}}
    lines = []
    for i in range(2000):
        event["message"]["id"] = f"m{i}"
        event["message"]["content"][1]["id"] = f"t{i}"
        lines.append(json.dumps(event))
    block = ("\n".join(lines) + "\n").encode()
    parser = make_parser("claude")
    total = 0
    start = cpu()
    while total < mb * 1024 * 1024:
        for i in range(0, len(block), 65536):
            parser.feed(block[i:i + 65536])
        total += len(block)
    used = cpu() - start
    return total / 1024 / 1024, used


def live(rate: float, seconds: float) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "output.log").write_bytes(b"")
        observer = AgentObserver(parser="claude", op_dir=tmp, folder=tmp)
        writer = subprocess.Popen([sys.executable, "-c", WRITER, str(rate), str(seconds), str(Path(tmp, "output.log"))],
                                  stdout=subprocess.PIPE, text=True)
        start_cpu, start_wall = cpu(), time.monotonic()
        while writer.poll() is None:
            observer.poll()
            time.sleep(0.2)
        observer.finish()
        used, wall = cpu() - start_cpu, time.monotonic() - start_wall
        written = int(writer.stdout.read().strip() or 0)
        size = os.path.getsize(Path(tmp, "output.log"))
    facts = observer.final_extras()
    return {"events": written, "mb": size / 1024 / 1024, "wall_s": wall, "cpu_s": used,
            "cpu_percent_of_one_core": 100 * used / wall, "turns_parsed": facts["usage"]["turns"]}


def whole_worker(rate: float, seconds: float) -> dict:
    import tomllib
    import uuid

    from machine.worker.clock import SYSTEM_CLOCK
    from machine.worker.config import parse_config
    from machine.worker.loop import Worker, WorkerOptions
    from machine.worker.store import StateDir, Store
    from machine.worker.testing import InMemoryService

    writer = WRITER.replace('with open(path, "ab", buffering=0) as f:', 'with open(1, "wb", buffering=0, closefd=False) as f:')
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp, "root")
        root.mkdir()
        state = StateDir(str(Path(tmp, "state")))
        state.ensure()
        state.write_identity(machine_id=str(uuid.uuid4()), generation=1, name="bench", server="memory://", token="t")
        config = parse_config(tomllib.loads(
            f'allowed_roots = ["{root}"]\n[profiles.fast]\nparser = "claude"\n'
            f"argv = {json.dumps([sys.executable, '-c', writer, str(rate), str(seconds), '-'])}\n"))
        service = InMemoryService(SYSTEM_CLOCK, duration_s=60, renew_every_s=15, margin_s=5, kill_grace_s=5)
        worker = Worker(state=state, store=Store(state.db_path), identity=state.read_identity(), config=config,
                        options=WorkerOptions(server="memory://", poll_wait_s=0.5), clock=SYSTEM_CLOCK,
                        connect=lambda: service)
        import threading

        thread = threading.Thread(target=worker.run, daemon=True)
        start_cpu, start_wall = cpu(), time.monotonic()
        thread.start()
        start = service.add_start(folder=str(root), grant_root=str(root), agent="fast")
        while service.receipt(start.operation_id, "final") is None:
            time.sleep(0.05)
        used, wall = cpu() - start_cpu, time.monotonic() - start_wall
        worker.on_signal()
        thread.join(10)
        final = service.receipt(start.operation_id, "final")["facts"]
        return {"wall_s": wall, "cpu_s": used, "cpu_percent_of_one_core": 100 * used / wall,
                "turns": final["usage"]["turns"], "progress_posts": len(service.progress_posts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=2000, help="events per second written by the fake agent")
    ap.add_argument("--seconds", type=float, default=10)
    ap.add_argument("--mb", type=int, default=50)
    args = ap.parse_args()
    mb, used = throughput(args.mb)
    print(f"throughput: {mb:.0f} MB of stream-json parsed in {used:.2f} CPU s = {mb / used:.1f} MB per CPU second")
    result = live(args.rate, args.seconds)
    print(f"live: {result['events']} events ({result['mb']:.1f} MB) in {result['wall_s']:.1f} s; "
          f"observer CPU {result['cpu_s']:.2f} s = {result['cpu_percent_of_one_core']:.1f}% of one core; "
          f"turns parsed {result['turns_parsed']}")
    result = whole_worker(args.rate, args.seconds)
    print(f"whole worker: {result['turns']} events parsed in {result['wall_s']:.1f} s; worker CPU {result['cpu_s']:.2f} s "
          f"= {result['cpu_percent_of_one_core']:.1f}% of one core; {result['progress_posts']} progress posts")


if __name__ == "__main__":
    main()
