"""The facts table J6 and the budget rules J4, through the receipt API (SPEC J1-J6, L8).

Every row is driven from ``running`` and from ``unknown`` (the lease expired first), with
the budget numbers it must leave: the task reserves ``max_runtime_s`` = 1800 s at
acceptance; a final state charges ``runtime_s`` (capped at the reservation) and releases
the rest, or releases everything when the process certainly never started.
"""
import pytest

from core import clock
from tasks_app.models import Budget, OutboxMessage, Task, TaskEvent
from tasks_app.services.judging import judge
from machine.worker.wire import refusal_stop_reason
from tasks_app.services.sweeps import expire_leases
from tests.factories import final_facts, grant_lease, receipt, submit

pytestmark = pytest.mark.django_db

RESERVED = 1800.0


def budget_of(owner) -> tuple[float, float]:
    b = Budget.objects.get(owner=owner)
    return b.reserved_s, b.spent_s


def start_running(owner, machine, folder, **extra) -> str:
    resp = submit(owner, machine, folder, **extra)
    assert resp.status_code == 201, resp.content
    task_id = resp.json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", {"pid": 100, "pgid": 100, "process_start_time": 5.0}).json() == {
        "outcome": "applied"
    }
    assert Task.objects.get(pk=task_id).state == "running"
    return task_id


def lapse_to_unknown(pinned, task_id):
    """Let the lease lapse and run the sweep: the task becomes ``unknown`` (L6)."""
    pinned.shift(61)
    assert expire_leases(now=clock.now()) == 1
    assert Task.objects.get(pk=task_id).state == "unknown"


# (row, facts, final state, charged seconds of a 100 s runtime, state_reason shown)
ROWS = [
    ("row1_process_not_started", dict(process_started=False, exit_code=None, runtime_s=0.0, stop_reason="refused"),
     "not_started", 0.0),
    ("row3_cancel", dict(stop_reason="cancel", exit_code=None, signal=15), "cancelled", 100.0),
    ("row3_cancel_wins_over_lease_lost", dict(stop_reason="cancel", signal=15, exit_code=None, ended_within_lease=False),
     "cancelled", 100.0),
    ("row4_ended_outside_lease_is_failed_lease_lost", dict(ended_within_lease=False), "failed_lease_lost", 100.0),
    ("row5_deadline", dict(stop_reason="deadline", exit_code=None, signal=9), "failed_lease_lost", 100.0),
    ("row5_renewal_refused", dict(stop_reason="renewal_refused", exit_code=None, signal=15), "failed_lease_lost", 100.0),
    ("row5a_exit_zero_agent_is_error_failed",
     dict(agent_result={"is_error": True, "subtype": "error_during_execution", "summary": "API Error: 500"}),
     "failed", 100.0),
    ("row6_exit_zero_succeeded", dict(), "succeeded", 100.0),
    ("row6_exit_zero_agent_success_succeeded",
     dict(agent_result={"is_error": False, "subtype": "success", "summary": "done"}), "succeeded", 100.0),
    ("row7_nonzero_exit_failed", dict(exit_code=2), "failed", 100.0),
    ("row7_signal_failed", dict(exit_code=None, signal=9), "failed", 100.0),
    ("row8_max_runtime", dict(stop_reason="max_runtime", exit_code=None, signal=15), "failed", 100.0),
    ("row8_worker_shutdown", dict(stop_reason="worker_shutdown", exit_code=None, signal=15), "failed", 100.0),
    ("row8_worker_restart", dict(stop_reason="worker_restart", exit_code=None, signal=9), "failed", 100.0),
]


@pytest.mark.parametrize("start", ["running", "unknown"])
@pytest.mark.parametrize("name,overrides,state,charged", ROWS, ids=[r[0] for r in ROWS])
def test_j6_each_row_from_running_and_unknown_with_budget(
    owner, machine, grant, grant_root, pinned, start, name, overrides, state, charged
):
    task_id = start_running(owner, machine, grant_root)
    if start == "unknown":
        lapse_to_unknown(pinned, task_id)
    assert budget_of(owner) == (RESERVED, 0.0)

    resp = receipt(machine, task_id, "final", final_facts(**{"runtime_s": 100.0, **overrides}))
    assert resp.status_code == 200 and resp.json() == {"outcome": "applied"}

    task = Task.objects.get(pk=task_id)
    assert task.state == state
    assert task.charged_s == charged
    assert budget_of(owner) == (0.0, charged)  # J4: charge runtime (or nothing), release the rest
    assert not task.holds_lock  # folder lock released when final
    assert task.final_at == clock.now()
    last = TaskEvent.objects.filter(task=task).last()
    assert (last.old_state, last.new_state) == (start, state)
    assert "J6 row" in last.reason
    if name.startswith("row8"):
        assert overrides["stop_reason"] in task.state_reason  # "reason shown"
    if name.startswith("row5a"):
        assert "agent reported error_during_execution" in task.state_reason  # G3: the agent's subtype
    # The folder is free again: a new exclusive task on it is accepted (A8).
    assert submit(owner, machine, grant_root).status_code == 201


