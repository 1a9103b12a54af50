"""Lock-order inversions found by the history run and its notes, now fixed (issue 42, SPEC P2, G7, J7).

``task_integrate`` (``POST /api/tasks/{id}/integrate/``) takes the owner's budget row,
then ``Task.objects.select_for_update().select_related("machine")``, which locks the
joined machine row ``FOR UPDATE`` too: machine after budget. Acceptance and lease grants
take the machine row ``FOR KEY SHARE`` before the budget row (P2: machine -> grant ->
budget). A merge racing an acceptance or a lease grant of the same owner's machine
deadlocks; under load the deadlock repeats through every retry (``DEADLOCK_RETRIES``),
and acceptances and lease grants answered 500 (seed 3 of ``bench/history.py``: 7 lease
grants and 2 acceptances in 3 s; PostgreSQL's log shows the cycle budget <- task/machine
<- budget). ``lease_grant`` avoids the same trap with ``of=("self",)``, and so does
``task_integrate`` now; this test races the two and sees no deadlock.
"""
import logging
import threading

import pytest
from django.db import OperationalError, connection, transaction
from django.utils import timezone

from core.errors import ApplicationError
from tasks_app.services import integration, leases
from tests.factories import operation_id, submit
from tests.wait import wait_for

pytestmark = [pytest.mark.postgres]


def blocked_on_a_lock() -> bool:
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE datname = current_database() "
                       "AND wait_event_type = 'Lock'")
        return cursor.fetchone()[0] >= 1


class Race:
    """Two service calls in two threads, each its own transaction: ``first`` runs until a
    patched step of it calls ``hold()``, which lets ``second`` start and waits until
    ``second`` is blocked on a row lock or done; then ``first`` goes on. ``run`` returns
    every deadlock seen: PostgreSQL's 40P01 raised, or retried (``runstead.locking``)."""

    def __init__(self, caplog):
        self.caplog, self.reached, self.second_done, self.errors = caplog, threading.Event(), threading.Event(), []

    def hold(self):
        self.reached.set()
        wait_for(lambda: self.second_done.is_set() or blocked_on_a_lock(), timeout_s=10,
                 what="the second call waits on a lock or is done")

    def _guarded(self, call, done=None):
        try:
            call()
        except OperationalError as exc:
            self.errors.append(exc)
        finally:
            if done is not None:
                done.set()
            connection.close()

    def run(self, first, second) -> list[str]:
        def second_once_first_holds():
            self.reached.wait(10)
            self._guarded(second, self.second_done)

        with self.caplog.at_level(logging.WARNING, logger="runstead.locking"):
            threads = [threading.Thread(target=self._guarded, args=(first,)), threading.Thread(target=second_once_first_holds)]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join(30)
        return [r.getMessage() for r in self.caplog.records if "deadlock" in r.getMessage()] + [str(e) for e in self.errors]


@pytest.mark.django_db(transaction=True)
def test_p2_a_merge_racing_a_lease_grant_of_the_same_machine_never_deadlocks(owner, machine, grant, monkeypatch,
                                                                            caplog):
    resp = submit(owner, machine, grant.path)
    assert resp.status_code == 201, resp.content
    task_id = resp.json()["id"]
    race, real_lock_budget = Race(caplog), leases.lock_budget

    def lock_budget_once_the_merge_waits(owner_id):
        # The grant holds the machine and grant rows FOR KEY SHARE here (P1); the budget
        # row is next. Let the merge take the budget row first: it then either waits on a
        # row lock (the inversion: it wants the machine row) or finishes.
        race.hold()
        real_lock_budget(owner_id)

    def merge():
        try:
            with transaction.atomic():  # respond_once's transaction, as the view runs it
                integration.task_integrate(owner=owner, task_id=task_id, action="merge", now=timezone.now())
        except ApplicationError:
            pass  # not final: refused, as it should be, once it has its locks

    def grant_lease():
        leases.lease_grant(machine=machine, operation_id=operation_id(task_id), now=timezone.now())

    monkeypatch.setattr(leases, "lock_budget", lock_budget_once_the_merge_waits)
    assert race.run(grant_lease, merge) == []


@pytest.mark.django_db(transaction=True)
def test_p2_a_start_acknowledged_while_the_owner_cancels_never_deadlocks(owner, machine, grant, monkeypatch, caplog):
    """``task_cancel`` locks the task, then acknowledges the cancelled task's ``start``
    message itself; ``message_ack`` of that ``start`` used to lock the message row first,
    then the task: the cycle task <- message <- task. The ack reaches its task transition
    first, the cancel runs there, and neither sees a deadlock."""
    from tasks_app.models import Task
    from tasks_app.services import cancel, messages

    task_id = submit(owner, machine, grant.path).json()["id"]
    (start,) = messages.messages_take(machine_id=machine.pk, now=timezone.now(), new_pull=True)
    race, real_transition = Race(caplog), messages.task_transition

    def transition_once_the_cancel_waits(*args, **kwargs):
        race.hold()
        return real_transition(*args, **kwargs)

    monkeypatch.setattr(messages, "task_transition", transition_once_the_cancel_waits)
    deadlocks = race.run(
        lambda: messages.message_ack(machine=machine, message_id=start.pk, now=timezone.now()),
        lambda: cancel.task_cancel(task=Task.objects.get(pk=task_id), actor="owner:test", now=timezone.now()),
    )
    assert deadlocks == []
    assert Task.objects.get(pk=task_id).state == "cancelled"
