"""Notifications (SPEC N1-N3, H): settings, push subscriptions, the outbox written in the
transaction of the change, and delivery by the notify loop to real local HTTP servers
(a webhook receiver, a Web Push endpoint that checks the VAPID JWT and decrypts the
payload with keys made here)."""
import hashlib
import hmac
import json
from datetime import timedelta

import pytest
from django.db import transaction

from notifications import delivery, services
from notifications.models import Delivery, Notification, PushSubscription, VapidKey
from tests.conftest import owner_api
from tests.notify_support import ALL_ON, b64url, browser_keys, put_settings, receiver, subscribe, turn, unb64url  # noqa: F401
from tests.sessions_events import T0, at, board, board_events, new_id  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)




# --- settings (N1, H) ------------------------------------------------------------------------


def test_n1_settings_default_shape(owner_client):
    response = owner_client.get("/api/notifications/settings/")
    assert response.status_code == 200
    assert response.json() == {"kinds": ALL_ON, "webhook_url": None, "board": True, "push": True}


def test_n2_new_webhook_url_answers_secret_once(owner_client):
    first = put_settings(owner_client, webhook_url="https://ntfy.example/topic")
    assert first.status_code == 200, first.content
    secret = first.json()["webhook_secret"]
    assert len(secret) == 64
    again = put_settings(owner_client, webhook_url="https://ntfy.example/topic", board=False)
    assert again.status_code == 200
    assert "webhook_secret" not in again.json()
    assert owner_client.get("/api/notifications/settings/").json() == {
        "kinds": ALL_ON, "webhook_url": "https://ntfy.example/topic", "board": False, "push": True}
    changed = put_settings(owner_client, webhook_url="https://ntfy.example/other")
    assert changed.json()["webhook_secret"] != secret


@pytest.mark.parametrize("body, field", [
    ({"kinds": ALL_ON, "webhook_url": None, "board": True, "push": True, "extra": 1}, "extra"),
    ({"kinds": ALL_ON, "webhook_url": None, "board": "yes", "push": True}, "board"),
    ({"kinds": {**ALL_ON, "session_idle": 1}, "webhook_url": None, "board": True, "push": True}, "kinds"),
    ({"kinds": {**ALL_ON, "other": True}, "webhook_url": None, "board": True, "push": True}, "kinds"),
    ({"kinds": ALL_ON, "webhook_url": "file:///etc/passwd", "board": True, "push": True}, "webhook_url"),
    ({"kinds": ALL_ON, "board": True, "push": True}, "webhook_url"),
])
def test_k3_settings_refuse_bad_input(owner_client, body, field):
    response = owner_client.put("/api/notifications/settings/", body, format="json")
    assert response.status_code == 400
    assert response.json()["error"] == "invalid"
    assert field in response.json()["fields"]
    assert owner_client.get("/api/notifications/settings/").json()["board"] is True  # nothing changed


def test_k2_settings_are_per_owner(owner_client, other_owner):
    put_settings(owner_client, webhook_url="https://a.example/hook", push=False)
    assert owner_api(other_owner).get("/api/notifications/settings/").json() == {
        "kinds": ALL_ON, "webhook_url": None, "board": True, "push": True}


# --- push subscriptions (N2, K2) ----------------------------------------------------------------


def test_n2_subscription_create_is_idempotent_per_endpoint(owner_client):
    _, keys, _ = browser_keys()
    first = subscribe(owner_client, "https://push.example/abc", keys)
    assert first.status_code == 201, first.content
    second = subscribe(owner_client, "https://push.example/abc", keys)
    assert second.status_code == 200
    assert second.json()["id"] == first.json()["id"]
    assert PushSubscription.objects.count() == 1


def test_k3_subscription_refuses_bad_keys_and_unknown_fields(owner_client):
    _, keys, _ = browser_keys()
    bad = subscribe(owner_client, "https://push.example/abc", {**keys, "auth": b64url(b"short")})
    assert (bad.status_code, bad.json()["error"]) == (400, "invalid_keys")
    extra = owner_client.post("/api/push/subscriptions/", {"endpoint": "https://push.example/abc", "keys": {**keys, "x": "1"}}, format="json")
    assert extra.status_code == 400 and "keys" in extra.json()["fields"]
    assert PushSubscription.objects.count() == 0


