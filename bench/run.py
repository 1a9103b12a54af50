#!/usr/bin/env python
"""RunStead's benchmark (SPEC D, issue 14): one command, a table on stdout, JSON on disk.

Needs PostgreSQL and Redis (``DATABASE_URL``, ``REDIS_URL``): it creates a scratch
database ``bench_<pid>`` on that server (dropped afterwards) and uses its own channel
prefix on that Redis. Sections (``--sections``, comma separated; all by default):

- ``idle``: N simulated workers (``--workers``, default 10,100,1000) long-polling
  ``GET /api/worker/messages/?wait=25`` on ONE daphne process, from one asyncio client
  process over raw sockets. Over a quiet window that begins one whole pull cycle
  (``WAIT_S`` + 5 s) after the last worker started, so that it sees the steady state
  and not the first start of every worker (cold token caches, machines coming back
  online, and PostgreSQL's statistics of those reaching ``pg_stat_database`` up to 10 s
  late): service CPU (% of one core, psutil on the
  daphne pid), database transactions/s (``pg_stat_database.xact_commit`` delta of the
  scratch database), service threads. Then tasks submitted meanwhile: acceptance latency
  (POST -> 201) and delivery latency (POST sent -> the simulated worker's pull answers
  with it).
  ``--processes P`` runs P daphne processes on the same database and Redis (D1), worker
  ``i`` on process ``i % P``; CPU, threads and RSS are their sums (the ``wave``
  and ``busy`` sections take it too).
- ``busy``: ``--busy-workers`` simulated workers, each running two long tasks at the
  service's lease timings, beside one real worker running short tasks four at a time
  (``section_busy``, ``ShortTasks``; issue 44); ``--busy-owners K`` deals the machines
  among K owners (default 1).
- ``http``: acceptance (new keys; ``accept_owners``: each connection its own owner),
  replay (the same keys again, A2) and a bare
  authenticated read (``GET /api/budget/``: token auth + one read) in each serving shape
  (``daphne``: one daphne process; ``gunicorn``: 2 workers x 4 threads, the production
  shape of ``/api/``), at 1, 8 and 32 connections.
- ``board``: 1, 100, 500 board WebSockets of one owner, in a client process of their
  own; a marker write (from this process, one every 0.5 s) that makes a new session
  busy -> ``session.status`` on every socket (``time.monotonic()`` in both processes).
- ``wave``: ``--wave-workers`` (default 1000) simulated workers start their pulls at
  the same instant (as after a service restart) and go on for two whole pull cycles
  while a task is submitted every 0.5 s: acceptance and delivery latency through it.
- ``statements``: the SQL statements (each one round trip; a transaction adds its
  ``COMMIT``) of one acceptance, its replay (A2) and the bare authenticated read, counted
  in this process with Django's query capture, as a ratio to the bare read; and a busy
  machine's renewal sync: its statements and this process's CPU per sync, through
  Django's handler and the service alone (``_renewal_sync_cost``).
- ``request_cost`` (not run by default): the daphne's CPU per request over real HTTP, a
  busy machine's renewal sync beside a bare authenticated owner read
  (``section_request_cost``; issue 44).
- ``worker``: a real paired ``manage.py worker`` at rest: CPU seconds per minute, RSS.
- ``approvals``: ``--hooks`` (default 500) real ``PermissionRequest`` hook processes
  waiting on one daphne: service CPU and database transactions/s while they wait, then
  decision -> the hook's decision JSON p50/p99 (``bench/approvals.py``, SPEC Q3; that
  script also runs it alone, and on the SQLite embedded default).

Usage (after README's set-up)::

    DATABASE_URL=postgresql://runstead:runstead@127.0.0.1:5432/runstead \\
    REDIS_URL=redis://127.0.0.1:6390/0 .venv/bin/python bench/run.py --label after

Tasks are submitted with ``exclusive: false``: every bench task stays unfinished, and the
A8 folder check walks a machine's unfinished exclusive tasks, so exclusive bench tasks
would measure a pile-up no real machine has.

The client runs on the same machine and takes CPU from the server; the JSON records the
machine's load average at the start so runs on a busy machine can be told apart.
"""
import argparse
import asyncio
import functools
import json
import os
import random
import sqlite3
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from harness import BASE_DIR, SERVICE_ENVS, Server, lat, report_save, report_start, service_env

WAIT_S = 25
DELIVERY_TIMEOUT_S = 30.0


# --- a minimal HTTP/1.1 client over asyncio streams (cheap enough for 1,000 workers) ----


class Conn:
    def __init__(self, port: int):
        self.port = port
        self.reader = self.writer = None

    async def request(self, method: str, path: str, headers: dict, body: bytes = b"", timeout: float = 60.0):
        if self.writer is None:
            self.reader, self.writer = await asyncio.open_connection("127.0.0.1", self.port)
        head = f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items()) + "\r\n"
        self.writer.write(head.encode() + body)
        try:
            return await asyncio.wait_for(self._response(), timeout)
        except BaseException:
            self.close()
            raise

    async def _response(self):
        status_line = await self.reader.readline()
        if not status_line:
            raise ConnectionError("closed")
        status = int(status_line.split()[1])
        length, chunked, close = None, False, False
        while True:
            line = await self.reader.readline()
            if line in (b"\r\n", b""):
                break
            name, _, value = line.decode("latin-1").partition(":")
            name, value = name.strip().lower(), value.strip()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding" and "chunked" in value.lower():
                chunked = True
            elif name == "connection" and value.lower() == "close":
                close = True
        if chunked:
            body = b""
            while True:
                size = int((await self.reader.readline()).strip(), 16)
                if size == 0:
                    await self.reader.readline()
                    break
                body += await self.reader.readexactly(size)
                await self.reader.readline()
        elif length is not None:
            body = await self.reader.readexactly(length)
        else:
            body = await self.reader.read()
            close = True
        if close:
            self.close()
        return status, body

    def close(self):
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


# --- fixtures in the scratch database -------------------------------------------------


def setup_data(n_machines: int) -> dict:
    from django.contrib.auth import get_user_model
    from django.db import connection
    from rest_framework.authtoken.models import Token

    from tasks_app.auth import token_digest
    from tasks_app.models import Budget, Grant, Machine

    user = get_user_model().objects.create_user(f"bench-{uuid.uuid4().hex[:8]}")
    Budget.objects.update_or_create(owner=user, defaults={"limit_s": 1e12})
    token = Token.objects.create(user=user).key
    tokens = [f"bench-machine-{i}-{uuid.uuid4().hex}" for i in range(n_machines)]
    machines = Machine.objects.bulk_create(
        [Machine(owner=user, name=f"m{i}", generation=1, token_hash=token_digest(t), paired=True) for i, t in enumerate(tokens)]
    )
    Grant.objects.bulk_create([Grant(owner=user, machine=m, path="/bench") for m in machines])
    connection.close()
    return {"user": user, "token": token, "machines": [str(m.id) for m in machines], "machine_tokens": tokens}


def xact_commit(dbname: str) -> int:
    import psycopg

    with psycopg.connect(os.environ["DATABASE_URL"], autocommit=True) as conn:
        return conn.execute("SELECT xact_commit FROM pg_stat_database WHERE datname = %s", [dbname]).fetchone()[0]


