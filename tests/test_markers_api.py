"""Running markers (SPEC M1-M8) through ``PUT /api/sessions/{id}/marker/`` and
``POST /api/devices/{device_id}/sweep/``; the reader rule M3 with a pinned clock."""
import threading
import uuid
from datetime import timedelta

import pytest
from django.db import connection

from sessions_app import rules
from sessions_app.models import EndedTurn, Marker, Session
from tests.conftest import machine_api, owner_api
from tests.sessions_events import T0, Board, at, board, board_events, make_task, new_id  # noqa: F401


def secs(n):
    return T0 + timedelta(seconds=n)


def marker_row(sid, device="laptop"):
    return Marker.objects.get(session_id=sid, device_id=device)


def running_on_board(owner_client, sid, device="laptop"):
    """What a reader shows now (M3), through the API."""
    body = owner_client.get(f"/api/sessions/{sid}/").json()
    return [m["running"] for m in body["markers"] if m["device_id"] == device][0]


def test_m1_running_stamps_service_times_and_default_class_20_min(board, board_events, owner, at):
    sid = new_id()
    answer = board.marker(sid, "t1", "running", device_name="MacBook")
    assert answer["outcome"] == "applied" and "reason" not in answer
    assert answer["marker"]["started_at"].startswith("2026-03-02T09:00:00")
    row = marker_row(sid)
    assert (row.started_at, row.expires_at) == (T0, secs(1200))
    assert row.device_name == "MacBook" and row.state == "running"
    event = board_events.markers(owner, sid)[-1]
    assert {k: event[k] for k in ("device_id", "device_name", "turn_id", "state", "version")} == {
        "device_id": "laptop", "device_name": "MacBook", "turn_id": "t1", "state": "running", "version": 1,
    }
    assert event["started_at"] == T0.isoformat() and event["expires_at"] == secs(1200).isoformat()
    assert "server_time" in event
    at(100)
    board.marker(sid, "t1", "ended")
    row.refresh_from_db()
    assert (row.state, row.ended_at, row.version) == ("ended", secs(100), 2)
    assert [e["version"] for e in board_events.markers(owner, sid)] == [1, 2]


