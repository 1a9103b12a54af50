"""The whole worker loop in-process against ``InMemoryService`` with a ``FakeClock``
(SPEC W2, W3, W8, L3, L5, R1, R3, R4, X3, X4; issue 10). Real agent processes
(tests/agents/agent.py), no daphne: time moves only when a test advances the clock, so
nothing waits out a real interval. The real-daphne tests of the same rules stay in
tests/test_worker_leases.py and tests/test_worker_restart.py."""
from __future__ import annotations

import json
import logging
import os
import random
import signal
import threading
import time
import uuid
from pathlib import Path

import pytest

from machine.protocol import Backoff
from machine.worker import faults
from machine.worker.clock import FakeClock
from machine.worker.loop import EXIT_REVOKED, Worker, WorkerOptions
from machine.worker.testing import InMemoryService
from tests.wait import wait_for
from tests.worker_harness import count_lines, live_pids, make_worker, recorded_pids

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

PROFILES = {
    "instant": {"AGENT_SLEEP_S": "0"},
    "long": {"AGENT_SLEEP_S": "30"},
    "tree": {"AGENT_SLEEP_S": "30", "AGENT_CHILDREN": "tree"},
    "stubborn": {"AGENT_SLEEP_S": "30", "AGENT_IGNORE_TERM": "1"},
}
# Lease terms of the fake service (seconds): renew every 15, local deadline 55 after a send.
TERMS = {"duration_s": 60.0, "renew_every_s": 15.0, "margin_s": 5.0, "kill_grace_s": 5.0}


class Rig:
    """A fake clock, a fake service, a granted root, and in-process workers on one state dir."""

    def __init__(self, tmp_path: Path):
        self.tmp = tmp_path
        self.clock = FakeClock()
        self.service = InMemoryService(self.clock, **TERMS)
        self.root = tmp_path / "root"
        self.repo = self.root / "repo"
        self.repo.mkdir(parents=True)
        self.threads: list[tuple[Worker, threading.Thread, list]] = []

    def worker(self, *, once: bool = False, backoff: Backoff | None = None) -> Worker:
        options = WorkerOptions(server="memory://", once=once, poll_wait_s=0 if once else 25)
        return make_worker(self.tmp, self.clock, roots=[str(self.root)], connect=lambda: self.service,
                           options=options, profiles=PROFILES, backoff=backoff)

    def start(self, worker: Worker) -> list:
        """Run ``worker.run()`` in a thread; the returned list receives its exit code."""
        result: list = []

        def target():
            try:
                result.append(worker.run())
            except faults.InjectedCrash as crash:
                result.append(crash)

        thread = threading.Thread(target=target, name="main", daemon=True)
        thread.start()
        self.threads.append((worker, thread, result))
        return result

    def run_once(self) -> int:
        """A ``--once`` worker run to its end (pull once, run what came, report, exit)."""
        worker = self.worker(once=True)
        result = self.start(worker)
        self.threads[-1][1].join(timeout=30)
        assert result, "the --once worker did not finish"
        return result[0]

    def submit(self, agent: str, **extra):
        return self.service.add_start(folder=str(self.repo), grant_root=str(self.root), agent=agent, **extra)

    def receipt(self, operation_id: str, kind: str, timeout: float = 15.0) -> dict:
        return wait_for(lambda: self.service.receipt(operation_id, kind), timeout_s=timeout, what=f"{kind} receipt")

    def starts(self) -> int:
        return count_lines(self.tmp / "starts")

    def agent_pids(self) -> list[int]:
        return [p for p, _ in recorded_pids(self.tmp / "pids")]

    def wait_working(self) -> None:
        """The agent is in its main loop (past its signal set-up)."""
        wait_for(lambda: any("working 1" in p.read_text() for p in (self.tmp / "state" / "ops").rglob("output.log")),
                 what="the agent at work")

    def drive(self, done, thread_prefix: str, real_timeout_s: float = 20.0) -> float:
        """Advance the fake clock to each next instant thread ``thread_prefix`` waits for,
        until ``done()``; returns the fake seconds advanced."""
        total = 0.0
        end = time.monotonic() + real_timeout_s
        while not done():
            assert time.monotonic() < end, "drive: timed out"
            try:
                total += self.clock.advance_to(thread_prefix, real_timeout_s=0.5)
            except AssertionError:
                continue  # the thread is busy (or gone): look again
        return total

    def close(self) -> None:
        for worker, thread, _ in self.threads:
            if thread.is_alive():
                worker.on_signal()
                worker.on_signal()
                self.clock.advance(60)
                thread.join(timeout=15)
        for pid in live_pids(self.agent_pids()):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def rig(tmp_path):
    r = Rig(tmp_path)
    yield r
    r.close()


