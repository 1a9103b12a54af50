"""Every receiver of the task seam (``tasks_app/signals.py``), in every app: ``RECEIVERS``
lists them in the order they run and ``connect()`` (from ``SessionsAppConfig.ready()``)
connects exactly these. The task core imports no app above it, so this is where a reader
of acceptance or of a transition finds what else happens. It lives in the sessions app,
the lowest layer that sees both receiving apps (sessions and notifications);
``tests/test_structure.py`` checks that these are the receivers connected.

Inside the sender's transaction (``send``, not ``send_robust``: a receiver's error rolls
the acceptance or the transition back, A5):

- ``task_session_claimed`` (acceptance, A1 with ``session`` or a conversation without
  one (C6), before the task row): ``on_task_session_claimed``: the owner's session,
  created idle (with the given title) when the id is new; 404 ``not_found`` for another
  owner's id (K2).
- ``task_changed`` (acceptance, every transition, after the row, its TaskEvent and
  the task's own conversation messages, C3; and ``task_ask_owner``, N1/U2, when an
  ``unknown`` task's owner is asked):
  1. ``on_task_changed``: Q5, a final task withdraws its pending approvals (each an
     approval board event and notification); S1, its session's busy/idle is re-evaluated
     (the session row locked, a change stored by compare-and-set, S2);
  2. ``notify_task_changed``: N1, a notification row and its deliveries for ``unknown``
     (once its owner is asked) and the ends ``succeeded``, ``failed``, ``failed_lease_lost``.

After commit, and only then, leave what they publish: board events (``core.broadcast``,
B2), the wake of the notification sender, the approvals' long-poll wakes (Q3).
"""
from notifications.services import notify_task_state
from sessions_app.approvals import approvals_withdraw_for_task
from sessions_app.services import session_get_or_create, session_refresh_status
from tasks_app.models import FINAL_STATES
from tasks_app.signals import task_changed, task_session_claimed


def on_task_changed(sender, *, task, now, **kwargs) -> None:
    """S1: a task was created or changed state; re-evaluate its session (the change is
    published after commit, once, S2). Q5: a task that is now final withdraws its pending
    approvals."""
    if task.state in FINAL_STATES:
        approvals_withdraw_for_task(task=task, now=now)
    if task.session_id:
        session_refresh_status(session_id=task.session_id, now=now)


def notify_task_changed(sender, *, task, now, **kwargs) -> None:
    """N1: the owner hears of a task that needs a decision or ended
    (``notifications.services.notify_task_state``)."""
    notify_task_state(task, now=now)


def on_task_session_claimed(sender, *, owner, session_id, now, title: str = "", **kwargs) -> None:
    """A1 with ``session``, and C6 (a conversation accepted without one): the owner's
    session ``session_id``, created idle with ``title`` when the id is new;
    ApplicationError 404 ``not_found`` for another owner's id (K2)."""
    session_get_or_create(owner=owner, session_id=session_id, now=now, title=title)


# (signal, receiver, dispatch_uid), in the order each signal calls them.
RECEIVERS = (
    (task_session_claimed, on_task_session_claimed, "sessions-claim"),
    (task_changed, on_task_changed, "sessions-s1-refresh"),
    (task_changed, notify_task_changed, "notifications.task_changed"),
)


def connect() -> None:
    """Connect ``RECEIVERS`` (idempotent: each has its ``dispatch_uid``)."""
    for signal, receiver, dispatch_uid in RECEIVERS:
        signal.connect(receiver, dispatch_uid=dispatch_uid)
