"""The worker long-poll without a thread or a database connection while it waits (D1, D2).

``GET /api/worker/messages/?wait=S`` is routed here by ``config/asgi.py`` before Django's
request handler (whose middleware would pin one thread per request for its whole life).
One pull:

1. In a pool thread (not a per-request thread), the DRF view ``WorkerMessages`` runs as
   it does under WSGI: authentication, ``last_heard_at``, input checks, and the first
   take, which returns the machine's delivered but unacknowledged messages too (a new
   pull means the previous connection is gone: one poller per machine, W5). The thread's
   database connection goes back at once.
2. With nothing to take, the pull waits on an ``asyncio.Event`` in this process's
   ``Waiters``: woken by ``machine_notify`` (sent after the commit that made a message
   visible: directly for pulls in the same process, over the channel layer group
   ``machine.<id>`` for the others), by one process-wide safety re-check every
   ``RUNSTEAD_LONGPOLL_RECHECK_S`` seconds (one query for all waiting machines; it also
   finds messages whose visibility window ran out), by a newer pull of the same machine
   (which supersedes it), or by the server stopping.
3. A client that disconnects ends the pull at once; whatever it had taken meanwhile is
   released (visible again) and announced.

Under WSGI (gunicorn, the Django test client) the same view waits by polling in its
thread; the production proxy sends this path to daphne (``deploy/``).
"""
import asyncio
import io
import logging
import threading
import time

from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.db import connections

from config import clock
from tasks_app.api.views import PendingPull, WorkerMessages, messages_response
from tasks_app.services import messages
from tasks_app.services.messages import machines_with_visible_messages
from tasks_app.wakeups import layer_is_remote, machine_group, registry_for

log = logging.getLogger("runstead.longpoll")

PATH = "/api/worker/messages/"
LAYER_RETRY_S = 1.0
GROUP_IDLE_DISCARD_S = 120.0


def run_db(fn, *args, **kwargs):
    """Run ``fn`` in the loop's shared thread pool and give its database connections back
    before returning: a waiting pull holds neither a thread nor a connection (D2)."""

    def call():
        try:
            return fn(*args, **kwargs)
        finally:
            connections.close_all()

    return sync_to_async(call, thread_sensitive=False)()


class Waiter:
    __slots__ = ("machine_id", "event", "reason")

    def __init__(self, machine_id: str):
        self.machine_id = machine_id
        self.event = asyncio.Event()
        self.reason = None

    def wake(self, reason: str):
        if self.reason not in ("superseded", "stopped"):
            self.reason = reason
        self.event.set()


class Waiters:
    """The waiting pulls of one event loop (one daphne process), by machine id."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.by_machine: dict[str, set[Waiter]] = {}
        self.joined: dict[str, float] = {}  # machine id -> last time a pull of it waited here
        self.channel = None
        self.channel_ready = asyncio.Event()
        self.stopping = False
        self._tasks = []

    # --- registration (event loop only) -----------------------------------------------

    def register(self, machine_id: str) -> Waiter:
        for older in self.by_machine.get(machine_id, ()):
            older.wake("superseded")
        waiter = Waiter(machine_id)
        if self.stopping:
            waiter.wake("stopped")
        self.by_machine.setdefault(machine_id, set()).add(waiter)
        self._start()
        if layer_is_remote() and machine_id not in self.joined:
            self._spawn(self._join(machine_id))
        self.joined[machine_id] = time.monotonic()
        return waiter

    def unregister(self, waiter: Waiter):
        group = self.by_machine.get(waiter.machine_id)
        if group is not None:
            group.discard(waiter)
            if not group:
                del self.by_machine[waiter.machine_id]
        if waiter.machine_id in self.joined:
            self.joined[waiter.machine_id] = time.monotonic()

    def wake(self, machine_id: str, reason: str = "notified"):
        for waiter in list(self.by_machine.get(str(machine_id), ())):
            waiter.wake(reason)

    def stop(self):
        self.stopping = True
        for group in list(self.by_machine.values()):
            for waiter in list(group):
                waiter.wake("stopped")

    # --- background: channel layer reader, safety re-check ------------------------------

    def _spawn(self, coro):
        task = self.loop.create_task(coro)
        self._tasks.append(task)
        task.add_done_callback(self._tasks.remove)

    def _start(self):
        if getattr(self, "_started", False):
            return
        self._started = True
        self.loop.create_task(self._recheck_loop())
        if layer_is_remote():
            self.loop.create_task(self._reader_loop())

    async def _join(self, machine_id: str):
        layer = get_channel_layer()
        try:
            await self.channel_ready.wait()
            await layer.group_add(machine_group(machine_id), self.channel)
        except Exception as exc:  # the layer is down: the safety re-check still delivers
            log.warning("channel layer group_add failed (%s); relying on the re-check", exc)
            self.joined.pop(machine_id, None)

    async def _reader_loop(self):
        layer = get_channel_layer()
        # One channel per process, with channels_redis's default prefix so it shares the
        # process's one receive loop with the board consumers instead of competing with it.
        self.channel = await layer.new_channel()
        self.channel_ready.set()
        while True:
            try:
                message = await layer.receive(self.channel)
            except Exception as exc:
                # A Redis outage or restart loses group memberships: join again later.
                log.warning("channel layer receive failed (%s); retrying in %s s", exc, LAYER_RETRY_S)
                self.joined = {}
                await asyncio.sleep(LAYER_RETRY_S)
                continue
            if message.get("type") == "machine.wake":
                self.wake(message.get("machine_id", ""))

    async def _recheck_loop(self):
        interval = settings.RUNSTEAD_LONGPOLL_RECHECK_S
        while True:
            await asyncio.sleep(interval)
            waiting = list(self.by_machine)
            if layer_is_remote():
                for machine_id in waiting:
                    if machine_id not in self.joined:
                        self._spawn(self._join(machine_id))
                        self.joined[machine_id] = time.monotonic()
                self._discard_idle_groups()
            if not waiting:
                continue
            try:
                ready = await run_db(machines_with_visible_messages, waiting)
            except Exception:
                log.exception("long-poll re-check failed")
                continue
            for machine_id in ready:
                self.wake(machine_id, "recheck")

    def _discard_idle_groups(self):
        cutoff = time.monotonic() - GROUP_IDLE_DISCARD_S
        idle = [m for m, t in self.joined.items() if t < cutoff and m not in self.by_machine]
        layer = get_channel_layer()
        for machine_id in idle:
            del self.joined[machine_id]
            if self.channel is not None:
                self._spawn(_quiet(layer.group_discard(machine_group(machine_id), self.channel)))


async def _quiet(coro):
    try:
        await coro
    except Exception:
        pass


def waiters() -> Waiters:
    """This event loop's registry (created on first use, kept in ``tasks_app.wakeups``)."""
    return registry_for(asyncio.get_running_loop(), Waiters)


