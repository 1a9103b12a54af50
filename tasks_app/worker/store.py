"""The worker's state directory and its local SQLite database (SPEC W1, W2, W3, W5, X1, X2, R4).

State directory (mode 0700, W5)::

    worker.lock      one worker per directory (flock)
    machine.json     {"machine_id", "generation", "name", "server"}
    token            the machine token (mode 0600); never put in an agent's environment
    worker.sqlite3   operations, seen messages, the outbox of receipts and markers
    ops/<op id>/     output.log (agent stdout+stderr), prompt (stdin), launcher.json, exit.json

The database runs WAL + synchronous=FULL + fullfsync + checkpoint_fullfsync (W1): every
commit is durable (on macOS, through the drive cache). Transactions are ``BEGIN IMMEDIATE``
/ ``COMMIT`` issued by hand (``isolation_level=None``). One connection, shared by the
worker's threads under a lock.
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import uuid
from contextlib import contextmanager
from dataclasses import dataclass

SCHEMA_VERSION = 1
DB_NAME = "worker.sqlite3"

PRAGMAS = (
    "PRAGMA journal_mode=WAL",
    "PRAGMA synchronous=FULL",
    "PRAGMA fullfsync=ON",
    "PRAGMA checkpoint_fullfsync=ON",
    "PRAGMA busy_timeout=10000",
    "PRAGMA foreign_keys=ON",
)

SCHEMA_V1 = """
CREATE TABLE operations (
    operation_id       TEXT PRIMARY KEY,
    task_id            TEXT,
    payload            TEXT NOT NULL,
    local_state        TEXT NOT NULL
                       CHECK (local_state IN ('received', 'starting', 'running', 'ended')),
    -- X1: committed as 1 before the spawn, the CHECK makes a second spawn impossible.
    spawn_count        INTEGER NOT NULL DEFAULT 0 CHECK (spawn_count <= 1),
    cancel_requested   INTEGER NOT NULL DEFAULT 0,
    lease_id           TEXT,
    lease_terms        TEXT,
    granted_mono       REAL,
    granted_wall       REAL,
    sent_mono          REAL,
    sent_wall          REAL,
    boot_id            TEXT,
    pid                INTEGER,
    pgid               INTEGER,
    process_start_time REAL,
    spawned_mono       REAL,
    spawned_wall       REAL,
    descendants        TEXT NOT NULL DEFAULT '[]',
    turn_id            TEXT,
    final              TEXT,
    created_wall       REAL NOT NULL,
    updated_wall       REAL NOT NULL
);
CREATE TABLE messages (
    message_id     TEXT PRIMARY KEY,
    kind           TEXT NOT NULL,
    operation_id   TEXT,
    received_wall  REAL NOT NULL
);
CREATE TABLE outbox (
    seq           INTEGER PRIMARY KEY AUTOINCREMENT,
    event_id      TEXT NOT NULL UNIQUE,
    kind          TEXT NOT NULL,
    operation_id  TEXT,
    method        TEXT NOT NULL,
    path          TEXT NOT NULL,
    body          TEXT NOT NULL,
    attempts      INTEGER NOT NULL DEFAULT 0,
    status        TEXT NOT NULL DEFAULT 'pending' CHECK (status IN ('pending', 'done', 'given_up')),
    answer        TEXT,
    created_wall  REAL NOT NULL
);
-- The sender's queue: pending rows in order.
CREATE INDEX outbox_pending ON outbox (seq) WHERE status = 'pending';
"""


class StateDirLocked(Exception):
    """Another worker holds this state directory (W5)."""


@dataclass(frozen=True)
class Identity:
    machine_id: str
    generation: int
    name: str
    server: str
    token: str


class StateDir:
    """The worker's directory: identity files, lock, per-operation files (W5)."""

    def __init__(self, path: str):
        self.path = os.path.abspath(os.path.expanduser(path))
        self._lock_fd = None

    def ensure(self) -> None:
        """Create the directory (and ops/) with mode 0700; tighten it if it exists."""
        os.makedirs(self.path, mode=0o700, exist_ok=True)
        os.chmod(self.path, 0o700)
        os.makedirs(os.path.join(self.path, "ops"), mode=0o700, exist_ok=True)

    def lock(self) -> None:
        """Take the state directory's lock or raise ``StateDirLocked`` (W5).

        flock dies with the process, so a crashed worker never blocks its restart; the
        descriptor is close-on-exec, so agents never hold it.
        """
        fd = os.open(os.path.join(self.path, "worker.lock"), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StateDirLocked(f"another worker is running on state directory {self.path}")
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._lock_fd = fd

    def op_dir(self, operation_id: str) -> str:
        path = os.path.join(self.path, "ops", str(uuid.UUID(str(operation_id))))
        os.makedirs(path, mode=0o700, exist_ok=True)
        return path

    @property
    def db_path(self) -> str:
        return os.path.join(self.path, DB_NAME)

    def write_identity(self, *, machine_id: str, generation: int, name: str, server: str, token: str) -> None:
        """Store the pairing result: the token in a 0600 file, the rest in machine.json."""
        self.ensure()
        write_file_atomic(os.path.join(self.path, "token"), token.encode(), mode=0o600)
        meta = {"machine_id": machine_id, "generation": generation, "name": name, "server": server}
        write_file_atomic(os.path.join(self.path, "machine.json"), json.dumps(meta).encode(), mode=0o600)

    def read_identity(self) -> Identity | None:
        try:
            with open(os.path.join(self.path, "machine.json")) as f:
                meta = json.load(f)
            with open(os.path.join(self.path, "token")) as f:
                token = f.read().strip()
        except FileNotFoundError:
            return None
        return Identity(
            machine_id=meta["machine_id"],
            generation=int(meta["generation"]),
            name=meta.get("name", ""),
            server=meta.get("server", ""),
            token=token,
        )


def write_file_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write ``data`` to ``path`` via a temporary file, fsync and rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    try:
        os.write(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)
    os.chmod(tmp, mode)
    os.replace(tmp, path)


def _row(cursor, row):
    return {d[0]: row[i] for i, d in enumerate(cursor.description)}


class Store:
    """The local database. Every public method is one durable transaction."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.RLock()
        self.conn = sqlite3.connect(path, isolation_level=None, check_same_thread=False, timeout=10)
        self.conn.row_factory = _row
        for pragma in PRAGMAS:
            self.conn.execute(pragma)
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def pragmas(self) -> dict:
        """Read back the durability settings (W1)."""
        with self._lock:
            out = {}
            for name in ("journal_mode", "synchronous", "fullfsync", "checkpoint_fullfsync"):
                out[name] = list(self.conn.execute(f"PRAGMA {name}").fetchone().values())[0]
            return out

    @contextmanager
    def transaction(self):
        with self._lock:
            self.conn.execute("BEGIN IMMEDIATE")
            try:
                yield self.conn
            except BaseException:
                self.conn.execute("ROLLBACK")
                raise
            else:
                self.conn.execute("COMMIT")

    def _migrate(self) -> None:
        with self.transaction() as c:
            version = list(c.execute("PRAGMA user_version").fetchone().values())[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"worker database {self.path} has schema {version}, newer than {SCHEMA_VERSION}")
            if version < 1:
                for statement in SCHEMA_V1.split(";"):
                    if statement.strip():
                        c.execute(statement)
                c.execute(f"PRAGMA user_version = {SCHEMA_VERSION}")

    # --- operations -------------------------------------------------------------------

    def get(self, operation_id: str) -> dict | None:
        with self._lock:
            return self.conn.execute("SELECT * FROM operations WHERE operation_id = ?", (operation_id,)).fetchone()

    def in_states(self, *states: str) -> list[dict]:
        with self._lock:
            marks = ",".join("?" * len(states))
            return self.conn.execute(
                f"SELECT * FROM operations WHERE local_state IN ({marks}) ORDER BY created_wall", states
            ).fetchall()

    def record_message(self, *, message_id: str, kind: str, operation_id: str, payload: dict, wall: float) -> bool:
        """Commit a pulled message before its ack (W2). For ``start``, also the operation
        record; returns False when the operation was already known (W3: ack, don't run)."""
        with self.transaction() as c:
            c.execute(
                "INSERT OR IGNORE INTO messages (message_id, kind, operation_id, received_wall) VALUES (?, ?, ?, ?)",
                (message_id, kind, operation_id, wall),
            )
            if kind != "start":
                return True
            cur = c.execute(
                "INSERT OR IGNORE INTO operations (operation_id, task_id, payload, local_state, created_wall, updated_wall)"
                " VALUES (?, ?, ?, 'received', ?, ?)",
                (operation_id, str(payload.get("task_id") or ""), json.dumps(payload), wall, wall),
            )
            return cur.rowcount == 1

    def request_cancel(self, operation_id: str) -> None:
        with self.transaction() as c:
            c.execute("UPDATE operations SET cancel_requested = 1 WHERE operation_id = ?", (operation_id,))

    def save_lease(self, operation_id: str, *, terms: dict, sent_mono: float, sent_wall: float, boot: str, granted: bool) -> None:
        """Persist a grant or renewal: the terms and the anchor's send times (X2, L3)."""
        with self.transaction() as c:
            if granted:
                c.execute(
                    "UPDATE operations SET lease_id = ?, lease_terms = ?, sent_mono = ?, sent_wall = ?,"
                    " granted_mono = COALESCE(granted_mono, ?), granted_wall = COALESCE(granted_wall, ?),"
                    " boot_id = ?, updated_wall = ? WHERE operation_id = ?",
                    (terms["lease_id"], json.dumps(terms), sent_mono, sent_wall, sent_mono, sent_wall, boot, sent_wall, operation_id),
                )
            else:
                c.execute(
                    "UPDATE operations SET lease_terms = ?, sent_mono = ?, sent_wall = ?, updated_wall = ?"
                    " WHERE operation_id = ?",
                    (json.dumps(terms), sent_mono, sent_wall, sent_wall, operation_id),
                )

    def mark_starting(self, operation_id: str, *, turn_id: str | None, wall: float, outbox: list[dict]) -> None:
        """X1: ``starting`` + ``spawn_count = 1`` before the spawn (raises on a second try)."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE operations SET local_state = 'starting', spawn_count = spawn_count + 1, turn_id = ?,"
                " updated_wall = ? WHERE operation_id = ? AND local_state = 'received'",
                (turn_id, wall, operation_id),
            )
            if cur.rowcount != 1:
                raise sqlite3.IntegrityError(f"operation {operation_id} is not in state received")
            self._enqueue(c, outbox, wall)

    def mark_running(
        self, operation_id: str, *, pid: int, pgid: int, start_time: float, spawned_mono: float, spawned_wall: float,
        outbox: list[dict],
    ) -> None:
        """X2: pid, group, process start time right after the spawn."""
        with self.transaction() as c:
            c.execute(
                "UPDATE operations SET local_state = 'running', pid = ?, pgid = ?, process_start_time = ?,"
                " spawned_mono = ?, spawned_wall = ?, updated_wall = ? WHERE operation_id = ?",
                (pid, pgid, start_time, spawned_mono, spawned_wall, spawned_wall, operation_id),
            )
            self._enqueue(c, outbox, spawned_wall)

    def save_descendants(self, operation_id: str, descendants: list) -> None:
        with self.transaction() as c:
            c.execute(
                "UPDATE operations SET descendants = ? WHERE operation_id = ?",
                (json.dumps(descendants), operation_id),
            )

    def mark_ended(self, operation_id: str, *, final: dict | None, wall: float, outbox: list[dict]) -> None:
        """The operation is over locally: keep its final facts and queue what reports it."""
        with self.transaction() as c:
            c.execute(
                "UPDATE operations SET local_state = 'ended', final = ?, updated_wall = ? WHERE operation_id = ?",
                (json.dumps(final) if final is not None else None, wall, operation_id),
            )
            self._enqueue(c, outbox, wall)

    # --- outbox (R4) --------------------------------------------------------------------

    def enqueue(self, items: list[dict], wall: float) -> None:
        with self.transaction() as c:
            self._enqueue(c, items, wall)

    @staticmethod
    def _enqueue(c, items: list[dict], wall: float) -> None:
        for item in items:
            c.execute(
                "INSERT OR IGNORE INTO outbox (event_id, kind, operation_id, method, path, body, created_wall)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (
                    item["event_id"], item["kind"], item.get("operation_id"), item.get("method", "POST"),
                    item["path"], json.dumps(item["body"]), wall,
                ),
            )

    def next_outbox(self) -> dict | None:
        with self._lock:
            return self.conn.execute(
                "SELECT * FROM outbox WHERE status = 'pending' ORDER BY seq LIMIT 1"
            ).fetchone()

    def pending_outbox(self) -> int:
        with self._lock:
            return self.conn.execute("SELECT COUNT(*) AS n FROM outbox WHERE status = 'pending'").fetchone()["n"]

    def outbox_attempt(self, seq: int) -> None:
        with self.transaction() as c:
            c.execute("UPDATE outbox SET attempts = attempts + 1 WHERE seq = ?", (seq,))

    def outbox_done(self, seq: int, *, status: str, answer: str) -> None:
        with self.transaction() as c:
            c.execute("UPDATE outbox SET status = ?, answer = ? WHERE seq = ?", (status, answer, seq))

    def outbox_rows(self) -> list[dict]:
        with self._lock:
            return self.conn.execute("SELECT * FROM outbox ORDER BY seq").fetchall()
