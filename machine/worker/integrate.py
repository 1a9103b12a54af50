"""Merge or discard a worktree task's branch, exactly once (SPEC G7, W1-W3, R1).

An ``integrate`` message ``{operation_id, integration_id, action, branch, base,
base_branch, head}`` is committed locally with its integration record before it is
acknowledged (W2); a duplicate is recognised and never carried out twice (W3). Each
integration runs in its own thread, under the repository's lock (``worktrees.repo_lock``):

- ``discard``: the worktree and the branch go (``worktrees.remove``), outcome
  ``discarded``;
- ``merge``: ``worktrees.merge_plan`` decides without touching any checkout (``conflict``,
  ``base_dirty``, ``base_missing``: nothing changed, branch and worktree kept); else the
  planned move of the base branch (from ``old`` to ``target``) is committed locally
  (state ``merging``) **before** it is made, then made; on success the worktree and branch
  go. A worker killed anywhere in between finds the plan on restart and asks git where the
  base stands (``worktrees.merge_state``): it holds the target (the merge happened: report
  it), it is still at ``old`` (it did not: make it now, the same move), or it moved
  elsewhere (plan again). Moving a branch to a recorded commit twice changes nothing, so
  it never merges twice.

The outcome and its ``integrated`` receipt (event id ``integrated:<integration id>``) are
committed in one local transaction (``Store.integration_done``) and sent by the outbox
sender (R1, R4).
"""
from __future__ import annotations

import json
import logging
import os
import threading

from . import faults, worktrees
from .context import WorkerContext
from .wire import receipt_item

log = logging.getLogger("runstead.worker")

PLAN_ATTEMPTS = 3  # the base moved between plan and move: plan again this many times


class Integrator:
    """Carries out recorded integrations, one thread each (never two for one id)."""

    def __init__(self, ctx: WorkerContext):
        self.ctx = ctx

    def start(self, integration_id: str) -> None:
        """Run ``integration_id`` in a thread unless it is done or already in flight."""
        ctx = self.ctx
        row = ctx.store.integration(integration_id)
        if row is None or row["state"] == "done":
            return
        with ctx.runs_lock:
            if integration_id in ctx.integrations:
                return
            ctx.integrations.add(integration_id)
        threading.Thread(target=self._thread, args=(integration_id,), name=f"integrate-{integration_id[:8]}",
                         daemon=True).start()

    def resume(self) -> None:
        """After a restart: every integration not done yet (``received`` or ``merging``)."""
        for row in self.ctx.store.integrations("received", "merging"):
            self.start(row["integration_id"])

    def _thread(self, integration_id: str) -> None:
        try:
            self.execute(integration_id)
        except faults.InjectedCrash as crash:
            log.warning("integration %s: injected crash at %s (tests)", integration_id, crash)
        except Exception:
            log.exception("integration %s failed", integration_id)
        finally:
            with self.ctx.runs_lock:
                self.ctx.integrations.discard(integration_id)
            self.ctx.wake()

    def execute(self, integration_id: str) -> None:
        ctx = self.ctx
        row = ctx.store.integration(integration_id)
        if row is None or row["state"] == "done":
            return
        payload = json.loads(row["payload"])
        record = ctx.store.get(row["operation_id"])
        info = json.loads(record["worktree"]) if record and record.get("worktree") else None
        if info is None:
            return self.finish(row, {"outcome": "failed",
                                     "detail": "this worker has no record of the task's worktree"})
        head = payload.get("head") or _final_head(record)
        if payload.get("action") == "discard":
            notes = worktrees.remove(info, expected_head=head, delete_branch=True)
            return self.finish(row, {"outcome": "discarded", "detail": "; ".join(notes) or
                                     f"worktree and branch {info['branch']} removed"})
        if not head:
            return self.finish(row, {"outcome": "failed", "detail": "no reviewed commit to merge"})
        with worktrees.repo_lock(info["common_dir"]):
            outcome = self.merge(row, info, head=head)
        if outcome["outcome"] == "merged":
            notes = worktrees.remove(info, expected_head=head, delete_branch=True)
            done = notes or [f"worktree and branch {info['branch']} removed"]
            outcome["detail"] = "; ".join([outcome["detail"], *done]) if outcome.get("detail") else "; ".join(done)
        self.finish(row, outcome)

    def merge(self, row: dict, info: dict, *, head: str) -> dict:
        """The merge state machine (module docstring); returns the outcome."""
        integration_id = row["integration_id"]
        apply = json.loads(row["plan"]) if row["plan"] else None
        task_id = info.get("task_id", "")
        for _ in range(PLAN_ATTEMPTS + 1):
            if apply is not None:
                state = worktrees.merge_state(info, apply)
                if state == "done":
                    log.info("integration %s: the base already holds %s (recorded move done)", integration_id,
                             apply["target"][:12])
                    return {"outcome": "merged", "commit": apply["target"],
                            "detail": f"{apply['kind']} of {info['branch']}"}
                if state == "pending":
                    result = worktrees.merge_apply(info, apply)
                    faults.fault("integrate_after_merge_before_receipt")
                    if not result.get("retry"):
                        return result
                if state == "missing":
                    return {"outcome": "base_missing",
                            "detail": f"branch {info['base_branch']} no longer exists; {info['branch']} kept"}
            planned = worktrees.merge_plan(info, head=head, task_id=task_id)
            if "apply" not in planned:
                return planned  # decided without moving anything
            apply = planned["apply"]
            self.ctx.store.integration_planned(integration_id, plan=apply, wall=self.ctx.clock.wall())
            faults.fault("integrate_after_plan_before_merge")
        return {"outcome": "failed", "detail": f"{info['base_branch']} kept moving while merging; nothing merged"}

    def finish(self, row: dict, outcome: dict) -> None:
        """The outcome and its ``integrated`` receipt, in one local commit (R1)."""
        ctx = self.ctx
        facts = {"integration_id": row["integration_id"], "outcome": outcome["outcome"]}
        for key in ("commit", "paths", "detail"):
            if outcome.get(key):
                facts[key] = outcome[key]
        ctx.store.integration_done(row["integration_id"], outcome=facts, wall=ctx.clock.wall(), outbox=[
            receipt_item(ctx.identity, operation_id=row["operation_id"], kind="integrated", facts=facts, slept=0.0,
                         event_id=f"integrated:{row['integration_id']}")])
        ctx.wake_sender()
        log.info("integration %s (%s): %s %s", row["integration_id"], json.loads(row["payload"]).get("action"),
                 facts["outcome"], facts.get("commit", ""))


