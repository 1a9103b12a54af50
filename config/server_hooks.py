"""What runs when daphne starts and stops. daphne implements no ASGI lifespan
(django/daphne#264), so this hooks into its Twisted reactor, from ``config/asgi.py``.

- start: the periodic sweep (L6, J5, S7, A7) as a task on the server's event loop, when
  ``RUNSTEAD_EMBEDDED_SWEEP`` is on (the default). Several processes sweeping at once is
  safe (O2); with it off, run ``manage.py sweep``.
- start: the notification delivery loop (N3) the same way, when
  ``RUNSTEAD_EMBEDDED_NOTIFY`` is on (the default); with it off, run ``manage.py notify``.
- stop: waiting worker long-polls return at once, so the server exits without waiting
  up to ``LONG_POLL_MAX_S`` (25 s) for their threads; and should a thread still hold
  the process EXIT_GRACE_S after the reactor stopped (e.g. one waiting in
  ``async_to_sync`` on the loop that no longer runs), it exits anyway (D3: daphne always
  exits within a few seconds of SIGTERM).

Part of the composition layer (with ``urls.py`` and ``asgi.py``): it may import both apps;
``asgi.py`` imports it once Django is set up.
"""
import asyncio
import logging
import os
import sys
import threading

from django.conf import settings

from sessions_app.notifications.delivery import notify_loop
from sessions_app.sweep import sweep_loop
from tasks_app.services.messages import server_stopping
from tasks_app.wakeups import stop_all

log = logging.getLogger("runstead.server")

EXIT_GRACE_S = 2.0  # in-flight sync views have lost their clients already (daphne killed them)


def _exit_after_grace() -> None:
    """Once the reactor has stopped, Python joins the thread pools' threads; one stuck in
    a sync view must not keep the process alive."""

    def force_exit():
        log.warning("threads still running %.0f s after shutdown: exiting now", EXIT_GRACE_S)
        logging.shutdown()
        os._exit(0)

    timer = threading.Timer(EXIT_GRACE_S, force_exit)
    timer.daemon = True
    timer.start()


def install() -> None:
    """Register the hooks on the running daphne's reactor; outside daphne, do nothing."""
    reactor = sys.modules.get("twisted.internet.reactor")
    if reactor is None:
        log.warning("not under daphne: no in-server sweep; run `manage.py sweep`")
        return
    if settings.RUNSTEAD_EMBEDDED_SWEEP:
        interval_s = settings.RUNSTEAD_SWEEP_INTERVAL_S
        reactor.callWhenRunning(lambda: asyncio.ensure_future(sweep_loop(interval_s)))
    if settings.RUNSTEAD_EMBEDDED_NOTIFY:
        notify_interval_s = settings.RUNSTEAD_NOTIFY_INTERVAL_S
        reactor.callWhenRunning(lambda: asyncio.ensure_future(notify_loop(notify_interval_s)))
    reactor.addSystemEventTrigger("before", "shutdown", server_stopping.set)
    reactor.addSystemEventTrigger("before", "shutdown", stop_all)
    reactor.addSystemEventTrigger("after", "shutdown", _exit_after_grace)
