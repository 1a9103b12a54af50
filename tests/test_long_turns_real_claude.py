"""SPEC I7, M3, N1 with the real Claude Code (issue 21: long turns stay true): hooks
installed with ``install_hooks claude`` into a temporary HOME, a real daphne whose marker
classes are shortened through the settings (``RUNSTEAD_MARKER_DEFAULT_S`` 4 s, grace
2 s: production's 20 min, 60 s), its embedded sweep and notify loop on, and the owner's
"session idle" notifications going to a local webhook receiver.

- A ``claude -p`` turn that keeps calling tools (shell ``sleep``s) for longer than two
  marker classes stays busy on every look and RUNNING throughout (its tool hooks continue
  the turn under fresh turn ids, I7), and sends exactly one "session idle", after it
  ended.
- A turn killed mid-way (no ``Stop``, no ``SessionEnd``) shows idle once its marker
  expires, and announces nothing (N1).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

import httpx
import pytest

from machine.hooks import mapping
from tests.claude_cli import claude_bin, claude_env, fake_model_api  # noqa: F401  (fixture)
from tests.hooks_support import BASE_DIR, Board, stop_sender
from tests.http_receiver import Receiver
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.notify_support import ALL_ON
from tests.wait import wait_for

pytestmark = [pytest.mark.surface, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

CLASS_S, GRACE_S = 4, 2
SHORT_CLASSES = {
    "RUNSTEAD_MARKER_DEFAULT_S": str(CLASS_S), "RUNSTEAD_MARKER_GRACE_S": str(GRACE_S),
    "RUNSTEAD_EMBEDDED_SWEEP": "1", "RUNSTEAD_SWEEP_INTERVAL_S": "0.2",
    "RUNSTEAD_EMBEDDED_NOTIFY": "1", "RUNSTEAD_NOTIFY_INTERVAL_S": "0.2",
    "RUNSTEAD_OUTBOUND_ALLOW": "127.0.0.0/8",  # K5: the local webhook receiver
}
# Five shell calls of 2 s: a turn of 10 s and more, past two 4 s classes; each tool hook
# comes at most ~2 s after the last, so every continuation is due (past half a class)
# well before the marker it replaces runs out.
LONG_PROMPT = "[[bash:sleep 2]] " * 5


class Rig:
    """Live daphne with short marker classes, the owner's webhook receiver, the owner's
    board socket, and a HOME where ``install_hooks claude`` ran."""

    def __init__(self, url, token, home, api):
        self.url, self.token, self.home, self.api = url, token, home, api
        self.receiver = Receiver()
        self.client = httpx.Client(base_url=url, headers={"Authorization": f"Token {token}"}, timeout=10)
        put = self.client.put("/api/notifications/settings/", json={
            "kinds": ALL_ON, "webhook_url": self.receiver.url + "/hook", "board": True, "push": False})
        assert put.status_code == 200, put.text
        env = {k: v for k, v in os.environ.items() if not k.startswith("RUNSTEAD_HOOK")}
        env["HOME"] = str(home)
        done = subprocess.run([sys.executable, "manage.py", "install_hooks", "claude", "--server", url,
                               "--token", token], cwd=BASE_DIR, env=env, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
        self.work = home / "work"
        self.work.mkdir()
        self.board = Board(url, token)
        self.board.start()
        assert self.board.connected.wait(10)

    def start(self, prompt: str) -> subprocess.Popen:
        """``claude -p PROMPT`` in its own process group, stream-json on stdout."""
        return subprocess.Popen(
            [claude_bin(), "-p", prompt, "--output-format", "stream-json", "--verbose",
             "--permission-mode", "bypassPermissions"],
            env=claude_env(home=self.home, api=self.api), cwd=self.work, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)

    def session_from(self, proc: subprocess.Popen):
        """The RunStead session (I2) of the run, from its first stream line (``system/init``)."""
        line = proc.stdout.readline()
        return mapping.session_uuid("claude", json.loads(line)["session_id"])

    def idle_notifications(self, session) -> list[dict]:
        return [json.loads(r["body"]) for r in self.receiver.requests
                if r["headers"].get("x-runstead-event") == "session_idle"
                and json.loads(r["body"]).get("session_id") == str(session)]

    def close(self):
        self.board.stop()
        self.client.close()
        self.receiver.close()
        stop_sender(self.home / ".runstead" / "hooks")


@pytest.fixture
def rig(live_daphne, make_owner, fake_model_api, tmp_path):  # noqa: F811
    owner = make_owner("long")
    rig = Rig(live_daphne(**SHORT_CLASSES), owner.auth_token.key, tmp_path / "home", fake_model_api)
    yield rig
    rig.close()


class ActivePoller(threading.Thread):
    """Asks ``GET /api/sessions/active/`` (S6: the owner's busy sessions) over and over
    until stopped; ``looks`` is ``[(time.monotonic(), busy session ids)]``."""

    def __init__(self, rig: Rig):
        super().__init__(daemon=True)
        self.rig, self.looks, self.stopping = rig, [], threading.Event()

    def run(self):
        with httpx.Client(base_url=self.rig.url, headers={"Authorization": f"Token {self.rig.token}"},
                          timeout=10) as client:
            while not self.stopping.is_set():
                answer = client.get("/api/sessions/active/")
                if answer.status_code == 200:
                    self.looks.append((time.monotonic(), {item["id"] for item in answer.json()["sessions"]}))
                self.stopping.wait(0.25)

    def stop(self):
        self.stopping.set()
        self.join(10)


def test_i7_n1_real_claude_long_turn_stays_running_and_sends_one_idle_after_it_ends(rig):
    proc = rig.start(LONG_PROMPT)
    session = rig.session_from(proc)
    wait_for(lambda: ("status", "busy") in rig.board.of(session), timeout_s=60)
    poller = ActivePoller(rig)
    poller.start()
    try:
        out, err = proc.communicate(timeout=120)
    finally:
        ended_at = time.monotonic()
        poller.stop()
    assert proc.returncode == 0, err[-2000:]
    assert out.count('"name":"Bash"') >= 5  # the five calls ran, one after another

    events = rig.board.wait_for(session, ("status", "idle"), timeout=30)
    statuses = [e[1] for e in events if e[0] == "status"]
    assert statuses == ["busy", "idle"], events  # never idle in between (no blip, I7)
    runs = [e[2] for e in events if e[:2] == ("marker", "running")]
    ends = [e[2] for e in events if e[:2] == ("marker", "ended")]
    assert len(set(runs)) == len(runs) >= 3, events  # the turn went on past two classes
    assert ends == [runs[-1]]  # Stop ended the turn's latest id, once
    markers = [e for e in rig.board.events if e["type"] == "marker" and e.get("session_id") == str(session)]
    assert len({e["device_id"] for e in markers}) == 1  # one device: each continuation replaced the marker
    # RUNNING throughout: every look while claude ran found the session busy.
    during = [ids for at, ids in poller.looks if at < ended_at - 0.5]
    assert len(during) >= 10 and all(str(session) in ids for ids in during), poller.looks

    wait_for(lambda: rig.idle_notifications(session), timeout_s=30)
    # Exactly one, however long the notify loop is given (it runs every 0.2 s).
    with pytest.raises(AssertionError):
        wait_for(lambda: len(rig.idle_notifications(session)) > 1, timeout_s=2)


def test_n1_m3_real_claude_killed_mid_turn_shows_idle_after_expiry_and_announces_nothing(rig):
    # Not a bare `sleep 60`: Claude Code refuses a standalone long sleep as a tool call,
    # and the turn then ends (Stop) before the kill, which this test is not about.
    proc = rig.start("[[bash:timeout 60 tail -f /dev/null]]")
    session = rig.session_from(proc)
    wait_for(lambda: ("status", "busy") in rig.board.of(session), timeout_s=60)
    wait_for(lambda: rig.api.paths().count("/v1/messages?beta=true") >= 1, timeout_s=30)
    os.killpg(proc.pid, signal.SIGKILL)  # no Stop, no SessionEnd
    proc.communicate(timeout=30)

    events = rig.board.wait_for(session, ("status", "idle"), timeout=30)
    assert [e[:2] for e in events] == [("marker", "running"), ("status", "busy"), ("status", "idle")], events
    idle = next(e for e in rig.board.events if e["type"] == "session.status" and e.get("session_id") == str(session)
                and e["status"] == "idle")
    assert idle["announced"] is False
    running = next(e for e in rig.board.events if e["type"] == "marker" and e.get("session_id") == str(session))
    assert idle["_seen"] - running["_seen"] >= CLASS_S + GRACE_S - 1  # not before its marker ran out
    # Nothing is sent for it, however long the notify loop is given.
    with pytest.raises(AssertionError):
        wait_for(lambda: rig.idle_notifications(session), timeout_s=2)
