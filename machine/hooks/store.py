"""The hook state directory, its config file and the durable outbox (SPEC I1, W1, R4).

The outbox is ``machine.outbox``'s (the worker's is the same code), with what only the
hooks have: per-row targets, I1's caps and each agent session's state and snapshot.

Layout of the state directory (default ``~/.runstead/hooks``, or ``RUNSTEAD_HOOK_DIR``;
mode 0700):

- ``config.json`` (mode 0600): ``{"server": "https://...", "token": "<owner token>"}``
  and, when not the default, ``approval_wait_s`` (Q3), written by ``manage.py
  install_hooks``;
- ``outbox.sqlite3``: table ``outbox`` (queued writes in order: ``seq``, ``method``,
  ``path``, ``body`` JSON, optional ``server`` / ``token`` for writes that carry their own
  target, like the ``turn`` wrapper's, and ``refresh``: 1 for a write that only refreshes
  state) and table ``agent_sessions`` (each agent session's local state as JSON);

Bounded (I1): the outbox keeps at most ``MAX_ROWS`` writes and ``MAX_BYTES`` of them;
past either, the oldest writes that only refresh state (attention, title) go first, then
the oldest of the rest, each drop logged in ``hook.log``. Agent session states untouched
for ``SESSION_RETENTION_S`` (7 days) are pruned by the sender (at its start and daily).
- ``sender.lock`` (one sender at a time, holds its pid), ``hook.log``, ``sender.log``;
- ``marker_class.json``: ``{"class_s"}``, the class (M2, seconds) of the last ``running``
  marker the service answered, written by the sender and read by tool hooks (I7).
- ``sessions/<hex of the session key>.json``: each agent session's state as last
  committed, the snapshot a tool hook reads (I7) without loading SQLite (``_sqlite3``
  imports ``functools`` and ``collections``: 3 ms of a 4 ms hook). A transaction that
  saves a session's state takes ``sessions.lock`` (``flock``), removes the snapshot before
  it commits and writes the new one (atomic rename) after, then lets go: a snapshot is
  the committed state, or there is none and the reader asks the outbox. A crash at any
  line leaves at worst no snapshot. A power loss can bring back the one removed just
  before (its removal not yet on disk): an older committed state, replaced at the
  session's next write (its ``SessionStart`` when resumed).

Every hook loads ``machine.outbox`` (``os`` alone until an outbox is opened); one that
writes, ``machine.files`` too. No Django here (I1), and no ``pathlib`` either: it imports ``urllib.parse`` and ``fnmatch``, a
few milliseconds of every hook (I7). A state directory is a ``str`` or any path-like.
"""
import os
import time

import machine.outbox
from machine.hooks import DEFAULT_MARKER_CLASS_S, Record, json_dumps, json_loads

CONFIG_NAME = "config.json"
MARKER_CLASS_NAME = "marker_class.json"
DB_NAME = "outbox.sqlite3"
LOCK_NAME = "sender.lock"
SNAPSHOT_DIR = "sessions"
SNAPSHOT_LOCK = "sessions.lock"
HOOK_LOG = "hook.log"
SENDER_LOG = "sender.log"
BUSY_TIMEOUT_MS = 2000
LOG_MAX_BYTES = 1_000_000  # the log is cut back to its last half past this size
MAX_ROWS = 10_000  # I1: queued writes kept at most
MAX_BYTES = 50 * 1024 * 1024  # I1: and at most this much of them (method, path, body, target)
SESSION_RETENTION_S = 7 * 86400.0  # agent session states untouched this long are pruned

SCHEMA = """
CREATE TABLE IF NOT EXISTS outbox (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    method TEXT NOT NULL,
    path TEXT NOT NULL,
    body TEXT,
    server TEXT,
    token TEXT,
    created_at REAL NOT NULL,
    attempts INTEGER NOT NULL DEFAULT 0,
    refresh INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS agent_sessions (
    key TEXT PRIMARY KEY,
    data TEXT NOT NULL,
    updated_at REAL NOT NULL
);
"""


StateDir = str | os.PathLike


def default_state_dir() -> str:
    """``RUNSTEAD_HOOK_DIR`` or ``~/.runstead/hooks``."""
    return os.environ.get("RUNSTEAD_HOOK_DIR") or os.path.join(os.path.expanduser("~"), ".runstead", "hooks")


def ensure_state_dir(path: StateDir) -> StateDir:
    """Creates the state directory with mode 0700 (and tightens an existing one); returns ``path``."""
    os.makedirs(path, mode=0o700, exist_ok=True)
    if os.stat(path).st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def _read_json(path: str):
    with open(path, "rb") as handle:
        return json_loads(handle.read())


