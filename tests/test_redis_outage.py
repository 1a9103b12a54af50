"""A Redis outage (D, B2): acceptance, receipts and renewals never depend on Redis; a board
handshake during the outage never answers 500 (it opens and closes with the "retry"
code); once Redis is back, the first handshake works and gets events.

The outage test runs its own ``redis-server`` on a free port and stops and starts it; it
never touches the shared one. The two channel-layer tests after it (D1, B2: a quiet
receive, a cancelled receive) use the configured layer on the shared Redis.
"""
import asyncio
import json
import subprocess
import time
import uuid

import httpx
import pytest
import websockets.sync.client as ws_client
from channels.layers import get_channel_layer
from channels_redis.core import RedisChannelLayer
from websockets.exceptions import ConnectionClosed

from board.consumers import LAYER_DOWN_CLOSE_CODE
from tests.live import free_port, live_daphne  # noqa: F401
from tests.wait import wait_for

pytestmark = [pytest.mark.postgres, pytest.mark.slow]


class PrivateRedis:
    def __init__(self):
        self.port = free_port()
        self.process = None
        self.start()

    def start(self):
        self.process = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        wait_for(lambda: subprocess.run(["redis-cli", "-p", str(self.port), "ping"], capture_output=True,
                                        text=True).stdout.strip(), until=lambda answer: answer == "PONG", timeout_s=10,
                 what="the private redis-server to start")

    def stop(self):
        self.process.terminate()
        self.process.wait(10)


def _board(url, token):
    return ws_client.connect(url.replace("http", "ws") + "/ws/board/", additional_headers={"Authorization": f"Token {token}"},
                             open_timeout=10)


def _status_event(sock, session_id, timeout=5.0):
    end = time.monotonic() + timeout
    while True:
        event = json.loads(sock.recv(timeout=max(0.01, end - time.monotonic())))
        if event.get("type") == "session.status" and event.get("session_id") == session_id:
            return event


def _marker(api, session_id):
    resp = api.put(f"/api/sessions/{session_id}/marker/",
                   json={"turn_id": uuid.uuid4().hex, "device_id": "dev-1", "state": "running"})
    assert resp.status_code == 200, resp.text


def test_d_redis_outage_acceptance_receipts_renewals_work_and_board_never_500s(live_daphne, owner, machine, grant):
    redis = PrivateRedis()
    try:
        url = live_daphne(REDIS_URL=f"redis://127.0.0.1:{redis.port}/0", RUNSTEAD_LONGPOLL_RECHECK_S="0.5")
        api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=15)
        worker = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=15)
        with _board(url, owner.auth_token.key) as sock:
            session_id = str(uuid.uuid4())
            _marker(api, session_id)
            assert _status_event(sock, session_id)["status"] == "busy"

        redis.stop()
        for attempt in range(3):
            resp = api.post("/api/tasks/", headers={"Idempotency-Key": uuid.uuid4().hex},
                            json={"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "p",
                                  "exclusive": False})
            assert resp.status_code == 201, resp.text
            task_id = resp.json()["id"]
            # The long-poll finds it through its re-check (no wake-up over Redis).
            pulled = worker.get("/api/worker/messages/?wait=5").json()["messages"]
            assert [m["payload"]["task_id"] for m in pulled] == [task_id]
            assert worker.post(f"/api/worker/messages/{pulled[0]['id']}/ack/", json={}).status_code == 200
            lease = worker.post("/api/worker/leases/", json={"operation_id": pulled[0]["operation_id"]})
            assert lease.status_code == 201, lease.text
            renewed = worker.post(f"/api/worker/leases/{lease.json()['lease_id']}/renew/", json={})
            assert renewed.status_code == 200, renewed.text
            receipt = worker.post("/api/worker/receipts/", json={
                "event_id": str(uuid.uuid4()), "generation": machine.generation, "operation_id": pulled[0]["operation_id"],
                "kind": "starting", "slept_s": 0, "facts": {}})
            assert receipt.status_code == 200, receipt.text
            # A handshake during the outage opens (no 500) and closes with the retry code.
            with _board(url, owner.auth_token.key) as sock:
                with pytest.raises(ConnectionClosed) as closed:
                    sock.recv(timeout=10)
                assert closed.value.rcvd.code == LAYER_DOWN_CLOSE_CODE

        redis.start()
        # Recovery on the first try: this handshake stays open and carries events.
        with _board(url, owner.auth_token.key) as sock:
            session_id = str(uuid.uuid4())
            _marker(api, session_id)
            assert _status_event(sock, session_id)["status"] == "busy"
    finally:
        redis.stop()


# redis-py 8's default read (and write) timeout, which channels_redis's 5 s blocking
# receive ran into (redis/redis-py#4091).
REDIS_PY_DEFAULT_TIMEOUT_S = 5


@pytest.mark.asyncio
@pytest.mark.usefixtures("fresh_layer")
async def test_d1_b2_a_quiet_channels_receive_outlasts_the_clients_default_read_timeout():
    """channels_redis receives with a blocking ``BZPOPMIN`` of 5 s; under redis-py 8's
    default read timeout (also 5 s) a quiet channel's read failed instead, and each
    failure closed the board's sockets and made the long-poll join every group of its
    process again. Here the layer's own receive (without the retry, which would hide a
    failure) is still waiting 1 s past that timeout, and the same channel then gets a
    message."""
    layer = get_channel_layer()
    assert isinstance(layer, RedisChannelLayer)
    channel = await layer.new_channel()
    with pytest.raises(TimeoutError):  # ours, not redis' "Timeout reading from ..."
        await asyncio.wait_for(RedisChannelLayer.receive(layer, channel), REDIS_PY_DEFAULT_TIMEOUT_S + 1)
    await layer.send(channel, {"type": "still.here"})
    assert (await asyncio.wait_for(layer.receive(channel), 5))["type"] == "still.here"


@pytest.mark.asyncio
@pytest.mark.usefixtures("fresh_layer")
async def test_d1_b2_a_cancelled_receive_ends_wherever_the_cancel_lands():
    """A board socket's or the long-poll's receive is cancelled when its socket or its
    event loop closes. With a client-side socket timeout, redis-py sends each command
    through ``asyncio.wait_for``, which on Python 3.11 loses a cancellation that lands as
    the send completes (CPython gh-86296): the receive went on blocking, and a closing
    loop waited for it until a read timeout, or forever. Here receives are cancelled after
    0, 1, 2, ... turns of the event loop, so the cancel lands on every step of the first
    commands; each ends at once."""
    layer = get_channel_layer()
    for round_ in range(3):
        for turns in range(40):
            receiving = asyncio.ensure_future(layer.receive(await layer.new_channel()))
            for _ in range(turns):
                await asyncio.sleep(0)
            receiving.cancel()
            done, _ = await asyncio.wait({receiving}, timeout=1)
            if not done:
                await asyncio.wait({receiving}, timeout=REDIS_PY_DEFAULT_TIMEOUT_S * 3)
            assert done, f"the receive cancelled after {turns} turns (round {round_}) went on"
