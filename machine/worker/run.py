"""One run as parts, each a step (SPEC X2, L4, L8, G2, G4, J1; the lease: ``renewer.py``,
the conversation: ``conversation.py``).

A ``Run`` is one operation this worker process handles. Its state lives in parts, each
owning one concern and offering ``step(now) -> bool`` (``now``: the clock's monotonic
seconds; True when the step found work, so the run loop looks again at once instead of
waiting, as healthchecks' ``sendalerts`` does) and ``next_due(now)`` (the monotonic
instant it next needs a look, or None):

- ``LeasePart`` (``renewer.py``): deadline, grant, renewal thread (L1, L3, L4, L5, L9, L10);
- ``ProcessPart``: the launcher, its identity, descendants and output (X2, L8, G2);
- ``ProgressPart``: what was offered to the progress sender (G4);
- ``ConversationPart`` (``conversation.py``): a live conversation's inbox and the
  messages the poller hands it (C1-C6); None for a headless run.

The run loop (``Runner.watch``) steps them in that order and waits on the run's one
event, ``work_arrived`` (a stop request or a conversation message), until the nearest
``next_due``.
"""
from __future__ import annotations

import logging
import os
import signal
import threading

from . import process
from .lease import SentAt
from .observe import MAX_READ_PER_POLL, AgentObserver
from .process import OutputFollower
from .renewer import LeasePart
from machine.protocol.shapes import StartPayload

log = logging.getLogger("runstead.worker")

WATCH_INTERVAL_S = 0.2  # the agent's exit and output are looked at this often (L4 asks >= once a second)
# A live conversation between turns (nothing placed, written or taken: the agent waits on
# its stdin) sleeps: a message taken wakes it, and so does the coordinator's once-a-second
# look (``Run.look``) when its deadline phase, its launcher or its files change; it looks
# by itself only this often (issue 43: an open conversation that waits costs nothing).
QUIET_WATCH_INTERVAL_S = 30.0
DESCENDANT_SNAPSHOT_S = 1.0  # L8: how often descendants are recorded
# ... while the agent waits on its stdin between turns: on a grid of this many monotonic
# seconds, so the quiet runs of a worker share one process-tree scan (``process._shared_tree``)
QUIET_DESCENDANT_SNAPSHOT_S = 30.0


class RunHooks:
    """Per-run extension points; the default does nothing.

    - ``wants_output``: when True, every complete line the agent writes (stdout and
      stderr, decoded UTF-8) is passed to ``on_output`` from the run's thread;
    - ``facts_extra()``: facts merged into the final receipt's facts (J1 keys win).
    """

    wants_output = False

    def on_output(self, line: str) -> None:
        pass

    def facts_extra(self) -> dict:
        return {}


class Run:
    """One operation this worker process is handling: its message (``payload``), its
    folder under the state directory (``op_dir``), its parts (module docstring), the
    session turn it holds (``turn_id``, M8) and the first stop asked of it
    (``stop_reason``, J1). ``progress``: the worker's ``ProgressSender`` (G4), or None."""

    def __init__(self, ctx, operation_id: str, payload: StartPayload, *, progress=None):
        self.ctx = ctx
        self.operation_id = operation_id
        self.payload = payload
        self.op_dir = ctx.state.op_dir(operation_id)
        self.hooks = RunHooks()
        self.lease = LeasePart(self)
        self.process = ProcessPart(self)
        self.progress = ProgressPart(self, progress)
        self.conversation = None  # a conversation.ConversationPart for a live conversation (C1-C6)
        self.turn_id: str | None = None
        self.stop_reason: str | None = None
        self.work_arrived = threading.Event()  # something to do for this run: a stop, a message
        self.lock = threading.Lock()

    def look(self) -> None:
        """The coordinator's look at this run, once a second (``Runner.look``: SPEC L4's
        check for every run at once, so no run's threads wake each second for nothing,
        issue 43): a renewal due (by the larger of the monotonic and wall time elapsed,
        L3: a sleep counts) wakes the renewal thread; a quiet conversation's run loop is
        woken when its lease reached its next phase, its launcher ended, or the launcher's
        ``written.log`` or the agent's output grew."""
        lease, agent, conversation = self.lease, self.process, self.conversation
        if lease.deadline is None or agent.proc is None:
            return
        clock = self.ctx.clock
        if lease.renewal_due(clock):
            lease.wake.set()
        if conversation is not None and conversation.quiet and (
                lease.deadline.phase(clock) != lease.seen or agent.proc.poll() is not None
                or conversation.files() != conversation.files_seen):
            self.work_arrived.set()

    def request_stop(self, reason: str, at: SentAt | None = None) -> None:
        """Ask the run loop to stop the agent with J1 ``stop_reason`` ``reason``; the first
        reason wins. ``at``: when the refusal that took the lease was sent (``ended_within_lease``)."""
        with self.lock:
            if self.stop_reason is None:
                self.stop_reason = reason
                if at is not None and self.lease.refused_at is None:
                    self.lease.refused_at = at
        self.work_arrived.set()

    def parts(self) -> list:
        """The parts, in the order the run loop steps them (the lease after the exit check)."""
        return [p for p in (self.process, self.progress, self.conversation, self.lease) if p is not None]

    def next_due(self, now: float) -> float:
        """The nearest instant (monotonic seconds) a part needs a look."""
        return min(due for due in (p.next_due(now) for p in self.parts()) if due is not None)


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


