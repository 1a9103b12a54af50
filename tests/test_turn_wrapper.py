"""The terminal wrapper ``manage.py turn`` (SPEC M1, M5, M6) as a real subprocess against a
live daphne server on the test database."""
import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from django.conf import settings

from machine.hooks import store
from sessions_app.models import EndedTurn, Marker, Session
from tests.hooks_support import stop_sender
from tests.live import module_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for

pytestmark = [pytest.mark.machine_side, pytest.mark.django_db(transaction=True)]
BASE_DIR = Path(settings.BASE_DIR)


@pytest.fixture(autouse=True)
def hook_dir(tmp_path, monkeypatch):
    """The wrapper's outbox (shared with the hooks, SPEC I1) in a folder of this test;
    the sender it started is stopped afterwards."""
    path = tmp_path / "hooks"
    monkeypatch.setenv("RUNSTEAD_HOOK_DIR", str(path))
    monkeypatch.setenv("RUNSTEAD_HOOK_SENDER_IDLE_S", "1")
    yield path
    stop_sender(path)


def wrapper(url, token, session_id, *command, options=(), **popen):
    env = {**os.environ, "RUNSTEAD_SERVER": url, "RUNSTEAD_TOKEN": token, "PYTHONUNBUFFERED": "1"}
    env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    return subprocess.Popen(
        [sys.executable, "manage.py", "turn", "--session", str(session_id), *options, "--", *command],
        cwd=BASE_DIR, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen,
    )


def device_of(session_id):
    return f"{socket.gethostname()}:{session_id}"


def running_marker(session_id):
    return Marker.objects.filter(session_id=session_id, device_id=device_of(session_id), state="running").first()


@pytest.fixture
def daphne_url(module_daphne):
    """One live daphne for the module, on the test database (each test commits its rows)."""
    return module_daphne()


@pytest.fixture
def server(daphne_url, owner):
    return daphne_url, owner.auth_token.key


def test_m1_wrapper_writes_ended_when_the_command_exits_non_zero(server, tmp_path):
    url, token = server
    sid = uuid.uuid4()
    seen = tmp_path / "seen"
    # The agent records what the service showed while it ran, then fails.
    probe = (
        "import json, os, sys, urllib.request; "
        "req = urllib.request.Request(os.environ['RUNSTEAD_SERVER'] + '/api/sessions/' + sys.argv[2] + '/', "
        "headers={'Authorization': 'Token ' + os.environ['RUNSTEAD_TOKEN']}); "
        "body = json.load(urllib.request.urlopen(req)); "
        "open(sys.argv[1], 'w').write(json.dumps([body['status'], [m['running'] for m in body['markers']]])); "
        "sys.exit(3)"
    )
    proc = wrapper(url, token, sid, sys.executable, "-c", probe, str(seen), str(sid))
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 3, err
    assert json.loads(seen.read_text()) == ["busy", [True]]
    marker = Marker.objects.get(session_id=sid)
    assert marker.device_id == device_of(sid)
    assert marker.state == "ended" and marker.ended_at is not None
    assert marker.version == 2  # exactly two writes: running, ended (M1)
    assert EndedTurn.objects.filter(session_id=sid, turn_id=marker.turn_id).exists()
    assert Session.objects.get(pk=sid).status == "idle"
    assert "runstead turn" not in err  # no warnings: every call succeeded


def test_m6_wrapper_writes_ended_on_ctrl_c(server, tmp_path):
    url, token = server
    sid = uuid.uuid4()
    pid_file = tmp_path / "agent.pid"
    # An agent that says it runs, then runs until a signal ends it.
    agent = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    # Own process group, like a terminal's foreground job: Ctrl-C reaches the wrapper and the agent.
    proc = wrapper(url, token, sid, sys.executable, "-c", agent, str(pid_file), start_new_session=True)
    try:
        # The agent runs (it wrote its pid), so Ctrl-C is what ends it.
        wait_for(lambda: running_marker(sid) is not None and pid_file.exists() and pid_file.read_text(), timeout_s=20,
                 what="running marker and the agent's pid")
        assert Session.objects.get(pk=sid).status == "busy"
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err  # the agent died of SIGINT: 128 + 2
    marker = Marker.objects.get(session_id=sid)
    assert marker.state == "ended" and marker.version == 2
    assert Session.objects.get(pk=sid).status == "idle"


