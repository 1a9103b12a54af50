"""Sending the durable outbox (SPEC R1, R3, R4, M8, W8).

One sender thread delivers the local outbox (receipts, session markers, device sweeps)
with ``machine.outbox.deliver``: in order, each row exactly as committed, so a retry keeps
its ``event_id`` (R1). Receipts at the head of the outbox go together: the head receipt
and the receipts queued right behind it (up to ``SYNC_ITEMS_MAX`` of them and
``SYNC_RECEIPT_BYTES_MAX`` bytes) are one ``POST /api/worker/sync/`` (issue 44: a machine's
traffic scales with machines, not with tasks), each settled by its own answer in it, so
a short task's ``starting``, ``running`` and ``final`` that are all still queued cost one
request. A service without that route (404) gets one receipt per request, as before. Answers (R3): 2xx -> done; 4xx other than 401/429 -> final, never
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
from machine.protocol.shapes import RECEIPTS_PATH, SYNC_ITEMS_MAX, SYNC_PATH, SYNC_RECEIPT_BYTES_MAX

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
        self.batching = True  # False once the service answered that it has no sync route

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

    def _batch(self, row: dict) -> list[dict]:
        """The receipts that go with ``row`` (a receipt at the head): the pending receipt
        rows right behind it, within the sync's bounds (module docstring); [] for none."""
        if not self.batching or row["path"] != RECEIPTS_PATH or len(row["body"]) > SYNC_RECEIPT_BYTES_MAX:
            return []
        size, batch = len(row["body"]), []
        for later in self.ctx.store.outbox.heads(SYNC_ITEMS_MAX)[1:]:
            size += len(later["body"])
            if later["path"] != RECEIPTS_PATH or size > SYNC_RECEIPT_BYTES_MAX:
                break  # order kept: nothing overtakes a row that is not in the batch
            batch.append(later)
        return batch

    def _send_sync(self, service, rows: list[dict]):
        """``rows`` (receipts, oldest first) as one sync. Returns the answer to the head
        row, having settled the rows behind it by their own answers; None when the head
        must go alone: the service has no sync route (then every row does, from now on),
        or refused the sync as a whole."""
        answer = service.send("POST", SYNC_PATH, {"receipts": [json.loads(r["body"]) for r in rows]})
        if answer.kind == "final" and answer.status == 404:
            log.info("the service has no %s: sending receipts one by one", SYNC_PATH)
            self.batching = False
            return None
        if answer.kind == "final":
            # The sync as a whole refused (one malformed receipt in it, 400; too large,
            # 413): the head goes alone, so each receipt gets its own verdict (R3).
            return None
        if answer.kind != "ok":
            return answer  # retried (R4) or revoked, as for the head alone
        items = (answer.body or {}).get("receipts") or []
        outbox = self.ctx.store.outbox
        for later, item in zip(rows[1:], items[1:]):
            text = json.dumps(item.get("answer"), separators=(",", ":"))[:ANSWER_KEEP_CHARS]
            outbox.settle(later["seq"], status="done" if item.get("status") == 200 else "given_up", answer=text)
        head = items[0] if items else {"status": 200, "answer": {}}
        return type(answer)(status=head.get("status", 200), body=head.get("answer"),
                            text=json.dumps(head.get("answer"), separators=(",", ":")))

    def send_one(self, service, row: dict) -> tuple[str, str]:
        """Send one outbox row (with the receipts queued behind it, as one sync); its
        outcome for ``machine.outbox.deliver``."""
        ctx = self.ctx
        if self.stopping():
            return "stop", ""
        self.idle.clear()
        batch = self._batch(row)
        answer = self._send_sync(service, [row, *batch]) if batch else None
        if answer is None:
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
