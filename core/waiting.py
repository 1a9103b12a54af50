"""One way to wait (SPEC D1, D2, Q3; STYLE 13): "take, or wait for a wake-up, then take".

Every long-poll (the worker's messages, an approval's decision) is a ``Wait``: a ``key``
naming what it waits on and a ``take`` that looks for it. ``take_or_wait`` performs it
under ASGI, holding no thread and no database connection while it waits (D1, D2);
``take_or_wait_sync`` performs the same wait in the calling thread (WSGI, the test
client). The service that changes what a take would find wakes the key's waiters with
``notify_after_commit(key)`` (or ``notify(key)`` outside a transaction), the way
procrastinate's one ``_fetch_job`` sits behind LISTEN/NOTIFY or polling.

How a wait is woken, in this process and across processes:

- ``notify(key)`` wakes this process's waiters of ``key`` directly (any thread) and the
  other processes' through the channel layer group ``wait.<key>`` (Redis): each event
  loop with waiters has one channel that joins the groups of its keys;
- a safety re-check every ``RUNSTEAD_LONGPOLL_RECHECK_S`` seconds per event loop: one
  ``Wait.ready`` call for all waiting keys that share it (one query for all waiting
  machines), or a wake-up of every waiter that has none. It delivers what no
  notification announced (a Redis outage, a visibility window that ran out);
- ``Wait.exclusive``: a newer wait of the same key supersedes the older (one poller per
  machine, W5), which returns its last take at once; in another process too, through
  the group every event loop's channel joins (``SUPERSEDE_GROUP``: one
  ``wait.supersede`` message for the exclusive waits that began on a loop within
  ``RUNSTEAD_LONGPOLL_START_BATCH_S``; the newer by its start time);
- ``stop_all()`` (the server stops, ``config/server_hooks.py``): every wait returns its
  last take at once, and so does any wait that starts afterwards.

``waiting(key)`` counts the waits that took, found nothing and now wait for a wake-up,
and each logs ``wait <key>: waiting for a wake-up`` at DEBUG on the ``runstead.waiting``
logger: the fact "the pull is waiting" that tests poll for instead of sleeping.

A new long-poll (the worker's is ``tasks_app.services.messages.messages_wait``):

1. a service function returns ``Wait(key=..., take=..., timeout_s=..., done=...)``;
2. every service that changes what its take finds calls ``notify_after_commit(key)`` in
   the same transaction;
3. the DRF view parses, authorises and answers ``core.longpoll.WaitResponse(wait,
   render)``;
4. ``config/asgi.py`` lists the view in ``LONG_POLL_VIEWS`` (its row goes in
   ``tests/test_k_socket_matrix.py``), and ``deploy/Caddyfile`` sends its path to daphne.
"""
import asyncio
import functools
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import async_to_sync, sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.db import connections, transaction

log = logging.getLogger("runstead.waiting")

# Under WSGI a wait hears only this process's notifications, so it also takes again this
# often (a gunicorn worker cannot hear another worker's commit).
SYNC_RECHECK_S = 0.2
LAYER_RETRY_S = 1.0  # after a failed channel layer receive (Redis down)
GROUP_IDLE_DISCARD_S = 120.0  # leave a key's group once nobody here waited on it for this long
GROUP_PREFIX = "wait."
# Every event loop's channel is in this group: the exclusive waits that began on one loop
# within a start batch go to the others in one message (W5 across processes).
SUPERSEDE_GROUP = "waits-superseding"
# Join the groups again this often: channels_redis forgets a member a day after it joined.
GROUP_REJOIN_S = 3600.0
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,90}")  # a channels group name once prefixed
FINAL = ("superseded", "stopped")


