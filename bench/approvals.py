#!/usr/bin/env python
"""Approvals benchmark (SPEC Q3, issue 19): N waiting ``PermissionRequest`` hooks on ONE daphne.

What it runs, all real: one daphne process (``config.asgi``), one owner, and N real hook
processes, ``python -m machine.hooks claude`` with Claude Code's ``PermissionRequest``
payload on stdin (``tests/fixtures/hooks/claude/permission_request.json``, each its own
agent session), exactly as Claude Code starts them and as ``tests/hooks_support.py``
``start_hook`` does. Each hook creates its approval (``POST /api/approvals/``) and then
long-polls ``GET /api/approvals/{id}/?wait=25`` (``core/longpoll/`` on the service). The
hooks share ``--state-dirs`` hook state directories (default 10: ten machines of 50
sessions each); they are started in batches of ``--batch``, each batch once the previous
one's approvals exist.

Measured:

1. while all N wait (every approval pending, >= N established connections on daphne),
   over ``--window`` seconds (default 25, one full long-poll cycle): daphne's CPU (% of
   one core, psutil user+system of the process and its children), database transactions
   per second (PostgreSQL: ``pg_stat_database`` ``xact_commit + xact_rollback`` delta of
   the scratch database, read from another database so the reading is not counted; the
   bench client makes no query meanwhile),
   daphne's threads and RSS, and the hook processes' own CPU and memory (USS);
2. then ``--decisions`` approvals decided one after the other by a separate client
   (``POST /api/approvals/{id}/decision/`` with an Idempotency-Key, allow and deny
   alternating): the time from the POST's 200 returning to the deciding hook's decision
   JSON arriving on its stdout (the moment the agent's tool runs), p50 / p99 / max
   (negative when the hook printed before the owner's client had its 200: the wake-up
   goes out at commit, before the response), the same from the POST sent, and the POST's
   own latency. The next decision is sent once the previous hook printed.

Shapes (``--shape``): ``postgres`` (default; ``DATABASE_URL`` of a PostgreSQL server where
a scratch database ``bench_appr_<pid>`` is created and dropped, ``REDIS_URL`` for the
channel layer with its own prefix) or ``sqlite`` (the embedded default: a scratch SQLite
file, in-memory channel layer; no transaction counter there, so the DB column says n/a).

Usage::

    DATABASE_URL=postgresql://runstead:runstead@127.0.0.1:5432/runstead \\
    REDIS_URL=redis://127.0.0.1:6390/0 .venv/bin/python bench/approvals.py --hooks 500

``bench/run.py --sections approvals`` runs the same (PostgreSQL shape) inside its report.
Prints one table (with the load average at start and end) and writes
``bench/results/approvals-<label>.json``.
"""
import argparse
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path

BASE_DIR = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(BASE_DIR))

from harness import SERVICE_ENVS, Server, lat, report_save, report_start, scratch_service  # noqa: E402  (daphne, percentiles, reports)

PAYLOAD = json.loads((BASE_DIR / "tests" / "fixtures" / "hooks" / "claude" / "permission_request.json").read_text())
ALLOW = {"hookSpecificOutput": {"hookEventName": "PermissionRequest", "decision": {"behavior": "allow"}}}
DENY_MESSAGE = "bench: not this one"
RAMP_TIMEOUT_S = 120.0
DECISION_TIMEOUT_S = 30.0


# --- the hooks --------------------------------------------------------------------------


