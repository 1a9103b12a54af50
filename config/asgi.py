"""ASGI entry point: Django over HTTP, the board over ``/ws/``.

daphne has no lifespan protocol, so the periodic sweep (L6, J5, S7, A7) starts here, when
the server imports this module: a task on each server process's event loop
(``tasks_app.services.sweeps.start_in_server``). Several processes sweeping at once
is safe (skip_locked, compare-and-set; O2). ``RUNSTEAD_EMBEDDED_SWEEP=0`` turns it off
when ``manage.py sweep`` runs as its own process instead.
"""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter, URLRouter  # noqa: E402
from django.conf import settings  # noqa: E402

from sessions_app.routing import websocket_application  # noqa: E402
from tasks_app.services.sweeps import start_in_server  # noqa: E402

application = ProtocolTypeRouter({"http": django_asgi_app, "websocket": websocket_application})

if settings.RUNSTEAD_EMBEDDED_SWEEP:
    start_in_server()
