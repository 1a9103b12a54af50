"""Deadlock retries shared by every app's services (SPEC P2).

A PostgreSQL deadlock (SQLSTATE 40P01) kills one of the transactions involved; the
victim is run again, from its own atomic block, at most ``DEADLOCK_RETRIES`` times. On
SQLite every transaction is ``BEGIN IMMEDIATE`` (settings), so there is none to retry.
"""
import functools
import logging
import time

from django.db import OperationalError, connection

log = logging.getLogger("runstead.locking")

DEADLOCK_RETRIES = 3


def is_deadlock(exc: BaseException) -> bool:
    """Whether ``exc`` (a Django ``OperationalError``) is PostgreSQL's 40P01."""
    cause = exc.__cause__
    return getattr(cause, "sqlstate", None) == "40P01"


def retry_on_deadlock(func):
    """Run ``func`` (which opens its own atomic block) again on a PostgreSQL deadlock
    (40P01), at most ``DEADLOCK_RETRIES`` times, 10 ms x attempt apart (P2). Inside
    someone else's atomic block the error goes up instead: that transaction is aborted."""

    @functools.wraps(func)
    def wrapper(*args, **kwargs):
        for attempt in range(DEADLOCK_RETRIES + 1):
            try:
                return func(*args, **kwargs)
            except OperationalError as exc:
                if not is_deadlock(exc) or attempt == DEADLOCK_RETRIES or connection.in_atomic_block:
                    raise
                log.warning("deadlock in %s, retry %d", func.__name__, attempt + 1)
                time.sleep(0.01 * (attempt + 1))

    return wrapper
