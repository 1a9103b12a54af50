"""``manage.py notify [--once]``: the notification delivery loop (N3) as its own process.

The embedded default runs the same loop inside daphne (``RUNSTEAD_EMBEDDED_NOTIFY``, on by
default); in production run this next to the sweep, or keep the embedded one: several
loops at once are safe (claims use ``skip_locked``).
"""
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand

from notifications.delivery import notify_drain, notify_forever


class Command(BaseCommand):
    help = "Send pending notifications (Web Push, webhooks) with backoff; drop them after 24 h."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="send what is due now, print how many, exit")
        parser.add_argument("--interval", type=float, default=settings.RUNSTEAD_NOTIFY_INTERVAL_S)

    def handle(self, *args, once=False, interval=None, **options):
        if once:
            self.stdout.write(f"attempted {notify_drain()}")
            return
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        notify_forever(stop, interval)
