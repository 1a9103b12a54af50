"""H: ``/api/schema/`` describes every answer, so a client generated from it is usable:
each operation's 2xx bodies have a typed shape (properties, or items that have them), and
each declares the one error shape for its 4xx. Also: real answers carry exactly the fields
the schema declares for them.

One description per wire shape (issue 18, STYLE 9): every answer and board event is
described by the ``TypedDict`` its builder returns (``*/shapes.py``), the schema is
generated from those, and a walk through every operation and board event validates the
real bodies, strictly (no missing, extra, mistyped or wrongly null key), against it."""
import base64
import importlib
import re
import typing
import uuid
from datetime import datetime

import pytest
from django.core.cache import cache
from drf_spectacular.generators import SchemaGenerator
from jsonschema import Draft7Validator, FormatChecker

from tests.conftest import machine_api, owner_api
from tests.factories import agent_facts, final_facts, grant_lease, operation_id, receipt, submit
from tests.sessions_events import board_events  # noqa: F401  (fixture)

METHODS = ("get", "post", "put", "patch", "delete")


@pytest.fixture(scope="module")
def schema():
    return SchemaGenerator().get_schema(request=None, public=True)


def resolve(schema, node):
    while "$ref" in node:
        node = schema["components"]["schemas"][node["$ref"].split("/")[-1]]
    return node


def untyped(schema, node, path="") -> list[str]:
    """Where ``node`` (a response schema) is a bare object or missing a shape."""
    node = resolve(schema, node)
    if "allOf" in node or "oneOf" in node:
        return [p for part in node.get("allOf", node.get("oneOf")) for p in untyped(schema, part, path)]
    kind = node.get("type")
    if node.get("enum") == [None]:
        return []  # drf-spectacular's NullEnum: the null of a nullable enum
    if kind == "array":
        return untyped(schema, node.get("items", {}), path + "[]")
    if kind == "object" or "properties" in node:
        if not node.get("properties"):
            return [path or "<body>"]
        return [p for name, sub in node["properties"].items() if (p := _untyped_property(schema, sub, f"{path}.{name}"))]
    if kind is None:
        return [path or "<body>"]
    return []


def _untyped_property(schema, node, path):
    """A nested object must be typed too; a declared free-form map (additionalProperties
    with a description, e.g. a payload whose shape depends on a kind) is allowed."""
    node = resolve(schema, node)
    if node.get("type") == "object" and not node.get("properties") and node.get("additionalProperties") is not None:
        return None if node.get("description") else path
    problems = untyped(schema, node, path)
    return problems[0] if problems else None


def operations(schema):
    for path, item in schema["paths"].items():
        for method in METHODS:
            if method in item:
                yield path, method, item[method]


def test_h_every_2xx_response_has_a_typed_shape(schema):
    problems = []
    for path, method, op in operations(schema):
        successes = {code: r for code, r in op["responses"].items() if code.startswith("2")}
        if not successes:
            problems.append(f"{method.upper()} {path}: no 2xx response")
        for code, response in successes.items():
            if code == "204":
                assert "content" not in response, (path, method)
                continue
            content = response.get("content", {}).get("application/json")
            if content is None:
                problems.append(f"{method.upper()} {path} {code}: no JSON body")
                continue
            problems += [f"{method.upper()} {path} {code}: untyped {where}" for where in untyped(schema, content["schema"])]
    assert problems == []


def test_h_every_operation_declares_the_error_shape(schema):
    error = schema["components"]["schemas"]["ErrorShape"]
    assert set(error["required"]) == {"error", "detail"}
    problems = []
    for path, method, op in operations(schema):
        codes = {code for code in op["responses"] if code.startswith("4")}
        for expected in ("400", "401", "403", "404"):
            if expected not in codes:
                problems.append(f"{method.upper()} {path}: no {expected}")
        for code in codes:
            ref = op["responses"][code].get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            if ref != "#/components/schemas/ErrorShape":
                problems.append(f"{method.upper()} {path} {code}: not ErrorShape")
    assert problems == []


