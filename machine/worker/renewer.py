"""A run's lease: its deadline, its renewal (SPEC L1, L3, L4, L5, L9, L10, W8).

``LeasePart`` holds what the grant (L1, ``Runner.acquire_lease``) and each renewal
answered: the local ``deadline``, anchored at the request's *send* time (L3), and when
the grant was sent (``granted``, for L9's ``slept_s``). Its ``step`` is the run loop's
deadline check (L4): at ``deadline - kill_grace_s`` the agent's group gets SIGTERM, at the
deadline the run loop kills it.

The renewal runs on its own thread (``renew-<operation>``), independent of the run loop,
the long-poll and the sender (W8): it renews ``renew_every_s`` after the last grant or
renewal was sent (L3) and anchors the new deadline at this request's send time. A 409 is
final for the lease (L5): the agent is stopped with the J6 stop reason and the renewal is
never retried. Network trouble, 429 and 5xx are retried until the local deadline, which
the run loop enforces on its own. Renewals carry the agent's last output lines (L10).
The thread looks every ``check_s`` (a wall-clock jump counts, L3), so it needs no event:
it ends at its next look once the agent ended or the run let its lease go (``release``).

Each grant and renewal is also written where the launcher reads it (``record_deadline``:
``op_dir/lease.json``, atomic): the launcher ends the agent itself once that deadline has
passed, so an agent whose worker died and did not come back in time never outlives its
lease (``machine/launcher.py``).
"""
from __future__ import annotations

import json
import logging
import os
import threading

from machine.files import write_atomic

from . import process
from .lease import KILL, OK, TERM, Deadline, LeaseTerms, SentAt
from .wire import refusal_stop_reason

log = logging.getLogger("runstead.worker")

LEASE_FILE = "lease.json"  # the last deadline, for the launcher (module docstring)
RENEW_CHECK_S = 0.05  # how often the renewal thread re-checks whether a renewal is due (wall jumps count)
RENEW_TIMEOUT_MIN_S = 0.5  # a renewal request's HTTP timeout: the time left on the lease,
RENEW_TIMEOUT_MAX_S = 10.0  # ... bounded to this window
RENEW_RETRY_FRACTION = 0.25  # a failed renewal is retried after renew_every_s * this,
RENEW_RETRY_MAX_S = 1.0  # ... at most this
LOG_EVERY_FAILURES = 20  # a long outage logs its first failure, then every 20th


