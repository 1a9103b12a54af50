"""Shared fixtures: owners, machines, grants, API clients; and the CI rule for services.

Tests marked ``postgres`` need PostgreSQL and Redis (``DATABASE_URL``, ``REDIS_URL``). The
SQLite pass deselects them (see ./test); under ``CI=true`` a missing server fails them.
"""
import os
import secrets
import socket

import pytest
from django.conf import settings
from django.db import connection, connections
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

# Parallel runs (pytest-xdist, ./test): pytest-django gives each worker its own test
# database (suffix gw0, gw1, ...), where owner ids repeat; so each worker gets its own
# channel-layer prefix too, here and in the daphne and worker processes it starts, or one
# worker's board sockets would hear another's events.
# Every test ``Client`` builds its own handler and so its own WhiteNoise middleware, which
# (with WHITENOISE_USE_FINDERS) walks every static file of every app at start: about
# 0.1 s per client. In autorefresh mode it looks a file up when asked instead; daphne
# and gunicorn processes keep the settings' behaviour.
settings.WHITENOISE_AUTOREFRESH = True



def _flush_retrying_a_deadlock():
    """A transactional test's flush (one TRUNCATE of every table) can deadlock with a
    transaction of a live daphne that a module shares across tests (``module_daphne``):
    the TRUNCATE takes its locks table by table while that transaction holds one and asks
    for another, and PostgreSQL may pick the TRUNCATE as the victim. The victim is rolled
    back whole, so it is tried again at once (its TRUNCATE waits for the locks itself; five
    times at most); any other error is raised."""
    import psycopg
    from django.db import OperationalError
    from django.db.backends.postgresql.operations import DatabaseOperations

    flush = DatabaseOperations.execute_sql_flush

    def execute_sql_flush(self, sql_list):
        for attempt in range(5):
            try:
                return flush(self, sql_list)
            except OperationalError as exc:
                if attempt == 4 or not isinstance(exc.__cause__, psycopg.errors.DeadlockDetected):
                    raise

    DatabaseOperations.execute_sql_flush = execute_sql_flush


_flush_retrying_a_deadlock()

if _xdist_worker := os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["RUNSTEAD_CHANNEL_PREFIX"] = f"{os.environ.get('RUNSTEAD_CHANNEL_PREFIX', 'runstead')}-{_xdist_worker}"
    if "prefix" in settings.CHANNEL_LAYERS["default"].get("CONFIG", {}):
        settings.CHANNEL_LAYERS["default"]["CONFIG"]["prefix"] = os.environ["RUNSTEAD_CHANNEL_PREFIX"]


# SPEC O3, CI time: ``backend_independent`` marks a test whose subject depends on neither the
# service's database nor its channel layer, so the PostgreSQL + Redis pass would repeat
# the SQLite pass's run of it identically; ./test deselects it in that pass (see pytest.ini).
# What this checks at collection (the rest is the author's word, see pytest.ini): such a
# test requests no database or layer fixture, directly or through another fixture, and is
# not also marked ``postgres`` or ``django_db``.
BACKEND_FIXTURES = frozenset({
    "db", "transactional_db", "django_db_reset_sequences", "django_db_serialized_rollback", "django_db_setup",
    "live_server", "live_daphne", "module_daphne", "fresh_layer",
})


@pytest.hookimpl(trylast=True)  # after pytest-django's reordering (tryfirst), which would undo the move
def pytest_collection_modifyitems(config, items):
    """Refuses the run (a usage error naming the tests) when a ``backend_independent``
    test uses the database or the channel layer by a fixture or a marker; then moves the
    tests marked ``runs_long`` to the front, in their order (the rest keep theirs): under
    ``./test``'s pytest-xdist (``--dist load``) one runner's first batch begins with
    the collection's first test, so a long test starts at once and overlaps the rest of
    the pass instead of adding its length at the end (pytest.ini)."""
    wrong = []
    for item in items:
        if not item.get_closest_marker("backend_independent"):
            continue
        used = sorted(BACKEND_FIXTURES & set(getattr(item, "fixturenames", ())))
        used += [f"@{name}" for name in ("postgres", "django_db") if item.get_closest_marker(name)]
        if used:
            wrong.append(f"{item.nodeid}: {', '.join(used)}")
    if wrong:
        raise pytest.UsageError("marked backend_independent but uses the database or the layer:\n" + "\n".join(wrong))
    items[:] = sorted(items, key=lambda item: item.get_closest_marker("runs_long") is None)


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
def _shared_thread_gives_back_its_connection():
    """An async test's ``sync_to_async`` (thread-sensitive, outside any ``async_to_sync``)
    runs in asgiref's one shared executor thread, which outlives the test: the database
    connection it took stayed in that thread, out of the pool, from test to test. A test
    that kills the database's other connections (D2's ``pg_terminate_backend``) then left
    it dead for the next async test of that runner ("terminating connection due to
    administrator command", then "the connection is closed" in every later one). So after every test that thread gives its connections back (PostgreSQL: to the pool,
    which drops a dead one; SQLite's in-memory test database ignores a close)."""
    yield
    if connection.vendor == "postgresql":
        from asgiref.sync import SyncToAsync

        SyncToAsync.single_thread_executor.submit(connections.close_all).result(timeout=30)


