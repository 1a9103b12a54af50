"""The periodic sweep (SPEC L6, J5, U1, O2).

The logic runs on a pinned service clock (time-machine). Two sweepers at once are raced on
PostgreSQL. One test starts a real daphne with short timings from the environment and
watches, with no client request, a silent running task become ``unknown`` on the board
within 5 s of its lease's expiry.
"""
import asyncio
import json
import threading
import time
import uuid
from datetime import datetime, timedelta

import httpx
import pytest
from channels.layers import InMemoryChannelLayer, channel_layers
from django.core.management import call_command
from django.conf import settings
from django.db import connection
from websockets.asyncio.client import connect as ws_connect

from core import clock
from core.broadcast import owner_group
from tasks_app.models import Budget, Lease, OutboxMessage, Task, TaskEvent
from board.sweep import sweep_once
from tasks_app.services.sweeps import expire_leases, expire_start_windows
from tests.conftest import PINNED_AT as T0
from tests.factories import final_facts, grant_lease, receipt, submit
from tests.live import live_daphne  # noqa: F401  (fixture)

RUNNING = {"pid": 7, "pgid": 7, "process_start_time": 1.0}
SENT: list[tuple[str, dict]] = []


class RecordingLayer(InMemoryChannelLayer):
    """The in-memory layer, also keeping every group_send it carries."""

    async def group_send(self, group, message):
        SENT.append((group, message))
        await super().group_send(group, message)


@pytest.fixture
def board(settings):
    settings.CHANNEL_LAYERS = {"default": {"BACKEND": "tests.test_sweep.RecordingLayer"}}
    channel_layers.backends.clear()
    SENT.clear()
    yield SENT
    SENT.clear()
    channel_layers.backends.clear()


def running_task(owner, machine, folder, **extra) -> str:
    task_id = submit(owner, machine, folder, **extra).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    receipt(machine, task_id, "running", RUNNING)
    return task_id


def queries(task_id):
    return OutboxMessage.objects.filter(operation__task_id=task_id, kind="query")


# --- L6 ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_l6_u1_sweep_moves_lapsed_running_task_to_unknown_and_queries(
    owner, machine, grant, grant_root, pinned, board, django_capture_on_commit_callbacks
):
    task_id = running_task(owner, machine, grant_root)
    pinned.shift(59.999)
    assert expire_leases(now=clock.now()) == 0
    assert Task.objects.get(pk=task_id).state == "running"

    pinned.shift(0.001)  # exactly expires_at
    board.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert expire_leases(now=clock.now()) == 1
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert TaskEvent.objects.filter(task=task).last().reason == "lease expired (L6)"
    lease = Lease.objects.get(task=task)
    assert (lease.ended_at, lease.end_reason) == (clock.now(), "expired")
    # Budget reservation and folder lock stay.
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s, task.holds_lock) == (1800, 0, True)
    # U1: one query, with a query id.
    [query] = queries(task_id)
    assert query.payload["query_id"]
    # The task event went to this owner's group; no notification yet (N1: the query's
    # report, or its bound, comes first, U2).
    events = [m["event"] for g, m in board if g == owner_group(owner.pk)]
    assert [e["task"]["state"] for e in events if e["type"] == "task"] == ["unknown"]
    assert sorted(e["type"] for e in events) == ["task"]
    assert task.decision_due_at == clock.now() + timedelta(seconds=settings.RUNSTEAD_UNKNOWN_ASK_S)
    # A second pass finds nothing.
    assert expire_leases(now=clock.now()) == 0
    assert queries(task_id).count() == 1


@pytest.mark.django_db
def test_l6_sweep_moves_lapsed_starting_task_to_unknown(owner, machine, grant, grant_root, pinned):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    pinned.shift(60)
    assert expire_leases(now=clock.now()) == 1
    assert Task.objects.get(pk=task_id).state == "unknown"


@pytest.mark.django_db
def test_l6_renewed_lease_is_not_expired(owner, machine, grant, grant_root, pinned):
    from tests.conftest import machine_api

    task_id = running_task(owner, machine, grant_root)
    lease_id = Lease.objects.get(task_id=task_id).id
    pinned.shift(50)
    assert machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/").status_code == 200
    pinned.shift(50)  # 100 s after the grant, 50 s after the renewal
    assert expire_leases(now=clock.now()) == 0
    assert Task.objects.get(pk=task_id).state == "running"


@pytest.mark.django_db
def test_l6_sweep_leaves_settled_tasks_alone(owner, machine, grant, grant_root, pinned):
    task_id = running_task(owner, machine, grant_root)
    receipt(machine, task_id, "final", final_facts())
    pinned.shift(120)
    assert expire_leases(now=clock.now()) == 0
    assert Task.objects.get(pk=task_id).state == "succeeded"
    assert not queries(task_id).exists()


# --- J5 ----------------------------------------------------------------------------------


