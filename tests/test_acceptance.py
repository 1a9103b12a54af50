"""Task acceptance, one request at a time, on both databases (SPEC A1-A8, P3).

The races (A4 under real concurrency, P1, P2) are in tests/test_races.py.
"""
import json
import threading
from datetime import datetime, timedelta, UTC

import httpx
import pytest
from django.conf import settings
from django.core.management import call_command
from django.db import connection

from tasks_app.models import (
    Budget,
    IdempotencyRecord,
    Machine,
    Operation,
    OutboxMessage,
    Task,
    TaskEvent,
)
from core import idempotency
from tasks_app.services import acceptance, transitions
from tasks_app.services.sweeps import cleanup_idempotency_records
from tests.conftest import machine_api, owner_api
from tests.factories import grant_lease, submit


T0 = datetime(2026, 1, 1, tzinfo=UTC)
sqlite_only = pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3", reason="the SQLite variant"
)


def body_for(machine, folder, **extra) -> dict:
    return {"machine": str(machine.id), "folder": str(folder), "agent": "demo", "prompt": "do it", **extra}


def post(owner, body, key=None, **headers):
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    return owner_api(owner).post("/api/tasks/", body, format="json", **headers)


def assert_nothing_stored(owner, *, tasks=0):
    """A refusal or a failure wrote nothing (A5)."""
    assert IdempotencyRecord.objects.filter(owner=owner).count() == tasks
    assert Task.objects.filter(owner=owner).count() == tasks
    assert Operation.objects.filter(task__owner=owner).count() == tasks
    assert OutboxMessage.objects.filter(operation__task__owner=owner).count() == tasks
    assert TaskEvent.objects.filter(task__owner=owner).count() == tasks
    assert Budget.objects.get(owner=owner).reserved_s == sum(
        Task.objects.filter(owner=owner).values_list("reserved_s", flat=True)
    )


# --- A1: the key --------------------------------------------------------------------------


@pytest.mark.django_db
def test_a1_missing_key_is_400_idempotency_key_missing(owner, machine, grant, grant_root):
    for headers in ({}, {"HTTP_IDEMPOTENCY_KEY": ""}):
        resp = post(owner, body_for(machine, grant_root), **headers)
        assert resp.status_code == 400
        assert resp.json()["error"] == "idempotency_key_missing"
    assert_nothing_stored(owner)


@pytest.mark.django_db
@pytest.mark.parametrize(
    "key",
    [
        "x" * 256,  # too long
        "tab\there",  # control character
        "new\x7fline",  # DEL is not printable
        "caf\u00e9",  # not ASCII (latin-1 on the wire)
        '""',  # quoted, but empty inside
        '"a"b"',  # a quote inside the quoted form
        'a"b',  # a bare quote
    ],
)
def test_a1_malformed_key_is_400_idempotency_key_invalid(owner, machine, grant, grant_root, key):
    resp = post(owner, body_for(machine, grant_root), key=key)
    assert resp.status_code == 400, resp.content
    assert resp.json()["error"] == "idempotency_key_invalid"
    assert_nothing_stored(owner)


@pytest.mark.django_db
def test_a1_longest_key_and_printable_punctuation_are_accepted(owner, machine, grant, grant_root):
    assert post(owner, body_for(machine, grant_root / "a"), key="k" * 255).status_code == 201
    assert post(owner, body_for(machine, grant_root / "b"), key="a b~!#$%&'()*+,-./:;<=>?@[]^_`{|}").status_code == 201


@pytest.mark.django_db
def test_a1_quoted_key_is_unquoted(owner, machine, grant, grant_root):
    body = body_for(machine, grant_root)
    first = post(owner, body, key='"order-17"')
    assert first.status_code == 201
    assert IdempotencyRecord.objects.get(owner=owner).key == "order-17"
    again = post(owner, body, key="order-17")  # the same key, bare
    assert again.status_code == 201 and again["Idempotent-Replayed"] == "true"
    assert again.content == first.content


