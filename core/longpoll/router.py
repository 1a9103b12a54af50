"""The ASGI router (``config/asgi.py``): a ``GET`` with ``?wait=`` for one of the declared
long-poll views is performed here, around Django's request handler (whose per-request
thread-sensitive context would hold a thread for the whole wait): the fast path or the
view in a pool thread, then ``take_or_wait`` with keep-alives, a bounded number of starts
at once, and the client's disconnect heard. See ``README.md``."""
import asyncio
import functools
import io
import logging
from collections.abc import Iterable
from urllib.parse import parse_qs

from django.conf import settings
from django.core.handlers.asgi import ASGIRequest
from django.http import HttpResponse
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.security import SecurityMiddleware
from django.urls import Resolver404, resolve

from core.longpoll.loops import batch
from core.longpoll.perform import take_or_wait
from core.longpoll.registry import run_db
from core.longpoll.view import WaitResponse, quick_key, quick_start, quick_warm

log = logging.getLogger("runstead.longpoll")


class LongPollRouter:
    """ASGI app: the waiting requests of ``views`` (view classes declaring ``long_poll``,
    ``core.longpoll.LongPoll``) are performed here; all else goes to ``django_app``."""

    def __init__(self, django_app, views: Iterable[type]):
        self.django_app = django_app
        self.views = tuple(views)
        for view in self.views:
            if getattr(view, "long_poll", None) is None:
                raise TypeError(f"{view.__name__} declares no long_poll (core.longpoll.LongPoll)")

    def match(self, scope):
        """The resolved view of a waiting request for one of ``views``, or None."""
        if scope["type"] != "http" or scope["method"] != "GET":
            return None
        if "wait" not in parse_qs(scope.get("query_string", b"").decode("latin-1")):
            return None
        found = _resolve(scope["path"])
        return found if found is not None and getattr(found.func, "view_class", None) in self.views else None

    async def __call__(self, scope, receive, send):
        found = self.match(scope)
        if found is None:
            return await self.django_app(scope, receive, send)
        return await long_poll(found, scope, receive, send)


@functools.lru_cache(maxsize=4096)
def _resolve(path: str):
    """``django.urls.resolve(path)``, or None; remembered, since every idle worker's pull
    asks for the same path every ~25 s (the URLconf does not change while serving)."""
    try:
        return resolve(path)
    except Resolver404:
        return None


def _dispatch(found, scope):
    """Run the view in this (pool) thread; a ``WaitResponse`` comes back unperformed,
    anything else rendered."""
    request = ASGIRequest(scope, io.BytesIO(b""))
    response = found.func(request, *found.args, **found.kwargs)
    if not isinstance(response, WaitResponse) and callable(getattr(response, "render", None)):
        response = response.render()
    return response


def _quick_start(found, scope) -> WaitResponse | None:
    return quick_start(found.func.view_class, scope, found.kwargs)


async def _warm(found, scope) -> bool:
    """For a start the fast path did not answer: its credential key (``quick_key``; None:
    nothing to read) joins the event loop's batch of such keys, which ONE ``quick_warm``
    reads in a pool thread (``batch``; the keys that come while a read is under way go to
    the next, at once after it), so that the fast path answers it: a wave of 1,000 pull
    starts makes a few reads, not 1,000 view dispatches. Whether it read (then ask the
    fast path again); a failure is left to the view, which answers it with its errors."""
    view_class = found.func.view_class
    key = quick_key(view_class, scope, found.kwargs)
    if key is None:
        return False
    flush = functools.partial(run_db, quick_warm, view_class)
    try:
        await asyncio.shield(batch((_warm, view_class), flush, key, every_s=0))
    except Exception as exc:
        log.debug("%s: the batched read before quick starts failed (%s); the view answers", view_class.__name__, exc)
        return False
    return True


