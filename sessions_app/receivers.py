"""The sessions app's side of the task seam (``tasks_app/signals.py``), connected in
``SessionsAppConfig.ready()``. Both run inside the task transaction that sent them."""
from sessions_app.approvals import approvals_withdraw_for_task
from sessions_app.services import session_get_or_create, session_refresh_status
from tasks_app.models import FINAL_STATES


def on_task_changed(sender, *, task, now, **kwargs) -> None:
    """S1: a task was created or changed state; re-evaluate its session (the change is
    published after commit, once, S2). Q5: a task that is now final withdraws its pending
    approvals."""
    if task.state in FINAL_STATES:
        approvals_withdraw_for_task(task=task, now=now)
    if task.session_id:
        session_refresh_status(session_id=task.session_id, now=now)


def on_task_session_claimed(sender, *, owner, session_id, now, **kwargs) -> None:
    """A1 with ``session``: the owner's session ``session_id``, created idle when the id
    is new; ApplicationError 404 ``not_found`` for another owner's id (K2)."""
    session_get_or_create(owner=owner, session_id=session_id, now=now)
