"""The seam between the task core and what sits on top of it (SPEC S1).

``tasks_app`` imports nothing from ``sessions_app``; the sessions app connects receivers
to these signals in ``SessionsAppConfig.ready()``. Both are sent inside the caller's
transaction with ``send`` (not ``send_robust``): a receiver's error rolls the whole
change back, and nothing a receiver publishes leaves before commit (it broadcasts
through ``core.broadcast``, after commit, S2).
"""
from django.dispatch import Signal

# Sent by ``tasks_app.services.transitions`` when a task is created (state ``accepted``)
# or changes state, inside the transaction that wrote it, after the row and its
# TaskEvent. Arguments: ``sender=Task``, ``task`` (the refreshed row), ``now`` (the
# operation's clock reading, UTC). The sessions app re-evaluates the task's session (S1).
task_changed = Signal()

# Sent by acceptance (A1) when ``POST /api/tasks/`` names a ``session``, inside the
# acceptance transaction before the task row is written. Arguments: ``sender=Task``,
# ``owner``, ``session_id`` (UUID), ``now``. A receiver makes sure the owner's session
# with that id exists (creating it idle when the id is new) and raises ApplicationError
# to refuse (404 ``not_found`` for another owner's id, K2).
task_session_claimed = Signal()
