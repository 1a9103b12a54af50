"""SPEC I1, W1, R3, R4: the hook command, its durable outbox and the detached sender,
without the service (a small local HTTP server stands in for it; the live service
tests are in test_hooks_live.py)."""
import ast
import json
import os
import stat
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from machine.hooks import store
from machine.hooks.sender import Sender
from tests.hooks_support import BASE_DIR, fixture, hook_env, run_hook, stop_sender
from tests.wait import wait_for

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)


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
    argv = [sys.executable, "-X", "importtime", "-m", "machine.hooks", "claude"]
    result = subprocess.run(argv, input=json.dumps(fixture("claude", "stop", session_id="s2")).encode(),
                            capture_output=True, env=hook_env(state_dir), cwd="/", timeout=30)
    imported = [line.split("|")[-1].strip() for line in result.stderr.decode().splitlines() if "|" in line]
    assert "machine.hooks.mapping" in imported
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
    result = subprocess.run([sys.executable, "-m", "machine.hooks", "codex", "not json"], capture_output=True,
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
        with mock.patch("machine.hooks.sender.time.sleep", side_effect=sleeps.append):
            Sender(Path(tmp), idle_exit_s=0, backoff_base_s=1, backoff_max_s=60, transport=transport).run()
    delays = sleeps[:8]
    ceilings = [1, 2, 4, 8, 16, 32, 60, 60]
    assert all(c / 2 <= d <= c for d, c in zip(delays, ceilings)), delays


def test_i1_two_senders_started_at_once_deliver_each_write_once(state_dir, recorder):
    store.write_config(state_dir, server=recorder.url, token="tok")
    with store.Outbox(state_dir) as outbox:
        outbox.enqueue(writes(30))
    env = hook_env(state_dir, RUNSTEAD_HOOK_SENDER_IDLE_S="0.3")
    argv = [sys.executable, "-m", "machine.hooks.sender", "--state-dir", str(state_dir)]
    procs = [subprocess.Popen(argv, env=env, cwd=BASE_DIR) for _ in range(2)]
    for proc in procs:
        proc.wait(timeout=30)
    assert [r[1] for r in recorder.requests] == [f"/api/w/{i}/" for i in range(30)]


def test_i1_hook_starts_a_sender_that_delivers_and_exits_when_idle(state_dir, recorder):
    store.write_config(state_dir, server=recorder.url, token="tok")
    env = hook_env(state_dir, RUNSTEAD_HOOK_SENDER_IDLE_S="0.3")
    result = run_hook("gemini", fixture("gemini", "before_agent", session_id="g1"), state_dir, env=env)
    assert result.returncode == 0
    wait_for(lambda: len(recorder.requests) == 3, timeout_s=20)
    assert [r[0] for r in recorder.requests] == ["POST", "PUT", "PATCH"]
    from machine.hooks.launch import sender_running

    wait_for(lambda: not sender_running(state_dir), timeout_s=10)
    assert os.listdir(state_dir)  # state kept


# --- bounded local state (I1) -----------------------------------------------------------------


def marker(turn, state):
    return {"method": "PUT", "path": "/api/sessions/5f0c6f3e-0000-4000-8000-000000000001/marker/",
            "body": {"turn_id": turn, "device_id": "host:claude:s1", "state": state}}


def attention(i):
    return {"method": "PATCH", "path": "/api/sessions/5f0c6f3e-0000-4000-8000-000000000001/",
            "body": {"attention": "permission", "attention_message": f"may I? {i}"}}


def test_i1_outbox_full_drops_oldest_refresh_writes_before_turn_starts_and_ends(state_dir):
    with store.Outbox(state_dir, max_rows=12) as outbox:
        for i in range(10):  # 20 writes: a turn start or end between attention refreshes
            outbox.enqueue([attention(i), marker(f"t{i}", "running" if i % 2 == 0 else "ended")])
        kept = outbox.rows()
        assert len(kept) == 12
        # the 8 dropped were the 8 oldest refreshes; every turn start and end is kept, in order
        assert [r.body.get("turn_id") for r in kept if r.method == "PUT"] == [f"t{i}" for i in range(10)]
        assert [r.body["attention_message"] for r in kept if r.method == "PATCH"] == ["may I? 8", "may I? 9"]
        log = (state_dir / "hook.log").read_text()
        assert "outbox full" in log and "refresh PATCH /api/sessions/*/" in log
        assert sum(int(line.split("dropped ")[1].split()[0]) for line in log.splitlines()) == 8
        # with no refresh left to drop, the oldest of the rest go, never the newest
        outbox.enqueue([marker("t10", "running"), marker("t10", "ended")])
        outbox.enqueue([marker("t11", "running"), marker("t11", "ended")])
        turns = [r.body.get("turn_id") for r in outbox.rows() if r.method == "PUT"]
        assert len(outbox.rows()) == 12 and turns[-4:] == ["t10", "t10", "t11", "t11"]
        assert "write PUT /api/sessions/*/marker/" in (state_dir / "hook.log").read_text()


def test_i1_outbox_keeps_at_most_10000_rows(state_dir):
    assert store.MAX_ROWS == 10_000 and store.MAX_BYTES == 50 * 1024 * 1024
    with store.Outbox(state_dir) as outbox:
        outbox.enqueue([attention(i) for i in range(5_000)] + writes(5_000))
        assert outbox.size()[0] == 10_000
        outbox.enqueue([marker("last", "running")] + writes(20))
        rows, _ = outbox.size()
        assert rows == 10_000
        kept = outbox.rows()
        assert sum(r.method == "PATCH" for r in kept) == 5_000 - 21  # only refreshes went
        assert kept[-1].path == "/api/w/19/" and kept[-21].body["turn_id"] == "last"


def test_i1_outbox_keeps_at_most_its_byte_cap(state_dir):
    big = "x" * 10_000
    with store.Outbox(state_dir, max_bytes=100_000) as outbox:
        for i in range(30):
            outbox.enqueue([{"method": "PATCH", "path": f"/api/sessions/{i}/", "body": {"title": big}},
                            {"method": "POST", "path": "/api/sessions/", "body": {"id": str(i), "title": big}}])
            assert outbox.size()[1] <= 100_000
        kept = outbox.rows()
        assert all(r.method == "POST" for r in kept) and [r.body["id"] for r in kept][-1] == "29"
        assert outbox.size()[1] > 100_000 - 2 * 10_100  # full up to the cap, not emptied


def test_i1_hook_writes_are_classified_refresh_only_by_what_they_do():
    sid = "5f0c6f3e-0000-4000-8000-000000000001"
    assert store.refresh_only(attention(1))
    assert store.refresh_only({"method": "PATCH", "path": f"/api/sessions/{sid}/", "body": {"attention": ""}})
    assert store.refresh_only({"method": "PATCH", "path": f"/api/sessions/{sid}/", "body": {"title": "x"}})
    assert not store.refresh_only(marker("t", "running")) and not store.refresh_only(marker("t", "ended"))
    assert not store.refresh_only({"method": "POST", "path": "/api/sessions/", "body": {"id": sid, "title": "x"}})
    assert not store.refresh_only({"method": "POST", "path": f"/api/sessions/{sid}/jobs/", "body": {"job_id": "j"}})
    assert not store.refresh_only({"method": "POST", "path": "/api/devices/d/sweep/", "body": None})


def _age_sessions(outbox, keys, age_s):
    import time

    with outbox.transaction():
        for key in keys:
            outbox.save_session_state(key, {"created": True})
        outbox.db.executemany("UPDATE agent_sessions SET updated_at = ? WHERE key = ?",
                              [(time.time() - age_s, key) for key in keys])


def test_i1_sender_prunes_session_states_older_than_7_days_at_start_and_daily(state_dir, recorder):
    from unittest import mock

    store.write_config(state_dir, server=recorder.url, token="tok")
    week = store.SESSION_RETENTION_S
    with store.Outbox(state_dir) as outbox:
        _age_sessions(outbox, [f"claude:old{i}" for i in range(50)], week + 60)
        _age_sessions(outbox, ["claude:recent"], week - 60)
        outbox.enqueue(writes(1))
    orphan = store.snapshot_path(state_dir, "claude:crashed") + ".123.tmp"  # a publish cut short long ago
    open(orphan, "w").close()
    os.utime(orphan, (0, 0))
    Sender(state_dir, idle_exit_s=0.1).run()  # at start
    with store.Outbox(state_dir) as outbox:
        assert [k for (k,) in outbox.db.execute("SELECT key FROM agent_sessions")] == ["claude:recent"]
        assert sorted(os.listdir(state_dir / store.SNAPSHOT_DIR)) == [
            os.path.basename(store.snapshot_path(state_dir, "claude:recent"))]  # the pruned ones' went too
        assert "pruned 50 agent session state(s)" in (state_dir / "sender.log").read_text()
        sender = Sender(state_dir, prune_every_s=86400)
        sender.prune(outbox)
        _age_sessions(outbox, ["claude:later"], week + 1)
        sender.prune(outbox)  # not due again yet
        assert outbox.db.execute("SELECT count(*) FROM agent_sessions").fetchone()[0] == 2
        import time as real_time

        with mock.patch("machine.hooks.sender.time.monotonic", return_value=real_time.monotonic() + 86401):
            sender.prune(outbox)  # a day later
        assert [k for (k,) in outbox.db.execute("SELECT key FROM agent_sessions")] == ["claude:recent"]


def _snapshot(state_dir, key):
    path = store.snapshot_path(state_dir, key)
    if not os.path.exists(path):
        return None
    with open(path) as handle:
        return json.load(handle)


def _committed(state_dir, key):
    import sqlite3

    db = sqlite3.connect(f"file:{state_dir / store.DB_NAME}?mode=ro", uri=True)  # a reader: never waits
    try:
        row = db.execute("SELECT data FROM agent_sessions WHERE key = ?", (key,)).fetchone()
    finally:
        db.close()
    return json.loads(row[0]) if row else None


def test_i7_a_sessions_snapshot_is_its_committed_state_after_every_hook(state_dir):
    """I7: after each hook of a session's life (start, a prompt, a tool hook that
    continues a long turn, a permission notification, the stop), its snapshot file is
    the state the outbox committed, byte for byte; a rolled-back transaction leaves none."""
    sid = "snap-1"
    store.write_marker_class(store.ensure_state_dir(state_dir), 2.0)  # a tool hook 1 s into the turn continues it
    steps = [("session_start_startup", {}), ("user_prompt_submit", {}), ("pre_tool_use", {}),
             ("notification_permission", {}), ("stop", {})]
    turns = []
    for name, extra in steps:
        if name == "pre_tool_use":
            with store.Outbox(state_dir) as outbox, outbox.transaction():
                state = outbox.session_state(f"claude:{sid}")
                outbox.save_session_state(f"claude:{sid}", {**state, "turn_at": state["turn_at"] - 1.5})
        run_hook("claude", {**fixture("claude", name), "session_id": sid, **extra}, state_dir)
        committed = _committed(state_dir, f"claude:{sid}")
        assert committed and _snapshot(state_dir, f"claude:{sid}") == committed, name
        turns.append(committed.get("turn"))
    assert turns[2] and turns[2] != turns[1]  # the tool hook did write: it continued the turn
    with pytest.raises(RuntimeError), store.Outbox(state_dir) as outbox, outbox.transaction():
        outbox.save_session_state(f"claude:{sid}", {"lost": True})
        raise RuntimeError("a hook that fails before its commit")
    assert _snapshot(state_dir, f"claude:{sid}") is None and _committed(state_dir, f"claude:{sid}") == committed
    assert store.peek_session_state(state_dir, f"claude:{sid}") == committed  # read from the outbox


def test_i7_a_hook_killed_between_its_commit_and_its_snapshot_leaves_none(state_dir):
    """I7, crash at any line: a process killed (SIGKILL) after the commit, before the
    snapshot is written, leaves no snapshot (removed before the commit), so the next
    tool hook reads the committed state from the outbox, and the next write's snapshot
    is right again; its lock went with the process."""
    key = "claude:killed"
    with store.Outbox(state_dir) as outbox, outbox.transaction():
        outbox.save_session_state(key, {"created": True, "turn": "old", "turn_at": 1.0})
    assert _snapshot(state_dir, key) == {"created": True, "turn": "old", "turn_at": 1.0}
    script = ("import os, signal, sys\n"
              "from machine.hooks import store\n"
              "store.Outbox._end_snapshots = lambda self, committed: os.kill(os.getpid(), signal.SIGKILL)\n"
              "with store.Outbox(sys.argv[1]) as outbox, outbox.transaction():\n"
              "    outbox.save_session_state(sys.argv[2], {'created': True, 'turn': 'new', 'turn_at': 2.0})\n")
    done = subprocess.run([sys.executable, "-c", script, str(state_dir), key], env=hook_env(state_dir), timeout=30)
    assert done.returncode == -9
    assert _committed(state_dir, key)["turn"] == "new" and _snapshot(state_dir, key) is None
    assert store.peek_session_state(state_dir, key)["turn"] == "new"
    with store.Outbox(state_dir) as outbox, outbox.transaction():  # the lock is free again
        outbox.save_session_state(key, {"created": True, "turn": "next", "turn_at": 3.0})
    assert _snapshot(state_dir, key) == _committed(state_dir, key) == {"created": True, "turn": "next", "turn_at": 3.0}


def test_i7_a_later_commit_waits_for_the_earlier_ones_snapshot(state_dir):
    """I7: two writers of one session overlap (real threads, their own connections): the
    second commits only after the first has written its snapshot, so the older state
    can never be written over the newer one; the last snapshot is the last commit."""
    key = "claude:race"
    first_committed, release = threading.Event(), threading.Event()
    original = store.Outbox._end_snapshots

    def slow_end(self, committed):
        first_committed.set()
        release.wait(10)  # the first writer has committed and not yet written its snapshot
        original(self, committed)

    def first():
        with store.Outbox(state_dir) as outbox:
            outbox._end_snapshots = slow_end.__get__(outbox)
            with outbox.transaction():
                outbox.save_session_state(key, {"n": 1})

    def second():
        with store.Outbox(state_dir) as outbox, outbox.transaction():
            outbox.save_session_state(key, {"n": 2})

    one = threading.Thread(target=first)
    one.start()
    assert first_committed.wait(10)
    two = threading.Thread(target=second)
    two.start()
    two.join(0.3)
    assert two.is_alive() and _committed(state_dir, key) == {"n": 1}  # the second waits for the lock
    release.set()
    one.join(10)
    two.join(10)
    assert _committed(state_dir, key) == _snapshot(state_dir, key) == {"n": 2}


def test_i1_outbox_made_before_the_caps_is_upgraded(state_dir):
    import sqlite3

    store.ensure_state_dir(state_dir)
    db = sqlite3.connect(state_dir / store.DB_NAME)
    db.executescript(store.SCHEMA.replace(",\n    refresh INTEGER NOT NULL DEFAULT 0", ""))
    db.execute("INSERT INTO outbox (method, path, body, created_at) VALUES ('PUT', '/api/w/0/', '{}', 0)")
    db.commit()
    db.close()
    with store.Outbox(state_dir, max_rows=1) as outbox:
        outbox.enqueue([attention(1)])  # the refresh goes, the old write (not one) stays
        assert [r.path for r in outbox.rows()] == ["/api/w/0/"]
        assert outbox.db.execute("SELECT refresh FROM outbox").fetchall() == [(0,)]


# --- I7: tool hooks ------------------------------------------------------------------------------


def _files(state_dir):
    """Each file of the state directory with its size and mtime, what a hook changed;
    SQLite's side files only as "the write-ahead log holds nothing" (a reader may open
    an empty one and touch the shared-memory index)."""
    files = {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in state_dir.iterdir()
             if not p.name.startswith(store.DB_NAME + "-")}
    wal = state_dir / (store.DB_NAME + "-wal")
    files["wal empty"] = not wal.exists() or wal.stat().st_size == 0
    return files


def test_i7_tool_hook_with_nothing_due_only_reads_then_one_due_writes_one_running(state_dir):
    prompt = fixture("claude", "user_prompt_submit", session_id="long-1")
    assert run_hook("claude", prompt, state_dir).returncode == 0
    # No service configured: the sender it started finds no config, keeps the rows, exits.
    wait_for(lambda: "no server or token" in (state_dir / store.SENDER_LOG).read_text(errors="replace")
             if (state_dir / store.SENDER_LOG).exists() else False, timeout_s=20)
    stop_sender(state_dir)
    with store.Outbox(state_dir) as outbox:
        queued = len(outbox.rows())
    before = _files(state_dir)
    tool = {"session_id": "long-1", "hook_event_name": "PreToolUse", "tool_name": "Bash", "cwd": "/x",
            "tool_input": {"command": "ls"}}
    result = run_hook("claude", tool, state_dir)
    assert (result.returncode, result.stdout) == (0, b"")
    assert _files(state_dir) == before  # no outbox write, no log line, no sender started
    from machine.hooks.launch import sender_running

    assert not sender_running(state_dir)

    # The service answered a class so short that the turn is past half of it: continued.
    store.write_marker_class(state_dir, 0.001)
    assert store.marker_class_s(state_dir) == 0.001
    assert run_hook("claude", {**tool, "hook_event_name": "PostToolUse"}, state_dir).returncode == 0
    with store.Outbox(state_dir) as outbox:
        rows = outbox.rows()
        state = outbox.session_state("claude:long-1")
    assert len(rows) == queued + 1
    assert rows[-1].body["state"] == "running" and rows[-1].body["turn_id"] == state["turn"]
    assert state["turn_origin"] == prompt["prompt_id"] != state["turn"]


def test_i7_sender_records_the_class_of_the_running_marker_the_service_answered(state_dir):
    answered = {"outcome": "applied", "marker": {"started_at": "2026-03-01T10:00:00Z",
                                                 "expires_at": "2026-03-01T10:00:30Z"}}

    class Answer:
        def json(self):
            return answered

    sender = Sender(store.ensure_state_dir(state_dir))
    assert store.marker_class_s(state_dir) == 1200.0  # M2's default until then
    sender.learn_marker_class(Answer())
    assert store.marker_class_s(state_dir) == 30.0
    answered["marker"] = None  # a refused write carries none: the last class stays
    sender.learn_marker_class(Answer())
    assert store.marker_class_s(state_dir) == 30.0



# What no hook without a permission request loads: Django, the asking client (an HTTP
# client, TLS), the sender (argparse, the retry schedule: it runs in its own
# process), ``pathlib`` (``urllib.parse``, ``fnmatch``), ``site`` (the hook runs with -S).
NOT_IN_A_HOOK = ("django", "httpx", "http.client", "ssl", "machine.hooks.approval",
                 "machine.hooks.task_approval", "machine.hooks.sender", "machine.protocol",
                 "argparse", "pathlib", "site", "dataclasses", "inspect", "runpy")
# ... and what a tool hook with nothing due does not load either: it reads the session's
# snapshot file, not the outbox (``_sqlite3`` imports ``functools`` and ``collections``).
NOT_IN_A_TOOL_HOOK = ("uuid", "urllib.parse", "machine.hooks.launch", "json", "re", "enum", "datetime",
                      "sqlite3", "_sqlite3", "functools", "collections", "importlib.util", "contextlib")


def probe_hook(state_dir, payload, absent):
    """Runs the hook (``entry.run``) in a fresh interpreter with the installed command's
    flags; returns which of ``absent`` (and the mapping) it loaded."""
    from machine.protocol import HOOK_PYTHON_FLAGS

    probe = ("import sys\nfrom machine.hooks.entry import run\nrun(['claude'])\n"
             f"print(repr([m for m in {absent!r} + ('machine.hooks.mapping',) if m in sys.modules]))")
    done = subprocess.run([sys.executable, *HOOK_PYTHON_FLAGS, "-c", probe], input=json.dumps(payload).encode(),
                          capture_output=True, timeout=30, env=hook_env(state_dir), cwd="/")
    assert done.returncode == 0, done.stderr
    return ast.literal_eval(done.stdout.decode())


TOOL_HOOK = {"session_id": "light-1", "hook_event_name": "PreToolUse", "tool_name": "Bash", "cwd": "/x",
             "tool_input": {"command": "ls"}}


@pytest.mark.parametrize("payload, also_absent", [
    (TOOL_HOOK, NOT_IN_A_TOOL_HOOK),
    ({"session_id": "light-2", "hook_event_name": "UserPromptSubmit", "prompt": "fix it", "cwd": "/x",
      "prompt_id": "p-1"}, ()),
], ids=["tool-hook", "prompt-hook"])
def test_i7_i1_a_hook_loads_only_the_mapping_and_the_store(state_dir, payload, also_absent):
    """I1, I7: a hook's own share of its start is a few milliseconds because it loads only
    the mapping and the store (and, when it queued writes, ``uuid`` and the sender's
    launcher); a tool hook with nothing due, in a session whose turn is open, not even
    those, nor ``json``, ``re``, SQLite or ``collections`` (``json_loads``, the session's
    snapshot) (``bench/hook_latency.py`` measures the difference). Run with the hook
    command's own interpreter flags."""
    run_hook("claude", {**fixture("claude", "user_prompt_submit"), "session_id": "light-1"}, state_dir)
    assert store.peek_session_state(state_dir, "claude:light-1")["turn"]  # a turn open, not half through
    assert probe_hook(state_dir, payload, NOT_IN_A_HOOK + also_absent) == ["machine.hooks.mapping"]


def test_i7_a_tool_hook_reads_the_outbox_when_its_session_has_no_snapshot(state_dir):
    """I7: a session whose snapshot is missing (removed by a write that did not get to
    write the next, or kept by an outbox older than snapshots) is read from the outbox:
    the same decision, nothing queued."""
    run_hook("claude", {**fixture("claude", "user_prompt_submit"), "session_id": "light-1"}, state_dir)
    stop_sender(state_dir)
    os.unlink(store.snapshot_path(state_dir, "claude:light-1"))
    with store.Outbox(state_dir) as outbox:
        before = outbox.pending()
    assert "_sqlite3" in probe_hook(state_dir, TOOL_HOOK, ("_sqlite3",))
    with store.Outbox(state_dir) as outbox:
        assert outbox.pending() == before
    assert not os.path.exists(store.snapshot_path(state_dir, "claude:light-1"))  # a read writes nothing


def test_t3_codex_title_thread_notify_makes_no_session_and_leaves_the_wrappers_session(state_dir, tmp_path):
    """Codex 0.169's terminal UI names the user's thread with a hidden thread of its own
    after a user message; only its ``notify`` fires (payloads from a real run offline,
    trimmed). It is no session of the user's: nothing queued, and the terminal wrapper's
    ``state.json`` still names the user's session (T3: a phone message goes there)."""
    terminal = tmp_path / "terminal"
    terminal.mkdir()
    env = hook_env(state_dir, RUNSTEAD_TERMINAL=str(terminal))
    turn = {"type": "agent-turn-complete", "cwd": "/work", "client": "codex-tui", "last-assistant-message": "done."}
    user = {**turn, "thread-id": "01a24904-768c-7d52-9b1e-5f3c1a2b4c6d", "turn-id": "01a24904-81ee-7a01-b2c3-d4e5f6a7b8c9",
            "input-messages": ["run [[bash:echo hi]]"]}
    title = {**turn, "thread-id": "01a24904-8349-7cf0-a5b6-ca0f6d5b64df", "turn-id": "01a24904-835f-70b3-8712-3002aadb844c",
             "input-messages": ["Generate a concise, single-line task title of at most 36 characters and under five "
                                "words where possible. Do not answer the request.\n\nUser prompt:\nrun [[bash:echo hi]]"]}
    assert run_hook("codex", user, state_dir, argv_payload=True, env=env).returncode == 0
    with store.Outbox(state_dir) as outbox:
        queued = outbox.pending()
    wrapped = json.loads((terminal / "state.json").read_text())
    assert queued > 0 and wrapped["agent_session"] == user["thread-id"]
    result = run_hook("codex", title, state_dir, argv_payload=True, env=env)
    assert (result.returncode, result.stdout) == (0, b"")
    with store.Outbox(state_dir) as outbox:
        assert outbox.pending() == queued
    assert json.loads((terminal / "state.json").read_text()) == wrapped
    assert not (state_dir / "hook.log").exists()
