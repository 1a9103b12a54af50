"""The one wait primitive (``core/longpoll/``; D1, D2, W5, Q3), on its own: a resource
that is not the outbox (an approval-like state that turns from ``pending`` to decided)
waits, is woken by ``notify``, times out with its last take, is superseded, releases what
a cancelled take took; the async and the sync form alike. The worker long-poll on a real
daphne is in ``tests/test_longpoll.py``."""
import asyncio
import threading
import time
import uuid

import pytest

from core.longpoll import Wait, notify, take_or_wait, take_or_wait_sync, waiting
from tests.wait import wait_for, wait_for_async

# channels_redis binds its receive state to one event loop; each test has its own loop.
pytestmark = pytest.mark.usefixtures("fresh_layer")

DEADLINE_S = 5.0


class Approval:
    """A stand-in resource: its take reads the state, ``decide`` changes it."""

    def __init__(self):
        self.key = f"approval.{uuid.uuid4()}"
        self.state = "pending"
        self.takes: list[bool] = []

    def take(self, first: bool) -> str:
        self.takes.append(first)
        return self.state

    def wait(self, timeout_s: float, **options) -> Wait:
        return Wait(key=self.key, take=self.take, timeout_s=timeout_s, done=lambda state: state != "pending", **options)


async def until_waiting(key: str, count: int = 1) -> None:
    """Until ``count`` waits of ``key`` are waiting (the registry's count, D2)."""
    await wait_for_async(lambda: waiting(key), until=lambda n: n == count, timeout_s=DEADLINE_S, interval_s=0.01,
                         what=f"{count} waits of {key} waiting")


def until_waiting_sync(key: str, count: int = 1) -> None:
    """``until_waiting`` for a test without an event loop."""
    wait_for(lambda: waiting(key), until=lambda n: n == count, timeout_s=DEADLINE_S, interval_s=0.01,
             what=f"{count} waits of {key} waiting")


@pytest.mark.asyncio
async def test_q3_waiting_take_answers_when_notified_not_on_the_recheck():
    approval = Approval()
    pull = asyncio.create_task(take_or_wait(approval.wait(20)))
    await until_waiting(approval.key)
    approval.state = "allowed"
    started = time.monotonic()
    await asyncio.to_thread(notify, approval.key)  # as a service's on_commit callback does
    assert await asyncio.wait_for(pull, DEADLINE_S) == "allowed"
    assert time.monotonic() - started < 2  # the safety re-check runs every 5 s
    assert approval.takes == [True, False]
    assert waiting(approval.key) == 0


@pytest.mark.asyncio
async def test_q3_wait_without_an_answer_returns_its_last_take_at_the_timeout():
    approval = Approval()
    started = time.monotonic()
    assert await take_or_wait(approval.wait(0.3)) == "pending"
    assert 0.3 <= time.monotonic() - started < 2
    assert approval.takes == [True]  # nothing woke it: no second take
    assert await take_or_wait(approval.wait(0)) == "pending"  # wait=0: one take, no wait


@pytest.mark.asyncio
async def test_w5_newer_exclusive_wait_supersedes_the_older_which_returns_at_once():
    approval = Approval()
    older = asyncio.create_task(take_or_wait(approval.wait(20, exclusive=True)))
    await until_waiting(approval.key)
    newer = asyncio.create_task(take_or_wait(approval.wait(20, exclusive=True)))
    assert await asyncio.wait_for(older, DEADLINE_S) == "pending"
    await until_waiting(approval.key)  # the newer one waits on
    approval.state = "denied"
    await asyncio.to_thread(notify, approval.key)
    assert await asyncio.wait_for(newer, DEADLINE_S) == "denied"


