"""Wire shapes of the tasks app (SPEC H, B1, B2, B7): the JSON that the task API answers
and that ``task`` and ``machine`` board events carry, written once.

Plain functions of model rows, no DRF: views, services (transitions, pairing, leases)
and the board snapshot all render through them (healthchecks' ``Check.to_dict``). Times
are ISO-8601 UTC strings from ``iso``; durations are seconds. Input validation stays in
``tasks_app/api/serializers.py``.

Actor strings (``TaskEvent.actor``, shown by the API and the admin) come from
``actor_owner`` / ``actor_machine`` and the two constants below, nowhere else.
"""
from datetime import datetime, timedelta

from django.conf import settings

ACTOR_SERVICE = "service"  # the service's own checks (L6 on a renewal, L5 refusals)
ACTOR_SWEEP = "sweep"  # the periodic sweep (J5, L6)

# GET /api/tasks/{id}/ lists at most this many receipts, newest last (H).
DETAIL_RECEIPTS = 50


def iso(value: datetime | None) -> str | None:
    """ISO-8601 of an aware datetime (UTC in this service), or None."""
    return value.isoformat() if value is not None else None


def actor_owner(user) -> str:
    """``owner:<username>``: an owner acting through the API, the board or the admin."""
    return f"owner:{user.get_username()}"


def actor_machine(machine) -> str:
    """``machine:<machine id>``: a machine acting with its token. The id, not the name:
    names are not unique and can change at a re-pair; the id is also the device id the
    worker writes markers with (M5, M8)."""
    return f"machine:{machine.pk}"


# --- machines (B7) ----------------------------------------------------------------------


def machine_offline_at(last_heard_at: datetime | None) -> datetime | None:
    """B7: the instant after which a machine last heard at ``last_heard_at`` counts as
    offline (``RUNSTEAD_MACHINE_OFFLINE_S`` later); None when never heard (offline)."""
    if last_heard_at is None:
        return None
    return last_heard_at + timedelta(seconds=settings.RUNSTEAD_MACHINE_OFFLINE_S)


def machine_is_offline(last_heard_at: datetime | None, now: datetime) -> bool:
    """B7, the one rule: offline when never heard, or not heard from for more than
    ``RUNSTEAD_MACHINE_OFFLINE_S`` seconds at ``now``."""
    offline_at = machine_offline_at(last_heard_at)
    return offline_at is None or now > offline_at


def machine_dict(machine, *, now: datetime) -> dict:
    """Machine of ``GET /api/machines/``, of ``machine`` events and of the board snapshot:
    ``{id, name, generation, paired, last_heard_at, offline, offline_at, profiles,
    version}`` (``profiles``: what the worker reported, B10).
    ``offline`` is B7 at ``now``; ``offline_at`` is when it turns offline if nothing is
    heard meanwhile (null: never heard), so the board re-evaluates B7 on its own timer
    without holding the threshold (B3 does the same for markers)."""
    return {
        "id": str(machine.id),
        "name": machine.name,
        "generation": machine.generation,
        "paired": machine.paired,
        "last_heard_at": iso(machine.last_heard_at),
        "offline": machine_is_offline(machine.last_heard_at, now),
        "offline_at": iso(machine_offline_at(machine.last_heard_at)),
        "profiles": machine.profiles,
        "version": machine.version,
    }


def machine_event(machine, *, now: datetime) -> dict:
    """The ``machine`` board event (B2, B7); ``server_time`` is added by the broadcast."""
    return {"type": "machine", "machine": machine_dict(machine, now=now), "version": machine.version}


def paired_dict(machine, token: str) -> dict:
    """Answer of ``POST /api/worker/pair/``: ``{machine_id, token, generation, name}``."""
    return {"machine_id": str(machine.id), "token": token, "generation": machine.generation, "name": machine.name}


def pairing_code_dict(code: str, row) -> dict:
    """Answer of ``POST /api/machines/pairing-codes/``: ``{code, expires_at}``."""
    return {"code": code, "expires_at": iso(row.expires_at)}


# --- grants and budget ------------------------------------------------------------------


def grant_dict(grant) -> dict:
    """Grant of ``GET/POST /api/grants/`` and of the board snapshot:
    ``{id, machine, path, created_at, revoked_at}``."""
    return {
        "id": str(grant.id),
        "machine": str(grant.machine_id),
        "path": grant.path,
        "created_at": iso(grant.created_at),
        "revoked_at": iso(grant.revoked_at),
    }


def budget_dict(budget) -> dict:
    """``GET /api/budget/``: ``{limit_s, reserved_s, spent_s}`` in seconds."""
    return {"limit_s": budget.limit_s, "reserved_s": budget.reserved_s, "spent_s": budget.spent_s}


# --- tasks ------------------------------------------------------------------------------


