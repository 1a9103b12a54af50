"""What the real Codex ``app-server`` does on stdio (SPEC C4, C9, C11; docs/codex-app-server.md),
checked on the recorded fixtures (tests/record_codex_app_server.py): the facts RunStead's
live Codex conversation is built on."""
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "codex_app_server"


def events(scenario: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{scenario}.jsonl").read_text().splitlines() if line.strip()]


def outline(scenario: str) -> list[str]:
    """``user:<clientId>:<text>`` / ``agent:<text>`` (completed items) / ``completed:<turn>:<status>``
    / ``answer:<id>:<turn id or error>``, the rest left out."""
    out = []
    for e in events(scenario):
        method, params = e.get("method"), e.get("params") or {}
        item = params.get("item") or {}
        if method == "item/started" and item.get("type") == "userMessage":
            out.append(f"user:{item['clientId']}:{item['content'][0]['text']}")
        elif method == "item/completed" and item.get("type") == "agentMessage":
            out.append(f"agent:{item['text']}")
        elif method == "turn/completed":
            out.append(f"completed:{params['turn']['id']}:{params['turn']['status']}")
        elif method is None and e.get("id", 0) >= 3:
            result = e.get("result") or {}
            turn = (result.get("turn") or {}).get("id") or result.get("turnId")
            out.append(f"answer:{e['id']}:{turn or (e.get('error') or {}).get('message') or '{}'}")
    return out


def test_c11_each_turn_start_after_the_last_turn_completed_is_its_own_turn_in_one_thread():
    assert outline("three_turns") == [
        "answer:3:TURN_1", "user:None:first hello", "agent:ok: first hello", "completed:TURN_1:completed",
        "answer:4:TURN_2", "user:rs-msg-2:second hello", "agent:ok: second hello", "completed:TURN_2:completed",
        "answer:5:TURN_3", "user:None:third hello", "agent:ok: third hello", "completed:TURN_3:completed"]
    threads = {(e.get("params") or {}).get("threadId") for e in events("three_turns") if e.get("method", "").startswith("turn/")}
    assert threads == {"THREAD_1"}
    usage = [e["params"]["tokenUsage"]["total"]["totalTokens"] for e in events("three_turns")
             if e.get("method") == "thread/tokenUsage/updated"]
    assert usage == [25, 50, 75]  # G2: the thread's total so far, after each model request


def test_c4_turn_interrupt_ends_the_turn_as_interrupted_and_keeps_the_thread():
    assert outline("interrupt_tool") == [
        "answer:3:TURN_1", 'user:None:[[bash:python3 -c "import time; time.sleep(30)"; echo slept]] long tool',
        "answer:4:{}", "completed:TURN_1:interrupted",
        "answer:5:TURN_2", "user:None:after interrupt", "agent:ok: after interrupt", "completed:TURN_2:completed",
        "answer:6:no active turn to interrupt"]


def test_c9_turn_steer_joins_the_running_turn_and_its_user_item_carries_the_client_id():
    for scenario, text in (("steer_during_tool", "steer during tool"), ("steer_during_text", "steer during text")):
        got = outline(scenario)
        steered = [x for x in got if x.startswith("user:rs-steer")]
        assert steered == [f"user:rs-steer-{1 if 'tool' in scenario else 2}:{text}"]
        assert got[-2:] == [f"agent:ok: {text}", "completed:TURN_1:completed"]
        assert "answer:4:TURN_1" in got and sum(x.startswith("completed:") for x in got) == 1


def test_c9_a_steer_with_no_turn_or_the_wrong_turn_is_refused_and_starts_nothing():
    got = outline("steer_refused")
    assert "answer:4:no active turn to steer" in got
    assert "answer:6:expected active turn id `not-the-turn` but found `TURN_2`" in got
    assert not any("steer idle" in x or "steer wrong turn" in x for x in got)
    assert [x for x in got if x.startswith("completed:")] == ["completed:TURN_1:completed", "completed:TURN_2:completed"]


def test_c9_an_accepted_steer_of_a_turn_interrupted_before_it_was_taken_is_dropped():
    got = outline("steer_then_interrupt")
    assert "answer:4:TURN_1" in got  # accepted
    assert not any(x.startswith("user:rs-steer-3") for x in got)  # never taken, no turn of its own
    assert [x for x in got if x.startswith("completed:")] == ["completed:TURN_1:interrupted", "completed:TURN_2:completed"]
    assert [x for x in got if x.startswith("user:rs-")] == ["user:rs-after:after interrupt"]


def test_c11_turn_start_during_a_turn_steers_it_so_one_message_one_turn_waits_for_turn_completed():
    assert outline("start_during_turn") == [
        "answer:3:TURN_1", "user:None:[[slow:3]] slow text", "answer:4:TURN_1", "user:None:started during turn",
        "agent:ok: started during turn", "completed:TURN_1:completed"]


def test_c5_eof_during_a_turn_exits_without_finishing_it():
    timeline = [json.loads(line) for line in (FIXTURES / "timeline.jsonl").read_text().splitlines()]
    for scenario in ("eof_during_turn", "eof_during_tool"):
        assert not any(x.startswith("completed:") for x in outline(scenario))
        rows = [r for r in timeline if r["scenario"] == scenario]
        eof = next(r["at_s"] for r in rows if r["stream"] == "in" and r["line"] == "<EOF>")
        exit_row = next(r for r in rows if r["stream"] == "exit")
        assert exit_row["line"] == 0 and exit_row["at_s"] - eof < 2


def test_g2_g3_the_app_server_parser_reads_thread_turns_tokens_tools_and_verdict():
    from machine.worker.parsers import make_parser

    parser = make_parser("codex_app_server")
    for seq, text in enumerate(["first hello", "second hello", "third hello"]):
        parser.turn_prompt(seq, text)
    parser.feed((FIXTURES / "three_turns.jsonl").read_bytes())
    parser.close()
    assert parser.facts() == {
        "agent_session_id": "THREAD_1",
        "agent_result": {"is_error": False, "subtype": "completed", "summary": "ok: third hello"},
        "usage": {"turns": 3, "tool_calls": 0, "input_tokens": 60, "output_tokens": 15, "cost_usd": None},
        "last_message": "ok: third hello"}
    assert [(e["kind"], e["text"], e.get("seq")) for e in parser.entries] == [
        ("prompt", "first hello", 0), ("message", "ok: first hello", None), ("prompt", "second hello", 1),
        ("message", "ok: second hello", None), ("prompt", "third hello", 2), ("message", "ok: third hello", None)]
    assert parser.unknown_events == 0
    tool = make_parser("codex_app_server")
    tool.feed((FIXTURES / "tool_turn.jsonl").read_bytes())
    tool.close()
    assert [(e["kind"], e["text"]) for e in tool.entries] == [
        ("tool_call", "/bin/bash -lc 'echo hi'"), ("tool_result", "hi\n"), ("message", "done.")]
    interrupted = make_parser("codex_app_server")
    interrupted.feed(b"".join(line + b"\n" for line in (FIXTURES / "interrupt_tool.jsonl").read_bytes().splitlines()
                              if b'"TURN_2"' not in line))  # up to the interrupted turn's end
    interrupted.close()
    assert interrupted.facts()["agent_result"]["subtype"] == "interrupted"
    assert interrupted.facts()["agent_result"]["is_error"] is False


def test_c11_the_app_server_adapter_waits_for_the_ids_it_needs():
    """``live_agents.AppServer``: a message's turn/start needs the thread's id, an
    interrupt the id of its message's turn; until the output shows them, no line."""
    from machine.worker.live_agents import AppServer

    agent = AppServer()
    message = {"item_id": "m0", "kind": "message", "placement": 0,
               "line": json.dumps({"type": "user", "message": {"role": "user", "content": "hi"}})}
    interrupt = {"item_id": "i1", "kind": "interrupt", "placement": 1, "line": None}
    items = [message, interrupt]
    assert agent.line(message, items) is None
    agent.see(json.dumps({"id": "rs-thread", "result": {"thread": {"id": "T"}}}))
    assert json.loads(agent.line(message, items)) == {"id": "msg:m0", "method": "turn/start", "params": {
        "threadId": "T", "input": [{"type": "text", "text": "hi"}], "clientUserMessageId": "m0"}}
    assert agent.line(interrupt, items) is None
    agent.see(json.dumps({"id": "msg:m0", "result": {"turn": {"id": "U", "status": "inProgress"}}}))
    assert json.loads(agent.line(interrupt, items))["params"] == {"threadId": "T", "turnId": "U"}
    assert agent.turns_ended == 0
    # What the output says of the input, for ``conversation.landings`` (C9).
    assert agent.see(json.dumps({"method": "item/started", "params": {"item": {
        "type": "userMessage", "id": "x", "clientId": "m0", "content": []}}})) == ("taken", "m0")
    assert agent.see(json.dumps({"method": "turn/completed", "params": {"threadId": "T", "turn": {"id": "U"}}})) \
        == ("result", None)
    assert agent.see(json.dumps({"id": "msg:m2", "error": {"code": -32600, "message": "no"}})) == ("result", None)
    assert agent.turns_ended == 2  # a refused turn/start ends its turn: no turn/completed will come


def test_c9_the_app_server_adapter_steers_with_turn_steer_and_gives_a_refused_steer_its_own_turn_start():
    """``live_agents.AppServer`` (C9): a steered message is ``turn/steer`` of the latest turn
    the output named; an accepted steer's answer names its turn (an interrupt after it
    stops that turn); a refused one joins ``refused``, and its ``again`` item's line is
    the message's ``turn/start``, with the same client id, so one text reaches the model."""
    from machine.worker.live_agents import AppServer

    def user(text):
        return json.dumps({"type": "user", "message": {"role": "user", "content": text}})

    agent = AppServer()
    prompt = {"item_id": "m0", "kind": "message", "seq": 0, "delivery": "queue", "placement": 0, "line": user("go")}
    steer = {"item_id": "m1", "kind": "message", "seq": 1, "delivery": "steer", "placement": 1, "line": user("now")}
    agent.see(json.dumps({"id": "rs-thread", "result": {"thread": {"id": "T"}}}))
    assert json.loads(agent.line(prompt, [prompt]))["method"] == "turn/start"  # the prompt is never a steer
    assert agent.line(steer, [prompt, steer]) is None  # no turn named yet
    agent.see(json.dumps({"id": "msg:m0", "result": {"turn": {"id": "U1", "status": "inProgress"}}}))
    assert json.loads(agent.line(steer, [prompt, steer])) == {"id": "steer:m1", "method": "turn/steer", "params": {
        "threadId": "T", "expectedTurnId": "U1", "input": [{"type": "text", "text": "now"}],
        "clientUserMessageId": "m1"}}
    assert agent.see(json.dumps({"id": "steer:m1", "result": {"turnId": "U1"}})) is None  # taken: its user item
    interrupt = {"item_id": "i2", "kind": "interrupt", "placement": 2, "line": None}
    assert json.loads(agent.line(interrupt, [prompt, steer, interrupt]))["params"] == {"threadId": "T", "turnId": "U1"}
    assert agent.refused == [] and agent.turns_ended == 0
    assert agent.see(json.dumps({"method": "item/started", "params": {"item": {
        "type": "userMessage", "id": "y", "clientId": "m1", "content": []}}})) == ("taken", "m1")
    # A later steer whose turn ended first: refused, nothing ended or taken; its second line.
    agent.see(json.dumps({"method": "turn/completed", "params": {"threadId": "T", "turn": {"id": "U1"}}}))
    late = {"item_id": "m3", "kind": "message", "seq": 3, "delivery": "steer", "placement": 3, "line": user("late")}
    assert json.loads(agent.line(late, [prompt, steer, late]))["params"]["expectedTurnId"] == "U1"
    refusal = {"error": {"code": -32600, "message": "no active turn to steer"}, "id": "steer:m3"}
    assert agent.see(json.dumps(refusal)) is None
    agent.see(json.dumps(refusal))  # a restarted worker's re-read, or a repeat: once
    assert agent.refused == ["m3"] and agent.turns_ended == 1
    again = {"item_id": "again:m3", "kind": "again", "seq": 3, "delivery": "steer", "placement": 4,
             "line": late["line"]}
    assert json.loads(agent.line(again, [prompt, steer, late, again])) == {
        "id": "msg:m3", "method": "turn/start", "params": {
            "threadId": "T", "input": [{"type": "text", "text": "late"}], "clientUserMessageId": "m3"}}
    agent.see(json.dumps({"method": "turn/started", "params": {"threadId": "T", "turn": {"id": "U2"}}}))
    assert agent.turn_id == "U2"
    # An accepted steer whose turn completes without its user item (an interrupt came
    # first: Codex drops it) is given again too; one whose item came is not.
    taken = {"item_id": "m5", "kind": "message", "seq": 5, "delivery": "steer", "placement": 5, "line": user("a")}
    lost = {"item_id": "m6", "kind": "message", "seq": 6, "delivery": "steer", "placement": 6, "line": user("b")}
    for item in (taken, lost):
        assert json.loads(agent.line(item, [item]))["params"]["expectedTurnId"] == "U2"
        agent.see(json.dumps({"id": f"steer:{item['item_id']}", "result": {"turnId": "U2"}}))
    assert agent.see(json.dumps({"method": "item/started", "params": {"item": {
        "type": "userMessage", "id": "x", "clientId": "m5", "content": []}}})) == ("taken", "m5")
    assert agent.refused == ["m3"]
    agent.see(json.dumps({"method": "turn/completed", "params": {"threadId": "T", "turn": {"id": "U2",
                                                                                             "status": "interrupted"}}}))
    assert agent.refused == ["m3", "m6"]
    # An acceptance read after its turn's end (were the answer ever written after it): dropped too.
    agent.see(json.dumps({"id": "steer:m7", "result": {"turnId": "U2"}}))
    assert agent.refused == ["m3", "m6", "m7"]