def test_m1_repeat_running_is_not_a_renewal(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t1", "running")
    at(600)
    answer = board.marker(sid, "t1", "running")
    assert (answer["outcome"], answer["reason"]) == ("applied", "duplicate")
    assert marker_row(sid).expires_at == secs(1200)  # unchanged: no heartbeat extends a turn
    assert len(board_events.markers(owner, sid)) == 1
    at(700)
    board.marker(sid, "t1", "ended")
    again = board.marker(sid, "t1", "ended")
    assert (again["outcome"], again["reason"]) == ("applied", "duplicate")
    assert len(board_events.markers(owner, sid)) == 2


def test_m2_deep_research_lasts_60_min(board, owner_client, owner, at):
    sid = new_id()
    board.marker(sid, "deep", "running", deep_research=True)
    row = marker_row(sid)
    assert row.expires_at == secs(3600) and row.deep_research is True
    at(3600 + 59)
    assert running_on_board(owner_client, sid) is True
    at(3600 + 60)
    assert running_on_board(owner_client, sid) is False


def test_m2_worker_turn_uses_task_runtime_plus_lease(board, owner, machine, grant, settings):
    sid = new_id()
    board.client.post("/api/sessions/", {"id": sid}, format="json")
    make_task(owner, machine, grant, sid, state="running", max_runtime_s=7200)
    worker = Board(machine_api(machine), board.capture)
    worker.marker(sid, "op-1", "running", device=str(machine.pk))
    row = marker_row(sid, str(machine.pk))
    assert (row.expires_at - row.started_at).total_seconds() == 7200 + settings.RUNSTEAD_LEASE_DURATION_S


def test_m2_machine_turn_without_a_task_takes_the_default_class(board, machine):
    sid = new_id()
    worker = Board(machine_api(machine), board.capture)
    worker.marker(sid, "t", "running", device=str(machine.pk))
    row = marker_row(sid, str(machine.pk))
    assert (row.expires_at - row.started_at).total_seconds() == 1200


def test_m3_crashed_device_shows_running_until_expires_plus_grace(board, board_events, owner_client, owner, at):
    sid = new_id()
    board.marker(sid, "t", "running")  # the device crashes: no `ended` ever comes
    expires_at = marker_row(sid).expires_at
    assert expires_at == secs(1200)
    at(1200 + 59.999)
    assert running_on_board(owner_client, sid) is True
    assert rules.marker_is_running(marker_row(sid), secs(1200 + 59.999)) is True
    assert board.sweep(secs(1200 + 59.999)) == 0
    assert Session.objects.get(pk=sid).status == "busy"
    at(1200 + 60)
    assert running_on_board(owner_client, sid) is False
    assert rules.marker_is_running(marker_row(sid), secs(1200 + 60)) is False
    assert board.sweep(secs(1200 + 60)) == 1
    assert board_events.statuses(owner, sid) == ["busy", "idle"]
    assert marker_row(sid).state == "running"  # expiry is a read-side decision; the sweep never edits markers
    assert len(board_events.markers(owner, sid)) == 1


def test_m4_stale_ended_from_an_older_turn_does_not_clear_a_newer_turn(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "old", "running")
    at(10)
    board.marker(sid, "new", "running")  # same device, next turn (the old `ended` was lost)
    at(20)
    stale = board.marker(sid, "old", "ended")
    assert (stale["outcome"], stale["reason"]) == ("not_applied", "stale_turn")
    row = marker_row(sid)
    assert (row.turn_id, row.state) == ("new", "running")
    assert Session.objects.get(pk=sid).status == "busy"
    assert board_events.statuses(owner, sid) == ["busy"]
    at(30)
    assert board.marker(sid, "new", "ended")["outcome"] == "applied"
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_m4_running_for_a_turn_that_already_ended_is_not_applied(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t1", "running")
    board.marker(sid, "t1", "ended")
    late = board.marker(sid, "t1", "running")
    assert (late["outcome"], late["reason"]) == ("not_applied", "turn_ended")
    assert marker_row(sid).state == "ended"
    # An overwritten turn counts as ended too.
    board.marker(sid, "t2", "running")
    board.marker(sid, "t3", "running")
    assert board.marker(sid, "t2", "running")["outcome"] == "not_applied"
    assert marker_row(sid).turn_id == "t3"
    # `ended` delivered before its `running`: the late running never shows a ghost.
    board.marker(sid, "t3", "ended")
    early = board.marker(sid, "t4", "ended")
    assert (early["outcome"], early["reason"]) == ("not_applied", "stale_turn")
    assert board.marker(sid, "t4", "running")["reason"] == "turn_ended"
    assert Session.objects.get(pk=sid).status == "idle"
    assert EndedTurn.objects.filter(session_id=sid).count() == 4
    assert board_events.statuses(owner, sid) == ["busy", "idle", "busy", "idle"]


def test_m5_startup_sweep_closes_only_that_devices_markers(board, board_events, owner, other_owner, at):
    s1, s2, s3 = new_id(), new_id(), new_id()
    board.marker(s1, "a1", "running", device="host:1")
    board.marker(s2, "a2", "running", device="host:1")
    board.marker(s2, "b2", "running", device="host:2")
    board.marker(s3, "b3", "running", device="host:2")
    mallory = Board(owner_api(other_owner), board.capture)
    m_sid = new_id()
    mallory.marker(m_sid, "m", "running", device="host:1")
    at(50)
    with board.capture(execute=True):
        answer = board.client.post("/api/devices/host:1/sweep/")
    assert answer.status_code == 200 and answer.json() == {"closed": 2}
    assert marker_row(s1, "host:1").state == "ended" and marker_row(s2, "host:1").state == "ended"
    assert marker_row(s2, "host:2").state == "running" and marker_row(s3, "host:2").state == "running"
    assert marker_row(m_sid, "host:1").state == "running"  # another owner's device of the same name
    assert board_events.statuses(owner, s1) == ["busy", "idle"]
    assert board_events.statuses(owner, s2) == ["busy"]  # host:2 still runs a turn there
    # The swept turn is over: its late `ended` or `running` changes nothing.
    assert board.marker(s1, "a1", "running")["reason"] == "turn_ended"
    with board.capture(execute=True):
        assert board.client.post("/api/devices/host:1/sweep/").json() == {"closed": 0}


def test_m6_interrupt_is_a_turn_end(board, board_events, owner, at):
    sid = new_id()
    board.marker(sid, "t", "running")
    at(3)  # the user presses Stop in the client, which writes `ended`
    board.marker(sid, "t", "ended")
    assert marker_row(sid).ended_at == secs(3)
    assert board_events.statuses(owner, sid) == ["busy", "idle"]


def test_m7_two_devices_one_session_both_shown_idle_only_when_both_end(board, board_events, owner_client, owner, at):
    sid = new_id()
    board.marker(sid, "lap-1", "running", device="laptop")
    at(5)
    board.marker(sid, "desk-1", "running", device="desktop")
    body = owner_client.get(f"/api/sessions/{sid}/").json()
    assert {(m["device_id"], m["running"]) for m in body["markers"]} == {("laptop", True), ("desktop", True)}
    at(10)
    board.marker(sid, "lap-1", "ended", device="laptop")
    assert Session.objects.get(pk=sid).status == "busy"
    # A device's `ended` never closes another device's turn.
    assert board.marker(sid, "desk-1", "ended", device="laptop")["reason"] == "stale_turn"
    assert marker_row(sid, "desktop").state == "running"
    at(20)
    board.marker(sid, "desk-1", "ended", device="desktop")
    assert board_events.statuses(owner, sid) == ["busy", "idle"]
    assert Marker.objects.filter(session_id=sid).count() == 2


@pytest.mark.django_db(transaction=True)
def test_m7_two_sessions_written_at_once_by_two_devices_never_interfere(make_owner):
    """Two devices write turns into two sessions at the same time, on real connections
    (SQLite file database; serialized by BEGIN IMMEDIATE, no lock errors)."""
    owner = make_owner("bob")
    sessions = {"laptop": str(uuid.uuid4()), "desktop": str(uuid.uuid4())}
    barrier = threading.Barrier(2)
    errors = []

    def device(name):
        try:
            client = owner_api(owner)
            barrier.wait()
            for i in range(10):
                for state in ("running", "ended"):
                    r = client.put(
                        f"/api/sessions/{sessions[name]}/marker/",
                        {"turn_id": f"{name}-{i}", "device_id": name, "state": state},
                        format="json",
                    )
                    assert r.status_code == 200 and r.json()["outcome"] == "applied", r.content
        except Exception as error:  # reported below
            errors.append(error)
        finally:
            connection.close()

    threads = [threading.Thread(target=device, args=(name,)) for name in sessions]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert errors == []
    for name, sid in sessions.items():
        markers = list(Marker.objects.filter(session_id=sid))
        assert [(m.device_id, m.turn_id, m.state, m.version) for m in markers] == [(name, f"{name}-9", "ended", 20)]
        assert EndedTurn.objects.filter(session_id=sid).count() == 10
        session = Session.objects.get(pk=sid)
        assert session.status == "idle" and session.version == 21  # 10 x (busy, idle)


def test_m8_machine_token_writes_and_sweeps_only_its_own_device(board, owner, machine, make_machine):
    sid = new_id()
    worker = machine_api(machine)
    body = {"turn_id": "t", "device_id": str(machine.pk), "state": "running"}
    with board.capture(execute=True):
        assert worker.put(f"/api/sessions/{sid}/marker/", body, format="json").status_code == 200
    other = make_machine(owner, name="desktop")
    refused = worker.put(f"/api/sessions/{sid}/marker/", {**body, "device_id": str(other.pk)}, format="json")
    assert refused.status_code == 403 and refused.json()["error"] == "forbidden_device"
    assert worker.put(f"/api/sessions/{sid}/marker/", {**body, "device_id": "laptop"}, format="json").status_code == 403
    assert worker.post(f"/api/devices/{other.pk}/sweep/").status_code == 403
    assert Marker.objects.filter(session_id=sid).count() == 1
    with board.capture(execute=True):
        assert worker.post(f"/api/devices/{machine.pk}/sweep/").json() == {"closed": 1}
    # Owner tokens may write any device id (terminal wrapper, browser).
    assert board.marker(sid, "o", "running", device=str(other.pk))["outcome"] == "applied"


def test_m8_marker_put_creates_the_session_and_refuses_other_owners(board, owner, other_owner):
    sid = new_id()
    board.marker(sid, "t", "running")
    session = Session.objects.get(pk=sid)
    assert session.owner == owner and session.status == "busy"
    mallory = owner_api(other_owner)
    answer = mallory.put(
        f"/api/sessions/{sid}/marker/", {"turn_id": "x", "device_id": "laptop", "state": "ended"}, format="json"
    )
    assert answer.status_code == 404 and answer.json()["error"] == "not_found"
    assert marker_row(sid).state == "running"


def test_k3_bad_marker_input_is_refused_and_changes_nothing(board, owner_client):
    sid = new_id()
    url = f"/api/sessions/{sid}/marker/"
    for body in (
        {"device_id": "d", "state": "running"},
        {"turn_id": "t", "device_id": "d", "state": "paused"},
        {"turn_id": "t", "device_id": "has space", "state": "running"},
        {"turn_id": "t" * 101, "device_id": "d", "state": "running"},
        {"turn_id": "t", "device_id": "d", "state": "running", "deep_research": "maybe"},
    ):
        answer = owner_client.put(url, body, format="json")
        assert answer.status_code == 400 and answer.json()["error"] == "invalid", body
    assert owner_client.put(url, "{not json", content_type="application/json").status_code == 400
    assert not Session.objects.filter(pk=sid).exists()
    assert owner_client.put("/api/sessions/not-a-uuid/marker/", {}, format="json").status_code == 404
    bad_sweep = owner_client.post("/api/devices/has%20space/sweep/")
    assert bad_sweep.status_code == 400 and bad_sweep.json()["error"] == "invalid"
