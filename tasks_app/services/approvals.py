"""The task's side of approvals (SPEC Q5): its ``attention``, its approval counts, its
timeline rows, and the per-task approval credential.

The approvals themselves live above (``sessions_app.approvals``), which calls these
inside its own transactions with the task row locked first (lock order budget -> task
-> session -> approval, so a task that ends while one of its approvals is decided cannot
deadlock with it).
"""
import secrets
from datetime import datetime

from django.db.models import F

from core.errors import ApplicationError
from tasks_app.auth import token_digest
from tasks_app.models import FINAL_STATES, Task
from tasks_app.services.transitions import task_publish, task_record

ATTENTION_APPROVAL = "approval"


def task_lock(*, task_id, owner) -> Task:
    """The owner's task, locked ``FOR UPDATE`` (inside ``transaction.atomic()``);
    404 ``not_found`` for another owner's or an unknown id (K2)."""
    task = Task.objects.select_for_update(of=("self",)).filter(pk=task_id, owner=owner).first()
    if task is None:
        raise ApplicationError("not_found", "no such task", status_code=404)
    return task


def task_approval_noted(task: Task, *, pending: bool, reason: str, actor: str, now: datetime, asked: int = 0,
                        allowed: int = 0, denied: int = 0) -> Task:
    """Record an approval of ``task`` (locked by the caller): a timeline row (``reason``,
    which never carries the tool input, Q7), the counts (``asked``/``allowed``/``denied``
    added), and ``attention`` = ``approval`` while ``pending`` (another of its approvals
    still waits), else ``""`` (a final task keeps ``""``). Publishes the task (B2) when
    something it shows changed. Returns the refreshed task."""
    attention = ATTENTION_APPROVAL if pending and task.state not in FINAL_STATES else ""
    task_record(task, reason=reason, actor=actor, now=now)
    if not (asked or allowed or denied) and attention == task.attention:
        return task
    Task.objects.filter(pk=task.pk).update(
        attention=attention, approvals_asked=F("approvals_asked") + asked,
        approvals_allowed=F("approvals_allowed") + allowed, approvals_denied=F("approvals_denied") + denied,
    )
    task_publish(task, now=now)
    return task


def task_credential_issue(task: Task) -> str:
    """Q5: a fresh approval credential for ``task`` (32 random bytes, URL-safe); only its
    SHA-256 is stored, replacing any earlier one, which stops working at once. The worker
    hands it to the run's approval hook, never to the agent's environment (W5)."""
    credential = secrets.token_urlsafe(32)
    Task.objects.filter(pk=task.pk).update(approval_token_hash=token_digest(credential))
    return credential