@pytest.mark.asyncio
async def test_d1_cancelled_wait_releases_what_its_take_took():
    key = f"machine.{uuid.uuid4()}"
    taking, finish = threading.Event(), threading.Event()
    released = []

    def take(first):
        taking.set()
        finish.wait(DEADLINE_S)
        return ["message-1"]

    pull = asyncio.create_task(take_or_wait(Wait(key=key, take=take, timeout_s=20, release=released.append)))
    assert await asyncio.to_thread(taking.wait, DEADLINE_S)
    pull.cancel()  # the client went away while the take ran
    await asyncio.wait({pull})
    assert pull.cancelled()
    finish.set()
    await wait_for_async(lambda: released, timeout_s=DEADLINE_S, interval_s=0.01,
                         what="the release of what the cancelled take took")
    assert released == [["message-1"]]
    assert waiting(key) == 0


@pytest.mark.asyncio
async def test_w5_wait_superseded_while_its_take_ran_gives_back_what_it_took():
    """The older pull's take claims a message while a newer pull begins (its first take
    ran before the claim, so it found nothing): by W5 the older client is gone, so the
    older wait answers ``empty`` and gives the message back, which wakes the newer."""
    key = f"machine.{uuid.uuid4()}"
    outbox: list[str] = []
    taking, finish = threading.Event(), threading.Event()
    released = []

    def older_take(first):
        if first:
            return []
        taking.set()
        finish.wait(DEADLINE_S)  # the claim is made; the newer pull starts meanwhile
        return ["message-1"]

    def release(taken):
        released.append(taken)
        outbox.extend(taken)
        notify(key)

    def newer_take(first):
        taken, outbox[:] = list(outbox), []
        return taken

    older = asyncio.create_task(take_or_wait(Wait(key=key, take=older_take, timeout_s=20, exclusive=True,
                                                  release=release, empty=[])))
    await until_waiting(key)
    await asyncio.to_thread(notify, key)
    assert await asyncio.to_thread(taking.wait, DEADLINE_S)
    newer = asyncio.create_task(take_or_wait(Wait(key=key, take=newer_take, timeout_s=20, exclusive=True,
                                                  release=release, empty=[])))
    await until_waiting(key)  # the newer's first take found nothing
    finish.set()
    assert await asyncio.wait_for(older, DEADLINE_S) == []
    assert released == [["message-1"]]
    assert await asyncio.wait_for(newer, DEADLINE_S) == ["message-1"]
    assert waiting(key) == 0


def test_q3_sync_form_waits_is_woken_and_superseded_the_same_way(monkeypatch):
    monkeypatch.setattr("core.longpoll.perform.SYNC_RECHECK_S", 30)  # only the notification can answer in time
    approval = Approval()
    answers = []
    older = threading.Thread(target=lambda: answers.append(take_or_wait_sync(approval.wait(20, exclusive=True))))
    older.start()
    until_waiting_sync(approval.key)
    newer = threading.Thread(target=lambda: answers.append(take_or_wait_sync(approval.wait(20, exclusive=True))))
    newer.start()
    older.join(DEADLINE_S)
    assert answers == ["pending"]  # superseded: the older one returned its last take
    until_waiting_sync(approval.key)
    approval.state = "allowed"
    started = time.monotonic()
    notify(approval.key)
    newer.join(DEADLINE_S)
    assert answers == ["pending", "allowed"]
    assert time.monotonic() - started < 2
    assert approval.takes == [True, True, False]  # each first take, then the woken one
    assert waiting(approval.key) == 0


@pytest.mark.parametrize("key", ["machine/1", "", "x" * 91, "approval 1"])
def test_wait_key_must_be_a_channel_group_name(key):
    with pytest.raises(ValueError, match="wait key"):
        Wait(key=key, take=lambda first: None, timeout_s=1)