class Daphnes:
    """``n`` daphne processes on one database and one Redis (D1). Simulated worker ``i``
    talks to process ``i % n`` (what a proxy's balancing amounts to for a client that
    keeps its connection); the owner's requests go to the first."""

    def __init__(self, n: int, env: dict):
        self.servers = []
        try:
            for _ in range(n):
                self.servers.append(Server("daphne", env))
        except BaseException:
            self.stop()
            raise
        self.port, self.url = self.servers[0].port, self.servers[0].url

    def port_of(self, i: int) -> int:
        return self.servers[i % len(self.servers)].port

    def cpu_s(self) -> float:
        return sum(s.cpu_s() for s in self.servers)

    def threads(self) -> int:
        return sum(s.threads() for s in self.servers)

    def rss_mb(self) -> float:
        return round(sum(p.memory_info().rss for s in self.servers for p in s.processes()) / 2**20, 1)

    def stop(self):
        for server in self.servers:
            server.stop()


# --- sections -------------------------------------------------------------------------


def section_idle(counts: list[int], env: dict, dbname: str, window_s: float, tasks: int, processes: int = 1) -> list[dict]:
    rows = []
    data = setup_data(max(counts))
    for n in counts:
        server = Daphnes(processes, env)
        try:
            rows.append(asyncio.run(_idle(server, data, n, dbname, window_s, tasks)))
        finally:
            server.stop()
        print(f"  idle {n}: {rows[-1]}", file=sys.stderr)
    return rows


async def _idle(server: Daphnes, data: dict, n: int, dbname: str, window_s: float, tasks: int) -> dict:
    delivered: dict[str, float] = {}
    errors = {"pull": 0}
    stop = asyncio.Event()
    worker = functools.partial(_puller, server, data, delivered, errors, stop)

    workers = []
    for i in range(n):  # ramp up over about two seconds
        workers.append(asyncio.create_task(worker(i)))
        if i % 50 == 49:
            await asyncio.sleep(0.1)
    await asyncio.sleep(WAIT_S + 5.0)  # one whole pull cycle: the window sees the steady state
    cpu0, x0, t0 = server.cpu_s(), xact_commit(dbname), time.perf_counter()
    threads_max = server.threads()
    while time.perf_counter() - t0 < window_s:
        await asyncio.sleep(1.0)
        threads_max = max(threads_max, server.threads())
    elapsed = time.perf_counter() - t0
    cpu1, x1 = server.cpu_s(), xact_commit(dbname)

    count = iter(range(tasks))
    accept, delivery, accept_errors, undelivered = await _submit_then_stop(
        server, data, n, delivered, workers, stop, lambda: next(count, None) is not None)
    return {
        "workers": n, "processes": len(server.servers), "rss_mb": server.rss_mb(),
        "cpu_pct": round(100 * (cpu1 - cpu0) / elapsed, 1),
        "db_xact_per_s": round((x1 - x0) / elapsed, 1),
        "threads": threads_max,
        "accept": {**lat(accept), "errors": accept_errors},
        "delivery": {**lat(delivery), "undelivered": undelivered},
        "pull_errors": errors["pull"],
    }


async def _puller(server: Daphnes, data: dict, delivered: dict, errors: dict, stop: asyncio.Event, i: int):
    """Simulated worker ``i``: pull, ack, pull again until ``stop``; ``delivered[task_id]``
    is when its pull answered with the task, ``data["first_pull"][i]`` when it began its
    first pull (perf_counter)."""
    conn = Conn(server.port_of(i))
    headers = {"Authorization": f"Machine {data['machine_tokens'][i]}"}
    data.setdefault("first_pull", {})[i] = time.perf_counter()
    while not stop.is_set():
        try:
            status, body = await conn.request("GET", f"/api/worker/messages/?wait={WAIT_S}", headers, timeout=WAIT_S + 15)
        except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError, ValueError, IndexError):
            errors["pull"] += 1
            await asyncio.sleep(0.5)
            continue
        if status != 200:
            errors["pull"] += 1
            await asyncio.sleep(0.5)
            continue
        now = time.perf_counter()
        for message in json.loads(body)["messages"]:
            task_id = message["payload"].get("task_id")
            if task_id:
                delivered.setdefault(task_id, now)
            try:
                await conn.request("POST", f"/api/worker/messages/{message['id']}/ack/", headers, timeout=30)
            except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError):
                errors["pull"] += 1
    conn.close()


async def _submit(owner: Conn, data: dict, n: int, submitted: dict, accept: list) -> bool:
    """One acceptance to a random one of the first ``n`` machines; False on an error."""
    headers = {"Authorization": f"Token {data['token']}", "Content-Type": "application/json",
               "Idempotency-Key": uuid.uuid4().hex}
    machine = random.randrange(n)
    body = json.dumps({"machine": data["machines"][machine], "folder": f"/bench/idle-{uuid.uuid4().hex}",
                       "agent": "bench", "prompt": "p", "max_runtime_s": 1, "exclusive": False}).encode()
    sent = time.perf_counter()
    try:
        status, answer = await owner.request("POST", "/api/tasks/", headers, body, timeout=DELIVERY_TIMEOUT_S)
    except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError):
        return False
    if status != 201:
        return False
    accept.append(time.perf_counter() - sent)
    task_id = json.loads(answer)["id"]
    submitted[task_id] = sent
    data.setdefault("task_machine", {})[task_id] = machine
    return True


async def _delivered(submitted: dict, delivered: dict) -> list[float]:
    deadline = time.perf_counter() + DELIVERY_TIMEOUT_S
    while time.perf_counter() < deadline and not all(t in delivered for t in submitted):
        await asyncio.sleep(0.05)
    return [delivered[t] - sent for t, sent in submitted.items() if t in delivered]


async def _submit_then_stop(server: Daphnes, data: dict, n: int, delivered: dict, workers: list, stop: asyncio.Event,
                            more) -> tuple[list[float], list[float], int, int]:
    """Submit a task every 0.5 s while ``more()``, wait for their deliveries, stop the
    pullers: (acceptance latencies, delivery latencies, acceptance errors, undelivered).
    The submissions run in a thread with an event loop of their own: an owner does not
    submit from the simulated workers' process, and on this loop (1,000 connections
    opening at once in a wave) an answer waited for the client itself, about 200 ms
    (the service's own span traced at about 250 ms of a 500 ms acceptance)."""

    async def submit_all() -> tuple[list[float], dict, int]:
        owner = Conn(server.port)
        accept, submitted, errors = [], {}, 0
        while more():
            errors += not await _submit(owner, data, n, submitted, accept)
            await asyncio.sleep(0.5)
        owner.close()
        return accept, submitted, errors

    accept, submitted, accept_errors = await asyncio.to_thread(asyncio.run, submit_all())
    delivery = await _delivered(submitted, delivered)
    data["submitted"] = submitted
    stop.set()
    for task in workers:
        task.cancel()
    await asyncio.gather(*workers, return_exceptions=True)
    return accept, delivery, accept_errors, len(submitted) - len(delivery)


