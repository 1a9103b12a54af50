"""Live conversations with the real opencode (SPEC C1-C6, C11): a real daphne, a real worker
subprocess, the pinned CLI's ``opencode serve`` behind RunStead's bridge
(machine/opencode_bridge.py: HTTP on 127.0.0.1 with a random password) offline against the
fake Chat Completions API (docs/opencode-server.md; the adapter is machine/worker/
live_agents.py's ``OpencodeServe``)."""
import json
import os

import httpx
import psutil
import pytest

from tests.conversation_support import (
    LIVE_CLI_TIMINGS,
    LONG_TOOL,
    op_dir,
    opencode_conversation_setup,
    opencode_turns_started,
    long_tool_runs,
    send,
    wait_states,
)
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.model_apis import ChatAPI
from tests.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def opencode_live(live_daphne, make_owner, tmp_path):  # noqa: F811
    with ChatAPI() as api:
        setup = opencode_conversation_setup(live_daphne(**LIVE_CLI_TIMINGS), make_owner(), tmp_path, api)
        try:
            yield setup, api
        finally:
            setup.close()


def servers(folder) -> list[psutil.Process]:
    """The ``opencode serve`` processes running in ``folder`` (the npm package's binary)."""
    found = []
    for p in psutil.process_iter():
        try:
            if p.cmdline()[1:2] == ["serve"] and "opencode" in p.cmdline()[0] and p.cwd() == str(folder):
                found.append(p)
        except (psutil.Error, IndexError):
            continue
    return found


def test_c11_opencode_serve_three_messages_in_order_a_worker_kill_and_an_interrupt_keep_one_session(opencode_live):
    setup, api = opencode_live
    task_id = setup.submit("opencode", prompt="[[slow:2]] first turn", mode="conversation")
    assert setup.task(task_id)["conversation"] == "live"
    wait_states(setup, task_id, {0: "delivered"}, timeout=90)
    # Two messages sent while the first turn runs: they wait on the worker (a prompt sent now
    # would be merged into one turn with the next, docs/opencode-server.md), one turn each.
    assert send(setup, task_id, "message one").status_code == 201
    assert send(setup, task_id, "message two").status_code == 201
    wait_states(setup, task_id, {0: "answered", 1: "answered", 2: "answered"}, timeout=90)
    # C9: opencode cannot take a message into a running turn: refused, nothing stored.
    refused = send(setup, task_id, "now please", delivery="steer")
    assert (refused.status_code, refused.json()["error"]) == (409, "steer_unsupported")
    texts = ["[[slow:2]] first turn", "message one", "message two"]
    assert opencode_turns_started(api) == texts  # each once, in order, one model turn each
    # One server, on 127.0.0.1 with a password only it and the bridge know (K: never open).
    started = servers(setup.repo)
    assert len(started) == 1, started
    server = started[0]
    assert server.cmdline()[1:] == ["serve", "--hostname", "127.0.0.1", "--port", "0", "--no-mdns"]
    password = server.environ().get("OPENCODE_SERVER_PASSWORD", "")
    assert len(password) >= 32
    listening = [c.laddr for c in server.net_connections("tcp") if c.status == psutil.CONN_LISTEN]
    assert listening and all(addr.ip == "127.0.0.1" for addr in listening)
    assert all(httpx.get(f"http://127.0.0.1:{addr.port}/session").status_code == 401 for addr in listening)
    # X3: the worker killed (SIGKILL) mid-turn; the next one adopts the same bridge and
    # server, reads their output again and carries on: no second agent process.
    assert send(setup, task_id, "[[slow:3]] across a worker kill").status_code == 201
    wait_states(setup, task_id, {3: "delivered"}, timeout=30)
    setup.stop_workers()
    setup.start_worker()
    wait_states(setup, task_id, {3: "answered"}, timeout=60)
    assert [p.pid for p in servers(setup.repo)] == [server.pid]
    # C4: an interrupt during a long command ends the turn (abort) and keeps the session.
    assert send(setup, task_id, LONG_TOOL).status_code == 201
    wait_for(long_tool_runs, timeout_s=60, what="the long command runs")
    resp = setup.api.post(f"/api/tasks/{task_id}/interrupt/")
    assert resp.status_code == 202, resp.text
    wait_states(setup, task_id, {4: "answered"}, timeout=30)
    assert send(setup, task_id, "after the interrupt").status_code == 201
    wait_states(setup, task_id, {5: "answered"}, timeout=60)
    texts.append("[[slow:3]] across a worker kill")
    assert opencode_turns_started(api) == [*texts, LONG_TOOL, "after the interrupt"]
    with open(os.path.join(op_dir(setup, task_id), "output.log")) as f:
        output = f.read()
    assert password not in output
    events = [json.loads(line) for line in output.splitlines() if line.startswith("{")]
    sessions = {e["properties"]["sessionID"] for e in events if isinstance(e.get("properties"), dict)
                and "sessionID" in e["properties"]}
    assert len(sessions) == 1  # one session, one server
    aborted = [e for e in events if e["type"] == "session.error"]
    assert [e["properties"]["error"]["name"] for e in aborted] == ["MessageAbortedError"]
    assert not long_tool_runs()  # opencode's abort ends the running command
    assert setup.task(task_id)["state"] == "running"
    # End: stdin closes with no turn open, the bridge stops the server, the task succeeds.
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    task = setup.wait_final(task_id, timeout=60)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert task["agent_session_id"] == sessions.pop()
    assert task["agent_result"] == {"is_error": False, "subtype": "stop", "summary": "ok: after the interrupt"}
    usage = task["usage"]
    assert usage["turns"] == 6 and usage["input_tokens"] > 0 and usage["output_tokens"] > 0
    assert usage["cost_usd"] > 0  # the fake model has a price (tests/agent_clis.py)
    assert servers(setup.repo) == []
