"""Live conversations with the real Claude Code (SPEC C1-C6): a real daphne, a real worker
subprocess, the pinned CLI in ``-p --input-format stream-json`` mode offline against the
fake Messages API (docs/claude-stream-input.md for what it does with its stdin)."""
import json
import os
import uuid

import psutil
import pytest

from tests.barrier import race
from tests.claude_cli import fake_model_api  # noqa: F401  (fixture)
from tests.conversation_support import (
    conversation_setup,
    idle_notices,
    messages,
    op_dir,
    open_conversation,
    send,
    session_status,
    turns_started,
    user_texts_in_last_request,
    wait_states,
)
from tests.live import DaphneServer, live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import SHORT_TIMINGS

# surface: what the real CLI does through the worker; the SQLite pass proves it (the service side
# of conversations has its own tests in both passes: test_conversation_live, test_c10_withdraw_live).
pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

LONG_TOOL = '[[bash:python3 -c "import time; time.sleep(60)"; echo slept]] long tool'
# Leases long enough for a worker or a daphne to restart inside one (the restart tests).
RESTART_TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "30", "RUNSTEAD_LEASE_RENEW_S": "0.5"}


@pytest.fixture
def live(live_daphne, make_owner, tmp_path, fake_model_api):  # noqa: F811
    def start(worker_fault=None, **env):
        setup = conversation_setup(live_daphne(**{**SHORT_TIMINGS, **env}), make_owner(), tmp_path, fake_model_api,
                                   worker_fault=worker_fault)
        started.append(setup)
        return setup

    started = []
    yield start
    for setup in started:
        setup.close()


def long_tool_runs() -> bool:
    for p in psutil.process_iter():
        try:
            if "time.sleep(60)" in " ".join(p.cmdline()):
                return True
        except psutil.Error:
            continue
    return False


def agent_launcher(setup, task_id) -> dict:
    with open(os.path.join(op_dir(setup, task_id), "launcher.json")) as f:
        return json.load(f)


def written_numbers(setup, task_id) -> list[int]:
    """What the launcher wrote to the agent's stdin, by inbox number, in order."""
    with open(os.path.join(op_dir(setup, task_id), "written.log")) as f:
        return [int(n) for n in f.read().split()]


def test_c2_c3_five_messages_each_delivered_once_in_order(live, fake_model_api):  # noqa: F811
    setup = live()
    task_id = open_conversation(setup, "[[slow:3]] first turn")
    setup.wait_state(task_id, "running", timeout=60)
    wait_states(setup, task_id, {0: "delivered"})
    # Two messages sent while the first turn runs: they wait on the worker (sent) and go
    # one turn each, after it.
    one = send(setup, task_id, "message one")
    two = send(setup, task_id, "message two")
    assert (one.status_code, two.status_code) == (201, 201), (one.text, two.text)
    assert [one.json()["seq"], two.json()["seq"]] == [1, 2]
    # A replay of the first: the same answer, no new message (A2).
    replay = setup.api.post(f"/api/tasks/{task_id}/messages/", json={"text": "message one"},
                            headers={"Idempotency-Key": one.request.headers["Idempotency-Key"]})
    assert replay.status_code == 201 and replay.json() == one.json()
    # Two racing with one key: one message, both get the winner's answer (A4).
    key = str(uuid.uuid4())
    answers = race(2, lambda i: send(setup, task_id, "message three", key=key))
    assert [a.status_code for a in answers] == [201, 201]
    assert answers[0].json()["id"] == answers[1].json()["id"] and answers[0].json()["seq"] == 3
    wait_states(setup, task_id, {0: "answered", 1: "answered", 2: "answered", 3: "answered"}, timeout=90)
    four = send(setup, task_id, "message four")
    assert four.status_code == 201 and four.json()["seq"] == 4
    final = wait_states(setup, task_id, {4: "answered"}, timeout=60)
    assert [m["text"] for m in final] == ["[[slow:3]] first turn", "message one", "message two", "message three",
                                          "message four"]
    assert all(m["delivered_at"] and m["answered_at"] for m in final)
    # Each reached the agent once, in order, one turn each, in one agent process.
    texts = [m["text"] for m in final]
    assert turns_started(fake_model_api) == texts
    assert user_texts_in_last_request(fake_model_api) == texts
    assert written_numbers(setup, task_id) == [0, 1, 2, 3, 4]
    assert setup.task(task_id)["state"] == "running"  # between turns the task runs on (C6)
    ended = setup.api.post(f"/api/tasks/{task_id}/end/")
    assert ended.status_code == 200, ended.text
    task = setup.wait_final(task_id, timeout=60)
    assert task["state"] == "succeeded", task
    assert task["conversation"] == "live" and task["conversation_ended_at"]


