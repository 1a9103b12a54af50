"""Racers released together (SPEC A4, A5, A8, P1, P2 races): real threads, each with its
own database connection, started by a ``threading.Barrier`` (STYLE: races on PostgreSQL,
assertions on the rows afterwards)."""
import threading

from django.db import connection

JOIN_TIMEOUT_S = 60


def race(n: int, work, *, prepare=None) -> list:
    """Run ``work(i)`` in ``n`` threads released together; returns the results in order.

    Each thread opens its own connection before the barrier (so connecting is not part of
    the race) and closes it at the end. ``prepare(i)`` runs before the barrier, e.g. to
    build a client. Any exception in a thread fails the test.
    """
    barrier = threading.Barrier(n)
    results: list = [None] * n
    errors: list = []

    def target(i):
        try:
            connection.ensure_connection()
            ctx = prepare(i) if prepare else None
            barrier.wait(timeout=JOIN_TIMEOUT_S)
            results[i] = work(i, ctx) if prepare else work(i)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            barrier.abort()
        finally:
            connection.close()

    threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads), "a racer hung"
    assert not errors, errors
    return results
