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
