"""Agent CLI hooks (SPEC I): ``python -m machine.hooks AGENT``.

This package imports no Django and nothing that imports Django, so a hook starts in a
few tens of milliseconds (I1). Modules:

- ``store``: the hook state directory (mode 0700), its config file (server URL and owner
  token, mode 0600) and the durable outbox (SQLite with W1's settings), which also keeps
  each agent session's local state (open turn, known background jobs, attention), and
  that state's snapshot file, which a tool hook reads without SQLite (I7).
- ``mapping``: one pure function per CLI from a hook payload and the session's local
  state to the writes it implies (I2-I4).
- ``sender``: the detached process that delivers queued writes in order (R4);
  ``launch``: what a hook needs to start it (the lock and the spawn, nothing else).
- ``install``: merging RunStead's entries into each CLI's user config (I5).
- ``entry``: the hook itself; ``__main__`` runs it (``install`` writes the command as
  that file's path, not ``-m``: ``runpy`` imports ``importlib.util``, ``contextlib`` and
  ``collections``, 1.5 ms of every hook, I7).
"""
# I2: RunStead session id = uuid5(RUNSTEAD_NAMESPACE, "<agent>:<agent session id>").
RUNSTEAD_NAMESPACE = "80bf71b1-6975-58ca-9896-94d5739ee39a"
AGENTS = ("claude", "codex", "gemini", "opencode")
# M2's default marker class (seconds), which I7's tool hooks assume until the sender has
# recorded the class the service answered (store.marker_class_s).
DEFAULT_MARKER_CLASS_S = 1200.0
# Q5: the argument that marks the hook entry a worker added for one task's run, and the
# variable the worker sets in every task's environment (``task_approval``). Here, not
# there, so that a tool hook decides without importing the HTTP client (I7).
TASK_FLAG = "--task"
TASK_ENV = "RUNSTEAD_TASK_ID"


def uuid5(name: str) -> str:
    """``str(uuid.uuid5(RUNSTEAD_NAMESPACE, name))`` (I2). ``uuid`` is imported on first
    use: on Python 3.11 it imports ``platform`` (5-9 ms), which a tool hook with nothing
    due never needs (I7)."""
    import uuid

    return str(uuid.uuid5(uuid.UUID(RUNSTEAD_NAMESPACE), name))


def in_task(environ) -> bool:
    """Whether this hook runs inside a RunStead task (the worker sets ``RUNSTEAD_TASK_ID``)."""
    return bool(environ.get(TASK_ENV))


_scanner = None


def json_loads(data: bytes | str):
    """``json.loads(data)``, through the C scanner of ``_json`` that ``json`` itself uses,
    without importing ``json``: that import (with ``re`` and ``enum``) is 8 of the 10 ms
    a tool hook adds to the interpreter's start (I7). The scanner is set as
    ``json.JSONDecoder()`` sets it, so a value it returns is the one ``json.loads``
    returns; anything it does not read whole (bad JSON, a BOM, no ``_json``) goes to
    ``json.loads``, which answers it, its ``ValueError`` included."""
    global _scanner
    try:
        text = data.decode() if isinstance(data, bytes) else data
        if _scanner is None:
            import _json

            _scanner = _json.make_scanner(_JSONContext())
        start = len(text) - len(text.lstrip(_JSON_SPACE))
        value, end = _scanner(text, start)
        if not text[end:].strip(_JSON_SPACE):
            return value
    except Exception:  # noqa: BLE001 - json.loads below says what was wrong
        pass
    import json

    return json.loads(data)


def json_dumps(value, **options) -> str:
    """``json.dumps``, ``json`` imported on first use (the writes of a hook, not I7's reads)."""
    import json

    return json.dumps(value, **options)


_JSON_SPACE = " \t\n\r"  # JSON's whitespace, as json.decoder.WHITESPACE


class _JSONContext:
    """What ``_json.make_scanner`` reads of a ``json.JSONDecoder()``: its defaults."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int
    parse_constant = staticmethod({"-Infinity": float("-inf"), "Infinity": float("inf"), "NaN": float("nan")}.__getitem__)


class Record:
    """The reading side of a named tuple without ``collections`` (``namedtuple`` imports
    ``operator``, ``keyword`` and ``reprlib``: a millisecond of every tool hook, I7). A
    subclass names its fields in ``__slots__``; ``Record(*values)`` sets them in that
    order (TypeError for another count); equal when of one type with equal values."""

    __slots__ = ()

    def __init__(self, *values):
        if len(values) != len(self.__slots__):
            raise TypeError(f"{type(self).__name__} takes {len(self.__slots__)} values, not {len(values)}")
        for name, value in zip(self.__slots__, values):
            setattr(self, name, value)

    def _values(self) -> tuple:
        return tuple(getattr(self, name) for name in self.__slots__)

    def __eq__(self, other):
        return type(other) is type(self) and self._values() == other._values()

    def __hash__(self):
        return hash(self._values())

    def __repr__(self):
        return f"{type(self).__name__}({', '.join(f'{n}={getattr(self, n)!r}' for n in self.__slots__)})"
