"""Receipts from the worker (SPEC R1-R3, J, X3, U1, U2).

An ``unknown`` task that a receipt cannot settle (a ``report`` without final facts, or
final facts that leave the outcome unknown, J6 row 2) is put to its owner there and then
(``transitions.task_ask_owner``, N1); one that a late receipt settles asks nobody.

A receipt is stored once per (machine, event_id) together with its answer; a second
delivery gets the first answer byte-equal and changes nothing (R1).
"""
from datetime import datetime

from django.db import transaction

from core.actors import actor_machine
from core.deadlocks import retry_on_deadlock
from core.errors import ErrorShape
from core.idempotency import rendered
from tasks_app.agent_facts import clean_agent_facts
from tasks_app.models import FINAL_STATES, LEASED_STATES, NEVER_LEASED_STATES, Lease, Machine, Receipt, Task, TaskState
from tasks_app.services.conversation import message_receipt_apply
from tasks_app.services.integration import integration_apply
from tasks_app.services.judging import RELEASE, judge
from tasks_app.services.locking import lock_budget
from tasks_app.services.progress import transcript_append
from tasks_app.services.transitions import task_ask_owner, task_finalize, task_publish, task_record, task_transition
from machine.protocol import OUTPUT_TAIL_MAX_CHARS
from tasks_app.shapes import ReceiptAnswerShape

APPLIED: ReceiptAnswerShape = {"outcome": "applied"}
SURVIVOR_KEEP_LIMIT = 50


def not_applied(reason: str) -> ReceiptAnswerShape:
    return {"outcome": "not_applied", "reason": reason}


@retry_on_deadlock
def receipt_apply(*, machine: Machine, receipt: dict, now: datetime) -> tuple[int, str]:
    """Apply one validated receipt (H shape: event_id, generation, operation_id, kind,
    slept_s, facts) from ``machine``. Returns (HTTP status, exact body text), stored with
    the receipt so a duplicate delivery gets the same bytes (R1). Answers per R3:
    200 applied / not_applied with a reason, 404 for an operation that is not this
    machine's."""
    with transaction.atomic():
        # Serializes this machine's receipts (and waits for a racing duplicate) without
        # blocking the FOR KEY SHARE of grants and acceptances (P1).
        current = Machine.objects.select_for_update(no_key=True).get(pk=machine.pk)
        stored = Receipt.objects.filter(machine=machine, event_id=receipt["event_id"]).first()
        if stored is not None:
            return stored.response_status, stored.response_body
        # The row whole only under lock (``_apply``); here which task, and its state for the
        # history row of a stale receipt.
        task = (Task.objects.filter(machine=machine, operation__id=receipt["operation_id"])
                .only("id", "owner_id", "state").first())
        if task is None:
            # Not stored: a refusal changes nothing (K3), and the answer is the same
            # bytes on every delivery anyway (R1).
            return 404, rendered(ErrorShape(error="not_found", detail="no such operation for this machine"))
        if receipt["generation"] < current.generation:
            task_record(task, reason=f"{receipt['kind']} receipt of old generation {receipt['generation']}", actor=actor_machine(machine), now=now)
            status, answer = 200, not_applied("old_generation")  # R2
        else:
            status, answer = 200, _apply(task, machine=machine, receipt=receipt, now=now)
        body = rendered(answer)
        Receipt.objects.create(
            machine=machine,
            event_id=receipt["event_id"],
            task=task,
            kind=receipt["kind"],
            generation=receipt["generation"],
            body=receipt,
            response_status=status,
            response_body=body,
            received_at=now,
        )
        return status, body


# Receipts that never settle the budget (J4): they lock the task row without the budget's
# first (P2 allows skipping a row of the order, never taking one out of it); a busy
# machine's every task reports both.
BUDGET_FREE_KINDS = frozenset({"starting", "running"})


