"""The two forms of one wait: ``take_or_wait`` on an event loop (ASGI: no thread, no
database connection while it waits; D1, D2) and ``take_or_wait_sync`` in a thread (WSGI,
the test client). See ``README.md``."""
import asyncio
import functools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from django.db import connections

from core.longpoll.loops import pump_for
from core.longpoll.registry import (Wait, Waiter, quiet, register, run_db, set_waiting, take_missed, take_quiet,
                                    unregister)

log = logging.getLogger("runstead.waiting")

# Under WSGI a wait hears only this process's notifications, so it also takes again this
# often (a gunicorn worker cannot hear another worker's commit).
SYNC_RECHECK_S = 0.2


async def take_or_wait(wait: Wait, *, first_taken: Callable[[], Any] | None = None):
    """Perform ``wait`` on the running event loop (ASGI): take; while the result is not
    ``wait.done``, wait for a wake-up (no thread, no database connection held) and take
    again, until ``wait.timeout_s`` seconds have passed, a newer exclusive wait of the
    key superseded this one, or the server stops. Returns the last take's result; raises
    what ``take`` raised. Cancelled (the client went away, the server stops) while a
    take runs, or superseded while a take found something, the take's result goes to
    ``wait.release`` (and a superseded wait returns ``wait.empty``). ``first_taken()`` is
    called once the first take is over, or once the wait joined a batch of
    ``wait.starts`` (the router's admission of wait starts). Implements D1, D2 (Q3)."""
    loop = asyncio.get_running_loop()
    pump = pump_for(loop)
    resumed = None
    if wait.starts is not None and wait.resume is not None and pump.hears(wait.key):
        last = take_quiet(wait.key)
        resumed = None if last is None else wait.resume(last)
    waiter = register(wait, loop)
    pump.watch(wait.key)
    if wait.exclusive:
        pump.supersede_elsewhere(wait.key, waiter.started)
    try:
        deadline = time.monotonic() + max(0.0, wait.timeout_s)
        wakes_seen = 0  # ``waiter.wakes`` when the last take (or read) began: none before the first
        # no batch: none to join, resumed, or woken before this wait began (take at once)
        alone = wait.starts is None or resumed is not None or take_missed(wait.key)
        started = None if alone else pump.start(wait)
        if started is not None and first_taken is not None:
            first_taken()  # its share of the start is the batch's: let the next one in
            first_taken = None
        try:
            if resumed is not None:
                result = resumed  # the previous wait's last result: nothing happened since
            elif started is None or wait.key in await asyncio.shield(started):
                result = await _take(wait, True)
            else:
                result = wait.empty
        finally:
            if first_taken is not None:
                first_taken()
        timed_out = False
        while not wait.done(result) and not waiter.final:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                timed_out = True
                break
            set_waiting(waiter, True)
            try:
                await asyncio.wait_for(waiter.event.wait(), remaining)
            except TimeoutError:
                timed_out = True
                break
            finally:
                set_waiting(waiter, False)
            if waiter.final:
                break
            wakes_seen = waiter.wakes
            waiter.event.clear()  # before the take: a wake-up during it is not lost
            result = await _take(wait, False)
        if timed_out:
            quiet(waiter, result, wakes_seen)
        if _superseded_holding(waiter, result):
            await run_db(_give_back, wait, result)
            return wait.empty
        return result
    finally:
        unregister(waiter)
        pump.seen(wait.key)


def take_or_wait_sync(wait: Wait):
    """``take_or_wait`` in the calling thread (WSGI, the test client): the same takes,
    timeout, supersession and stop; woken by this process's notifications, and taking
    again every ``SYNC_RECHECK_S`` (0.2) seconds since it cannot hear other processes.
    The thread (and its database connection) is held while it waits: the production
    shape sends long-polls to daphne (``deploy/``). Returns the last take's result."""
    waiter = register(wait, None)
    try:
        deadline = time.monotonic() + max(0.0, wait.timeout_s)
        result = wait.take(True)
        while not wait.done(result) and not waiter.final:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            set_waiting(waiter, True)
            try:
                waiter.event.wait(min(remaining, SYNC_RECHECK_S))
            finally:
                set_waiting(waiter, False)
            if waiter.final:
                break
            waiter.event.clear()
            result = wait.take(False)
        if _superseded_holding(waiter, result):
            _give_back(wait, result)
            return wait.empty
        return result
    finally:
        unregister(waiter)


def _superseded_holding(waiter: Waiter, result) -> bool:
    """W5, D1: a newer exclusive wait superseded this one while its take found something
    (the newer one's first take ran before it, so would not see it): by W5 this wait's
    client is gone, so what it took goes back (``_give_back``) and wakes the newer wait."""
    wait = waiter.wait
    return waiter.reason == "superseded" and wait.release is not None and wait.done(result)


def _give_back(wait: Wait, result) -> None:
    """``wait.release(result)``; a failure is logged (what the take took then shows again
    after its visibility window) and never reaches the client."""
    try:
        wait.release(result)
    except Exception:
        log.exception("wait %s: giving back what its take took failed", wait.key)


async def _take(wait: Wait, first: bool):
    future = asyncio.ensure_future(run_db(wait.take, first))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        if wait.release is not None:
            future.add_done_callback(functools.partial(_release_abandoned, wait))
        raise


def _release_abandoned(wait: Wait, future) -> None:
    """A take finished for a wait that was cancelled meanwhile: give back what it took.
    In a thread of its own, since the loop may be stopping."""
    if future.cancelled() or future.exception() is not None or not wait.done(future.result()):
        return
    threading.Thread(target=_release_now, args=(wait, future.result()), daemon=True).start()


def _release_now(wait: Wait, result) -> None:
    try:
        _give_back(wait, result)
    finally:
        connections.close_all()
