"""Acceptance and revocation under truly overlapping requests (SPEC A4, A5, A8, P1, P2).

Every racer is a real thread with its own database connection, released together by a
``threading.Barrier``, going through the real HTTP stack (DRF ``APIClient`` -> view ->
service). Assertions look at the rows that exist afterwards, not only at the responses.
The PostgreSQL tests are the proof; the SQLite ones check that ``BEGIN IMMEDIATE``
(settings ``transaction_mode``) gives the same answers on the embedded default.
"""
import random
import threading
import uuid
from datetime import datetime, UTC

import pytest
from django.conf import settings
from django.db import OperationalError, connection, transaction

from core import deadlocks
from tasks_app.models import Budget, Grant, IdempotencyRecord, Operation, OutboxMessage, Task
from tasks_app.services import locking
from tests.barrier import JOIN_TIMEOUT_S, race
from tests.conftest import owner_api
from tests.factories import grant_lease, receipt, submit


@pytest.fixture(autouse=True)
def _no_acceptance_brake(settings):
    """Races send hundreds of acceptances per owner in a few seconds: the K3 rate limit
    (RUNSTEAD_ACCEPT_RATE, proven in test_k_abuse.py) is lifted so each round is decided
    by the locks under test, not by the brake."""
    settings.RUNSTEAD_ACCEPT_RATE = "100000/min"

T_HEARD = datetime(2026, 1, 1, tzinfo=UTC)
sqlite_only = pytest.mark.skipif(
    settings.DATABASES["default"]["ENGINE"] != "django.db.backends.sqlite3", reason="the SQLite variant (BEGIN IMMEDIATE)"
)


def body_of(resp) -> tuple:
    return resp.status_code, resp.content, resp.headers.get("Idempotent-Replayed")


# --- A4: identical requests --------------------------------------------------------------


def _identical_race(owner, machine, folder, n):
    key = f"same-{uuid.uuid4()}"
    results = race(n, lambda i: body_of(submit(owner, machine, folder, key=key)))
    statuses = {status for status, _, _ in results}
    bodies = {content for _, content, _ in results}
    assert statuses == {201}, results
    assert len(bodies) == 1
    # Exactly one racer evaluated; every other one replayed the winner's stored response.
    assert sorted(replayed or "" for _, _, replayed in results) == [""] + ["true"] * (n - 1)
    task_id = results[0][1].decode()
    assert Task.objects.count() == 1
    task = Task.objects.get()
    assert str(task.id) in task_id
    assert Operation.objects.count() == 1
    assert OutboxMessage.objects.filter(kind="start").count() == 1
    assert IdempotencyRecord.objects.filter(owner=owner, key=key).count() == 1
    assert Budget.objects.get(owner=owner).reserved_s == task.max_runtime_s == 1800


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a4_32_identical_requests_get_one_byte_equal_201(owner, machine, grant, grant_root):
    _identical_race(owner, machine, grant_root / "repo", 32)


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_a4_identical_requests_on_sqlite_wait_for_the_winner(owner, machine, grant, grant_root):
    _identical_race(owner, machine, grant_root / "repo", 8)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a3_a4_16_same_key_different_bodies_one_201_fifteen_422(owner, machine, grant, grant_root):
    key = f"k-{uuid.uuid4()}"
    results = race(16, lambda i: body_of(submit(owner, machine, grant_root / f"repo-{i}", key=key)))
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [201] + [422] * 15
    for status, content, _ in results:
        if status == 422:
            assert b'"idempotency_key_reused"' in content
    assert Task.objects.count() == 1
    assert Operation.objects.count() == OutboxMessage.objects.count() == 1
    assert Budget.objects.get(owner=owner).reserved_s == 1800


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a4_rejected_winner_lets_each_racer_be_evaluated_on_its_own(owner, machine, grant, grant_root):
    """Identical racers against an exhausted budget: nobody stores anything, every racer
    gets its own 409, and the key still works afterwards (A4, A5)."""
    Budget.objects.filter(owner=owner).update(limit_s=100)
    key = f"k-{uuid.uuid4()}"
    results = race(8, lambda i: body_of(submit(owner, machine, grant_root, key=key)))
    assert {(status, replayed) for status, _, replayed in results} == {(409, None)}
    assert IdempotencyRecord.objects.count() == 0 and Task.objects.count() == 0
    Budget.objects.filter(owner=owner).update(limit_s=36000)
    assert submit(owner, machine, grant_root, key=key).status_code == 201


# --- A8: folder locks ------------------------------------------------------------------