def test_k2_another_owners_subscription_is_404(owner_client, other_owner):
    _, keys, _ = browser_keys()
    sub_id = subscribe(owner_client, "https://push.example/abc", keys).json()["id"]
    response = owner_api(other_owner).delete(f"/api/push/subscriptions/{sub_id}/")
    assert (response.status_code, response.json()["error"]) == (404, "not_found")
    assert PushSubscription.objects.filter(pk=sub_id).exists()
    assert owner_client.delete(f"/api/push/subscriptions/{sub_id}/").status_code == 204
    assert not PushSubscription.objects.filter(pk=sub_id).exists()


def test_n2_vapid_key_created_once_per_deployment(owner_client):
    first = owner_client.get("/api/push/vapid-public-key/").json()["public_key"]
    second = owner_client.get("/api/push/vapid-public-key/").json()["public_key"]
    assert first == second == VapidKey.objects.get().public_key
    assert len(unb64url(first)) == 65


# --- the outbox (N1, N3) ---------------------------------------------------------------------------


def test_n1_true_idle_writes_one_notification_and_board_event(board, board_events, owner, at):
    sid = new_id()
    turn(board, sid)
    (note,) = Notification.objects.all()
    assert (note.kind, note.owner_id, note.payload["session_id"]) == ("session_idle", owner.pk, sid)
    events = [e for e in board_events.of(owner) if e["type"] == "notification"]
    assert [e["notification"]["id"] for e in events] == [str(note.id)]


def test_n1_no_notification_at_a_wake_blip(board, board_events, owner, at):
    """S3: turn ends while a held job runs; the job finishes with wakes; the wake turn
    runs and ends: one idle, one notification, at the very end."""
    sid = new_id()
    board.marker(sid, "turn-1", "running")
    board.job(sid, "bg", "held")
    board.marker(sid, "turn-1", "ended")
    at(60)
    board.finish(sid, "bg", wakes=True)
    at(61)
    board.marker(sid, "turn-2", "running")
    assert Notification.objects.count() == 0
    at(90)
    board.marker(sid, "turn-2", "ended")
    assert Notification.objects.filter(kind="session_idle").count() == 1


def test_n1_idle_by_marker_expiry_announces_nothing(board, board_events, owner, at, settings):
    """A turn whose marker expired (the agent was killed: no ``ended``) is idle by M3 and
    the sweep stores it, but nobody saw it finish: no notification, and the board event
    says so (B5 plays no sound). Its late ``ended`` then changes nothing."""
    sid = new_id()
    board.marker(sid, "t1", "running")
    expiry = settings.RUNSTEAD_MARKER_DEFAULT_S + settings.RUNSTEAD_MARKER_GRACE_S
    assert board.sweep(at(expiry + 1)) == 1
    statuses = [e for e in board_events.of(owner) if e["type"] == "session.status"]
    assert [(e["status"], e["announced"]) for e in statuses] == [("busy", False), ("idle", False)]
    board.marker(sid, "t1", "ended")
    assert Notification.objects.count() == 0
    # The same session's next turn, seen to end, is announced.
    board.marker(sid, "t2", "running")
    board.marker(sid, "t2", "ended")
    assert Notification.objects.filter(kind="session_idle").count() == 1
    last = [e for e in board_events.of(owner) if e["type"] == "session.status"][-1]
    assert (last["status"], last["announced"]) == ("idle", True)


def test_n1_device_sweep_of_a_crashed_turn_announces_nothing(board, owner, at):
    sid = new_id()
    board.marker(sid, "t1", "running", device="laptop:claude:s1")
    with board.capture(execute=True):
        response = board.client.post("/api/devices/laptop:claude:s1/sweep/", format="json")
    assert response.json() == {"closed": 1}
    assert Notification.objects.count() == 0


def test_n3_rolled_back_change_writes_no_notification(owner, at):
    from sessions_app.models import Session

    session = Session.objects.create(owner=owner, title="s", status="busy", status_since=T0, created_at=T0)
    with pytest.raises(RuntimeError):
        with transaction.atomic():
            assert services.notify_session_idle(Session(pk=session.pk, owner=owner, version=2), now=T0) is not None
            raise RuntimeError("the change fails")
    assert Notification.objects.count() == 0