def test_c4_interrupt_stops_the_long_tool_and_the_next_message_is_answered_in_the_same_session(
        live, fake_model_api):  # noqa: F811
    setup = live()
    task_id = open_conversation(setup, LONG_TOOL)
    setup.wait_state(task_id, "running", timeout=60)
    wait_for(long_tool_runs, timeout_s=60, what="the long tool runs")
    resp = setup.api.post(f"/api/tasks/{task_id}/interrupt/")
    assert resp.status_code == 202, resp.text
    wait_states(setup, task_id, {0: "answered"}, timeout=30)
    # Claude Code kills the tool's process group as it ends the turn: gone within moments.
    wait_for(lambda: not long_tool_runs(), timeout_s=10, what="the interrupted tool to be gone")
    after = send(setup, task_id, "after the interrupt")
    assert after.status_code == 201
    wait_states(setup, task_id, {1: "answered"}, timeout=60)
    results = [json.loads(line) for line in open(os.path.join(op_dir(setup, task_id), "output.log"))
               if line.startswith("{") and '"type":"result"' in line]
    assert [r["subtype"] for r in results] == ["error_during_execution", "success"]
    assert results[0]["session_id"] == results[1]["session_id"]  # same session, same process
    assert setup.task(task_id)["state"] == "running"


def test_c3_worker_killed_between_recording_and_writing_a_message_it_reaches_the_agent_once(
        live, fake_model_api):  # noqa: F811
    setup = live(**RESTART_TIMINGS)
    setup.stop_workers()
    first = setup.start_worker(fault="conversation_after_record_before_write")
    task_id = open_conversation(setup, "hello")
    wait_states(setup, task_id, {0: "answered"}, timeout=60)
    launcher = agent_launcher(setup, task_id)
    resp = send(setup, task_id, "written once")
    assert resp.status_code == 201
    assert first.wait(timeout=30) == 97  # died with the message recorded, its inbox file not written
    record = setup.local_record(task_id)
    assert record["local_state"] == "running"
    assert not os.path.exists(os.path.join(op_dir(setup, task_id), "inbox", "0000000001.json"))
    assert messages(setup, task_id)[1]["state"] == "sent"
    setup.start_worker()  # adopts the agent, which runs on, and writes the message once
    final = wait_states(setup, task_id, {1: "answered"}, timeout=60)
    assert [m["text"] for m in final] == ["hello", "written once"]
    assert turns_started(fake_model_api) == ["hello", "written once"]
    assert written_numbers(setup, task_id) == [0, 1]
    assert agent_launcher(setup, task_id) == launcher  # the same agent process: nothing spawned again
    assert psutil.pid_exists(launcher["agent_pid"])
    again = send(setup, task_id, "and after the restart")
    assert again.status_code == 201
    wait_states(setup, task_id, {2: "answered"}, timeout=60)
    assert turns_started(fake_model_api) == ["hello", "written once", "and after the restart"]
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    assert setup.wait_final(task_id, timeout=60)["state"] == "succeeded"


