"""The worker long-poll against a real daphne (D1, D2): woken after commit, a safety
re-check, one poller per machine (a dead connection never hides a delivery), no thread
or database connection held while waiting, and a server that stops at once."""
import asyncio
import json
import os
import signal
import time
import uuid

import httpx
import psutil
import pytest

from tasks_app.models import Grant, Machine, OutboxMessage, Task
from tests.live import Background, DaphneServer, live_daphne  # noqa: F401  (live_daphne: a fixture)
from tests.wait import wait_for, wait_for_async
from tests.worker_harness import LiveSetup
from tests.proxies import BlackholeProxy

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


DEBUG = {"RUNSTEAD_LOG_LEVEL": "DEBUG"}  # core.longpoll logs each wait that begins waiting


def _key(machine) -> str:
    from tasks_app.services.transitions import outbox_key

    return outbox_key(machine.id)


def test_d1_waiting_pull_wakes_after_commit_not_on_a_timer(live_daphne, owner, machine, grant):
    # Re-check every 30 s: only the after-commit notification can answer within 3 s.
    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="30", **DEBUG)
    pull = Background(_pull, url, machine.test_token)
    live_daphne.servers[-1].wait_waiting(key=_key(machine))  # its first take found nothing
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

    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="0.5", **DEBUG)
    task_id = submit(owner, machine, grant.path).json()["id"]
    hidden = OutboxMessage.objects.filter(operation__task_id=task_id)
    hidden.update(acked_at=timezone.now())  # the pull's first take does not see it
    pull = Background(_pull, url, machine.test_token)
    live_daphne.servers[-1].wait_waiting(key=_key(machine))  # the first take saw nothing
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


def test_d1_blackholed_pull_connection_delivers_within_seconds_of_the_next_pull(live_daphne, owner, machine, grant):
    url = live_daphne(RUNSTEAD_LONGPOLL_RECHECK_S="30", **DEBUG)  # visibility window 60 s
    proxy = BlackholeProxy(int(url.rsplit(":", 1)[1]))
    try:
        dead = Background(_pull, f"http://127.0.0.1:{proxy.port}", machine.test_token, 25, 3)
        live_daphne.servers[-1].wait_waiting(key=_key(machine))
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


def test_d1_a_waiting_answer_carries_the_security_headers_every_api_answer_has(live_daphne, owner, machine, grant):
    """The router answers ``?wait=`` requests without Django's middleware (its thread would
    be held for the whole wait), but not without its headers: an answer at once, one that
    began with keep-alives, and the same route without ``?wait=`` (through the middleware)
    say the same ``X-Frame-Options``, ``nosniff``, ``Referrer-Policy`` and COOP."""
    url = live_daphne(RUNSTEAD_LONGPOLL_KEEPALIVE_S="0.3")
    plain = httpx.get(f"{url}/api/worker/messages/", headers={"Authorization": f"Machine {machine.test_token}"},
                      timeout=10)
    at_once, streamed = _pull(url, machine.test_token, wait=0), _pull(url, machine.test_token, wait=1)
    assert streamed.content.startswith(b" "), "the keep-alive began this answer"
    names = ("x-frame-options", "x-content-type-options", "referrer-policy", "cross-origin-opener-policy")
    expected = {name: plain.headers.get(name) for name in names}
    assert expected == {"x-frame-options": "DENY", "x-content-type-options": "nosniff",
                        "referrer-policy": "same-origin", "cross-origin-opener-policy": "same-origin"}
    for answer in (at_once, streamed):
        assert answer.status_code == 200
        assert {name: answer.headers.get(name) for name in names} == expected


def test_d1_waiting_pull_sends_a_space_every_keepalive_interval(live_daphne, owner, machine, grant):
    """While it waits, the pull's body is spaces, one per keep-alive interval (0.3 s here),
    then the JSON: a client reading with an inactivity timeout shorter than the wait keeps
    a healthy pull; the answer parses as JSON."""
    url = live_daphne(RUNSTEAD_LONGPOLL_KEEPALIVE_S="0.3")
    started = time.monotonic()
    answer = _pull(url, machine.test_token, wait=2, timeout=httpx.Timeout(10, read=1.0))
    assert answer.status_code == 200 and time.monotonic() - started >= 1.5  # 2 s less its end jitter
    assert answer.headers["content-type"] == "application/json" and "content-length" not in answer.headers
    spaces = len(answer.content) - len(answer.content.lstrip(b" "))
    assert 3 <= spaces <= 7, answer.content  # about 1.6-2 s / 0.3 s, never one per read
    assert answer.json() == {"messages": []}