def _assert_one_winner_rest_locked(owner, results):
    winners = [content for status, content, _ in results if status == 201]
    assert len(winners) == 1, [r[:2] for r in results]
    winner = Task.objects.get()
    for status, content, _ in results:
        if status != 201:
            assert status == 409
            assert b'"folder_locked"' in content
            assert str(winner.id).encode() in content
    assert Operation.objects.count() == OutboxMessage.objects.count() == IdempotencyRecord.objects.count() == 1
    assert Budget.objects.get(owner=owner).reserved_s == winner.reserved_s == 1800


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a8_32_keys_same_exclusive_folder_one_201_rest_folder_locked(owner, machine, grant, grant_root):
    results = race(32, lambda i: body_of(submit(owner, machine, grant_root / "repo")))
    _assert_one_winner_rest_locked(owner, results)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a8_folder_and_subfolder_racing_one_wins(owner, machine, grant, grant_root):
    """Half the racers ask for a folder, half for a folder below it: the per-machine lock
    makes the check and the insert one step, so only one of all 32 is accepted."""
    folders = [grant_root / "repo", grant_root / "repo" / "src" / "deep"]
    results = race(32, lambda i: body_of(submit(owner, machine, folders[i % 2])))
    _assert_one_winner_rest_locked(owner, results)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a8_non_exclusive_racers_take_no_lock(owner, machine, grant, grant_root):
    results = race(8, lambda i: body_of(submit(owner, machine, grant_root, exclusive=False, max_runtime_s=60)))
    assert [r[0] for r in results] == [201] * 8
    assert Task.objects.filter(holds_lock=True).count() == 0
    assert Budget.objects.get(owner=owner).reserved_s == 8 * 60


# --- budget --------------------------------------------------------------------------


def _budget_race(owner, machine, grant_root, n, fits):
    Budget.objects.filter(owner=owner).update(limit_s=fits * 600 + 599)
    results = race(n, lambda i: body_of(submit(owner, machine, grant_root / f"f{i}", max_runtime_s=600)))
    statuses = sorted(status for status, _, _ in results)
    assert statuses == [201] * fits + [409] * (n - fits)
    assert all(b'"budget_exhausted"' in content for status, content, _ in results if status == 409)
    budget = Budget.objects.get(owner=owner)
    assert budget.reserved_s == fits * 600 <= budget.limit_s
    assert Task.objects.count() == Operation.objects.count() == OutboxMessage.objects.count() == fits
    assert sum(Task.objects.values_list("reserved_s", flat=True)) == budget.reserved_s


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_a5_budget_race_exactly_n_accepted_never_over_limit(owner, machine, grant, grant_root):
    _budget_race(owner, machine, grant_root, 24, 7)


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_a5_budget_race_on_sqlite(owner, machine, grant, grant_root):
    _budget_race(owner, machine, grant_root, 8, 3)


# --- P1: revocation vs acceptance --------------------------------------------------------