def section_wave(n: int, env: dict, dbname: str, cycles: int, processes: int = 1) -> dict:
    """``n`` simulated workers start their pulls at the same instant (as after a service
    restart) and keep pulling for ``cycles`` whole pull cycles while a task is submitted
    every 0.5 s: acceptance and delivery latency through the wave and after it; the
    daphnes' CPU (% of one core), database transactions/s and RSS (MB, at the end) over
    the whole run, wave included."""
    data = setup_data(n)
    server = Daphnes(processes, env)
    try:
        cpu0, x0, t0 = server.cpu_s(), xact_commit(dbname), time.perf_counter()
        row = asyncio.run(_wave(server, data, n, cycles))
        elapsed = time.perf_counter() - t0
        return {**row, "cpu_pct": round(100 * (server.cpu_s() - cpu0) / elapsed, 1),
                "db_xact_per_s": round((xact_commit(dbname) - x0) / elapsed, 1), "rss_mb": server.rss_mb(),
                "threads": server.threads()}
    finally:
        server.stop()


async def _wave(server: Daphnes, data: dict, n: int, cycles: int) -> dict:
    delivered: dict[str, float] = {}
    errors = {"pull": 0}
    stop = asyncio.Event()
    workers = [asyncio.create_task(_puller(server, data, delivered, errors, stop, i)) for i in range(n)]
    started = time.perf_counter()
    accept, delivery, accept_errors, undelivered = await _submit_then_stop(
        server, data, n, delivered, workers, stop, lambda: time.perf_counter() - started < cycles * WAIT_S)
    first = data["first_pull"]
    # Each delivery over 0.5 s: when its task was submitted and when its machine's first
    # pull began, from the start of the wave (seconds); the client's own pace shows in
    # when its last first pull began.
    late = [{"submitted_s": round(sent - started, 2), "delivery_ms": round(1000 * (delivered[t] - sent)) if t in delivered else None,
             "first_pull_s": round(first[data["task_machine"][t]] - started, 2)}
            for t, sent in sorted(data["submitted"].items(), key=lambda item: item[1])
            if delivered.get(t, float("inf")) - sent > 0.5]
    return {"workers": n, "processes": len(server.servers), "cycles": cycles, "accept": {**lat(accept), "errors": accept_errors},
            "delivery": {**lat(delivery), "undelivered": undelivered}, "pull_errors": errors["pull"],
            "late": late, "last_first_pull_s": round(max(first.values()) - started, 2)}


BUSY_TASKS = 2  # tasks each busy machine runs at once
BUSY_RAMP_MAX_S = 900.0  # every machine's tasks running before the window, or this long at most,
BUSY_RAMP_STALL_S = 60.0  # ... or until no more ran for this long


def section_busy(n: int, env: dict, dbname: str, window_s: float, processes: int = 1, owners: int = 1) -> dict:
    """``n`` simulated busy workers at the service's lease timings (production's unless
    ``env`` says otherwise), each running ``BUSY_TASKS`` long tasks (issue 44): pull and
    ack its start messages, grant a lease per task, send both tasks' ``starting`` and
    ``running`` receipts in one sync, then one sync per renewal interval renewing both
    leases (L2, as ``machine.worker.renewer`` does), and once the window is over and the
    real worker's last tasks ended (the steady state throughout), the
    ``final`` receipts in one sync. Reported: service CPU (% of one core) and database
    transactions/s over ``window_s`` seconds of steady state, the sync's latency, the
    receipt lag (queued -> answered, seconds) p50/p99, renewals refused, and the tasks
    that passed through ``unknown`` (a healthy task's lease that expired). ``owners``: the
    machines are dealt round-robin among that many owners (one by default, the real
    worker's): an owner's settlements serialize on their budget row (P2)."""
    from django.db import connection
    from django.db.models import Count

    from tasks_app.models import Task, TaskEvent

    data = setup_data(n)
    data["owner_tokens"] = [data["token"]] * n
    for k in range(1, owners):
        _move_to_new_owner(data, range(k, n, owners))
    server = Daphnes(processes, env)
    real = ShortTasks(server, data, env)
    try:
        real.start()
        row = asyncio.run(_busy(server, data, n, dbname, window_s, real))
    finally:
        real.stop.set()
        real.close()
        server.stop()
    mine = Task.objects.filter(machine_id__in=data["machines"])
    row["states_after"] = dict(mine.values_list("state").annotate(n=Count("id")).values_list("state", "n"))
    row["passed_through_unknown"] = TaskEvent.objects.filter(task__in=mine, new_state="unknown").count()
    row["real_worker"] = real.figures()
    row["owners"] = owners
    connection.close()
    return row


def _move_to_new_owner(data: dict, machines: range) -> None:
    """The busy section's machines ``machines`` (indexes into ``data``) and their grants
    go to a new owner with its own budget and token."""
    from django.db import connection

    from tasks_app.models import Grant, Machine

    other = setup_data(0)
    ids = [data["machines"][i] for i in machines]
    Machine.objects.filter(id__in=ids).update(owner=other["user"])
    Grant.objects.filter(machine_id__in=ids).update(owner=other["user"])
    for i in machines:
        data["owner_tokens"][i] = other["token"]
    connection.close()


