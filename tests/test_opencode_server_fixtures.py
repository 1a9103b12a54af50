"""What the real opencode 1.18.33 terminal UI's local server does with a prompt sent to it
(SPEC T4 ``native``; docs/opencode-server.md), checked on the recorded fixture
(tests/record_opencode_server.py)."""
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "opencode_server" / "steps.json"


def step(name: str) -> dict:
    return next(s for s in json.loads(FIXTURE.read_text()) if s["step"] == name)


def turns(messages: list[dict]) -> list[tuple[str, str]]:
    return [(m["role"], m["text"]) for m in messages]


def test_t4_opencode_prompt_async_while_idle_is_a_turn_of_the_tuis_session():
    got = step("idle")
    assert [(c["path"], c["status"], c["answer"]) for c in got["calls"]] == [
        ("/session/SESSION_ID/prompt_async", 204, "")]
    assert got["asked"][-1] == "from the server while idle"
    assert turns(got["messages"])[-2:] == [("user", "from the server while idle"),
                                           ("assistant", "ok: from the server while idle")]


def test_t4_opencode_prompts_sent_during_a_turn_are_answered_together_by_one_next_turn():
    got = step("busy")
    assert all(c["status"] == 204 for c in got["calls"])
    assert got["asked"] == ["[[slow:5]] a slow turn", "during the turn B"]  # one model call after the turn
    assert turns(got["messages"])[-5:] == [
        ("user", "[[slow:5]] a slow turn"), ("assistant", "ok: a slow turn"),
        ("user", "during the turn A"), ("user", "during the turn B"), ("assistant", "ok: during the turn B")]


def test_t4_opencode_abort_ends_the_running_turn_and_the_session_takes_the_next_prompt():
    got = step("abort")
    assert [(c["path"], c["status"], c["answer"]) for c in got["calls"]] == [
        ("/session/SESSION_ID/prompt_async", 204, ""), ("/session/SESSION_ID/abort", 200, "true"),
        ("/session/SESSION_ID/prompt_async", 204, "")]
    aborted = [m for m in got["messages"] if m["error"]]
    assert [(m["role"], m["error"]) for m in aborted] == [("assistant", "MessageAbortedError")]
    assert turns(got["messages"])[-2:] == [("user", "after the abort"), ("assistant", "ok: after the abort")]
    assert any("interrupted" in line for line in got["screen"])
