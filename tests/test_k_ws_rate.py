"""K3: board WebSocket handshakes are rate-limited per owner and per client address
(a per-process brake, ``core.throttling.KeyedRate``), refused with close code 4429 after a
``rate_limited`` message; and a flood of 2,000 handshakes in 10 s from one owner leaves
the other owners' boards receiving their events as fast as before (real daphne, the
flood from its own process, from 20 client addresses, so the per-owner limit is the one
that holds and every refused handshake costs its token lookup)."""
import json
import os
import statistics
import subprocess
import sys
import threading
import time
import uuid
from contextlib import ExitStack
from datetime import datetime

import httpx
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from board.consumers import RATE_LIMITED_CLOSE_CODE
from core.throttling import KeyedRate, parse_rate
from tests.live import BASE_DIR, BoardSocket, live_daphne  # noqa: F401
from tests.wait import wait_for

pytestmark = pytest.mark.django_db(transaction=True)


# --- the brake -------------------------------------------------------------------------------


def test_k3_keyed_rate_passes_a_burst_then_one_per_interval():
    now = [100.0]
    rate = KeyedRate(clock=lambda: now[0])
    assert [rate.allow("a", "3/min")[0] for _ in range(4)] == [True, True, True, False]
    assert rate.allow("a", "3/min") == (False, pytest.approx(20.0))  # one token per 20 s
    assert rate.allow("b", "3/min") == (True, 0.0)  # keys are independent
    now[0] += 20
    assert rate.allow("a", "3/min")[0] and not rate.allow("a", "3/min")[0]
    assert parse_rate("120/min") == (120, 60.0) and parse_rate("5/s") == (5, 1.0)
    with pytest.raises(ValueError):
        parse_rate("many")


def test_k3_keyed_rate_remembers_a_bounded_number_of_keys():
    now = [0.0]
    rate = KeyedRate(max_keys=100, clock=lambda: now[0])
    for i in range(1_000):
        rate.allow(("addr", i), "10/s")
        now[0] += 0.001
    assert len(rate.buckets) <= 101


# --- on a real daphne ------------------------------------------------------------------------


def open_board(url, token, source, **kw):
    """A board socket as a terminal client from ``source`` (a loopback address)."""
    return connect(url.replace("http://", "ws://") + "/ws/board/", additional_headers={"Authorization": f"Token {token}"},
                   source_address=(source, 0), proxy=None, open_timeout=10, **kw)


def refused_as_rate_limited(ws) -> dict:
    """The one message of a refused socket, after which it is closed with 4429."""
    event = json.loads(ws.recv(timeout=5))
    with pytest.raises(ConnectionClosed) as closed:
        ws.recv(timeout=5)
    assert closed.value.rcvd.code == RATE_LIMITED_CLOSE_CODE
    return event


def test_k3_board_handshakes_limited_per_owner_and_per_address(live_daphne, make_owner):
    url = live_daphne(RUNSTEAD_WS_OWNER_RATE="3/min", RUNSTEAD_WS_ADDRESS_RATE="5/min")
    a, b = make_owner(), make_owner()
    with ExitStack() as held:
        for i in (1, 2, 3):  # owner a from 3 addresses: its 3 handshakes
            held.enter_context(open_board(url, a.auth_token.key, f"127.0.2.{i}"))
        with open_board(url, a.auth_token.key, "127.0.2.4") as fourth:
            event = refused_as_rate_limited(fourth)
        assert event == {"type": "rate_limited", "error": "rate_limited",
                         "detail": "too many connections, retry in 20 s", "retry_after_s": 20}
        with open_board(url, b.auth_token.key, "127.0.2.4") as other:  # another owner, same address: let in
            with pytest.raises(TimeoutError):
                other.recv(timeout=0.5)
        # Address 127.0.2.9: five handshakes of several owners pass, the sixth is refused
        # before authentication: a bogus token gets 4429, not the 403 of a bad credential.
        for o in [make_owner() for _ in range(5)]:
            held.enter_context(open_board(url, o.auth_token.key, "127.0.2.9"))
        with open_board(url, "not-a-token", "127.0.2.9") as sixth:
            assert refused_as_rate_limited(sixth)["retry_after_s"] == 12
        with pytest.raises(Exception, match="403"):
            open_board(url, "not-a-token", "127.0.2.10")  # elsewhere the same bogus token is a 403
    assert httpx.get(url + "/api/board/", headers={"Authorization": f"Token {a.auth_token.key}"}).status_code == 200


