"""Regressions found by the K2 isolation matrix and the schemathesis run (issue 15), each
named after the rule it broke."""
import json
import uuid

from django.conf import settings
from django.test import Client
from drf_spectacular.generators import SchemaGenerator

from tests.conftest import machine_api, owner_api
from tests.factories import grant_lease, operation_id, receipt, submit


def test_h_413_is_documented_for_every_operation(db):
    """schemathesis: POST /api/worker/progress/ answered 413 (body over the limit), which
    its schema did not list. Every operation now declares 413 with the error shape."""
    schema = SchemaGenerator().get_schema(request=None, public=True)
    missing = [(path, method) for path, item in schema["paths"].items() for method, op in item.items()
               if method in ("get", "post", "put", "patch", "delete") and "413" not in op["responses"]]
    assert missing == []


def test_k3_progress_body_over_the_limit_is_413_with_the_error_shape(owner, machine, grant, pinned):
    task_id = submit(owner, machine, grant.path).json()["id"]
    grant_lease(machine, task_id)
    receipt(machine, task_id, "running", {"pid": 7})
    body = {"operation_id": operation_id(task_id), "seq": 1, "output_tail": "x" * (settings.DATA_UPLOAD_MAX_MEMORY_SIZE + 1),
            "last_message": None, "usage": None}
    response = machine_api(machine).post("/api/worker/progress/", body, format="json")
    assert response.status_code == 413
    assert response.json()["error"] == "body_too_large"


def test_k3_receipt_for_another_machines_operation_writes_no_row(owner, other_owner, machine, grant, make_machine, pinned):
    """Matrix: another machine's receipt naming this machine's operation answered 404 but
    stored a Receipt row (a write on a refusal, and unbounded). Now nothing is stored, and a
    second delivery still gets the same bytes (R1)."""
    from tasks_app.models import Receipt

    task_id = submit(owner, machine, grant.path).json()["id"]
    intruder = make_machine(other_owner, name="intruder")
    body = {"event_id": "e1", "generation": 1, "operation_id": operation_id(task_id), "kind": "starting", "slept_s": 0,
            "facts": {}}
    first = machine_api(intruder).post("/api/worker/receipts/", body, format="json")
    again = machine_api(intruder).post("/api/worker/receipts/", body, format="json")
    assert first.status_code == again.status_code == 404
    assert first.content == again.content
    assert json.loads(first.content)["error"] == "not_found"
    assert Receipt.objects.count() == 0


def test_k2_schema_reads_no_credential(owner, machine):
    """Matrix: /api/schema/ (public) answered a stale token with a YAML 401. It reads no
    credential now: every caller gets the document."""
    stale_token = owner.auth_token.key
    owner_api(owner).post("/api/token/rotate/")
    for header in (f"Token {stale_token}", "Machine not-a-token", ""):
        response = Client().get("/api/schema/?format=json", HTTP_AUTHORIZATION=header)
        assert response.status_code == 200, header
        assert "paths" in json.loads(response.content)


def test_n2_pwa_files_answer_head(db):
    """Matrix: /sw.js and /manifest.webmanifest answered HEAD with 405."""
    for path in ("/sw.js", "/manifest.webmanifest"):
        assert Client().head(path).status_code == 200
        assert Client().post(path).status_code == 405


def test_k2_sibling_machine_cannot_ack_or_renew_for_another_machine(owner, machine, grant, make_machine, pinned):
    """A sibling machine of the same owner reaches none of this machine's messages or
    leases (K2): 404, and nothing changes."""
    from tasks_app.models import Lease, OutboxMessage

    task_id = submit(owner, machine, grant.path).json()["id"]
    (message,) = machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    sibling = machine_api(make_machine(owner, name="desk"))
    before = (list(OutboxMessage.objects.values()), list(Lease.objects.values()))
    assert sibling.post(f"/api/worker/messages/{message['id']}/ack/").status_code == 404
    assert sibling.post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json").status_code == 404
    assert sibling.post(f"/api/worker/messages/{uuid.uuid4()}/ack/").status_code == 404
    assert (list(OutboxMessage.objects.values()), list(Lease.objects.values())) == before
