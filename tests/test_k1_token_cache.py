"""K1 with the pull start's machine-token cache (``tasks_app.auth.MachineTokenCache``;
issue 22): a pull start, a sync and a renewal (issue 44) read their machine's token from
the database once per process, and a revoked or re-paired token is refused at once all the
same. The cache needs the
shared counter in Redis, so these run in the PostgreSQL + Redis pass; across three real
daphne processes: ``tests/test_several_daphnes.py``."""
import re

import pytest
from django.db import connection
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from core import epoch
from tasks_app.models import Machine
from tasks_app.services.pairing import machine_pair, pairing_code_create
from tasks_app.services.revocation import machine_unpair
from tests.conftest import machine_api, owner_api
from tests.factories import grant_lease, submit
from tests.wait import wait_for

pytestmark = pytest.mark.postgres


def _pull(machine_or_token):
    token = getattr(machine_or_token, "test_token", machine_or_token)
    client = machine_api(type("M", (), {"test_token": token}))
    with CaptureQueriesContext(connection) as queries:
        response = client.get("/api/worker/messages/?wait=0")
    return response, _token_reads(queries)


def _token_reads(queries) -> list[str]:
    return [q["sql"] for q in queries.captured_queries if re.search(r'"tasks_app_machine"."token_hash" (=|IN) ', q["sql"])]


@pytest.mark.django_db
def test_k1_a_pull_start_reads_its_machine_token_once_per_process(machine):
    first, reads = _pull(machine)
    assert first.status_code == 200 and len(reads) == 1
    for _ in range(3):
        again, reads = _pull(machine)
        assert again.status_code == 200 and reads == []  # from this process's cache
    with CaptureQueriesContext(connection) as queries:
        other = machine_api(machine).post("/api/worker/leases/", {}, format="json")
    assert other.status_code == 400 and len(_token_reads(queries)) == 1  # other endpoints: as before


@pytest.mark.django_db
def test_k1_l2_renewals_read_their_machine_token_once_and_an_unpaired_machines_sync_is_refused_at_once(
        owner, machine, grant):
    """Issue 44: every busy machine renews once per interval; its syncs and renewals take
    the token from the cache as its pulls do, and an unpairing still refuses the next one."""
    task_id = submit(owner, machine, grant.path, exclusive=False).json()["id"]
    lease_id = grant_lease(machine, task_id).json()["lease_id"]
    client, reads = machine_api(machine), []
    for path, body in [("/api/worker/sync/", {"renew": [{"lease_id": lease_id}]})] * 3 + [
            (f"/api/worker/leases/{lease_id}/renew/", {})]:
        with CaptureQueriesContext(connection) as queries:
            answer = client.post(path, body, format="json")
        assert answer.status_code == 200, answer.content
        reads.append(len(_token_reads(queries)))
    assert reads == [1, 0, 0, 0]
    machine_unpair(machine=machine, actor="owner:test", now=timezone.now())
    refused = client.post("/api/worker/sync/", {"renew": [{"lease_id": lease_id}]}, format="json")
    assert refused.status_code == 401 and refused.json()["error"] == "token_revoked"


@pytest.mark.django_db
def test_k1_unpaired_machines_cached_token_is_refused_at_once(owner, machine):
    assert _pull(machine)[0].status_code == 200
    machine_unpair(machine=machine, actor="owner:test", now=timezone.now())
    refused, _ = _pull(machine)
    assert refused.status_code == 401 and refused.json()["error"] == "token_revoked"


@pytest.mark.django_db
def test_k1_repaired_machines_cached_old_token_is_refused_and_the_new_one_works(owner, machine):
    assert _pull(machine)[0].status_code == 200
    code, _ = pairing_code_create(owner=owner, machine_id=machine.id, now=timezone.now())
    _, new_token = machine_pair(code=code, client="test", now=timezone.now())
    refused, _ = _pull(machine)
    assert refused.status_code == 401 and refused.json()["error"] == "token_revoked"
    assert _pull(new_token)[0].status_code == 200


