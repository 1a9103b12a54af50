"""SPEC Q1-Q7 on the service: approvals are rows, created once per key, answered exactly
once, listed with the B11 cursor, shown on the board (B4, Q6), withdrawn with their task,
expired on time; and every refusal is a clear 4xx that changes nothing."""
import json
import uuid

import pytest
from asgiref.sync import sync_to_async
from django.test import Client

from board.sweep import sweep_once
from core import clock
from machine.hooks.mapping import session_uuid
from sessions_app.models import Approval, Session
from tasks_app.models import IdempotencyRecord, Task, TaskEvent
from machine.protocol import json_digest
from tests.conftest import board_of, machine_api, owner_api
from tests.factories import final_facts, grant_lease, receipt, submit
from tests.barrier import race

SESSION = str(session_uuid("claude", "8a7c1f3e-claude-session"))
BASH = {"command": "rm -rf build && make", "description": "Clean and build"}
SUGGESTIONS = [{"type": "addDirectories", "directories": ["/tmp"], "destination": "session"}]


def ask(owner, *, key=None, client=None, **fields):
    body = {"key": key or f"k-{uuid.uuid4()}", "session": SESSION, "agent": "claude", "tool_name": "Bash",
            "tool_input": BASH, "cwd": "/Users/alice/src/shop", "suggestions": SUGGESTIONS, **fields}
    body = {k: v for k, v in body.items() if v is not None}
    return (client or owner_api(owner)).post("/api/approvals/", body, format="json")


def decide(owner, approval_id, *, key=None, client=None, **body):
    return (client or owner_api(owner)).post(
        f"/api/approvals/{approval_id}/decision/", body or {"behavior": "allow"}, format="json",
        HTTP_IDEMPOTENCY_KEY=key or f"d-{uuid.uuid4()}")


def running_task(owner, machine, grant, **extra) -> str:
    task_id = submit(owner, machine, grant.path, **extra).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", {"pid": 4242, "pgid": 4242, "process_start_time": 1.0}).status_code == 200
    return task_id


# --- Q1: rows, once per key --------------------------------------------------------------


def test_q1_create_is_idempotent_on_the_hooks_key(owner, pinned):
    first = ask(owner, key="claude:s1:p1:abc:1")
    assert first.status_code == 201, first.content
    again = ask(owner, key="claude:s1:p1:abc:1")
    assert again.status_code == 200
    assert again.json() == first.json()
    assert Approval.objects.count() == 1
    body = first.json()
    assert body["state"] == "pending" and body["session"] == SESSION and body["task"] is None
    assert body["tool_input"] == BASH and body["tool_input_digest"] == json_digest(BASH)
    assert body["suggestions"] == SUGGESTIONS and body["decided_by"] == "" and body["decided_at"] is None
    # the session did not exist: it is created like the hook's SessionStart would (I3)
    session = Session.objects.get(pk=SESSION)
    assert (session.owner, session.title, session.agent, session.cwd) == (owner, "shop", "claude",
                                                                             "/Users/alice/src/shop")
    assert (session.attention, session.attention_message) == ("approval", "Bash waits for your approval")


def test_q1_a_known_key_naming_another_session_is_refused(owner, pinned):
    assert ask(owner, key="same").status_code == 201
    refused = ask(owner, key="same", session=str(uuid.uuid4()))
    assert refused.status_code == 422 and refused.json()["error"] == "approval_key_reused"
    assert Approval.objects.count() == 1


def test_q1_tool_input_kept_cut_to_4_kib_with_the_digest_over_the_whole(owner, pinned):
    big = {"file_path": "/tmp/x.py", "content": "print('hello')\n" * 2000}
    body = ask(owner, tool_name="Write", tool_input=big).json()
    assert body["tool_input_truncated"] is True
    assert len(json.dumps(body["tool_input"], ensure_ascii=False, separators=(",", ":")).encode()) <= 4096
    assert body["tool_input"]["file_path"] == "/tmp/x.py"
    assert body["tool_input"]["content"].startswith("print('hello')\n") and body["tool_input"]["content"].endswith("…")
    assert body["tool_input_digest"] == json_digest(big)