# --- A2, A3: replay and reuse -------------------------------------------------------------


@pytest.mark.django_db
def test_a2_replay_is_byte_equal_with_header_and_evaluates_nothing(owner, machine, grant, grant_root):
    body = body_for(machine, grant_root, max_runtime_s=900)
    first = post(owner, body, key="k1")
    assert first.status_code == 201
    assert "Idempotent-Replayed" not in first
    reserved = Budget.objects.get(owner=owner).reserved_s
    # The replay must not look at the current state: make a fresh evaluation fail.
    Budget.objects.filter(owner=owner).update(limit_s=0)
    Machine.objects.filter(pk=machine.pk).update(paired=False)
    # Keys in another order, same JSON: the same canonical body.
    reordered = json.dumps(dict(reversed(list(body.items()))))
    again = owner_api(owner).post("/api/tasks/", reordered, content_type="application/json", HTTP_IDEMPOTENCY_KEY="k1")
    assert again.status_code == 201
    assert again["Idempotent-Replayed"] == "true"
    assert again["Content-Type"] == first["Content-Type"]
    assert again.content == first.content
    assert Task.objects.count() == Operation.objects.count() == OutboxMessage.objects.count() == 1
    assert Budget.objects.get(owner=owner).reserved_s == reserved == 900


@pytest.mark.django_db
def test_a2_replay_is_the_acceptance_snapshot_while_get_is_live(owner, machine, grant, grant_root):
    body = body_for(machine, grant_root)
    first = post(owner, body, key="snap")
    task_id = first.json()["id"]
    assert owner_api(owner).post(f"/api/tasks/{task_id}/cancel/").status_code == 200
    again = post(owner, body, key="snap")
    assert again.content == first.content and again.json()["state"] == "accepted"
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["state"] == "cancelled"


@pytest.mark.django_db
def test_a3_same_key_different_body_is_422(owner, machine, grant, grant_root):
    body = body_for(machine, grant_root)
    assert post(owner, body, key="k").status_code == 201
    for changed in (
        {**body, "prompt": "do something else"},
        {**body, "max_runtime_s": 1800},  # the default written out is a different body (no defaults filled in)
        {**body, "exclusive": True},
    ):
        resp = post(owner, changed, key="k")
        assert resp.status_code == 422, changed
        assert resp.json()["error"] == "idempotency_key_reused"
        assert "Idempotent-Replayed" not in resp
    assert Task.objects.count() == 1


@pytest.mark.django_db
def test_a2_keys_are_per_owner(owner, other_owner, machine, make_machine, grant, grant_root, tmp_path):
    from tasks_app.models import Grant

    theirs = make_machine(other_owner)
    Grant.objects.create(owner=other_owner, machine=theirs, path=str(tmp_path))
    mine = post(owner, body_for(machine, grant_root), key="shared")
    other = post(other_owner, body_for(theirs, tmp_path, prompt="theirs"), key="shared")
    assert mine.status_code == other.status_code == 201
    assert "Idempotent-Replayed" not in other
    assert mine.json()["id"] != other.json()["id"]
    assert post(owner, body_for(machine, grant_root), key="shared").content == mine.content
    assert post(other_owner, body_for(theirs, tmp_path, prompt="theirs"), key="shared").content == other.content
    assert IdempotencyRecord.objects.filter(key="shared").count() == 2


# --- A5: all or nothing -------------------------------------------------------------------


def _raise_injected(*args, **kwargs):
    raise RuntimeError("injected fault")


