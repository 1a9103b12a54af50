"""K1, W5, I1, N2: secrets at rest and on the way.

- machine tokens and pairing codes are stored only as SHA-256 digests (verified by
  digest: the plain value is in no table);
- the hook state file with the owner token is 0600 in a 0700 directory, whatever the umask;
- the webhook secret is in the database, answered once (the PUT that set a new URL) and
  never again; the VAPID private key is in the database and never in any answer;
- a full live flow (real daphne, real worker, an agent that dumps its environment, a board
  socket, notifications with a webhook, refusals with stale credentials): no secret in
  daphne's or the worker's log, in the agent's environment (W5), in a board event, or in
  the board and task pages.
"""
import hashlib
import json
import os
import stat
import threading

import httpx
import pytest
from django.db import connection
from django.test import Client

from tests.conftest import owner_api
from tests.live import live_daphne  # noqa: F401 - the fixture
from tests.factories import notification_settings, push_subscription


def every_stored_value() -> str:
    """Every row of every table as text (to search for a plain secret)."""
    out = []
    with connection.cursor() as cursor:
        for table in connection.introspection.table_names():
            cursor.execute(f'SELECT * FROM "{table}"')
            out.extend(repr(row) for row in cursor.fetchall())
    return "\n".join(out)


def test_k1_machine_token_and_pairing_code_are_stored_only_as_digests(owner, pinned):
    from tasks_app.models import Machine, PairingCode

    code = owner_api(owner).post("/api/machines/pairing-codes/", {"name": "mac"}, format="json").json()["code"]
    paired = Client().post("/api/worker/pair/", {"code": code}, content_type="application/json").json()
    token = paired["token"]
    machine = Machine.objects.get(pk=paired["machine_id"])
    assert machine.token_hash == hashlib.sha256(token.encode()).hexdigest()
    assert PairingCode.objects.get().code_hash == hashlib.sha256(code.encode()).hexdigest()
    stored = every_stored_value()
    assert token not in stored and code not in stored
    # and the digest is what authenticates: the token works, its digest does not
    assert Client().get("/api/worker/messages/?wait=0", HTTP_AUTHORIZATION=f"Machine {token}").status_code == 200
    assert Client().get("/api/worker/messages/?wait=0",
                        HTTP_AUTHORIZATION=f"Machine {machine.token_hash}").status_code == 401


def test_i1_hook_state_file_is_0600_in_a_0700_directory_whatever_the_umask(tmp_path):
    from machine.hooks import store

    old = os.umask(0)
    try:
        state = tmp_path / "hooks"
        path = store.write_config(state, server="http://127.0.0.1:8000", token="owner-token-1")
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        # a directory left group-readable is tightened; the file is replaced atomically, still 0600
        os.chmod(state, 0o755)
        path = store.write_config(state, server="http://127.0.0.1:8000", token="owner-token-2")
        assert stat.S_IMODE(os.stat(state).st_mode) == 0o700
        assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
        assert json.loads(path.read_text())["token"] == "owner-token-2"
    finally:
        os.umask(old)


def test_n2_webhook_secret_is_answered_once_and_the_vapid_private_key_never(owner, pinned):
    from notifications.models import VapidKey

    api = owner_api(owner)
    settings_body = {**notification_settings(), "webhook_url": "https://ntfy.example.com/topic"}
    first = api.put("/api/notifications/settings/", settings_body, format="json").json()
    secret = first["webhook_secret"]
    assert len(secret) == 64
    assert api.post("/api/push/subscriptions/", push_subscription(), format="json").status_code == 201
    public = api.get("/api/push/vapid-public-key/").json()["public_key"]
    private = VapidKey.objects.get().private_pem
    private_lines = [line for line in private.splitlines() if line and not line.startswith("-----")]
    assert private_lines
    again = api.put("/api/notifications/settings/", settings_body, format="json").json()
    assert "webhook_secret" not in again
    browser = Client()
    browser.force_login(owner)
    answers = [api.get(p).content.decode() for p in ("/api/notifications/settings/", "/api/board/",
                                                      "/api/push/vapid-public-key/", "/api/schema/")]
    answers += [json.dumps(again), browser.get("/").content.decode()]
    for text in answers:
        assert secret not in text
        assert not any(line in text for line in private_lines)
    assert public in answers[2]


