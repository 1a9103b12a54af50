"""Numbers and policies of the service <-> worker contract (SPEC H, R4), written once;
the shapes of its messages and receipts are in ``machine.protocol.shapes``.

No Django and nothing outside the standard library here: the worker
(``machine/worker/``) imports this package, and it must run without Django (it may ship
alone one day); the hook sender (``machine/hooks/``), which imports no Django
either, and the notify loop retry through the same ``Backoff``. A hook imports this
module and starts in milliseconds (I7): nothing heavier than it imports today (no
``typing``), which is why the shapes live in a module of their own.
"""
import hashlib
import json
import os
import random
from collections.abc import Callable

# I1, I7: how every hook command starts Python. ``-S`` leaves out ``site`` (and the
# ``.pth`` files of the virtualenv), 2 ms of every hook: a hook needs only the standard
# library and the checkout its command puts on ``PYTHONPATH``. ``-P`` puts neither the
# script's folder nor the working directory (the agent's project) on ``sys.path``, so no
# file there is imported in place of a module the hook uses. The script is run by its
# path, not with ``-m``: ``runpy`` imports ``importlib.util``, ``contextlib`` and
# ``collections``, 1.5 ms of every hook. The sender the hook starts runs with ``site``
# (it sends with httpx, ``launch``).
HOOK_PYTHON_FLAGS = ("-S", "-P")
HOOK_SCRIPT = ("machine", "hooks", "__main__.py")  # under the checkout


def hook_python(executable: str, project_root: str) -> list[str]:
    """The interpreter part of a hook command, ``[executable, "-S", "-P",
    "<project_root>/machine/hooks/__main__.py"]``; the agent's name follows (I1)."""
    return [executable, *HOOK_PYTHON_FLAGS, os.path.join(project_root, *HOOK_SCRIPT)]

# POST /api/tasks/ without ``max_runtime_s``: the task may run this long, in seconds, and
# this much budget is reserved at acceptance (A6, J4).
DEFAULT_MAX_RUNTIME_S = 1800

# GET /api/worker/messages/?wait=S holds the request at most this long, in seconds (H, W2).
LONG_POLL_MAX_S = 25

# D1: while a long-poll waits, the service sends one space (JSON allows leading whitespace)
# every LONG_POLL_KEEPALIVE_S seconds, and the worker gives a pull up after
# PULL_IDLE_TIMEOUT_S seconds without a byte: a half-open connection (Wi-Fi switched, lid
# reopened) is seen within seconds instead of at the end of the wait.
LONG_POLL_KEEPALIVE_S = 3.0
PULL_IDLE_TIMEOUT_S = 2 * LONG_POLL_KEEPALIVE_S + 1

# D1: a pull with nothing to deliver ends after its wait less up to this fraction (a
# random share): pulls that began together (every worker after a service restart) do not
# end, and begin again, together.
PULL_END_JITTER = 0.2

# Characters of agent output kept: what the worker sends in a renewal or a final receipt
# and what the service stores from either (L10, W4).
OUTPUT_TAIL_MAX_CHARS = 4000
# T6: a turn's last assistant message as the Stop hook reports it with its `ended` marker
# (the hook cuts it to this; the service refuses more).
TURN_REPLY_MAX_CHARS = 20000

# Q1: an approval keeps at most this much of its tool input (JSON, UTF-8 bytes); the
# digest covers the whole. An asking hook cuts an input above APPROVAL_INPUT_MAX_BYTES
# itself (the service refuses a bigger one with 400), so any request can be asked.
APPROVAL_INPUT_KEEP_BYTES = 4096
APPROVAL_INPUT_MAX_BYTES = 64 * 1024

# GET /api/approvals/{id}/?wait=S holds the request at most this long, in seconds (Q3).
APPROVAL_WAIT_MAX_S = 25

# R4: no retry waits longer than this, in seconds.
BACKOFF_CAP_S = 60.0