def test_w2_message_committed_locally_before_ack(rig):
    seen_at_ack = {}

    def on_ack(message):
        store = rig.threads[-1][0].ctx.store
        record = store.get(message.operation_id)
        row = store.conn.execute("SELECT * FROM messages WHERE message_id = ?", (message.id,)).fetchone()
        seen_at_ack[message.id] = (record and record["local_state"], row is not None)

    rig.service.on_ack = on_ack
    start = rig.submit("instant")
    assert rig.run_once() == 0
    assert seen_at_ack == {start.id: ("received", True)}  # committed, not yet leased, when acked
    assert rig.service.messages[start.id].acks == 1
    final = rig.service.receipt(start.operation_id, "final")
    assert final["facts"]["stop_reason"] == "exit" and final["facts"]["exit_code"] == 0
    assert rig.starts() == 1


def test_w2_crash_between_commit_and_ack_runs_from_local_record_redelivery_acked_not_rerun(rig):
    start = rig.submit("instant")
    with faults.crash_at("after_commit_before_ack"):
        worker = rig.worker(once=True)
        result = rig.start(worker)
        rig.threads[-1][1].join(timeout=15)
    assert isinstance(result[0], faults.InjectedCrash)
    worker.ctx.exiting.set()
    assert rig.service.messages[start.id].acked_at is None and rig.starts() == 0
    assert rig.run_once() == 0  # the committed start runs from the local record
    assert rig.starts() == 1 and rig.service.messages[start.id].deliveries == 1
    assert rig.service.receipt(start.operation_id, "final")["facts"]["stop_reason"] == "exit"
    rig.clock.advance(rig.service.visibility_s)  # never acked: delivered again (W2)
    assert rig.run_once() == 0
    assert rig.service.messages[start.id].deliveries == 2 and rig.service.messages[start.id].acks == 1
    assert rig.starts() == 1  # recognised (W3)


def test_w3_duplicate_start_acked_not_run(rig):
    start = rig.submit("instant")
    assert rig.run_once() == 0
    assert rig.starts() == 1
    rig.service.redeliver(start.id)  # the ack got lost: the same start comes again
    assert rig.run_once() == 0  # a second --once run that has exited
    assert rig.service.messages[start.id].deliveries == 2 and rig.service.messages[start.id].acks == 2
    assert len(rig.service.calls_to("grant")) == 1  # never asked for a lease again
    assert rig.starts() == 1


def test_l5_refused_renewal_stops_agent_no_retry(rig):
    worker = rig.worker()
    result = rig.start(worker)
    start = rig.submit("stubborn")  # ignores SIGTERM: it lives through the kill grace
    rig.receipt(start.operation_id, "running")
    rig.wait_working()
    rig.service.refuse_renewals(start.operation_id, "revoked")
    rig.clock.advance(TERMS["renew_every_s"])  # a renewal is due: refused (L5)
    wait_for(lambda: rig.service.calls_to("renew"), what="the renewal")
    # Through the 5 s kill grace, step by step of the stopping thread's polls.
    advanced = rig.drive(lambda: rig.service.receipt(start.operation_id, "final"), "run-")
    assert advanced >= TERMS["kill_grace_s"]
    final = rig.receipt(start.operation_id, "final")["facts"]
    assert [c.status for c in rig.service.calls_to("renew")] == [409]  # never retried
    assert final["stop_reason"] == "renewal_refused" and final["ended_within_lease"] is False
    assert final["signal"] == signal.SIGKILL and final["survivors"] == []
    assert live_pids(rig.agent_pids()) == []
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")
    assert result == [0]