@pytest.mark.parametrize(
    "overrides",
    [dict(process_started="unknown"), dict(exit_code=None, signal=None)],
    ids=["process_started_unknown", "exit_status_unknown"],
)
def test_j6_row2_from_running_becomes_unknown_and_keeps_budget(owner, machine, grant, grant_root, pinned, overrides):
    task_id = start_running(owner, machine, grant_root)
    resp = receipt(machine, task_id, "final", final_facts(runtime_s=100.0, stop_reason="worker_restart", **overrides))
    assert resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert budget_of(owner) == (RESERVED, 0.0)  # kept
    assert task.holds_lock  # the folder stays locked while unknown
    assert task.runtime_s == 100.0  # recorded as evidence (U4)
    assert OutboxMessage.objects.filter(operation__task=task, kind="query").count() == 1  # U1


@pytest.mark.parametrize(
    "overrides",
    [dict(process_started="unknown"), dict(exit_code=None, signal=None)],
    ids=["process_started_unknown", "exit_status_unknown"],
)
def test_j6_row2_from_unknown_stays_unknown_and_keeps_budget(owner, machine, grant, grant_root, pinned, overrides):
    task_id = start_running(owner, machine, grant_root)
    lapse_to_unknown(pinned, task_id)
    events = TaskEvent.objects.filter(task_id=task_id).count()
    resp = receipt(machine, task_id, "final", final_facts(runtime_s=100.0, **overrides))
    assert resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "unknown"
    assert budget_of(owner) == (RESERVED, 0.0)
    assert task.holds_lock
    # Recorded, no transition; the facts cannot settle it, so its owner is asked (N1, U2).
    reasons = list(TaskEvent.objects.filter(task_id=task_id).values_list("reason", flat=True)[events:])
    assert len(reasons) == 2 and reasons[1].startswith("needs the owner's decision: final receipt: ")
    assert task.decision_asked_at is not None
    assert OutboxMessage.objects.filter(operation__task=task, kind="query").count() == 1  # no second query


def test_j2_late_final_within_lease_after_unknown_is_succeeded(owner, machine, grant, grant_root, pinned):
    task_id = start_running(owner, machine, grant_root)
    lapse_to_unknown(pinned, task_id)
    pinned.shift(300)  # the receipt arrives long after the service expired the lease
    resp = receipt(machine, task_id, "final", final_facts(runtime_s=55.0, ended_within_lease=True))
    assert resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert task.state == "succeeded"
    assert budget_of(owner) == (0.0, 55.0)


def test_j3_agent_that_ended_after_lease_lost_is_recorded_as_reported(owner, machine, grant, grant_root, pinned):
    task_id = start_running(owner, machine, grant_root)
    lapse_to_unknown(pinned, task_id)
    receipt(machine, task_id, "final", final_facts(runtime_s=90.0, exit_code=0, ended_within_lease=False))
    task = Task.objects.get(pk=task_id)
    assert task.state == "failed_lease_lost"
    assert (task.exit_code, task.runtime_s, task.stop_reason) == (0, 90.0, "exit")  # as reported


def test_j4_runtime_charge_is_capped_at_the_reservation(owner, machine, grant, grant_root, pinned):
    task_id = start_running(owner, machine, grant_root, max_runtime_s=100)
    assert budget_of(owner) == (100.0, 0.0)
    receipt(machine, task_id, "final", final_facts(runtime_s=250.0, stop_reason="max_runtime", exit_code=None, signal=15))
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.charged_s) == ("failed", 100.0)
    assert budget_of(owner) == (0.0, 100.0)


def test_j4_unknown_runtime_charges_the_whole_reservation(owner, machine, grant, grant_root, pinned):
    task_id = start_running(owner, machine, grant_root)
    receipt(machine, task_id, "final", final_facts(runtime_s=None, exit_code=1))
    assert Task.objects.get(pk=task_id).state == "failed"
    assert budget_of(owner) == (0.0, RESERVED)


def test_j6_row1_never_leased_final_is_not_started_with_full_release(owner, machine, grant, grant_root, pinned):
    """W4: the worker refused the start before asking for a lease."""
    task_id = submit(owner, machine, grant_root).json()["id"]
    resp = receipt(machine, task_id, "final", final_facts(process_started=False, exit_code=None, stop_reason="refused"))
    assert resp.json() == {"outcome": "applied"}
    task = Task.objects.get(pk=task_id)
    assert (task.state, task.holds_lock) == ("not_started", False)
    assert budget_of(owner) == (0.0, 0.0)


def test_j6_row1_never_leased_wins_over_claimed_facts(owner, machine, grant, grant_root, pinned):
    """A process that ran without a lease cannot have been started by the service: row 1."""
    task_id = submit(owner, machine, grant_root).json()["id"]
    receipt(machine, task_id, "final", final_facts(runtime_s=30.0))
    assert Task.objects.get(pk=task_id).state == "not_started"
    assert budget_of(owner) == (0.0, 0.0)


