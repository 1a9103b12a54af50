"""Owner decisions on ``unknown`` tasks in Django admin (SPEC U1-U4), through the Django
test client: the changelist lists unknown tasks first, the change page shows the evidence,
and each action does exactly what U3 says, recorded with who and when."""
import re

import pytest
from django.contrib.admin.helpers import ACTION_CHECKBOX_NAME
from django.contrib.auth.models import Permission
from django.test import Client

from core import clock
from tasks_app.models import Budget, OutboxMessage, Task, TaskEvent
from board.sweep import sweep_once
from tasks_app.services.sweeps import expire_leases
from tests.conftest import machine_api
from tests.factories import final_facts, grant_lease, receipt, submit

pytestmark = pytest.mark.django_db

CHANGELIST = "/admin/tasks_app/task/"


@pytest.fixture
def admin_client_for(db):
    """A browser session in the admin for ``user``, made staff with view/change on tasks."""

    def make(user) -> Client:
        user.is_staff = True
        user.save()
        user.user_permissions.add(*Permission.objects.filter(codename__in=["view_task", "change_task"]))
        client = Client()
        client.force_login(user)
        return client

    return make


def budget_of(owner):
    b = Budget.objects.get(owner=owner)
    return b.reserved_s, b.spent_s


def unknown_task(owner, machine, folder, pinned, *, runtime_s=None, slept_s=0.0) -> str:
    """A task that ran, went silent (lease lapsed, L6), and whose worker has no record."""
    task_id = submit(owner, machine, folder).json()["id"]
    lease = grant_lease(machine, task_id).json()
    receipt(machine, task_id, "running", {"pid": 4242, "pgid": 4242, "process_start_time": 1767225600.25})
    machine_api(machine).post(f"/api/worker/leases/{lease['lease_id']}/renew/", {"output_tail": "step 3 of 9\n"},
                              format="json")
    if runtime_s is not None:  # row 2 facts: exit status unknown, runtime known
        receipt(machine, task_id, "final", final_facts(process_started="unknown", exit_code=None,
                                                       runtime_s=runtime_s, stop_reason="worker_restart"),
                slept_s=slept_s)
    else:
        pinned.shift(61)
        assert expire_leases(now=clock.now()) == 1
        receipt(machine, task_id, "report", {"query_id": "q-1", "record": None}, slept_s=slept_s)
    assert Task.objects.get(pk=task_id).state == "unknown"
    return task_id


def act(client, action, *task_ids):
    return client.post(CHANGELIST, {"action": action, ACTION_CHECKBOX_NAME: [str(t) for t in task_ids], "index": 0},
                       follow=True)


def test_u3_changelist_lists_unknown_tasks_first(owner, machine, grant, grant_root, pinned, admin_client_for):
    unknown_id = unknown_task(owner, machine, grant_root / "a", pinned)
    pinned.shift(10)
    running_id = submit(owner, machine, grant_root / "b").json()["id"]
    pinned.shift(10)
    done_id = submit(owner, machine, grant_root / "c").json()["id"]
    receipt(machine, done_id, "final", final_facts(process_started=False, exit_code=None, stop_reason="refused"))
    html = admin_client_for(owner).get(CHANGELIST).content.decode()
    order = [m for m in re.findall(r"/admin/tasks_app/task/([0-9a-f-]{36})/change/", html)]
    order = list(dict.fromkeys(order))
    assert order[0] == unknown_id  # oldest, but first
    assert set(order) == {unknown_id, running_id, done_id}


def test_u3_changelist_shows_only_the_owners_tasks(owner, other_owner, machine, grant, grant_root, pinned,
                                                   admin_client_for):
    task_id = unknown_task(owner, machine, grant_root, pinned)
    html = admin_client_for(other_owner).get(CHANGELIST).content.decode()
    assert task_id not in html
    assert admin_client_for(other_owner).get(f"{CHANGELIST}{task_id}/change/").status_code == 404


def test_u4_change_page_shows_the_evidence(owner, machine, grant, grant_root, pinned, admin_client_for):
    task_id = unknown_task(owner, machine, grant_root, pinned, slept_s=812.5)
    resp = admin_client_for(owner).get(f"{CHANGELIST}{task_id}/change/")
    assert resp.status_code == 200
    html = resp.content.decode()
    # Lease timeline: granted, renewals, expiry.
    assert "Granted at" in html and "Renewals" in html and "Expires at" in html
    assert "expired" in html  # end_reason of the lease
    # pid and process start time, slept_s, last output.
    assert "4242" in html and "1767225600.25" in html
    assert "812.5" in html
    assert "step 3 of 9" in html
    # The worker's answers: the report receipt and its answer, and the history.
    assert "report" in html and "q-1" in html and "no_final_facts" in html
    assert "lease expired (L6)" in html and "report: no record" in html


def test_u4_change_page_shows_survivors(owner, machine, grant, grant_root, pinned, admin_client_for):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    receipt(machine, task_id, "final", final_facts(process_started="unknown", exit_code=None, stop_reason="worker_restart",
                                                   survivors=[{"pid": 9191, "start_time": 3.5}]))
    html = admin_client_for(owner).get(f"{CHANGELIST}{task_id}/change/").content.decode()
    assert "9191" in html


