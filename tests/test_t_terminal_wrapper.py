"""The terminal wrapper (SPEC T3, T5, T7) as a real process under a real terminal (tmux,
tests/tmux.py), around a stand-in raw-mode terminal UI (tests/agents/raw_agent.py) that
logs every byte it receives: keys pass through unchanged (Ctrl-C as ``\\x03``), the
window size and its changes, the exit status; a message recorded in the session's inbox
is typed once, as one bracketed paste then Enter, only when the session is idle and the
keyboard quiet, never into a half-typed line; escape sequences, ``\\x03`` and the end of
a bracketed paste in a message reach the agent only as inert text; an interrupt sends
the CLI's key once; a message a killed wrapper took is reported undelivered, never typed.
"""
import ast
import sys
import time
import uuid
from pathlib import Path

import pytest

from machine import inbox
from machine.terminal import inert, own_process, paste
from tests.tmux import Terminal
from tests.wait import wait_for

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

ROOT = Path(__file__).resolve().parent.parent
AGENT = ROOT / "tests" / "agents" / "raw_agent.py"


def received(log: Path) -> list[bytes]:
    try:
        lines = log.read_text().splitlines()
    except FileNotFoundError:
        return []
    return [ast.literal_eval(line) for line in lines if line.startswith("b")]


@pytest.fixture
def wrapped(tmp_path):
    hook_dir, log, session_id = tmp_path / "hooks", tmp_path / "agent.log", str(uuid.uuid4())
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TERM": "xterm-256color", "PYTHONPATH": str(ROOT),
           "RUNSTEAD_HOOK_DIR": str(hook_dir), "RUNSTEAD_TERMINAL_QUIET_S": "0.5", "RAW_AGENT_LOG": str(log),
           "RAW_AGENT_SESSION": session_id}
    status = tmp_path / "status"
    argv = ["sh", "-c", f'"$0" -m machine.terminal "$0" {AGENT}; echo $? > {status}', sys.executable]
    with Terminal(tmp_path / "tmux.sock", argv, env=env, cwd=tmp_path, width=120, height=40) as term:
        term.wait_for("raw agent ready")
        yield term, str(hook_dir), log, session_id, status


def message(session_id, seq, text):
    return {"session_id": session_id, "message_id": str(uuid.uuid4()), "seq": seq, "text": text, "channel": "terminal"}


def test_t3_keys_ctrl_c_window_size_and_exit_status_pass_through(wrapped):
    term, hook_dir, log, session_id, status = wrapped
    term.type("héllo")
    term.key("C-c")
    term.key("Escape")
    wait_for(lambda: b"\x03" in b"".join(received(log)) and b"\x1b" in b"".join(received(log)), what="keys")
    assert b"".join(received(log)) == "héllo".encode() + b"\x03\x1b"
    assert "size 120x40" in log.read_text()
    term._run("resize-window", "-t", "main", "-x", "100", "-y", "30")
    wait_for(lambda: "size 100x30" in log.read_text(), what="SIGWINCH with the new size")
    assert "\x1b[38;5;208m" not in term.screen()  # the colour was a colour, not text
    term.type("q")
    assert wait_for(lambda: status.exists() and status.read_text().strip(), what="exit status") == "7"


def test_t3_message_typed_once_as_a_paste_then_enter_when_idle_and_quiet(wrapped):
    term, hook_dir, log, session_id, _ = wrapped
    one = message(session_id, 1, "run the tests\nthen commit")
    assert inbox.record(hook_dir, one)
    wait_for(lambda: b"\r" in received(log), what="the Enter")
    assert received(log)[-2:] == [paste("run the tests\nthen commit"), b"\r"]
    (name,) = inbox.in_state(hook_dir, session_id, inbox.DONE)
    assert one["message_id"] in name and not inbox.waiting(hook_dir, session_id)
    assert not inbox.record(hook_dir, one)  # delivered again by the service: not typed again (W3)
    time.sleep(1.0)
    assert len([r for r in received(log) if r.startswith(b"\x1b[200~")]) == 1


def test_t3_persons_typing_wins_and_is_never_mixed_with_a_message(wrapped):
    term, hook_dir, log, session_id, _ = wrapped
    term.type("my own")
    wait_for(lambda: received(log), what="the person's keys")
    inbox.record(hook_dir, message(session_id, 1, "from the phone"))
    time.sleep(1.5)  # quiet for three times the quiet period, but the line is half typed
    assert all(not r.startswith(b"\x1b[200~") for r in received(log))
    term.type(" words")
    term.key("Enter")
    wait_for(lambda: b"".join(received(log)).endswith(b"\x1b[201~\r"), what="the message after the Enter")
    got = b"".join(received(log))
    assert got == b"my own words\r" + paste("from the phone") + b"\r"


