"""Session busy/idle (SPEC S1-S7) and the sessions API (H): exact ``session.status``
sequences as published to the owner's board group, after commit."""
from datetime import timedelta

import pytest
from django.db import transaction

from sessions_app import services
from sessions_app.models import Job, Marker, Session
from tests.conftest import machine_api, owner_api
from tasks_app.models import Task
from tasks_app.services.sweeps import expire_leases
from tests.factories import final_facts, grant_lease, receipt, submit
from tests.sessions_events import T0, at, board, board_events, make_task, new_id  # noqa: F401

RUNNING = {"pid": 4242, "pgid": 4242, "process_start_time": 1.0}


def accept_in_session(board, owner, machine, grant, sid) -> str:
    """POST /api/tasks/ with ``session`` (A1), committed; returns the task id."""
    with board.capture(execute=True):
        answer = submit(owner, machine, grant.path, session=sid)
    assert answer.status_code == 201, answer.content
    return answer.json()["id"]


def run_under_lease(board, machine, task_id) -> str:
    """The worker's lease grant and ``running`` receipt, through the machine API; returns
    the lease id."""
    with board.capture(execute=True):
        lease = grant_lease(machine, task_id)
    assert lease.status_code == 201, lease.content
    with board.capture(execute=True):
        assert receipt(machine, task_id, "running", RUNNING).status_code == 200
    return lease.json()["lease_id"]


def final_receipt(board, machine, task_id, lease_id, **facts) -> None:
    with board.capture(execute=True):
        answer = receipt(machine, task_id, "final", final_facts(lease_id=lease_id, **facts))
    assert answer.status_code == 200, answer.content


# --- the sequences of issue 7 -----------------------------------------------------------