@pytest.mark.slow
def test_k1_w5_no_secret_in_logs_agent_environment_board_events_or_pages(live_daphne, make_owner, tmp_path):  # noqa: F811
    """One full flow on a real daphne with a real worker; then every secret is searched
    for in every place it must never be."""
    from rest_framework.authtoken.models import Token
    from websockets.sync.client import connect

    from notifications.models import NotificationSettings, VapidKey
    from tests.worker_harness import PROFILES, SHORT_TIMINGS, LiveSetup
    from tests.wait import wait_for

    url = live_daphne(**SHORT_TIMINGS, RUNSTEAD_LOG_LEVEL="DEBUG", RUNSTEAD_OUTBOUND_ALLOW="127.0.0.0/8")  # K5

    def daphne_log() -> str:
        return "".join(p.read_text(errors="replace") for p in tmp_path.glob("daphne-*.log"))

    owner = make_owner()
    env_dump = tmp_path / "agent-env.json"
    live = LiveSetup(url, owner, tmp_path, profiles={**PROFILES, "envdump": {"AGENT_ENV_DUMP": str(env_dump),
                                                                               "AGENT_SLEEP_S": "0.5"}})
    try:
        events, stop = [], threading.Event()

        def listen():
            with connect(url.replace("http://", "ws://") + "/ws/board/",
                         additional_headers={"Authorization": f"Token {owner.auth_token.key}"}) as ws:
                while not stop.is_set():
                    try:
                        events.append(ws.recv(timeout=0.2))
                    except TimeoutError:
                        continue

        listener = threading.Thread(target=listen, daemon=True)
        listener.start()
        settings_body = {**notification_settings(), "webhook_url": "http://127.0.0.1:9/hook"}
        secret = live.api.put("/api/notifications/settings/", json=settings_body).json()["webhook_secret"]
        live.api.get("/api/push/vapid-public-key/")
        worker = live.start_worker()
        task_id = live.submit("envdump")
        task = live.wait_final(task_id)
        assert task["state"] == "succeeded", live.log()
        # refusals with stale credentials are logged as refusals, never with the credential
        stale = Token.objects.get(user=owner).key
        rotated = live.api.post("/api/token/rotate/").json()["token"]
        assert httpx.get(f"{url}/api/tasks/", headers={"Authorization": f"Token {stale}"}).status_code == 401
        machine_token = (live.state_dir / "token").read_text().strip()
        assert httpx.get(f"{url}/api/tasks/", headers={"Authorization": f"Machine {machine_token}"}).status_code == 403
        # Searched below once they are there: the board's event of the final state, and
        # daphne's log lines of both refusals (written just after their answers).
        wait_for(lambda: any(task_id in e and '"succeeded"' in e for e in list(events)), what="the succeeded event")
        wait_for(lambda: all(f'"GET /api/tasks/" {code}' in daphne_log() for code in (401, 403)),
                 what="the refusals in daphne's log")
        stop.set()
        listener.join(timeout=5)
        worker.terminate()
        worker.wait(timeout=20)
        assert NotificationSettings.objects.get(owner=owner).webhook_secret == secret
        private_lines = [line for line in VapidKey.objects.get().private_pem.splitlines()
                         if line and not line.startswith("-----")]
        secrets = {"owner token": stale, "rotated owner token": rotated, "machine token": machine_token,
                   "webhook secret": secret, **{f"VAPID private key line {i}": v for i, v in enumerate(private_lines)}}
        browser = Client()
        browser.force_login(owner)
        places = {
            "daphne log": daphne_log(),
            "worker log": live.log(),
            "agent environment": env_dump.read_text(),
            "board events": "\n".join(events),
            "board page": browser.get("/").content.decode(),
            "task page": browser.get(f"/tasks/{task_id}/").content.decode(),
            "task page data": browser.get(f"/tasks/{task_id}/data/").content.decode(),
        }
        assert len(events) >= 3 and json.loads(env_dump.read_text())["RUNSTEAD_OPERATION_ID"]
        assert places["daphne log"], "daphne logged nothing: the search would prove nothing"
        found = [(name, where) for name, value in secrets.items() for where, text in places.items() if value in text]
        assert found == []
    finally:
        live.close()
