"""H, K3: a property-based run over ``/api/schema/`` (schemathesis, pinned in
requirements-dev.txt), part of both CI passes.

For every operation the schema documents, schemathesis generates requests from the
schema (fixed seed, ``MAX_EXAMPLES`` per operation, so one pass takes well under a
couple of minutes) and sends them in-process to the WSGI app (``config/wsgi.py``) against
the test database, with the owner token on owner paths and the machine token on
``/api/worker/`` paths. Each answer must be no 5xx, documented (status code and content
type), match its documented schema, and every 4xx must carry the
``{"error", "detail"}`` shape. Each example runs in a savepoint that is rolled back, so
examples do not pile up state.

Failing cases found by this run are kept as named regression tests in
tests/test_k_regressions.py.
"""
import json
import os

import hypothesis
import hypothesis.errors
import pytest
import schemathesis
from schemathesis import GenerationMode
from django.core.cache import cache
from django.db import transaction
from hypothesis import HealthCheck, Phase
from schemathesis.checks import (
    content_type_conformance,
    not_a_server_error,
    response_schema_conformance,
    status_code_conformance,
)

# CI: fixed seed, bounded examples. A deeper one-off run: RUNSTEAD_SCHEMATHESIS_EXAMPLES=200
# RUNSTEAD_SCHEMATHESIS_SEED=7 ./test tests/test_k_schemathesis.py
MAX_EXAMPLES = int(os.environ.get("RUNSTEAD_SCHEMATHESIS_EXAMPLES", "15"))
SEED = int(os.environ.get("RUNSTEAD_SCHEMATHESIS_SEED", "20261201"))


def error_shape(ctx, response, case):
    """Every 4xx answer is ``{"error": str, "detail": str}`` (H)."""
    if 400 <= response.status_code < 500 and case.method.upper() != "HEAD":
        body = json.loads(response.content or b"null")
        if not (isinstance(body, dict) and isinstance(body.get("error"), str) and isinstance(body.get("detail"), str)):
            raise AssertionError(f"{response.status_code} without the error shape: {response.content[:200]!r}")
    return True


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]


@pytest.fixture
def api_schema(one_of_each):
    """The schema, loaded from the app itself. Requests go through the WSGI handler
    in this thread, so, as Django's test client does, the handler must not close the test
    transaction's connection at the end of each request. (After ``one_of_each``: Django's test
    client connects that signal again after each of its requests.)"""
    from django.core import signals
    from django.db import close_old_connections

    from config.wsgi import application

    signals.request_started.disconnect(close_old_connections)
    signals.request_finished.disconnect(close_old_connections)
    try:
        yield schemathesis.openapi.from_wsgi("/api/schema/?format=json", application)
    finally:
        signals.request_started.connect(close_old_connections)
        signals.request_finished.connect(close_old_connections)


def credentials(path: str, world) -> dict:
    if path == "/api/worker/pair/":
        return {}
    if path.startswith("/api/worker/"):
        return {"Authorization": f"Machine {world['machine'].test_token}"}
    return {"Authorization": f"Token {world['owner'].auth_token.key}"}


def real_ids(operation, world) -> dict | None:
    """The operation's path parameters filled with ids that exist (the caller's own), so
    examples reach past the 404 of a random id; None when it has none."""
    names = {"task_id": "task", "machine_id": "machine", "grant_id": "grant", "lease_id": "lease",
             "message_id": "message", "session_id": "session", "subscription_id": "subscription",
             "approval_id": "approval", "pool_id": "pool"}
    params = [p.name for p in operation.path_parameters]
    if not params:
        return None
    out = {}
    conversation_route = operation.path.endswith(("/messages/", "/interrupt/", "/end/", "/withdraw/")) \
        and "/worker/" not in operation.path and "/sessions/" not in operation.path
    for name in params:
        if name == "task_id" and conversation_route:
            out[name] = world["conversation"]  # C2-C5: the routes of a conversation task
        elif name == "seq":
            out[name] = 1  # T2, C10: the world's conversation and session each have a message 1
        elif name == "job_id":
            out[name] = "j1"
        elif name == "device_id":
            out[name] = world["machine"]
        else:
            out[name] = world[names[name]]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("part", ["random_ids", "negative", "real_ids"])
def test_h_k3_property_based_run_over_the_schema(api_schema, one_of_each, owner, machine, part):
    """Per operation, in three parts (so parallel test runners share them): positive
    examples with random ids, negative examples (schema violations), and positive examples
    with the caller's real ids."""
    from tasks_app.models import Machine

    who = {"owner": owner, "machine": machine}
    failures, counts, statuses = [], {}, {}
    plans = []
    for result in api_schema.get_all_operations():
        operation = result.ok()
        if part == "random_ids":
            plans.append((operation, GenerationMode.POSITIVE, None))
        elif part == "negative":
            plans.append((operation, GenerationMode.NEGATIVE, None))
        elif ids := real_ids(operation, one_of_each):
            plans.append((operation, GenerationMode.POSITIVE, ids))
    for operation, mode, ids in plans:
        headers = credentials(operation.path, who)
        strategy = operation.as_strategy(mode, path_parameters=ids) if ids else operation.as_strategy(mode)

        @hypothesis.seed(SEED)
        @hypothesis.settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=False,
                             suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate],
                             print_blob=False)
        @hypothesis.given(case=strategy)
        def run(case):
            cache.clear()
            Machine.objects.filter(pk=machine.pk).update(last_heard_at=None)
            sid = transaction.savepoint()
            try:
                response = case.call(headers=headers)
                counts[operation.label] = counts.get(operation.label, 0) + 1
                statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
                case.validate_response(response, checks=CHECKS, additional_checks=[error_shape])
            finally:
                transaction.savepoint_rollback(sid)

        try:
            run()
        except hypothesis.errors.Unsatisfiable:
            continue  # nothing to negate: an operation without parameters or body
        except Exception as exc:  # noqa: BLE001 - collected so every operation is tried
            failures.append(f"{operation.label} ({mode.value}{', real ids' if ids else ''}): {str(exc)[:1500]}")
    print(f"schemathesis: {len(counts)} operations, {sum(counts.values())} requests, statuses {sorted(statuses.items())}")
    assert failures == [], "\n\n".join(failures)
    assert len(counts) >= (30 if part == "random_ids" else 10)