def test_q1_list_pending_newest_first_with_the_b11_cursor(owner, other_owner, pinned):
    ids = []
    for _ in range(5):
        ids.append(ask(owner).json()["id"])
        pinned.shift(1)
    ask(other_owner)
    decide(owner, ids[1], behavior="deny")  # no longer pending (and the next ask resolved the others, Q4)
    api = owner_api(owner)
    everything = api.get("/api/approvals/?limit=2").json()
    assert [a["id"] for a in everything["results"]] == ids[::-1][:2] and everything["next"]
    rest = api.get(everything["next"]).json()
    assert [a["id"] for a in rest["results"]] == ids[::-1][2:4]
    pending = api.get("/api/approvals/?state=pending").json()["results"]
    assert [a["id"] for a in pending] == [ids[4]]
    assert {a["state"] for a in api.get("/api/approvals/?state=answered_in_terminal").json()["results"]} == {
        "answered_in_terminal"}
    assert owner_api(owner).get("/api/approvals/?state=maybe").status_code == 400


# --- Q2: exactly one answer -------------------------------------------------------------


def test_q2_the_same_key_and_body_replay_byte_equal(owner, pinned):
    approval = ask(owner).json()
    first = decide(owner, approval["id"], key="tap-1", behavior="deny", message="use make clean instead")
    assert first.status_code == 200, first.content
    assert first.json()["state"] == "denied" and first.json()["message"] == "use make clean instead"
    assert first.json()["decided_by"] == "owner:alice"
    pinned.shift(30)
    replay = decide(owner, approval["id"], key="tap-1", behavior="deny", message="use make clean instead")
    assert (replay.status_code, replay.content) == (200, first.content)
    assert replay["Idempotent-Replayed"] == "true" and "Idempotent-Replayed" not in first
    reused = decide(owner, approval["id"], key="tap-1", behavior="allow")
    assert reused.status_code == 422 and reused.json()["error"] == "idempotency_key_reused"
    assert IdempotencyRecord.objects.filter(scope=f"approval:{approval['id']}").count() == 1


def test_q2_any_later_answer_is_409_already_decided_with_the_approval_as_decided(owner, pinned):
    approval = ask(owner).json()
    won = decide(owner, approval["id"], behavior="allow", scope="session").json()
    assert (won["state"], won["scope"]) == ("allowed", "session")
    late = decide(owner, approval["id"], behavior="deny")
    assert late.status_code == 409
    body = late.json()
    assert body["error"] == "already_decided" and body["detail"]
    assert body["approval"] == won
    assert Approval.objects.get().state == "allowed"
    # the session no longer needs its owner
    assert Session.objects.get(pk=SESSION).attention == ""


def test_q2_an_idempotency_key_of_a_task_is_not_a_decisions_key(owner, machine, grant, pinned):
    """The scope keeps operations apart: a key used to accept a task decides nothing."""
    assert submit(owner, machine, grant.path, key="shared-key").status_code == 201
    approval = ask(owner).json()
    answer = decide(owner, approval["id"], key="shared-key")
    assert answer.status_code == 200 and answer.json()["state"] == "allowed"


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_q2_sixteen_answers_one_winner(owner):
    """16 phones tap at once, allow and deny mixed, each with its own key: one 200, fifteen
    409 naming the same winner, one decision stored."""
    approval = ask(owner).json()
    clients = [owner_api(owner) for _ in range(16)]

    def tap(i):
        body = {"behavior": "allow"} if i % 2 else {"behavior": "deny", "message": f"no {i}"}
        response = decide(owner, approval["id"], key=f"phone-{i}", client=clients[i], **body)
        return response.status_code, response.json()

    results = race(16, tap)
    winners = [body for status, body in results if status == 200]
    losers = [body for status, body in results if status == 409]
    assert len(winners) == 1 and len(losers) == 15, [status for status, _ in results]
    winner = winners[0]
    assert all(body["error"] == "already_decided" and body["approval"] == winner for body in losers)
    row = Approval.objects.get(pk=approval["id"])
    assert row.state == winner["state"] and row.decided_by == "owner:alice" and row.version == 2
    assert IdempotencyRecord.objects.filter(scope=f"approval:{approval['id']}").count() == 1


