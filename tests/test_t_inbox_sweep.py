"""SPEC T2, W1: the worker's sweep of the session inbox (``machine.worker.sessions.sweep``,
``machine.inbox.orphans`` and ``prune``). A message a wrapper took and then died with
(kill -9: its ``terminals/<pid>`` folder stays), in a session no wrapper runs any more,
is marked lost once it has been taken for ``STALE_TAKE_S`` and reported ``undelivered``
once, through the worker's outbox, which the service accepts from the machine token; a
session a live wrapper runs is left to that wrapper; finished files older than the
retention are pruned, waiting and taken ones never."""
import os
import subprocess
import sys
import time
import uuid

import pytest

from machine import inbox
from machine.worker import sessions
from tests.conftest import machine_api, owner_api


def message(session_id, seq):
    return {"session_id": session_id, "message_id": str(uuid.uuid4()), "seq": seq, "text": f"m{seq}",
            "channel": "terminal"}


def terminal(hook_dir, pid, session_id):
    folder = os.path.join(hook_dir, "terminals", str(pid))
    os.makedirs(folder)
    with open(os.path.join(folder, "state.json"), "w") as handle:
        handle.write(f'{{"session_id": "{session_id}", "busy": false}}')
    return folder


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_t2_a_message_a_dead_wrapper_took_is_reported_undelivered_once_a_live_ones_is_left(tmp_path):
    hook_dir, dead, live = str(tmp_path / "hooks"), str(uuid.uuid4()), str(uuid.uuid4())
    lost = message(dead, 1)
    inbox.record(hook_dir, lost)
    inbox.record(hook_dir, message(dead, 2))  # still waiting: not the sweep's
    inbox.take(hook_dir, dead)
    inbox.record(hook_dir, message(live, 1))
    inbox.take(hook_dir, live)
    dead_folder = terminal(hook_dir, dead_pid(), dead)
    terminal(hook_dir, os.getpid(), live)  # this process stands for a live wrapper
    now = time.time()
    # taken just now: maybe still being typed
    assert sessions.sweep(now=now, retention_s=86400, state_dir=hook_dir) == []
    later = now + inbox.STALE_TAKE_S + 1
    items = sessions.sweep(now=later, retention_s=86400, state_dir=hook_dir)
    assert items == [{"event_id": f"session-delivery:{lost['message_id']}:undelivered", "kind": "session_delivery",
                      "operation_id": None, "method": "POST", "path": f"/api/sessions/{dead}/messages/1/delivery/",
                      "body": {"state": "undelivered"}}]
    assert not os.path.exists(dead_folder)  # the dead wrapper's leftovers are gone
    assert sessions.sweep(now=later, retention_s=86400, state_dir=hook_dir) == []  # reported once
    assert [n.split("-")[0] for n in inbox.in_state(hook_dir, dead, inbox.LOST)] == ["lost"]
    assert len(inbox.waiting(hook_dir, dead)) == 1
    assert len(inbox.in_state(hook_dir, live, inbox.TAKE)) == 1  # its live wrapper decides


def test_w1_finished_inbox_files_are_pruned_after_the_retention_waiting_and_taken_kept(tmp_path):
    hook_dir, one, two = str(tmp_path / "hooks"), str(uuid.uuid4()), str(uuid.uuid4())
    for seq in (1, 2, 3):
        inbox.record(hook_dir, message(one, seq))
    name, _ = inbox.take(hook_dir, one)
    inbox.move(hook_dir, one, name, inbox.DONE)
    name, _ = inbox.take(hook_dir, one)
    inbox.move(hook_dir, one, name, inbox.GONE)
    inbox.record_interrupt(hook_dir, one, "i1")
    inbox.take_interrupt(hook_dir, one)
    inbox.record(hook_dir, message(two, 1))
    name, _ = inbox.take(hook_dir, two)
    inbox.move(hook_dir, two, name, inbox.LOST)
    now = time.time()
    assert inbox.prune(hook_dir, before=now - 60) == 0  # younger than the retention
    assert inbox.prune(hook_dir, before=now + 1) == 4
    assert [n.split("-")[0] for n in sorted(os.listdir(inbox.session_dir(hook_dir, one)))] == ["wait"]
    assert not os.path.exists(inbox.session_dir(hook_dir, two))  # emptied: removed


@pytest.mark.django_db
def test_t2_the_sweeps_report_is_accepted_from_the_machine_token(owner, machine, tmp_path):
    session_id = str(uuid.uuid4())
    assert owner_api(owner).post("/api/sessions/", {"id": session_id, "agent": "claude", "machine": str(machine.id),
                                                    "channel": "terminal"}, format="json").status_code == 201
    sent = owner_api(owner).post(f"/api/sessions/{session_id}/messages/", {"text": "lost one"}, format="json",
                                 HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4())).json()
    hook_dir = str(tmp_path / "hooks")
    inbox.record(hook_dir, {**sent, "session_id": session_id, "message_id": sent["id"], "channel": "terminal"})
    inbox.take(hook_dir, session_id)
    (item,) = sessions.sweep(now=time.time() + 60, retention_s=86400, state_dir=hook_dir)
    answer = machine_api(machine).post(item["path"], item["body"], format="json")
    assert answer.status_code == 200, answer.content
    assert answer.json()["state"] == "undelivered"


def test_t5_an_interrupt_being_recorded_is_not_taken_half_written(tmp_path):
    """The worker writes an interrupt as a temporary file renamed into place: a wrapper
    looking at that moment takes nothing (it once took the temporary file, and the
    worker's rename then failed)."""
    state_dir, session_id = str(tmp_path), str(uuid.uuid4())
    folder = inbox.session_dir(state_dir, session_id)
    os.makedirs(folder)
    with open(os.path.join(folder, "intr-abc.json.123.tmp"), "w") as handle:
        handle.write("{}")
    assert inbox.take_interrupt(state_dir, session_id) is False
    assert inbox.record_interrupt(state_dir, session_id, "abc") is True
    assert inbox.take_interrupt(state_dir, session_id) is True
    assert inbox.take_interrupt(state_dir, session_id) is False
