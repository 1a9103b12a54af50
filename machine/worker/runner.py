"""One operation, from its ``start`` message to its final receipt (SPEC W4, W8, L1, L4, L8,
X1, X2, J1, M8).

``Runner.start`` runs each operation in its own thread:

1. local checks (W4: profile, folder inside the allowed roots and the grant root; G7: a
   worktree task's folder in a git work tree) and a slot (W8: at most ``max_concurrent``
   agents); a refused start is a final receipt with ``process_started: false``,
   ``stop_reason: refused``;
2. the lease (L1: no lease, no start);
3. ``starting`` committed with ``spawn_count = 1`` (X1) and, for a worktree task, where
   its worktree goes; the worktree made (G7); the spawn through the launcher,
   pid, group and start time committed right after (X2), the ``running`` marker (M8);
4. the watch: the deadline checked every ``watch_interval_s`` (L4), stop requests
   (cancel, refused renewal, shutdown) and descendant snapshots (L8), while a renewer
   thread (``renewer.py``) keeps the lease;
5. the exit facts, the bounded stop of leftovers and the final receipt (J1).

Per-run extension points (``RunHooks``): the agent's output lines are fed to
``hooks.on_output(line)`` while it runs (a stream parser), and ``hooks.facts_extra()``
is merged into the final facts (never over a J1 key). A progress sender would read what
the hooks collected from its own thread, like the renewer, so it never delays a renewal
or a receipt (W8).
"""
from __future__ import annotations

import json
import logging
import os
import signal
import threading
import uuid
from dataclasses import dataclass, field
from collections.abc import Callable

from machine.protocol import Backoff
from machine.protocol.shapes import StartPayload

from . import approvals, faults, process, worktrees
from .conversation import Conversation
from .process import OutputFollower
from .config import check_start
from .observe import AgentObserver
from .presets import ResumeUnsupported
from .context import WorkerContext
from .lease import KILL, OK, TERM, Deadline, LeaseTerms, SentAt, slept_s
from .renewer import Renewer
from .wire import final_facts, marker_item, receipt_item

log = logging.getLogger("runstead.worker")

WATCH_INTERVAL_S = 0.2  # L4 asks for >= once a second
DESCENDANT_SNAPSHOT_S = 1.0  # L8: how often descendants are recorded
SLOT_POLL_S = 0.2  # a start waiting for a slot (W8) re-checks draining this often
LEASE_RETRY_CAP_S = 5.0  # a grant request that met network trouble is retried within this
REAP_TIMEOUT_S = 5.0  # how long the exit status of a stopped launcher is awaited
NATURAL_EXIT_STOP_GRACE_S = 2.0  # leftovers of an agent that exited by itself: SIGTERM grace cap
FAULT_WHILE_RUNNING_AFTER_S = 0.3  # crash tests: "while_agent_runs" fires this long after spawn


class RunHooks:
    """Per-run extension points; the default does nothing.

    - ``wants_output``: when True, every complete line the agent writes (stdout and
      stderr, decoded UTF-8) is passed to ``on_output`` from the run's watch thread;
    - ``facts_extra()``: facts merged into the final receipt's facts (J1 keys win).
    """

    wants_output = False

    def on_output(self, line: str) -> None:
        pass

    def facts_extra(self) -> dict:
        return {}