def test_n3_an_event_key_seen_before_writes_nothing_and_the_callers_change_commits(owner, at):
    """One change is announced once (N3): the second emit of an event key returns None and
    writes nothing, and the caller's own write in the same transaction still commits (the
    duplicate loses inside its savepoint). The one row's payload carries its own id."""
    from sessions_app.models import Session

    session = Session.objects.create(owner=owner, title="s", status="busy", status_since=T0, created_at=T0)
    announced = Session(pk=session.pk, owner=owner, version=2)
    first = services.notify_session_idle(announced, now=T0)
    with transaction.atomic():
        assert services.notify_session_idle(announced, now=T0) is None
        Session.objects.filter(pk=session.pk).update(title="changed after")
    (row,) = Notification.objects.all()
    assert row.pk == first.pk and row.payload["id"] == str(row.pk)
    assert Session.objects.get(pk=session.pk).title == "changed after"


def test_n1_kind_turned_off_writes_nothing(board, owner_client, at):
    put_settings(owner_client, kinds={**ALL_ON, "session_idle": False})
    turn(board, new_id())
    assert Notification.objects.count() == 0


def test_n1_unknown_is_announced_when_its_owner_is_asked_and_ends_are_announced(
        owner, machine, grant, at, django_capture_on_commit_callbacks):
    """N1 as amended: becoming ``unknown`` announces nothing; the owner is asked (once)
    when U2 leaves it unsettled (``task_ask_owner``); its end is announced as usual."""
    from tasks_app.services.transitions import task_ask_owner, task_transition
    from tests.sessions_events import make_task

    task = make_task(owner, machine, grant, None, state="running")
    with transaction.atomic():
        task = task_transition(task, from_states={"running"}, to="unknown", reason="lease expired", actor="sweep", now=T0)
    assert Notification.objects.count() == 0
    with transaction.atomic():
        assert task_ask_owner(task, reason="no report", actor="sweep", now=T0) is True
        assert task_ask_owner(task, reason="no report", actor="sweep", now=T0) is False  # once
    with transaction.atomic():
        task_transition(task, from_states={"unknown"}, to="succeeded", reason="report", actor="worker", now=T0)
    kinds = sorted(Notification.objects.values_list("kind", "payload__state"))
    assert kinds == [("task_succeeded", "succeeded"), ("unknown", "unknown")]


RUNNING_FACTS = {"pid": 7, "pgid": 7, "process_start_time": 1.0}


def running_task(owner, machine, grant, prompt="ship it"):
    """A task leased and running through the worker API (L1, R1)."""
    from tests.factories import grant_lease, receipt, submit

    task_id = submit(owner, machine, grant.path, prompt=prompt, exclusive=False).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", RUNNING_FACTS).json() == {"outcome": "applied"}
    return task_id


def task_notifications():
    return sorted(Notification.objects.values_list("kind", "payload__state", "payload__task_id"))


def test_n1_final_receipts_announce_succeeded_and_failed(owner, machine, grant, at):
    from tests.factories import final_facts, receipt

    good = running_task(owner, machine, grant, "good one")
    bad = running_task(owner, machine, grant, "bad one")
    assert Notification.objects.count() == 0  # accepted, starting, running: nothing to tell
    assert receipt(machine, good, "final", final_facts(exit_code=0)).json() == {"outcome": "applied"}
    assert receipt(machine, bad, "final", final_facts(exit_code=1)).json() == {"outcome": "applied"}
    assert task_notifications() == sorted([("task_succeeded", "succeeded", good), ("task_failed", "failed", bad)])
    failed = Notification.objects.get(kind="task_failed")
    assert failed.payload["title"] == "Task failed" and "bad one" in failed.payload["body"], failed.payload
    # A replayed final receipt changes nothing and announces nothing again (R2, N3).
    assert receipt(machine, bad, "final", final_facts(exit_code=1)).status_code == 200
    assert Notification.objects.count() == 2