@pytest.mark.asyncio
async def test_d2_pump_ends_when_its_loop_closes_even_if_the_layer_turns_the_cancel_into_an_error(monkeypatch):
    """Seen in CI on PostgreSQL: closing a test's event loop cancelled the pump's reader
    while channels_redis read from Redis, redis-py reported it as its own read timeout,
    and the reader retried forever, so the loop never closed. The layer here is a stand-in
    that does exactly that (a real Redis does it only under a race); the reader must end."""
    from core.longpoll import loops

    class CancelSwallowingLayer:
        async def new_channel(self):
            return "specific.test!one"

        async def receive(self, channel):
            try:
                await asyncio.Event().wait()
            except asyncio.CancelledError:
                raise TimeoutError("Timeout reading from 127.0.0.1:6390") from None

    monkeypatch.setattr(loops, "layer_is_remote", lambda: True)
    monkeypatch.setattr(loops, "get_channel_layer", lambda: CancelSwallowingLayer())
    pump = loops.Pump(asyncio.get_running_loop())
    await asyncio.wait_for(pump.channel_ready.wait(), DEADLINE_S)
    tasks = set(pump.tasks)
    for task in tasks:
        task.cancel()
    done, pending = await asyncio.wait(tasks, timeout=DEADLINE_S)
    assert not pending and all(task.cancelled() for task in done)


async def _nothing_to_warm(found, scope):
    return None


@pytest.mark.asyncio
async def test_d2_long_poll_starts_are_admitted_a_few_at_a_time(settings, monkeypatch):
    """A wave of pull starts (every worker after a restart) runs at most
    ``RUNSTEAD_LONGPOLL_START_SLOTS`` views at once per process: the rest queue behind
    them, not in front of the API's requests. Ten requests, two slots, real pool threads."""
    from django.http import JsonResponse

    from core.longpoll import router

    settings.RUNSTEAD_LONGPOLL_START_SLOTS = 2
    lock, active, peak = threading.Lock(), [0], [0]

    def view(found, scope):  # stands in for the authorisation and the first take
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.05)
        with lock:
            active[0] -= 1
        return JsonResponse({"messages": []})

    monkeypatch.setattr(router, "_dispatch", view)
    monkeypatch.setattr(router, "_quick_start", lambda found, scope: None)  # every start goes to the view
    monkeypatch.setattr(router, "_warm", _nothing_to_warm)
    sent = []

    async def send(message):
        sent.append(message)

    async def receive():
        await asyncio.Event().wait()  # the client stays

    await asyncio.wait_for(asyncio.gather(*(router.long_poll(None, {}, receive, send) for _ in range(10))), DEADLINE_S)
    assert peak[0] == 2
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [200] * 10


@pytest.mark.asyncio
async def test_d1_a_key_woken_before_its_wait_began_takes_at_once_not_at_the_batchs_turn(settings):
    """Issue 44 (a task submitted in a reconnect wave, before its machine's pull came
    back): the wake-up found no waiter of its key here, so the key's next start makes
    its first take at once instead of joining the ``starts`` batch, whose next turn is
    ``RUNSTEAD_LONGPOLL_START_BATCH_S`` after the last; a key not woken still waits for it."""
    settings.RUNSTEAD_LONGPOLL_START_BATCH_S = 60
    calls: list[list[str]] = []

    def starts(waits: list[Wait]) -> set[str]:
        calls.append(sorted(wait.key for wait in waits))
        return set()

    first, woken, other = Approval(), Approval(), Approval()
    pending = [asyncio.create_task(take_or_wait(first.wait(20, starts=starts, empty="pending")))]
    await until_waiting(first.key)  # the batch's first call was made: its next turn is 60 s away
    woken.state = "allowed"
    await asyncio.to_thread(notify, woken.key)  # as the acceptance's on_commit does; nothing waits on it
    pending.append(asyncio.create_task(take_or_wait(other.wait(20, starts=starts, empty="pending"))))
    assert await asyncio.wait_for(take_or_wait(woken.wait(20, starts=starts, empty="pending")), DEADLINE_S) == "allowed"
    assert woken.takes == [True]
    assert calls == [[first.key]]  # ``other`` waits for the batch's turn; ``woken`` never joined it
    assert other.takes == []
    for task in pending:
        task.cancel()
    await asyncio.wait(pending, timeout=DEADLINE_S)


