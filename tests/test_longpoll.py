"""The worker long-poll against a real daphne (D1, D2): woken after commit, a safety
re-check, one poller per machine (a dead connection never hides a delivery), no thread
or database connection held while waiting, and a server that stops at once."""
import asyncio
import json
import os
import signal
import socket
import threading
import time
import uuid

import httpx
import psutil
import pytest

from tasks_app.models import OutboxMessage, Task
from tests.live import DaphneServer, live_daphne  # noqa: F401
from tests.worker_harness import LiveSetup

pytestmark = pytest.mark.slow


def _pull(url, token, wait=25, timeout=35):
    return httpx.get(f"{url}/api/worker/messages/?wait={wait}", headers={"Authorization": f"Machine {token}"}, timeout=timeout)


def _submit(url, owner, machine, folder):
    resp = httpx.post(
        f"{url}/api/tasks/", headers={"Authorization": f"Token {owner.auth_token.key}", "Idempotency-Key": uuid.uuid4().hex},
        json={"machine": str(machine.id), "folder": folder, "agent": "demo", "prompt": "p"}, timeout=15,
    )
    assert resp.status_code == 201, resp.text
    return resp.json()["id"]


class Background:
    """Run ``fn`` in a thread; ``result(timeout)`` returns its value or raises."""

    def __init__(self, fn, *args, **kwargs):
        self.value = self.error = None
        self.done = threading.Event()

        def run():
            try:
                self.value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout):
        assert self.done.wait(timeout), f"not done within {timeout} s"
        if self.error:
            raise self.error
        return self.value


