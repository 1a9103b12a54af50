"""The worker dies for real and restarts (SPEC W2, W3, W4, W6, X1-X4; issue 5).

Every test runs ``manage.py worker`` as a subprocess against a real daphne with short
lease timings (tests.worker_harness.SHORT_TIMINGS). The test agent appends a line to a
file on every start, so "ran at most once" is a line count. "It never ran again" is
proven by one more worker run with ``--once`` that has exited after the service offered
it the start message again (``never_runs_again``), not by waiting.
"""
import os
import signal

import pytest
from django.utils import timezone

from tests.live import module_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS, LiveSetup, live_pids

pytestmark = [pytest.mark.machine_side, pytest.mark.slow]
FAULT_EXIT = 97
DRAINING = "draining: no new work"  # what the worker logs once it has handled a first SIGTERM (W6)


@pytest.fixture
def live(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    yield setup
    setup.close()


def receipt_kinds(task):
    return [r["kind"] for r in reversed(task["receipts"])]


def unknown_then_final(task) -> bool:
    """X3: the restarted worker reported ``unknown`` first, then the final facts (a
    ``report`` answering the service's query may follow)."""
    kinds = receipt_kinds(task)
    return "unknown" in kinds and "final" in kinds and kinds.index("unknown") < kinds.index("final")


def final_facts(task):
    """The facts of the task's (last) final receipt, as the worker sent them."""
    return [r for r in task["receipts"] if r["kind"] == "final"][0]["body"]["facts"]


def never_runs_again(live, task_id, starts):
    """X4, W3: with no other worker running, the service delivers the task's ``start``
    again to a ``--once`` worker, which recognises it from its local record, acknowledges
    it and exits (0) without starting the agent: the agent's start count, the worker's
    local record, the task's state and lease are as they were, and the only receipts it
    sent are ``report`` answers to a pending query (U1), which never run anything."""
    before_task, before_record = live.task(task_id), live.local_record(task_id)
    deliveries = live.redeliver_start(task_id)
    assert live.run_once() == 0, live.log()
    assert live.start_redelivered_and_acked(task_id, deliveries), live.log()  # it was offered the start again
    assert live.starts() == starts
    assert live.local_record(task_id) == before_record
    after_task = live.task(task_id)
    assert (after_task["state"], after_task["lease"]) == (before_task["state"], before_task["lease"])
    seen = {r["event_id"] for r in before_task["receipts"]}
    assert [r["kind"] for r in after_task["receipts"] if r["event_id"] not in seen and r["kind"] != "report"] == []


def wait_final_receipt(live, task_id, timeout=20):
    return wait_for(lambda: (t := live.task(task_id)) and "final" in receipt_kinds(t) and t, timeout_s=timeout,
                    what=f"final receipt\n{live.log()}")


# (fault point, agent profile, states the task may end in, agent starts)
FAULTS = [
    ("after_commit_before_ack", "quick", {"succeeded"}, 1),
    ("after_ack_before_lease", "quick", {"succeeded"}, 1),
    ("after_starting_commit_before_spawn", "quick", {"unknown"}, 0),
    ("after_spawn_before_pid_commit", "long", {"unknown"}, 1),
    ("while_agent_runs", "long", {"failed", "failed_lease_lost"}, 1),
    ("after_exit_before_final_receipt", "quick", {"succeeded"}, 1),
]


@pytest.mark.parametrize("point,agent,states,starts", FAULTS, ids=[f[0] for f in FAULTS])
def test_x4_worker_dies_at_fault_point_restart_never_runs_twice(live, point, agent, states, starts):
    first = live.start_worker(fault=point)
    task_id = live.submit(agent)
    assert first.wait(timeout=30) == FAULT_EXIT, live.log()
    if point in ("after_spawn_before_pid_commit", "while_agent_runs", "after_exit_before_final_receipt"):
        wait_for(lambda: live.starts() >= 1, what="the agent's start")  # it ran under the first worker
    second = live.start_worker()
    if "unknown" in states:
        task = wait_final_receipt(live, task_id)
        assert task["state"] == "unknown"
        assert final_facts(task)["process_started"] == "unknown"
        assert final_facts(task)["stop_reason"] == "worker_restart"
        assert "unknown" in receipt_kinds(task)
    else:
        task = live.wait_final(task_id)
        assert task["state"] in states, (task, live.log())
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=20) == 0
    assert live.starts() == starts
    assert live_pids([p for p, _ in live.agent_pids()]) == []  # no leftover keeps running
    if point == "while_agent_runs":
        assert task["stop_reason"] == "worker_restart"
        assert unknown_then_final(task), receipt_kinds(task)
    if point == "after_exit_before_final_receipt":
        assert task["exit_code"] == 0 and task["stop_reason"] == "exit"
    never_runs_again(live, task_id, starts)