def task_dict(task) -> dict:
    """Task of the API and of ``task`` board events (H, B1)."""
    return {
        "id": str(task.id),
        "state": task.state,
        "state_reason": task.state_reason,
        "machine": str(task.machine_id),
        "folder": task.folder,
        "agent": task.agent,
        "prompt": task.prompt,
        "session": str(task.session_id) if task.session_id else None,
        "deep_research": task.deep_research,
        "max_runtime_s": task.max_runtime_s,
        "exclusive": task.exclusive,
        "created_at": iso(task.created_at),
        "updated_at": iso(task.updated_at),
        "final_at": iso(task.final_at),
        "cancel_requested_at": iso(task.cancel_requested_at),
        "reserved_s": task.reserved_s,
        "charged_s": task.charged_s,
        "pid": task.pid,
        "exit_code": task.exit_code,
        "signal": task.signal,
        "stop_reason": task.stop_reason,
        "runtime_s": task.runtime_s,
        "slept_s": task.slept_s,
        "survivors": task.survivors,
        "output_tail": task.output_tail,
        "holds_lock": task.holds_lock,
        **agent_dict(task),
        "version": task.version,
    }


def agent_dict(task) -> dict:
    """The G2-G6 part of the task shape (H "Task JSON"): ``agent_session_id``,
    ``agent_result``, ``usage``, ``progress`` (G4, the latest), ``evidence`` (G5) and
    ``continue_task`` (G6, the task this follow-up continues)."""
    return {
        "agent_session_id": task.agent_session_id or None,
        "agent_result": task.agent_result,
        "usage": task.usage,
        "progress": task.progress,
        "evidence": task.evidence or {},
        "continue_task": str(task.continued_from_id) if task.continued_from_id else None,
    }


def task_event(task) -> dict:
    """The ``task`` board event (B2); ``server_time`` is added by the broadcast."""
    return {"type": "task", "task": task_dict(task), "version": task.version}


def task_started_at(task) -> str | None:
    """When the task's lease was granted (its run began), for the board's live runtime."""
    granted = [lease.granted_at for lease in task.leases.all()]
    return iso(min(granted)) if granted else None


def board_task_dict(task) -> dict:
    """A task in the board snapshot (B4): as in ``task`` events, plus ``started_at``."""
    return {**task_dict(task), "started_at": task_started_at(task)}


def lease_history_dict(lease) -> dict:
    """The lease timeline of a task (U4): grant, renewals, end."""
    return {
        "id": str(lease.id),
        "granted_at": iso(lease.granted_at),
        "expires_at": iso(lease.expires_at),
        "renewals": lease.renewals,
        "last_renewed_at": iso(lease.last_renewed_at),
        "refused_reason": lease.refused_reason,
        "ended_at": iso(lease.ended_at),
        "end_reason": lease.end_reason,
    }


def task_event_row_dict(event) -> dict:
    """One TaskEvent (history, append-only): ``{old_state, new_state, reason, actor, at}``."""
    return {"old_state": event.old_state, "new_state": event.new_state, "reason": event.reason, "actor": event.actor, "at": iso(event.at)}


def receipt_dict(receipt) -> dict:
    """One stored receipt with the answer the worker got (R1)."""
    return {
        "event_id": receipt.event_id, "kind": receipt.kind, "generation": receipt.generation, "body": receipt.body,
        "answer": receipt.response_body, "received_at": iso(receipt.received_at),
    }


def task_detail_dict(task) -> dict:
    """``GET /api/tasks/{id}/``: the task with its lease, events and last
    ``DETAIL_RECEIPTS`` receipts."""
    lease = task.leases.first()
    return {
        **task_dict(task),
        "lease": None if lease is None else lease_history_dict(lease),
        "events": [task_event_row_dict(e) for e in task.events.all()],
        "receipts": [receipt_dict(r) for r in task.receipts.all()[:DETAIL_RECEIPTS]],
    }


# --- worker protocol --------------------------------------------------------------------


def lease_dict(lease) -> dict:
    """Answer of a lease grant or renewal (H, L2):
    ``{lease_id, expires_at, duration_s, renew_every_s, margin_s, kill_grace_s}``."""
    return {
        "lease_id": str(lease.id),
        "expires_at": iso(lease.expires_at),
        "duration_s": lease.duration_s,
        "renew_every_s": lease.renew_every_s,
        "margin_s": lease.margin_s,
        "kill_grace_s": lease.kill_grace_s,
    }


def message_dict(message) -> dict:
    """One outbox message of ``GET /api/worker/messages/`` (W2):
    ``{id, kind, operation_id, payload}``."""
    return {"id": str(message.id), "kind": message.kind, "operation_id": str(message.operation_id), "payload": message.payload}


def messages_dict(messages) -> dict:
    """Answer of the long-poll (H, W2): ``{"messages": [message]}``."""
    return {"messages": [message_dict(m) for m in messages]}
