#!/usr/bin/env python
"""Measure task acceptance (POST /api/tasks/, SPEC A) of ONE daphne process.

Not a test: prints figures. For each database it creates a fresh one (a temporary SQLite
file; a scratch ``bench_accept_*`` database on the PostgreSQL server of ``DATABASE_URL``),
migrates it, creates an owner with a token, a machine and a grant, starts one
``daphne config.asgi:application`` on it (embedded sweep off), and sends acceptances with
a few concurrent httpx clients: new keys (each a full acceptance: key claim, locks,
task, operation, outbox, reservation) and then replays of known keys (A2).

Usage (from the project root)::

    .venv/bin/python scripts/bench_accept.py                       # SQLite, and PostgreSQL if DATABASE_URL is set
    DATABASE_URL=postgresql://runstead:runstead@127.0.0.1:5432/runstead \\
        .venv/bin/python scripts/bench_accept.py --requests 600 --concurrency 8

The client runs on the same machine and takes CPU from the server, so the figures are a
floor for one process, not a ceiling.
"""
import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BASE_DIR = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def db_env(kind: str, scratch: str) -> dict:
    if kind == "sqlite":
        return {"DATABASE_URL": "", "RUNSTEAD_SQLITE_PATH": scratch}
    parts = urlsplit(os.environ["DATABASE_URL"])
    return {"DATABASE_URL": urlunsplit(parts._replace(path="/" + scratch))}


def run_one(kind: str, requests: int, concurrency: int) -> dict:
    """Child process: everything for one database. Returns the figures."""
    import django

    django.setup()
    from django.core.management import call_command

    call_command("migrate", verbosity=0)
    from django.contrib.auth import get_user_model
    from rest_framework.authtoken.models import Token

    from tasks_app.auth import token_digest
    from tasks_app.models import Budget, Grant, Machine, Task

    user = get_user_model().objects.create_user(f"bench-{uuid.uuid4().hex[:8]}")
    Budget.objects.update_or_create(owner=user, defaults={"limit_s": 1e12})
    token = Token.objects.create(user=user).key
    machine = Machine.objects.create(owner=user, name="bench", generation=1, token_hash=token_digest("x"), paired=True)
    Grant.objects.create(owner=user, machine=machine, path="/bench")

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = tempfile.NamedTemporaryFile(prefix="bench-daphne-", suffix=".log", delete=False)
    server = subprocess.Popen(
        [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(port), "config.asgi:application"],
        cwd=BASE_DIR,
        env={**os.environ, "RUNSTEAD_EMBEDDED_SWEEP": "0", "RUNSTEAD_LOG_LEVEL": "WARNING"},
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        import httpx

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                httpx.get(url + "/accounts/login/", timeout=1.0)
                break
            except httpx.HTTPError:
                if time.monotonic() > deadline or server.poll() is not None:
                    raise RuntimeError(f"daphne did not start; see {log.name}")
                time.sleep(0.1)

        headers = {"Authorization": f"Token {token}"}

        def body(i: int) -> dict:
            return {"machine": str(machine.id), "folder": f"/bench/f{i}", "agent": "bench", "prompt": "p", "max_runtime_s": 1}

        async def drive(keys: list[str], offset: int) -> tuple[float, list[float], dict]:
            latencies: list[float] = []
            statuses: dict = {}
            queue: asyncio.Queue = asyncio.Queue()
            for i, key in enumerate(keys):
                queue.put_nowait((i + offset, key))

            async def client():
                async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60) as http:
                    while not queue.empty():
                        i, key = queue.get_nowait()
                        t0 = time.perf_counter()
                        resp = await http.post("/api/tasks/", json=body(i), headers={"Idempotency-Key": key})
                        latencies.append(time.perf_counter() - t0)
                        statuses[resp.status_code] = statuses.get(resp.status_code, 0) + 1

            started = time.perf_counter()
            await asyncio.gather(*(client() for _ in range(concurrency)))
            return time.perf_counter() - started, latencies, statuses

        def figures(name, elapsed, latencies, statuses):
            latencies.sort()
            return {
                "what": name,
                "requests": len(latencies),
                "seconds": round(elapsed, 2),
                "req_per_s": round(len(latencies) / elapsed, 1),
                "p50_ms": round(statistics.median(latencies) * 1000, 1),
                "p95_ms": round(latencies[int(len(latencies) * 0.95) - 1] * 1000, 1),
                "statuses": statuses,
            }

        warm = [f"warm-{i}" for i in range(min(40, requests))]
        asyncio.run(drive(warm, 10**6))
        keys = [f"bench-{i}-{uuid.uuid4().hex}" for i in range(requests)]
        new = figures("new keys (full acceptance)", *asyncio.run(drive(keys, 0)))
        replay = figures("same keys again (A2 replays)", *asyncio.run(drive(keys, 0)))
        assert Task.objects.filter(owner=user).count() == requests + len(warm), "every new key made exactly one task"
        return {"database": kind, "concurrency": concurrency, "results": [new, replay]}
    finally:
        server.terminate()
        server.wait(10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--db", choices=["sqlite", "postgres", "both"], default="both")
    parser.add_argument("--one", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.chdir(BASE_DIR)
    sys.path.insert(0, str(BASE_DIR))
    os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

    if args.one:
        print(json.dumps(run_one(args.one, args.requests, args.concurrency)))
        return 0

    kinds = ["sqlite", "postgres"] if args.db == "both" else [args.db]
    if "postgres" in kinds and not os.environ.get("DATABASE_URL"):
        if args.db == "postgres":
            parser.error("--db postgres needs DATABASE_URL")
        kinds.remove("postgres")
    for kind in kinds:
        if kind == "sqlite":
            scratch = tempfile.mkdtemp(prefix="bench-accept-") + "/db.sqlite3"
        else:
            import psycopg

            scratch = f"bench_accept_{os.getpid()}"
            with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
                conn.execute(f"CREATE DATABASE {scratch}")
        try:
            out = subprocess.run(
                [sys.executable, __file__, "--one", kind, "--requests", str(args.requests),
                 "--concurrency", str(args.concurrency)],
                env={**os.environ, **db_env(kind, scratch)},
                capture_output=True,
                text=True,
                check=False,
            )
            if out.returncode != 0:
                print(out.stdout, out.stderr, file=sys.stderr)
                return out.returncode
            report = json.loads(out.stdout.strip().splitlines()[-1])
        finally:
            if kind == "postgres":
                with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
                    conn.execute(f"DROP DATABASE IF EXISTS {scratch} WITH (FORCE)")
        print(f"{report['database']}: one daphne process, {report['concurrency']} concurrent clients")
        for r in report["results"]:
            print(
                f"  {r['what']:<30} {r['req_per_s']:>7} req/s  p50 {r['p50_ms']} ms  p95 {r['p95_ms']} ms  "
                f"({r['requests']} in {r['seconds']} s, statuses {r['statuses']})"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
