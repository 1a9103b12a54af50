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

``start_daphne(env)`` / ``DaphneServer.stop()`` do the same outside a fixture.
``BoardSocket(url, token)`` reads the owner's ``/ws/board/`` events as a terminal client.
"""
import json
import os
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

from tests.procs import stop_process

BASE_DIR = Path(settings.BASE_DIR)
READY_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 3.0  # SIGTERM, then SIGKILL


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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

    def _wait_ready(self):
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"daphne exited with {self.process.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(self.url + settings.LOGIN_URL, timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"daphne not ready after {READY_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def stop(self):
        stop_process(self.process, STOP_TIMEOUT_S)


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

    yield start
    for server in servers:
        server.stop()


class BoardSocket(threading.Thread):
    """The owner's board socket (``/ws/board/`` on ``url``, token header auth, as a
    terminal client), collecting every event (B2) in arrival order in ``events``, each
    with ``_seen``: ``time.monotonic()`` when it arrived. ``start()``, then wait on
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
                    self.events.append({**json.loads(ws.recv(timeout=0.1)), "_seen": time.monotonic()})
                except TimeoutError:
                    continue

    def stop(self):
        self.closing.set()
        self.join(timeout=5)