@dataclass(frozen=True)
class Wait:
    """What one long-poll waits for (D1, D2, Q3).

    - ``key``: what it waits on, such as ``machine.<uuid>`` (a machine's outbox) or
      ``approval.<uuid>``; letters, digits, ``_``, ``.``, ``-``, at most 90 characters
      (it names the channel layer group ``wait.<key>``), else ``ValueError``.
    - ``take(first: bool) -> result``: looks and takes; called in a thread that may use
      the database, outside any transaction, once at the start (``first=True``) and again
      after each wake-up. A take that raises ends the wait with that exception.
    - ``timeout_s``: seconds to wait at most (negative counts as 0: take once).
    - ``done(result) -> bool``: whether the result answers the long-poll (default
      ``bool``: a non-empty list of messages); otherwise, at timeout, when superseded or
      when the server stops, the last result is returned as it is.
    - ``exclusive``: one waiter per key; a newer one supersedes (W5), in any process.
    - ``ready(keys: list[str]) -> Iterable[str]``: optional, the safety re-check for
      many keys at once (which of them a take would now find something for), called in
      a thread; without it the re-check wakes every waiter, whose take is the check.
    - ``release(result)``: optional, gives back what a take took when its answer cannot
      reach the client (the client went away, the server stopped during a take, or a
      newer exclusive wait superseded this one while its take ran: by W5 its client is
      gone), so it is not hidden for a visibility window (D1). Called in a thread.
    - ``empty``: what a superseded wait answers once it gave back what it took, and a
      wait whose ``starts`` found nothing for it as its first result.
    - ``starts(waits: list[Wait]) -> Iterable[str]``: optional, the start of many waits
      at once (``take_or_wait`` only): called in a thread with the waits that began on
      one event loop within ``RUNSTEAD_LONGPOLL_START_BATCH_S`` of each other (at most
      one call per that many seconds), does what each start needs and returns the keys
      whose first take could find something; only those make it, the others begin
      waiting with ``empty``. A start that raises ends each of those waits with it.
    - ``subject``: what the wait is for, for ``starts`` (the pull's machine).
    """

    key: str
    take: Callable[[bool], Any]
    timeout_s: float
    done: Callable[[Any], bool] = bool
    exclusive: bool = False
    ready: Callable[[list[str]], Iterable[str]] | None = None
    release: Callable[[Any], Any] | None = None
    empty: Any = None
    starts: Callable[[list["Wait"]], Iterable[str]] | None = None
    subject: Any = None

    def __post_init__(self):
        if not KEY_PATTERN.fullmatch(self.key):
            raise ValueError(f"wait key {self.key!r}: letters, digits, '_', '.', '-', at most 90 characters")


def group_name(key: str) -> str:
    """The channel layer group whose messages wake ``key``'s waiters in other processes."""
    return GROUP_PREFIX + key


def layer_is_remote() -> bool:
    """Whether the channel layer reaches other processes (Redis), not only this one."""
    layer = get_channel_layer()
    return layer is not None and not layer.__class__.__name__.startswith("InMemory")


def run_db(fn, *args, **kwargs):
    """Await ``fn(*args, **kwargs)`` run in the event loop's shared thread pool, its
    database connections given back before it returns: a waiting long-poll holds neither
    a thread nor a connection (D2)."""

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            connections.close_all()

    return sync_to_async(call, thread_sensitive=False)()


# --- the registry of waiters (one per process, any thread) ----------------------------


_PROCESS = uuid.uuid4().hex  # tells this process's supersessions from the others'


class _Waiter:
    __slots__ = ("wait", "loop", "event", "reason", "waiting", "started")

    def __init__(self, wait: Wait, loop: asyncio.AbstractEventLoop | None):
        self.wait = wait
        self.loop = loop  # None: a thread waits (the sync form)
        self.started = time.time()  # UTC seconds: which of two processes' waits is newer
        self.event = asyncio.Event() if loop is not None else threading.Event()
        self.reason = None
        self.waiting = False

    @property
    def final(self) -> bool:
        return self.reason in FINAL

    def wake(self, reason: str) -> None:
        """From any thread."""
        if not self.final:
            self.reason = reason
        if self.loop is None:
            self.event.set()
        elif not self.loop.is_closed():
            try:
                self.loop.call_soon_threadsafe(self.event.set)
            except RuntimeError:  # closed meanwhile: nobody waits on it any more
                pass


