"""Messages to a session started in a terminal, through the API (SPEC T1, T2, T4, T5, T7,
with A1-A5, C7, C10, K2, K3): a session bound to its machine and channel, a message
numbered once per Idempotency-Key and in acceptance order, sent to the machine in the
same transaction, its state moved only forward, the Stop hook's claim won by exactly one
caller, refusals that store nothing. Races: real threads released by a barrier
(tests/barrier.py), on PostgreSQL (``postgres``) and on SQLite (BEGIN IMMEDIATE).
"""
import uuid

import pytest

from sessions_app.models import Session, SessionMessage
from tasks_app.models import IdempotencyRecord, OutboxMessage
from tests.barrier import race
from tests.conftest import machine_api, owner_api
from tests.factories import table_digest


def bind(owner, machine, channel="terminal", *, agent="claude", session_id=None) -> str:
    """A session reported by the wrapper or the hooks on ``machine`` (T1)."""
    session_id = session_id or str(uuid.uuid4())
    body = {"id": session_id, "title": "repo", "agent": agent, "cwd": "/home/me/repo", "machine": str(machine.id),
            "channel": channel}
    resp = owner_api(owner).post("/api/sessions/", body, format="json")
    assert resp.status_code in (200, 201), resp.content
    return session_id


def send(owner, session_id, text, *, key=None):
    return owner_api(owner).post(f"/api/sessions/{session_id}/messages/", {"text": text}, format="json",
                                 HTTP_IDEMPOTENCY_KEY=key or str(uuid.uuid4()))


def delivery(client, session_id, seq, state, claim=None):
    body = {"state": state, **({"claim": claim} if claim else {})}
    return client.post(f"/api/sessions/{session_id}/messages/{seq}/delivery/", body, format="json")


def pulled(machine) -> list[dict]:
    return machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]


@pytest.fixture(autouse=True)
def _pinned_unless_threaded(request):
    marker = request.node.get_closest_marker("django_db")
    if marker is None or not marker.kwargs.get("transaction"):
        request.getfixturevalue("pinned")


# --- T1: machine and channel ---------------------------------------------------------------


@pytest.mark.django_db
def test_t1_session_carries_machine_channel_and_the_words_of_its_reach(owner, machine):
    api = owner_api(owner)
    plain = api.post("/api/sessions/", {"title": "web"}, format="json").json()
    assert (plain["machine"], plain["channel"]) == (None, "none")
    assert plain["reach"].startswith("cannot reach this session: start it with `runstead-term")
    session_id = bind(owner, machine, "hook")
    got = api.get(f"/api/sessions/{session_id}/").json()
    assert (got["machine"], got["channel"], got["reach"]) == (str(machine.id), "hook", "when this turn ends")
    # the same session started again under the wrapper re-binds it (version rises)
    bind(owner, machine, "terminal", session_id=session_id)
    again = api.get(f"/api/sessions/{session_id}/").json()
    assert (again["channel"], again["reach"]) == ("terminal", "now, at the prompt")
    assert again["version"] == got["version"] + 1


@pytest.mark.django_db
def test_t1_another_owners_machine_is_refused_and_nothing_is_written(owner, other_owner, make_machine):
    theirs = make_machine(other_owner, name="theirs")
    before = table_digest()
    resp = owner_api(owner).post("/api/sessions/", {"id": str(uuid.uuid4()), "machine": str(theirs.id),
                                                    "channel": "terminal"}, format="json")
    assert (resp.status_code, resp.json()["error"]) == (403, "machine_forbidden")
    assert table_digest() == before


# --- T2: messages ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_t2_message_numbered_in_order_and_sent_to_its_machine_in_one_transaction(owner, machine):
    session_id = bind(owner, machine)
    first, second = send(owner, session_id, "run the tests"), send(owner, session_id, "then\tcommit\nplease")
    assert (first.status_code, second.status_code) == (201, 201)
    assert [first.json()["seq"], second.json()["seq"]] == [1, 2]
    assert (first.json()["state"], first.json()["channel"]) == ("sent", "terminal")
    # One pinned clock: both rows have the same created_at, so the pull's order between them
    # is the uuid's; the worker's inbox orders a session's messages by seq (machine/inbox.py).
    messages = sorted(pulled(machine), key=lambda m: m["payload"]["seq"])
    assert [(m["kind"], m["operation_id"], m["payload"]["seq"], m["payload"]["text"]) for m in messages] == [
        ("session_message", None, 1, "run the tests"), ("session_message", None, 2, "then\tcommit\nplease")]
    assert messages[0]["payload"] == {"session_id": session_id, "message_id": first.json()["id"], "seq": 1,
                                      "text": "run the tests", "channel": "terminal"}
    listed = owner_api(owner).get(f"/api/sessions/{session_id}/messages/").json()["results"]
    assert [(m["seq"], m["state"]) for m in listed] == [(1, "sent"), (2, "sent")]