def event_latencies(url, owners, sockets, rounds: int, until: float | None = None) -> tuple[list, list]:
    """Marker writes through the API, round-robin over ``owners``. Returns, per write,
    the push latency (its ``marker`` event's arrival on that owner's board socket minus
    the event's ``server_time``, taken when the service sends it after commit) and the
    write's HTTP round trip, in seconds."""
    push, http = [], []
    with httpx.Client(base_url=url, timeout=30) as api:
        i = 0
        while i < rounds or (until is not None and time.monotonic() < until):
            owner, board = owners[i % len(owners)], sockets[i % len(owners)]
            turn = f"t-{uuid.uuid4().hex[:8]}"
            started = time.monotonic()
            response = api.put(f"/api/sessions/{uuid.uuid4()}/marker/", headers={"Authorization": f"Token {owner.auth_token.key}"},
                               json={"turn_id": turn, "device_id": "d1", "state": "running"})
            assert response.status_code == 200, response.text
            http.append(time.monotonic() - started)
            event = wait_for(lambda: next((e for e in list(board.events) if e.get("type") == "marker"
                                           and e.get("turn_id") == turn), None), timeout_s=10, what="the marker event")
            push.append(event["_at"] - datetime.fromisoformat(event["server_time"]).timestamp())
            i += 1
            time.sleep(0.05)
    return push, http


def p95(values):
    return statistics.quantiles(values, n=20, method="inclusive")[-1] if len(values) >= 2 else values[0]


@pytest.mark.slow
def test_k3_handshake_flood_of_one_owner_leaves_other_boards_as_fast(live_daphne, make_owner):
    url = live_daphne()  # the default rates
    port = int(url.rsplit(":", 1)[1])
    flooder, others = make_owner(), [make_owner() for _ in range(4)]
    sockets = [BoardSocket(url, o.auth_token.key) for o in others]
    for s in sockets:
        s.start()
    try:
        assert all(s.connected.wait(10) for s in sockets)
        event_latencies(url, others, sockets, rounds=8)  # warm-up
        baseline, baseline_http = event_latencies(url, others, sockets, rounds=40)
        flood = subprocess.Popen([sys.executable, "-m", "tests.ws_flood", str(port), flooder.auth_token.key, "2000", "10", "20"],
                                 cwd=BASE_DIR, stdout=subprocess.PIPE, text=True)
        measured: list = []
        measuring = threading.Thread(target=lambda: measured.extend(
            event_latencies(url, others, sockets, rounds=0, until=time.monotonic() + 10)))
        assert flood.stdout.readline().strip() == "under way"  # its first handshake was refused
        measuring.start()
        out, _ = flood.communicate(timeout=60)
        measuring.join(timeout=60)
        result = json.loads(out)
        during, during_http = measured
    finally:
        for s in sockets:
            s.stop()
    ms = lambda values: (f"p50 {statistics.median(values) * 1000:.0f} p95 {p95(values) * 1000:.0f} "  # noqa: E731
                         f"max {max(values) * 1000:.0f}")
    print(f"\nflood {result}, load average {os.getloadavg()[0]:.1f}\nother owners' board push latency ms: "
          f"baseline {ms(baseline)}; during the flood {ms(during)} ({len(during)} events)\n"
          f"their writes' HTTP round trip on the same daphne ms: baseline {ms(baseline_http)}; during {ms(during_http)}")
    assert result["sent"] == 2000 and result["elapsed_s"] <= 15, result
    # No handshake is refused with an HTTP status; a handful may fail on the flooding
    # client's side (a read past its 5 s on this loaded 2-core machine: seen once in 2,000
    # in CI), which is the client's limit, not the service's: at most 0.5 %.
    assert result["refused"] == 0 and result["errors"] <= 10, result
    assert result["rate_limited"] >= 2000 - 30 - 10 - result["errors"], result  # only the owner's burst of 30 (+ refill) let in
    assert len(during) >= 10
    # The other boards keep their push latency: the median as before (within 100 ms), the
    # tail under a second (the flood's handshakes cost daphne about 1.3 ms each, on a
    # machine shared with other work; see the figures printed above).
    assert statistics.median(during) <= statistics.median(baseline) + 0.1, (baseline, during)
    assert p95(during) < 1.0, (baseline, during)