def test_r4_retry_same_event_id_backoff_capped(rig):
    rig.service.script("receipt", *[503] * 5, 429, 0, 502)  # 8 failures: 5xx, 429, network
    worker = rig.worker(backoff=Backoff(base_s=1.0, cap_s=60.0, rng=random.Random(4).random))
    worker.ctx.store.enqueue([{"event_id": "ev-1", "kind": "final", "operation_id": "op-1", "method": "POST",
                           "path": "/api/worker/receipts/", "body": {"event_id": "ev-1", "generation": 1,
                           "operation_id": "op-1", "kind": "report", "slept_s": 0,
                           "facts": {"query_id": "q-1", "record": None}}}], wall=rig.clock.wall())
    result = rig.start(worker)
    steps = []
    for attempt in range(8):
        wait_for(lambda: len(rig.service.calls_to("receipt")) == attempt + 1, what=f"attempt {attempt + 1}")
        steps.append(rig.clock.advance_to("sender"))
    wait_for(lambda: len(rig.service.calls_to("receipt")) == 9, what="the ninth attempt")
    calls = rig.service.calls_to("receipt")
    assert [c.status for c in calls] == [503] * 5 + [429, 0, 502, 200]
    assert {json.dumps(c.args["body"], sort_keys=True) for c in calls} == {json.dumps(calls[0].args["body"],
                                                                                      sort_keys=True)}
    assert {c.args["event_id"] for c in calls} == {"ev-1"}
    for n, step in enumerate(steps):  # equal jitter: [d/2, d], d = min(60, 2**n)
        ceiling = min(60.0, 2.0 ** n)
        assert ceiling / 2 <= step <= ceiling, (n, step)
    assert max(steps) <= 60 and steps[-1] >= 30 and steps[-2] >= 30  # capped at 60 s
    assert [round(b.at - a.at, 6) for a, b in zip(calls, calls[1:])] == [round(s, 6) for s in steps]
    row = [r for r in worker.ctx.store.outbox.rows() if r["event_id"] == "ev-1"][0]
    assert row["status"] == "done" and row["attempts"] == 9
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def test_r3_final_answers_never_retried(rig):
    rig.service.script("receipt", 400, 409)
    worker = rig.worker()
    rows = [{"event_id": f"ev-{n}", "kind": "report", "operation_id": "op-1", "method": "POST",
             "path": "/api/worker/receipts/", "body": {"n": n}} for n in (1, 2)]
    worker.ctx.store.enqueue(rows, wall=rig.clock.wall())  # now: a row from 1970 is W1-prunable
    result = rig.start(worker)
    wait_for(lambda: len(rig.service.calls_to("receipt")) == 2, what="both sent")
    for _ in range(5):
        rig.clock.advance(60)
    wait_for(lambda: all(r["status"] != "pending" for r in worker.ctx.store.outbox.rows()), what="rows settled")
    assert [c.status for c in rig.service.calls_to("receipt")] == [400, 409]
    out = {r["event_id"]: r for r in worker.ctx.store.outbox.rows()}
    assert out["ev-1"]["status"] == out["ev-2"]["status"] == "given_up"
    assert out["ev-1"]["attempts"] == out["ev-2"]["attempts"] == 1
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def _report(event_id: str, **extra) -> dict:
    body = {"event_id": event_id, "generation": 1, "operation_id": "op-1", "kind": "report", "slept_s": 0,
            "facts": {"query_id": "q-1", "record": None}, **extra}
    return {"event_id": event_id, "kind": "report", "operation_id": "op-1", "method": "POST",
            "path": "/api/worker/receipts/", "body": body}