PG_ORDER_SQL = [
    "CREATE SEQUENCE race_order_seq",
    "CREATE TABLE race_order (seq bigint NOT NULL, kind text NOT NULL, machine_id uuid NOT NULL, grant_id uuid)",
    """CREATE FUNCTION race_order_accept() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN INSERT INTO race_order VALUES (nextval('race_order_seq'), 'accept', NEW.machine_id, NEW.grant_id);
       RETURN NULL; END $$""",
    """CREATE FUNCTION race_order_revoke() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN INSERT INTO race_order VALUES (nextval('race_order_seq'), 'revoke', NEW.machine_id, NEW.id);
       RETURN NULL; END $$""",
    """CREATE FUNCTION race_order_unpair() RETURNS trigger LANGUAGE plpgsql AS $$
       BEGIN INSERT INTO race_order VALUES (nextval('race_order_seq'), 'revoke', NEW.id, NULL);
       RETURN NULL; END $$""",
    # AFTER ROW triggers run inside the transaction, after the row's FK checks (RI_*
    # triggers sort first), while it holds its lock on the grant / machine row: KEY SHARE
    # (acceptance) or FOR UPDATE (revocation, unpairing). Those conflict, so of two
    # numbers on the same row the smaller one's transaction ended first.
    """CREATE TRIGGER race_order_accept AFTER INSERT ON tasks_app_task
       FOR EACH ROW EXECUTE FUNCTION race_order_accept()""",
    """CREATE TRIGGER race_order_revoke AFTER UPDATE OF revoked_at ON tasks_app_grant
       FOR EACH ROW WHEN (OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL)
       EXECUTE FUNCTION race_order_revoke()""",
    """CREATE TRIGGER race_order_unpair AFTER UPDATE OF paired ON tasks_app_machine
       FOR EACH ROW WHEN (OLD.paired AND NOT NEW.paired)
       EXECUTE FUNCTION race_order_unpair()""",
]
PG_ORDER_DROP = [
    "DROP TRIGGER IF EXISTS race_order_accept ON tasks_app_task",
    "DROP TRIGGER IF EXISTS race_order_revoke ON tasks_app_grant",
    "DROP TRIGGER IF EXISTS race_order_unpair ON tasks_app_machine",
    "DROP FUNCTION IF EXISTS race_order_accept()",
    "DROP FUNCTION IF EXISTS race_order_revoke()",
    "DROP FUNCTION IF EXISTS race_order_unpair()",
    "DROP TABLE IF EXISTS race_order",
    "DROP SEQUENCE IF EXISTS race_order_seq",
]
# On SQLite every writer holds the whole database from BEGIN IMMEDIATE to COMMIT, so an
# AUTOINCREMENT id assigned inside the transaction is the commit order.
SQLITE_ORDER_SQL = [
    "CREATE TABLE race_order (seq INTEGER PRIMARY KEY AUTOINCREMENT, kind TEXT NOT NULL, machine_id TEXT NOT NULL, grant_id TEXT)",
    """CREATE TRIGGER race_order_accept AFTER INSERT ON tasks_app_task
       BEGIN INSERT INTO race_order (kind, machine_id, grant_id) VALUES ('accept', NEW.machine_id, NEW.grant_id); END""",
    """CREATE TRIGGER race_order_revoke AFTER UPDATE OF revoked_at ON tasks_app_grant
       WHEN OLD.revoked_at IS NULL AND NEW.revoked_at IS NOT NULL
       BEGIN INSERT INTO race_order (kind, machine_id, grant_id) VALUES ('revoke', NEW.machine_id, NEW.id); END""",
    """CREATE TRIGGER race_order_unpair AFTER UPDATE OF paired ON tasks_app_machine
       WHEN OLD.paired AND NOT NEW.paired
       BEGIN INSERT INTO race_order (kind, machine_id, grant_id) VALUES ('revoke', NEW.id, NULL); END""",
]
SQLITE_ORDER_DROP = [
    "DROP TRIGGER IF EXISTS race_order_accept",
    "DROP TRIGGER IF EXISTS race_order_revoke",
    "DROP TRIGGER IF EXISTS race_order_unpair",
    "DROP TABLE IF EXISTS race_order",
]


def _execute(statements):
    with connection.cursor() as cursor:
        for sql in statements:
            cursor.execute(sql)


def _revocation_race(owner, grant_root, rounds, *, unpair=False):
    """``rounds`` rounds of revoke (or unpair) vs accept, released together by a barrier.
    Each round has its own machine and grant, so rounds are independent. Asserts every
    round against the order the database recorded; returns (accepted, refused) counts."""
    is_pg = connection.vendor == "postgresql"
    _execute(PG_ORDER_DROP if is_pg else SQLITE_ORDER_DROP)
    _execute(PG_ORDER_SQL if is_pg else SQLITE_ORDER_SQL)
    try:
        outcomes = _run_rounds(owner, grant_root, rounds, unpair=unpair)
        with connection.cursor() as cursor:
            cursor.execute("SELECT seq, kind, machine_id FROM race_order")
            rows = cursor.fetchall()
    finally:
        _execute(PG_ORDER_DROP if is_pg else SQLITE_ORDER_DROP)

    order: dict = {}  # machine id (32 hex) -> {"accept": seq, "revoke": seq}
    for seq, kind, machine_id in rows:
        order.setdefault(uuid.UUID(str(machine_id)).hex, {})[kind] = seq
    accepted = refused = 0
    for machine_id, grant_id, status, content in outcomes:
        seen = order[machine_id.hex]
        tasks = list(Task.objects.filter(machine_id=machine_id))
        if status == 201:
            accepted += 1
            # The heart of P1: the acceptance committed before the revocation did.
            assert seen["accept"] < seen["revoke"], (machine_id, seen)
            assert len(tasks) == 1 and tasks[0].grant_id == grant_id
            # P3: the revocation that followed made the never-leased task not_started.
            assert tasks[0].state == "not_started" and not tasks[0].holds_lock, tasks[0].state
        else:
            refused += 1
            code = b'"machine_unpaired"' if unpair else b'"folder_not_granted"'
            assert code in content and status == (409 if unpair else 403), (status, content)
            assert tasks == [] and "accept" not in seen, seen
    # Never a task accepted under a grant (machine) whose revocation committed first.
    assert all(seen["accept"] < seen["revoke"] for seen in order.values() if "accept" in seen)
    assert IdempotencyRecord.objects.count() == Task.objects.count() == accepted
    assert Budget.objects.get(owner=owner).reserved_s == 0  # every accepted task released by P3
    return accepted, refused


