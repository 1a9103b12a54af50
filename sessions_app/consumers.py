"""The board's WebSocket (B2, K1, K2): authenticate, join the owner's group, forward.

Browsers authenticate with the session cookie and must come from an allowed origin;
terminal clients send ``Authorization: Token <key>`` (DRF token) instead. A browser cannot
put an Authorization header on a WebSocket, so a token connection skips the origin check
without opening a cross-site hole. Anonymous connections are refused (the handshake gets
HTTP 403). The consumer never reads or decides anything: it forwards ``board.event``
messages sent by ``sessions_app.broadcast.broadcast`` as JSON text.
"""
import json

from channels.auth import AuthMiddlewareStack
from channels.db import database_sync_to_async
from channels.generic.websocket import AsyncWebsocketConsumer
from channels.security.websocket import AllowedHostsOriginValidator
from django.contrib.auth.models import AnonymousUser

from sessions_app.broadcast import owner_group

TOKEN_KEYWORD = "Token"


class BoardConsumer(AsyncWebsocketConsumer):
    """One owner's live board feed. Client messages are ignored."""

    group = None

    async def connect(self):
        user = self.scope.get("user")
        if user is None or not user.is_authenticated:
            await self.close()  # before accept: the handshake is refused with 403
            return
        self.group = owner_group(user.pk)
        await self.channel_layer.group_add(self.group, self.channel_name)
        await self.accept()

    async def disconnect(self, code):
        if self.group is not None:
            await self.channel_layer.group_discard(self.group, self.channel_name)

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
    from rest_framework.authtoken.models import Token

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
