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
The thread sleeps until a renewal is due (``wake``): the coordinator's once-a-second look
(``Run.look``) wakes it when a wall-clock jump or a sleep made one due early (L3), and
``release`` when the run let its lease go; it ends once the agent ended or the lease was
let go.

A machine's leases are renewed together (issue 44: its traffic scales with machines, not
with tasks): the renewal that falls due takes along every other lease of the worker due
within half a renewal interval (``COMPANION_FRACTION``), as one ``POST /api/worker/sync/``
anchored at that request's send time (L3: renewing early never extends a deadline past
its terms), and hands each lease its own answer; once renewed together, leases stay in
step. A lease being renewed is not taken along twice (``renewing``, under
``ctx.renew_lock``). A service without the route (404) gets one renewal per lease.

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
from machine.protocol.shapes import SYNC_ITEMS_MAX, SYNC_PATH, SYNC_RECEIPT_BYTES_MAX

from . import process
from .lease import KILL, OK, TERM, Deadline, LeaseTerms, SentAt
from .client import Answer
from .wire import refusal_stop_reason

log = logging.getLogger("runstead.worker")

LEASE_FILE = "lease.json"  # the last deadline, for the launcher (module docstring)
RENEW_CHECK_S = 0.05  # how often the renewal thread looks again while something is under way (a companion's sync)
# Until a renewal is due the thread sleeps until it is (on the monotonic clock), woken
# early by the coordinator's look (``Run.look``, once a second) when the wall clock says
# it is due, and looking by itself at least this often. It looked every RENEW_CHECK_S,
# then every second: 100 open conversations woke their renewal threads 2,000, then 100
# times a second for nothing (issue 43).
RENEW_LOOK_S = 30.0
# A sync's renewals stay under the service's body limit as its receipts do (each renewal
# carries up to OUTPUT_TAIL_MAX_CHARS of the agent's output).
SYNC_RENEW_BYTES_MAX = SYNC_RECEIPT_BYTES_MAX
RENEW_TIMEOUT_MIN_S = 0.5  # a renewal request's HTTP timeout: the time left on the lease,
RENEW_TIMEOUT_MAX_S = 10.0  # ... bounded to this window
RENEW_RETRY_FRACTION = 0.25  # a failed renewal is retried after renew_every_s * this,
RENEW_RETRY_MAX_S = 1.0  # ... at most this
LOG_EVERY_FAILURES = 20  # a long outage logs its first failure, then every 20th
COMPANION_FRACTION = 0.5  # a lease due within renew_every_s * this goes along with one due now
COMPANION_WAIT_S = 1.0  # a lease renewed along with another waits for that sync's end (``wake``) at most this long between looks


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
        self.renewing = False  # a renewal of this lease is in flight (its own, or another's sync)
        self.finished = False  # refused (L5) or the token revoked: nothing more to renew
        self.wake = threading.Event()  # a renewal is due (``Run.look``) or the lease was let go

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
        thread ends."""
        self.released = True
        self.wake.set()

    def renewal_due(self, clock) -> bool:
        """True when this lease's renewal is due (L3's elapsed time: the larger of the
        monotonic and wall clocks' since the last grant or renewal was sent) and not under
        way or over."""
        deadline = self.deadline
        return (deadline is not None and not self.renewing and not self.finished and not self.released
                and deadline.terms.renew_every_s - deadline.sent.elapsed(clock) <= 0)

    def _running(self) -> bool:
        return not self.released and not self.finished and self.run.process.proc.poll() is None

    def _renewable(self, clock) -> bool:
        """Whether this lease may be renewed now (by its thread or along with another)."""
        process = getattr(self.run, "process", None)
        if self.deadline is None or process is None or getattr(process, "proc", None) is None:
            return False  # not leased or not spawned yet: its own thread renews it once it is
        return self._running() and self.run.stop_reason != "worker_shutdown" and self.deadline.phase(clock) != KILL

    def _companions(self) -> list[LeasePart]:
        """Mark this lease ``renewing`` and pick the worker's other leases due within
        ``COMPANION_FRACTION`` of a renewal interval (marked too); [] for none, or when
        this lease is already being renewed along with another (then None)."""
        ctx, clock = self.run.ctx, self.run.ctx.clock
        with ctx.runs_lock:
            runs = list(ctx.runs.values())
        with ctx.renew_lock:
            if self.renewing:
                return None
            self.renewing = True
            if not ctx.sync_renewals:
                return []
            picked = []
            for run in runs:
                part = getattr(run, "lease", None)
                try:
                    if part is None or part is self or part.renewing or not part._renewable(clock):
                        continue
                    terms = part.deadline.terms
                    due_in = terms.renew_every_s - part.deadline.sent.elapsed(clock)
                except Exception:  # a run in transition: never let batching cost this lease its renewal
                    log.exception("operation %s: not renewed along with another lease", run.operation_id)
                    continue
                if due_in <= terms.renew_every_s * COMPANION_FRACTION:
                    part.renewing = True
                    picked.append(part)
            return picked

    def _renewal_item(self) -> dict:
        return {"lease_id": self.deadline.terms.lease_id, "output_tail": process.output_tail(self.run.op_dir)}

    def _within_bounds(self, others: list[LeasePart]) -> tuple[list[dict], list[LeasePart]]:
        """This lease's renewal item and its companions' while the sync stays within
        ``SYNC_ITEMS_MAX`` items and ``SYNC_RENEW_BYTES_MAX`` bytes (each item carries up to
        ``OUTPUT_TAIL_MAX_CHARS`` of output, L10); the companions left out are let go to
        renew on their own threads. Returns (items, the companions kept)."""
        items, kept = [self._renewal_item()], []
        size = len(json.dumps(items[0]).encode())
        for other in others:
            item = other._renewal_item()
            size += len(json.dumps(item).encode()) + 2
            if len(items) >= SYNC_ITEMS_MAX or size > SYNC_RENEW_BYTES_MAX:
                break
            items.append(item)
            kept.append(other)
        with self.run.ctx.renew_lock:
            for other in others[len(kept):]:
                other.renewing = False
                other.wake.set()
        return items, kept

    def _send_renewal(self, service, sent: SentAt, timeout: float) -> Answer | None:
        """Renew this lease, with its companions as one sync; returns this lease's answer,
        having applied each companion's (``apply_renewal``). None: already renewed along
        with another lease meanwhile."""
        ctx = self.run.ctx
        others = self._companions()
        if others is None:
            return None
        try:
            if others:
                items, others = self._within_bounds(others)
                answer = service.send("POST", SYNC_PATH, {"renew": items}, timeout_s=timeout)
                if answer.kind == "final" and answer.status == 404:
                    log.info("the service has no %s: renewing each lease on its own", SYNC_PATH)
                    ctx.sync_renewals = False
                elif answer.kind == "final":  # the sync refused as a whole refuses no lease: this one goes alone
                    log.warning("operation %s: a sync of %d renewals refused (%s): renewing alone",
                                self.run.operation_id, len(items), answer.status)
                elif answer.kind != "ok":
                    return answer  # each companion retries on its own thread
                else:
                    items = (answer.body or {}).get("leases") or []
                    for other, item in zip(others, items[1:]):
                        other.apply_renewal(_item_answer(item), sent)
                    return _item_answer(items[0]) if items else Answer(status=0, body=None, text="empty sync")
            return service.lease_renew(self.deadline.terms.lease_id, output_tail=process.output_tail(self.run.op_dir),
                                       timeout_s=timeout)
        finally:
            with ctx.renew_lock:
                self.renewing = False
                for other in others:
                    other.renewing = False
                    other.wake.set()  # its thread, waiting for this answer, looks again

    def apply_renewal(self, answer: Answer, sent: SentAt) -> bool:
        """Apply a renewal's answer sent at ``sent``: a new deadline (``ok``), or stop the
        agent (a refusal, final for the lease, L5), or the worker (401). True when the
        renewal took (``ok``); a retry answer changes nothing."""
        run, ctx = self.run, self.run.ctx
        if run.process.proc.poll() is not None:
            return False
        if answer.kind == "ok":
            self.deadline = Deadline(LeaseTerms.from_reply(answer.body), sent)
            ctx.store.save_lease(run.operation_id, terms=answer.body, sent_mono=sent.monotonic,
                                 sent_wall=sent.wall, boot=ctx.boot, granted=False)
            self.record_deadline()
            return True
        if answer.kind == "final":
            reason = answer.error
            log.warning("operation %s: renewal refused (%s): stopping", run.operation_id, reason)
            self.finished = True
            # A refusal takes the lease (L5), but ``max_runtime`` only ends the task's
            # time: the agent stopped inside its lease is J6 row 8 (``failed``).
            run.request_stop(refusal_stop_reason(reason), at=None if reason == "max_runtime" else sent)
        elif answer.kind == "revoked":
            self.finished = True
            ctx.on_revoked()
        return False

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
                    clock.wait(self.wake, min(due_in, max(self.check_s, RENEW_LOOK_S)))
                    self.wake.clear()
                    continue
                sent = SentAt.now(clock)
                timeout = max(RENEW_TIMEOUT_MIN_S, min(RENEW_TIMEOUT_MAX_S, self.deadline.remaining(clock)))
                answer = self._send_renewal(service, sent, timeout)
                if answer is None:  # being renewed along with another lease: its answer comes (``wake``)
                    clock.wait(self.wake, COMPANION_WAIT_S)
                    self.wake.clear()
                    continue
                if run.process.proc.poll() is not None:
                    return
                if answer.kind in ("ok", "final", "revoked"):
                    self.apply_renewal(answer, sent)
                    if answer.kind != "ok":
                        return
                    failures = 0
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


def _item_answer(item: dict) -> Answer:
    """One lease's item of a sync answer as the ``Answer`` its own renewal would have got."""
    status = item.get("status", 0)
    body = item.get("lease") if status == 200 else {"error": item.get("error"), "detail": item.get("detail")}
    return Answer(status=status, body=body, text="")
