"""The board WebSocket (B2, K1, K2): who may connect, and that events reach only their
owner. Runs the real websocket application that config/asgi.py mounts (origin check,
session cookie, token header, URL router, consumer) on the in-memory layer, or on Redis
when REDIS_URL is set."""
import json

import pytest
from asgiref.sync import sync_to_async
from channels.layers import get_channel_layer
from channels.testing import WebsocketCommunicator
from django.db import transaction
from django.test import Client

from core.broadcast import broadcast, owner_group
from board.routing import websocket_application

pytestmark = [pytest.mark.asyncio, pytest.mark.django_db(transaction=True), pytest.mark.usefixtures("fresh_layer")]

ORIGIN = (b"origin", b"http://testserver")


def session_cookie(user) -> tuple[bytes, bytes]:
    client = Client()
    client.force_login(user)
    return (b"cookie", f"sessionid={client.cookies['sessionid'].value}".encode())


async def connect(headers):
    communicator = WebsocketCommunicator(websocket_application, "/ws/board/", headers=headers)
    connected, _ = await communicator.connect()
    return communicator, connected


async def browser(user):
    cookie = await sync_to_async(session_cookie)(user)
    communicator, connected = await connect([ORIGIN, cookie])
    assert connected
    return communicator


async def test_b2_event_reaches_the_owners_browser_as_json(owner):
    communicator = await browser(owner)
    event = {"type": "session.status", "session_id": "s1", "status": "busy", "version": 2, "server_time": "t"}
    await get_channel_layer().group_send(owner_group(owner.pk), {"type": "board.event", "event": event})
    assert json.loads(await communicator.receive_from()) == event
    await communicator.disconnect()


async def test_b2_broadcast_after_commit_arrives_with_server_time(owner):
    communicator = await browser(owner)

    def write():
        with transaction.atomic():
            broadcast(owner.pk, {"type": "machine", "machine": {"id": "m1"}, "version": 3})

    await sync_to_async(write)()
    message = json.loads(await communicator.receive_from())
    assert message["type"] == "machine" and message["version"] == 3
    assert message["server_time"]
    await communicator.disconnect()


async def test_b7_machines_coming_back_together_reach_each_board_as_one_message_and_a_frame_each(
        owner, other_owner, make_machine):
    """Issue 22 (a wave of pull starts after a restart): the machines one batch of starts
    brings back (``machines_heard``) are announced after commit as ONE group message per
    owner (``board.events``), which the board's feed sends on as one frame per machine,
    in order; another owner gets only its own."""
    from django.utils import timezone

    from tasks_app.services.pairing import machines_heard

    mine = [await sync_to_async(make_machine)(owner, name=f"m{i}") for i in range(3)]
    theirs = await sync_to_async(make_machine)(other_owner)
    board, other = await browser(owner), await browser(other_owner)
    sent = []
    layer = get_channel_layer()
    group_send = layer.group_send

    async def recording(group, message):
        sent.append((group, message["type"]))
        await group_send(group, message)

    layer.group_send = recording
    try:
        await sync_to_async(lambda: machines_heard([*mine, theirs], now=timezone.now()))()
        frames = [json.loads(await board.receive_from()) for _ in mine]
        theirs_frame = json.loads(await other.receive_from())
    finally:
        layer.group_send = group_send
    assert sorted(sent) == sorted([(owner_group(owner.pk), "board.events"), (owner_group(other_owner.pk), "board.event")])
    assert [f["machine"]["id"] for f in frames] == sorted(str(m.id) for m in mine)
    assert {f["type"] for f in frames} == {"machine"} and all(f["server_time"] and not f["machine"]["offline"] for f in frames)
    assert theirs_frame["machine"]["id"] == str(theirs.id)
    assert await board.receive_nothing(timeout=0.1)
    await board.disconnect()
    await other.disconnect()


async def test_b2_broadcast_rolled_back_is_never_sent(owner):
    communicator = await browser(owner)

    def write():
        try:
            with transaction.atomic():
                broadcast(owner.pk, {"type": "machine", "machine": {"id": "m1"}, "version": 3})
                raise RuntimeError("rollback")
        except RuntimeError:
            pass

    await sync_to_async(write)()
    assert await communicator.receive_nothing(timeout=0.3)
    await communicator.disconnect()


async def test_k2_another_owners_events_never_arrive(owner, other_owner):
    mine = await browser(owner)
    theirs = await browser(other_owner)
    await sync_to_async(broadcast)(other_owner.pk, {"type": "task", "task": {"id": "t1"}, "version": 1})
    assert json.loads(await theirs.receive_from())["task"] == {"id": "t1"}
    assert await mine.receive_nothing(timeout=0.3)
    await mine.disconnect()
    await theirs.disconnect()


async def test_k1_anonymous_socket_is_refused(db):
    communicator, connected = await connect([ORIGIN])
    assert not connected
    await communicator.disconnect()


async def test_k1_cross_origin_socket_with_a_valid_cookie_is_refused(owner):
    cookie = await sync_to_async(session_cookie)(owner)
    communicator, connected = await connect([(b"origin", b"http://evil.example"), cookie])
    assert not connected
    communicator, connected = await connect([cookie])  # no Origin header at all
    assert not connected


async def test_k1_token_header_authenticates_a_terminal_client(owner):
    key = await sync_to_async(lambda: owner.auth_token.key)()
    communicator, connected = await connect([(b"authorization", f"Token {key}".encode())])
    assert connected
    await sync_to_async(broadcast)(owner.pk, {"type": "task", "task": {"id": "t2"}, "version": 5})
    assert json.loads(await communicator.receive_from())["version"] == 5
    await communicator.disconnect()


async def test_k1_bad_token_or_machine_token_is_refused_even_with_a_cookie(owner, machine):
    cookie = await sync_to_async(session_cookie)(owner)
    for header in (b"Token not-a-key", f"Machine {machine.test_token}".encode(), b"Token"):
        communicator, connected = await connect([ORIGIN, cookie, (b"authorization", header)])
        assert not connected, header


async def test_k3_a_client_message_closes_the_one_way_board(owner):
    """The board takes nothing from the client: a message closes the socket (1008), an
    oversized one with 1009, and nothing is echoed or kept."""
    communicator = await browser(owner)
    await communicator.send_to(text_data='{"type": "task", "task": {"id": "x"}, "version": 1}')
    assert await communicator.receive_output(timeout=1) == {"type": "websocket.close", "code": 1008}
    await communicator.disconnect()
    communicator = await browser(owner)
    await communicator.send_to(text_data="x" * 5000)
    assert await communicator.receive_output(timeout=1) == {"type": "websocket.close", "code": 1009}
    await communicator.disconnect()
    communicator = await browser(owner)
    await communicator.send_to(bytes_data=b"\x00" * 10)
    assert await communicator.receive_output(timeout=1) == {"type": "websocket.close", "code": 1008}
    await communicator.disconnect()
