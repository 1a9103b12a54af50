"""K1, K2 on the routes that ``config/asgi.py`` serves outside Django's urlconf: the board
socket ``/ws/board/`` and the worker long-poll (``core.longpoll``), each driven
through the real ASGI application (``config.asgi.application``) with channels' test
communicators. A route added at the ASGI level without a row here fails
``test_k2_every_asgi_route_has_a_row``.

Board socket: the owner's session cookie from the same origin, or her ``Authorization:
Token`` header, connect; the cookie cross-origin or without an Origin, anonymous, a revoked
(rotated) owner token, a machine token and an old-generation machine token are refused at
the handshake; another owner's socket connects but never receives the victim's events.
Long-poll: the documented refusals with the error shape, another machine sees none of the
victim's messages. Nothing of that changes a row (digest of every table).
"""
import json
import uuid

import pytest
from asgiref.sync import sync_to_async
from channels.layers import channel_layers
from channels.routing import URLRouter
from channels.testing import HttpCommunicator, WebsocketCommunicator
from django.test import Client
from rest_framework.test import APIClient

from core.broadcast import broadcast
from tests.conftest import machine_api, owner_api
from tests.factories import submit
from tests.factories import table_digest

pytestmark = [pytest.mark.django_db(transaction=True)]

ORIGIN = (b"origin", b"http://testserver")
EVIL = (b"origin", b"http://evil.example")

# ASGI-level routes and who may use them (the urlconf's routes are in test_k_isolation_matrix).
WS_ROWS = {"ws/board/": "owner: session cookie + same origin, or Authorization: Token"}
HTTP_ROWS = {
    "/api/worker/messages/": "machine token (long-poll, D1)",
    "/api/approvals/00000000-0000-0000-0000-000000000000/": "owner token or the task's credential (long-poll, Q3)",
}


@pytest.fixture(autouse=True)
def fresh_layer():
    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


def asgi_app():
    from config.asgi import application

    return application


def test_k2_every_asgi_route_has_a_row():
    """The http side is the long-poll router over Django (each of its views has a row by
    path); the websocket side's URL router has a row per route."""
    from django.urls import resolve

    from board.consumers import HandshakeLimit, TokenOrBrowserAuth
    from core.longpoll import LongPollRouter

    app = asgi_app()
    assert set(app.application_mapping) == {"http", "websocket"}
    http = app.application_mapping["http"]
    assert type(http) is LongPollRouter, "a new ASGI http wrapper: give its routes rows in tests/test_k_socket_matrix.py"
    assert {resolve(path).func.view_class for path in HTTP_ROWS} == set(http.views)
    limit = app.application_mapping["websocket"]
    assert isinstance(limit, HandshakeLimit)  # K3: the handshake brake comes first
    ws = limit.inner
    assert isinstance(ws, TokenOrBrowserAuth) and isinstance(ws.token_app, URLRouter)
    routes = {str(route.pattern) for route in ws.token_app.routes}
    assert routes == set(WS_ROWS)


def _world(owner, other_owner, machine, grant, make_machine):
    """Victim alice: a task (a start message for her machine), a browser login; then she
    re-pairs the machine and rotates her token. Mallory: a browser login and a machine."""
    from rest_framework.authtoken.models import Token

    submit(owner, machine, grant.path)
    api = owner_api(owner)
    old_machine = machine.test_token
    code = api.post("/api/machines/pairing-codes/", {"machine": str(machine.id)}, format="json").json()["code"]
    machine.test_token = Client().post("/api/worker/pair/", {"code": code}, content_type="application/json").json()["token"]
    revoked = Token.objects.get(user=owner).key
    api.post("/api/token/rotate/")
    other_machine = make_machine(other_owner, name="mallory-laptop")
    from django.utils import timezone

    from tasks_app.models import Machine

    Machine.objects.update(last_heard_at=timezone.now())  # P2: heard just now, not written again within 20 s
    victim, attacker = Client(), Client()
    victim.force_login(owner)
    attacker.force_login(other_owner)
    return {
        "victim_cookie": (b"cookie", f"sessionid={victim.cookies['sessionid'].value}".encode()),
        "attacker_cookie": (b"cookie", f"sessionid={attacker.cookies['sessionid'].value}".encode()),
        "token": Token.objects.get(user=owner).key, "revoked": revoked, "attacker_token": Token.objects.get(user=other_owner).key,
        "machine": machine.test_token, "old_machine": old_machine,
        "other_machine": other_machine.test_token,
        "victim_id": owner.pk,
    }


@pytest.fixture
def world(owner, other_owner, machine, grant, make_machine):
    return _world(owner, other_owner, machine, grant, make_machine)


def auth(value: str):
    return (b"authorization", value.encode())


async def ws_connect(headers):
    communicator = WebsocketCommunicator(asgi_app(), "/ws/board/", headers=headers)
    connected, _ = await communicator.connect(timeout=3)
    return communicator, connected


@pytest.mark.asyncio
async def test_k1_board_socket_matrix(world):
    """Who gets a board socket (B2, K1), and that nothing changes in the database."""
    w = world
    baseline = await sync_to_async(table_digest)()
    cases = [
        ("session cookie, same origin", [ORIGIN, w["victim_cookie"]], True),
        ("Token header", [auth(f"Token {w['token']}")], True),
        ("Token header, foreign origin (not a browser: no cookie is read)", [EVIL, auth(f"Token {w['token']}")], True),
        ("session cookie, cross-origin", [EVIL, w["victim_cookie"]], False),
        ("session cookie, no Origin", [w["victim_cookie"]], False),
        ("anonymous", [ORIGIN], False),
        ("revoked owner token (rotated)", [auth(f"Token {w['revoked']}")], False),
        ("revoked owner token beside a valid cookie", [ORIGIN, w["victim_cookie"], auth(f"Token {w['revoked']}")], False),
        ("machine token", [ORIGIN, auth(f"Machine {w['machine']}")], False),
        ("old-generation machine token", [auth(f"Machine {w['old_machine']}")], False),
        ("another machine's token", [auth(f"Machine {w['other_machine']}")], False),
        ("a bare Token keyword", [auth("Token")], False),
    ]
    outcomes = []
    for name, headers, allowed in cases:
        communicator, connected = await ws_connect(headers)
        outcomes.append((name, connected))
        await communicator.disconnect()
    assert outcomes == [(name, allowed) for name, _, allowed in cases]
    assert await sync_to_async(table_digest)() == baseline