class ShortTasks(threading.Thread):
    """Beside the busy section's simulated workers: one real paired ``manage.py worker``
    with ``max_concurrent = 4`` and short tasks (0-2.5 s of ``sleep``), ``RATE`` offered
    per second until ``stop``. ``figures()``: its tasks' final states, how many passed
    through ``unknown``, and two lags of its ``running`` and ``final`` receipts (the
    service's ``received_at`` minus, one machine, one wall clock): the receipt lag proper,
    minus the moment the worker queued the receipt in its outbox (``created_wall``:
    queued -> received, the issue's measure), and minus the moment the receipt reports
    (the launcher's start time, plus ``runtime_s`` for the final one: the worker's own
    steps from spawn to queue included)."""

    RATE = 2.5

    def __init__(self, server: "Daphnes", data: dict, env: dict):
        import httpx

        super().__init__(daemon=True)
        self.stop, self.server, self.token = threading.Event(), server, data["token"]
        self.go, self.submit_errors = threading.Event(), 0  # set once the busy machines run
        self.state = Path(tempfile.mkdtemp(prefix="bench-busy-worker-"))
        api = {"Authorization": f"Token {self.token}"}
        code = httpx.post(server.url + "/api/machines/pairing-codes/", json={"name": "real"}, headers=api).json()["code"]
        subprocess.run([sys.executable, "manage.py", "pair_worker", "--server", server.url, "--code", code,
                        "--state-dir", str(self.state / "s")], cwd=BASE_DIR, env={**os.environ, **env}, check=True,
                       capture_output=True)
        config = self.state / "worker.toml"
        config.write_text(f'allowed_roots = ["{self.state}"]\nmax_concurrent = 4\n\n[profiles.short]\n'
                          'argv = ["python3", "-c", "import random, time; time.sleep(random.uniform(0, 2.5))"]\n')
        self.worker = subprocess.Popen([sys.executable, "manage.py", "worker", "--server", server.url, "--state-dir",
                                        str(self.state / "s"), "--config", str(config)], cwd=BASE_DIR,
                                       env={**os.environ, **env}, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        from django.db import connection

        from tasks_app.models import Machine

        self.machine = str(Machine.objects.filter(owner=data["user"]).exclude(id__in=data["machines"]).get().id)
        connection.close()
        httpx.post(server.url + "/api/grants/", json={"machine": self.machine, "path": str(self.state)}, headers=api)

    def run(self):
        import httpx

        api = {"Authorization": f"Token {self.token}"}
        self.go.wait()  # the busy machines' ramp is over: this measures the steady state
        with httpx.Client(base_url=self.server.url, headers=api, timeout=30) as client:
            while not self.stop.wait(1 / self.RATE):
                try:
                    client.post("/api/tasks/", headers={"Idempotency-Key": uuid.uuid4().hex}, json={
                        "machine": self.machine, "folder": str(self.state), "agent": "short", "prompt": "p",
                        "exclusive": False})
                except httpx.HTTPError:
                    self.submit_errors += 1
        from django.db import connection

        from tasks_app.models import Task

        deadline = time.monotonic() + 120  # every task it took ends
        unfinished = Task.objects.filter(machine_id=self.machine, state__in=("accepted", "delivered", "starting", "running"))
        while time.monotonic() < deadline and unfinished.exists():
            time.sleep(1)
        connection.close()

    def figures(self) -> dict:
        from django.db.models import Count

        from tasks_app.models import Receipt, Task, TaskEvent

        mine = Task.objects.filter(machine_id=self.machine)
        lags = {"running": [], "final": []}
        started = {}
        for receipt in Receipt.objects.filter(machine_id=self.machine, kind="running").order_by("received_at"):
            started[receipt.task_id] = receipt.body["facts"]["process_start_time"]
            lags["running"].append(receipt.received_at.timestamp() - started[receipt.task_id])
        for receipt in Receipt.objects.filter(machine_id=self.machine, kind="final"):
            facts = receipt.body["facts"]
            if receipt.task_id in started and facts.get("runtime_s") is not None:
                lags["final"].append(receipt.received_at.timestamp() - started[receipt.task_id] - facts["runtime_s"])
        queued = {"running": [], "final": []}
        with sqlite3.connect(f"file:{self.state / 's' / 'worker.sqlite3'}?mode=ro", uri=True) as db:
            walls = dict(db.execute("SELECT event_id, created_wall FROM outbox WHERE kind IN ('running', 'final')"))
        for event_id, kind, received in Receipt.objects.filter(machine_id=self.machine, kind__in=queued).values_list(
                "event_id", "kind", "received_at"):
            if event_id in walls:
                queued[kind].append(received.timestamp() - walls[event_id])
        return {"tasks": mine.count(), "submit_errors": self.submit_errors,
                "running_receipt_queued_lag": lat(queued["running"]), "final_receipt_queued_lag": lat(queued["final"]),
                "states_after": dict(mine.values_list("state").annotate(n=Count("id")).values_list("state", "n")),
                "passed_through_unknown": TaskEvent.objects.filter(task__in=mine, new_state="unknown").count(),
                "running_receipt_lag": lat(lags["running"]), "final_receipt_lag": lat(lags["final"])}

    def close(self):
        from tests.procs import stop_process

        stop_process(self.worker)


async def _busy(server: "Daphnes", data: dict, n: int, dbname: str, window_s: float, real: ShortTasks) -> dict:
    owners = [Conn(server.port) for _ in range(8)]
    submitted = []

    async def submit_all(conn: Conn, machines: range):
        for i in machines:
            for _ in range(BUSY_TASKS):
                headers = {"Authorization": f"Token {data['owner_tokens'][i]}", "Content-Type": "application/json",
                           "Idempotency-Key": uuid.uuid4().hex}
                body = json.dumps({"machine": data["machines"][i], "folder": f"/bench/busy-{uuid.uuid4().hex}",
                                   "agent": "bench", "prompt": "p", "max_runtime_s": 36000, "exclusive": False})
                status, _ = await conn.request("POST", "/api/tasks/", headers, body.encode())
                submitted.append(status)

    await asyncio.gather(*(submit_all(c, range(k, n, len(owners))) for k, c in enumerate(owners)))
    for conn in owners:
        conn.close()
    figures = {"running": 0, "refused": 0, "sync_errors": 0, "errors": {}}
    lag: dict[str, list[float]] = {"start": [], "renew": [], "final": [], "gap": []}
    syncs: list[float] = []
    stop, window = asyncio.Event(), {"open": False}
    machines = []
    for i in range(n):  # ramp up over about two seconds, as in the idle section
        machines.append(asyncio.create_task(_busy_machine(server, data, i, figures, lag, syncs, stop, window)))
        if i % 50 == 49:
            await asyncio.sleep(0.1)
    # The ramp (every machine pulls, acks, grants and reports its two starts) is a wave of
    # about 6 requests a machine on this 2-core machine: it is waited out before the window,
    # which measures the steady state (renewals, the real worker's short tasks).
    ramp0, client_cpu0 = time.perf_counter(), time.process_time()
    deadline, last, grew = ramp0 + BUSY_RAMP_MAX_S, -1, ramp0
    while figures["running"] < n * BUSY_TASKS and time.perf_counter() < deadline:
        if figures["running"] != last:
            last, grew = figures["running"], time.perf_counter()
        elif time.perf_counter() - grew > BUSY_RAMP_STALL_S:
            break  # no machine got further for a while: measure what runs (the errors say why)
        await asyncio.sleep(0.5)
    ramp_s, running_before = time.perf_counter() - ramp0, figures["running"]
    client_cpu_ramp = 100 * (time.process_time() - client_cpu0) / ramp_s
    real.go.set()
    await asyncio.sleep(20.0)  # past the first renewal of every machine: the steady state
    window["open"] = True
    cpu0, x0, t0, client0 = server.cpu_s(), xact_commit(dbname), time.perf_counter(), time.process_time()
    await asyncio.sleep(window_s)
    elapsed = time.perf_counter() - t0
    cpu1, x1, client1 = server.cpu_s(), xact_commit(dbname), time.process_time()
    window["open"] = False
    real.stop.set()  # the real worker's last tasks end while the machines still only renew
    await asyncio.to_thread(real.join)
    stop.set()
    await asyncio.gather(*machines, return_exceptions=True)
    return {
        "machines": n, "processes": len(server.servers), "tasks_per_machine": BUSY_TASKS, "accepted": submitted.count(201),
        "ramp_s": round(ramp_s, 1), "running_before_window": running_before,
        "running_receipts_answered": figures["running"],
        "cpu_pct": round(100 * (cpu1 - cpu0) / elapsed, 1),
        "db_xact_per_s": round((x1 - x0) / elapsed, 1),
        "sync_in_window": lat(syncs),
        "receipt_lag_start": lat(lag["start"]), "renewal_lag": lat(lag["renew"]), "receipt_lag_final": lat(lag["final"]),
        # The renewal interval as the service saw it (grant or renewal answered -> next
        # renewal answered; renew_every_s plus the sync's time plus this client's own
        # lateness): over the lease's duration, a lease expires whatever the service does.
        "renewal_gap": lat(lag["gap"]),
        # This bench process's CPU (the simulated machines' asyncio loop, the real worker's
        # submitter), % of a core: near 100 %, its timers fire late.
        "client_cpu_pct": {"ramp": round(client_cpu_ramp, 1), "window": round(100 * (client1 - client0) / elapsed, 1)},
        "renewals_refused": figures["refused"], "sync_errors": figures["sync_errors"], "errors": figures["errors"],
    }


def _count_error(figures: dict, where: str, exc: BaseException) -> None:
    """How many of each error (its first words) a busy machine met, by where."""
    key = f"{where}: {type(exc).__name__}: {str(exc)[:80]}"
    figures["errors"][key] = figures["errors"].get(key, 0) + 1


async def _busy_machine(server: "Daphnes", data: dict, i: int, figures: dict, lag: dict, syncs: list,
                        stop: asyncio.Event, window: dict):
    """Busy machine ``i`` of the busy section: its pulls on one connection, its receipts
    (syncs) on another, and its renewals on a third from its first lease's grant on, as
    ``machine.worker``'s renewer thread keeps them whatever the other requests wait for
    (a grant retried after 503 included)."""
    headers = {"Authorization": f"Machine {data['machine_tokens'][i]}", "Content-Type": "application/json"}
    pull, sync, renew = Conn(server.port_of(i)), Conn(server.port_of(i)), Conn(server.port_of(i))

    async def post(conn: Conn, path: str, body: dict) -> dict:
        status, answer = await conn.request("POST", path, headers, json.dumps(body).encode())
        while status == 503:  # service_busy: again after its Retry-After (1 s), as the worker does
            _count_error(figures, "503 (retried)", ValueError(path))
            await asyncio.sleep(1.0)
            status, answer = await conn.request("POST", path, headers, json.dumps(body).encode())
        if status >= 300:
            raise ValueError(f"{path}: {status} {answer[:200]!r}")
        return json.loads(answer)

    def receipt(operation_id: str, kind: str, facts: dict) -> dict:
        return {"event_id": uuid.uuid4().hex, "generation": 1, "operation_id": operation_id, "kind": kind,
                "slept_s": 0.0, "facts": facts}

    async def send(conn: Conn, body: dict, into: list) -> dict:
        """``body`` as one sync; its latency into ``into`` once per item it carries."""
        queued = time.perf_counter()
        try:
            answer = await post(conn, "/api/worker/sync/", body)
        except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
            figures["sync_errors"] += 1
            _count_error(figures, "sync", exc)
            return {"leases": [], "receipts": []}
        took = time.perf_counter() - queued
        if window["open"]:
            syncs.append(took)
        into.extend([took] * len(body.get("receipts") or body.get("renew") or []))
        return answer

    leases: dict[str, dict] = {}

    async def renewals(every: float) -> None:
        """Every ``every`` seconds from the first grant, one sync renewing the leases
        granted so far (L2); ``lag["gap"]``: answer to answer, as the service saw it."""
        renewed = time.perf_counter()
        while True:
            try:
                await asyncio.wait_for(stop.wait(), max(0.0, renewed + every - time.perf_counter()))
                return
            except TimeoutError:
                pass
            answer = await send(renew, {"renew": [{"lease_id": lease["lease_id"]} for lease in leases.values()]},
                                lag["renew"])
            lag["gap"].append(time.perf_counter() - renewed)  # since the first grant or the last renewal
            renewed = time.perf_counter()
            for refused in (a for a in answer["leases"] if a["status"] != 200):
                figures["refused"] += 1
                when = "in the window" if window["open"] else "outside the window"
                _count_error(figures, f"renewal refused {when}", ValueError(refused.get("error")))

    renewer = None
    try:
        operations = []
        while len(operations) < BUSY_TASKS and not stop.is_set():
            try:
                status, body = await pull.request("GET", f"/api/worker/messages/?wait={WAIT_S}", headers,
                                                  timeout=WAIT_S + 15)
            except TimeoutError as exc:  # a slow answer in the wave: pull again, as the worker does
                _count_error(figures, "pull (retried)", exc)
                continue
            for message in json.loads(body)["messages"] if status == 200 else []:
                await post(pull, f"/api/worker/messages/{message['id']}/ack/", {})
                if message["kind"] == "start":
                    operations.append(message["payload"]["operation_id"])
        for op in operations:
            leases[op] = await post(sync, "/api/worker/leases/", {"operation_id": op})
            renewer = renewer or asyncio.create_task(renewals(leases[op]["renew_every_s"]))
        began = time.time()
        answer = await send(sync, {"receipts": [r for op, lease in leases.items() for r in (
            receipt(op, "starting", {"lease_id": lease["lease_id"]}),
            receipt(op, "running", {"pid": 10_000 + i, "pgid": 10_000 + i, "process_start_time": began}))]}, lag["start"])
        figures["running"] += sum(1 for a in answer["receipts"][1::2] if a["status"] < 300)
        await stop.wait()
    except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError, ValueError) as exc:
        figures["sync_errors"] += 1
        _count_error(figures, "ramp", exc)
        if renewer:
            renewer.cancel()
        return
    if renewer:
        await renewer
        every = next(iter(leases.values()))["renew_every_s"]
        await asyncio.sleep(random.uniform(0, every))  # the tasks end spread over one interval, not at once
        runtime = time.time() - began
        await send(renew, {"receipts": [receipt(op, "final", {  # the connection kept open by the renewals
            "process_started": True, "exit_code": 0, "signal": None, "lease_id": lease["lease_id"],
            "ended_within_lease": True, "runtime_s": runtime, "stop_reason": "exit", "survivors": [],
            "output_tail": ""}) for op, lease in leases.items()]}, lag["final"])
    for conn in (pull, sync, renew):
        conn.close()