# --- Q4: answered in the terminal -------------------------------------------------------


def test_q4_terminal_answer_resolves_once_and_repeats_are_harmless(owner, pinned):
    approval = ask(owner).json()
    api = owner_api(owner)
    answered = api.post(f"/api/approvals/{approval['id']}/terminal/", format="json")
    assert answered.status_code == 200
    assert (answered.json()["state"], answered.json()["decided_by"]) == ("answered_in_terminal", "terminal")
    assert Session.objects.get(pk=SESSION).attention == ""
    again = api.post(f"/api/approvals/{approval['id']}/terminal/", format="json")
    assert again.json() == answered.json()
    assert decide(owner, approval["id"]).status_code == 409


def test_q4_the_next_permission_request_answers_the_earlier_one_in_the_terminal(owner, pinned):
    first = ask(owner, tool_input={"command": "ls"}).json()
    second = ask(owner, tool_input={"command": "make"}).json()
    assert Approval.objects.get(pk=first["id"]).state == "answered_in_terminal"
    assert Approval.objects.get(pk=second["id"]).state == "pending"
    assert Session.objects.get(pk=SESSION).attention == "approval"


# --- expiry ------------------------------------------------------------------------------


def test_q1_a_pending_approval_expires_after_the_wait_by_read_or_by_sweep(owner, pinned, settings):
    settings.RUNSTEAD_APPROVAL_WAIT_S = 60
    read, swept = ask(owner, session=str(uuid.uuid4())).json(), ask(owner, session=str(uuid.uuid4())).json()
    pinned.shift(59)
    assert sweep_once(now=clock.now())["approvals_expired"] == 0
    pinned.shift(2)
    answer = owner_api(owner).get(f"/api/approvals/{read['id']}/").json()
    assert (answer["state"], answer["decided_by"]) == ("expired", "timeout")
    assert sweep_once(now=clock.now())["approvals_expired"] == 1
    assert Approval.objects.get(pk=swept["id"]).state == "expired"
    late = decide(owner, swept["id"])
    assert late.status_code == 409 and late.json()["approval"]["state"] == "expired"
    assert not Session.objects.filter(attention="approval").exists()


# --- Q5 (service side): a task's approvals ------------------------------------------------


def test_q5_a_task_approval_keeps_it_running_with_attention_counts_and_timeline(owner, machine, grant, pinned):
    task_id = running_task(owner, machine, grant)
    approval = ask(owner, session=None, task=task_id).json()
    assert (approval["task"], approval["machine"], approval["session"]) == (task_id, str(machine.id), None)
    api = owner_api(owner)
    task = api.get(f"/api/tasks/{task_id}/").json()
    assert (task["state"], task["attention"]) == ("running", "approval")
    assert task["approvals"] == {"asked": 1, "allowed": 0, "denied": 0}
    pinned.shift(3)
    decide(owner, approval["id"], behavior="deny", message="not on main")
    second = ask(owner, session=None, task=task_id, tool_input={"command": "ls"}).json()
    decide(owner, second["id"])
    ask(owner, session=None, task=task_id, tool_input={"command": "make"})
    task = api.get(f"/api/tasks/{task_id}/").json()
    assert task["approvals"] == {"asked": 3, "allowed": 1, "denied": 1} and task["attention"] == "approval"
    reasons = [(e.reason, e.actor) for e in TaskEvent.objects.filter(task_id=task_id, reason__startswith="approval")]
    assert reasons == [("approval asked: Bash", "agent:claude"), ("approval denied: Bash", "owner:alice"),
                       ("approval asked: Bash", "agent:claude"), ("approval allowed: Bash", "owner:alice"),
                       ("approval asked: Bash", "agent:claude")]
    assert not any("rm -rf" in r for r, _ in reasons)  # Q7: the input is shown, never logged

    # The task ends: the pending one is withdrawn, attention cleared, counts stay.
    assert receipt(machine, task_id, "final", final_facts()).status_code == 200
    task = api.get(f"/api/tasks/{task_id}/").json()
    assert (task["state"], task["attention"]) == ("succeeded", "")
    assert task["approvals"] == {"asked": 3, "allowed": 1, "denied": 1}
    assert sorted(Approval.objects.values_list("state", flat=True)) == ["allowed", "denied", "withdrawn"]
    withdrawn = Approval.objects.get(state="withdrawn")
    assert withdrawn.decided_by == "system"
    assert TaskEvent.objects.filter(task_id=task_id, reason="approval withdrawn: Bash", actor="system").count() == 1
    final = ask(owner, session=None, task=task_id, tool_input={"command": "late"})
    assert final.status_code == 409 and final.json()["error"] == "task_final"
    # The task page's timeline lists each approval with who answered it and when (B9, Q5).
    browser = Client()
    browser.force_login(owner)
    timeline = browser.get(f"/tasks/{task_id}/data/").json()["timeline"]
    rows = [(i["at"], i["text"]) for i in timeline if i["kind"] == "approval"]
    assert [text for _, text in rows] == [
        "approval asked: Bash (agent:claude)", "approval denied: Bash (owner:alice)",
        "approval asked: Bash (agent:claude)", "approval allowed: Bash (owner:alice)",
        "approval asked: Bash (agent:claude)", "approval withdrawn: Bash (system)"]
    assert rows[1][0] == Approval.objects.get(state="denied").decided_at.isoformat()


