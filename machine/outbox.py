"""The one durable outbox of the owner's machine and its delivery loop (SPEC W1, R1, R3, R4, I1).

The worker (``machine.worker.store`` / ``sender``: receipts, markers, sweeps) and the hooks
(``machine.hooks.store`` / ``sender``: session, marker and job writes) each queue what
they send the service in a table ``outbox`` of their own SQLite database, and deliver it
with this module:

- ``connect``: a connection with W1's settings (``journal_mode=WAL``,
  ``synchronous=FULL``, ``fullfsync=ON``, ``checkpoint_fullfsync=ON``): every commit is
  durable, on macOS through the drive cache; ``Outbox.pragmas`` reads them back.
- ``Immediate``: one ``BEGIN IMMEDIATE`` ... ``COMMIT`` transaction (``ROLLBACK`` on an
  exception), issued by hand (``isolation_level=None``).
- ``Outbox``: the table. Rows are queued in order (``seq``) inside the caller's
  transaction, so a row commits with the state change it reports; ``head`` takes the
  oldest pending row; ``settle`` ends a row that got its answer, ``attempted`` counts a
  try that must be repeated.
- ``deliver``: the loop: the oldest row, sent as committed, until the service answered it
  (R3: 2xx done; a final refusal never resent; 429, 5xx and network errors retried after
  ``machine.protocol.Backoff``, R4), so a later row never overtakes it.

Every outbox table has ``seq INTEGER PRIMARY KEY AUTOINCREMENT``, ``method``, ``path``,
``body`` (JSON text) and ``attempts`` (tries that got an answer or a retry). The worker's
adds ``event_id`` (UNIQUE: R1, a row queued twice is queued once), ``kind``,
``operation_id``, ``status`` (``pending`` -> ``done`` | ``given_up``) and ``answer``, and
keeps answered rows for W1's pruning (``keep_answered``); the hooks' adds ``server``,
``token`` and ``refresh`` (I1's caps) and deletes a row once answered. Each keeps the DDL of
its table with the rest of its schema.

Loads only ``os`` (SQLite on first connect): a hook imports it (I1, I7).
"""
import os

W1_PRAGMAS = ("synchronous = FULL", "fullfsync = ON", "checkpoint_fullfsync = ON")


def connect(path: str, *, busy_timeout_s: float, threads: bool = False):
    """A SQLite connection to ``path`` (created with mode 0600 when missing) in W1's
    settings, autocommit (transactions by hand, ``Immediate``), waiting up to
    ``busy_timeout_s`` seconds for another writer. ``threads``: shared by several threads
    (the caller serialises them with a lock). ``_sqlite3``, what ``sqlite3`` re-exports,
    is imported here, on first use: the package adds only date adapters (and the 2 ms of
    ``datetime``), and a tool hook that reads a snapshot needs none of it (I7)."""
    import _sqlite3

    path = os.fspath(path)
    if not os.path.exists(path):
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT, 0o600))
    db = _sqlite3.connect(path, isolation_level=None, timeout=busy_timeout_s, check_same_thread=not threads)
    db.execute(f"PRAGMA busy_timeout = {int(busy_timeout_s * 1000)}")
    if db.execute("PRAGMA journal_mode").fetchone()[0] != "wal":
        db.execute("PRAGMA journal_mode = WAL")
    for pragma in W1_PRAGMAS:
        db.execute(f"PRAGMA {pragma}")
    return db


class _NoLock:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


NO_LOCK = _NoLock()


class Immediate:
    """``with Immediate(db, lock=..., after=...) as db:`` one ``BEGIN IMMEDIATE``
    transaction, committed at the end of the block, rolled back on an exception. ``lock``
    (a ``threading.RLock``, or none): held for the whole transaction, for a connection
    several threads share. ``after(committed: bool)``: called once the transaction is
    over, whatever happened (the hooks write their snapshots there, I7)."""

    def __init__(self, db, *, lock=NO_LOCK, after=None):
        self.db, self.lock, self.after = db, lock, after

    def __enter__(self):
        self.lock.__enter__()
        try:
            self.db.execute("BEGIN IMMEDIATE")
        except BaseException:
            self.lock.__exit__(None, None, None)
            raise
        return self.db

    def __exit__(self, exc_type, exc, tb):
        committed = False
        try:
            self.db.execute("ROLLBACK" if exc_type else "COMMIT")
            committed = not exc_type
        finally:
            try:
                if self.after is not None:
                    self.after(committed)
            finally:
                self.lock.__exit__(None, None, None)
        return False


