"""Sending the durable outbox (SPEC R1, R3, R4, M8, W8).

One sender thread delivers the local outbox (receipts, session markers, device sweeps)
with ``machine.outbox.deliver``: in order, each row exactly as committed, so a retry keeps
its ``event_id`` (R1). Answers (R3): 2xx -> done; 4xx other than 401/429 -> final, never
resent (``given_up``); 401 -> the token is revoked (the worker stops); 429, 5xx and
network errors -> retried after ``machine.protocol.Backoff`` (equal jitter, capped at
60 s, R4). It runs apart from the long-poll and the renewals (W8).
"""
from __future__ import annotations

import json
import logging
import threading

from machine.outbox import deliver
from machine.protocol import Backoff

from .context import WorkerContext

log = logging.getLogger("runstead.worker")

OUTBOX_IDLE_S = 0.5  # with nothing to send, the sender re-checks the outbox this often
ANSWER_KEEP_CHARS = 2000  # of an answer kept in the outbox row


class Sender:
    """The worker's sender thread over ``ctx.store.outbox``. ``failing``: set while the
    last send needs a retry (the service is away); ``idle``: set while nothing is pending."""

    def __init__(self, ctx: WorkerContext, *, backoff: Backoff, idle_s: float = OUTBOX_IDLE_S):
        self.ctx = ctx
        self.backoff = backoff
        self.idle_s = idle_s
        self.failing = threading.Event()
        self.idle = threading.Event()
        self.problem = ""  # what the last retried send got

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.loop, name="sender", daemon=True)
        thread.start()
        return thread

    def loop(self) -> None:
        """Send until the token is revoked or the worker exits."""
        service = self.ctx.connect()
        try:
            deliver(self.ctx.store.outbox, lambda row: self.send_one(service, row), backoff=self.backoff,
                    pause=self.pause, idle=self.wait_for_rows)
        finally:
            service.close()

    def stopping(self) -> bool:
        return self.ctx.revoked.is_set() or self.ctx.exiting.is_set()

    def wait_for_rows(self) -> bool:
        """Nothing pending: say so, wait ``idle_s`` or until woken; False once stopping."""
        if self.stopping():
            return False
        self.idle.set()
        self.ctx.wake()
        self.ctx.clock.wait(self.ctx.outbox_wake, self.idle_s)
        self.ctx.outbox_wake.clear()
        return not self.stopping()

    def send_one(self, service, row: dict) -> tuple[str, str]:
        """Send one outbox row; its outcome for ``machine.outbox.deliver``."""
        ctx = self.ctx
        if self.stopping():
            return "stop", ""
        self.idle.clear()
        answer = service.send(row["method"], row["path"], json.loads(row["body"]))
        if answer.kind == "retry":
            self.failing.set()
            ctx.wake()
        else:
            self.failing.clear()
        if answer.kind == "ok":
            outcome = (answer.body or {}).get("outcome")
            if outcome == "not_applied":
                log.info("%s %s not applied: %s", row["kind"], row["event_id"], (answer.body or {}).get("reason"))
            return "done", answer.text[:ANSWER_KEEP_CHARS]
        if answer.kind == "final":
            level = logging.INFO if row["kind"] in ("marker", "sweep") and answer.status == 404 else logging.WARNING
            log.log(level, "%s %s answered %s (final, not resent): %s", row["kind"], row["event_id"],
                    answer.status, answer.text[:300])
            return "final", f"{answer.status} {answer.text[:ANSWER_KEEP_CHARS]}"
        if answer.kind == "revoked":
            ctx.on_revoked()
            return "stop", ""
        self.problem = answer.status or answer.text[:120]
        return "retry", ""

    def pause(self, delay: float, row: dict) -> bool:
        """R4: wait ``delay`` seconds before the same row again (ended early by a revocation)."""
        ctx, clock = self.ctx, self.ctx.clock
        log.warning("%s %s: %s; retrying in %.1f s", row["kind"], row["event_id"], self.problem, delay)
        ctx.outbox_wake.clear()
        end = clock.monotonic() + delay
        while clock.monotonic() < end and not ctx.revoked.is_set():
            clock.wait(ctx.revoked, end - clock.monotonic())
        return True