class Hooks:
    """N hook processes and one thread reading their stdout (the time each decision line
    arrives, ``time.perf_counter``)."""

    def __init__(self, root: Path, server_url: str, token: str, state_dirs: int):
        from machine.hooks import store

        self.procs: list[subprocess.Popen] = []
        self.sids: list[str] = []
        self.lines: dict[int, tuple[float, bytes]] = {}
        self.exited: dict[int, float] = {}
        self.dirs = [root / f"hooks-{k}" for k in range(state_dirs)]
        for d in self.dirs:
            store.write_config(d, server=server_url, token=token)
        self.selector = selectors.DefaultSelector()
        self.buffers: dict[int, bytes] = {}
        self.lock = threading.Lock()
        self.stopping = False
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader_started = False

    def env(self, state_dir: Path) -> dict:
        # as tests/hooks_support.hook_env: the agent's environment, no service settings
        env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "RUNSTEAD_"))}
        env.update({"RUNSTEAD_HOOK_DIR": str(state_dir), "PYTHONPATH": str(BASE_DIR),
                    # the detached senders (one per state dir, for the attention marker) leave
                    # 5 s after their outbox is empty, before the window, not 30 s
                    "RUNSTEAD_HOOK_SENDER_IDLE_S": "5"})
        return env

    def start(self, i: int) -> None:
        sid = f"bench-{uuid.uuid4()}"
        state_dir = self.dirs[i % len(self.dirs)]
        proc = subprocess.Popen([sys.executable, "-m", "machine.hooks", "claude"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=self.env(state_dir), cwd="/")
        proc.stdin.write(json.dumps({**PAYLOAD, "session_id": sid, "tool_input": {"command": f"make bench-{i}"}}).encode())
        proc.stdin.close()
        proc.stdin = None
        os.set_blocking(proc.stdout.fileno(), False)
        with self.lock:
            self.procs.append(proc)
            self.sids.append(sid)
            self.buffers[i] = b""
            self.selector.register(proc.stdout, selectors.EVENT_READ, i)
        if not self.reader_started:
            self.reader_started = True
            self.reader.start()

    def _read(self) -> None:
        while not self.stopping:
            with self.lock:
                has = bool(self.selector.get_map())
            if not has:
                time.sleep(0.01)
                continue
            for key, _ in self.selector.select(timeout=0.05):
                now = time.perf_counter()
                i = key.data
                try:
                    chunk = os.read(key.fd, 65536)
                except BlockingIOError:
                    continue
                if chunk:
                    self.buffers[i] += chunk
                    if b"\n" in self.buffers[i] and i not in self.lines:
                        self.lines[i] = (now, self.buffers[i])
                else:  # EOF: the hook exited
                    self.exited[i] = now
                    with self.lock:
                        self.selector.unregister(key.fileobj)

    def stop(self) -> None:
        self.stopping = True
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                pass
        from machine.hooks import launch

        for d in self.dirs:  # the detached senders the hooks started
            pid = launch.sender_pid(d)
            if pid:
                try:
                    os.kill(pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

    def cpu_s(self) -> float:
        import psutil

        total = 0.0
        for proc in self.procs:
            try:
                t = psutil.Process(proc.pid).cpu_times()
                total += t.user + t.system
            except psutil.Error:
                pass
        return total

    def uss_mb(self) -> float:
        """Memory only the hook processes hold (unique set size), MB."""
        import psutil

        total = 0
        for proc in self.procs:
            try:
                total += psutil.Process(proc.pid).memory_full_info().uss
            except psutil.Error:
                pass
        return total / 2**20


# --- the service side -------------------------------------------------------------------


# PostgreSQL 15's PGSTAT_IDLE_INTERVAL (src/backend/utils/activity/pgstat.c), seconds.
PG_STATS_IDLE_S = 10.0


def xacts(admin_url: str | None, dbname: str | None) -> int | None:
    """``xact_commit + xact_rollback`` of ``dbname`` (PostgreSQL), read through
    ``admin_url`` (another database, so the reading is not counted); None on SQLite."""
    if dbname is None or admin_url is None:
        return None
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        return conn.execute("SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
                            [dbname]).fetchone()[0]


def established(server: Server) -> int:
    """TCP connections daphne holds open to clients (each waiting hook holds one)."""
    import psutil

    port = server.port
    count = 0
    for p in server.processes():
        try:
            count += sum(1 for c in p.net_connections(kind="tcp")
                         if c.status == psutil.CONN_ESTABLISHED and c.laddr and c.laddr.port == port)
        except psutil.Error:
            pass
    return count


def pending_count(owner) -> int:
    from django.db import connection

    from sessions_app.models import Approval

    try:
        return Approval.objects.filter(owner=owner, state="pending").count()
    finally:
        connection.close()


def make_owner():
    from django.contrib.auth import get_user_model
    from django.db import connection
    from rest_framework.authtoken.models import Token

    user = get_user_model().objects.create_user(f"bench-appr-{uuid.uuid4().hex[:8]}")
    token = Token.objects.create(user=user).key
    connection.close()
    return user, token


def run_approvals(env: dict, dbname: str | None, admin_url: str | None, *, hooks: int, window_s: float, decisions: int, state_dirs: int,
                  batch: int) -> dict:
    """The measurement (module docstring) against a daphne started with ``env``; returns
    the row as a dict (times in ms, CPU in % of one core)."""
    import httpx

    owner, token = make_owner()
    root = Path(tempfile.mkdtemp(prefix="bench-appr-"))
    server = Server("daphne", env)
    group = None
    try:
        group = Hooks(root, server.url, token, state_dirs)
        ramp0 = time.perf_counter()
        for start in range(0, hooks, batch):
            for i in range(start, min(start + batch, hooks)):
                group.start(i)
            deadline = time.perf_counter() + RAMP_TIMEOUT_S
            while pending_count(owner) < len(group.procs):
                if time.perf_counter() > deadline:
                    raise RuntimeError(f"only {pending_count(owner)} of {len(group.procs)} approvals created; "
                                       f"see {server.log.name} and {root}")
                time.sleep(0.1)
        # all created; now until every hook holds its long-poll open on daphne
        deadline = time.perf_counter() + RAMP_TIMEOUT_S
        while established(server) < hooks:
            if time.perf_counter() > deadline:
                raise RuntimeError(f"{established(server)} of {hooks} hooks hold a connection")
            time.sleep(0.2)
        ramp_s = time.perf_counter() - ramp0
        # The senders (idle 5 s) leave, and PostgreSQL counts the ramp's last transactions:
        # a backend that reported its statistics less than 1 s before going idle reports
        # the rest 10 s later (PGSTAT_IDLE_INTERVAL), which would land in the window.
        time.sleep(PG_STATS_IDLE_S + 1.0)
        early = [i for i, p in enumerate(group.procs) if p.poll() is not None]

        cpu0, x0, h0, t0 = server.cpu_s(), xacts(admin_url, dbname), group.cpu_s(), time.perf_counter()
        threads, conns_min = server.threads(), hooks * 10
        # For a profiler to attach to the daphne for exactly the window (bench/README.md).
        print(f"window of {window_s} s begins: daphne pid {server.process.pid}", file=sys.stderr, flush=True)
        while time.perf_counter() - t0 < window_s:
            time.sleep(min(1.0, max(0.0, window_s - (time.perf_counter() - t0))))
            threads = max(threads, server.threads())
            conns_min = min(conns_min, established(server))
        elapsed = time.perf_counter() - t0
        cpu1, x1, h1 = server.cpu_s(), xacts(admin_url, dbname), group.cpu_s()
        rss = sum(p.memory_info().rss for p in server.processes()) / 2**20
        hooks_uss = group.uss_mb()
        still_pending = pending_count(owner)

        from django.db import connection

        from sessions_app.models import Approval

        by_session = {str(s): str(a) for a, s in Approval.objects.filter(owner=owner, state="pending")
                      .values_list("id", "session_id")}
        connection.close()
        from machine.hooks import mapping

        latencies, from_sent, post_ms, wrong, missing = [], [], [], 0, 0
        client = httpx.Client(base_url=server.url, headers={"Authorization": f"Token {token}"}, timeout=30)
        order = [i for i in range(len(group.procs)) if group.procs[i].poll() is None][:decisions]
        for n, i in enumerate(order):
            approval_id = by_session.get(str(mapping.session_uuid("claude", group.sids[i])))
            if approval_id is None:
                missing += 1
                continue
            deny = n % 2 == 1
            body = {"behavior": "deny", "message": DENY_MESSAGE} if deny else {"behavior": "allow"}
            sent = time.perf_counter()
            response = client.post(f"/api/approvals/{approval_id}/decision/", json=body,
                                   headers={"Idempotency-Key": str(uuid.uuid4())})
            returned = time.perf_counter()
            if response.status_code != 200:
                wrong += 1
                continue
            post_ms.append(returned - sent)
            deadline = returned + DECISION_TIMEOUT_S
            while i not in group.lines and time.perf_counter() < deadline:
                time.sleep(0.0005)
            if i not in group.lines:
                missing += 1
                continue
            at, line = group.lines[i]
            expected = ({"hookSpecificOutput": {"hookEventName": "PermissionRequest",
                                                "decision": {"behavior": "deny", "message": DENY_MESSAGE}}}
                        if deny else ALLOW)
            if json.loads(line) != expected:
                wrong += 1
            latencies.append(at - returned)
            from_sent.append(at - sent)
        client.close()
        return {
            "hooks": hooks, "client": "real hook processes (python -m machine.hooks claude)",
            "state_dirs": state_dirs, "ramp_s": round(ramp_s, 1), "exited_early": len(early),
            "window_s": round(elapsed, 1),
            "cpu_pct": round(100 * (cpu1 - cpu0) / elapsed, 1),
            "db_xact_per_s": round((x1 - x0) / elapsed, 1) if x0 is not None else None,
            "service_threads": threads, "service_rss_mb": round(rss, 1),
            "connections_min": conns_min, "pending_after_window": still_pending,
            "hooks_cpu_pct": round(100 * (h1 - h0) / elapsed, 1), "hooks_uss_mb": round(hooks_uss, 1),
            "decision_to_tool": {**lat(latencies), "missing": missing, "wrong": wrong,
                                 "before_post_returned": sum(1 for x in latencies if x < 0)},
            "decision_sent_to_tool": lat(from_sent),
            "decision_post": lat(post_ms),
        }
    finally:
        if group is not None:
            group.stop()
        server.stop()
        shutil.rmtree(root, ignore_errors=True)


def table(report: dict) -> str:
    """The report as text: a title line with the load average, then ``rows``."""
    return "\n".join([
        f"RunStead approvals bench '{report['label']}' at {report['started']} (shape {report['shape']}; load average "
        f"{report['loadavg']} at start, {report.get('loadavg_end')} at end; {report['cpus']} CPUs; git {report['git']})",
        *rows(report["approvals"])])


def rows(r: dict) -> list[str]:
    """The lines of one ``run_approvals`` result."""
    d, s, p = r["decision_to_tool"], r["decision_sent_to_tool"], r["decision_post"]
    return [
        f"clients: {r['hooks']} {r['client']}, {r['state_dirs']} hook state dirs; ramp {r['ramp_s']} s",
        "",
        "waiting hooks | window s | daphne CPU % core | DB xact/s | threads | RSS MB | conns (min) | hooks CPU % / USS MB | "
        "decision -> tool p50 / p99 / max ms (n, missing, wrong, printed before the 200) | "
        "from POST sent p50 / p99 | decision POST p50 / p99 ms",
        f"  {r['hooks']:>5} | {r['window_s']} | {r['cpu_pct']} | "
        f"{r['db_xact_per_s'] if r['db_xact_per_s'] is not None else 'n/a'} | {r['service_threads']} | "
        f"{r['service_rss_mb']} | {r['connections_min']} | {r['hooks_cpu_pct']} / {r['hooks_uss_mb']} | "
        f"{d['p50_ms']} / {d['p99_ms']} / {d['max_ms']} ({d['n']}, {d['missing']}, {d['wrong']}, "
        f"{d['before_post_returned']}) | {s['p50_ms']} / {s['p99_ms']} | {p['p50_ms']} / {p['p99_ms']}",
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run")
    parser.add_argument("--shape", choices=["postgres", "sqlite"], default="postgres")
    parser.add_argument("--hooks", type=int, default=500)
    parser.add_argument("--window", type=float, default=25.0, help="seconds measured while all hooks wait")
    parser.add_argument("--decisions", type=int, default=100)
    parser.add_argument("--state-dirs", type=int, default=10)
    parser.add_argument("--batch", type=int, default=25, help="hooks started at once during the ramp")
    parser.add_argument("--service-env", choices=SERVICE_ENVS, default="development",
                        help="RUNSTEAD_ENV of the measured service (harness.service_env)")
    parser.add_argument("--out", help="JSON path (default bench/results/approvals-LABEL.json)")
    args = parser.parse_args()
    os.chdir(BASE_DIR)
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.hooks + 256)), hard))
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))

    if args.shape == "postgres" and not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")):
        parser.error("--shape postgres: set DATABASE_URL (PostgreSQL) and REDIS_URL")
    report = report_start(args.label, shape=args.shape, service_env=args.service_env)
    try:
        with scratch_service(args.shape, "bench_appr", args.service_env) as (env, dbname, admin_url):
            report["approvals"] = run_approvals(env, dbname, admin_url, hooks=args.hooks, window_s=args.window,
                                                decisions=args.decisions, state_dirs=args.state_dirs,
                                                batch=args.batch)
    finally:
        out = report_save(report, Path(args.out or BASE_DIR / "bench" / "results" / f"approvals-{args.label}.json"))
        if "approvals" in report:
            print(table(report))
        print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
