"""Several daphne processes act as one (issue 22; SPEC D1, W5, Q3, B2), in CI's
PostgreSQL + Redis pass: three real daphne processes on one database and one Redis, as
``deploy/`` runs them behind the proxy (here each is reached directly, which is what the
proxy's balancing amounts to for one request).

- W5 across processes: a newer pull of a machine on B ends the older one waiting on A at
  once (superseded), and B's pull is the one a new message wakes;
- D1 across processes: a message made visible through C wakes the pull waiting on B
  within 1 s (the re-check is 30 s here, so only the wake-up can do it);
- Q3: an approval's wait on A is answered by a decision taken on B;
- B2: a board socket on each process gets its owner's event once;
- kill -9 of one of the three while 100 workers and 50 board sockets are connected
  through a balancer (a TCP one standing in for the proxy's: a new connection goes to
  the next process that accepts it): every worker and board reconnects to a live
  process, then each of 100 tasks reaches its machine once and each board event reaches
  every socket once.
"""
import asyncio
import json
import re
import signal
import time
from contextlib import ExitStack
import uuid

import httpx
import pytest
import websockets
import websockets.sync.client as ws_client

from tests.live import Background, live_daphne  # noqa: F401  (live_daphne: a fixture)
from tests.wait import wait_for_async
from tests.proxies import Balancer

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

SLOW_RECHECK = {"RUNSTEAD_LONGPOLL_RECHECK_S": "30", "RUNSTEAD_LOG_LEVEL": "DEBUG"}


def three(live_daphne, **env):
    urls = [live_daphne(**SLOW_RECHECK, **env) for _ in range(3)]
    return urls, live_daphne.servers[-3:]


def pull(url, token, wait=25):
    return httpx.get(f"{url}/api/worker/messages/?wait={wait}", headers={"Authorization": f"Machine {token}"},
                     timeout=35)


