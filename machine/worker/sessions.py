"""Session messages through the worker's pull (SPEC T2, T5, W2, W3).

A ``session_message`` is recorded in the local inbox of its session (``machine.inbox``,
fsynced) before the poller acknowledges it; the terminal wrapper (T3) or the session's
Stop hook (T4) takes it from there at most once. A message delivered again (its ack was
lost) is recognised by its id in any state and not recorded twice (W3). A
``session_interrupt`` is recorded the same way for the wrapper. The inbox is in the hook
state directory (``RUNSTEAD_HOOK_DIR``), which the wrapper and the hooks of this user share.
"""
from __future__ import annotations

import logging

from machine import inbox

log = logging.getLogger("runstead.worker")

KINDS = ("session_message", "session_interrupt")


def record(kind: str, payload: dict, *, state_dir: str | None = None) -> bool:
    """Record a session message or interrupt in the local inbox (W2: before the ack).
    Returns whether it was new."""
    state_dir = state_dir or inbox.hook_state_dir()
    if kind == "session_message":
        new = inbox.record(state_dir, payload)
        what = f"message {payload['seq']} of session {payload['session_id']}"
    else:
        new = inbox.record_interrupt(state_dir, payload["session_id"], payload["interrupt_id"])
        what = f"interrupt {payload['interrupt_id']} of session {payload['session_id']}"
    log.info("%s %s", what, "recorded" if new else "already known: not recorded again (W3)")
    return new
