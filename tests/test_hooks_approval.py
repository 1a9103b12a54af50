"""SPEC Q3, Q4 (and I1 beside them): Claude Code's ``PermissionRequest`` hook as a real
subprocess against a real daphne. It asks the service, waits by long-poll and prints the
decision JSON on allow or deny, nothing on anything else; the session's next hook
resolves a still pending approval as answered in the terminal; the hook survives a
service restart and leaves quietly when the service stops."""
import json
import signal
import time
import uuid

import httpx
import pytest

from machine.hooks import mapping, store
from sessions_app.models import Approval, Session
from machine.protocol import json_digest
from tests.hooks_support import fixture, finish_hook, hook_env, run_hook, start_hook, stop_sender
from tests.live import DaphneServer, free_port, live_daphne, module_daphne  # noqa: F401
from tests.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.django_db(transaction=True)]
FAST = {"RUNSTEAD_HOOK_SENDER_IDLE_S": "5", "RUNSTEAD_HOOK_BACKOFF_BASE_S": "0.05",
        "RUNSTEAD_HOOK_BACKOFF_MAX_S": "0.3"}
ALLOW = {"hookSpecificOutput": {"hookEventName": "PermissionRequest", "decision": {"behavior": "allow"}}}


class Rig:
    """One owner, one hook state dir pointed at ``url``; every hook runs with ``env``."""

    def __init__(self, url, token, state_dir, **env):
        self.url, self.token, self.state_dir = url, token, state_dir
        store.write_config(state_dir, server=url, token=token)
        self.env = hook_env(state_dir, **FAST, **env)
        self.sid = f"agent-{uuid.uuid4()}"
        self.rs = mapping.session_uuid("claude", self.sid)

    def payload(self, name, **extra):
        return fixture("claude", name, session_id=self.sid, **extra)

    def ask(self, **extra):
        return start_hook("claude", self.payload("permission_request", **extra), self.state_dir, env=self.env)

    def hook(self, name, **extra):
        start = time.monotonic()
        result = run_hook("claude", self.payload(name, **extra), self.state_dir, env=self.env)
        assert (result.returncode, result.stdout) == (0, b""), result.stderr
        return time.monotonic() - start

    def pending(self, count=1, timeout=20.0) -> list[Approval]:
        return wait_for(lambda: (rows := list(Approval.objects.filter(session=self.rs, state="pending")
                                              .order_by("created_at"))) and len(rows) >= count and rows,
                        timeout_s=timeout)

    def decide(self, approval_id, **body):
        response = httpx.post(f"{self.url}/api/approvals/{approval_id}/decision/", json=body or {"behavior": "allow"},
                              headers={"Authorization": f"Token {self.token}", "Idempotency-Key": str(uuid.uuid4())},
                              timeout=20)
        assert response.status_code == 200, response.text
        return response.json()

    def local_state(self) -> dict:
        return store.peek_session_state(self.state_dir, f"claude:{self.sid}")

    def close(self):
        stop_sender(self.state_dir)


@pytest.fixture
def rig(module_daphne, make_owner, tmp_path, transactional_db):  # noqa: F811
    owner = make_owner()
    r = Rig(module_daphne(), owner.auth_token.key, tmp_path / "hooks")
    yield r
    r.close()


def output(stdout: bytes):
    assert stdout.endswith(b"\n") and stdout.count(b"\n") == 1, stdout
    return json.loads(stdout)


# --- Q3: the answer from RunStead ----------------------------------------------------------