def security_headers(scope) -> list[tuple[bytes, bytes]]:
    """The headers Django's ``SecurityMiddleware`` and ``XFrameOptionsMiddleware`` add to
    an answer to this request (``X-Content-Type-Options``, ``Referrer-Policy``,
    ``Cross-Origin-Opener-Policy``, ``X-Frame-Options``, and ``Strict-Transport-Security``
    when the request is secure, as the settings say), as ``(name, value)`` byte pairs: the
    answers this router sends skip Django's middleware, not its headers (K: the same
    headers on every answer of the API)."""
    forwarded = next((v for k, v in scope.get("headers", ()) if k == b"x-forwarded-proto"), b"")
    return _security_headers(scope.get("scheme", "http"), forwarded)


@functools.lru_cache(maxsize=16)
def _security_headers(scheme: str, forwarded_proto: bytes) -> list[tuple[bytes, bytes]]:
    """Made by the two middlewares themselves, on an empty answer to a request that is
    secure as this one is (its scheme, or the proxy's ``X-Forwarded-Proto``)."""
    scope = {"type": "http", "method": "GET", "path": "/", "query_string": b"", "scheme": scheme,
             "headers": [(b"x-forwarded-proto", forwarded_proto)] if forwarded_proto else []}
    request, response = ASGIRequest(scope, io.BytesIO(b"")), HttpResponse()
    for middleware in (SecurityMiddleware, XFrameOptionsMiddleware):
        response = middleware(lambda _request: response).process_response(request, response)
    return [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in response.items() if k.lower() != "content-type"]


async def _send(send, response, scope) -> None:
    headers = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in response.items()]
    given = {k.lower() for k, _ in headers}
    headers += [(k, v) for k, v in security_headers(scope) if k not in given]
    headers.append((b"content-length", str(len(response.content)).encode()))
    await send({"type": "http.response.start", "status": response.status_code, "headers": headers})
    await send({"type": "http.response.body", "body": response.content})


