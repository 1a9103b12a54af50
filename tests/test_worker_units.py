"""Worker parts without a service: lease math with a controllable clock (L3, L4, L9),
the local database (W1, X1), local checks (W4), the idle-sleep command
(W7), process identity (X3) and bounded stops (L8) with real processes."""
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
import uuid

import psutil
import pytest

from machine.worker import process
from machine.worker.clock import FakeClock
from machine.worker.config import ConfigError, check_start, parse_config
from machine.worker.lease import KILL, OK, TERM, Deadline, LeaseTerms, SentAt, slept_s
from machine.worker.store import Store
from tests.wait import wait_for
from tests.worker_harness import AGENT, count_lines, live_pids, make_worker, recorded_pids

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)

TERMS = LeaseTerms(lease_id="lease-1", duration_s=60, renew_every_s=15, margin_s=5, kill_grace_s=5)


# --- L3 / L4: deadline math --------------------------------------------------------------

def test_l3_deadline_is_duration_minus_margin_from_send():
    clock = FakeClock()
    d = Deadline(TERMS, SentAt.now(clock))
    assert d.remaining(clock) == pytest.approx(55)
    clock.advance(20)
    assert d.remaining(clock) == pytest.approx(35)
    assert d.phase(clock) == OK


def test_l3_sleep_monotonic_stands_still_wall_advances_deadline_passes():
    clock = FakeClock()
    d = Deadline(TERMS, SentAt.now(clock))
    clock.suspend(600)  # lid closed: wall runs, monotonic does not
    assert d.remaining(clock) == pytest.approx(55 - 600)
    assert d.phase(clock) == KILL
    assert slept_s(d.sent, clock) == pytest.approx(600)


def test_l3_wall_clock_backward_never_extends_deadline():
    clock = FakeClock()
    d = Deadline(TERMS, SentAt.now(clock))
    clock.advance(30)
    clock.jump_wall(-3600)
    assert d.remaining(clock) == pytest.approx(25)  # monotonic elapsed still counts
    clock.advance(30)
    assert d.phase(clock) == KILL


def test_l3_wall_clock_forward_stops_early():
    clock = FakeClock()
    d = Deadline(TERMS, SentAt.now(clock))
    clock.advance(1)
    clock.jump_wall(+52)
    assert d.phase(clock) == TERM
    clock.jump_wall(+10)
    assert d.phase(clock) == KILL


def test_l3_delayed_reply_shortens_deadline_by_the_delay():
    clock = FakeClock()
    sent = SentAt.now(clock)
    clock.advance(7)  # the renewal reply takes 7 s to arrive
    d = Deadline(TERMS, sent)
    assert d.remaining(clock) == pytest.approx(55 - 7)


def test_l4_sigterm_phase_at_deadline_minus_kill_grace_then_kill_at_deadline():
    clock = FakeClock()
    d = Deadline(TERMS, SentAt.now(clock))
    clock.advance(49.9)
    assert d.phase(clock) == OK
    clock.advance(0.2)
    assert d.phase(clock) == TERM
    clock.advance(5)
    assert d.phase(clock) == KILL


def test_l3_within_uses_max_of_both_clocks():
    clock = FakeClock()
    d = Deadline(TERMS, SentAt.now(clock))
    assert d.within(clock.monotonic() + 10, clock.wall() + 10)
    assert not d.within(clock.monotonic() + 10, clock.wall() + 600)  # slept through it
    assert not d.within(None, clock.wall() + 56)  # other boot: wall only


