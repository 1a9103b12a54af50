"""The task life cycle through the HTTP API on either database (SPEC 2, A, L, R, J)."""
import pytest

from tasks_app.models import Budget, Lease, OutboxMessage, Task, TaskEvent
from tests.conftest import machine_api, owner_api
from rest_framework.test import APIClient

from tests.factories import final_facts, grant_lease, operation_id, receipt, submit

pytestmark = pytest.mark.django_db


def test_a2_l1_j6_happy_path_accept_ack_lease_run_succeed(owner, machine, grant, grant_root):
    resp = submit(owner, machine, grant_root / "repo")
    assert resp.status_code == 201, resp.content
    task_id = resp.json()["id"]
    assert resp.json()["state"] == "accepted"
    budget = Budget.objects.get(owner=owner)
    assert budget.reserved_s == 1800

    pulled = machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]
    assert [m["kind"] for m in pulled] == ["start"]
    assert pulled[0]["payload"]["grant_root"] == str(grant_root)
    assert machine_api(machine).post(f"/api/worker/messages/{pulled[0]['id']}/ack/").status_code == 200
    assert Task.objects.get(pk=task_id).state == "delivered"

    lease = grant_lease(machine, task_id)
    assert lease.status_code == 201, lease.content
    assert set(lease.json()) == {"lease_id", "expires_at", "duration_s", "renew_every_s", "margin_s", "kill_grace_s"}
    assert grant_lease(machine, task_id).json()["lease_id"] == lease.json()["lease_id"]  # L1 idempotent
    assert receipt(machine, task_id, "starting").json() == {"outcome": "applied"}
    assert receipt(machine, task_id, "running", {"pid": 4242, "pgid": 4242, "process_start_time": 1.0}).json() == {
        "outcome": "applied"
    }
    renew = machine_api(machine).post(
        f"/api/worker/leases/{lease.json()['lease_id']}/renew/", {"output_tail": "line 1\n"}, format="json"
    )
    assert renew.status_code == 200
    assert receipt(machine, task_id, "final", final_facts(runtime_s=100.0)).json() == {"outcome": "applied"}

    task = Task.objects.get(pk=task_id)
    assert task.state == "succeeded"
    assert not task.holds_lock
    budget.refresh_from_db()
    assert (budget.reserved_s, budget.spent_s) == (0, 100.0)
    assert [e.new_state for e in TaskEvent.objects.filter(task=task)] == [
        "accepted", "delivered", "starting", "starting", "running", "succeeded",
    ]
    assert OutboxMessage.objects.filter(operation__task=task).count() == 1


def test_r1_duplicate_receipt_gets_first_answer_byte_equal(owner, machine, grant, grant_root):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    first = receipt(machine, task_id, "final", final_facts(), event_id="ev-1")
    second = receipt(machine, task_id, "final", final_facts(exit_code=3), event_id="ev-1")
    assert first.content == second.content
    assert Task.objects.get(pk=task_id).state == "succeeded"


def test_l6_renewal_after_expiry_refused_and_task_unknown(owner, machine, grant, grant_root, time_machine):
    time_machine.move_to("2026-01-01T00:00:00Z", tick=False)
    task_id = submit(owner, machine, grant_root).json()["id"]
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    time_machine.shift(61)
    resp = machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json")
    assert resp.status_code == 409 and resp.json()["error"] == "expired"
    assert Task.objects.get(pk=task_id).state == "unknown"
    assert OutboxMessage.objects.filter(operation__task_id=task_id, kind="query").count() == 1
    assert Lease.objects.get(pk=lease_id).end_reason == "expired"


def test_a7_retention_window_published_in_api_schema(owner_client):
    resp = owner_client.get("/api/schema/?format=json")
    assert (resp.status_code, resp["Content-Type"].split(";")[0]) == (200, "application/vnd.oai.openapi+json")
    schema = resp.json()
    assert "retention window of 86400 seconds" in schema["info"]["description"]
    assert "/api/tasks/" in schema["paths"]