def section_http(shapes: list[str], env: dict, duration_s: float, conns: list[int]) -> list[dict]:
    data = setup_data(1)
    # "accept_owners": each connection submits as its own owner (acceptance serializes per
    # owner on the budget row, A5), to tell the per-owner ceiling from the process's.
    data["owners"] = [setup_data(1) for _ in range(max(conns))]
    rows = []
    for shape in shapes:
        try:
            server = Server(shape, env)
        except RuntimeError as exc:
            print(f"  {shape}: {exc}", file=sys.stderr)
            continue
        try:
            for c in conns:
                keys = []
                for what in ("bare", "accept", "replay", "accept_owners"):
                    row = asyncio.run(_http(server, data, what, c, duration_s, keys))
                    rows.append({"shape": shape, "what": what, "connections": c, **row})
                    print(f"  http {shape} {what} x{c}: {row}", file=sys.stderr)
        finally:
            server.stop()
    return rows


async def _http(server: Server, data: dict, what: str, c: int, duration_s: float, keys: list) -> dict:
    headers = {"Authorization": f"Token {data['token']}", "Content-Type": "application/json"}
    latencies, statuses = [], {}
    end = time.perf_counter() + duration_s
    replay = list(keys)

    async def client(idx: int):
        conn = Conn(server.port)
        j = idx
        me = data["owners"][idx] if what == "accept_owners" else data
        my_headers = {**headers, "Authorization": f"Token {me['token']}"}
        while time.perf_counter() < end:
            if what == "bare":
                args = ("GET", "/api/budget/", headers, b"")
            else:
                if what == "accept_owners":
                    key = uuid.uuid4().hex
                elif what == "accept":
                    key = uuid.uuid4().hex
                    keys.append(key)
                else:
                    if not replay:
                        return
                    key = replay[j % len(replay)]
                    j += c
                body = json.dumps({"machine": me["machines"][0], "folder": f"/bench/{key}", "agent": "bench",
                                   "prompt": "p", "max_runtime_s": 1, "exclusive": False}).encode()
                args = ("POST", "/api/tasks/", {**my_headers, "Idempotency-Key": key}, body)
            t0 = time.perf_counter()
            try:
                status, _ = await conn.request(*args, timeout=60)
            except (TimeoutError, OSError, ConnectionError, asyncio.IncompleteReadError):
                status = "error"
            latencies.append(time.perf_counter() - t0)
            statuses[status] = statuses.get(status, 0) + 1
        conn.close()

    t0 = time.perf_counter()
    await asyncio.gather(*(client(i) for i in range(c)))
    elapsed = time.perf_counter() - t0
    return {"req_per_s": round(len(latencies) / elapsed, 1), **lat(latencies), "statuses": {str(k): v for k, v in statuses.items()}}