@pytest.mark.asyncio
async def test_k2_another_owners_board_socket_gets_none_of_the_victims_events(world):
    w = world
    victim, connected = await ws_connect([ORIGIN, w["victim_cookie"]])
    assert connected
    attacker, connected = await ws_connect([ORIGIN, w["attacker_cookie"]])
    assert connected
    attacker_token, connected = await ws_connect([auth(f"Token {w['attacker_token']}")])
    assert connected
    await sync_to_async(broadcast)(w["victim_id"], {"type": "task", "task": {"id": "secret"}, "version": 7})
    assert json.loads(await victim.receive_from(timeout=2))["task"]["id"] == "secret"
    assert await attacker.receive_nothing(timeout=0.3)
    assert await attacker_token.receive_nothing(timeout=0.1)
    for communicator in (victim, attacker, attacker_token):
        await communicator.disconnect()


async def long_poll(headers):
    communicator = HttpCommunicator(asgi_app(), "GET", "/api/worker/messages/?wait=0", headers=headers)
    response = await communicator.get_response(timeout=5)
    return response["status"], json.loads(response["body"] or b"null")


@pytest.mark.asyncio
async def test_k2_long_poll_matrix_on_the_asgi_route(world):
    """The long-poll answers as the Django view does, through the ASGI route: refusals
    with the error shape, another machine's pull empty, nothing changed; then the victim's
    own machine gets its message (the control)."""
    w = world
    baseline = await sync_to_async(table_digest)()
    cases = [
        ("anonymous", [], 401, "not_authenticated"),
        ("owner token on a machine path", [auth(f"Token {w['token']}")], 403, "permission_denied"),
        ("another owner's token", [auth(f"Token {w['attacker_token']}")], 403, "permission_denied"),
        ("revoked owner token", [auth(f"Token {w['revoked']}")], 401, "authentication_failed"),
        ("old-generation machine token", [auth(f"Machine {w['old_machine']}")], 401, "token_revoked"),
        # the ASGI route runs the view without Django's middleware: a cookie is not even read
        ("session cookie", [ORIGIN, w["victim_cookie"]], 401, "not_authenticated"),
    ]
    for name, headers, status, code in cases:
        got_status, body = await long_poll(headers)
        assert (name, got_status, body["error"]) == (name, status, code)
        assert isinstance(body["detail"], str) and body["detail"], name
    status, body = await long_poll([auth(f"Machine {w['other_machine']}")])
    assert (status, body) == (200, {"messages": []})
    assert await sync_to_async(table_digest)() == baseline
    status, body = await long_poll([auth(f"Machine {w['machine']}")])
    assert status == 200 and [m["kind"] for m in body["messages"]] == ["start"]


@pytest.mark.asyncio
async def test_k2_approval_long_poll_matrix_on_the_asgi_route(world):
    """Q3, Q7 through the ASGI route (a waiting read passes no middleware): another
    owner's approval is 404, a machine token 403, no credential 401; the owner reads it."""
    w = world
    body = {"key": "k-1", "session": str(uuid.uuid4()), "agent": "claude", "tool_name": "Bash", "tool_input": {}}
    created = await sync_to_async(lambda: APIClient(HTTP_AUTHORIZATION=f"Token {w['token']}").post(
        "/api/approvals/", body, format="json"))()
    path = f"/api/approvals/{created.json()['id']}/?wait=0"
    baseline = await sync_to_async(table_digest)()
    cases = [
        ("anonymous", [], 401, "not_authenticated"),
        ("another owner's token", [auth(f"Token {w['attacker_token']}")], 404, "not_found"),
        ("machine token", [auth(f"Machine {w['machine']}")], 403, "permission_denied"),
        ("session cookie", [ORIGIN, w["victim_cookie"]], 401, "not_authenticated"),
    ]
    for name, headers, status, code in cases:
        response = await HttpCommunicator(asgi_app(), "GET", path, headers=headers).get_response(timeout=5)
        assert (name, response["status"], json.loads(response["body"])["error"]) == (name, status, code)
    assert await sync_to_async(table_digest)() == baseline
    response = await HttpCommunicator(asgi_app(), "GET", path, headers=[auth(f"Token {w['token']}")]).get_response(
        timeout=5)
    assert response["status"] == 200 and json.loads(response["body"])["state"] == "pending"


def test_k1_machine_token_on_owner_paths_is_refused_after_repair(owner, machine):
    """The re-paired machine's old token answers 401 token_revoked on every kind of path;
    the new one is a machine, never an owner (403)."""
    old = machine_api(machine)
    code = owner_api(owner).post("/api/machines/pairing-codes/", {"machine": str(machine.id)}, format="json").json()["code"]
    Client().post("/api/worker/pair/", {"code": code}, content_type="application/json")
    for path in ("/api/worker/messages/?wait=0", "/api/tasks/", "/api/board/"):
        response = old.get(path)
        assert (response.status_code, response.json()["error"]) == (401, "token_revoked"), path
