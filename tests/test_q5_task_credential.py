"""Q5, Q7: a headless task's approval credential, on the service side.

The worker asks for it with the lease (``approval_credential``); the grant answer carries
it and the service's ``approval_wait_s``. It creates approvals of its own task and reads
them, nothing else: no deciding (403), no other task's approvals (404), no session
approval (403), no other endpoint (403), and nothing once its task is final (401). A
retried grant replaces it, so a lost answer never leaves two usable secrets.
"""
import hashlib
import uuid

from rest_framework.test import APIClient

from sessions_app.models import Approval
from tasks_app.models import Lease, Task
from tests.conftest import machine_api, owner_api
from tests.factories import final_facts, operation_id, receipt, submit

BASH = {"command": "make deploy", "description": "deploy"}


def lease(machine, task_id, **extra):
    return machine_api(machine).post("/api/worker/leases/", {"operation_id": operation_id(task_id), **extra},
                                     format="json")


def as_task(credential: str) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Task {credential}")
    return client


def ask_body(**fields):
    return {"key": f"task:{uuid.uuid4()}", "agent": "claude", "tool_name": "Bash", "tool_input": BASH,
            "cwd": "/work/repo", **fields}


def running(owner, machine, grant, folder="a", **lease_extra):
    task_id = submit(owner, machine, f"{grant.path}/{folder}").json()["id"]
    answer = lease(machine, task_id, **lease_extra)
    assert answer.status_code == 201, answer.content
    assert receipt(machine, task_id, "running", {"pid": 4242, "pgid": 4242, "process_start_time": 1.0}).status_code == 200
    return task_id, answer.json()


def test_q5_the_grant_carries_a_credential_only_when_asked_and_a_retry_replaces_it(owner, machine, grant, pinned,
                                                                                    settings):
    settings.RUNSTEAD_APPROVAL_WAIT_S = 42.5
    task_id, plain = running(owner, machine, grant)
    assert "approval" not in plain  # a profile with approvals = "off" gets no secret
    first = lease(machine, task_id, approval_credential=True)  # the live lease again (L1), now with one
    assert first.status_code == 200 and first.json()["lease_id"] == plain["lease_id"]
    assert first.json()["approval"]["wait_s"] == 42.5
    credential = first.json()["approval"]["credential"]
    assert as_task(credential).post("/api/approvals/", ask_body(), format="json").status_code == 201
    # Only the digest is stored (K1).
    task = Task.objects.get(pk=task_id)
    assert task.approval_token_hash == hashlib.sha256(credential.encode()).hexdigest()
    rows = repr(list(Task.objects.values())) + repr(list(Lease.objects.values())) + repr(list(Approval.objects.values()))
    assert credential not in rows
    # A grant asked again (its answer lost, say) mints a new one; the first stops working.
    second = lease(machine, task_id, approval_credential=True).json()["approval"]["credential"]
    assert second != credential
    assert as_task(credential).get("/api/approvals/").status_code == 401
    assert as_task(second).get("/api/approvals/").status_code == 200
    # A renewal never carries it.
    renewed = machine_api(machine).post(f"/api/worker/leases/{plain['lease_id']}/renew/", {}, format="json")
    assert renewed.status_code == 200 and "approval" not in renewed.json()


def test_q5_q7_the_credential_asks_and_reads_for_its_task_and_nothing_else(owner, machine, grant, pinned):
    task_id, answer = running(owner, machine, grant, approval_credential=True)
    other_id, _ = running(owner, machine, grant, folder="b")
    agent = as_task(answer["approval"]["credential"])
    owner_client = owner_api(owner)

    mine = agent.post("/api/approvals/", ask_body(), format="json")  # no task named: its own
    assert mine.status_code == 201 and mine.json()["task"] == task_id
    mine = mine.json()
    assert agent.get(f"/api/approvals/{mine['id']}/").json()["state"] == "pending"
    theirs = owner_client.post("/api/approvals/", ask_body(task=other_id), format="json").json()

    # Cannot decide, nor answer "in the terminal" (403), and nothing changed.
    decided = agent.post(f"/api/approvals/{mine['id']}/decision/", {"behavior": "allow"}, format="json",
                         HTTP_IDEMPOTENCY_KEY="k-1")
    assert (decided.status_code, decided.json()["error"]) == (403, "permission_denied")
    assert agent.post(f"/api/approvals/{mine['id']}/terminal/", {}, format="json").status_code == 403
    assert Approval.objects.get(pk=mine["id"]).state == "pending"
    # Another task's approvals, even its owner's: 404 to read, 404 to ask for, absent from the list.
    assert agent.get(f"/api/approvals/{theirs['id']}/").status_code == 404
    asked = agent.post("/api/approvals/", ask_body(task=other_id), format="json")
    assert (asked.status_code, asked.json()["error"]) == (404, "not_found")
    assert [a["id"] for a in agent.get("/api/approvals/").json()["results"]] == [mine["id"]]
    # No session approval, no other endpoint.
    session = agent.post("/api/approvals/", {**ask_body(), "session": str(uuid.uuid4())}, format="json")
    assert session.status_code == 403
    for path in ("/api/tasks/", f"/api/tasks/{task_id}/", "/api/board/", "/api/machines/", "/api/worker/messages/"):
        assert agent.get(path).status_code == 403, path
    assert Approval.objects.count() == 2

    # The task ends: its pending approval is withdrawn and the credential stops (401).
    assert receipt(machine, task_id, "final", final_facts()).status_code == 200
    assert Approval.objects.get(pk=mine["id"]).state == "withdrawn"
    for refused in (agent.get(f"/api/approvals/{mine['id']}/"), agent.post("/api/approvals/", ask_body(), format="json")):
        assert (refused.status_code, refused.json()["error"]) == (401, "token_revoked")
    assert Approval.objects.count() == 2


def test_q5_a_grant_with_the_flag_but_no_lease_gets_no_credential(owner, machine, grant, pinned):
    task_id = submit(owner, machine, grant.path).json()["id"]
    assert owner_api(owner).post(f"/api/tasks/{task_id}/cancel/", {}, format="json",
                                 HTTP_IDEMPOTENCY_KEY="c-1").status_code in (200, 202)
    refused = lease(machine, task_id, approval_credential=True)
    assert refused.status_code == 409 and "approval" not in refused.json()
    assert Task.objects.get(pk=task_id).approval_token_hash in ("", None)