@pytest.mark.django_db(transaction=True)
def test_a5_failure_after_outbox_write_leaves_nothing(owner, machine, grant, grant_root, monkeypatch):
    """Fault injection: ``transitions._announce`` runs right after the outbox ``start``
    message is written (task_created), before the idempotency record gets its response
    and before commit. The exception must take everything back."""
    body = body_for(machine, grant_root)
    seen_outbox = []
    real_send = transitions.message_send

    def send_then_remember(*args, **kwargs):
        message = real_send(*args, **kwargs)
        seen_outbox.append(OutboxMessage.objects.filter(pk=message.pk).exists())
        return message

    monkeypatch.setattr(transitions, "message_send", send_then_remember)
    monkeypatch.setattr(transitions, "_announce", _raise_injected)
    with pytest.raises(RuntimeError, match="injected fault"):
        post(owner, body, key="a5")
    assert seen_outbox == [True]  # the outbox row was really written in that transaction
    assert_nothing_stored(owner)
    assert Budget.objects.get(owner=owner).reserved_s == 0

    monkeypatch.undo()
    resp = post(owner, body, key="a5")  # the key was never stored: it works now
    assert resp.status_code == 201 and "Idempotent-Replayed" not in resp
    assert_nothing_stored(owner, tasks=1)


@pytest.mark.django_db(transaction=True)
def test_a5_failure_while_rendering_the_stored_response_leaves_nothing(owner, machine, grant, grant_root, monkeypatch):
    """The last step before the record is completed: rendering the 201 body."""
    data = {"machine": machine.pk, "folder": str(grant_root), "agent": "demo", "prompt": "p", "session": None,
            "deep_research": False, "max_runtime_s": 60, "exclusive": True}
    monkeypatch.setattr(acceptance, "task_dict", _raise_injected)
    with pytest.raises(RuntimeError, match="injected fault"):
        idempotency.respond_once(IdempotencyRecord, owner=owner, scope=acceptance.ACCEPT_SCOPE, key="a5b",
                                 digest=idempotency.body_digest({"x": 1}), now=T0,
                                 work=lambda: acceptance.task_accept(owner=owner, data=data, now=T0))
    assert_nothing_stored(owner)


@pytest.mark.django_db
def test_a5_one_acceptance_writes_task_operation_record_budget_lock_and_outbox(owner, machine, grant, grant_root):
    resp = post(owner, body_for(machine, grant_root / "repo", max_runtime_s=120), key="all")
    task = Task.objects.get(pk=resp.json()["id"])
    assert task.holds_lock and task.reserved_s == 120
    record = IdempotencyRecord.objects.get(owner=owner, key="all")
    assert (record.task_id, record.response_status, record.response_body) == (task.id, 201, resp.content.decode())
    assert record.body_digest == idempotency.body_digest(body_for(machine, grant_root / "repo", max_runtime_s=120))
    message = OutboxMessage.objects.get(operation__task=task)
    assert message.kind == "start" and message.operation_id == task.operation.id
    assert message.payload["folder"] == str(grant_root / "repo") and message.payload["grant_root"] == str(grant_root)
    assert Budget.objects.get(owner=owner).reserved_s == 120


# --- A6: refusals, in order ---------------------------------------------------------------


@pytest.mark.django_db
@pytest.mark.parametrize(
    "change",
    [
        {"prompt": "a\x00b"},
        {"prompt": "x" * (64 * 1024 + 1)},
        {"prompt": "\u00e9" * (32 * 1024 + 1)},  # 64 KiB + 2 bytes of UTF-8
        {"folder": "relative/path"},
        {"folder": "/a/../etc"},
        {"max_runtime_s": "soon"},
        {"max_runtime_s": 0},
        {"exclusive": "perhaps"},
        {"machine": "not a uuid"},  # nor "any", nor a pool name ("not-a-uuid" is one: 400 pool_unknown, C8)
        {"surprise": 1},
    ],
)
def test_a6_invalid_body_is_400_and_stores_nothing(owner, machine, grant, grant_root, change):
    resp = post(owner, {**body_for(machine, grant_root), **change}, key="same-key")
    assert resp.status_code == 400, resp.content
    assert resp.json()["error"] == "invalid"
    assert_nothing_stored(owner)


@pytest.mark.django_db
def test_a6_prompt_of_exactly_64_kib_is_accepted(owner, machine, grant, grant_root):
    assert post(owner, body_for(machine, grant_root, prompt="x" * 64 * 1024), key="big").status_code == 201


