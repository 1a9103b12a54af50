"""The admin shows history and edits none of it (SPEC U5), through the Django test client
with a logged-in superuser: every add, change and delete POST to a history model answers
403 and leaves its table byte-unchanged; no form edits a field a rule depends on; unpair,
re-pair and revoke are actions that run the API's services, so P1/P3 and K1 hold."""
import re

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth import get_user_model
from django.test import Client
from rest_framework.test import APIClient

from sessions_app.models import EndedTurn, Job, Marker, Session
from tasks_app.models import (
    Budget, Grant, IdempotencyRecord, Lease, Machine, Operation, OutboxMessage, PairingAttempt, PairingCode, Receipt,
    Task, TaskEvent,
)
from tests.conftest import machine_api, owner_api
from tests.factories import grant_lease, receipt, submit

pytestmark = pytest.mark.django_db

HISTORY = [Receipt, Lease, TaskEvent, OutboxMessage, IdempotencyRecord, Operation, PairingCode, PairingAttempt,
           Marker, Job, EndedTurn]
NEVER_DELETED = HISTORY + [Task, Machine, Grant, Budget, Session]


def url(model, *parts) -> str:
    return "/".join(["", "admin", model._meta.app_label, model._meta.model_name, *map(str, parts), ""])


def table(model) -> list[dict]:
    """Every row and column of ``model``'s table, to compare byte for byte."""
    return list(model.objects.order_by("pk").values())


@pytest.fixture
def superuser_client(db) -> Client:
    user = get_user_model().objects.create_superuser("root", "root@example.com", "pw")
    client = Client()
    client.force_login(user)
    return client


@pytest.fixture
def history(owner, machine, grant, grant_root, pinned):
    """One row of each history model, made through the API as the service makes them: a
    task with its operation, start message, lease, receipt and events; a pairing code and a
    failed pairing attempt; a session with an ended turn's marker and a job."""
    task_id = submit(owner, machine, grant_root / "a").json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", {"pid": 4242, "pgid": 4242,
                                                 "process_start_time": 1767225600.25}).status_code == 200
    api = owner_api(owner)
    assert api.post("/api/machines/pairing-codes/", {"name": "spare"}, format="json").status_code == 201
    assert APIClient().post("/api/worker/pair/", {"code": "WRONGWRONG22"}, format="json").status_code == 400
    sid = "9a3c1a5e-0000-4000-8000-000000000001"
    for state in ("running", "ended"):
        assert api.put(f"/api/sessions/{sid}/marker/", {"turn_id": "t1", "device_id": "laptop", "state": state},
                       format="json").status_code == 200
    assert api.post(f"/api/sessions/{sid}/jobs/", {"job_id": "j1", "mode": "held"}, format="json").status_code == 201
    for model in NEVER_DELETED:
        assert model.objects.exists(), model
    return task_id


def payload(model, row) -> dict:
    """A change form's POST that would alter every editable-looking column."""
    data = {"_save": "Save"}
    for field in model._meta.concrete_fields:
        if not field.primary_key:
            data[field.attname] = "tampered" if field.get_internal_type() in ("CharField", "TextField") else "0"
    return data


@pytest.mark.parametrize("model", HISTORY, ids=lambda m: m._meta.model_name)
def test_u5_change_post_to_history_refused(model, history, superuser_client):
    row = model.objects.order_by("pk").first()
    before = table(model)
    response = superuser_client.post(url(model, row.pk, "change"), payload(model, row))
    assert response.status_code == 403
    assert table(model) == before


@pytest.mark.parametrize("model", HISTORY, ids=lambda m: m._meta.model_name)
def test_u5_add_post_to_history_refused(model, history, superuser_client):
    row = model.objects.order_by("pk").first()
    before = table(model)
    response = superuser_client.post(url(model, "add"), payload(model, row))
    assert response.status_code == 403
    assert table(model) == before