# --- Q6: the board ----------------------------------------------------------------------


def test_q6_the_board_snapshot_lists_pending_approvals_oldest_first(owner, other_owner, pinned):
    older = ask(owner, session=str(uuid.uuid4())).json()
    pinned.shift(1)
    newer = ask(owner, session=str(uuid.uuid4())).json()
    decided = ask(owner, session=str(uuid.uuid4())).json()
    decide(owner, decided["id"])
    ask(other_owner)
    snapshot = owner_api(owner).get("/api/board/").json()
    assert [a["id"] for a in snapshot["approvals"]] == [older["id"], newer["id"]]
    assert snapshot["approvals"][0] == owner_api(owner).get(f"/api/approvals/{older['id']}/").json()


@pytest.mark.asyncio
@pytest.mark.django_db(transaction=True)
@pytest.mark.usefixtures("fresh_layer")
async def test_q6_approval_events_on_create_and_on_decision_to_the_owner_only(owner, other_owner):
    board, theirs = await board_of(owner), await board_of(other_owner)
    created = (await sync_to_async(ask)(owner)).json()
    events = [json.loads(await board.receive_from()) for _ in range(3)]
    assert [e["type"] for e in events] == ["approval", "notification", "session.status"]
    assert events[0]["approval"] == created and events[0]["version"] == created["version"] == 1
    assert events[1]["notification"]["tag"] == created["id"]  # N2's board channel, kind approval
    assert events[2]["attention"] == "approval" and "server_time" in events[0]
    decided = (await sync_to_async(decide)(owner, created["id"], behavior="deny")).json()
    events = [json.loads(await board.receive_from()) for _ in range(3)]
    assert [e["type"] for e in events] == ["approval", "notification", "session.status"]
    assert events[0]["approval"] == decided and events[0]["version"] == 2
    assert events[1]["notification"]["approval_state"] == "denied"
    assert events[2]["attention"] == ""
    assert await board.receive_nothing(timeout=0.2)
    assert await theirs.receive_nothing(timeout=0.1)
    await board.disconnect()
    await theirs.disconnect()


# --- Q7, K3: refusals change nothing ------------------------------------------------------


