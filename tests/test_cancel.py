"""Cancel in every state (SPEC J7, J4, J6, L1, L5), and a cancel racing a final receipt."""
import threading

import pytest
from django.db import connection

from core import clock
from tasks_app.models import Budget, OutboxMessage, Task, TaskEvent
from tasks_app.services.sweeps import expire_leases
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, grant_lease, operation_id, receipt, submit

RUNNING = {"pid": 7, "pgid": 7, "process_start_time": 1.0}


def cancel(owner, task_id):
    return owner_api(owner).post(f"/api/tasks/{task_id}/cancel/")


def budget_of(owner):
    b = Budget.objects.get(owner=owner)
    return b.reserved_s, b.spent_s


def messages(task_id, kind):
    return OutboxMessage.objects.filter(operation__task_id=task_id, kind=kind)


def in_state(owner, machine, folder, state, **extra) -> str:
    """A task brought to ``state`` through the worker protocol."""
    task_id = submit(owner, machine, folder, **extra).json()["id"]
    if state == "accepted":
        return task_id
    if state == "delivered":
        start = machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"][0]
        machine_api(machine).post(f"/api/worker/messages/{start['id']}/ack/")
    else:
        assert grant_lease(machine, task_id).status_code == 201
        if state != "starting":
            receipt(machine, task_id, "running", RUNNING)
    assert Task.objects.get(pk=task_id).state == state
    return task_id


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["accepted", "delivered"])
def test_j7_never_leased_task_is_cancelled_at_once_with_full_release(owner, machine, grant, grant_root, pinned, state):
    task_id = in_state(owner, machine, grant_root, state)
    resp = cancel(owner, task_id)
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.holds_lock, task.charged_s, task.final_at) == ("cancelled", False, 0, clock.now())
    assert budget_of(owner) == (0, 0)
    assert not messages(task_id, "cancel").exists()
    # The start message is withdrawn: the worker pulls nothing.
    assert machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"] == []
    assert TaskEvent.objects.filter(task=task).last().actor == "owner:alice"
    # No lease can follow (L1).
    assert grant_lease(machine, task_id).json()["error"] == "final"


@pytest.mark.django_db
@pytest.mark.parametrize("state", ["starting", "running"])
def test_j7_leased_task_gets_cancel_request_and_cancel_message(owner, machine, grant, grant_root, pinned, state):
    task_id = in_state(owner, machine, grant_root, state)
    resp = cancel(owner, task_id)
    assert resp.status_code == 200
    assert resp.json()["state"] == state
    assert resp.json()["cancel_requested_at"] == clock.now().isoformat()
    task = Task.objects.get(pk=task_id)
    assert task.state == state and task.cancel_requested_at == clock.now()
    assert budget_of(owner) == (1800, 0)  # nothing settled until the facts arrive
    [message] = messages(task_id, "cancel")
    assert message.payload == {"operation_id": operation_id(task_id)}
    lease_id = task.leases.get().id
    assert machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/").json()["error"] == "cancelled"
    assert grant_lease(machine, task_id).json()["error"] == "cancelled"
    # A second cancel is idempotent: no second message.
    assert cancel(owner, task_id).status_code == 200
    assert messages(task_id, "cancel").count() == 1


@pytest.mark.django_db
def test_j7_running_task_becomes_cancelled_by_its_final_receipt(owner, machine, grant, grant_root, pinned):
    task_id = in_state(owner, machine, grant_root, "running")
    cancel(owner, task_id)
    pinned.shift(5)
    receipt(machine, task_id, "final", final_facts(stop_reason="cancel", exit_code=None, signal=15, runtime_s=5.0))
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.holds_lock) == ("cancelled", False)
    assert budget_of(owner) == (0, 5.0)  # J4: runtime charged


@pytest.mark.django_db
def test_j7_starting_task_cancelled_before_spawn_is_not_started_with_full_release(
    owner, machine, grant, grant_root, pinned
):
    task_id = in_state(owner, machine, grant_root, "starting")
    cancel(owner, task_id)
    receipt(machine, task_id, "final", final_facts(process_started=False, exit_code=None, stop_reason="cancel",
                                                   runtime_s=0.0))
    assert Task.objects.get(pk=task_id).state == "not_started"  # J6 row 1
    assert budget_of(owner) == (0, 0)


@pytest.mark.django_db
def test_j7_facts_win_over_a_cancel_request(owner, machine, grant, grant_root, pinned):
    """The agent finished by itself before it saw the cancel: its result stands (J6 row 6)."""
    task_id = in_state(owner, machine, grant_root, "running")
    cancel(owner, task_id)
    receipt(machine, task_id, "final", final_facts(runtime_s=9.0))
    assert Task.objects.get(pk=task_id).state == "succeeded"


@pytest.mark.django_db
def test_j7_cancel_requested_task_becomes_unknown_at_lease_expiry(owner, machine, grant, grant_root, pinned):
    task_id = in_state(owner, machine, grant_root, "running")
    cancel(owner, task_id)
    pinned.shift(60)
    assert expire_leases(now=clock.now()) == 1
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert budget_of(owner) == (1800, 0) and task.holds_lock


