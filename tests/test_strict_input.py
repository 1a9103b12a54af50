"""K3 in every API: unknown fields and values of the wrong JSON type are refused with 400
and the ``{"error", "detail"}`` shape, in both apps, in bodies and in query strings, and
a refused request changes nothing in the database. Also the error shape of the other
refusals DRF makes (401, 403, 404, 405, 415)."""
import json
import uuid

from django.apps import apps
from rest_framework.test import APIClient

from tests.conftest import machine_api, owner_api
from tests.factories import notification_settings, push_subscription, submit


def _ask(session_id, **overrides):
    return {"key": f"k-{uuid.uuid4()}", "session": session_id, "agent": "claude", "tool_name": "Bash",
            "tool_input": {"command": "ls"}, **overrides}


def _receipt(w, **overrides):
    return {"event_id": "e1", "generation": w["generation"], "operation_id": w["op"], "kind": "starting", "slept_s": 0,
            "facts": {}, **overrides}


# (who, method, path, bad-type body, field named by the refusal, a valid body to add an unknown field to)
BODY_ENDPOINTS = [
    ("owner", "post", "/api/tasks/",
     lambda w: {"machine": w["machine"], "folder": w["folder"], "agent": "demo", "prompt": "p", "exclusive": "yes"},
     "exclusive", lambda w: {"machine": w["machine"], "folder": w["folder"], "agent": "demo", "prompt": "p"}),
    ("owner", "post", "/api/tasks/{task}/cancel/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/tasks/{task}/integrate/", lambda w: {"action": True}, "action",
     lambda w: {"action": "merge"}),
    ("owner", "post", "/api/tasks/{conversation}/messages/", lambda w: {"text": 5}, "text", lambda w: {"text": "hi"}),
    ("owner", "post", "/api/tasks/{conversation}/messages/{seq}/withdraw/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/tasks/{conversation}/interrupt/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/tasks/{conversation}/end/", lambda w: "now", "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/token/rotate/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/machines/pairing-codes/", lambda w: {"name": 5}, "name", lambda w: {"name": "x"}),
    ("owner", "post", "/api/machines/{machine}/unpair/", lambda w: "now", "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/grants/", lambda w: {"machine": w["machine"], "path": 5}, "path",
     lambda w: {"machine": w["machine"], "path": w["folder"] + "/sub"}),
    ("owner", "post", "/api/grants/{grant}/revoke/", lambda w: [], "non_field_errors", lambda w: {}),
    # C8: machine pools
    ("owner", "post", "/api/pools/", lambda w: {"name": "gpu", "machines": w["machine"]}, "machines",
     lambda w: {"name": "gpu", "machines": [w["machine"]]}),
    ("owner", "post", "/api/pools/", lambda w: {"name": "any"}, "name", lambda w: {"name": "gpu"}),
    ("owner", "post", "/api/pools/", lambda w: {"name": "gpu", "machines": [w["machine"], w["machine"]]}, "machines",
     lambda w: {"name": "gpu", "machines": []}),
    ("owner", "patch", "/api/pools/{pool}/", lambda w: {"name": 5}, "name", lambda w: {"name": "gpu"}),
    ("owner", "patch", "/api/pools/{pool}/", lambda w: {}, "non_field_errors", lambda w: {"machines": []}),
    ("owner", "delete", "/api/pools/{pool}/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/tasks/",
     lambda w: {"machine": "pool with spaces", "folder": w["folder"], "agent": "demo", "prompt": "p"}, "machine",
     lambda w: {"machine": "desk", "folder": w["folder"], "agent": "demo", "prompt": "p"}),
    ("anonymous", "post", "/api/worker/pair/", lambda w: {"code": 12345678}, "code", lambda w: {"code": "ABCD-EFGH"}),
    ("machine", "post", "/api/worker/messages/{message}/ack/", lambda w: [], "non_field_errors", lambda w: {}),
    ("machine", "post", "/api/worker/leases/", lambda w: {"operation_id": 7}, "operation_id",
     lambda w: {"operation_id": w["op"]}),
    ("machine", "post", "/api/worker/leases/", lambda w: {"operation_id": w["op"], "approval_credential": "maybe"},
     "approval_credential", lambda w: {"operation_id": w["op"], "approval_credential": True}),  # Q5
    ("machine", "post", "/api/worker/leases/{lease}/renew/", lambda w: {"output_tail": ["x"]}, "output_tail",
     lambda w: {"output_tail": "x"}),
    ("machine", "post", "/api/worker/progress/",
     lambda w: {"operation_id": w["op"], "seq": "1", "output_tail": "", "last_message": None, "usage": None}, "seq",
     lambda w: {"operation_id": w["op"], "seq": 1, "output_tail": "", "last_message": None, "usage": None}),
    ("machine", "post", "/api/worker/progress/",
     lambda w: {"operation_id": w["op"], "seq": 1, "output_tail": "", "last_message": None, "usage": None,
                "entries": [{"n": "1", "kind": "message", "text": "hi"}]}, "entries",
     lambda w: {"operation_id": w["op"], "seq": 1, "output_tail": "", "last_message": None, "usage": None,
                "entries": [{"n": 1, "kind": "message", "text": "hi"}]}),
    ("machine", "put", "/api/worker/profiles/", lambda w: {"profiles": [{"name": "claude", "preset": 1}]}, "profiles",
     lambda w: {"profiles": [{"name": "claude", "preset": None}]}),
    ("machine", "post", "/api/worker/receipts/", lambda w: _receipt(w, generation=str(w["generation"])), "generation",
     lambda w: _receipt(w)),
    ("machine", "post", "/api/worker/sync/", lambda w: {"receipts": [_receipt(w, generation=str(w["generation"]))]},
     "receipts", lambda w: {"renew": [{"lease_id": w["lease"]}], "receipts": [_receipt(w)]}),
    ("machine", "post", "/api/worker/sync/", lambda w: {"renew": [{"lease_id": w["lease"], "output_tail": 5}]},
     "renew", lambda w: {"renew": [{"lease_id": w["lease"]}]}),
    ("owner", "post", "/api/sessions/", lambda w: {"title": 5}, "title", lambda w: {"title": "t"}),
    ("owner", "patch", "/api/sessions/{session}/", lambda w: {"title": False}, "title", lambda w: {"title": "t"}),
    ("owner", "delete", "/api/sessions/{session}/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "put", "/api/sessions/{session}/marker/",
     lambda w: {"turn_id": "t1", "device_id": "laptop", "state": "running", "deep_research": "yes"}, "deep_research",
     lambda w: {"turn_id": "t1", "device_id": "laptop", "state": "running"}),
    ("machine", "put", "/api/sessions/{session}/marker/",
     lambda w: {"turn_id": "t1", "device_id": w["machine"], "state": 1}, "state",
     lambda w: {"turn_id": "t1", "device_id": w["machine"], "state": "running"}),
    ("owner", "post", "/api/devices/{device}/sweep/", lambda w: [], "non_field_errors", lambda w: {}),
    ("machine", "post", "/api/devices/{machine}/sweep/", lambda w: 1, "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/sessions/{session}/jobs/", lambda w: {"job_id": "j2", "mode": "held", "auto_backgrounded": 1},
     "auto_backgrounded", lambda w: {"job_id": "j2", "mode": "held"}),
    ("owner", "post", "/api/sessions/{session}/jobs/{job}/finish/", lambda w: {"wakes": "yes"}, "wakes",
     lambda w: {"wakes": True}),
    ("owner", "post", "/api/sessions/{session}/stop/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/sessions/", lambda w: {"title": "t", "channel": True}, "channel",
     lambda w: {"title": "t", "machine": w["machine"], "channel": "hook"}),
    ("owner", "post", "/api/sessions/{session}/messages/", lambda w: {"text": ["hi"]}, "text",
     lambda w: {"text": "hi"}),
    ("owner", "post", "/api/sessions/{session}/messages/{seq}/delivery/", lambda w: {"state": 1}, "state",
     lambda w: {"state": "delivered"}),
    ("machine", "post", "/api/sessions/{session}/messages/{seq}/delivery/", lambda w: {"state": "delivered", "claim": 5},
     "claim", lambda w: {"state": "delivered", "claim": "c1"}),
    ("owner", "post", "/api/sessions/{session}/messages/{seq}/withdraw/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/sessions/{session}/interrupt/", lambda w: "now", "non_field_errors", lambda w: {}),
    ("owner", "put", "/api/notifications/settings/", lambda w: {**notification_settings(), "board": "yes"}, "board",
     lambda w: notification_settings()),
    ("owner", "post", "/api/push/subscriptions/", lambda w: {**push_subscription(), "expirationTime": "soon"},
     "expirationTime", lambda w: push_subscription()),
    ("owner", "delete", "/api/push/subscriptions/{subscription}/", lambda w: [], "non_field_errors", lambda w: {}),
    ("owner", "post", "/api/approvals/", lambda w: _ask(w["session"], tool_input="ls"), "tool_input",
     lambda w: _ask(w["session"])),
    ("owner", "post", "/api/approvals/", lambda w: _ask(w["session"], suggestions={"type": "setMode"}), "suggestions",
     lambda w: _ask(w["session"], suggestions=[])),
    ("owner", "post", "/api/approvals/{approval}/decision/", lambda w: {"behavior": True}, "behavior",
     lambda w: {"behavior": "allow"}),
    ("owner", "post", "/api/approvals/{approval}/decision/", lambda w: {"behavior": "deny", "message": 5}, "message",
     lambda w: {"behavior": "deny"}),
    ("owner", "post", "/api/approvals/{approval}/terminal/", lambda w: [], "non_field_errors", lambda w: {}),
]

