"""The seam between the task core and the apps on top of it (SPEC S1, N1, Q5).

``tasks_app`` imports no app above it. Every receiver of these signals, in every app, is
listed and connected in one module, ``sessions_app/receivers.py``, which says what runs
inside the sender's transaction and what after commit. Both are sent inside the
caller's transaction with ``send`` (not ``send_robust``): a receiver's error rolls the
whole change back, and nothing a receiver publishes leaves before commit (it broadcasts
through ``core.broadcast``, after commit, S2). The task core's own reaction to a
transition (its conversation messages, C3) is a plain call in ``transitions``.
"""
from django.dispatch import Signal

# Sent by ``tasks_app.services.transitions`` when a task is created (state ``accepted``)
# or changes state, inside the transaction that wrote it, after the row and its
# TaskEvent. Arguments: ``sender=Task``, ``task`` (the refreshed row), ``now`` (the
# operation's clock reading, UTC). Receivers: S1 and Q5 (sessions), N1 (notifications).
task_changed = Signal()

# Sent by acceptance (A1) when ``POST /api/tasks/`` names a ``session``, or accepts a
# conversation without one (C6: acceptance then names a new session id), inside the
# acceptance transaction before the task row is written. Arguments: ``sender=Task``,
# ``owner``, ``session_id`` (UUID), ``now``, ``title`` (for a session created now: a
# conversation's, from its first prompt; else ""). A receiver makes sure the owner's
# session with that id exists (creating it idle when the id is new) and raises
# ApplicationError to refuse (404 ``not_found`` for another owner's id, K2).
task_session_claimed = Signal()
