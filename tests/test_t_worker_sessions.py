"""Session messages through the real worker's pull (SPEC T2, T5, W2, W3), with a real
daphne and real worker processes (tests/worker_harness.py): a message is recorded in the
session's local inbox (``machine.inbox``) before it is acknowledged; a worker killed
between the two gets it again and recognises it; a message the wrapper already took is
never put back to wait."""
import os
import signal
import uuid

import pytest

from machine import inbox
from tests.live import module_daphne  # noqa: F401  (fixture)
from tests.worker_harness import SHORT_TIMINGS, LiveSetup, wait_for

pytestmark = pytest.mark.slow
FAULT_EXIT = 97


@pytest.fixture
def live(module_daphne, transactional_db, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(module_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    yield setup
    setup.close()


def bind(live, channel="terminal") -> str:
    session_id = str(uuid.uuid4())
    resp = live.api.post("/api/sessions/", json={"id": session_id, "agent": "claude", "machine": live.machine_id,
                                                 "channel": channel})
    assert resp.status_code == 201, resp.text
    return session_id


def send(live, session_id, text) -> dict:
    resp = live.api.post(f"/api/sessions/{session_id}/messages/", json={"text": text},
                         headers={"Idempotency-Key": str(uuid.uuid4())})
    assert resp.status_code == 201, resp.text
    return resp.json()


def files(hook_dir, session_id) -> list[str]:
    try:
        return sorted(os.listdir(inbox.session_dir(str(hook_dir), session_id)))
    except FileNotFoundError:
        return []


def test_t2_worker_records_before_ack_and_a_redelivery_is_recognised(live, tmp_path):
    from tasks_app.models import OutboxMessage

    hook_dir = tmp_path / "hooks"
    env = {"RUNSTEAD_HOOK_DIR": str(hook_dir)}
    session_id = bind(live)
    first = live.start_worker(fault="after_commit_before_ack", env=env)
    message = send(live, session_id, "run the tests\nthen commit")
    assert first.wait(timeout=30) == FAULT_EXIT, live.log()
    outbox = OutboxMessage.objects.get(kind="session_message")
    assert outbox.acked_at is None  # died before the ack...
    (name,) = files(hook_dir, session_id)  # ...but after the record
    assert name == f"wait-000000001-{message['id']}.json"
    payload = inbox.payload_of(str(hook_dir), session_id, name)
    assert (payload["text"], payload["seq"], payload["channel"]) == ("run the tests\nthen commit", 1, "terminal")
    # the wrapper takes it (the rename is the at-most-once step)
    taken, _ = inbox.take(str(hook_dir), session_id)
    second = live.start_worker(env=env)
    wait_for(lambda: OutboxMessage.objects.get(pk=outbox.pk).acked_at is not None, what=f"redelivery acked\n{live.log()}")
    assert OutboxMessage.objects.get(pk=outbox.pk).deliveries >= 2
    assert files(hook_dir, session_id) == [taken]  # recognised: not put back to wait (W3)
    assert "already known" in live.log()
    # an interrupt (T5) is recorded the same way
    assert live.api.post(f"/api/sessions/{session_id}/interrupt/").status_code == 202
    # the record is written to ``intr-<id>.json.<pid>.tmp`` and renamed: wait for the renamed file
    wait_for(lambda: any(n.startswith("intr-") and n.endswith(".json") for n in files(hook_dir, session_id)),
             what="interrupt recorded")
    assert inbox.take_interrupt(str(hook_dir), session_id) and not inbox.take_interrupt(str(hook_dir), session_id)
    assert os.stat(inbox.inbox_root(str(hook_dir))).st_mode & 0o777 == 0o700
    second.send_signal(signal.SIGTERM)
    assert second.wait(timeout=20) == 0