async def _disconnected(receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def of_running_loop(registry: dict, make):
    """``registry[loop]`` of the running event loop, made by ``make(loop)`` the first
    time; entries of closed loops are dropped (each test has its own loop)."""
    loop = asyncio.get_running_loop()
    found = registry.get(loop)
    if found is None:
        for old in [other for other in registry if other.is_closed()]:
            del registry[old]
        found = registry[loop] = make(loop)
    return found


class _Streaming:
    """A waiting response's keep-alive side (D1): one space of the body at a time (JSON
    allows leading whitespace); the first one starts the response (the view has
    authorised, so the status is known; no length, so the server sends it chunked and a
    proxy flushes each write)."""

    __slots__ = ("send", "status", "started", "sending", "headers")

    def __init__(self, send, status: int, scope):
        self.send, self.status = send, status
        self.headers = [(b"content-type", b"application/json"), (b"cache-control", b"no-store"), *security_headers(scope)]
        self.started = False  # the response has begun: only the body may follow
        self.sending = False

    async def keepalive(self) -> None:
        self.sending = True
        try:
            if not self.started:
                await self.send({"type": "http.response.start", "status": self.status, "headers": self.headers})
                self.started = True
            await self.send({"type": "http.response.body", "body": b" ", "more_body": True})
        finally:
            self.sending = False


class _KeepAlive:
    """The keep-alives of every waiting long-poll of one event loop from ONE timer (not a
    timer per response; 1,000 idle workers): every ``RUNSTEAD_LONGPOLL_KEEPALIVE_S``
    seconds each response added before that tick gets a space, so the first comes
    within that many seconds of the start and the next ones that far apart. Event loop only."""

    _loops: "dict[asyncio.AbstractEventLoop, _KeepAlive]" = {}

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.responses: set[_Streaming] = set()
        self.timer = None
        self.senders: set[asyncio.Task] = set()  # the loop keeps only a weak reference

    @classmethod
    def here(cls) -> "_KeepAlive":
        return of_running_loop(cls._loops, cls)

    def add(self, response: _Streaming) -> None:
        self.responses.add(response)
        if self.timer is None:
            self.timer = self.loop.call_later(settings.RUNSTEAD_LONGPOLL_KEEPALIVE_S, self._tick)

    def _tick(self) -> None:
        self.timer = None
        if self.responses:
            sender = self.loop.create_task(self._send_all(list(self.responses)))
            self.senders.add(sender)
            sender.add_done_callback(self.senders.discard)
            self.timer = self.loop.call_later(settings.RUNSTEAD_LONGPOLL_KEEPALIVE_S, self._tick)

    async def _send_all(self, responses: list[_Streaming]) -> None:
        for response in responses:
            if response in self.responses:  # not answered meanwhile
                try:
                    await response.keepalive()
                except Exception:  # the connection is gone: its request ends on the disconnect
                    self.responses.discard(response)


class _Admission:
    """At most ``RUNSTEAD_LONGPOLL_START_SLOTS`` wait starts (the view, then the first
    take: the database work of a pull start) at once per event loop, so a wave of pulls
    (every worker after a restart) queues behind itself, not in front of the API's
    requests for the threads, the connection pool and the interpreter."""

    _semaphores: "dict[asyncio.AbstractEventLoop, asyncio.Semaphore]" = {}

    def __init__(self):
        self.semaphore = of_running_loop(self._semaphores,
                                         lambda loop: asyncio.Semaphore(settings.RUNSTEAD_LONGPOLL_START_SLOTS))
        self.held = False

    async def __aenter__(self):
        await self.semaphore.acquire()
        self.held = True
        return self

    def release(self) -> None:
        if self.held:
            self.held = False
            self.semaphore.release()

    async def __aexit__(self, *exc):
        self.release()


async def long_poll(found, scope, receive, send) -> None:
    """One waiting request (``found``: its ``ResolverMatch``). The fast path (no I/O)
    comes first, after one batched read if it needs one (``_warm``); whatever it does not
    answer goes to the view. The view and the first take wait for one of the loop's
    start slots (``_Admission``). While it waits, a space goes out every
    ``RUNSTEAD_LONGPOLL_KEEPALIVE_S`` seconds if the view's ``LongPoll`` says so, so the
    client sees a half-open connection by the silence (D1)."""
    response = _quick_start(found, scope)
    if response is None and await _warm(found, scope):
        response = _quick_start(found, scope)
    async with _Admission() as admission:
        await _long_poll(found, scope, receive, send, admission, response)


async def _long_poll(found, scope, receive, send, admission: _Admission, response: WaitResponse | None) -> None:
    disconnect = asyncio.ensure_future(_disconnected(receive))
    waiting = streaming = None
    try:
        if response is None:
            response = await run_db(_dispatch, found, scope)
        if isinstance(response, WaitResponse):
            waiting = asyncio.ensure_future(take_or_wait(response.wait, first_taken=admission.release))
        else:
            admission.release()
        if waiting is not None:
            streaming, keepalive = _Streaming(send, response.status_code, scope), _KeepAlive.here()
            if response.keepalive:
                keepalive.add(streaming)
            try:
                await asyncio.wait({waiting, disconnect}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                keepalive.responses.discard(streaming)
            while streaming.sending:  # a keep-alive that began goes out whole before the body
                await asyncio.sleep(0)
            if not waiting.done():  # the client is gone; a take in flight is released
                waiting.cancel()
                await asyncio.wait({waiting})
                return
            result = waiting.result()
            if disconnect.done():
                if response.wait.release is not None and response.wait.done(result):
                    await run_db(response.wait.release, result)
                return
            response = await run_db(response.finish, result) if response.render_in_thread else response.finish(result)
        if disconnect.done():
            return
        if streaming is not None and streaming.started:
            await send({"type": "http.response.body", "body": response.content})
        else:
            await _send(send, response, scope)
    finally:
        disconnect.cancel()
        if waiting is not None and not waiting.done():  # this request itself was cancelled
            waiting.cancel()