def test_r1_queued_receipts_go_together_in_one_sync_each_settled_by_its_own_answer(rig):
    """Issue 44: the receipts queued at the head of the outbox are one sync (a failed sync
    is retried whole, same event ids, R4); a row that is not a receipt is not overtaken;
    a sync the service refuses whole (a malformed receipt in it) sends its head alone, so
    each receipt gets its own verdict (R3); a service without the route gets one receipt
    per request."""
    rig.service.sync_route = True
    rig.service.script("sync", 503)
    worker = rig.worker(backoff=Backoff(base_s=1.0, cap_s=60.0, rng=random.Random(4).random))
    session = str(uuid.uuid4())
    marker = {"event_id": "m-1", "kind": "marker", "operation_id": None, "method": "PUT",
              "path": f"/api/sessions/{session}/marker/", "body": {"turn_id": "t", "device_id": "d", "state": "running"}}
    bad = _report("ev-5")
    bad["body"]["kind"] = "nonsense"
    worker.ctx.store.enqueue([_report("ev-1"), _report("ev-2"), _report("ev-3"), marker, _report("ev-4"), bad,
                              _report("ev-6")], wall=rig.clock.wall())
    result = rig.start(worker)
    wait_for(lambda: len(rig.service.calls_to("sync")) == 1, what="the first sync")
    rig.clock.advance_to("sender")  # R4's pause after the 503
    wait_for(lambda: all(r["status"] != "pending" for r in worker.ctx.store.outbox.rows()), what="all settled")
    assert [(c.status, c.args["event_ids"]) for c in rig.service.calls_to("sync")] == [
        (503, ["ev-1", "ev-2", "ev-3"]), (200, ["ev-1", "ev-2", "ev-3"]),
        (400, ["ev-4", "ev-5", "ev-6"]), (400, ["ev-5", "ev-6"])]
    # after the refused syncs: ev-4 alone (applied), ev-5 alone (refused), ev-6 alone
    assert [(c.args["event_id"], c.status) for c in rig.service.calls_to("receipt") if not c.args.get("repeat")] == [
        ("ev-1", 200), ("ev-2", 200), ("ev-3", 200), ("ev-4", 200), ("ev-5", 400), ("ev-6", 200)]
    assert [c.status for c in rig.service.calls_to("marker")] == [200]
    out = {r["event_id"]: r["status"] for r in worker.ctx.store.outbox.rows() if r["event_id"][:3] in ("ev-", "m-1")}
    assert out == {**{f"ev-{n}": "done" for n in (1, 2, 3, 4, 6)}, "ev-5": "given_up", "m-1": "done"}
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def test_r1_a_service_without_the_sync_route_gets_one_receipt_per_request(rig):
    worker = rig.worker()
    worker.ctx.store.enqueue([_report("ev-1"), _report("ev-2")], wall=rig.clock.wall())
    result = rig.start(worker)
    wait_for(lambda: all(r["status"] != "pending" for r in worker.ctx.store.outbox.rows()), what="all settled")
    assert [c.args["event_id"] for c in rig.service.calls_to("receipt")] == ["ev-1", "ev-2"]
    assert worker.sender.batching is False
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def test_l3_a_machines_leases_due_together_are_renewed_in_one_sync(rig):
    """Issue 44: two runs' leases fall due at once: each round is one sync carrying both
    renewals (no renewal of its own), each lease keeps renewing (L3), and a cancel still
    refuses its own lease (L5) while the other's renewal goes on."""
    rig.service.sync_route = True
    worker = rig.worker()
    result = rig.start(worker)
    first, second = rig.submit("long"), rig.submit("long")
    for start in (first, second):
        rig.receipt(start.operation_id, "running")
    leases = {rig.service.lease_of(s.operation_id).id for s in (first, second)}
    for n in (1, 2):
        rig.clock.advance(TERMS["renew_every_s"])
        wait_for(lambda: len(rig.service.calls_to("renew")) == 2 * n, timeout_s=5, what=f"round {n}")
        renewals = [c for c in rig.service.calls_to("sync") if c.args["lease_ids"]]  # (receipts go by sync too)
        assert [set(c.args["lease_ids"]) for c in renewals] == [leases] * n
    assert [len(rig.service.lease_of(s.operation_id).renewals) for s in (first, second)] == [2, 2]
    rig.service.cancel(first.operation_id)
    rig.clock.advance(TERMS["renew_every_s"])
    assert rig.receipt(first.operation_id, "final")["facts"]["stop_reason"] == "cancel"
    assert rig.service.lease_of(second.operation_id).refused is None
    rig.service.cancel(second.operation_id)
    rig.clock.advance(TERMS["renew_every_s"])
    assert rig.receipt(second.operation_id, "final")["facts"]["stop_reason"] == "cancel"
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def test_l3_l10_renewals_due_together_go_in_syncs_within_the_services_bounds(rig, monkeypatch):
    """Issue 44, L5: more leases due at once than a sync may carry (``SYNC_ITEMS_MAX``,
    here 2; the service refuses a larger sync as a whole, 400) go in syncs within the
    bound, and every lease renews: none is stopped as if its renewal had been refused."""
    from machine.protocol import shapes
    from machine.worker import renewer, sender

    for module in (shapes, renewer, sender):
        monkeypatch.setattr(module, "SYNC_ITEMS_MAX", 2)
    rig.service.sync_route = True
    worker = rig.worker()
    result = rig.start(worker)
    starts = [rig.submit("long") for _ in range(3)]
    for start in starts:
        rig.receipt(start.operation_id, "running")
    rig.clock.advance(TERMS["renew_every_s"])
    wait_for(lambda: len(rig.service.calls_to("renew")) == 3, timeout_s=5, what="three renewals",
             detail=lambda: str([(c.route, c.status, c.args.get("lease_ids")) for c in rig.service.calls[-12:]]))
    syncs = [c for c in rig.service.calls_to("sync") if c.args.get("lease_ids")]
    assert syncs and all(len(c.args["lease_ids"]) <= 2 for c in syncs)
    assert {c.status for c in rig.service.calls_to("sync")} == {200}  # none refused as a whole
    assert all(rig.service.lease_of(s.operation_id).refused is None for s in starts)
    assert [len(rig.service.lease_of(s.operation_id).renewals) for s in starts] == [1, 1, 1]
    for start in starts:
        rig.service.cancel(start.operation_id)
    rig.clock.advance(TERMS["renew_every_s"])
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def test_r3_token_revoked_stops_loop(rig, caplog):
    caplog.set_level(logging.ERROR, logger="runstead.worker")
    worker = rig.worker()
    result = rig.start(worker)
    start = rig.submit("tree")
    rig.receipt(start.operation_id, "running")
    wait_for(lambda: len(rig.agent_pids()) >= 3, what="agent, child and grandchild")
    revoked_at = len(rig.service.calls)
    rig.service.revoke_token()  # the held long-poll, the next renewal or receipt gets 401
    wait_for(lambda: result, timeout_s=15, what="the worker's exit")
    assert result == [EXIT_REVOKED]
    assert live_pids(rig.agent_pids()) == []
    record = worker.ctx.store.get(start.operation_id)
    assert json.loads(record["final"])["stop_reason"] == "worker_shutdown"
    assert "pair_worker --server" in caplog.text and "token_revoked" in caplog.text
    after = [c for c in rig.service.calls[revoked_at:]]
    assert after and {c.status for c in after} == {401}  # whoever met it first, nobody went on