def test_q3_allow_prints_the_decision_json_and_attention_is_approval_while_pending(rig):
    payload = rig.payload("permission_request")
    rig.hook("user_prompt_submit")
    proc = rig.ask()
    [approval] = rig.pending()
    # Q1's key: agent session id, prompt id (the turn's: Claude Code sends none with
    # PermissionRequest), tool input digest, the count in the turn
    prompt_id = rig.payload("user_prompt_submit")["prompt_id"]
    assert approval.key == f"claude:{rig.sid}:{prompt_id}:{json_digest(payload['tool_input'])}:1"
    assert (approval.tool_name, approval.tool_input, approval.cwd) == ("Bash", payload["tool_input"], payload["cwd"])
    assert approval.suggestions == payload["permission_suggestions"]
    assert Session.objects.get(pk=rig.rs).attention == "approval"
    assert proc.poll() is None  # it waits
    rig.decide(approval.pk, behavior="allow")
    status, out, err = finish_hook(proc)
    assert status == 0 and output(out) == ALLOW, (out, err)
    assert Session.objects.get(pk=rig.rs).attention == ""
    assert "approvals" not in rig.local_state()  # nothing left for Q4 to resolve


def test_q3_allow_for_the_session_prints_updated_permissions_from_the_suggestions(rig):
    suggestions = rig.payload("permission_request")["permission_suggestions"]
    proc = rig.ask()
    [approval] = rig.pending()
    rig.decide(approval.pk, behavior="allow", scope="session")
    status, out, _ = finish_hook(proc)
    assert status == 0 and output(out) == {"hookSpecificOutput": {"hookEventName": "PermissionRequest", "decision": {
        "behavior": "allow", "updatedPermissions": [{**s, "destination": "session"} for s in suggestions]}}}


def test_q3_deny_prints_the_owners_message(rig):
    proc = rig.ask()
    [approval] = rig.pending()
    rig.decide(approval.pk, behavior="deny", message="Not on main: use a branch <b>please</b>")
    status, out, _ = finish_hook(proc)
    assert status == 0 and output(out) == {"hookSpecificOutput": {"hookEventName": "PermissionRequest", "decision": {
        "behavior": "deny", "message": "Not on main: use a branch <b>please</b>"}}}


def test_q3_a_second_identical_request_in_the_turn_is_a_second_approval_and_a_retry_is_not(rig):
    first = rig.ask()
    [one] = rig.pending()
    rig.decide(one.pk)
    assert output(finish_hook(first)[1]) == ALLOW
    second = rig.ask()  # the same tool input again in the same turn: count 2
    two = wait_for(lambda: Approval.objects.filter(session=rig.rs, state="pending").first(), timeout_s=20)
    assert two.key.endswith(":2") and two.key[:-2] == one.key[:-2]
    # the hook's own retry of the create (same key) makes no second row
    response = httpx.post(f"{rig.url}/api/approvals/", headers={"Authorization": f"Token {rig.token}"}, timeout=20,
                          json={"key": two.key, "session": str(rig.rs), "agent": "claude", "tool_name": "Bash",
                                "tool_input": two.tool_input})
    assert response.status_code == 200 and response.json()["id"] == str(two.pk)
    rig.decide(two.pk, behavior="deny", message="no")
    assert output(finish_hook(second)[1])["hookSpecificOutput"]["decision"]["behavior"] == "deny"
    assert Approval.objects.filter(session=rig.rs).count() == 2


# --- Q3: nothing printed, the terminal decides --------------------------------------------


def test_q3_expired_on_the_service_prints_nothing(live_daphne, make_owner, tmp_path):  # noqa: F811
    owner = make_owner()
    r = Rig(live_daphne(RUNSTEAD_APPROVAL_WAIT_S="2"), owner.auth_token.key, tmp_path / "hooks",
            RUNSTEAD_HOOK_APPROVAL_POLL_S="1")
    try:
        proc = r.ask()
        [approval] = r.pending()
        status, out, _ = finish_hook(proc)
        assert (status, out) == (0, b"")
        approval.refresh_from_db()
        assert (approval.state, approval.decided_by) == ("expired", "timeout")
        assert "approvals" not in r.local_state()
    finally:
        r.close()