def test_l3_l4_l9_sleep_stops_agent_at_once_and_reports_slept_600(tmp_path):
    """A real agent under a FakeClock: the laptop "sleeps" 600 s (monotonic still); on
    waking the worker kills the group at once and the final receipt carries slept_s ~600."""
    clock = FakeClock()
    worker = make_worker(tmp_path, clock)
    op = str(uuid.uuid4())
    repo = tmp_path / "repo"
    repo.mkdir()
    payload = {"task_id": str(uuid.uuid4()), "operation_id": op, "folder": str(repo), "grant_root": str(tmp_path),
               "agent": "tree", "prompt": "p", "max_runtime_s": 100, "session_id": None, "deep_research": False}
    worker.ctx.store.record_message(message_id=str(uuid.uuid4()), kind="start", operation_id=op, payload=payload,
                                wall=clock.wall())
    run = worker.runner.new_run(op, payload)
    run.lease.granted = SentAt.now(clock)
    run.lease.deadline = Deadline(TERMS, run.lease.granted)
    profile, folder = check_start(worker.ctx.config, payload)
    env = process.agent_env(dict(os.environ), profile_env=profile.env, operation_id=op, task_id="t", token="x")
    thread = threading.Thread(target=worker.runner.spawn_and_watch, name="watch",
                              args=(run, profile.command(prompt="p", folder=folder), folder, False, env))
    thread.start()
    wait_for(lambda: len(recorded_pids(tmp_path / "pids")) >= 3, what="agent, child and grandchild")
    clock.wait_for_waiter("watch")  # the watch loop runs: it waits on the clock for its next look
    assert thread.is_alive()
    woke = time.monotonic()
    clock.suspend(600)
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert time.monotonic() - woke < 3.0
    assert live_pids([p for p, _ in recorded_pids(tmp_path / "pids")]) == []
    final = json.loads(worker.ctx.store.get(op)["final"])
    assert final["stop_reason"] == "deadline" and final["process_started"] is True
    assert final["ended_within_lease"] is False
    body = json.loads([r for r in worker.ctx.store.outbox.rows() if r["event_id"] == f"{op}:final"][0]["body"])
    assert body["slept_s"] == pytest.approx(600, abs=1)
    assert count_lines(tmp_path / "starts") == 1


# --- W1 / X1: local database ---------------------------------------------------------------

def test_w1_pragmas_read_back_from_worker_database(tmp_path):
    store = Store(str(tmp_path / "w.sqlite3"))
    assert store.pragmas() == {"journal_mode": "wal", "synchronous": 2, "fullfsync": 1, "checkpoint_fullfsync": 1}


def _ended_operation(store, *, wall, acked=True, report_pending=False, state="ended", worktree=False,
                     integration=None):
    """An operation run to its end at ``wall``: start recorded (and its ack answered),
    final report queued and (unless ``report_pending``) answered."""
    op = str(uuid.uuid4())
    message = f"m-{op}"
    store.record_message(message_id=message, kind="start", operation_id=op, payload={"task_id": "t"}, wall=wall)
    if acked:
        store.message_acked(message, wall)
    store.mark_starting(op, turn_id=None, wall=wall, outbox=[], worktree={"path": f"/wt/{op}"} if worktree else None)
    if integration:
        store.record_integration(message_id=f"i-{op}", integration_id=f"int-{op}", operation_id=op, payload={},
                                 wall=wall)
        if integration == "done":
            store.integration_done(f"int-{op}", outcome={"outcome": "discarded"}, wall=wall, outbox=[])
    if state == "ended":
        store.mark_ended(op, final={"exit_code": 0}, wall=wall, outbox=[
            {"event_id": f"{op}:final", "kind": "final", "operation_id": op, "path": "/api/worker/receipts/", "body": {}}])
        if not report_pending:
            seq = [r["seq"] for r in store.outbox.rows() if r["event_id"] == f"{op}:final"][0]
            store.outbox.settle(seq, status="done", answer="{}")
    return op


