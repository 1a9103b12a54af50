"""Marker and session events end to end (B2, K2): an API write reaches its owner's board
socket, after commit, with versions; another owner's board gets nothing."""
import json
import uuid

import pytest
from asgiref.sync import sync_to_async

from tests.conftest import board_of, owner_api

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_layer")]


async def test_k2_marker_and_status_events_reach_only_the_owners_board(owner, other_owner):
    mine, theirs = await board_of(owner), await board_of(other_owner)
    sid = str(uuid.uuid4())

    def put(state):
        answer = owner_api(owner).put(
            f"/api/sessions/{sid}/marker/", {"turn_id": "t1", "device_id": "laptop", "state": state}, format="json"
        )
        assert answer.status_code == 200

    await sync_to_async(put)("running")
    first = [json.loads(await mine.receive_from()) for _ in range(2)]
    assert [(e["type"], e.get("state"), e.get("status")) for e in first] == [
        ("marker", "running", None), ("session.status", None, "busy"),
    ]
    assert all(e["session_id"] == sid and e["server_time"] for e in first)
    await sync_to_async(put)("ended")
    second = [json.loads(await mine.receive_from()) for _ in range(3)]
    assert [(e["type"], e["version"]) for e in second] == [
        ("marker", 2), ("session.status", first[1]["version"] + 1), ("notification", 1),
    ]
    assert second[1]["status"] == "idle"
    assert second[2]["notification"]["kind"] == "session_idle"  # N1 on the open board, after the status
    assert await theirs.receive_nothing(timeout=0.3)
    assert await mine.receive_nothing(timeout=0.1)
    await mine.disconnect()
    await theirs.disconnect()
