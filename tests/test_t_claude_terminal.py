"""SPEC T2, T3, T4 with the real interactive Claude Code, offline against the fake
Messages API (tests/claude_cli.py), under tmux (tests/tmux.py), its hooks installed by
``install_hooks claude --machine`` into a temporary HOME and reporting to a live service.

Inside the wrapper (``scripts/runstead-term claude``, channel ``terminal``):

- a message sent while the session is idle starts a turn and is answered; the model API
  sees its text once, the message ends ``delivered`` then ``answered``;
- a message sent mid-turn stays in the inbox until the turn ends, then goes in at the
  prompt and is answered;
- the person types in the terminal while a message waits: a half-typed line holds the
  message back however quiet the keyboard; the person's prompt and the message reach the
  model as two prompts, each once, the person's first;
- interrupted (``POST .../interrupt/``, Esc) during a long tool call: the tool stops and
  the next message is answered by the same process in the same conversation;
- the wrapper killed (kill -9) after it took a message and before it typed it: the next
  wrapper of that session (``claude --resume``) reports it ``undelivered``; the model
  never sees it.

Without the wrapper (channel ``hook``): a message sent by two racing phones (one
Idempotency-Key) is one message, handed to the agent once by the Stop hook at the end
of the person's turn; the service silent: the turn ends as it would within 3 s.

The worker's part (pull, record in the inbox before the ack) is what
``tests/test_t_worker_sessions.py`` proves; here the test records each pulled message in
the inbox itself, as the worker does.
"""
import json
import os
import signal
import socket
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import pytest

from machine import inbox
from machine.hooks import store
from machine.hooks.install import install
from machine.hooks.mapping import session_uuid
from machine.worker import sessions
from sessions_app.models import Session, SessionMessage
from tests.claude_cli import claude_bin, claude_env, fake_model_api  # noqa: F401  (fixture)
from tests.conftest import machine_api
from tests.hooks_support import stop_sender
from tests.model_apis import AnthropicAPI
from tests.tmux import Terminal
from tests.wait import wait_for

pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]
ROOT = Path(__file__).resolve().parent.parent
READY = "manual mode on"
FEEDBACK = "Stop hook feedback:\nMessage from your phone (RunStead): "


