"""A live agent never outlives its lease (SPEC L3, L4, L8, X3; issue 43): the worker writes
each grant's and renewal's deadline to ``op_dir/lease.json`` and the launcher that holds a
live conversation's agent ends it once that deadline has passed with no renewal; a worker
that comes back in time adopts the agent as before. Real processes: daphne, ``manage.py
worker`` killed with SIGKILL, the launcher and the demo's live profile (``fake-claude``,
scripts/fake_claude.py speaking Claude Code's stream-json input)."""
import json
import os
import time

import psutil
import pytest

from tests.conversation_support import fake_claude_setup, op_dir, send, wait_states
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "6", "RUNSTEAD_LEASE_RENEW_S": "0.5"}
MARGIN_S, GRACE_S = float(TIMINGS["RUNSTEAD_LEASE_MARGIN_S"]), float(TIMINGS["RUNSTEAD_KILL_GRACE_S"])


@pytest.fixture
def live(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = fake_claude_setup(live_daphne(**TIMINGS), make_owner(), tmp_path, pause_s=0.2)
    yield setup
    setup.close()


def read_json(setup, task_id, name):
    with open(os.path.join(op_dir(setup, task_id), name)) as f:
        return json.load(f)


def deadline_wall(lease: dict) -> float:
    """The recorded deadline in wall time (the launcher takes max(monotonic, wall) elapsed)."""
    return lease["sent_wall"] + lease["duration_s"] - lease["margin_s"]


def open_idle_conversation(setup) -> tuple[str, dict]:
    task_id = setup.submit("fake-claude", prompt="look around the repository", mode="conversation")
    wait_states(setup, task_id, {0: "answered"}, timeout=30)  # the agent now waits on its stdin
    return task_id, read_json(setup, task_id, "launcher.json")


def test_l4_worker_killed_and_not_restarted_the_launcher_ends_the_live_agent_after_the_lease_deadline(live):
    task_id, launcher = open_idle_conversation(live)
    lease = read_json(live, task_id, "lease.json")
    assert (lease["duration_s"], lease["margin_s"], lease["kill_grace_s"]) == (6, MARGIN_S, GRACE_S)
    live.stop_workers()  # SIGKILL, and no worker comes back
    killed_at = time.time()
    last = read_json(live, task_id, "lease.json")  # the last renewal the worker recorded
    assert psutil.pid_exists(launcher["agent_pid"])
    wait_for(lambda: not psutil.pid_exists(launcher["agent_pid"]), timeout_s=20, interval_s=0.05,
             what="the agent to be ended by its launcher")
    gone_at = time.time()
    exit_facts = read_json(live, task_id, "exit.json")
    assert exit_facts["lease_stop"] is True
    # Never before the recorded deadline, and soon after it: its input closed, it exited
    # (fake-claude, like Claude Code, ends when its stdin closes).
    assert exit_facts["exit_wall"] >= deadline_wall(last) - 0.05, (exit_facts, last)
    assert gone_at - deadline_wall(last) < 2 * GRACE_S + 1.5, (gone_at, last, killed_at)
    assert exit_facts["exit_code"] == 0
    wait_for(lambda: not psutil.pid_exists(launcher["launcher_pid"]), timeout_s=5, what="the launcher gone too")
    # The service expired the lease meanwhile (L6); a worker started much later reports
    # what the launcher recorded: ended after its lease (J3).
    live.wait_state(task_id, "unknown", timeout=20)
    live.start_worker()
    task = live.wait_final(task_id, timeout=30)
    assert task["state"] == "failed_lease_lost", task
    assert task["exit_code"] == 0 and task["stop_reason"] == "exit"


def test_x3_worker_back_in_time_adopts_the_live_agent_and_its_renewals_move_the_launchers_deadline(live):
    task_id, launcher = open_idle_conversation(live)
    live.stop_workers()
    first = read_json(live, task_id, "lease.json")
    live.start_worker()  # back well within the 6 s lease: it adopts the agent (X3)
    # Past the deadline the dead worker had recorded: the adopting worker's renewals moved it on.
    wait_for(lambda: time.time() > deadline_wall(first) + 2 * GRACE_S + 0.5, timeout_s=20,
             what="the first worker's deadline to pass")
    assert deadline_wall(read_json(live, task_id, "lease.json")) > time.time()
    assert psutil.pid_exists(launcher["agent_pid"])
    assert not os.path.exists(os.path.join(op_dir(live, task_id), "exit.json"))
    assert send(live, task_id, "still there?").status_code == 201
    wait_states(live, task_id, {1: "answered"}, timeout=30)
    assert read_json(live, task_id, "launcher.json") == launcher  # the same agent: nothing spawned again
    assert live.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    assert live.wait_final(task_id, timeout=30)["state"] == "succeeded"
