"""What runs when daphne starts and stops. daphne implements no ASGI lifespan
(django/daphne#264), so this hooks into its Twisted reactor, from ``config/asgi.py``.

- start: the periodic sweep (L6, J5, S7, A7) as a task on the server's event loop, when
  ``RUNSTEAD_EMBEDDED_SWEEP`` is on (the default). Several processes sweeping at once is
  safe (O2); with it off, run ``manage.py sweep``.
- start: the notification delivery loop (N3) the same way, when
  ``RUNSTEAD_EMBEDDED_NOTIFY`` is on (the default); with it off, run ``manage.py notify``.
- start: autobahn (daphne's WebSocket layer) formats a debug line with ``pformat`` and
  styles others with click on every connection, whether or not debug logging is on:
  about a quarter of daphne's own cost per handshake, measured with a flood of refused
  handshakes (K3). ``_lazy_autobahn_logging`` makes both lazy (formatted only when a
  debug line is emitted), so nothing a log reader sees changes.
- start: the garbage collector is set for a long-running server (``_settle_heap``).
- load: daphne's TCP sockets listen with ``RUNSTEAD_LISTEN_BACKLOG`` (``_listen_backlog``).
- stop: waiting long-polls return at once (``core.longpoll.stop_all``), so the server
  exits without waiting up to ``LONG_POLL_MAX_S`` (25 s) for them; and should a thread still hold
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

from notifications.delivery import notify_loop
from board.sweep import sweep_loop
from core.longpoll import stop_all

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


class _LazyPformat:
    """``pprint.pformat(obj)``, computed only if the log line is formatted."""

    def __init__(self, obj):
        self.obj = obj

    def __format__(self, spec):
        import pprint

        return format(pprint.pformat(self.obj), spec)

    def __str__(self):
        return format(self, "")


def _lazy_autobahn_logging() -> None:
    import autobahn.util
    import autobahn.websocket.protocol

    autobahn.websocket.protocol.pformat = _LazyPformat
    autobahn.util._HAS_CLICK = False  # plain text in autobahn's own log lines, no ANSI colours


FULL_COLLECTION_EVERY = 100  # generation-1 collections per full one (CPython's default: 10)


def _settle_heap() -> None:
    """What start-up loaded (settings, the URLconf and every view module it imports) is
    moved out of the collector's sight (``gc.freeze``: it lives as long as the process),
    and a full collection waits for ``FULL_COLLECTION_EVERY`` young ones, not 10. With
    1,000 idle workers connected, a full collection of the default scans some 300,000
    objects for 100-150 ms every 7-9 s, to find a few thousand (issue 22: measured with a
    ``gc.callbacks`` probe); that pause is an idle process's single largest cost and the
    p99 of an acceptance or a board push that lands on it. Cyclic garbage still goes, as
    young garbage at once, and what survives two generations at the next full collection."""
    import gc

    from django.urls import get_resolver

    get_resolver().url_patterns  # noqa: B018 (imports every view module now, before the freeze)
    gc.collect()
    gc.freeze()
    young, middle, _ = gc.get_threshold()
    gc.set_threshold(young, middle, FULL_COLLECTION_EVERY)


def _listen_backlog() -> None:
    """daphne listens on the Twisted endpoint strings it builds from ``-b``/``-p`` after
    it loaded the application, with Twisted's default backlog of 50: a wave of 1,000
    workers reconnecting at once (after a restart) overflowed it, and every connection
    dropped retried its SYN a second or more later (issue 22: 1,010 ``ListenOverflows``
    per wave, the wave's late deliveries). Those strings get ``backlog=`` the setting;
    an ``-e`` endpoint string is left as its author wrote it."""
    import daphne.cli

    build = daphne.cli.build_endpoint_description_strings
    if getattr(build, "with_backlog", False):
        return

    def with_backlog(*args, **kwargs):
        backlog = settings.RUNSTEAD_LISTEN_BACKLOG
        return [f"{d}:backlog={backlog}" if d.startswith("tcp:") and ":backlog=" not in d else d
                for d in build(*args, **kwargs)]

    with_backlog.with_backlog = True
    daphne.cli.build_endpoint_description_strings = with_backlog


def install() -> None:
    """Register the hooks on the running daphne's reactor; outside daphne, do nothing."""
    reactor = sys.modules.get("twisted.internet.reactor")
    if reactor is None:
        log.warning("not under daphne: no in-server sweep; run `manage.py sweep`")
        return
    _lazy_autobahn_logging()
    _listen_backlog()
    reactor.callWhenRunning(_settle_heap)
    if settings.RUNSTEAD_EMBEDDED_SWEEP:
        interval_s = settings.RUNSTEAD_SWEEP_INTERVAL_S
        reactor.callWhenRunning(lambda: asyncio.ensure_future(sweep_loop(interval_s)))
    if settings.RUNSTEAD_EMBEDDED_NOTIFY:
        notify_interval_s = settings.RUNSTEAD_NOTIFY_INTERVAL_S
        reactor.callWhenRunning(lambda: asyncio.ensure_future(notify_loop(notify_interval_s)))
    reactor.addSystemEventTrigger("before", "shutdown", stop_all)
    reactor.addSystemEventTrigger("after", "shutdown", _exit_after_grace)
