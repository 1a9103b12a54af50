"""The board page and its snapshot (B1, B4, B7, K2)."""
from datetime import timedelta

import pytest
from django.conf import settings
from django.test import Client
from django.utils import timezone

from tests.conftest import machine_api, owner_api


def make_task(owner, machine, grant, **fields):
    from tasks_app.models import Task

    now = timezone.now()
    defaults = {"folder": grant.path, "agent": "claude", "prompt": "fix it", "created_at": now, "updated_at": now}
    return Task.objects.create(owner=owner, machine=machine, grant=grant, **{**defaults, **fields})


def make_session(owner, **fields):
    from sessions_app.models import Session

    now = timezone.now()
    return Session.objects.create(owner=owner, **{"title": "chat", "status_since": now, "created_at": now, **fields})


@pytest.mark.django_db
def test_b4_snapshot_has_sessions_tasks_machines_and_server_time(owner, machine, grant):
    session = make_session(owner, title="refactor", status="busy")
    task = make_task(owner, machine, grant, state="running", output_tail="line 1\nline 2")
    response = owner_api(owner).get("/api/board/")
    assert response.status_code == 200
    body = response.json()
    assert [s["id"] for s in body["sessions"]] == [str(session.id)]
    assert body["sessions"][0]["status"] == "busy"
    assert body["sessions"][0]["title"] == "refactor"
    assert body["sessions"][0]["version"] == session.version
    assert body["sessions"][0]["markers"] == []
    assert [t["id"] for t in body["tasks"]] == [str(task.id)]
    assert body["tasks"][0]["state"] == "running"
    assert body["tasks"][0]["version"] == task.version
    assert [m["id"] for m in body["machines"]] == [str(machine.id)]
    assert body["grants"] == [
        {"id": str(grant.id), "machine": str(machine.id), "path": grant.path,
         "created_at": grant.created_at.isoformat(), "revoked_at": None}
    ]
    assert body["marker_grace_s"] == settings.RUNSTEAD_MARKER_GRACE_S
    assert abs((timezone.datetime.fromisoformat(body["server_time"]) - timezone.now()).total_seconds()) < 5


@pytest.mark.django_db
def test_k2_snapshot_holds_only_the_requesting_owners_rows(owner, other_owner, machine, grant, make_machine):
    from tasks_app.models import Grant

    make_session(owner, title="mine")
    make_task(owner, machine, grant)
    theirs = make_machine(other_owner, name="their-laptop")
    their_grant = Grant.objects.create(owner=other_owner, machine=theirs, path="/srv/theirs")
    make_session(other_owner, title="theirs")
    make_task(other_owner, theirs, their_grant)
    body = owner_api(owner).get("/api/board/").json()
    assert [s["title"] for s in body["sessions"]] == ["mine"]
    assert {t["machine"] for t in body["tasks"]} == {str(machine.id)}
    assert [m["name"] for m in body["machines"]] == ["laptop"]
    assert [g["path"] for g in body["grants"]] == [grant.path]


@pytest.mark.django_db
def test_k1_snapshot_refuses_anonymous_and_machine_tokens(machine):
    anonymous = Client().get("/api/board/")
    assert (anonymous.status_code, anonymous.json()["error"]) == (401, "not_authenticated")
    assert machine_api(machine).get("/api/board/").status_code == 403


@pytest.mark.django_db
def test_b4_snapshot_keeps_unfinished_tasks_and_recent_finished_ones(owner, machine, grant):
    from board import shapes

    now = timezone.now()
    unknown = make_task(owner, machine, grant, state="unknown", created_at=now - timedelta(days=30))
    finished = [
        make_task(owner, machine, grant, state="succeeded", final_at=now - timedelta(minutes=i))
        for i in range(shapes.SNAPSHOT_FINISHED_TASKS + 5)
    ]
    ids = {t["id"] for t in owner_api(owner).get("/api/board/").json()["tasks"]}
    assert str(unknown.id) in ids
    assert len(ids) == 1 + shapes.SNAPSHOT_FINISHED_TASKS
    assert str(finished[0].id) in ids and str(finished[-1].id) not in ids


@pytest.mark.django_db
def test_b1_board_page_requires_login_and_embeds_the_snapshot(owner, machine, grant):
    client = Client()
    response = client.get("/")
    assert response.status_code == 302
    assert response["Location"].startswith(settings.LOGIN_URL)
    login_page = client.get(settings.LOGIN_URL)
    assert login_page.status_code == 200
    assert b'name="username"' in login_page.content

    task = make_task(owner, machine, grant, prompt="</script><script>alert(1)</script>")
    assert client.post(settings.LOGIN_URL, {"username": "alice", "password": "pw"}).status_code == 302
    page = client.get("/")
    assert page.status_code == 200
    html = page.content.decode()
    assert 'id="board-snapshot"' in html
    assert str(task.id) in html
    assert "</script><script>alert(1)" not in html  # json_script escapes the prompt
    assert "/static/board.js" in html
    assert 'data-csrf="' in html


@pytest.mark.django_db
def test_m3_snapshot_markers_carry_expiry_and_running_by_service_clock(owner):
    from sessions_app.models import Marker

    now = timezone.now()
    session = make_session(owner, status="busy")
    grace = timedelta(seconds=settings.RUNSTEAD_MARKER_GRACE_S)
    Marker.objects.create(session=session, device_id="phone", device_name="Phone", turn_id="t1", state="running",
                          started_at=now - timedelta(minutes=30), expires_at=now - grace - timedelta(seconds=1))
    Marker.objects.create(session=session, device_id="mac", device_name="Mac", turn_id="t2", state="running",
                          started_at=now, expires_at=now + timedelta(minutes=20), version=4)
    markers = {m["device_id"]: m for m in owner_api(owner).get("/api/board/").json()["sessions"][0]["markers"]}
    assert markers["phone"]["running"] is False  # expired past grace: a read-side decision (M3)
    assert markers["mac"]["running"] is True
    assert markers["mac"]["version"] == 4
    assert markers["mac"]["device_name"] == "Mac"
    assert markers["mac"]["turn_id"] == "t2"
    assert markers["mac"]["expires_at"] == (now + timedelta(minutes=20)).isoformat()