_lock = threading.Lock()
_waiters: dict[str, set[_Waiter]] = {}
_pumps: dict[asyncio.AbstractEventLoop, "_Pump"] = {}
_stopping = False


def _register(wait: Wait, loop) -> _Waiter:
    waiter = _Waiter(wait, loop)
    with _lock:
        older = list(_waiters.get(wait.key, ())) if wait.exclusive else []
        _waiters.setdefault(wait.key, set()).add(waiter)
        stopping = _stopping
    for other in older:
        other.wake("superseded")
    if stopping:
        waiter.wake("stopped")
    if loop is not None:
        pump = _pump_for(loop)
        pump.watch(wait.key)
        if wait.exclusive:
            pump.supersede_elsewhere(wait.key, waiter.started)
    return waiter


def _unregister(waiter: _Waiter) -> None:
    with _lock:
        group = _waiters.get(waiter.wait.key)
        if group is not None:
            group.discard(waiter)
            if not group:
                del _waiters[waiter.wait.key]
        pump = _pumps.get(waiter.loop) if waiter.loop is not None else None
    if pump is not None:
        pump.seen(waiter.wait.key)


def _set_waiting(waiter: _Waiter, flag: bool) -> None:
    with _lock:
        waiter.waiting = flag
    if flag:
        log.debug("wait %s: waiting for a wake-up", waiter.wait.key)


def _snapshot(key=None, loop=...) -> list[_Waiter]:
    with _lock:
        groups = [_waiters.get(key, set())] if key is not None else list(_waiters.values())
        return [w for group in groups for w in group if loop is ... or w.loop is loop]


def waiting(key: str | None = None) -> int:
    """How many waits of this process wait for a wake-up now (they took and found
    nothing): of ``key``, or of every key. For tests and operators."""
    return sum(1 for waiter in _snapshot(key) if waiter.waiting)


def wake(key: str, reason: str = "notified", *, loop=...) -> None:
    """Wake this process's waiters of ``key`` (of one event loop's only, if given), from
    any thread: each takes again."""
    for waiter in _snapshot(str(key), loop):
        waiter.wake(reason)


def supersede_older(key: str, started: float, *, loop=...) -> None:
    """W5 across processes: end this process's exclusive waits of ``key`` that began
    before ``started`` (UTC seconds), as a newer one elsewhere does."""
    for waiter in _snapshot(str(key), loop):
        if waiter.wait.exclusive and waiter.started < started:
            waiter.wake("superseded")


def notify(key: str) -> None:
    """Wake ``key``'s waiters: this process's directly, other processes' through the
    channel layer group ``wait.<key>`` (Redis). Best effort: a layer failure is logged and
    the safety re-check delivers instead (D1); nothing that calls this depends on Redis.
    Call it from synchronous code (a service, an ``on_commit`` callback)."""
    key = str(key)
    wake(key)
    if not layer_is_remote():
        return
    try:
        async_to_sync(get_channel_layer().group_send)(group_name(key), {"type": "wait.wake", "key": key})
    except Exception as exc:
        log.warning("wake-up of %s over the channel layer failed (%s); the re-check delivers", key, exc)


def notify_after_commit(key: str) -> None:
    """``notify(key)`` once the current transaction commits, so the take it wakes sees
    the change (D1). Call it in the transaction that changes what a take finds."""
    transaction.on_commit(functools.partial(notify, str(key)), robust=True)


def stop_all() -> None:
    """The server is stopping: every wait returns its last take at once, and every wait
    that starts from now on returns after its first take (D3: daphne exits in seconds)."""
    global _stopping
    with _lock:
        _stopping = True
    for waiter in _snapshot():
        waiter.wake("stopped")


# --- the two forms of one wait ----------------------------------------------------------