class Desk:
    """One owner's machine with Claude Code's hooks installed (``--machine``), a live
    service, and the terminals the test opens."""

    def __init__(self, url, owner, machine, tmp_path, api):
        self.url, self.owner, self.machine, self.tmp, self.api = url, owner, machine, tmp_path, api
        self.home, self.work = tmp_path / "home", tmp_path / "work"
        self.state_dir = self.home / ".runstead" / "hooks"
        self.work.mkdir(parents=True)
        (self.home / ".claude").mkdir(parents=True)
        (self.home / ".claude.json").write_text(json.dumps({
            "hasCompletedOnboarding": True, "customApiKeyResponses": {"approved": ["sk-test-offline"], "rejected": []},
            "projects": {str(self.work): {"hasTrustDialogAccepted": True}}}))
        install("claude", server=url, token=owner.auth_token.key, config_dir=self.home / ".claude",
                state_dir=self.state_dir, machine=str(machine.id))
        env = claude_env(home=self.home, api=api, extra={
            "RUNSTEAD_HOOK_SENDER_IDLE_S": "10", "TERM": "xterm-256color", "RUNSTEAD_TERMINAL_QUIET_S": "0.5",
            "RUNSTEAD_PYTHON": sys.executable, "RUNSTEAD_HOOK_DIR": str(self.state_dir)})
        self.env = {k: v for k, v in env.items() if k in ("PATH", "LANG", "LC_ALL") or k.startswith(
            ("HOME", "ANTHROPIC_", "CLAUDE_", "DISABLE_", "IS_SANDBOX", "RUNSTEAD_", "TERM"))}
        self.terms: list[Terminal] = []
        self.headers = {"Authorization": f"Token {owner.auth_token.key}"}

    def open(self, *args: str, wrapped: bool = True) -> Terminal:
        argv = [claude_bin(), "--permission-mode", "manual", *args]
        if wrapped:
            argv = [str(ROOT / "scripts" / "runstead-term"), *argv]
        term = Terminal(self.tmp / f"tmux{len(self.terms)}.sock", argv, env=self.env, cwd=self.work)
        self.terms.append(term)
        term.wait_for(READY, timeout=90)
        return term

    def session(self, agent_session: str | None = None, channel: str = "terminal") -> Session:
        """The service's session of the terminal, once the hooks reported it (T1)."""
        def found():
            rows = Session.objects.filter(owner=self.owner, agent="claude", channel=channel, machine=self.machine)
            if agent_session:
                rows = rows.filter(pk=session_uuid("claude", agent_session))
            return rows.first()
        return wait_for(found, timeout_s=30, what=f"a {channel} session on the service")

    def send(self, session_id, text: str, key: str | None = None) -> dict:
        answer = httpx.post(f"{self.url}/api/sessions/{session_id}/messages/", json={"text": text}, timeout=20,
                            headers={**self.headers, "Idempotency-Key": key or str(uuid.uuid4())})
        assert answer.status_code in (200, 201), answer.text
        return answer.json()

    def pull_and_record(self) -> int:
        """What the machine's worker does: pull, record each session message or
        interrupt in the inbox (W2)."""
        messages = machine_api(self.machine).get("/api/worker/messages/?wait=0").json()["messages"]
        for message in messages:
            if message["kind"] in sessions.KINDS:
                sessions.record(message["kind"], message["payload"], state_dir=str(self.state_dir))
        return len(messages)

    def prompts(self) -> list[str]:
        """Each prompt the model was asked to answer (its request's last user text), in
        the order of the requests, a prompt asked again in a row (after a tool's result)
        counted once."""
        asked = [AnthropicAPI.conversation(body)[0] for path, body in self.api.requests
                 if path.startswith("/v1/messages") and not path.startswith("/v1/messages/count_tokens")]
        return [prompt for n, prompt in enumerate(asked) if n == 0 or asked[n - 1] != prompt]

    def seen(self, text: str) -> int:
        """The most times ``text`` occurs in one request to the model (its whole
        conversation so far): 1 once it reached the agent once, 2 if it was typed twice."""
        needle = json.dumps(text)[1:-1]
        return max((json.dumps(body).count(needle) for path, body in self.api.requests
                    if path.startswith("/v1/messages")), default=0)

    def state(self, message: dict) -> str:
        return SessionMessage.objects.get(pk=message["id"]).state

    def close(self):
        for term in self.terms:
            term.close()
        stop_sender(self.state_dir)


@pytest.fixture
def desk(live_server, owner, machine, tmp_path, fake_model_api):  # noqa: F811
    made = Desk(live_server.url, owner, machine, tmp_path, fake_model_api)
    yield made
    made.close()


def test_t3_real_claude_in_the_wrapper_idle_message_starts_a_turn_and_is_answered_once(desk):
    term = desk.open()
    session = desk.session()
    sent = desk.send(session.pk, "hello from the phone")
    assert desk.pull_and_record() == 1
    term.wait_for("ok: hello from the phone")
    wait_for(lambda: desk.state(sent) == "answered", timeout_s=30, what="the message answered")
    assert desk.seen("hello from the phone") == 1
    assert inbox.in_state(str(desk.state_dir), str(session.pk), inbox.DONE)
    assert not inbox.waiting(str(desk.state_dir), str(session.pk))
    delivered = SessionMessage.objects.get(pk=sent["id"])
    assert delivered.delivered_at is not None and delivered.answered_at >= delivered.delivered_at


def test_t3_real_claude_in_the_wrapper_message_sent_mid_turn_waits_for_the_prompt(desk):
    term = desk.open()
    session = desk.session()
    term.submit("[[slow:6]] a long one", accepted=lambda: any("a long one" in json.dumps(b) for _, b in desk.api.requests))
    wait_for(lambda: Session.objects.get(pk=session.pk).status == "busy", timeout_s=20, what="the turn open")
    sent = desk.send(session.pk, "then this from the phone")
    desk.pull_and_record()
    samples = []  # (the message still waits, the long answer is complete on the screen)

    def answered() -> bool:
        screen = term.screen()
        samples.append((bool(inbox.waiting(str(desk.state_dir), str(session.pk))), "ok: a long one" in screen))
        return "ok: then this from the phone" in screen

    wait_for(answered, timeout_s=60, interval_s=0.05, what="the phone's message answered")
    assert samples[0] == (True, False), samples[:3]  # recorded while the turn was open
    assert all(waits or done for waits, done in samples), "taken before the turn ended"
    assert desk.seen("then this from the phone") == 1 and desk.seen("[[slow:6]] a long one") == 1
    wait_for(lambda: desk.state(sent) == "answered", timeout_s=30, what="the message answered")


