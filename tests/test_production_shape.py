"""D3 and O2 in CI's PostgreSQL + Redis pass: the production shape (gunicorn for /api/,
daphne for /ws/ and the long-poll, a proxy, a separate sweep) runs a real worker's task,
wakes a long-poll waiting in daphne from an acceptance in gunicorn, and pushes to a board
socket from a write in another process."""
import json
import threading
import time
import uuid

import httpx
import pytest
import websockets.sync.client as ws_client

from tests.production_shape import production_shape  # noqa: F401
from tests.worker_harness import SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


def test_d3_production_shape_runs_a_task_and_wakes_across_processes(production_shape, make_owner, owner, machine, grant, tmp_path):
    timings = {k: v for k, v in SHORT_TIMINGS.items() if k != "RUNSTEAD_EMBEDDED_SWEEP"}
    shape = production_shape(RUNSTEAD_LONGPOLL_RECHECK_S="30", RUNSTEAD_LOG_LEVEL="DEBUG", **timings)
    api = httpx.Client(base_url=shape.url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=15)

    # A pull waiting in daphne is woken by an acceptance that commits in gunicorn.
    answer = {}
    pull = threading.Thread(target=lambda: answer.update(r=httpx.get(
        f"{shape.url}/api/worker/messages/?wait=25", headers={"Authorization": f"Machine {machine.test_token}"}, timeout=35)))
    pull.start()
    shape.ws.wait_waiting(key=f"machine.{machine.id}")  # the pull waits in daphne: its first take found nothing
    sent = time.monotonic()
    resp = api.post("/api/tasks/", headers={"Idempotency-Key": uuid.uuid4().hex},
                    json={"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "p"})
    assert resp.status_code == 201, resp.text
    pull.join(10)
    assert [m["payload"]["task_id"] for m in answer["r"].json()["messages"]] == [resp.json()["id"]]
    assert time.monotonic() - sent < 3

    # A board socket on daphne gets the event of a marker written through gunicorn.
    with ws_client.connect(shape.url.replace("http", "ws") + "/ws/board/",
                           additional_headers={"Authorization": f"Token {owner.auth_token.key}"}) as sock:
        session_id = str(uuid.uuid4())
        marker = api.put(f"/api/sessions/{session_id}/marker/", json={"turn_id": "t1", "device_id": "d1", "state": "running"})
        assert marker.status_code == 200, marker.text
        while True:
            event = json.loads(sock.recv(timeout=5))
            if event.get("type") == "session.status" and event.get("session_id") == session_id:
                break

    # A real worker through the proxy runs a task to the end.
    live = LiveSetup(shape.url, make_owner(), tmp_path)
    try:
        live.start_worker()
        task_id = live.submit("quick")
        assert live.wait_final(task_id, timeout=30)["state"] == "succeeded"
    finally:
        live.close()