def test_x4_restart_never_runs_again(rig):
    """The worker "dies" while its agent runs (its runner thread stops at the fault point,
    the agent keeps running); a second ``--once`` worker stops the leftover, reports
    ``unknown`` then the final facts, and never starts the operation again, even when
    the same start is delivered again."""
    start = rig.submit("long")
    with faults.crash_at("while_agent_runs"):
        worker = rig.worker(once=True)
        result = rig.start(worker)
        rig.receipt(start.operation_id, "running")
        rig.wait_working()
        rig.clock.advance(1.0)  # past the fault point's delay
        wait_for(lambda: result, what="the first worker gone")
    assert live_pids(rig.agent_pids())  # the leftover still runs
    rig.service.redeliver(start.id)
    assert rig.run_once() == 0
    kinds = [b["kind"] for b in rig.service.receipts_for(start.operation_id)]
    assert kinds == ["starting", "running", "unknown", "final"]
    final = rig.service.receipt(start.operation_id, "final")["facts"]
    assert final["stop_reason"] == "worker_restart" and final["signal"] == signal.SIGTERM
    assert final["survivors"] == []
    assert live_pids(rig.agent_pids()) == []
    assert len(rig.service.calls_to("grant")) == 1
    assert rig.service.messages[start.id].acks == 1 + 1  # redelivery acknowledged, not run (W3)
    assert rig.run_once() == 0  # and a third run has nothing left to do
    assert rig.starts() == 1


def test_w8_slow_poll_never_delays_renewal(rig):
    worker = rig.worker()
    result = rig.start(worker)
    start = rig.submit("long")
    rig.receipt(start.operation_id, "running")
    rig.service.hold_pulls()  # the next long-poll does not come back while we look
    wait_for(lambda: rig.service.pulls_in_flight == 1 and not rig.service.pull_gate.is_set(), what="a held pull")
    for n in range(1, 4):
        rig.clock.advance(TERMS["renew_every_s"])
        wait_for(lambda: len(rig.service.calls_to("renew")) == n, timeout_s=5, what=f"renewal {n}")
        assert rig.service.pulls_in_flight == 1  # still inside the same long-poll
    assert [c.status for c in rig.service.calls_to("renew")] == [200, 200, 200]
    assert len(rig.service.lease_of(start.operation_id).renewals) == 3
    rig.service.cancel(start.operation_id)
    rig.service.release_pulls()
    final = rig.receipt(start.operation_id, "final")["facts"]
    assert final["stop_reason"] == "cancel"
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")
    assert result == [0]