def test_c3_service_restarted_mid_conversation_messages_flow_on(live, live_daphne, fake_model_api, tmp_path):  # noqa: F811
    setup = live(**RESTART_TIMINGS)
    task_id = open_conversation(setup, "before the restart")
    wait_states(setup, task_id, {0: "answered"}, timeout=60)
    server = live_daphne.servers[-1]
    server.stop()
    back = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0", **RESTART_TIMINGS}, port=server.port, log_dir=tmp_path)
    live_daphne.servers.append(back)
    resp = send(setup, task_id, "after the restart")
    assert resp.status_code == 201, resp.text
    final = wait_states(setup, task_id, {1: "answered"}, timeout=60)
    assert [m["text"] for m in final] == ["before the restart", "after the restart"]
    assert turns_started(fake_model_api) == ["before the restart", "after the restart"]
    assert setup.task(task_id)["state"] == "running"


def test_c5_idle_conversation_ends_by_itself_and_the_task_succeeds(live, fake_model_api):  # noqa: F811
    setup = live(RUNSTEAD_CONVERSATION_IDLE_S="1.5")
    task_id = open_conversation(setup, "only one")
    wait_states(setup, task_id, {0: "answered"}, timeout=60)
    task = setup.wait_final(task_id, timeout=30)
    assert task["state"] == "succeeded", task
    assert turns_started(fake_model_api) == ["only one"]
    late = send(setup, task_id, "too late")
    assert late.status_code == 409 and late.json()["error"] == "already_final"


def test_c6_between_turns_the_task_runs_and_its_session_is_idle_one_turn_marker_per_message(
        live, fake_model_api):  # noqa: F811
    setup = live()
    session_id = str(uuid.uuid4())
    task_id = setup.submit("claude", prompt="[[slow:2]] first", mode="conversation", session=session_id)
    wait_states(setup, task_id, {0: "delivered"}, timeout=60)
    assert session_status(setup, session_id) == "busy"
    wait_states(setup, task_id, {0: "answered"}, timeout=60)
    wait_for(lambda: session_status(setup, session_id) == "idle", timeout_s=10, what="idle between turns")
    assert setup.task(task_id)["state"] == "running"
    [first_turn] = setup.api.get(f"/api/sessions/{session_id}/").json()["markers"]
    # B5/N1 once, at the first turn's end: none at its start (the task's ``running`` no
    # longer holds the session busy, its turn marker does, and it is sent first).
    assert idle_notices(session_id) == 1
    assert send(setup, task_id, "[[slow:2]] second").status_code == 201
    wait_states(setup, task_id, {1: "delivered"}, timeout=30)
    assert session_status(setup, session_id) == "busy"
    assert idle_notices(session_id) == 1  # nothing between the turns: no blip
    wait_states(setup, task_id, {1: "answered"}, timeout=60)
    wait_for(lambda: session_status(setup, session_id) == "idle", timeout_s=10, what="idle after the second turn")
    assert idle_notices(session_id) == 2
    # M: one marker per device, its turn the second one now, ended.
    [second_turn] = setup.api.get(f"/api/sessions/{session_id}/").json()["markers"]
    assert first_turn["state"] == second_turn["state"] == "ended"
    assert second_turn["turn_id"] != first_turn["turn_id"]


GATE = """import os, sys, time
folder, n = sys.argv[1], sys.argv[2]
open(os.path.join(folder, "started-" + n), "w").close()
while not os.path.exists(os.path.join(folder, "open-" + n)):
    time.sleep(0.02)
print("gate", n, "passed")
"""


def result_lines(setup, task_id) -> list[dict]:
    with open(os.path.join(op_dir(setup, task_id), "output.log")) as f:
        return [json.loads(line) for line in f if line.startswith("{") and '"type":"result"' in line]


