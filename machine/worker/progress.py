"""Live progress (SPEC G4, W8): ``POST /api/worker/progress/`` from its own thread.

Runners ``offer`` the latest progress of an operation whenever it changed, with the
transcript entries parsed since their last offer; the sender keeps only the newest
progress per operation (a slot, not a queue: nothing piles up behind a slow service) and
posts each operation at most once per ``interval_s``. Posting runs on this thread alone,
so a slow, failing or hanging progress call never delays a renewal, a deadline check or a
receipt (those have their own threads). Progress is not durable: a lost post is replaced
by the next; nothing is retried on its own.

Entries are the one part that accumulates: those not yet confirmed (a post answered
``applied``) ride along with the next post, oldest first, at most ``ENTRIES_PER_POST`` a
post and ``ENTRIES_KEPT`` waiting (the oldest go first past that); what remains after a
confirmed post goes one interval later. ``forget`` tells the highest entry number the
service confirmed, so the final receipt carries the rest (observe.py). The service keeps
each number once, so an entry sent twice (a post that timed out but was applied) is
harmless.

Body: ``{"operation_id", "seq", "output_tail", "last_message", "usage", "entries"}``;
``seq`` rises with every post of an operation (the service ignores a seq not above the
last).
"""
from __future__ import annotations

import logging
import threading
import time

from machine.protocol import ENTRIES_KEPT, ENTRIES_PER_POST

log = logging.getLogger("runstead.worker")

PROGRESS_INTERVAL_S = 1.0


class ProgressSender:
    """``post(body) -> bool`` does the HTTP call: True when the service applied the
    progress (its entries are then confirmed); any exception is logged and counts as
    not applied."""

    def __init__(self, post, *, interval_s: float = PROGRESS_INTERVAL_S, monotonic=time.monotonic):
        self.post = post
        self.interval_s = interval_s
        self.monotonic = monotonic
        self.lock = threading.Lock()
        self.latest: dict[str, dict] = {}  # operation -> newest progress (without entries)
        self.unsent: dict[str, list[dict]] = {}  # operation -> entries not yet confirmed, in order
        self.dirty: set[str] = set()  # operations with something new to post
        self.confirmed: dict[str, int] = {}  # operation -> highest entry number applied
        self.seq: dict[str, int] = {}
        self.last_sent: dict[str, float] = {}
        self.offered = threading.Event()  # an offer came (or ``stop``): the thread looks again
        self.stopped = False
        self.thread: threading.Thread | None = None
        self.sent = 0

    def start(self) -> ProgressSender:
        self.thread = threading.Thread(target=self.loop, name="progress", daemon=True)
        self.thread.start()
        return self

    def stop(self) -> None:
        self.stopped = True
        self.offered.set()

    def offer(self, operation_id: str, payload: dict, entries: list[dict] = ()) -> None:
        """The newest progress of ``operation_id`` (``output_tail``, ``last_message``,
        ``usage``), replacing an unsent older one, and the ``entries`` parsed since the
        last offer (kept until confirmed). Never blocks on the network."""
        with self.lock:
            self.latest[operation_id] = dict(payload)
            waiting = self.unsent.setdefault(operation_id, [])
            waiting.extend(entries)
            if len(waiting) > ENTRIES_KEPT:
                del waiting[:len(waiting) - ENTRIES_KEPT]
            self.dirty.add(operation_id)
        self.offered.set()

    def forget(self, operation_id: str) -> int:
        """The operation ended: drop what is unsent (the final receipt says it all) and
        return the highest entry number the service confirmed (0: none)."""
        with self.lock:
            self.latest.pop(operation_id, None)
            self.unsent.pop(operation_id, None)
            self.dirty.discard(operation_id)
            self.last_sent.pop(operation_id, None)
            return self.confirmed.pop(operation_id, 0)

    def _due(self) -> tuple[dict | None, float]:
        now = self.monotonic()
        wait = self.interval_s
        with self.lock:
            for operation_id in list(self.dirty):
                left = self.last_sent.get(operation_id, -1e18) + self.interval_s - now
                if left <= 0:
                    self.dirty.discard(operation_id)
                    self.last_sent[operation_id] = now
                    seq = self.seq[operation_id] = self.seq.get(operation_id, 0) + 1
                    entries = [dict(e) for e in self.unsent.get(operation_id, [])[:ENTRIES_PER_POST]]
                    return {"operation_id": operation_id, "seq": seq, **self.latest[operation_id],
                            "entries": entries}, 0.0
                wait = min(wait, left)
        return None, wait if self.dirty else self.interval_s

    def _settle(self, body: dict, applied: bool) -> None:
        operation_id = body["operation_id"]
        with self.lock:
            if operation_id not in self.latest or not applied or not body["entries"]:
                return  # forgotten meanwhile, or not applied: the entries wait for the next offer
            top = body["entries"][-1]["n"]
            self.confirmed[operation_id] = max(self.confirmed.get(operation_id, 0), top)
            rest = [e for e in self.unsent.get(operation_id, []) if e["n"] > top]
            self.unsent[operation_id] = rest
            if rest:
                self.dirty.add(operation_id)

    def loop(self) -> None:
        while not self.stopped:
            body, wait = self._due()
            if body is None:
                self.offered.wait(wait)
                self.offered.clear()
                continue
            applied = False
            try:
                applied = bool(self.post(body))
                self.sent += 1
            except Exception as exc:  # progress is best effort; the next one replaces it
                log.debug("progress for %s not sent: %s", body["operation_id"], exc)
            self._settle(body, applied)
