"""Session messages through the worker's pull (SPEC T2, T5, W2, W3).

A ``session_message`` is recorded in the local inbox of its session (``machine.inbox``,
fsynced) before the poller acknowledges it; the terminal wrapper (T3) or the session's
Stop hook (T4) takes it from there at most once. A message delivered again (its ack was
lost) is recognised by its id in any state and not recorded twice (W3). A
``session_interrupt`` is recorded the same way for the wrapper. The inbox is in the hook
state directory (``RUNSTEAD_HOOK_DIR``), which the wrapper and the hooks of this user share.

Every ``SWEEP_EVERY_S`` the worker sweeps that inbox (``sweep``): a message a dead wrapper
(or Stop hook) took, in a session no live wrapper runs, is marked lost and reported
``undelivered`` through the worker's outbox (``machine.inbox.orphans``), and finished
files older than the record retention are pruned (``machine.inbox.prune``).
"""
from __future__ import annotations

import logging

from machine import inbox

log = logging.getLogger("runstead.worker")

KINDS = ("session_message", "session_interrupt")
SWEEP_EVERY_S = 30.0


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


def sweep(*, now: float, retention_s: float, state_dir: str | None = None) -> list[dict]:
    """The inbox sweep: outbox rows reporting each orphaned message ``undelivered``
    (enqueue them), after pruning finished files older than ``retention_s``."""
    from machine.worker.wire import session_delivery_item

    state_dir = state_dir or inbox.hook_state_dir()
    lost = inbox.orphans(state_dir, now=now)
    pruned = inbox.prune(state_dir, before=now - retention_s)
    for payload in lost:
        log.warning("message %s of session %s was taken by a terminal wrapper or Stop hook that died before "
                    "it finished: reported undelivered", payload["seq"], payload["session_id"])
    if pruned:
        log.info("pruned %d finished session inbox file(s)", pruned)
    return [session_delivery_item(session_id=p["session_id"], seq=p["seq"], message_id=p["message_id"],
                                  state="undelivered") for p in lost]