def test_k3_malformed_json_and_unknown_fields_answer_400_with_code(owner, machine, grant, grant_root):
    client = owner_api(owner)
    bad = client.post("/api/tasks/", "{not json", content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1")
    assert bad.status_code == 400 and bad.json()["error"] == "malformed_json"
    unknown = submit(owner, machine, grant_root, surprise=1)
    assert unknown.status_code == 400 and unknown.json()["error"] == "invalid"
    assert "surprise" in unknown.json()["fields"]
    assert Task.objects.count() == 0


def test_k4_folder_escapes_are_refused(owner, machine, grant, grant_root):
    dotdot = submit(owner, machine, f"{grant_root}/../etc")
    assert dotdot.status_code == 400 and "folder" in dotdot.json()["fields"]
    sibling = submit(owner, machine, f"{grant_root}-sibling")  # a name prefix is not a subfolder
    assert sibling.status_code == 403 and sibling.json()["error"] == "folder_not_granted"
    relative = submit(owner, machine, "repo")
    assert relative.status_code == 400
    assert Task.objects.count() == 0


def test_l7_lease_expiry_is_decided_by_the_service_clock_alone(owner, machine, grant, grant_root, time_machine):
    """The worker sends durations, never its wall clock; the service compares expires_at
    with its own clock."""
    time_machine.move_to("2026-03-01T12:00:00Z", tick=False)
    task_id = submit(owner, machine, grant_root).json()["id"]
    lease = grant_lease(machine, task_id).json()
    assert lease["expires_at"] == "2026-03-01T12:01:00+00:00"
    time_machine.shift(59)
    renewed = machine_api(machine).post(f"/api/worker/leases/{lease['lease_id']}/renew/", {}, format="json")
    assert renewed.json()["expires_at"] == "2026-03-01T12:01:59+00:00"
    time_machine.shift(60)
    expired = machine_api(machine).post(f"/api/worker/leases/{lease['lease_id']}/renew/", {}, format="json")
    assert expired.status_code == 409 and expired.json()["error"] == "expired"


def test_l2_renewal_after_repair_is_refused_unpaired(owner, machine, grant, grant_root):
    """A lease belongs to the pairing that took it: after a re-pair (generation 2), the new
    token cannot renew the old generation's lease."""
    task_id = submit(owner, machine, grant_root).json()["id"]
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    code = owner_api(owner).post("/api/machines/pairing-codes/", {"machine": str(machine.id)}, format="json").json()["code"]
    paired = APIClient().post("/api/worker/pair/", {"code": code}, format="json").json()
    assert paired["generation"] == 2
    new = APIClient()
    new.credentials(HTTP_AUTHORIZATION=f"Machine {paired['token']}")
    refused = new.post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json")
    assert refused.status_code == 409 and refused.json()["error"] == "unpaired"
    again = new.post("/api/worker/leases/", {"operation_id": operation_id(task_id)}, format="json")
    assert again.status_code == 409 and again.json()["error"] == "unpaired"
    assert Lease.objects.filter(task_id=task_id).count() == 1


def test_p3_granting_a_folder_twice_gives_one_grant_so_one_revocation_ends_it(owner, machine, grant, grant_root):
    client = owner_api(owner)
    again = client.post("/api/grants/", {"machine": str(machine.id), "path": str(grant_root)}, format="json")
    assert again.status_code == 200 and again.json()["id"] == str(grant.id)
    assert client.post(f"/api/grants/{grant.id}/revoke/").status_code == 200
    refused = submit(owner, machine, grant_root / "repo")
    assert refused.status_code == 403 and refused.json()["error"] == "folder_not_granted"
    fresh = client.post("/api/grants/", {"machine": str(machine.id), "path": str(grant_root)}, format="json")
    assert fresh.status_code == 201 and fresh.json()["id"] != str(grant.id)


def test_k3_bad_input_answers_json_4xx_and_changes_nothing(owner, machine, machine_client, grant, grant_root):
    client = owner_api(owner)
    assert client.get("/api/tasks/not-a-uuid/").json()["error"] == "not_found"
    assert client.get("/api/nope/").json() == {"error": "not_found", "detail": "not found"}
    deep = client.post("/api/tasks/", "[" * 100000 + "]" * 100000, content_type="application/json", HTTP_IDEMPOTENCY_KEY="deep")
    assert deep.status_code == 400 and deep.json()["error"] == "malformed_json"
    big = submit(owner, machine, grant_root, prompt="x" * 300 * 1024)
    assert big.status_code == 413 and big.json()["error"] == "body_too_large"
    for wrong in ({"prompt": 5}, {"deep_research": "yes"}, {"session": 5}, {"max_runtime_s": True}):
        resp = submit(owner, machine, grant_root, **wrong)
        assert resp.status_code == 400 and set(resp.json()["fields"]) == set(wrong), resp.json()
    int_machine = client.post(
        "/api/tasks/", {"machine": 5, "folder": str(grant_root), "agent": "a", "prompt": "p"}, format="json",
        HTTP_IDEMPOTENCY_KEY="int-machine",
    )
    assert int_machine.status_code == 400 and "machine" in int_machine.json()["fields"]
    assert client.options("/api/tasks/").status_code == 200
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    for facts in ({"pid": 10**30}, {"pid": 7, "process_start_time": "x"}, {"pid": -5}):
        assert receipt(machine, task_id, "running", facts).status_code == 400
    assert receipt(machine, task_id, "starting", generation=10**30).status_code == 400
    assert receipt(machine, task_id, "final", final_facts(exit_code=10**30)).status_code == 400
    no_slash = client.post("/api/tasks", {}, format="json")
    assert no_slash.status_code == 404 and no_slash.json()["error"] == "not_found"
    survivors = receipt(machine, task_id, "final", final_facts(survivors=["garbage"]))
    assert survivors.status_code == 400
    assert receipt(machine, task_id, "running", {"pid": 7}).json() == {"outcome": "applied"}
    assert receipt(machine, task_id, "running", {"pid": 8}).json()["outcome"] == "not_applied"
    assert Task.objects.get(pk=task_id).pid == 7  # a receipt that does not apply changes nothing
    head = client.head("/api/budget/")
    assert head.status_code == 200 and head.content == b""


def test_k1_pairing_code_single_use_and_guessing_braked_per_client(owner):
    anonymous = APIClient()
    for _ in range(30):
        wrong = anonymous.post("/api/worker/pair/", {"code": "WRONGWRONG22"}, format="json", REMOTE_ADDR="10.0.0.66")
        assert wrong.status_code == 400 and wrong.json()["error"] == "pairing_code_invalid"
    code = owner_api(owner).post("/api/machines/pairing-codes/", {"name": "mac"}, format="json").json()["code"]
    assert len(code) >= 8  # 12 symbols of 32: 60 bits
    braked = anonymous.post("/api/worker/pair/", {"code": code}, format="json", REMOTE_ADDR="10.0.0.66")
    assert braked.status_code == 429 and braked.json()["error"] == "too_many_attempts"
    paired = anonymous.post("/api/worker/pair/", {"code": code.lower()}, format="json", REMOTE_ADDR="10.0.0.7")
    assert paired.status_code == 201 and paired.json()["generation"] == 1
    reused = anonymous.post("/api/worker/pair/", {"code": code}, format="json", REMOTE_ADDR="10.0.0.7")
    assert reused.status_code == 400 and reused.json()["error"] == "pairing_code_invalid"


def test_k1_owner_rotates_api_token_and_the_old_one_stops_working(owner):
    old = owner_api(owner)
    rotated = old.post("/api/token/rotate/")
    assert rotated.status_code == 201
    refused = old.get("/api/budget/")
    assert refused.status_code == 401
    assert refused["WWW-Authenticate"] == "Token"  # the scheme an owner's endpoint takes
    new = APIClient()
    new.credentials(HTTP_AUTHORIZATION=f"Token {rotated.json()['token']}")
    assert new.get("/api/budget/").status_code == 200