def read_config(state_dir: StateDir) -> dict:
    """``{"server", "token"}`` from ``config.json``, or ``{}`` when it is missing or unreadable."""
    try:
        data = _read_json(os.path.join(state_dir, CONFIG_NAME))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def write_config(state_dir: StateDir, *, server: str, token: str, extra: dict | None = None):
    """Writes ``config.json`` with mode 0600 (created with that mode, then replaced
    atomically, so the token is never readable by others, not even briefly); ``extra``:
    further settings (``approval_wait_s``). Returns the file's ``pathlib.Path``."""
    from pathlib import Path

    from machine.files import write_atomic

    ensure_state_dir(state_dir)
    path = Path(state_dir) / CONFIG_NAME
    write_atomic(path, json_dumps({"server": server, "token": token, **(extra or {})}, indent=2) + "\n")
    return path


def marker_class_s(state_dir: StateDir) -> float:
    """I7: the marker class (seconds) the service last answered with, or M2's default."""
    try:
        value = _read_json(os.path.join(state_dir, MARKER_CLASS_NAME)).get("class_s")
    except (OSError, ValueError, AttributeError):
        return DEFAULT_MARKER_CLASS_S
    return float(value) if isinstance(value, (int, float)) and value > 0 else DEFAULT_MARKER_CLASS_S


def write_marker_class(state_dir: StateDir, class_s: float) -> None:
    """Records the class of a ``running`` marker the service answered (atomic; never raises)."""
    from machine.files import write_atomic  # here, not above: a tool hook with nothing due writes nothing (I7)

    try:
        path = os.path.join(state_dir, MARKER_CLASS_NAME)
        if marker_class_s(state_dir) == class_s and os.path.exists(path):
            return
        write_atomic(path, json_dumps({"class_s": class_s}), sync=False)
    except OSError:
        pass


def snapshot_path(state_dir: StateDir, key: str) -> str | None:
    """The snapshot file of one agent session (``sessions/<hex of key>.json``), or None
    for a key too long to name a file (that session has none: its hooks read the outbox)."""
    name = key.encode().hex()
    return os.path.join(state_dir, SNAPSHOT_DIR, name + ".json") if len(name) <= 200 else None


