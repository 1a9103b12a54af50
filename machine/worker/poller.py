"""Pulling messages (SPEC W2, W3, J7, U1, W6, W8).

The poller long-polls the service and handles each message in order:

- ``start``: committed locally (with the operation record) first, then acknowledged
  (W2); a start for an operation the local database already knows is acknowledged and
  not run (W3); a new one goes to the runner;
- ``cancel``: recorded, acknowledged, and the running agent is asked to stop (J7);
- ``query``: answered with a ``report`` receipt from the local record, or ``record:
  null`` (U1); the report is queued before the ack;
- ``integrate`` (G7): committed with its integration record, acknowledged, carried out
  by the integrator (``integrate.py``) once, whatever the number of deliveries;
- ``message``, ``interrupt``, ``end`` (C2-C5): committed as a conversation item, acknowledged,
  and handed to the run's conversation part, which writes it to the agent on its next
  step (``conversation.py``);
- ``session_message``, ``session_interrupt`` (T2, T5): recorded in the session's local
  inbox, then acknowledged (``sessions.py``);
- anything else, or a payload without a required field of its kind's shape
  (``machine.protocol.shapes``, read here, where the message is received): acknowledged
  and ignored; a field the shape does not name is left out and logged.

A pull answered after draining began (W6) is neither committed nor acknowledged: the
service delivers it again later. Pull failures back off (R4). It runs in its own thread,
so a 25 s long-poll never delays a renewal or a receipt (W8).
"""
from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable

from . import conversation, faults, sessions
from machine.protocol import Backoff
from machine.protocol.shapes import ProtocolError, ReportRecord, read_message

from .client import MAX_POLL_WAIT_S, Service
from .context import WorkerContext
from .lease import record_slept_s
from .wire import receipt_item, report_facts

log = logging.getLogger("runstead.worker")

POLL_WAIT_S = MAX_POLL_WAIT_S  # the long-poll wait asked of the service: the most H allows


class Poller:
    """``start_run(operation_id, payload)`` is called for each new ``start``,
    ``start_integration(integration_id)`` for each recorded ``integrate`` (G7)."""

    def __init__(self, ctx: WorkerContext, *, start_run: Callable[[str, dict], None], backoff: Backoff,
                 wait_s: float = POLL_WAIT_S, start_integration: Callable[[str], None] | None = None):
        self.ctx = ctx
        self.start_run = start_run
        self.start_integration = start_integration or (lambda integration_id: None)
        self.backoff = backoff
        self.wait_s = wait_s

    def start(self) -> threading.Thread:
        thread = threading.Thread(target=self.loop, name="poller", daemon=True)
        thread.start()
        return thread

    def loop(self) -> None:
        """Pull until draining (W6); failed pulls wait a backoff delay."""
        ctx, clock = self.ctx, self.ctx.clock
        service = ctx.connect()
        attempt = 0
        try:
            while not ctx.draining.is_set():
                if self.poll_once(service):
                    attempt = 0
                    continue
                end = clock.monotonic() + self.backoff.delay(attempt)
                attempt += 1
                while clock.monotonic() < end and not ctx.draining.is_set():
                    clock.wait(ctx.draining, end - clock.monotonic())
        finally:
            service.close()

    def poll_once(self, service: Service) -> bool:
        """One long-poll and its messages; False when the pull failed."""
        answer = service.pull(self.wait_s)
        if answer.kind == "revoked":
            self.ctx.on_revoked()
            return False
        if answer.kind != "ok" or not answer.body:
            log.warning("pull failed: %s %s", answer.status, answer.text[:200])
            return False
        if self.ctx.draining.is_set():
            return True  # not committed, not acked: delivered again later
        for message in answer.body.get("messages", []):
            try:
                self.handle(service, message)
            except Exception:
                log.exception("message %s could not be handled", message.get("id"))
        return True

    def handle(self, service: Service, message: dict) -> None:
        ctx = self.ctx
        kind, payload = message.get("kind"), message.get("payload") or {}
        operation_id = str(message.get("operation_id") or payload.get("operation_id"))
        message_id = str(message["id"])
        try:
            payload, unknown = read_message(kind, payload)
        except ProtocolError as exc:
            log.warning("message %s: %s: acknowledged and ignored", message_id, exc)
            self.ack(service, message_id)
            return
        if unknown:
            log.warning("message %s (%s): fields this worker does not know, left out: %s", message_id, kind,
                        ", ".join(unknown))
        if kind == "start":
            new = ctx.store.record_message(message_id=message_id, kind=kind, operation_id=operation_id,
                                           payload=payload, wall=ctx.clock.wall())
            faults.fault("after_commit_before_ack")
            self.ack(service, message_id)
            faults.fault("after_ack_before_lease")
            if new:
                self.start_run(operation_id, payload)
            else:
                log.info("start for operation %s already known: acknowledged, not run again (W3)", operation_id)
        elif kind == "cancel":
            ctx.store.record_message(message_id=message_id, kind=kind, operation_id=operation_id,
                                     payload=payload, wall=ctx.clock.wall())
            ctx.store.request_cancel(operation_id)
            self.ack(service, message_id)
            run = ctx.run_for(operation_id)
            if run is not None:
                run.request_stop("cancel")
        elif kind == "query":
            query_id = str(payload["query_id"])
            ctx.enqueue([self.report_item(operation_id, query_id)])
            ctx.store.record_message(message_id=message_id, kind=kind, operation_id=operation_id,
                                     payload=payload, wall=ctx.clock.wall())
            self.ack(service, message_id)
        elif kind in conversation.KINDS:
            conversation.record(ctx.store, kind=kind, operation_id=operation_id, payload=payload,
                                wall=ctx.clock.wall(), message_id=message_id)
            self.ack(service, message_id)
            run = ctx.run_for(operation_id)
            if run is not None and run.conversation is not None:
                run.conversation.take(kind, message_id)
        elif kind in sessions.KINDS:  # T2, T5: recorded in the session's local inbox, then acknowledged
            sessions.record(kind, payload)
            faults.fault("after_commit_before_ack")
            self.ack(service, message_id)
        elif kind == "integrate":
            integration_id = str(payload["integration_id"])
            new = ctx.store.record_integration(message_id=message_id, integration_id=integration_id,
                                               operation_id=operation_id, payload=payload, wall=ctx.clock.wall())
            self.ack(service, message_id)
            if not new:
                log.info("integrate %s already known: acknowledged, carried out once (W3)", integration_id)
            self.start_integration(integration_id)  # a no-op when done or in flight

    def ack(self, service: Service, message_id: str) -> None:
        answer = service.ack(message_id)
        if answer.kind == "ok":
            self.ctx.store.message_acked(message_id, self.ctx.clock.wall())  # W1: prunable once ended
        elif answer.kind == "revoked":
            self.ctx.on_revoked()
        else:
            log.warning("ack of %s failed (%s); it will be delivered again and recognised", message_id, answer.status)

    def report_item(self, operation_id: str, query_id: str) -> dict:
        """U1: a ``report`` receipt from the local record, or ``record: null``."""
        record = self.ctx.store.get(operation_id)
        body: ReportRecord | None = None
        slept = 0.0
        if record is not None:
            body = {
                "local_state": record["local_state"],
                "pid": record["pid"],
                "lease_id": record["lease_id"],
                "final": json.loads(record["final"]) if record["final"] else None,
            }
            slept = record_slept_s(record, clock=self.ctx.clock, boot=self.ctx.boot)
        return receipt_item(self.ctx.identity, operation_id=operation_id, kind="report",
                            facts=report_facts(query_id, body), slept=slept, event_id=f"report:{query_id}")