def test_u3_mark_succeeded_charges_known_runtime_releases_lock_records_who(
    owner, machine, grant, grant_root, pinned, admin_client_for
):
    task_id = unknown_task(owner, machine, grant_root, pinned, runtime_s=40.0)
    pinned.shift(3600)
    resp = act(admin_client_for(owner), "mark_succeeded", task_id)
    assert resp.status_code == 200
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.charged_s, task.holds_lock) == ("succeeded", 40.0, False)
    assert (task.decided_by, task.decided_at, task.final_at) == (owner, clock.now(), clock.now())
    assert budget_of(owner) == (0, 40.0)
    event = TaskEvent.objects.filter(task=task).last()
    assert (event.old_state, event.new_state, event.actor, event.at) == ("unknown", "succeeded", "owner:alice", clock.now())
    assert "owner decision" in event.reason
    assert submit(owner, machine, grant_root).status_code == 201  # the folder is free


def test_u3_mark_failed_without_runtime_charges_the_reservation(
    owner, machine, grant, grant_root, pinned, admin_client_for
):
    task_id = unknown_task(owner, machine, grant_root, pinned)
    act(admin_client_for(owner), "mark_failed", task_id)
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.charged_s, task.holds_lock, task.decided_by) == ("failed", 1800, False, owner)
    assert budget_of(owner) == (0, 1800)
    assert TaskEvent.objects.filter(task=task).last().actor == "owner:alice"


def test_u3_it_never_ran_abandons_with_full_release(owner, machine, grant, grant_root, pinned, admin_client_for):
    task_id = unknown_task(owner, machine, grant_root, pinned, runtime_s=40.0)
    act(admin_client_for(owner), "mark_abandoned", task_id)
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.charged_s, task.holds_lock) == ("abandoned", 0, False)
    assert (task.decided_by, task.decided_at) == (owner, clock.now())
    assert budget_of(owner) == (0, 0)


def test_u3_ask_again_sends_a_query_and_changes_nothing_else(
    owner, machine, grant, grant_root, pinned, admin_client_for
):
    task_id = unknown_task(owner, machine, grant_root, pinned)
    queries = list(OutboxMessage.objects.filter(operation__task_id=task_id, kind="query"))
    assert len(queries) == 1  # U1: sent when the task became unknown
    version = Task.objects.get(pk=task_id).version
    resp = act(admin_client_for(owner), "ask_again", task_id)
    assert "asked the worker again" in resp.content.decode()
    new = OutboxMessage.objects.filter(operation__task_id=task_id, kind="query").exclude(pk=queries[0].pk).get()
    assert new.payload["query_id"] != queries[0].payload["query_id"]
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.version, task.holds_lock, task.decided_by) == ("unknown", version, True, None)
    assert budget_of(owner) == (1800, 0)
    event = TaskEvent.objects.filter(task=task).last()
    assert (event.reason, event.actor, event.new_state) == ("owner asked the worker again", "owner:alice", "unknown")
    # The worker pulls it.
    kinds = [m["kind"] for m in machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]]
    assert kinds.count("query") == 2


def test_u3_decision_on_a_task_that_is_not_unknown_changes_nothing(
    owner, machine, grant, grant_root, pinned, admin_client_for
):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)  # starting: not for the owner to decide
    resp = act(admin_client_for(owner), "mark_succeeded", task_id)
    assert "not unknown" in resp.content.decode()
    assert Task.objects.get(pk=task_id).state == "starting"
    assert budget_of(owner) == (1800, 0)


def test_u3_nothing_is_retried_automatically(owner, machine, grant, grant_root, pinned):
    """An unknown task stays unknown through sweeps: no new lease, no new start, no query."""
    task_id = unknown_task(owner, machine, grant_root, pinned)
    messages_before = OutboxMessage.objects.filter(operation__task_id=task_id).count()
    for _ in range(3):
        pinned.shift(700)
        expire_leases(now=clock.now())
    sweep_once(now=clock.now())
    assert Task.objects.get(pk=task_id).state == "unknown"
    assert OutboxMessage.objects.filter(operation__task_id=task_id).count() == messages_before
    assert grant_lease(machine, task_id).json()["error"] == "unknown"


def test_u3_view_only_staff_cannot_decide(owner, machine, grant, grant_root, pinned):
    task_id = unknown_task(owner, machine, grant_root, pinned)
    owner.is_staff = True
    owner.save()
    owner.user_permissions.add(Permission.objects.get(codename="view_task"))
    client = Client()
    client.force_login(owner)
    act(client, "mark_succeeded", task_id)
    assert Task.objects.get(pk=task_id).state == "unknown"


def test_l8_clear_survivor_lock_action(owner, machine, grant, grant_root, pinned, admin_client_for):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    receipt(machine, task_id, "final", final_facts(stop_reason="cancel", signal=15, exit_code=None,
                                                   survivors=[{"pid": 9191, "start_time": 3.5}]))
    assert Task.objects.get(pk=task_id).holds_lock
    act(admin_client_for(owner), "clear_survivor_lock", task_id)
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.holds_lock) == ("cancelled", False)
    assert TaskEvent.objects.filter(task=task).last().actor == "owner:alice"


def test_u4_g5_change_page_shows_git_evidence_in_words(owner, machine, grant, grant_root, pinned, admin_client_for):
    task_id = unknown_task(owner, machine, grant_root, pinned, slept_s=0.0)
    git = {"start_head": "a" * 40, "end_head": "b" * 40, "commits": 2, "subjects": ["one", "two"], "files_changed": 5,
           "insertions": 7, "deletions": 1, "dirty": [], "dirty_count": 0, "start_dirty": 0}
    Task.objects.filter(pk=task_id).update(evidence={"git": git})
    html = admin_client_for(owner).get(f"{CHANGELIST}{task_id}/change/").content.decode()
    assert "2 commits, 5 files changed since the task started (+7 -1)" in html