@pytest.mark.django_db
def test_a6_refusals_come_in_spec_order_and_store_nothing(owner, other_owner, machine, make_machine, grant, grant_root):
    """Each step breaks every rule that comes later too, so the first one must win; the
    one key is reused with a different body each time, which only works because no
    refusal stored it (A5). Then the same key and body succeed once the cause is gone."""
    Budget.objects.filter(owner=owner).update(limit_s=3000)
    holder = post(owner, body_for(machine, grant_root / "a"), key="holder").json()["id"]  # reserves 1800
    foreign = make_machine(other_owner, name="theirs")
    Machine.objects.filter(pk=machine.pk).update(paired=False)
    key = "one-key"
    nested = grant_root / "a" / "sub"

    def refused(body, status, code):
        resp = post(owner, body, key=key)
        assert (resp.status_code, resp.json()["error"]) == (status, code), resp.content
        assert_nothing_stored(owner, tasks=1)
        return resp.json()

    refused(body_for(foreign, "relative", prompt="nul\x00", max_runtime_s=1500), 400, "invalid")
    refused(body_for(foreign, nested, max_runtime_s=1500), 403, "machine_forbidden")
    refused({**body_for(machine, nested, max_runtime_s=1500), "machine": "00000000-0000-4000-8000-000000000000"},
            403, "machine_forbidden")
    refused(body_for(machine, "/not/granted", max_runtime_s=1500), 403, "folder_not_granted")
    refused(body_for(machine, nested, max_runtime_s=1500), 409, "machine_unpaired")
    Machine.objects.filter(pk=machine.pk).update(paired=True)
    locked = refused(body_for(machine, nested, max_runtime_s=1500), 409, "folder_locked")
    assert locked["task_id"] == holder
    refused(body_for(machine, grant_root / "a", max_runtime_s=1500), 409, "folder_locked")  # the same folder
    refused(body_for(machine, grant_root, max_runtime_s=1500), 409, "folder_locked")  # an ancestor
    final_body = body_for(machine, grant_root / "b", max_runtime_s=1500)
    refused(final_body, 409, "budget_exhausted")
    Budget.objects.filter(owner=owner).update(limit_s=3300)  # exactly enough
    resp = post(owner, final_body, key=key)
    assert resp.status_code == 201 and "Idempotent-Replayed" not in resp
    assert Budget.objects.get(owner=owner).reserved_s == 3300


@pytest.mark.django_db
def test_a6_ids_in_url_paths_of_another_owner_are_404(owner, other_owner, machine, grant, grant_root):
    task_id = post(owner, body_for(machine, grant_root), key="mine").json()["id"]
    theirs = owner_api(other_owner)
    assert theirs.get(f"/api/tasks/{task_id}/").status_code == 404
    assert theirs.post(f"/api/tasks/{task_id}/cancel/").status_code == 404
    assert theirs.post(f"/api/grants/{grant.id}/revoke/").status_code == 404
    assert theirs.post(f"/api/machines/{machine.id}/unpair/").status_code == 404
    assert Task.objects.get(pk=task_id).state == "accepted"


# --- A8: folder locks ----------------------------------------------------------------------


@pytest.mark.django_db
def test_a8_exclusive_conflicts_with_same_ancestor_descendant_only(owner, machine, make_machine, grant, grant_root):
    from tasks_app.models import Grant

    holder = submit(owner, machine, grant_root / "repo" / "pkg", max_runtime_s=60).json()["id"]
    for folder in ("repo/pkg", "repo", "repo/pkg/deep/er", ""):
        resp = submit(owner, machine, grant_root / folder, max_runtime_s=60)
        assert resp.status_code == 409 and resp.json() == {**resp.json(), "error": "folder_locked", "task_id": holder}
    # Siblings and look-alike prefixes are not nested.
    assert submit(owner, machine, grant_root / "repo" / "pkg2", max_runtime_s=60).status_code == 201
    assert submit(owner, machine, grant_root / "repo" / "other", max_runtime_s=60).status_code == 201
    # Non-exclusive tasks take and check no lock.
    assert submit(owner, machine, grant_root / "repo", exclusive=False, max_runtime_s=60).status_code == 201
    # Another machine of the same owner has its own locks.
    laptop2 = make_machine(owner, name="second")
    Grant.objects.create(owner=owner, machine=laptop2, path=str(grant_root))
    assert submit(owner, laptop2, grant_root / "repo" / "pkg", max_runtime_s=60).status_code == 201
    # A final task releases its lock.
    assert owner_api(owner).post(f"/api/tasks/{holder}/cancel/").status_code == 200
    assert submit(owner, machine, grant_root / "repo" / "pkg", max_runtime_s=60).status_code == 201