def test_h_schema_covers_every_api_route(schema):
    """Nothing under /api/ is missing from the schema (a hand-written view would be)."""
    from django.urls import get_resolver

    def walk(patterns, prefix=""):
        for p in patterns:
            route = prefix + str(p.pattern)
            if hasattr(p, "url_patterns"):
                yield from walk(p.url_patterns, route)
            else:
                yield route

    routes = {r for r in walk(get_resolver().url_patterns) if r.startswith("api/") and r != "api/schema/"}
    documented = {p.lstrip("/") for p in schema["paths"]}
    as_schema = {_placeholder(r) for r in routes}
    assert as_schema - {_placeholder(p) for p in documented} == set()


def _placeholder(route: str) -> str:
    import re

    return re.sub(r"<(?:\w+:)?\w+>|\{\w+\}", "{}", route)


def declared_fields(schema, path, method, code="200"):
    node = schema["paths"][path][method]["responses"][code]["content"]["application/json"]["schema"]
    node = resolve(schema, node)
    if "results" in node.get("properties", {}):
        node = resolve(schema, node["properties"]["results"]["items"])
    return set(node["properties"])


def test_h_real_answers_carry_the_declared_fields(schema, owner, machine, grant, pinned):
    """The schema's serializers describe the wire shapes; a drift is caught here."""
    api = owner_api(owner)
    created = submit(owner, machine, grant.path)
    assert set(created.json()) == declared_fields(schema, "/api/tasks/", "post", "201")
    task_id = created.json()["id"]
    assert set(api.get("/api/tasks/").json()["results"][0]) == declared_fields(schema, "/api/tasks/", "get")
    assert set(api.get(f"/api/tasks/{task_id}/").json()) == declared_fields(schema, "/api/tasks/{task_id}/", "get")
    assert set(api.get("/api/machines/").json()["results"][0]) == declared_fields(schema, "/api/machines/", "get")
    assert set(api.get("/api/grants/").json()["results"][0]) == declared_fields(schema, "/api/grants/", "get")
    assert set(api.get("/api/budget/").json()) == declared_fields(schema, "/api/budget/", "get")
    messages = machine_api(machine).get("/api/worker/messages/?wait=0").json()
    assert set(messages) == declared_fields(schema, "/api/worker/messages/", "get")
    lease = machine_api(machine).post("/api/worker/leases/", {"operation_id": operation_id(task_id),
                                                               "approval_credential": True}, format="json")
    assert set(lease.json()) == declared_fields(schema, "/api/worker/leases/", "post", "201")  # Q5: approval too
    assert set(grant_lease(machine, task_id).json()) == set(lease.json()) - {"approval"}  # only when asked
    board = api.get("/api/board/").json()
    assert set(board) == declared_fields(schema, "/api/board/", "get")
    sid = str(uuid.uuid4())
    session = api.post("/api/sessions/", {"id": sid, "title": "t"}, format="json").json()
    assert set(session) == declared_fields(schema, "/api/sessions/", "post", "201")
    approval = api.post("/api/approvals/", {"key": "k", "session": sid, "agent": "claude", "tool_name": "Bash",
                                            "tool_input": {}}, format="json").json()
    assert set(approval) == declared_fields(schema, "/api/approvals/", "post", "201")
    assert set(api.get("/api/approvals/").json()["results"][0]) == declared_fields(schema, "/api/approvals/", "get")
    assert set(api.get("/api/board/").json()["approvals"][0]) == set(approval)


@pytest.mark.django_db
def test_h_schema_refusal_is_json_error_shape(client):
    """POST /api/schema/ (405) answers the JSON error shape, not YAML in the OpenAPI type."""
    response = client.post("/api/schema/")
    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"error": "method_not_allowed", "detail": 'Method "POST" not allowed.'}


# --- one description per wire shape ------------------------------------------------------

SHAPE_MODULES = ("core.errors", "tasks_app.shapes", "sessions_app.shapes", "notifications.shapes", "board.shapes")


