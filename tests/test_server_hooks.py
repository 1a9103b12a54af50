"""daphne start/stop hooks (config/server_hooks.py): a waiting long-poll must not hold a
stopping server for its 25 s (W2, O1 "Ctrl-C stops everything cleanly")."""
import threading
import time

import httpx

from tests.live import DaphneServer, live_daphne  # noqa: F401


def test_w2_waiting_long_poll_returns_when_the_server_stops(make_owner, make_machine, transactional_db):
    machine = make_machine(make_owner("poller"))
    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0"})
    answers = []

    def poll():
        try:
            answers.append(httpx.get(
                f"{server.url}/api/worker/messages/?wait=25",
                headers={"Authorization": f"Machine {machine.test_token}"}, timeout=30,
            ))
        except httpx.HTTPError as exc:
            answers.append(exc)

    poller = threading.Thread(target=poll)
    poller.start()
    time.sleep(1.0)  # the pull is now waiting inside the server
    started = time.monotonic()
    server.process.terminate()
    server.process.wait(timeout=20)
    took = time.monotonic() - started
    poller.join(5)
    assert took < 5, f"daphne needed {took:.1f} s to stop with a waiting long-poll"
    assert answers, "the long-poll did not return"
