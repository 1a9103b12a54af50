"""The production shape in one test fixture (D3): gunicorn for ``/api/`` and pages, daphne
for ``/ws/`` and the worker long-poll, a small path-routing proxy in front (what Caddy does
in ``deploy/Caddyfile``), and ``manage.py sweep`` as its own process; all on the test
database and, with ``REDIS_URL``, one Redis.

The proxy reads each request head, picks the upstream by path, asks for ``Connection:
close`` (one request per connection, so a kept-alive connection is never routed by an
earlier request's path) and then splices bytes both ways (WebSocket upgrades included).
"""
import asyncio
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import httpx
import pytest

from tests.live import BASE_DIR, DaphneServer, database_env, free_port
from tests.procs import stop_process
from tests.wait import wait_for

DAPHNE_PATHS = ("/ws/", "/api/worker/messages/", "/api/approvals/")


class PathProxy:
    """``http://127.0.0.1:PORT`` in front of ``api_port`` and ``ws_port``."""

    def __init__(self, api_port: int, ws_port: int):
        self.api_port, self.ws_port = api_port, ws_port
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.loop = asyncio.new_event_loop()
        ready = threading.Event()
        self.thread = threading.Thread(target=self._run, args=(ready,), daemon=True)
        self.thread.start()
        assert ready.wait(10)

    def _run(self, ready):
        asyncio.set_event_loop(self.loop)
        self.server = self.loop.run_until_complete(asyncio.start_server(self._handle, "127.0.0.1", self.port))
        ready.set()
        self.loop.run_forever()

    async def _handle(self, reader, writer):
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            writer.close()
            return
        path = head.split(b" ", 2)[1].decode("latin-1")
        port = self.ws_port if path.startswith(DAPHNE_PATHS) else self.api_port
        lines = head.split(b"\r\n")
        upgrade = any(line.lower().startswith(b"upgrade:") for line in lines)
        if not upgrade:
            lines = [line for line in lines if not line.lower().startswith(b"connection:")]
            lines.insert(1, b"Connection: close")
        lines.insert(1, b"X-Forwarded-Proto: http")
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", port)
        except OSError:
            writer.close()
            return
        up_writer.write(b"\r\n".join(lines))
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer))

    @staticmethod
    async def _pipe(src, dst):
        try:
            while data := await src.read(65536):
                dst.write(data)
                await dst.drain()
        except (ConnectionError, OSError):
            pass
        finally:
            dst.close()

    def close(self):
        self.loop.call_soon_threadsafe(self.server.close)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


class Process:
    def __init__(self, argv, env, log_dir, name):
        self.log_path = Path(tempfile.mkstemp(prefix=f"{name}-", suffix=".log", dir=log_dir)[1])
        with open(self.log_path, "wb") as log:
            self.process = subprocess.Popen(argv, cwd=BASE_DIR, env=env, stdout=log, stderr=subprocess.STDOUT)

    def stop(self):
        stop_process(self.process)


class ProductionShape:
    """gunicorn + daphne + sweep + proxy; ``url`` is the proxy's."""

    def __init__(self, env: dict, log_dir: Path):
        full = {**os.environ, "DJANGO_SETTINGS_MODULE": "config.settings", "PYTHONUNBUFFERED": "1", **database_env(),
                "RUNSTEAD_EMBEDDED_SWEEP": "0", **{k: str(v) for k, v in env.items()}}
        full.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
        self.ws = DaphneServer(env={**env, "RUNSTEAD_EMBEDDED_SWEEP": "0"}, log_dir=log_dir)
        api_port = free_port()
        self.api = Process([sys.executable, "-m", "gunicorn", "config.wsgi:application", "-b", f"127.0.0.1:{api_port}",
                            "-w", "2", "--threads", "4", "--graceful-timeout", "2"], full, log_dir, "gunicorn")
        self.sweep = Process([sys.executable, "manage.py", "sweep"], full, log_dir, "sweep")
        self.proxy = PathProxy(api_port, self.ws.port)
        self.url = self.proxy.url

        def answers() -> bool:
            assert self.api.process.poll() is None, self.api.log_path.read_text()
            return httpx.get(f"http://127.0.0.1:{api_port}/accounts/login/", timeout=1).status_code == 200

        wait_for(answers, timeout_s=30, interval_s=0.1, ignore=(httpx.HTTPError,), what="gunicorn to start")

    def stop(self):
        self.proxy.close()
        for part in (self.sweep, self.api, self.ws):
            part.stop()


@pytest.fixture
def production_shape(transactional_db, tmp_path):
    """A factory: ``production_shape(**env) -> ProductionShape`` (stopped after the test)."""
    shapes = []

    def start(**env):
        shape = ProductionShape(env, tmp_path)
        shapes.append(shape)
        return shape

    yield start
    for shape in shapes:
        shape.stop()
