"""Shared fixtures: owners, machines, grants, API clients; and the CI rule for services.

Tests marked ``postgres`` need PostgreSQL and Redis (``DATABASE_URL``, ``REDIS_URL``). The
SQLite pass deselects them (see ./test); under ``CI=true`` a missing server fails them.
"""
import os
import secrets

import pytest
from django.conf import settings
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient


@pytest.fixture(autouse=True)
def _services_for_marked_tests(request):
    if request.node.get_closest_marker("postgres") and not (settings.DATABASE_URL and settings.REDIS_URL):
        if os.environ.get("CI") == "true":
            pytest.fail("CI=true: this test needs DATABASE_URL and REDIS_URL and is never skipped")
        pytest.skip("needs DATABASE_URL and REDIS_URL")


@pytest.fixture(autouse=True)
def _fast_password_hashing(request, settings):
    """MD5 for users made in this process (about 0.5 s less per owner). Browser tests log
    in through a daphne subprocess, which knows only the real hashers, so they keep them."""
    if not request.node.get_closest_marker("browser"):
        settings.PASSWORD_HASHERS = ["django.contrib.auth.hashers.MD5PasswordHasher"]


@pytest.fixture(autouse=True)
def _fresh_rate_limits():
    """Rate limits (config/throttling.py) count in the cache, which outlives a test;
    owner and machine ids repeat across tests, so each test starts with clean counters."""
    from django.core.cache import cache

    cache.clear()
    yield
    cache.clear()


PINNED_AT = "2026-03-01T00:00:00Z"


@pytest.fixture
def pinned(time_machine):
    """The service clock stopped at PINNED_AT; move it with ``pinned.shift(seconds)``."""
    time_machine.move_to(PINNED_AT, tick=False)
    return time_machine


@pytest.fixture
def make_owner(db):
    from django.contrib.auth import get_user_model

    from tasks_app.models import Budget

    def make(username=None, limit_s=36000):
        user = get_user_model().objects.create_user(username or f"owner-{secrets.token_hex(4)}", password="pw")
        Budget.objects.filter(owner=user).update(limit_s=limit_s)
        Token.objects.create(user=user)
        return user

    return make


@pytest.fixture
def owner(make_owner):
    return make_owner("alice")


@pytest.fixture
def other_owner(make_owner):
    return make_owner("mallory")


def owner_api(user) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Token {user.auth_token.key}")
    return client


@pytest.fixture
def owner_client(owner):
    return owner_api(owner)


@pytest.fixture
def fresh_layer():
    """The in-memory channel layer is bound to one event loop; each test gets its own.
    Use with ``pytest.mark.usefixtures("fresh_layer")``."""
    from channels.layers import channel_layers

    channel_layers.backends.clear()
    yield
    channel_layers.backends.clear()


async def board_of(user):
    """``user``'s board socket (``/ws/board/``, token header auth, B2): a connected
    ``WebsocketCommunicator`` on the ASGI WebSocket application, in this process."""
    from asgiref.sync import sync_to_async
    from channels.testing import WebsocketCommunicator

    from sessions_app.routing import websocket_application

    key = await sync_to_async(lambda: user.auth_token.key)()
    communicator = WebsocketCommunicator(
        websocket_application, "/ws/board/", headers=[(b"authorization", f"Token {key}".encode())]
    )
    connected, _ = await communicator.connect()
    assert connected
    return communicator


@pytest.fixture
def make_machine(db):
    from tasks_app.auth import token_digest
    from tasks_app.models import Machine

    def make(user, name="laptop"):
        token = secrets.token_urlsafe(32)
        machine = Machine.objects.create(
            owner=user, name=name, generation=1, token_hash=token_digest(token), paired=True
        )
        machine.test_token = token
        return machine

    return make


@pytest.fixture
def machine(owner, make_machine):
    return make_machine(owner)


def machine_api(machine) -> APIClient:
    client = APIClient()
    client.credentials(HTTP_AUTHORIZATION=f"Machine {machine.test_token}")
    return client


@pytest.fixture
def machine_client(machine):
    return machine_api(machine)


@pytest.fixture
def grant_root(tmp_path):
    root = tmp_path / "grant"
    root.mkdir()
    return root


@pytest.fixture
def grant(machine, grant_root):
    from tasks_app.models import Grant

    return Grant.objects.create(owner=machine.owner, machine=machine, path=str(grant_root))
