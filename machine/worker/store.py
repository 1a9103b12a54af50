"""The worker's state directory and its local SQLite database (SPEC W1, W2, W3, W5, X1, X2, R4).

State directory (mode 0700, W5)::

    worker.lock      one worker per directory (flock)
    machine.json     {"machine_id", "generation", "name", "server"}
    token            the machine token (mode 0600); never put in an agent's environment
    worker.sqlite3   operations, seen messages, integrations, conversation items, the outbox
    ops/<op id>/     output.log (agent stdout+stderr), prompt (stdin), launcher.json, exit.json,
                     inbox/ and written.log (a live conversation's input, C3)
    worktrees/<op id>/  the git worktree of a worktree task (G7)

Bounded (W1): the records of an operation that ended locally, whose start message's ack
the service answered and whose every queued report was answered, are pruned once
untouched for ``RECORD_RETENTION_S`` (7 days), with its ``ops/`` directory (a worktree
task's only after its integration is done, G7); so are seen
messages and answered outbox rows of that age that belong to no kept operation
(``Store.prune``, run by the worker at start and daily).

The database, its W1 settings, its transactions and its ``outbox`` table are
``machine.outbox``'s (the hooks' outbox is the same code): every commit is durable. One
connection, shared by the worker's threads under a lock.
"""
from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import threading
import uuid
from dataclasses import dataclass

from machine.outbox import Immediate, Outbox, connect
from machine.files import write_atomic

SCHEMA_VERSION = 6
DB_NAME = "worker.sqlite3"
RECORD_RETENTION_S = 7 * 86400.0

BUSY_TIMEOUT_S = 10.0

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

# G7: worktree tasks and their merge or discard.
SCHEMA_V2 = """
-- The worktree of a worktree task (worktrees.plan's JSON), recorded with 'starting'.
ALTER TABLE operations ADD COLUMN worktree TEXT;
CREATE TABLE integrations (
    integration_id  TEXT PRIMARY KEY,
    operation_id    TEXT NOT NULL,
    payload         TEXT NOT NULL,
    -- received -> merging (the planned ref move recorded before it is made) -> done
    state           TEXT NOT NULL CHECK (state IN ('received', 'merging', 'done')),
    plan            TEXT,
    outcome         TEXT,
    created_wall    REAL NOT NULL,
    updated_wall    REAL NOT NULL
);
"""

# v3: when the service answered a message's ack (W1's pruning needs to know that a start
# will never be delivered again, W3).
SCHEMA_V3 = """
ALTER TABLE messages ADD COLUMN acked_wall REAL
"""

# v4: what a live conversation's agent is to read (C3; ``conversation.py``). An item is
# recorded when pulled (before its ack), gets its inbox number recorded before its file is
# written (``placed``), is ``written`` when the launcher wrote it to the agent, a message
# ``answered`` when its turn's ``result`` came; an interrupt with no turn to stop is
# ``skipped``, and so is a message the owner withdrew before the worker claimed it (C10).
SCHEMA_V4 = """
CREATE TABLE conversation_items (
    item_id       TEXT PRIMARY KEY,
    operation_id  TEXT NOT NULL,
    kind          TEXT NOT NULL CHECK (kind IN ('message', 'interrupt', 'end')),
    seq           INTEGER,
    line          TEXT,
    state         TEXT NOT NULL DEFAULT 'received'
                  CHECK (state IN ('received', 'placed', 'written', 'answered', 'skipped')),
    placement     INTEGER,
    created_wall  REAL NOT NULL,
    UNIQUE (operation_id, placement)
)
"""

# v5 (C9): a message's ``delivery`` (``queue`` or ``steer``) and ``turn_seq``, the seq of the
# message whose agent turn took it (set when the agent's stream shows it took it: its own
# seq while its turn runs, then ``answered``; another's: it joined that turn, ``answered``
# at once, as a message whose turn is over for it).
SCHEMA_V5 = """
ALTER TABLE conversation_items ADD COLUMN delivery TEXT NOT NULL DEFAULT 'queue';
ALTER TABLE conversation_items ADD COLUMN turn_seq INTEGER
"""