@pytest.mark.django_db
def test_k1_a_revocation_the_other_processes_cannot_hear_is_refused_and_changes_nothing(owner, machine, settings,
                                                                                         monkeypatch):
    assert _pull(machine)[0].status_code == 200
    settings.REDIS_URL = "redis://127.0.0.1:9/0"  # nothing listens: the shared counter is unreachable
    monkeypatch.setattr(epoch, "_client", None)
    answer = owner_api(owner).post(f"/api/machines/{machine.id}/unpair/")
    assert answer.status_code == 503 and answer.json()["error"] == "service_unavailable"
    assert Machine.objects.get(pk=machine.pk).paired
    pulled, reads = _pull(machine)  # without the counter nothing is cached: read each time
    assert pulled.status_code == 200 and len(reads) == 1


@pytest.mark.django_db
def test_b7_p2_heard_through_a_stale_cached_machine_writes_by_the_row_at_most_every_20_s_announces_only_a_real_return(
        machine, pinned, monkeypatch):
    from datetime import timedelta

    from tasks_app.services import pairing

    announced = []
    monkeypatch.setattr(pairing, "broadcast_all", lambda events: announced.extend(e["machine"]["last_heard_at"] for _, e in events))
    start = timezone.now()
    Machine.objects.filter(pk=machine.pk).update(last_heard_at=start)
    cached = Machine.objects.get(pk=machine.pk)  # as this process cached it
    Machine.objects.filter(pk=machine.pk).update(last_heard_at=start + timedelta(seconds=60))  # another process heard it
    later = start + timedelta(seconds=120)  # offline by the cached value, online by the row
    pairing.machines_heard([cached], now=later)
    assert Machine.objects.get(pk=machine.pk).last_heard_at == later and cached.last_heard_at == later
    assert announced == []
    much_later = later + timedelta(seconds=300)  # offline by the row too: a real return
    pairing.machines_heard([cached], now=much_later)
    assert Machine.objects.get(pk=machine.pk).last_heard_at == much_later and announced == [much_later.isoformat()]
    # within LAST_HEARD_WRITE_EVERY_S (20 s; a busy machine's renewal syncs every ~15 s
    # write nothing, issue 44): no write; at 20 s, one
    pairing.machines_heard([cached], now=much_later + timedelta(seconds=19))
    assert Machine.objects.get(pk=machine.pk).last_heard_at == much_later
    pairing.machines_heard([cached], now=much_later + timedelta(seconds=20))
    assert Machine.objects.get(pk=machine.pk).last_heard_at == much_later + timedelta(seconds=20)


@pytest.mark.django_db
def test_k1_a_deleted_owners_cached_machine_token_is_refused(make_owner, make_machine):
    gone = make_owner()
    machine = make_machine(gone)
    assert _pull(machine)[0].status_code == 200
    gone.delete()  # its machines go with it
    refused, _ = _pull(machine)
    assert refused.status_code == 401 and refused.json()["error"] == "token_revoked"


