"""The facts table J6: the only place that maps how a process ended to a final state.

(The table's footnote, a refused renewal's ``stop_reason``, is the worker's to apply:
``machine.worker.wire.refusal_stop_reason``.)"""
from dataclasses import dataclass

from tasks_app.models import TaskState

# Budget outcomes of J4.
RELEASE = "release"  # certain the process never started: full release
RUNTIME = "runtime"  # charge runtime_s (capped at the reservation), release the rest
KEEP = "keep"  # stays unknown: reservation kept

@dataclass(frozen=True)
class Verdict:
    """``state`` is a final TaskState, or None when the facts leave the task ``unknown``."""

    state: str | None
    budget: str
    row: int | str  # J6 row number; "5a" for the agent's own verdict (G3)
    reason: str


def judge(facts: dict, *, leased: bool) -> Verdict:
    """Apply the J6 table (first matching row wins) to a final receipt's ``facts``
    (J1 shape: process_started true/false/"unknown", exit_code, signal,
    ended_within_lease, stop_reason, runtime_s; agent_result ``{is_error, subtype,
    summary}`` or None, G3). ``leased`` says whether the operation ever
    got a lease."""
    started = facts.get("process_started")
    stop = facts.get("stop_reason")
    exit_code = facts.get("exit_code")
    signal = facts.get("signal")
    if not leased or started is False:
        refused = facts.get("refused_reason")
        reason = "never leased" if not leased else "process not started"
        if refused:
            reason = f"refused by the worker: {refused}"  # W4, G1, G6
        return Verdict(TaskState.NOT_STARTED, RELEASE, 1, reason)
    if started is not True or (exit_code is None and signal is None):
        return Verdict(None, KEEP, 2, "process start or exit status unknown")
    if stop == "cancel":
        return Verdict(TaskState.CANCELLED, RUNTIME, 3, "cancelled")
    if facts.get("ended_within_lease") is False:
        return Verdict(TaskState.FAILED_LEASE_LOST, RUNTIME, 4, "ended after its lease was lost")
    if stop in ("deadline", "renewal_refused"):
        return Verdict(TaskState.FAILED_LEASE_LOST, RUNTIME, 5, f"stopped: {stop}")
    agent_result = facts.get("agent_result")
    if stop == "exit" and exit_code == 0 and signal is None and isinstance(agent_result, dict) \
            and agent_result.get("is_error") is True:
        # G3: some agent CLIs exit 0 after an API error; the agent's own verdict stands.
        return Verdict(TaskState.FAILED, RUNTIME, "5a", f"agent reported {agent_result.get('subtype') or 'error'}")
    if stop == "exit" and exit_code == 0 and signal is None:
        return Verdict(TaskState.SUCCEEDED, RUNTIME, 6, "exit 0")
    if stop == "exit" and exit_code == 1 and signal is None and isinstance(agent_result, dict) \
            and agent_result.get("subtype") == "interrupted" and agent_result.get("is_error") is False:
        # C4: a conversation whose last turn its owner stopped; Claude Code then exits 1
        # (its last turn's result is an error). The owner's stop is no failure of the agent.
        return Verdict(TaskState.SUCCEEDED, RUNTIME, "6c", "exit 1 after the owner interrupted its last turn")
    if stop == "exit":
        what = f"signal {signal}" if signal is not None else f"exit {exit_code}"
        return Verdict(TaskState.FAILED, RUNTIME, 7, what)
    if stop in ("max_runtime", "worker_shutdown", "worker_restart"):
        return Verdict(TaskState.FAILED, RUNTIME, 8, f"stopped: {stop}")
    return Verdict(None, KEEP, 2, f"unrecognised stop_reason {stop!r}")
