"""Admission to Django's request handler under daphne (issue 44; SPEC D2, L2).

Django's ASGI handler runs every request in a thread of its own and lets in as many as
arrive: a burst of 1,000 machines' syncs becomes 1,000 threads fighting over the
interpreter and the connection pool, and a machine's lease renewal waits behind the
grants, acknowledgements and submissions that came before it, until its lease expires
(L6) and a healthy agent is stopped (L4).

``RequestGate`` wraps Django's ASGI app (the long-polls go around both, ``core/longpoll``):
at most ``RUNSTEAD_REQUEST_SLOTS`` HTTP requests are in Django at once per event loop; the
others wait on the event loop (no thread, no connection), renewals first (a renewal keeps
a running agent alive; the rest can wait), then in order of arrival, with one slot kept
for the rest while they wait (``Slots``). A request that waited
``RUNSTEAD_REQUEST_QUEUE_S`` without a slot is answered 503 ``service_busy`` with
``Retry-After: 1`` and never performed (the worker tries again, as for any 5xx).

Production's ``/api/`` runs under gunicorn (SPEC D3), whose fixed threads bound it already;
this gate serves the embedded default and the daphnes of D1.
"""
import asyncio
import json
import logging
from collections import deque

from django.conf import settings

from core.errors import service_busy
from core.longpoll.router import of_running_loop, security_headers

log = logging.getLogger("runstead.admission")

RENEWAL, OTHER = 0, 1  # admission classes, lowest first


def admission_class(scope) -> int:
    """``RENEWAL`` for a machine's lease renewals (``POST /api/worker/sync/``, which also
    carries its receipts, and ``POST /api/worker/leases/<id>/renew/``), ``OTHER`` for the
    rest."""
    if scope["method"] == "POST":
        path = scope["path"]
        if path == "/api/worker/sync/" or (path.startswith("/api/worker/leases/") and path.endswith("/renew/")):
            return RENEWAL
    return OTHER


class Slots:
    """The ``size`` slots of one event loop: ``free`` ones, the requests inside by class
    (``inside``), and the requests waiting for one, a queue per class. A freed slot goes to
    the first renewal waiting, unless renewals already hold ``size - 1`` slots (at least
    one) and another request waits: that one goes in, so the owner's requests still move
    when the machines' renewals alone would fill the process. Event loop only."""

    _loops: "dict[asyncio.AbstractEventLoop, Slots]" = {}

    def __init__(self, size: int):
        self.free = size
        self.renewals_max = max(1, size - 1)
        self.inside = {RENEWAL: 0, OTHER: 0}
        self.waiting: dict[int, deque] = {RENEWAL: deque(), OTHER: deque()}

    @classmethod
    def here(cls) -> "Slots":
        """This event loop's slots, ``RUNSTEAD_REQUEST_SLOTS`` of them."""
        return of_running_loop(cls._loops, lambda _loop: cls(settings.RUNSTEAD_REQUEST_SLOTS))

    def take(self, klass: int) -> bool:
        """A slot at once for a request of ``klass``, if one is free and nobody waits."""
        if self.free and not self._next():
            self._enter(klass)
            return True
        return False

    async def wait(self, klass: int, timeout_s: float) -> bool:
        """Wait until ``release`` hands this request a slot: True; False after
        ``timeout_s`` seconds without one."""
        future = asyncio.get_running_loop().create_future()
        self.waiting[klass].append(future)
        try:
            async with asyncio.timeout(timeout_s):
                await asyncio.shield(future)
            return True
        except TimeoutError:
            return self._gave_up(future)
        except asyncio.CancelledError:
            if self._gave_up(future):
                self.release(klass)
            raise

    def _gave_up(self, future: asyncio.Future) -> bool:
        """Whether the slot reached ``future`` after all (handed over in the same turn of
        the loop as the timeout); otherwise it is marked cancelled and skipped."""
        if future.done():
            return True
        future.cancel()
        return False

    def release(self, klass: int) -> None:
        """A request of ``klass`` left its slot: hand it over (see the class docstring)."""
        self.inside[klass] -= 1
        self.free += 1
        while self.free and (nxt := self._next()) is not None:
            self._enter(nxt)
            self.waiting[nxt].popleft().set_result(None)

    def _next(self) -> int | None:
        """The class whose first waiting request gets the next free slot, or None."""
        for queue in self.waiting.values():
            while queue and queue[0].done():  # gave up waiting
                queue.popleft()
        renewals, others = self.waiting[RENEWAL], self.waiting[OTHER]
        if renewals and (self.inside[RENEWAL] < self.renewals_max or not others):
            return RENEWAL
        return OTHER if others else None

    def _enter(self, klass: int) -> None:
        self.free -= 1
        self.inside[klass] += 1


BUSY = service_busy()
BUSY_BODY = json.dumps(BUSY.body()).encode()


class RequestGate:
    """ASGI app: ``app``'s HTTP requests go in through this event loop's ``Slots``
    (see the module docstring); WebSockets and lifespan pass straight through."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        slots, klass = Slots.here(), admission_class(scope)
        if not slots.take(klass):
            log.debug("%s %s waits for a slot (class %s)", scope["method"], scope["path"], klass)
            if not await slots.wait(klass, settings.RUNSTEAD_REQUEST_QUEUE_S):
                return await _busy(scope, send)
        try:
            return await self.app(scope, receive, send)
        finally:
            slots.release(klass)


async def _busy(scope, send) -> None:
    """``core.errors.service_busy`` (as the exception handler answers a ``PoolTimeout``),
    with the security headers."""
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(BUSY_BODY)).encode()),
               *((k.lower().encode(), v.encode()) for k, v in BUSY.headers.items()), *security_headers(scope)]
    await send({"type": "http.response.start", "status": BUSY.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": BUSY_BODY})
