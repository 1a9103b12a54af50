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


@pytest.mark.django_db(transaction=True)
def test_p2_a_merge_racing_a_lease_grant_of_the_same_machine_never_deadlocks(owner, machine, grant, monkeypatch,
                                                                            caplog):
    resp = submit(owner, machine, grant.path)
    assert resp.status_code == 201, resp.content
    task_id = resp.json()["id"]
    holds_machine, merge_done = threading.Event(), threading.Event()
    real_lock_budget = leases.lock_budget
    errors = []

    def lock_budget_once_the_merge_waits(owner_id):
        # The grant holds the machine and grant rows FOR KEY SHARE here (P1); the budget
        # row is next. Let the merge take the budget row first: it then either waits on a
        # row lock (the inversion: it wants the machine row) or finishes.
        holds_machine.set()
        wait_for(lambda: merge_done.is_set() or blocked_on_a_lock(), timeout_s=10, what="the merge waits or is done")
        real_lock_budget(owner_id)

    def grant_lease():
        try:
            leases.lease_grant(machine=machine, operation_id=operation_id(task_id), now=timezone.now())
        except OperationalError as exc:
            errors.append(exc)
        finally:
            connection.close()

    def merge():
        holds_machine.wait(10)
        try:
            with transaction.atomic():  # respond_once's transaction, as the view runs it
                integration.task_integrate(owner=owner, task_id=task_id, action="merge", now=timezone.now())
        except ApplicationError:
            pass  # not final: refused, as it should be, once it has its locks
        except OperationalError as exc:
            errors.append(exc)
        finally:
            merge_done.set()
            connection.close()

    monkeypatch.setattr(leases, "lock_budget", lock_budget_once_the_merge_waits)
    with caplog.at_level(logging.WARNING, logger="runstead.locking"):
        threads = [threading.Thread(target=grant_lease), threading.Thread(target=merge)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    deadlocks = [r.getMessage() for r in caplog.records if "deadlock" in r.getMessage()] + [str(e) for e in errors]
    assert deadlocks == []


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
    at_transition, cancel_done = threading.Event(), threading.Event()
    real_transition = messages.task_transition
    errors = []

    def transition_once_the_cancel_waits(*args, **kwargs):
        at_transition.set()
        wait_for(lambda: cancel_done.is_set() or blocked_on_a_lock(), timeout_s=10, what="the cancel waits or is done")
        return real_transition(*args, **kwargs)

    def ack():
        try:
            messages.message_ack(machine=machine, message_id=start.pk, now=timezone.now())
        except OperationalError as exc:
            errors.append(exc)
        finally:
            connection.close()

    def cancel_task():
        at_transition.wait(10)
        try:
            cancel.task_cancel(task=Task.objects.get(pk=task_id), actor="owner:test", now=timezone.now())
        except OperationalError as exc:
            errors.append(exc)
        finally:
            cancel_done.set()
            connection.close()

    monkeypatch.setattr(messages, "task_transition", transition_once_the_cancel_waits)
    with caplog.at_level(logging.WARNING, logger="runstead.locking"):
        threads = [threading.Thread(target=ack), threading.Thread(target=cancel_task)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    deadlocks = [r.getMessage() for r in caplog.records if "deadlock" in r.getMessage()] + [str(e) for e in errors]
    assert deadlocks == []
    assert Task.objects.get(pk=task_id).state == "cancelled"