def test_s1_plain_turn_busy_then_idle(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t1", "running")
    assert board_events.statuses(owner, sid) == ["busy"]
    at(30)
    board.marker(sid, "t1", "ended")
    assert board_events.statuses(owner, sid) == ["busy", "idle"]
    session = Session.objects.get(pk=sid)
    assert (session.status, session.status_since) == ("idle", T0 + timedelta(seconds=30))
    versions = [e["version"] for e in board_events.of(owner) if e["type"] == "session.status"]
    assert versions == sorted(versions) and len(set(versions)) == 2


def test_s3_held_job_wakes_new_turn_no_idle_in_between(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "turn-1", "running")
    at(10)
    board.job(sid, "bg-1", "held")
    at(20)
    board.marker(sid, "turn-1", "ended")  # the turn ends before the job finishes
    assert Session.objects.get(pk=sid).status == "busy"
    at(300)
    job = board.finish(sid, "bg-1", wakes=True)
    assert job["counts"] is True  # waits for the wake turn
    assert Session.objects.get(pk=sid).status == "busy"
    at(301)
    board.marker(sid, "turn-2", "running")  # the job's notice wakes a new turn
    assert Job.objects.get(job_id="bg-1").consumed_at == T0 + timedelta(seconds=301)
    at(360)
    board.marker(sid, "turn-2", "ended")
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s3_waking_job_not_consumed_by_a_turn_that_started_before_it_finished(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "turn-1", "running")
    board.job(sid, "bg", "held")
    at(5)
    board.finish(sid, "bg", wakes=True)  # finishes while turn-1 still runs
    at(6)
    board.marker(sid, "turn-1", "ended")
    assert board_events.statuses(owner, sid) == ["busy"]  # the wake turn has not run yet
    at(7)
    board.marker(sid, "turn-2", "running")
    at(8)
    board.marker(sid, "turn-2", "ended")
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s3_wakes_false_releases_at_once(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t", "running")
    board.job(sid, "bg", "held")
    board.marker(sid, "t", "ended")
    assert board_events.statuses(owner, sid) == ["busy"]
    at(40)
    job = board.finish(sid, "bg", wakes=False)
    assert job["counts"] is False
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s4_detached_job_idle_when_turn_ends(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t", "running")
    job = board.job(sid, "devserver", "detached")
    assert job["counts"] is False
    at(15)
    board.marker(sid, "t", "ended")
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s4_auto_backgrounded_job_counts_like_held(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t", "running")
    job = board.job(sid, "auto", mode=None, auto_backgrounded=True)
    assert (job["mode"], job["counts"]) == ("held", True)
    board.marker(sid, "t", "ended")
    assert board_events.statuses(owner, sid) == ["busy"]
    board.finish(sid, "auto", wakes=False)
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s3_job_without_mode_is_refused_and_repeat_is_idempotent(board, owner):
    sid = new_id()
    board.job(sid, "j", mode=None, expect=400)
    first = board.job(sid, "j", "held")
    again = board.job(sid, "j", "detached", expect=200)
    assert again == first
    assert Job.objects.filter(session_id=sid).count() == 1
    board.finish(sid, "nope", wakes=True, expect=404)


def test_s5_stop_with_held_job_cancels_it_and_goes_idle(board, board_events, owner, machine, grant, at):
    sid = new_id()
    board.marker(sid, "t", "running", device="laptop")
    board.marker(sid, "t2", "running", device="phone")
    board.job(sid, "bg", "held")
    board.job(sid, "dev", "detached")
    task = make_task(owner, machine, grant, sid, state="accepted")
    at(60)
    answer = board.stop(sid)
    assert answer["markers_closed"] == 2
    assert answer["jobs_cancelled"] == 1
    assert answer["tasks_cancelled"] == 1
    assert answer["status"] == "idle"
    job = Job.objects.get(job_id="bg")
    assert job.cancelled_at == T0 + timedelta(seconds=60)
    task.refresh_from_db()
    assert task.state == "cancelled"
    assert set(Marker.objects.filter(session_id=sid).values_list("state", flat=True)) == {"ended"}
    assert board_events.statuses(owner, sid) == ["busy", "idle"]
    ended = [e for e in board_events.markers(owner, sid) if e["state"] == "ended"]
    assert {e["device_id"] for e in ended} == {"laptop", "phone"}


def test_s5_stop_leaves_session_busy_while_leased_task_still_runs(board, board_events, owner, machine, grant):
    sid = new_id()
    board.marker(sid, "t", "running")
    task_id = accept_in_session(board, owner, machine, grant, sid)
    lease_id = run_under_lease(board, machine, task_id)
    answer = board.stop(sid)
    assert answer["tasks_cancelled"] == 1
    task = Task.objects.get(pk=task_id)
    assert task.state == "running" and task.cancel_requested_at is not None  # J7: waits for the facts
    assert board_events.statuses(owner, sid) == ["busy"]
    final_receipt(board, machine, task_id, lease_id, exit_code=None, signal=15, stop_reason="cancel")
    assert Task.objects.get(pk=task_id).state == "cancelled"
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s5_stop_is_owner_only(board, owner, machine, other_owner):
    sid = new_id()
    board.marker(sid, "t", "running")
    assert machine_api(machine).post(f"/api/sessions/{sid}/stop/").status_code == 403
    assert owner_api(other_owner).post(f"/api/sessions/{sid}/stop/").status_code == 404
    assert Marker.objects.get(session_id=sid).state == "running"


def test_s7_held_job_that_never_reports_goes_idle_after_the_bound(board, board_events, owner, at, settings):
    sid = new_id()
    board.marker(sid, "t", "running")
    board.job(sid, "forgotten", "held")
    at(60)
    board.marker(sid, "t", "ended")
    assert board_events.statuses(owner, sid) == ["busy"]
    bound = settings.RUNSTEAD_JOB_HOLD_MAX_S
    assert bound == 3600
    assert board.sweep(T0 + timedelta(seconds=bound - 1)) == 0
    assert board_events.statuses(owner, sid) == ["busy"]
    assert board.sweep(T0 + timedelta(seconds=bound)) == 1
    assert board.sweep(T0 + timedelta(seconds=bound + 1)) == 0
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s7_sweep_takes_only_lapsed_sessions_so_busy_ones_never_starve_it(board, board_events, owner, at):
    long_busy, lapsed = new_id(), new_id()
    board.job(long_busy, "forever", "held")  # busy first, and still busy
    at(3000)
    board.job(long_busy, "fresh", "held")
    board.marker(lapsed, "t", "running", device="crashed")
    sweep_at = T0 + timedelta(seconds=3000 + 1200 + 60)
    with board.capture(execute=True):
        assert services.sessions_sweep(now=sweep_at, batch=1) == 1
    assert board_events.statuses(owner, lapsed) == ["busy", "idle"]
    assert board_events.statuses(owner, long_busy) == ["busy"]


def test_s7_waking_job_never_consumed_stops_counting_after_the_bound(board, board_events, owner, at):
    sid = new_id()
    board.job(sid, "bg", "held")
    at(100)
    board.finish(sid, "bg", wakes=True)
    assert board.sweep(T0 + timedelta(seconds=3599)) == 0
    assert board.sweep(T0 + timedelta(seconds=3600)) == 1
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s6_reconnect_after_work_ended_offline_active_says_idle(board, board_events, owner, at):
    busy_sid, done_sid = new_id(), new_id()
    board.marker(done_sid, "a", "running")
    board.marker(busy_sid, "b", "running", device="desk")
    body = board.active()
    assert {s["id"] for s in body["sessions"]} == {busy_sid, done_sid}
    assert body["server_time"].startswith("2026-03-02T09:00:00")
    # The board goes offline; the work in done_sid ends meanwhile.
    at(120)
    board.marker(done_sid, "a", "ended")
    body = board.active()
    assert [(s["id"], s["status"]) for s in body["sessions"]] == [(busy_sid, "busy")]
    assert body["sessions"][0]["since"].startswith("2026-03-02T09:00:00")
    assert Session.objects.get(pk=done_sid).status == "idle"


def test_s6_active_settles_a_lapsed_marker_even_before_the_sweep(board, board_events, owner, at, settings):
    sid = new_id()
    board.marker(sid, "crashed", "running")
    at(settings.RUNSTEAD_MARKER_DEFAULT_S + settings.RUNSTEAD_MARKER_GRACE_S)
    assert board.active()["sessions"] == []
    assert board_events.statuses(owner, sid) == ["busy", "idle"]
    assert board.sweep(T0 + timedelta(days=1)) == 0  # already settled, published once


def test_s1_task_accept_makes_session_busy_final_receipt_idle(board, board_events, owner, machine, grant):
    """S1 through the real paths: acceptance (POST /api/tasks/ with a session) makes the
    session busy; lease grant and ``running`` keep it busy; the final receipt makes it
    idle. Each change is published once, after commit (S2)."""
    sid = new_id()
    task_id = accept_in_session(board, owner, machine, grant, sid)
    assert Session.objects.get(pk=sid).status == "busy"
    assert board_events.statuses(owner, sid) == ["busy"]
    lease_id = run_under_lease(board, machine, task_id)
    assert Task.objects.get(pk=task_id).state == "running"
    assert board_events.statuses(owner, sid) == ["busy"]
    final_receipt(board, machine, task_id, lease_id)
    assert Task.objects.get(pk=task_id).state == "succeeded"
    assert Session.objects.get(pk=sid).status == "idle"
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s1_unknown_task_does_not_keep_its_session_busy(board, board_events, owner, machine, grant, at, settings):
    sid = new_id()
    task_id = accept_in_session(board, owner, machine, grant, sid)
    run_under_lease(board, machine, task_id)
    at(settings.RUNSTEAD_LEASE_DURATION_S + 1)
    with board.capture(execute=True):
        assert expire_leases(now=T0 + timedelta(seconds=settings.RUNSTEAD_LEASE_DURATION_S + 1)) == 1
    assert Task.objects.get(pk=task_id).state == "unknown"
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_s1_accept_with_another_owners_session_is_refused_and_publishes_nothing(
    board, board_events, owner, other_owner, machine, grant
):
    theirs = Session.objects.create(owner=other_owner, title="theirs", status_since=T0, created_at=T0)
    with board.capture(execute=True):
        answer = submit(owner, machine, grant.path, session=str(theirs.id))
    assert (answer.status_code, answer.json()["error"]) == (404, "not_found")
    assert not Task.objects.filter(owner=owner).exists()
    assert board_events.of(owner) == [] and board_events.of(other_owner) == []


def test_s2_refresh_without_change_publishes_nothing(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t", "running")
    for _ in range(3):
        with board.capture(execute=True):
            with transaction.atomic():
                assert services.session_refresh_status(session_id=sid, now=T0) is False
    assert board_events.statuses(owner, sid) == ["busy"]


def test_s2_rolled_back_change_publishes_nothing(board, board_events, owner, machine, grant):
    sid = new_id()
    board.client.post("/api/sessions/", {"id": sid}, format="json")
    task = make_task(owner, machine, grant, sid, state="succeeded")
    with board.capture(execute=True):
        with pytest.raises(RuntimeError):
            with transaction.atomic():
                from tasks_app.models import Task

                Task.objects.filter(pk=task.pk).update(state="running")
                assert services.session_refresh_status(session_id=sid, now=T0) is True
                raise RuntimeError("the task transaction fails after the status change")
    assert board_events.statuses(owner, sid) == []
    assert Session.objects.get(pk=sid).status == "idle"


def test_k2_events_never_reach_another_owner(board, board_events, owner, other_owner):
    sid = new_id()
    board.marker(sid, "t", "running")
    board.job(sid, "j", "held")
    board.marker(sid, "t", "ended")
    board.finish(sid, "j", wakes=False)
    assert board_events.of(other_owner) == []
    assert board_events.groups() == {f"owner.{owner.pk}"}
    # And another owner's ids answer 404 everywhere.
    mallory = owner_api(other_owner)
    turn = {"turn_id": "x", "device_id": "d", "state": "running"}
    assert mallory.put(f"/api/sessions/{sid}/marker/", turn, format="json").status_code == 404
    assert mallory.post(f"/api/sessions/{sid}/jobs/", {"job_id": "k", "mode": "held"}, format="json").status_code == 404
    assert mallory.post(f"/api/sessions/{sid}/jobs/j/finish/", {"wakes": True}, format="json").status_code == 404
    assert mallory.patch(f"/api/sessions/{sid}/", {"title": "x"}, format="json").status_code == 404
    assert mallory.delete(f"/api/sessions/{sid}/").status_code == 404
    assert mallory.get("/api/sessions/").json()["results"] == []
    assert mallory.post("/api/devices/d/sweep/").json() == {"closed": 0}
    assert board_events.of(other_owner) == []


# --- sessions CRUD (H) ------------------------------------------------------------------


def test_h_session_create_is_idempotent_on_id(owner_client, owner, other_owner):
    sid = new_id()
    first = owner_client.post("/api/sessions/", {"id": sid, "title": "refactor"}, format="json")
    assert first.status_code == 201
    assert first.json()["status"] == "idle" and first.json()["title"] == "refactor"
    again = owner_client.post("/api/sessions/", {"id": sid, "title": "other"}, format="json")
    assert again.status_code == 200 and again.json()["title"] == "refactor"
    assert owner_api(other_owner).post("/api/sessions/", {"id": sid}, format="json").status_code == 404
    no_id = owner_client.post("/api/sessions/", {"title": "fresh"}, format="json")
    assert no_id.status_code == 201 and no_id.json()["id"] != sid
    assert owner_client.post("/api/sessions/", {"id": "nope"}, format="json").json()["error"] == "invalid"


def test_h_session_list_rename_delete(owner_client, owner, machine, grant):
    ids = [owner_client.post("/api/sessions/", {"title": f"s{i}"}, format="json").json()["id"] for i in range(3)]
    listed = owner_client.get("/api/sessions/").json()
    assert {s["id"] for s in listed["results"]} == set(ids) and "next" in listed
    renamed = owner_client.patch(f"/api/sessions/{ids[0]}/", {"title": "renamed"}, format="json")
    assert renamed.status_code == 200 and renamed.json()["title"] == "renamed"
    task = make_task(owner, machine, grant, ids[1], state="succeeded")
    assert owner_client.delete(f"/api/sessions/{ids[1]}/").status_code == 204
    assert not Session.objects.filter(pk=ids[1]).exists()
    task.refresh_from_db()
    assert task.session_id is None  # tasks stay, detached
    assert owner_client.get(f"/api/sessions/{ids[1]}/").status_code == 404
    assert owner_client.get(f"/api/sessions/{ids[0]}/").json()["title"] == "renamed"


def test_h_sessions_api_needs_an_owner(client, machine):
    anonymous = client.get("/api/sessions/")
    assert (anonymous.status_code, anonymous.json()["error"]) == (401, "not_authenticated")
    assert machine_api(machine).get("/api/sessions/").status_code == 403
    assert machine_api(machine).get("/api/sessions/active/").status_code == 403
