"""SPEC I1, W1, R3, R4: the hook command, its durable outbox and the detached sender,
without the service (a small local HTTP server stands in for it; the live service
tests are in test_hooks_live.py)."""
import json
import os
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from sessions_app.hooks import store
from sessions_app.hooks.sender import Sender
from tests.hooks_support import BASE_DIR, fixture, hook_env, run_hook, stop_sender, wait_until


@pytest.fixture
def state_dir(tmp_path):
    path = tmp_path / "hooks"
    yield path
    stop_sender(path)


class Recorder:
    """A stand-in HTTP service: records every request; answers from ``statuses`` (a list
    consumed per request, then 200)."""

    def __init__(self):
        self.requests = []
        self.statuses = []
        self.lock = threading.Lock()
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            def _any(self):
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length) if length else b""
                with recorder.lock:
                    status = recorder.statuses.pop(0) if recorder.statuses else 200
                    recorder.requests.append((self.command, self.path, json.loads(body) if body else None,
                                              self.headers.get("Authorization"), status))
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(b"{}")

            do_GET = do_POST = do_PUT = do_PATCH = _any

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def recorder():
    r = Recorder()
    yield r
    r.close()


def writes(n):
    return [{"method": "PUT", "path": f"/api/w/{i}/", "body": {"i": i}} for i in range(n)]


def test_w1_i1_outbox_runs_with_wal_full_synchronous_and_fullfsync(state_dir):
    with store.Outbox(state_dir) as outbox:
        assert outbox.pragmas() == {"journal_mode": "wal", "synchronous": 2, "fullfsync": 1,
                                    "checkpoint_fullfsync": 1}


def test_i1_state_dir_is_0700_and_config_0600(state_dir):
    store.write_config(state_dir, server="http://x", token="secret")
    store.Outbox(state_dir).close()
    assert stat.S_IMODE(state_dir.stat().st_mode) == 0o700
    assert stat.S_IMODE((state_dir / "config.json").stat().st_mode) == 0o600
    assert stat.S_IMODE((state_dir / "outbox.sqlite3").stat().st_mode) == 0o600
    assert store.read_config(state_dir) == {"server": "http://x", "token": "secret"}


def test_i1_hook_queues_writes_prints_nothing_and_exits_zero(state_dir):
    result = run_hook("claude", fixture("claude", "user_prompt_submit", session_id="s1"), state_dir)
    assert (result.returncode, result.stdout) == (0, b"")
    with store.Outbox(state_dir) as outbox:
        rows = outbox.rows()
    assert [(r.method, r.path.split("/")[-2]) for r in rows] == [("POST", "sessions"), ("PUT", "marker"),
                                                                ("PATCH", rows[2].path.split("/")[-2])]
    assert rows[1].body["state"] == "running" and rows[2].body == {"title": "Run the test suite in the background and fix whatever fails"}


def test_i1_hook_imports_no_django(state_dir):
    argv = [sys.executable, "-X", "importtime", "-m", "sessions_app.hooks", "claude"]
    result = subprocess.run(argv, input=json.dumps(fixture("claude", "stop", session_id="s2")).encode(),
                            capture_output=True, env=hook_env(state_dir), cwd="/", timeout=30)
    imported = [line.split("|")[-1].strip() for line in result.stderr.decode().splitlines() if "|" in line]
    assert "sessions_app.hooks.mapping" in imported
    assert not [name for name in imported if name.split(".")[0] in ("django", "rest_framework", "httpx")]
    assert result.stdout == b""


@pytest.mark.parametrize("case", ["empty", "invalid_json", "unknown_event", "huge", "not_an_object"])
def test_i1_bad_input_exits_zero_queues_nothing_and_logs_one_line(state_dir, case):
    stdin = {
        "empty": b"",
        "invalid_json": b'{"session_id": "s", "hook_event_name": ',
        "unknown_event": json.dumps({"session_id": "s", "hook_event_name": "Teleport"}).encode(),
        "huge": json.dumps({**fixture("claude", "stop"), "last_assistant_message": "x" * (5 * 1024 * 1024)}).encode(),
        "not_an_object": b"[1, 2]",
    }[case]
    result = run_hook("claude", None, state_dir, stdin=stdin)
    assert (result.returncode, result.stdout) == (0, b"")
    with store.Outbox(state_dir) as outbox:
        assert outbox.pending() == 0
    lines = (state_dir / "hook.log").read_text().splitlines()
    assert len(lines) == 1 and "ignored" in lines[0]


