"""What the real Claude Code does with ``--replay-user-messages`` and lines written mid-turn
(SPEC C9; docs/claude-stream-input.md "Steering"), checked on the recorded fixtures
(tests/record_claude_stream_input.py, scenarios ``replay_*``): the facts a steer is built on."""
import json
from pathlib import Path
import pytest

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "claude_stream_input"


def events(scenario: str) -> list[dict]:
    return [json.loads(line) for line in (FIXTURES / f"{scenario}.jsonl").read_text().splitlines() if line.strip()]


def outline(scenario: str) -> list[str]:
    """The stream as ``replay:<text>`` / ``result`` / ``init`` / ``tool_result``, the rest left out."""
    out = []
    for e in events(scenario):
        if e.get("type") == "user" and e.get("isReplay"):
            out.append(f"replay:{e['message']['content']}")
        elif e.get("type") == "user":
            out.append("tool_result")
        elif e.get("type") == "result":
            out.append("result")
        elif e.get("type") == "system" and e.get("subtype") == "init":
            out.append("init")
    return out


def test_c9_replay_echoes_each_taken_line_once_and_keeps_the_writers_uuid():
    got = [e for e in events("replay_idle") if e.get("isReplay")]
    assert [e["message"]["content"] for e in got] == ["replayed hello", "replayed with uuid"]
    assert got[1]["uuid"] == "00000000-0000-4000-8000-00000000c9c9"
    assert got[0]["uuid"] != got[1]["uuid"]
    assert outline("replay_idle") == ["init", "replay:replayed hello", "result",
                                      "init", "replay:replayed with uuid", "result"]


def test_c9_lines_written_during_a_tool_call_join_the_running_turn_at_its_tool_boundary():
    assert outline("replay_during_tool") == [
        "init", 'replay:[[bash:python3 -c "import time; time.sleep(4)"]] tool first', "tool_result",
        "replay:steer during tool A", "replay:steer during tool B", "result"]


def test_c9_a_line_written_while_text_streams_or_at_the_turn_end_is_the_next_turn():
    assert outline("replay_during_text") == ["init", "replay:[[slow:4]] slow text", "result",
                                             "init", "replay:steer during text", "result"]
    assert outline("replay_at_turn_end") == ["init", "replay:[[bash:echo hi]] quick tool", "tool_result", "result",
                                             "init", "replay:steer at turn end", "result"]


# --- what the worker reads from such a stream (machine/worker/conversation.py) ------------------


def landed(scenario: str, *, replay: bool = True) -> dict[str, tuple[int | None, bool]]:
    """``landings`` on the recorded stream: each written message (the scenario's stdin
    lines, seq in order) -> (seq of the turn that took it, answered). The CLI made its own
    uuids there (the lines carried none): an echo is matched to its line by its text;
    ``replay=False`` reads the stream as if the echoes were not there (a CLI without them)."""
    from machine.worker.conversation import landings
    from machine.worker.live_agents import stream_event

    written = [json.loads(json.loads(line)["line"]) for line in (FIXTURES / "stdin.jsonl").read_text().splitlines()
               if json.loads(line)["scenario"] == scenario and json.loads(line)["line"] != "<EOF>"]
    messages = [{"item_id": f"m{seq}", "seq": seq, "text": line["message"]["content"]}
                for seq, line in enumerate(written)]
    by_text = {m["text"]: m["item_id"] for m in messages}
    stream = []
    for line in (FIXTURES / f"{scenario}.jsonl").read_text().splitlines():
        event = stream_event(line)
        if event and event[0] == "taken":
            event = ("taken", by_text[json.loads(line)["message"]["content"]]) if replay else None
        if event:
            stream.append(event)
    turn_of, answered = landings(messages, stream)
    return {m["text"]: (turn_of.get(m["item_id"]), m["item_id"] in answered) for m in messages}


def test_c9_steers_taken_at_a_tool_boundary_land_in_the_running_turn_one_answered_message():
    assert landed("replay_during_tool") == {
        '[[bash:python3 -c "import time; time.sleep(4)"]] tool first': (0, True),
        "steer during tool A": (0, False), "steer during tool B": (0, False)}


def test_c9_a_steer_the_running_turn_did_not_take_opens_the_next_turn_and_is_answered():
    assert landed("replay_during_text") == {"[[slow:4]] slow text": (0, True), "steer during text": (1, True)}
    assert landed("replay_at_turn_end") == {"[[bash:echo hi]] quick tool": (0, True), "steer at turn end": (1, True)}
    assert landed("replay_idle") == {"replayed hello": (0, True), "replayed with uuid": (1, True)}


def test_c9_the_echo_carries_the_writers_uuid_and_the_worker_reads_it():
    from machine.worker.conversation import user_line
    from machine.worker.live_agents import stream_event

    message_id = "00000000-0000-4000-8000-00000000c9c9"
    assert json.loads(user_line("hi", message_id))["uuid"] == message_id
    assert "uuid" not in json.loads(user_line("hi", "prompt:not-a-uuid"))  # the CLI makes its own then
    echoes = [stream_event(json.dumps(e)) for e in events("replay_idle") if e.get("isReplay")]
    assert echoes[1] == ("taken", message_id)
    tool_results = [stream_event(json.dumps(e)) for e in events("replay_during_tool")
                    if e.get("type") == "user" and not e.get("isReplay")]
    assert tool_results == [None]


def test_c9_without_echoes_each_result_still_answers_one_message_in_order():
    """A stream with no echoes (an agent run without ``--replay-user-messages``, the demo's
    fake CLI) reads as C3 did: the k-th ``result`` answers the k-th message."""
    assert landed("replay_during_text", replay=False) == {"[[slow:4]] slow text": (0, True),
                                                          "steer during text": (1, True)}


def test_c9_two_lines_the_next_turn_took_together_are_one_turn_its_first_answered():
    """As ``queued_during_turn`` (two lines written during a text turn, merged into one
    next turn), echoed: the first opens the turn, the second joined it; and a restart that
    reads the stream again from its start gets the same answer (pure)."""
    from machine.worker.conversation import landings

    messages = [{"item_id": f"m{seq}", "seq": seq} for seq in range(3)]
    stream = [("taken", "m0"), ("result", None), ("taken", "m1"), ("taken", "m2"), ("result", None)]
    assert landings(messages, stream) == ({"m0": 0, "m1": 1, "m2": 1}, {"m0", "m1"})
    assert landings(messages, stream[:4]) == ({"m0": 0, "m1": 1, "m2": 1}, {"m0"})
    assert landings(messages, stream + [("taken", "m1"), ("result", None)]) == landings(messages, stream)