@dataclass
class Run:
    """One operation this worker process is handling."""

    operation_id: str
    payload: StartPayload  # its ``start`` message's, read by key (H)
    op_dir: str
    deadline: Deadline | None = None
    granted: SentAt | None = None
    proc: object = None
    leader: process.ProcRef | None = None
    spawned: SentAt | None = None
    exited: SentAt | None = None  # when the watch saw the agent's launcher end by itself
    stop_reason: str | None = None
    refused_at: SentAt | None = None
    survivors: list | None = None
    turn_id: str | None = None
    hooks: RunHooks = field(default_factory=RunHooks)
    follower: OutputFollower | None = None
    observer: AgentObserver | None = None  # G2-G5: parser, output follower, git evidence
    worktree: dict | None = None  # G7: worktrees.plan of a worktree task
    progress_sent: dict | None = None  # G4: the last progress offered (offers go only on change)
    progress_offset: int = 0  # output bytes seen at the last offer (none yet: no progress)
    entries_offered: int = 0  # G4: the highest transcript entry number offered so far
    conversation: Conversation | None = None  # C1-C6: a live conversation's input
    adopted: bool = False  # C3: a live conversation a previous worker started (``Runner.adopt``)
    asks: bool = False  # Q5: the profile says approvals = "ask"
    approval: dict | None = None  # Q5: the lease answer's {credential, wait_s}; kept in memory only
    known: dict = field(default_factory=dict)
    finished: threading.Event = field(default_factory=threading.Event)
    wake: threading.Event = field(default_factory=threading.Event)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def request_stop(self, reason: str, at: SentAt | None = None) -> None:
        """Ask the watch to stop the agent with J1 ``stop_reason`` ``reason``; the first
        reason wins. ``at``: when the refusal that took the lease was sent (``ended_within_lease``)."""
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
                if at is not None and self.refused_at is None:
                    self.refused_at = at
        self.wake.set()


class AdoptedLauncher:
    """The launcher of an adopted run (``Runner.adopt``): not this worker's child, so its
    end is seen through its identity (pid and start time) and its status in ``exit.json``
    (none recorded: it was killed, SIGKILL)."""

    def __init__(self, leader: process.ProcRef, op_dir: str):
        self.leader, self.exit_path = leader, os.path.join(op_dir, "exit.json")

    def poll(self) -> int | None:
        if process.alive(self.leader):
            return None
        facts = process.read_json(self.exit_path) or {}
        if facts.get("exit_code") is not None:
            return int(facts["exit_code"])
        return -int(facts.get("signal") or signal.SIGKILL)