@pytest.mark.django_db
def test_j7_cancel_of_unknown_task_records_request_and_sends_cancel(owner, machine, grant, grant_root, pinned):
    task_id = in_state(owner, machine, grant_root, "running")
    pinned.shift(61)
    expire_leases(now=clock.now())
    resp = cancel(owner, task_id)
    assert resp.status_code == 200 and resp.json()["state"] == "unknown"
    task = Task.objects.get(pk=task_id)
    assert task.cancel_requested_at == clock.now()
    assert messages(task_id, "cancel").count() == 1
    assert TaskEvent.objects.filter(task=task).last().reason == "cancel requested"
    assert budget_of(owner) == (1800, 0)
    # The worker stops the agent and reports: the facts settle it.
    receipt(machine, task_id, "final", final_facts(stop_reason="cancel", signal=15, exit_code=None, runtime_s=70.0))
    assert Task.objects.get(pk=task_id).state == "cancelled"
    assert budget_of(owner) == (0, 70.0)


@pytest.mark.django_db
@pytest.mark.parametrize("how", ["cancelled", "succeeded"])
def test_j7_cancel_of_final_task_is_409_already_final(owner, machine, grant, grant_root, pinned, how):
    task_id = in_state(owner, machine, grant_root, "running")
    if how == "cancelled":
        cancel(owner, task_id)
        receipt(machine, task_id, "final", final_facts(stop_reason="cancel", signal=15, exit_code=None))
    else:
        receipt(machine, task_id, "final", final_facts())
    before = Task.objects.get(pk=task_id)
    resp = cancel(owner, task_id)
    assert resp.status_code == 409 and resp.json()["error"] == "already_final"
    after = Task.objects.get(pk=task_id)
    assert (after.state, after.version, after.cancel_requested_at) == (before.state, before.version, before.cancel_requested_at)


@pytest.mark.django_db
def test_j7_cancel_of_another_owners_task_is_404(owner, other_owner, machine, grant, grant_root, pinned):
    task_id = in_state(owner, machine, grant_root, "accepted")
    assert cancel(other_owner, task_id).status_code == 404
    assert Task.objects.get(pk=task_id).state == "accepted"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_j7_cancel_racing_final_receipt_settles_once_by_the_facts(owner, machine, grant, grant_root):
    """Cancel and the final receipt released together: whichever commits first, the task
    ends by its facts exactly once, the budget is settled once, and the cancel either
    recorded its request (and a message) or answered 409 already_final."""
    outcomes = set()
    for i in range(6):
        task_id = in_state(owner, machine, grant_root / f"r{i}", "running")
        barrier = threading.Barrier(2)
        answers = {}

        def do_cancel():
            try:
                barrier.wait()
                answers["cancel"] = cancel(owner, task_id)
            finally:
                connection.close()

        def do_final():
            try:
                barrier.wait()
                answers["final"] = receipt(machine, task_id, "final", final_facts(runtime_s=10.0))
            finally:
                connection.close()

        threads = [threading.Thread(target=do_cancel), threading.Thread(target=do_final)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert answers["final"].json() == {"outcome": "applied"}
        task = Task.objects.get(pk=task_id)
        assert task.state == "succeeded"
        assert TaskEvent.objects.filter(task=task, new_state="succeeded").count() == 1
        if answers["cancel"].status_code == 200:
            outcomes.add("cancel_first")
            assert task.cancel_requested_at is not None
            assert messages(task_id, "cancel").count() == 1
        else:
            outcomes.add("final_first")
            assert answers["cancel"].status_code == 409
            assert answers["cancel"].json()["error"] == "already_final"
            assert task.cancel_requested_at is None and not messages(task_id, "cancel").exists()
    assert budget_of(owner) == (0, 60.0)  # six tasks, 10 s each, settled once
    assert outcomes  # at least one ordering observed (both, usually)


@pytest.mark.django_db
def test_j7_cancelling_a_task_does_not_stop_its_session(owner, machine, grant, grant_root, pinned):
    from sessions_app.models import Marker, Session

    session_id = "0b4f3a52-0000-4000-8000-000000000001"
    turn = {"turn_id": "turn-1", "device_id": "phone", "state": "running"}
    assert owner_api(owner).put(f"/api/sessions/{session_id}/marker/", turn, format="json").status_code == 200
    task_id = in_state(owner, machine, grant_root, "running", session=session_id)
    assert Session.objects.get(pk=session_id).status == "busy"
    cancel(owner, task_id)
    receipt(machine, task_id, "final", final_facts(stop_reason="cancel", signal=15, exit_code=None))
    assert Task.objects.get(pk=task_id).state == "cancelled"
    assert Session.objects.get(pk=session_id).status == "busy"  # the phone's turn still runs
    assert Marker.objects.get(session_id=session_id, device_id="phone").state == "running"
