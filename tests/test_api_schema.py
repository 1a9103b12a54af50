"""H: ``/api/schema/`` describes every answer, so a client generated from it is usable:
each operation's 2xx bodies have a typed shape (properties, or items that have them), and
each declares the one error shape for its 4xx. Also: real answers carry exactly the fields
the schema declares for them."""
import uuid

import pytest
from drf_spectacular.generators import SchemaGenerator

from tests.conftest import machine_api, owner_api
from tests.factories import grant_lease, submit

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
    error = schema["components"]["schemas"]["ErrorOut"]
    assert set(error["required"]) == {"error", "detail"}
    problems = []
    for path, method, op in operations(schema):
        codes = {code for code in op["responses"] if code.startswith("4")}
        for expected in ("400", "401", "403", "404"):
            if expected not in codes:
                problems.append(f"{method.upper()} {path}: no {expected}")
        for code in codes:
            ref = op["responses"][code].get("content", {}).get("application/json", {}).get("schema", {}).get("$ref")
            if ref != "#/components/schemas/ErrorOut":
                problems.append(f"{method.upper()} {path} {code}: not ErrorOut")
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
    lease = grant_lease(machine, task_id)
    assert set(lease.json()) == declared_fields(schema, "/api/worker/leases/", "post", "201")
    board = api.get("/api/board/").json()
    assert set(board) == declared_fields(schema, "/api/board/", "get")
    sid = str(uuid.uuid4())
    session = api.post("/api/sessions/", {"id": sid, "title": "t"}, format="json").json()
    assert set(session) == declared_fields(schema, "/api/sessions/", "post", "201")


@pytest.mark.django_db
def test_h_schema_refusal_is_json_error_shape(client):
    """POST /api/schema/ (405) answers the JSON error shape, not YAML in the OpenAPI type."""
    response = client.post("/api/schema/")
    assert response.status_code == 405
    assert response["Content-Type"] == "application/json"
    assert response.json() == {"error": "method_not_allowed", "detail": 'Method "POST" not allowed.'}