async def take_or_wait(wait: Wait, *, first_taken: Callable[[], Any] | None = None):
    """Perform ``wait`` on the running event loop (ASGI): take; while the result is not
    ``wait.done``, wait for a wake-up (no thread, no database connection held) and take
    again, until ``wait.timeout_s`` seconds have passed, a newer exclusive wait of the
    key superseded this one, or the server stops. Returns the last take's result; raises
    what ``take`` raised. Cancelled (the client went away, the server stops) while a
    take runs, or superseded while a take found something, the take's result goes to
    ``wait.release`` (and a superseded wait returns ``wait.empty``). ``first_taken()`` is called
    once the first take is over, or once the wait joined a batch of ``wait.starts``
    (``core.longpoll``'s admission of wait starts). Implements D1, D2 (Q3)."""
    waiter = _register(wait, asyncio.get_running_loop())
    try:
        deadline = time.monotonic() + max(0.0, wait.timeout_s)
        started = None if wait.starts is None else _pump_for(waiter.loop).starts.add(wait)
        if started is not None and first_taken is not None:
            first_taken()  # its share of the start is the batch's: let the next one in
            first_taken = None
        try:
            if started is None or wait.key in await asyncio.shield(started):
                result = await _take(wait, True)
            else:
                result = wait.empty
        finally:
            if first_taken is not None:
                first_taken()
        while not wait.done(result) and not waiter.final:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _set_waiting(waiter, True)
            try:
                await asyncio.wait_for(waiter.event.wait(), remaining)
            except TimeoutError:
                break
            finally:
                _set_waiting(waiter, False)
            if waiter.final:
                break
            waiter.event.clear()  # before the take: a wake-up during it is not lost
            result = await _take(wait, False)
        if _superseded_holding(waiter, result):
            await run_db(_give_back, wait, result)
            return wait.empty
        return result
    finally:
        _unregister(waiter)


def take_or_wait_sync(wait: Wait):
    """``take_or_wait`` in the calling thread (WSGI, the test client): the same takes,
    timeout, supersession and stop; woken by this process's notifications, and taking
    again every ``SYNC_RECHECK_S`` (0.2) seconds since it cannot hear other processes.
    The thread (and its database connection) is held while it waits: the production
    shape sends long-polls to daphne (``deploy/``). Returns the last take's result."""
    waiter = _register(wait, None)
    try:
        deadline = time.monotonic() + max(0.0, wait.timeout_s)
        result = wait.take(True)
        while not wait.done(result) and not waiter.final:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            _set_waiting(waiter, True)
            try:
                waiter.event.wait(min(remaining, SYNC_RECHECK_S))
            finally:
                _set_waiting(waiter, False)
            if waiter.final:
                break
            waiter.event.clear()
            result = wait.take(False)
        if _superseded_holding(waiter, result):
            _give_back(wait, result)
            return wait.empty
        return result
    finally:
        _unregister(waiter)


def _superseded_holding(waiter: _Waiter, result) -> bool:
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


# --- per event loop: wake-ups from other processes, the safety re-check ---------------


def batch(name, flush, item, *, every_s: float | None = None) -> asyncio.Future:
    """Add ``item`` to the running event loop's batch ``name`` (any hashable), which
    ``flush(items)`` (a coroutine function) takes whole, one flush at a time, as the
    starts of waits are (``Wait.starts``): at once after a quiet spell, else once the
    flush in flight ended and ``every_s`` seconds (``RUNSTEAD_LONGPOLL_START_BATCH_S``
    unless given; 0: as soon as it ended) after it began. Returns the future of that
    flush's result (or of its exception); shield it, another caller may share it."""
    pump = _pump_for(asyncio.get_running_loop())
    batches = pump.batches.get(name)
    if batches is None:
        batches = pump.batches[name] = _Batches(pump, flush, every_s)
    return batches.add(item)