def test_x3_restart_after_sigkill_stops_agent_child_and_grandchild_and_reports_unknown_then_final(live):
    worker = live.start_worker()
    task_id = live.submit("tree")
    pids = wait_for(lambda: len(live.agent_pids()) >= 3 and live.agent_pids(), what="agent, child, grandchild")
    live.wait_state(task_id, "running")
    output = next((live.state_dir / "ops").rglob("output.log"))
    worker.kill()
    worker.wait(timeout=10)
    # The worker's death did not end them: the agent goes on working (a new line of its
    # once-a-second output after the death), its child and grandchild with it.
    lines = output.read_text().count("working")
    wait_for(lambda: output.read_text().count("working") > lines, timeout_s=5, what="the agent working on")
    assert len(live_pids([p for p, _ in pids])) == 3
    restarted = live.start_worker()
    task = live.wait_final(task_id)
    # J6: row 4 when the restarted worker stopped the tree after the lease ran out, else row 8.
    assert task["state"] == ("failed_lease_lost" if final_facts(task)["ended_within_lease"] is False else "failed")
    assert task["stop_reason"] == "worker_restart" and task["survivors"] == []
    assert unknown_then_final(task), receipt_kinds(task)
    assert task["signal"] == signal.SIGTERM  # the launcher recorded how the agent ended
    restarted.send_signal(signal.SIGTERM)
    assert restarted.wait(timeout=20) == 0
    assert live_pids([p for p, _ in live.agent_pids()]) == []
    assert live.starts() == 1
    never_runs_again(live, task_id, 1)


def test_w3_duplicate_start_delivery_runs_once_before_and_after_restart(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    from tasks_app.models import OutboxMessage

    live = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path, pair_via_command=True)

    def redeliver():
        OutboxMessage.objects.filter(operation__task_id=task_id, kind="start").update(
            acked_at=None, visible_at=timezone.now())

    def acked_again(n):
        m = OutboxMessage.objects.get(operation__task_id=task_id, kind="start")
        return m.acked_at is not None and m.deliveries >= n

    worker = live.start_worker()
    task_id = live.submit("slow")
    live.wait_state(task_id, "running")
    redeliver()  # the service delivers the same start again while the agent runs
    wait_for(lambda: acked_again(2), what="second delivery acked")
    task = live.wait_final(task_id)
    assert task["state"] == "succeeded"
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0
    redeliver()  # and once more to a freshly started worker, which exits after its one pull
    assert live.run_once() == 0, live.log()
    assert acked_again(3)
    assert live.starts() == 1
    assert live.task(task_id)["state"] == "succeeded"
    live.close()


def test_w6_first_sigterm_drains_running_agent_finishes_and_reports(live):
    worker = live.start_worker()
    task_id = live.submit("slow")
    live.wait_state(task_id, "running")
    worker.send_signal(signal.SIGTERM)
    later = live.submit("quick", exclusive=False)  # arrives after the signal: not pulled any more
    assert worker.wait(timeout=20) == 0
    task = live.task(task_id)
    assert task["state"] == "succeeded" and task["stop_reason"] == "exit", live.log()
    assert live.task(later)["state"] == "accepted"
    assert live.starts() == 1


def test_w6_second_sigterm_stops_agent_with_worker_shutdown(live):
    worker = live.start_worker()
    task_id = live.submit("tree")
    live.wait_state(task_id, "running")
    wait_for(lambda: len(live.agent_pids()) >= 3, what="agent tree")
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: DRAINING in live.log(), what="the first signal handled")
    assert worker.poll() is None  # draining: the agent still runs
    worker.send_signal(signal.SIGTERM)
    assert worker.wait(timeout=20) == 0, live.log()
    task = live.wait_final(task_id, timeout=5)
    assert task["state"] == "failed" and task["stop_reason"] == "worker_shutdown"
    assert live_pids([p for p, _ in live.agent_pids()]) == []


def test_w4_symlink_out_of_allowed_root_refused_with_final_receipt_nothing_runs(live, tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    (live.root / "escape").symlink_to(outside)
    worker = live.start_worker()
    task_id = live.submit("quick", folder=live.root / "escape")
    task = live.wait_final(task_id)
    assert task["state"] == "not_started"
    assert final_facts(task)["process_started"] is False and final_facts(task)["stop_reason"] == "refused"
    assert "outside" in task["output_tail"]
    assert receipt_kinds(task) == ["final"]  # refused before any lease was asked for
    assert live.starts() == 0
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=20)


