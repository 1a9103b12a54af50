"""Leases on the service side (SPEC L1, L2, L5, L6, L10, J5, J7).

The service clock is pinned with time-machine; the default timings apply (lease 60 s,
start window 600 s).
"""
from datetime import timedelta

import pytest
from rest_framework.test import APIClient

from core import clock
from tasks_app.models import Budget, Lease, Machine, OutboxMessage, Task, TaskEvent
from tasks_app.services.leases import LeaseRefused, lease_grant, lease_renew
from tasks_app.services.revocation import machine_unpair
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, grant_lease, operation_id, receipt, submit

pytestmark = pytest.mark.django_db


def new_task(owner, machine, folder, **extra) -> str:
    resp = submit(owner, machine, folder, **extra)
    assert resp.status_code == 201, resp.content
    return resp.json()["id"]


def leased(owner, machine, folder, **extra) -> tuple[str, str]:
    task_id = new_task(owner, machine, folder, **extra)
    resp = grant_lease(machine, task_id)
    assert resp.status_code == 201, resp.content
    receipt(machine, task_id, "running", {"pid": 7, "pgid": 7, "process_start_time": 1.0})
    return task_id, resp.json()["lease_id"]


def renew(machine, lease_id, **body):
    return machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/", body, format="json")


def refused(resp, reason):
    assert resp.status_code == 409, resp.content
    assert resp.json()["error"] == reason
    return True


# --- L1: one lease per operation, ever -------------------------------------------------


