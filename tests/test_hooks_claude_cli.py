"""SPEC I3, I5, S3 with the real Claude Code CLI (offline, against tests.claude_cli's
fake Messages API): ``install_hooks claude`` into a temporary HOME, then ``claude -p``;
the board socket sees the turn. CI installs the CLI (scripts/install_agent_clis.sh), and
``claude_bin()`` fails there if it is missing, so these run in CI."""
import json
import os
import subprocess
import sys

import pytest

from machine.hooks import mapping
from tests.claude_cli import claude_bin, claude_env, fake_model_api  # noqa: F401
from tests.hooks_support import BASE_DIR, Board, stop_sender
from tests.live import live_daphne  # noqa: F401

pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]


@pytest.fixture
def installed(live_daphne, make_owner, tmp_path):  # noqa: F811
    """A live daphne and a HOME where ``manage.py install_hooks claude`` ran as a person
    runs it; yields ``(url, token, home)`` and stops the sender afterwards."""
    owner = make_owner("cli")
    token = owner.auth_token.key
    url = live_daphne()
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUNSTEAD_HOOK")}
    env["HOME"] = str(home)
    result = subprocess.run(
        [sys.executable, "manage.py", "install_hooks", "claude", "--server", url, "--token", token],
        cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert f"{home / '.claude' / 'settings.json'}: created" in result.stdout
    assert token not in (home / ".claude" / "settings.json").read_text()
    yield url, token, home
    stop_sender(home / ".runstead" / "hooks")


@pytest.fixture
def board(installed):
    """The owner's board socket on the live daphne, closed after the test (skipped or not)."""
    url, token, _ = installed
    socket = Board(url, token)
    socket.start()
    assert socket.connected.wait(10)
    yield socket
    socket.stop()


def run_claude(prompt, home, api, cwd):
    env = claude_env(home=home, api=api)
    proc = subprocess.run(
        [claude_bin(), "-p", prompt, "--output-format", "stream-json", "--verbose",
         "--permission-mode", "bypassPermissions"],
        env=env, cwd=cwd, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=180,
    )
    lines = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    init = next(e for e in lines if e.get("type") == "system" and e.get("subtype") == "init")
    return proc, init["session_id"], lines


def test_i3_i5_real_claude_turn_is_busy_then_idle_on_the_board(installed, board, fake_model_api, tmp_path):  # noqa: F811
    home = installed[2]
    work = tmp_path / "shop"
    work.mkdir()
    proc, agent_session, _ = run_claude("say hi", home, fake_model_api, work)
    assert proc.returncode == 0, proc.stderr
    rs = mapping.session_uuid("claude", agent_session)
    events = board.wait_for(rs, ("status", "idle"), timeout=30)
    assert [e[:2] for e in events] == [("marker", "running"), ("status", "busy"), ("marker", "ended"),
                                       ("status", "idle")]
    assert events[0][2] == events[2][2]  # one turn (its prompt_id)
    from sessions_app.models import Session

    session = Session.objects.get(pk=rs)
    assert session.title == "say hi"


def test_s3_real_claude_background_task_keeps_busy_through_the_wake_turn(installed, board, fake_model_api, tmp_path):  # noqa: F811
    home = installed[2]
    work = tmp_path / "api"
    work.mkdir()
    proc, agent_session, lines = run_claude("[[bash_bg:sleep 2; echo x]]", home, fake_model_api, work)
    assert proc.returncode == 0, proc.stderr
    rs = mapping.session_uuid("claude", agent_session)
    events = board.wait_for(rs, ("status", "idle"), timeout=30)
    # turn 1 ends while the background task runs (still busy); the wake turn's end is idle.
    assert [e[:2] for e in events] == [
        ("marker", "running"), ("status", "busy"), ("marker", "ended"), ("marker", "running"), ("marker", "ended"),
        ("status", "idle"),
    ], events
    assert events[0][2] == events[2][2] != events[3][2] == events[4][2]