def test_w1_prune_removes_only_final_acknowledged_records_older_than_7_days(tmp_path):
    from machine.worker.store import RECORD_RETENTION_S

    store = Store(str(tmp_path / "w.sqlite3"))
    now = 1_800_000_000.0
    old = now - RECORD_RETENTION_S - 60
    prunable = [_ended_operation(store, wall=old) for _ in range(100)]
    prunable.append(_ended_operation(store, wall=old, worktree=True, integration="done"))
    kept = {
        "recent": _ended_operation(store, wall=now - RECORD_RETENTION_S + 60),
        "start ack never answered": _ended_operation(store, wall=old, acked=False),
        "final report still pending": _ended_operation(store, wall=old, report_pending=True),
        "still running": _ended_operation(store, wall=old, state="starting"),
        "worktree never integrated": _ended_operation(store, wall=old, worktree=True),
        "integration under way": _ended_operation(store, wall=old, worktree=True, integration="received"),
    }
    store.enqueue([{"event_id": "sweep-old", "kind": "sweep", "path": "/api/devices/d/sweep/", "body": {}},
                   {"event_id": "marker-old", "kind": "marker", "path": "/api/sessions/s/marker/", "body": {}}], old)
    store.outbox.settle([r["seq"] for r in store.outbox.rows() if r["event_id"] == "sweep-old"][0], status="done",
                      answer="{}")
    store.record_message(message_id="q-old", kind="query", operation_id=str(uuid.uuid4()), payload={}, wall=old)

    pruned = store.prune(before_wall=now - RECORD_RETENTION_S)

    assert sorted(pruned) == sorted(prunable)
    remaining = {r["operation_id"] for r in store.conn.execute("SELECT operation_id FROM operations")}
    assert remaining == set(kept.values())
    events = {r["event_id"] for r in store.outbox.rows()}
    assert events == {f"{kept[k]}:final" for k in kept if k != "still running"} | {"marker-old"}  # answered, old, no op: gone
    messages = {r["operation_id"] for r in store.conn.execute("SELECT operation_id FROM messages")}
    assert messages == set(kept.values())  # W3 still recognises every kept operation's start
    assert {r["operation_id"] for r in store.integrations()} == {kept["integration under way"]}
    assert not store.record_message(message_id="again", kind="start", operation_id=kept["recent"], payload={}, wall=now)
    assert store.prune(before_wall=now - RECORD_RETENTION_S) == []


def test_w1_worker_database_of_schema_2_is_migrated(tmp_path):
    import sqlite3

    from machine.worker.store import SCHEMA_V1, SCHEMA_V2, SCHEMA_VERSION

    path = str(tmp_path / "w.sqlite3")
    db = sqlite3.connect(path)
    db.executescript(SCHEMA_V1 + ";" + SCHEMA_V2 + ";PRAGMA user_version = 2;")
    db.execute("INSERT INTO messages (message_id, kind, operation_id, received_wall) VALUES ('m', 'start', 'o', 1)")
    db.commit()
    db.close()
    store = Store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone() == {"user_version": SCHEMA_VERSION}
    assert store.conn.execute("SELECT acked_wall FROM messages").fetchone() == {"acked_wall": None}
    store.message_acked("m", 5.0)
    assert store.conn.execute("SELECT acked_wall FROM messages").fetchone() == {"acked_wall": 5.0}


def test_c9_worker_database_of_schema_5_keeps_its_conversation_items_and_takes_again_items(tmp_path):
    import sqlite3

    from machine.worker.store import SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMA_V5, SCHEMA_VERSION

    path = str(tmp_path / "w.sqlite3")
    db = sqlite3.connect(path)
    db.executescript(";".join((SCHEMA_V1, SCHEMA_V2, SCHEMA_V3, SCHEMA_V4, SCHEMA_V5)) + ";PRAGMA user_version = 5;")
    for n, item_id in enumerate(("z", "a")):  # recorded in this order (not the ids' order)
        db.execute("INSERT INTO conversation_items (item_id, operation_id, kind, seq, line, state, placement,"
                   " created_wall, delivery, turn_seq) VALUES (?, 'o', 'message', ?, 'l', 'written', ?, 1, 'steer', ?)",
                   (item_id, n, n, n or None))
    db.commit()
    db.close()
    store = Store(path)
    assert store.conn.execute("PRAGMA user_version").fetchone() == {"user_version": SCHEMA_VERSION}
    assert [(i["item_id"], i["seq"], i["placement"], i["delivery"], i["turn_seq"]) for i in store.items("o")] == [
        ("z", 0, 0, "steer", None), ("a", 1, 1, "steer", 1)]
    assert store.record_item(item_id="again:a", operation_id="o", kind="again", seq=1, line="l", wall=2.0,
                             delivery="steer")
    assert store.item_moved("again:a", came_from="received", to="placed", placement=2)
    with pytest.raises(sqlite3.IntegrityError):  # one line per inbox number still (C3)
        store.record_item(item_id="b", operation_id="o", kind="message", seq=2, line="l", wall=3.0)
        store.item_moved("b", came_from="received", to="placed", placement=2)
    with pytest.raises(sqlite3.IntegrityError):  # the kinds are still checked
        store.conn.execute("INSERT INTO conversation_items (item_id, operation_id, kind, created_wall)"
                           " VALUES ('c', 'o', 'other', 3)")