@pytest.mark.django_db
def test_t2_same_key_replays_byte_equal_and_another_body_is_422(owner, machine):
    session_id = bind(owner, machine)
    one = send(owner, session_id, "once", key="k1")
    two = send(owner, session_id, "once", key="k1")
    assert two.content == one.content and two["Idempotent-Replayed"] == "true"
    assert send(owner, session_id, "other", key="k1").status_code == 422
    assert SessionMessage.objects.count() == 1 and OutboxMessage.objects.filter(kind="session_message").count() == 1
    # scope: the same key on another session is another message
    other = bind(owner, machine)
    assert send(owner, other, "once", key="k1").status_code == 201
    assert IdempotencyRecord.objects.filter(scope=f"session-message:{session_id}").count() == 1


@pytest.mark.django_db
@pytest.mark.parametrize("text", ["\x1b[201~rm -rf ~\n", "stop\x03", "\x1b[2J", "nul\x00", "del\x7f", "c1\x9b31m",
                                  "   \n\t ", "x" * 32769])
def test_t2_control_characters_empty_and_oversize_text_is_400_invalid_and_nothing_stored(owner, machine, text):
    session_id = bind(owner, machine)
    before = table_digest()
    resp = send(owner, session_id, text)
    assert (resp.status_code, resp.json()["error"]) == (400, "invalid"), resp.content
    assert table_digest() == before


@pytest.mark.django_db
@pytest.mark.parametrize("channel", ["none", "native"])
def test_t1_session_unreachable_is_409_and_nothing_stored(owner, machine, channel):
    session_id = bind(owner, machine, channel)
    unbound = owner_api(owner).post("/api/sessions/", {"title": "web"}, format="json").json()["id"]
    before = table_digest()
    for target in (session_id, unbound):
        resp = send(owner, target, "hello", key="same")
        assert (resp.status_code, resp.json()["error"]) == (409, "session_unreachable")
    assert table_digest() == before


@pytest.mark.django_db
def test_t7_another_owners_session_is_404_and_a_machine_cannot_send(owner, other_owner, machine):
    session_id = bind(owner, machine)
    before = table_digest()
    resp = send(other_owner, session_id, "mine now")
    assert (resp.status_code, resp.json()["error"]) == (404, "not_found")
    resp = machine_api(machine).post(f"/api/sessions/{session_id}/messages/", {"text": "x"}, format="json",
                                     HTTP_IDEMPOTENCY_KEY="m")
    assert resp.status_code == 403
    assert owner_api(other_owner).get(f"/api/sessions/{session_id}/messages/").status_code == 404
    assert table_digest() == before


@pytest.mark.django_db
def test_t2_states_only_move_forward_and_a_turn_end_answers_delivered_messages(owner, machine):
    session_id = bind(owner, machine)
    send(owner, session_id, "one")
    api = owner_api(owner)
    assert delivery(machine_api(machine), session_id, 1, "delivered").json()["state"] == "delivered"
    assert delivery(api, session_id, 1, "delivered").status_code == 200  # a retried report: same answer
    resp = delivery(api, session_id, 1, "undelivered")
    assert (resp.status_code, resp.json()["error"]) == (409, "message_not_sent")
    marker = {"turn_id": "t1", "device_id": "laptop:claude:x", "state": "running"}
    assert api.put(f"/api/sessions/{session_id}/marker/", marker, format="json").status_code == 200
    assert api.put(f"/api/sessions/{session_id}/marker/", {**marker, "state": "ended"}, format="json").json()[
        "outcome"] == "applied"
    (message,) = api.get(f"/api/sessions/{session_id}/messages/").json()["results"]
    assert (message["state"], message["version"]) == ("answered", 3)
    assert message["answered_at"] and message["delivered_at"]


@pytest.mark.django_db
def test_t7_a_sibling_machine_cannot_report_another_machines_session(owner, machine, make_machine):
    session_id = bind(owner, machine)
    send(owner, session_id, "one")
    sibling = make_machine(owner, name="desk")
    resp = delivery(machine_api(sibling), session_id, 1, "delivered")
    assert (resp.status_code, resp.json()["error"]) == (404, "not_found")
    assert SessionMessage.objects.get().state == "sent"


