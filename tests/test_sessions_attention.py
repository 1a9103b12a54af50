"""SPEC I6, K3, B4: a session's agent, title, folder and attention ("needs you"). An
attention change is a compare-and-set on the session row (its version rises) published
as ``session.status``; every ``session.status`` event and ``GET /api/board/`` carry them."""
import json
import uuid

import pytest
from asgiref.sync import sync_to_async

from tests.conftest import board_of, owner_api

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_layer")]
INFO = ("agent", "title", "cwd", "attention", "attention_message", "attention_since")


def call(owner, method, path, body=None):
    return getattr(owner_api(owner), method)(path, body, format="json")


async def test_i6_attention_is_one_session_status_event_with_a_higher_version(owner, other_owner):
    board, theirs = await board_of(owner), await board_of(other_owner)
    sid = str(uuid.uuid4())
    created = await sync_to_async(call)(owner, "post", "/api/sessions/", {
        "id": sid, "title": "shop", "agent": "claude", "cwd": "/Users/me/src/shop"})
    assert created.status_code == 201
    body = created.json()
    assert {k: body[k] for k in INFO} == {"agent": "claude", "title": "shop", "cwd": "/Users/me/src/shop",
                                          "attention": "", "attention_message": "", "attention_since": None}
    version = body["version"]

    answer = await sync_to_async(call)(owner, "patch", f"/api/sessions/{sid}/", {
        "attention": "permission", "attention_message": "Claude needs your permission to use Bash"})
    assert answer.status_code == 200
    event = json.loads(await board.receive_from())
    assert event["type"] == "session.status" and event["session_id"] == sid
    assert event["status"] == "idle" and event["version"] == version + 1
    assert {k: event[k] for k in INFO[:-1]} == {
        "agent": "claude", "title": "shop", "cwd": "/Users/me/src/shop", "attention": "permission",
        "attention_message": "Claude needs your permission to use Bash"}
    assert event["attention_since"] is not None and event["attention_since"] <= event["server_time"]
    notice = json.loads(await board.receive_from())  # N1 "attention" on the open board, after the status
    assert (notice["type"], notice["notification"]["kind"]) == ("notification", "attention")
    assert await board.receive_nothing(timeout=0.2)
    assert await theirs.receive_nothing(timeout=0.1)

    # The same attention again changes nothing and publishes nothing.
    again = await sync_to_async(call)(owner, "patch", f"/api/sessions/{sid}/", {
        "attention": "permission", "attention_message": "Claude needs your permission to use Bash"})
    assert again.json()["version"] == version + 1
    assert await board.receive_nothing(timeout=0.2)

    # A turn starting while it waits: the busy event carries the attention too.
    await sync_to_async(call)(owner, "put", f"/api/sessions/{sid}/marker/",
                              {"turn_id": "t1", "device_id": "mac:claude:x", "state": "running"})
    events = [json.loads(await board.receive_from()) for _ in range(2)]
    assert [e["type"] for e in events] == ["marker", "session.status"]
    assert events[1]["status"] == "busy" and events[1]["attention"] == "permission"

    cleared = await sync_to_async(call)(owner, "patch", f"/api/sessions/{sid}/", {"attention": ""})
    assert cleared.status_code == 200
    event = json.loads(await board.receive_from())
    assert (event["type"], event["status"], event["attention"], event["attention_message"],
            event["attention_since"]) == ("session.status", "busy", "", "", None)
    assert event["version"] == events[1]["version"] + 1
    await board.disconnect()
    await theirs.disconnect()


async def test_i6_b4_board_snapshot_carries_agent_title_folder_and_attention(owner):
    sid = str(uuid.uuid4())
    await sync_to_async(call)(owner, "post", "/api/sessions/", {"id": sid, "title": "api", "agent": "codex",
                                                                 "cwd": "/srv/api"})
    await sync_to_async(call)(owner, "patch", f"/api/sessions/{sid}/", {"attention": "permission",
                                                                        "attention_message": "Allow npm install?"})
    board = (await sync_to_async(call)(owner, "get", "/api/board/")).json()
    [item] = [s for s in board["sessions"] if s["id"] == sid]
    assert {k: item[k] for k in INFO[:-1]} == {"agent": "codex", "title": "api", "cwd": "/srv/api",
                                              "attention": "permission", "attention_message": "Allow npm install?"}
    assert item["attention_since"] is not None


async def test_i6_a_title_patch_alone_keeps_the_attention(owner):
    sid = str(uuid.uuid4())
    await sync_to_async(call)(owner, "post", "/api/sessions/", {"id": sid, "title": "a"})
    await sync_to_async(call)(owner, "patch", f"/api/sessions/{sid}/", {"attention": "permission",
                                                                        "attention_message": "m"})
    body = (await sync_to_async(call)(owner, "patch", f"/api/sessions/{sid}/", {"title": "b"})).json()
    assert (body["title"], body["attention"], body["attention_message"]) == ("b", "permission", "m")


@pytest.mark.parametrize("method,path,body", [
    ("post", "/api/sessions/", {"title": "x", "colour": "red"}),
    ("post", "/api/sessions/", {"title": "x", "agent": 5}),
    ("post", "/api/sessions/", {"title": "x", "agent": "notepad"}),
    ("post", "/api/sessions/", {"title": "x", "cwd": "relative/path"}),
    ("post", "/api/sessions/", {"title": "x", "attention": "permission"}),
    ("patch", "/api/sessions/{sid}/", {"attention": "urgent"}),
    ("patch", "/api/sessions/{sid}/", {"attention": True}),
    ("patch", "/api/sessions/{sid}/", {"attention_message": "no attention given"}),
    ("patch", "/api/sessions/{sid}/", {"attention": "", "attention_message": "stale"}),
    ("patch", "/api/sessions/{sid}/", {"title": "x", "extra": 1}),
    ("patch", "/api/sessions/{sid}/", {}),
])
async def test_k3_i6_session_create_and_patch_inputs_are_strict(owner, method, path, body):
    sid = str(uuid.uuid4())
    await sync_to_async(call)(owner, "post", "/api/sessions/", {"id": sid, "title": "t"})
    answer = await sync_to_async(call)(owner, method, path.format(sid=sid), body)
    assert answer.status_code == 400
    assert answer.json()["error"] == "invalid" and answer.json()["detail"]
    session = (await sync_to_async(call)(owner, "get", f"/api/sessions/{sid}/")).json()
    assert (session["title"], session["attention"], session["version"]) == ("t", "", 1)
