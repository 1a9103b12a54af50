"""One operation, from its ``start`` message to its final receipt (SPEC W4, W8, L1, L4, L8,
X1, X2, J1, M8), and the worker's thread model.

``Runner.start`` runs each operation in its own thread:

1. local checks (W4: profile, folder inside the allowed roots and the grant root; G7: a
   worktree task's folder in a git work tree) and a slot (W8: at most ``max_concurrent``
   agents); a refused start is a final receipt with ``process_started: false``,
   ``stop_reason: refused``;
2. the lease (L1: no lease, no start);
3. ``starting`` committed with ``spawn_count = 1`` (X1) and, for a worktree task, where
   its worktree goes; the worktree made (G7); the spawn through the launcher,
   pid, group and start time committed right after (X2), the ``running`` marker (M8);
4. the run loop (``watch``): each pass steps the run's parts (``run.py``): the process
   (output to the hooks and the observer, descendant snapshots, L8), progress (G4), the
   live conversation (C1-C6) and the lease (L4: SIGTERM at deadline - kill grace); then
   the agent's exit, the deadline and stop requests (cancel, refused renewal, shutdown)
   are acted on; while the lease part's renewal thread keeps the lease (L3, L5, L10);
5. the exit facts, the bounded stop of leftovers and the final receipt (J1).

Per-run extension points (``run.RunHooks``): the agent's output lines are fed to
``hooks.on_output(line)`` while it runs (a stream parser), and ``hooks.facts_extra()``
is merged into the final facts (never over a J1 key).

Threads (who runs what, who wakes whom). Each thread blocks on one thing only, so a
slow service or a slow stop never delays another's work (W8); every wait goes through
the ``Clock`` (tests move fake time):

- main (``loop.Worker.run``): the coordinator; waits on ``ctx.coordinator_wake`` (set when
  a run or integration ends, a signal comes, the sender sends) or ``main_tick_s``; once a
  second it looks at every run (``Runner.look``, ``Run.look``: L4's check), waking a
  renewal thread whose renewal is due and a quiet conversation's run loop that has
  something to see, so a run that waits wakes none of its threads each second;
- ``poller``: the long-poll (``poller.py``); it asks a run to stop (cancel:
  ``Run.request_stop``) and hands a conversation message to the run's conversation part
  (``ConversationPart.take``); both set the run's ``work_arrived``; it waits between
  failed pulls on ``ctx.draining``;
- ``sender``: the outbox (``sender.py``); waits on ``ctx.outbox_wake``, which whoever
  queues a row sets (``ctx.wake_sender``);
- ``progress``: the progress posts (``progress.py``); waits on ``ProgressSender.offered``,
  set by the run loops' offers;
- ``run-<operation>``, one per run: steps 1-5 above; it waits for a slot on
  ``Runner.slot_released``, between grant attempts on ``ctx.draining``, and in its run
  loop on ``Run.work_arrived`` until the nearest instant a part needs a look
  (``Run.next_due``: the next look at the process, at most ``WATCH_INTERVAL_S`` away,
  ``QUIET_WATCH_INTERVAL_S`` for a quiet conversation, which the coordinator wakes);
- ``renew-<operation>``, one per running agent (``renewer.LeasePart``): the renewals;
  it sleeps on ``LeasePart.wake`` until a renewal is due and ends once the agent ended or the
  run released its lease; a refusal asks its run to stop;
- ``integrate-<id>``, one per merge or discard (``integrate.py``).

``ctx.stop_all`` (second signal, revoked token) asks every run to stop; ``ctx.revoked``
and ``ctx.exiting`` end the sender, ``ctx.draining`` the poller and queued starts.
"""
from __future__ import annotations

import json
import logging
import os
import threading
import uuid
from collections.abc import Callable

from machine.protocol import Backoff
from machine.protocol.shapes import StartPayload

