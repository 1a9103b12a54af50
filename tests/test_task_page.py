"""The task page (SPEC B9) without a browser: login required, owner-scoped, what it
shows (usage, agent result, git evidence, timeline with "paused by sleep", receipts), and
the U3 decisions posted from it (CSRF, the same service as the admin, who and when)."""
import json

import pytest
from django.test import Client

from tasks_app.models import Task, TaskEvent
from tests.factories import agent_facts, final_facts, grant_lease, receipt, submit

pytestmark = pytest.mark.django_db

AGENT = agent_facts(agent_result={"is_error": True, "subtype": "api_error", "summary": "API Error: 500"},
                    agent_session_id="s-1", subjects=["fix: x", "y"], dirty=[], dirty_count=0)


def logged_in(user) -> Client:
    client = Client(enforce_csrf_checks=True)
    client.force_login(user)
    return client


def page_data(response) -> dict:
    html = response.content.decode()
    start = html.index('<script id="task-data" type="application/json">') + len('<script id="task-data" type="application/json">')
    return json.loads(html[start:html.index("</script>", start)])


def test_b9_login_required_and_owner_scoped(owner, other_owner, machine, grant, grant_root, pinned):
    task_id = submit(owner, machine, grant_root).json()["id"]
    anonymous = Client().get(f"/tasks/{task_id}/")
    assert anonymous.status_code == 302 and "/accounts/login/" in anonymous["Location"]
    assert logged_in(other_owner).get(f"/tasks/{task_id}/").status_code == 404
    assert logged_in(other_owner).get(f"/tasks/{task_id}/data/").status_code == 404
    lax = Client()  # CSRF checks off: the owner scope alone answers
    lax.force_login(other_owner)
    assert lax.post(f"/tasks/{task_id}/decide/", {"decision": "abandoned"}).status_code == 404
    assert logged_in(owner).get(f"/tasks/{task_id}/").status_code == 200


def test_b9_page_shows_agent_result_usage_git_and_sleep_in_the_timeline(owner, machine, grant, grant_root, pinned):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    receipt(machine, task_id, "running", {"pid": 5, "pgid": 5, "process_start_time": 1.0})
    pinned.shift(30)
    receipt(machine, task_id, "final", final_facts(runtime_s=400.0, exit_code=0, **AGENT), slept_s=340.0)
    response = logged_in(owner).get(f"/tasks/{task_id}/")
    data = page_data(response)
    assert data["task"]["state"] == "failed" and data["task"]["state_reason"] == "agent reported api_error"
    assert data["task"]["usage"] == AGENT["usage"] and data["task"]["agent_result"] == AGENT["agent_result"]
    assert data["git_line"] == "2 commits, 5 files changed since the task started (+10 -3)"
    kinds = [item["kind"] for item in data["timeline"]]
    assert kinds.count("lease") >= 2 and "sleep" in kinds
    sleep = next(i for i in data["timeline"] if i["kind"] == "sleep")
    assert sleep["text"] == "paused by sleep: the laptop slept 340 s before this final receipt"
    texts = [item["text"] for item in data["timeline"]]
    assert kinds.index("sleep") < texts.index("final receipt")  # the gap, then what ended it
    assert data["timeline"][kinds.index("sleep")]["at"] == data["timeline"][texts.index("final receipt")]["at"]
    assert [r["kind"] for r in data["receipts"]] == ["final", "running"]
    assert data["task"]["evidence"]["git"]["subjects"] == ["fix: x", "y"]
    assert 'src="/static/task.js"' in response.content.decode()


def test_u3_decision_on_the_page_settles_and_records_who_and_when(owner, machine, grant, grant_root, pinned):
    task_id = submit(owner, machine, grant_root).json()["id"]
    grant_lease(machine, task_id)
    receipt(machine, task_id, "running", {"pid": 5, "pgid": 5, "process_start_time": 1.0})
    pinned.shift(61)
    from core import clock
    from tasks_app.services.sweeps import expire_leases
    assert expire_leases(now=clock.now()) == 1
    client = logged_in(owner)
    page = client.get(f"/tasks/{task_id}/")
    assert b"Needs your decision" in page.content
    assert client.post(f"/tasks/{task_id}/decide/", {"decision": "failed"}).status_code == 403  # no CSRF token
    assert Task.objects.get(pk=task_id).state == "unknown"
    token = page.cookies["csrftoken"].value
    answer = client.post(f"/tasks/{task_id}/decide/", {"decision": "failed"}, HTTP_X_CSRFTOKEN=token)
    assert answer.status_code == 302 and answer["Location"] == f"/tasks/{task_id}/"
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.decided_by, task.decided_at) == ("failed", owner, clock.now())
    last = TaskEvent.objects.filter(task=task).last()
    assert (last.reason, last.actor) == ("owner decision: failed", "owner:alice")
    again = client.post(f"/tasks/{task_id}/decide/", {"decision": "succeeded"}, HTTP_X_CSRFTOKEN=token)
    assert again.status_code == 302 and "error=" in again["Location"]  # not unknown any more
    assert Task.objects.get(pk=task_id).state == "failed"
