"""Sending the durable outbox (SPEC R1, R3, R4, M8, W8).

One sender thread delivers the local outbox (receipts, session markers, device sweeps)
in order, each row exactly as committed, so a retry keeps its ``event_id`` (R1). Answers
(R3): 2xx -> done; 4xx other than 401/429 -> final, never resent (``given_up``); 401 ->
the token is revoked (the worker stops); 429, 5xx and network errors -> retried after
``machine.protocol.Backoff`` (equal jitter, capped at 60 s, R4). It runs apart from the long-poll and
the renewals (W8).
"""
from __future__ import annotations

import json
import logging
import threading

from machine.protocol import Backoff

from .context import WorkerContext

log = logging.getLogger("runstead.worker")

OUTBOX_IDLE_S = 0.5  # with nothing to send, the sender re-checks the outbox this often
ANSWER_KEEP_CHARS = 2000  # of an answer kept in the outbox row


class Sender:
    def __init__(self, ctx: WorkerContext, *, backoff: Backoff, idle_s: float = OUTBOX_IDLE_S):
        self.ctx = ctx
        self.backoff = backoff
        self.idle_s = idle_s
        self.failing = threading.Event()  # the last send needs a retry (service away)
        self.idle = threading.Event()  # nothing pending (set by the sender thread)

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.loop, name="sender", daemon=True)
        thread.start()
        return thread

    def loop(self) -> None:
        """Send until the token is revoked (the process exits around it otherwise)."""
        ctx, clock = self.ctx, self.ctx.clock
        service = ctx.connect()
        try:
            while not ctx.revoked.is_set() and not ctx.exiting.is_set():
                row = ctx.store.next_outbox()
                if row is None:
                    self.idle.set()
                    ctx.wake()
                    clock.wait(ctx.outbox_wake, self.idle_s)
                    ctx.outbox_wake.clear()
                    continue
                self.idle.clear()
                if not self.send_one(service, row):
                    break
        finally:
            service.close()

    def send_one(self, service, row: dict) -> bool:
        """Send one outbox row; False when the loop must end (token revoked)."""
        ctx, clock = self.ctx, self.ctx.clock
        body = json.loads(row["body"])
        ctx.store.outbox_attempt(row["seq"])
        answer = service.send(row["method"], row["path"], body)
        if answer.kind == "retry":
            self.failing.set()
            ctx.wake()
        else:
            self.failing.clear()
        if answer.kind == "ok":
            outcome = (answer.body or {}).get("outcome")
            if outcome == "not_applied":
                log.info("%s %s not applied: %s", row["kind"], row["event_id"], (answer.body or {}).get("reason"))
            ctx.store.outbox_done(row["seq"], status="done", answer=answer.text[:ANSWER_KEEP_CHARS])
        elif answer.kind == "final":
            level = logging.INFO if row["kind"] in ("marker", "sweep") and answer.status == 404 else logging.WARNING
            log.log(level, "%s %s answered %s (final, not resent): %s", row["kind"], row["event_id"],
                    answer.status, answer.text[:300])
            ctx.store.outbox_done(row["seq"], status="given_up",
                                  answer=f"{answer.status} {answer.text[:ANSWER_KEEP_CHARS]}")
        elif answer.kind == "revoked":
            ctx.on_revoked()
            return False
        else:
            delay = self.backoff.delay(row["attempts"])
            log.warning("%s %s: %s; retrying in %.1f s", row["kind"], row["event_id"],
                        answer.status or answer.text[:120], delay)
            ctx.outbox_wake.clear()
            end = clock.monotonic() + delay
            while clock.monotonic() < end and not ctx.revoked.is_set():
                clock.wait(ctx.revoked, end - clock.monotonic())
        return True
