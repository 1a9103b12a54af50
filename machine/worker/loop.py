"""The worker: the coordinator of its parts (SPEC W, X, R4, L, U1, M5, M8). Standard
library + httpx + psutil only; no Django ORM anywhere in ``machine.worker``.

Module map (each part gets one ``WorkerContext``, ``context.py``):

- ``poller.py``   long-poll, local commit then ack (W2), duplicates (W3), cancel, query (U1);
- ``runner.py``   one operation: local checks (W4), lease (L1), spawn (X1, X2), the run
  loop (L4, L8), final facts (J1); its docstring has the thread model;
- ``run.py``      a run's parts, each a step: process (L8, G2), progress (G4); the lease
  part in ``renewer.py`` (its renewal thread: L3, L5, L10), the conversation part in
  ``conversation.py`` (C1-C6);
- ``sender.py``   the durable outbox, backoff capped at 60 s, same event id (R3, R4);
- ``progress.py`` live progress, at most once a second, on its own thread (G4, W8);
- ``observe.py``  the agent's stream parsed (G2) and git evidence (G5);
- ``recovery.py`` what a previous worker left (X3, X4);
- ``integrate.py`` merge or discard of a worktree task's branch, once (G7; git in ``worktrees.py``);
- ``wire.py``     the shapes of receipts, markers, sweeps and final facts;
- ``client.py``   the ``Service`` the parts talk to (HTTP; ``testing.py`` has one in memory).

This module holds the lifecycle: the device sweep (M5), recovery before pulling, pruning
old records at start and daily (W1's bound, ``Store.prune``), the
threads (each independent of the others, W8), signals (W6: first one drains, second
stops agents with ``worker_shutdown``), ``--once`` (pull once, run what came, report,
exit) and the exit code. Every wait goes through the ``Clock``.
"""
from __future__ import annotations

import json
import logging
import signal
from dataclasses import dataclass

from machine.protocol import BACKOFF_CAP_S, PULL_IDLE_TIMEOUT_S, Backoff

from .client import BACKOFF_BASE_S, Connect, http_connect
from .clock import SYSTEM_CLOCK, Clock, boot_id
from .config import WorkerConfig
from .context import WorkerContext
from . import sessions
from .integrate import Integrator
from .poller import POLL_WAIT_S, Poller
from .progress import ProgressSender
from .recovery import recover
from .runner import Runner
from .sender import Sender
from .store import RECORD_RETENTION_S, Identity, StateDir, Store
from .wire import profiles_item, sweep_item

log = logging.getLogger("runstead.worker")

MAIN_TICK_S = 0.1  # the coordinator re-checks its flags at least this often
DRAIN_FLUSH_S = 5.0  # after the last agent: how long queued reports may still take to send
ONCE_FLUSH_S = 30.0  # the same for ``--once``
FLUSH_CHECK_S = 0.05
PRUNE_EVERY_S = 86400.0  # W1: old records pruned at start and then daily
EXIT_OK = 0
EXIT_REVOKED = 3


@dataclass
class WorkerOptions:
    """Command-line level options. Seconds."""

    server: str
    poll_wait_s: float = POLL_WAIT_S
    pull_idle_s: float = PULL_IDLE_TIMEOUT_S
    once: bool = False
    backoff_base_s: float = BACKOFF_BASE_S
    backoff_cap_s: float = BACKOFF_CAP_S
    main_tick_s: float = MAIN_TICK_S
    drain_flush_s: float = DRAIN_FLUSH_S
    once_flush_s: float = ONCE_FLUSH_S
    record_retention_s: float = RECORD_RETENTION_S
    prune_every_s: float = PRUNE_EVERY_S


