"""Conversations through the API (SPEC C1-C7, with A1-A5, H, K2): a conversation task's
kind (live, resume, refused), its messages numbered once per Idempotency-Key and in
acceptance order, their states moved only forward by the worker's receipts, interrupt and
end, a live conversation's session idle between turns, and bad input refused with H's
error shape and nothing written.

The machine reports its profiles through ``PUT /api/worker/profiles/`` as the worker does
at start (B10): ``claude`` converses live (streaming input), ``gemini`` by resuming (a
follow-up per message, G6), ``aider`` not at all. The task is moved through the worker
protocol (lease, receipts) as in tests/test_receipts.py. Races: real threads released by
a barrier (tests/barrier.py), on PostgreSQL (``postgres``) and on SQLite (BEGIN IMMEDIATE).
"""
import json
import uuid

import pytest
from django.conf import settings
from django.test import override_settings

from core import clock
from tasks_app.models import (
    FINAL_STATES,
    ConversationMessage,
    IdempotencyRecord,
    OutboxMessage,
    Task,
)
from tests.barrier import race
from tests.conftest import machine_api, owner_api
from tests.sessions_events import board_events  # noqa: F401  (fixture)
from tests.factories import agent_facts, final_facts, grant_lease, operation_id, receipt, submit, table_digest

PROFILES = [
    {"name": "claude", "preset": "claude", "conversation": "live"},
    {"name": "gemini", "preset": "gemini", "conversation": "resume"},
    {"name": "aider", "preset": "aider", "conversation": "none"},
    {"name": "demo", "preset": None},  # reported without ``conversation``: stored as "none"
]
RUNNING = {"pid": 7, "pgid": 7, "process_start_time": 1.0}

sqlite_only = pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3", reason="the SQLite variant (BEGIN IMMEDIATE)"
)


@pytest.fixture
def profiles(machine):
    """The machine's worker reported its profiles (B10, C1)."""
    resp = machine_api(machine).put("/api/worker/profiles/", {"profiles": PROFILES}, format="json")
    assert resp.status_code == 200, resp.content
    machine.refresh_from_db()
    assert {p["name"]: p["conversation"] for p in machine.profiles} == {
        "aider": "none", "claude": "live", "demo": "none", "gemini": "resume"}
    return machine


# --- helpers ---------------------------------------------------------------------------------


def open_conversation(owner, machine, folder, *, agent="claude", **extra):
    """POST /api/tasks/ with ``"mode": "conversation"``; the response."""
    return submit(owner, machine, folder, agent=agent, mode="conversation", exclusive=False, **extra)


def conversation_id(owner, machine, folder, *, agent="claude", **extra) -> str:
    resp = open_conversation(owner, machine, folder, agent=agent, **extra)
    assert resp.status_code == 201, resp.content
    return resp.json()["id"]


def send(owner, task_id, text="hello", *, key=None, body=None):
    """POST /api/tasks/{id}/messages/ with a fresh key unless one is given."""
    return owner_api(owner).post(f"/api/tasks/{task_id}/messages/", {"text": text} if body is None else body,
                                 format="json", HTTP_IDEMPOTENCY_KEY=key or f"msg-{uuid.uuid4()}")


def post_raw(owner, task_id, content, *, key="raw-key", content_type="application/json", **headers):
    if key is not None:
        headers["HTTP_IDEMPOTENCY_KEY"] = key
    return owner_api(owner).generic("POST", f"/api/tasks/{task_id}/messages/", content, content_type=content_type,
                                    **headers)


def listed(owner, task_id) -> list[dict]:
    resp = owner_api(owner).get(f"/api/tasks/{task_id}/messages/")
    assert resp.status_code == 200, resp.content
    return resp.json()["results"]


def states(owner, task_id) -> dict[int, str]:
    return {m["seq"]: m["state"] for m in listed(owner, task_id)}


def outbox(task_id, kind):
    return OutboxMessage.objects.filter(operation__task_id=task_id, kind=kind).order_by("created_at", "id")


def running(machine, task_id) -> str:
    """The task leased and its process reported running."""
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", RUNNING).json() == {"outcome": "applied"}
    assert Task.objects.get(pk=task_id).state == "running"
    return task_id


def live_running(owner, machine, folder, **extra) -> str:
    return running(machine, conversation_id(owner, machine, folder, **extra))


def message_receipt(machine, task_id, message_id, state, **kw):
    return receipt(machine, task_id, "message", {"message_id": str(message_id), "state": state}, **kw)


def message_row(message_id) -> dict:
    return ConversationMessage.objects.filter(pk=message_id).values().get()


def assert_error(resp, status, code):
    assert resp.status_code == status, resp.content
    body = resp.json()
    assert body["error"] == code, body
    assert isinstance(body["detail"], str) and body["detail"], body
    return body


def counts(task_id=None) -> tuple:
    messages = ConversationMessage.objects.all()
    out = OutboxMessage.objects.all()
    if task_id:
        messages, out = messages.filter(task_id=task_id), out.filter(operation__task_id=task_id)
    return messages.count(), out.count(), IdempotencyRecord.objects.count(), Task.objects.count()


class NothingWritten:
    """Every table's rows equal before and after the block (factories.table_digest), and
    the message, outbox, idempotency and task counts too (named for a readable failure)."""

    def __enter__(self):
        self.counts, self.digest = counts(), table_digest()
        return self

    def __exit__(self, *exc):
        if exc[0] is None:
            assert counts() == self.counts
            after = table_digest()
            assert after == self.digest, sorted(t for t in after if after[t] != self.digest.get(t))


@pytest.fixture(autouse=True)
def _pinned(request):
    """The service clock stopped (``pinned``), except in the threaded races."""
    marker = request.node.get_closest_marker("django_db")
    if marker is None or not marker.kwargs.get("transaction"):
        request.getfixturevalue("pinned")


# --- C1: a conversation's kind -------------------------------------------------------------


@pytest.mark.django_db
def test_c1_live_profile_gives_a_live_conversation_whose_message_0_is_the_prompt(owner, profiles, grant, grant_root):
    resp = open_conversation(owner, profiles, grant_root / "repo", prompt="Read the README first.")
    assert resp.status_code == 201, resp.content
    task = resp.json()
    assert (task["mode"], task["conversation"], task["conversation_ended_at"], task["messages_sent"]) == (
        "conversation", "live", None, 0)
    assert owner_api(owner).get(f"/api/tasks/{task['id']}/").json()["conversation"] == "live"
    (first,) = listed(owner, task["id"])
    assert (first["seq"], first["text"], first["state"], first["carrier"], first["task"]) == (
        0, "Read the README first.", "sent", None, task["id"])
    # The start message keeps the agent open and names message 0 (C1, C5).
    (start,) = outbox(task["id"], "start")
    assert start.payload["mode"] == "conversation"
    assert start.payload["prompt_message_id"] == first["id"]
    assert start.payload["idle_s"] == settings.RUNSTEAD_CONVERSATION_IDLE_S
    assert start.payload["prompt"] == "Read the README first."


@pytest.mark.django_db
def test_c1_resume_profile_gives_a_resume_conversation(owner, profiles, grant, grant_root):
    resp = open_conversation(owner, profiles, grant_root / "repo", agent="gemini", prompt="Plan it.")
    assert resp.status_code == 201, resp.content
    task = resp.json()
    assert (task["mode"], task["conversation"]) == ("conversation", "resume")
    (first,) = listed(owner, task["id"])
    # In a resume conversation the task itself carries its prompt (G6).
    assert (first["seq"], first["text"], first["carrier"]) == (0, "Plan it.", task["id"])
    (start,) = outbox(task["id"], "start")
    assert "mode" not in start.payload and "prompt_message_id" not in start.payload


