"""The board's WebSocket (B2, K1, K2): authenticate, join the owner's group, forward.

Browsers authenticate with the session cookie and must come from an allowed origin;
terminal clients send ``Authorization: Token <key>`` (DRF token) instead. A browser cannot
put an Authorization header on a WebSocket, so a token connection skips the origin check
without opening a cross-site hole. Anonymous connections are refused (the handshake gets
HTTP 403). The consumer never reads or decides anything: it forwards ``board.event``
(and ``board.events``) messages sent by ``core.broadcast`` as JSON text, through one
``OwnerFeed`` per owner and process (one channel in the owner's group, fanned out here).
The events (B2; each shape a ``*BoardEvent`` in ``BOARD_EVENTS`` of ``board/schema.py``,
so ``/api/schema/`` documents them): ``task``, ``task.progress``, ``message``, ``machine``,
``pool`` (``{"pool": {id, name, machines, created_at, updated_at, version}, "version"}``,
C8: a machine pool created or changed) and ``pool.deleted`` (``{"pool_id", "version"}``),
``session.status``, ``marker``, ``session.deleted``, ``notification``, ``approval``,
``session.message``; each with ``server_time``.

Handshakes are rate-limited (K3, a per-process brake, ``core.throttling.KeyedRate``):
per client address and per presented credential before authentication (``HandshakeLimit``,
so a flood costs no database read) at ``RUNSTEAD_WS_ADDRESS_RATE`` and
``RUNSTEAD_WS_OWNER_RATE``, and per owner after it at ``RUNSTEAD_WS_OWNER_RATE``. A refused handshake opens, gets one message ``{"type":
"rate_limited", "error": "rate_limited", "detail", "retry_after_s"}`` and is closed with
RATE_LIMITED_CLOSE_CODE (daphne sends no close reason, so the reason is that message);
the page waits at least ``retry_after_s`` before it tries again.

The channel layer (Redis in production) may fail: a handshake then never answers 500. The
socket opens and closes at once with LAYER_DOWN_CLOSE_CODE, which the page shows as
"live updates paused" while it hydrates over HTTP (B4) and retries. The layer retries a
call that fails on a connection left over from before a Redis restart
(``config/channel_layer.py``), so the first handshake after recovery works (D, B2).
"""
import asyncio
import functools
import hashlib
import json
import logging
import math

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.layers import get_channel_layer
from channels.utils import await_many_dispatch
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.security.websocket import AllowedHostsOriginValidator
from django.conf import settings
from django.contrib.auth.models import AnonymousUser
from rest_framework.authtoken.models import Token

from core.broadcast import owner_group
from core.throttling import KeyedRate

TOKEN_KEYWORD = "Token"
# Close code of a socket that the service cannot feed because its channel layer is down.
LAYER_DOWN_CLOSE_CODE = 4503
# K3: the board takes no client messages. One that arrives closes the socket: 1008 (policy
# violation), or 1009 (too big) past this many bytes. daphne bounds a frame before that.
CLIENT_MESSAGE_MAX_BYTES = 4096
CLIENT_UNEXPECTED_CLOSE_CODE = 1008
CLIENT_TOO_BIG_CLOSE_CODE = 1009
# K3: a handshake over its owner's or its address's rate (4000 + HTTP 429).
RATE_LIMITED_CLOSE_CODE = 4429

# This process's handshake counts (K3); tests reset them with ``handshake_limits_clear``.
_owner_handshakes = KeyedRate()
_address_handshakes = KeyedRate()
_credential_handshakes = KeyedRate()

log = logging.getLogger("runstead.board")


class OwnerFeed:
    """One owner's board sockets in one process behind ONE channel-layer channel in the
    owner's group: a broadcast crosses Redis once per process and is fanned out here, not
    once per socket (500 sockets: one Redis message, one JSON encoding)."""

    def __init__(self, owner_id):
        self.owner_id = owner_id
        self.sockets: set = set()
        self.channel = None
        self.ready = asyncio.Event()
        self.error = None
        self.task = None

    async def open(self, layer):
        try:
            self.channel = await layer.new_channel()
            await layer.group_add(owner_group(self.owner_id), self.channel)
        except Exception as exc:
            self.error = exc
            raise
        finally:
            self.ready.set()
        self.task = asyncio.get_running_loop().create_task(self.run(layer))

    async def run(self, layer):
        while True:
            try:
                message = await layer.receive(self.channel)
            except Exception as exc:
                log.warning("board: channel layer receive failed: %s", exc)
                self.close_all()
                return
            if message.get("type") == "board.event":
                await self.forward(message["event"])
            elif message.get("type") == "board.events":  # several at once (``broadcast_all``)
                for event in message["events"]:
                    await self.forward(event)

    async def forward(self, event: dict) -> None:
        """``event`` to every socket of the feed, as one JSON text frame."""
        text = json.dumps(event)
        for consumer in list(self.sockets):
            try:
                await consumer.send(text_data=text)
            except Exception:  # a socket that went away meanwhile
                self.sockets.discard(consumer)

    def close_all(self):
        """The layer failed: forget this feed and close its sockets with the retry code."""
        if _feeds().get(self.owner_id) is self:
            del _feeds()[self.owner_id]
        for consumer in list(self.sockets):
            asyncio.get_running_loop().create_task(consumer.board_layer_down({}))
        self.sockets.clear()