@pytest.mark.postgres  # Redis: a wake-up from another process comes through the key's group
@pytest.mark.asyncio
async def test_d1_a_wake_up_published_before_its_group_was_joined_is_found_once_the_join_is_done(settings, monkeypatch):
    """Issue 44 (10,000 workers on three daphnes: each joins its new keys' groups one
    after another): another process's wake-up sent while this loop's join of the key's
    group was still under way never arrives, so once the join is done the key is looked
    at again (its wait's ``ready``), not only at the next safety re-check (here 60 s)."""
    from channels.layers import get_channel_layer

    from core.longpoll.registry import group_name

    settings.RUNSTEAD_LONGPOLL_RECHECK_S = 60
    layer = get_channel_layer()
    joining, join = asyncio.Event(), asyncio.Event()
    group_add = layer.group_add

    async def slow_group_add(group, channel):
        if group != "waits-superseding":
            joining.set()
            await join.wait()
        return await group_add(group, channel)

    monkeypatch.setattr(layer, "group_add", slow_group_add)
    approval = Approval()
    pull = asyncio.create_task(take_or_wait(approval.wait(
        20, ready=lambda keys: {k for k in keys if approval.state != "pending"})))
    await until_waiting(approval.key)
    await asyncio.wait_for(joining.wait(), DEADLINE_S)  # the key's join is under way
    approval.state = "allowed"
    await layer.group_send(group_name(approval.key), {"type": "wait.wake", "key": approval.key})  # another process's notify
    join.set()
    assert await asyncio.wait_for(pull, DEADLINE_S) == "allowed"
    assert approval.takes == [True, False]


@pytest.mark.asyncio
async def test_d1_starts_of_one_event_loop_are_checked_together_and_only_found_keys_take(settings):
    """Issue 22 (1,000 idle workers, < 5 transactions/s): waits with ``starts`` that begin
    together on one event loop are started by one ``starts`` call (in the real pull, one
    transaction for all), at most one call per ``RUNSTEAD_LONGPOLL_START_BATCH_S``; only
    the keys it names make a first take, the others wait from ``empty`` and are still
    woken by ``notify``. A start that raises ends each wait of its batch with the error."""
    settings.RUNSTEAD_LONGPOLL_START_BATCH_S = 0.3
    calls: list[list[str]] = []
    approvals = [Approval() for _ in range(30)]
    ready = {approvals[0].key}  # has something at the start

    def starts(waits: list[Wait]) -> set[str]:
        calls.append(sorted(wait.key for wait in waits))
        return {wait.key for wait in waits} & ready

    approvals[0].state = "allowed"
    first = asyncio.create_task(take_or_wait(approvals[-1].wait(20, starts=starts, empty="pending")))
    await until_waiting(approvals[-1].key)  # a start after a quiet spell: checked at once
    pulls = [asyncio.create_task(take_or_wait(a.wait(20, starts=starts, empty="pending"))) for a in approvals[:-1]]
    for approval in approvals[1:-1]:
        await until_waiting(approval.key)
    assert await asyncio.wait_for(pulls[0], DEADLINE_S) == "allowed"
    assert calls == [[approvals[-1].key], sorted(a.key for a in approvals[:-1])]
    assert approvals[0].takes == [True]
    assert all(a.takes == [] for a in approvals[1:])  # nothing found: no take at all

    approvals[5].state = "denied"
    await asyncio.to_thread(notify, approvals[5].key)
    assert await asyncio.wait_for(pulls[5], DEADLINE_S) == "denied"
    assert approvals[5].takes == [False]
    for task in [first, *pulls]:
        task.cancel()
    await asyncio.wait([first, *pulls], timeout=DEADLINE_S)

    def broken(waits):
        raise RuntimeError("database down")

    failing = [asyncio.create_task(take_or_wait(Approval().wait(20, starts=broken))) for _ in range(3)]
    results = await asyncio.wait_for(asyncio.gather(*failing, return_exceptions=True), DEADLINE_S)
    assert [type(r) for r in results] == [RuntimeError] * 3
