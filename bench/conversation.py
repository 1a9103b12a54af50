#!/usr/bin/env python
"""Conversation benchmark (SPEC C2, C3, issue 33): a message's way from the owner's POST
to the agent's stdin.

What it runs, all real processes except the agent: one daphne (``config.asgi``), one
paired worker (``manage.py worker``) whose ``bench`` profile is the ``claude`` preset in
its live-conversation argv with ``bench/stream_agent.py`` as the binary (it notes the
wall time it read each stdin line, and answers at once), ``--open`` idle conversations
kept open on that worker, and one measured conversation. For each of ``--messages``
messages, one after the other (the next once the previous is ``answered``, so each meets
an idle agent): ``POST /api/tasks/{id}/messages/`` with an Idempotency-Key, and the time
from just before the POST to the agent reading the line (``time.time()`` in both
processes: one machine, one clock), p50 / p99 / max; and the POST's own latency.

``--delivery steer`` (C9): the measured conversation's prompt holds its turn open
(``[[hold]]``: the stand-in agent answers only at EOF) and each message is a steer,
written into that running turn and echoed by the agent as it reads it (as Claude Code's
``--replay-user-messages`` does); measured besides submit -> stdin: submit -> ``consumed``
as the owner sees it (the message's state read back through the API, polled every 5 ms:
the worker's ``consumed`` receipt applied), the next message once the previous one is
consumed.

The path measured: acceptance (one transaction: the message, its seq, the outbox row) ->
the worker's waiting long-poll woken (D1) -> the item committed in the worker's SQLite
(W2) and acknowledged -> the run's watch thread woken -> its inbox number committed, its
file written (C3) and the launcher's doorbell rung (``machine.files.bell_ring``) -> the
agent's stdin.

Shapes (``--shape``): ``sqlite`` (default, the embedded default: a scratch SQLite file,
in-memory channel layer) or ``postgres`` (``DATABASE_URL`` of a PostgreSQL server, a
scratch database ``bench_conv_<pid>`` created and dropped; ``REDIS_URL``).

Usage::

    .venv/bin/python bench/conversation.py --open 0 --label idle
    .venv/bin/python bench/conversation.py --open 100 --label open100
    .venv/bin/python bench/conversation.py --open 100 --delivery steer --label steer-open100

With ``--open N``, what the N conversations cost while they wait is measured first
(``measure_idle``: CPU of the worker, of its launchers and stand-in agents, and of the
daphne, over ``--idle-window`` seconds; issue 43's goal: under 2 % of a core).

Prints one table (with the load average at start and end) and writes
``bench/results/conversation-<label>.json``.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import psutil

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(BASE_DIR))

from harness import Server, lat, report_save, report_start, scratch_service  # noqa: E402  (daphne, percentiles, reports)

AGENT = BASE_DIR / "bench" / "stream_agent.py"
READY_TIMEOUT_S = 120.0
MESSAGE_TIMEOUT_S = 30.0


class Arrivals:
    """What the stand-in agents read, from their ``<pid>.jsonl`` files: text -> wall time."""

    def __init__(self, path: Path):
        self.path = path
        self.seen: dict[str, float] = {}
        self.offsets: dict[Path, int] = {}

    def poll(self) -> None:
        for file in self.path.glob("*.jsonl"):
            with open(file) as f:
                f.seek(self.offsets.get(file, 0))
                data = f.read()
            complete = data[:data.rfind("\n") + 1]
            self.offsets[file] = self.offsets.get(file, 0) + len(complete.encode())
            for line in complete.splitlines():
                row = json.loads(line)
                self.seen.setdefault(row["text"], row["t"])

    def wait(self, text: str, timeout: float) -> float | None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            self.poll()
            if text in self.seen:
                return self.seen[text]
            time.sleep(0.001)
        return None


def setup_worker(server: Server, root: Path, arrivals: Path, conversations: int):
    """An owner, a paired worker state directory, a grant and the worker process; returns
    (client, machine id, worker process)."""
    import httpx
    from django.contrib.auth import get_user_model
    from django.db import connection
    from rest_framework.authtoken.models import Token

    from machine.worker.client import pair
    from machine.worker.store import StateDir

    user = get_user_model().objects.create_user(f"bench-conv-{uuid.uuid4().hex[:8]}")
    token = Token.objects.create(user=user).key
    from tasks_app.models import Budget

    Budget.objects.update_or_create(owner=user, defaults={"limit_s": 10.0 ** 9})  # 101 conversations x 1 h
    connection.close()
    client = httpx.Client(base_url=server.url, headers={"Authorization": f"Token {token}"}, timeout=30)
    code = client.post("/api/machines/pairing-codes/", json={"name": "bench-laptop"}).json()["code"]
    answer = pair(server.url, code, "bench-laptop")
    state = root / "state"
    StateDir(str(state)).write_identity(machine_id=answer.body["machine_id"], generation=answer.body["generation"],
                                        name="bench-laptop", server=server.url, token=answer.body["token"])
    machine = answer.body["machine_id"]
    work = root / "work"
    work.mkdir()
    assert client.post("/api/grants/", json={"machine": machine, "path": str(work)}).status_code == 201
    config = root / "worker.toml"
    config.write_text(f'allowed_roots = ["{work}"]\nmax_concurrent = {conversations + 1}\nprevent_idle_sleep = false\n'
                      f'[profiles.bench]\npreset = "claude"\nbinary = "{AGENT}"\n'
                      f'env = {{ BENCH_ARRIVALS = "{arrivals}" }}\n')
    log = open(root / "worker.log", "wb")
    worker = subprocess.Popen([sys.executable, "manage.py", "worker", "--server", server.url, "--state-dir", str(state),
                               "--config", str(config)], cwd=BASE_DIR, stdout=log, stderr=subprocess.STDOUT,
                              env={**os.environ, "RUNSTEAD_LOG_LEVEL": "WARNING"})
    end = time.monotonic() + READY_TIMEOUT_S
    while not any(p.get("conversation") == "live" for m in client.get("/api/machines/").json()["results"]
                  if m["id"] == machine for p in m.get("profiles") or []):
        if time.monotonic() > end or worker.poll() is not None:
            raise RuntimeError(f"the worker never reported its profile; see {root / 'worker.log'}")
        time.sleep(0.1)
    return client, machine, worker, work


def open_conversation(client, machine: str, work: Path, prompt: str) -> str:
    resp = client.post("/api/tasks/", json={"machine": machine, "folder": str(work), "agent": "bench", "prompt": prompt,
                                            "mode": "conversation", "exclusive": False,
                                            "max_runtime_s": 3600},
                       headers={"Idempotency-Key": str(uuid.uuid4())})
    if resp.status_code != 201:
        raise RuntimeError(f"submit refused: {resp.status_code} {resp.text}")
    return resp.json()["id"]


def answered(client, task_id: str, seq: int, state: str = "answered") -> bool:
    rows = client.get(f"/api/tasks/{task_id}/messages/").json()["results"]
    return any(m["seq"] == seq and m["state"] == state for m in rows)


def wait_answered(client, task_id: str, seq: int, timeout: float, state: str = "answered") -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if answered(client, task_id, seq, state):
            return True
        time.sleep(0.005)
    return False


def measure_idle(server: Server, worker, window_s: float) -> dict:
    """Issue 43: what the open conversations cost while they wait (their first turns
    answered, nothing sent): CPU (% of one core) over ``window_s`` seconds of the worker
    process, of its launchers and stand-in agents (its descendants), and of the daphne."""
    time.sleep(float(os.environ.get("BENCH_IDLE_SETTLE_S", "5")))  # past the conversations' quiet threshold (QUIET_AFTER_S) and their last receipts
    top = psutil.Process(worker.pid)

    def cpu() -> tuple[float, float]:
        own = top.cpu_times()
        rest = 0.0
        for child in top.children(recursive=True):
            try:
                times = child.cpu_times()
                rest += times.user + times.system
            except psutil.Error:
                pass
        return own.user + own.system, rest

    (w0, c0), s0, t0 = cpu(), server.cpu_s(), time.perf_counter()
    time.sleep(window_s)
    (w1, c1), s1, elapsed = cpu(), server.cpu_s(), time.perf_counter() - t0
    return {"window_s": window_s, "worker_cpu_pct": round(100 * (w1 - w0) / elapsed, 2),
            "launchers_and_agents_cpu_pct": round(100 * (c1 - c0) / elapsed, 2),
            "daphne_cpu_pct": round(100 * (s1 - s0) / elapsed, 2),
            "processes": len(top.children(recursive=True))}


def run_bench(env: dict, *, open_count: int, messages: int, delivery: str = "queue",
              idle_window_s: float = 20.0) -> dict:
    root = Path(tempfile.mkdtemp(prefix="bench-conv-"))
    arrivals_dir = root / "arrivals"
    arrivals_dir.mkdir()
    arrivals = Arrivals(arrivals_dir)
    server = Server("daphne", env)
    worker = None
    try:
        client, machine, worker, work = setup_worker(server, root, arrivals_dir, open_count)
        ramp0 = time.perf_counter()
        idle = [open_conversation(client, machine, work, f"idle-{i}") for i in range(open_count)]
        for i, task_id in enumerate(idle):
            if arrivals.wait(f"idle-{i}", READY_TIMEOUT_S) is None:
                raise RuntimeError(f"idle conversation {i} never started; see {root / 'worker.log'}")
        idle_cost = measure_idle(server, worker, idle_window_s) if open_count and idle_window_s else None
        steer = delivery == "steer"
        prompt = "[[hold]] measured" if steer else "measured"  # C9: a turn that runs while it is steered
        measured = open_conversation(client, machine, work, prompt)
        if arrivals.wait(prompt, READY_TIMEOUT_S) is None or not wait_answered(
                client, measured, 0, READY_TIMEOUT_S, "delivered" if steer else "answered"):
            raise RuntimeError(f"the measured conversation never started; see {root / 'worker.log'}")
        ramp_s = time.perf_counter() - ramp0
        to_stdin, to_consumed, post, missing = [], [], [], 0
        for n in range(messages):
            text = f"bench-{n}-{uuid.uuid4()}"
            sent_wall, sent = time.time(), time.perf_counter()
            resp = client.post(f"/api/tasks/{measured}/messages/", json={"text": text, "delivery": delivery},
                               headers={"Idempotency-Key": str(uuid.uuid4())})
            post.append(time.perf_counter() - sent)
            if resp.status_code != 201:
                raise RuntimeError(f"message refused: {resp.status_code} {resp.text}")
            at = arrivals.wait(text, MESSAGE_TIMEOUT_S)
            if at is None:
                missing += 1
                continue
            to_stdin.append(at - sent_wall)
            if not wait_answered(client, measured, resp.json()["seq"], MESSAGE_TIMEOUT_S,
                                 "consumed" if steer else "answered"):
                raise RuntimeError(f"message {n} never {'consumed' if steer else 'answered'}; "
                                   f"see {root / 'worker.log'}")
            if steer:
                to_consumed.append(time.perf_counter() - sent)
        still_open = sum(1 for t in idle if client.get(f"/api/tasks/{t}/").json()["state"] == "running")
        out = {"open": open_count, "still_running": still_open, "ramp_s": round(ramp_s, 1), "messages": messages,
               "delivery": delivery, "agent": "bench/stream_agent.py (the claude preset's live argv)",
               "submit_to_stdin": {**lat(to_stdin), "missing": missing}, "post": lat(post)}
        if steer:
            out["submit_to_consumed"] = lat(to_consumed)
        if idle_cost is not None:
            out["idle_cost"] = idle_cost
        return out
    finally:
        if worker is not None:
            worker.kill()
            worker.wait(10)
        for file in arrivals_dir.glob("*.jsonl"):  # the stand-in agents the killed worker left, by their pids
            try:
                if str(AGENT) in " ".join(psutil.Process(int(file.stem)).cmdline()):  # not a reused pid
                    os.kill(int(file.stem), signal.SIGKILL)
            except (ValueError, OSError, psutil.Error):
                pass
        server.stop()
        if os.environ.get("BENCH_KEEP"):
            print(f"kept {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)


def rows(r: dict) -> list[str]:
    s, p = r["submit_to_stdin"], r["post"]
    out = [
        "open conversations | messages (delivery) | submit -> agent stdin p50 / p99 / max ms (missing) | "
        "POST p50 / p99 ms",
        f"  {r['open']:>5} (+1 measured, {r['still_running']} still running) | {r['messages']} "
        f"({r.get('delivery', 'queue')}) | {s['p50_ms']} / {s['p99_ms']} / {s['max_ms']} ({s['missing']}) | "
        f"{p['p50_ms']} / {p['p99_ms']}",
    ]
    if "idle_cost" in r:
        c = r["idle_cost"]
        out.append(f"  {r['open']} open conversations waiting, {c['window_s']} s: worker {c['worker_cpu_pct']} %, "
                   f"its {c['processes']} launchers and agents {c['launchers_and_agents_cpu_pct']} %, "
                   f"daphne {c['daphne_cpu_pct']} % of a core")
    if "submit_to_consumed" in r:
        c = r["submit_to_consumed"]
        out.append(f"  submit -> consumed (seen through the API) p50 / p99 / max ms: "
                   f"{c['p50_ms']} / {c['p99_ms']} / {c['max_ms']}")
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--label", default="local")
    parser.add_argument("--shape", choices=["sqlite", "postgres"], default="sqlite")
    parser.add_argument("--open", type=int, default=0, help="idle conversations kept open on the worker")
    parser.add_argument("--messages", type=int, default=100)
    parser.add_argument("--delivery", choices=["queue", "steer"], default="queue",
                        help="C9: queue (each message its own turn) or steer (into a running turn)")
    parser.add_argument("--idle-window", type=float, default=20.0,
                        help="seconds over which the open conversations' cost while waiting is measured (0: not)")
    parser.add_argument("--out", help="JSON path (default bench/results/conversation-LABEL.json)")
    args = parser.parse_args()
    os.chdir(BASE_DIR)
    if args.shape == "postgres" and not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")):
        parser.error("--shape postgres: set DATABASE_URL (PostgreSQL) and REDIS_URL")
    report = report_start(args.label, shape=args.shape)
    try:
        with scratch_service(args.shape, "bench_conv") as (env, _, _):
            report["conversation"] = run_bench(env, open_count=args.open, messages=args.messages,
                                               delivery=args.delivery, idle_window_s=args.idle_window)
    finally:
        out = report_save(report, Path(args.out or BASE_DIR / "bench" / "results" / f"conversation-{args.label}.json"))
        if "conversation" in report:
            print(f"RunStead conversation bench '{report['label']}' at {report['started']} (shape {report['shape']}; "
                  f"load average {report['loadavg']} at start, {report['loadavg_end']} at end; {report['cpus']} CPUs; "
                  f"git {report['git']})")
            print("\n".join(rows(report["conversation"])))
        print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