def holds(check, for_s: float) -> None:
    """``check()`` stays true for ``for_s`` seconds (read every 50 ms): a thing that must
    not happen during a window (here, a message typed while the person's line is dirty)."""
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        assert check(), "it happened"
        time.sleep(0.05)


def test_t3_real_claude_in_the_wrapper_the_persons_typing_and_a_waiting_message_never_mix(desk):
    term = desk.open()
    session = desk.session()
    folder = str(desk.state_dir), str(session.pk)
    term.type("desk half")
    term.wait_for("desk half")
    sent = desk.send(session.pk, "the phone words")
    desk.pull_and_record()
    # a half-typed line: the keyboard quiet for 4 x RUNSTEAD_TERMINAL_QUIET_S, the message still waits
    holds(lambda: inbox.waiting(*folder), for_s=4 * 0.5)
    term.submit(" done", accepted=lambda: "ok: desk half done" in term.screen())
    term.wait_for("ok: the phone words")  # then, at the prompt, the message as its own turn
    wait_for(lambda: desk.state(sent) == "answered", timeout_s=30, what="the message answered")
    prompts = desk.prompts()
    assert [p for p in prompts if "desk" in p or "phone" in p] == ["desk half done", "the phone words"], prompts


def wrapper_pid(term: Terminal) -> int:
    """The wrapper's process: the python running ``machine.terminal`` in the window."""
    shell = int(term._run("display-message", "-p", "-t", "main", "#{pane_pid}").strip())
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"machine.terminal" in argv and int(entry.name) in (shell, *_children(shell)):
                return int(entry.name)
    raise AssertionError("no wrapper process")


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def test_t2_real_claude_wrapper_killed_between_taking_and_typing_reports_undelivered(desk):
    agent_session = str(uuid.uuid4())
    term = desk.open("--session-id", agent_session)
    session = desk.session(agent_session)
    term.submit("a first turn", accepted=lambda: "ok: a first turn" in term.screen())  # a session to resume
    # The wrapper dies between its take and its typing. tmux continues a stopped pane (seen:
    # a SIGSTOPped wrapper was sleeping, not stopped, seconds later), so the wrapper
    # cannot be held still by SIGSTOP: it is killed first and the take is made as it would
    # have made it (the inbox's rename), leaving a taken message and no live wrapper.
    pid = wrapper_pid(term)
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
             what="the wrapper gone")
    sent = desk.send(session.pk, "maybe typed")
    assert desk.pull_and_record() == 1
    assert inbox.take(str(desk.state_dir), str(session.pk)) is not None
    term.close()
    again = desk.open("--resume", agent_session)
    wait_for(lambda: inbox.in_state(str(desk.state_dir), str(session.pk), inbox.LOST), timeout_s=30,
             what="the taken message marked lost by the next wrapper")
    wait_for(lambda: desk.state(sent) == "undelivered", timeout_s=30, what="the message reported undelivered")
    again.submit("are you there", accepted=lambda: "ok: are you there" in again.screen())
    assert desk.seen("maybe typed") == 0


def test_t4_real_claude_without_the_wrapper_two_racing_phones_one_message_once_by_the_stop_hook(desk):
    term = desk.open(wrapped=False)
    session = desk.session(channel="hook")
    key, answers = str(uuid.uuid4()), []
    phones = [threading.Thread(target=lambda: answers.append(desk.send(session.pk, "also say banana", key)))
              for _ in range(2)]
    for phone in phones:
        phone.start()
    for phone in phones:
        phone.join()
    assert len(answers) == 2 and answers[0]["id"] == answers[1]["id"] and answers[0]["seq"] == 1
    assert desk.pull_and_record() == 1
    term.submit("first the desk", accepted=lambda: "ok: first the desk" in term.screen())
    term.wait_for("Message from your phone (RunStead): also say banana")
    wait_for(lambda: desk.state(answers[0]) in ("delivered", "answered"), timeout_s=30, what="claimed")
    # one hand-over: the CLI sends it as the Stop hook's feedback (and a system block naming the hook)
    wait_for(lambda: desk.seen(FEEDBACK + "also say banana") == 1, timeout_s=30, what="the model asked with it")
    term.submit("and again", accepted=lambda: "ok: and again" in term.screen())
    assert desk.seen(FEEDBACK + "also say banana") == 1
    assert SessionMessage.objects.filter(session=session).count() == 1


