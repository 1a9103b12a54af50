"""What every benchmark shares (``run.py``, ``approvals.py``, ``conversation.py``): a free
port, percentiles in milliseconds, the report's header and file, a scratch database
(``scratch_service``) and one service process (``Server``). Imports no other bench module,
so the benches import it and never each other's helpers."""
import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

BASE_DIR = Path(__file__).resolve().parent.parent
READY_TIMEOUT_S = 30.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def pct(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return round(ordered[min(len(ordered) - 1, max(0, int(round(q * len(ordered))) - 1))] * 1000, 1)


def lat(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": pct(values, 0.5), "p99_ms": pct(values, 0.99), "max_ms": pct(values, 1.0)}


def report_start(label: str, **extra) -> dict:
    """A bench report's header: label, UTC start, load average, CPUs and git revision."""
    git = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BASE_DIR, capture_output=True, text=True).stdout.strip()
    return {"label": label, **extra, "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "loadavg": [round(x, 2) for x in os.getloadavg()], "cpus": os.cpu_count(), "git": git}


def report_save(report: dict, out: Path) -> Path:
    """Close a bench report (load average at the end) and write it as JSON to ``out``."""
    report["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    return out


SERVICE_ENVS = ("development", "production")


def service_env(name: str) -> dict:
    """The environment of a measured service's ``RUNSTEAD_ENV`` ``name``: ``development``
    (``./run``'s embedded default: DEBUG on, Django's query log) or ``production`` as
    ``deploy/`` runs it (DEBUG off), without the TLS redirect (no proxy here)."""
    env = {"RUNSTEAD_ENV": name}
    if name == "production":
        env.update({"SECRET_KEY": os.environ.get("SECRET_KEY") or os.urandom(32).hex(),
                    "ALLOWED_HOSTS": "127.0.0.1,localhost", "RUNSTEAD_SSL_REDIRECT": "0"})
    return env


@contextlib.contextmanager
def scratch_service(shape: str, prefix: str, env_name: str = "development"):
    """A scratch database for one benchmark run, migrated, its settings in this process's
    environment (and so in the servers it starts): ``postgres`` creates ``<prefix>_<pid>``
    on ``DATABASE_URL``'s server, with a channel prefix of its own on ``REDIS_URL``, and
    drops it afterwards; ``sqlite`` a scratch file and the in-memory channel layer. Yields
    ``(env, dbname, admin_url)`` (``dbname`` and ``admin_url`` None on SQLite); the
    service runs as ``service_env(env_name)`` says."""
    tmp = Path(tempfile.mkdtemp(prefix=f"{prefix}-db-"))
    dbname = admin_url = None
    if shape == "postgres":
        import psycopg

        admin_url = os.environ["DATABASE_URL"]
        dbname = f"{prefix}_{os.getpid()}"
        with psycopg.connect(admin_url, autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {dbname}")
        env = {"DATABASE_URL": urlunsplit(urlsplit(admin_url)._replace(path="/" + dbname)),
               "RUNSTEAD_CHANNEL_PREFIX": f"{prefix.replace('_', '')}{os.getpid()}"}
    else:
        for name in ("DATABASE_URL", "REDIS_URL"):
            os.environ.pop(name, None)
        env = {"RUNSTEAD_SQLITE_PATH": str(tmp / "db.sqlite3")}
    env["DJANGO_SETTINGS_MODULE"] = "config.settings"
    env.update(service_env(env_name))
    os.environ.update(env)
    try:
        import django

        django.setup()
        from django.core.management import call_command
        from django.db import connection

        call_command("migrate", verbosity=0)
        connection.close()
        yield env, dbname, admin_url
    finally:
        from django.db import connections

        connections.close_all()
        if dbname:
            import psycopg

            with psycopg.connect(admin_url, autocommit=True) as conn:
                conn.execute(f"DROP DATABASE IF EXISTS {dbname} WITH (FORCE)")
        shutil.rmtree(tmp, ignore_errors=True)


# --- servers ----------------------------------------------------------------------------


class Server:
    """One service process in a given shape (``daphne`` or ``gunicorn``)."""

    def __init__(self, shape: str, env: dict):
        self.shape = shape
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = tempfile.NamedTemporaryFile(prefix=f"bench-{shape}-", suffix=".log", delete=False)
        if shape == "daphne":
            argv = [sys.executable, "-m", "daphne", "-b", "127.0.0.1", "-p", str(self.port), "config.asgi:application"]
        else:
            argv = [sys.executable, "-m", "gunicorn", "-w", "2", "--threads", "4", "-b", f"127.0.0.1:{self.port}",
                    "--log-level", "warning", "config.wsgi:application"]
        self.process = subprocess.Popen(
            argv, cwd=BASE_DIR, stdout=self.log, stderr=subprocess.STDOUT,
            env={**os.environ, **env, "RUNSTEAD_EMBEDDED_SWEEP": "0", "RUNSTEAD_LOG_LEVEL": "WARNING",
                 # the benchmark measures throughput, not the K3 brake on one owner's acceptances
                 "RUNSTEAD_ACCEPT_RATE": os.environ.get("RUNSTEAD_ACCEPT_RATE", "1000000/s"),
                 # nor the K3 brake on board handshakes (500 sockets of one owner from one address)
                 "RUNSTEAD_WS_OWNER_RATE": os.environ.get("RUNSTEAD_WS_OWNER_RATE", "1000000/s"),
                 "RUNSTEAD_WS_ADDRESS_RATE": os.environ.get("RUNSTEAD_WS_ADDRESS_RATE", "1000000/s")},
        )
        import httpx

        deadline = time.monotonic() + READY_TIMEOUT_S
        while True:
            try:
                httpx.get(self.url + "/accounts/login/", timeout=1.0)
                return
            except httpx.HTTPError:
                if time.monotonic() > deadline or self.process.poll() is not None:
                    raise RuntimeError(f"{shape} did not start; see {self.log.name}")
                time.sleep(0.1)

    def processes(self):
        import psutil

        top = psutil.Process(self.process.pid)
        return [top, *top.children(recursive=True)]

    def cpu_s(self) -> float:
        return sum(p.cpu_times().user + p.cpu_times().system for p in self.processes())

    def threads(self) -> int:
        return sum(p.num_threads() for p in self.processes())

    def stop(self):
        from tests.procs import stop_process  # BASE_DIR is on sys.path once main() runs

        stop_process(self.process)
