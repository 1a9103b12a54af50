"""Receipts (SPEC R1-R3, X3, U1, U2, L9): stored once per event id, answered the same way
every time, older generations recorded but never applied, malformed ones refused."""
import uuid

import pytest
from rest_framework.test import APIClient

from tasks_app.models import Budget, Receipt, Task, TaskEvent
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, grant_lease, operation_id, receipt, submit

pytestmark = pytest.mark.django_db

RUNNING = {"pid": 7, "pgid": 7, "process_start_time": 1.0}


@pytest.fixture(autouse=True)
def _pinned(pinned):
    return pinned


def running_task(owner, machine, folder) -> str:
    task_id = submit(owner, machine, folder).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", RUNNING).json() == {"outcome": "applied"}
    return task_id


def machine_with_token(token) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Machine {token}")
    return client


def repair(owner, machine) -> dict:
    """Re-pair ``machine`` through the API: a code for it, exchanged by the worker."""
    code = owner_api(owner).post("/api/machines/pairing-codes/", {"machine": str(machine.id)}, format="json")
    assert code.status_code == 201, code.content
    paired = APIClient().post("/api/worker/pair/", {"code": code.json()["code"]}, format="json")
    assert paired.status_code == 201, paired.content
    return paired.json()


def body(task_id, kind, facts=None, *, generation=1, event_id=None, **extra):
    return {
        "event_id": event_id or str(uuid.uuid4()), "generation": generation, "operation_id": operation_id(task_id),
        "kind": kind, "slept_s": 0.0, "facts": facts if facts is not None else {}, **extra,
    }


# --- R1 -------------------------------------------------------------------------------


def test_r1_duplicate_running_receipt_applied_once_same_bytes(owner, machine, grant, grant_root):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    first = receipt(machine, task_id, "running", RUNNING, event_id="ev-run")
    events = TaskEvent.objects.filter(task_id=task_id).count()
    again = receipt(machine, task_id, "running", {**RUNNING, "pid": 999}, event_id="ev-run")
    assert first.status_code == again.status_code == 200
    assert first.content == again.content == b'{"outcome":"applied"}'
    assert TaskEvent.objects.filter(task_id=task_id).count() == events
    assert Receipt.objects.filter(machine=machine, event_id="ev-run").count() == 1
    assert Task.objects.get(pk=task_id).pid == 7


def test_r1_duplicate_of_a_not_applied_answer_repeats_it_byte_equal(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    receipt(machine, task_id, "final", final_facts())
    late = receipt(machine, task_id, "running", RUNNING, event_id="ev-late")
    again = receipt(machine, task_id, "running", RUNNING, event_id="ev-late")
    assert late.json() == {"outcome": "not_applied", "reason": "final"}
    assert late.content == again.content


def test_r1_event_id_is_unique_per_machine_not_global(owner, machine, make_machine, grant, grant_root):
    from tasks_app.models import Grant

    other = make_machine(owner, name="desktop")
    Grant.objects.create(owner=owner, machine=other, path=str(grant_root))
    mine = running_task(owner, machine, grant_root / "a")
    theirs = running_task(owner, other, grant_root / "b")
    receipt(machine, mine, "final", final_facts(), event_id="same")
    receipt(other, theirs, "final", final_facts(exit_code=1), event_id="same")
    assert Task.objects.get(pk=mine).state == "succeeded"
    assert Task.objects.get(pk=theirs).state == "failed"


# --- reordered and repeated facts -------------------------------------------------------


def test_r3_running_after_final_is_not_applied(owner, machine, grant, grant_root):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    assert receipt(machine, task_id, "final", final_facts(runtime_s=20.0)).json() == {"outcome": "applied"}
    resp = receipt(machine, task_id, "running", RUNNING)
    assert resp.status_code == 200
    assert resp.json() == {"outcome": "not_applied", "reason": "final"}
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.pid) == ("succeeded", None)
    assert TaskEvent.objects.filter(task=task).last().reason == "running receipt after final state"


def test_r3_second_final_with_another_event_id_changes_nothing(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    assert receipt(machine, task_id, "final", final_facts(runtime_s=20.0), slept_s=3.0).json()["outcome"] == "applied"
    resp = receipt(machine, task_id, "final", final_facts(exit_code=1, runtime_s=900.0), slept_s=50.0)
    assert resp.json() == {"outcome": "not_applied", "reason": "final"}
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.exit_code, task.runtime_s, task.slept_s) == ("succeeded", 0, 20.0, 3.0)
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (0, 20.0)  # charged once
    assert TaskEvent.objects.filter(task=task, new_state="succeeded").exclude(old_state="succeeded").count() == 1