def peek_session_state(state_dir: StateDir, key: str) -> dict:
    """One agent session's local state read without a lock or a write: its snapshot
    when there is one, else from a read-only connection to the outbox (``{}`` when there
    is no outbox or no such session): what a tool hook with nothing due needs (I7)."""
    path = snapshot_path(state_dir, key)
    if path is not None:
        try:
            with open(path, "rb") as handle:
                return json_loads(handle.read())
        except (OSError, ValueError):
            pass  # no snapshot (never written, or a write under way): the outbox has the state
    path = os.path.join(state_dir, DB_NAME)
    if not os.path.exists(path):
        return {}
    import _sqlite3 as sqlite3  # what ``sqlite3`` re-exports, without its date adapters (I7)

    try:
        db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, timeout=BUSY_TIMEOUT_MS / 1000)
        try:
            row = db.execute("SELECT data FROM agent_sessions WHERE key = ?", (key,)).fetchone()
        finally:
            db.close()
    except sqlite3.Error:
        return {}
    return json_loads(row[0]) if row else {}


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def try_lock(path: str) -> int | None:
    """An open descriptor of the lock file ``path`` holding ``flock(LOCK_EX)``, or None
    when another process holds it."""
    import fcntl

    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def log_line(state_dir: StateDir, name: str, message: str) -> None:
    """Appends one line to a log file of the state directory; never raises."""
    try:
        ensure_state_dir(state_dir)
        path = os.path.join(state_dir, name)
        stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        line = f"{stamp} {' '.join(message.split())}\n"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "a") as handle:
            handle.write(line)
        if os.path.getsize(path) > LOG_MAX_BYTES:
            with open(path, "rb") as handle:
                data = handle.read()[-LOG_MAX_BYTES // 2:]
            with open(path, "wb") as handle:
                handle.write(data[data.find(b"\n") + 1:])
    except OSError:
        pass


# A row's size as the caps count it: bytes of what is sent.
ROW_BYTES = ("length(CAST(method AS BLOB)) + length(CAST(path AS BLOB)) + coalesce(length(CAST(body AS BLOB)), 0)"
             " + coalesce(length(CAST(server AS BLOB)), 0) + coalesce(length(CAST(token AS BLOB)), 0)")
REFRESH_KEYS = {"attention", "attention_message", "title"}


def refresh_only(write: dict) -> bool:
    """Whether a queued write only refreshes state a later write refreshes again (I1's
    first to drop when the outbox is full): a session ``PATCH`` of attention (I6) or
    title. Session creation, sweeps, markers (turn start and end) and jobs are not."""
    body = write.get("body")
    return (write.get("method") == "PATCH" and isinstance(body, dict) and bool(body)
            and set(body) <= REFRESH_KEYS)


class Row(Record):
    """One queued write: seq (int), method, path, body (dict or None), server and token
    (str or None: the config's at send time), attempts (int). ``row["seq"]`` reads a field
    too (``machine.outbox.deliver``)."""

    __slots__ = ("seq", "method", "path", "body", "server", "token", "attempts")

    def __getitem__(self, name: str):
        return getattr(self, name)


def _row(values: tuple) -> Row:
    seq, method, path, body, server, token, attempts = values
    return Row(seq, method, path, json_loads(body) if body else None, server, token, attempts)


class Outbox(machine.outbox.Outbox):
    """The hooks' durable outbox (``machine.outbox.Outbox`` in W1's settings; an answered
    write is deleted): its ``head``, ``rows``, ``pending``, ``attempted``, ``settle`` are
    the shared ones, in ``Row``s. Every method is one short ``BEGIN IMMEDIATE``
    transaction (``append`` and the session states: in the caller's ``transaction()``); a
    committed write survives a crash or power loss."""

    def __init__(self, state_dir: StateDir, *, max_rows: int = MAX_ROWS, max_bytes: int = MAX_BYTES):
        self.state_dir = ensure_state_dir(state_dir)
        self.max_rows, self.max_bytes = max_rows, max_bytes
        self._snapshot_lock: int | None = None
        self._snapshots: dict[str, str] = {}  # path -> state JSON, written once committed
        db = machine.outbox.connect(os.path.join(state_dir, DB_NAME), busy_timeout_s=BUSY_TIMEOUT_MS / 1000)
        super().__init__(db, keep_answered=False, columns="seq, method, path, body, server, token, attempts",
                         row=_row)
        self.db.executescript(SCHEMA)
        columns = {row[1] for row in self.db.execute("PRAGMA table_info(outbox)")}
        if "refresh" not in columns:  # an outbox made before the caps
            self.db.execute("ALTER TABLE outbox ADD COLUMN refresh INTEGER NOT NULL DEFAULT 0")

    def close(self) -> None:
        self.db.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def transaction(self) -> machine.outbox.Immediate:
        """``with outbox.transaction():`` one ``BEGIN IMMEDIATE`` transaction, committed
        at the end of the block (rolled back on an exception), and then the snapshots of
        the session states it saved written."""
        return machine.outbox.Immediate(self.db, after=self._end_snapshots)

    def session_state(self, key: str) -> dict:
        """The local state of one agent session (``{}`` when new); call inside ``transaction()``."""
        row = self.db.execute("SELECT data FROM agent_sessions WHERE key = ?", (key,)).fetchone()
        return json_loads(row[0]) if row else {}

    def save_session_state(self, key: str, data: dict) -> None:
        """Saves one agent session's state; call inside ``transaction()``. Its snapshot is
        removed now and written after the commit (TimeoutError when another process held
        ``sessions.lock`` for ``BUSY_TIMEOUT_MS``)."""
        text = json_dumps(data, sort_keys=True)
        path = snapshot_path(self.state_dir, key)
        if path is not None:
            self._claim_snapshots()
            _unlink(path)
            self._snapshots[path] = text
        self.db.execute(
            "INSERT INTO agent_sessions (key, data, updated_at) VALUES (?, ?, ?) "
            "ON CONFLICT (key) DO UPDATE SET data = excluded.data, updated_at = excluded.updated_at",
            (key, text, time.time()),
        )

    def _claim_snapshots(self) -> None:
        """Holds ``sessions.lock`` until the transaction's snapshots are written: a
        transaction that committed before this one cannot write its older snapshot after
        this one's."""
        if self._snapshot_lock is not None:
            return
        os.makedirs(os.path.join(self.state_dir, SNAPSHOT_DIR), mode=0o700, exist_ok=True)
        deadline = time.monotonic() + BUSY_TIMEOUT_MS / 1000
        while (fd := try_lock(os.path.join(self.state_dir, SNAPSHOT_LOCK))) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{SNAPSHOT_LOCK} held by another process for {BUSY_TIMEOUT_MS} ms")
            time.sleep(0.001)
        self._snapshot_lock = fd

    def _end_snapshots(self, committed: bool) -> None:
        """After the commit (``committed``) or the rollback: writes the snapshots (each
        to a temporary file, then renamed over), then lets go of ``sessions.lock``. A
        snapshot that cannot be written stays absent (the outbox has the state)."""
        from machine.files import write_atomic

        try:
            for path, text in self._snapshots.items() if committed else ():
                try:
                    write_atomic(path, text, sync=False)  # a power loss may take it: the outbox has the state
                except OSError:
                    pass
        finally:
            self._snapshots.clear()
            if self._snapshot_lock is not None:
                os.close(self._snapshot_lock)
                self._snapshot_lock = None

    def append(self, writes: list[dict], *, server: str | None = None, token: str | None = None) -> list[int]:
        """Queues ``writes`` (``{"method", "path", "body"}``) in order; call inside
        ``transaction()``. Returns their sequence numbers."""
        now = time.time()
        seqs = self.insert([
            {"method": write["method"], "path": write["path"], "body": json_dumps(write.get("body")),
             "server": server, "token": token, "created_at": now, "refresh": int(refresh_only(write))}
            for write in writes
        ])
        self._trim()
        return seqs

    def size(self) -> tuple[int, int]:
        """``(rows, bytes)`` queued, as the caps count them."""
        rows, size = self.db.execute(f"SELECT count(*), coalesce(sum({ROW_BYTES}), 0) FROM outbox").fetchone()
        return rows, size

    def _trim(self) -> None:
        """I1's caps, inside the caller's transaction: while over ``max_rows`` or
        ``max_bytes``, drop the oldest refresh-only writes, then the oldest others; one
        line in ``hook.log`` says what went."""
        rows, size = self.size()
        if rows <= self.max_rows and size <= self.max_bytes:
            return
        dropped: dict[str, int] = {}
        first = last = None
        for refresh in (1, 0):
            if rows <= self.max_rows and size <= self.max_bytes:
                break
            cursor = self.db.execute(
                f"SELECT seq, method, path, {ROW_BYTES} FROM outbox WHERE refresh = ? ORDER BY seq", (refresh,))
            victims = []
            for seq, method, path, row_bytes in cursor:
                if rows <= self.max_rows and size <= self.max_bytes:
                    break
                victims.append(seq)
                rows, size = rows - 1, size - row_bytes
                label = f"{'refresh' if refresh else 'write'} {method} {_path_shape(path)}"
                dropped[label] = dropped.get(label, 0) + 1
                first, last = min(first or seq, seq), max(last or seq, seq)
            self.db.executemany("DELETE FROM outbox WHERE seq = ?", [(seq,) for seq in victims])
        what = ", ".join(f"{n} x {label}" for label, n in dropped.items())
        log_line(self.state_dir, HOOK_LOG, f"outbox full (caps {self.max_rows} rows, {self.max_bytes} bytes): "
                                           f"dropped {sum(dropped.values())} oldest writes, seq {first}..{last}: {what}")

    def prune_sessions(self, *, older_than_s: float = SESSION_RETENTION_S, now: float | None = None) -> int:
        """Delete the agent session states not touched for ``older_than_s`` seconds
        (their turns' markers expired long ago, M2), with their snapshots and any
        snapshot file as old (left by a crash); returns how many states. Its own
        transaction."""
        cutoff = (now if now is not None else time.time()) - older_than_s
        with self.transaction():
            keys = [key for (key,) in self.db.execute("SELECT key FROM agent_sessions WHERE updated_at < ?", (cutoff,))]
            self.db.execute("DELETE FROM agent_sessions WHERE updated_at < ?", (cutoff,))
            if keys:
                self._claim_snapshots()
            for key in keys:
                path = snapshot_path(self.state_dir, key)
                if path is not None:
                    _unlink(path)
        try:
            with os.scandir(os.path.join(self.state_dir, SNAPSHOT_DIR)) as entries:
                for entry in entries:
                    if entry.stat().st_mtime < cutoff:
                        _unlink(entry.path)
        except OSError:
            pass
        return len(keys)

    def enqueue(self, writes: list[dict], *, server: str | None = None, token: str | None = None) -> list[int]:
        """``append`` in its own transaction."""
        with self.transaction():
            return self.append(writes, server=server, token=token)


def _path_shape(path: str) -> str:
    """A path with its ids left out, for the drop log (``/api/sessions/*/marker/``)."""
    parts = path.split("/")
    return "/".join("*" if len(part) > 20 or ":" in part else part for part in parts)
