"""The order in which a daphne's requests get into Django (core/admission.py ``Slots``;
issue 44, SPEC L2, D2): the real class on a real event loop, no server (tests/
test_admission.py has the daphne)."""
import asyncio

import pytest

from core.admission import OTHER, RENEWAL, Slots

pytestmark = pytest.mark.backend_independent


async def _queue(slots: Slots, klass: int, order: list, name: str, timeout_s: float = 5.0):
    """A request of ``klass`` that waits for a slot; ``name`` goes into ``order`` once it
    has one (False: it gave up)."""
    got = await slots.wait(klass, timeout_s)
    order.append(name if got else f"{name} gave up")


async def _until(fact, what: str, turns: int = 100):
    """Let the event loop run (no clock: each ``sleep(0)`` is one turn) until ``fact()``,
    at most ``turns`` turns."""
    for _ in range(turns):
        if fact():
            return
        await asyncio.sleep(0)
    raise AssertionError(f"{what}: not after {turns} turns of the loop")


def _waiting(slots: Slots) -> int:
    return sum(not future.done() for queue in slots.waiting.values() for future in queue)


def test_l2_a_freed_slot_goes_to_the_first_renewal_waiting_and_one_is_kept_for_other_requests():
    async def scenario():
        slots, order = Slots(3), []
        assert all(slots.take(OTHER) for _ in range(3)) and not slots.take(RENEWAL)
        waiting = [asyncio.create_task(_queue(slots, klass, order, name)) for klass, name in
                   ((OTHER, "read a"), (RENEWAL, "renewal 1"), (OTHER, "read b"), (RENEWAL, "renewal 2"),
                    (RENEWAL, "renewal 3"))]
        await _until(lambda: _waiting(slots) == 5, "five requests waiting")
        for expected in (["renewal 1"], ["renewal 1", "renewal 2"],
                         # renewals hold 2 of the 3 slots: the third goes to the read waiting longest
                         ["renewal 1", "renewal 2", "read a"]):
            slots.release(OTHER)
            await _until(lambda: len(order) == len(expected), "the freed slot handed over")
            assert order == expected
        slots.release(RENEWAL)  # a renewal left: renewal 3 before read b
        await _until(lambda: len(order) == 4, "the freed slot handed over")
        assert order[-1] == "renewal 3"
        slots.release(OTHER)
        await asyncio.gather(*waiting)
        assert order[-1] == "read b" and slots.free == 0 and slots.inside == {RENEWAL: 2, OTHER: 1}

    asyncio.run(scenario())


def test_l2_with_one_slot_renewals_go_first():
    async def scenario():
        slots, order = Slots(1), []
        assert slots.take(OTHER)
        waiting = [asyncio.create_task(_queue(slots, klass, order, name))
                   for klass, name in ((OTHER, "read"), (RENEWAL, "renewal"))]
        await _until(lambda: _waiting(slots) == 2, "two requests waiting")
        slots.release(OTHER)
        await _until(lambda: len(order) == 1, "the freed slot handed over")
        slots.release(RENEWAL)
        await asyncio.gather(*waiting)
        assert order == ["renewal", "read"]

    asyncio.run(scenario())


def test_d2_a_request_that_waits_too_long_gets_no_slot_and_the_next_one_gets_it():
    async def scenario():
        slots, order = Slots(1), []
        assert slots.take(OTHER)
        late = asyncio.create_task(_queue(slots, OTHER, order, "late", timeout_s=0.01))
        await late
        assert order == ["late gave up"]
        later = asyncio.create_task(_queue(slots, OTHER, order, "later"))
        await _until(lambda: _waiting(slots) == 1, "the next request waiting")
        slots.release(OTHER)
        await later
        assert order == ["late gave up", "later"] and slots.free == 0 and slots.inside == {RENEWAL: 0, OTHER: 1}
        slots.release(OTHER)
        assert slots.free == 1 and slots.take(RENEWAL)

    asyncio.run(scenario())
