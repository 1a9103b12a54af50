"""A live agent never outlives its lease (SPEC L3, L4, L8, X3; issue 43): the worker writes
each grant's and renewal's deadline to ``op_dir/lease.json`` and the launcher that holds a
live conversation's agent ends it once that deadline has passed with no renewal; a worker
that comes back in time adopts the agent as before. Real processes: daphne, ``manage.py
worker`` killed with SIGKILL, the launcher and the demo's live profile (``fake-claude``,
scripts/fake_claude.py speaking Claude Code's stream-json input), and the real opencode's
``opencode serve`` behind machine/opencode_bridge.py, offline against the fake Chat
Completions API (tests/model_apis.py): the server leads a process group of its own under
the bridge, and the lease stop ends it too."""
import json
import os
import time

import psutil
import pytest

from tests.conversation_support import (
    fake_claude_setup, op_dir, opencode_conversation_setup, opencode_servers, send, wait_states,
)
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.model_apis import ChatAPI
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS

pytestmark = [pytest.mark.machine_side, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "6", "RUNSTEAD_LEASE_RENEW_S": "0.5"}
MARGIN_S, GRACE_S = float(TIMINGS["RUNSTEAD_LEASE_MARGIN_S"]), float(TIMINGS["RUNSTEAD_KILL_GRACE_S"])


@pytest.fixture
def live(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = fake_claude_setup(live_daphne(**TIMINGS), make_owner(), tmp_path, pause_s=0.2)
    yield setup
    setup.close()


# The real opencode: a lease that outlives a renewal delayed while the server starts (heavy
# on 2 shared cores), short enough that the test waits on it only seconds.
OPENCODE_TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "10", "RUNSTEAD_LEASE_RENEW_S": "1"}


@pytest.fixture
def opencode_live(live_daphne, make_owner, tmp_path):  # noqa: F811
    with ChatAPI() as api:
        setup = opencode_conversation_setup(live_daphne(**OPENCODE_TIMINGS), make_owner(), tmp_path, api)
        try:
            yield setup
        finally:
            setup.close()
            end_leftovers(setup)


def end_leftovers(setup) -> None:
    """SIGKILL whatever still carries the tag of one of the worker's operations: the
    server leads its own group, which ``LiveSetup.close`` (the launchers' groups) misses
    when a failing run left it behind."""
    ops = setup.state_dir / "ops"
    for operation_id in os.listdir(ops) if ops.is_dir() else ():
        for proc in tagged(operation_id):
            try:
                proc.kill()
            except psutil.Error:
                pass


def read_json(setup, task_id, name):
    with open(os.path.join(op_dir(setup, task_id), name)) as f:
        return json.load(f)


def output_log(setup, task_id) -> str:
    with open(os.path.join(op_dir(setup, task_id), "output.log"), errors="replace") as f:
        return f.read()


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
    # The launcher reaps the agent, then writes exit.json: wait on the file, not the pid.
    exit_path = os.path.join(op_dir(live, task_id), "exit.json")
    wait_for(lambda: os.path.exists(exit_path), timeout_s=5, interval_s=0.05, what="the launcher's exit.json")
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


def tagged(operation_id: str) -> list[psutil.Process]:
    """Live processes whose environment carries the operation's tag (L8:
    ``RUNSTEAD_OPERATION_ID``, set for the launcher and inherited by all it starts)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.environ().get("RUNSTEAD_OPERATION_ID") == operation_id and p.status() != psutil.STATUS_ZOMBIE:
                found.append(p)
        except psutil.Error:
            continue
    return found


def running(proc: psutil.Process) -> bool:
    """Whether ``proc`` (that process: pid and start time) still runs; a zombie has ended."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.mark.surface
def test_l4_l8_worker_killed_the_launcher_ends_the_real_opencode_server_after_the_lease_deadline(opencode_live):
    setup = opencode_live
    task_id = setup.submit("opencode", prompt="look around the repository", mode="conversation")
    wait_states(setup, task_id, {0: "answered"}, timeout=90)  # the bridge now waits on its stdin
    launcher = read_json(setup, task_id, "launcher.json")
    operation_id = os.path.basename(op_dir(setup, task_id))
    launcher_proc, bridge = psutil.Process(launcher["launcher_pid"]), psutil.Process(launcher["agent_pid"])
    started = opencode_servers(bridge.children(recursive=True))
    assert len(started) == 1, started
    server = started[0]
    # The server leads a process group of its own (machine/opencode_bridge.py): the
    # launcher's group signals do not reach it, the bridge has to end it.
    assert os.getpgid(server.pid) == server.pid != os.getpgid(bridge.pid) == launcher_proc.pid
    ours = [launcher_proc, bridge, *bridge.children(recursive=True)]  # every process of the run now
    assert {launcher_proc.pid, bridge.pid, server.pid} <= {p.pid for p in tagged(operation_id)}
    lease = read_json(setup, task_id, "lease.json")
    assert (lease["duration_s"], lease["margin_s"], lease["kill_grace_s"]) == (10, MARGIN_S, GRACE_S)
    setup.stop_workers()  # SIGKILL, and no worker comes back
    last = read_json(setup, task_id, "lease.json")  # the last renewal the worker recorded
    deadline = deadline_wall(last)
    assert deadline > time.time(), last

    def still_running_until_due() -> bool:
        for proc in (launcher_proc, bridge, server):
            assert running(proc), f"{proc} ended {deadline - time.time():.2f} s before the lease deadline"
        return time.time() >= deadline - 0.2

    wait_for(still_running_until_due, timeout_s=20, what="the recorded lease deadline to come near")
    wait_for(lambda: not any(running(p) for p in (launcher_proc, bridge, server)), timeout_s=20,
             what="the launcher, the bridge and the opencode server ended by the lease",
             detail=lambda: f"--- output.log ---\n{output_log(setup, task_id)[-4000:]}")
    gone_at = time.time()
    exit_facts = read_json(setup, task_id, "exit.json")
    assert exit_facts["lease_stop"] is True, exit_facts
    assert exit_facts["agent_pid"] == bridge.pid
    # Never before the recorded deadline, and soon after it: the bridge's input closed (it
    # stops the server), SIGTERM to the launcher's group, SIGKILL to the bridge (the server
    # dies with it), each ``kill_grace_s`` after the last.
    assert exit_facts["exit_wall"] >= deadline - 0.05, (exit_facts, last)
    assert gone_at - deadline < 2 * GRACE_S + 2.0, (gone_at, exit_facts, last)
    # The bridge stopped the server itself: on its input's close (0), or on the launcher's
    # SIGTERM when the server took longer than ``kill_grace_s`` to go (143); never SIGKILLed.
    assert (exit_facts["exit_code"], exit_facts["signal"]) in ((0, None), (143, None)), exit_facts
    # No process of the operation is left: none seen before the kill, none carrying its tag.
    wait_for(lambda: not tagged(operation_id) and not any(running(p) for p in ours), timeout_s=5,
             what="no process of the operation left", detail=lambda: repr(tagged(operation_id)))
