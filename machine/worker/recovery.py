"""After a restart: settle what a previous worker left, never run it again (SPEC X3, X4, L8, M8).

For each local record in ``starting`` or ``running``:

- no pid (``starting``): nobody knows whether it spawned: processes carrying its tag are
  stopped and it is reported ``process_started: unknown``, ``stop_reason:
  worker_restart``, and nothing more;
- a live process matching pid and start time (within a tolerance) is the leftover: it is
  stopped (L8), the worker reports ``unknown``, then the final facts
  (``stop_reason: worker_restart``) with the exit status the launcher recorded;
- a leftover that already ended is reported with the launcher's exit status
  (``stop_reason: exit``), or as exit status unknown when none was recorded.

An ``ended`` marker closes the run's session turn. In no case is the operation started
again (X4): the record moves to ``ended``. The one exception to stopping a leftover: a
live conversation's agent still running under its lease is adopted (``adopt``, the
runner's ``Runner.adopt``), watched to its end by this worker and never spawned again.
"""
from __future__ import annotations

import json
import logging
import os

from . import live_agents, process
from .context import WorkerContext
from .conversation import placed_prompts
from .observe import recovered_extras
from .lease import Deadline, LeaseTerms, SentAt, record_slept_s
from .wire import final_facts, marker_item, receipt_item

log = logging.getLogger("runstead.worker")

DEFAULT_KILL_GRACE_S = 1.0  # a record without lease terms: SIGTERM grace for its leftovers
ENDED_LEFTOVER_GRACE_S = 1.0  # a leader already gone: grace cap for what it left behind
EXIT_RECORD_WAIT_S = 2.0  # after stopping a leftover, how long the launcher's exit.json is awaited
EXIT_RECORD_POLL_S = 0.05


def recover(ctx: WorkerContext, adopt=None) -> None:
    """Settle every ``starting``/``running`` record (see the module docstring);
    ``adopt(record)`` returns True for a run it took over (C3)."""
    for record in ctx.store.in_states("starting", "running"):
        try:
            if adopt is not None and adopt(record):
                continue
            recover_one(ctx, record)
        except Exception:
            log.exception("operation %s: recovery failed", record["operation_id"])


def _agent_extras(ctx: WorkerContext, operation_id: str, payload: dict, op_dir: str, worktree: dict | None) -> dict:
    """The agent facts of an operation a previous worker ran: its output file re-parsed
    with the profile's parser, git evidence from the recorded start (observe.py), in its
    worktree for a worktree task (G7)."""
    profile = ctx.config.profiles.get(payload.get("agent"))
    folder = payload.get("folder")
    live = payload.get("mode") == "conversation"  # its prompt is message 0, placed like the others (G4)
    try:
        parser = (live_agents.for_preset(profile.preset).parser if live else profile.parser) if profile else "text"
        return recovered_extras(parser=parser, op_dir=op_dir,
                                folder=os.path.realpath(folder) if isinstance(folder, str) else None,
                                worktree=worktree, prompt=None if live else payload.get("prompt"),
                                record=profile.record_path(op_dir) if profile else None,
                                turn_prompts=placed_prompts(ctx.store.items(operation_id))
                                if live else ())
    except Exception:
        log.exception("agent facts of %s could not be recovered", op_dir)
        return {}


def recover_one(ctx: WorkerContext, record: dict) -> None:
    clock = ctx.clock
    operation_id = record["operation_id"]
    op_dir = ctx.state.op_dir(operation_id)
    payload = json.loads(record["payload"])
    terms = json.loads(record["lease_terms"]) if record["lease_terms"] else None
    grace = float(terms["kill_grace_s"]) if terms else DEFAULT_KILL_GRACE_S
    same_boot = record["boot_id"] == ctx.boot
    known = tuple(process.ProcRef(int(p), float(t)) for p, t in json.loads(record["descendants"] or "[]"))
    slept = record_slept_s(record, clock=clock, boot=ctx.boot)
    items = [receipt_item(ctx.identity, operation_id=operation_id, kind="unknown",
                          facts={"reason": "worker_restart"}, slept=slept)]
    if record["pid"] is None:
        # X3: spawned or not, nobody knows: process_started unknown. Tagged leftovers stop.
        survivors = process.stop(process.Target(operation_id=operation_id, known=known), grace_s=grace, clock=clock)
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
        survivors = process.stop(target, grace_s=grace if leftover else min(grace, ENDED_LEFTOVER_GRACE_S),
                                 clock=clock)
        exit_path = os.path.join(op_dir, "exit.json")
        if leftover:
            # The launcher records the exit status once the agent is gone.
            end = clock.monotonic() + EXIT_RECORD_WAIT_S
            while process.read_json(exit_path) is None and clock.monotonic() < end:
                clock.wait(None, EXIT_RECORD_POLL_S)
        exit_facts = process.read_json(exit_path)
        deadline = None
        if terms and record["sent_wall"] is not None:
            deadline = Deadline(LeaseTerms.from_reply(terms), SentAt(record["sent_mono"], record["sent_wall"]))
        if exit_facts is not None:
            exit_mono = exit_facts.get("exit_mono") if same_boot else None
            # The launcher's times are the system's; a clock that is not cannot judge them.
            comparable = deadline is not None and clock.shares_system_time
            within = deadline.within(exit_mono, exit_facts["exit_wall"]) if comparable else None
            facts = final_facts(
                process_started=not exit_facts.get("spawn_error"), exit_code=exit_facts.get("exit_code"),
                signal_=exit_facts.get("signal"), lease_id=record["lease_id"], ended_within_lease=within,
                runtime_s=(exit_facts["exit_wall"] - (record["spawned_wall"] or exit_facts["exit_wall"])
                           if clock.shares_system_time else None),
                stop_reason="worker_restart" if leftover else "exit", survivors=survivors,
                output_tail=process.output_tail(op_dir),
            )
        else:
            facts = final_facts(process_started=True, lease_id=record["lease_id"], stop_reason="worker_restart",
                                survivors=survivors, output_tail=process.output_tail(op_dir))
    if facts.get("process_started") is not False:
        worktree = json.loads(record["worktree"]) if record.get("worktree") else None
        facts = {**_agent_extras(ctx, operation_id, payload, op_dir, worktree), **facts}  # G2-G5, G7 from what it left
    items.append(receipt_item(ctx.identity, operation_id=operation_id, kind="final", facts=facts, slept=slept))
    if record["turn_id"] and payload.get("session_id"):
        items.append(marker_item(ctx.identity, session_id=str(payload["session_id"]), turn_id=record["turn_id"],
                                 state="ended", deep_research=payload.get("deep_research", False)))
    ctx.store.mark_ended(operation_id, final=facts, wall=clock.wall(), outbox=items)
    ctx.wake_sender()
    log.info("operation %s: recovered after restart (%s); never started again (X4)", operation_id,
             facts["stop_reason"])