def test_x1_spawn_count_check_constraint_forbids_a_second_spawn(tmp_path):
    import sqlite3

    store = Store(str(tmp_path / "w.sqlite3"))
    op = str(uuid.uuid4())
    assert store.record_message(message_id="m1", kind="start", operation_id=op, payload={"task_id": "t"}, wall=1.0)
    assert not store.record_message(message_id="m2", kind="start", operation_id=op, payload={"task_id": "t"}, wall=2.0)
    store.mark_starting(op, turn_id=None, wall=3.0, outbox=[])
    assert store.get(op)["spawn_count"] == 1
    with pytest.raises(sqlite3.IntegrityError):
        store.mark_starting(op, turn_id=None, wall=4.0, outbox=[])
    with pytest.raises(sqlite3.IntegrityError, match="CHECK"):
        with store.transaction() as c:
            c.execute("UPDATE operations SET spawn_count = 2 WHERE operation_id = ?", (op,))
    assert store.get(op)["spawn_count"] == 1


# --- W4: local checks ----------------------------------------------------------------------

def _config(root):
    return parse_config(tomllib.loads(f'allowed_roots = ["{root}"]\n[profiles.a]\nargv = ["/bin/echo", "{{prompt}}"]\n'))


def test_w4_folder_checks_resolve_dotdot_and_symlinks(tmp_path):
    allowed = tmp_path / "allowed"
    (allowed / "repo").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (allowed / "link").symlink_to(tmp_path / "outside")
    config = _config(allowed)
    base = {"agent": "a", "prompt": "x", "grant_root": str(allowed)}
    assert check_start(config, {**base, "folder": str(allowed / "repo")})[1] == str(allowed / "repo")
    assert "outside" in check_start(config, {**base, "folder": f"{allowed}/repo/../../outside"})
    assert "outside" in check_start(config, {**base, "folder": str(allowed / "link")})
    assert "grant root" in check_start(config, {**base, "folder": str(allowed / "repo"), "grant_root": str(allowed / "other")})
    assert "unknown agent" in check_start(config, {**base, "agent": "sh", "folder": str(allowed / "repo")})
    assert "absolute" in check_start(config, {**base, "folder": "repo"})


def test_w4_prompt_is_one_argument_never_a_shell():
    cfg = parse_config({"allowed_roots": ["/tmp"], "profiles": {
        "a": {"argv": ["agent", "--dir", "{folder}", "{prompt}"]},
        "s": {"argv": ["agent", "{prompt}"], "prompt_via": "stdin"}}})
    prompt = "x; rm -rf / $(whoami) `id` 'q'"
    assert cfg.profiles["a"].command(prompt=prompt, folder="/tmp/r") == ["agent", "--dir", "/tmp/r", prompt]
    assert cfg.profiles["s"].command(prompt=prompt, folder="/tmp/r") == ["agent"]
    with pytest.raises(ConfigError):
        parse_config({"allowed_roots": ["relative/path"]})
    with pytest.raises(ConfigError):
        parse_config({"profiles": {"x": {"argv": "agent {prompt}"}}})


# --- W7: idle sleep ------------------------------------------------------------------------