class Outbox:
    """The table ``outbox`` of ``db`` (module docstring). ``keep_answered``: an answered
    row stays with its ``status`` and ``answer`` (the worker) instead of being deleted (the
    hooks). ``columns``/``row``: what ``head`` and ``rows`` select and how a selected
    tuple becomes a row (None: as the connection returns it). A row is read by column
    name: ``row["seq"]``, ``row["attempts"]``. ``lock``: as for ``Immediate``. Every
    method but ``insert`` is its own transaction (or a single read)."""

    def __init__(self, db, *, keep_answered: bool, lock=NO_LOCK, columns: str = "*", row=None):
        self.db, self.lock, self.keep_answered = db, lock, keep_answered
        self.columns, self.row = columns, row
        self.waiting = "status = 'pending'" if keep_answered else "1"  # the rows still to send

    def pragmas(self) -> dict:
        """W1's durability settings as SQLite reports them: ``{"journal_mode": "wal",
        "synchronous": 2, "fullfsync": 1, "checkpoint_fullfsync": 1}`` when set."""
        with self.lock:
            cursor = self.db.cursor()
            cursor.row_factory = None
            return {name: cursor.execute(f"PRAGMA {name}").fetchone()[0]
                    for name in ("journal_mode", "synchronous", "fullfsync", "checkpoint_fullfsync")}

    def insert(self, rows: list[dict]) -> list[int]:
        """Queue ``rows`` (column -> value; ``body`` as JSON text) in order, inside the
        caller's transaction; a row whose unique key (the worker's ``event_id``) is queued
        already is left as it is (R1). Returns the ``seq`` of each row added."""
        seqs = []
        for values in rows:
            names = ", ".join(values)
            marks = ", ".join("?" * len(values))
            cursor = self.db.execute(f"INSERT OR IGNORE INTO outbox ({names}) VALUES ({marks})", tuple(values.values()))
            if cursor.rowcount == 1:
                seqs.append(cursor.lastrowid)
        return seqs

    def head(self):
        """The oldest row still to send, or None."""
        with self.lock:
            found = self.db.execute(
                f"SELECT {self.columns} FROM outbox WHERE {self.waiting} ORDER BY seq LIMIT 1").fetchone()
        return found if found is None or self.row is None else self.row(found)

    def heads(self, limit: int) -> list:
        """The ``limit`` oldest rows still to send, oldest first."""
        with self.lock:
            found = self.db.execute(
                f"SELECT {self.columns} FROM outbox WHERE {self.waiting} ORDER BY seq LIMIT ?", (limit,)).fetchall()
        return found if self.row is None else [self.row(r) for r in found]

    def rows(self) -> list:
        """Every row, in order (those answered too when kept)."""
        with self.lock:
            found = self.db.execute(f"SELECT {self.columns} FROM outbox ORDER BY seq").fetchall()
        return found if self.row is None else [self.row(r) for r in found]

    def pending(self, seqs: list[int] | None = None) -> int:
        """How many rows are still to send (of ``seqs`` when given)."""
        where, args = self.waiting, ()
        if seqs is not None:
            where, args = f"{where} AND seq IN ({','.join('?' * len(seqs))})", tuple(seqs)
        with self.lock:
            cursor = self.db.cursor()
            cursor.row_factory = None
            return cursor.execute(f"SELECT count(*) FROM outbox WHERE {where}", args).fetchone()[0]

    def attempted(self, seq: int) -> None:
        """Count one try of row ``seq`` that must be repeated (R4)."""
        with Immediate(self.db, lock=self.lock):
            self.db.execute("UPDATE outbox SET attempts = attempts + 1 WHERE seq = ?", (seq,))

    def settle(self, seq: int, *, status: str, answer: str = "") -> None:
        """Row ``seq`` got its answer (``status``: ``done`` or ``given_up``, R3): counted
        and kept with ``answer`` when answered rows are kept, else deleted. Never sent
        again either way."""
        with Immediate(self.db, lock=self.lock):
            if self.keep_answered:
                self.db.execute("UPDATE outbox SET status = ?, answer = ?, attempts = attempts + 1 WHERE seq = ?",
                                (status, answer, seq))
            else:
                self.db.execute("DELETE FROM outbox WHERE seq = ?", (seq,))


def deliver(outbox: Outbox, send, *, backoff, pause, idle) -> None:
    """Send ``outbox``'s rows oldest first, each exactly as committed (R1: a retry keeps
    its ``event_id``), until a callback says stop.

    ``send(row) -> (outcome, answer)``: ``"done"`` (2xx) and ``"final"`` (R3: a refusal
    never resent) settle the row (``done`` / ``given_up``, with ``answer`` text);
    ``"retry"`` (429, 5xx, a network error) counts the attempt, then
    ``pause(backoff.delay(n), row)`` with ``n`` the row's tries before this one
    (``machine.protocol.Backoff``: equal jitter, capped at 60 s, R4) and the same row
    again, so no later row overtakes it; ``"stop"`` ends the loop, the row untouched.
    ``pause(seconds, row) -> bool`` waits (False: stop); ``idle() -> bool`` is called
    when nothing is pending and waits for more (False: stop)."""
    while True:
        row = outbox.head()
        if row is None:
            if not idle():
                return
            continue
        outcome, answer = send(row)
        if outcome == "stop":
            return
        if outcome == "retry":
            outbox.attempted(row["seq"])
            if not pause(backoff.delay(row["attempts"]), row):
                return
        else:
            outbox.settle(row["seq"], status="done" if outcome == "done" else "given_up", answer=answer)