@pytest.mark.django_db
@pytest.mark.parametrize("agent", ["aider", "demo", "never-reported"])
def test_c1_profile_without_conversation_refused_conversation_unsupported_nothing_created(
        owner, profiles, grant, grant_root, agent):
    with NothingWritten():
        resp = open_conversation(owner, profiles, grant_root / "repo", agent=agent, key="conv-1")
        assert_error(resp, 400, "conversation_unsupported")
    assert Task.objects.count() == 0 and ConversationMessage.objects.count() == 0
    # A5: nothing was stored for the key; it works once the cause is gone.
    again = open_conversation(owner, profiles, grant_root / "repo", agent="claude", key="conv-1")
    assert again.status_code == 201 and again.json()["conversation"] == "live"


@pytest.mark.django_db
@pytest.mark.parametrize("mode", [None, "task"])
def test_c1_plain_task_has_conversation_null(owner, profiles, grant, grant_root, mode):
    extra = {"mode": mode} if mode else {}
    resp = submit(owner, profiles, grant_root / "repo", agent="claude", **extra)
    assert resp.status_code == 201, resp.content
    task = resp.json()
    assert (task["mode"], task["conversation"], task["conversation_ended_at"], task["messages_sent"]) == (
        "task", None, None, 0)
    assert listed(owner, task["id"]) == []
    assert "mode" not in outbox(task["id"], "start").get().payload


@pytest.mark.django_db
def test_c1_unknown_mode_is_bad_input(owner, profiles, grant, grant_root):
    with NothingWritten():
        body = assert_error(submit(owner, profiles, grant_root / "repo", agent="claude", mode="chat"), 400, "invalid")
    assert set(body["fields"]) == {"mode"}


# --- C2: messages, once per key, in acceptance order -----------------------------------------