def test_i1_unknown_agent_and_codex_bad_argument_exit_zero(state_dir):
    assert run_hook("aider", {}, state_dir).returncode == 0
    result = subprocess.run([sys.executable, "-m", "sessions_app.hooks", "codex", "not json"], capture_output=True,
                            env=hook_env(state_dir), cwd="/", timeout=30)
    assert (result.returncode, result.stdout) == (0, b"")
    assert len((state_dir / "hook.log").read_text().splitlines()) == 2


def test_r4_sender_retries_the_same_write_then_delivers_all_in_order(state_dir, recorder):
    store.write_config(state_dir, server=recorder.url, token="tok")
    with store.Outbox(state_dir) as outbox:
        outbox.enqueue(writes(3))
    recorder.statuses = [503, 503, 429]
    Sender(state_dir, idle_exit_s=0.1, backoff_base_s=0.01, backoff_max_s=0.05).run()
    assert [(r[1], r[4]) for r in recorder.requests] == [
        ("/api/w/0/", 503), ("/api/w/0/", 503), ("/api/w/0/", 429), ("/api/w/0/", 200), ("/api/w/1/", 200),
        ("/api/w/2/", 200),
    ]
    assert {r[3] for r in recorder.requests} == {"Token tok"}
    with store.Outbox(state_dir) as outbox:
        assert outbox.pending() == 0


def test_r3_sender_drops_a_final_refusal_and_goes_on(state_dir, recorder):
    store.write_config(state_dir, server=recorder.url, token="tok")
    with store.Outbox(state_dir) as outbox:
        outbox.enqueue(writes(2))
    recorder.statuses = [400]
    Sender(state_dir, idle_exit_s=0.1, backoff_base_s=0.01).run()
    assert [(r[1], r[4]) for r in recorder.requests] == [("/api/w/0/", 400), ("/api/w/1/", 200)]
    assert "dropped PUT /api/w/0/: HTTP 400" in (state_dir / "sender.log").read_text()


def test_r4_backoff_doubles_with_jitter_and_is_capped():
    sleeps = []
    state = {"n": 0}

    def transport(method, url, headers, body):
        state["n"] += 1
        if state["n"] > 8:
            return 200
        raise ConnectionError("down")

    import tempfile
    from unittest import mock
    from pathlib import Path

    with tempfile.TemporaryDirectory() as tmp:
        store.write_config(Path(tmp), server="http://x", token="t")
        with store.Outbox(Path(tmp)) as outbox:
            outbox.enqueue(writes(1))
        with mock.patch("sessions_app.hooks.sender.time.sleep", side_effect=sleeps.append):
            Sender(Path(tmp), idle_exit_s=0, backoff_base_s=1, backoff_max_s=60, transport=transport).run()
    delays = sleeps[:8]
    ceilings = [1, 2, 4, 8, 16, 32, 60, 60]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings)), delays


def test_i1_two_senders_started_at_once_deliver_each_write_once(state_dir, recorder):
    store.write_config(state_dir, server=recorder.url, token="tok")
    with store.Outbox(state_dir) as outbox:
        outbox.enqueue(writes(30))
    env = hook_env(state_dir, RUNSTEAD_HOOK_SENDER_IDLE_S="0.3")
    argv = [sys.executable, "-m", "sessions_app.hooks.sender", "--state-dir", str(state_dir)]
    procs = [subprocess.Popen(argv, env=env, cwd=BASE_DIR) for _ in range(2)]
    for proc in procs:
        proc.wait(timeout=30)
    assert [r[1] for r in recorder.requests] == [f"/api/w/{i}/" for i in range(30)]


def test_i1_hook_starts_a_sender_that_delivers_and_exits_when_idle(state_dir, recorder):
    store.write_config(state_dir, server=recorder.url, token="tok")
    env = hook_env(state_dir, RUNSTEAD_HOOK_SENDER_IDLE_S="0.3")
    result = run_hook("gemini", fixture("gemini", "before_agent", session_id="g1"), state_dir, env=env)
    assert result.returncode == 0
    wait_until(lambda: len(recorder.requests) == 3)
    assert [r[0] for r in recorder.requests] == ["POST", "PUT", "PATCH"]
    from sessions_app.hooks.sender import sender_running

    wait_until(lambda: not sender_running(state_dir), timeout=10)
    assert os.listdir(state_dir)  # state kept
