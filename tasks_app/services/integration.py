"""Merge or discard a worktree task's branch, once (SPEC G7, A1-A4, H).

The owner decides once per task: ``POST /api/tasks/{id}/integrate/`` with an
Idempotency-Key runs ``task_integrate`` through the A1 machinery (``core.idempotency``),
so the same key replays the first answer byte-equal. In one transaction the decision is
recorded (an ``Integration`` row: action, who, when; its one-per-task constraint is the
compare-and-set), the ``integrate`` message for the worker is written to the outbox and
the task is published. The outcome comes back as an ``integrated`` receipt
(``integration_apply``), applied exactly once (R1).
"""
from datetime import datetime

from django.db.models import Q

from core.actors import actor_owner
from core.errors import ApplicationError
from core.idempotency import Answer, body_digest
from tasks_app.models import FINAL_STATES, Integration, IntegrationAction, MessageKind, Task
from tasks_app.services.locking import lock_budget
from tasks_app.services.transitions import message_send, task_publish, task_record
from tasks_app.shapes import task_dict

INTEGRATION_PATHS_MAX = 1000
INTEGRATION_DETAIL_MAX = 500


def decision_digest(task_id, raw_body) -> str:
    """A1 for G7: the digest of a decision covers the task id (its scope is acceptance's,
    ``ACCEPT_SCOPE``), so one key names one decision on one task."""
    return body_digest({"integrate": str(task_id), "body": raw_body})


def task_integrate(*, owner, task_id, action: str, now: datetime) -> Answer:
    """Record the owner's ``merge`` or ``discard`` of final worktree task ``task_id``
    and send the worker an ``integrate`` message ``{operation_id, integration_id, action,
    branch, base, base_branch, head}`` (``head``: the reviewed commit, the branch's head
    in the final evidence). The view runs this once per Idempotency-Key through
    ``core.idempotency.respond_once`` (``decision_digest``), inside its transaction.
    Returns ``(202, task shape with its integration pending, {"task": task})``.

    Refusals (nothing stored, A5), in this order: 404 ``not_found`` (not the owner's),
    409 ``not_final``, ``not_worktree``, ``follow_up_pending`` (G8: a follow-up on the
    same branch is unfinished; ``task_id`` names it), ``no_branch`` (it never made one),
    ``already_decided`` (on any task of the branch), ``superseded`` (a later follow-up
    worked on the branch: decide on that one, ``task_id``), ``no_base_branch`` (a merge of a task started on a detached
    HEAD), ``machine_unpaired``."""
    # P2: the owner's budget row first, as acceptance takes it: a follow-up accepted on
    # this branch (G8) and this decision serialize, so neither misses the other.
    lock_budget(owner.pk)
    # ``of=("self",)``: the task row alone. The joined machine row is only read; locking it
    # here, after the budget row, would invert P2's machine -> budget order and deadlock
    # with acceptance and lease grants (found by the history checker, issue 42).
    task = Task.objects.select_for_update(of=("self",)).select_related("machine").filter(pk=task_id, owner=owner).first()
    if task is None:
        raise ApplicationError("not_found", "no such task", status_code=404)
    if task.state not in FINAL_STATES:
        raise ApplicationError("not_final", f"the task is {task.state}: decide once it is final", status_code=409)
    if task.isolation != "worktree":
        raise ApplicationError("not_worktree", "the task ran in the folder itself, not on a branch of its own",
                               status_code=409)
    # G8: a follow-up of a worktree task works on the same branch: one decision per
    # branch, taken on its latest task once no follow-up on it is unfinished.
    branch = Task.objects.filter(Q(pk=task.branch_of_id or task.pk) | Q(branch_of_id=task.branch_of_id or task.pk))
    pending = branch.exclude(state__in=FINAL_STATES).order_by("created_at").first()
    if pending is not None:
        raise ApplicationError("follow_up_pending", "a follow-up on this task's branch has not finished yet: decide "
                               "once it has", status_code=409, task_id=str(pending.pk))
    git = (task.evidence or {}).get("git") or {}
    if not git.get("branch"):
        raise ApplicationError("no_branch", "the task never made its branch (it did not start)", status_code=409)
    if Integration.objects.filter(task__in=branch).exists():
        raise ApplicationError("already_decided", "this task's branch was already merged or discarded",
                               status_code=409)
    later = _later_on_branch(branch, task, git["branch"])
    if later is not None:
        raise ApplicationError("superseded", "a later follow-up worked on this branch: decide on it (its diff holds "
                               "this task's work too)", status_code=409, task_id=str(later.pk))
    if action == IntegrationAction.MERGE and not git.get("base_branch"):
        raise ApplicationError("no_base_branch", "the task started on a detached HEAD: there is no branch to merge "
                               "into (discard it, or merge its branch by hand)", status_code=409)
    if not task.machine.paired:
        raise ApplicationError("machine_unpaired", "the machine is not paired: it would never get the message",
                               status_code=409)
    integration = Integration.objects.create(task=task, action=action, decided_by=owner, decided_at=now)
    message_send(task, kind=MessageKind.INTEGRATE, now=now, integration_id=str(integration.id), action=action,
                 branch=git["branch"], base=git.get("base"), base_branch=git.get("base_branch"),
                 head=git.get("end_head"))
    task_record(task, reason=f"owner decision: {action} branch {git['branch']}", actor=actor_owner(owner), now=now)
    task_publish(task, now=now)
    task = Task.objects.select_related("integration").get(pk=task.pk)
    return 202, task_dict(task), {"task": task}


def _later_on_branch(branch, task: Task, name: str) -> Task | None:
    """G8: a follow-up of ``task`` (at any depth, on the same ``branch``) whose final
    evidence shows it worked on branch ``name``, or None."""
    frontier, later = [task.pk], None
    while frontier:
        children = list(branch.filter(continued_from_id__in=frontier))
        later = next((c for c in children if ((c.evidence or {}).get("git") or {}).get("branch") == name), later)
        frontier = [c.pk for c in children]
    return later


def integration_apply(task: Task, facts: dict, *, actor: str, now: datetime) -> dict:
    """Apply an ``integrated`` receipt's facts ``{integration_id, outcome, commit?,
    paths?, detail?}`` (validated) to the task's integration: once (a compare-and-set on
    an unreported outcome), recorded in the task's history and published. Returns the
    R3 answer: applied, or not_applied ``unknown_integration`` / ``already_reported``."""
    integration = Integration.objects.filter(pk=facts["integration_id"], task=task).first()
    if integration is None:
        task_record(task, reason="integrated receipt for an unknown integration", actor=actor, now=now)
        return {"outcome": "not_applied", "reason": "unknown_integration"}
    commit = facts.get("commit") or ""
    updated = Integration.objects.filter(pk=integration.pk, outcome="").update(
        outcome=facts["outcome"], commit=commit, paths=list(facts.get("paths") or [])[:INTEGRATION_PATHS_MAX],
        detail=(facts.get("detail") or "")[:INTEGRATION_DETAIL_MAX], reported_at=now)
    if not updated:
        task_record(task, reason="integrated receipt after the outcome was reported", actor=actor, now=now)
        return {"outcome": "not_applied", "reason": "already_reported"}
    what = f"{facts['outcome']} {commit[:12]}".strip()
    task_record(task, reason=f"{integration.action}: {what}", actor=actor, now=now)
    task_publish(task, now=now)
    return {"outcome": "applied"}
