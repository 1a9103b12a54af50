"""Withdraw against delivery through the real worker and the demo's live profile
(``fake-claude``, scripts/fake_claude.py speaking Claude Code's stream-json input),
against a real daphne (SPEC C10): a message withdrawn while it waits on the worker never
reaches the agent and the next one goes on in its place; a message withdrawn as the
worker claims it either is withdrawn and never written or is delivered and answered, and
the two answers agree. And C9's order on the same worker: a steer goes at once, past a
queued message, which waits for a turn of its own."""
import glob
import json
import os

import pytest

from tests.conversation_support import fake_claude_setup, messages, op_dir, send, wait_states
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.worker_harness import SHORT_TIMINGS

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def live(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = fake_claude_setup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path, pause_s=2.0)
    yield setup
    setup.close()


def agent_read(setup, task_id) -> list[str]:
    """Every text the launcher was given for the agent's stdin (the inbox files, each written once)."""
    texts = []
    for path in sorted(glob.glob(os.path.join(op_dir(setup, task_id), "inbox", "*.json"))):
        with open(path) as f:
            line = json.load(f).get("line")
        if line:
            texts.append(json.loads(line)["message"]["content"])
    return texts


def withdraw(setup, task_id, seq):
    return setup.api.post(f"/api/tasks/{task_id}/messages/{seq}/withdraw/")


def test_c10_withdrawn_while_waiting_is_never_written_and_the_next_message_takes_its_turn(live):
    task_id = live.submit("fake-claude", prompt="look around the repository", mode="conversation")
    wait_states(live, task_id, {0: "delivered"}, timeout=30)
    # Turn 0 runs (two model turns 2 s apart): messages 1 and 2 wait on the worker, unclaimed.
    assert send(live, task_id, "delete everything").status_code == 201
    assert send(live, task_id, "now the readme").status_code == 201
    resp = withdraw(live, task_id, 1)
    assert resp.status_code == 200, resp.text
    assert resp.json()["state"] == "withdrawn"
    assert withdraw(live, task_id, 1).json()["state"] == "withdrawn"  # the same answer again
    got = wait_states(live, task_id, {0: "answered", 1: "withdrawn", 2: "answered"}, timeout=60)
    assert [m["delivered_at"] for m in got if m["seq"] == 1] == [None]
    assert agent_read(live, task_id) == ["look around the repository", "now the readme"]
    # Delivered: too late to take back, and it says so.
    resp = withdraw(live, task_id, 2)
    assert resp.status_code == 409 and resp.json()["error"] == "already_delivered", resp.text
    assert live.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    assert live.wait_final(task_id, timeout=30)["state"] == "succeeded"


def test_c10_withdraw_racing_the_workers_claim_one_wins_and_the_agent_sees_it_only_if_delivery_won(live):
    task_id = live.submit("fake-claude", prompt="look around the repository", mode="conversation")
    wait_states(live, task_id, {0: "answered"}, timeout=30)
    outcomes = {}
    for n in range(1, 4):
        # Between turns: the worker claims the message as soon as it pulls it; the
        # withdraw is sent at once and meets that claim.
        assert send(live, task_id, f"race {n}").status_code == 201
        resp = withdraw(live, task_id, n)
        assert (resp.status_code, resp.json().get("error")) in ((200, None), (409, "already_delivered")), resp.text
        outcomes[n] = "withdrawn" if resp.status_code == 200 else "answered"
        wait_states(live, task_id, {n: outcomes[n]}, timeout=60)
    read = agent_read(live, task_id)
    for n, outcome in outcomes.items():
        assert read.count(f"race {n}") == (1 if outcome == "answered" else 0), (n, outcome, read)
    by_seq = {m["seq"]: m for m in messages(live, task_id)}
    assert all(by_seq[n]["state"] == outcome for n, outcome in outcomes.items())
    assert live.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    assert live.wait_final(task_id, timeout=30)["state"] == "succeeded"


@pytest.mark.machine_side
def test_c9_a_steer_is_written_at_once_past_a_queued_message_which_waits_for_a_turn_of_its_own(live):
    """The order decision of C9 (machine/worker/conversation.py): a steer does not wait
    behind queued messages, a queued one waits until no turn is open, the steer's included.
    The demo's fake CLI echoes nothing: each ``result`` answers the next message in the
    order they were written (the steer first)."""
    task_id = live.submit("fake-claude", prompt="look around the repository", mode="conversation")
    wait_states(live, task_id, {0: "delivered"}, timeout=30)
    assert send(live, task_id, "next one").status_code == 201
    assert send(live, task_id, "now one", delivery="steer").status_code == 201
    got = wait_states(live, task_id, {2: "delivered"}, timeout=30)
    assert got[1]["state"] == "sent"  # queued: waits for every open turn, the steer's too
    got = wait_states(live, task_id, {0: "answered", 1: "answered", 2: "answered"}, timeout=60)
    assert agent_read(live, task_id) == ["look around the repository", "now one", "next one"]
    assert got[2]["answered_at"] < got[1]["delivered_at"]
    assert [(m["delivery"], m["turn_seq"]) for m in got] == [("queue", 0), ("queue", 1), ("steer", 2)]
    assert live.api.post(f"/api/tasks/{task_id}/end/").status_code == 200
    assert live.wait_final(task_id, timeout=30)["state"] == "succeeded"
