"""Live conversations with the real Codex CLI (SPEC C1-C6, C11): a real daphne, a real
worker subprocess, the pinned CLI's ``codex app-server`` (JSON-RPC on stdio) offline
against the fake Responses API (docs/codex-app-server.md for what it does; the adapter
is machine/worker/live_agents.py's ``AppServer``)."""
import json
import os

import psutil
import pytest

from tests.conversation_support import (
    LIVE_CLI_TIMINGS,
    LONG_TOOL,
    codex_conversation_setup,
    codex_turns_started,
    op_dir,
    long_tool_runs,
    send,
    wait_states,
)
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.model_apis import ResponsesAPI
from tests.wait import wait_for

# surface: what the real CLI does through the worker; the SQLite pass proves it (the service side
# of conversations has its own tests in both passes: test_conversation_live, test_c10_withdraw_live).
pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

# Runs until the test writes ``steer-go`` in the folder (20 s at most, within the tool's
# first wait, so a failure does not hang).
WAITING_TOOL = '[[bash:for i in $(seq 400); do [ -e steer-go ] && break; sleep 0.05; done; echo went]] wait'


@pytest.fixture
def codex_live(live_daphne, make_owner, tmp_path):  # noqa: F811
    with ResponsesAPI() as api:
        setup = codex_conversation_setup(live_daphne(**LIVE_CLI_TIMINGS), make_owner(), tmp_path, api)
        try:
            yield setup, api
        finally:
            setup.close()


def output_events(setup, task_id) -> list[dict]:
    events = []
    with open(os.path.join(op_dir(setup, task_id), "output.log")) as f:
        for line in f:
            if line.startswith("{"):
                events.append(json.loads(line))
    return events