@pytest.mark.django_db
def test_t2_withdraw_against_delivery_one_wins(owner, machine):
    session_id = bind(owner, machine)
    send(owner, session_id, "one")
    send(owner, session_id, "two")
    api = owner_api(owner)
    assert api.post(f"/api/sessions/{session_id}/messages/1/withdraw/").json()["state"] == "withdrawn"
    resp = delivery(api, session_id, 1, "delivered")
    assert (resp.status_code, resp.json()["error"]) == (409, "message_not_sent")
    assert delivery(api, session_id, 2, "delivered").status_code == 200
    resp = api.post(f"/api/sessions/{session_id}/messages/2/withdraw/")
    assert (resp.status_code, resp.json()["error"]) == (409, "message_not_sent")


# --- T5: interrupt ----------------------------------------------------------------------------


@pytest.mark.django_db
def test_t5_interrupt_goes_to_the_wrapper_and_hook_sessions_cannot(owner, machine):
    session_id = bind(owner, machine)
    resp = owner_api(owner).post(f"/api/sessions/{session_id}/interrupt/")
    assert resp.status_code == 202 and resp.json()["id"] == session_id
    (message,) = pulled(machine)
    assert (message["kind"], message["payload"]["session_id"]) == ("session_interrupt", session_id)
    hooked = bind(owner, machine, "hook")
    before = table_digest()
    resp = owner_api(owner).post(f"/api/sessions/{hooked}/interrupt/")
    assert (resp.status_code, resp.json()["error"]) == (409, "interrupt_unsupported")
    assert table_digest() == before


# --- T4: the claim is a compare-and-set, one winner --------------------------------------------


def _claim_race(owner, machine, n):
    session_id = bind(owner, machine, "hook")
    assert send(owner, session_id, "only once").status_code == 201

    def claim(i):
        client = owner_api(owner) if i % 2 else machine_api(machine)
        return delivery(client, session_id, 1, "delivered", claim=f"stop-{i}")

    answers = race(n, claim)
    assert sorted(r.status_code for r in answers) == [200] + [409] * (n - 1)
    (winner,) = [i for i, r in enumerate(answers) if r.status_code == 200]
    assert answers[winner].json()["text"] == "only once"
    message = SessionMessage.objects.get(session_id=session_id)
    assert (message.state, message.version, message.delivered_by) == ("delivered", 2, f"stop-{winner}")
    # the winner's retry is answered again; another claimant's is not
    assert delivery(owner_api(owner), session_id, 1, "delivered", claim=f"stop-{winner}").status_code == 200
    assert delivery(owner_api(owner), session_id, 1, "delivered", claim="late").status_code == 409


@pytest.mark.django_db(transaction=True)
def test_t4_racing_claims_deliver_once_sqlite(owner, machine):
    _claim_race(owner, machine, 6)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_t4_racing_claims_deliver_once_postgres(owner, machine):
    _claim_race(owner, machine, 8)


def _same_key_race(owner, machine, n):
    session_id = bind(owner, machine)
    codes = race(n, lambda i: send(owner, session_id, "once", key="race").status_code)
    assert sorted(codes) == [201] * n
    assert SessionMessage.objects.filter(session_id=session_id).count() == 1
    assert Session.objects.get(pk=session_id).message_seq == 1
    assert OutboxMessage.objects.filter(kind="session_message").count() == 1


@pytest.mark.django_db(transaction=True)
def test_t2_identical_racing_sends_make_one_message_sqlite(owner, machine):
    _same_key_race(owner, machine, 6)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_t2_identical_racing_sends_make_one_message_postgres(owner, machine):
    _same_key_race(owner, machine, 8)


# --- T6: each turn's last assistant message --------------------------------------------------


def _replay(api, writes):
    for w in writes:
        resp = getattr(api, w["method"].lower())(w["path"], w["body"], format="json")
        assert resp.status_code in (200, 201), (w, resp.content)


