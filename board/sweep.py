"""The periodic sweep (SPEC L6, J5, A7, S7, Q1): the task steps, then the session steps,
then the approvals' expiry.

Composed in ``board`` because it spans both apps (``board`` sits above ``tasks_app`` and
``sessions_app``); the task core knows nothing of sessions. Every step is safe with several processes (O2).

How it runs: inside every daphne process, as ``sweep_loop`` on its event loop, scheduled
by ``config/server_hooks.py`` (daphne has no lifespan protocol); in the embedded default
the in-memory channel layer then reaches that process's boards. ``manage.py sweep``
(``board/management/commands/sweep.py``) runs the same pass as its own process
(``--once`` for one pass).
"""
import asyncio
import logging
from datetime import datetime

from asgiref.sync import sync_to_async
from django.db import close_old_connections

from core import clock
from sessions_app.approvals import approvals_expire
from sessions_app.services import sessions_sweep
from tasks_app.services.sweeps import tasks_sweep

log = logging.getLogger("runstead.sweep")


def sweep_once(*, now: datetime | None = None) -> dict:
    """One pass of every step, reading the clock once; returns how much each found:
    ``{"leases_expired", "start_windows", "idempotency_deleted", "sessions",
    "approvals_expired"}`` (counts)."""
    now = now or clock.now()
    return {**tasks_sweep(now=now), "sessions": sessions_sweep(now=now), "approvals_expired": approvals_expire(now=now)}


def sweep_pass() -> None:
    """One guarded pass for the loops: errors are logged, connections closed."""
    try:
        sweep_once()
    except Exception:  # noqa: BLE001 - a sweep must outlive one bad pass
        log.exception("sweep pass failed")
    finally:
        close_old_connections()


async def sweep_loop(interval_s: float) -> None:
    """The sweep as a task on the server's event loop; each pass runs in a worker thread,
    so its after-commit broadcasts reach this process's channel layer on its own loop."""
    while True:
        await sync_to_async(sweep_pass, thread_sensitive=False)()
        await asyncio.sleep(interval_s)
