"""SPEC Q6, N: the notification kind ``approval``. On by default, one per approval id,
pushed (Web Push, decrypted here) and posted (webhook) to real local receivers through
K5's allow list; the push is tagged with the approval id (and carries it as the RFC 8030
``Topic``) and is replaced by the answer; a decided approval sends nothing more."""
import json
import uuid

import pytest

from notifications import delivery
from notifications.models import Delivery, Notification
from machine.hooks.mapping import session_uuid
from tests.conftest import owner_api
from tests.notify_support import browser_keys, put_settings, receiver, subscribe  # noqa: F401
from tests.sessions_events import at, board_events  # noqa: F401

pytestmark = pytest.mark.django_db(transaction=True)

SESSION = str(session_uuid("claude", "q6-notify-session"))
BASH = {"command": "rm -rf build && make", "description": "Clean and build"}


def ask(owner, key="claude:q6:p1:abc:1"):
    return owner_api(owner).post("/api/approvals/", {
        "key": key, "session": SESSION, "agent": "claude", "tool_name": "Bash", "tool_input": BASH,
        "cwd": "/Users/alice/src/shop", "suggestions": []}, format="json")


def decide(owner, approval_id, **body):
    return owner_api(owner).post(f"/api/approvals/{approval_id}/decision/", body or {"behavior": "allow"},
                                 format="json", HTTP_IDEMPOTENCY_KEY=f"d-{uuid.uuid4()}")


def decrypt(request, private, auth) -> dict:
    import http_ece

    return json.loads(http_ece.decrypt(request["body"], private_key=private, auth_secret=auth, version="aes128gcm"))


@pytest.fixture
def channels(owner, owner_client, receiver):
    """A push subscription and a webhook of ``owner``, each on a local receiver:
    ``(push receiver, webhook receiver, decrypt(request) -> payload)``."""
    push, hook = receiver([201]), receiver([200])
    private, keys, auth = browser_keys()
    assert subscribe(owner_client, push.url + "/push/phone", keys).status_code == 201
    assert put_settings(owner_client, webhook_url=hook.url + "/hook").status_code == 200
    return push, hook, lambda request: decrypt(request, private, auth)


def test_q6_one_notification_per_approval_id_tagged_with_it(owner, channels, at):
    push, hook, read = channels
    first = ask(owner)
    assert first.status_code == 201, first.content
    assert ask(owner).status_code == 200  # the hook's retry: the same row, no second notification
    approval_id = first.json()["id"]
    (note,) = Notification.objects.all()
    assert note.kind == "approval" and note.event_key == f"approval:{approval_id}:asked"
    assert delivery.notify_step() == 2
    assert delivery.notify_step() == 0
    (pushed,) = push.wait_for(1)
    (posted,) = hook.wait_for(1)
    payload = read(pushed)
    assert payload == json.loads(posted["body"])
    assert (payload["kind"], payload["tag"], payload["approval_id"], payload["approval_state"]) == (
        "approval", approval_id, approval_id, "pending")
    assert payload["title"] == "Bash waits for your approval"
    assert "rm -rf build && make" in payload["body"] and "shop" in payload["body"]
    assert payload["session_id"] == SESSION
    assert pushed["headers"]["topic"] == uuid.UUID(approval_id).hex  # the push service replaces by it
    assert posted["headers"]["x-runstead-event"] == "approval"


