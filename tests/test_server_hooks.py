"""daphne start/stop hooks (config/server_hooks.py): a waiting long-poll must not hold a
stopping server for its 25 s (W2, O1 "Ctrl-C stops everything cleanly")."""
import os
import selectors
import signal
import socket
import threading
import time

import httpx

from tests.live import DaphneServer


def test_w2_waiting_long_poll_returns_when_the_server_stops(make_owner, make_machine, transactional_db):
    machine = make_machine(make_owner("poller"))
    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0", "RUNSTEAD_LOG_LEVEL": "DEBUG"})
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
    try:
        server.wait_waiting(key=f"machine.{machine.id}")  # the pull is waiting inside the server
        started = time.monotonic()
        server.process.terminate()
        server.process.wait(timeout=20)
        took = time.monotonic() - started
        poller.join(5)
    finally:
        server.stop()
    assert took < 5, f"daphne needed {took:.1f} s to stop with a waiting long-poll"
    # The pull ended with the server: daphne closes its open connections as it stops, so
    # the worker sees a disconnection (and pulls again elsewhere), not a 25 s hang.
    assert len(answers) == 1, "the long-poll did not return"


def test_d1_the_server_freezes_its_start_up_heap_and_collects_fully_less_often():
    """Issue 22 (1,000 idle workers, board p99): once daphne runs, what start-up loaded
    (every view module of the URLconf included) is out of the collector's sight and a full
    collection waits for ``FULL_COLLECTION_EVERY`` young ones. In this process, then
    undone: the figures it buys are in bench/README.md."""
    import gc

    from config.server_hooks import FULL_COLLECTION_EVERY, _settle_heap

    threshold = gc.get_threshold()
    try:
        _settle_heap()
        assert gc.get_threshold() == (threshold[0], threshold[1], FULL_COLLECTION_EVERY)
        assert gc.get_freeze_count() > 10_000
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)


WAVE = 300  # connections at once: six times Twisted's default backlog


def test_d1_daphne_queues_a_wave_of_connections_it_cannot_accept_yet(transactional_db):
    """Issue 22 (1,000 workers reconnecting at once, every delivery under 1 s): daphne
    listens with ``RUNSTEAD_LISTEN_BACKLOG``, so the kernel queues a wave of connections
    while the server is busy instead of dropping them (each dropped one retries its SYN a
    second or more later). The server is stopped (SIGSTOP) while ``WAVE`` connections
    are made, so only the kernel's queue can complete them; with Twisted's default
    backlog of 50, 51 would complete and the rest hang."""
    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0", "RUNSTEAD_EMBEDDED_NOTIFY": "0"})
    selector, sockets, pending = selectors.DefaultSelector(), [], set()
    os.kill(server.process.pid, signal.SIGSTOP)
    try:
        for _ in range(WAVE):
            sock = socket.socket()
            sock.setblocking(False)
            sock.connect_ex(("127.0.0.1", server.port))
            sockets.append(sock)
            pending.add(sock)
            selector.register(sock, selectors.EVENT_WRITE)
        deadline = time.monotonic() + 10  # bounds a failure only: the queue completes them in milliseconds
        while pending and time.monotonic() < deadline:
            for key, _ in selector.select(timeout=0.2):
                assert key.fileobj.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR) == 0
                selector.unregister(key.fileobj)
                pending.discard(key.fileobj)
    finally:
        os.kill(server.process.pid, signal.SIGCONT)
        for sock in sockets:
            sock.close()
        server.stop()
    hung = len(pending)
    assert hung == 0, f"{hung} of {WAVE} connections were not queued while daphne could not accept"