def test_w4_dotdot_folder_in_start_message_refused_even_if_service_sent_it(live, tmp_path):
    """The service refuses '..' at acceptance; the worker does not rely on that: a start
    message edited to carry '..' out of the root is refused locally."""
    from tasks_app.models import OutboxMessage

    (tmp_path / "outside").mkdir()
    task_id = live.submit("quick")
    message = OutboxMessage.objects.get(operation__task_id=task_id, kind="start")
    message.payload = {**message.payload, "folder": f"{live.repo}/../../outside"}
    message.save(update_fields=["payload"])
    worker = live.start_worker()
    task = live.wait_final(task_id)
    assert task["state"] == "not_started"
    assert final_facts(task)["stop_reason"] == "refused" and final_facts(task)["process_started"] is False
    assert live.starts() == 0
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=20)


def test_w5_token_never_in_agent_environment(live):
    worker = live.start_worker()
    task_id = live.submit("tree")
    live.wait_state(task_id, "running")
    pids = wait_for(lambda: len(live.agent_pids()) >= 3 and live.agent_pids())
    token = (live.state_dir / "token").read_text().strip()
    import psutil

    for pid, _ in pids:
        env = psutil.Process(pid).environ()
        assert not any(token in v for v in env.values())
        assert env["RUNSTEAD_OPERATION_ID"]
    assert os.stat(live.state_dir).st_mode & 0o777 == 0o700
    worker.send_signal(signal.SIGTERM)
    wait_for(lambda: DRAINING in live.log(), what="the first signal handled")  # else the two could merge
    worker.send_signal(signal.SIGTERM)
    worker.wait(timeout=20)


def test_x3_agent_that_ended_while_worker_was_down_is_reported_with_launcher_exit_status(live):
    worker = live.start_worker()
    task_id = live.submit("fail")  # exits 3 after 0.2 s
    # Killed once the launcher's pid is committed (X2), so the restart finds a leftover
    # that already ended (not a 'starting' record without a pid).
    wait_for(lambda: (r := live.local_record(task_id)) and r["pid"], what="the launcher's pid committed")
    worker.kill()
    worker.wait(timeout=10)
    wait_for(lambda: list((live.state_dir / "ops").rglob("exit.json")), what="the launcher's exit record")
    restarted = live.start_worker()
    task = live.wait_final(task_id)
    assert task["state"] == "failed" and task["exit_code"] == 3 and task["stop_reason"] == "exit", live.log()
    assert final_facts(task)["ended_within_lease"] is True
    assert live.starts() == 1
    restarted.send_signal(signal.SIGTERM)
    assert restarted.wait(timeout=20) == 0


def test_w2_message_committed_locally_before_ack_and_redelivered_after_crash(live):
    from tasks_app.models import OutboxMessage
    from machine.worker.store import Store

    first = live.start_worker(fault="after_commit_before_ack")
    task_id = live.submit("quick")
    assert first.wait(timeout=30) == FAULT_EXIT
    message = OutboxMessage.objects.get(operation__task_id=task_id, kind="start")
    assert message.acked_at is None  # died before the ack...
    store = Store(str(live.state_dir / "worker.sqlite3"))
    record = store.get(str(message.operation_id))
    assert record["local_state"] == "received"  # ...but after the local commit
    assert store.conn.execute("SELECT COUNT(*) AS n FROM messages WHERE message_id = ?",
                              (str(message.id),)).fetchone()["n"] == 1
    store.close()
    second = live.start_worker()
    assert live.wait_final(task_id)["state"] == "succeeded"
    wait_for(lambda: OutboxMessage.objects.get(pk=message.pk).acked_at is not None, what="redelivery acked")
    assert OutboxMessage.objects.get(pk=message.pk).deliveries >= 2
    assert live.starts() == 1
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=20) == 0


def test_x2_pid_group_start_time_and_lease_send_times_committed_right_after_spawn(live):
    import psutil

    from machine.worker.clock import boot_id
    from machine.worker.store import Store

    first = live.start_worker(fault="while_agent_runs")
    task_id = live.submit("long")
    assert first.wait(timeout=30) == FAULT_EXIT
    store = Store(str(live.state_dir / "worker.sqlite3"))
    record = store.in_states("running")[0]
    store.close()
    launcher = psutil.Process(record["pid"])
    assert "launcher.py" in " ".join(launcher.cmdline())
    assert abs(launcher.create_time() - record["process_start_time"]) < 0.01
    assert record["pgid"] == record["pid"] == os.getpgid(record["pid"])
    assert record["spawn_count"] == 1 and record["lease_id"]
    assert record["sent_mono"] is not None and record["sent_wall"] is not None
    assert record["boot_id"] == boot_id()
    second = live.start_worker()
    assert live.wait_final(task_id)["stop_reason"] == "worker_restart"
    assert not psutil.pid_exists(record["pid"]) or psutil.Process(record["pid"]).status() == psutil.STATUS_ZOMBIE
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=20) == 0