@pytest.mark.django_db
def test_j5_sweep_makes_unleased_task_not_started_after_start_window(owner, machine, grant, grant_root, pinned):
    accepted = submit(owner, machine, grant_root / "a").json()["id"]
    leased = running_task(owner, machine, grant_root / "b")
    pinned.shift(599)
    assert expire_start_windows(now=clock.now()) == 0
    pinned.shift(1)
    assert expire_start_windows(now=clock.now()) == 1
    task = Task.objects.get(pk=accepted)
    assert (task.state, task.holds_lock, task.charged_s) == ("not_started", False, 0)
    assert TaskEvent.objects.filter(task=task).last().reason == "start window passed (J5)"
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (1800, 0)  # only the leased task's reservation left
    assert Task.objects.get(pk=leased).state == "running"  # leased: J5 is not its rule
    assert expire_start_windows(now=clock.now()) == 0


@pytest.mark.django_db
def test_j5_delivered_task_also_expires(owner, machine, grant, grant_root, pinned):
    from tests.conftest import machine_api

    task_id = submit(owner, machine, grant_root).json()["id"]
    start = machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"][0]
    machine_api(machine).post(f"/api/worker/messages/{start['id']}/ack/")
    pinned.shift(600)
    assert sweep_once(now=clock.now())["start_windows"] == 1
    assert Task.objects.get(pk=task_id).state == "not_started"


@pytest.mark.django_db
def test_o2_sweep_command_once_runs_one_pass(owner, machine, grant, grant_root, pinned, capsys):
    task_id = running_task(owner, machine, grant_root)
    pinned.shift(61)
    call_command("sweep", "--once")
    assert "'leases_expired': 1" in capsys.readouterr().out
    assert Task.objects.get(pk=task_id).state == "unknown"


# --- O2: two sweepers at once ------------------------------------------------------------


def race(fn, n=2):
    """Run ``fn()`` in ``n`` threads released together; returns their results."""
    barrier = threading.Barrier(n)
    results = [None] * n
    errors = []

    def run(i):
        try:
            barrier.wait()
            results[i] = fn()
        except Exception as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    return results


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_o2_l6_two_sweepers_never_double_process(owner, machine, grant, grant_root, time_machine):
    time_machine.move_to(T0, tick=False)
    task_ids = [running_task(owner, machine, grant_root / f"t{i}") for i in range(12)]
    time_machine.shift(61)
    now = clock.now()
    results = race(lambda: expire_leases(now=now))
    assert sum(results) == 12
    for task_id in task_ids:
        assert Task.objects.get(pk=task_id).state == "unknown"
        assert TaskEvent.objects.filter(task_id=task_id, old_state="running", new_state="unknown").count() == 1
        assert queries(task_id).count() == 1
    assert expire_leases(now=now) == 0


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_o2_j5_two_sweepers_never_double_release(owner, machine, grant, grant_root, time_machine):
    time_machine.move_to(T0, tick=False)
    task_ids = [submit(owner, machine, grant_root / f"t{i}").json()["id"] for i in range(12)]
    assert Budget.objects.get(owner=owner).reserved_s == 12 * 1800
    time_machine.shift(600)
    now = clock.now()
    results = race(lambda: sweep_once(now=now)["start_windows"])
    assert sum(results) == 12
    for task_id in task_ids:
        assert TaskEvent.objects.filter(task_id=task_id, new_state="not_started").count() == 1
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (0, 0)  # released once each, never below zero


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_l6_j5_sweep_and_grant_race_exactly_one_wins(owner, machine, grant, grant_root, time_machine):
    """J5: the sweep and a late grant decide by compare-and-set; exactly one wins."""
    time_machine.move_to(T0, tick=False)
    task_ids = []
    for i in range(6):
        task_id = submit(owner, machine, grant_root / f"t{i}").json()["id"]
        task_ids.append(task_id)
        # The grant comes just in time (its clock reads 599.5 s); the sweep's reads 600 s.
        time_machine.shift(599.5)
        late = clock.now() + timedelta(seconds=0.5)
        results = race_pair(lambda: grant_lease(machine, task_id).status_code,
                            lambda: expire_start_windows(now=late))
        task = Task.objects.get(pk=task_id)
        if results[0] == 201:
            assert task.state == "starting" and results[1] == 0
        else:
            assert results[0] == 409 and task.state == "not_started" and results[1] == 1
        assert Lease.objects.filter(task=task).count() == (1 if task.state == "starting" else 0)
    budget = Budget.objects.get(owner=owner)
    started = Task.objects.filter(pk__in=task_ids, state="starting").count()
    assert budget.reserved_s == started * 1800