def test_m6_wrapper_writes_ended_on_sigterm_and_stops_the_agent(server, tmp_path):
    url, token = server
    sid = uuid.uuid4()
    pid_file = tmp_path / "agent.pid"
    agent = "import os, sys, time; open(sys.argv[1], 'w').write(str(os.getpid())); time.sleep(60)"
    proc = wrapper(url, token, sid, sys.executable, "-c", agent, str(pid_file), start_new_session=True)
    try:
        wait_for(lambda: running_marker(sid) is not None and pid_file.exists() and pid_file.read_text(), timeout_s=20,
                 what="running marker and the agent's pid")
        agent_pid = int(pid_file.read_text())
        proc.send_signal(signal.SIGTERM)  # only the wrapper: it forwards to the agent
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGTERM, err
    with pytest.raises(ProcessLookupError):
        os.kill(agent_pid, 0)
    assert Marker.objects.get(session_id=sid).state == "ended"
    assert Session.objects.get(pk=sid).status == "idle"


def test_m5_wrapper_sweeps_its_device_at_start(server, owner):
    """A previous run on this terminal was killed (-9) mid-turn: the next run's startup
    sweep closes its marker, so the old turn's late messages change nothing."""
    url, token = server
    sid = uuid.uuid4()
    first = wrapper(url, token, sid, sys.executable, "-c", "import time; time.sleep(60)", start_new_session=True)
    try:
        wait_for(lambda: running_marker(sid) is not None, timeout_s=20, what="running marker")
        crashed_turn = running_marker(sid).turn_id
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.communicate(timeout=10)
    assert running_marker(sid).turn_id == crashed_turn  # nobody wrote `ended`
    second = wrapper(url, token, sid, sys.executable, "-c", "pass")
    out, err = second.communicate(timeout=60)
    assert second.returncode == 0, err
    ended = EndedTurn.objects.get(session_id=sid, turn_id=crashed_turn)
    marker = Marker.objects.get(session_id=sid)
    assert marker.turn_id != crashed_turn and marker.state == "ended"
    assert ended.ended_at <= marker.started_at
    assert Session.objects.get(pk=sid).status == "idle"


def test_m8_wrapper_runs_the_command_even_when_the_service_is_down(tmp_path, hook_dir):
    sid = uuid.uuid4()
    out_file = tmp_path / "out"
    proc = wrapper(
        "http://127.0.0.1:9", "t", sid, sys.executable, "-c", f"open({str(out_file)!r}, 'w').write('ran')",
        options=["--start-wait", "0.5", "--ended-wait", "0.5"],
    )
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert out_file.read_text() == "ran"
    assert "could not publish the running turn yet" in err and "could not publish the end of the turn yet" in err
    # I1, R4: the three writes stay queued, in order, for the sender to deliver later.
    with store.Outbox(hook_dir) as outbox:
        rows = outbox.rows()
    assert [(r.method, r.body and r.body["state"]) for r in rows] == [("POST", None), ("PUT", "running"),
                                                                       ("PUT", "ended")]
    assert {r.server for r in rows} == {"http://127.0.0.1:9"}


def test_i1_wrapper_writes_queued_while_the_service_was_down_arrive_in_order_once_it_is_back(
    server, tmp_path, hook_dir
):
    url, token = server
    sid = uuid.uuid4()
    # Queue a whole turn against the live service while the sender cannot run (the lock
    # is held here), then let a sender deliver it.
    from machine.hooks.launch import try_lock

    lock = try_lock(store.ensure_state_dir(hook_dir))
    proc = wrapper(url, token, sid, sys.executable, "-c", "pass", options=["--start-wait", "0.2", "--ended-wait", "0.2"])
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "queued" in err
    assert not Marker.objects.filter(session_id=sid).exists()
    os.close(lock)
    from machine.hooks.launch import ensure_sender

    ensure_sender(hook_dir)
    wait_for(lambda: Marker.objects.filter(session_id=sid, state="ended").exists(), timeout_s=20, what="ended marker")
    marker = Marker.objects.get(session_id=sid)
    assert marker.version == 2  # running then ended, in order, once each
    assert Session.objects.get(pk=sid).status == "idle"