def test_q7_bad_asks_and_answers_are_clear_4xx_and_change_nothing(owner, other_owner, machine, pinned):
    approval = ask(owner).json()
    before = list(Approval.objects.values())
    api = owner_api(owner)
    cases = [
        (ask(owner, colour="red"), 400, "invalid"),
        (ask(owner, tool_input={"content": "x" * 70000}), 400, "invalid"),
        (ask(owner, tool_input="rm -rf /"), 400, "invalid"),
        (ask(owner, task=str(uuid.uuid4())), 400, "invalid"),  # both session and task
        (ask(owner, session=None), 400, "invalid"),  # neither
        (ask(owner, cwd="relative/path"), 400, "invalid"),
        (ask(owner, session=None, task=str(uuid.uuid4())), 404, "not_found"),
        (ask(other_owner, key="mallory", session=SESSION), 404, "not_found"),  # alice's session
        (api.post(f"/api/approvals/{approval['id']}/decision/", {"behavior": "allow"}, format="json"), 400,
         "idempotency_key_missing"),
        (decide(owner, approval["id"], behavior="maybe"), 400, "invalid"),
        (decide(owner, approval["id"], behavior="allow", message="why"), 400, "invalid"),
        (decide(owner, approval["id"], behavior="deny", scope="session"), 400, "invalid"),
        (decide(owner, approval["id"], behavior="deny", message="x" * 2001), 400, "invalid"),
        (decide(owner, approval["id"], behavior="allow", colour="red"), 400, "invalid"),
        (decide(other_owner, approval["id"]), 404, "not_found"),
        (decide(owner, approval["id"], client=machine_api(machine)), 403, "permission_denied"),
        (owner_api(other_owner).get(f"/api/approvals/{approval['id']}/"), 404, "not_found"),
        (owner_api(other_owner).post(f"/api/approvals/{approval['id']}/terminal/", format="json"), 404, "not_found"),
        (machine_api(machine).get("/api/approvals/"), 403, "permission_denied"),
        (api.get(f"/api/approvals/{approval['id']}/?wait=26"), 400, "invalid"),
        (api.get(f"/api/approvals/{approval['id']}/?colour=red"), 400, "invalid"),
    ]
    for response, status, code in cases:
        assert (response.status_code, response.json()["error"]) == (status, code), response.content
        assert response.json()["detail"]
        assert "rm -rf" not in response.content.decode()
    assert list(Approval.objects.values()) == before
    assert not IdempotencyRecord.objects.exists()


def test_q7_creation_is_rate_limited_per_session(owner, pinned, settings):
    settings.RUNSTEAD_APPROVAL_RATE = "3/min"
    statuses = [ask(owner).status_code for _ in range(3)]
    limited = ask(owner)
    other_session = ask(owner, session=str(uuid.uuid4()))
    assert statuses == [201, 201, 201]
    assert limited.status_code == 429 and limited.json()["error"] == "rate_limited" and limited["Retry-After"]
    assert other_session.status_code == 201
    assert Approval.objects.count() == 4


def test_q1_admin_shows_approvals_read_only(owner, admin_client, pinned):
    approval = ask(owner).json()
    page = admin_client.get(f"/admin/sessions_app/approval/{approval['id']}/change/")
    assert page.status_code == 200 and b"Bash" in page.content
    assert admin_client.get("/admin/sessions_app/approval/add/").status_code == 403
    assert admin_client.post(f"/admin/sessions_app/approval/{approval['id']}/delete/", {"post": "yes"}).status_code == 403
    assert Approval.objects.get().state == "pending"


def test_q5_task_counts_start_at_zero(owner, machine, grant, pinned):
    task = submit(owner, machine, grant.path).json()
    assert (task["attention"], task["approvals"]) == ("", {"asked": 0, "allowed": 0, "denied": 0})
    assert Task.objects.get(pk=task["id"]).approval_token_hash == ""


@pytest.mark.parametrize("field, value", [
    ("tool_input", {"comm\x00and": "ls"}),
    ("tool_input", {"command": "printf 'a\x00b'"}),
    ("suggestions", [{"type": "addRules", "rules": [{"toolName": "B\x00ash"}]}]),
])
def test_k3_q1_nul_in_tool_input_or_suggestions_is_400_and_nothing_stored(owner, pinned, field, value):
    # PostgreSQL's jsonb cannot hold U+0000 (found by schemathesis as a 500): refused as input.
    resp = ask(owner, **{field: value})
    assert resp.status_code == 400, resp.content
    assert resp.json()["error"] == "invalid" and field in resp.json()["fields"]
    assert Approval.objects.count() == 0