def test_c9_steers_written_while_tools_run_are_each_consumed_once_by_the_running_turn_and_a_late_one_is_the_next_turn(
        live, fake_model_api, tmp_path):  # noqa: F811
    """Five steers into one long turn of tool calls, each written while a tool runs (a
    gate the test opens) and taken at that tool's end, the worker killed once between
    recording the first and writing it; a sixth written while the turn's last text
    streams opens the next turn. Each text reaches the agent once; two turns, two
    ``answered`` messages."""
    setup = live(worker_fault="conversation_after_record_before_write", **RESTART_TIMINGS)
    [first] = setup.workers
    gates = tmp_path / "gates"
    gates.mkdir()
    (tmp_path / "gate.py").write_text(GATE)

    def tool(n):  # a tool call that runs until the test opens gate n
        return f"[[bash:python3 {tmp_path / 'gate.py'} {gates} {n}]]"

    prompt = f"{tool(0)} a long turn"
    task_id = open_conversation(setup, prompt)
    # Each steer asks for one more gated tool, so the turn goes on (the fake model follows
    # the last message the turn took, tests/model_apis.py).
    steers = [f"{tool(k)} steer {k}" for k in range(1, 5)] + [f"{tool(5)}[[slow:3]] steer 5"]
    for k, text in enumerate(steers, start=1):
        wait_for(lambda: (gates / f"started-{k - 1}").exists(), timeout_s=60, what=f"tool {k - 1} to run")
        resp = send(setup, task_id, text, delivery="steer")
        assert resp.status_code == 201 and resp.json()["delivery"] == "steer", resp.text
        if k == 1:
            assert first.wait(timeout=30) == 97  # died with steer 1 claimed and recorded, its file not written
            assert not os.path.exists(os.path.join(op_dir(setup, task_id), "inbox", "0000000001.json"))
            assert messages(setup, task_id)[1]["state"] == "sent"
            launcher = agent_launcher(setup, task_id)
            setup.start_worker()  # adopts the agent (whose tool still runs) and writes steer 1 once
        wait_states(setup, task_id, {k: "delivered"}, timeout=30)
        (gates / f"open-{k - 1}").touch()
        got = wait_states(setup, task_id, {k: "consumed"}, timeout=30)
        assert got[k]["turn_seq"] == 0 and got[0]["state"] == "delivered"  # taken by the running turn
    wait_for(lambda: (gates / "started-5").exists(), timeout_s=30, what="tool 5 to run")
    asked = len(fake_model_api.requests)
    (gates / "open-5").touch()
    # The turn's last text streams (3 s): a steer written now is not taken by this turn.
    wait_for(lambda: len(fake_model_api.requests) > asked, timeout_s=30, what="the turn's last model request")
    late = send(setup, task_id, "late steer", delivery="steer")
    assert late.status_code == 201, late.text
    final = wait_states(setup, task_id, {0: "answered", 6: "answered"}, timeout=60)
    assert [(m["seq"], m["state"], m["turn_seq"]) for m in final] == [
        (0, "answered", 0), *[(k, "consumed", 0) for k in range(1, 6)], (6, "answered", 6)]
    assert final[6]["consumed_at"] and final[6]["delivery"] == "steer"
    # Two agent turns (two ``result`` lines), two answered messages; every text once.
    assert [r["subtype"] for r in result_lines(setup, task_id)] == ["success", "success"]
    assert user_texts_in_last_request(fake_model_api) == [prompt, *steers, "late steer"]
    assert written_numbers(setup, task_id) == [0, 1, 2, 3, 4, 5, 6]
    assert agent_launcher(setup, task_id) == launcher  # one agent process throughout
    # C6: the agent went from its first turn straight into the late steer's: one true end,
    # one "idle" notification, no blip between the two turns.
    session_id = setup.task(task_id)["session"]
    wait_for(lambda: session_status(setup, session_id) == "idle", timeout_s=10, what="idle after the second turn")
    assert idle_notices(session_id) == 1
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    assert setup.wait_final(task_id, timeout=60)["state"] == "succeeded"