def test_w7_caffeinate_command_while_agents_run_macos_call_mocked():
    """Labelled: on Linux there is no caffeinate; only the macOS process start is replaced
    by a recorder. The guard's counting and the exact command are real."""
    started = []

    class FakeCaffeinate:
        def __init__(self, argv):
            self.argv, self.terminated = argv, False
            started.append(self)

        def terminate(self):
            self.terminated = True

        def wait(self, timeout=None):
            return 0

    guard = process.IdleSleepGuard(enabled=True, platform="darwin", spawn=FakeCaffeinate, worker_pid=4242)
    guard.acquire()
    guard.acquire()
    assert [s.argv for s in started] == [["caffeinate", "-i", "-w", "4242"]]
    guard.release()
    assert not started[0].terminated
    guard.release()
    assert started[0].terminated
    assert process.IdleSleepGuard(enabled=True, platform="linux", spawn=FakeCaffeinate).enabled is False
    assert process.IdleSleepGuard(enabled=False, platform="darwin", spawn=FakeCaffeinate).enabled is False


# --- X3: identity --------------------------------------------------------------------------

# A process that writes the name of every catchable signal it gets to the file argv[1].
BYSTANDER = """
import signal, sys, time
out = open(sys.argv[1], "a", buffering=1)
for s in (signal.SIGHUP, signal.SIGINT, signal.SIGUSR1, signal.SIGUSR2, signal.SIGTERM, signal.SIGWINCH):
    signal.signal(s, lambda n, f: out.write(signal.Signals(n).name + "\\n"))
out.write("ready\\n")
time.sleep(30)
"""


def test_x3_pid_reuse_unrelated_process_with_other_start_time_is_not_killed(tmp_path):
    """A local record whose pid now belongs to an unrelated process (different start
    time): recovery does not touch it, and reports the exit status as unknown."""
    signals = tmp_path / "bystander-signals"
    bystander = subprocess.Popen([sys.executable, "-c", BYSTANDER, str(signals)], start_new_session=True)
    try:
        wait_for(lambda: signals.exists() and signals.read_text() == "ready\n", what="the bystander's handlers")
        real_start = psutil.Process(bystander.pid).create_time()
        worker = make_worker(tmp_path, FakeClock())
        op = str(uuid.uuid4())
        worker.ctx.store.record_message(message_id="m", kind="start", operation_id=op,
                                    payload={"task_id": "t", "session_id": None}, wall=1.0)
        worker.ctx.store.mark_starting(op, turn_id=None, wall=1.0, outbox=[])
        worker.ctx.store.mark_running(op, pid=bystander.pid, pgid=bystander.pid, start_time=real_start - 50,
                                  spawned_mono=1.0, spawned_wall=real_start - 50, outbox=[])
        worker.recover()
        # Every catchable signal the bystander got is in its file, in arrival order; a
        # probe sent now lands after anything recover() sent (Python runs pending
        # handlers in signal-number order, SIGWINCH is the highest here), so once the
        # probe is in the file nothing else is (and a SIGKILL would have stopped it).
        os.kill(bystander.pid, signal.SIGWINCH)
        wait_for(lambda: signals.read_text().endswith("SIGWINCH\n"), what="the bystander's answer to the probe")
        assert signals.read_text() == "ready\nSIGWINCH\n"
        assert bystander.poll() is None
        assert psutil.Process(bystander.pid).create_time() == real_start
        final = json.loads(worker.ctx.store.get(op)["final"])
        assert final["process_started"] is True and final["exit_code"] is None and final["signal"] is None
        assert final["stop_reason"] == "worker_restart"
        assert worker.ctx.store.get(op)["spawn_count"] == 1  # X4: never spawned again
    finally:
        bystander.kill()
        bystander.wait()


def test_x3_identity_matches_within_tolerance_only():
    me = psutil.Process(os.getpid())
    ref = process.ProcRef(me.pid, me.create_time())
    assert process.alive(ref)
    assert process.alive(process.ProcRef(me.pid, me.create_time() + 0.5))
    assert not process.alive(process.ProcRef(me.pid, me.create_time() - 5))


# --- L8: bounded stop with real processes --------------------------------------------------