def _pump_for(loop) -> "_Pump":
    with _lock:
        for old in [other for other in _pumps if other.is_closed()]:
            del _pumps[old]
        pump = _pumps.get(loop)
        if pump is None:
            pump = _pumps[loop] = _Pump(loop)
    return pump


class _Pump:
    """The background of one event loop with waiters: its channel on the layer (joined to
    the groups of the keys waited on here) and its safety re-check. Event loop only."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.remote = layer_is_remote()
        self.channel = None
        self.channel_ready = asyncio.Event()
        self.joined: dict[str, float] = {}  # key -> last time a wait of it was here
        self.joining: set[str] = set()  # keys whose group this loop's channel is yet to join
        self.joiner = False  # whether a task joins them
        self.tasks: set[asyncio.Task] = set()
        self.starts = _Batches(self, self._starts)  # of waits, for ``Wait.starts``
        self.batches: dict = {}  # name -> _Batches, for ``batch``
        self.superseding = _Batches(self, self._send_superseding)  # of [key, started]
        self.supersede_joined = float("-inf")
        self._spawn(self._recheck_loop())
        if self.remote:
            self._spawn(self._reader_loop())

    def _spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self.tasks.discard)

    async def _starts(self, batch: list[Wait]) -> set[str]:
        """The keys of ``batch`` whose first take could find something (``Wait.starts``)."""
        by_starts: dict = {}
        for wait in batch:
            by_starts.setdefault(wait.starts, []).append(wait)
        keys: set[str] = set()
        for starts, waits in by_starts.items():
            keys.update(await run_db(starts, waits))
        return keys

    def watch(self, key: str) -> None:
        if self.remote and key not in self.joined:
            self.joining.add(key)
            if not self.joiner:
                self.joiner = True
                self._spawn(self._join())
        self.joined[key] = time.monotonic()

    def seen(self, key: str) -> None:
        if key in self.joined:
            self.joined[key] = time.monotonic()

    async def _join(self) -> None:
        """Join the groups of ``joining`` one after the other: a wave of new keys (every
        worker after a restart) takes one connection of the layer's pool, not all."""
        try:
            await self.channel_ready.wait()
            layer = get_channel_layer()
            while self.joining:
                key = self.joining.pop()
                try:
                    await layer.group_add(group_name(key), self.channel)
                except Exception as exc:  # the layer is down: the safety re-check still delivers
                    log.warning("channel layer group_add failed (%s); relying on the re-check", exc)
                    for left in (key, *self.joining):  # the re-check watches them again
                        self.joined.pop(left, None)
                    self.joining.clear()
        finally:
            self.joiner = False

    async def _reader_loop(self) -> None:
        layer = get_channel_layer()
        # One channel per loop, with channels_redis's default prefix so it shares the
        # process's one receive loop with the board consumers instead of competing with it.
        self.channel = await layer.new_channel()
        self.channel_ready.set()
        await self._join_superseding()
        while True:
            try:
                message = await layer.receive(self.channel)
            except Exception as exc:
                if asyncio.current_task().cancelling():
                    # The loop is closing: a client library turned the cancellation into
                    # its own error (redis-py's read timeout); end instead of retrying.
                    raise asyncio.CancelledError from exc
                # A Redis outage or restart loses group memberships: join again later.
                log.warning("channel layer receive failed (%s); retrying in %s s", exc, LAYER_RETRY_S)
                self.joined = {}
                self.supersede_joined = float("-inf")  # the re-check joins it again
                await asyncio.sleep(LAYER_RETRY_S)
                continue
            if message.get("type") == "wait.wake":
                wake(message.get("key", ""), loop=self.loop)
            elif message.get("type") == "wait.supersede" and message.get("origin") != _PROCESS:
                for key, started in message.get("waits", ()):
                    supersede_older(str(key), float(started), loop=self.loop)

    async def _join_superseding(self) -> None:
        try:
            await get_channel_layer().group_add(SUPERSEDE_GROUP, self.channel)
            self.supersede_joined = time.monotonic()
        except Exception as exc:  # the re-check tries again
            log.warning("channel layer group_add of %s failed (%s)", SUPERSEDE_GROUP, exc)

    def supersede_elsewhere(self, key: str, started: float) -> None:
        """An exclusive wait of ``key`` began here at ``started``: the other processes end
        their older ones (W5: one poller per machine, whichever process it reached). Sent
        at once after a quiet spell, else with the others of its start batch: one
        message per ``RUNSTEAD_LONGPOLL_START_BATCH_S`` at most."""
        if self.remote:
            self.superseding.add([key, started])

    async def _send_superseding(self, waits: list[list]) -> None:
        message = {"type": "wait.supersede", "waits": waits, "origin": _PROCESS}
        await _quiet(get_channel_layer().group_send(SUPERSEDE_GROUP, message))

    async def _recheck_loop(self) -> None:
        interval = settings.RUNSTEAD_LONGPOLL_RECHECK_S
        while True:
            await asyncio.sleep(interval)
            mine = _snapshot(loop=self.loop)
            if self.channel is not None and time.monotonic() - self.supersede_joined > GROUP_REJOIN_S:
                self.joined = {}  # the keys waited on now are joined again just below
                self._spawn(self._join_superseding())
            if self.remote:
                for key in {w.wait.key for w in mine} - set(self.joined):
                    self.watch(key)
                self._discard_idle_groups({w.wait.key for w in mine})
            by_check: dict = {}
            for waiter in mine:
                by_check.setdefault(waiter.wait.ready, set()).add(waiter.wait.key)
            for ready, keys in by_check.items():
                if ready is None:
                    found = keys
                else:
                    try:
                        found = await run_db(ready, sorted(keys))
                    except Exception:
                        log.exception("long-poll re-check failed")
                        continue
                for key in found:
                    wake(key, "recheck", loop=self.loop)

    def _discard_idle_groups(self, waited: set[str]) -> None:
        cutoff = time.monotonic() - GROUP_IDLE_DISCARD_S
        idle = [key for key, at in self.joined.items() if at < cutoff and key not in waited]
        layer = get_channel_layer()
        for key in idle:
            del self.joined[key]
            if self.channel is not None:
                self._spawn(_quiet(layer.group_discard(group_name(key), self.channel)))


