"""What the parts of one worker process share (SPEC W6, W8, R3).

The poller, the runners (and their runs' renewal threads), the sender and recovery each
get one ``WorkerContext``: the local store, the identity, the clock, a ``connect()``
factory for the service (one ``Service`` per thread), the runs in flight, and the flags
the coordinator (``loop.py``) sets. Nothing here starts a thread (the thread model:
``runner.py``).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

from .client import Connect
from .clock import Clock
from .config import WorkerConfig
from .store import Identity, StateDir, Store

log = logging.getLogger("runstead.worker")


@dataclass
class WorkerContext:
    state: StateDir
    store: Store
    identity: Identity
    config: WorkerConfig
    clock: Clock
    connect: Connect
    boot: str
    server: str = ""
    draining: threading.Event = field(default_factory=threading.Event)  # W6 first signal: no new work
    revoked: threading.Event = field(default_factory=threading.Event)  # R3 401: stop everything
    outbox_wake: threading.Event = field(default_factory=threading.Event)  # the sender has rows to send
    # the coordinator has something to look at: a run or integration ended, a signal, a send
    coordinator_wake: threading.Event = field(default_factory=threading.Event)
    exiting: threading.Event = field(default_factory=threading.Event)  # run() is returning: threads end
    runs: dict = field(default_factory=dict)  # operation id -> run.Run
    integrations: set = field(default_factory=set)  # integration ids in flight (G7), under runs_lock
    runs_lock: threading.Lock = field(default_factory=threading.Lock)
    # Issue 44: leases due together are renewed in one sync (``renewer.LeasePart``); the
    # lock guards each lease's ``renewing`` flag; False once the service has no sync route.
    renew_lock: threading.Lock = field(default_factory=threading.Lock)
    sync_renewals: bool = True

    def enqueue(self, items: list[dict]) -> None:
        """Commit outbox rows (``wire.py`` shapes) and wake the sender."""
        self.store.enqueue(items, self.clock.wall())
        self.outbox_wake.set()

    def wake_sender(self) -> None:
        self.outbox_wake.set()

    def wake(self) -> None:
        """Tell the coordinator something changed (a run ended, a flag was set)."""
        self.coordinator_wake.set()

    def run_for(self, operation_id: str):
        with self.runs_lock:
            return self.runs.get(operation_id)

    def active(self) -> int:
        """Runs and integrations in flight: the worker waits for both before it exits."""
        with self.runs_lock:
            return len(self.runs) + len(self.integrations)

    def stop_all(self, reason: str) -> None:
        """Ask every run in flight to stop its agent with ``stop_reason`` ``reason``."""
        with self.runs_lock:
            runs = list(self.runs.values())
        for run in runs:
            run.request_stop(reason)

    def on_revoked(self) -> None:
        """401 token_revoked (R3, K1): stop agents and the loop, ask to be paired again."""
        with self.runs_lock:
            if self.revoked.is_set():
                return
            self.revoked.set()
        self.draining.set()
        log.error(
            "machine token revoked (401 token_revoked). Pair this worker again: "
            "python manage.py pair_worker --server %s --code CODE --state-dir %s",
            self.server, self.state.path,
        )
        self.stop_all("worker_shutdown")
        self.outbox_wake.set()
        self.wake()
