"""What the real Codex ``app-server`` does on stdio (SPEC C4, C9, C11; docs/codex-app-server.md),
checked on the recorded fixtures (tests/record_codex_app_server.py): the facts RunStead's
live Codex conversation is built on."""
import json
from pathlib import Path

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