def test_l3_sleep_does_not_extend_deadline(rig):
    worker = rig.worker()
    result = rig.start(worker)
    start = rig.submit("tree")
    rig.receipt(start.operation_id, "running")
    wait_for(lambda: len(rig.agent_pids()) >= 3, what="agent, child and grandchild")
    rig.clock.suspend(600)  # lid closed 600 s: wall runs, monotonic does not
    final = rig.receipt(start.operation_id, "final")["facts"]
    assert final["stop_reason"] == "deadline" and final["ended_within_lease"] is False
    assert final["signal"] == signal.SIGKILL
    assert rig.service.calls_to("renew") == []  # waking up, it did not try to stretch the lease
    assert rig.service.receipt(start.operation_id, "final")["slept_s"] == pytest.approx(600, abs=0.01)
    assert live_pids(rig.agent_pids()) == []
    worker.on_signal()
    wait_for(lambda: result, what="worker exit")


def test_u1_query_answered_from_local_record_or_no_record(rig):
    start = rig.submit("instant")
    assert rig.run_once() == 0
    known, unknown = rig.service.query(start.operation_id), rig.service.query("0" * 8 + "-0000-4000-8000-" + "0" * 12)
    assert rig.run_once() == 0
    reports = {body["facts"]["query_id"]: body for body, _ in rig.service.receipts.values() if body["kind"] == "report"}
    record = reports[known.payload["query_id"]]["facts"]["record"]
    assert record["local_state"] == "ended" and record["final"]["stop_reason"] == "exit"
    assert reports[unknown.payload["query_id"]]["facts"]["record"] is None
    assert rig.starts() == 1  # a query never runs anything


def test_j1_run_hooks_get_every_output_line_and_add_facts_without_replacing_j1_keys(rig):
    """The seam for stream parsers (issue 11): per-run hooks see the agent's lines in
    order, and their extra facts reach the final receipt."""
    from machine.worker.run import RunHooks

    class Collect(RunHooks):
        wants_output = True

        def __init__(self):
            self.lines = []

        def on_output(self, line):
            self.lines.append(line)

        def facts_extra(self):
            return {"agent_result": {"lines": len(self.lines)}, "stop_reason": "overridden?"}

    hooks = []
    worker = make_worker(rig.tmp, rig.clock, roots=[str(rig.root)], connect=lambda: rig.service,
                         options=WorkerOptions(server="memory://", once=True, poll_wait_s=0), profiles=PROFILES,
                         hooks_for=lambda run: hooks.append(Collect()) or hooks[-1])
    start = rig.submit("instant", prompt="hello")
    result = rig.start(worker)
    rig.threads[-1][1].join(timeout=30)
    assert result == [0]
    assert hooks[0].lines == ["agent started, prompt: hello", "agent done"]
    facts = rig.service.receipt(start.operation_id, "final")["facts"]
    assert facts["agent_result"] == {"lines": 2} and facts["stop_reason"] == "exit"


def test_w1_worker_prunes_final_acknowledged_records_at_start_and_daily(rig):
    """Records of operations that ended, were acknowledged and were reported stay for
    7 days, then go (database rows and ops/ files), at the next start and by the daily
    prune of a worker that keeps running."""
    week = 7 * 86400
    first = [rig.submit("instant") for _ in range(2)]
    assert rig.run_once() == 0
    ops = rig.tmp / "state" / "ops"
    store = rig.threads[-1][0].ctx.store
    assert {store.get(s.operation_id)["local_state"] for s in first} == {"ended"}
    assert all((ops / s.operation_id).is_dir() for s in first)
    assert rig.run_once() == 0  # a start within the week prunes nothing
    assert all(store.get(s.operation_id) for s in first)

    rig.clock.advance(week + 60)
    worker = rig.worker()
    rig.start(worker)
    wait_for(lambda: all(worker.ctx.store.get(s.operation_id) is None and not (ops / s.operation_id).exists()
                         for s in first), what="pruned at start: rows and files")

    later = rig.submit("instant")
    rig.receipt(later.operation_id, "final")
    wait_for(lambda: not worker.ctx.store.outbox.pending(), what="the final report answered")
    rig.clock.advance(week + 60)  # past the retention, and past the next daily prune
    wait_for(lambda: worker.ctx.store.get(later.operation_id) is None and not (ops / later.operation_id).exists(),
             what="pruned by the daily prune: rows and files")
    assert rig.starts() == 3  # nothing ran twice