_hubs: dict = {}


def _feeds() -> dict:
    """This event loop's owner feeds (owner id -> OwnerFeed)."""
    return _hubs.setdefault(asyncio.get_running_loop(), {})


async def _feed_join(consumer, owner_id, layer) -> OwnerFeed:
    feeds = _feeds()
    feed = feeds.get(owner_id)
    if feed is None:
        feed = feeds[owner_id] = OwnerFeed(owner_id)
        try:
            await feed.open(layer)
        except Exception:
            if feeds.get(owner_id) is feed:
                del feeds[owner_id]
            raise
    else:
        await feed.ready.wait()
        if feed.error is not None:
            raise feed.error
    feed.sockets.add(consumer)
    return feed


def _feed_leave(consumer, feed: OwnerFeed, layer) -> None:
    feed.sockets.discard(consumer)
    feeds = _feeds()
    if feed.sockets or feeds.get(feed.owner_id) is not feed:
        return
    del feeds[feed.owner_id]
    if feed.task is not None:
        feed.task.cancel()

    async def discard():
        try:
            await layer.group_discard(owner_group(feed.owner_id), feed.channel)
        except Exception as exc:
            log.warning("board: channel layer group_discard failed: %s", exc)

    asyncio.get_running_loop().create_task(discard())


def handshake_limits_clear() -> None:
    """Forget this process's handshake counts (tests: owner ids and addresses repeat)."""
    _owner_handshakes.clear()
    _address_handshakes.clear()
    _credential_handshakes.clear()


def rate_limited_event(retry_after_s: float) -> dict:
    """The one message a rate-limited socket gets before RATE_LIMITED_CLOSE_CODE (K3)."""
    wait = max(1, math.ceil(retry_after_s))
    return {"type": "rate_limited", "error": "rate_limited", "detail": f"too many connections, retry in {wait} s",
            "retry_after_s": wait}


async def _refuse_rate_limited(receive, send, retry_after_s: float) -> None:
    """Answer a handshake with RATE_LIMITED_CLOSE_CODE at the ASGI level (no consumer)."""
    message = await receive()
    if message["type"] != "websocket.connect":
        return
    await send({"type": "websocket.accept"})
    await send({"type": "websocket.send", "text": json.dumps(rate_limited_event(retry_after_s))})
    await send({"type": "websocket.close", "code": RATE_LIMITED_CLOSE_CODE})


def _credential(scope) -> str | None:
    """A digest of what a handshake authenticates with (the ``Authorization`` header, or
    the session cookie), so one owner's flood is refused before its credential is looked
    up; None when it carries neither."""
    presented = _authorization_header(scope)
    if presented is None:
        wanted = settings.SESSION_COOKIE_NAME
        for name, value in scope.get("headers", []):
            if name == b"cookie":
                for part in value.decode("latin-1").split(";"):
                    key, _, cookie = part.strip().partition("=")
                    if key == wanted and cookie:
                        presented = "session " + cookie
    if presented is None:
        return None
    return hashlib.sha256(presented.encode("latin-1", "replace")).hexdigest()[:32]


class HandshakeLimit:
    """ASGI middleware in front of authentication (K3): a handshake from a client address
    over ``RUNSTEAD_WS_ADDRESS_RATE``, or presenting a credential over
    ``RUNSTEAD_WS_OWNER_RATE``, is refused before any database read, so a flood costs
    about what daphne's own handshake costs. (The consumer checks the owner's rate again
    once it knows the owner, for one owner's several credentials.) The address is
    daphne's ``scope["client"]``: behind the proxy, daphne's ``--proxy-headers`` make it
    the client's (``deploy/``)."""

    def __init__(self, inner):
        self.inner = inner

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket":
            client = scope.get("client")
            checks = []
            if client:
                checks.append((_address_handshakes, client[0], settings.RUNSTEAD_WS_ADDRESS_RATE))
            credential = _credential(scope)
            if credential is not None:
                checks.append((_credential_handshakes, credential, settings.RUNSTEAD_WS_OWNER_RATE))
            for limiter, key, rate in checks:
                allowed, retry_after_s = limiter.allow(key, rate)
                if not allowed:
                    return await _refuse_rate_limited(receive, send, retry_after_s)
        return await self.inner(scope, receive, send)