def section_board(counts: list[int], env: dict, rounds: int) -> list[dict]:
    """Board push latency: the sockets live in a separate client process
    (``_board_clients``), so the writer's clock is not slowed by 500 receivers; times
    are ``time.monotonic()``, one clock for every process of the machine."""
    import multiprocessing

    data = setup_data(0)
    server = Server("daphne", env)
    rows = []
    try:
        for n in counts:
            ready, results = multiprocessing.Event(), multiprocessing.Queue()
            clients = multiprocessing.Process(target=_board_clients,
                                              args=(server.port, data["token"], n, rounds, ready, results))
            clients.start()
            rows.append(_board_writer(server, data, n, rounds, ready, results))
            clients.join(30)
            print(f"  board {n}: {rows[-1]}", file=sys.stderr)
    finally:
        server.stop()
    return rows


def _board_clients(port: int, token: str, n: int, rounds: int, ready, results) -> None:
    """Client process: ``n`` board sockets; puts ``(connect_failed, {session_id: [first
    session.status receive time per socket]})`` on ``results`` once ``rounds`` sessions
    were seen on every socket (or 10 s after the last one arrived)."""
    import websockets

    async def run():
        sockets, failed = [], 0
        for _ in range(n):
            try:
                sockets.append(await websockets.connect(f"ws://127.0.0.1:{port}/ws/board/", open_timeout=30,
                                                        additional_headers={"Authorization": f"Token {token}"},
                                                        max_queue=None))
            except Exception:
                failed += 1
        seen: dict[str, list[float]] = {}

        async def read(ws):
            mine = set()
            while len(mine) < rounds:
                event = json.loads(await ws.recv())
                if event.get("type") == "session.status" and event["session_id"] not in mine:
                    mine.add(event["session_id"])
                    seen.setdefault(event["session_id"], []).append(time.monotonic())

        readers = [asyncio.create_task(read(ws)) for ws in sockets]
        ready.set()
        await asyncio.wait(readers, timeout=10 + rounds * 2)
        for task in readers:
            task.cancel()
        for ws in sockets:
            await ws.close()
        results.put((failed, seen))

    asyncio.run(run())


def _board_writer(server: Server, data: dict, n: int, rounds: int, ready, results) -> dict:
    import httpx

    assert ready.wait(120), "the board clients did not connect"
    sent = {}
    with httpx.Client(base_url=server.url, headers={"Authorization": f"Token {data['token']}"}, timeout=30) as api:
        for _ in range(rounds):
            session_id = str(uuid.uuid4())
            sent[session_id] = time.monotonic()
            api.put(f"/api/sessions/{session_id}/marker/",
                    json={"turn_id": uuid.uuid4().hex, "device_id": "bench", "state": "running"})
            time.sleep(0.5)  # one event at a time: its latency, not a queue of them
    failed, seen = results.get(timeout=60 + rounds * 2)
    latencies = [at - sent[sid] for sid, times in seen.items() if sid in sent for at in times]
    missing = rounds * (n - failed) - len(latencies)
    return {"sockets": n, "connect_failed": failed, "rounds": rounds, **lat(latencies), "missing": missing}


def section_statements() -> dict:
    """One acceptance, its replay and ``GET /api/budget/`` through the test client on the
    scratch database: each one's statements (first words) and its ratio to the read."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from rest_framework.test import APIClient

    data = setup_data(1)
    client = APIClient(HTTP_AUTHORIZATION=f"Token {data['token']}", HTTP_HOST="127.0.0.1")
    body = {"machine": data["machines"][0], "folder": "/bench", "agent": "demo", "prompt": "p", "exclusive": False}
    client.get("/api/budget/")  # the first request pays for imports and the connection

    def measure(call) -> dict:
        with CaptureQueriesContext(connection) as captured:
            status = call().status_code
        words = [" ".join(q["sql"].split()[:3]) for q in captured.captured_queries]
        return {"status": status, "statements": len(words), "sql": words}

    key = uuid.uuid4().hex
    out = {
        "read": measure(lambda: client.get("/api/budget/")),
        "accept": measure(lambda: client.post("/api/tasks/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)),
        "replay": measure(lambda: client.post("/api/tasks/", body, format="json", HTTP_IDEMPOTENCY_KEY=key)),
    }
    out["renewal_sync"] = _renewal_sync_cost(data, client)
    connection.close()
    for what in ("accept", "replay", "renewal_sync"):
        out[what]["ratio_to_read"] = round(out[what]["statements"] / max(1, out["read"]["statements"]), 1)
    return out


def _busy_machine_leases(submit, worker) -> list[dict]:
    """Submit ``BUSY_TASKS`` tasks (``submit()``: one ``POST /api/tasks/``), then, as their
    machine (``worker(method, path, body) -> dict``, the JSON answer), pull, ack each
    message and take each start's lease. Returns a sync's ``renew`` ``[{"lease_id"}]``."""
    for _ in range(BUSY_TASKS):
        submit()
    renew = []
    for message in worker("GET", "/api/worker/messages/?wait=0", None)["messages"]:
        worker("POST", f"/api/worker/messages/{message['id']}/ack/", {})
        if message["kind"] == "start":
            lease = worker("POST", "/api/worker/leases/", {"operation_id": message["payload"]["operation_id"]})
            renew.append({"lease_id": lease["lease_id"]})
    return renew


def _renewal_sync_cost(data: dict, owner, rounds: int = 300) -> dict:
    """A busy machine's usual request (issue 44): ``POST /api/worker/sync/`` renewing its
    leases: the ``BUSY_TASKS`` submitted here and the acceptance ``section_statements``
    measured before (three; a sync's statements do not grow with its leases). Its statements, and this process's CPU per sync (ms, ``time.process_time``
    over ``rounds`` syncs, no network, no daphne): through Django's handler (the test
    client) and the service function alone (``machine_sync``), so their difference is what
    the handler, the middleware and DRF add."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from rest_framework.test import APIClient

    from core import clock
    from tasks_app.models import Machine
    from tasks_app.services.sync import machine_sync

    body = {"machine": data["machines"][0], "folder": "/bench", "agent": "demo", "prompt": "p", "exclusive": False}
    worker = APIClient(HTTP_AUTHORIZATION=f"Machine {data['machine_tokens'][0]}", HTTP_HOST="127.0.0.1")
    renew = _busy_machine_leases(
        lambda: owner.post("/api/tasks/", body, format="json", HTTP_IDEMPOTENCY_KEY=uuid.uuid4().hex),
        lambda method, path, body: (worker.get(path) if method == "GET" else worker.post(path, body, format="json")).json())

    def sync():
        return worker.post("/api/worker/sync/", {"renew": renew}, format="json")

    sync()  # the token cache and the machine's last_heard_at warm, as in the steady state
    with CaptureQueriesContext(connection) as captured:
        status = sync().status_code
    out = {"status": status, "leases": len(renew), "statements": len(captured.captured_queries),
           "sql": [" ".join(q["sql"].split()[:3]) for q in captured.captured_queries]}
    started = time.process_time()
    for _ in range(rounds):
        sync()
    out["cpu_ms_through_django"] = round((time.process_time() - started) * 1000 / rounds, 2)
    machine = Machine.objects.get(pk=data["machines"][0])
    started = time.process_time()
    for _ in range(rounds):
        machine_sync(machine=machine, renew=renew, receipts=[], now=clock.now())
    out["cpu_ms_service_alone"] = round((time.process_time() - started) * 1000 / rounds, 2)
    return out