def test_d1_worker_gives_up_a_half_open_pull_by_its_silence_and_gets_the_task_within_seconds(live_daphne, make_owner, tmp_path):
    """A task submitted while the worker's pull sits on a half-open connection reaches the
    worker within seconds, not at the end of the wait: the waiting pull sends a space
    every keep-alive interval, and the worker gives up a pull silent for longer (here
    0.3 s and 1.5 s; by default 3 s and 7 s, so under 10 s). The lost answer is delivered
    again to the next pull, and the task runs to its end."""
    url = live_daphne(RUNSTEAD_LONGPOLL_KEEPALIVE_S="0.3", RUNSTEAD_LONGPOLL_RECHECK_S="30", **DEBUG)
    server = live_daphne.servers[-1]
    proxy = BlackholeProxy(int(url.rsplit(":", 1)[1]))
    live = LiveSetup(f"http://127.0.0.1:{proxy.port}", make_owner(), tmp_path)
    try:
        live.start_worker(env={"RUNSTEAD_WORKER_POLL_S": "25", "RUNSTEAD_WORKER_PULL_IDLE_S": "1.5",
                               "RUNSTEAD_WORKER_BACKOFF_BASE_S": "0.2"})
        server.wait_waiting(key=f"machine.{live.machine_id}", timeout=20)
        assert proxy.blackhole(b"GET /api/worker/messages/") >= 1  # the waiting pull's connection
        submitted = time.monotonic()
        task_id = live.submit("quick")
        live.wait_state(task_id, ("running", "succeeded"), timeout=10)
        took = time.monotonic() - submitted
        assert took < 5, f"the worker had the task {took:.1f} s after the submit (its pull waits 25 s)"
        live.wait_state(task_id, "succeeded", timeout=20)
        message = OutboxMessage.objects.get(operation__task_id=task_id, kind="start")
        assert message.deliveries == 2  # the answer lost on the dead connection, and the next pull's
    finally:
        live.close()
        proxy.close()


def test_d1_kill9_worker_with_a_waiting_pull_then_restart_delivers_within_5s(live_daphne, make_owner, tmp_path):
    url = live_daphne(RUNSTEAD_EMBEDDED_SWEEP="1", RUNSTEAD_LONGPOLL_RECHECK_S="30", **DEBUG)
    server = live_daphne.servers[-1]
    live = LiveSetup(url, make_owner(), tmp_path)
    key = f"machine.{live.machine_id}"
    try:
        env = {"RUNSTEAD_WORKER_POLL_S": "25"}
        worker = live.start_worker(env=env)
        server.wait_waiting(key=key, timeout=20)  # its pull waits in the server
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(10)
        worker = live.start_worker(env=env)
        server.wait_waiting(2, key=key, timeout=20)  # the new worker's pull waits
        task_id = live.submit("quick")
        live.wait_state(task_id, ("delivered", "starting", "running", "succeeded"), timeout=5)
    finally:
        live.close()


def _threads(pid) -> int:
    return psutil.Process(pid).num_threads()


def test_d2_waiting_pulls_hold_no_thread_and_no_database_connection(live_daphne, owner, make_machine, grant):
    # A pool of 4 connections on PostgreSQL: 60 waiting pulls must not take them.
    url = live_daphne(RUNSTEAD_DB_POOL_MAX="4", **DEBUG)
    server = live_daphne.servers[-1]
    machines = [make_machine(owner, name=f"m{i}") for i in range(60)]
    httpx.get(f"{url}/api/budget/", headers={"Authorization": f"Token {owner.auth_token.key}"})
    before = _threads(server.process.pid)
    pulls = [Background(_pull, url, m.test_token) for m in machines]
    server.wait_waiting(60)  # 60 machines' pulls wait
    during = _threads(server.process.pid)
    started = time.monotonic()
    resp = httpx.get(f"{url}/api/budget/", headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10)
    assert resp.status_code == 200
    assert time.monotonic() - started < 2
    assert during - before < 10, f"threads {before} -> {during} with 60 waiting pulls"
    assert all(not p.done.is_set() for p in pulls)