@pytest.mark.django_db
def test_t6_the_stop_hooks_last_assistant_message_is_kept_on_the_messages_its_turn_answered(owner, machine):
    """Claude Code's recorded ``Stop`` (with ``last_assistant_message``) through the hook's
    own mapping: its ``ended`` marker carries the reply (cut, NUL dropped), and the
    service keeps it on the message that turn answered; a turn without one keeps none."""
    from machine.hooks.mapping import handle, identify
    from machine.protocol import TURN_REPLY_MAX_CHARS
    from tests.hooks_support import fixture

    api, session_id = owner_api(owner), str(uuid.uuid4())
    binding = {"machine": str(machine.id), "channel": "hook"}
    state: dict = {}

    def hook(name, **overrides):
        payload = fixture("claude", name, session_id=session_id, **overrides)
        return handle(identify("claude", payload), payload, state, hostname="laptop", now=1.0, binding=binding)

    _replay(api, hook("user_prompt_submit"))
    real_id = Session.objects.get().pk
    assert send(owner, real_id, "run the tests").status_code == 201
    assert delivery(api, real_id, 1, "delivered", claim="stop-1").status_code == 200
    reply = "All 12 tests pass.\x00" + "x" * (TURN_REPLY_MAX_CHARS + 50)
    stop = hook("stop", last_assistant_message=reply, stop_hook_active=False)
    assert [w["body"]["reply"] for w in stop if w["path"].endswith("/marker/")] == \
        [("All 12 tests pass." + "x" * TURN_REPLY_MAX_CHARS)[:TURN_REPLY_MAX_CHARS]]
    _replay(api, stop)
    got = api.get(f"/api/sessions/{real_id}/messages/").json()["results"]
    assert (got[0]["state"], got[0]["reply"][:18]) == ("answered", "All 12 tests pass.")
    # the next turn's Stop carries no message: nothing is sent, nothing kept
    _replay(api, hook("user_prompt_submit", prompt_id="turn-2"))
    assert send(owner, real_id, "and lint").status_code == 201
    assert delivery(api, real_id, 2, "delivered").status_code == 200
    stop = hook("stop", last_assistant_message=None, prompt_id="turn-2")
    assert all("reply" not in (w["body"] or {}) for w in stop)
    _replay(api, stop)
    assert [(m["state"], m["reply"]) for m in api.get(f"/api/sessions/{real_id}/messages/").json()["results"]][1] == \
        ("answered", "")


@pytest.mark.django_db
def test_t6_codex_last_assistant_message_from_its_stop_hook_or_notify_is_kept_on_the_answered_message(owner, machine):
    """Codex's recorded ``Stop`` (``last_assistant_message``) and ``notify``
    (``last-assistant-message``) both end the turn with its reply: whichever comes first
    carries it to the message that turn answered, the other changes nothing."""
    from machine.hooks.mapping import handle, identify
    from tests.hooks_support import fixture

    api, thread = owner_api(owner), str(uuid.uuid4())
    state: dict = {}

    def hook(name, **overrides):
        ids = {"thread-id": thread} if name.startswith("notify") else {"session_id": thread}
        payload = fixture("codex", name, **ids, **overrides)
        return handle(identify("codex", payload), payload, state, hostname="laptop", now=1.0,
                      binding={"machine": str(machine.id), "channel": "terminal"})

    for turn, (first, then) in enumerate([("notify_turn_complete", "stop"), ("stop", "notify_turn_complete")], 1):
        turn_id = f"turn-{turn}"
        _replay(api, hook("user_prompt_submit", turn_id=turn_id))
        real_id = Session.objects.get().pk
        assert send(owner, real_id, f"message {turn}").status_code == 201
        assert delivery(api, real_id, turn, "delivered").status_code == 200
        reply = {"last-assistant-message" if first.startswith("notify") else "last_assistant_message": f"reply {turn}"}
        _replay(api, hook(first, **{"turn-id" if first.startswith("notify") else "turn_id": turn_id}, **reply))
        assert hook(then, **{"turn-id" if then.startswith("notify") else "turn_id": turn_id}) == []
    got = api.get(f"/api/sessions/{real_id}/messages/").json()["results"]
    assert [(m["state"], m["reply"]) for m in got] == [("answered", "reply 1"), ("answered", "reply 2")]


@pytest.mark.django_db
def test_t5_the_wrappers_interrupted_event_ends_the_open_turn_on_the_service(owner, machine):
    """Claude Code fires no hook for an interrupted turn; the wrapper reports RunStead's
    own ``RunsteadInterrupted`` through the hook: the open turn ends (the session idle),
    and with no turn open it writes nothing."""
    from machine.hooks.mapping import INTERRUPTED, handle, identify
    from tests.hooks_support import fixture

    api, agent_session = owner_api(owner), str(uuid.uuid4())
    state: dict = {}

    def hook(payload):
        return handle(identify("claude", payload), payload, state, hostname="laptop", now=1.0,
                      binding={"machine": str(machine.id), "channel": "terminal"})

    _replay(api, hook(fixture("claude", "user_prompt_submit", session_id=agent_session)))
    assert Session.objects.get().status == "busy"
    _replay(api, hook({"hook_event_name": INTERRUPTED, "session_id": agent_session}))
    assert Session.objects.get().status == "idle" and "turn" not in state
    assert hook({"hook_event_name": INTERRUPTED, "session_id": agent_session}) == []
