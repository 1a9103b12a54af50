"""ASGI entry point: Django over HTTP (the long-polls of ``LONG_POLL_VIEWS`` around its
request handler, ``core/longpoll/``), the board over ``/ws/``; and, because daphne has
no lifespan protocol, the server start/stop hooks (the periodic sweep) installed when the
server imports this module (``config/server_hooks.py``).
"""
import os

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "config.settings")

from django.core.asgi import get_asgi_application  # noqa: E402

django_asgi_app = get_asgi_application()

from channels.routing import ProtocolTypeRouter  # noqa: E402
from board.routing import websocket_application  # noqa: E402
from config import server_hooks  # noqa: E402
from core.admission import RequestGate  # noqa: E402
from core.longpoll import LongPollRouter  # noqa: E402
from sessions_app.api.approvals import ApprovalDetail  # noqa: E402
from tasks_app.api.views import WorkerMessages  # noqa: E402

# Long-polls that wait go around Django's handler, so they wait without a thread (D1, D2);
# the other requests go in through a bounded number of slots, renewals first (D2, L2).
LONG_POLL_VIEWS = [WorkerMessages, ApprovalDetail]
application = ProtocolTypeRouter(
    {"http": LongPollRouter(RequestGate(django_asgi_app), LONG_POLL_VIEWS), "websocket": websocket_application}
)

server_hooks.install()