def _run_rounds(owner, grant_root, rounds, *, unpair):
    from tasks_app.auth import token_digest
    from tasks_app.models import Machine

    state: dict = {}
    outcomes = []  # (machine id, grant id, accept status, accept body)
    jitter = random.Random(1234)

    def new_round():
        # Barrier action: runs in one racer on its own (autocommit) connection, so these
        # rows are committed before both racers are released.
        i = state["i"] = state.get("i", -1) + 1
        machine = Machine.objects.create(
            owner=owner, name=f"m{i}", generation=1, token_hash=token_digest(uuid.uuid4().hex), paired=True
        )
        folder = grant_root / f"round-{i}"
        state.update(
            machine=machine,
            folder=folder,
            grant=Grant.objects.create(owner=owner, machine=machine, path=str(folder)),
            # The acceptance does more before it reaches the grant row than the revocation,
            # so the revocation mostly waits a little: spread over the acceptance's time,
            # every interleaving happens, including each one blocking on the other's lock.
            delay=("revoke", jitter.random() * 0.025) if jitter.random() < 0.85 else ("accept", jitter.random() * 0.003),
        )

    start = threading.Barrier(2, action=new_round)
    end = threading.Barrier(2)
    errors = []

    def loop(me, act):
        try:
            connection.ensure_connection()
            client = owner_api(owner)
            for _ in range(rounds):
                start.wait(timeout=JOIN_TIMEOUT_S)
                who, delay = state["delay"]
                if who == me:
                    threading.Event().wait(delay)
                act(client)
                end.wait(timeout=JOIN_TIMEOUT_S)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
            start.abort()
            end.abort()
        finally:
            connection.close()

    def accept(client):
        machine, grant = state["machine"], state["grant"]
        resp = submit(owner, machine, state["folder"] / "sub", max_runtime_s=60)
        outcomes.append((machine.id, grant.id, resp.status_code, resp.content))

    def revoke(client):
        if unpair:
            resp = client.post(f"/api/machines/{state['machine'].id}/unpair/")
        else:
            resp = client.post(f"/api/grants/{state['grant'].id}/revoke/")
        assert resp.status_code == 200, resp.content

    threads = [
        threading.Thread(target=loop, args=("accept", accept), daemon=True),
        threading.Thread(target=loop, args=("revoke", revoke), daemon=True),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(JOIN_TIMEOUT_S * 2)
    assert not any(t.is_alive() for t in threads), "a racer hung"
    assert not errors, errors
    assert len(outcomes) == rounds
    return outcomes


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_p1_revocation_race_200_rounds_never_accepts_under_a_committed_revocation(owner, grant_root):
    accepted, refused = _revocation_race(owner, grant_root, 200)
    # Both orders really happened, so the rounds were races.
    assert accepted > 0 and refused > 0, (accepted, refused)


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_p1_unpair_race_never_accepts_on_an_unpaired_machine(owner, grant_root):
    accepted, refused = _revocation_race(owner, grant_root, 60, unpair=True)
    assert accepted + refused == 60


@sqlite_only
@pytest.mark.django_db(transaction=True)
def test_p1_revocation_race_on_sqlite_with_begin_immediate(owner, grant_root):
    accepted, refused = _revocation_race(owner, grant_root, 40)
    assert accepted + refused == 40


# --- P2: deadlocks are retried ---------------------------------------------------------


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_p2_deadlock_is_retried(owner, make_owner):
    """Two transactions lock two budget rows in opposite orders: PostgreSQL kills one with
    40P01 and ``retry_on_deadlock`` runs it again, so both finish."""
    other = make_owner()
    ids = [Budget.objects.get(owner=owner).pk, Budget.objects.get(owner=other).pk]
    attempts = {0: 0, 1: 0}
    meet = threading.Barrier(2)

    def make(i):
        @deadlocks.retry_on_deadlock
        def crossed():
            attempts[i] += 1
            with transaction.atomic():
                first, second = (ids[0], ids[1]) if i == 0 else (ids[1], ids[0])
                Budget.objects.select_for_update().get(pk=first)
                if attempts[i] == 1:
                    meet.wait(timeout=10)  # both hold their first row
                Budget.objects.select_for_update().get(pk=second)
                return i

        return crossed

    results = race(2, lambda i: make(i)())
    assert sorted(results) == [0, 1]
    assert sorted(attempts.values()) == [1, 2]  # one was the deadlock victim and ran again


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_p2_deadlock_inside_an_outer_transaction_is_not_retried(owner, make_owner):
    """Retrying inside someone else's atomic block would run on an aborted transaction:
    the error goes up instead."""
    other = make_owner()
    ids = [Budget.objects.get(owner=owner).pk, Budget.objects.get(owner=other).pk]
    meet = threading.Barrier(2)
    calls = []

    @deadlocks.retry_on_deadlock
    def inner(first, second):
        calls.append(first)
        Budget.objects.select_for_update().get(pk=first)
        meet.wait(timeout=10)
        Budget.objects.select_for_update().get(pk=second)

    def work(i):
        try:
            with transaction.atomic():
                inner(*(ids if i == 0 else ids[::-1]))
            return "ok"
        except OperationalError as exc:
            assert deadlocks.is_deadlock(exc)
            return "deadlock"

    assert sorted(race(2, work)) == ["deadlock", "ok"]
    assert len(calls) == 2


@pytest.mark.django_db(transaction=True)
def test_p1_for_key_share_needs_an_atomic_block():
    with pytest.raises(transaction.TransactionManagementError):
        locking.for_key_share(Grant.objects.all())


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_p1_for_key_share_blocks_for_update_but_not_last_heard_at(owner, machine, grant):
    """The helper really takes KEY SHARE: a revocation's FOR UPDATE cannot get the rows,
    while ``last_heard_at`` (a no-key UPDATE, P2) goes through at once."""
    from django.db import DatabaseError

    from tasks_app.models import Machine

    seen = {}

    def other_connection():
        try:
            with transaction.atomic():
                with connection.cursor() as cursor:
                    cursor.execute("SET LOCAL lock_timeout = '2s'")
                Machine.objects.filter(pk=machine.pk).update(last_heard_at=T_HEARD)
                seen["heard"] = True
            for model, pk in ((Grant, grant.pk), (Machine, machine.pk)):
                try:
                    with transaction.atomic():
                        model.objects.select_for_update(nowait=True).get(pk=pk)
                    seen[model.__name__] = "locked it"
                except DatabaseError:
                    seen[model.__name__] = "refused"
        finally:
            connection.close()

    with transaction.atomic():
        assert [m.pk for m in locking.for_key_share(Machine.objects.filter(pk=machine.pk))] == [machine.pk]
        assert [g.pk for g in locking.for_key_share(Grant.objects.filter(pk=grant.pk))] == [grant.pk]
        thread = threading.Thread(target=other_connection)
        thread.start()
        thread.join(10)
    assert seen == {"heard": True, "Grant": "refused", "Machine": "refused"}


@pytest.mark.postgres
@pytest.mark.django_db(transaction=True)
def test_p2_starting_and_running_receipts_apply_while_the_budget_row_is_locked(owner, machine, grant):
    """Issue 44: every task of a busy machine reports ``starting`` and ``running``, and
    neither can settle the budget (J4), so neither takes the budget row before the task's
    (P2 allows leaving a row of the order out, never taking one out of order): while
    another transaction holds the owner's budget FOR UPDATE, both apply at once. (With
    the budget locked first, each waited for the holder; here it would fail on the 2 s
    lock timeout.)"""
    task_id = submit(owner, machine, grant.path, exclusive=False).json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    held, release = threading.Event(), threading.Event()

    def holder():
        try:
            with transaction.atomic():
                Budget.objects.select_for_update().get(owner=owner)
                held.set()
                release.wait(JOIN_TIMEOUT_S)
        finally:
            connection.close()

    thread = threading.Thread(target=holder)
    thread.start()
    try:
        assert held.wait(JOIN_TIMEOUT_S)
        with connection.cursor() as cursor:
            cursor.execute("SET lock_timeout = '2s'")
        answers = [receipt(machine, task_id, kind, facts).json()
                   for kind, facts in (("starting", {}), ("running", {"pid": 7, "pgid": 7}))]
        assert answers == [{"outcome": "applied"}] * 2
        assert Task.objects.get(pk=task_id).state == "running"
    finally:
        release.set()
        thread.join(JOIN_TIMEOUT_S)
        with connection.cursor() as cursor:
            cursor.execute("RESET lock_timeout")