def _apply(task: Task, *, machine: Machine, receipt: dict, now: datetime) -> dict:
    if receipt["kind"] not in BUDGET_FREE_KINDS:
        lock_budget(task.owner_id)
    task = Task.objects.select_for_update().get(pk=task.pk)
    kind, facts, actor = receipt["kind"], receipt["facts"], actor_machine(machine)
    if kind == "integrated":  # G7: the outcome of a final task's merge or discard
        return integration_apply(task, facts, actor=actor, now=now)
    if kind == "message":  # C3: delivered / answered / undelivered, also after the task ended
        return message_receipt_apply(task, facts, actor=actor, now=now)
    if task.state in FINAL_STATES:
        # Evidence of a final task stays as it was settled (reordered or late receipts).
        task_record(task, reason=f"{kind} receipt after final state", actor=actor, now=now)
        return not_applied("final")
    if task.state == TaskState.QUEUED:  # G8: nothing was sent to run yet
        task_record(task, reason=f"{kind} receipt while queued", actor=actor, now=now)
        return not_applied("state")
    if receipt.get("slept_s") is not None and receipt["slept_s"] != task.slept_s:  # L9; mostly 0.0 again
        Task.objects.filter(pk=task.pk).update(slept_s=receipt["slept_s"])
        task.slept_s = receipt["slept_s"]
    if kind == "starting":
        task_record(task, reason="starting receipt", actor=actor, now=now)
        return APPLIED
    if kind == "running":
        return _apply_running(task, facts, actor=actor, now=now)
    if kind == "unknown":
        if task.state not in LEASED_STATES:
            task_record(task, reason=f"unknown receipt in state {task.state}", actor=actor, now=now)
            return not_applied("state")
        # X3: the worker lost track of its process; the lease cannot be kept alive.
        Lease.objects.filter(task=task, ended_at__isnull=True).update(ended_at=now, end_reason="unknown_receipt")
        task_transition(
            task, from_states=LEASED_STATES, to=TaskState.UNKNOWN, reason=f"worker: {facts.get('reason', '')}",
            actor=actor, now=now,
        )
        return APPLIED
    if kind == "report":
        record = facts.get("record")
        if record is None or not record.get("final"):
            what = "no record" if record is None else f"local state {record.get('local_state')}, no final facts"
            task_record(task, reason=f"report: {what}", actor=actor, now=now)
            if task.state == TaskState.UNKNOWN:  # N1, U2: the worker's record cannot settle it
                task_ask_owner(task, reason=f"the worker's report: {what}", actor=actor, now=now)
            return not_applied("no_final_facts")
        return _apply_final(task, record["final"], actor=actor, now=now, via="report")
    return _apply_final(task, facts, actor=actor, now=now, via="final receipt")


def _apply_running(task: Task, facts: dict, *, actor: str, now: datetime) -> dict:
    fields = {"pid": facts.get("pid"), "process_start_time": facts.get("process_start_time")}
    if task.state != TaskState.STARTING:
        task_record(task, reason=f"running receipt (pid {fields['pid']}) in state {task.state}", actor=actor, now=now)
        return not_applied("state")
    task_transition(
        task, from_states=[TaskState.STARTING], to=TaskState.RUNNING, reason=f"running, pid {fields['pid']}",
        actor=actor, now=now, **fields,
    )
    return APPLIED


def _agent_fields(task: Task, facts: dict) -> dict:
    """G3/G5 facts as task fields (validated at the API; bounded here); G4's last
    transcript entries go to the transcript."""
    agent = clean_agent_facts(facts)
    transcript_append(task, agent["entries"])
    return {"agent_result": agent["agent_result"], "usage": agent["usage"],
            "agent_session_id": agent["agent_session_id"] or "", "evidence": agent["evidence"]}


def _apply_final(task: Task, facts: dict, *, actor: str, now: datetime, via: str) -> dict:
    """J6 via ``judge``; J2/J3 follow from the facts themselves (ended_within_lease)."""
    leased = Lease.objects.filter(task=task).exists()
    verdict = judge(facts, leased=leased)
    survivors = list(facts.get("survivors") or [])[:SURVIVOR_KEEP_LIMIT]
    fields = {
        "exit_code": facts.get("exit_code"),
        "signal": facts.get("signal"),
        "stop_reason": facts.get("stop_reason") or "",
        "runtime_s": facts.get("runtime_s"),
        "survivors": survivors,
        "output_tail": (facts.get("output_tail") or task.output_tail or "")[-OUTPUT_TAIL_MAX_CHARS:],
        "facts": {k: v for k, v in facts.items() if k != "entries"},  # the transcript keeps those
        **_agent_fields(task, facts),
    }
    Lease.objects.filter(task=task, ended_at__isnull=True).update(ended_at=now, end_reason="final")
    if verdict.state is None:  # J6 row 2: stays (or becomes) unknown, budget kept
        Task.objects.filter(pk=task.pk).update(**fields)
        if task.state in LEASED_STATES:
            task = task_transition(task, from_states=LEASED_STATES, to=TaskState.UNKNOWN, reason=f"{via}: {verdict.reason}", actor=actor, now=now)
        else:
            task_record(task, reason=f"{via}: {verdict.reason}", actor=actor, now=now)
            task_publish(task, now=now)
        if task.state == TaskState.UNKNOWN:  # N1, U2: the facts themselves leave the outcome unknown
            task_ask_owner(task, reason=f"{via}: {verdict.reason}", actor=actor, now=now)
        return APPLIED
    runtime = facts.get("runtime_s")
    charge = 0 if verdict.budget == RELEASE else (task.reserved_s if runtime is None else runtime)
    task_finalize(
        task,
        from_states=NEVER_LEASED_STATES | LEASED_STATES | {TaskState.UNKNOWN},
        to=verdict.state,
        charge_s=charge,
        reason=f"{via}: J6 row {verdict.row}, {verdict.reason}",
        actor=actor,
        now=now,
        keep_lock=bool(survivors),
        state_reason=verdict.reason,
        **fields,
    )
    return APPLIED