def declared_shapes() -> dict[str, type]:
    """Every wire shape declared in a shapes module, by name: the ``TypedDict`` classes
    (``*Part`` ones are merged into shapes and have no component of their own)."""
    found = {}
    for module_name in SHAPE_MODULES:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if typing.is_typeddict(value) and value.__module__ == module_name and not name.endswith("Part"):
                found[name] = value
    return found


def json_schema(node):
    """OpenAPI 3.0 -> JSON Schema, strict: ``nullable`` becomes a null alternative, and an
    object with properties admits no other key (so an extra field is a drift too)."""
    if isinstance(node, list):
        return [json_schema(item) for item in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: json_schema(sub) for name, sub in value.items()}
        elif key not in ("nullable", "discriminator"):
            out[key] = json_schema(value)
    if "properties" in out and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return {"anyOf": [out, {"type": "null"}]} if node.get("nullable") else out


FORMATS = FormatChecker()


@FORMATS.checks("date-time", raises=ValueError)
def _aware_iso_time(value) -> bool:
    return not isinstance(value, str) or datetime.fromisoformat(value).tzinfo is not None


class Shapes:
    """Validates bodies against the generated schema and records which shape components
    a non-null value was checked against."""

    def __init__(self, schema):
        self.schema = schema
        self.components = schema["components"]["schemas"]
        self.root = {"components": {"schemas": {n: json_schema(s) for n, s in self.components.items()}}}
        self.checked: set[str] = set()

    def errors(self, node, instance) -> list[str]:
        validator = Draft7Validator({**json_schema(node), **self.root}, format_checker=FORMATS)
        return [f"{'/'.join(map(str, e.absolute_path)) or '<body>'}: {e.message}" for e in validator.iter_errors(instance)]

    def check(self, where: str, node, instance) -> list[str]:
        problems = [f"{where} {p}" for p in self.errors(node, instance)]
        if not problems:
            self._visit(node, instance)
        return problems

    def _visit(self, node, instance) -> None:
        if instance is None:
            return
        if "$ref" in node:
            name = node["$ref"].split("/")[-1]
            self.checked.add(name)
            node = self.components[name]
        if "discriminator" in node:
            return self._visit({"$ref": node["discriminator"]["mapping"][instance["type"]]}, instance)
        for part in node.get("allOf", []):
            self._visit(part, instance)
        for part in node.get("oneOf", []) + node.get("anyOf", []):
            if not self.errors(part, instance):
                self._visit(part, instance)
        if isinstance(instance, dict):
            for key, value in instance.items():
                if key in node.get("properties", {}):
                    self._visit(node["properties"][key], value)
        if isinstance(instance, list) and "items" in node:
            for item in instance:
                self._visit(node["items"], item)


def template_of(schema, url: str) -> str:
    """The documented path of a concrete URL (literal paths before parameterised ones)."""
    path = url.split("?")[0]
    for template in sorted(schema["paths"], key=lambda p: p.count("{")):
        if re.fullmatch(re.sub(r"\{\w+\}", "[^/]+", template), path):
            return template
    raise AssertionError(f"{path} is not documented")


class Walk:
    """Calls the API as a client would, committing each call (its board events are sent),
    and keeps every answer with its documented path."""

    def __init__(self, schema, capture):
        self.schema, self.capture, self.answers = schema, capture, []

    def __call__(self, client, method, url, body=None, *, expect, **headers):
        with self.capture(execute=True):
            response = getattr(client, method)(url, body, format="json", **headers)
        assert response.status_code == expect, (method, url, response.content)
        self.answers.append((method, template_of(self.schema, url), str(expect), response))
        return response.json() if response.content else None


