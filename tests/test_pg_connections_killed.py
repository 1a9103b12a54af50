"""PostgreSQL connections killed under a running daphne (D2, the history run's
``pg_terminate_backend`` fault): the pool checks a connection before it hands it out, so
a request never gets a connection PostgreSQL already closed; it gets a fresh one and
answers as usual, with no burst of 500s. And a pool with no connection to give within
``RUNSTEAD_DB_POOL_TIMEOUT_S`` answers 503 ``service_busy`` with ``Retry-After``, not 500.
"""
import concurrent.futures
import uuid

import httpx
import pytest
from django.db import connection, transaction

from tests.live import live_daphne  # noqa: F401  (the fixture)
from tests.wait import wait_for

pytestmark = [pytest.mark.postgres]


def _terminate_the_servers_connections() -> int:
    """Ends every backend on the test database but this process's own (the daphne's pool);
    returns how many. This process's are told by their client ports (psutil): killing them
    too left its own pool without a connection to give for 30 s in CI (the next test's
    ``owner`` fixture, a ``PoolTimeout``), and the daphne's pool is this test's subject."""
    import psutil

    port = int(connection.settings_dict.get("PORT") or 5432)
    own = [c.laddr.port for c in psutil.Process().net_connections(kind="tcp") if c.raddr and c.raddr.port == port]
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                       "AND NOT (client_port = ANY(%s))", [own])
        return cursor.fetchone()[0]


def test_d2_pooled_connections_postgres_killed_are_replaced_not_answered_500(live_daphne, owner):
    url = live_daphne()
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=15)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        # Several requests at once, so the pool holds several connections.
        assert {r.status_code for r in pool.map(lambda _: api.get("/api/board/"), range(16))} == {200}
        assert _terminate_the_servers_connections() >= 2  # the pool's min_size, at least
        answers = list(pool.map(lambda _: api.get("/api/board/"), range(16)))
    assert [r.status_code for r in answers] == [200] * 16, [r.text[:200] for r in answers if r.status_code != 200]


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
