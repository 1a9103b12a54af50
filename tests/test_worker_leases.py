"""Worker side of leases, receipts, queries and markers, with a real worker process and a
real daphne (SPEC L1, L3-L5, L8-L10, R3, R4, U1, M8; issue 6). Short real timings:
lease 3 s, renew every 0.5 s, margin 0.5 s, kill grace 0.5 s."""
import json
import signal
import time
import uuid
from datetime import datetime, timedelta

import httpx
import pytest

from machine.worker.store import Store
from tests.live import DaphneServer, module_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup, live_pids

pytestmark = [pytest.mark.machine_side, pytest.mark.slow]


@pytest.fixture
def live(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    yield setup
    setup.close()


def final_facts(task):
    return [r for r in task["receipts"] if r["kind"] == "final"][0]["body"]["facts"]


def stop_worker(worker):
    worker.send_signal(signal.SIGTERM)
    return worker.wait(timeout=20)


def test_l5_revoked_grant_renewal_refused_group_gone_within_a_renewal_interval(live):
    worker = live.start_worker()
    task_id = live.submit("tree")
    live.wait_state(task_id, "running")
    pids = wait_for(lambda: len(live.agent_pids()) >= 3 and live.agent_pids(), what="agent, child, grandchild")
    revoked_at = time.monotonic()
    assert live.api.post(f"/api/grants/{live.grant_id}/revoke/").status_code == 200
    wait_for(lambda: not live_pids([p for p, _ in pids]), timeout_s=5, interval_s=0.02, what="the whole group gone")
    gone_after = time.monotonic() - revoked_at
    assert gone_after < 0.5 + 0.5 + 0.5  # one renewal interval + kill grace + scheduling slack
    task = live.wait_final(task_id)
    assert task["state"] == "failed_lease_lost"
    assert task["stop_reason"] == "renewal_refused" and task["survivors"] == []
    assert final_facts(task)["ended_within_lease"] is False
    assert live.starts() == 1
    assert stop_worker(worker) == 0


def test_j6_row8_max_runtime_refusal_stops_the_agent_within_its_lease_and_the_task_is_failed(live):
    """L5/J6: a renewal refused for ``max_runtime`` stops the agent (L4) inside its
    lease: ``ended_within_lease`` true, so row 8 (``failed``, reason shown), never row 4
    (``failed_lease_lost``: nothing was lost)."""
    worker = live.start_worker()
    task_id = live.submit("tree", max_runtime_s=1)
    task = live.wait_final(task_id, timeout=20)
    assert (task["state"], task["stop_reason"]) == ("failed", "max_runtime"), task["state_reason"]
    assert final_facts(task)["ended_within_lease"] is True
    assert "max_runtime" in task["state_reason"]  # the reason shown (row 8)
    assert live.starts() == 1
    assert stop_worker(worker) == 0


def test_l8_setsid_escape_stopped_on_cancel_no_survivor(live):
    worker = live.start_worker()
    task_id = live.submit("setsid")
    live.wait_state(task_id, "running")
    pids = wait_for(lambda: len(live.agent_pids()) >= 2 and live.agent_pids(), what="escaped child")
    assert live.api.post(f"/api/tasks/{task_id}/cancel/").status_code == 200
    task = live.wait_final(task_id)
    assert task["state"] == "cancelled" and task["stop_reason"] == "cancel"
    assert task["survivors"] == []
    assert live_pids([p for p, _ in pids]) == []
    assert stop_worker(worker) == 0


def test_l8_forking_agent_stopped_every_process_gone_or_named(live):
    worker = live.start_worker()
    task_id = live.submit("forks")
    live.wait_state(task_id, "running")
    wait_for(lambda: len(live.agent_pids()) >= 30, what="forks under way")
    assert live.api.post(f"/api/tasks/{task_id}/cancel/").status_code == 200
    task = live.wait_final(task_id)
    assert task["state"] == "cancelled"
    assert task["survivors"] == []  # every process of the agent is gone, none to name
    # SIGKILLed forks leave the process table a moment after the stop saw them die; one
    # the stop missed would sleep on and fail this wait.
    wait_for(lambda: not live_pids([p for p, _ in live.agent_pids()]), timeout_s=3, what="every fork gone")
    assert stop_worker(worker) == 0


def test_l4_agent_ignoring_sigterm_is_killed_and_named_reason(live):
    worker = live.start_worker()
    task_id = live.submit("stubborn")
    live.wait_state(task_id, "running")
    pids = wait_for(lambda: live.agent_pids())
    assert live.api.post(f"/api/tasks/{task_id}/cancel/").status_code == 200
    task = live.wait_final(task_id)
    assert task["state"] == "cancelled" and task["signal"] == signal.SIGKILL
    assert live_pids([p for p, _ in pids]) == []
    assert stop_worker(worker) == 0


def test_l10_renewals_carry_output_tail_and_l9_slept_s_reported(live):
    worker = live.start_worker()
    task_id = live.submit("slow")
    live.wait_state(task_id, "running")
    wait_for(lambda: "agent started" in (live.task(task_id)["output_tail"] or ""), timeout_s=5,
             what="output tail from a renewal")
    task = live.wait_final(task_id)
    assert task["state"] == "succeeded"
    assert "agent done" in task["output_tail"]
    assert all(r["body"]["slept_s"] is not None and r["body"]["slept_s"] < 1 for r in task["receipts"])
    assert task["lease"]["renewals"] >= 1
    assert stop_worker(worker) == 0


def test_r4_service_down_longer_than_a_lease_agent_ended_inside_it_succeeds_later(transactional_db, make_owner, tmp_path):
    """The service goes down while the agent runs, the agent ends inside its lease, and
    the service's time passes the lease's end while it is still down: on its return the
    task is ``unknown`` (L6). The worker's final receipt, retried with backoff (R4) until
    the service answers, settles it by J6 row 6 (ended within the lease: succeeded).

    The service's time is moved, not waited out: its sweep (L6) runs with ``now`` one
    second past the lease's ``expires_at``, as a sweep process would then."""
    from tasks_app.models import Lease, Task
    from tasks_app.services.sweeps import expire_leases

    server = DaphneServer(SHORT_TIMINGS)
    live = LiveSetup(server.url, make_owner(), tmp_path)
    back = None
    try:
        worker = live.start_worker()
        task_id = live.submit("brief")  # 1 s: ends well inside its lease (TERM would come at 2 s)
        live.wait_state(task_id, "running")
        server.stop()
        try:
            wait_for(lambda: "agent done" in next((tmp_path / "state" / "ops").rglob("output.log")).read_text(),
                     timeout_s=10, what="agent finished while the service is down")
        except AssertionError:
            raise AssertionError(live.log())
        lease = Lease.objects.get(task_id=task_id)
        assert lease.ended_at is None  # no final receipt reached the service
        assert expire_leases(now=lease.expires_at + timedelta(seconds=1)) == 1
        assert Task.objects.get(pk=task_id).state == "unknown"
        back = DaphneServer(SHORT_TIMINGS, port=server.port)
        task = live.wait_final(task_id, timeout=30)
        assert task["state"] == "succeeded", live.log()
        facts = final_facts(task)
        assert facts["ended_within_lease"] is True and facts["exit_code"] == 0
        transitions = [(e.old_state, e.new_state) for e in Task.objects.get(pk=task_id).events.all()
                       if e.old_state != e.new_state]  # not the notes (a U1 report's, say)
        assert transitions[-2:] == [("running", "unknown"), ("unknown", "succeeded")]
        assert live.starts() == 1
        assert stop_worker(worker) == 0
    finally:
        live.close()
        server.stop()
        if back:
            back.stop()


def test_r3_malformed_receipt_and_not_applied_are_not_resent(live):
    worker = live.start_worker()
    task_id = live.submit("quick")
    assert live.wait_final(task_id)["state"] == "succeeded"
    assert stop_worker(worker) == 0
    op = live.task(task_id)["receipts"][0]["body"]["operation_id"]
    generation = json.loads((live.state_dir / "machine.json").read_text())["generation"]
    store = Store(str(live.state_dir / "worker.sqlite3"))
    bad = {"event_id": "bad-1", "generation": generation, "operation_id": op, "kind": "final", "slept_s": 0,
           "facts": {"process_started": "maybe", "stop_reason": "exit"}}
    late = {**bad, "event_id": "late-1", "facts": {"process_started": True, "exit_code": 1, "signal": None,
            "lease_id": None, "ended_within_lease": True, "runtime_s": 1.0, "stop_reason": "exit",
            "survivors": [], "output_tail": ""}}
    store.enqueue([{"event_id": b["event_id"], "kind": "final", "operation_id": op, "path": "/api/worker/receipts/",
                    "body": b} for b in (bad, late)], wall=time.time())
    store.close()
    assert live.run_once() == 0, live.log()
    rows = {r["event_id"]: r for r in Store(str(live.state_dir / "worker.sqlite3")).outbox.rows()}
    assert rows["bad-1"]["status"] == "given_up" and rows["bad-1"]["attempts"] == 1
    assert rows["bad-1"]["answer"].startswith("400")
    assert rows["late-1"]["status"] == "done" and rows["late-1"]["attempts"] == 1
    assert json.loads(rows["late-1"]["answer"]) == {"outcome": "not_applied", "reason": "final"}
    receipts = live.task(task_id)["receipts"]
    # Not resent: a second --once run (it sends whatever is still queued, then exits) sent
    # neither again; their outbox rows and the service's receipts are unchanged.
    assert live.run_once() == 0, live.log()
    after = {r["event_id"]: r for r in Store(str(live.state_dir / "worker.sqlite3")).outbox.rows()}
    assert {event_id: after[event_id] for event_id in rows} == rows
    # What the second run queued is its own start-up (M5 sweep, B10 profiles), nothing for this operation.
    assert [r for event_id, r in after.items() if event_id not in rows and r["operation_id"] is not None] == []
    task = live.task(task_id)
    assert task["state"] == "succeeded" and task["receipts"] == receipts


def test_u1_query_known_finished_operation_settles_unknown_task_and_unknown_operation_reports_no_record(live):
    """Two tasks leased by hand (the test acts as a worker that then vanished) go
    ``unknown`` at lease expiry. The real worker has a finished local record for the
    first only; its reports settle the first by J6 and leave the second unknown."""
    from tasks_app.models import Lease
    from tasks_app.services.sweeps import expire_leases

    token = (live.state_dir / "token").read_text().strip()
    machine = httpx.Client(base_url=live.url, headers={"Authorization": f"Machine {token}"}, timeout=10)
    known, unknown = live.submit("quick", exclusive=False), live.submit("quick", exclusive=False)
    messages = machine.get("/api/worker/messages/?wait=1").json()["messages"]
    starts = {m["payload"]["task_id"]: m for m in messages if m["kind"] == "start"}
    leases = {}
    for task_id in (known, unknown):
        assert machine.post(f"/api/worker/messages/{starts[task_id]['id']}/ack/").status_code == 200
        resp = machine.post("/api/worker/leases/", json={"operation_id": starts[task_id]["operation_id"]})
        assert resp.status_code == 201, resp.text  # a new lease (L1)
        leases[task_id] = resp.json()["lease_id"]
    # The service's time passes both leases' ends (its sweep with that ``now``, L6), rather
    # than the test waiting the 3 s out.
    last_end = max(Lease.objects.filter(task_id__in=(known, unknown)).values_list("expires_at", flat=True))
    assert expire_leases(now=last_end + timedelta(seconds=1)) == 2
    for task_id in (known, unknown):
        assert live.task(task_id)["state"] == "unknown"
    op = starts[known]["operation_id"]
    store = Store(str(live.state_dir / "worker.sqlite3"))
    store.record_message(message_id=starts[known]["id"], kind="start", operation_id=op,
                         payload=starts[known]["payload"], wall=time.time())
    store.mark_starting(op, turn_id=None, wall=time.time(), outbox=[])
    store.mark_ended(op, wall=time.time(), outbox=[], final={
        "process_started": True, "exit_code": 0, "signal": None, "lease_id": leases[known],
        "ended_within_lease": True, "runtime_s": 1.5, "stop_reason": "exit", "survivors": [], "output_tail": "ok"})
    store.close()
    worker = live.start_worker()
    task = live.wait_final(known, timeout=15)
    assert task["state"] == "succeeded"
    assert any(r["kind"] == "report" for r in task["receipts"])
    other = wait_for(lambda: (t := live.task(unknown)) and any(r["kind"] == "report" for r in t["receipts"]) and t,
                     what="no-record report")
    assert other["state"] == "unknown"
    report = [r for r in other["receipts"] if r["kind"] == "report"][0]
    assert report["body"]["facts"]["record"] is None
    assert live.starts() == 0  # a query never runs anything (X4)
    assert stop_worker(worker) == 0
    machine.close()


def test_m8_worker_writes_running_then_ended_marker_for_a_session_task(live):
    from sessions_app.models import Marker

    session_id = str(uuid.uuid4())
    worker = live.start_worker()
    task_id = live.submit("slow", session=session_id, deep_research=True)
    live.wait_state(task_id, "running")
    marker = wait_for(lambda: Marker.objects.filter(session_id=session_id, device_id=live.machine_id).first(),
                      what="running marker")
    assert marker.state == "running" and marker.deep_research and marker.device_name == "test-laptop"
    live.wait_final(task_id)
    wait_for(lambda: Marker.objects.get(pk=marker.pk).state == "ended", what="ended marker")
    ended = Marker.objects.get(pk=marker.pk)
    assert ended.turn_id == marker.turn_id
    record = Store(str(live.state_dir / "worker.sqlite3")).in_states("ended")[0]
    assert record["turn_id"] == marker.turn_id
    assert stop_worker(worker) == 0


def test_r3_token_revoked_stops_agents_and_loop_and_says_how_to_pair_again(live):
    worker = live.start_worker()
    task_id = live.submit("tree")
    live.wait_state(task_id, "running")
    pids = wait_for(lambda: len(live.agent_pids()) >= 3 and live.agent_pids(), what="agent tree")
    assert live.api.post(f"/api/machines/{live.machine_id}/unpair/").status_code == 200
    assert worker.wait(timeout=15) == 3, live.log()  # EXIT_REVOKED
    assert live_pids([p for p, _ in pids]) == []
    assert "pair_worker --server" in live.log() and "token_revoked" in live.log()
    record = Store(str(live.state_dir / "worker.sqlite3")).in_states("ended")[0]
    assert json.loads(record["final"])["stop_reason"] == "worker_shutdown"


def test_w8_at_most_max_concurrent_agents(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    live = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path, max_concurrent=1)
    try:
        worker = live.start_worker()
        first = live.submit("slow", exclusive=False)
        second = live.submit("quick", exclusive=False)
        live.wait_state(first, "running")
        live.wait_state(second, "delivered")  # acknowledged (W2), waiting for the slot; the order is proven below
        assert live.wait_final(first)["state"] == "succeeded"
        second_task = live.wait_final(second)
        assert second_task["state"] == "succeeded"
        store = Store(str(live.state_dir / "worker.sqlite3"))
        rec = {r["task_id"]: r for r in store.in_states("ended")}
        first_exit = json.loads((live.state_dir / "ops" / rec[first]["operation_id"] / "exit.json").read_text())
        assert rec[second]["spawned_wall"] >= first_exit["exit_wall"]  # never both at once
        # ...and the second waited for the slot unleased: the service granted its lease
        # (same host, same wall clock) only after the first agent had exited.
        assert datetime.fromisoformat(second_task["lease"]["granted_at"]).timestamp() >= first_exit["exit_wall"]
        assert stop_worker(worker) == 0
    finally:
        live.close()