@pytest.mark.django_db(transaction=True)
def test_p1_k1_a_cache_miss_during_a_revocation_waits_for_it_and_caches_nothing(owner, machine):
    """Real PostgreSQL, two connections: the revocation has locked the machine's row and
    moved the counter, not yet committed; a pull start's miss then must not read the
    still-committed old row (it would cache it under the new counter for good): its
    ``FOR KEY SHARE`` read waits for the commit and finds the token revoked."""
    import threading

    from django.db import connection, connections, transaction

    from tasks_app.auth import TokenRevoked, machine_tokens, machine_tokens_changed, token_digest

    digest = token_digest(machine.test_token)
    locked, release = threading.Event(), threading.Event()
    outcome = {}

    def revoke():
        try:
            with transaction.atomic():
                Machine.objects.select_for_update().get(pk=machine.pk)
                machine_tokens_changed()
                Machine.objects.filter(pk=machine.pk).update(paired=False, token_hash="")
                locked.set()
                release.wait(10)
        finally:
            connections.close_all()

    def look():
        try:
            outcome["owner_machine"] = machine_tokens.lookup(digest)
        except TokenRevoked as exc:
            outcome["refused"] = exc
        finally:
            connections.close_all()

    revoker = threading.Thread(target=revoke)
    revoker.start()
    assert locked.wait(10)
    looker = threading.Thread(target=look)
    looker.start()
    with connection.cursor() as cursor:  # the fact: the lookup waits on the revocation's row lock

        def lookups_waiting_on_a_lock() -> int:
            assert looker.is_alive(), "the lookup did not wait for the revocation"
            cursor.execute("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                           "AND query LIKE %s", ["%FOR KEY SHARE%"])
            return cursor.fetchone()[0]

        wait_for(lookups_waiting_on_a_lock, until=lambda n: n == 1, timeout_s=10, interval_s=0.02,
                 what="the lookup to wait for the revocation")
    release.set()
    revoker.join(10)
    looker.join(10)
    assert "refused" in outcome, outcome
    with pytest.raises(TokenRevoked):
        machine_tokens.lookup(digest)  # and nothing stale was cached


def _scope(query: bytes = b"wait=25", *headers: tuple[bytes, bytes]) -> dict:
    return {"type": "http", "method": "GET", "path": "/api/worker/messages/", "query_string": query,
            "headers": [(b"host", b"testserver"), *headers], "client": ("127.0.0.1", 1),
            "server": ("testserver", 80), "scheme": "http", "root_path": ""}


def _machine_header(token: str) -> tuple[bytes, bytes]:
    return (b"authorization", f"Machine {token}".encode())


def _finished(response) -> tuple[int, list, bytes]:
    response.finish([])
    return response.status_code, sorted(response.items()), response.content


@pytest.mark.django_db
def test_d1_k1_a_pull_quick_start_answers_as_the_view_does(machine):
    """The usual idle pull starts on the event loop without DRF's dispatch (issue 22):
    the same status, headers and body as the view's, the same wait (the machine's
    exclusive outbox wait, the asked seconds less the end jitter)."""
    from core.longpoll.router import _dispatch, _resolve
    from core.longpoll.view import quick_start
    from tasks_app.api.views import WorkerMessages
    from tasks_app.services.messages import PULL_END_JITTER

    found = _resolve("/api/worker/messages/")
    for accept in ([], [(b"accept", b"*/*")], [(b"accept", b"application/json")]):
        scope = _scope(b"wait=12.5", _machine_header(machine.test_token), *accept)
        viewed = _dispatch(found, scope)  # caches the token
        quick = quick_start(WorkerMessages, scope)
        assert quick is not None and quick.wait.subject.pk == machine.pk
        assert (quick.wait.key, quick.wait.exclusive) == (viewed.wait.key, True)
        assert 12.5 * (1 - PULL_END_JITTER) <= quick.wait.timeout_s <= 12.5
        assert _finished(quick) == _finished(viewed)


_OTHER_STARTS = {  # case: (query, headers given the machine's token, the view's status and error code)
    "no_token": (b"wait=1", lambda t: [], 401, "not_authenticated"),
    "owner_token_scheme": (b"wait=1", lambda t: [(b"authorization", f"Token {t}".encode())], 401,
                           "authentication_failed"),
    "three_words": (b"wait=1", lambda t: [(b"authorization", f"Machine {t} x".encode())], 401, "token_revoked"),
    "unknown_token": (b"wait=1", lambda t: [_machine_header("not-a-token")], 401, "token_revoked"),
    "revoked": (b"wait=1", lambda t: [_machine_header(t)], 401, "token_revoked"),
    "counter_not_fresh": (b"wait=1", lambda t: [_machine_header(t)], 200, None),
    "wait_over_25": (b"wait=25.5", lambda t: [_machine_header(t)], 400, "invalid"),
    "wait_exponent": (b"wait=1e1", lambda t: [_machine_header(t)], 400, "invalid"),
    "wait_negative": (b"wait=-1", lambda t: [_machine_header(t)], 400, "invalid"),
    "no_wait": (b"", lambda t: [_machine_header(t)], 200, None),
    "wait_twice": (b"wait=1&wait=2", lambda t: [_machine_header(t)], 400, "invalid"),
    "unknown_parameter": (b"wait=1&x=1", lambda t: [_machine_header(t)], 400, "invalid"),
    "accept_text": (b"wait=1", lambda t: [_machine_header(t), (b"accept", b"text/plain")], 406, "not_acceptable"),
    "authorization_twice": (b"wait=1", lambda t: [_machine_header(t)] * 2, 401, "token_revoked"),
}


@pytest.mark.django_db
@pytest.mark.parametrize("case", sorted(_OTHER_STARTS))
def test_d1_k1_k3_every_other_pull_start_is_left_to_the_view(case, machine, settings):
    """Whatever is not the usual pull of a cached, current token goes through the view,
    which answers its error code (K1, K3) or, for a valid pull the quick start could not
    vouch for without I/O (the counter must be read again; no ``wait``), the pull."""
    from core.longpoll.router import _dispatch, _resolve
    from core.longpoll.view import quick_start
    from tasks_app.api.views import WorkerMessages

    found = _resolve("/api/worker/messages/")
    assert _dispatch(found, _scope(b"wait=1", _machine_header(machine.test_token))).status_code == 200  # cached
    query, headers, status, error = _OTHER_STARTS[case]
    if case == "revoked":
        machine_unpair(machine=machine, actor="owner:test", now=timezone.now())
    elif case == "counter_not_fresh":
        settings.RUNSTEAD_TOKEN_EPOCH_FRESH_S = 0  # the counter must be read again: that is I/O
    scope = _scope(query, *headers(machine.test_token))
    assert quick_start(WorkerMessages, scope) is None
    answered = _dispatch(found, scope)
    assert (answered.status_code, (getattr(answered, "data", None) or {}).get("error")) == (status, error)


@pytest.mark.django_db(transaction=True)
def test_d1_k1_a_wave_of_pull_starts_reads_its_tokens_in_one_statement(owner, make_machine, caplog, settings):
    """Issue 22 (1,000 workers reconnecting at once, every delivery under 1 s): the
    starts the quick start cannot answer yet (nothing cached after a restart) join one
    batch, read by ONE ``FOR KEY SHARE`` statement in a pool thread
    (``MachineTokenCache.warm``); then the quick start answers every paired one. A
    revoked token in the wave is read and not cached: the view refuses it (K1)."""
    import asyncio
    import logging

    from core.longpoll.router import _resolve, _warm
    from core.longpoll.view import quick_start
    from tasks_app.api.views import WorkerMessages
    from tasks_app.auth import machine_tokens

    settings.RUNSTEAD_TOKEN_EPOCH_FRESH_S = 30  # the counter read by the batch is still fresh when checked below
    machines = [make_machine(owner, name=f"m{i}") for i in range(30)]
    revoked = make_machine(owner, name="gone")
    machine_unpair(machine=revoked, actor="owner:test", now=timezone.now())
    machine_tokens.forget()
    found = _resolve("/api/worker/messages/")
    scopes = [_scope(b"wait=25", _machine_header(m.test_token)) for m in [*machines, revoked]]
    assert all(quick_start(WorkerMessages, scope) is None for scope in scopes)

    async def wave():
        return await asyncio.gather(*(_warm(found, scope) for scope in scopes))

    with caplog.at_level(logging.DEBUG, logger="runstead.auth"):
        assert asyncio.run(wave()) == [True] * len(scopes)
    reads = [int(n) for n in re.findall(r"machine token cache: (\d+) missed", caplog.text)]
    assert reads == [len(scopes)]  # one statement for the whole wave
    started = [quick_start(WorkerMessages, scope) for scope in scopes]
    assert [s.wait.subject.pk for s in started[:-1]] == [m.pk for m in machines]
    assert started[-1] is None  # the view answers it: 401 token_revoked