@pytest.mark.django_db
def test_a8_folders_differing_only_in_case_or_unicode_form_conflict(owner, machine, grant, grant_root):
    """Decision (spec silent): the Mac's default file system is case-insensitive and
    normalization-insensitive, so ``Repo`` and ``repo`` may be one folder; A8 treats them
    as one. The task keeps the spelling it was given."""
    holder = submit(owner, machine, grant_root / "Repo" / "caf\u00e9", max_runtime_s=60).json()["id"]
    for folder in ("repo/CAF\u00c9", "REPO", "Repo/cafe\u0301/src"):  # the last one is NFD
        resp = submit(owner, machine, grant_root / folder, max_runtime_s=60)
        assert (resp.status_code, resp.json()["error"], resp.json()["task_id"]) == (409, "folder_locked", holder)
    assert Task.objects.get(pk=holder).folder == str(grant_root / "Repo" / "caf\u00e9")
    assert submit(owner, machine, grant_root / "Repo2", max_runtime_s=60).status_code == 201


@pytest.mark.django_db
def test_a6_session_of_another_owner_is_refused_and_stores_nothing(owner, other_owner, machine, grant, grant_root):
    from sessions_app.models import Session

    now = T0
    theirs = Session.objects.create(owner=other_owner, title="t", status_since=now, created_at=now)
    resp = submit(owner, machine, grant_root, key="sess", session=str(theirs.id))
    assert resp.status_code == 404 and resp.json()["error"] == "not_found"
    assert_nothing_stored(owner)
    mine = submit(owner, machine, grant_root, key="sess2", session="6f1c3f38-5a0e-4c1e-9a55-3f4f1b9d1a10")
    assert mine.status_code == 201 and mine.json()["session"] == "6f1c3f38-5a0e-4c1e-9a55-3f4f1b9d1a10"
    assert Session.objects.get(pk=mine.json()["session"]).owner == owner


@pytest.mark.django_db
def test_a8_non_exclusive_task_does_not_block_an_exclusive_one(owner, machine, grant, grant_root):
    assert submit(owner, machine, grant_root, exclusive=False).status_code == 201
    assert submit(owner, machine, grant_root).status_code == 201


# --- A7: retention ---------------------------------------------------------------------------


def _cancel_at(owner, task_id, when, time_machine):
    time_machine.move_to(when, tick=False)
    assert owner_api(owner).post(f"/api/tasks/{task_id}/cancel/").status_code == 200


@pytest.mark.django_db
def test_a7_cleanup_removes_only_records_final_longer_than_retention(owner, machine, grant, grant_root, time_machine):
    retention = timedelta(seconds=settings.RUNSTEAD_IDEMPOTENCY_RETENTION_S)
    time_machine.move_to(T0, tick=False)
    bodies = {k: body_for(machine, grant_root / k, max_runtime_s=60) for k in ("old", "recent", "open")}
    first = {k: post(owner, b, key=k) for k, b in bodies.items()}
    _cancel_at(owner, first["old"].json()["id"], T0 + timedelta(hours=1), time_machine)
    _cancel_at(owner, first["recent"].json()["id"], T0 + timedelta(hours=20), time_machine)

    now = T0 + timedelta(hours=1) + retention  # "old" final exactly the retention window ago
    assert cleanup_idempotency_records(now=now) == 0
    now += timedelta(seconds=1)
    assert cleanup_idempotency_records(now=now) == 1
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"recent", "open"}
    assert cleanup_idempotency_records(now=now) == 0

    time_machine.move_to(now, tick=False)
    for key in ("recent", "open"):
        again = post(owner, bodies[key], key=key)
        assert again["Idempotent-Replayed"] == "true" and again.content == first[key].content
    # The deleted key is free again: a new acceptance, not a replay.
    fresh = post(owner, bodies["old"], key="old")
    assert fresh.status_code == 201 and "Idempotent-Replayed" not in fresh
    assert fresh.json()["id"] != first["old"].json()["id"]

    far = T0 + timedelta(days=365)
    cleanup_idempotency_records(now=far)
    # Unfinished tasks keep their records however old they are.
    assert set(IdempotencyRecord.objects.values_list("key", flat=True)) == {"open", "old"}