class Worker:
    """The worker. ``run()`` returns the process exit code (0, or 3 when the token was
    revoked). ``connect`` makes a ``Service`` per thread (default: HTTP to
    ``options.server``); ``clock``, ``backoff`` and ``hooks_for`` are for tests and
    extensions."""

    def __init__(self, *, state: StateDir, store: Store, identity: Identity, config: WorkerConfig,
                 options: WorkerOptions, clock: Clock = SYSTEM_CLOCK, idle_guard=None, connect: Connect | None = None,
                 backoff: Backoff | None = None, hooks_for=None):
        self.options = options
        self.clock = clock
        self.ctx = WorkerContext(
            state=state, store=store, identity=identity, config=config, clock=clock,
            connect=connect or http_connect(options.server, identity.token, options.pull_idle_s), boot=boot_id(), server=options.server,
        )
        self.backoff = backoff or Backoff(options.backoff_base_s, options.backoff_cap_s)
        self.progress = ProgressSender(self._post_progress)
        self._progress_service = None
        self.runner = Runner(self.ctx, backoff=self.backoff, idle_guard=idle_guard,
                             hooks_for=hooks_for, progress=self.progress)
        self.sender = Sender(self.ctx, backoff=self.backoff)
        self.integrator = Integrator(self.ctx)
        self.poller = Poller(self.ctx, start_run=self.runner.start, backoff=self.backoff,
                             wait_s=options.poll_wait_s, start_integration=self.integrator.start)
        self.no_pull = False  # --once: the one pull is done
        self.signals = 0
        self.next_prune = None  # monotonic; None: at start
        self.next_session_sweep = None  # monotonic; None: at start

    def _post_progress(self, body: dict) -> bool:
        """G4, on the progress thread only: its own service connection, so a slow or
        failing progress call holds up nothing else (W8). Best effort, never retried.
        True when the service applied it."""
        if self._progress_service is None:
            self._progress_service = self.ctx.connect()
        answer = self._progress_service.progress(body)
        if answer.kind == "revoked":
            self.ctx.on_revoked()
        return answer.kind == "ok" and isinstance(answer.body, dict) and answer.body.get("outcome") == "applied"

    def recover(self) -> None:
        """X3, X4: settle what a previous worker left (``recovery.recover``); a live
        conversation still running is adopted (C3, ``Runner.adopt``)."""
        recover(self.ctx, adopt=self.runner.adopt)

    def prune_if_due(self) -> None:
        """W1's bound: at start and every ``prune_every_s``, prune the records of final,
        acknowledged operations untouched for ``record_retention_s`` (``Store.prune``)
        and their ``ops/`` files. A failure is logged; the next day tries again."""
        ctx, options = self.ctx, self.options
        now = self.clock.monotonic()
        if self.next_prune is not None and now < self.next_prune:
            return
        self.next_prune = now + options.prune_every_s
        try:
            pruned = ctx.store.prune(before_wall=self.clock.wall() - options.record_retention_s)
            for operation_id in pruned:
                ctx.state.remove_op_dir(operation_id)
        except Exception:  # noqa: BLE001 - pruning must never stop the worker
            log.exception("pruning old records failed")
            return
        if pruned:
            log.info("pruned the records of %d operation(s) final for over %.0f s", len(pruned),
                     options.record_retention_s)

    def sweep_sessions_if_due(self) -> None:
        """T2: every ``sessions.SWEEP_EVERY_S``, messages dead wrappers took reported
        ``undelivered``, old inbox files pruned (``sessions.sweep``)."""
        now = self.clock.monotonic()
        if self.next_session_sweep is not None and now < self.next_session_sweep:
            return
        self.next_session_sweep = now + sessions.SWEEP_EVERY_S
        try:
            items = sessions.sweep(now=self.clock.wall(), retention_s=self.options.record_retention_s)
        except Exception:  # noqa: BLE001 - the sweep must never stop the worker
            log.exception("sweeping the session inbox failed")
            return
        if items:
            self.ctx.enqueue(items)

    # --- signals (W6) ----------------------------------------------------------------------

    def on_signal(self) -> None:
        """What SIGTERM/SIGINT do: the first drains, the second stops agents. Only sets
        flags, so it is safe in a signal handler (which may interrupt a lock holder)."""
        self.signals += 1
        self.ctx.draining.set()
        self.ctx.coordinator_wake.set()

    def install_signal_handlers(self) -> None:
        signal.signal(signal.SIGTERM, lambda signum, frame: self.on_signal())
        signal.signal(signal.SIGINT, lambda signum, frame: self.on_signal())

    # --- main --------------------------------------------------------------------------------

    def run(self) -> int:
        ctx, options = self.ctx, self.options
        log.info("worker %s (%s, generation %s) on %s, state %s", ctx.identity.machine_id, ctx.identity.name,
                 ctx.identity.generation, options.server, ctx.state.path)
        ctx.enqueue([sweep_item(ctx.identity)])  # M5: close markers a previous run left running
        ctx.enqueue([profiles_item(ctx.config)])  # B10: the board's task form offers these profiles
        self.sender.start()
        self.progress.start()
        self.recover()
        self.prune_if_due()
        self.sweep_sessions_if_due()
        for record in ctx.store.in_states("received"):
            self.runner.start(record["operation_id"], json.loads(record["payload"]))
        self.integrator.resume()  # G7: merges and discards a previous worker left unfinished
        if options.once:
            service = ctx.connect()
            try:
                self.poller.poll_once(service)
            finally:
                service.close()
            self.no_pull = True
        else:
            self.poller.start()
        self.wait_for_work_to_end()
        try:
            return self.flush_and_exit()
        finally:
            ctx.exiting.set()  # the sender stops (in-process tests run several workers in turn)
            ctx.outbox_wake.set()
            self.progress.stop()

    def wait_for_work_to_end(self) -> None:
        ctx, clock = self.ctx, self.clock
        announced_drain = announced_stop = False
        while True:
            if ctx.draining.is_set() and not announced_drain and not ctx.revoked.is_set():
                announced_drain = True
                log.info("draining: no new work; running agents finish and report (a second signal stops them)")
            if self.signals > 1 and not announced_stop:
                announced_stop = True
                log.info("second signal: stopping agents (worker_shutdown)")
                ctx.stop_all("worker_shutdown")
            if (self.no_pull or ctx.draining.is_set()) and ctx.active() == 0:
                return
            self.prune_if_due()
            self.sweep_sessions_if_due()
            self.runner.look()
            clock.wait(ctx.coordinator_wake, self.options.main_tick_s)
            ctx.coordinator_wake.clear()

    def flush_and_exit(self) -> int:
        """Give queued reports a bounded time to go out while the service answers."""
        ctx, clock = self.ctx, self.clock
        flush = self.options.once_flush_s if self.options.once else self.options.drain_flush_s
        end = clock.monotonic() + flush
        while (ctx.store.outbox.pending() and clock.monotonic() < end and not ctx.revoked.is_set()
               and not self.sender.failing.is_set()):
            ctx.wake_sender()
            clock.wait(ctx.coordinator_wake, FLUSH_CHECK_S)
            ctx.coordinator_wake.clear()
        if ctx.revoked.is_set():
            return EXIT_REVOKED
        left = ctx.store.outbox.pending()
        if left:
            log.warning("exiting with %d report(s) still queued; the next start sends them", left)
        return EXIT_OK


def open_worker(*, state_dir: str, config: WorkerConfig, options: WorkerOptions, clock: Clock = SYSTEM_CLOCK) -> Worker:
    """State dir (0700) + lock (W5) + database (W1) + identity; raises on any problem."""
    state = StateDir(state_dir)
    state.ensure()
    state.lock()
    identity = state.read_identity()
    if identity is None:
        raise RuntimeError(
            f"no machine token in {state.path}: pair first with "
            f"python manage.py pair_worker --server URL --code CODE --state-dir {state.path}"
        )
    store = Store(state.db_path)
    options.server = options.server or identity.server
    return Worker(state=state, store=store, identity=identity, config=config, options=options, clock=clock)