def test_w5_d1_newer_pull_on_another_process_supersedes_and_a_third_process_wakes_it(live_daphne, owner, machine, grant):
    (a, b, c), (server_a, server_b, _) = three(live_daphne)
    key = f"machine.{machine.id}"
    older = Background(pull, a, machine.test_token)
    server_a.wait_waiting(key=key)
    newer_started = time.monotonic()
    newer = Background(pull, b, machine.test_token)
    answer = older.result(5)
    took = time.monotonic() - newer_started
    assert (answer.status_code, answer.json()) == (200, {"messages": []})
    assert took < 1.5, f"the older pull on A ended {took:.2f} s after the newer one began on B"
    server_b.wait_waiting(key=key)

    sent = time.monotonic()
    resp = httpx.post(f"{c}/api/tasks/", headers={"Authorization": f"Token {owner.auth_token.key}",
                                                   "Idempotency-Key": uuid.uuid4().hex},
                      json={"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "p"}, timeout=15)
    assert resp.status_code == 201, resp.text
    messages = newer.result(5).json()["messages"]
    took = time.monotonic() - sent
    assert [m["payload"]["task_id"] for m in messages] == [resp.json()["id"]]
    assert took < 1, f"the pull on B had the message {took:.2f} s after the acceptance on C"


def test_q3_approval_wait_on_one_process_is_answered_by_a_decision_on_another(live_daphne, owner):
    (a, b, _), (server_a, _, _) = three(live_daphne)
    api = {"Authorization": f"Token {owner.auth_token.key}"}
    created = httpx.post(f"{b}/api/approvals/", headers=api, timeout=15, json={
        "key": "k-1", "session": str(uuid.uuid4()), "agent": "claude", "tool_name": "Bash", "tool_input": {"command": "ls"}})
    assert created.status_code == 201, created.text
    approval_id = created.json()["id"]
    waiting = Background(httpx.get, f"{a}/api/approvals/{approval_id}/?wait=25", headers=api, timeout=35)
    server_a.wait_waiting(key=f"approval.{approval_id}")
    decided = time.monotonic()
    answer = httpx.post(f"{b}/api/approvals/{approval_id}/decision/", json={"behavior": "allow"}, timeout=15,
                        headers={**api, "Idempotency-Key": uuid.uuid4().hex})
    assert answer.status_code == 200, answer.text
    body = waiting.result(5).json()
    assert body["state"] == "allowed", body
    assert time.monotonic() - decided < 1


def test_b2_board_socket_on_every_process_gets_its_owners_event_once(live_daphne, owner):
    urls, _ = three(live_daphne)
    headers = {"Authorization": f"Token {owner.auth_token.key}"}
    with ExitStack() as held:
        sockets = [held.enter_context(ws_client.connect(url.replace("http", "ws") + "/ws/board/", additional_headers=headers))
                   for url in urls]
        sessions = [str(uuid.uuid4()) for _ in range(2)]  # the second is the sentinel: all before it has arrived
        for session_id in sessions:
            marker = httpx.put(f"{urls[0]}/api/sessions/{session_id}/marker/", headers=headers, timeout=15,
                               json={"turn_id": "t1", "device_id": "d1", "state": "running"})
            assert marker.status_code == 200, marker.text
        for sock in sockets:
            seen = []
            while sessions[1] not in seen:
                event = json.loads(sock.recv(timeout=5))
                if event.get("type") == "session.status":
                    seen.append(event["session_id"])
            assert seen == sessions  # each once, in order


async def _puller(url, token, seen: dict, stop: asyncio.Event):
    """A worker's pull loop: pull, record each message id under its task, ack; any
    connection error (its process died) -> pull again at once through the balancer."""
    headers = {"Authorization": f"Machine {token}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=httpx.Timeout(10, read=30)) as client:
        while not stop.is_set():
            try:
                answer = await client.get("/api/worker/messages/?wait=25")
                for message in answer.json()["messages"]:
                    seen.setdefault(message["payload"]["task_id"], set()).add((token, message["id"]))
                    await client.post(f"/api/worker/messages/{message['id']}/ack/")
            except (httpx.HTTPError, ValueError, KeyError):
                await asyncio.sleep(0.1)


async def _board(url, token, board: dict, stop: asyncio.Event):
    """A board socket that reconnects when its process dies: ``board["opened"]`` and
    ``["closed"]`` count its connections, ``["events"]`` are the session ids of its
    ``session.status`` events."""
    ws_url = url.replace("http", "ws") + "/ws/board/"
    while not stop.is_set():
        try:
            async with websockets.connect(ws_url, additional_headers={"Authorization": f"Token {token}"}) as sock:
                board["opened"] += 1
                try:
                    async for raw in sock:
                        event = json.loads(raw)
                        if event.get("type") == "session.status":
                            board["events"].append(event["session_id"])
                finally:
                    board["closed"] += 1
        except (OSError, websockets.WebSocketException):
            await asyncio.sleep(0.1)


def test_d1_b2_kill9_of_one_daphne_every_worker_and_board_reconnects_and_nothing_is_lost_or_doubled(
        live_daphne, owner, make_machine):
    from tasks_app.models import Grant, OutboxMessage

    urls, servers = three(live_daphne, RUNSTEAD_ACCEPT_RATE="1000/min")  # 100 acceptances in a few seconds
    machines = [make_machine(owner, name=f"m{i}") for i in range(100)]
    Grant.objects.bulk_create([Grant(owner=owner, machine=m, path="/kill9") for m in machines])
    balancer = Balancer([int(url.rsplit(":", 1)[1]) for url in urls])
    token = owner.auth_token.key

    async def scenario():
        stop = asyncio.Event()
        seen: dict = {}
        boards = [{"opened": 0, "closed": 0, "events": []} for _ in range(50)]
        tasks = [asyncio.create_task(_puller(balancer.url, m.test_token, seen, stop)) for m in machines]
        tasks += [asyncio.create_task(_board(balancer.url, token, board, stop)) for board in boards]
        try:
            await wait_for_async(lambda: sum(len(set(s.waits())) for s in servers) >= 100
                                 and all(b["opened"] for b in boards), timeout_s=60,
                                 what="100 waiting pulls and every board socket open")
            # kill -9 the process holding the most waiting pulls
            victim = max(servers, key=lambda s: len(set(s.waits())))
            on_victim = set(victim.waits())
            before = {id(s): s.waits() for s in servers if s is not victim}
            assert on_victim and balancer.open_to(victim.port) >= len(on_victim)
            victim.process.send_signal(signal.SIGKILL)
            victim.process.wait(10)
            survivors = [s for s in servers if s is not victim]

            def all_back():
                again = set()
                for s in survivors:
                    again |= set(s.waits()[len(before[id(s)]):])
                boards_open = all(b["opened"] == b["closed"] + 1 for b in boards)
                return balancer.open_to(victim.port) == 0 and on_victim <= again and boards_open

            # every connection to the victim is gone, its pulls wait again on the others,
            # and every board socket is open (those that were on the victim, again)
            await wait_for_async(all_back, timeout_s=60, what="every pull and board back on the survivors")
            assert sum(b["closed"] for b in boards) >= 1  # some of them were on the victim

            async with httpx.AsyncClient(base_url=balancer.url, timeout=15, headers={
                    "Authorization": f"Token {token}"}) as api:
                submitted = {}
                for m in machines:
                    answer = await api.post("/api/tasks/", headers={"Idempotency-Key": uuid.uuid4().hex}, json={
                        "machine": str(m.id), "folder": "/kill9", "agent": "demo", "prompt": "p", "exclusive": False,
                        "max_runtime_s": 60})
                    assert answer.status_code == 201, answer.text
                    submitted[answer.json()["id"]] = m.test_token
                await wait_for_async(lambda: set(seen) >= set(submitted), timeout_s=30,
                                     what="every task at its worker")
                sessions = [str(uuid.uuid4()) for _ in range(3)]
                for session_id in sessions:
                    marker = await api.put(f"/api/sessions/{session_id}/marker/",
                                           json={"turn_id": "t1", "device_id": "d1", "state": "running"})
                    assert marker.status_code == 200, marker.text
                await wait_for_async(lambda: all(sessions[-1] in b["events"] for b in boards), timeout_s=30,
                                     what="the last session on every board")
            return submitted, seen, [b["events"] for b in boards], sessions
        finally:
            stop.set()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    try:
        submitted, seen, board_events, sessions = asyncio.run(scenario())
    finally:
        balancer.close()
    # each task reached its own machine's worker, as one message, delivered once
    assert {task_id: {t for t, _ in seen[task_id]} for task_id in submitted} == {
        task_id: {machine_token} for task_id, machine_token in submitted.items()}
    assert all(len(seen[task_id]) == 1 for task_id in submitted)
    assert set(OutboxMessage.objects.filter(operation__task_id__in=list(submitted)).values_list(
        "deliveries", flat=True)) == {1}
    # each board socket got each event once, in order
    for events in board_events:
        assert [e for e in events if e in sessions] == sessions, events


def _token_misses(server) -> int:
    """Pull starts of ``server`` that read their machine token from the database (its
    ``tasks_app.auth.MachineTokenCache`` logs each miss at DEBUG)."""
    return sum(int(n) for n in re.findall(r" runstead\.auth machine token cache: (\d+) missed", server.log()))


def test_k1_revoked_and_repaired_tokens_are_refused_on_every_process_within_the_epoch_freshness_while_100_pulls_wait(
        live_daphne, owner, make_machine):
    from django.conf import settings
    from django.utils import timezone

    from tasks_app.services.pairing import machine_pair, pairing_code_create
    from tasks_app.services.revocation import machine_unpair

    urls, servers = three(live_daphne)
    machines = [make_machine(owner, name=f"m{i}") for i in range(100)]

    async def pull_all(pairs, wait=0, at_once=20):
        """GET the pull for each (url, token), ``at_once`` at a time: (status, error) of each."""
        gate = asyncio.Semaphore(at_once)

        async def one(client, url, token):
            async with gate:
                answer = await client.get(f"{url}/api/worker/messages/?wait={wait}",
                                          headers={"Authorization": f"Machine {token}"})
                return answer.status_code, answer.json().get("error")

        async with httpx.AsyncClient(timeout=40) as client:
            return await asyncio.gather(*(one(client, url, token) for url, token in pairs))

    every = [(url, m.test_token) for url in urls for m in machines]
    assert set(asyncio.run(pull_all(every))) == {(200, None)}
    assert [_token_misses(s) for s in servers] == [100, 100, 100]  # one database read each...
    assert set(asyncio.run(pull_all(every))) == {(200, None)}
    assert [_token_misses(s) for s in servers] == [100, 100, 100]  # ...and none the second time

    waiting = Background(lambda: asyncio.run(pull_all([(urls[i % 3], m.test_token) for i, m in enumerate(machines)],
                                                       wait=8, at_once=100)))
    for server in servers:
        server.wait_waiting(count=33, timeout=20)  # 34, 33, 33 pulls wait on the three
    now = timezone.now()
    for m in machines[:50]:
        machine_unpair(machine=m, actor="owner:test", now=now)
    new_tokens = []
    for m in machines[50:]:
        code, _ = pairing_code_create(owner=owner, machine_id=m.id, now=now)
        new_tokens.append(machine_pair(code=code, client="test", now=now)[1])
    revoked = time.monotonic()
    # Each process trusts the counter it read for RUNSTEAD_TOKEN_EPOCH_FRESH_S (0.25 s), so
    # an old token may pass for that long; a round of every old token on every process
    # that starts later than that after the last revocation must see them all refused.
    while True:
        started = time.monotonic() - revoked
        answers = asyncio.run(pull_all(every))
        if set(answers) == {(401, "token_revoked")} or started > settings.RUNSTEAD_TOKEN_EPOCH_FRESH_S:
            break
    took = time.monotonic() - revoked
    assert set(answers) == {(401, "token_revoked")}, sorted(set(answers))
    assert set(asyncio.run(pull_all([(url, t) for url in urls for t in new_tokens]))) == {(200, None)}
    print(f"\n300 old tokens refused {took:.2f} s after the last revocation; misses {[_token_misses(s) for s in servers]}")
    assert set(waiting.result(20)) == {(200, None)}  # the pulls that were waiting end as they would
