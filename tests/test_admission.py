"""An overloaded daphne (issue 44, SPEC D2, L2): a bounded number of requests in Django
at once per event loop (core/admission.py), a machine's renewals let in before the
requests that waited longer, and a request that waits too long for a slot, or for a
pooled connection, answered 503 ``service_busy`` with ``Retry-After`` without being
performed. Real daphnes; a slot or a connection is held by an acceptance waiting on the
owner's budget row, which the test holds (PostgreSQL: a row lock that makes a request
wait inside Django)."""
import concurrent.futures
import re
import time
import uuid

import httpx
import pytest
from django.db import connection, transaction

from tests.live import live_daphne  # noqa: F401  (the fixture)
from tests.wait import wait_for

pytestmark = [pytest.mark.postgres]


def _waiting_on_a_lock() -> int:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0]


def test_d2_no_pool_connection_within_the_timeout_is_503_service_busy_and_the_waiting_requests_finish(
        live_daphne, owner, machine, grant):  # noqa: F811
    """A daphne with a pool of 2 and a 0.5 s pool timeout; the owner's budget row is held
    here, so two acceptances (A5 serializes them on it) each wait holding one of the two
    connections. A third request finds none: 503 ``service_busy``, ``Retry-After: 1``,
    the error shape. Once the row is free both acceptances are answered 201."""
    from tasks_app.models import Budget, Task

    url = live_daphne(RUNSTEAD_DB_POOL_MAX="2", RUNSTEAD_DB_POOL_TIMEOUT_S="0.5")
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=30)
    body = {"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "p", "exclusive": False}
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with transaction.atomic():
            Budget.objects.select_for_update().get(owner=owner)
            submits = [pool.submit(api.post, "/api/tasks/", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
                       for _ in range(2)]
            wait_for(_waiting_on_a_lock, until=lambda n: n == 2, timeout_s=20, what="two acceptances on the budget row")
            busy = api.get("/api/budget/")
        answers = [f.result(timeout=30) for f in submits]
    assert busy.status_code == 503, busy.text
    assert busy.json() == {"error": "service_busy", "detail": "the service is busy, try again in 1 s", "retry_after_s": 1}
    assert busy.headers["Retry-After"] == "1"
    assert [a.status_code for a in answers] == [201, 201], [a.text for a in answers]
    assert Task.objects.filter(owner=owner).count() == 2


def _holding_the_slot(live_daphne, owner, machine, grant, pool, **env):  # noqa: F811
    """Start a daphne with one slot and an acceptance that holds it, waiting on the budget
    row the caller holds; returns (url, owner's client, that acceptance's future)."""
    url = live_daphne(RUNSTEAD_REQUEST_SLOTS="1", RUNSTEAD_LOG_LEVEL="DEBUG", **env)
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=30)
    body = {"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "p", "exclusive": False}
    holder = pool.submit(api.post, "/api/tasks/", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
    wait_for(_waiting_on_a_lock, until=lambda n: n == 1, timeout_s=20, what="the acceptance on the budget row")
    return url, api, holder


def _queued(server, method: str, path: str) -> None:
    wait_for(lambda: re.search(rf"runstead\.admission {method} {re.escape(path)} waits for a slot", server.log()),
             timeout_s=20, interval_s=0.02, what=f"{method} {path} to wait for a slot", detail=lambda: server.log()[-2000:])


def test_l2_a_renewal_waiting_for_a_slot_goes_in_before_a_request_that_waited_longer(
        live_daphne, owner, machine, grant):  # noqa: F811
    from tasks_app.models import Budget

    worker = None
    with concurrent.futures.ThreadPoolExecutor(3) as pool:
        with transaction.atomic():
            Budget.objects.select_for_update().get(owner=owner)
            url, api, holder = _holding_the_slot(live_daphne, owner, machine, grant, pool)
            server = live_daphne.servers[-1]
            worker = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=30)

            def timed(call, *args, **kwargs):
                response = call(*args, **kwargs)
                return response, time.monotonic()

            read = pool.submit(timed, api.get, "/api/budget/")
            _queued(server, "GET", "/api/budget/")
            renewal = pool.submit(timed, worker.post, "/api/worker/sync/",
                                  json={"renew": [{"lease_id": str(uuid.uuid4())}]})
            _queued(server, "POST", "/api/worker/sync/")
        (read_answer, read_at), (renewal_answer, renewal_at) = read.result(timeout=30), renewal.result(timeout=30)
    assert holder.result().status_code == 201
    assert read_answer.status_code == 200 and renewal_answer.status_code == 200, (read_answer.text, renewal_answer.text)
    assert renewal_answer.json()["leases"][0]["error"] == "not_found"
    assert renewal_at < read_at  # one slot: the renewal was answered before the read went in


def test_d2_a_request_that_waits_too_long_for_a_slot_is_503_service_busy_and_not_performed(
        live_daphne, owner, machine, grant):  # noqa: F811
    from tasks_app.models import Budget, Task

    key = str(uuid.uuid4())
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        with transaction.atomic():
            Budget.objects.select_for_update().get(owner=owner)
            url, api, holder = _holding_the_slot(live_daphne, owner, machine, grant, pool, RUNSTEAD_REQUEST_QUEUE_S="0.3")
            body = {"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "q", "exclusive": False}
            busy = api.post("/api/tasks/", json=body, headers={"Idempotency-Key": key})
        assert holder.result(timeout=30).status_code == 201
    assert busy.status_code == 503, busy.text
    assert busy.json() == {"error": "service_busy", "detail": "the service is busy, try again in 1 s", "retry_after_s": 1}
    assert busy.headers["Retry-After"] == "1" and busy.headers["X-Content-Type-Options"] == "nosniff"
    assert not Task.objects.filter(owner=owner, prompt="q").exists()  # never performed
    assert Task.objects.filter(owner=owner).count() == 1
    again = api.post("/api/tasks/", json=body, headers={"Idempotency-Key": key})  # the worker's retry
    assert again.status_code == 201, again.text