from . import approvals, faults, live_agents, process, worktrees
from .conversation import ConversationPart
from .config import check_start
from .presets import ResumeUnsupported
from .context import WorkerContext
from .lease import KILL, OK, Deadline, LeaseTerms, SentAt, slept_s
from .run import AdoptedLauncher, Run, RunHooks
from .wire import final_facts, marker_item, receipt_item

log = logging.getLogger("runstead.worker")

SLOT_POLL_S = 0.2  # a start waiting for a slot (W8) re-checks draining this often
LEASE_RETRY_CAP_S = 5.0  # a grant request that met network trouble is retried within this
REAP_TIMEOUT_S = 5.0  # how long the exit status of a stopped launcher is awaited
NATURAL_EXIT_STOP_GRACE_S = 2.0  # leftovers of an agent that exited by itself: SIGTERM grace cap
FAULT_WHILE_RUNNING_AFTER_S = 0.3  # crash tests: "while_agent_runs" fires this long after spawn
LOOK_EVERY_S = 1.0  # L4: the coordinator looks at every run this often (``Runner.look``)


class Runner:
    """Starts and runs operations (one thread each). ``hooks_for(run)`` makes each run's
    ``RunHooks`` (issue 11: agent presets and stream parsers plug in here); ``progress``
    is the worker's ``ProgressSender`` (G4), or None."""

    def __init__(self, ctx: WorkerContext, *, backoff: Backoff, hooks_for: Callable[[Run], RunHooks] | None = None,
                 slot_poll_s: float = SLOT_POLL_S, lease_retry_cap_s: float = LEASE_RETRY_CAP_S, idle_guard=None,
                 progress=None):
        self.ctx = ctx
        self.progress = progress
        self.backoff = backoff
        self.hooks_for = hooks_for or (lambda run: RunHooks())
        self.slot_poll_s = slot_poll_s
        self.lease_retry_cap_s = lease_retry_cap_s
        self.idle_guard = idle_guard or process.IdleSleepGuard(enabled=ctx.config.prevent_idle_sleep)
        self.slots = threading.BoundedSemaphore(ctx.config.max_concurrent)
        self.slot_released = threading.Event()  # a run gave its slot back (W8)
        self.next_look: float | None = None  # monotonic; None: at the first ``look``

    def look(self) -> None:
        """SPEC L4 for every run at once, from the coordinator's thread: at most every
        ``LOOK_EVERY_S`` (monotonic seconds), ``Run.look`` for each run in flight, which
        wakes the threads that have something to do (issue 43: 100 waiting conversations
        wake no thread each second)."""
        now = self.ctx.clock.monotonic()
        if self.next_look is not None and now < self.next_look:
            return
        self.next_look = now + LOOK_EVERY_S
        with self.ctx.runs_lock:
            runs = list(self.ctx.runs.values())
        for run in runs:
            try:
                run.look()
            except Exception:  # a run in transition: its own threads still look by themselves
                log.exception("operation %s: look failed", run.operation_id)

    # --- threads ---------------------------------------------------------------------------

    def new_run(self, operation_id: str, payload: StartPayload) -> Run:
        """A ``Run`` of this worker, its hooks made (``hooks_for``)."""
        run = Run(self.ctx, operation_id, payload, progress=self.progress)
        run.hooks = self.hooks_for(run)
        return run

    def start(self, operation_id: str, payload: StartPayload) -> None:
        """Run ``operation_id`` in a new thread unless it is already in flight here."""
        ctx = self.ctx
        with ctx.runs_lock:
            if operation_id in ctx.runs:
                return
            run = ctx.runs[operation_id] = self.new_run(operation_id, payload)
        self._launch(run, self.execute)

    def _launch(self, run: Run, body: Callable[[Run], None]) -> None:
        """The run's thread (``run-<operation>``): ``body(run)``, then the run is over."""
        threading.Thread(target=self._thread, args=(run, body), name=f"run-{run.operation_id[:8]}", daemon=True).start()

    def _thread(self, run: Run, body: Callable[[Run], None]) -> None:
        try:
            body(run)
        except faults.InjectedCrash as crash:
            log.warning("operation %s: injected crash at %s (tests)", run.operation_id, crash)
        except Exception:
            log.exception("operation %s: runner failed", run.operation_id)
        finally:
            run.lease.release()
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
        """Steps 1-5 of the module docstring for a run received here."""
        ctx = self.ctx
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
            folder = run.process.worktree["cwd"]
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
        # A live conversation's prompt is its message 0: its entry (with its seq) comes from
        # the conversation part, like every message's (G4).
        observer = run.process.observe(parser=live_agents.for_preset(profile.preset).parser if live else profile.parser,
                                       folder=folder, prompt=None if live else run.payload["prompt"],
                                       record=profile.record_path(run.op_dir))
        observer.record_git_start()  # G5, before the lease: a slow git costs no lease time
        # W8: at most max_concurrent agents; a queued start waits here, unleased.
        while not self.slots.acquire(blocking=False):
            if ctx.draining.is_set():
                return
            ctx.clock.wait(self.slot_released, self.slot_poll_s)
            self.slot_released.clear()
        try:
            if ctx.draining.is_set():
                return  # stays 'received': the next worker start takes it up
            asks = profile.asks_owner(live=live)
            if not self.acquire_lease(run, asks=asks):
                return
            if asks:
                argv, env = self.asking(run, argv, env, command if profile.asks_through_settings() else None)
            self.spawn_and_watch(run, argv, folder, profile.prompt_via == "stdin" and not live, env, live=live)
        finally:
            self.slots.release()
            self.slot_released.set()

    def plan_worktree(self, run: Run, folder: str):
        """G7: the repository of ``folder`` and the worktree this run will make (kept on
        ``run.process.worktree``), or the refused start (``not_a_git_repository`` outside a work
        tree or before its first commit)."""
        repo = worktrees.find_repo(folder)
        if repo is None or repo.head is None:
            why = "is not inside a git work tree" if repo is None else "is in a git repository without any commit"
            return self.refuse(run, f"folder {folder} {why}; a worktree task needs a commit to branch from",
                               code="not_a_git_repository")
        task_id = str(run.payload.get("task_id") or run.operation_id)
        try:
            run.process.worktree = {**worktrees.plan(repo, state_path=self.ctx.state.path, operation_id=run.operation_id,
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
        run.process.worktree = {**info, "cwd": cwd, "task_id": task_id, "start": start, "reused": True}
        return None

    def acquire_lease(self, run: Run, *, asks: bool = False) -> bool:
        """L1: no lease, no start. Retries network trouble (backoff capped at
        ``lease_retry_cap_s``); a 409 is final. ``asks``: the profile's approvals are
        ``ask`` (Q5: the grant brings an approval credential)."""
        ctx, clock = self.ctx, self.ctx.clock
        service = ctx.connect()
        attempt = 0
        try:
            while not ctx.draining.is_set():
                if ctx.store.get(run.operation_id)["cancel_requested"]:
                    self.refuse(run, "cancelled before start", stop_reason="cancel")
                    return False
                sent = SentAt.now(clock)
                if asks:
                    answer = service.lease_grant(run.operation_id, approval_credential=True)
                else:
                    answer = service.lease_grant(run.operation_id)
                if answer.kind == "ok":
                    body = dict(answer.body)
                    run.lease.approval = body.pop("approval", None)  # Q5: never stored, never logged
                    terms = LeaseTerms.from_reply(body)
                    deadline = Deadline(terms, sent)
                    if deadline.phase(clock) != OK:
                        log.warning("operation %s: lease reply came too late to start; asking again", run.operation_id)
                        continue
                    run.lease.deadline, run.lease.granted = deadline, sent
                    ctx.store.save_lease(run.operation_id, terms=body, sent_mono=sent.monotonic,
                                         sent_wall=sent.wall, boot=ctx.boot, granted=True)
                    run.lease.record_deadline()
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
        rebuilds the argv with it; ``command`` None: the argv stays, as for opencode's
        bridge, which asks itself), and the credential
        of the lease answer in the environment (``approvals.py``). A service that sent
        no credential (older than Q5) gets the run as with ``approvals = "off"``."""
        approval = run.lease.approval or {}
        if not isinstance(approval.get("credential"), str) or not approval["credential"]:
            log.warning("operation %s: the service sent no approval credential; what would prompt is denied",
                        run.operation_id)
            return argv, env
        wait_s = float(approval.get("wait_s") or 600)
        env = {**env, **approvals.asking_env(credential=approval["credential"], server=self.ctx.server,
                                             op_dir=run.op_dir, wait_s=wait_s)}
        return (command(approvals.settings_args(wait_s=wait_s)) if command is not None else argv), env

    # --- the agent (X1, X2, L4, L8, J1) --------------------------------------------------------

    def spawn_and_watch(self, run: Run, argv: list[str], folder: str, via_stdin: bool, env: dict,
                        live: bool = False) -> None:
        """Step 3 (X1, X2, G7, M8, C1), then the run loop and the final receipt."""
        ctx, clock = self.ctx, self.ctx.clock
        payload, lease, agent = run.payload, run.lease, run.process
        session_id = payload.get("session_id")
        run.turn_id = turn_id = str(uuid.uuid4()) if session_id else None
        slept = slept_s(lease.granted, clock)
        ctx.store.mark_starting(run.operation_id, turn_id=turn_id, wall=clock.wall(), worktree=agent.worktree, outbox=[
            receipt_item(ctx.identity, operation_id=run.operation_id, kind="starting",
                         facts={"lease_id": lease.deadline.terms.lease_id}, slept=slept)])
        ctx.wake_sender()
        faults.fault("after_starting_commit_before_spawn")
        problem = None
        worktree = agent.worktree
        if worktree is not None and not worktree.get("reused"):
            try:
                worktrees.create(worktree)  # G7: recorded above, so a restart knows it
            except worktrees.WorktreeError as exc:
                problem = f"no worktree for this task: {exc}"
        if live and problem is None:  # C1: the prompt is message 0 in the launcher's inbox
            run.conversation = ConversationPart(run, idle_s=float(payload.get("idle_s") or 1800),
                                                agent=self._live_agent(payload))
            run.conversation.open(prompt_message_id=payload.get("prompt_message_id") or f"prompt:{run.operation_id}",
                                  prompt=payload["prompt"], folder=folder)
        agent.spawned = SentAt.now(clock)
        try:
            if problem is None:
                proc, leader = process.spawn(argv=argv, cwd=folder, env=env, op_dir=run.op_dir,
                                             stdin_text=payload["prompt"] if via_stdin else None, inbox=live)
        except OSError as exc:
            problem = f"spawn failed: {exc}"
            if worktree is not None and not worktree.get("reused"):  # nothing ran in it: it goes again
                worktrees.remove(worktree, expected_head=worktree["base"], delete_branch=True)
        if problem is not None:
            facts = final_facts(process_started=False, stop_reason="refused", lease_id=lease.deadline.terms.lease_id,
                                runtime_s=0.0, output_tail=problem)
            ctx.store.mark_ended(run.operation_id, final=facts, wall=clock.wall(), outbox=[
                receipt_item(ctx.identity, operation_id=run.operation_id, kind="final", facts=facts, slept=slept)])
            ctx.wake_sender()
            return
        faults.fault("after_spawn_before_pid_commit")
        agent.proc, agent.leader = proc, leader
        # The turn's marker goes first: a live conversation's ``running`` task no longer
        # holds its session busy (C6), so the marker must already do so (no blip, S3).
        outbox = [marker_item(ctx.identity, session_id=str(session_id), turn_id=turn_id, state="running",
                              deep_research=payload.get("deep_research", False))] if turn_id else []
        outbox.append(receipt_item(ctx.identity, operation_id=run.operation_id, kind="running",
                                   facts={"pid": leader.pid, "pgid": leader.pid,
                                          "process_start_time": leader.create_time},
                                   slept=slept_s(lease.granted, clock)))
        ctx.store.mark_running(run.operation_id, pid=leader.pid, pgid=leader.pid, start_time=leader.create_time,
                               spawned_mono=agent.spawned.monotonic, spawned_wall=agent.spawned.wall, outbox=outbox)
        ctx.wake_sender()
        log.info("operation %s: agent started (launcher pid %s) in %s", run.operation_id, leader.pid, folder)
        self.watch_to_end(run)

    def watch_to_end(self, run: Run) -> None:
        """The renewal thread, the run loop, the final receipt (J1)."""
        self.idle_guard.acquire()
        try:
            run.lease.start_renewal()
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
        conversation survives a worker crash. Its renewal, inbox (messages recorded but not
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
            log.warning("operation %s: live conversation not adopted: launcher %s %s, lease %s (%.1f s left)",
                        record["operation_id"], leader.pid, "alive" if process.alive(leader) else "gone",
                        deadline.phase(clock), deadline.remaining(clock))
            return False
        operation_id = record["operation_id"]
        with ctx.runs_lock:
            if operation_id in ctx.runs:
                return True
            run = ctx.runs[operation_id] = self.new_run(operation_id, payload)
        run.lease.deadline, run.lease.granted = deadline, SentAt(record["granted_mono"], record["granted_wall"])
        agent = run.process
        agent.proc, agent.leader = AdoptedLauncher(leader, run.op_dir), leader
        agent.spawned = SentAt(record["spawned_mono"], record["spawned_wall"])
        agent.known = {int(p): process.ProcRef(int(p), float(t)) for p, t in json.loads(record["descendants"] or "[]")}
        run.turn_id = record["turn_id"]
        profile = ctx.config.profiles.get(payload.get("agent"))
        if profile is not None:
            agent.worktree = json.loads(record["worktree"]) if record.get("worktree") else None
            folder = agent.worktree["cwd"] if agent.worktree else os.path.realpath(payload["folder"])
            agent.observe(parser=live_agents.for_preset(profile.preset).parser, folder=folder,
                          prompt=None,  # the prompt is message 0 (G4)
                          record=profile.record_path(run.op_dir)).resume_git_start()
        run.conversation = ConversationPart(run, idle_s=float(payload.get("idle_s") or 1800),
                                            agent=self._live_agent(payload))
        run.conversation.adopted()
        log.warning("operation %s: live conversation (launcher pid %s) adopted after restart", operation_id,
                    leader.pid)
        self._launch(run, self._watch_adopted)
        return True

    def _live_agent(self, payload: dict):
        """C1, C11: the adapter of the CLI a live conversation runs (``live_agents``), by
        its profile's preset."""
        profile = self.ctx.config.profiles.get(payload.get("agent"))
        return live_agents.for_preset(profile.preset if profile is not None else None)

    def _watch_adopted(self, run: Run) -> None:
        with self.slots:  # W8: an adopted agent holds a slot like any other
            self.watch_to_end(run)

    # --- the run loop (L4, L8, G4, C1-C6) ---------------------------------------------------------

    def watch(self, run: Run) -> None:
        """Until the agent ends: each pass steps the run's parts (``Run.parts``: output to
        the hooks and the observer, descendant snapshots (L8), progress (G4), the live
        conversation (C1-C6), the lease's SIGTERM at deadline - kill grace (L4)), then
        acts on the agent's exit, a lost lease (SIGKILL, L4) and stop requests. When no
        part found work it waits on ``run.work_arrived`` until the nearest ``next_due``."""
        clock = self.ctx.clock
        fault_at = clock.monotonic() + FAULT_WHILE_RUNNING_AFTER_S
        agent, lease = run.process, run.lease
        agent.begin_watch()
        while True:
            now = clock.monotonic()
            found = agent.step(now)
            found = run.progress.step(now) or found
            if run.conversation is not None:
                found = run.conversation.step(now) or found
            if agent.ended():
                return
            if faults.active_point() == "while_agent_runs" and clock.monotonic() >= fault_at:
                faults.fault("while_agent_runs")
            found = lease.step(now) or found
            if lease.seen == KILL:
                agent.stop(grace_s=0, term=False)
                return
            if run.stop_reason is not None and lease.seen == OK:
                log.info("operation %s: stopping (%s)", run.operation_id, run.stop_reason)
                agent.stop(grace_s=max(0.0, min(lease.deadline.terms.kill_grace_s, lease.deadline.remaining(clock))))
                return
            if not found:
                clock.wait(run.work_arrived, run.next_due(now) - clock.monotonic())
                run.work_arrived.clear()

    def _reap(self, run: Run) -> int | None:
        """The launcher's exit status, awaited up to ``REAP_TIMEOUT_S``; None if it lives on."""
        clock = self.ctx.clock
        end = clock.monotonic() + REAP_TIMEOUT_S
        while True:
            code = run.process.proc.poll()
            if code is not None or clock.monotonic() >= end:
                return code
            clock.wait(None, process.POLL_S)

    def finish(self, run: Run) -> None:
        """Collect the exit facts, clean up leftovers, queue the final receipt (J1)."""
        ctx, clock = self.ctx, self.ctx.clock
        agent, lease = run.process, run.lease
        code = self._reap(run)
        seen = SentAt.now(clock)
        survivors = agent.survivors
        if survivors is None:
            # The agent ended by itself: leftovers of the task still get the bounded stop.
            grace = lease.deadline.terms.kill_grace_s if lease.deadline.phase(clock) == OK else 0.0
            survivors = agent.stop(grace_s=min(grace, NATURAL_EXIT_STOP_GRACE_S))
        if agent.follower is not None:
            for line in agent.follower.rest():
                run.hooks.on_output(line)
        extra = {}
        if agent.observer is not None:
            # The final receipt says it all, the transcript entries no progress post delivered included.
            confirmed = run.progress.forget()
            agent.observer.finish()
            agent.observer.record_git_end()
            extra.update(agent.observer.final_extras(confirmed))
        extra.update(run.hooks.facts_extra())  # an extension's own facts win over the observer's
        if run.conversation is not None:
            run.conversation.settle()  # the last receipts (delivered, answered) before the final one
            extra = run.conversation.final_extras(extra)
        exit_facts = process.read_json(os.path.join(run.op_dir, "exit.json")) or {}
        # When the agent ended: the launcher's record (more precise than our observation),
        # if its times are comparable with our clock; else when the run loop saw it end.
        observed = agent.exited or seen
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
        within = lease.deadline.within(ended.monotonic, ended.wall)
        if lease.refused_at is not None:  # ended before the refused renewal took the lease
            within = within and ended.wall < lease.refused_at.wall
        faults.fault("after_exit_before_final_receipt")
        facts = final_facts(
            process_started=process_started, exit_code=exit_code, signal_=sig, lease_id=lease.deadline.terms.lease_id,
            ended_within_lease=within, runtime_s=ended.wall - agent.spawned.wall,
            stop_reason=run.stop_reason or "exit", survivors=survivors, output_tail=process.output_tail(run.op_dir),
            extra=extra,
        )
        outbox = [receipt_item(ctx.identity, operation_id=run.operation_id, kind="final", facts=facts,
                               slept=slept_s(lease.granted, clock))]
        if run.turn_id:
            outbox.append(marker_item(ctx.identity, session_id=str(run.payload.get("session_id")), turn_id=run.turn_id,
                                      state="ended", deep_research=run.payload.get("deep_research", False)))
        ctx.store.mark_ended(run.operation_id, final=facts, wall=clock.wall(), outbox=outbox)
        ctx.wake_sender()
        log.info("operation %s: ended (%s, exit %s, signal %s, survivors %d)", run.operation_id, facts["stop_reason"],
                 exit_code, sig, len(survivors))