# v6 (C9, Codex): an ``again`` item, the second line of a steered message whose steer the
# agent refused because the turn had ended (Codex's ``turn/steer``: "no active turn"): the
# message's ``turn/start`` (``live_agents.AppServer``), its own inbox number (``item_id``
# ``again:<message id>``, the message's ``seq`` and ``line``). SQLite cannot change a
# CHECK constraint, so the table is copied (rows in their order: ``items`` reads by rowid).
SCHEMA_V6 = """
CREATE TABLE conversation_items_v6 (
    item_id       TEXT PRIMARY KEY,
    operation_id  TEXT NOT NULL,
    kind          TEXT NOT NULL CHECK (kind IN ('message', 'interrupt', 'end', 'again')),
    seq           INTEGER,
    line          TEXT,
    state         TEXT NOT NULL DEFAULT 'received'
                  CHECK (state IN ('received', 'placed', 'written', 'answered', 'skipped')),
    placement     INTEGER,
    created_wall  REAL NOT NULL,
    delivery      TEXT NOT NULL DEFAULT 'queue',
    turn_seq      INTEGER,
    UNIQUE (operation_id, placement)
);
INSERT INTO conversation_items_v6 (item_id, operation_id, kind, seq, line, state, placement, created_wall,
                                   delivery, turn_seq)
    SELECT item_id, operation_id, kind, seq, line, state, placement, created_wall, delivery, turn_seq
    FROM conversation_items ORDER BY rowid;
DROP TABLE conversation_items;
ALTER TABLE conversation_items_v6 RENAME TO conversation_items
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

    def remove_op_dir(self, operation_id: str) -> None:
        """Delete an operation's files (after ``Store.prune``); a missing one is fine."""
        import shutil

        shutil.rmtree(os.path.join(self.path, "ops", str(uuid.UUID(str(operation_id)))), ignore_errors=True)

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
        write_atomic(os.path.join(self.path, "token"), token)
        meta = {"machine_id": machine_id, "generation": generation, "name": name, "server": server}
        write_atomic(os.path.join(self.path, "machine.json"), json.dumps(meta))

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


def _row(cursor, row):
    return {d[0]: row[i] for i, d in enumerate(cursor.description)}


