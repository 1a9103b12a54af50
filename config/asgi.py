"""ASGI entry point: Django over HTTP, the board over ``/ws/``; and, because daphne has
no lifespan protocol, the server start/stop hooks (the periodic sweep) installed when the
server imports this module (``config/server_hooks.py``).
"""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from sessions_app.routing import websocket_application  # noqa: E402
from config import server_hooks  # noqa: E402

from tasks_app import longpoll  # noqa: E402

# The worker long-poll bypasses Django's handler so it waits without a thread (D1, D2).
application = ProtocolTypeRouter({"http": longpoll.route(django_asgi_app), "websocket": websocket_application})

server_hooks.install()
