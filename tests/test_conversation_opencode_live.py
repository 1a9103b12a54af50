"""Live conversations with the real opencode (SPEC C1-C6, C11): a real daphne, a real worker
subprocess, the pinned CLI's ``opencode serve`` behind RunStead's bridge
(machine/opencode_bridge.py: HTTP on 127.0.0.1 with a random password) offline against the
fake Chat Completions API (docs/opencode-server.md; the adapter is machine/worker/
live_agents.py's ``OpencodeServe``); an interrupt before opencode's first turn has begun
(C4) and its permission requests (Q5: rejected, or asked of the owner with
``approvals = "ask"``)."""
import json
import os
import uuid
from contextlib import ExitStack

import httpx
import psutil
import pytest

from tests.conversation_support import (
    LIVE_CLI_TIMINGS,
    LONG_TOOL,
    OPENCODE_BASH_ASKS,
    op_dir,
    opencode_conversation_setup,
    opencode_servers,
    opencode_turns_started,
    long_tool_runs,
    send,
    wait_states,
)
from tests.live import live_daphne  # noqa: F401  (fixture)
from machine.worker.parsers import make_parser
from tests.model_apis import ChatAPI
from tests.wait import wait_for

# surface: what the real CLI does through the worker; the SQLite pass proves it (the service side
# of conversations has its own tests in both passes: test_conversation_live, test_c10_withdraw_live).
pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def opencode_live(live_daphne, make_owner, tmp_path):  # noqa: F811
    with ChatAPI() as api:
        setup = opencode_conversation_setup(live_daphne(**LIVE_CLI_TIMINGS), make_owner(), tmp_path, api)
        try:
            yield setup, api
        finally:
            setup.close()


@pytest.fixture
def opencode_live_with(live_daphne, make_owner, tmp_path):  # noqa: F811
    """``opencode_live_with(options, env) -> (setup, api)``: as ``opencode_live`` with the
    profile's TOML lines ``options`` and more ``env``."""
    with ExitStack() as stack:
        def make(options: str = "", env: dict | None = None):
            api = stack.enter_context(ChatAPI())
            setup = opencode_conversation_setup(live_daphne(**LIVE_CLI_TIMINGS), make_owner(), tmp_path, api,
                                                options=options, env=env)
            stack.callback(setup.close)
            return setup, api

        yield make


def output_lines(setup, task_id: str) -> list[str]:
    """The bridge's stdout so far (the operation's ``output.log``), one JSON object a line."""
    with open(os.path.join(op_dir(setup, task_id), "output.log")) as f:
        return [line for line in f.read().splitlines() if line.startswith("{")]


def verdict_of_first_turn(lines: list[str]) -> dict:
    """The ``opencode_serve`` parser's verdict once the first turn ended (G3)."""
    parser = make_parser("opencode_serve")
    for line in lines:
        parser.feed_line(line)
        if parser.facts().get("agent_result"):
            return parser.facts()["agent_result"]
    raise AssertionError("no turn ended")


def tool_states(lines: list[str]) -> list[tuple[str, str]]:
    """Each finished tool part of the stream: (status, its output or error)."""
    found = {}
    for line in lines:
        event = json.loads(line)
        part = (event.get("properties") or {}).get("part") or {}
        state = part.get("state") or {}
        if part.get("type") == "tool" and state.get("status") in ("completed", "error"):
            found[part["id"]] = (state["status"], state.get("output") or state.get("error") or "")
    return list(found.values())


def pending_approvals(setup) -> list[dict]:
    resp = setup.api.get("/api/approvals/", params={"state": "pending"})
    assert resp.status_code == 200, resp.text
    return resp.json()["results"]


def decide(setup, approval_id: str, **body) -> dict:
    answer = setup.api.post(f"/api/approvals/{approval_id}/decision/", json=body,
                            headers={"Idempotency-Key": str(uuid.uuid4())})
    assert answer.status_code == 200, answer.text
    return answer.json()


def servers(folder) -> list[psutil.Process]:
    """The ``opencode serve`` processes running in ``folder``."""
    def inside(p: psutil.Process) -> bool:
        try:
            return p.cwd() == str(folder)
        except psutil.Error:
            return False

    return [p for p in opencode_servers(psutil.process_iter()) if inside(p)]


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


def test_c4_an_interrupt_sent_while_opencodes_first_turn_still_loads_ends_that_turn_interrupted(opencode_live):
    """Issue 43: on a fresh home opencode's first turn loads its plugins before it begins
    (seconds to tens of seconds); an abort then is answered 200 and does nothing. The
    bridge holds it until the turn has begun (busy) and sends it then: the owner's
    interrupt is never lost, the session answers the next message."""
    setup, api = opencode_live
    task_id = setup.submit("opencode", prompt="[[slow:20]] first turn", mode="conversation")
    wait_states(setup, task_id, {0: "delivered"}, timeout=90)
    resp = setup.api.post(f"/api/tasks/{task_id}/interrupt/")
    assert resp.status_code == 202, resp.text
    wait_states(setup, task_id, {0: "answered"}, timeout=60)
    lines = output_lines(setup, task_id)
    assert verdict_of_first_turn(lines) == {"is_error": False, "subtype": "interrupted", "summary": ""}
    held = [json.loads(line)["properties"] for line in lines if '"bridge.abort"' in line]
    assert len(held) <= 1  # held (the turn had not begun) at most once; else sent at once
    assert send(setup, task_id, "after the interrupt").status_code == 201
    wait_states(setup, task_id, {1: "answered"}, timeout=60)
    assert opencode_turns_started(api)[-1] == "after the interrupt"
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    task = setup.wait_final(task_id, timeout=60)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert task["agent_result"] == {"is_error": False, "subtype": "stop", "summary": "ok: after the interrupt"}