def test_t4_real_claude_without_the_wrapper_service_silent_the_turn_ends_within_3_s(desk):
    term = desk.open(wrapped=False)
    session = desk.session(channel="hook")
    desk.send(session.pk, "send-later-7f3")
    desk.pull_and_record()
    silent = socket.socket()  # accepts connections (the backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    try:
        store.write_config(desk.state_dir, server=f"http://127.0.0.1:{silent.getsockname()[1]}",
                           token=desk.owner.auth_token.key, extra={"machine": str(desk.machine.id)})
        folder = str(desk.state_dir), str(session.pk)
        term.type("a desk turn")
        term.wait_for("a desk turn")
        term.key("Enter")
        # the Stop hook takes the message, finds the service silent, puts it back
        wait_for(lambda: inbox.in_state(*folder, inbox.TAKE), timeout_s=30, interval_s=0.02, what="the hook's take")
        taken = time.monotonic()
        wait_for(lambda: inbox.waiting(*folder), timeout_s=10, interval_s=0.02, what="the message back to wait")
        took_s = time.monotonic() - taken
        assert took_s < 3.0, took_s
        assert "ok: a desk turn" in term.screen()
        # the turn ended as it would: the next prompt is a new turn, answered
        term.submit("next one", accepted=lambda: "ok: next one" in term.screen())
    finally:
        silent.close()
    assert desk.seen("send-later-7f3") == 0
    # back to wait for a Stop that can claim it (the second turn's Stop tried again, as silent)
    wait_for(lambda: inbox.waiting(str(desk.state_dir), str(session.pk)), timeout_s=10, what="still waiting")
    assert SessionMessage.objects.get(session=session).state == "sent"


def running(marker: str) -> bool:
    """A process whose command line holds ``marker`` runs (the agent's tool call)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    return True
            except OSError:
                continue
    return False


LONG = "time.sleep(47.5)"


def test_t5_real_claude_in_the_wrapper_interrupted_in_a_long_tool_call_answers_the_next_message(desk):
    """Claude Code fires no hook when a turn is interrupted (no Stop): the wrapper counts
    the turn over once it sent Esc and the screen went still, and ends it on the service
    through the hook (machine.terminal)."""
    term = desk.open("--allowedTools", "Bash(python3:*)")  # Claude Code refuses a bare `sleep`
    session = desk.session()
    (agent,) = _children(wrapper_pid(term))
    term.submit(f"[[bash:python3 -c 'import time; {LONG}']] a long tool call", accepted=lambda: running(LONG),
                settle_s=15)
    wait_for(lambda: Session.objects.get(pk=session.pk).status == "busy", timeout_s=20, what="the turn open")
    answer = httpx.post(f"{desk.url}/api/sessions/{session.pk}/interrupt/", headers=desk.headers, timeout=20)
    assert answer.status_code == 202, answer.text
    assert desk.pull_and_record() == 1
    wait_for(lambda: not running(LONG), timeout_s=20, what="the tool call stopped")
    term.wait_for("Interrupted")
    # no hook fires for it: the wrapper ends the turn on the service itself
    wait_for(lambda: Session.objects.get(pk=session.pk).status == "idle", timeout_s=20, what="the session idle")
    sent = desk.send(session.pk, "after the interrupt")
    desk.pull_and_record()
    term.wait_for("ok: after the interrupt")
    wait_for(lambda: desk.state(sent) == "answered", timeout_s=30, what="the message answered")
    # the same process and the same conversation: the model is asked with the interrupted turn in it
    assert _children(wrapper_pid(term)) == [agent]
    assert Session.objects.filter(owner=desk.owner, agent="claude").count() == 1
    asked = [body for _, body in desk.api.requests if AnthropicAPI.conversation(body)[0] == "after the interrupt"]
    assert asked and "a long tool call" in json.dumps(asked[-1]["messages"])
    assert desk.prompts().count("after the interrupt") == 1