class LeasePart:
    """One run's lease (module docstring). ``deadline``: ``lease.Deadline`` (None before
    the grant); ``granted``: ``SentAt`` of the grant request; ``refused_at``: when the
    refused renewal that took the lease was sent (``ended_within_lease``, J1);
    ``approval``: the grant's ``{credential, wait_s}`` (Q5, in memory only); ``seen``: the
    phase (``OK``, ``TERM``, ``KILL``) the last step saw."""

    def __init__(self, run, *, check_s: float = RENEW_CHECK_S):
        self.run = run
        self.check_s = check_s
        self.deadline: Deadline | None = None
        self.granted: SentAt | None = None
        self.refused_at: SentAt | None = None
        self.approval: dict | None = None
        self.seen = OK
        self.term_sent = False
        self.released = False

    # --- the run loop's check (L4) ----------------------------------------------------------------

    def step(self, now: float) -> bool:
        """L4: at ``deadline - kill_grace_s`` ask the run to stop (``deadline``) and SIGTERM
        its group, once; at the deadline ask it to stop (the run loop kills at once).
        True when it did either."""
        run = self.run
        self.seen = self.deadline.phase(run.ctx.clock)
        if self.seen == KILL:
            run.request_stop("deadline")
            log.warning("operation %s: lease deadline reached, killing", run.operation_id)
            return True
        if self.seen == TERM and not self.term_sent:
            run.request_stop("deadline")
            log.warning("operation %s: lease deadline - kill grace: SIGTERM to the group", run.operation_id)
            run.process.signal_term()
            self.term_sent = True
            return True
        return False

    def next_due(self, now: float) -> float:
        """The instant (monotonic) of the next phase: SIGTERM, then the deadline."""
        left = self.deadline.remaining(self.run.ctx.clock)
        return now + (left if self.term_sent else left - self.deadline.terms.kill_grace_s)

    def record_deadline(self) -> None:
        """The deadline of the last grant or renewal as ``op_dir/lease.json`` ``{sent_mono,
        sent_wall, duration_s, margin_s, kill_grace_s}`` (L3's terms and send times), for the
        launcher, which computes the same ``Deadline.remaining`` with the system's clocks.
        Only when the worker's clock is the system's (a test's fake clock writes nothing,
        and the launcher then enforces nothing)."""
        run, deadline = self.run, self.deadline
        if deadline is None or not run.ctx.clock.shares_system_time:
            return
        terms = deadline.terms
        write_atomic(os.path.join(run.op_dir, LEASE_FILE), json.dumps({
            "sent_mono": deadline.sent.monotonic, "sent_wall": deadline.sent.wall, "duration_s": terms.duration_s,
            "margin_s": terms.margin_s, "kill_grace_s": terms.kill_grace_s}))

    # --- renewal (L3, L5, L10) ----------------------------------------------------------------------

    def start_renewal(self) -> threading.Thread:
        thread = threading.Thread(target=self.renew, name=f"renew-{self.run.operation_id[:8]}", daemon=True)
        thread.start()
        return thread

    def release(self) -> None:
        """The run is over (its final receipt is queued, or it crashed): the renewal
        thread ends at its next look."""
        self.released = True

    def _running(self) -> bool:
        return not self.released and self.run.process.proc.poll() is None

    def renew(self) -> None:
        """Renew until the agent ends, the lease is refused, or the token is revoked."""
        run = self.run
        ctx, clock = run.ctx, run.ctx.clock
        service = ctx.connect()
        failures = 0
        try:
            while self._running():
                if run.stop_reason == "worker_shutdown" or self.deadline.phase(clock) == KILL:
                    # Being stopped, or the local deadline passed (L3: a sleep never extends
                    # it; the run loop kills the agent): nothing to renew.
                    clock.wait(None, self.check_s)
                    continue
                due_in = self.deadline.terms.renew_every_s - self.deadline.sent.elapsed(clock)
                if due_in > 0:
                    clock.wait(None, min(due_in, self.check_s))
                    continue
                sent = SentAt.now(clock)
                timeout = max(RENEW_TIMEOUT_MIN_S, min(RENEW_TIMEOUT_MAX_S, self.deadline.remaining(clock)))
                answer = service.lease_renew(self.deadline.terms.lease_id, output_tail=process.output_tail(run.op_dir),
                                             timeout_s=timeout)
                if run.process.proc.poll() is not None:
                    return
                if answer.kind == "ok":
                    self.deadline = Deadline(LeaseTerms.from_reply(answer.body), sent)
                    ctx.store.save_lease(run.operation_id, terms=answer.body, sent_mono=sent.monotonic,
                                         sent_wall=sent.wall, boot=ctx.boot, granted=False)
                    self.record_deadline()
                    failures = 0
                elif answer.kind == "final":
                    reason = answer.error
                    log.warning("operation %s: renewal refused (%s): stopping", run.operation_id, reason)
                    # A refusal takes the lease (L5), but ``max_runtime`` only ends the task's
                    # time: the agent stopped inside its lease is J6 row 8 (``failed``).
                    run.request_stop(refusal_stop_reason(reason), at=None if reason == "max_runtime" else sent)
                    return
                elif answer.kind == "revoked":
                    ctx.on_revoked()
                    return
                else:
                    failures += 1
                    if failures == 1 or failures % LOG_EVERY_FAILURES == 0:
                        log.warning("operation %s: renewal failed (%s), retrying until the deadline (%d tries)",
                                    run.operation_id, answer.status or answer.text[:120], failures)
                    end = clock.monotonic() + min(RENEW_RETRY_MAX_S,
                                                  self.deadline.terms.renew_every_s * RENEW_RETRY_FRACTION)
                    while clock.monotonic() < end and not self.released:
                        clock.wait(None, min(self.check_s, end - clock.monotonic()))
        finally:
            service.close()
