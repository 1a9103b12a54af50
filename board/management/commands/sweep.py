"""``manage.py sweep [--once]``: the periodic sweep (L6, J5, A7, S7) as its own process."""
import signal
import threading

from django.conf import settings
from django.core.management.base import BaseCommand

from board.sweep import sweep_once, sweep_pass


class Command(BaseCommand):
    help = "Expire leases, start windows, idempotency records and session holds, every interval."

    def add_arguments(self, parser):
        parser.add_argument("--once", action="store_true", help="one pass, print what it did, exit")
        parser.add_argument("--interval", type=float, default=settings.RUNSTEAD_SWEEP_INTERVAL_S)

    def handle(self, *args, once=False, interval=None, **options):
        if once:
            self.stdout.write(str(sweep_once()))
            return
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        while not stop.is_set():
            sweep_pass()
            stop.wait(interval)
