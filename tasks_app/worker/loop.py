"""The worker loop (SPEC W, X, R4, L, U1, M8). Standard library + httpx + psutil only.

Threads, each independent of the others (W8):

- poller: long-polls ``GET /api/worker/messages/``; commits each message locally, then
  acknowledges it (W2); a ``start`` for a known operation is acked and not run (W3);
- one runner per operation: local checks (W4), lease (L1), ``starting`` commit with
  ``spawn_count = 1`` (X1), spawn through the launcher, pid commit (X2), then a watch loop
  that checks the deadline and the process 5 times a second (L4) and stops the agent when
  told to (cancel, refused renewal, shutdown);
- one renewer per running operation (L3, L5, L10);
- sender: sends the durable outbox (receipts and session markers) in order, with
  backoff and jitter capped at 60 s and the same ``event_id`` on every retry (R4).

On start-up, before pulling, ``recover`` settles what a previous worker left (X3, X4).
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import threading
import time
import uuid
from dataclasses import dataclass, field

from . import faults, process
from .client import Backoff, ServiceClient
from .clock import SYSTEM_CLOCK, Clock, boot_id
from .config import WorkerConfig, check_start
from .lease import KILL, OK, TERM, Deadline, LeaseTerms, SentAt, slept_s
from .store import Identity, StateDir, Store

log = logging.getLogger("runstead.worker")

POLL_WAIT_S = 25.0
WATCH_INTERVAL_S = 0.2  # L4 asks for >= once a second
DESCENDANT_SNAPSHOT_S = 1.0
DRAIN_FLUSH_S = 5.0
ONCE_FLUSH_S = 30.0
EXIT_REVOKED = 3

# J6: a refused renewal becomes the worker's stop_reason.
REFUSAL_STOP_REASON = {"cancelled": "cancel", "max_runtime": "max_runtime"}


def refusal_stop_reason(reason: str | None) -> str:
    return REFUSAL_STOP_REASON.get(reason or "", "renewal_refused")


@dataclass
class WorkerOptions:
    server: str
    poll_wait_s: float = POLL_WAIT_S
    once: bool = False
    backoff_base_s: float = 1.0
    backoff_cap_s: float = 60.0


@dataclass
class Run:
    """One operation this worker process is handling."""

    operation_id: str
    payload: dict
    op_dir: str
    deadline: Deadline | None = None
    granted: SentAt | None = None
    proc: object = None
    leader: process.ProcRef | None = None
    spawned: SentAt | None = None
    stop_reason: str | None = None
    refused_at: SentAt | None = None
    survivors: list | None = None
    known: dict = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request_stop(self, reason: str, at: SentAt | None = None) -> None:
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
                if at is not None and self.refused_at is None:
                    self.refused_at = at
        self.wake.set()


def receipt_item(identity: Identity, *, operation_id: str, kind: str, facts: dict, slept: float, event_id: str | None = None) -> dict:
    """An outbox row for ``POST /api/worker/receipts/`` (H, R1)."""
    event_id = event_id or f"{operation_id}:{kind}"
    return {
        "event_id": event_id,
        "kind": kind,
        "operation_id": operation_id,
        "method": "POST",
        "path": "/api/worker/receipts/",
        "body": {
            "event_id": event_id,
            "generation": identity.generation,
            "operation_id": operation_id,
            "kind": kind,
            "slept_s": round(slept, 3),
            "facts": facts,
        },
    }


def marker_item(identity: Identity, *, session_id: str, turn_id: str, state: str, deep_research: bool) -> dict:
    """An outbox row for ``PUT /api/sessions/{id}/marker/`` (M8)."""
    return {
        "event_id": f"marker:{turn_id}:{state}",
        "kind": "marker",
        "operation_id": None,
        "method": "PUT",
        "path": f"/api/sessions/{session_id}/marker/",
        "body": {
            "turn_id": turn_id,
            "device_id": identity.machine_id,
            "device_name": identity.name,
            "state": state,
            "deep_research": bool(deep_research),
        },
    }


def final_facts(*, process_started, exit_code=None, signal_=None, lease_id=None, ended_within_lease=None,
                runtime_s=None, stop_reason, survivors=(), output_tail="") -> dict:
    """The ``final`` receipt's facts (J1)."""
    return {
        "process_started": process_started,
        "exit_code": exit_code,
        "signal": signal_,
        "lease_id": lease_id,
        "ended_within_lease": ended_within_lease,
        "runtime_s": None if runtime_s is None else round(max(0.0, runtime_s), 3),
        "stop_reason": stop_reason,
        "survivors": list(survivors),
        "output_tail": output_tail,
    }


