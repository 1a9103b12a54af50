"""The background of each event loop with waits (D1, W5): its channel on the channel
layer (joined to the groups of the keys waited on there, and to ``SUPERSEDE_GROUP``),
its safety re-check, and its batches (``batch``: the starts of waits, supersessions
sent to the other processes, the fast path's token reads). See ``README.md``."""
import asyncio
import logging
import threading
import time

from channels.layers import get_channel_layer
from django.conf import settings

from core.longpoll.registry import PROCESS, Wait, group_name, layer_is_remote, run_db, snapshot, supersede_older, wake

log = logging.getLogger("runstead.waiting")

LAYER_RETRY_S = 1.0  # after a failed channel layer receive (Redis down)
GROUP_IDLE_DISCARD_S = 120.0  # leave a key's group once nobody here waited on it for this long
# Every event loop's channel is in this group: the exclusive waits that began on one loop
# within a start batch go to the others in one message (W5 across processes).
SUPERSEDE_GROUP = "waits-superseding"
# Join the groups again this often: channels_redis forgets a member a day after it joined.
GROUP_REJOIN_S = 3600.0


def _checkable(keys: list[str], loop) -> list:
    """This process's waiters of ``keys`` on ``loop`` whose wait has a ``ready`` check (the
    others would each take again; they wait for the safety re-check, as before)."""
    return [waiter for key in keys for waiter in snapshot(key, loop) if waiter.wait.ready is not None]


_lock = threading.Lock()
_pumps: dict[asyncio.AbstractEventLoop, "Pump"] = {}


def pump_for(loop: asyncio.AbstractEventLoop) -> "Pump":
    """The ``Pump`` of ``loop``, started the first time; those of closed loops are dropped
    (each test has its own loop)."""
    with _lock:
        for old in [other for other in _pumps if other.is_closed()]:
            del _pumps[old]
        pump = _pumps.get(loop)
        if pump is None:
            pump = _pumps[loop] = Pump(loop)
    return pump


def batch(name, flush, item, *, every_s: float | None = None) -> asyncio.Future:
    """Add ``item`` to the running event loop's batch ``name`` (any hashable), which
    ``flush(items)`` (a coroutine function) takes whole, one flush at a time, as the
    starts of waits are (``Wait.starts``): at once after a quiet spell, else once the
    flush in flight ended and ``every_s`` seconds (``RUNSTEAD_LONGPOLL_START_BATCH_S``
    unless given; 0: as soon as it ended) after it began. Returns the future of that
    flush's result (or of its exception); shield it, another caller may share it."""
    pump = pump_for(asyncio.get_running_loop())
    batches = pump.batches.get(name)
    if batches is None:
        batches = pump.batches[name] = Batches(pump, flush, every_s)
    return batches.add(item)