def _final_head(record: dict) -> str | None:
    """The branch head the task's final facts reported (the reviewed commit)."""
    final = json.loads(record["final"]) if record.get("final") else {}
    return (((final.get("evidence") or {}).get("git")) or {}).get("end_head")


def prune(store, out) -> int:
    """``worker --prune-worktrees``: for every operation whose integration is done, remove
    what is left of its worktree (never one changed since) and, after a merge or a
    discard, its branch (only while it points at the reviewed commit); branches of a
    conflict, base_dirty or base_missing stay for the owner to merge by hand. Prints one
    line per thing removed or kept (``out(text)``); returns how many were removed."""
    removed = 0
    for row in store.integrations("done"):
        record = store.get(row["operation_id"])
        info = json.loads(record["worktree"]) if record and record.get("worktree") else None
        if info is None:
            continue
        outcome = json.loads(row["outcome"] or "{}").get("outcome")
        head = json.loads(row["payload"]).get("head") or _final_head(record)
        integrated = outcome in ("merged", "discarded")
        had_tree = os.path.isdir(info["path"])
        had_branch = worktrees.branch_head(info) is not None
        if not had_tree and not (integrated and had_branch):
            continue
        notes = worktrees.remove(info, expected_head=head, delete_branch=integrated)
        if had_tree and not os.path.isdir(info["path"]):
            removed += 1
            out(f"removed worktree {info['path']} (task {info.get('task_id', '?')}, {outcome})")
        if integrated and had_branch and worktrees.branch_head(info) is None:
            removed += 1
            out(f"deleted branch {info['branch']} in {info['repo']}")
        if not integrated and had_branch:
            out(f"kept branch {info['branch']} in {info['repo']} ({outcome}: merge it yourself, "
                f"git merge {info['branch']})")
        for note in notes:
            out(f"kept: {note}")
    return removed