def test_r3_starting_after_running_is_history_only(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    assert receipt(machine, task_id, "starting").json() == {"outcome": "applied"}
    assert Task.objects.get(pk=task_id).state == "running"
    assert TaskEvent.objects.filter(task_id=task_id).last().reason == "starting receipt"


def test_r3_final_before_running_settles_and_late_running_is_not_applied(owner, machine, grant, grant_root):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    receipt(machine, task_id, "final", final_facts(exit_code=4))
    assert receipt(machine, task_id, "running", RUNNING).json()["reason"] == "final"
    assert Task.objects.get(pk=task_id).state == "failed"


# --- R2: an older generation is stored, never applied ----------------------------------


def test_r2_receipt_of_previous_generation_after_repair_is_recorded_not_applied(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    paired = repair(owner, machine)
    assert paired["generation"] == 2 and paired["machine_id"] == str(machine.id)

    # The old token is dead (R3: 401 token_revoked, final).
    old = machine_api(machine).post("/api/worker/receipts/", body(task_id, "final", final_facts()), format="json")
    assert old.status_code == 401 and old.json()["error"] == "token_revoked"

    # The re-paired worker forwards a receipt it recorded under generation 1.
    new = machine_with_token(paired["token"])
    resp = new.post("/api/worker/receipts/", body(task_id, "final", final_facts(), generation=1), format="json")
    assert resp.status_code == 200
    assert resp.json() == {"outcome": "not_applied", "reason": "old_generation"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "running"
    assert "old generation 1" in TaskEvent.objects.filter(task=task).last().reason
    stored = Receipt.objects.get(task=task, kind="final")
    assert stored.generation == 1  # in the task's history (admin inline, GET detail)
    detail = owner_api(owner).get(f"/api/tasks/{task_id}/").json()
    assert any(r["kind"] == "final" and r["generation"] == 1 for r in detail["receipts"])

    # Under the new generation, facts apply.
    resp = new.post("/api/worker/receipts/", body(task_id, "final", final_facts(), generation=2), format="json")
    assert resp.json() == {"outcome": "applied"}
    assert Task.objects.get(pk=task_id).state == "succeeded"


def test_r3_token_revoked_for_unknown_and_unpaired_tokens(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    resp = machine_with_token("not-a-token").post("/api/worker/receipts/", body(task_id, "starting"), format="json")
    assert resp.status_code == 401 and resp.json()["error"] == "token_revoked"
    owner_api(owner).post(f"/api/machines/{machine.id}/unpair/")
    resp = receipt(machine, task_id, "final", final_facts())
    assert resp.status_code == 401 and resp.json()["error"] == "token_revoked"
    assert Task.objects.get(pk=task_id).state == "running"


def test_r3_owner_token_cannot_post_receipts(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    resp = owner_api(owner).post("/api/worker/receipts/", body(task_id, "final", final_facts()), format="json")
    assert (resp.status_code, resp.json()["error"]) == (403, "permission_denied")
    assert Task.objects.get(pk=task_id).state == "running"


def test_r3_receipt_for_another_machines_operation_is_404(owner, other_owner, machine, make_machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    stranger = make_machine(other_owner, name="theirs")
    resp = receipt(stranger, task_id, "final", final_facts(), generation=1)
    assert resp.status_code == 404
    assert Task.objects.get(pk=task_id).state == "running"


# --- R3: malformed -> 400, nothing stored ------------------------------------------------


MALFORMED = {
    "missing_event_id": lambda b: b.pop("event_id"),
    "empty_event_id": lambda b: b.update(event_id=""),
    "generation_not_int": lambda b: b.update(generation="one"),
    "operation_not_uuid": lambda b: b.update(operation_id="op-1"),
    "unknown_kind": lambda b: b.update(kind="exploded"),
    "unknown_field": lambda b: b.update(colour="red"),
    "facts_not_object": lambda b: b.update(facts=[1, 2]),
    "negative_slept": lambda b: b.update(slept_s=-1),
    "process_started_maybe": lambda b: b["facts"].update(process_started="maybe"),
    "process_started_int": lambda b: b["facts"].update(process_started=1),
    "exit_code_string": lambda b: b["facts"].update(exit_code="0"),
    "exit_code_bool": lambda b: b["facts"].update(exit_code=False),
    "runtime_negative": lambda b: b["facts"].update(runtime_s=-5),
    "stop_reason_unknown": lambda b: b["facts"].update(stop_reason="bored"),
    "stop_reason_missing": lambda b: b["facts"].pop("stop_reason"),
    "ended_within_lease_string": lambda b: b["facts"].update(ended_within_lease="yes"),
    "survivors_not_list": lambda b: b["facts"].update(survivors="1234"),
    "running_without_pid": lambda b: b.update(kind="running", facts={"pgid": 1}),
    "report_without_record": lambda b: b.update(kind="report", facts={"query_id": "q"}),
    "report_record_string": lambda b: b.update(kind="report", facts={"query_id": "q", "record": "gone"}),
    "report_with_bad_final": lambda b: b.update(
        kind="report", facts={"query_id": "q", "record": {"local_state": "ended", "final": {"process_started": "?"}}}
    ),
}


@pytest.mark.parametrize("name", list(MALFORMED))
def test_r3_malformed_receipt_is_400_and_changes_nothing(owner, machine, grant, grant_root, name):
    task_id = running_task(owner, machine, grant_root)
    bad = body(task_id, "final", final_facts())
    MALFORMED[name](bad)
    resp = machine_api(machine).post("/api/worker/receipts/", bad, format="json")
    assert resp.status_code == 400, resp.content
    assert "error" in resp.json()
    assert Task.objects.get(pk=task_id).state == "running"
    assert Receipt.objects.filter(task_id=task_id).count() == 1  # only the running receipt


def test_r3_body_that_is_not_json_is_400(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    resp = machine_api(machine).post("/api/worker/receipts/", b"{not json", content_type="application/json")
    assert resp.status_code == 400
    assert Task.objects.get(pk=task_id).state == "running"


# --- X3, U1, U2, L9 ----------------------------------------------------------------------


def test_x3_u1_unknown_receipt_moves_running_to_unknown_and_queries(owner, machine, grant, grant_root):
    from tasks_app.models import OutboxMessage

    task_id = running_task(owner, machine, grant_root)
    resp = receipt(machine, task_id, "unknown", {"reason": "worker restarted"})
    assert resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert TaskEvent.objects.filter(task=task).last().reason == "worker: worker restarted"
    query = OutboxMessage.objects.get(operation__task=task, kind="query")
    assert query.payload["operation_id"] == operation_id(task_id) and query.payload["query_id"]
    # A second unknown changes nothing.
    assert receipt(machine, task_id, "unknown", {"reason": "again"}).json()["outcome"] == "not_applied"


def test_u2_report_without_record_leaves_task_waiting(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    receipt(machine, task_id, "unknown", {"reason": "restart"})
    resp = receipt(machine, task_id, "report", {"query_id": "q1", "record": None})
    assert resp.status_code == 200
    assert resp.json() == {"outcome": "not_applied", "reason": "no_final_facts"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"  # waits for its owner, who is asked now (N1)
    assert list(TaskEvent.objects.filter(task=task).values_list("reason", flat=True))[-2:] == [
        "report: no record", "needs the owner's decision: the worker's report: no record"]
    assert task.decision_asked_at is not None
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (1800, 0)


def test_u2_report_with_record_but_no_final_facts_leaves_task_waiting(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    receipt(machine, task_id, "unknown", {"reason": "restart"})
    record = {"local_state": "running", "pid": 7, "lease_id": None, "final": None}
    assert receipt(machine, task_id, "report", {"query_id": "q1", "record": record}).json()["outcome"] == "not_applied"
    assert Task.objects.get(pk=task_id).state == "unknown"


def test_u2_report_with_final_facts_settles_by_j6(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    receipt(machine, task_id, "unknown", {"reason": "restart"})
    record = {"local_state": "ended", "pid": 7, "lease_id": None, "final": final_facts(exit_code=0, runtime_s=33.0)}
    assert receipt(machine, task_id, "report", {"query_id": "q1", "record": record}).json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "succeeded"
    assert "report: J6 row 6" in TaskEvent.objects.filter(task=task).last().reason
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (0, 33.0)


def test_l9_slept_s_is_kept_as_evidence(owner, machine, grant, grant_root):
    task_id = running_task(owner, machine, grant_root)
    receipt(machine, task_id, "unknown", {"reason": "lid closed"}, slept_s=840.5)
    assert Task.objects.get(pk=task_id).slept_s == 840.5
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["slept_s"] == 840.5


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_r1_racing_duplicates_are_applied_once_with_one_answer(owner, machine, grant, grant_root):
    import threading

    from django.db import connection

    task_id = running_task(owner, machine, grant_root)
    barrier = threading.Barrier(3)
    answers = []

    def run():
        try:
            barrier.wait()
            answers.append(receipt(machine, task_id, "final", final_facts(runtime_s=8.0), event_id="dup"))
        finally:
            connection.close()

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert {(a.status_code, a.content) for a in answers} == {(200, b'{"outcome":"applied"}')}
    assert Receipt.objects.filter(machine=machine, event_id="dup").count() == 1
    assert TaskEvent.objects.filter(task_id=task_id, new_state="succeeded").count() == 1
    budget = Budget.objects.get(owner=owner)
    assert (budget.reserved_s, budget.spent_s) == (0, 8.0)