def test_l8_survivors_keep_the_folder_lock_after_final(owner, machine, grant, grant_root, pinned):
    task_id = start_running(owner, machine, grant_root)
    survivors = [{"pid": 4321, "start_time": 7.0, "cmdline": "sleep 999"}]
    receipt(machine, task_id, "final", final_facts(runtime_s=10.0, stop_reason="cancel", signal=15, exit_code=None,
                                                   survivors=survivors))
    task = Task.objects.get(pk=task_id)
    assert task.state == "cancelled"
    assert task.holds_lock and task.survivors == survivors
    assert budget_of(owner) == (0.0, 10.0)
    resp = submit(owner, machine, grant_root)
    assert resp.status_code == 409 and resp.json()["error"] == "folder_locked"


def test_j1_final_facts_are_kept_as_evidence(owner, machine, grant, grant_root, pinned):
    task_id = start_running(owner, machine, grant_root)
    facts = final_facts(runtime_s=42.0, exit_code=3, output_tail="boom\n")
    receipt(machine, task_id, "final", facts, slept_s=12.0)
    task = Task.objects.get(pk=task_id)
    assert (task.exit_code, task.runtime_s, task.stop_reason, task.output_tail, task.slept_s) == (
        3, 42.0, "exit", "boom\n", 12.0,
    )
    assert task.facts == facts


# The table itself, as a pure function: first matching row wins.
@pytest.mark.parametrize(
    "facts,leased,row,state",
    [
        (final_facts(), False, 1, "not_started"),
        (final_facts(process_started=False, stop_reason="cancel"), True, 1, "not_started"),
        (final_facts(process_started="unknown", stop_reason="cancel"), True, 2, None),
        (final_facts(exit_code=None, signal=None, stop_reason="cancel"), True, 2, None),
        (final_facts(stop_reason="cancel", ended_within_lease=False), True, 3, "cancelled"),
        (final_facts(stop_reason="deadline", ended_within_lease=False), True, 4, "failed_lease_lost"),
        (final_facts(stop_reason="renewal_refused"), True, 5, "failed_lease_lost"),
        (final_facts(agent_result={"is_error": True, "subtype": "api_error", "summary": ""}), True, "5a", "failed"),
        (final_facts(agent_result=None), True, 6, "succeeded"),
        (final_facts(agent_result={"is_error": False, "subtype": "success", "summary": ""}), True, 6, "succeeded"),
        (final_facts(), True, 6, "succeeded"),
        # 5a is about exit 0 only: a failing exit is row 7, a cancel row 3, a lost lease row 4/5.
        (final_facts(exit_code=2, agent_result={"is_error": True, "subtype": "x", "summary": ""}), True, 7, "failed"),
        (final_facts(stop_reason="cancel", agent_result={"is_error": True, "subtype": "x", "summary": ""}), True, 3,
         "cancelled"),
        (final_facts(stop_reason="deadline", agent_result={"is_error": True, "subtype": "x", "summary": ""}), True, 5,
         "failed_lease_lost"),
        (final_facts(exit_code=0, signal=15), True, 7, "failed"),
        (final_facts(stop_reason="worker_restart"), True, 8, "failed"),
    ],
)
def test_j6_judge_first_matching_row_wins(facts, leased, row, state):
    verdict = judge(facts, leased=leased)
    assert (verdict.row, verdict.state) == (row, state)


def test_g3_j6_row5a_reason_names_the_agent_subtype():
    verdict = judge(final_facts(agent_result={"is_error": True, "subtype": "error_max_turns", "summary": "x"}),
                    leased=True)
    assert (verdict.state, verdict.row, verdict.reason) == ("failed", "5a", "agent reported error_max_turns")


def test_j6_refused_renewal_maps_to_stop_reason():
    assert [refusal_stop_reason(r) for r in ("cancelled", "max_runtime", "revoked", "budget", "expired")] == [
        "cancel", "max_runtime", "renewal_refused", "renewal_refused", "renewal_refused",
    ]


def test_c4_j6_exit_1_after_the_owner_interrupted_the_last_turn_is_succeeded():
    base = {"process_started": True, "exit_code": 1, "signal": None, "ended_within_lease": True, "stop_reason": "exit"}
    owner_stopped = judge({**base, "agent_result": {"is_error": False, "subtype": "interrupted", "summary": None}},
                          leased=True)
    assert (owner_stopped.state, owner_stopped.row) == ("succeeded", "6c")
    # The same exit after a real error (or with no such fact) is still a failure (row 7).
    for agent_result in ({"is_error": True, "subtype": "error_during_execution", "summary": None}, None):
        verdict = judge({**base, "agent_result": agent_result}, leased=True)
        assert (verdict.state, verdict.row) == ("failed", 7)
    assert judge({**base, "exit_code": 2, "agent_result": {"is_error": False, "subtype": "interrupted"}},
                 leased=True).state == "failed"
