"""What the real Codex 0.169.0 does with ``codex queue --thread ID --message TEXT``
(SPEC T4 ``native``; docs/codex-queue.md), checked on the recorded fixtures
(tests/record_codex_queue.py): the facts a native channel for Codex would be built on."""
import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "codex_queue"


def scenario(name: str) -> dict:
    return json.loads((FIXTURES / f"{name}.json").read_text())


def test_t4_codex_queue_answers_at_once_with_the_queued_id_and_exit_0():
    for name in ("idle", "busy", "twice", "typed_draft", "no_daemon", "after_exit"):
        for row in scenario(name)["queued"]:
            assert (row["exit"], row["stdout"]) == (0, "Queued message QUEUED_ID for thread THREAD_ID.\n"), (name, row)
            assert row["seconds"] < 2, (name, row)


def test_t4_codex_queue_to_an_idle_tui_is_a_turn_of_its_own_on_its_screen():
    got = scenario("idle")
    assert got["prompts"] == ["first turn", "queued while idle"]
    assert "› queued while idle" in got["screen"] and "• ok: queued while idle" in got["screen"]


def test_t4_codex_queue_during_a_turn_waits_and_each_message_is_its_own_turn_in_order():
    assert scenario("busy")["prompts"] == ["first turn", "[[slow:5]] a slow turn", "queued during the turn A",
                                           "queued during the turn B"]


def test_t4_codex_queue_has_no_deduplication_the_same_text_twice_is_two_turns():
    assert scenario("twice")["prompts"] == ["first turn", "queued twice", "queued twice"]


def test_t4_codex_queue_goes_in_as_its_own_turn_and_leaves_the_persons_draft_in_the_composer():
    got = scenario("typed_draft")
    assert got["prompts"] == ["first turn", "queued over a draft"]
    screen = [line.strip() for line in got["screen"]]
    assert screen.index("• ok: queued over a draft") < screen.index("› half typed"), screen  # still in the box


def test_t4_codex_queue_to_a_no_daemon_tui_says_queued_and_never_reaches_it():
    assert scenario("no_daemon")["prompts"] == ["first turn"]


def test_t4_codex_queue_with_no_tui_running_is_taken_by_the_next_resume_of_the_thread():
    got = scenario("after_exit")
    assert got["prompts"] == ["first turn", "queued after exit"]
    assert "• ok: queued after exit" in got["screen"]