def board_task(owner, task_id):
    return next(t for t in owner_api(owner).get("/api/board/").json()["tasks"] if t["id"] == task_id)


def test_n1_u2_lease_lost_then_settled_by_its_late_receipt_asks_nobody(owner, machine, grant, at):
    """L6 then J6 row 4: the real sweep turns a lapsed lease into ``unknown``, which asks
    nobody yet (N1: the worker's record comes first, U2); the late final receipt (ended
    outside the lease), within the bound, settles it ``failed_lease_lost``: the owner hears
    of that end, never of an unknown outcome, and was never listed first."""
    from core import clock
    from tasks_app.services.sweeps import ask_owners_of_unsettled_tasks, expire_leases
    from tests.factories import final_facts, receipt

    task_id = running_task(owner, machine, grant)
    at(59.9)
    assert expire_leases(now=clock.now()) == 0
    at(60)
    assert expire_leases(now=clock.now()) == 1
    assert Notification.objects.count() == 0
    shown = board_task(owner, task_id)
    assert (shown["state"], shown["needs_decision"], shown["decision_asked_at"]) == ("unknown", False, None)
    at(75)
    assert ask_owners_of_unsettled_tasks(now=clock.now()) == 0
    late = receipt(machine, task_id, "final", final_facts(ended_within_lease=False, runtime_s=70.0))
    assert late.json() == {"outcome": "applied"}
    at(60 + 120)
    assert ask_owners_of_unsettled_tasks(now=clock.now()) == 0  # settled: nothing left to ask
    assert task_notifications() == [("task_failed", "failed_lease_lost", task_id)]
    assert Notification.objects.get(kind="task_failed").payload["title"] == "Task failed: lease lost"


def test_n1_u2_no_report_within_the_bound_asks_the_owner_once(owner, machine, grant, at, settings):
    """No report within ``RUNSTEAD_UNKNOWN_ASK_S`` of the query (sent when the lease
    expired): the sweep asks the owner then, once (notified, listed first); a report that
    arrives later still settles the task."""
    from core import clock
    from tasks_app.models import TaskEvent
    from tasks_app.services.sweeps import ask_owners_of_unsettled_tasks, expire_leases
    from tests.factories import final_facts, receipt

    settings.RUNSTEAD_UNKNOWN_ASK_S = 120
    task_id = running_task(owner, machine, grant)
    at(60)
    assert expire_leases(now=clock.now()) == 1
    at(60 + 119.9)
    assert ask_owners_of_unsettled_tasks(now=clock.now()) == 0
    assert Notification.objects.count() == 0
    at(60 + 120)
    assert ask_owners_of_unsettled_tasks(now=clock.now()) == 1
    assert task_notifications() == [("unknown", "unknown", task_id)]
    assert Notification.objects.get().payload["title"] == "Task needs your decision"
    shown = board_task(owner, task_id)
    assert (shown["needs_decision"], shown["decision_asked_at"]) == (True, (T0 + timedelta(seconds=180)).isoformat())
    assert TaskEvent.objects.filter(task_id=task_id).last().reason == (
        "needs the owner's decision: no report from the worker within 120 s of the query")
    at(60 + 300)
    assert ask_owners_of_unsettled_tasks(now=clock.now()) == 0  # once
    record = {"local_state": "ended", "pid": 7, "lease_id": None, "final": final_facts(exit_code=0)}
    assert receipt(machine, task_id, "report", {"query_id": "q", "record": record}).json() == {"outcome": "applied"}
    assert task_notifications() == [("task_succeeded", "succeeded", task_id), ("unknown", "unknown", task_id)]
    assert board_task(owner, task_id)["needs_decision"] is False


