"""The hook state directory, its config file and the durable outbox (SPEC I1, W1, R4).

Layout of the state directory (default ``~/.runstead/hooks``, or ``RUNSTEAD_HOOK_DIR``;
mode 0700):

- ``config.json`` (mode 0600): ``{"server": "https://...", "token": "<owner token>"}``,
  written by ``manage.py install_hooks``;
- ``outbox.sqlite3``: table ``outbox`` (queued writes in order: ``seq``, ``method``,
  ``path``, ``body`` JSON, optional ``server`` / ``token`` for writes that carry their own
  target, like the ``turn`` wrapper's) and table ``agent_sessions`` (each agent session's
  local state as JSON);
- ``sender.lock`` (one sender at a time, holds its pid), ``hook.log``, ``sender.log``.

No Django here (I1).
"""
import json
import os
import sqlite3
import time
from dataclasses import dataclass
from pathlib import Path

CONFIG_NAME = "config.json"
DB_NAME = "outbox.sqlite3"
LOCK_NAME = "sender.lock"
HOOK_LOG = "hook.log"
SENDER_LOG = "sender.log"
BUSY_TIMEOUT_MS = 2000
LOG_MAX_BYTES = 1_000_000  # the log is cut back to its last half past this size

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    body TEXT,
    server TEXT,
    token TEXT,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS agent_sessions (
    key TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""


def default_state_dir() -> Path:
    """``RUNSTEAD_HOOK_DIR`` or ``~/.runstead/hooks``."""
    configured = os.environ.get("RUNSTEAD_HOOK_DIR")
    return Path(configured) if configured else Path.home() / ".runstead" / "hooks"


def ensure_state_dir(path: Path) -> Path:
    """Creates the state directory with mode 0700 (and tightens an existing one)."""
    path.mkdir(parents=True, exist_ok=True, mode=0o700)
    if path.stat().st_mode & 0o077:
        path.chmod(0o700)
    return path


def read_config(state_dir: Path) -> dict:
    """``{"server", "token"}`` from ``config.json``, or ``{}`` when it is missing or unreadable."""
    try:
        data = json.loads((state_dir / CONFIG_NAME).read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_config(state_dir: Path, *, server: str, token: str) -> Path:
    """Writes ``config.json`` with mode 0600 (created with that mode, then replaced
    atomically, so the token is never readable by others, not even briefly)."""
    ensure_state_dir(state_dir)
    path = state_dir / CONFIG_NAME
    tmp = state_dir / (CONFIG_NAME + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as handle:
        json.dump({"server": server, "token": token}, handle, indent=2)
        handle.write("\n")
        handle.flush()
        os.fsync(handle.fileno())
    os.chmod(tmp, 0o600)
    os.replace(tmp, path)
    return path


def log_line(state_dir: Path, name: str, message: str) -> None:
    """Appends one line to a log file of the state directory; never raises."""
    try:
        ensure_state_dir(state_dir)
        path = state_dir / name
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"{stamp} {' '.join(message.split())}\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as handle:
            handle.write(line)
        if path.stat().st_size > LOG_MAX_BYTES:
            data = path.read_bytes()[-LOG_MAX_BYTES // 2:]
            path.write_bytes(data[data.find(b"\n") + 1:])
    except OSError:
        pass


@dataclass
class Row:
    """One queued write."""

    seq: int
    method: str
    path: str
    body: dict | None
    server: str | None
    token: str | None
    attempts: int


class Outbox:
    """The durable outbox (SQLite: ``journal_mode=WAL``, ``synchronous=FULL``,
    ``fullfsync=ON``, ``checkpoint_fullfsync=ON``; W1). Every method is one short
    ``BEGIN IMMEDIATE`` transaction; a committed write survives a crash or power loss."""

    def __init__(self, state_dir: Path):
        self.state_dir = ensure_state_dir(Path(state_dir))
        path = self.state_dir / DB_NAME
        if not path.exists():
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
        self.db = sqlite3.connect(path, isolation_level=None, timeout=BUSY_TIMEOUT_MS / 1000)
        self.db.execute(f"PRAGMA busy_timeout = {BUSY_TIMEOUT_MS}")
        if self.db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
            self.db.execute("PRAGMA journal_mode = WAL")
        for pragma in ("synchronous = FULL", "fullfsync = ON", "checkpoint_fullfsync = ON"):
            self.db.execute(f"PRAGMA {pragma}")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def pragmas(self) -> dict:
        """The durability settings as SQLite reports them (for W1's read-back test)."""
        return {
            name: self.db.execute(f"PRAGMA {name}").fetchone()[0]
            for name in ("journal_mode", "synchronous", "fullfsync", "checkpoint_fullfsync")
        }

    def transaction(self):
        return _Immediate(self.db)

    def session_state(self, key: str) -> dict:
        """The local state of one agent session (``{}`` when new); call inside ``transaction()``."""
        row = self.db.execute("SELECT data FROM agent_sessions WHERE key = ?", (key,)).fetchone()
        return json.loads(row[0]) if row else {}

    def save_session_state(self, key: str, data: dict) -> None:
        self.db.execute(
            "INSERT INTO agent_sessions (key, data, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET data = excluded.data, updated_at = excluded.updated_at",
            (key, json.dumps(data, sort_keys=True), time.time()),
        )

    def append(self, writes: list[dict], *, server: str | None = None, token: str | None = None) -> list[int]:
        """Queues ``writes`` (``{"method", "path", "body"}``) in order; call inside
        ``transaction()``. Returns their sequence numbers."""
        seqs = []
        now = time.time()
        for write in writes:
            cursor = self.db.execute(
                "INSERT INTO outbox (method, path, body, server, token, created_at) VALUES (?, ?, ?, ?, ?, ?)",
                (write["method"], write["path"], json.dumps(write.get("body")), server, token, now),
            )
            seqs.append(cursor.lastrowid)
        return seqs

    def enqueue(self, writes: list[dict], *, server: str | None = None, token: str | None = None) -> list[int]:
        """``append`` in its own transaction."""
        with self.transaction():
            return self.append(writes, server=server, token=token)

    def head(self) -> Row | None:
        """The oldest queued write, or None."""
        row = self.db.execute(
            "SELECT seq, method, path, body, server, token, attempts FROM outbox ORDER BY seq LIMIT 1"
        ).fetchone()
        if row is None:
            return None
        return Row(row[0], row[1], row[2], json.loads(row[3]) if row[3] else None, row[4], row[5], row[6])

    def delete(self, seq: int) -> None:
        with self.transaction():
            self.db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))

    def count_attempt(self, seq: int) -> None:
        with self.transaction():
            self.db.execute("UPDATE outbox SET attempts = attempts + 1 WHERE seq = ?", (seq,))

    def pending(self, seqs: list[int] | None = None) -> int:
        """How many writes are queued (of ``seqs`` when given)."""
        if seqs is None:
            return self.db.execute("SELECT count(*) FROM outbox").fetchone()[0]
        marks = ",".join("?" * len(seqs))
        return self.db.execute(f"SELECT count(*) FROM outbox WHERE seq IN ({marks})", seqs).fetchone()[0]

    def rows(self) -> list[Row]:
        """Every queued write, in order (tests and diagnostics)."""
        result = []
        for row in self.db.execute("SELECT seq, method, path, body, server, token, attempts FROM outbox ORDER BY seq"):
            result.append(Row(row[0], row[1], row[2], json.loads(row[3]) if row[3] else None, row[4], row[5], row[6]))
        return result


class _Immediate:
    def __init__(self, db):
        self.db = db

    def __enter__(self):
        self.db.execute("BEGIN IMMEDIATE")
        return self

    def __exit__(self, exc_type, exc, tb):
        self.db.execute("ROLLBACK" if exc_type else "COMMIT")
        return False