@pytest.mark.django_db
def test_a7_sweep_command_runs_the_cleanup_and_schema_publishes_retention(owner, machine, grant, grant_root, time_machine):
    time_machine.move_to(T0, tick=False)
    task_id = post(owner, body_for(machine, grant_root), key="swept").json()["id"]
    _cancel_at(owner, task_id, T0, time_machine)
    time_machine.move_to(T0 + timedelta(seconds=settings.RUNSTEAD_IDEMPOTENCY_RETENTION_S + 5), tick=False)
    call_command("sweep", "--once", stdout=open("/dev/null", "w"))
    assert not IdempotencyRecord.objects.filter(key="swept").exists()
    schema = owner_api(owner).get("/api/schema/", HTTP_ACCEPT="application/json").content.decode()
    assert f"retention window of {int(settings.RUNSTEAD_IDEMPOTENCY_RETENTION_S)} seconds" in schema


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a7_two_cleanups_at_once_delete_each_record_once(owner, machine, grant, grant_root):
    from tests.barrier import race

    old, recent = T0 - timedelta(days=3), T0 - timedelta(hours=1)
    tasks = Task.objects.bulk_create(
        Task(owner=owner, machine=machine, grant=grant, folder=str(grant_root / str(i)), agent="demo", prompt="p",
             state="cancelled", created_at=old, updated_at=old, final_at=old if i < 300 else recent)
        for i in range(320)
    )
    IdempotencyRecord.objects.bulk_create(
        IdempotencyRecord(owner=owner, key=f"k{i}", body_digest="0" * 64, response_status=201, response_body="{}",
                          task=task, created_at=old)
        for i, task in enumerate(tasks)
    )
    deleted = race(2, lambda i: cleanup_idempotency_records(now=T0))
    assert sum(deleted) == 300
    assert IdempotencyRecord.objects.count() == 20


# --- A2: replays survive a restart of the service process ------------------------------------


@pytest.mark.django_db(transaction=True)
def test_a2_replay_after_service_restart_is_byte_equal(owner, machine, grant, grant_root):
    from tests.live import start_daphne

    headers = {"Authorization": f"Token {owner.auth_token.key}", "Idempotency-Key": "restart-1"}
    body = body_for(machine, grant_root)
    env = {"RUNSTEAD_EMBEDDED_SWEEP": "0"}
    server = start_daphne(env)
    try:
        first = httpx.post(server.url + "/api/tasks/", json=body, headers=headers, timeout=10)
        assert first.status_code == 201, first.text
        assert "idempotent-replayed" not in first.headers
    finally:
        server.stop()
    assert server.process.returncode is not None
    server = start_daphne(env)  # a new process: nothing in memory
    try:
        again = httpx.post(server.url + "/api/tasks/", json=body, headers=headers, timeout=10)
        reused = httpx.post(server.url + "/api/tasks/", json={**body, "prompt": "other"}, headers=headers, timeout=10)
    finally:
        server.stop()
    assert again.status_code == 201
    assert again.headers["idempotent-replayed"] == "true"
    assert again.content == first.content
    assert reused.status_code == 422 and reused.json()["error"] == "idempotency_key_reused"
    assert Task.objects.count() == 1