# --- the ASGI endpoint ------------------------------------------------------------------


def route(django_app):
    """ASGI app: ``PATH`` to the long-poll, everything else to ``django_app``."""

    async def app(scope, receive, send):
        if scope["type"] == "http" and scope["path"] == PATH:
            return await long_poll(scope, receive, send)
        return await django_app(scope, receive, send)

    return app


def _begin(scope):
    """Run the DRF view in this (pool) thread; returns the rendered response, or the
    ``PendingPull`` it answered with when the pull has to wait."""
    request = ASGIRequest(scope, io.BytesIO(b""))
    request.runstead_async_pull = True
    response = WorkerMessages.as_view()(request)
    if hasattr(response, "render") and callable(response.render):
        response = response.render()
    return response


async def _send(send, response):
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.items()]
    headers.append((b"content-length", str(len(response.content)).encode()))
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


async def _disconnected(receive):
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def long_poll(scope, receive, send):
    """One pull (see the module docstring)."""
    disconnect = asyncio.ensure_future(_disconnected(receive))
    waiter = None
    registry = None
    try:
        first = await run_db(_begin, scope)
        if not isinstance(first, PendingPull):
            if not disconnect.done():
                await _send(send, first)
            elif getattr(first, "runstead_taken", None):
                await run_db(messages.messages_release, machine_id=first.runstead_machine, message_ids=first.runstead_taken)
            return
        registry = waiters()
        waiter = registry.register(first.machine_id)
        deadline = time.monotonic() + first.wait_s
        taken = []
        while not taken:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or waiter.reason in ("superseded", "stopped"):
                break
            woken = asyncio.ensure_future(waiter.event.wait())
            done, _ = await asyncio.wait({woken, disconnect}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            woken.cancel()
            if disconnect in done:
                return
            if woken not in done or waiter.reason in ("superseded", "stopped"):
                continue
            waiter.event.clear()
            taken = await _take_shielded(first.machine_id)
        if disconnect.done():
            if taken:
                await run_db(messages.messages_release, machine_id=first.machine_id, message_ids=[m.id for m in taken])
            return
        await _send(send, messages_response(taken))
    finally:
        disconnect.cancel()
        if waiter is not None:
            registry.unregister(waiter)


async def _take_shielded(machine_id):
    """Take the machine's visible messages; if this pull is cancelled meanwhile (the
    server stops), what the thread took is released, not lost for the visibility window."""
    future = asyncio.ensure_future(run_db(messages.messages_take, machine_id=machine_id, now=clock.now(), new_pull=False))
    try:
        return await asyncio.shield(future)
    except asyncio.CancelledError:
        def release(done):
            if not done.cancelled() and done.exception() is None and done.result():
                ids = [m.id for m in done.result()]
                threading.Thread(
                    target=lambda: _release_now(machine_id, ids), daemon=True
                ).start()

        future.add_done_callback(release)
        raise


def _release_now(machine_id, ids):
    try:
        messages.messages_release(machine_id=machine_id, message_ids=ids)
    finally:
        connections.close_all()
