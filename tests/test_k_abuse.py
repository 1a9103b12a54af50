"""K1, K3 abuse: pairing codes (entropy, expiry, single use, attempts counted per client
in the database), rate limits on acceptance (429 ``rate_limited`` with ``Retry-After``),
bodies over the limit refused before they are parsed (413), and the error shape of each.
The board socket's bound on client messages is in tests/test_board_consumer.py."""
import math
import re
import uuid

import pytest
from django.conf import settings
from rest_framework.test import APIClient

from tests.conftest import machine_api, owner_api
from tests.factories import submit
from tests.factories import table_digest

pytestmark = pytest.mark.django_db


def pairing_code(owner, **body):
    response = owner_api(owner).post("/api/machines/pairing-codes/", body or {"name": "mac"}, format="json")
    assert response.status_code == 201
    return response.json()


def pair(code, client="10.0.0.7"):
    return APIClient().post("/api/worker/pair/", {"code": code}, format="json", REMOTE_ADDR=client)


# --- K1 pairing codes -------------------------------------------------------------------------


def test_k1_pairing_code_has_at_least_40_bits_and_codes_do_not_repeat(owner, pinned):
    from tasks_app.services.pairing import CODE_ALPHABET, CODE_LENGTH

    assert len(set(CODE_ALPHABET)) == len(CODE_ALPHABET) == 32
    assert CODE_LENGTH * math.log2(len(CODE_ALPHABET)) >= 40
    codes = [pairing_code(owner)["code"] for _ in range(50)]
    assert len(set(codes)) == 50
    for code in codes:
        assert re.fullmatch(f"[{CODE_ALPHABET}]{{{CODE_LENGTH}}}", code), code


def test_k1_pairing_code_is_stored_hashed_and_expires_after_ten_minutes(owner, pinned):
    from tasks_app.auth import token_digest
    from tasks_app.models import PairingCode

    assert settings.RUNSTEAD_PAIRING_CODE_TTL_S == 600
    early, late = pairing_code(owner)["code"], pairing_code(owner)["code"]
    rows = list(PairingCode.objects.values_list("code_hash", flat=True))
    assert early not in rows and token_digest(early) in rows
    pinned.shift(599)
    assert pair(early).status_code == 201
    pinned.shift(2)  # 601 s after creation
    expired = pair(late)
    assert (expired.status_code, expired.json()["error"]) == (400, "pairing_code_invalid")


def test_k1_pairing_code_is_single_use_even_for_a_re_pair(owner, machine, pinned):
    code = pairing_code(owner, machine=str(machine.id))["code"]
    assert pair(code).json()["generation"] == 2
    again = pair(code)
    assert (again.status_code, again.json()["error"]) == (400, "pairing_code_invalid")
    machine.refresh_from_db()
    assert machine.generation == 2


def test_k1_pairing_attempts_are_counted_per_client_in_the_database(owner, pinned):
    """Every attempt is a row (client, time, ok); 30 failures in a minute brake that
    client with 429 ``too_many_attempts`` and ``Retry-After``, and only that client; a
    minute later the client may try again."""
    from tasks_app.models import PairingAttempt, PairingCode
    from tasks_app.services.pairing import MAX_FAILED_ATTEMPTS_PER_MINUTE

    for _ in range(MAX_FAILED_ATTEMPTS_PER_MINUTE):
        assert pair("WRONGWRONG22", client="10.0.0.66").status_code == 400
    assert PairingAttempt.objects.filter(client="10.0.0.66", ok=False).count() == MAX_FAILED_ATTEMPTS_PER_MINUTE
    code = pairing_code(owner)["code"]
    braked = pair(code, client="10.0.0.66")
    assert braked.status_code == 429
    assert braked["Retry-After"] == "60"
    assert braked.json() == {"error": "too_many_attempts", "detail": "too many pairing attempts, wait a minute",
                             "retry_after_s": 60}
    assert PairingCode.objects.get().used_at is None  # the brake does not burn the code
    pinned.shift(61)
    assert pair(code, client="10.0.0.66").status_code == 201
    assert PairingAttempt.objects.filter(client="10.0.0.66", ok=True).count() == 1
    assert PairingCode.objects.get().attempts == 1


# --- K3 rate limits -----------------------------------------------------------------------------