def test_d3_daphne_exits_within_seconds_of_sigterm_with_waiting_pulls_and_open_sockets(owner, make_machine, transactional_db):
    import contextlib

    import websockets.sync.client as ws_client

    server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0", **DEBUG})
    try:
        machines = [make_machine(owner, name=f"m{i}") for i in range(10)]
        pulls = [Background(_pull, server.url, m.test_token) for m in machines]
        sockets = contextlib.ExitStack()
        for _ in range(5):
            sockets.enter_context(ws_client.connect(server.url.replace("http", "ws") + "/ws/board/",
                                                    additional_headers={"Authorization": f"Token {owner.auth_token.key}"}))
        server.wait_waiting(10)  # the 10 pulls wait; the 5 sockets are open (connect returned)
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

    url = live_daphne(**DEBUG)
    server = live_daphne.servers[-1]
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
            length, chunked = 0, False
            while (line := await reader.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
                chunked = chunked or line.lower().startswith(b"transfer-encoding: chunked")
            if chunked:  # a pull that waited past a keep-alive interval (D1)
                raw = b""
                while size := int((await reader.readline()).strip(), 16):
                    raw += await reader.readexactly(size)
                    await reader.readline()
                await reader.readline()
            else:
                raw = await reader.readexactly(length)
            body = json.loads(raw)
            assert b"200" in status, status
            for m in body["messages"]:
                got.setdefault(m["payload"]["task_id"], time.monotonic())
        writer.close()

    async def scenario():
        stop = asyncio.Event()
        tasks = [asyncio.create_task(worker(i, stop)) for i in range(200)]
        await asyncio.to_thread(server.wait_waiting, 200, timeout=30)  # all 200 pulls wait
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
                await wait_for_async(lambda: task_id in got, timeout_s=5, interval_s=0.02, what="the task at its worker")
                assert got[task_id] - t0 < 1, f"task reached its worker after {got[task_id] - t0:.2f} s"
        stop.set()
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(scenario())
    assert Task.objects.filter(owner=owner).count() == 5


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_d1_a_pulls_answer_is_rendered_on_the_event_loop_not_in_a_thread(owner, machine, grant, monkeypatch):
    """Issue 44 (1,000 idle workers end about 40 pulls a second): the pull's ``render``
    reads only the messages its take loaded (``LongPoll(render_in_thread=False)``), so the
    router renders the answer on the event loop, without a thread hop."""
    import threading

    from asgiref.sync import sync_to_async
    from django.db import connections

    from config.asgi import application
    from tasks_app import shapes
    from tests.factories import submit

    task_id = (await sync_to_async(submit)(owner, machine, grant.path)).json()["id"]
    rendered_in, sent = [], []
    render_one = shapes.message_dict

    def spied(message):
        rendered_in.append(threading.current_thread())
        return render_one(message)

    monkeypatch.setattr(shapes, "message_dict", spied)

    async def receive():
        await asyncio.Event().wait()  # the client stays

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "path": "/api/worker/messages/", "method": "GET", "query_string": b"wait=25", "root_path": "",
             "headers": [(b"authorization", f"Machine {machine.test_token}".encode()), (b"host", b"testserver")],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    await asyncio.wait_for(application(scope, receive, send), 10)
    assert sent[0]["status"] == 200
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert [m["payload"]["task_id"] for m in body["messages"]] == [task_id]
    assert rendered_in == [threading.current_thread()]  # the event loop's own thread
    await sync_to_async(connections.close_all)()  # the ORM's thread: no session left at teardown


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
async def test_d1_pull_whose_client_disconnects_during_its_take_releases_the_message(owner, machine, grant, monkeypatch):
    from asgiref.sync import sync_to_async
    from django.utils import timezone

    from config.asgi import application
    from core.longpoll.registry import wake, waiting
    from tasks_app.services import messages
    from tasks_app.services.transitions import outbox_key
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

    scope = {"type": "http", "path": "/api/worker/messages/", "method": "GET", "query_string": b"wait=25", "root_path": "",
             "headers": [(b"authorization", f"Machine {machine.test_token}".encode()), (b"host", b"testserver")],
             "client": ("127.0.0.1", 1), "server": ("testserver", 80)}
    loop = asyncio.get_running_loop()
    take = messages.messages_take

    def take_then_client_gone(**kwargs):
        taken = take(**kwargs)
        if taken:
            loop.call_soon_threadsafe(gone.set)  # the client goes away while the take runs...
            # ...and the request ends before the take returns
            wait_for(pull.done, timeout_s=5, interval_s=0.01, what="the request to end on the disconnect")
        return taken

    monkeypatch.setattr(messages, "messages_take", take_then_client_gone)
    key = outbox_key(machine.pk)
    pull = asyncio.create_task(application(scope, receive, send))

    def pull_waits() -> int:
        assert not pull.done(), "the pull never waited"
        return waiting(key)

    await wait_for_async(pull_waits, timeout_s=5, interval_s=0.01, what="the pull to wait")
    await hidden.aupdate(acked_at=None)
    wake(key)  # as the after-commit notification would
    await asyncio.wait_for(pull, 5)
    assert sent == []  # nothing was answered to a client that is gone
    message = await wait_for_async(hidden.aget, until=lambda m: m.visible_at <= timezone.now(), timeout_s=5,
                                   interval_s=0.02, what="the release of the message taken for the gone client")
    assert message.deliveries == 1 and message.acked_at is None  # taken once, and visible again
    assert waiting(key) == 0
    from django.db import connections

    await sync_to_async(connections.close_all)()  # the ORM's thread: no session left at teardown


@pytest.mark.django_db
def test_w5_d1_release_gives_back_only_what_that_pull_still_holds(owner, machine, grant, pinned):
    """``messages_release`` of a superseded or abandoned pull: a message that a newer
    pull has taken since stays with the newer pull (nothing delivered twice); one the
    pull still holds is visible again at once."""
    from django.utils import timezone

    from tasks_app.services.messages import messages_release, messages_take
    from tests.factories import submit

    submit(owner, machine, grant.path)
    older = messages_take(machine_id=machine.pk, now=timezone.now(), new_pull=True)
    pinned.shift(1)
    newer = messages_take(machine_id=machine.pk, now=timezone.now(), new_pull=True)
    assert [m.pk for m in older] == [m.pk for m in newer] and len(older) == 1
    assert messages_release(machine_id=machine.pk, taken=older) == 0
    held = OutboxMessage.objects.get(pk=older[0].pk)
    assert held.visible_at == newer[0].visible_at > timezone.now()  # still the newer pull's
    assert messages_release(machine_id=machine.pk, taken=newer) == 1
    assert OutboxMessage.objects.get(pk=older[0].pk).visible_at == timezone.now()
    assert messages_take(machine_id=machine.pk, now=timezone.now(), new_pull=False) != []


def test_d1_pulls_begun_together_end_apart():
    """1,000 workers that pull together after a restart must not end, and pull again,
    together: each pull's wait is its ``wait`` less a random share of up to 20 %."""
    from tasks_app.services.messages import messages_wait

    ends = [messages_wait(machine=Machine(pk=uuid.uuid4()), wait_s=25).timeout_s for _ in range(1000)]
    assert all(20 <= end <= 25 for end in ends)
    assert max(ends) - min(ends) > 4  # spread over the whole 5 s
    assert len({round(end, 2) for end in ends}) > 300  # not a few synchronized groups


@pytest.mark.django_db
def test_d1_p2_pull_starts_together_are_one_heard_update_and_one_look_for_messages(
        owner, machine, make_machine, grant, pinned, django_capture_on_commit_callbacks):
    """Issue 22: the pull starts of an event loop (``messages_starts``) record their
    machines heard in one UPDATE (at most every 20 s each, P2) and find, in one SELECT,
    which machines have an unacknowledged message, visible or delivered to an earlier pull
    (that pull's connection is gone, D1); one transaction. A machine that comes back
    online is announced (B7), once; the others are not."""
    from django.db import connection
    from django.test.utils import CaptureQueriesContext
    from django.utils import timezone

    from core.longpoll import Wait
    from tasks_app.models import Machine
    from tasks_app.services.messages import message_ack, messages_starts, messages_take, messages_wait
    from tasks_app.services.transitions import outbox_key
    from tests.factories import submit

    delivered, acked, idle, back = (make_machine(owner, name) for name in ("delivered", "acked", "idle", "back"))
    for other in (delivered, acked):
        Grant.objects.create(owner=owner, machine=other, path=grant.path)
        assert submit(owner, other, grant.path).status_code == 201
    assert submit(owner, machine, grant.path).status_code == 201  # visible, never taken
    messages_take(machine_id=delivered.pk, now=timezone.now(), new_pull=True)  # hidden, not acknowledged
    for message in messages_take(machine_id=acked.pk, now=timezone.now(), new_pull=True):
        message_ack(machine=acked, message_id=message.pk, now=timezone.now())
    online = timezone.now() - timezone.timedelta(seconds=30)
    Machine.objects.exclude(pk=back.pk).update(last_heard_at=online)
    machines = list(Machine.objects.filter(owner=owner))  # as the pulls' token lookups found them
    waits: list[Wait] = [messages_wait(machine=m, wait_s=25) for m in machines]

    with CaptureQueriesContext(connection) as queries, django_capture_on_commit_callbacks() as announced:
        found = messages_starts(waits)
    assert found == {outbox_key(machine.pk), outbox_key(delivered.pk)}
    statements = [q["sql"].split()[0] for q in queries.captured_queries]
    # the messages; and for `back` alone, its row locked, then read again to announce it
    assert statements.count("UPDATE") == 1 and statements.count("SELECT") == 3
    assert len(announced) == 1  # `back` only
    assert set(Machine.objects.values_list("last_heard_at", flat=True)) == {timezone.now()}
    assert all(m.last_heard_at == timezone.now() for m in machines)

    pinned.shift(1)  # all heard a second ago: no write, one statement
    with CaptureQueriesContext(connection) as queries:
        assert messages_starts(waits) == found
    assert [q["sql"].split()[0] for q in queries.captured_queries if "SAVEPOINT" not in q["sql"]] == ["SELECT"]
    assert idle.pk in {m.pk for m in machines}
