"""PostgreSQL connections killed under a running daphne (D2, the history run's
``pg_terminate_backend`` fault): the pool checks a connection before it hands it out, so
a request never gets a connection PostgreSQL already closed; it gets a fresh one and
answers as usual, with no burst of 500s. (A pool with no connection to give:
tests/test_admission.py.)
"""
import concurrent.futures

import httpx
import pytest
from django.db import connection

from tests.live import live_daphne  # noqa: F401  (the fixture)

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
