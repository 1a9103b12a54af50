"""A real daphne subprocess on the test database, for tests that need real processes
(browser tests, end-to-end worker tests).

pytest-django's ``live_server`` is WSGI and serves no WebSocket, so this starts
``daphne config.asgi:application`` on a free port, pointed at the same test database as
the test process (the SQLite ``TEST.NAME`` file, or the ``test_*`` PostgreSQL database).
Tests using it must commit their rows: use ``transactional_db`` /
``django_db(transaction=True)``. With the in-memory channel layer, broadcasts reach
browsers only when they happen inside the daphne process, so drive changes through its
HTTP API; with ``REDIS_URL`` set, broadcasts from the test process arrive too.

Usage::

    from tests.live import live_daphne  # noqa: F401  (the fixture)

    def test_something(live_daphne):
        url = live_daphne(RUNSTEAD_MARKER_GRACE_S="1")   # env overrides, strings
        httpx.get(url + "/api/board/", ...)

``module_daphne`` is the same factory with servers shared by a module's tests.
``start_daphne(env)`` / ``DaphneServer.stop()`` do the same outside a fixture.
``DaphneServer.wait_waiting(count, key)`` waits until long-polls wait in the server (with
``RUNSTEAD_LOG_LEVEL="DEBUG"``); the fixture's servers are ``live_daphne.servers``.
``BoardSocket(url, token)`` reads the owner's ``/ws/board/`` events as a terminal client.
"""
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import httpx
import pytest
from django.conf import settings
from django.db import connection
from websockets.sync.client import connect

from tests.wait import wait_for

BASE_DIR = Path(settings.BASE_DIR)
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 5.0  # for a killed process to be reaped


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def local_listener(backlog: int = 16) -> socket.socket:
    """A listening TCP socket on 127.0.0.1, on a free port (``getsockname()[1]``): the
    front of the tests' TCP proxies."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    listener.listen(backlog)
    return listener


def database_env() -> dict:
    """Environment that points a subprocess at the test process's (test) database."""
    name = connection.settings_dict["NAME"]
    if connection.vendor == "sqlite":
        return {"RUNSTEAD_SQLITE_PATH": str(name), "DATABASE_URL": ""}
    parts = urlsplit(settings.DATABASE_URL)
    return {"DATABASE_URL": urlunsplit(parts._replace(path="/" + name))}


