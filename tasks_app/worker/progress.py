"""Live progress (SPEC G4, W8): ``POST /api/worker/progress/`` from its own thread.

Runners ``offer`` the latest progress of an operation whenever it changed; the sender
keeps only the newest offer per operation (a slot, not a queue: nothing piles up behind
a slow service) and posts each operation at most once per ``interval_s``. Posting runs on
this thread alone, so a slow, failing or hanging progress call never delays a renewal, a
deadline check or a receipt (those have their own threads). Progress is not durable: a
lost post is replaced by the next; nothing is retried.

Body: ``{"operation_id", "seq", "output_tail", "last_message", "usage"}``; ``seq`` rises
with every offer of an operation (the service ignores a seq not above the last).
"""
from __future__ import annotations

import logging
import threading
import time

log = logging.getLogger("runstead.worker")

PROGRESS_INTERVAL_S = 1.0


class ProgressSender:
    """``post(body) -> None`` does the HTTP call (any exception is logged and dropped)."""

    def __init__(self, post, *, interval_s: float = PROGRESS_INTERVAL_S, monotonic=time.monotonic):
        self.post = post
        self.interval_s = interval_s
        self.monotonic = monotonic
        self.lock = threading.Lock()
        self.pending: dict[str, dict] = {}
        self.seq: dict[str, int] = {}
        self.last_sent: dict[str, float] = {}
        self.wake = threading.Event()
        self.stopped = threading.Event()
        self.thread: threading.Thread | None = None
        self.sent = 0

    def start(self) -> ProgressSender:
        self.thread = threading.Thread(target=self.loop, name="progress", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()

    def offer(self, operation_id: str, payload: dict) -> None:
        """The newest progress of ``operation_id`` (``output_tail``, ``last_message``,
        ``usage``); replaces an unsent older one. Never blocks on the network."""
        with self.lock:
            seq = self.seq.get(operation_id, 0) + 1
            self.seq[operation_id] = seq
            self.pending[operation_id] = {"operation_id": operation_id, "seq": seq, **payload}
        self.wake.set()

    def forget(self, operation_id: str) -> None:
        """The operation ended: drop an unsent offer (the final receipt says it all)."""
        with self.lock:
            self.pending.pop(operation_id, None)
            self.last_sent.pop(operation_id, None)

    def _due(self) -> tuple[dict | None, float]:
        now = self.monotonic()
        wait = self.interval_s
        with self.lock:
            for operation_id, body in list(self.pending.items()):
                left = self.last_sent.get(operation_id, -1e18) + self.interval_s - now
                if left <= 0:
                    del self.pending[operation_id]
                    self.last_sent[operation_id] = now
                    return body, 0.0
                wait = min(wait, left)
        return None, wait if self.pending else self.interval_s

    def loop(self) -> None:
        while not self.stopped.is_set():
            body, wait = self._due()
            if body is None:
                self.wake.wait(wait)
                self.wake.clear()
                continue
            try:
                self.post(body)
                self.sent += 1
            except Exception as exc:  # progress is best effort; the next one replaces it
                log.debug("progress for %s not sent: %s", body["operation_id"], exc)