# (who, path with a malformed parameter value or None, the parameter, path for an unknown parameter)
QUERY_ENDPOINTS = [
    ("owner", "/api/tasks/?limit=ten", "limit", "/api/tasks/"),
    ("owner", "/api/tasks/?state=sleeping", "state", "/api/tasks/"),
    ("owner", "/api/tasks/?machine=laptop", "machine", "/api/tasks/"),
    ("owner", "/api/tasks/?limit=5&limit=6", "limit", "/api/tasks/{task}/"),
    ("owner", "/api/tasks/{task}/entries/?before=ten", "before", "/api/tasks/{task}/entries/"),
    ("owner", "/api/tasks/{task}/entries/?after=-1", "after", "/api/tasks/{task}/entries/"),
    ("owner", "/api/tasks/{task}/entries/?limit=201", "limit", "/api/tasks/{task}/entries/"),
    ("owner", "/api/tasks/{task}/entries/?before=5&after=1", "non_field_errors", "/api/tasks/{task}/entries/"),
    ("owner", "/api/machines/?limit=0", "limit", "/api/machines/"),
    ("owner", "/api/grants/?limit=101", "limit", "/api/grants/"),
    ("owner", "/api/pools/?limit=0", "limit", "/api/pools/"),
    ("owner", None, None, "/api/pools/{pool}/"),
    ("owner", "/api/sessions/?limit=1.0", "limit", "/api/sessions/"),
    ("machine", "/api/worker/messages/?wait=yes", "wait", "/api/worker/messages/"),
    ("machine", "/api/worker/messages/?wait=26", "wait", "/api/worker/messages/"),
    ("owner", None, None, "/api/tasks/{conversation}/messages/"),
    ("owner", None, None, "/api/sessions/{session}/"),
    ("owner", None, None, "/api/sessions/{session}/messages/"),
    ("owner", None, None, "/api/sessions/active/"),
    ("owner", None, None, "/api/budget/"),
    ("owner", None, None, "/api/board/"),
    ("owner", None, None, "/api/notifications/settings/"),
    ("owner", None, None, "/api/push/vapid-public-key/"),
    ("owner", "/api/approvals/?state=maybe", "state", "/api/approvals/"),
    ("owner", "/api/approvals/?task=t1", "task", "/api/approvals/"),
    ("owner", "/api/approvals/{approval}/?wait=yes", "wait", "/api/approvals/{approval}/"),
    ("owner", "/api/approvals/{approval}/?wait=26", "wait", "/api/approvals/{approval}/"),
]