class ProcessPart:
    """The agent's launcher and what it leaves (SPEC X2, L4, L8, G2, J1): ``proc`` (a
    ``Popen`` or an ``AdoptedLauncher``), ``leader`` (its identity, leader of its group),
    ``spawned``/``exited`` (``SentAt``), ``known`` descendants (pid -> ``ProcRef``),
    ``survivors`` of the stop, the ``worktree`` it runs in (G7: ``worktrees.plan``), the
    ``observer`` of its stream (G2-G5) and the ``follower`` feeding the run's hooks.

    ``step(now)``: new output lines to the hooks, new output to the observer, and every
    ``snapshot_every_s`` the descendants recorded (L8); True when the observer's read
    stopped at its bound (more output is waiting)."""

    def __init__(self, run: Run, *, watch_interval_s: float = WATCH_INTERVAL_S,
                 snapshot_every_s: float = DESCENDANT_SNAPSHOT_S):
        self.run, self.clock = run, run.ctx.clock
        self.watch_interval_s, self.snapshot_every_s = watch_interval_s, snapshot_every_s
        self.proc = None
        self.leader: process.ProcRef | None = None
        self.spawned: SentAt | None = None
        self.exited: SentAt | None = None  # when the run loop saw the launcher end by itself
        self.survivors: list | None = None
        self.known: dict = {}
        self.worktree: dict | None = None
        self.observer: AgentObserver | None = None
        self.follower: OutputFollower | None = None
        self.next_snapshot: float | None = None

    def observe(self, *, parser: str, folder: str, prompt: str | None, record: str | None) -> AgentObserver:
        """G2-G5: the observer of this run's stream and git evidence."""
        self.observer = AgentObserver(parser=parser, op_dir=self.run.op_dir, folder=folder, worktree=self.worktree,
                                      prompt=prompt, record=record)
        return self.observer

    def begin_watch(self) -> None:
        """The run loop starts: follow the output for hooks that want it."""
        self.follower = OutputFollower(self.run.op_dir) if self.run.hooks.wants_output else None

    def step(self, now: float) -> bool:
        more = False
        if self.follower is not None:
            for line in self.follower.read_lines():
                self.run.hooks.on_output(line)
        if self.observer is not None:
            offset = self.observer.offset
            self.observer.poll()
            more = self.observer.offset - offset >= MAX_READ_PER_POLL
        if self.next_snapshot is None or now >= self.next_snapshot:
            quiet = self.run.conversation is not None and self.run.conversation.quiet
            self.next_snapshot = (now + self.snapshot_every_s if not quiet else
                                  (now // QUIET_DESCENDANT_SNAPSHOT_S + 1) * QUIET_DESCENDANT_SNAPSHOT_S)
            self.snapshot()
        return more

    def next_due(self, now: float) -> float:
        """The next look at the launcher (its exit has no event) or the next snapshot;
        a quiet conversation (``ConversationPart.quiet``) is looked at less often."""
        quiet = self.run.conversation is not None and self.run.conversation.quiet
        look = now + max(self.watch_interval_s, QUIET_WATCH_INTERVAL_S if quiet else 0.0)
        return look if self.next_snapshot is None else min(look, self.next_snapshot)

    def ended(self) -> bool:
        """True once the launcher ended by itself (``exited`` notes when it was seen)."""
        if self.proc.poll() is None:
            return False
        self.exited = SentAt.now(self.clock)
        return True

    def snapshot(self) -> None:
        """L8: record descendants not seen before (a restart stops them too)."""
        changed = False
        for ref in process.descendants(self.leader, shared=True):
            if ref.pid not in self.known or self.known[ref.pid] != ref:
                self.known[ref.pid] = ref
                changed = True
        if changed:
            self.run.ctx.store.save_descendants(self.run.operation_id, [r.as_list() for r in self.known.values()])

    def target(self) -> process.Target:
        return process.Target(operation_id=self.run.operation_id, leader=self.leader, pgid=self.leader.pid,
                              spawned_wall=self.spawned.wall, known=tuple(self.known.values()))

    def signal_term(self) -> None:
        """L4: SIGTERM to the agent's group (its leader verified)."""
        process.signal_group(self.leader, self.leader.pid, signal.SIGTERM)

    def stop(self, *, grace_s: float, term: bool = True) -> list[dict]:
        """The bounded stop of everything the task started (L4, L8); its survivors."""
        self.survivors = process.stop(self.target(), grace_s=grace_s, term=term, clock=self.clock)
        return self.survivors


class ProgressPart:
    """What this run offered the progress sender (SPEC G4): the last progress payload
    (offers go only on change), the output offset it was read at and the highest
    transcript entry offered. ``step(now)``: when the observer read new output, offer
    the progress and the new entries (the sender posts at most once a second from its
    own thread, W8); True when it offered."""

    def __init__(self, run: Run, sender=None):
        self.run, self.sender = run, sender
        self.sent: dict | None = None
        self.offset = 0  # output bytes seen at the last offer (none yet: no progress)
        self.entries_offered = 0

    def step(self, now: float) -> bool:
        observer = self.run.process.observer
        if self.sender is None or observer is None or observer.offset == self.offset:
            return False
        self.offset = observer.offset
        payload = observer.progress(process.output_tail(self.run.op_dir))
        entries = observer.entries_since(self.entries_offered)
        if entries:
            self.entries_offered = entries[-1]["n"]
        if payload == self.sent and not entries:
            return False
        self.sent = payload
        self.sender.offer(self.run.operation_id, payload, entries)
        return True

    def next_due(self, now: float) -> None:
        return None  # it follows the process part's looks

    def forget(self) -> int:
        """The run ended: the highest entry number the service confirmed (0: none)."""
        return self.sender.forget(self.run.operation_id) if self.sender is not None else 0