class BoardConsumer(AsyncWebsocketConsumer):
    """One owner's live board feed. A client message closes the socket (K3). Events come
    from the owner's ``OwnerFeed`` in this process, not from a channel of its own."""

    feed = None
    opened = False
    closed = False

    async def __call__(self, scope, receive, send):
        """channels' ``AsyncConsumer.__call__`` without a per-socket channel: the feed
        receives for all of the owner's sockets, and a failure of the layer closes them
        with LAYER_DOWN_CLOSE_CODE instead of killing them (a 500 during the handshake)."""
        self.scope = scope
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        self.base_send = send
        try:
            await await_many_dispatch([receive], self.dispatch)
        except StopConsumer:
            pass

    async def connect(self):
        if self.closed:
            return
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # before accept: the handshake is refused with 403
            return
        allowed, retry_after_s = _owner_handshakes.allow(user.pk, settings.RUNSTEAD_WS_OWNER_RATE)
        if not allowed:
            await self.accept()
            self.opened = self.closed = True
            await self.send(text_data=json.dumps(rate_limited_event(retry_after_s)))
            await self.close(code=RATE_LIMITED_CLOSE_CODE)
            return
        try:
            self.feed = await _feed_join(self, user.pk, self.channel_layer)
        except Exception as exc:
            log.warning("board: channel layer group_add failed: %s", exc)
            await self.board_layer_down({})
            return
        await self.accept()
        self.opened = True

    async def board_layer_down(self, message):
        """The layer failed: open (if not yet) and close with LAYER_DOWN_CLOSE_CODE, so
        the page hydrates over HTTP, shows the outage and retries."""
        if self.closed:
            return
        if not self.opened:
            await self.accept()
            self.opened = True
        self.closed = True
        await self.close(code=LAYER_DOWN_CLOSE_CODE)

    async def disconnect(self, code):
        if self.feed is not None:
            _feed_leave(self, self.feed, self.channel_layer)
            self.feed = None

    async def receive(self, text_data=None, bytes_data=None):
        """The board is one-way (K3: client messages bounded): any message from the client
        closes the socket, with CLIENT_TOO_BIG_CLOSE_CODE when it is over
        CLIENT_MESSAGE_MAX_BYTES, else CLIENT_UNEXPECTED_CLOSE_CODE. Nothing is parsed or
        kept; the page never sends, and it reconnects and hydrates (B4) if it ever did."""
        size = len(text_data.encode()) if text_data is not None else len(bytes_data or b"")
        code = CLIENT_TOO_BIG_CLOSE_CODE if size > CLIENT_MESSAGE_MAX_BYTES else CLIENT_UNEXPECTED_CLOSE_CODE
        log.info("board: closing a socket that sent a %s-byte message", size)
        await self.close(code=code)


def _authorization_header(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return value.decode("latin-1")
    return None


# Not thread-sensitive: a burst of handshakes looks tokens up in the default executor,
# never queued in the one thread Django's sync views share (K3: one owner's flood must
# not delay the other owners' requests).
@functools.partial(database_sync_to_async, thread_sensitive=False)
def _token_user(key: str):
    token = Token.objects.select_related("user").filter(key=key).first()
    if token is None or not token.user.is_active:
        return AnonymousUser()
    return token.user


class TokenOrBrowserAuth:
    """Route a WebSocket by how it authenticates (K1).

    With an ``Authorization`` header: only ``Token <key>`` of an active owner counts (any
    other scheme, a machine token included, leaves the user anonymous, so the consumer
    refuses it); no cookie fallback. Without one: ``browser_app``, which checks the origin
    and reads the session cookie.
    """

    def __init__(self, token_app, browser_app):
        self.token_app = token_app
        self.browser_app = browser_app

    async def __call__(self, scope, receive, send):
        header = _authorization_header(scope)
        if header is None:
            return await self.browser_app(scope, receive, send)
        parts = header.split()
        user = AnonymousUser()
        if len(parts) == 2 and parts[0] == TOKEN_KEYWORD:
            user = await _token_user(parts[1])
        return await self.token_app({**scope, "user": user}, receive, send)


def board_websocket_application(inner):
    """Wrap the ``inner`` URL router with the per-address handshake brake and the two
    ways in (token header, or cookie + same-origin)."""
    return HandshakeLimit(
        TokenOrBrowserAuth(token_app=inner, browser_app=AllowedHostsOriginValidator(AuthMiddlewareStack(inner))))