class Store:
    """The local database. Every public method is one durable transaction. ``outbox``:
    its queue of reports (``machine.outbox.Outbox``; rows are dicts, answered rows kept
    until ``prune``), which the sender delivers."""

    def __init__(self, path: str):
        self.path = path
        self._lock = threading.RLock()
        self.conn = connect(path, busy_timeout_s=BUSY_TIMEOUT_S, threads=True)
        self.conn.row_factory = _row
        self.conn.execute("PRAGMA foreign_keys = ON")
        self.outbox = Outbox(self.conn, keep_answered=True, lock=self._lock)
        self._migrate()

    def close(self) -> None:
        with self._lock:
            self.conn.close()

    def pragmas(self) -> dict:
        """Read back the durability settings (W1)."""
        return self.outbox.pragmas()

    def transaction(self) -> Immediate:
        """``with store.transaction() as c:`` one ``BEGIN IMMEDIATE`` transaction under the lock."""
        return Immediate(self.conn, lock=self._lock)

    def _migrate(self) -> None:
        with self.transaction() as c:
            version = list(c.execute("PRAGMA user_version").fetchone().values())[0]
            if version > SCHEMA_VERSION:
                raise RuntimeError(f"worker database {self.path} has schema {version}, newer than {SCHEMA_VERSION}")
            for number, schema in ((1, SCHEMA_V1), (2, SCHEMA_V2), (3, SCHEMA_V3), (4, SCHEMA_V4),
                                   (5, SCHEMA_V5), (6, SCHEMA_V6)):
                if version < number:
                    for statement in schema.split(";"):
                        if statement.strip():
                            c.execute(statement)
            if version < SCHEMA_VERSION:
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

    def message_acked(self, message_id: str, wall: float) -> None:
        """The service answered this message's ack (200): it will not deliver it again."""
        with self.transaction() as c:
            c.execute("UPDATE messages SET acked_wall = COALESCE(acked_wall, ?) WHERE message_id = ?", (wall, message_id))

    def prune(self, *, before_wall: float) -> list[str]:
        """W1's bound, one transaction: delete every operation that ended locally, was last
        updated before ``before_wall`` (wall seconds), has its start message's ack
        answered (so it can never be delivered again and W3 needs no record) and no
        report still pending; then the answered outbox rows and seen messages older than
        ``before_wall`` that belong to no kept operation. A worktree task (G7) goes only
        once an integration of its worktree is done (merge or discard; its own, or that of
        a later follow-up in the same worktree, G8), never while the owner may still
        decide. Returns the pruned operation ids
        (their ``ops/`` directories are the caller's to remove)."""
        with self.transaction() as c:
            pruned = [row["operation_id"] for row in c.execute(
                "SELECT o.operation_id FROM operations o WHERE o.local_state = 'ended' AND o.updated_wall < ?"
                " AND EXISTS (SELECT 1 FROM messages m WHERE m.operation_id = o.operation_id AND m.kind = 'start'"
                "             AND m.acked_wall IS NOT NULL)"
                " AND NOT EXISTS (SELECT 1 FROM outbox x WHERE x.operation_id = o.operation_id AND x.status = 'pending')"
                " AND NOT EXISTS (SELECT 1 FROM integrations i WHERE i.operation_id = o.operation_id"
                "                 AND i.state != 'done')"
                " AND (o.worktree IS NULL OR EXISTS (SELECT 1 FROM integrations i JOIN operations w"
                "      ON w.operation_id = i.operation_id WHERE i.state = 'done'"
                "      AND json_extract(w.worktree, '$.path') = json_extract(o.worktree, '$.path')))",
                (before_wall,),
            ).fetchall()]
            c.executemany("DELETE FROM operations WHERE operation_id = ?", [(op,) for op in pruned])
            c.executemany("DELETE FROM integrations WHERE operation_id = ?", [(op,) for op in pruned])
            c.executemany("DELETE FROM conversation_items WHERE operation_id = ?", [(op,) for op in pruned])
            c.execute(
                "DELETE FROM outbox WHERE status != 'pending' AND created_wall < ? AND (operation_id IS NULL OR"
                " operation_id NOT IN (SELECT operation_id FROM operations))", (before_wall,))
            c.execute(
                "DELETE FROM messages WHERE received_wall < ? AND (operation_id IS NULL OR"
                " operation_id NOT IN (SELECT operation_id FROM operations))", (before_wall,))
            return pruned

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

    def mark_starting(self, operation_id: str, *, turn_id: str | None, wall: float, outbox: list[dict],
                      worktree: dict | None = None) -> None:
        """X1: ``starting`` + ``spawn_count = 1`` before the spawn (raises on a second try);
        ``worktree`` (G7) is where the worktree is about to be made."""
        with self.transaction() as c:
            cur = c.execute(
                "UPDATE operations SET local_state = 'starting', spawn_count = spawn_count + 1, turn_id = ?,"
                " worktree = ?, updated_wall = ? WHERE operation_id = ? AND local_state = 'received'",
                (turn_id, json.dumps(worktree) if worktree else None, wall, operation_id),
            )
            if cur.rowcount != 1:
                raise sqlite3.IntegrityError(f"operation {operation_id} is not in state received")
            self._enqueue(outbox, wall)

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
            self._enqueue(outbox, spawned_wall)

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
            self._enqueue(outbox, wall)

    # --- live conversations (C3) -------------------------------------------------------------

    def record_item(self, *, item_id: str, operation_id: str, kind: str, seq: int | None, line: str | None,
                    wall: float, message_id: str | None = None, delivery: str = "queue") -> bool:
        """Commit a conversation item (and the pulled message that carried it) before its
        ack (W2); False when it was already known (W3: never written twice). ``delivery``:
        a message's ``queue`` or ``steer`` (C9)."""
        with self.transaction() as c:
            if message_id is not None:
                c.execute("INSERT OR IGNORE INTO messages (message_id, kind, operation_id, received_wall)"
                          " VALUES (?, ?, ?, ?)", (message_id, kind, operation_id, wall))
            cur = c.execute("INSERT OR IGNORE INTO conversation_items (item_id, operation_id, kind, seq, line,"
                            " created_wall, delivery) VALUES (?, ?, ?, ?, ?, ?, ?)",
                            (item_id, operation_id, kind, seq, line, wall, delivery))
            return cur.rowcount == 1

    def items(self, operation_id: str) -> list[dict]:
        """The operation's conversation items in the order they were recorded."""
        with self._lock:
            return self.conn.execute("SELECT * FROM conversation_items WHERE operation_id = ? ORDER BY rowid",
                                     (operation_id,)).fetchall()

    def item_moved(self, item_id: str, *, to: str, came_from: str, placement: int | None = None,
                   outbox: list[dict] = (), turn_id: str | None = None, wall: float = 0.0,
                   turn_seq: int | None = None) -> bool:
        """Compare-and-set an item's state ``came_from`` -> ``to`` (``placement``: its
        inbox number, set with ``placed``; ``turn_seq``: set once, C9, only on an item that
        has none yet), with what reports it and, when a turn starts, the operation's
        ``turn_id``, in one commit. False (nothing done) if it was not in ``came_from``
        (or, with ``turn_seq``, already had one)."""
        with self.transaction() as c:
            cur = c.execute("UPDATE conversation_items SET state = ?, placement = COALESCE(?, placement),"
                            " turn_seq = COALESCE(?, turn_seq) WHERE item_id = ? AND state = ?"
                            " AND (? IS NULL OR turn_seq IS NULL)",
                            (to, placement, turn_seq, item_id, came_from, turn_seq))
            if cur.rowcount != 1:
                return False
            if turn_id is not None:
                c.execute("UPDATE operations SET turn_id = ? WHERE operation_id ="
                          " (SELECT operation_id FROM conversation_items WHERE item_id = ?)", (turn_id, item_id))
            self._enqueue(list(outbox), wall)
            return True

    # --- integrations (G7) ----------------------------------------------------------------

    def record_integration(self, *, message_id: str, integration_id: str, operation_id: str, payload: dict,
                           wall: float) -> bool:
        """Commit a pulled ``integrate`` message before its ack (W2); False when the
        integration was already known (W3: acknowledged, never carried out twice)."""
        with self.transaction() as c:
            c.execute(
                "INSERT OR IGNORE INTO messages (message_id, kind, operation_id, received_wall) VALUES (?, ?, ?, ?)",
                (message_id, "integrate", operation_id, wall),
            )
            cur = c.execute(
                "INSERT OR IGNORE INTO integrations (integration_id, operation_id, payload, state, created_wall,"
                " updated_wall) VALUES (?, ?, ?, 'received', ?, ?)",
                (integration_id, operation_id, json.dumps(payload), wall, wall),
            )
            return cur.rowcount == 1

    def integration(self, integration_id: str) -> dict | None:
        with self._lock:
            return self.conn.execute("SELECT * FROM integrations WHERE integration_id = ?",
                                     (integration_id,)).fetchone()

    def integrations(self, *states: str) -> list[dict]:
        """Integrations in ``states`` (all when none given), oldest first."""
        with self._lock:
            if not states:
                return self.conn.execute("SELECT * FROM integrations ORDER BY created_wall").fetchall()
            marks = ",".join("?" * len(states))
            return self.conn.execute(f"SELECT * FROM integrations WHERE state IN ({marks}) ORDER BY created_wall",
                                     states).fetchall()

    def integration_planned(self, integration_id: str, *, plan: dict, wall: float) -> None:
        """The ref move a merge is about to make, durable before it is made (``merging``)."""
        with self.transaction() as c:
            c.execute("UPDATE integrations SET state = 'merging', plan = ?, updated_wall = ?"
                      " WHERE integration_id = ? AND state != 'done'", (json.dumps(plan), wall, integration_id))

    def integration_done(self, integration_id: str, *, outcome: dict, wall: float, outbox: list[dict]) -> None:
        """The outcome, and the ``integrated`` receipt that reports it, in one commit."""
        with self.transaction() as c:
            c.execute("UPDATE integrations SET state = 'done', outcome = ?, updated_wall = ? WHERE integration_id = ?",
                      (json.dumps(outcome), wall, integration_id))
            self._enqueue(outbox, wall)

    # --- outbox (R4) --------------------------------------------------------------------

    def enqueue(self, items: list[dict], wall: float) -> None:
        """Queue reports (``_enqueue``) in their own transaction."""
        with self.transaction():
            self._enqueue(items, wall)

    def _enqueue(self, items: list[dict], wall: float) -> None:
        """Queue ``items`` (``{"event_id", "kind", "path", "body"[, "operation_id", "method"]}``,
        ``body`` a JSON value) inside the caller's transaction; an ``event_id`` queued
        before is not queued again (R1)."""
        self.outbox.insert([
            {"event_id": item["event_id"], "kind": item["kind"], "operation_id": item.get("operation_id"),
             "method": item.get("method", "POST"), "path": item["path"], "body": json.dumps(item["body"]),
             "created_wall": wall}
            for item in items
        ])