class DaphneServer:
    """One daphne process; ``url`` like ``http://127.0.0.1:PORT``; ``log_path`` holds its
    stdout and stderr."""

    def __init__(self, env: dict | None = None, port: int | None = None, log_dir: Path | None = None):
        # ``port``: start on a given port, e.g. to bring a stopped server back at the
        # same URL (the worker's "service down, then back" tests).
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = Path(tempfile.mkstemp(prefix="daphne-", suffix=".log", dir=log_dir)[1])
        full_env = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONUNBUFFERED": "1"}
        full_env.update(database_env())
        full_env.update({k: str(v) for k, v in (env or {}).items()})
        full_env.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "config.asgi:application"],
                cwd=BASE_DIR,
                env=full_env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
        self._wait_ready()

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def waits(self) -> list[str]:
        """The key of each wait that began waiting for a wake-up (``machine.<id>`` for a
        worker's pull), in order: ``core.longpoll`` logs them at DEBUG, so start the server
        with ``RUNSTEAD_LOG_LEVEL="DEBUG"``."""
        # The project's own handler's lines only: daphne's root handler repeats each one.
        return re.findall(r" runstead\.waiting wait (\S+): waiting for a wake-up", self.log())

    def wait_waiting(self, count: int = 1, key: str | None = None, timeout: float = 10.0) -> None:
        """Until ``count`` waits (of ``key``, or of distinct keys) have begun waiting for a
        wake-up in this server: the fact "the pull waits", instead of a sleep."""

        def found() -> int:
            seen = self.waits()
            return seen.count(key) if key is not None else len(set(seen))

        wait_for(found, until=lambda n: n >= count, timeout_s=timeout, interval_s=0.02,
                 what=f"{count} waits{f' of {key}' if key else ''} to begin waiting (RUNSTEAD_LOG_LEVEL=DEBUG?)",
                 detail=lambda: self.log()[-2000:])

    def _wait_ready(self):
        def answers() -> bool:
            if self.process.poll() is not None:
                raise RuntimeError(f"daphne exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            return httpx.get(self.url + settings.LOGIN_URL, timeout=1.0).status_code == 200

        try:
            wait_for(answers, timeout_s=READY_TIMEOUT_S, interval_s=0.1, ignore=(httpx.HTTPError,),
                     what="daphne to answer", detail=lambda: self.log()[-4000:])
        except AssertionError:
            self.stop()
            raise

    def stop(self):
        """Kill it and wait. A test's server owes nobody an orderly exit, and the
        interpreter's own shutdown of a daphne takes 1-3 s on this machine after the server
        has stopped serving (per server, so per test). The tests of stopping send SIGTERM
        themselves and time it (test_server_hooks, test_longpoll's D3)."""
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait(STOP_TIMEOUT_S)


def start_daphne(env: dict | None = None, log_dir: Path | None = None, port: int | None = None) -> DaphneServer:
    return DaphneServer(env, port=port, log_dir=log_dir)


@pytest.fixture
def live_daphne(transactional_db, tmp_path):
    """A factory: ``live_daphne(**env_overrides) -> base URL``. Every server it started is
    stopped after the test; its log stays in the test's ``tmp_path``. The embedded sweep
    is off unless the caller turns it on (``RUNSTEAD_EMBEDDED_SWEEP="1"``)."""
    servers = []

    def start(**env) -> str:
        server = DaphneServer({"RUNSTEAD_EMBEDDED_SWEEP": "0", **env}, log_dir=tmp_path)
        servers.append(server)
        return server.url

    start.servers = servers  # in start order: ``live_daphne.servers[-1].wait_waiting()``
    yield start
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def module_daphne(django_db_setup, django_db_blocker, tmp_path_factory):
    """Like ``live_daphne``, but the servers live for the whole module: ``module_daphne(
    **env_overrides) -> base URL`` starts one per distinct environment on first use, so
    a module of live tests pays a daphne start once, not per test (its logs in one
    module temporary directory). Tests still commit their rows (request
    ``transactional_db``), flushed after each test as usual; what a server keeps in memory
    across tests is keyed by ids that never repeat (rate-limit counters, channel groups)."""
    servers: dict[tuple, DaphneServer] = {}
    log_dir = tmp_path_factory.mktemp("daphne")

    def start(**env) -> str:
        env = {"RUNSTEAD_EMBEDDED_SWEEP": "0", **env}
        key = tuple(sorted(env.items()))
        if key not in servers:
            with django_db_blocker.unblock():
                servers[key] = DaphneServer(env, log_dir=log_dir)
        return servers[key].url

    start.servers = servers  # ``DaphneServer`` by environment: ``.log()`` of the one at a url
    yield start
    for server in servers.values():
        server.stop()


class BoardSocket(threading.Thread):
    """The owner's board socket (``/ws/board/`` on ``url``, token header auth, as a
    terminal client), collecting every event (B2) in arrival order in ``events``, each
    with ``_seen``: ``time.monotonic()`` when it arrived, and ``_at``: ``time.time()``
    then (to compare with the event's ``server_time``). ``start()``, then wait on
    ``connected``; ``stop()`` closes it."""

    def __init__(self, url: str, token: str):
        super().__init__(daemon=True)
        self.url = url.replace("http://", "ws://") + "/ws/board/"
        self.token = token
        self.events: list[dict] = []
        self.connected = threading.Event()
        self.closing = threading.Event()

    def run(self):
        with connect(self.url, additional_headers={"Authorization": f"Token {self.token}"}) as ws:
            self.connected.set()
            while not self.closing.is_set():
                try:
                    self.events.append({**json.loads(ws.recv(timeout=0.1)), "_seen": time.monotonic(), "_at": time.time()})
                except TimeoutError:
                    continue

    def stop(self):
        self.closing.set()
        self.join(timeout=5)


class Background:
    """Run ``fn`` in a thread; ``result(timeout)`` returns its value or raises."""

    def __init__(self, fn, *args, **kwargs):
        self.value = self.error = None
        self.done = threading.Event()

        def run():
            try:
                self.value = fn(*args, **kwargs)
            except BaseException as exc:  # noqa: BLE001 - handed to the test
                self.error = exc
            finally:
                self.done.set()

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def result(self, timeout):
        assert self.done.wait(timeout), f"not done within {timeout} s"
        if self.error:
            raise self.error
        return self.value