class Pump:
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
        self.starts: dict[float | None, Batches] = {}  # Wait.starts_every_s -> its batches of waits (Wait.starts)
        self.batches: dict = {}  # name -> Batches, for ``batch``
        self.superseding = Batches(self, self._send_superseding)  # of [key, started]
        self.supersede_joined = float("-inf")
        self.spawn(self._recheck_loop())
        if self.remote:
            self.spawn(self._reader_loop())

    def spawn(self, coro) -> None:
        task = self.loop.create_task(coro)
        self.tasks.add(task)  # the loop keeps only a weak reference
        task.add_done_callback(self.tasks.discard)

    def start(self, wait: Wait) -> asyncio.Future:
        """The future of the keys of ``wait``'s batch of starts (``Wait.starts``) whose first
        take could find something; batched with the waits of the same ``starts_every_s``."""
        batches = self.starts.get(wait.starts_every_s)
        if batches is None:
            batches = self.starts[wait.starts_every_s] = Batches(self, self._starts, every_s=wait.starts_every_s)
        return batches.add(wait)

    async def _starts(self, batch: list[Wait]) -> set[str]:
        """The keys of ``batch`` whose first take could find something (``Wait.starts``)."""
        by_starts: dict = {}
        for wait in batch:
            by_starts.setdefault(wait.starts, []).append(wait)
        keys: set[str] = set()
        for starts, waits in by_starts.items():
            keys.update(await run_db(starts, waits))
        return keys

    def hears(self, key: str) -> bool:
        """Whether a wake-up of ``key`` from any process reaches this loop now: always with
        a layer local to this process; with Redis, while its channel is in the key's group
        (joined or being joined since a wait of it began here)."""
        return not self.remote or key in self.joined

    def watch(self, key: str) -> None:
        """A wait of ``key`` began on this loop: its channel joins the key's group."""
        if self.remote and key not in self.joined:
            self.joining.add(key)
            if not self.joiner:
                self.joiner = True
                self.spawn(self._join())
        self.joined[key] = time.monotonic()

    def seen(self, key: str) -> None:
        """A wait of ``key`` ended on this loop: its group is left once idle."""
        if key in self.joined:
            self.joined[key] = time.monotonic()

    async def _join(self) -> None:
        """Join the groups of ``joining`` one after the other: a wave of new keys (every
        worker after a restart) takes one connection of the layer's pool, not all. A
        wake-up published before its key's group was joined never came here, and the
        wait's first look may have come before that commit: so the keys just joined are
        looked at once more by their waits' ``ready`` (``_check``), every
        ``RUNSTEAD_LONGPOLL_START_BATCH_S`` of joining and at its end, instead of at the
        next safety re-check, 5 s (issue 44: a 10,000-worker wave on three daphnes made
        3,333 joins each, over 5 s)."""
        joined, since = [], time.monotonic()
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
                    break
                joined.append(key)
                if time.monotonic() - since >= settings.RUNSTEAD_LONGPOLL_START_BATCH_S:
                    self.spawn(self._check(_checkable(joined, self.loop)))
                    joined, since = [], time.monotonic()
            if joined:
                self.spawn(self._check(_checkable(joined, self.loop)))
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
                    # The loop is closing and the cancellation came out as the client
                    # library's own error: end instead of retrying.
                    raise asyncio.CancelledError from exc
                # A Redis outage or restart loses group memberships: join again later.
                log.warning("channel layer receive failed (%s); retrying in %s s", exc, LAYER_RETRY_S)
                self.joined = {}
                self.supersede_joined = float("-inf")  # the re-check joins it again
                await asyncio.sleep(LAYER_RETRY_S)
                continue
            if message.get("type") == "wait.wake":
                wake(message.get("key", ""), loop=self.loop)
            elif message.get("type") == "wait.supersede" and message.get("origin") != PROCESS:
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
        message = {"type": "wait.supersede", "waits": waits, "origin": PROCESS}
        await quiet(get_channel_layer().group_send(SUPERSEDE_GROUP, message))

    async def _recheck_loop(self) -> None:
        interval = settings.RUNSTEAD_LONGPOLL_RECHECK_S
        while True:
            await asyncio.sleep(interval)
            mine = snapshot(loop=self.loop)
            if self.channel is not None and time.monotonic() - self.supersede_joined > GROUP_REJOIN_S:
                self.joined = {}  # the keys waited on now are joined again just below
                self.spawn(self._join_superseding())
            if self.remote:
                for key in {w.wait.key for w in mine} - set(self.joined):
                    self.watch(key)
                self._discard_idle_groups({w.wait.key for w in mine})
            await self._check(mine)

    async def _check(self, waiters: list) -> None:
        """Wake those of ``waiters`` (this loop's) whose take would find something now, by
        their wait's ``ready`` (one call per ``ready`` for all its keys; without one, every
        waiter takes again): the safety re-check (D1)."""
        by_check: dict = {}
        for waiter in waiters:
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
                self.spawn(quiet(layer.group_discard(group_name(key), self.channel)))


class Batches:
    """Items added on one event loop go to ``flush(items)`` (a coroutine function)
    together, one flush at a time: at once after a quiet spell, else once the flush in
    flight ended and ``every_s`` seconds (``RUNSTEAD_LONGPOLL_START_BATCH_S`` unless
    given) after it began. ``add`` returns the future of that flush's result (or of its
    exception). Event loop only."""

    def __init__(self, pump: Pump, flush, every_s: float | None = None):
        self.pump, self.flush, self.every_s = pump, flush, every_s
        self.items: list | None = None
        self.result: asyncio.Future | None = None
        self.last = float("-inf")  # monotonic seconds of the last flush
        self.in_flight: asyncio.Future | None = None  # the result of the flush under way

    def add(self, item) -> asyncio.Future:
        if self.items is None:
            self.items, self.result = [], self.pump.loop.create_future()
            self.pump.spawn(self._flush_later())
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


async def quiet(coro) -> None:
    """Await ``coro``, ignoring its failure (a best-effort channel layer call)."""
    try:
        await coro
    except Exception:
        pass