def race_pair(a, b):
    barrier = threading.Barrier(2)
    results = [None, None]

    def run(i, fn):
        try:
            barrier.wait()
            results[i] = fn()
        finally:
            connection.close()

    threads = [threading.Thread(target=run, args=(0, a)), threading.Thread(target=run, args=(1, b))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


# --- L6 in a real server: no client request, on time, on the board ------------------------

SHORT_TIMINGS = {
    "RUNSTEAD_EMBEDDED_SWEEP": "1",
    "RUNSTEAD_LEASE_DURATION_S": "2",
    "RUNSTEAD_LEASE_RENEW_S": "0.5",
    "RUNSTEAD_LEASE_MARGIN_S": "0.25",
    "RUNSTEAD_KILL_GRACE_S": "0.25",
    "RUNSTEAD_SWEEP_INTERVAL_S": "0.2",
}


def operation_of(task_id) -> str:
    """The task's operation id, read from a helper thread that closes its connection."""
    try:
        return str(Task.objects.get(pk=task_id).operation.id)
    finally:
        connection.close()


@pytest.mark.slow
def test_l6_real_daphne_silent_running_task_becomes_unknown_within_5s_on_the_board(
    owner, machine, grant, grant_root, live_daphne  # noqa: F811
):
    url = live_daphne(**SHORT_TIMINGS)
    ws_url = url.replace("http://", "ws://") + "/ws/board/"
    owner_headers = {"Authorization": f"Token {owner.auth_token.key}"}
    machine_headers = {"Authorization": f"Machine {machine.test_token}"}

    async def scenario():
        async with ws_connect(ws_url, additional_headers=owner_headers, open_timeout=10) as ws, \
                httpx.AsyncClient(base_url=url, timeout=10) as http:
            created = await http.post(
                "/api/tasks/", headers={**owner_headers, "Idempotency-Key": str(uuid.uuid4())},
                json={"machine": str(machine.id), "folder": str(grant_root), "agent": "demo", "prompt": "work"},
            )
            assert created.status_code == 201, created.text
            task_id = created.json()["id"]
            operation = await asyncio.to_thread(operation_of, task_id)
            lease = await http.post("/api/worker/leases/", headers=machine_headers, json={"operation_id": operation})
            assert lease.status_code == 201, lease.text
            assert lease.json()["duration_s"] == 2
            ran = await http.post("/api/worker/receipts/", headers=machine_headers, json={
                "event_id": str(uuid.uuid4()), "generation": machine.generation, "operation_id": operation,
                "kind": "running", "slept_s": 0, "facts": RUNNING,
            })
            assert ran.json() == {"outcome": "applied"}
            expires_at = datetime.fromisoformat(lease.json()["expires_at"]).timestamp()
            # From here on: no client request, only listening.
            deadline = time.monotonic() + 15
            while True:
                remaining = deadline - time.monotonic()
                assert remaining > 0, "no unknown event within 15 s"
                event = json.loads(await asyncio.wait_for(ws.recv(), remaining))
                if event["type"] == "task" and event["task"]["id"] == task_id and event["task"]["state"] == "unknown":
                    return task_id, expires_at, time.time(), event

    task_id, expires_at, seen_at, event = asyncio.run(scenario())
    assert seen_at - expires_at < 5.0, f"unknown seen {seen_at - expires_at:.2f} s after expiry"
    assert seen_at >= expires_at - 0.5  # not before the lease lapsed (same host clock)
    assert event["version"] >= 1 and event["server_time"]
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert TaskEvent.objects.filter(task=task, new_state="unknown").get().actor == "service"
    [query] = queries(task_id)
    assert query.machine_id == machine.id and query.payload["query_id"]


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_l6_sweep_racing_renewal_and_final_receipt_transitions_once(owner, machine, grant, grant_root, time_machine):
    """At expiry the sweep, a late renewal and a final receipt all reach for the same task:
    no deadlock (one lock order, P2), one transition to unknown at most, one query at most,
    and the facts settle the task."""
    from tests.conftest import machine_api

    time_machine.move_to(T0, tick=False)
    for i in range(5):
        task_id = running_task(owner, machine, grant_root / f"t{i}")
        lease_id = Lease.objects.get(task_id=task_id).id
        time_machine.shift(60)
        now = clock.now()
        barrier = threading.Barrier(3)
        answers, errors = {}, []

        def run(name, fn):
            try:
                barrier.wait()
                answers[name] = fn()
            except Exception as exc:  # noqa: BLE001 - reported below
                errors.append(exc)
            finally:
                connection.close()

        threads = [
            threading.Thread(target=run, args=("sweep", lambda: expire_leases(now=now))),
            threading.Thread(target=run, args=("renew", lambda: machine_api(machine).post(
                f"/api/worker/leases/{lease_id}/renew/").json())),
            threading.Thread(target=run, args=("final", lambda: receipt(
                machine, task_id, "final", final_facts(runtime_s=59.0)).json())),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not errors, errors
        assert answers["renew"]["error"] == "expired"
        assert answers["final"] == {"outcome": "applied"}
        task = Task.objects.get(pk=task_id)
        assert task.state == "succeeded"  # J2: ended within its lease
        assert TaskEvent.objects.filter(task=task, new_state="unknown").count() <= 1
        assert queries(task_id).count() == TaskEvent.objects.filter(task=task, new_state="unknown").count()
        assert TaskEvent.objects.filter(task=task, new_state="succeeded").count() == 1
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (0, 5 * 59.0)