# --- P3: after revocation or unpairing --------------------------------------------------------


@pytest.mark.django_db
def test_p3_revocation_makes_never_leased_tasks_not_started_and_refuses_leases(owner, machine, grant, grant_root):
    waiting = submit(owner, machine, grant_root / "a", max_runtime_s=100).json()["id"]
    leased = submit(owner, machine, grant_root / "b", max_runtime_s=200).json()["id"]
    lease_id = grant_lease(machine, leased).json()["lease_id"]
    resp = owner_api(owner).post(f"/api/grants/{grant.id}/revoke/")
    assert resp.status_code == 200 and resp.json()["revoked_at"]

    task = Task.objects.get(pk=waiting)
    assert (task.state, task.holds_lock, task.charged_s) == ("not_started", False, 0)
    assert Task.objects.get(pk=leased).state == "starting"  # running work stops through its lease
    assert Budget.objects.get(owner=owner).reserved_s == 200
    renew = machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json")
    assert (renew.status_code, renew.json()["error"]) == (409, "revoked")
    # Acceptance under the revoked grant is refused; a second revoke is harmless.
    assert submit(owner, machine, grant_root / "c").json()["error"] == "folder_not_granted"
    assert owner_api(owner).post(f"/api/grants/{grant.id}/revoke/").status_code == 200


@pytest.mark.django_db
def test_p3_unpairing_makes_never_leased_tasks_not_started_and_revokes_the_token(owner, machine, grant, grant_root):
    waiting = submit(owner, machine, grant_root / "a", max_runtime_s=100).json()["id"]
    leased = submit(owner, machine, grant_root / "b", max_runtime_s=200).json()["id"]
    assert grant_lease(machine, leased).status_code == 201
    resp = owner_api(owner).post(f"/api/machines/{machine.id}/unpair/")
    assert resp.status_code == 200 and resp.json()["paired"] is False
    assert Task.objects.get(pk=waiting).state == "not_started"
    assert Budget.objects.get(owner=owner).reserved_s == 200
    assert machine_api(machine).get("/api/worker/messages/?wait=0").status_code == 401
    assert submit(owner, machine, grant_root / "c").json()["error"] == "machine_unpaired"


# --- SQLite: writers serialize (P1 on the embedded default) -------------------------------------


@sqlite_only
@pytest.mark.django_db
def test_p1_sqlite_transactions_begin_immediate():
    options = settings.DATABASES["default"]["OPTIONS"]
    assert options["transaction_mode"] == "IMMEDIATE"
    assert options["timeout"] >= 30  # A4: racers wait for the winner within the busy timeout


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_p1_sqlite_second_writer_cannot_begin_while_the_first_is_open(owner):
    """With BEGIN IMMEDIATE a second transaction cannot even start while the first is
    open, so a read-then-write (the budget check) cannot interleave. The second writer is
    told so at once (busy timeout 0: "database is locked") instead of waiting, so the
    test observes the refusal itself, not a pause; once the first commits it begins."""
    from django.db import OperationalError, transaction

    entered = threading.Event()
    release = threading.Event()

    def first():
        try:
            with transaction.atomic():
                Budget.objects.filter(owner=owner).update(reserved_s=1)
                entered.set()
                release.wait(10)
        finally:
            connection.close()

    def begin() -> str:
        outcome = []

        def second():
            try:
                connection.ensure_connection()
                connection.connection.execute("PRAGMA busy_timeout = 0")  # refuse, never wait
                with transaction.atomic():
                    outcome.append("began")
            except OperationalError as exc:
                outcome.append(str(exc))
            finally:
                connection.close()

        thread = threading.Thread(target=second)
        thread.start()
        thread.join(10)
        return outcome[0]

    holder = threading.Thread(target=first)
    holder.start()
    assert entered.wait(10)
    assert begin() == "database is locked"  # BEGIN IMMEDIATE, before any read
    release.set()
    holder.join(10)
    assert begin() == "began"