def _wait_waiting(server_pid, port, count, timeout=10.0):
    """Until the server has ``count`` established client connections on ``port``."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        conns = [c for c in psutil.Process(server_pid).net_connections("tcp")
                 if c.status == "ESTABLISHED" and c.laddr.port == port]
        if len(conns) >= count:
            return
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} connections reached the server")


def test_d1_waiting_pull_wakes_after_commit_not_on_a_timer(live_daphne, owner, machine, grant):
    # Re-check every 30 s: only the after-commit notification can answer within 3 s.
    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="30")
    port = int(url.rsplit(":", 1)[1])
    pull = Background(_pull, url, machine.test_token)
    server_pid = [p for p in psutil.process_iter(["cmdline"]) if f"{port}" in " ".join(p.info["cmdline"] or [])][0].pid
    _wait_waiting(server_pid, port, 1)
    time.sleep(0.3)  # the pull has passed its first take and waits
    sent = time.monotonic()
    task_id = _submit(url, grant.owner, machine, grant.path)
    answer = pull.result(10)
    took = time.monotonic() - sent
    assert answer.status_code == 200
    assert [m["payload"]["task_id"] for m in answer.json()["messages"]] == [task_id]
    assert took < 3, f"delivered {took:.2f} s after the submit"


def test_d1_safety_recheck_finds_a_message_nobody_announced(live_daphne, owner, machine, grant):
    from django.utils import timezone

    from tests.factories import submit

    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="0.5")
    task_id = submit(owner, machine, grant.path).json()["id"]
    hidden = OutboxMessage.objects.filter(operation__task_id=task_id)
    hidden.update(acked_at=timezone.now())  # the pull's first take does not see it
    pull = Background(_pull, url, machine.test_token)
    time.sleep(1.0)  # the pull waits
    hidden.update(acked_at=None)  # visible again, and no notification sent
    answer = pull.result(5)
    assert [m["payload"]["task_id"] for m in answer.json()["messages"]] == [task_id]


def test_d1_new_pull_gets_delivered_but_unacked_messages_at_once(live_daphne, owner, machine, grant):
    url = live_daphne()  # visibility window 60 s
    task_id = _submit(url, grant.owner, machine, grant.path)
    first = _pull(url, machine.test_token, wait=0).json()["messages"]
    assert [m["payload"]["task_id"] for m in first] == [task_id]
    started = time.monotonic()
    again = _pull(url, machine.test_token, wait=25).json()["messages"]
    assert [m["id"] for m in again] == [first[0]["id"]]
    assert time.monotonic() - started < 2
    httpx.post(f"{url}/api/worker/messages/{first[0]['id']}/ack/", headers={"Authorization": f"Machine {machine.test_token}"})
    assert OutboxMessage.objects.get(pk=first[0]["id"]).deliveries == 2


class BlackholeProxy:
    """A TCP proxy to ``port``; ``blackhole()`` stops forwarding both ways and closes
    nothing: a half-open connection, as after a Wi-Fi drop."""

    def __init__(self, port):
        self.target = port
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.port = self.listener.getsockname()[1]
        self.holes = threading.Event()
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src, dst):
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.holes.is_set():
                continue  # dropped on the floor; the connection stays open
            try:
                dst.sendall(data)
            except OSError:
                return

    def blackhole(self):
        self.holes.set()

    def close(self):
        self.listener.close()
        for s in self.sockets:
            s.close()


def test_d1_blackholed_pull_connection_delivers_within_seconds_of_the_next_pull(live_daphne, owner, machine, grant):
    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="30")  # visibility window 60 s
    port = int(url.rsplit(":", 1)[1])
    proxy = BlackholeProxy(port)
    try:
        dead = Background(_pull, f"http://127.0.0.1:{proxy.port}", machine.test_token, 25, 3)
        server_pid = [p for p in psutil.process_iter(["cmdline"]) if f"{port}" in " ".join(p.info["cmdline"] or [])][0].pid
        _wait_waiting(server_pid, port, 1)
        time.sleep(0.3)
        proxy.blackhole()
        task_id = _submit(url, grant.owner, machine, grant.path)  # the dead pull takes it; the answer is lost
        with pytest.raises(httpx.ReadTimeout):
            dead.result(10)
        started = time.monotonic()
        answer = _pull(url, machine.test_token, wait=25).json()["messages"]
        took = time.monotonic() - started
        assert [m["payload"]["task_id"] for m in answer] == [task_id]
        assert took < 5, f"the next pull needed {took:.1f} s"
        assert OutboxMessage.objects.get(pk=answer[0]["id"]).deliveries == 2  # the lost one, and this one
    finally:
        proxy.close()


def test_d1_kill9_worker_with_a_waiting_pull_then_restart_delivers_within_5s(live_daphne, make_owner, tmp_path):
    url = live_daphne(RUNSTEAD_EMBEDDED_SWEEP="1", RUNSTEAD_LONGPOLL_RECHECK_S="30")
    port = int(url.rsplit(":", 1)[1])
    live = LiveSetup(url, make_owner(), tmp_path)
    try:
        env = {"RUNSTEAD_WORKER_POLL_S": "25"}
        worker = live.start_worker(env=env)
        end = time.monotonic() + 20
        while not [c for c in psutil.Process(worker.pid).net_connections("tcp") if c.raddr and c.raddr.port == port]:
            assert time.monotonic() < end, live.log()
            time.sleep(0.05)
        time.sleep(0.5)  # its pull waits in the server
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        worker = live.start_worker(env=env)
        end = time.monotonic() + 20
        while not [c for c in psutil.Process(worker.pid).net_connections("tcp") if c.raddr and c.raddr.port == port]:
            assert time.monotonic() < end, live.log()
            time.sleep(0.05)
        task_id = live.submit("quick")
        live.wait_state(task_id, ("delivered", "starting", "running", "succeeded"), timeout=5)
    finally:
        live.close()


def _threads(pid) -> int:
    return psutil.Process(pid).num_threads()


def test_d2_waiting_pulls_hold_no_thread_and_no_database_connection(live_daphne, owner, make_machine, grant):
    # A pool of 4 connections on PostgreSQL: 60 waiting pulls must not take them.
    url = live_daphne(RUNSTEAD_DB_POOL_MAX="4")
    port = int(url.rsplit(":", 1)[1])
    server_pid = [p for p in psutil.process_iter(["cmdline"]) if f"{port}" in " ".join(p.info["cmdline"] or [])][0].pid
    machines = [make_machine(owner, name=f"m{i}") for i in range(60)]
    httpx.get(f"{url}/api/budget/", headers={"Authorization": f"Token {owner.auth_token.key}"})
    before = _threads(server_pid)
    pulls = [Background(_pull, url, m.test_token) for m in machines]
    _wait_waiting(server_pid, port, 60)
    time.sleep(1.0)
    during = _threads(server_pid)
    started = time.monotonic()
    resp = httpx.get(f"{url}/api/budget/", headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10)
    assert resp.status_code == 200
    assert time.monotonic() - started < 2
    assert during - before < 10, f"threads {before} -> {during} with 60 waiting pulls"
    assert all(not p.done.is_set() for p in pulls)


def test_d3_daphne_exits_within_seconds_of_sigterm_with_waiting_pulls_and_open_sockets(owner, make_machine, transactional_db):
    import contextlib

    import websockets.sync.client as ws_client

    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0"})
    try:
        machines = [make_machine(owner, name=f"m{i}") for i in range(10)]
        pulls = [Background(_pull, server.url, m.test_token) for m in machines]
        sockets = contextlib.ExitStack()
        for _ in range(5):
            sockets.enter_context(ws_client.connect(server.url.replace("http", "ws") + "/ws/board/",
                                                    additional_headers={"Authorization": f"Token {owner.auth_token.key}"}))
        _wait_waiting(server.process.pid, server.port, 15)
        started = time.monotonic()
        server.process.terminate()
        server.process.wait(timeout=20)
        took = time.monotonic() - started
        assert took < 5, f"daphne needed {took:.1f} s to stop"
        for p in pulls:
            p.done.wait(5)
        sockets.close()
    finally:
        server.stop()


@pytest.mark.postgres
def test_d1_200_waiting_workers_owner_answers_and_task_arrives_within_1s(live_daphne, owner, grant, make_machine, django_db_blocker):
    from tasks_app.auth import token_digest
    from tasks_app.models import Grant, Machine

    url = live_daphne()
    port = int(url.rsplit(":", 1)[1])
    tokens = [f"t-{i}-{uuid.uuid4().hex}" for i in range(200)]
    machines = Machine.objects.bulk_create(
        [Machine(owner=owner, name=f"w{i}", generation=1, token_hash=token_digest(t), paired=True) for i, t in enumerate(tokens)]
    )
    Grant.objects.bulk_create([Grant(owner=owner, machine=m, path=grant.path) for m in machines])
    got: dict = {}

    async def worker(i, stop):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        head = (f"GET /api/worker/messages/?wait=25 HTTP/1.1\r\nHost: x\r\nAuthorization: Machine {tokens[i]}\r\n\r\n").encode()
        while not stop.is_set():
            writer.write(head)
            status = await reader.readline()
            length = 0
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            body = json.loads(await reader.readexactly(length))
            assert b"200" in status, status
            for m in body["messages"]:
                got.setdefault(m["payload"]["task_id"], time.monotonic())
        writer.close()

    async def scenario():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker(i, stop)) for i in range(200)]
        await asyncio.sleep(3)
        async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}) as http:
            for k in range(5):
                t0 = time.monotonic()
                assert (await http.get("/api/budget/")).status_code == 200
                answered = time.monotonic() - t0
                assert answered < 1, f"owner request took {answered:.2f} s"
                target = machines[k * 37]
                t0 = time.monotonic()
                resp = await http.post("/api/tasks/", headers={"Idempotency-Key": uuid.uuid4().hex},
                                       json={"machine": str(target.id), "folder": grant.path, "agent": "demo", "prompt": "p",
                                             "exclusive": False})
                assert resp.status_code == 201, resp.text
                task_id = resp.json()["id"]
                while task_id not in got and time.monotonic() - t0 < 5:
                    await asyncio.sleep(0.02)
                assert task_id in got, "task never reached its worker"
                assert got[task_id] - t0 < 1, f"task reached its worker after {got[task_id] - t0:.2f} s"
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    assert Task.objects.filter(owner=owner).count() == 5


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_d1_pull_whose_client_disconnects_during_its_take_releases_the_message(owner, machine, grant, monkeypatch):
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from tasks_app import longpoll
    from tests.factories import submit

    task_id = (await sync_to_async(submit)(owner, machine, grant.path)).json()["id"]
    hidden = OutboxMessage.objects.filter(operation__task_id=task_id)
    await hidden.aupdate(acked_at=timezone.now())  # the pull's first take finds nothing and waits
    gone = asyncio.Event()
    sent = []

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": longpoll.PATH, "method": "GET", "query_string": b"wait=25", "root_path": "",
             "headers": [(b"authorization", f"Machine {machine.test_token}".encode()), (b"host", b"testserver")],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    from tasks_app.services import messages

    loop = asyncio.get_running_loop()
    take = messages.messages_take

    def take_then_client_gone(**kwargs):
        taken = take(**kwargs)
        if taken:
            loop.call_soon_threadsafe(gone.set)  # the client goes away while the take runs
            time.sleep(0.3)
        return taken

    monkeypatch.setattr(messages, "messages_take", take_then_client_gone)
    pull = asyncio.create_task(longpoll.long_poll(scope, receive, send))
    registry = longpoll.waiters()  # this loop's registry, the one the pull registers in
    for _ in range(200):
        if str(machine.pk) in registry.by_machine:
            break
        await asyncio.sleep(0.02)
    assert str(machine.pk) in registry.by_machine, "the pull never waited"
    await hidden.aupdate(acked_at=None)
    registry.wake(str(machine.pk))
    await asyncio.wait_for(pull, 5)
    assert sent == []  # nothing was answered to a client that is gone
    message = await hidden.aget()
    assert message.deliveries == 1  # it was taken...
    assert message.acked_at is None and message.visible_at <= timezone.now(), "...and must be visible again"
    assert str(machine.pk) not in registry.by_machine
    from django.db import connections

    await sync_to_async(connections.close_all)()  # the ORM's thread: no session left at teardown