@pytest.mark.django_db
def test_c2_messages_numbered_1_2_3_in_acceptance_order(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    answers = [send(owner, task_id, text) for text in ("one", "two", "three")]
    assert [a.status_code for a in answers] == [201, 201, 201]
    assert [a.headers.get("Idempotent-Replayed") for a in answers] == [None, None, None]
    bodies = [a.json() for a in answers]
    assert [(b["seq"], b["text"], b["state"], b["task"], b["carrier"]) for b in bodies] == [
        (1, "one", "sent", task_id, None), (2, "two", "sent", task_id, None), (3, "three", "sent", task_id, None)]
    assert [(m["seq"], m["text"]) for m in listed(owner, task_id)] == [(0, "do it"), (1, "one"), (2, "two"), (3, "three")]
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["messages_sent"] == 3
    # Each live message goes to the worker in the acceptance transaction (C2, W2).
    op = operation_id(task_id)
    payloads = sorted((m.payload for m in outbox(task_id, "message")), key=lambda p: p["seq"])
    assert payloads == [{"operation_id": op, "message_id": b["id"], "seq": b["seq"], "text": b["text"]} for b in bodies]
    assert {m.machine_id for m in outbox(task_id, "message")} == {profiles.id}
    pulled = machine_api(profiles).get("/api/worker/messages/?wait=0").json()["messages"]
    assert sorted(m["payload"]["seq"] for m in pulled if m["kind"] == "message") == [1, 2, 3]


@pytest.mark.django_db
def test_c2_an_accepted_message_publishes_its_task_with_messages_sent(owner, profiles, grant, grant_root,
                                                                       board_events,  # noqa: F811
                                                                       django_capture_on_commit_callbacks):
    task_id = live_running(owner, profiles, grant_root / "repo")
    version = Task.objects.get(pk=task_id).version
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert send(owner, task_id, "one").status_code == 201
    assert Task.objects.get(pk=task_id).version == version + 1
    [row] = [e for e in board_events.of(owner) if e["type"] == "task"]
    assert (row["task"]["id"], row["task"]["messages_sent"], row["task"]["version"]) == (task_id, 1, version + 1)
    assert [e["message"]["seq"] for e in board_events.of(owner) if e["type"] == "message"] == [1]


@pytest.mark.django_db
def test_c2_replay_returns_same_message(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    first = send(owner, task_id, "fix the test", key="same-key")
    again = send(owner, task_id, "fix the test", key="same-key")
    quoted = send(owner, task_id, "fix the test", key='"same-key"')  # A1: the structured-field form
    assert first.status_code == again.status_code == quoted.status_code == 201
    assert first.content == again.content == quoted.content
    assert (first.headers.get("Idempotent-Replayed"), again.headers.get("Idempotent-Replayed"),
            quoted.headers.get("Idempotent-Replayed")) == (None, "true", "true")
    assert first.json()["seq"] == 1
    assert list(ConversationMessage.objects.filter(task_id=task_id).values_list("seq", flat=True)) == [0, 1]
    assert outbox(task_id, "message").count() == 1
    assert Task.objects.get(pk=task_id).message_seq == 1
    # The next key gets the next number: the replays took none.
    assert send(owner, task_id, "and then?").json()["seq"] == 2


@pytest.mark.django_db
def test_c2_replay_after_the_message_moved_on_is_the_stored_snapshot(owner, profiles, grant, grant_root):
    """A2: the replay is the answer of acceptance time; the live message is read from GET."""
    task_id = live_running(owner, profiles, grant_root / "repo")
    first = send(owner, task_id, "x", key="k1")
    message_receipt(profiles, task_id, first.json()["id"], "delivered")
    again = send(owner, task_id, "x", key="k1")
    assert again.content == first.content and again.json()["state"] == "sent"
    assert states(owner, task_id)[1] == "delivered"


@pytest.mark.django_db
def test_c2_same_key_different_body_is_422_idempotency_key_reused(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    assert send(owner, task_id, "first", key="k").status_code == 201
    with NothingWritten():
        assert_error(send(owner, task_id, "second", key="k"), 422, "idempotency_key_reused")
    assert [m["text"] for m in listed(owner, task_id)] == ["do it", "first"]
    assert outbox(task_id, "message").count() == 1


@pytest.mark.django_db
def test_c2_a_key_names_one_message_of_one_task(owner, profiles, grant, grant_root):
    """The key's scope is the task: the same key on another conversation, or on
    ``POST /api/tasks/``, is a different request."""
    a = live_running(owner, profiles, grant_root / "a")
    b = live_running(owner, profiles, grant_root / "b")
    to_a, to_b = send(owner, a, "same", key="shared"), send(owner, b, "same", key="shared")
    assert (to_a.status_code, to_b.status_code) == (201, 201)
    assert to_b.headers.get("Idempotent-Replayed") is None
    assert (to_a.json()["task"], to_b.json()["task"]) == (a, b)
    assert to_a.json()["id"] != to_b.json()["id"]
    assert submit(owner, profiles, grant_root / "c", key="shared", exclusive=False).status_code == 201


@pytest.mark.django_db
def test_c2_resume_conversation_message_is_a_follow_up(owner, profiles, grant, grant_root):
    """G6: in a resume conversation each message is carried by a follow-up task (queued
    behind the unfinished one, G8); no ``message`` goes to the worker."""
    task_id = running(profiles, conversation_id(owner, profiles, grant_root / "repo", agent="gemini"))
    resp = send(owner, task_id, "now the tests")
    assert resp.status_code == 201, resp.content
    message = resp.json()
    carrier = Task.objects.get(pk=message["carrier"])
    assert (message["seq"], message["state"]) == (1, "sent")
    assert (carrier.continued_from_id, carrier.prompt, carrier.agent, carrier.state) == (
        uuid.UUID(task_id), "now the tests", "gemini", "queued")
    assert not outbox(task_id, "message").exists()
    # The conversation's task ends with an agent session to resume: the follow-up runs,
    # and ends with its answer: the message is answered (C3).
    receipt(profiles, task_id, "final", final_facts(**agent_facts()))
    carrier.refresh_from_db()
    assert carrier.state == "accepted"
    running(profiles, str(carrier.id))
    assert states(owner, task_id)[1] == "delivered"
    receipt(profiles, str(carrier.id), "final", final_facts(**agent_facts()))
    assert states(owner, task_id) == {0: "answered", 1: "answered"}
    # Once nothing is unfinished, the next message's follow-up is accepted at once.
    later = Task.objects.get(pk=send(owner, task_id, "and the docs").json()["carrier"])
    assert later.state == "accepted"
    assert outbox(str(later.id), "start").get().payload["agent_session_id"] == agent_facts()["agent_session_id"]


@pytest.mark.django_db
def test_c2_resume_message_whose_turn_cannot_come_is_undelivered(owner, profiles, grant, grant_root):
    """G8: the conversation's task ended without an agent session id: its queued
    follow-up never starts, and the message it carries is ``undelivered``."""
    task_id = running(profiles, conversation_id(owner, profiles, grant_root / "repo", agent="gemini"))
    carrier = send(owner, task_id, "now the tests").json()["carrier"]
    receipt(profiles, task_id, "final", final_facts())
    assert Task.objects.get(pk=carrier).state == "not_started"
    assert states(owner, task_id) == {0: "answered", 1: "undelivered"}


def _same_key_race(owner, machine, folder, n):
    task_id = conversation_id(owner, machine, folder)
    key = f"race-{uuid.uuid4()}"

    def post(i):
        resp = send(owner, task_id, "only once", key=key)
        return resp.status_code, resp.content, resp.headers.get("Idempotent-Replayed")

    results = race(n, post)
    assert {status for status, _, _ in results} == {201}, results
    assert len({content for _, content, _ in results}) == 1
    assert sorted(replayed or "" for _, _, replayed in results) == [""] + ["true"] * (n - 1)
    assert list(ConversationMessage.objects.filter(task_id=task_id).values_list("seq", "text")) == [
        (0, "do it"), (1, "only once")]
    assert json.loads(results[0][1])["id"] == str(ConversationMessage.objects.get(task_id=task_id, seq=1).id)
    assert outbox(task_id, "message").count() == 1
    assert IdempotencyRecord.objects.filter(owner=owner, key=key).count() == 1
    assert Task.objects.get(pk=task_id).message_seq == 1


def _distinct_keys_race(owner, machine, folder, n):
    task_id = conversation_id(owner, machine, folder)
    results = race(n, lambda i: send(owner, task_id, f"text {i}", key=f"k-{i}-{uuid.uuid4()}"))
    assert [r.status_code for r in results] == [201] * n
    bodies = [r.json() for r in results]
    assert sorted(b["seq"] for b in bodies) == list(range(1, n + 1))
    assert len({b["id"] for b in bodies}) == n
    rows = list(ConversationMessage.objects.filter(task_id=task_id, seq__gte=1).values_list("seq", "text"))
    assert sorted(rows) == sorted((b["seq"], b["text"]) for b in bodies)
    assert sorted(m.payload["seq"] for m in outbox(task_id, "message")) == list(range(1, n + 1))
    assert Task.objects.get(pk=task_id).message_seq == n


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_c2_racing_duplicates_one_message_identical_answers(owner, profiles, grant, grant_root):
    _same_key_race(owner, profiles, grant_root / "repo", 8)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_c2_racing_distinct_keys_get_distinct_consecutive_seqs(owner, profiles, grant, grant_root):
    _distinct_keys_race(owner, profiles, grant_root / "repo", 2)
    _distinct_keys_race(owner, profiles, grant_root / "repo2", 8)


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_c2_racing_duplicates_on_sqlite(owner, profiles, grant, grant_root):
    _same_key_race(owner, profiles, grant_root / "repo", 4)


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_c2_racing_distinct_keys_on_sqlite(owner, profiles, grant, grant_root):
    _distinct_keys_race(owner, profiles, grant_root / "repo", 2)


# --- C3: a message's state only moves forward ---------------------------------------------------


@pytest.mark.django_db
def test_c3_receipts_move_a_message_sent_delivered_answered(owner, profiles, grant, grant_root, pinned):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message = send(owner, task_id, "go").json()
    assert (message["state"], message["version"], message["delivered_at"], message["answered_at"]) == ("sent", 1, None, None)
    pinned.shift(2)
    delivered_at = clock.now().isoformat()
    assert message_receipt(profiles, task_id, message["id"], "delivered").json() == {"outcome": "applied"}
    got = listed(owner, task_id)[1]
    assert (got["state"], got["version"], got["delivered_at"], got["answered_at"]) == ("delivered", 2, delivered_at, None)
    pinned.shift(3)
    assert message_receipt(profiles, task_id, message["id"], "answered").json() == {"outcome": "applied"}
    got = listed(owner, task_id)[1]
    assert (got["state"], got["version"], got["delivered_at"], got["answered_at"]) == (
        "answered", 3, delivered_at, clock.now().isoformat())
    assert Task.objects.get(pk=task_id).state == "running"  # C6: the turn ended, the task did not


@pytest.mark.django_db
def test_c3_answered_straight_from_sent_is_delivered_too(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message = send(owner, task_id, "go").json()
    assert message_receipt(profiles, task_id, message["id"], "answered").json() == {"outcome": "applied"}
    got = listed(owner, task_id)[1]
    assert (got["state"], got["delivered_at"], got["answered_at"]) == ("answered", clock.now().isoformat(),
                                                                       clock.now().isoformat())


@pytest.mark.django_db
@pytest.mark.parametrize("reached, late", [
    ("answered", "delivered"), ("answered", "answered"), ("answered", "undelivered"),
    ("delivered", "delivered"), ("delivered", "undelivered"), ("undelivered", "delivered"),
    ("undelivered", "answered"),
])
def test_c3_stale_or_backward_receipt_is_not_applied_and_changes_nothing(
        owner, profiles, grant, grant_root, pinned, reached, late):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message_id = send(owner, task_id, "go").json()["id"]
    if reached == "answered":
        message_receipt(profiles, task_id, message_id, "delivered")
    assert message_receipt(profiles, task_id, message_id, reached).json() == {"outcome": "applied"}
    before = message_row(message_id)
    pinned.shift(5)
    answer = message_receipt(profiles, task_id, message_id, late)
    assert answer.status_code == 200 and answer.json() == {"outcome": "not_applied", "reason": "stale"}
    assert message_row(message_id) == before
    assert before["state"] == reached


@pytest.mark.django_db
def test_c3_duplicate_receipt_gets_the_first_answer_byte_equal(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message_id = send(owner, task_id, "go").json()["id"]
    first = message_receipt(profiles, task_id, message_id, "delivered", event_id="ev-1")
    version = message_row(message_id)["version"]
    again = message_receipt(profiles, task_id, message_id, "delivered", event_id="ev-1")
    assert first.content == again.content == b'{"outcome":"applied"}'
    assert message_row(message_id)["version"] == version == 2


@pytest.mark.django_db
def test_c3_receipt_for_a_message_not_of_this_task_is_unknown_message(owner, profiles, grant, grant_root):
    a = live_running(owner, profiles, grant_root / "a")
    b = live_running(owner, profiles, grant_root / "b")
    of_b = send(owner, b, "for b").json()["id"]
    for message_id in (of_b, uuid.uuid4()):
        answer = message_receipt(profiles, a, message_id, "delivered")
        assert answer.json() == {"outcome": "not_applied", "reason": "unknown_message"}
    assert message_row(of_b)["state"] == "sent"


@pytest.mark.django_db
@pytest.mark.parametrize("facts", [
    {"message_id": "MID", "state": "read"},
    {"message_id": "MID", "state": "sent"},
    {"message_id": "not-a-uuid", "state": "delivered"},
    {"message_id": 5, "state": "delivered"},
    {"message_id": "MID"},
    {"message_id": "MID", "state": "delivered", "extra": 1},
])
def test_c3_malformed_message_receipt_is_400_and_changes_nothing(owner, profiles, grant, grant_root, facts):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message_id = send(owner, task_id, "go").json()["id"]
    facts = {k: (message_id if v == "MID" else v) for k, v in facts.items()}
    with NothingWritten():
        assert_error(receipt(profiles, task_id, "message", facts), 400, "invalid")
    assert message_row(message_id)["state"] == "sent"


@pytest.mark.django_db
def test_c3_live_task_that_ends_leaves_its_unwritten_messages_undelivered(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    prompt_id = listed(owner, task_id)[0]["id"]
    one, two, three = (send(owner, task_id, t).json()["id"] for t in ("one", "two", "three"))
    message_receipt(profiles, task_id, prompt_id, "answered")
    message_receipt(profiles, task_id, one, "answered")
    message_receipt(profiles, task_id, two, "delivered")
    assert receipt(profiles, task_id, "final", final_facts()).json() == {"outcome": "applied"}
    assert Task.objects.get(pk=task_id).state in FINAL_STATES
    assert states(owner, task_id) == {0: "answered", 1: "answered", 2: "delivered", 3: "undelivered"}
    # A late receipt cannot bring an undelivered message back; a turn that was written
    # can still be reported answered after the end.
    assert message_receipt(profiles, task_id, three, "delivered").json() == {"outcome": "not_applied", "reason": "stale"}
    assert message_receipt(profiles, task_id, two, "answered").json() == {"outcome": "applied"}
    assert states(owner, task_id) == {0: "answered", 1: "answered", 2: "answered", 3: "undelivered"}


@pytest.mark.django_db
def test_c3_live_conversation_cancelled_before_it_started_leaves_message_0_undelivered(
        owner, profiles, grant, grant_root):
    task_id = conversation_id(owner, profiles, grant_root / "repo")
    send(owner, task_id, "one")
    resp = owner_api(owner).post(f"/api/tasks/{task_id}/cancel/")
    assert resp.status_code == 200 and resp.json()["state"] == "cancelled"
    assert states(owner, task_id) == {0: "undelivered", 1: "undelivered"}


# --- C4: interrupt ---------------------------------------------------------------------------------


def interrupt(owner, task_id, body=None):
    return owner_api(owner).post(f"/api/tasks/{task_id}/interrupt/", body, format="json")


def end(owner, task_id, body=None):
    return owner_api(owner).post(f"/api/tasks/{task_id}/end/", body, format="json")


@pytest.mark.django_db
def test_c4_interrupt_of_a_live_conversation_is_202_with_an_interrupt_message(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    resp = interrupt(owner, task_id)
    assert resp.status_code == 202, resp.content
    assert (resp.json()["id"], resp.json()["state"], resp.json()["conversation"]) == (task_id, "running", "live")
    (message,) = outbox(task_id, "interrupt")
    assert set(message.payload) == {"operation_id", "interrupt_id"}
    assert message.payload["operation_id"] == operation_id(task_id)
    uuid.UUID(message.payload["interrupt_id"])
    assert message.machine_id == profiles.id
    # The session is kept: the task runs on and takes messages (C4).
    assert Task.objects.get(pk=task_id).state == "running"
    assert send(owner, task_id, "instead, do this").status_code == 201


@pytest.mark.django_db
def test_c4_interrupt_of_a_resume_conversation_is_409_interrupt_unsupported(owner, profiles, grant, grant_root):
    task_id = running(profiles, conversation_id(owner, profiles, grant_root / "repo", agent="gemini"))
    with NothingWritten():
        assert_error(interrupt(owner, task_id), 409, "interrupt_unsupported")


@pytest.mark.django_db
def test_c4_interrupt_of_a_plain_task_is_409_not_conversation(owner, profiles, grant, grant_root):
    task_id = running(profiles, submit(owner, profiles, grant_root / "repo", agent="claude").json()["id"])
    with NothingWritten():
        assert_error(interrupt(owner, task_id), 409, "not_conversation")
        assert_error(end(owner, task_id), 409, "not_conversation")
        assert_error(send(owner, task_id, "hi"), 409, "not_conversation")


@pytest.mark.django_db
def test_c4_interrupt_of_a_final_or_ended_conversation_is_refused(owner, profiles, grant, grant_root):
    final = live_running(owner, profiles, grant_root / "a")
    receipt(profiles, final, "final", final_facts())
    ended = live_running(owner, profiles, grant_root / "b")
    assert end(owner, ended).status_code == 200
    with NothingWritten():
        assert_error(interrupt(owner, final), 409, "already_final")
        assert_error(interrupt(owner, ended), 409, "conversation_ended")
        assert_error(interrupt(owner, ended, {"now": True}), 400, "invalid")


# --- C5: end ---------------------------------------------------------------------------------------


@pytest.mark.django_db
def test_c5_end_sets_ended_at_and_sends_end_with_the_last_seq(owner, profiles, grant, grant_root, pinned):
    task_id = live_running(owner, profiles, grant_root / "repo")
    send(owner, task_id, "one")
    send(owner, task_id, "two")
    pinned.shift(7)
    resp = end(owner, task_id)
    assert resp.status_code == 200, resp.content
    task = resp.json()
    assert (task["id"], task["state"], task["conversation_ended_at"], task["messages_sent"]) == (
        task_id, "running", clock.now().isoformat(), 2)
    assert Task.objects.get(pk=task_id).conversation_ended_at == clock.now()
    (message,) = outbox(task_id, "end")
    assert message.payload == {"operation_id": operation_id(task_id), "reason": "owner", "last_seq": 2}


@pytest.mark.django_db
def test_c5_end_without_messages_has_last_seq_0(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    assert end(owner, task_id).status_code == 200
    assert outbox(task_id, "end").get().payload["last_seq"] == 0


@pytest.mark.django_db
def test_c5_message_after_end_is_409_conversation_ended(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    send(owner, task_id, "one", key="before-end")
    assert end(owner, task_id).status_code == 200
    with NothingWritten():
        assert_error(send(owner, task_id, "one more"), 409, "conversation_ended")
    # A replay of a message accepted before the end is still its stored answer (A2).
    replay = send(owner, task_id, "one", key="before-end")
    assert replay.status_code == 201 and replay.headers["Idempotent-Replayed"] == "true"
    assert outbox(task_id, "message").count() == 1


@pytest.mark.django_db
def test_c5_end_twice_same_answer_one_end_message(owner, profiles, grant, grant_root, pinned):
    task_id = live_running(owner, profiles, grant_root / "repo")
    first = end(owner, task_id)
    pinned.shift(30)
    with NothingWritten():
        second = end(owner, task_id)
    assert first.status_code == second.status_code == 200
    assert second.json() == first.json()
    assert outbox(task_id, "end").count() == 1


@pytest.mark.django_db
def test_c5_end_of_a_resume_conversation_stops_its_messages(owner, profiles, grant, grant_root):
    task_id = running(profiles, conversation_id(owner, profiles, grant_root / "repo", agent="gemini"))
    resp = end(owner, task_id)
    assert resp.status_code == 200 and resp.json()["conversation_ended_at"] == clock.now().isoformat()
    assert not outbox(task_id, "end").exists()  # nothing stays open on the worker
    with NothingWritten():
        assert_error(send(owner, task_id, "more"), 409, "conversation_ended")
    assert Task.objects.count() == 1  # no follow-up


@pytest.mark.django_db
def test_c5_end_of_a_final_live_conversation_is_409_already_final(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    receipt(profiles, task_id, "final", final_facts())
    with NothingWritten():
        assert_error(end(owner, task_id), 409, "already_final")
        assert_error(end(owner, task_id, {"reason": "bye"}), 400, "invalid")


# --- C6: between turns the session is idle ---------------------------------------------------------


@pytest.mark.django_db
def test_c6_live_conversation_running_does_not_make_its_session_busy(owner, profiles, grant, grant_root):
    from sessions_app.services import busy_tasks_q, session_is_busy

    api = owner_api(owner)
    sid = str(uuid.uuid4())

    def status():
        return api.get(f"/api/sessions/{sid}/").json()["status"]

    task_id = conversation_id(owner, profiles, grant_root / "repo", session=sid)
    # Until its process runs the task counts as any other (S1).
    assert session_is_busy(session_id=uuid.UUID(sid), now=clock.now()) is True
    assert status() == "busy"
    assert grant_lease(profiles, task_id).status_code == 201
    assert (Task.objects.get(pk=task_id).state, status()) == ("starting", "busy")
    receipt(profiles, task_id, "running", RUNNING)
    assert Task.objects.get(pk=task_id).state == "running"
    assert session_is_busy(session_id=uuid.UUID(sid), now=clock.now()) is False
    assert status() == "idle"
    assert not Task.objects.filter(busy_tasks_q(), pk=task_id).exists()
    # A message is not a turn by itself: the turn's marker makes it busy (C6), not the task.
    send(owner, task_id, "next")
    assert status() == "idle"


@pytest.mark.django_db
@pytest.mark.parametrize("agent", ["claude", "gemini"])
def test_c6_a_conversation_accepted_without_session_gets_one_titled_by_its_prompt_replay_same(
        owner, profiles, grant, grant_root, agent):
    from sessions_app.models import Session

    api = owner_api(owner)
    resp = open_conversation(owner, profiles, grant_root / "repo", agent=agent, key="conv-s",
                             prompt="\n  Fix the   flaky login test\nthen tell me why it failed")
    assert resp.status_code == 201, resp.content
    task = resp.json()
    session = Session.objects.get(pk=task["session"])
    assert (session.owner_id, session.title) == (owner.pk, "Fix the flaky login test")
    assert Task.objects.get(pk=task["id"]).session_id == session.pk
    # S1: accepted, so busy at once; the board and the session's own read agree.
    assert api.get(f"/api/sessions/{session.pk}/").json()["status"] == "busy"
    assert [s["id"] for s in api.get("/api/board/").json()["sessions"]] == [str(session.pk)]
    # A1: a replay answers the same task and session, and makes no other.
    replay = open_conversation(owner, profiles, grant_root / "repo", agent=agent, key="conv-s",
                               prompt="\n  Fix the   flaky login test\nthen tell me why it failed")
    assert replay.status_code == 201 and replay.content == resp.content
    assert (Session.objects.count(), Task.objects.count()) == (1, 1)
    # Its start message names the session, so the worker marks each turn in it (M8).
    (start,) = outbox(task["id"], "start")
    assert start.payload["session_id"] == str(session.pk)


@pytest.mark.django_db
def test_c6_a_plain_task_without_session_gets_none_and_a_given_session_is_kept(owner, profiles, grant, grant_root):
    from sessions_app.models import Session

    assert submit(owner, profiles, grant_root / "repo", agent="claude", exclusive=False).json()["session"] is None
    assert Session.objects.count() == 0
    sid = str(uuid.uuid4())
    assert conversation_id(owner, profiles, grant_root / "repo", session=sid, prompt="hello") and \
        Session.objects.get().pk == uuid.UUID(sid)
    assert Session.objects.get().title == "hello"  # a new id given: titled like one made


@pytest.mark.django_db
def test_c6_a_conversation_refused_makes_no_session(owner, profiles, grant, grant_root):
    from sessions_app.models import Session

    with NothingWritten():
        assert_error(open_conversation(owner, profiles, grant_root / "repo", agent="aider"), 400,
                     "conversation_unsupported")
    assert Session.objects.count() == 0


@pytest.mark.parametrize("prompt, title", [
    ("short", "short"),
    ("   ", ""),
    ("word " * 30, "word word word word word word word word word word word word…"),
    ("x" * 80, "x" * 59 + "…"),
    ("Refactor the payment module, then add tests for every edge case we know of",
     "Refactor the payment module, then add tests for every edge…"),
    ("first line\nsecond line", "first line"),
])
def test_c6_session_title_is_the_first_line_cut_at_a_word(prompt, title):
    from tasks_app.services.acceptance import SESSION_TITLE_MAX_CHARS, session_title

    assert session_title(prompt) == title
    assert len(session_title(prompt)) <= SESSION_TITLE_MAX_CHARS


@pytest.mark.django_db
def test_c6_the_task_says_whether_a_live_conversations_turn_is_open_or_waiting_for_its_owner(
        owner, profiles, grant, grant_root, board_events, django_capture_on_commit_callbacks):  # noqa: F811
    api = owner_api(owner)

    def turn():
        return api.get(f"/api/tasks/{task_id}/").json()["turn"]

    task_id = conversation_id(owner, profiles, grant_root / "repo")
    assert turn() == "open"  # message 0 waits for the agent
    running(profiles, task_id)
    first = ConversationMessage.objects.get(task_id=task_id, seq=0)
    message_receipt(profiles, task_id, first.pk, "delivered")
    assert turn() == "open"
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        assert message_receipt(profiles, task_id, first.pk, "answered").json() == {"outcome": "applied"}
    assert turn() == "waiting"
    # The board hears it with the task, no extra read (B2).
    assert [e["task"]["turn"] for e in board_events.of(owner) if e["type"] == "task"] == ["waiting"]
    assert [t["turn"] for t in api.get("/api/board/").json()["tasks"] if t["id"] == task_id] == ["waiting"]
    second = send(owner, task_id, "next").json()
    assert turn() == "open"  # sent: the agent gets it next
    message_receipt(profiles, task_id, second["id"], "answered")
    assert turn() == "waiting"
    assert api.post(f"/api/tasks/{task_id}/end/").status_code in (200, 202)
    assert turn() is None  # ended, nothing open: the agent is finishing
    receipt(profiles, task_id, "final", final_facts())
    assert turn() is None


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["plain", "resume"])
def test_c6_turn_is_null_for_a_plain_task_and_a_resume_conversation(owner, profiles, grant, grant_root, kind):
    if kind == "plain":
        task_id = submit(owner, profiles, grant_root / "repo", agent="claude", exclusive=False).json()["id"]
    else:
        task_id = conversation_id(owner, profiles, grant_root / "repo", agent="gemini")
    running(profiles, task_id)
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["turn"] is None


@pytest.mark.django_db
@pytest.mark.parametrize("kind", ["plain", "resume"])
def test_c6_other_running_tasks_keep_their_session_busy(owner, profiles, grant, grant_root, kind):
    """The control: a running plain task, and a resume conversation's running turn (its
    process is the turn), keep the session busy."""
    from sessions_app.services import busy_tasks_q, session_is_busy

    sid = str(uuid.uuid4())
    if kind == "plain":
        task_id = submit(owner, profiles, grant_root / "repo", agent="claude", session=sid).json()["id"]
    else:
        task_id = conversation_id(owner, profiles, grant_root / "repo", agent="gemini", session=sid)
    running(profiles, task_id)
    assert session_is_busy(session_id=uuid.UUID(sid), now=clock.now()) is True
    assert Task.objects.filter(busy_tasks_q(), pk=task_id).exists()
    assert owner_api(owner).get(f"/api/sessions/{sid}/").json()["status"] == "busy"


# --- C7: bad input changes nothing -----------------------------------------------------------------


@pytest.mark.django_db
def test_c7_message_to_a_final_task_is_409_already_final(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    receipt(profiles, task_id, "final", final_facts())
    with NothingWritten():
        assert_error(send(owner, task_id, "too late"), 409, "already_final")
    assert len(listed(owner, task_id)) == 1


@pytest.mark.django_db
def test_c7_message_to_a_resume_conversation_whose_task_was_cancelled_is_409(owner, profiles, grant, grant_root):
    task_id = conversation_id(owner, profiles, grant_root / "repo", agent="gemini")
    assert owner_api(owner).post(f"/api/tasks/{task_id}/cancel/").json()["state"] == "cancelled"
    with NothingWritten():
        assert_error(send(owner, task_id, "too late"), 409, "already_final")


@pytest.mark.django_db
def test_c7_message_to_a_cancel_requested_task_is_409_cancel_requested(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    assert owner_api(owner).post(f"/api/tasks/{task_id}/cancel/").json()["cancel_requested_at"] is not None
    with NothingWritten():
        assert_error(send(owner, task_id, "wait"), 409, "cancel_requested")
        assert_error(interrupt(owner, task_id), 409, "cancel_requested")


@pytest.mark.django_db
def test_c7_message_to_an_unknown_task_is_409_task_unknown(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    assert receipt(profiles, task_id, "unknown", {"reason": "lost it"}).json() == {"outcome": "applied"}
    with NothingWritten():
        assert_error(send(owner, task_id, "hello?"), 409, "task_unknown")


@pytest.mark.django_db
def test_c7_another_owners_task_is_404_not_found(owner, other_owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    mallory = owner_api(other_owner)
    with NothingWritten():
        assert_error(send(other_owner, task_id, "mine now"), 404, "not_found")
        assert_error(send(other_owner, uuid.uuid4(), "nobody's"), 404, "not_found")
        assert_error(mallory.get(f"/api/tasks/{task_id}/messages/"), 404, "not_found")
        assert_error(mallory.post(f"/api/tasks/{task_id}/interrupt/"), 404, "not_found")
        assert_error(mallory.post(f"/api/tasks/{task_id}/end/"), 404, "not_found")
    # The key mallory used is hers: alice's own message with the same key is new.
    assert send(owner, task_id, "mine", key="shared").status_code == 201
    assert_error(send(other_owner, task_id, "mine", key="shared"), 404, "not_found")


@pytest.mark.django_db
@pytest.mark.parametrize("text, problem", [
    ("", "must not be empty"), ("   ", "must not be empty"), (" \n\t\r ", "must not be empty"),
    ("\u3000", "must not be empty"), ("bad\x00byte", "Null characters are not allowed."),
    ("\x00", "Null characters are not allowed."),
])
def test_c7_empty_whitespace_or_nul_text_is_400_and_changes_nothing(owner, profiles, grant, grant_root, text, problem):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        body = assert_error(send(owner, task_id, text), 400, "invalid")
    assert body["fields"] == {"text": [problem]}


# C7 with T2's rule: what a message may not carry (core/text.py).
CONTROL_TEXTS = [
    ("ESC", "red \x1b[31mALERT\x1b[0m", "U+001B"), ("BEL", "ding\x07", "U+0007"), ("CR", "over\rwrite", "U+000D"),
    ("RLO", "reversed \u202etxet\u202c", "U+202E"), ("DEL", "del\x7f", "U+007F"), ("C1 CSI", "c1 \x9b2J", "U+009B"),
    ("VT", "v\x0btab", "U+000B"), ("LRI", "iso \u2066x\u2069", "U+2066"), ("RLM", "rlm\u200f", "U+200F"),
    ("ALM", "alm\u061c", "U+061C"), ("FS", "fs\x1c", "U+001C"),
]


@pytest.mark.django_db
@pytest.mark.parametrize("name, text, found", CONTROL_TEXTS, ids=[c[0] for c in CONTROL_TEXTS])
def test_c7_control_characters_in_a_message_are_400_invalid_nothing_stored(owner, profiles, grant, grant_root,
                                                                           name, text, found):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        body = assert_error(send(owner, task_id, text), 400, "invalid")
    assert body["fields"] == {"text": [f"must not contain control characters (found {found})"]}
    assert len(listed(owner, task_id)) == 1


@pytest.mark.django_db
def test_c7_newline_tab_and_plain_unicode_are_kept(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    text = "line one\n\tindented – «ünïcode» 🙂 עברית \u200d joiner"
    resp = send(owner, task_id, text)
    assert resp.status_code == 201, resp.content
    assert listed(owner, task_id)[-1]["text"] == text


@pytest.mark.django_db
@pytest.mark.parametrize("name, text, found", CONTROL_TEXTS[:4], ids=[c[0] for c in CONTROL_TEXTS[:4]])
def test_c7_a_conversations_prompt_is_message_0_under_the_same_rule(owner, profiles, grant, grant_root,
                                                                   name, text, found):
    with NothingWritten():
        body = assert_error(open_conversation(owner, profiles, grant_root / "repo", prompt=text), 400, "invalid")
    assert body["fields"] == {"prompt": [f"a conversation's prompt must not contain control characters (found {found})"]}
    # A plain task's prompt is the agent's business (and --follow strips what it prints).
    assert submit(owner, profiles, grant_root / "repo", agent="claude", prompt=text, exclusive=False).status_code == 201


def test_c7_one_rule_in_core_text_shared_with_the_terminal_client():
    from core import text
    from tasks_app import follow

    assert follow.CONTROL is text.CONTROL
    assert text.control_character("fine\n\ttext") is None
    assert [text.control_character(t) for _, t, _ in CONTROL_TEXTS] == [f for _, _, f in CONTROL_TEXTS]


@pytest.mark.django_db
def test_c7_oversized_message_refused_changes_nothing(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    limit = settings.RUNSTEAD_MESSAGE_MAX_BYTES
    assert limit == 32768  # the default
    with NothingWritten():
        body = assert_error(send(owner, task_id, "x" * (limit + 1)), 400, "invalid")
    assert body["fields"]["text"] == [f"must be at most {limit} bytes"]
    assert send(owner, task_id, "x" * limit).status_code == 201


@pytest.mark.django_db
@override_settings(RUNSTEAD_MESSAGE_MAX_BYTES=12)
def test_c7_message_size_counts_utf8_bytes_not_characters(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        for text in ("x" * 13, "é" * 7, "€" * 5, "🙂" * 4):  # 13, 14, 15, 16 bytes; 13, 7, 5, 4 characters
            body = assert_error(send(owner, task_id, text), 400, "invalid")
            assert body["fields"]["text"] == ["must be at most 12 bytes"], text
    for text in ("x" * 12, "é" * 6, "€" * 4, "🙂" * 3):  # exactly 12 bytes each
        resp = send(owner, task_id, text)
        assert resp.status_code == 201 and resp.json()["text"] == text
    assert [m["text"] for m in listed(owner, task_id)][1:] == ["x" * 12, "é" * 6, "€" * 4, "🙂" * 3]


@pytest.mark.django_db
@pytest.mark.parametrize("headers, code", [
    ({}, "idempotency_key_missing"),
    ({"HTTP_IDEMPOTENCY_KEY": ""}, "idempotency_key_missing"),
    ({"HTTP_IDEMPOTENCY_KEY": "k" * 256}, "idempotency_key_invalid"),
    ({"HTTP_IDEMPOTENCY_KEY": "clé"}, "idempotency_key_invalid"),
    ({"HTTP_IDEMPOTENCY_KEY": "a\x01b"}, "idempotency_key_invalid"),
    ({"HTTP_IDEMPOTENCY_KEY": '""'}, "idempotency_key_invalid"),
    ({"HTTP_IDEMPOTENCY_KEY": 'a"b'}, "idempotency_key_invalid"),
])
def test_c7_missing_or_malformed_idempotency_key_is_400(owner, profiles, grant, grant_root, headers, code):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        assert_error(post_raw(owner, task_id, json.dumps({"text": "hi"}), key=None, **headers), 400, code)


@pytest.mark.django_db
def test_c7_longest_key_is_accepted(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    assert send(owner, task_id, "hi", key="k" * 255).status_code == 201


@pytest.mark.django_db
@pytest.mark.parametrize("content, code, field", [
    ("not json{", "malformed_json", None),
    ('{"text": "hi"', "malformed_json", None),
    ('["hi"]', "invalid", "non_field_errors"),
    ('"hi"', "invalid", "non_field_errors"),
    ("{}", "invalid", "text"),
    ('{"text": null}', "invalid", "text"),
    ('{"text": 5}', "invalid", "text"),
    ('{"text": ["hi"]}', "invalid", "text"),
    ('{"text": "hi", "colour": "red"}', "invalid", "colour"),
])
def test_c7_non_json_or_wrong_body_is_400(owner, profiles, grant, grant_root, content, code, field):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        body = assert_error(post_raw(owner, task_id, content), 400, code)
    if field:
        assert field in body["fields"], body


@pytest.mark.django_db
def test_c7_a_body_that_is_not_json_at_all_is_refused(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        resp = post_raw(owner, task_id, "text=hi", content_type="text/plain")
        assert resp.status_code == 415 and resp.json()["error"] == "unsupported_media_type"


@pytest.mark.django_db
def test_c7_query_parameters_are_refused(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        assert_error(owner_api(owner).get(f"/api/tasks/{task_id}/messages/?limit=5"), 400, "invalid")
        resp = owner_api(owner).post(f"/api/tasks/{task_id}/messages/?x=1", {"text": "hi"}, format="json",
                                     HTTP_IDEMPOTENCY_KEY="q")
        assert_error(resp, 400, "invalid")


# --- C10: withdraw against delivery ------------------------------------------------------------


def withdraw(owner, task_id, seq):
    return owner_api(owner).post(f"/api/tasks/{task_id}/messages/{seq}/withdraw/")


def claim(machine, task_id, message_id, **kw):
    """The worker's claim before it writes the message (C10); the R3 answer."""
    resp = message_receipt(machine, task_id, message_id, "claimed", **kw)
    assert resp.status_code == 200, resp.content
    return resp.json()


@pytest.mark.django_db
def test_c10_withdraw_a_sent_message_then_the_claim_is_refused_withdrawn(
        owner, profiles, grant, grant_root, board_events, django_capture_on_commit_callbacks):  # noqa: F811
    task_id = live_running(owner, profiles, grant_root / "repo")
    prompt = ConversationMessage.objects.get(task_id=task_id, seq=0)
    assert message_receipt(profiles, task_id, prompt.id, "answered").json() == {"outcome": "applied"}
    message = send(owner, task_id, "go").json()
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["turn"] == "open"
    board_events.clear()
    with django_capture_on_commit_callbacks(execute=True):
        got = withdraw(owner, task_id, 1)
    assert got.status_code == 200, got.content
    assert (got.json()["state"], got.json()["version"]) == ("withdrawn", 2)
    # The board hears both: the message withdrawn, its task waiting for its owner again (C6).
    events = board_events.of(owner)
    assert [e["message"]["state"] for e in events if e["type"] == "message"] == ["withdrawn"]
    assert [e["task"]["turn"] for e in events if e["type"] == "task"] == ["waiting"]
    assert withdraw(owner, task_id, 1).json() == got.json()  # again: the same answer, nothing changes
    assert claim(profiles, task_id, message["id"]) == {"outcome": "not_applied", "reason": "withdrawn"}
    answer = message_receipt(profiles, task_id, message["id"], "delivered").json()
    assert answer == {"outcome": "not_applied", "reason": "stale"}
    assert states(owner, task_id) == {0: "answered", 1: "withdrawn"}
    assert message_row(message["id"])["claimed_at"] is None


@pytest.mark.django_db
@pytest.mark.parametrize("reached", ["claimed", "delivered", "answered"])
def test_c10_withdraw_after_delivery_won_is_409_already_delivered_and_changes_nothing(
        owner, profiles, grant, grant_root, reached):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message_id = send(owner, task_id, "go").json()["id"]
    assert claim(profiles, task_id, message_id, event_id="claim-1") == {"outcome": "applied"}
    if reached != "claimed":
        message_receipt(profiles, task_id, message_id, "delivered")
    if reached == "answered":
        message_receipt(profiles, task_id, message_id, "answered")
    before = message_row(message_id)
    assert_error(withdraw(owner, task_id, 1), 409, "already_delivered")
    assert message_row(message_id) == before
    # The worker's retried claim (after a crash) gets the first answer; a new one: stale, write it.
    assert claim(profiles, task_id, message_id, event_id="claim-1") == {"outcome": "applied"}
    assert claim(profiles, task_id, message_id) == {"outcome": "not_applied", "reason": "stale"}


@pytest.mark.django_db
def test_c10_withdraw_refusals(owner, profiles, grant, grant_root, make_owner):
    task_id = live_running(owner, profiles, grant_root / "repo")
    send(owner, task_id, "go")
    assert_error(withdraw(owner, task_id, 0), 409, "prompt_not_withdrawable")
    assert_error(withdraw(owner, task_id, 2), 404, "not_found")
    assert_error(withdraw(make_owner(), task_id, 1), 404, "not_found")
    resume_id = running(profiles, conversation_id(owner, profiles, grant_root / "repo2", agent="gemini"))
    send(owner, resume_id, "later")
    assert_error(withdraw(owner, resume_id, 1), 409, "withdraw_unsupported")
    receipt(profiles, task_id, "final", final_facts())
    assert states(owner, task_id)[1] == "undelivered"
    assert_error(withdraw(owner, task_id, 1), 409, "already_final")


def _withdraw_claim_race(owner, machine, folder, rounds):
    task_id = live_running(owner, machine, folder)
    winners = []
    for n in range(1, rounds + 1):
        message_id = send(owner, task_id, f"text {n}").json()["id"]

        def racer(i):
            if i == 0:
                resp = withdraw(owner, task_id, n)
                return resp.status_code, resp.json()
            return claim(machine, task_id, message_id)

        (status, withdrawn), claimed = race(2, racer)
        row = message_row(message_id)
        if status == 200:  # withdraw won: the worker is told so and never writes it
            assert withdrawn["state"] == "withdrawn"
            assert claimed == {"outcome": "not_applied", "reason": "withdrawn"}
            assert (row["state"], row["claimed_at"]) == ("withdrawn", None)
        else:  # delivery won: the owner is told so, the worker writes it
            assert (status, withdrawn["error"]) == (409, "already_delivered")
            assert claimed == {"outcome": "applied"}
            assert row["state"] == "sent" and row["claimed_at"] is not None
        winners.append(status)
    return winners


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_c10_withdraw_race_against_the_workers_claim_exactly_one_wins_both_told(owner, profiles, grant, grant_root):
    _withdraw_claim_race(owner, profiles, grant_root / "repo", 12)


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_c10_withdraw_race_on_sqlite(owner, profiles, grant, grant_root):
    _withdraw_claim_race(owner, profiles, grant_root / "repo", 4)


# --- C9: steer or queue -----------------------------------------------------------------------


def steer(owner, task_id, text="now please", *, key=None):
    return send(owner, task_id, body={"text": text, "delivery": "steer"}, key=key)


@pytest.mark.django_db
def test_c9_a_steer_is_stored_as_steer_and_goes_to_the_worker_as_one(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    queued = send(owner, task_id, "next please")
    steered = steer(owner, task_id)
    assert (queued.status_code, steered.status_code) == (201, 201), (queued.content, steered.content)
    assert (queued.json()["delivery"], steered.json()["delivery"]) == ("queue", "steer")
    assert steered.json()["state"] == "sent" and steered.json()["turn_seq"] is None
    assert steered.json()["consumed_at"] is None
    payloads = sorted((m.payload for m in outbox(task_id, "message")), key=lambda p: p["seq"])
    # A queued message's payload is as before C9 (an older worker reads it unchanged).
    assert [p.get("delivery") for p in payloads] == [None, "steer"]
    assert "delivery" not in payloads[0]
    assert [(m["seq"], m["delivery"]) for m in listed(owner, task_id)] == [(0, "queue"), (1, "queue"), (2, "steer")]
    explicit = send(owner, task_id, body={"text": "queued on purpose", "delivery": "queue"})
    assert explicit.status_code == 201 and explicit.json()["delivery"] == "queue"


@pytest.mark.django_db
@pytest.mark.parametrize("delivery", ["now", "STEER", "", None, 1, ["steer"], {"steer": True}])
def test_c9_unknown_delivery_is_400_invalid_and_changes_nothing(owner, profiles, grant, grant_root, delivery):
    task_id = live_running(owner, profiles, grant_root / "repo")
    with NothingWritten():
        body = assert_error(send(owner, task_id, body={"text": "hi", "delivery": delivery}), 400, "invalid")
    assert list(body["fields"]) == ["delivery"], body


@pytest.mark.django_db
def test_c9_steer_where_the_cli_cannot_steer_is_409_steer_unsupported_nothing_stored(
        owner, profiles, grant, grant_root):
    # Live profiles of the presets that cannot steer (what decides is the preset, even if a
    # machine reports them live) and a resume conversation (each message its own follow-up
    # process: nothing runs to steer).
    others = [{"name": f"{preset}-live", "preset": preset, "conversation": "live"}
              for preset in ("gemini", "aider", "opencode")]
    resp = machine_api(profiles).put("/api/worker/profiles/", {"profiles": PROFILES + others}, format="json")
    assert resp.status_code == 200, resp.content
    tasks = [live_running(owner, profiles, grant_root / p["name"], agent=p["name"]) for p in others]
    tasks.append(conversation_id(owner, profiles, grant_root / "resume", agent="gemini"))
    for task_id in tasks:
        with NothingWritten():
            assert_error(steer(owner, task_id, key="steer-key"), 409, "steer_unsupported")
        # Nothing stored, the key neither (A5): the same key queues the message.
        assert send(owner, task_id, "queued instead", key="steer-key").status_code == 201


@pytest.mark.django_db
def test_c9_steer_to_a_live_codex_conversation_is_accepted(owner, profiles, grant, grant_root):
    # C11: Codex's app-server steers (turn/steer, docs/codex-app-server.md).
    resp = machine_api(profiles).put("/api/worker/profiles/", {"profiles": PROFILES + [
        {"name": "codex-live", "preset": "codex", "conversation": "live"}]}, format="json")
    assert resp.status_code == 200, resp.content
    task_id = live_running(owner, profiles, grant_root / "codex", agent="codex-live")
    resp = steer(owner, task_id, "now please")
    assert resp.status_code == 201, resp.content
    assert resp.json()["delivery"] == "steer" and resp.json()["state"] == "sent"
    payloads = sorted((m.payload for m in outbox(task_id, "message")), key=lambda p: p["seq"])
    assert payloads[-1]["delivery"] == "steer" and payloads[-1]["text"] == "now please"


@pytest.mark.django_db
def test_c9_steer_replay_is_the_same_message_and_the_key_with_queue_is_reused(owner, profiles, grant, grant_root):
    task_id = live_running(owner, profiles, grant_root / "repo")
    first = steer(owner, task_id, key="k")
    again = steer(owner, task_id, key="k")
    assert again.status_code == 201 and again.json() == first.json()
    with NothingWritten():
        assert_error(send(owner, task_id, body={"text": "now please", "delivery": "queue"}, key="k"), 422,
                     "idempotency_key_reused")
    assert outbox(task_id, "message").count() == 1


@pytest.mark.django_db
def test_c9_consumed_records_where_it_landed_and_one_answered_message_per_turn(owner, profiles, grant, grant_root):
    """A steer that opened a turn: delivered -> consumed (its own seq) -> answered; one
    that joined the running turn: consumed with that turn's seq, and there it stays."""
    task_id = live_running(owner, profiles, grant_root / "repo")
    prompt = ConversationMessage.objects.get(task_id=task_id, seq=0)
    assert message_receipt(profiles, task_id, prompt.id, "delivered").json() == {"outcome": "applied"}
    joined, own = steer(owner, task_id, "join").json(), steer(owner, task_id, "own").json()
    for message in (joined, own):
        assert claim(profiles, task_id, message["id"]) == {"outcome": "applied"}
        assert message_receipt(profiles, task_id, message["id"], "delivered").json() == {"outcome": "applied"}
    consumed = receipt(profiles, task_id, "message", {"message_id": joined["id"], "state": "consumed", "turn_seq": 0})
    assert consumed.json() == {"outcome": "applied"}
    assert message_receipt(profiles, task_id, prompt.id, "answered").json() == {"outcome": "applied"}
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["turn"] == "open"  # "own" is still to come
    assert receipt(profiles, task_id, "message", {"message_id": own["id"], "state": "consumed",
                                                  "turn_seq": 2}).json() == {"outcome": "applied"}
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["turn"] == "open"  # its own turn runs
    assert message_receipt(profiles, task_id, own["id"], "answered").json() == {"outcome": "applied"}
    got = {m["seq"]: m for m in listed(owner, task_id)}
    assert {seq: (m["state"], m["turn_seq"]) for seq, m in got.items()} == {
        0: ("answered", 0), 1: ("consumed", 0), 2: ("answered", 2)}
    assert got[1]["consumed_at"] and got[2]["consumed_at"] and got[0]["consumed_at"] is None
    # Two agent turns, two answered messages; the board's turn is over.
    assert owner_api(owner).get(f"/api/tasks/{task_id}/").json()["turn"] == "waiting"
    # Only forward: consumed again, or after answered, changes nothing.
    for message_id, turn_seq in ((joined["id"], 2), (own["id"], 2)):
        stale = receipt(profiles, task_id, "message", {"message_id": message_id, "state": "consumed",
                                                       "turn_seq": turn_seq})
        assert stale.json() == {"outcome": "not_applied", "reason": "stale"}
    assert message_row(joined["id"])["turn_seq"] == 0


@pytest.mark.django_db
@pytest.mark.parametrize("facts, problem", [
    ({"state": "consumed"}, "consumed message facts are message_id, state and turn_seq"),
    ({"state": "consumed", "turn_seq": -1}, "turn_seq must be a seq (an integer from 0)"),
    ({"state": "consumed", "turn_seq": "0"}, "turn_seq must be a seq (an integer from 0)"),
    ({"state": "consumed", "turn_seq": True}, "turn_seq must be a seq (an integer from 0)"),
    ({"state": "consumed", "turn_seq": 2 ** 31}, "turn_seq must be a seq (an integer from 0)"),
    ({"state": "delivered", "turn_seq": 0}, "message facts are message_id and state"),
    ({"state": "taken"}, "state must be claimed, delivered, consumed, answered or undelivered"),
])
def test_c9_bad_consumed_receipt_is_400_and_changes_nothing(owner, profiles, grant, grant_root, facts, problem):
    task_id = live_running(owner, profiles, grant_root / "repo")
    message_id = steer(owner, task_id).json()["id"]
    with NothingWritten():
        resp = receipt(profiles, task_id, "message", {"message_id": message_id, **facts})
        assert resp.status_code == 400, resp.content
    assert problem in json.dumps(resp.json()), resp.json()