@pytest.mark.parametrize("model", NEVER_DELETED, ids=lambda m: m._meta.model_name)
def test_u5_delete_post_refused(model, history, superuser_client):
    """Deleting a task, machine or grant would delete history through its cascades
    (a lease: L1, "one per operation, ever"); so neither the delete URL nor the bulk delete
    action exists for any of them."""
    row = model.objects.order_by("pk").first()
    before = {m: table(m) for m in NEVER_DELETED}
    assert superuser_client.post(url(model, row.pk, "delete"), {"post": "yes"}).status_code == 403
    bulk = superuser_client.post(url(model), {"action": "delete_selected", ACTION_CHECKBOX_NAME: [str(row.pk)],
                                              "post": "yes", "index": 0}, follow=True)
    assert bulk.status_code == 200
    assert 'value="delete_selected"' not in superuser_client.get(url(model)).content.decode()
    assert {m: table(m) for m in NEVER_DELETED} == before


@pytest.mark.parametrize("model", HISTORY, ids=lambda m: m._meta.model_name)
def test_u5_history_is_listed_and_shown_read_only(model, history, superuser_client):
    row = model.objects.order_by("pk").first()
    listing = superuser_client.get(url(model))
    assert listing.status_code == 200
    assert url(model, row.pk, "change") in listing.content.decode()
    page = superuser_client.get(url(model, row.pk, "change"))
    assert page.status_code == 200
    html = page.content.decode()
    assert form_fields(html) == set()
    for field in model._meta.concrete_fields:  # every column is on the page, read-only
        assert f"field-{field.name}" in html, field.name


def form_fields(html: str) -> set[str]:
    """Names of the editable inputs of an admin change form, without Django's own."""
    tags = re.findall(r'<(?:input|select|textarea)\b[^>]*>', html)
    names = {re.search(r'\bname="([^"]+)"', t).group(1) for t in tags if 'name="' in t and 'type="hidden"' not in t}
    return {n for n in names if n not in {"csrfmiddlewaretoken", "_save", "_continue", "_addanother"}
            and not re.match(r".*-(TOTAL|INITIAL|MIN_NUM|MAX_NUM)_FORMS$", n)}


def act(client, model, action, *pks):
    return client.post(url(model), {"action": action, ACTION_CHECKBOX_NAME: [str(pk) for pk in pks], "index": 0},
                       follow=True)


def test_u5_machine_form_has_no_rule_fields(history, machine, grant, superuser_client):
    page = superuser_client.get(url(Machine, machine.pk, "change"))
    assert page.status_code == 200
    assert form_fields(page.content.decode()) == {"name"}
    before = Machine.objects.values().get(pk=machine.pk)
    response = superuser_client.post(url(Machine, machine.pk, "change"), {
        "name": "renamed", "paired": "", "generation": "99", "token_hash": "0" * 64, "owner": "", "unpaired_at": "",
        "_save": "Save",
    })
    assert response.status_code == 302
    after = Machine.objects.values().get(pk=machine.pk)
    assert after.pop("name") == "renamed"
    before.pop("name")
    assert after == before  # paired, generation, token digest untouched
    assert superuser_client.post(url(Machine, "add"), {"name": "new", "_save": "Save"}).status_code == 403

    grant_page = superuser_client.get(url(Grant, grant.pk, "change")).content.decode()
    assert form_fields(grant_page) == set()
    assert superuser_client.post(url(Grant, grant.pk, "change"), {"revoked_at": "", "path": "/"}).status_code == 403
    task_page = superuser_client.get(url(Task, history, "change")).content.decode()
    assert form_fields(task_page) == set()  # state, holds_lock, ... move only through services


