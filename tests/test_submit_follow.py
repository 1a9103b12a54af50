"""``manage.py submit_task --follow`` (SPEC B2, B4, G4, O4): a terminal follows its task
against a real daphne and a real worker running the fake Claude: state changes and
transcript lines as they arrive, plain when piped and with a spinner line on a terminal,
one JSON object a line with ``--json``; exit 0 on ``succeeded``, 1 on another final
state, 2 on ``unknown``."""
import json
import os
import pty
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tasks_app.follow import Follower, printable
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import BASE_DIR, SHORT_TIMINGS, LiveSetup, manage_env

pytestmark = [pytest.mark.machine_side, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAKE_CLAUDE = Path(__file__).resolve().parent.parent / "scripts" / "fake_claude.py"
PROFILES = {"claude": {"FAKE_CLAUDE_PAUSE_S": "0.3", "FAKE_CLAUDE_TURNS": "3", "FAKE_CLAUDE_COMMIT": "0"},
            "broken": {"FAKE_CLAUDE_PAUSE_S": "0.2", "FAKE_CLAUDE_RESULT": "api_error"},
            "stuck": {"FAKE_CLAUDE_PAUSE_S": "30", "FAKE_CLAUDE_TURNS": "2"}}


@pytest.fixture
def setup(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
    lines = [f'allowed_roots = ["{setup.root}"]']
    for name, env in PROFILES.items():
        env_toml = ", ".join(f'{k} = "{v}"' for k, v in env.items())
        lines += [f"[profiles.{name}]", 'preset = "claude"', f'binary = "{FAKE_CLAUDE}"', f"env = {{ {env_toml} }}"]
    setup.config.write_text("\n".join(lines) + "\n")
    setup.start_worker()
    yield setup
    setup.close()


def command(setup, agent, *extra, prompt="tidy the readme"):
    return [sys.executable, "manage.py", "submit_task", "--server", setup.url, "--token", setup.owner.auth_token.key,
            "--machine", setup.machine_id, "--folder", str(setup.repo), "--agent", agent, "--follow", *extra, prompt]


def follow(setup, agent, *extra, timeout=60):
    done = subprocess.run(command(setup, agent, *extra), cwd=BASE_DIR, env=manage_env(), capture_output=True,
                          text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr


def test_o4_follow_prints_states_and_the_transcript_and_exits_0_on_succeeded(setup):
    code, out, err = follow(setup, "claude")
    assert code == 0, (out, err)
    assert "\r" not in out and "\x1b" not in out  # piped: plain lines only
    first, *rest = out.splitlines()
    # One line for the submission (not the task's JSON), then the state lines.
    assert first.startswith("task ") and " accepted: " in first and f"{setup.url}/tasks/" in first, first
    assert rest[0] == "[accepted]", rest[:3]
    lines = out[out.index("[accepted]"):].splitlines()
    states = [line.split("]")[0] + "]" for line in lines if line.startswith("[")]
    assert states[0] == "[accepted]" and states[-1] == "[succeeded]" and "[running]" in states
    assert "> tidy the readme" in lines
    assert "Turn 1: looking at the repository for 'tidy the readme'." in lines
    assert lines.count("$ Bash: git status --short") == 2 and lines.count("  ↳ ok") == 2
    assert "Done: 'tidy the readme' is handled; I committed my notes." in lines  # the last entry, from the final
    result = "result: exit code 0 · 3 turns · 2 tool calls · 9600 in / 240 out · $0.0324"
    assert lines.index("> tidy the readme") < lines.index("$ Bash: git status --short") < lines.index(result)
    assert lines[-1] == "agent: Done: 'tidy the readme' is handled; I committed my notes."


HOSTILE = "red \x1b[31mALERT\x1b[0m, title \x1b]0;TITLE\x07, bell \x07, cr \r, del \x7f, c1 \x9b, " \
          "reversed \u202etxet\u202c, isolate \u2066x\u2069, rlm \u200f, tab\tkept"


def offline_follower(**options):
    """A Follower fed by hand (no service is asked anything): what it writes."""
    out = []
    task = {"id": "t1", "state": "running", "version": 1, "state_reason": "reason \x1b[2J" + HOSTILE}
    follower = Follower(server="http://127.0.0.1:9", token="x", task=task, write=out.append, **options)
    follower.on_entries([{"n": 1, "kind": "prompt", "text": HOSTILE + "\nsecond line"},
                         {"n": 2, "kind": "message", "text": HOSTILE},
                         {"n": 3, "kind": "tool_call", "tool": "Bash\x1b[1m", "text": HOSTILE},
                         {"n": 4, "kind": "tool_result", "status": "error", "text": HOSTILE},
                         {"n": 5, "kind": "error", "text": HOSTILE}])
    follower.http.close()
    return "".join(out)


@pytest.mark.django_db(transaction=False)
def test_o4_follow_strips_control_characters_from_what_it_prints():
    """Piped or on a terminal, nothing the agent or the owner wrote reaches it as control
    characters: no escape sequence (colour, window title, clear screen), no C0 but newline
    and tab, no DEL, no C1, no bidi control."""
    for tty in (False, True):
        text = offline_follower(tty=tty)
        assert re.search("[\x00-\x08\x0b-\x1f\x7f-\x9f\u061c\u200e\u200f\u202a-\u202e\u2066-\u2069]",
                         text) is None, repr(text)
        assert "> red ALERT, title , bell , cr , del , c1 , reversed txet, isolate x, rlm , tab\tkept" in text
        assert "> second line" in text and "$ Bash: red ALERT" in text and "! error: red ALERT" in text
        assert "[running] reason red ALERT" in text
    assert printable("a\r\nb") == "a\nb"


@pytest.mark.django_db(transaction=False)
def test_o4_follow_json_keeps_the_text_with_control_characters_escaped():
    lines = offline_follower(json_mode=True).splitlines()
    assert all(re.search("[\x00-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069\u200e\u200f]", line) is None
               for line in lines), lines
    entries = [json.loads(line) for line in lines if json.loads(line)["type"] == "entry"]
    assert entries[1]["text"] == HOSTILE  # the data itself, whole


def test_o4_follow_exits_1_on_another_final_state_with_json_lines(setup):
    code, out, err = follow(setup, "broken", "--json")
    assert code == 1, (out, err)
    objects = [json.loads(line) for line in out.splitlines()]
    accepted, *events = objects
    assert accepted["state"] == "accepted"  # the POST answer
    assert events[-1]["type"] == "final" and events[-1]["task"]["state"] == "failed"
    states = [e["state"] for e in events if e["type"] == "state"]
    assert states[0] == "accepted" and states[-1] == "failed"
    kinds = [e["kind"] for e in events if e["type"] == "entry"]
    assert kinds == ["prompt", "message", "error"]
    numbers = [e["n"] for e in events if e["type"] == "entry"]
    assert numbers == [1, 2, 3]


def test_o4_follow_exits_2_on_unknown_with_a_spinner_on_a_terminal(setup):
    """A worker killed with SIGKILL mid-run: the lease lapses and the task is unknown."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(command(setup, "stuck"), cwd=BASE_DIR, env=manage_env(), stdin=slave, stdout=slave,
                            stderr=slave, close_fds=True)
    os.close(slave)
    output = bytearray()

    def read_some() -> bytes:
        try:
            return os.read(master, 65536)
        except OSError:
            return b""

    try:
        wait_for(lambda: output.extend(read_some()) or b"[running]" in output, timeout_s=30, what="running")
        for worker in setup.workers:
            worker.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == 2
        output.extend(read_some())
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)
    text = output.decode(errors="replace")
    assert "\x1b[2K" in text and any(frame in text for frame in "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏")  # the spinner line
    assert "[unknown]" in text and "outcome unknown" in text


def test_k1_submit_task_with_a_rotated_token_says_not_signed_in_not_task_refused(live_daphne, owner):  # noqa: F811
    """A token rotated since it was saved (``var/demo.json`` keeps the old one) is a login
    failure, not a refusal of the task: the command says so and what to do."""
    import httpx

    url = live_daphne()
    old = owner.auth_token.key
    assert httpx.post(f"{url}/api/token/rotate/", headers={"Authorization": f"Token {old}"}, timeout=10).status_code == 201
    done = subprocess.run([sys.executable, "manage.py", "submit_task", "--server", url, "--token", old, "--machine",
                           "00000000-0000-4000-8000-000000000000", "--folder", "/tmp/repo", "--agent", "demo", "p"],
                          cwd=BASE_DIR, env=manage_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert "not signed in (authentication_failed)" in done.stderr and "task refused" not in done.stderr, done.stderr
    assert "--token" in done.stderr