class Backoff:
    """R4's retry delay: exponential backoff with *equal jitter*, capped, in seconds.

    ``delay(n)`` for the ``n``-th consecutive retry (0 for the first; a negative ``n``
    counts as 0) is ``d/2 + rng() * d/2`` with ``d = min(cap_s, base_s * 2**n)``: uniform
    in ``[d/2, d]``. Equal jitter rather than full jitter (uniform in ``[0, d]``) so a
    retry never comes back at once and the floor ``d/2`` doubles with each failure, up to
    ``[cap_s/2, cap_s]``; the random half still spreads retries that failed together.

    ``rng() -> float`` in ``[0, 1)`` (default ``random.random``; tests pass a seeded
    ``random.Random(s).random``). Used by the worker (poll, lease grant, outbox), the
    notify loop (N3) and the hook sender (I1). Implements R4.
    """

    def __init__(self, base_s: float, cap_s: float = BACKOFF_CAP_S, rng: Callable[[], float] = random.random):
        self.base_s = base_s
        self.cap_s = cap_s
        self.rng = rng

    def delay(self, attempt: int) -> float:
        # 2**62 dwarfs any cap; bounding the exponent keeps a long outage from overflowing.
        d = min(self.cap_s, self.base_s * 2.0 ** min(max(attempt, 0), 62))
        return d / 2 + self.rng() * d / 2


# POST /api/worker/receipts/ takes bodies up to this many bytes (K3): a final receipt may
# carry a worktree task's diff, at most 256 KiB of UTF-8, JSON-escaped (G7).
RECEIPT_MAX_BYTES = 2 * 1024 * 1024

# G4 transcript entries: ``{n, kind, text, tool?, status?, call?, usage?, seq?}``, numbered
# from 1 per task by the worker; ``seq`` is on the ``prompt`` entry that opens a live
# conversation's turn: the seq of its message (C2), so a reply is paired with it exactly. ``text`` is at most ENTRY_TEXT_MAX_BYTES of UTF-8 (a longer one is
# cut and ends with ENTRY_CUT_MARK); a progress post or a final receipt carries at most
# ENTRIES_PER_POST of them; the service keeps the last ENTRIES_KEPT of a task.
ENTRY_KINDS = ("prompt", "message", "tool_call", "tool_result", "error")
ENTRY_STATUSES = ("ok", "error")
ENTRY_TEXT_MAX_BYTES = 2048
ENTRY_TOOL_MAX_CHARS = 100
ENTRY_CUT_MARK = "…"
ENTRIES_PER_POST = 50
ENTRIES_KEPT = 500
def json_bytes(value) -> int:
    """Size in bytes of ``value`` as compact UTF-8 JSON."""
    return len(json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode())


def json_digest(value) -> str:
    """SHA-256 hex of the canonical JSON of ``value`` (keys sorted, compact, UTF-8): A2's
    body digest and Q1's ``tool_input_digest``."""
    canonical = json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


CUT_MARK = "…"
_CUT_MIN_CHARS = 32


def cut_json(value, max_bytes: int) -> tuple[object, bool]:
    """``value`` (parsed JSON) made at most ``max_bytes`` as compact JSON, and whether it
    was cut (Q1). Strings are shortened first, the longest first, each ending in ``…``,
    so the input stays the same shape and readable (a long command keeps its start);
    when that is not enough (thousands of keys), the result is ``{"truncated_json":
    "<the start of the JSON text>"}``. ``value`` itself is not changed."""
    if json_bytes(value) <= max_bytes:
        return value, False
    value = json.loads(json.dumps(value))
    while True:
        excess = json_bytes(value) - max_bytes
        if excess <= 0:
            return value, True
        leaves = list(_string_leaves(value))
        if not leaves:
            break
        size, holder, key = max(leaves, key=lambda leaf: leaf[0])
        if size <= _CUT_MIN_CHARS:
            break
        text = holder[key]
        per_char = json_bytes(text) / len(text)  # escapes and multi-byte characters
        keep = max(_CUT_MIN_CHARS, len(text) - int(excess / per_char) - 2)
        holder[key] = text[:keep] + CUT_MARK
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"))
    room = max_bytes - json_bytes({"truncated_json": ""}) - len(CUT_MARK.encode()) - 8
    start = text.encode()[:max(room, 0)].decode(errors="ignore")
    while json_bytes({"truncated_json": start + CUT_MARK}) > max_bytes and start:
        start = start[:-1]
    return {"truncated_json": start + CUT_MARK}, True


def _string_leaves(value):
    """``(length, container, key)`` of every string inside ``value`` (lists and dicts)."""
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, inner in items:
        if isinstance(inner, str):
            yield len(inner), value, key
        elif isinstance(inner, (dict, list)):
            yield from _string_leaves(inner)