def test_q3_the_hooks_own_wait_over_prints_nothing_and_the_next_hook_tells_the_service(module_daphne, make_owner,  # noqa: F811
                                                                                          tmp_path):
    owner = make_owner()
    r = Rig(module_daphne(), owner.auth_token.key, tmp_path / "hooks", RUNSTEAD_HOOK_APPROVAL_WAIT_S="1.5")
    try:
        start = time.monotonic()
        proc = r.ask()
        [approval] = r.pending()
        status, out, _ = finish_hook(proc)
        assert (status, out) == (0, b"") and time.monotonic() - start < 15
        approval.refresh_from_db()
        assert approval.state == "pending"  # the person answers the terminal's dialog now
        assert r.local_state()["approvals"] == [str(approval.pk)]
        r.hook("post_tool_use")  # the tool ran: answered in the terminal (Q4)
        wait_for(lambda: Approval.objects.get(pk=approval.pk).state == "answered_in_terminal", timeout_s=20)
        assert Session.objects.get(pk=r.rs).attention == ""
    finally:
        r.close()


def test_q3_withdrawn_prints_nothing(live_daphne, make_owner, tmp_path):  # noqa: F811
    """A session's approval is never withdrawn through the API (only a task's, Q5): the
    service's one way out of pending sets it here, and the long-poll's safety re-check
    delivers it to the waiting hook."""
    from core import clock
    from sessions_app import approvals
    from sessions_app.models import DECIDED_BY_SYSTEM, ApprovalState

    owner = make_owner()
    r = Rig(live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="0.5"), owner.auth_token.key, tmp_path / "hooks")
    try:
        proc = r.ask()
        [approval] = r.pending()
        assert approvals._settle(approval, to=ApprovalState.WITHDRAWN, decided_by=DECIDED_BY_SYSTEM, now=clock.now())
        status, out, _ = finish_hook(proc)
        assert (status, out) == (0, b"")
        assert "approvals" not in r.local_state()
    finally:
        r.close()


def test_q3_service_unreachable_for_the_window_prints_nothing_and_exits_0(tmp_path):
    r = Rig(f"http://127.0.0.1:{free_port()}", "no-such-token", tmp_path / "hooks",
            RUNSTEAD_HOOK_UNREACHABLE_S="1.5")
    start = time.monotonic()
    status, out, err = finish_hook(r.ask())
    elapsed = time.monotonic() - start
    assert (status, out) == (0, b""), err
    assert 1.5 <= elapsed < 15, elapsed
    assert "the terminal decides" in (tmp_path / "hooks" / store.HOOK_LOG).read_text()
    assert "rm -rf" not in (tmp_path / "hooks" / store.HOOK_LOG).read_text()  # Q7: input never logged


def test_q3_a_refused_token_prints_nothing(rig):
    store.write_config(rig.state_dir, server=rig.url, token="not-a-token")
    status, out, _ = finish_hook(rig.ask())
    assert (status, out) == (0, b"")
    assert "HTTP 401" in (rig.state_dir / store.HOOK_LOG).read_text()


# --- Q4: answered in the terminal --------------------------------------------------------


@pytest.mark.parametrize("next_hook", ["post_tool_use", "stop", "session_end"])
def test_q4_the_sessions_next_hook_answers_it_in_the_terminal_and_the_hook_exits_within_2s(rig, next_hook):
    rig.hook("user_prompt_submit")  # a turn is open and the sender runs, as in a real session
    rig.hook("pre_tool_use")
    proc = rig.ask()
    [approval] = rig.pending()
    wait_for(lambda: rig.local_state().get("approvals") == [str(approval.pk)], timeout_s=20)
    # I1: the other hooks still return at once while this one waits
    assert rig.hook("notification_permission") < 5
    assert proc.poll() is None
    rig.hook(next_hook)  # the person answered the dialog; the tool ran (or the turn ended)
    answered = time.monotonic()
    status, out, _ = finish_hook(proc)
    took = time.monotonic() - answered
    assert (status, out) == (0, b"")
    assert took < 2.0, f"the waiting hook exited {took:.2f} s after the terminal answer"
    approval.refresh_from_db()
    assert (approval.state, approval.decided_by) == ("answered_in_terminal", "terminal")
    assert Session.objects.get(pk=rig.rs).attention == ""
    assert "approvals" not in rig.local_state()