def app_servers(folder) -> list[int]:
    """Pids of the processes running in ``folder`` whose command line ends in ``app-server``
    (the launcher, npm's ``codex`` script, the native binary)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.cmdline()[-1:] == ["app-server"] and p.cwd() == str(folder):
                found.append(p.pid)
        except (psutil.Error, IndexError):
            continue
    return found


def answer(setup, task_id, request_id: str) -> dict | None:
    """The app-server's answer to the request ``request_id`` (``live_agents.AppServer``'s
    ids: ``msg:<message id>``, ``steer:<message id>``), or None."""
    return next((e for e in output_events(setup, task_id) if e.get("id") == request_id and "method" not in e), None)


def test_c11_c9_codex_app_server_messages_in_order_steers_a_worker_kill_and_an_interrupt_keep_one_thread(codex_live):
    setup, api = codex_live
    task_id = setup.submit("codex", prompt="[[slow:2]] first turn", mode="conversation")
    assert setup.task(task_id)["conversation"] == "live"
    wait_states(setup, task_id, {0: "delivered"}, timeout=90)
    # Two messages sent while the first turn runs: they wait on the worker (a turn/start
    # written now would join the running turn) and go one turn each, after it.
    assert send(setup, task_id, "message one").status_code == 201
    assert send(setup, task_id, "message two").status_code == 201
    wait_states(setup, task_id, {0: "answered", 1: "answered", 2: "answered"}, timeout=90)
    texts = ["[[slow:2]] first turn", "message one", "message two"]
    assert codex_turns_started(api) == texts  # each once, in order, one model turn each
    # C9: a steer while a command runs (it waits for a file the test writes once Codex has
    # accepted the steer) is turn/steer of that turn: consumed into it, answered by it.
    assert send(setup, task_id, WAITING_TOOL).status_code == 201
    wait_for(lambda: any(e.get("method") == "item/started" and "steer-go" in str(e["params"]["item"].get("command"))
                         for e in output_events(setup, task_id)), timeout_s=60, what="the waiting command runs")
    steered = send(setup, task_id, "steered in", delivery="steer")
    assert steered.status_code == 201, steered.text
    wait_for(lambda: answer(setup, task_id, f"steer:{steered.json()['id']}"), timeout_s=30,
             what="Codex answers the turn/steer")
    assert answer(setup, task_id, f"steer:{steered.json()['id']}")["result"]["turnId"]  # accepted
    (setup.repo / "steer-go").write_text("")
    got = {m["seq"]: m for m in wait_states(setup, task_id, {3: "answered", 4: "consumed"}, timeout=60)}
    assert got[4]["turn_seq"] == 3 and got[3]["turn_seq"] == 3
    # A steer after the turn ended: Codex refuses the turn/steer (no active turn), so it is
    # the next turn's prompt (turn/start): consumed in its own turn, answered by it.
    late = send(setup, task_id, "steered late", delivery="steer")
    assert late.status_code == 201, late.text
    got = {m["seq"]: m for m in wait_states(setup, task_id, {5: "answered"}, timeout=60)}
    assert got[5]["turn_seq"] == 5 and got[5]["consumed_at"] is not None
    assert answer(setup, task_id, f"steer:{late.json()['id']}")["error"]["message"] == "no active turn to steer"
    assert answer(setup, task_id, f"msg:{late.json()['id']}")["result"]["turn"]["id"]
    texts += [WAITING_TOOL, "steered in", "steered late"]
    assert codex_turns_started(api) == texts  # each text once: a refused steer gave the model nothing
    with open(os.path.join(op_dir(setup, task_id), "launcher.json")) as f:
        agent_pid = json.load(f)["agent_pid"]
    processes = app_servers(setup.repo)
    assert agent_pid in processes
    # X3: the worker killed (SIGKILL) mid-turn; the next one adopts the same agent, reads
    # its output again (the thread's and turns' ids) and carries on.
    assert send(setup, task_id, "[[slow:3]] across a worker kill").status_code == 201
    wait_states(setup, task_id, {6: "delivered"}, timeout=30)
    setup.stop_workers()
    setup.start_worker()
    wait_states(setup, task_id, {6: "answered"}, timeout=60)
    assert app_servers(setup.repo) == processes  # no second agent process
    # C4: an interrupt during a long command ends the turn and keeps the thread. C9: a
    # steer Codex accepted during that command and dropped with the interrupted turn (it
    # never reached the model) is the next turn.
    assert send(setup, task_id, LONG_TOOL).status_code == 201
    wait_for(long_tool_runs, timeout_s=60, what="the long command runs")
    dropped = send(setup, task_id, "steered then interrupted", delivery="steer")
    assert dropped.status_code == 201, dropped.text
    wait_for(lambda: answer(setup, task_id, f"steer:{dropped.json()['id']}"), timeout_s=30,
             what="Codex answers the turn/steer")
    assert answer(setup, task_id, f"steer:{dropped.json()['id']}")["result"]["turnId"]  # accepted
    resp = setup.api.post(f"/api/tasks/{task_id}/interrupt/")
    assert resp.status_code == 202, resp.text
    got = {m["seq"]: m for m in wait_states(setup, task_id, {7: "answered", 8: "answered"}, timeout=30)}
    assert got[8]["turn_seq"] == 8 and got[8]["consumed_at"] is not None  # its own turn, after
    assert send(setup, task_id, "after the interrupt").status_code == 201
    wait_states(setup, task_id, {9: "answered"}, timeout=60)
    texts.append("[[slow:3]] across a worker kill")
    assert codex_turns_started(api) == [*texts, LONG_TOOL, "steered then interrupted", "after the interrupt"]
    events = output_events(setup, task_id)
    completed = [e["params"] for e in events if e.get("method") == "turn/completed"]
    assert [t["turn"]["status"] for t in completed] == ["completed"] * 6 + ["interrupted"] + ["completed"] * 2
    assert len({t["threadId"] for t in completed}) == 1  # one thread, one process
    with open(os.path.join(op_dir(setup, task_id), "launcher.json")) as f:
        assert json.load(f)["agent_pid"] == agent_pid and psutil.pid_exists(agent_pid)
    assert setup.task(task_id)["state"] == "running"
    # End: stdin closes with no turn open (EOF would abandon a running one), the task succeeds.
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    task = setup.wait_final(task_id, timeout=60)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert task["agent_session_id"] == completed[0]["threadId"]
    assert task["agent_result"] == {"is_error": False, "subtype": "completed", "summary": "ok: after the interrupt"}
    usage = task["usage"]
    assert usage["turns"] == 9 and usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["cost_usd"] is None  # Codex reports tokens only
    # The interrupted command outlives its turn (docs/codex-app-server.md) but not the task (L8).
    assert not long_tool_runs()