class _Batches:
    """Items added on one event loop go to ``flush(items)`` (a coroutine function)
    together, one flush at a time: at once after a quiet spell, else once the flush in
    flight ended and ``every_s`` seconds (``RUNSTEAD_LONGPOLL_START_BATCH_S`` unless
    given) after it began. ``add`` returns the future of that flush's result (or of its
    exception). Event loop only."""

    def __init__(self, pump: "_Pump", flush, every_s: float | None = None):
        self.pump, self.flush, self.every_s = pump, flush, every_s
        self.items: list | None = None
        self.result: asyncio.Future | None = None
        self.last = float("-inf")  # monotonic seconds of the last flush
        self.in_flight: asyncio.Future | None = None  # the result of the flush under way

    def add(self, item) -> asyncio.Future:
        if self.items is None:
            self.items, self.result = [], self.pump.loop.create_future()
            self.pump._spawn(self._flush_later())
        self.items.append(item)
        return self.result

    async def _flush_later(self) -> None:
        if self.in_flight is not None:
            await asyncio.wait({self.in_flight})
        every = settings.RUNSTEAD_LONGPOLL_START_BATCH_S if self.every_s is None else self.every_s
        await asyncio.sleep(max(0.0, self.last + every - time.monotonic()))
        items, result = self.items, self.result
        self.items = self.result = None
        self.last, self.in_flight = time.monotonic(), result
        try:
            result.set_result(await self.flush(items))
        except Exception as exc:
            result.set_exception(exc)
            result.exception()  # retrieved: whoever still awaits it raises it


async def _quiet(coro) -> None:
    try:
        await coro
    except Exception:
        pass