def test_q6_the_answer_replaces_the_question_with_the_same_tag_then_nothing_more(owner, channels, at):
    push, hook, read = channels
    approval_id = ask(owner).json()["id"]
    assert delivery.notify_step() == 2
    push.wait_for(1)
    hook.wait_for(1)
    at(5)
    assert decide(owner, approval_id, behavior="deny", message="use make clean").status_code == 200
    assert delivery.notify_step() == 2
    question, answer = (read(r) for r in push.wait_for(2))
    assert answer["tag"] == question["tag"] == approval_id
    assert answer["id"] != question["id"]
    assert (answer["approval_state"], answer["title"]) == ("denied", "Bash: denied")
    assert answer["body"] == "by alice: use make clean"
    assert push.requests[1]["headers"]["topic"] == push.requests[0]["headers"]["topic"]
    assert json.loads(hook.wait_for(2)[1]["body"]) == answer
    # Q6: decided is final: later answers, the terminal, the sweep announce nothing.
    at(10)
    assert decide(owner, approval_id).status_code == 409
    assert owner_api(owner).post(f"/api/approvals/{approval_id}/terminal/", {}, format="json").status_code == 200
    assert ask(owner, key="claude:q6:p1:abc:1").status_code == 200
    at(3600)
    assert delivery.notify_step() == 0
    assert [n.event_key for n in Notification.objects.order_by("created_at")] == [
        f"approval:{approval_id}:asked", f"approval:{approval_id}:decided"]
    assert len(push.requests) == len(hook.requests) == 2


def test_q6_an_answer_before_the_question_went_out_sends_nothing_to_devices(owner, channels, board_events, at):
    """Decided before the notify loop ran: the question is dropped unsent (superseded),
    so no device gets a question it can no longer answer, nor an answer to nothing; the
    open board gets both (its notification for the question is replaced by the tag)."""
    push, hook, _ = channels
    approval_id = ask(owner).json()["id"]
    assert decide(owner, approval_id).status_code == 200
    assert delivery.notify_step() == 0
    asked = Notification.objects.get(event_key=f"approval:{approval_id}:asked")
    assert {(d.status, d.last_error) for d in asked.deliveries.all()} == {
        ("dropped", "superseded: the approval was decided (Q6)")}
    assert not Delivery.objects.filter(notification__event_key=f"approval:{approval_id}:decided").exists()
    shown = [e["notification"] for e in board_events.of(owner) if e["type"] == "notification"]
    assert [(n["approval_state"], n["tag"]) for n in shown] == [("pending", approval_id), ("allowed", approval_id)]
    assert push.requests == [] and hook.requests == []


def test_q6_an_answer_while_the_question_is_in_flight_waits_out_the_send(owner, channels, at):
    push, hook, _ = channels
    approval_id = ask(owner).json()["id"]
    claimed = delivery.deliveries_claim(now=at(1))  # a loop took them and is sending
    assert len(claimed) == 2
    assert decide(owner, approval_id).status_code == 200
    answers = Delivery.objects.filter(notification__event_key=f"approval:{approval_id}:decided")
    assert answers.count() == 2
    assert all((d.next_attempt_at - at(1)).total_seconds() == pytest.approx(11.0) for d in answers)
    for row in claimed:  # the sends end; their records lose to the supersession, harmlessly
        delivery.delivery_record(row, delivery.Outcome("sent"), now=at(2))
    assert delivery.notify_step(now=at(2)) == 0
    assert delivery.notify_step(now=at(13)) == 2


def test_q6_kind_off_writes_neither_question_nor_answer(owner, owner_client, channels, at):
    from tests.notify_support import ALL_ON

    assert put_settings(owner_client, kinds={**ALL_ON, "approval": False},
                        webhook_url=channels[1].url + "/hook").status_code == 200
    approval_id = ask(owner).json()["id"]
    assert decide(owner, approval_id).status_code == 200
    assert not Notification.objects.exists()


def test_q6_approval_kind_is_on_by_default_and_kept_by_a_body_without_it(owner, owner_client):
    assert owner_client.get("/api/notifications/settings/").json()["kinds"]["approval"] is True
    older_client = {"session_idle": True, "attention": False, "unknown": True, "task_succeeded": True,
                    "task_failed": True}
    response = owner_client.put("/api/notifications/settings/", {"kinds": older_client, "webhook_url": None,
                                                                 "board": True, "push": True}, format="json")
    assert response.status_code == 200, response.content
    assert response.json()["kinds"] == {**older_client, "approval": True}
