"""The waits of this process and their wake-ups (D1, D2, W5, Q3): ``Wait`` (what one
long-poll waits for), the registry of waiters (any thread), ``notify`` /
``notify_after_commit`` / ``wake``, ``stop_all``, ``waiting``. See ``README.md``."""
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
from django.db import connections, transaction

log = logging.getLogger("runstead.waiting")

GROUP_PREFIX = "wait."
KEY_PATTERN = re.compile(r"[A-Za-z0-9_.-]{1,90}")  # a channels group name once prefixed
FINAL = ("superseded", "stopped")
PROCESS = uuid.uuid4().hex  # tells this process's supersessions from the others'


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
      A start of a key woken in this process while nothing here waited on it (within
      ``MISSED_KEEP_S``: a task submitted in a reconnect wave, before its machine's pull
      came back) skips the batch and makes its first take at once (``take_missed``).
    - ``subject``: what the wait is for, for ``starts`` (the pull's machine).
    - ``starts_every_s``: at most one ``starts`` call per that many seconds for the waits
      that share it (None: ``RUNSTEAD_LONGPOLL_START_BATCH_S``); a wait whose first take
      is only a safety check (a decision made between two waits of a hook) batches longer.
    - ``resume(last) -> first result | None``: optional, with ``starts``: a start of a key
      whose previous wait in this process ended by its timeout, not done, with no wake-up
      of the key since (and this event loop still in the key's group: it would have
      heard one) begins from that wait's last result instead of joining ``starts``'s
      batch: no database read at all (issue 44: a hook waiting again). Called on the
      event loop (no I/O); None: go through ``starts`` after all.
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
    starts_every_s: float | None = None
    resume: Callable[[Any], Any] | None = None

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


class Waiter:
    """One wait in progress: ``loop`` is None when a thread waits (the sync form).
    ``reason`` says why it was last woken; ``waiting`` whether it waits for a wake-up now."""

    __slots__ = ("wait", "loop", "event", "reason", "waiting", "started", "wakes")

    def __init__(self, wait: Wait, loop):
        self.wait = wait
        self.loop = loop
        self.started = time.time()  # UTC seconds: which of two processes' waits is newer
        self.event = threading.Event() if loop is None else asyncio.Event()
        self.reason = None
        self.waiting = False
        self.wakes = 0  # wake-ups counted by ``wake`` under the registry's lock (``quiet``)

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
_waiters: dict[str, set[Waiter]] = {}
_stopping = False
# Keys whose last wait here ended by its timeout with no wake-up since: key -> its last
# result, for the next start's ``Wait.resume`` (``quiet``, ``take_quiet``); a wake-up of
# the key forgets it. At most QUIET_MAX keys (the oldest go first).
_quiet: dict[str, Any] = {}
QUIET_MAX = 100_000
# Keys woken when no waiter of theirs was here: key -> monotonic seconds, for the next
# start's first take (``take_missed``). Kept MISSED_KEEP_S seconds (about one pull cycle),
# at most MISSED_MAX keys (the oldest go first).
_missed: dict[str, float] = {}
MISSED_KEEP_S = 30.0
MISSED_MAX = 100_000


def register(wait: Wait, loop) -> Waiter:
    """Add a waiter of ``wait`` (on ``loop``, or None for a thread): an exclusive wait
    supersedes this process's older waiters of its key (W5); after ``stop_all`` it is
    stopped at once."""
    waiter = Waiter(wait, loop)
    with _lock:
        older = list(_waiters.get(wait.key, ())) if wait.exclusive else []
        _waiters.setdefault(wait.key, set()).add(waiter)
        stopping = _stopping
    for other in older:
        other.wake("superseded")
    if stopping:
        waiter.wake("stopped")
    return waiter


def unregister(waiter: Waiter) -> None:
    """Remove ``waiter`` (its wait ended, however)."""
    with _lock:
        group = _waiters.get(waiter.wait.key)
        if group is not None:
            group.discard(waiter)
            if not group:
                del _waiters[waiter.wait.key]


def set_waiting(waiter: Waiter, flag: bool) -> None:
    """Mark ``waiter`` as waiting for a wake-up (the fact tests poll for) or not."""
    with _lock:
        waiter.waiting = flag
    if flag:
        log.debug("wait %s: waiting for a wake-up", waiter.wait.key)


def snapshot(key=None, loop=...) -> list[Waiter]:
    """This process's waiters: of ``key`` (every key if None), of ``loop`` if given."""
    with _lock:
        groups = [_waiters.get(key, set())] if key is not None else list(_waiters.values())
        return [w for group in groups for w in group if loop is ... or w.loop is loop]


def waiting(key: str | None = None) -> int:
    """How many waits of this process wait for a wake-up now (they took and found
    nothing): of ``key``, or of every key. For tests and operators."""
    return sum(1 for waiter in snapshot(key) if waiter.waiting)


def wake(key: str, reason: str = "notified", *, loop=...) -> None:
    """Wake this process's waiters of ``key`` (of one event loop's only, if given), from
    any thread: each takes again. The key is no longer quiet (``quiet``)."""
    key = str(key)
    with _lock:
        _quiet.pop(key, None)
        waiters = [w for w in _waiters.get(key, ()) if loop is ... or w.loop is loop]
        for waiter in waiters:
            waiter.wakes += 1
        if not waiters:
            _remember_missed(key)
    for waiter in waiters:
        waiter.wake(reason)


def quiet(waiter: Waiter, last, wakes_seen: int) -> None:
    """``waiter``'s wait ended by its timeout with ``last`` as its result, not done: when
    nothing woke it since its last take began (``wakes_seen``, its ``wakes`` then) and its
    wait can resume, the next start of its key may begin from ``last`` (``take_quiet``).
    Call it while the waiter is still registered."""
    if waiter.wait.resume is None:
        return
    with _lock:
        if waiter.wakes != wakes_seen:
            return
        _quiet.pop(waiter.wait.key, None)
        _quiet[waiter.wait.key] = last
        while len(_quiet) > QUIET_MAX:
            del _quiet[next(iter(_quiet))]


def _remember_missed(key: str) -> None:
    """Under ``_lock``: ``key`` was woken with no waiter here (``take_missed``)."""
    now = time.monotonic()
    _missed.pop(key, None)
    _missed[key] = now
    while len(_missed) > MISSED_MAX or next(iter(_missed.values())) < now - MISSED_KEEP_S:
        del _missed[next(iter(_missed))]  # the oldest first


def take_missed(key: str) -> bool:
    """Whether ``key`` was woken in the last ``MISSED_KEEP_S`` seconds while no waiter of
    it was here (``wake``), so its next start takes at once rather than in a batch of
    ``Wait.starts`` (D1: what the wake-up announced is found now, not at the batch's
    turn); forgotten either way (one start takes for it)."""
    with _lock:
        when = _missed.pop(key, None)
    return when is not None and time.monotonic() - when <= MISSED_KEEP_S


def take_quiet(key: str):
    """The last result of ``key``'s previous wait if it ended quiet (``quiet``), else None;
    forgotten either way (one start resumes from it)."""
    with _lock:
        return _quiet.pop(key, None)


def supersede_older(key: str, started: float, *, loop=...) -> None:
    """W5 across processes: end this process's exclusive waits of ``key`` that began
    before ``started`` (UTC seconds), as a newer one elsewhere does."""
    for waiter in snapshot(str(key), loop):
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
    for waiter in snapshot():
        waiter.wake("stopped")
