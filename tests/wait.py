"""The one way a test waits (STYLE 15: tests wait on facts): poll a condition until it
holds or a deadline passes, never sleep and hope.

``wait_for(condition, timeout_s=..., what=...)`` calls ``condition()`` every
``interval_s`` seconds and returns its first truthy value. After ``timeout_s`` seconds it
raises ``AssertionError`` naming ``what``, the timeout and the last value the condition
returned (or the last exception it raised, for the types listed in ``ignore``), so a
failure says what was seen, not only that it timed out. ``wait_for_async`` is the same
for a coroutine test: it sleeps with ``asyncio.sleep`` and awaits a condition that
returns an awaitable.

A condition that must stop the wait at once (the process it waits on died) asserts
inside the condition: an exception not in ``ignore`` propagates unchanged.
"""
import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any

LAST_VALUE_CHARS = 4000  # a failure message shows at most this much of the last value


def _seen(last: Any) -> str:
    """The last value for a failure message: a text of several lines (a screen) as it
    reads, anything else as its ``repr``, cut to ``LAST_VALUE_CHARS``."""
    if isinstance(last, BaseException):
        return f"last error: {last!r}"
    text = f"\n{last}" if isinstance(last, str) and "\n" in last else repr(last)
    return f"last value: {text[:LAST_VALUE_CHARS]}{' ...' if len(text) > LAST_VALUE_CHARS else ''}"


def _failure(what: str, timeout_s: float, last: Any, detail: Callable[[], str] | None) -> AssertionError:
    message = f"timed out after {timeout_s} s waiting for {what}; {_seen(last)}"
    if detail is not None:
        message += f"\n{detail()}"
    return AssertionError(message)


def wait_for(condition: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05,
             what: str = "the condition", until: Callable[[Any], Any] = bool,
             ignore: tuple[type[BaseException], ...] = (), detail: Callable[[], str] | None = None) -> Any:
    """The first value of ``condition()`` for which ``until(value)`` is truthy (by default
    the value itself), polled every ``interval_s`` seconds (wall time, monotonic clock)
    for at most ``timeout_s`` seconds. The condition runs at least once and once more at
    the deadline; no sleep reaches past the deadline.

    ``ignore``: exception types that mean "not yet" (a server still starting); the last
    one is reported. ``detail``: called once on failure, its text appended to the
    message (a worker log). Raises ``AssertionError`` with ``what``, ``timeout_s`` and
    the last value (or error) seen."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            last = condition()
            if until(last):
                return last
        except ignore as error:
            last = error
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout_s, last, detail)
        time.sleep(min(interval_s, left))


async def wait_for_async(condition: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05,
                         what: str = "the condition", until: Callable[[Any], Any] = bool,
                         ignore: tuple[type[BaseException], ...] = (),
                         detail: Callable[[], str] | None = None) -> Any:
    """``wait_for`` for a coroutine: sleeps with ``asyncio.sleep`` so the loop runs
    meanwhile, and awaits ``condition()`` when it returns an awaitable (an ORM ``aget``)."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            last = condition()
            if inspect.isawaitable(last):
                last = await last
            if until(last):
                return last
        except ignore as error:
            last = error
        left = deadline - time.monotonic()
        if left <= 0:
            raise _failure(what, timeout_s, last, detail)
        await asyncio.sleep(min(interval_s, left))
