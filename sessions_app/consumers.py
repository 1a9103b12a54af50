"""The board's WebSocket (B2, K1, K2): authenticate, join the owner's group, forward.

Browsers authenticate with the session cookie and must come from an allowed origin;
terminal clients send ``Authorization: Token <key>`` (DRF token) instead. A browser cannot
put an Authorization header on a WebSocket, so a token connection skips the origin check
without opening a cross-site hole. Anonymous connections are refused (the handshake gets
HTTP 403). The consumer never reads or decides anything: it forwards ``board.event``
messages sent by ``config.broadcast.broadcast`` as JSON text.

The channel layer (Redis in production) may fail: a handshake then never answers 500. The
socket opens and closes at once with LAYER_DOWN_CLOSE_CODE, which the page shows as
"live updates paused" while it hydrates over HTTP (B4) and retries. The layer retries a
call that fails on a connection left over from before a Redis restart
(``config/channel_layer.py``), so the first handshake after recovery works (D, B2).
"""
import asyncio
import json
import logging

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.exceptions import StopConsumer
from channels.layers import get_channel_layer
from channels.utils import await_many_dispatch
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser
from rest_framework.authtoken.models import Token

from config.broadcast import owner_group

TOKEN_KEYWORD = "Token"
# Close code of a socket that the service cannot feed because its channel layer is down.
LAYER_DOWN_CLOSE_CODE = 4503

log = logging.getLogger("runstead.board")




class BoardConsumer(AsyncWebsocketConsumer):
    """One owner's live board feed. Client messages are ignored."""

    group = None
    layer_down = False
    opened = False
    closed = False

    async def __call__(self, scope, receive, send):
        """channels' ``AsyncConsumer.__call__``, with a channel-layer receive whose failure
        becomes a ``board.layer_down`` message instead of an exception that kills the
        socket (a 500 during the handshake)."""
        self.scope = scope
        self.channel_layer = get_channel_layer(self.channel_layer_alias)
        self.channel_name = await self.channel_layer.new_channel()
        self.channel_receive = self._layer_receive
        self.base_send = send
        try:
            await await_many_dispatch([receive, self.channel_receive], self.dispatch)
        except StopConsumer:
            pass

    async def _layer_receive(self):
        if self.layer_down:
            await asyncio.Event().wait()  # nothing more from a failed layer; the client reconnects
        try:
            return await self.channel_layer.receive(self.channel_name)
        except Exception as exc:
            self.layer_down = True
            log.warning("board: channel layer receive failed: %s", exc)
            return {"type": "board.layer_down"}

    async def connect(self):
        if self.closed:
            return
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # before accept: the handshake is refused with 403
            return
        group = owner_group(user.pk)
        try:
            await self.channel_layer.group_add(group, self.channel_name)
        except Exception as exc:
            log.warning("board: channel layer group_add failed: %s", exc)
            await self.board_layer_down({})
            return
        self.group = group
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
        if self.group is not None:
            try:
                await self.channel_layer.group_discard(self.group, self.channel_name)
            except Exception as exc:
                log.warning("board: channel layer group_discard failed: %s", exc)

    async def receive(self, text_data=None, bytes_data=None):
        """The board is one-way; whatever a client sends is dropped."""

    async def board_event(self, message):
        """Forward one board event (``message["event"]``, a dict with ``type``, ``version``
        and ``server_time``) as a JSON text frame."""
        await self.send(text_data=json.dumps(message["event"]))


def _authorization_header(scope) -> str | None:
    for name, value in scope.get("headers", []):
        if name == b"authorization":
            return value.decode("latin-1")
    return None


@database_sync_to_async
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
    """Wrap the ``inner`` URL router with the two ways in (token header, or cookie +
    same-origin)."""
    return TokenOrBrowserAuth(token_app=inner, browser_app=AllowedHostsOriginValidator(AuthMiddlewareStack(inner)))
