"""The tests' one wait helper (tests/wait.py, STYLE 15): it returns what it waited for,
fails with what it last saw, sees a condition that turns true later, and never sleeps
past its deadline."""
import asyncio
import itertools
import time

import pytest

from tests.wait import wait_for, wait_for_async

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)


def test_wait_returns_the_conditions_first_truthy_value():
    values = iter([None, 0, [], {"state": "running"}, {"state": "later"}])
    assert wait_for(lambda: next(values), interval_s=0) == {"state": "running"}


def test_wait_with_until_returns_the_value_that_satisfied_it():
    count = itertools.count()
    assert wait_for(lambda: next(count), until=lambda n: n >= 3, interval_s=0) == 3


def test_wait_fails_after_the_deadline_with_what_the_timeout_and_the_last_value():
    count = itertools.count()
    with pytest.raises(AssertionError) as failure:
        wait_for(lambda: {"seen": next(count), "state": "queued"}, until=lambda v: v["state"] == "running",
                 timeout_s=0.2, interval_s=0.01, what="the task to run", detail=lambda: "--- log ---")
    message = str(failure.value)
    assert "the task to run" in message and "0.2 s" in message
    last = int(message.split("'seen': ")[1].split(",")[0])
    assert last >= 5 and f"{{'seen': {last}, 'state': 'queued'}}" in message  # the last, not the first
    assert message.endswith("\n--- log ---")


def test_wait_sees_a_condition_that_becomes_true_later():
    ready_at = time.monotonic() + 0.2
    assert wait_for(lambda: time.monotonic() >= ready_at and "ready", timeout_s=5, interval_s=0.01) == "ready"


def test_wait_never_sleeps_past_the_deadline_and_checks_once_more_at_it():
    calls = []
    started = time.monotonic()
    with pytest.raises(AssertionError, match="last value: False"):
        wait_for(lambda: calls.append(time.monotonic()) or False, timeout_s=0.3, interval_s=10)
    assert time.monotonic() - started < 1.0  # not the 10 s interval
    assert len(calls) == 2 and calls[1] - started >= 0.3  # the first try, and one at the deadline


def test_wait_treats_an_ignored_error_as_not_yet_and_reports_the_last_one():
    tries = itertools.count()

    def flaky():
        if next(tries) < 3:
            raise ConnectionError("not up yet")
        return "up"

    assert wait_for(flaky, ignore=(ConnectionError,), interval_s=0) == "up"
    with pytest.raises(AssertionError, match=r"last error: ConnectionError\('refused'\)"):
        wait_for(lambda: (_ for _ in ()).throw(ConnectionError("refused")), ignore=(ConnectionError,), timeout_s=0.05)


def test_wait_lets_an_error_not_ignored_through_at_once():
    started = time.monotonic()
    with pytest.raises(ZeroDivisionError):
        wait_for(lambda: 1 / 0, timeout_s=5)
    assert time.monotonic() - started < 1.0


@pytest.mark.asyncio
async def test_async_wait_awaits_the_condition_and_lets_the_loop_run():
    flag = []
    asyncio.get_running_loop().call_later(0.1, flag.append, "set")

    async def read():
        return list(flag)

    assert await wait_for_async(read, timeout_s=5, interval_s=0.01) == ["set"]
    assert await wait_for_async(lambda: len(flag), timeout_s=1) == 1


@pytest.mark.asyncio
async def test_async_wait_fails_with_the_last_value_and_never_sleeps_past_the_deadline():
    started = time.monotonic()
    with pytest.raises(AssertionError, match=r"waiting for the flag; last value: \[\]"):
        await wait_for_async(lambda: [], timeout_s=0.2, interval_s=10, what="the flag")
    assert time.monotonic() - started < 1.0
