"""Named fault-injection points for crash tests (issue 5).

Only active when the environment variable ``RUNSTEAD_WORKER_FAULT`` names a point; the
worker then dies right there with ``os._exit`` (no cleanup, no flush, like a crash). The
agent never inherits the variable.
"""
import os
import sys

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
    }
)


def active_point() -> str | None:
    point = os.environ.get(ENV, "").strip()
    return point or None


def fault(point: str) -> None:
    """Die here (exit code 97) if the environment names this point."""
    assert point in POINTS, point
    if active_point() == point:
        sys.stderr.write(f"runstead worker: fault injection at {point}, dying now\n")
        sys.stderr.flush()
        os._exit(EXIT_CODE)