class Worker:
    """The worker. ``run()`` returns the process exit code."""

    def __init__(self, *, state: StateDir, store: Store, identity: Identity, config: WorkerConfig,
                 options: WorkerOptions, clock: Clock = SYSTEM_CLOCK, idle_guard=None):
        self.state = state
        self.store = store
        self.identity = identity
        self.config = config
        self.options = options
        self.clock = clock
        self.boot = boot_id()
        self.backoff = Backoff(options.backoff_base_s, options.backoff_cap_s)
        self.idle_guard = idle_guard or process.IdleSleepGuard(enabled=config.prevent_idle_sleep)
        self.runs: dict[str, Run] = {}
        self.runs_lock = threading.Lock()
        self.slots = threading.BoundedSemaphore(config.max_concurrent)
        self.draining = threading.Event()  # W6 first signal: stop pulling and starting
        self.no_pull = threading.Event()  # --once: the one pull is done
        self.stopping = threading.Event()  # W6 second signal: stop agents
        self.revoked = threading.Event()
        self.outbox_wake = threading.Event()
        self.sender_failing = threading.Event()  # the last send needs a retry (service away)
        self.signals = 0

    # --- helpers -----------------------------------------------------------------------

    def client(self, timeout_s: float = 10.0) -> ServiceClient:
        return ServiceClient(self.options.server, self.identity.token, timeout_s=timeout_s)

    def enqueue(self, items: list[dict]) -> None:
        self.store.enqueue(items, self.clock.wall())
        self.outbox_wake.set()

    def on_revoked(self) -> None:
        """401 token_revoked (R3, K1): stop agents and the loop, ask to be paired again."""
        if self.revoked.is_set():
            return
        self.revoked.set()
        self.draining.set()
        log.error(
            "machine token revoked (401 token_revoked). Pair this worker again: "
            "python manage.py pair_worker --server %s --code CODE --state-dir %s",
            self.options.server, self.state.path,
        )
        self.stop_all("worker_shutdown")

    def stop_all(self, reason: str) -> None:
        with self.runs_lock:
            runs = list(self.runs.values())
        for run in runs:
            run.request_stop(reason)

    def active(self) -> int:
        with self.runs_lock:
            return len(self.runs)

    # --- main --------------------------------------------------------------------------

    def install_signal_handlers(self) -> None:
        """W6. The handler only sets flags (it runs between bytecodes of the main thread,
        which may hold a lock); the main loop acts on them."""

        def handler(signum, frame):
            self.signals += 1
            self.draining.set()
            if self.signals > 1:
                self.stopping.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def run(self) -> int:
        log.info("worker %s (%s, generation %s) on %s, state %s", self.identity.machine_id, self.identity.name,
                 self.identity.generation, self.options.server, self.state.path)
        # M5: close markers a previous run of this device left running.
        self.enqueue([{
            "event_id": f"sweep:{uuid.uuid4()}", "kind": "sweep", "method": "POST",
            "path": f"/api/devices/{self.identity.machine_id}/sweep/", "body": {},
        }])
        # B10: the board's task form offers this machine's profiles.
        self.enqueue([{
            "event_id": f"profiles:{uuid.uuid4()}", "kind": "profiles", "method": "PUT", "path": "/api/worker/profiles/",
            "body": {"profiles": [{"name": name, "preset": p.preset} for name, p in sorted(self.config.profiles.items())]},
        }])
        sender = threading.Thread(target=self.sender_loop, name="sender", daemon=True)
        sender.start()
        self.recover()
        for record in self.store.in_states("received"):
            self.start_runner(record["operation_id"], json.loads(record["payload"]))
        if self.options.once:
            self.poll_once(self.client(self.options.poll_wait_s + 10))
            self.no_pull.set()
        else:
            threading.Thread(target=self.poll_loop, name="poller", daemon=True).start()
        announced_drain = announced_stop = False
        while True:
            if self.draining.is_set() and not announced_drain and not self.revoked.is_set():
                announced_drain = True
                log.info("draining: no new work; running agents finish and report (a second signal stops them)")
            if self.stopping.is_set() and not announced_stop:
                announced_stop = True
                log.info("second signal: stopping agents (worker_shutdown)")
                self.stop_all("worker_shutdown")
            if (self.no_pull.is_set() or self.draining.is_set()) and self.active() == 0:
                break
            time.sleep(0.1)
        flush = ONCE_FLUSH_S if self.options.once else DRAIN_FLUSH_S
        end = time.monotonic() + flush
        while (self.store.pending_outbox() and time.monotonic() < end and not self.revoked.is_set()
               and not self.sender_failing.is_set()):
            self.outbox_wake.set()
            time.sleep(0.05)
        if self.revoked.is_set():
            return EXIT_REVOKED
        left = self.store.pending_outbox()
        if left:
            log.warning("exiting with %d report(s) still queued; the next start sends them", left)
        return 0

    # --- pulling (W2, W3) ----------------------------------------------------------------

    def poll_loop(self) -> None:
        client = self.client(self.options.poll_wait_s + 10)
        attempt = 0
        while not self.draining.is_set():
            ok = self.poll_once(client)
            if ok:
                attempt = 0
            else:
                delay = self.backoff.delay(attempt)
                attempt += 1
                self.draining.wait(delay)

    def poll_once(self, client: ServiceClient) -> bool:
        wait = max(0, min(25, self.options.poll_wait_s))
        answer = client.request("GET", f"/api/worker/messages/?wait={wait:g}", timeout_s=wait + 10)
        if answer.kind == "revoked":
            self.on_revoked()
            return False
        if answer.kind != "ok" or not answer.body:
            log.warning("pull failed: %s %s", answer.status, answer.text[:200])
            return False
        if self.draining.is_set():
            return True  # not committed, not acked: delivered again later
        for message in answer.body.get("messages", []):
            try:
                self.handle_message(client, message)
            except Exception:
                log.exception("message %s could not be handled", message.get("id"))
        return True

    def handle_message(self, client: ServiceClient, message: dict) -> None:
        kind, payload = message.get("kind"), message.get("payload") or {}
        operation_id = str(message.get("operation_id") or payload.get("operation_id"))
        message_id = str(message["id"])
        if kind == "start":
            new = self.store.record_message(message_id=message_id, kind=kind, operation_id=operation_id,
                                            payload=payload, wall=self.clock.wall())
            faults.fault("after_commit_before_ack")
            self.ack(client, message_id)
            faults.fault("after_ack_before_lease")
            if new:
                self.start_runner(operation_id, payload)
            else:
                log.info("start for operation %s already known: acknowledged, not run again (W3)", operation_id)
        elif kind == "cancel":
            self.store.record_message(message_id=message_id, kind=kind, operation_id=operation_id,
                                      payload=payload, wall=self.clock.wall())
            self.store.request_cancel(operation_id)
            self.ack(client, message_id)
            with self.runs_lock:
                run = self.runs.get(operation_id)
            if run is not None:
                run.request_stop("cancel")
        elif kind == "query":
            query_id = str(payload.get("query_id"))
            self.enqueue([self.report_item(operation_id, query_id)])
            self.store.record_message(message_id=message_id, kind=kind, operation_id=operation_id,
                                      payload=payload, wall=self.clock.wall())
            self.ack(client, message_id)
        else:
            log.warning("unknown message kind %r: acknowledged and ignored", kind)
            self.ack(client, message_id)

    def ack(self, client: ServiceClient, message_id: str) -> None:
        answer = client.request("POST", f"/api/worker/messages/{message_id}/ack/", {})
        if answer.kind == "revoked":
            self.on_revoked()
        elif answer.kind != "ok":
            log.warning("ack of %s failed (%s); it will be delivered again and recognised", message_id, answer.status)

    def report_item(self, operation_id: str, query_id: str) -> dict:
        """U1: a ``report`` receipt from the local record, or ``record: null``."""
        record = self.store.get(operation_id)
        if record is None:
            body = None
            slept = 0.0
        else:
            body = {
                "local_state": record["local_state"],
                "pid": record["pid"],
                "lease_id": record["lease_id"],
                "final": json.loads(record["final"]) if record["final"] else None,
            }
            slept = self.slept_for(record)
        return receipt_item(self.identity, operation_id=operation_id, kind="report",
                            facts={"query_id": query_id, "record": body}, slept=slept,
                            event_id=f"report:{query_id}")

    def slept_for(self, record: dict) -> float:
        if record.get("granted_mono") is None:
            return 0.0
        if record.get("boot_id") != self.boot:
            return 0.0
        return slept_s(SentAt(record["granted_mono"], record["granted_wall"]), self.clock)

    # --- running one operation -------------------------------------------------------------

    def start_runner(self, operation_id: str, payload: dict) -> None:
        with self.runs_lock:
            if operation_id in self.runs:
                return
            run = Run(operation_id=operation_id, payload=payload, op_dir=self.state.op_dir(operation_id))
            self.runs[operation_id] = run
        threading.Thread(target=self._runner, args=(run,), name=f"run-{operation_id[:8]}", daemon=True).start()

    def _runner(self, run: Run) -> None:
        try:
            self.execute(run)
        except Exception:
            log.exception("operation %s: runner failed", run.operation_id)
        finally:
            run.finished.set()
            with self.runs_lock:
                self.runs.pop(run.operation_id, None)

    def refuse(self, run: Run, reason: str, stop_reason: str = "refused", lease_id: str | None = None) -> None:
        """A start that never spawned: final receipt with ``process_started: false`` (W4)."""
        log.warning("operation %s refused: %s", run.operation_id, reason)
        facts = final_facts(process_started=False, stop_reason=stop_reason, lease_id=lease_id, runtime_s=0.0,
                            output_tail=f"refused by the worker: {reason}")
        self.store.mark_ended(run.operation_id, final=facts, wall=self.clock.wall(), outbox=[
            receipt_item(self.identity, operation_id=run.operation_id, kind="final", facts=facts, slept=0.0)])
        self.outbox_wake.set()

    def execute(self, run: Run) -> None:
        record = self.store.get(run.operation_id)
        if record is None or record["local_state"] != "received":
            return
        if record["cancel_requested"]:
            return self.refuse(run, "cancelled before start", stop_reason="cancel")
        checked = check_start(self.config, run.payload)
        if isinstance(checked, str):
            return self.refuse(run, checked)
        profile, folder = checked
        argv = profile.command(prompt=run.payload["prompt"], folder=folder)
        env = process.agent_env(os.environ, profile_env=profile.env, operation_id=run.operation_id,
                                task_id=str(run.payload.get("task_id", "")), token=self.identity.token)
        if shutil.which(argv[0], path=env.get("PATH")) is None and not os.path.isabs(argv[0]):
            return self.refuse(run, f"agent executable {argv[0]!r} not found")
        # W8: at most max_concurrent agents; a queued start waits here, unleased.
        while not self.slots.acquire(timeout=0.2):
            if self.draining.is_set():
                return
        try:
            if self.draining.is_set():
                return  # stays 'received': the next worker start takes it up
            if not self.acquire_lease(run):
                return
            self.spawn_and_watch(run, argv, folder, profile.prompt_via == "stdin", env)
        finally:
            self.slots.release()

    def acquire_lease(self, run: Run) -> bool:
        """L1: no lease, no start. Retries network trouble; a 409 is final."""
        client = self.client()
        attempt = 0
        try:
            while not self.draining.is_set():
                if self.store.get(run.operation_id)["cancel_requested"]:
                    self.refuse(run, "cancelled before start", stop_reason="cancel")
                    return False
                sent = SentAt.now(self.clock)
                answer = client.request("POST", "/api/worker/leases/", {"operation_id": run.operation_id})
                if answer.kind == "ok":
                    terms = LeaseTerms.from_reply(answer.body)
                    deadline = Deadline(terms, sent)
                    if deadline.phase(self.clock) != OK:
                        log.warning("operation %s: lease reply came too late to start; asking again", run.operation_id)
                        continue
                    run.deadline, run.granted = deadline, sent
                    self.store.save_lease(run.operation_id, terms=answer.body, sent_mono=sent.monotonic,
                                          sent_wall=sent.wall, boot=self.boot, granted=True)
                    return True
                if answer.kind == "final":
                    reason = answer.error or f"http {answer.status}"
                    self.refuse(run, f"lease refused: {reason}",
                                stop_reason="cancel" if reason == "cancelled" else "refused")
                    return False
                if answer.kind == "revoked":
                    self.on_revoked()
                    return False
                self.draining.wait(min(self.backoff.delay(attempt), 5.0))
                attempt += 1
            return False
        finally:
            client.close()

    def spawn_and_watch(self, run: Run, argv: list[str], folder: str, via_stdin: bool, env: dict) -> None:
        payload = run.payload
        session_id = payload.get("session_id")
        turn_id = str(uuid.uuid4()) if session_id else None
        slept = slept_s(run.granted, self.clock)
        self.store.mark_starting(run.operation_id, turn_id=turn_id, wall=self.clock.wall(), outbox=[
            receipt_item(self.identity, operation_id=run.operation_id, kind="starting",
                         facts={"lease_id": run.deadline.terms.lease_id}, slept=slept)])
        self.outbox_wake.set()
        faults.fault("after_starting_commit_before_spawn")
        run.spawned = SentAt.now(self.clock)
        try:
            proc, leader = process.spawn(argv=argv, cwd=folder, env=env, op_dir=run.op_dir,
                                         stdin_text=payload["prompt"] if via_stdin else None)
        except OSError as exc:
            facts = final_facts(process_started=False, stop_reason="refused", lease_id=run.deadline.terms.lease_id,
                                runtime_s=0.0, output_tail=f"spawn failed: {exc}")
            self.store.mark_ended(run.operation_id, final=facts, wall=self.clock.wall(), outbox=[
                receipt_item(self.identity, operation_id=run.operation_id, kind="final", facts=facts, slept=slept)])
            return
        faults.fault("after_spawn_before_pid_commit")
        run.proc, run.leader = proc, leader
        outbox = [receipt_item(self.identity, operation_id=run.operation_id, kind="running",
                               facts={"pid": leader.pid, "pgid": leader.pid, "process_start_time": leader.create_time},
                               slept=slept_s(run.granted, self.clock))]
        if turn_id:
            outbox.append(marker_item(self.identity, session_id=str(session_id), turn_id=turn_id, state="running",
                                      deep_research=payload.get("deep_research", False)))
        self.store.mark_running(run.operation_id, pid=leader.pid, pgid=leader.pid, start_time=leader.create_time,
                                spawned_mono=run.spawned.monotonic, spawned_wall=run.spawned.wall, outbox=outbox)
        self.outbox_wake.set()
        log.info("operation %s: agent started (launcher pid %s) in %s", run.operation_id, leader.pid, folder)
        self.idle_guard.acquire()
        try:
            renewer = threading.Thread(target=self.renew_loop, args=(run,), name=f"renew-{run.operation_id[:8]}",
                                       daemon=True)
            renewer.start()
            self.watch(run)
        finally:
            self.idle_guard.release()
        self.finish(run, turn_id)

    def target(self, run: Run) -> process.Target:
        return process.Target(operation_id=run.operation_id, leader=run.leader, pgid=run.leader.pid,
                              spawned_wall=run.spawned.wall, known=tuple(run.known.values()))

    def watch(self, run: Run) -> None:
        """Until the agent ends: deadline (L4), stop requests, descendant snapshots (L8)."""
        term_sent = False
        last_snapshot = 0.0
        fault_at = time.monotonic() + 0.3
        while True:
            if run.proc.poll() is not None:
                return
            if faults.active_point() == "while_agent_runs" and time.monotonic() >= fault_at:
                faults.fault("while_agent_runs")
            phase = run.deadline.phase(self.clock)
            if phase == KILL:
                run.request_stop("deadline")
                log.warning("operation %s: lease deadline reached, killing", run.operation_id)
                run.survivors = process.stop(self.target(run), grace_s=0, term=False)
                return
            if phase == TERM and not term_sent:
                run.request_stop("deadline")
                log.warning("operation %s: lease deadline - kill grace: SIGTERM to the group", run.operation_id)
                process.signal_group(run.leader, run.leader.pid, signal.SIGTERM)
                term_sent = True
            elif run.stop_reason is not None and phase == OK:
                log.info("operation %s: stopping (%s)", run.operation_id, run.stop_reason)
                grace = max(0.0, min(run.deadline.terms.kill_grace_s, run.deadline.remaining(self.clock)))
                run.survivors = process.stop(self.target(run), grace_s=grace)
                return
            if time.monotonic() - last_snapshot >= DESCENDANT_SNAPSHOT_S:
                last_snapshot = time.monotonic()
                self.snapshot(run)
            run.wake.wait(WATCH_INTERVAL_S)
            run.wake.clear()

    def snapshot(self, run: Run) -> None:
        changed = False
        for ref in process.descendants(run.leader):
            if ref.pid not in run.known or run.known[ref.pid] != ref:
                run.known[ref.pid] = ref
                changed = True
        if changed:
            self.store.save_descendants(run.operation_id, [r.as_list() for r in run.known.values()])

    def finish(self, run: Run, turn_id: str | None) -> None:
        """Collect the exit facts, clean up leftovers, queue the final receipt (J1)."""
        try:
            code = run.proc.wait(timeout=5)
        except Exception:
            code = None
        seen = SentAt.now(self.clock)
        survivors = run.survivors
        if survivors is None:
            # The agent ended by itself: leftovers of the task still get the bounded stop.
            grace = run.deadline.terms.kill_grace_s if run.deadline.phase(self.clock) == OK else 0.0
            survivors = process.stop(self.target(run), grace_s=min(grace, 2.0))
        exit_facts = process.read_json(os.path.join(run.op_dir, "exit.json")) or {}
        process_started = True
        if "exit_code" in exit_facts or "signal" in exit_facts:
            exit_code, sig = exit_facts.get("exit_code"), exit_facts.get("signal")
            ended = SentAt(exit_facts.get("exit_mono", seen.monotonic), exit_facts.get("exit_wall", seen.wall))
            if exit_facts.get("spawn_error"):
                process_started = False
        elif code is not None:
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
            ended = seen
        else:
            exit_code, sig, ended = None, None, seen
        within = run.deadline.within(ended.monotonic, ended.wall)
        if run.refused_at is not None:
            within = within and ended.wall <= run.refused_at.wall
        faults.fault("after_exit_before_final_receipt")
        facts = final_facts(
            process_started=process_started, exit_code=exit_code, signal_=sig, lease_id=run.deadline.terms.lease_id,
            ended_within_lease=within, runtime_s=ended.wall - run.spawned.wall,
            stop_reason=run.stop_reason or "exit", survivors=survivors, output_tail=process.output_tail(run.op_dir),
        )
        outbox = [receipt_item(self.identity, operation_id=run.operation_id, kind="final", facts=facts,
                               slept=slept_s(run.granted, self.clock))]
        if turn_id:
            outbox.append(marker_item(self.identity, session_id=str(run.payload.get("session_id")), turn_id=turn_id,
                                      state="ended", deep_research=run.payload.get("deep_research", False)))
        self.store.mark_ended(run.operation_id, final=facts, wall=self.clock.wall(), outbox=outbox)
        self.outbox_wake.set()
        log.info("operation %s: ended (%s, exit %s, signal %s, survivors %d)", run.operation_id, facts["stop_reason"],
                 exit_code, sig, len(survivors))

    def renew_loop(self, run: Run) -> None:
        """Renew every ``renew_every_s`` from the last send (L3); a 409 is final (L5)."""
        client = self.client()
        failures = 0
        try:
            while not run.finished.is_set() and run.proc.poll() is None:
                if not run.deadline.renewal_due(self.clock) or run.stop_reason == "worker_shutdown":
                    run.finished.wait(0.05)
                    continue
                sent = SentAt.now(self.clock)
                timeout = max(0.5, min(10.0, run.deadline.remaining(self.clock)))
                answer = client.request("POST", f"/api/worker/leases/{run.deadline.terms.lease_id}/renew/",
                                        {"output_tail": process.output_tail(run.op_dir)}, timeout_s=timeout)
                if run.proc.poll() is not None:
                    return
                if answer.kind == "ok":
                    terms = LeaseTerms.from_reply(answer.body)
                    run.deadline = Deadline(terms, sent)
                    self.store.save_lease(run.operation_id, terms=answer.body, sent_mono=sent.monotonic,
                                          sent_wall=sent.wall, boot=self.boot, granted=False)
                elif answer.kind == "final":
                    reason = answer.error
                    log.warning("operation %s: renewal refused (%s): stopping", run.operation_id, reason)
                    run.request_stop(refusal_stop_reason(reason), at=sent)
                    return
                elif answer.kind == "revoked":
                    self.on_revoked()
                    return
                else:
                    failures += 1
                    if failures == 1 or failures % 20 == 0:
                        log.warning("operation %s: renewal failed (%s), retrying until the deadline (%d tries)",
                                    run.operation_id, answer.status or answer.text[:120], failures)
                    run.finished.wait(min(1.0, run.deadline.terms.renew_every_s / 4))
                    continue
                failures = 0
        finally:
            client.close()

    # --- sending (R3, R4) -------------------------------------------------------------------

    def sender_loop(self) -> None:
        client = self.client()
        while not self.revoked.is_set():
            row = self.store.next_outbox()
            if row is None:
                self.outbox_wake.wait(0.5)
                self.outbox_wake.clear()
                continue
            body = json.loads(row["body"])
            self.store.outbox_attempt(row["seq"])
            answer = client.request(row["method"], row["path"], body)
            if answer.kind == "retry":
                self.sender_failing.set()
            else:
                self.sender_failing.clear()
            if answer.kind == "ok":
                outcome = (answer.body or {}).get("outcome")
                if outcome == "not_applied":
                    log.info("%s %s not applied: %s", row["kind"], row["event_id"], (answer.body or {}).get("reason"))
                self.store.outbox_done(row["seq"], status="done", answer=answer.text[:2000])
            elif answer.kind == "final":
                level = logging.INFO if row["kind"] in ("marker", "sweep") and answer.status == 404 else logging.WARNING
                log.log(level, "%s %s answered %s (final, not resent): %s", row["kind"], row["event_id"],
                        answer.status, answer.text[:300])
                self.store.outbox_done(row["seq"], status="given_up", answer=f"{answer.status} {answer.text[:2000]}")
            elif answer.kind == "revoked":
                self.on_revoked()
                break
            else:
                delay = self.backoff.delay(row["attempts"])
                log.warning("%s %s: %s; retrying in %.1f s", row["kind"], row["event_id"],
                            answer.status or answer.text[:120], delay)
                self.outbox_wake.clear()
                end = time.monotonic() + delay
                while time.monotonic() < end and not self.revoked.is_set():
                    time.sleep(min(0.1, max(0.0, end - time.monotonic())))
        client.close()

    # --- restart (X3, X4) ------------------------------------------------------------------

    def recover(self) -> None:
        """Settle every ``starting``/``running`` record a previous worker left: never run it
        again (X4); stop a live leftover (L8); report ``unknown`` then the final facts."""
        for record in self.store.in_states("starting", "running"):
            try:
                self.recover_one(record)
            except Exception:
                log.exception("operation %s: recovery failed", record["operation_id"])

    def recover_one(self, record: dict) -> None:
        operation_id = record["operation_id"]
        op_dir = self.state.op_dir(operation_id)
        payload = json.loads(record["payload"])
        terms = json.loads(record["lease_terms"]) if record["lease_terms"] else None
        grace = float(terms["kill_grace_s"]) if terms else 1.0
        same_boot = record["boot_id"] == self.boot
        known = tuple(process.ProcRef(int(p), float(t)) for p, t in json.loads(record["descendants"] or "[]"))
        slept = self.slept_for(record)
        items = [receipt_item(self.identity, operation_id=operation_id, kind="unknown",
                              facts={"reason": "worker_restart"}, slept=slept)]
        if record["pid"] is None:
            # X3: spawned or not, nobody knows: process_started unknown. Tagged leftovers stop.
            survivors = process.stop(process.Target(operation_id=operation_id, known=known), grace_s=grace)
            facts = final_facts(process_started="unknown", lease_id=record["lease_id"], stop_reason="worker_restart",
                                survivors=survivors, output_tail=process.output_tail(op_dir))
            log.warning("operation %s: 'starting' without a pid after restart: process_started unknown", operation_id)
        else:
            leader = process.ProcRef(int(record["pid"]), float(record["process_start_time"]))
            target = process.Target(operation_id=operation_id, leader=leader, pgid=record["pgid"],
                                    spawned_wall=record["spawned_wall"], known=known)
            leftover = process.alive(leader)
            if leftover:
                log.warning("operation %s: leftover agent (pid %s) found after restart: stopping it",
                            operation_id, leader.pid)
            else:
                items = items[:1]
            survivors = process.stop(target, grace_s=grace if leftover else min(grace, 1.0))
            if leftover:
                # The launcher records the exit status once the agent is gone.
                end = time.monotonic() + 2.0
                while process.read_json(os.path.join(op_dir, "exit.json")) is None and time.monotonic() < end:
                    time.sleep(0.05)
            exit_facts = process.read_json(os.path.join(op_dir, "exit.json"))
            deadline = None
            if terms and record["sent_wall"] is not None:
                deadline = Deadline(LeaseTerms.from_reply(terms), SentAt(record["sent_mono"], record["sent_wall"]))
            if exit_facts is not None:
                exit_mono = exit_facts.get("exit_mono") if same_boot else None
                within = deadline.within(exit_mono, exit_facts["exit_wall"]) if deadline else None
                facts = final_facts(
                    process_started=not exit_facts.get("spawn_error"), exit_code=exit_facts.get("exit_code"),
                    signal_=exit_facts.get("signal"), lease_id=record["lease_id"], ended_within_lease=within,
                    runtime_s=exit_facts["exit_wall"] - (record["spawned_wall"] or exit_facts["exit_wall"]),
                    stop_reason="worker_restart" if leftover else "exit", survivors=survivors,
                    output_tail=process.output_tail(op_dir),
                )
            else:
                facts = final_facts(process_started=True, lease_id=record["lease_id"], stop_reason="worker_restart",
                                    survivors=survivors, output_tail=process.output_tail(op_dir))
        items.append(receipt_item(self.identity, operation_id=operation_id, kind="final", facts=facts, slept=slept))
        if record["turn_id"] and payload.get("session_id"):
            items.append(marker_item(self.identity, session_id=str(payload["session_id"]), turn_id=record["turn_id"],
                                     state="ended", deep_research=payload.get("deep_research", False)))
        self.store.mark_ended(operation_id, final=facts, wall=self.clock.wall(), outbox=items)
        self.outbox_wake.set()
        log.info("operation %s: recovered after restart (%s); never started again (X4)", operation_id,
                 facts["stop_reason"])


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
    server = options.server or identity.server
    options.server = server
    return Worker(state=state, store=store, identity=identity, config=config, options=options, clock=clock)