def section_request_cost(env: dict, rounds: int = 400) -> dict:
    """The daphne's CPU per request over real HTTP (ms, the server process's CPU time over
    ``rounds`` requests one after another on one keep-alive connection): a busy machine's
    usual renewal sync (``POST /api/worker/sync/`` renewing its ``BUSY_TASKS`` leases;
    issue 44) beside a bare authenticated owner read (``GET /api/budget/``), what any
    request costs through daphne, Django's handler, the middleware and DRF."""
    import httpx

    data = setup_data(1)
    server = Server("daphne", env)
    try:
        owner = httpx.Client(base_url=server.url, headers={"Authorization": f"Token {data['token']}"})
        machine = httpx.Client(base_url=server.url, headers={"Authorization": f"Machine {data['machine_tokens'][0]}"})
        body = {"machine": data["machines"][0], "folder": "/bench", "agent": "bench", "prompt": "p",
                "exclusive": False, "max_runtime_s": 36000}
        renew = _busy_machine_leases(
            lambda: owner.post("/api/tasks/", headers={"Idempotency-Key": uuid.uuid4().hex}, json=body).raise_for_status(),
            lambda method, path, body: machine.request(method, path, json=body).raise_for_status().json())
        out = {"leases": len(renew)}
        for name, call in (("renewal_sync", lambda: machine.post("/api/worker/sync/", json={"renew": renew})),
                           ("bare_owner_read", lambda: owner.get("/api/budget/"))):
            for _ in range(20):  # the caches and the connection pool warm, as in the steady state
                call().raise_for_status()
            cpu0, t0 = server.cpu_s(), time.perf_counter()
            for _ in range(rounds):
                call().raise_for_status()
            out[name] = {"cpu_ms": round(1000 * (server.cpu_s() - cpu0) / rounds, 2),
                         "wall_ms": round(1000 * (time.perf_counter() - t0) / rounds, 2)}
        return out
    finally:
        server.stop()