def _client(who, machine, owner) -> APIClient:
    return {"owner": lambda: owner_api(owner), "machine": lambda: machine_api(machine), "anonymous": APIClient}[who]()


def snapshot() -> dict:
    """Every row of every RunStead model and of the owners' tokens."""
    models = [model for label in ("tasks_app", "sessions_app", "notifications", "authtoken")
              for model in apps.get_app_config(label).get_models()]
    return {m.__name__: list(m.objects.order_by("pk").values()) for m in models}


def send(client, method, path, body):
    return client.generic(method.upper(), path, json.dumps(body), content_type="application/json",
                          HTTP_IDEMPOTENCY_KEY=f"k-{uuid.uuid4()}")


def assert_refused(response, field):
    assert response.status_code == 400, response.content
    body = response.json()
    assert body["error"] == "invalid" and isinstance(body["detail"], str) and body["detail"]
    assert field in body["fields"], body


def test_k3_unknown_field_refused_in_every_api(one_of_each, owner, machine):
    """Table over both apps: one body of the wrong JSON type and one with an unknown field
    per endpoint -> 400 ``invalid`` naming the field, and the database is unchanged."""
    before = snapshot()
    for who, method, template, bad_type, field, valid in BODY_ENDPOINTS:
        path = template.format(**one_of_each)
        client = _client(who, machine, owner)
        assert_refused(send(client, method, path, bad_type(one_of_each)), field)
        assert_refused(send(client, method, path, {**valid(one_of_each), "colour": "red"}), "colour")
    assert snapshot() == before