class Runner:
    """Starts and runs operations (one thread each). ``hooks_for(run)`` makes each run's
    ``RunHooks`` (issue 11: agent presets and stream parsers plug in here)."""

    def __init__(self, ctx: WorkerContext, *, backoff: Backoff, renewer: Renewer | None = None,
                 hooks_for: Callable[[Run], RunHooks] | None = None, watch_interval_s: float = WATCH_INTERVAL_S,
                 snapshot_every_s: float = DESCENDANT_SNAPSHOT_S, slot_poll_s: float = SLOT_POLL_S,
                 lease_retry_cap_s: float = LEASE_RETRY_CAP_S, idle_guard=None, progress=None):
        self.ctx = ctx
        self.progress = progress  # a progress.ProgressSender (G4), or None
        self.backoff = backoff
        self.renewer = renewer or Renewer(ctx)
        self.hooks_for = hooks_for or (lambda run: RunHooks())
        self.watch_interval_s = watch_interval_s
        self.snapshot_every_s = snapshot_every_s
        self.slot_poll_s = slot_poll_s
        self.lease_retry_cap_s = lease_retry_cap_s
        self.idle_guard = idle_guard or process.IdleSleepGuard(enabled=ctx.config.prevent_idle_sleep)
        self.slots = threading.BoundedSemaphore(ctx.config.max_concurrent)
        self.slot_freed = threading.Event()

    # --- threads ---------------------------------------------------------------------------

    def start(self, operation_id: str, payload: StartPayload) -> None:
        """Run ``operation_id`` in a new thread unless it is already in flight here."""
        ctx = self.ctx
        with ctx.runs_lock:
            if operation_id in ctx.runs:
                return
            run = Run(operation_id=operation_id, payload=payload, op_dir=ctx.state.op_dir(operation_id))
            run.hooks = self.hooks_for(run)
            ctx.runs[operation_id] = run
        threading.Thread(target=self._thread, args=(run,), name=f"run-{operation_id[:8]}", daemon=True).start()

    def _thread(self, run: Run) -> None:
        try:
            self.execute(run)
        except faults.InjectedCrash as crash:
            log.warning("operation %s: injected crash at %s (tests)", run.operation_id, crash)
        except Exception:
            log.exception("operation %s: runner failed", run.operation_id)
        finally:
            run.finished.set()
            with self.ctx.runs_lock:
                self.ctx.runs.pop(run.operation_id, None)
            self.ctx.wake()

    # --- before the spawn (W4, W8, L1) -------------------------------------------------------

    def refuse(self, run: Run, reason: str, stop_reason: str = "refused", lease_id: str | None = None,
               code: str | None = None) -> None:
        """A start that never spawned: final receipt with ``process_started: false`` (W4);
        ``code`` is H's ``refused_reason`` (``agent_not_found``, ``resume_unsupported``, ...)."""
        log.warning("operation %s refused: %s", run.operation_id, reason)
        code = code or getattr(reason, "code", None)
        facts = final_facts(process_started=False, stop_reason=stop_reason, lease_id=lease_id, runtime_s=0.0,
                            output_tail=f"refused by the worker: {reason}",
                            extra={"refused_reason": code} if code else None)
        self.ctx.store.mark_ended(run.operation_id, final=facts, wall=self.ctx.clock.wall(), outbox=[
            receipt_item(self.ctx.identity, operation_id=run.operation_id, kind="final", facts=facts, slept=0.0)])
        self.ctx.wake_sender()

    def execute(self, run: Run) -> None:
        ctx = self.ctx
        if run.adopted:
            with self.slots:
                return self.watch_to_end(run)
        record = ctx.store.get(run.operation_id)
        if record is None or record["local_state"] != "received":
            return
        if record["cancel_requested"]:
            return self.refuse(run, "cancelled before start", stop_reason="cancel")
        checked = check_start(ctx.config, run.payload)
        if isinstance(checked, str):
            return self.refuse(run, checked)
        profile, folder = checked
        # G7: the task's isolation wins over the profile's; W4 checked the original folder.
        if (run.payload.get("isolation") or profile.isolation) == "worktree":
            if run.payload.get("worktree_of"):  # G8: a follow-up, in the worktree of the task it follows
                refusal = self.reuse_worktree(run, folder, run.payload["worktree_of"])
            else:
                refusal = self.plan_worktree(run, folder)
            if refusal is not None:
                return refusal
            folder = run.worktree["cwd"]
        env = process.agent_env(os.environ, profile_env=profile.env, operation_id=run.operation_id,
                                task_id=str(run.payload.get("task_id", "")), token=ctx.identity.token)
        # G1: the binary is looked up on the agent's PATH when the task starts.
        binary = profile.find_binary(env.get("PATH"))
        if binary is None:
            where = "" if os.sep in profile.executable else " on the worker's PATH"
            return self.refuse(run, f"agent executable {profile.executable!r} not found{where} "
                                    f"(profile {profile.name!r}; set binary = \"/abs/path\" in its config)",
                               code="agent_not_found")
        live = run.payload.get("mode") == "conversation"
        if live and profile.conversation != "live":
            return self.refuse(run, f"profile {profile.name!r} has no live conversation (conversation = "
                                    f"\"{profile.conversation}\")", code="conversation_unsupported")

        def command(after_binary=()):
            return profile.command(prompt=run.payload["prompt"], folder=folder, binary=binary,
                                   agent_session_id=run.payload.get("agent_session_id") or None, op_dir=run.op_dir,
                                   after_binary=after_binary, live=live)

        try:
            argv = command()
        except ResumeUnsupported:
            return self.refuse(run, f"profile {profile.name!r} cannot resume an agent session (follow-up refused)",
                               code="resume_unsupported")
        run.observer = AgentObserver(parser=profile.parser, op_dir=run.op_dir, folder=folder, worktree=run.worktree,
                                     prompt=run.payload["prompt"], record=profile.record_path(run.op_dir))
        run.observer.record_git_start()  # G5, before the lease: a slow git costs no lease time
        # W8: at most max_concurrent agents; a queued start waits here, unleased.
        while not self.slots.acquire(blocking=False):
            if ctx.draining.is_set():
                return
            ctx.clock.wait(self.slot_freed, self.slot_poll_s)
            self.slot_freed.clear()
        try:
            if ctx.draining.is_set():
                return  # stays 'received': the next worker start takes it up
            run.asks = profile.approvals == "ask"
            if not self.acquire_lease(run):
                return
            if run.asks:
                argv, env = self.asking(run, argv, env, command)
            self.spawn_and_watch(run, argv, folder, profile.prompt_via == "stdin" and not live, env, live=live)
        finally:
            self.slots.release()
            self.slot_freed.set()

    def plan_worktree(self, run: Run, folder: str):
        """G7: the repository of ``folder`` and the worktree this run will make (kept on
        ``run.worktree``), or the refused start (``not_a_git_repository`` outside a work
        tree or before its first commit)."""
        repo = worktrees.find_repo(folder)
        if repo is None or repo.head is None:
            why = "is not inside a git work tree" if repo is None else "is in a git repository without any commit"
            return self.refuse(run, f"folder {folder} {why}; a worktree task needs a commit to branch from",
                               code="not_a_git_repository")
        task_id = str(run.payload.get("task_id") or run.operation_id)
        try:
            run.worktree = {**worktrees.plan(repo, state_path=self.ctx.state.path, operation_id=run.operation_id,
                                             task_id=task_id), "task_id": task_id}
        except worktrees.WorktreeError as exc:
            return self.refuse(run, f"no worktree for this task: {exc}")
        return None

    def reuse_worktree(self, run: Run, folder: str, operation_id: str):
        """G7, G8: a follow-up of a worktree task runs in that task's worktree, on its
        branch (the agent's session belongs to that directory): ``operation_id`` is the
        followed task's operation, whose worktree this worker recorded. Its ``start`` is
        the branch's head now (G5 counts this run's commits from there); ``base`` stays
        the branch's base, so the diff is still what a merge brings. Refused
        (``worktree_unavailable``) when this worker has no record of it, the worktree is
        gone (merged, discarded, removed by hand) or ``folder`` is in another repository."""
        record = self.ctx.store.get(operation_id)
        info = json.loads(record["worktree"]) if record and record.get("worktree") else None
        repo = worktrees.find_repo(folder)
        why = None
        if info is None:
            why = "this worker has no record of the worktree of the task it follows"
        elif not os.path.isdir(info["path"]):
            why = f"the worktree {info['path']} of the task it follows is gone"
        elif repo is None or repo.common_dir != info["common_dir"]:
            why = f"folder {folder} is not in the repository of the task it follows"
        else:
            start = worktrees.branch_head(info)
            if start is None:
                why = f"branch {info['branch']} of the task it follows is gone"
        if why is not None:
            return self.refuse(run, f"no worktree for this follow-up: {why}", code="worktree_unavailable")
        task_id = str(run.payload.get("task_id") or run.operation_id)
        cwd = os.path.join(info["path"], repo.prefix) if repo.prefix else info["path"]
        run.worktree = {**info, "cwd": cwd, "task_id": task_id, "start": start, "reused": True}
        return None

    def acquire_lease(self, run: Run) -> bool:
        """L1: no lease, no start. Retries network trouble (backoff capped at
        ``lease_retry_cap_s``); a 409 is final."""
        ctx, clock = self.ctx, self.ctx.clock
        service = ctx.connect()
        attempt = 0
        try:
            while not ctx.draining.is_set():
                if ctx.store.get(run.operation_id)["cancel_requested"]:
                    self.refuse(run, "cancelled before start", stop_reason="cancel")
                    return False
                sent = SentAt.now(clock)
                if run.asks:
                    answer = service.lease_grant(run.operation_id, approval_credential=True)
                else:
                    answer = service.lease_grant(run.operation_id)
                if answer.kind == "ok":
                    body = dict(answer.body)
                    run.approval = body.pop("approval", None)  # Q5: never stored, never logged
                    terms = LeaseTerms.from_reply(body)
                    deadline = Deadline(terms, sent)
                    if deadline.phase(clock) != OK:
                        log.warning("operation %s: lease reply came too late to start; asking again", run.operation_id)
                        continue
                    run.deadline, run.granted = deadline, sent
                    ctx.store.save_lease(run.operation_id, terms=body, sent_mono=sent.monotonic,
                                         sent_wall=sent.wall, boot=ctx.boot, granted=True)
                    return True
                if answer.kind == "final":
                    reason = answer.error or f"http {answer.status}"
                    self.refuse(run, f"lease refused: {reason}",
                                stop_reason="cancel" if reason == "cancelled" else "refused")
                    return False
                if answer.kind == "revoked":
                    ctx.on_revoked()
                    return False
                end = clock.monotonic() + min(self.backoff.delay(attempt), self.lease_retry_cap_s)
                attempt += 1
                while clock.monotonic() < end and not ctx.draining.is_set():
                    clock.wait(ctx.draining, end - clock.monotonic())
            return False
        finally:
            service.close()

    def asking(self, run: Run, argv: list[str], env: dict, command) -> tuple[list[str], dict]:
        """Q5: the argv and environment of a run whose owner answers its permission
        prompts: ``--settings`` with the ``PermissionRequest`` hook (``command(after_binary)``
        rebuilds the argv with it), and the credential
        of the lease answer in the environment (``approvals.py``). A service that sent
        no credential (older than Q5) gets the run as with ``approvals = "off"``."""
        approval = run.approval or {}
        if not isinstance(approval.get("credential"), str) or not approval["credential"]:
            log.warning("operation %s: the service sent no approval credential; what would prompt is denied",
                        run.operation_id)
            return argv, env
        wait_s = float(approval.get("wait_s") or 600)
        env = {**env, **approvals.asking_env(credential=approval["credential"], server=self.ctx.server,
                                             op_dir=run.op_dir, wait_s=wait_s)}
        return command(approvals.settings_args(wait_s=wait_s)), env

    # --- the agent (X1, X2, L4, L8, J1) --------------------------------------------------------

    def spawn_and_watch(self, run: Run, argv: list[str], folder: str, via_stdin: bool, env: dict,
                        live: bool = False) -> None:
        ctx, clock = self.ctx, self.ctx.clock
        payload = run.payload
        session_id = payload.get("session_id")
        run.turn_id = turn_id = str(uuid.uuid4()) if session_id else None
        slept = slept_s(run.granted, clock)
        ctx.store.mark_starting(run.operation_id, turn_id=turn_id, wall=clock.wall(), worktree=run.worktree, outbox=[
            receipt_item(ctx.identity, operation_id=run.operation_id, kind="starting",
                         facts={"lease_id": run.deadline.terms.lease_id}, slept=slept)])
        ctx.wake_sender()
        faults.fault("after_starting_commit_before_spawn")
        problem = None
        if run.worktree is not None and not run.worktree.get("reused"):
            try:
                worktrees.create(run.worktree)  # G7: recorded above, so a restart knows it
            except worktrees.WorktreeError as exc:
                problem = f"no worktree for this task: {exc}"
        if live and problem is None:  # C1: the prompt is message 0 in the launcher's inbox
            run.conversation = Conversation(ctx, run, idle_s=float(payload.get("idle_s") or 1800))
            run.conversation.open(prompt_message_id=payload.get("prompt_message_id") or f"prompt:{run.operation_id}",
                                  prompt=payload["prompt"])
        run.spawned = SentAt.now(clock)
        try:
            if problem is None:
                proc, leader = process.spawn(argv=argv, cwd=folder, env=env, op_dir=run.op_dir,
                                             stdin_text=payload["prompt"] if via_stdin else None, inbox=live)
        except OSError as exc:
            problem = f"spawn failed: {exc}"
            if run.worktree is not None and not run.worktree.get("reused"):  # nothing ran in it: it goes again
                worktrees.remove(run.worktree, expected_head=run.worktree["base"], delete_branch=True)
        if problem is not None:
            facts = final_facts(process_started=False, stop_reason="refused", lease_id=run.deadline.terms.lease_id,
                                runtime_s=0.0, output_tail=problem)
            ctx.store.mark_ended(run.operation_id, final=facts, wall=clock.wall(), outbox=[
                receipt_item(ctx.identity, operation_id=run.operation_id, kind="final", facts=facts, slept=slept)])
            ctx.wake_sender()
            return
        faults.fault("after_spawn_before_pid_commit")
        run.proc, run.leader = proc, leader
        # The turn's marker goes first: a live conversation's ``running`` task no longer
        # holds its session busy (C6), so the marker must already do so (no blip, S3).
        outbox = [marker_item(ctx.identity, session_id=str(session_id), turn_id=turn_id, state="running",
                              deep_research=payload.get("deep_research", False))] if turn_id else []
        outbox.append(receipt_item(ctx.identity, operation_id=run.operation_id, kind="running",
                                   facts={"pid": leader.pid, "pgid": leader.pid,
                                          "process_start_time": leader.create_time},
                                   slept=slept_s(run.granted, clock)))
        ctx.store.mark_running(run.operation_id, pid=leader.pid, pgid=leader.pid, start_time=leader.create_time,
                               spawned_mono=run.spawned.monotonic, spawned_wall=run.spawned.wall, outbox=outbox)
        ctx.wake_sender()
        log.info("operation %s: agent started (launcher pid %s) in %s", run.operation_id, leader.pid, folder)
        self.watch_to_end(run)

    def watch_to_end(self, run: Run) -> None:
        """The renewer, the watch, the final receipt (J1)."""
        self.idle_guard.acquire()
        try:
            self.renewer.start(run)
            self.watch(run)
        finally:
            self.idle_guard.release()
        self.finish(run)

    # --- a live conversation a previous worker started (C3, X3) -------------------------------

    def adopt(self, record: dict) -> bool:
        """X3 as it applies to a live conversation: the agent a previous worker of this
        boot started is still the one recorded (pid and start time), its lease deadline has
        not passed and this worker's clock is the system's (the recorded monotonic times
        are comparable): it is watched again here instead of stopped, so the owner's
        conversation survives a worker crash. Its renewer, inbox (messages recorded but not
        written are written now, once) and final receipt carry on as if never interrupted;
        nothing is spawned. False (recovery settles it as any other) otherwise."""
        ctx, clock = self.ctx, self.ctx.clock
        payload = json.loads(record["payload"])
        if (payload.get("mode") != "conversation" or record["local_state"] != "running" or record["pid"] is None
                or not record["lease_terms"] or record["sent_wall"] is None or record["boot_id"] != ctx.boot
                or not clock.shares_system_time):
            return False
        leader = process.ProcRef(int(record["pid"]), float(record["process_start_time"]))
        deadline = Deadline(LeaseTerms.from_reply(json.loads(record["lease_terms"])),
                            SentAt(record["sent_mono"], record["sent_wall"]))
        if not process.alive(leader) or deadline.phase(clock) != OK:
            return False
        operation_id = record["operation_id"]
        op_dir = ctx.state.op_dir(operation_id)
        known = {int(p): process.ProcRef(int(p), float(t)) for p, t in json.loads(record["descendants"] or "[]")}
        run = Run(operation_id=operation_id, payload=payload, op_dir=op_dir, deadline=deadline,
                  granted=SentAt(record["granted_mono"], record["granted_wall"]), proc=AdoptedLauncher(leader, op_dir),
                  leader=leader, spawned=SentAt(record["spawned_mono"], record["spawned_wall"]),
                  turn_id=record["turn_id"], adopted=True, known=known)
        profile = ctx.config.profiles.get(payload.get("agent"))
        if profile is not None:
            worktree = json.loads(record["worktree"]) if record.get("worktree") else None
            folder = worktree["cwd"] if worktree else os.path.realpath(payload["folder"])
            run.observer = AgentObserver(parser=profile.parser, op_dir=op_dir, folder=folder, worktree=worktree,
                                         prompt=payload["prompt"], record=profile.record_path(op_dir))
            run.observer.resume_git_start()
        run.conversation = Conversation(ctx, run, idle_s=float(payload.get("idle_s") or 1800))
        run.conversation.adopted()
        run.hooks = self.hooks_for(run)
        with ctx.runs_lock:
            if operation_id in ctx.runs:
                return True
            ctx.runs[operation_id] = run
        log.warning("operation %s: live conversation (launcher pid %s) adopted after restart", operation_id,
                    leader.pid)
        threading.Thread(target=self._thread, args=(run,), name=f"run-{operation_id[:8]}", daemon=True).start()
        return True

    def target(self, run: Run) -> process.Target:
        return process.Target(operation_id=run.operation_id, leader=run.leader, pgid=run.leader.pid,
                              spawned_wall=run.spawned.wall, known=tuple(run.known.values()))

    def watch(self, run: Run) -> None:
        """Until the agent ends: deadline (L4), stop requests, descendant snapshots (L8),
        output lines to the run's hooks."""
        clock = self.ctx.clock
        term_sent = False
        last_snapshot = None
        fault_at = clock.monotonic() + FAULT_WHILE_RUNNING_AFTER_S
        follower = run.follower = OutputFollower(run.op_dir) if run.hooks.wants_output else None
        while True:
            if follower is not None:
                for line in follower.read_lines():
                    run.hooks.on_output(line)
            self.observe(run)
            if run.conversation is not None:
                run.conversation.step()
            if run.proc.poll() is not None:
                run.exited = SentAt.now(clock)
                return
            if faults.active_point() == "while_agent_runs" and clock.monotonic() >= fault_at:
                faults.fault("while_agent_runs")
            phase = run.deadline.phase(clock)
            if phase == KILL:
                run.request_stop("deadline")
                log.warning("operation %s: lease deadline reached, killing", run.operation_id)
                run.survivors = process.stop(self.target(run), grace_s=0, term=False, clock=clock)
                return
            if phase == TERM and not term_sent:
                run.request_stop("deadline")
                log.warning("operation %s: lease deadline - kill grace: SIGTERM to the group", run.operation_id)
                process.signal_group(run.leader, run.leader.pid, signal.SIGTERM)
                term_sent = True
            elif run.stop_reason is not None and phase == OK:
                log.info("operation %s: stopping (%s)", run.operation_id, run.stop_reason)
                grace = max(0.0, min(run.deadline.terms.kill_grace_s, run.deadline.remaining(clock)))
                run.survivors = process.stop(self.target(run), grace_s=grace, clock=clock)
                return
            if last_snapshot is None or clock.monotonic() - last_snapshot >= self.snapshot_every_s:
                last_snapshot = clock.monotonic()
                self.snapshot(run)
            clock.wait(run.wake, self.watch_interval_s)
            run.wake.clear()

    def observe(self, run: Run) -> None:
        """G2: feed new output to the parser; G4: offer progress and the new transcript
        entries when something changed (the progress sender posts at most once a second
        from its own thread)."""
        observer = run.observer
        if observer is None:
            return
        observer.poll()
        if self.progress is None or observer.offset == run.progress_offset:
            return
        run.progress_offset = observer.offset
        payload = observer.progress(process.output_tail(run.op_dir))
        entries = observer.entries_since(run.entries_offered)
        if entries:
            run.entries_offered = entries[-1]["n"]
        if payload != run.progress_sent or entries:
            run.progress_sent = payload
            self.progress.offer(run.operation_id, payload, entries)

    def snapshot(self, run: Run) -> None:
        changed = False
        for ref in process.descendants(run.leader):
            if ref.pid not in run.known or run.known[ref.pid] != ref:
                run.known[ref.pid] = ref
                changed = True
        if changed:
            self.ctx.store.save_descendants(run.operation_id, [r.as_list() for r in run.known.values()])

    def _reap(self, run: Run) -> int | None:
        """The launcher's exit status, awaited up to ``REAP_TIMEOUT_S``; None if it lives on."""
        clock = self.ctx.clock
        end = clock.monotonic() + REAP_TIMEOUT_S
        while True:
            code = run.proc.poll()
            if code is not None or clock.monotonic() >= end:
                return code
            clock.wait(None, process.POLL_S)

    def finish(self, run: Run) -> None:
        """Collect the exit facts, clean up leftovers, queue the final receipt (J1)."""
        ctx, clock = self.ctx, self.ctx.clock
        code = self._reap(run)
        seen = SentAt.now(clock)
        survivors = run.survivors
        if survivors is None:
            # The agent ended by itself: leftovers of the task still get the bounded stop.
            grace = run.deadline.terms.kill_grace_s if run.deadline.phase(clock) == OK else 0.0
            survivors = process.stop(self.target(run), grace_s=min(grace, NATURAL_EXIT_STOP_GRACE_S), clock=clock)
        if run.follower is not None:
            for line in run.follower.rest():
                run.hooks.on_output(line)
        extra = {}
        if run.observer is not None:
            # The final receipt says it all, the transcript entries no progress post delivered included.
            confirmed = self.progress.forget(run.operation_id) if self.progress is not None else 0
            run.observer.finish()
            run.observer.record_git_end()
            extra.update(run.observer.final_extras(confirmed))
        extra.update(run.hooks.facts_extra())  # an extension's own facts win over the observer's
        if run.conversation is not None:
            run.conversation.settle()  # the last receipts (delivered, answered) before the final one
            extra = run.conversation.final_extras(extra)
        exit_facts = process.read_json(os.path.join(run.op_dir, "exit.json")) or {}
        # When the agent ended: the launcher's record (more precise than our observation),
        # if its times are comparable with our clock; else when the watch saw it end.
        observed = run.exited or seen
        process_started = True
        if "exit_code" in exit_facts or "signal" in exit_facts:
            exit_code, sig = exit_facts.get("exit_code"), exit_facts.get("signal")
            if clock.shares_system_time:
                ended = SentAt(exit_facts.get("exit_mono", observed.monotonic), exit_facts.get("exit_wall", observed.wall))
            else:
                ended = observed
            if exit_facts.get("spawn_error"):
                process_started = False
        elif code is not None:
            exit_code, sig = (code, None) if code >= 0 else (None, -code)
            ended = observed
        else:
            exit_code, sig, ended = None, None, seen
        within = run.deadline.within(ended.monotonic, ended.wall)
        if run.refused_at is not None:  # ended before the refused renewal took the lease
            within = within and ended.wall < run.refused_at.wall
        faults.fault("after_exit_before_final_receipt")
        facts = final_facts(
            process_started=process_started, exit_code=exit_code, signal_=sig, lease_id=run.deadline.terms.lease_id,
            ended_within_lease=within, runtime_s=ended.wall - run.spawned.wall,
            stop_reason=run.stop_reason or "exit", survivors=survivors, output_tail=process.output_tail(run.op_dir),
            extra=extra,
        )
        outbox = [receipt_item(ctx.identity, operation_id=run.operation_id, kind="final", facts=facts,
                               slept=slept_s(run.granted, clock))]
        if run.turn_id:
            outbox.append(marker_item(ctx.identity, session_id=str(run.payload.get("session_id")), turn_id=run.turn_id,
                                      state="ended", deep_research=run.payload.get("deep_research", False)))
        ctx.store.mark_ended(run.operation_id, final=facts, wall=clock.wall(), outbox=outbox)
        ctx.wake_sender()
        log.info("operation %s: ended (%s, exit %s, signal %s, survivors %d)", run.operation_id, facts["stop_reason"],
                 exit_code, sig, len(survivors))