@pytest.fixture(autouse=True)
def _fresh_rate_limits():
    """Rate limits (core/throttling.py) count in the cache, which outlives a test;
    owner and machine ids repeat across tests, so each test starts with clean counters."""
    from django.core.cache import cache

    from board.consumers import handshake_limits_clear

    cache.clear()
    handshake_limits_clear()
    yield
    cache.clear()
    handshake_limits_clear()


@pytest.fixture(autouse=True)
def _fresh_machine_tokens():
    """This process's credential caches (``tasks_app.auth.MachineTokenCache``,
    ``OwnerTokenCache``, ``sessions_app.approvals.ApprovalOwners``) outlive a test's
    rolled-back rows; each test starts without them."""
    from sessions_app.approvals import approval_owners
    from tasks_app.auth import machine_tokens, owner_tokens

    caches = (machine_tokens, owner_tokens, approval_owners)
    for cache in caches:
        cache.forget()
    yield
    for cache in caches:
        cache.forget()


@pytest.fixture(autouse=True)
def outbound_names(monkeypatch):
    """K5's resolver in this process (``notifications.outbound.getaddrinfo``) answers
    without the network: IP literals as the C library reads them, ``localhost``, and the
    names a test adds (``outbound_names["rebind.test"] = ["127.0.0.1"]``, changeable
    between calls); any other name does not resolve, so no test sends a DNS query."""
    from notifications import outbound

    names = {"localhost": ["127.0.0.1"]}
    real = socket.getaddrinfo

    def getaddrinfo(host, port, family=0, type=0, proto=0, flags=0):
        try:
            return real(host, port, family, type, proto, flags | socket.AI_NUMERICHOST)
        except socket.gaierror:
            pass
        addresses = names.get(str(host).rstrip(".").lower())
        if not addresses:
            raise socket.gaierror(socket.EAI_NONAME, f"{host}: not in the test's names")
        return [real(a, port, family, type, proto, socket.AI_NUMERICHOST)[0] for a in addresses]

    monkeypatch.setattr(outbound, "getaddrinfo", getaddrinfo)
    return names


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

    from board.routing import websocket_application

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


@pytest.fixture
def one_of_each(owner, machine, grant, pinned):
    """One of everything an endpoint can name (K3 strict input, the schemathesis run): a
    task with its operation, lease and start message; a live conversation task with a
    message (C2); a session with a job; a pending
    pairing code; a push subscription; a pending approval of the session; a machine pool (C8). The machine has been heard from, so its
    ``last_heard_at`` does not move during the test (P2 writes it at most every few
    seconds and the clock is pinned). Returns their ids (strings) by name."""
    import uuid

    from tests.factories import grant_lease, operation_id, push_subscription, submit

    task_id = submit(owner, machine, grant.path).json()["id"]
    (message,) = machine_api(machine).get("/api/worker/messages/?wait=0").json()["messages"]
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    api = owner_api(owner)
    session_id = str(uuid.uuid4())
    assert api.post("/api/sessions/", {"id": session_id, "title": "s", "machine": str(machine.id), "channel": "terminal"},
                    format="json").status_code == 201
    assert api.post(f"/api/sessions/{session_id}/messages/", {"text": "hi"}, format="json",
                    HTTP_IDEMPOTENCY_KEY="one-of-each").status_code == 201  # T2
    assert api.post(f"/api/sessions/{session_id}/jobs/", {"job_id": "j1", "mode": "held"}, format="json").status_code == 201
    assert api.post("/api/machines/pairing-codes/", {"name": "new"}, format="json").status_code == 201
    subscription = api.post("/api/push/subscriptions/", push_subscription(), format="json").json()["id"]
    approval = api.post("/api/approvals/", {"key": "one-of-each", "session": session_id, "agent": "claude",
                                            "tool_name": "Bash", "tool_input": {"command": "ls"}}, format="json")
    # C1, C2: a live conversation (its machine's profile converses live) with a message
    live = {"profiles": [{"name": "claude", "preset": "claude", "conversation": "live"}]}
    assert machine_api(machine).put("/api/worker/profiles/", live, format="json").status_code == 200
    conversation = submit(owner, machine, grant.path, agent="claude", mode="conversation", exclusive=False).json()["id"]
    assert api.post(f"/api/tasks/{conversation}/messages/", {"text": "hi"}, format="json",
                    HTTP_IDEMPOTENCY_KEY="one-of-each").status_code == 201
    pool = api.post("/api/pools/", {"name": "desk", "machines": [str(machine.id)]}, format="json").json()["id"]  # C8
    return {"pool": pool, "subscription": subscription, "job": "j1", "device": "laptop", "approval": approval.json()["id"],
            "task": task_id, "conversation": conversation, "op": operation_id(task_id), "lease": lease_id, "message": message["id"],
            "session": session_id, "machine": str(machine.id), "grant": str(grant.id), "folder": grant.path,
            "generation": machine.generation, "seq": 1}
