"""Small helpers for service tests: submit a task, walk it through the worker protocol."""
import itertools
import uuid

from tests.conftest import machine_api, owner_api

_keys = itertools.count()


def submit(owner, machine, folder, *, key=None, **extra):
    """POST /api/tasks/ as ``owner``; returns the response."""
    body = {"machine": str(machine.id), "folder": str(folder), "agent": "demo", "prompt": "do it", **extra}
    return owner_api(owner).post(
        "/api/tasks/", body, format="json", HTTP_IDEMPOTENCY_KEY=key or f"key-{next(_keys)}-{uuid.uuid4()}"
    )


def operation_id(task_id) -> str:
    from tasks_app.models import Operation

    return str(Operation.objects.get(task_id=task_id).id)


def grant_lease(machine, task_id):
    return machine_api(machine).post("/api/worker/leases/", {"operation_id": operation_id(task_id)}, format="json")


def receipt(machine, task_id, kind, facts=None, *, event_id=None, generation=None, slept_s=0.0):
    body = {
        "event_id": event_id or str(uuid.uuid4()),
        "generation": machine.generation if generation is None else generation,
        "operation_id": operation_id(task_id),
        "kind": kind,
        "slept_s": slept_s,
        "facts": facts or {},
    }
    return machine_api(machine).post("/api/worker/receipts/", body, format="json")


def final_facts(**overrides):
    facts = {
        "process_started": True, "exit_code": 0, "signal": None, "lease_id": None, "ended_within_lease": True,
        "runtime_s": 12.5, "stop_reason": "exit", "survivors": [], "output_tail": "ok\n",
    }
    facts.update(overrides)
    return facts


def agent_facts(*, agent_result=None, agent_session_id="b6e66952-929c-4f1e-a0e0-91664c71fa14", **git):
    """The agent's part of final facts (G3, G5): ``agent_result``, ``usage``,
    ``agent_session_id`` and git ``evidence``; ``git`` overrides evidence fields."""
    return {
        "agent_result": agent_result or {"is_error": False, "subtype": "success", "summary": "Fixed it."},
        "usage": {"turns": 3, "tool_calls": 2, "input_tokens": 1200, "output_tokens": 80, "cost_usd": 0.0123},
        "agent_session_id": agent_session_id,
        "evidence": {"git": {"start_head": "a" * 40, "end_head": "b" * 40, "commits": 2, "subjects": ["x", "y"],
                             "files_changed": 5, "insertions": 10, "deletions": 3, "dirty": ["n.txt"],
                             "dirty_count": 1, "start_dirty": 0, **git}},
    }