def test_u5_unpair_action_runs_p3(owner, machine, grant, grant_root, pinned, superuser_client):
    waiting = submit(owner, machine, grant_root / "a", max_runtime_s=100).json()["id"]
    leased = submit(owner, machine, grant_root / "b", max_runtime_s=200).json()["id"]
    lease_id = grant_lease(machine, leased).json()["lease_id"]

    done = act(superuser_client, Machine, "unpair", machine.pk)
    assert done.status_code == 200 and "Unpaired laptop" in done.content.decode()
    row = Machine.objects.get(pk=machine.pk)
    assert (row.paired, row.token_hash, row.unpaired_at.isoformat()) == (False, "", "2026-03-01T00:00:00+00:00")
    task = Task.objects.get(pk=waiting)
    assert (task.state, task.holds_lock, task.charged_s) == ("not_started", False, 0)
    event = TaskEvent.objects.filter(task_id=waiting).latest("pk")
    assert (event.new_state, event.reason, event.actor) == ("not_started", "machine unpaired (P3)", "owner:root")
    assert Task.objects.get(pk=leased).state == "starting"  # running work stops through its lease
    assert Budget.objects.get(owner=owner).reserved_s == 200
    old = machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json")
    assert (old.status_code, old.json()["error"]) == (401, "token_revoked")

    # Re-pair through the admin: a one-time code, shown once; the new pairing cannot renew
    # the old pairing's lease (L2, P3).
    shown = act(superuser_client, Machine, "re_pair", machine.pk).content.decode()
    code = re.search(r"Pairing code for laptop: ([A-Z0-9]{12}) ", shown).group(1)
    assert code not in superuser_client.get(url(Machine)).content.decode()
    assert PairingCode.objects.get(machine=machine).expires_at.isoformat() == "2026-03-01T00:10:00+00:00"
    paired = APIClient().post("/api/worker/pair/", {"code": code}, format="json").json()
    assert paired["generation"] == 2
    new = APIClient()
    new.credentials(HTTP_AUTHORIZATION=f"Machine {paired['token']}")
    refused = new.post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json")
    assert (refused.status_code, refused.json()["error"]) == (409, "unpaired")
    assert Lease.objects.filter(task_id=leased).count() == 1


def test_u5_revoke_action_runs_p3(owner, machine, grant, grant_root, pinned, superuser_client):
    waiting = submit(owner, machine, grant_root / "a", max_runtime_s=100).json()["id"]
    leased = submit(owner, machine, grant_root / "b", max_runtime_s=200).json()["id"]
    lease_id = grant_lease(machine, leased).json()["lease_id"]

    done = act(superuser_client, Grant, "revoke", grant.pk)
    assert done.status_code == 200 and f"Revoked the grant of {grant.path}" in done.content.decode()
    assert Grant.objects.get(pk=grant.pk).revoked_at.isoformat() == "2026-03-01T00:00:00+00:00"
    task = Task.objects.get(pk=waiting)
    assert (task.state, task.holds_lock, task.charged_s) == ("not_started", False, 0)
    event = TaskEvent.objects.filter(task_id=waiting).latest("pk")
    assert (event.reason, event.actor) == ("grant revoked (P3)", "owner:root")
    assert Task.objects.get(pk=leased).state == "starting"
    renew = machine_api(machine).post(f"/api/worker/leases/{lease_id}/renew/", {}, format="json")
    assert (renew.status_code, renew.json()["error"]) == (409, "revoked")
    assert submit(owner, machine, grant_root / "c").json()["error"] == "folder_not_granted"


def test_u5_pairing_actions_need_change_permission(owner, machine, grant, pinned):
    """A staff member who may only view machines and grants sees no unpair/revoke action."""
    from django.contrib.auth.models import Permission

    owner.is_staff = True
    owner.save()
    owner.user_permissions.add(*Permission.objects.filter(codename__in=["view_machine", "view_grant"]))
    client = Client()
    client.force_login(owner)
    html = client.get(url(Machine)).content.decode()
    assert "laptop" in html and 'value="unpair"' not in html and 'value="re_pair"' not in html
    act(client, Machine, "unpair", machine.pk)
    act(client, Grant, "revoke", grant.pk)
    assert Machine.objects.get(pk=machine.pk).paired is True
    assert Grant.objects.get(pk=grant.pk).revoked_at is None
