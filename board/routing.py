"""WebSocket routes (B2): ``/ws/board/``. ``websocket_application`` is what
config/asgi.py mounts for the ``websocket`` protocol."""
from channels.routing import URLRouter
from django.urls import path

from board.consumers import BoardConsumer, board_websocket_application

websocket_urlpatterns = [path("ws/board/", BoardConsumer.as_asgi())]

websocket_application = board_websocket_application(URLRouter(websocket_urlpatterns))
