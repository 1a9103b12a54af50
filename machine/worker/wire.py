"""What the worker sends, as outbox rows (SPEC H, R1, J1, J6, M5, M8, U1). No I/O here.

An outbox row is ``{"event_id", "kind", "operation_id", "method", "path", "body"}``: the
sender (``sender.py``) delivers ``method path body`` unchanged on every retry, so a
receipt keeps its ``event_id`` (R1, R4). A receipt's body and facts are the shapes of
``machine.protocol.shapes``, checked here where they are built. Seconds are rounded to
milliseconds.
"""
from __future__ import annotations

import uuid

from machine.protocol.shapes import (
    RECEIPTS_PATH,
    FinalFacts,
    ReceiptBody,
    ReportFacts,
    ReportRecord,
    StopReason,
    check_receipt,
)

from .repositories import repository_identities
from .store import Identity

# J6 footnote: a refused renewal becomes the worker's stop_reason.
REFUSAL_STOP_REASON = {"cancelled": "cancel", "max_runtime": "max_runtime"}


def refusal_stop_reason(reason: str | None) -> str:
    """The J1 ``stop_reason`` for an L5 refusal reason: ``cancelled`` -> ``cancel``,
    ``max_runtime`` -> ``max_runtime``, anything else -> ``renewal_refused`` (J6)."""
    return REFUSAL_STOP_REASON.get(reason or "", "renewal_refused")


def receipt_item(identity: Identity, *, operation_id: str, kind: str, facts: dict, slept: float,
                 event_id: str | None = None) -> dict:
    """An outbox row for ``POST /api/worker/receipts/`` (H, R1): a ``ReceiptBody`` whose
    ``facts`` are the shape of ``kind`` (``starting``, ``running``, ``final``, ``unknown``,
    ``report``, ``integrated``, ``message``; ``ProtocolError`` otherwise); the event id
    defaults to ``<operation id>:<kind>`` (one of each kind per operation)."""
    event_id = event_id or f"{operation_id}:{kind}"
    body: ReceiptBody = {
        "event_id": event_id,
        "generation": identity.generation,
        "operation_id": operation_id,
        "kind": kind,
        "slept_s": round(slept, 3),
        "facts": facts,
    }
    return {
        "event_id": event_id,
        "kind": kind,
        "operation_id": operation_id,
        "method": "POST",
        "path": RECEIPTS_PATH,
        "body": check_receipt(body),
    }


def marker_item(identity: Identity, *, session_id: str, turn_id: str, state: str, deep_research: bool) -> dict:
    """An outbox row for ``PUT /api/sessions/{id}/marker/`` (M8): ``state`` is
    ``running`` or ``ended``; the device is this machine."""
    return {
        "event_id": f"marker:{turn_id}:{state}",
        "kind": "marker",
        "operation_id": None,
        "method": "PUT",
        "path": f"/api/sessions/{session_id}/marker/",
        "body": {
            "turn_id": turn_id,
            "device_id": identity.machine_id,
            "device_name": identity.name,
            "state": state,
            "deep_research": bool(deep_research),
        },
    }


def session_delivery_item(*, session_id: str, seq: int, message_id: str, state: str) -> dict:
    """An outbox row for ``POST /api/sessions/{id}/messages/{seq}/delivery/`` (T2): what
    became of a session message this machine holds (``undelivered`` from the sweep of
    ``machine.inbox.orphans``); one per message and state."""
    return {
        "event_id": f"session-delivery:{message_id}:{state}",
        "kind": "session_delivery",
        "operation_id": None,
        "method": "POST",
        "path": f"/api/sessions/{session_id}/messages/{int(seq)}/delivery/",
        "body": {"state": state},
    }


def sweep_item(identity: Identity) -> dict:
    """An outbox row for ``POST /api/devices/{machine id}/sweep/`` (M5): close the markers
    a previous run of this device left ``running``. A fresh event id per worker start."""
    return {
        "event_id": f"sweep:{uuid.uuid4()}",
        "kind": "sweep",
        "operation_id": None,
        "method": "POST",
        "path": f"/api/devices/{identity.machine_id}/sweep/",
        "body": {},
    }


def profiles_item(config) -> dict:
    """An outbox row for ``PUT /api/worker/profiles/`` (B10): the profile names, presets
    and isolation (G7) of this worker's local configuration, for the board's task form
    and for acceptance, which takes no folder lock for a worktree task; ``conversation``
    (C1) says how acceptance answers ``"mode": "conversation"``; ``max_concurrent`` (W8)
    and the ``repositories`` under the allowed roots are how acceptance picks a machine
    for ``"machine": "any"`` (C8)."""
    return {
        "event_id": f"profiles:{uuid.uuid4()}",
        "kind": "profiles",
        "operation_id": None,
        "method": "PUT",
        "path": "/api/worker/profiles/",
        "body": {"profiles": [{"name": name, "preset": p.preset, "isolation": p.isolation,
                               "conversation": p.conversation}
                              for name, p in sorted(config.profiles.items())],
                 "max_concurrent": config.max_concurrent,
                 "repositories": repository_identities(config.allowed_roots)},
    }


def final_facts(*, process_started, exit_code=None, signal_=None, lease_id=None, ended_within_lease=None,
                runtime_s=None, stop_reason: StopReason, survivors=(), output_tail="",
                extra: dict | None = None) -> FinalFacts:
    """The ``final`` receipt's facts (J1, ``FinalFacts``). ``process_started`` is True,
    False or ``"unknown"``; ``runtime_s`` is wall seconds from spawn. ``extra`` adds facts
    a run collected beyond J1, the optional keys of ``FinalFacts`` (they never replace a
    J1 key)."""
    facts: FinalFacts = dict(extra or {})
    facts.update({
        "process_started": process_started,
        "exit_code": exit_code,
        "signal": signal_,
        "lease_id": lease_id,
        "ended_within_lease": ended_within_lease,
        "runtime_s": None if runtime_s is None else round(max(0.0, runtime_s), 3),
        "stop_reason": stop_reason,
        "survivors": list(survivors),
        "output_tail": output_tail,
    })
    return facts


def report_facts(query_id: str, record: ReportRecord | None) -> ReportFacts:
    """U1: the facts of a ``report`` receipt answering query ``query_id``: the local
    record (``local_state``, ``pid``, ``lease_id``, ``final``) or ``record: null``."""
    return {"query_id": query_id, "record": record}