def test_k3_acceptance_is_rate_limited_per_owner_with_retry_after(owner, other_owner, machine, grant, make_machine,
                                                                  settings, pinned):
    from tasks_app.models import Grant, IdempotencyRecord, Task

    settings.RUNSTEAD_ACCEPT_RATE = "3/min"
    for _ in range(3):
        assert submit(owner, machine, grant.path, exclusive=False).status_code == 201
    before = table_digest()
    limited = submit(owner, machine, grant.path, exclusive=False)
    assert limited.status_code == 429
    assert limited["Retry-After"] == "60"
    assert limited.json() == {"error": "rate_limited", "detail": "too many requests, retry in 60 s", "retry_after_s": 60}
    assert table_digest() == before  # refused before anything is evaluated: no task, no idempotency record
    assert (Task.objects.count(), IdempotencyRecord.objects.count()) == (3, 3)
    # per owner: another owner is not braked by alice's rate
    theirs = make_machine(other_owner, name="m2")
    Grant.objects.create(owner=other_owner, machine=theirs, path=grant.path)
    assert submit(other_owner, theirs, grant.path, exclusive=False).status_code == 201
    # reads are not limited
    assert owner_api(owner).get("/api/tasks/").status_code == 200
    pinned.shift(30)
    assert int(submit(owner, machine, grant.path, exclusive=False)["Retry-After"]) == 30
    pinned.shift(31)
    assert submit(owner, machine, grant.path, exclusive=False).status_code == 201


def test_k3_rate_limit_answers_only_after_authentication(machine, settings, pinned):
    """An anonymous caller or a machine token is refused as such (401/403), never counted."""
    settings.RUNSTEAD_ACCEPT_RATE = "1/min"
    for _ in range(3):
        assert APIClient().post("/api/tasks/", {}, format="json").status_code == 401
        assert machine_api(machine).post("/api/tasks/", {}, format="json").status_code == 403


def test_k3_rate_limit_is_declared_in_the_schema():
    from drf_spectacular.generators import SchemaGenerator

    schema = SchemaGenerator().get_schema(request=None, public=True)
    assert "429" in schema["paths"]["/api/tasks/"]["post"]["responses"]


# --- K3 bodies over the limit ---------------------------------------------------------------------


@pytest.mark.parametrize("who, path", [
    ("owner", "/api/tasks/"), ("owner", "/api/sessions/"), ("machine", "/api/worker/receipts/"),
    ("anonymous", "/api/worker/pair/"),
])
def test_k3_body_over_the_limit_is_refused_before_parsing(who, path, owner, machine, pinned):
    """A body larger than DATA_UPLOAD_MAX_MEMORY_SIZE (or the route's own limit in
    RUNSTEAD_BODY_LIMITS: receipts carry diffs, G7) answers 413 ``body_too_large`` with
    the error shape, before parsing: the body is not even JSON, which would be a 400 if it
    were read; and nothing is written (not even a pairing attempt)."""
    from core import clock
    from tasks_app.models import Machine

    client = {"owner": lambda: owner_api(owner), "machine": lambda: machine_api(machine), "anonymous": APIClient}[who]()
    Machine.objects.update(last_heard_at=clock.now())  # P2: a heard machine is not written again within 20 s
    before = table_digest()
    body = b"{" + b"x" * settings.RUNSTEAD_BODY_LIMITS.get(path, settings.DATA_UPLOAD_MAX_MEMORY_SIZE)
    response = client.generic("POST", path, body, content_type="application/json", HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()))
    assert response.status_code == 413
    assert response.json()["error"] == "body_too_large" and response.json()["detail"]
    assert table_digest() == before
    small = client.generic("POST", path, b"{", content_type="application/json", HTTP_IDEMPOTENCY_KEY=str(uuid.uuid4()))
    assert (small.status_code, small.json()["error"]) == (400, "malformed_json")


def test_k3_progress_is_rate_limited_per_machine_with_retry_after(owner, machine, grant, make_machine, settings, pinned):
    from tests.factories import grant_lease, operation_id, receipt

    settings.RUNSTEAD_PROGRESS_RATE = "2/min"
    task_id = submit(owner, machine, grant.path).json()["id"]
    grant_lease(machine, task_id)
    assert receipt(machine, task_id, "running", {"pid": 7}).json() == {"outcome": "applied"}
    op = operation_id(task_id)

    def progress(who, seq):
        body = {"operation_id": op, "seq": seq, "output_tail": f"line {seq}", "last_message": None, "usage": None}
        return machine_api(who).post("/api/worker/progress/", body, format="json")

    assert [progress(machine, seq).status_code for seq in (1, 2)] == [200, 200]
    before = table_digest()
    limited = progress(machine, 3)
    assert limited.status_code == 429 and limited["Retry-After"] == "60"
    assert limited.json()["error"] == "rate_limited" and limited.json()["retry_after_s"] == 60
    assert table_digest() == before
    sibling = make_machine(owner, name="desk")
    assert progress(sibling, 4).status_code == 404  # counted per machine: the sibling is not braked
    pinned.shift(61)
    assert progress(machine, 3).status_code == 200
