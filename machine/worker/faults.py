"""Named fault-injection points for crash tests (issue 5).

Only active when the environment variable ``RUNSTEAD_WORKER_FAULT`` names a point; the
worker then dies right there with ``os._exit`` (no cleanup, no flush, like a crash). The
agent never inherits the variable.

In-process tests use ``crash_at(point)`` instead: the thread that reaches the point
raises ``InjectedCrash`` (a ``BaseException``, so no ``except Exception`` swallows it)
and nothing after the point runs in that thread.
"""
import os
import sys
from contextlib import contextmanager

ENV = "RUNSTEAD_WORKER_FAULT"
EXIT_CODE = 97

POINTS = frozenset(
    {
        "after_commit_before_ack",
        "after_ack_before_lease",
        "after_starting_commit_before_spawn",
        "after_spawn_before_pid_commit",
        "while_agent_runs",
        "after_exit_before_final_receipt",
        # G7: a merge's move of the base branch recorded, not made; made, not reported.
        "integrate_after_plan_before_merge",
        "integrate_after_merge_before_receipt",
        # C3: a later message's inbox number recorded, its file not yet written.
        "conversation_after_record_before_write",
    }
)


_in_process: set[str] = set()


class InjectedCrash(BaseException):
    """An in-process crash at a named point (tests only)."""


@contextmanager
def crash_at(point: str):
    """While active, a thread reaching ``point`` raises ``InjectedCrash``."""
    assert point in POINTS, point
    _in_process.add(point)
    try:
        yield
    finally:
        _in_process.discard(point)


def active_point() -> str | None:
    point = os.environ.get(ENV, "").strip()
    return point or next(iter(_in_process), None)


def fault(point: str) -> None:
    """Die here (exit code 97) if the environment names this point."""
    assert point in POINTS, point
    if point in _in_process:
        raise InjectedCrash(point)
    if os.environ.get(ENV, "").strip() == point:
        sys.stderr.write(f"runstead worker: fault injection at {point}, dying now\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