@pytest.mark.parametrize("report, asked", [
    ({"record": None}, True),  # "no record"
    ({"record": {"local_state": "running", "pid": 7, "lease_id": None, "final": None}}, True),
    ({"record": {"local_state": "ended", "pid": 7, "lease_id": None,
                 "final": {"process_started": "unknown", "exit_code": None, "signal": None, "lease_id": None,
                           "ended_within_lease": False, "runtime_s": None, "stop_reason": "worker_restart",
                           "survivors": [], "output_tail": ""}}}, True),  # J6 row 2: the facts leave it unknown
    ({"record": {"local_state": "ended", "pid": 7, "lease_id": None,
                 "final": {"process_started": True, "exit_code": 0, "signal": None, "lease_id": None,
                           "ended_within_lease": True, "runtime_s": 3.0, "stop_reason": "exit", "survivors": [],
                           "output_tail": ""}}}, False),  # settled: succeeded
])
def test_n1_u2_a_report_that_cannot_settle_asks_the_owner_at_once(owner, machine, grant, at, report, asked):
    """The worker's answer to the query decides at once: without final facts (or with
    facts that leave the outcome unknown) the owner is asked then, before the bound; with
    final facts the task settles and nobody is asked."""
    from core import clock
    from tasks_app.models import Task
    from tasks_app.services.sweeps import ask_owners_of_unsettled_tasks, expire_leases
    from tests.factories import receipt

    task_id = running_task(owner, machine, grant)
    at(60)
    assert expire_leases(now=clock.now()) == 1
    at(65)
    receipt(machine, task_id, "report", {"query_id": "q", **report})
    task = Task.objects.get(pk=task_id)
    assert (task.state == "unknown", task.decision_asked_at is not None) == (asked, asked)
    want = [("unknown", "unknown", task_id)] if asked else [("task_succeeded", "succeeded", task_id)]
    assert task_notifications() == want
    at(60 + 120)
    assert ask_owners_of_unsettled_tasks(now=clock.now()) == 0
    assert task_notifications() == want


def test_n1_task_kinds_turned_off_write_nothing(owner, owner_client, machine, grant, at):
    from tests.factories import final_facts, receipt

    put_settings(owner_client, kinds={**ALL_ON, "task_failed": False})
    bad = running_task(owner, machine, grant)
    good = running_task(owner, machine, grant)
    receipt(machine, bad, "final", final_facts(exit_code=2))
    receipt(machine, good, "final", final_facts(exit_code=0))
    assert task_notifications() == [("task_succeeded", "succeeded", good)]


def test_k2_notification_reaches_only_its_owners_board_group(board, board_events, owner, other_owner, at):
    turn(board, new_id())
    assert any(e["type"] == "notification" for e in board_events.of(owner))
    assert board_events.of(other_owner) == []


# --- webhook delivery (N2, N3, R4) ---------------------------------------------------------------------


def test_n2_webhook_gets_one_signed_post_per_event(board, owner_client, owner, receiver, at):
    hook = receiver([200])
    secret = put_settings(owner_client, webhook_url=hook.url + "/hook").json()["webhook_secret"]
    sid = new_id()
    turn(board, sid, "t1")
    at(10)
    turn(board, sid, "t2")
    assert delivery.notify_step() == 2
    assert delivery.notify_step() == 0
    at(3600)
    assert delivery.notify_step() == 0  # sent ones never go again
    requests = hook.wait_for(2)
    assert len(requests) == 2
    ids = set()
    for request in requests:
        body = request["body"]
        expected = "sha256=" + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()
        assert request["headers"]["x-runstead-signature"] == expected
        assert request["headers"]["x-runstead-event"] == "session_idle"
        payload = json.loads(body)
        assert request["headers"]["x-runstead-delivery"] == payload["id"]
        assert payload["session_id"] == sid
        ids.add(payload["id"])
    assert ids == {str(n) for n in Notification.objects.values_list("id", flat=True)}


def test_r4_webhook_500_is_retried_with_backoff_then_sent_once(board, owner_client, receiver, at):
    hook = receiver([500, 200])
    put_settings(owner_client, webhook_url=hook.url + "/hook")
    turn(board, new_id())
    assert delivery.notify_step() == 1
    row = Delivery.objects.get()
    assert (row.status, row.attempts) == ("pending", 1)
    assert T0 + timedelta(seconds=0.5) <= row.next_attempt_at <= T0 + timedelta(seconds=1)  # R4, first backoff
    assert delivery.notify_step() == 0  # not due yet
    at(2)
    assert delivery.notify_step() == 1
    first, second = hook.wait_for(2)
    assert first["headers"]["x-runstead-delivery"] == second["headers"]["x-runstead-delivery"]
    row.refresh_from_db()
    assert (row.status, row.attempts) == ("sent", 2)
    at(500)
    assert delivery.notify_step() == 0
    assert len(hook.requests) == 2