def test_q4_the_next_permission_request_answers_the_earlier_one_in_the_terminal(rig):
    first = rig.ask()
    [one] = rig.pending()
    second = rig.ask(tool_input={"command": "make test", "description": "Run the tests"})
    wait_for(lambda: Approval.objects.filter(session=rig.rs, state="pending").exclude(pk=one.pk).exists(), timeout_s=20)
    assert finish_hook(first)[:2] == (0, b"")
    one.refresh_from_db()
    assert one.state == "answered_in_terminal"
    two = Approval.objects.get(session=rig.rs, state="pending")
    rig.decide(two.pk)
    assert output(finish_hook(second)[1]) == ALLOW


def test_q4_a_tool_hook_with_nothing_pending_stays_local(rig):
    """I7 unchanged: a tool hook with no approval to resolve and no turn to continue
    queues nothing."""
    rig.hook("pre_tool_use")
    with store.Outbox(rig.state_dir) as outbox:
        assert outbox.pending() == 0


# --- Q3: faults of the service -----------------------------------------------------------


def test_q3_service_restarted_while_the_hook_waits_then_the_answer_reaches_it(make_owner, tmp_path, transactional_db):
    owner = make_owner()
    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0"}, log_dir=tmp_path)
    try:
        r = Rig(server.url, owner.auth_token.key, tmp_path / "hooks", RUNSTEAD_HOOK_UNREACHABLE_S="60")
        proc = r.ask()
        [approval] = r.pending()
        server.stop()  # killed: its waits end with the connection
        server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0"}, port=server.port, log_dir=tmp_path)
        assert proc.poll() is None
        r.decide(approval.pk, behavior="allow")
        status, out, err = finish_hook(proc, timeout=60)
        assert status == 0 and output(out) == ALLOW, err
        r.close()
    finally:
        server.stop()


def test_q3_daphne_sigterm_while_50_hooks_wait_ends_their_polls_at_once_and_they_exit_silently(make_owner, tmp_path,
                                                                                               transactional_db):
    """daphne closes its open connections as it stops (test_server_hooks: a waiting
    long-poll never holds it), so each waiting hook learns at once that the service is
    gone, keeps trying for its unreachable window (3 s here, 10 s by default: a restart
    within it resumes the wait), then exits 0 printing nothing: the terminal decides."""
    owner = make_owner()
    token = owner.auth_token.key
    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0", "RUNSTEAD_LOG_LEVEL": "DEBUG"}, log_dir=tmp_path)
    procs = []
    try:
        for n in range(50):
            state_dir = tmp_path / f"hooks-{n}"
            store.write_config(state_dir, server=server.url, token=token)
            payload = fixture("claude", "permission_request", session_id=f"agent-{uuid.uuid4()}")
            procs.append(start_hook("claude", payload, state_dir,
                                    env=hook_env(state_dir, **FAST, RUNSTEAD_HOOK_UNREACHABLE_S="3")))
            if n % 10 == 9:  # in tens: 50 creates at once on 2 shared cores outlast the hooks' window
                server.wait_waiting(n + 1, timeout=60)
        stopped = time.monotonic()
        server.process.send_signal(signal.SIGTERM)
        server.process.wait(15)
        assert time.monotonic() - stopped < 10  # D3: the waiting long-polls did not hold it
        for proc in procs:
            status, out, err = finish_hook(proc, timeout=60)
            assert (status, out) == (0, b""), err
        assert time.monotonic() - stopped < 30  # the window, not the 25 s poll nor the 600 s wait
        for n in range(50):
            log = (tmp_path / f"hooks-{n}" / store.HOOK_LOG).read_text()
            # the poll ended with the connection (not after its 25 s), then the window ran out
            # (IncompleteRead: the wait had begun its keep-alive body, D1)
            assert any(f": {e}" in log for e in ("RemoteDisconnected", "ConnectionResetError", "ConnectionRefusedError",
                                                 "IncompleteRead"))
            assert "the service failed for" in log and "the terminal decides" in log, log
        assert Approval.objects.filter(state="pending").count() == 50  # nobody answered them
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        server.stop()
