"""Live conversations through the real worker with the demo's live profile
(``fake-claude``: scripts/fake_claude.py speaking Claude Code's stream-json input), against
a real daphne (SPEC C6, S1, B5, N1, G4): every conversation is a session, busy in each
turn and idle between, announced once per turn end; each message's turn starts with a
``prompt`` entry carrying its ``seq``."""
import json
import os
import signal
import time

import pytest

from machine.worker.conversation import QUIET_AFTER_S
from machine.worker.run import QUIET_WATCH_INTERVAL_S
from tests.conversation_support import fake_claude_setup, idle_notices, op_dir, send, session_status, wait_states
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.worker_harness import SHORT_TIMINGS, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def live(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = fake_claude_setup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    yield setup
    setup.close()


def board_session(setup, session_id) -> dict:
    resp = setup.api.get("/api/board/")
    assert resp.status_code == 200, resp.text
    return next(s for s in resp.json()["sessions"] if s["id"] == session_id)


def test_c6_a_conversation_without_session_is_one_busy_in_each_turn_idle_between_one_idle_notice_per_turn(live):
    task_id = live.submit("fake-claude", prompt="look around the repository", mode="conversation")
    session_id = live.task(task_id)["session"]
    assert session_id, "acceptance made the conversation a session"
    assert board_session(live, session_id)["title"] == "look around the repository"
    for seq, text in enumerate(["look around the repository", "also update the changelog", "now the readme"]):
        if seq:
            assert send(live, task_id, text).status_code == 201
        wait_states(live, task_id, {seq: "delivered"}, timeout=30)
        # In the turn: busy (its marker, sent before the delivered receipt), no notice yet.
        assert session_status(live, session_id) == "busy"
        assert board_session(live, session_id)["status"] == "busy"
        assert idle_notices(session_id) == seq
        assert live.task(task_id)["turn"] == "open"
        wait_states(live, task_id, {seq: "answered"}, timeout=30)
        wait_for(lambda: session_status(live, session_id) == "idle", timeout_s=10, what=f"idle after turn {seq}")
        assert board_session(live, session_id)["status"] == "idle"
        assert live.task(task_id)["state"] == "running"  # between turns: the task runs on (C6)
        assert live.task(task_id)["turn"] == "waiting"
        assert idle_notices(session_id) == seq + 1  # B5/N1 once, at the turn's true end
    assert live.api.post(f"/api/tasks/{task_id}/end/").status_code in (200, 202)
    assert live.wait_final(task_id, timeout=30)["state"] == "succeeded"
    assert (session_status(live, session_id), idle_notices(session_id)) == ("idle", 3)  # no idle again at the end


@pytest.mark.machine_side
def test_g4_c2_each_message_opens_its_turn_in_the_transcript_with_its_seq(live):
    texts = ["look around the repository", "also update the changelog", "now the readme", "and a summary"]
    task_id = live.submit("fake-claude", prompt=texts[0], mode="conversation")
    for seq, text in enumerate(texts):
        if seq:
            assert send(live, task_id, text).status_code == 201
        wait_states(live, task_id, {seq: "answered"}, timeout=30)

    def entries():
        resp = live.api.get(f"/api/tasks/{task_id}/entries/?after=0")
        assert resp.status_code == 200, resp.text
        return resp.json()["results"]

    wait_for(lambda: len([e for e in entries() if e["kind"] == "prompt"]) == 4
             and f"Done: {texts[-1]!r} is handled" in " ".join(e["text"] for e in entries()), timeout_s=15,
             what="every turn's prompt entry and the last reply on the service")
    got = entries()
    prompts = [e for e in got if e["kind"] == "prompt"]
    assert [(e["seq"], e["text"]) for e in prompts] == list(enumerate(texts))
    # Each reply follows its own message: the agent's words between two prompt entries
    # are about the earlier one (fake-claude answers "Done: '<text>' is handled").
    at = [got.index(p) for p in prompts] + [len(got)]
    for seq, (a, b) in enumerate(zip(at, at[1:])):
        replies = " ".join(e["text"] for e in got[a + 1:b] if e["kind"] == "message")
        assert f"Done: {texts[seq]!r} is handled" in replies, (seq, got[a:b])


# Production-like lease timings: with SHORT_TIMINGS the lease's own phases wake the run
# loop every couple of seconds, and the test below would pass without the coordinator's look.
LONG_LEASE = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "60", "RUNSTEAD_LEASE_RENEW_S": "20",
              "RUNSTEAD_LEASE_MARGIN_S": "5", "RUNSTEAD_KILL_GRACE_S": "2"}


@pytest.fixture
def live_long_lease(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = fake_claude_setup(live_daphne(**LONG_LEASE), make_owner(), tmp_path)
    yield setup
    setup.close()


@pytest.mark.machine_side
def test_l4_a_quiet_conversation_sleeps_yet_its_agent_ending_is_seen_within_the_coordinators_second(live_long_lease):
    """Issue 43: a conversation waiting between turns wakes none of its threads by itself
    (its run loop looks every QUIET_WATCH_INTERVAL_S, its renewal thread when a renewal
    is due); the worker's coordinator looks at every run once a second (``Runner.look``,
    L4) and wakes the one whose agent ended."""
    live = live_long_lease
    task_id = live.submit("fake-claude", prompt="look around the repository", mode="conversation")
    wait_states(live, task_id, {0: "answered"}, timeout=30)
    time.sleep(QUIET_AFTER_S + 1.0)  # the worker's own threshold: the conversation is quiet now
    with open(os.path.join(op_dir(live, task_id), "launcher.json")) as f:
        agent_pid = json.load(f)["agent_pid"]
    killed = time.monotonic()
    os.kill(agent_pid, signal.SIGKILL)
    task = live.wait_final(task_id, timeout=QUIET_WATCH_INTERVAL_S / 2)
    seen_s = time.monotonic() - killed
    assert task["state"] == "failed", task
    assert seen_s < 5.0, f"the agent's end took {seen_s:.1f} s to reach the service\n{live.log()}"
