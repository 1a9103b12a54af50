"""Keeping a lease (SPEC L3, L5, L10, W8).

One renewer thread per running agent, independent of the long-poll and of the sender
(W8). It renews ``renew_every_s`` after the last grant or renewal was *sent* (L3) and
anchors the new local deadline at this request's send time. A 409 is final for the lease
(L5): the agent is stopped with the J6 stop reason and the renewal is never retried.
Network trouble, 429 and 5xx are retried until the local deadline, which the runner's
watch enforces on its own. Renewals carry the agent's last output lines (L10).
"""
from __future__ import annotations

import logging
import threading

from . import process
from .context import WorkerContext
from .lease import KILL, Deadline, LeaseTerms, SentAt
from .wire import refusal_stop_reason

log = logging.getLogger("runstead.worker")

RENEW_CHECK_S = 0.05  # how often a renewer re-checks whether a renewal is due (wall jumps count)
RENEW_TIMEOUT_MIN_S = 0.5  # a renewal request's HTTP timeout: the time left on the lease,
RENEW_TIMEOUT_MAX_S = 10.0  # ... bounded to this window
RENEW_RETRY_FRACTION = 0.25  # a failed renewal is retried after renew_every_s * this,
RENEW_RETRY_MAX_S = 1.0  # ... at most this
LOG_EVERY_FAILURES = 20  # a long outage logs its first failure, then every 20th


class Renewer:
    """Starts one renewal thread per run (``start(run)``); see the module docstring."""

    def __init__(self, ctx: WorkerContext, *, check_s: float = RENEW_CHECK_S):
        self.ctx = ctx
        self.check_s = check_s

    def start(self, run) -> threading.Thread:
        thread = threading.Thread(target=self.loop, args=(run,), name=f"renew-{run.operation_id[:8]}", daemon=True)
        thread.start()
        return thread

    def loop(self, run) -> None:
        """Renew until the agent ends, the lease is refused, or the token is revoked."""
        ctx, clock = self.ctx, self.ctx.clock
        service = ctx.connect()
        failures = 0
        try:
            while not run.finished.is_set() and run.proc.poll() is None:
                if run.stop_reason == "worker_shutdown" or run.deadline.phase(clock) == KILL:
                    # Being stopped, or the local deadline passed (L3: a sleep never extends
                    # it; the watch kills the agent): nothing to renew.
                    clock.wait(run.finished, self.check_s)
                    continue
                due_in = run.deadline.terms.renew_every_s - run.deadline.sent.elapsed(clock)
                if due_in > 0:
                    clock.wait(run.finished, min(due_in, self.check_s))
                    continue
                sent = SentAt.now(clock)
                timeout = max(RENEW_TIMEOUT_MIN_S, min(RENEW_TIMEOUT_MAX_S, run.deadline.remaining(clock)))
                answer = service.lease_renew(run.deadline.terms.lease_id, output_tail=process.output_tail(run.op_dir),
                                             timeout_s=timeout)
                if run.proc.poll() is not None:
                    return
                if answer.kind == "ok":
                    terms = LeaseTerms.from_reply(answer.body)
                    run.deadline = Deadline(terms, sent)
                    ctx.store.save_lease(run.operation_id, terms=answer.body, sent_mono=sent.monotonic,
                                         sent_wall=sent.wall, boot=ctx.boot, granted=False)
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
                                                  run.deadline.terms.renew_every_s * RENEW_RETRY_FRACTION)
                    while clock.monotonic() < end and not run.finished.is_set():
                        clock.wait(run.finished, end - clock.monotonic())
        finally:
            service.close()