def section_worker(env: dict, seconds: float) -> dict:
    import httpx
    import psutil

    data = setup_data(0)
    server = Server("daphne", env)
    state = tempfile.mkdtemp(prefix="bench-worker-")
    try:
        code = httpx.post(server.url + "/api/machines/pairing-codes/", json={"name": "rest"},
                          headers={"Authorization": f"Token {data['token']}"}).json()["code"]
        subprocess.run([sys.executable, "manage.py", "pair_worker", "--server", server.url, "--code", code,
                        "--state-dir", state + "/s"], cwd=BASE_DIR, env={**os.environ, **env}, check=True, capture_output=True)
        config = Path(state) / "worker.toml"
        config.write_text(f'allowed_roots = ["{state}"]\n[profiles.demo]\nargv = ["true"]\n')
        worker = subprocess.Popen([sys.executable, "manage.py", "worker", "--server", server.url, "--state-dir", state + "/s",
                                   "--config", str(config)], cwd=BASE_DIR, env={**os.environ, **env},
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(5)
            proc = psutil.Process(worker.pid)
            c0 = proc.cpu_times()
            time.sleep(seconds)
            c1 = proc.cpu_times()
            cpu = (c1.user + c1.system) - (c0.user + c0.system)
            return {"cpu_s_per_min": round(cpu * 60 / seconds, 3), "rss_mb": round(proc.memory_info().rss / 2**20, 1),
                    "threads": proc.num_threads(), "seconds": seconds}
        finally:
            worker.terminate()
            worker.wait(30)
    finally:
        server.stop()


# --- the table ------------------------------------------------------------------------


def table(report: dict) -> str:
    out = [f"RunStead bench '{report['label']}' at {report['started']} (load average {report['loadavg']}, "
           f"{report['cpus']} CPUs, git {report['git']})"]
    if report.get("idle"):
        out.append("\nidle workers | daphnes | RSS MB | CPU % core | DB xact/s | threads | accept p50/p99 ms | delivered p50/p99 ms (undelivered) | pull errors")
        for r in report["idle"]:
            a, d = r["accept"], r["delivery"]
            out.append(f"  {r['workers']:>5} | {r.get('processes', 1)} | {r.get('rss_mb')} | {r['cpu_pct']:>6} | {r['db_xact_per_s']:>7} | {r['threads']:>5} | "
                       f"{a['p50_ms']}/{a['p99_ms']} ({a['errors']} err) | {d['p50_ms']}/{d['p99_ms']} ({d['undelivered']}) | {r['pull_errors']}")
    if report.get("statements", {}).get("renewal_sync"):
        r = report["statements"]["renewal_sync"]
        out.append(f"\nrenewal sync ({r['leases']} leases): {r['statements']} statements; CPU {r['cpu_ms_through_django']} ms "
                   f"through Django's handler, {r['cpu_ms_service_alone']} ms the service alone")
    if report.get("http"):
        out.append("\nHTTP shape | what | conns | req/s | p50 ms | p99 ms | statuses")
        for r in report["http"]:
            out.append(f"  {r['shape']:<8} | {r['what']:<6} | {r['connections']:>3} | {r['req_per_s']:>7} | {r['p50_ms']} | {r['p99_ms']} | {r['statuses']}")
    if report.get("board"):
        out.append("\nboard sockets | push p50 ms | p99 ms | max ms | missing | connect failed")
        for r in report["board"]:
            out.append(f"  {r['sockets']:>4} | {r['p50_ms']} | {r['p99_ms']} | {r['max_ms']} | {r['missing']} | {r['connect_failed']}")
    if report.get("approvals"):
        from approvals import rows

        out.append("\napprovals (Q3), one daphne")
        out += ["  " + line for line in rows(report["approvals"])]
    if report.get("wave"):
        w = report["wave"]
        a, d = w["accept"], w["delivery"]
        out.append(f"\npull-start wave: {w['workers']} workers at once, {w['cycles']} cycles | accept p50/p99/max ms | "
                   f"delivered p50/p99/max ms (undelivered) | pull errors")
        out.append(f"  {a['p50_ms']}/{a['p99_ms']}/{a['max_ms']} ({a['errors']} err) | "
                   f"{d['p50_ms']}/{d['p99_ms']}/{d['max_ms']} ({d['undelivered']}) | {w['pull_errors']}")
        out.append(f"  daphne CPU {w.get('cpu_pct')} % of a core, {w.get('db_xact_per_s')} xact/s, RSS {w.get('rss_mb')} MB")
        out.append(f"  the client began its last first pull {w['last_first_pull_s']} s in; deliveries over 0.5 s "
                   f"(submitted s, delivered ms, its machine's first pull s): "
                   + (", ".join(f"{x['submitted_s']}/{x['delivery_ms']}/{x['first_pull_s']}" for x in w["late"]) or "none"))
    if report.get("statements"):
        st = report["statements"]
        out.append("\nSQL statements per request (each a round trip; + COMMIT per transaction) | x bare read")
        for what in ("read", "accept", "replay"):
            r = st[what]
            out.append(f"  {what:<6} | {r['statements']:>3} | x{r.get('ratio_to_read', 1.0)} | HTTP {r['status']} | "
                       + ", ".join(r["sql"]))
    if report.get("request_cost"):
        rc = report["request_cost"]
        out.append("\ndaphne CPU per request, one connection (ms CPU / ms wall): "
                   + ", ".join(f"{k} {v['cpu_ms']} / {v['wall_ms']}" for k, v in rc.items() if isinstance(v, dict)))
    if report.get("busy"):
        b = report["busy"]
        out.append(f"\nbusy: {b['machines']} machines x {b['tasks_per_machine']} tasks, {b.get('processes', 1)} daphne(s) | CPU % core | DB xact/s | "
                   f"sync p50/p99 ms | receipt lag start, final p99 ms | renewals refused | through unknown")
        out.append(f"  {b['cpu_pct']} | {b['db_xact_per_s']} | {b['sync_in_window']['p50_ms']}/{b['sync_in_window']['p99_ms']} | "
                   f"{b['receipt_lag_start']['p99_ms']}, {b['receipt_lag_final']['p99_ms']} | {b['renewals_refused']} | "
                   f"{b['passed_through_unknown']} (after: {b['states_after']}); ramp {b.get('ramp_s')} s, "
                   f"{b.get('running_before_window')} running before the window")
        r = b["real_worker"]
        out.append(f"  real worker, 4 at a time, short tasks: {r['tasks']} tasks {r['states_after']}, "
                   f"{r['passed_through_unknown']} through unknown; receipt lag (queued -> received) running p50/p99 "
                   f"{r['running_receipt_queued_lag']['p50_ms']}/{r['running_receipt_queued_lag']['p99_ms']} ms, final "
                   f"{r['final_receipt_queued_lag']['p50_ms']}/{r['final_receipt_queued_lag']['p99_ms']} ms; "
                   f"from the agent's start: running {r['running_receipt_lag']['p50_ms']}/{r['running_receipt_lag']['p99_ms']}"
                   f" ms, final {r['final_receipt_lag']['p50_ms']}/{r['final_receipt_lag']['p99_ms']} ms")
    if report.get("worker"):
        w = report["worker"]
        out.append(f"\nworker at rest: {w['cpu_s_per_min']} CPU s/min, RSS {w['rss_mb']} MB, {w['threads']} threads")
    return "\n".join(out)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--label", default="run")
    parser.add_argument("--sections", default="statements,wave,idle,http,board,worker,approvals,busy")
    parser.add_argument("--wave-workers", type=int, default=1000)
    parser.add_argument("--workers", default="10,100,1000")
    parser.add_argument("--processes", type=int, default=1,
                        help="daphne processes behind the simulated workers (sections idle, wave, busy; D1)")
    parser.add_argument("--busy-workers", type=int, default=1000, help="busy simulated workers (section busy)")
    parser.add_argument("--busy-owners", type=int, default=1, help="owners the busy machines are dealt among")
    parser.add_argument("--sockets", default="1,100,500")
    parser.add_argument("--shapes", default="daphne,gunicorn")
    parser.add_argument("--connections", default="1,8,32")
    parser.add_argument("--window", type=float, default=15.0, help="idle measurement window, seconds")
    parser.add_argument("--tasks", type=int, default=10, help="tasks submitted per idle step")
    parser.add_argument("--http-seconds", type=float, default=4.0)
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--worker-seconds", type=float, default=30.0)
    parser.add_argument("--hooks", type=int, default=500, help="waiting approval hooks (section approvals)")
    parser.add_argument("--approval-window", type=float, default=25.0)
    parser.add_argument("--decisions", type=int, default=100)
    parser.add_argument("--service-env", choices=SERVICE_ENVS, default="development",
                        help="RUNSTEAD_ENV of the measured service (harness.service_env): production as deploy/ "
                             "runs it (DEBUG off: no query log), without the TLS redirect (no proxy here)")
    parser.add_argument("--out", help="JSON path (default bench/results/LABEL.json)")
    args = parser.parse_args()
    if not (os.environ.get("DATABASE_URL") and os.environ.get("REDIS_URL")):
        parser.error("set DATABASE_URL (PostgreSQL) and REDIS_URL")
    os.chdir(BASE_DIR)
    sys.path.insert(0, str(BASE_DIR))

    import signal

    import psycopg

    # SIGTERM ends the run like Ctrl-C: servers stopped, scratch database dropped.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    dbname = f"bench_{os.getpid()}"
    admin_url = os.environ["DATABASE_URL"]
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {dbname}")
    parts = urlsplit(admin_url)
    env = {"DATABASE_URL": urlunsplit(parts._replace(path="/" + dbname)),
           "RUNSTEAD_CHANNEL_PREFIX": f"bench{os.getpid()}", "DJANGO_SETTINGS_MODULE": "config.settings",
           **service_env(args.service_env)}
    os.environ.update(env)
    report = report_start(args.label)
    report["service_env"] = args.service_env
    sections = args.sections.split(",")
    try:
        import django

        django.setup()
        from django.core.management import call_command

        call_command("migrate", verbosity=0)
        from django.db import connection

        connection.close()
        if "statements" in sections:
            report["statements"] = section_statements()
        if "wave" in sections:
            report["wave"] = section_wave(args.wave_workers, env, dbname, cycles=2, processes=args.processes)
        if "http" in sections:
            report["http"] = section_http(args.shapes.split(","), env, args.http_seconds, [int(x) for x in args.connections.split(",")])
        if "board" in sections:
            report["board"] = section_board([int(x) for x in args.sockets.split(",")], env, args.rounds)
        if "worker" in sections:
            report["worker"] = section_worker(env, args.worker_seconds)
        if "approvals" in sections:
            import resource

            from approvals import run_approvals

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.hooks + 256)), hard))
            report["approvals"] = run_approvals(env, dbname, admin_url, hooks=args.hooks, window_s=args.approval_window,
                                                decisions=args.decisions, state_dirs=10, batch=25)
        if "request_cost" in sections:
            report["request_cost"] = section_request_cost(env)
        if "busy" in sections:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, 4 * args.busy_workers + 256)), hard))
            report["busy"] = section_busy(args.busy_workers, env, dbname, args.window, processes=args.processes,
                                          owners=args.busy_owners)
        if "idle" in sections:
            import resource

            soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
            most = max(int(x) for x in args.workers.split(","))
            resource.setrlimit(resource.RLIMIT_NOFILE, (max(soft, min(hard, most + 1024)), hard))
            report["idle"] = section_idle([int(x) for x in args.workers.split(",")], env, dbname, args.window, args.tasks,
                                          processes=args.processes)
    finally:
        from django.db import connections

        connections.close_all()
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        out = report_save(report, Path(args.out or BASE_DIR / "bench" / "results" / f"{args.label}.json"))
        print(table(report))
        print(f"\nJSON: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