def test_k3_query_parameters_are_strict_in_every_api(one_of_each, owner, machine):
    """Query strings too: a malformed value or an unknown parameter -> 400, nothing changed."""
    before = snapshot()
    for who, bad_path, param, plain in QUERY_ENDPOINTS:
        client = _client(who, machine, owner)
        if bad_path:
            assert_refused(client.get(bad_path.format(**one_of_each)), param)
        assert_refused(client.get(plain.format(**one_of_each) + "?colour=red"), "colour")
    assert snapshot() == before


def test_k3_sessions_api_refuses_string_boolean(owner_client, owner, pinned):
    sid = str(uuid.uuid4())
    owner_client.post(f"/api/sessions/{sid}/jobs/", {"job_id": "j1", "mode": "held"}, format="json")
    response = owner_client.post(f"/api/sessions/{sid}/jobs/j1/finish/", {"wakes": "yes"}, format="json")
    assert response.status_code == 400
    assert response.json() == {"error": "invalid", "detail": "wakes: expected boolean, got string",
                               "fields": {"wakes": ["expected boolean, got string"]}}
    from sessions_app.models import Job

    assert Job.objects.get(session_id=sid, job_id="j1").finished_at is None


def test_k3_integer_is_not_coerced_from_string_or_boolean(owner, machine, grant, pinned):
    for value, kind in (("60", "string"), (True, "boolean"), (60.5, "number")):
        response = submit(owner, machine, grant.path, max_runtime_s=value)
        assert response.status_code == 400
        assert response.json()["fields"] == {"max_runtime_s": [f"expected integer, got {kind}"]}


def test_k3_marker_without_body_is_refused_not_defaulted(owner_client, pinned):
    """An absent body is ``{}``: required fields are missing (no HTML-form defaults)."""
    response = owner_client.put(f"/api/sessions/{uuid.uuid4()}/marker/")
    assert response.status_code == 400
    assert set(response.json()["fields"]) == {"turn_id", "device_id", "state"}


def test_h_error_shape_of_auth_method_and_media_type_refusals(owner, machine, pinned):
    anonymous = APIClient()
    response = anonymous.get("/api/tasks/")
    assert (response.status_code, response.json()["error"]) == (401, "not_authenticated")
    response = machine_api(machine).get("/api/tasks/")
    assert (response.status_code, response.json()["error"]) == (403, "permission_denied")
    response = owner_api(owner).delete("/api/tasks/")
    assert (response.status_code, response.json()["error"]) == (405, "method_not_allowed")
    response = owner_api(owner).post("/api/sessions/", "title=x", content_type="application/x-www-form-urlencoded")
    assert (response.status_code, response.json()["error"]) == (415, "unsupported_media_type")
    response = owner_api(owner).post("/api/sessions/", "{", content_type="application/json")
    assert (response.status_code, response.json()["error"]) == (400, "malformed_json")
    response = owner_api(owner).get(f"/api/tasks/{uuid.uuid4()}/")
    assert (response.status_code, response.json()["error"]) == (404, "not_found")
    for response in (anonymous.get("/api/tasks/"), owner_api(owner).delete("/api/tasks/")):
        assert set(response.json()) == {"error", "detail"} and response.json()["detail"]


def test_k3_bad_cursor_is_refused(owner_client, pinned):
    response = owner_client.get("/api/tasks/?cursor=not-a-cursor")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid_cursor"


def test_k3_table_covers_every_api_operation():
    """A new endpoint cannot skip K3 unnoticed: every operation in /api/schema/ is in one
    of the tables above (bodies for writes, query strings for reads)."""
    import re

    from drf_spectacular.generators import SchemaGenerator

    def shape(path):
        return re.sub(r"\{\w+\}", "{}", path.split("?")[0])

    covered = {(m.upper(), shape(p)) for _, m, p, *_ in BODY_ENDPOINTS}
    covered |= {("GET", shape(p)) for _, bad, _, plain in QUERY_ENDPOINTS for p in (bad, plain) if p}
    schema = SchemaGenerator().get_schema(request=None, public=True)
    operations = {(m.upper(), shape(p)) for p, item in schema["paths"].items() for m in item if m in
                  ("get", "post", "put", "patch", "delete")}
    assert operations - covered == set()