def test_t7_escape_sequences_ctrl_c_and_paste_end_reach_the_agent_only_as_text(wrapped):
    term, hook_dir, log, session_id, _ = wrapped
    hostile = "a\x1b[201~\x03rm -rf ~\x1b[2J\x7fb\x9b" + "\n" * 10000
    inbox.record(hook_dir, message(session_id, 1, hostile))
    wait_for(lambda: b"\r" in received(log), timeout_s=20, what="the Enter")
    got = b"".join(received(log))
    assert got == b"\x1b[200~a[201~rm -rf ~[2Jb" + b"\r" * 10000 + b"\x1b[201~\r"
    assert got.count(b"\x1b") == 2 and b"\x03" not in got  # only the paste's own start and end
    assert inert(hostile) == "a[201~rm -rf ~[2Jb" + "\n" * 10000


def test_t5_interrupt_sends_the_key_once(wrapped):
    term, hook_dir, log, session_id, _ = wrapped
    assert inbox.record_interrupt(hook_dir, session_id, "i1")
    wait_for(lambda: received(log), what="the interrupt key")
    time.sleep(0.5)
    assert received(log) == [b"\x03"]  # a CLI without its own key gets Ctrl-C; Claude Code and Codex get Esc
    assert not inbox.record_interrupt(hook_dir, session_id, "i1")


def test_t2_a_message_a_killed_wrapper_took_is_reported_undelivered_never_typed(tmp_path):
    from machine.hooks import store

    hook_dir, session_id = str(tmp_path / "hooks"), str(uuid.uuid4())
    inbox.record(hook_dir, message(session_id, 3, "maybe typed"))
    name, _ = inbox.take(hook_dir, session_id)  # then kill -9: nobody knows whether it was typed
    log = tmp_path / "agent.log"
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path), "TERM": "xterm-256color", "PYTHONPATH": str(ROOT),
           "RUNSTEAD_HOOK_DIR": hook_dir, "RUNSTEAD_TERMINAL_QUIET_S": "0.2", "RAW_AGENT_LOG": str(log),
           "RAW_AGENT_SESSION": session_id}
    with Terminal(tmp_path / "tmux.sock", [sys.executable, "-m", "machine.terminal", sys.executable, str(AGENT)],
                  env=env, cwd=tmp_path) as term:
        term.wait_for("raw agent ready")
        wait_for(lambda: inbox.in_state(hook_dir, session_id, inbox.LOST), what="the message marked lost")
        time.sleep(0.5)
        assert all(not r.startswith(b"\x1b[200~") for r in received(log))
    with store.Outbox(hook_dir) as outbox:
        rows = outbox.rows()
    assert [(r["path"], r["body"]) for r in rows] == [(f"/api/sessions/{session_id}/messages/3/delivery/",
                                             {"state": "undelivered"})]


def test_t3_the_terminals_answers_to_the_clis_queries_are_not_the_person_typing():
    """Claude Code asks the terminal (device attributes, colours, cursor, keyboard
    protocol) at start-up and tmux answers through the wrapper's input: those answers
    neither dirty the line nor break the quiet, or no message would ever be typed."""
    from machine.terminal import typing

    for answer in (b"\x1b[?1;2c", b"\x1b[>0;10;1c", b"\x1b]11;rgb:0000/0000/0000\x1b\\", b"\x1b]10;rgb:ff/ff/ff\x07",
                   b"\x1b[12;1R", b"\x1b[?0u", b"\x1b[I", b"\x1b[O", b"\x1bP>|tmux 3.3a\x1b\\"):
        assert typing(answer) == (False, None), answer
    assert typing(b"my own") == (True, True) and typing(b"words\r") == (True, False)
    assert typing(b"\x1b[A") == (True, True)  # history up fills the line
    assert typing(b"\x1b") == (True, None) and typing(b"\x03") == (True, False)
    assert typing(b"\x1b[?1;2cab") == (True, True)


def test_t3_codex_runs_its_turns_in_the_wrappers_process_unless_the_person_chose():
    """Codex's shared background server would run the hooks outside the wrapper's
    environment: the wrapper adds ``--no-daemon``, other CLIs' arguments are unchanged."""
    assert own_process("codex", ["/bin/codex", "resume", "--last"]) == ["/bin/codex", "--no-daemon", "resume", "--last"]
    assert own_process("codex", ["codex", "--remote", "unix://"]) == ["codex", "--remote", "unix://"]
    assert own_process("codex", ["codex", "--no-daemon"]) == ["codex", "--no-daemon"]
    assert own_process("claude", ["claude", "-c"]) == ["claude", "-c"]