def b64url(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def walk_worktree_task(call, api, worker, owner, machine, grant):
    """G7: a worktree task's diff evidence, its merge decided once, and the outcome."""
    task_id = submit(owner, machine, grant.path, isolation="worktree").json()["id"]
    call(worker, "post", "/api/worker/leases/", {"operation_id": operation_id(task_id)}, expect=201)
    call(worker, "post", "/api/worker/leases/", {"operation_id": operation_id(task_id), "approval_credential": True},
         expect=200)  # Q5: the live lease again, with the task's approval credential
    assert receipt(machine, task_id, "running", {"pid": 11}).status_code == 200
    files = [{"status": "R", "old_path": "a.py", "path": "b.py", "insertions": 1, "deletions": 0},
             {"status": "A", "path": "logo.png", "insertions": None, "deletions": None}]
    worktree = {"branch": "runstead/abcd1234", "base": "a" * 40, "base_branch": "main", "files": files,
                "diff": "diff --git a/a.py b/b.py\n", "truncated": False}
    assert receipt(machine, task_id, "final", final_facts(**agent_facts(**worktree))).status_code == 200
    decided = call(api, "post", f"/api/tasks/{task_id}/integrate/", {"action": "merge"}, expect=202,
                   HTTP_IDEMPOTENCY_KEY="walk-merge")
    call(api, "post", f"/api/tasks/{task_id}/integrate/", {"action": "discard"}, expect=409,
         HTTP_IDEMPOTENCY_KEY="walk-merge-2")
    facts = {"integration_id": decided["integration"]["id"], "outcome": "merged", "commit": "b" * 40,
             "detail": "fast-forward of runstead/abcd1234"}
    body = {"event_id": "walk-integrated", "generation": machine.generation, "operation_id": operation_id(task_id),
            "kind": "integrated", "slept_s": 0.0, "facts": facts}
    call(worker, "post", "/api/worker/receipts/", body, expect=200)
    assert call(api, "get", f"/api/tasks/{task_id}/", expect=200)["integration"]["outcome"] == "merged"


def walk_conversation(call, api, worker, machine, grant):
    """C1-C5: a live conversation: a message (and its replay), its receipts, the list,
    an interrupt and the end; ``message`` board events on each change."""
    live = {"profiles": [{"name": "claude", "preset": "claude", "conversation": "live"},
                         {"name": "default", "preset": "claude"},
                         {"name": "bare", "preset": None, "isolation": "worktree"}]}
    call(worker, "put", "/api/worker/profiles/", live, expect=200)
    task = call(api, "post", "/api/tasks/", {"machine": str(machine.id), "folder": grant.path + "/chat", "agent": "claude",
                                              "prompt": "hello", "mode": "conversation", "exclusive": False},
                expect=201, HTTP_IDEMPOTENCY_KEY="walk-chat")
    call(worker, "post", "/api/worker/leases/", {"operation_id": operation_id(task["id"])}, expect=201)
    assert receipt(machine, task["id"], "running", {"pid": 12}).status_code == 200
    message = call(api, "post", f"/api/tasks/{task['id']}/messages/", {"text": "and then?"}, expect=201,
                   HTTP_IDEMPOTENCY_KEY="walk-message")
    call(api, "post", f"/api/tasks/{task['id']}/messages/", {"text": "and then?"}, expect=201,
         HTTP_IDEMPOTENCY_KEY="walk-message")  # the replay
    call(api, "post", f"/api/tasks/{task['id']}/messages/", {"text": "other"}, expect=422,
         HTTP_IDEMPOTENCY_KEY="walk-message")
    for state in ("delivered", "answered"):
        body = {"event_id": f"walk-message-{state}", "generation": machine.generation,
                "operation_id": operation_id(task["id"]), "kind": "message", "slept_s": 0.0,
                "facts": {"message_id": message["id"], "state": state}}
        call(worker, "post", "/api/worker/receipts/", body, expect=200)
    call(api, "post", f"/api/tasks/{task['id']}/messages/1/withdraw/", expect=409)  # C10: already_delivered
    call(api, "post", f"/api/tasks/{task['id']}/messages/", {"text": "never mind"}, expect=201,
         HTTP_IDEMPOTENCY_KEY="walk-message-withdrawn")
    assert call(api, "post", f"/api/tasks/{task['id']}/messages/2/withdraw/", expect=200)["state"] == "withdrawn"
    body = {"event_id": "walk-message-claimed", "generation": machine.generation,
            "operation_id": operation_id(task["id"]), "kind": "message", "slept_s": 0.0,
            "facts": {"message_id": message["id"], "state": "claimed"}}
    call(worker, "post", "/api/worker/receipts/", body, expect=200)  # not_applied: stale
    listed = call(api, "get", f"/api/tasks/{task['id']}/messages/", expect=200)["results"]
    assert [(m["seq"], m["state"]) for m in listed] == [(0, "sent"), (1, "answered"), (2, "withdrawn")]
    call(api, "post", f"/api/tasks/{task['id']}/interrupt/", expect=202)
    assert call(api, "post", f"/api/tasks/{task['id']}/end/", expect=200)["conversation_ended_at"] is not None
    call(api, "post", f"/api/tasks/{task['id']}/messages/", {"text": "more"}, expect=409,
         HTTP_IDEMPOTENCY_KEY="walk-message-2")
    call(api, "post", f"/api/tasks/{task['id']}/interrupt/", expect=409)
    body = {"event_id": "walk-chat-final", "generation": machine.generation, "operation_id": operation_id(task["id"]),
            "kind": "final", "slept_s": 0.0, "facts": final_facts(**agent_facts())}
    call(worker, "post", "/api/worker/receipts/", body, expect=200)  # message 0 was never written: undelivered
    # The worker's pull carries the conversation's messages (W2): kinds message, interrupt, end.
    pulled = call(worker, "get", "/api/worker/messages/?wait=0", expect=200)["messages"]
    assert {"message", "interrupt", "end"} <= {m["kind"] for m in pulled}


def walk_every_operation(call, owner, machine, grant, grant_root, make_machine):
    """One of every answer and board event, through the real API and services."""
    api, worker = owner_api(owner), machine_api(machine)
    task = call(api, "post", "/api/tasks/", {"machine": str(machine.id), "folder": grant.path, "agent": "demo",
                                              "prompt": "do it"}, expect=201, HTTP_IDEMPOTENCY_KEY="walk-1")
    call(api, "get", "/api/tasks/", expect=200)
    (message,) = call(worker, "get", "/api/worker/messages/?wait=0", expect=200)["messages"]
    call(worker, "post", f"/api/worker/messages/{message['id']}/ack/", expect=200)
    lease = call(worker, "post", "/api/worker/leases/", {"operation_id": operation_id(task["id"])}, expect=201)
    call(worker, "post", f"/api/worker/leases/{lease['lease_id']}/renew/", {"output_tail": "line\n"}, expect=200)
    running = {"pid": 10, "pgid": 10, "process_start_time": 1.0}
    assert receipt(machine, task["id"], "running", running).status_code == 200
    call(api, "post", "/api/approvals/", {"key": "walk-task", "task": task["id"], "agent": "claude", "tool_name": "Bash",
                                          "tool_input": {"command": "make"}}, expect=201)  # withdrawn when it ends
    call(worker, "post", "/api/worker/progress/", {
        "operation_id": operation_id(task["id"]), "seq": 1, "output_tail": "line\n", "last_message": "Working.",
        "usage": {"turns": 1, "tool_calls": 0, "input_tokens": 1, "output_tokens": 1, "cost_usd": None},
        "entries": [{"n": 1, "kind": "prompt", "text": "do it"},
                    {"n": 2, "kind": "tool_call", "text": "ls", "tool": "Bash", "usage": {"input_tokens": 5,
                                                                                         "output_tokens": None}},
                    {"n": 3, "kind": "tool_result", "text": "a.py", "tool": "Bash", "status": "ok", "call": 2}],
    }, expect=200)
    call(api, "get", f"/api/tasks/{task['id']}/entries/?limit=2", expect=200)  # with a next link
    call(worker, "put", "/api/worker/profiles/", {"profiles": [{"name": "default", "preset": "claude"},
                                                               {"name": "bare", "preset": None, "isolation": "worktree"}],
                                                  "max_concurrent": 4,  # C8
                                                  "repositories": [{"path": grant.path, "remote": None,
                                                                    "root_commit": "a" * 40}]},
         expect=200)
    # One sync (issue 44): the lease renewed, a receipt carried, another machine's lease refused.
    starting = {"event_id": "walk-sync", "generation": machine.generation, "operation_id": operation_id(task["id"]),
                "kind": "starting", "slept_s": 0.0, "facts": {"lease_id": lease["lease_id"]}}
    synced = call(worker, "post", "/api/worker/sync/", {"renew": [{"lease_id": lease["lease_id"], "output_tail": "x\n"},
                                                                  {"lease_id": str(uuid.uuid4())}],
                                                        "receipts": [starting]}, expect=200)
    assert [a["status"] for a in synced["leases"]] == [200, 404]
    survivor = {"pid": 9191, "process_start_time": 3.5, "name": "sleep", "cmdline": "sleep 60"}
    facts = final_facts(survivors=[survivor], **agent_facts())
    body = {"event_id": "walk-final", "generation": machine.generation, "operation_id": operation_id(task["id"]),
            "kind": "final", "slept_s": 0.0, "facts": facts}
    call(worker, "post", "/api/worker/receipts/", body, expect=200)
    call(api, "get", f"/api/tasks/{task['id']}/", expect=200)
    submission = {"machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": "again"}
    locked = call(api, "post", "/api/tasks/", submission, expect=409, HTTP_IDEMPOTENCY_KEY="walk-2")  # survivors hold it
    invalid = call(api, "post", "/api/tasks/", {**submission, "agent": 7}, expect=400, HTTP_IDEMPOTENCY_KEY="walk-3")
    assert (locked["task_id"], set(invalid["fields"])) == (task["id"], {"agent"})
    call(api, "get", f"/api/tasks/{uuid.uuid4()}/", expect=404)
    other = submit(owner, machine, grant.path, exclusive=False).json()
    call(api, "post", f"/api/tasks/{other['id']}/cancel/", expect=200)
    # C8: a machine picked by acceptance, and none that can take it (why, per machine)
    anywhere = {"machine": "any", "folder": grant.path + "/any", "agent": "default", "prompt": "x", "exclusive": False}
    assert call(api, "post", "/api/tasks/", anywhere, expect=201, HTTP_IDEMPOTENCY_KEY="walk-any")["machine_choice"] == "any"
    nowhere = call(api, "post", "/api/tasks/", {**anywhere, "agent": "absent"}, expect=409,
                   HTTP_IDEMPOTENCY_KEY="walk-any-2")
    assert [m["reason"] for m in nowhere["machines"]] == ["profile_not_reported"]
    # C8: an owner-named pool, a task naming it, an unknown pool name
    pool = call(api, "post", "/api/pools/", {"name": "desk", "machines": [str(machine.id)]}, expect=201)
    call(api, "get", "/api/pools/", expect=200)
    call(api, "get", f"/api/pools/{pool['id']}/", expect=200)
    call(api, "patch", f"/api/pools/{pool['id']}/", {"name": "desks"}, expect=200)
    assert call(api, "post", "/api/tasks/", {**anywhere, "machine": "desks", "folder": grant.path + "/pool"}, expect=201,
                HTTP_IDEMPOTENCY_KEY="walk-pool")["machine_choice"] == "desks"
    call(api, "post", "/api/tasks/", {**anywhere, "machine": "nope"}, expect=400, HTTP_IDEMPOTENCY_KEY="walk-pool-2")
    call(api, "post", "/api/pools/", {"name": "desks"}, expect=409)
    call(api, "get", "/api/board/", expect=200)  # with the pool
    call(api, "delete", f"/api/pools/{pool['id']}/", expect=204)
    walk_worktree_task(call, api, worker, owner, machine, grant)
    walk_conversation(call, api, worker, machine, grant)

    call(api, "get", "/api/budget/", expect=200)
    call(api, "get", "/api/machines/", expect=200)
    (grant_root / "sub").mkdir()
    new_grant = call(api, "post", "/api/grants/", {"machine": str(machine.id), "path": str(grant_root / "sub")}, expect=201)
    call(api, "get", "/api/grants/", expect=200)
    call(api, "post", f"/api/grants/{new_grant['id']}/revoke/", expect=200)
    code = call(api, "post", "/api/machines/pairing-codes/", {"name": "box"}, expect=201)["code"]
    paired = call(machine_api(machine), "post", "/api/worker/pair/", {"code": code, "name": "box"}, expect=201)

    sid, device = str(uuid.uuid4()), "laptop"
    call(api, "post", "/api/sessions/", {"id": sid, "title": "t", "agent": "claude", "cwd": "/tmp"}, expect=201)
    call(api, "patch", f"/api/sessions/{sid}/", {"attention": "permission", "attention_message": "May I?"}, expect=200)
    marker = {"turn_id": "turn-1", "device_id": device, "state": "running"}
    call(api, "put", f"/api/sessions/{sid}/marker/", marker, expect=200)
    call(api, "post", f"/api/sessions/{sid}/jobs/", {"job_id": "bg", "mode": "held"}, expect=201)
    call(api, "get", "/api/sessions/active/", expect=200)
    # T1, T2, T5: the session on a machine under the wrapper, a message and what became of it
    call(api, "post", "/api/sessions/", {"id": sid, "machine": str(machine.id), "channel": "terminal"}, expect=200)
    call(api, "post", f"/api/sessions/{sid}/messages/", {"text": "and then?"}, expect=201,
         HTTP_IDEMPOTENCY_KEY="walk-session-message")
    call(api, "post", f"/api/sessions/{sid}/messages/", {"text": "withdrawn"}, expect=201,
         HTTP_IDEMPOTENCY_KEY="walk-session-message-2")
    call(api, "post", f"/api/sessions/{sid}/messages/2/withdraw/", expect=200)
    call(api, "post", f"/api/sessions/{sid}/messages/1/delivery/", {"state": "delivered", "claim": "walk"}, expect=200)
    call(api, "get", f"/api/sessions/{sid}/messages/", expect=200)
    call(api, "post", f"/api/sessions/{sid}/interrupt/", expect=202)
    ask = {"key": "walk-ask", "session": sid, "agent": "claude", "tool_name": "Bash", "tool_input": {"command": "ls"},
           "cwd": "/tmp", "suggestions": [
               {"type": "setMode", "mode": "acceptEdits", "destination": "session"},
               {"type": "addDirectories", "directories": ["/tmp/x"], "destination": "session"},
               {"type": "addRules", "rules": [{"toolName": "Bash", "ruleContent": "make:*"}], "behavior": "allow",
                "destination": "localSettings"}]}
    approval = call(api, "post", "/api/approvals/", ask, expect=201)
    call(api, "post", "/api/approvals/", ask, expect=200)
    call(api, "get", "/api/approvals/?state=pending", expect=200)
    call(api, "get", f"/api/approvals/{approval['id']}/", expect=200)
    call(api, "post", f"/api/approvals/{approval['id']}/decision/", {"behavior": "allow", "scope": "session"},
         expect=200, HTTP_IDEMPOTENCY_KEY="walk-decide")
    second = call(api, "post", "/api/approvals/", {**ask, "key": "walk-ask-2"}, expect=201)
    call(api, "post", f"/api/approvals/{second['id']}/terminal/", expect=200)
    call(api, "post", f"/api/sessions/{sid}/jobs/bg/finish/", {"wakes": False}, expect=200)
    call(api, "put", f"/api/sessions/{sid}/marker/", {**marker, "state": "ended"}, expect=200)  # idle: a notification
    call(api, "put", f"/api/sessions/{sid}/marker/", marker, expect=200)  # not_applied, with a reason
    call(api, "get", "/api/sessions/", expect=200)
    call(api, "get", f"/api/sessions/{sid}/", expect=200)
    call(api, "get", "/api/board/", expect=200)
    call(api, "post", f"/api/devices/{device}/sweep/", expect=200)
    call(api, "post", f"/api/sessions/{sid}/stop/", expect=200)
    call(api, "delete", f"/api/sessions/{sid}/", expect=204)

    call(api, "get", "/api/notifications/settings/", expect=200)
    kinds = {"session_idle": True, "attention": True, "unknown": True, "task_succeeded": True, "task_failed": True}
    call(api, "put", "/api/notifications/settings/", {"kinds": kinds, "webhook_url": "https://hooks.example/x",
                                                      "board": True, "push": True}, expect=200)
    call(api, "post", "/api/push/subscriptions/", {
        "endpoint": "https://push.example/sub/1", "keys": {"p256dh": b64url(b"\x04" + bytes(64)), "auth": b64url(bytes(16))}}, expect=201)
    call(api, "get", "/api/push/vapid-public-key/", expect=200)
    new_machine = make_machine(owner, name="spare")
    call(api, "post", f"/api/machines/{new_machine.id}/unpair/", expect=200)
    call(api, "post", "/api/token/rotate/", expect=201)
    return paired


def test_h_every_answer_and_board_event_validates_against_its_generated_shape(
    schema, owner, machine, grant, grant_root, make_machine, pinned, board_events, django_capture_on_commit_callbacks,  # noqa: F811
):
    """Each builder's real output (through every operation, and every board event as sent,
    with ``server_time``) is valid against the schema generated from its ``TypedDict``, and
    every declared shape was checked with a real, non-null value: a field added to a
    builder but not to its shape (or the reverse, or a wrong type or nullability) fails."""
    cache.clear()
    shapes = Shapes(schema)
    call = Walk(schema, django_capture_on_commit_callbacks)
    walk_every_operation(call, owner, machine, grant, grant_root, make_machine)
    problems = []
    for method, template, code, response in call.answers:
        documented = schema["paths"][template][method]["responses"]
        assert code in documented, (method, template, code)
        if code == "204":
            assert not response.content
            continue
        node = documented[code]["content"]["application/json"]["schema"]
        problems += shapes.check(f"{method.upper()} {template} {code}", node, response.json())
    events = board_events.of(owner)
    for event in events:
        assert "server_time" in event
        problems += shapes.check(f"event {event['type']}", {"$ref": "#/components/schemas/BoardEvent"}, event)
    assert problems == []
    assert {e["type"] for e in events} == set(schema["components"]["schemas"]["BoardEvent"]["discriminator"]["mapping"])
    assert set(declared_shapes()) - shapes.checked == set()


def test_h_every_answer_is_a_declared_shape(schema):
    """Every 2xx body of every operation, and every board event, is a component generated
    from a shapes-module ``TypedDict`` (no serializer written only for the schema), and
    every declared shape is in the document."""
    declared = declared_shapes()
    components = schema["components"]["schemas"]
    problems = []
    for path, method, op in operations(schema):
        for code, response in op["responses"].items():
            if not code.startswith("2") or code == "204":
                continue
            node = response["content"]["application/json"]["schema"]
            node = node.get("items", node)
            name = node["$ref"].split("/")[-1]
            if name.startswith("Paginated"):
                name = components[name]["properties"]["results"]["items"]["$ref"].split("/")[-1]
            if name not in declared:
                problems.append(f"{method.upper()} {path} {code}: {name} is no shape")
    events = [ref.split("/")[-1] for ref in components["BoardEvent"]["discriminator"]["mapping"].values()]
    problems += [f"event {name} is no shape" for name in events if name not in declared]
    problems += [f"{name} is not in the schema" for name in declared if name not in components]
    assert problems == []
