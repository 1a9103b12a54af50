"""T4: a Claude Code session without the wrapper gets a waiting message through its Stop
hook, as the real hook command (``python -m machine.hooks claude``) against a live
service: claimed once by compare-and-set and printed as ``{"decision": "block", "reason"}``;
nothing on the ``stop_hook_active`` re-fire; nothing and no network when nothing waits
(I1); the service unreachable: nothing claimed, the hook done within 3 s, the message
back to wait for the next Stop. The inbox is filled as the worker fills it (``machine.inbox``
from the pulled ``session_message``)."""
import json
import socket
import time
import uuid

import pytest

from machine import inbox
from machine.hooks import store
from machine.hooks.mapping import session_uuid
from sessions_app.models import SessionMessage
from tests.conftest import machine_api, owner_api
from tests.hooks_support import fixture, run_hook, stop_sender


@pytest.fixture
def hooked(live_server, owner, machine, tmp_path):
    state_dir = tmp_path / "hooks"
    store.write_config(state_dir, server=live_server.url, token=owner.auth_token.key, extra={"machine": str(machine.id)})
    agent_session = f"s-{uuid.uuid4()}"
    session_id = session_uuid("claude", agent_session)
    body = {"id": session_id, "agent": "claude", "machine": str(machine.id), "channel": "hook"}
    assert owner_api(owner).post("/api/sessions/", body, format="json").status_code == 201
    yield state_dir, agent_session, session_id
    stop_sender(state_dir)


def send_and_record(owner, machine, state_dir, session_id, text):
    resp = owner_api(owner).post(f"/api/sessions/{session_id}/messages/", {"text": text}, format="json",
                                 HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()))
    assert resp.status_code == 201, resp.content
    for message in machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]:
        inbox.record(str(state_dir), message["payload"])  # what the worker does before its ack
    return resp.json()


def stop(agent_session, **extra):
    return fixture("claude", "stop", session_id=agent_session, cwd="/tmp", **extra)


@pytest.mark.django_db(transaction=True)
def test_t4_stop_hook_hands_a_waiting_message_once_then_lets_the_turn_end(hooked, owner, machine):
    state_dir, agent_session, session_id = hooked
    sent = send_and_record(owner, machine, state_dir, session_id, "also say banana")
    done = run_hook("claude", stop(agent_session, stop_hook_active=False), state_dir)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {"decision": "block",
                                       "reason": "Message from your phone (RunStead): also say banana"}
    message = SessionMessage.objects.get(pk=sent["id"])
    assert (message.state, message.delivered_by) == ("delivered", f"stop-{sent['id']}")
    again = run_hook("claude", stop(agent_session, stop_hook_active=True), state_dir)
    assert (again.returncode, again.stdout) == (0, b"")
    # a Stop of another turn: nothing waits, nothing printed
    assert run_hook("claude", stop(agent_session, stop_hook_active=False), state_dir).stdout == b""
    assert len(inbox.in_state(str(state_dir), session_id, inbox.DONE)) == 1


@pytest.mark.django_db(transaction=True)
def test_t4_withdrawn_message_is_not_handed_over(hooked, owner, machine):
    state_dir, agent_session, session_id = hooked
    send_and_record(owner, machine, state_dir, session_id, "never mind")
    assert owner_api(owner).post(f"/api/sessions/{session_id}/messages/1/withdraw/").status_code == 200
    done = run_hook("claude", stop(agent_session, stop_hook_active=False), state_dir)
    assert (done.returncode, done.stdout) == (0, b"")
    assert inbox.in_state(str(state_dir), session_id, inbox.GONE)


@pytest.mark.django_db(transaction=True)
def test_t4_service_unreachable_nothing_claimed_and_the_turn_ends_within_3_s(hooked, owner, machine):
    state_dir, agent_session, session_id = hooked
    send_and_record(owner, machine, state_dir, session_id, "later")
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    store.write_config(state_dir, server=f"http://127.0.0.1:{silent.getsockname()[1]}", token=owner.auth_token.key)
    started = time.monotonic()
    try:
        done = run_hook("claude", stop(agent_session, stop_hook_active=False), state_dir)
    finally:
        silent.close()
    assert time.monotonic() - started < 3.0
    assert (done.returncode, done.stdout) == (0, b"")
    assert SessionMessage.objects.get(session_id=session_id).state == "sent"
    assert inbox.waiting(str(state_dir), session_id)  # back to wait for the next Stop