def test_q5_opencode_live_conversation_with_approvals_off_rejects_a_permission_request_and_the_turn_ends(
        opencode_live_with):
    """Q5 ``approvals = "off"`` (the default): a tool opencode's configuration makes ask
    for permission is rejected at once by the bridge (what headless opencode does), so the
    turn ends instead of waiting forever; nothing is asked of the owner."""
    setup, api = opencode_live_with(env=OPENCODE_BASH_ASKS)
    task_id = setup.submit("opencode", prompt="[[bash:echo ran > off.txt]] try the tool", mode="conversation")
    wait_states(setup, task_id, {0: "answered"}, timeout=90)
    lines = output_lines(setup, task_id)
    asked = [json.loads(line)["properties"] for line in lines if '"permission.asked"' in line]
    replied = [json.loads(line)["properties"] for line in lines if '"permission.replied"' in line]
    assert [a["permission"] for a in asked] == ["bash"]
    assert [(r["requestID"], r["reply"]) for r in replied] == [(asked[0]["id"], "reject")]
    assert [status for status, _ in tool_states(lines)] == ["error"]
    assert not (setup.repo / "off.txt").exists()  # the command never ran
    assert pending_approvals(setup) == [] and setup.api.get("/api/approvals/").json()["results"] == []
    assert send(setup, task_id, "still there").status_code == 201  # the session goes on
    wait_states(setup, task_id, {1: "answered"}, timeout=60)
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    task = setup.wait_final(task_id, timeout=60)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])


DENY_WORDS = "Not on this machine: use the staging database instead."


def test_q5_opencode_live_conversation_asks_the_owner_and_runs_the_tool_once_allowed_and_rejects_it_once_denied(
        opencode_live_with):
    """Q5 with ``approvals = "ask"``: the bridge (the task's credential in its environment
    only, never in the server's nor in its output) creates the approval of the task and
    waits; the owner allows it: the tool runs and the turn ends; the owner denies the next
    with a message: the tool is rejected and the model is told the owner's words."""
    setup, api = opencode_live_with(options='approvals = "ask"\n', env=OPENCODE_BASH_ASKS)
    task_id = setup.submit("opencode", prompt="[[bash:echo allowed > allowed.txt]] please", mode="conversation")
    found: list[dict] = []

    def asked() -> bool:
        found[:] = pending_approvals(setup)
        return bool(found)

    wait_for(asked, timeout_s=90, what=f"the task's approval\n{setup.log()}")
    approval = found[0]
    assert (approval["task"], approval["agent"], approval["tool_name"]) == (task_id, "opencode", "bash")
    assert approval["tool_input"]["metadata"]["command"] == "echo allowed > allowed.txt"
    assert setup.task(task_id)["state"] == "running"
    assert not (setup.repo / "allowed.txt").exists()  # waiting for the owner
    # The credential: in the bridge's environment only (W5, Q5), never printed.
    started = servers(setup.repo)
    assert len(started) == 1
    bridge = started[0].parent()
    credential = bridge.environ().get("RUNSTEAD_TASK_CREDENTIAL", "")
    assert credential and "RUNSTEAD_TASK_CREDENTIAL" not in started[0].environ()
    assert decide(setup, approval["id"], behavior="allow")["state"] == "allowed"
    wait_states(setup, task_id, {0: "answered"}, timeout=60)
    assert (setup.repo / "allowed.txt").read_text() == "allowed\n"
    lines = output_lines(setup, task_id)
    assert [json.loads(line)["properties"]["reply"] for line in lines if '"permission.replied"' in line] == ["once"]
    # Denied with a message: rejected, and the model hears why.
    assert send(setup, task_id, "[[bash:echo denied > denied.txt]] again").status_code == 201
    wait_for(asked, timeout_s=60, what="the second approval")
    assert decide(setup, found[0]["id"], behavior="deny", message=DENY_WORDS)["state"] == "denied"
    wait_states(setup, task_id, {1: "answered"}, timeout=60)
    assert not (setup.repo / "denied.txt").exists()
    lines = output_lines(setup, task_id)
    assert [json.loads(line)["properties"]["reply"] for line in lines if '"permission.replied"' in line] == \
        ["once", "reject"]
    assert DENY_WORDS in tool_states(lines)[-1][1]
    assert setup.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    task = setup.wait_final(task_id, timeout=60)
    assert task["state"] == "succeeded", (task["state_reason"], task["output_tail"])
    assert credential not in "\n".join(lines) and credential not in setup.log()