def test_l1_grant_moves_task_to_starting_with_published_timings(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    resp = grant_lease(machine, task_id)
    assert resp.status_code == 201
    body = resp.json()
    assert body["duration_s"] == 60 and body["renew_every_s"] == 15
    assert body["margin_s"] == 5 and body["kill_grace_s"] == 5
    assert body["expires_at"] == (clock.now() + timedelta(seconds=60)).isoformat()
    assert Task.objects.get(pk=task_id).state == "starting"


def test_l1_repeated_grant_returns_the_same_live_lease(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    first = grant_lease(machine, task_id)
    pinned.shift(20)
    again = grant_lease(machine, task_id)
    assert (first.status_code, again.status_code) == (201, 200)
    assert again.json() == first.json()
    assert Lease.objects.filter(task_id=task_id).count() == 1
    assert TaskEvent.objects.filter(task_id=task_id, new_state="starting").count() == 1


def test_l1_no_second_lease_after_expiry(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    pinned.shift(60)  # expires_at == now: expired
    assert refused(grant_lease(machine, task_id), "expired")
    # The grant itself expired the lease (L6 without the sweep); the task is unknown.
    assert Lease.objects.get(pk=lease_id).end_reason == "expired"
    assert Task.objects.get(pk=task_id).state == "unknown"
    assert refused(grant_lease(machine, task_id), "unknown")
    assert Lease.objects.filter(task_id=task_id).count() == 1


def test_l1_no_grant_for_unknown_task(owner, machine, grant, grant_root, pinned):
    task_id, _ = leased(owner, machine, grant_root)
    receipt(machine, task_id, "unknown", {"reason": "worker restarted"})
    assert Task.objects.get(pk=task_id).state == "unknown"
    assert refused(grant_lease(machine, task_id), "unknown")


def test_l1_no_grant_for_final_task(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    owner_api(owner).post(f"/api/tasks/{task_id}/cancel/")
    assert Task.objects.get(pk=task_id).state == "cancelled"
    assert refused(grant_lease(machine, task_id), "final")
    assert not Lease.objects.filter(task_id=task_id).exists()


def test_l1_no_grant_for_final_task_that_had_a_lease(owner, machine, grant, grant_root, pinned):
    task_id, _ = leased(owner, machine, grant_root)
    receipt(machine, task_id, "final", final_facts())
    assert refused(grant_lease(machine, task_id), "final")


def test_l1_j7_no_grant_for_cancel_requested_task_even_with_live_lease(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    assert grant_lease(machine, task_id).status_code == 201
    owner_api(owner).post(f"/api/tasks/{task_id}/cancel/")
    task = Task.objects.get(pk=task_id)
    assert task.state == "starting" and task.cancel_requested_at == clock.now()
    assert refused(grant_lease(machine, task_id), "cancelled")


def test_l1_j5_no_grant_past_start_window_and_task_not_started(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    pinned.shift(600)
    assert refused(grant_lease(machine, task_id), "start_window")
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.holds_lock) == ("not_started", False)
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (0, 0)
    assert not Lease.objects.filter(task_id=task_id).exists()


def test_l1_j5_grant_just_inside_start_window_is_given(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    pinned.shift(599.9)
    assert grant_lease(machine, task_id).status_code == 201


def test_l2_grant_refused_when_folder_grant_revoked(owner, machine, grant, grant_root, pinned):
    task_id, _ = leased(owner, machine, grant_root)
    # The leased task keeps its state (its facts decide) but gets no lease again.
    assert owner_api(owner).post(f"/api/grants/{grant.id}/revoke/").status_code == 200
    assert refused(grant_lease(machine, task_id), "revoked")


def test_l2_grant_refused_when_budget_reservation_no_longer_fits(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    Budget.objects.filter(owner=owner).update(limit_s=100)  # the owner lowered the limit in admin
    assert refused(grant_lease(machine, task_id), "budget")
    assert Task.objects.get(pk=task_id).state == "accepted"


def test_l2_grant_refused_for_unpaired_machine(owner, machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    stale = Machine.objects.get(pk=machine.pk)  # authenticated just before the unpair committed
    machine_unpair(machine=machine, actor="owner:alice", now=clock.now())
    with pytest.raises(LeaseRefused) as exc:
        lease_grant(machine=stale, operation_id=operation_id(task_id), now=clock.now())
    assert exc.value.code == "unpaired"
    resp = grant_lease(machine, task_id)  # through HTTP the old token is refused first
    assert resp.status_code == 401 and resp.json()["error"] == "token_revoked"
    anonymous = APIClient().post("/api/worker/leases/", {"operation_id": operation_id(task_id)}, format="json")
    assert anonymous.status_code == 401 and anonymous["WWW-Authenticate"] == "Machine"  # the scheme it takes


def test_l1_grant_for_another_machines_operation_is_404(owner, machine, make_machine, grant, grant_root, pinned):
    task_id = new_task(owner, machine, grant_root)
    other = make_machine(owner, name="desktop")
    resp = grant_lease(other, task_id)
    assert resp.status_code == 404
    assert Task.objects.get(pk=task_id).state == "accepted"


# --- L2, L5, L10: renewals --------------------------------------------------------------


def test_l2_renewal_extends_from_now_and_l10_keeps_output_tail(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    pinned.shift(15)
    resp = renew(machine, lease_id, output_tail="line 1\nline 2\n")
    assert resp.status_code == 200
    assert resp.json()["expires_at"] == (clock.now() + timedelta(seconds=60)).isoformat()
    lease = Lease.objects.get(pk=lease_id)
    assert (lease.renewals, lease.last_renewed_at) == (1, clock.now())
    assert Task.objects.get(pk=task_id).output_tail == "line 1\nline 2\n"


def test_l10_output_tail_is_bounded(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    assert renew(machine, lease_id, output_tail="x" * 10000 + "END").status_code == 200
    tail = Task.objects.get(pk=task_id).output_tail
    assert len(tail) == 4000 and tail.endswith("END")


def test_l5_renewal_refused_revoked(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    owner_api(owner).post(f"/api/grants/{grant.id}/revoke/")
    assert refused(renew(machine, lease_id), "revoked")
    assert Task.objects.get(pk=task_id).state == "running"  # the facts decide later


def test_l5_renewal_refused_unpaired(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    stale = Machine.objects.get(pk=machine.pk)
    owner_api(owner).post(f"/api/machines/{machine.id}/unpair/")
    with pytest.raises(LeaseRefused) as exc:
        lease_renew(machine=stale, lease_id=lease_id, output_tail=None, now=clock.now())
    assert exc.value.code == "unpaired"
    assert Lease.objects.get(pk=lease_id).refused_reason == "unpaired"
    resp = renew(machine, lease_id)
    assert resp.status_code == 401 and resp.json()["error"] == "token_revoked"


def test_l5_renewal_refused_cancelled(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    owner_api(owner).post(f"/api/tasks/{task_id}/cancel/")
    assert refused(renew(machine, lease_id), "cancelled")
    assert Task.objects.get(pk=task_id).state == "running"


def test_l5_renewal_past_max_runtime_refused_with_max_runtime(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root, max_runtime_s=100)
    for _ in range(3):  # renewals at 30, 60, 90 s keep the lease
        pinned.shift(30)
        assert renew(machine, lease_id).status_code == 200
    pinned.shift(10)  # 100 s of run time
    assert refused(renew(machine, lease_id), "max_runtime")
    assert Lease.objects.get(pk=lease_id).refused_reason == "max_runtime"


def test_l5_renewal_refused_budget(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    Budget.objects.filter(owner=owner).update(limit_s=600)  # below the 1800 s reserved
    assert refused(renew(machine, lease_id), "budget")


def test_l5_renewal_refused_expired_and_task_unknown_without_sweep(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    pinned.shift(60.001)
    assert refused(renew(machine, lease_id), "expired")
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert task.holds_lock and Budget.objects.get(owner=owner).reserved_s == 1800  # L6: both stay
    assert OutboxMessage.objects.filter(operation__task=task, kind="query").count() == 1


def test_l5_refusal_is_final_for_the_lease(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    Budget.objects.filter(owner=owner).update(limit_s=600)
    assert refused(renew(machine, lease_id), "budget")
    Budget.objects.filter(owner=owner).update(limit_s=36000)  # the cause is gone...
    assert refused(renew(machine, lease_id), "budget")  # ...the lease stays refused
    assert refused(grant_lease(machine, task_id), "budget")  # and no new lease either
    assert Lease.objects.filter(task_id=task_id).count() == 1


def test_l5_renewal_of_a_lease_ended_by_final_receipt_is_refused(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    receipt(machine, task_id, "final", final_facts())
    assert refused(renew(machine, lease_id), "expired")
    assert Task.objects.get(pk=task_id).state == "succeeded"


def test_l6_renewal_just_before_expiry_is_given(owner, machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    pinned.shift(59.9)
    assert renew(machine, lease_id).status_code == 200
    pinned.shift(59.9)
    assert renew(machine, lease_id).status_code == 200
    assert Task.objects.get(pk=task_id).state == "running"


def test_l5_renewal_by_another_machine_is_404(owner, machine, make_machine, grant, grant_root, pinned):
    task_id, lease_id = leased(owner, machine, grant_root)
    other = make_machine(owner, name="desktop")
    assert renew(other, lease_id).status_code == 404
    assert Lease.objects.get(pk=lease_id).refused_reason == ""


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_l1_racing_grants_get_one_lease(owner, machine, grant, grant_root):
    import threading

    from django.db import connection

    for i in range(4):
        task_id = new_task(owner, machine, grant_root / f"t{i}")
        barrier = threading.Barrier(3)
        answers = []

        def run():
            try:
                barrier.wait()
                answers.append(grant_lease(machine, task_id))
            finally:
                connection.close()

        threads = [threading.Thread(target=run) for _ in range(3)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert sorted(a.status_code for a in answers) == [200, 200, 201]
        assert len({a.json()["lease_id"] for a in answers}) == 1
        assert Lease.objects.filter(task_id=task_id).count() == 1
        assert TaskEvent.objects.filter(task_id=task_id, new_state="starting").count() == 1
