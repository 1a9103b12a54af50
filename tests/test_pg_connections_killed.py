"""PostgreSQL connections killed under a running daphne (D2, the history run's
``pg_terminate_backend`` fault): the pool checks a connection before it hands it out, so
a request never gets a connection PostgreSQL already closed; it gets a fresh one and
answers as usual, with no burst of 500s.
"""
import concurrent.futures

import httpx
import pytest
from django.db import connection

from tests.live import live_daphne  # noqa: F401  (the fixture)

pytestmark = [pytest.mark.postgres]


def _terminate_the_servers_connections() -> int:
    """Ends every other backend on the test database (the daphne's pool); returns how many."""
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
                       "WHERE datname = current_database() AND pid <> pg_backend_pid()")
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