def test_n3_undelivered_dropped_after_24_h(board, owner_client, receiver, at):
    hook = receiver([503])
    put_settings(owner_client, webhook_url=hook.url + "/hook")
    turn(board, new_id())
    assert delivery.notify_step() == 1
    at(24 * 3600 + 1)
    assert delivery.notify_step() == 0
    row = Delivery.objects.get()
    assert row.status == "dropped" and "24 h" in row.last_error
    assert len(hook.requests) == 1


def test_n3_webhook_4xx_is_final(board, owner_client, receiver, at):
    hook = receiver([404])
    put_settings(owner_client, webhook_url=hook.url + "/hook")
    turn(board, new_id())
    assert delivery.notify_step() == 1
    at(120)
    assert delivery.notify_step() == 0
    assert Delivery.objects.get().status == "dropped"


# --- Web Push (N2) ----------------------------------------------------------------------------------------


def verify_vapid(header: str, endpoint_origin: str):
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import encode_dss_signature

    scheme, _, params = header.partition(" ")
    assert scheme == "vapid"
    fields = dict(part.split("=", 1) for part in params.split(","))
    public = unb64url(fields["k"])
    assert fields["k"] == VapidKey.objects.get().public_key
    head, claims, signature = fields["t"].split(".")
    assert json.loads(unb64url(head)) == {"typ": "JWT", "alg": "ES256"}
    raw = unb64url(signature)
    assert len(raw) == 64
    key = ec.EllipticCurvePublicKey.from_encoded_point(ec.SECP256R1(), public)
    der = encode_dss_signature(int.from_bytes(raw[:32], "big"), int.from_bytes(raw[32:], "big"))
    key.verify(der, f"{head}.{claims}".encode(), ec.ECDSA(hashes.SHA256()))  # raises when invalid
    body = json.loads(unb64url(claims))
    assert body["aud"] == endpoint_origin
    assert body["sub"] == "mailto:runstead@localhost"
    assert body["exp"] > T0.timestamp()
    return body


def test_n2_web_push_carries_valid_vapid_jwt_and_decryptable_payload(board, owner_client, owner, receiver, at):
    import http_ece

    push = receiver([201])
    private, keys, auth = browser_keys()
    assert subscribe(owner_client, push.url + "/push/sub-1", keys).status_code == 201
    sid = new_id()
    turn(board, sid)
    assert delivery.notify_step() == 1
    (request,) = push.wait_for(1)
    assert request["path"] == "/push/sub-1"
    assert request["headers"]["content-encoding"] == "aes128gcm"
    assert int(request["headers"]["ttl"]) == 86400
    verify_vapid(request["headers"]["authorization"], push.url)
    payload = json.loads(http_ece.decrypt(request["body"], private_key=private, auth_secret=auth, version="aes128gcm"))
    note = Notification.objects.get()
    assert payload["id"] == str(note.id)
    assert (payload["kind"], payload["session_id"], payload["url"]) == ("session_idle", sid, "/")
    assert Delivery.objects.get().status == "sent"


def test_n3_push_answered_410_removes_the_subscription(board, owner_client, receiver, at):
    push = receiver([410])
    _, keys, _ = browser_keys()
    subscribe(owner_client, push.url + "/push/gone", keys)
    turn(board, new_id())
    assert delivery.notify_step() == 1
    push.wait_for(1)
    assert PushSubscription.objects.count() == 0
    at(120)
    turn(board, new_id(), "t2")
    assert Delivery.objects.filter(status="pending").count() == 0  # nothing goes to it again
    assert delivery.notify_step() == 0


def test_n2_push_off_writes_no_push_delivery(board, owner_client, receiver, at):
    push = receiver([201])
    _, keys, _ = browser_keys()
    subscribe(owner_client, push.url + "/push/x", keys)
    put_settings(owner_client, push=False)
    turn(board, new_id())
    assert Notification.objects.count() == 1
    assert Delivery.objects.count() == 0