def _spawn_agent(tmp_path, op, **env):
    op_dir = tmp_path / "op"
    op_dir.mkdir(exist_ok=True)
    full_env = process.agent_env(dict(os.environ), profile_env={"AGENT_PIDS": str(tmp_path / "pids"),
                                 "AGENT_STARTS": str(tmp_path / "starts"), **env},
                                 operation_id=op, task_id="t", token="secret-token")
    spawned_wall = time.time()
    proc, leader = process.spawn(argv=[sys.executable, str(AGENT), "p"], cwd=str(tmp_path), env=full_env,
                                 op_dir=str(op_dir), stdin_text=None)
    return proc, process.Target(operation_id=op, leader=leader, pgid=leader.pid, spawned_wall=spawned_wall), op_dir


@pytest.mark.slow
def test_l8_setsid_child_escaping_the_group_is_stopped(tmp_path):
    op = str(uuid.uuid4())
    proc, target, _ = _spawn_agent(tmp_path, op, AGENT_CHILDREN="setsid", AGENT_SLEEP_S="30")
    pids = wait_for(lambda: len(recorded_pids(tmp_path / "pids")) >= 2 and recorded_pids(tmp_path / "pids"))
    escaped = [p for p, role in pids if role == "escaped"][0]
    assert os.getpgid(escaped) != target.pgid  # it really left the group
    survivors = process.stop(target, grace_s=0.5)
    proc.wait(timeout=5)
    assert survivors == []
    assert live_pids([p for p, _ in recorded_pids(tmp_path / "pids")]) == []


@pytest.mark.slow
def test_l8_forking_agent_all_children_stopped_or_named(tmp_path):
    op = str(uuid.uuid4())
    proc, target, _ = _spawn_agent(tmp_path, op, AGENT_CHILDREN="forks", AGENT_FORKS="150", AGENT_SLEEP_S="30")
    wait_for(lambda: len(recorded_pids(tmp_path / "pids")) >= 40, what="forks under way")
    survivors = process.stop(target, grace_s=0.3)
    proc.wait(timeout=5)
    assert survivors == []
    # SIGKILLed processes leave the process table a moment after stop() saw them die; one
    # that stop() missed would sleep on and fail this wait.
    wait_for(lambda: not live_pids([p for p, _ in recorded_pids(tmp_path / "pids")]), timeout_s=3,
             what="every fork gone")


def test_w5_token_never_in_agent_environment_and_tag_set(tmp_path):
    env = process.agent_env({"PATH": "/bin", "RUNSTEAD_WORKER_FAULT": "x", "SOME": "has secret-token inside"},
                            profile_env={"A": "1"}, operation_id="op-1", task_id="t-1", token="secret-token")
    assert env == {"PATH": "/bin", "A": "1", "RUNSTEAD_OPERATION_ID": "op-1", "RUNSTEAD_TASK_ID": "t-1"}


def test_w5_state_dir_mode_0700_token_0600_and_second_lock_refused(tmp_path):
    from machine.worker.store import StateDir, StateDirLocked

    state = StateDir(str(tmp_path / "s"))
    state.write_identity(machine_id="m", generation=1, name="n", server="http://x", token="tok")
    assert os.stat(state.path).st_mode & 0o777 == 0o700
    assert os.stat(os.path.join(state.path, "token")).st_mode & 0o777 == 0o600
    state.lock()
    with pytest.raises(StateDirLocked):
        StateDir(state.path).lock()


def test_w5_second_worker_process_on_same_state_dir_refuses(tmp_path):
    from machine.worker.store import StateDir
    from tests.worker_harness import BASE_DIR, UNREACHABLE, manage_env

    state = StateDir(str(tmp_path / "s"))
    state.write_identity(machine_id=str(uuid.uuid4()), generation=1, name="n", server=UNREACHABLE, token="tok")
    args = [sys.executable, "manage.py", "worker", "--server", UNREACHABLE, "--state-dir", state.path]
    first = subprocess.Popen(args, cwd=BASE_DIR, env=manage_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: os.path.exists(os.path.join(state.path, "worker.sqlite3")), timeout_s=20, what="first worker up")
        second = subprocess.run(args, cwd=BASE_DIR, env=manage_env(), capture_output=True, text=True, timeout=30)
        assert second.returncode == 2
        assert "another worker" in second.stderr
        assert first.poll() is None
    finally:
        first.send_signal(signal.SIGTERM)
        first.wait(timeout=15)
