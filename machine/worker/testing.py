"""An in-memory control service for the worker's tests (SPEC W2, W3, L1, L2, L5, R1, R3,
U1, M5, M8, B10), the way procrastinate tests its worker with ``InMemoryConnector``.

``InMemoryService`` implements ``client.Service`` with the protocol's semantics, kept
small: outbox messages with a visibility window (W2: not acknowledged in time ->
delivered again), idempotent acks, leases (L1: one per operation, ever; the same live
lease returned again; L5: a refused renewal stays refused), receipts deduplicated by
``event_id`` with the first answer returned byte-equal (R1), messages and receipts
checked against their shapes (``machine.protocol.shapes``: a test that gives a message
a field its shape does not name fails at once; a receipt that is not its shape is
refused 400, R3), and answers on demand
(``script``: 401/409/429/5xx/network error for the next calls of a route;
``revoke_token``: every call answers 401 ``token_revoked``). Its own times are the
given clock's *wall* readings (the service's clock, L7), so a worker that sleeps past a
lease finds it expired. It records every call with the clock's monotonic time.

Standard library only; no Django. Thread-safe: one instance serves every worker thread
(``connect=lambda: service``).
"""
from __future__ import annotations

import json
import re
import secrets
import threading
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field
from datetime import UTC, datetime

from machine.protocol import shapes
from machine.protocol.shapes import RECEIPTS_PATH, SYNC_PATH, ProtocolError, check_message, check_receipt

from .client import MAX_POLL_WAIT_S, Answer

ROUTES = ("pull", "ack", "grant", "renew", "receipt", "marker", "sweep", "profiles", "progress", "sync")
MARKER_PATH = re.compile(r"^/api/sessions/(?P<session>[^/]+)/marker/$")
SWEEP_PATH = re.compile(r"^/api/devices/(?P<device>[^/]+)/sweep/$")


def answer(status: int, body: dict | None = None) -> Answer:
    """An ``Answer`` as the HTTP client would build it (status 0: network error)."""
    if status == 0:
        return Answer(status=0, body=None, text="ConnectError: scripted network error")
    text = json.dumps(body if body is not None else {})
    return Answer(status=status, body=body if body is not None else {}, text=text)


def error(status: int, code: str, detail: str = "") -> Answer:
    return answer(status, {"error": code, "detail": detail or code})


@dataclass
class Message:
    id: str
    kind: str
    operation_id: str
    payload: dict
    visible_at: float  # service wall time
    acked_at: float | None = None
    deliveries: int = 0
    acks: int = 0

    def wire(self) -> dict:
        return {"id": self.id, "kind": self.kind, "operation_id": self.operation_id, "payload": self.payload}


@dataclass
class Lease:
    id: str
    operation_id: str
    expires_at: float  # service wall time
    refused: str | None = None  # L5: once refused, always refused
    renewals: list = field(default_factory=list)  # (monotonic, output_tail)


@dataclass
class Call:
    route: str
    at: float  # the clock's monotonic reading
    args: dict
    status: int


class InMemoryService:
    """See the module docstring. Lease timings in seconds."""

    def __init__(self, clock, *, duration_s: float = 60.0, renew_every_s: float = 15.0, margin_s: float = 5.0,
                 kill_grace_s: float = 5.0, visibility_s: float = 30.0, approval_wait_s: float = 600.0):
        self.clock = clock
        self.approval_wait_s = approval_wait_s  # Q5: the service's approval_wait_s
        self.terms = {"duration_s": duration_s, "renew_every_s": renew_every_s, "margin_s": margin_s,
                      "kill_grace_s": kill_grace_s}
        self.visibility_s = visibility_s
        self._lock = threading.RLock()
        self._arrived = threading.Event()
        self.messages: dict[str, Message] = {}
        self.operations: dict[str, dict] = {}  # operation id -> {"cancelled", "refuse_grant", "refuse_renewal"}
        self.leases: dict[str, Lease] = {}
        self.receipts: dict[str, tuple[dict, Answer]] = {}  # event id -> (first body, first answer) (R1)
        self.markers: list[dict] = []
        self.sweeps: list[str] = []
        self.profiles: list | None = None  # B10: the last profile list the worker sent
        self.calls: list[Call] = []
        self.scripted: dict[str, deque] = defaultdict(deque)
        self.revoked = False
        # Issue 44: whether it serves POST /api/worker/sync/ (receipts only); off, it
        # answers 404 there as a service from before that route does.
        self.sync_route = False
        self.on_ack = None  # called with the Message before an ack is recorded (W2 tests)
        self.pull_gate = threading.Event()  # cleared by hold_pulls(): pulls block (real time)
        self.pull_gate.set()
        self.pulls_in_flight = 0
        self.progress_posts: list[tuple[float, dict]] = []  # G4: (monotonic, body)
        self.progress_gate = threading.Event()  # cleared: progress calls block (a slow service)
        self.progress_gate.set()

    # --- the service's side, driven by the test -----------------------------------------------

    def add_message(self, kind: str, operation_id: str, payload: dict) -> Message:
        """A message of ``kind`` for ``operation_id``; ``payload`` (without the operation
        id) must be that kind's shape (``ProtocolError`` otherwise)."""
        payload = check_message(kind, {"operation_id": operation_id, **payload})
        with self._lock:
            message = Message(id=str(uuid.uuid4()), kind=kind, operation_id=operation_id, payload=payload,
                              visible_at=self.clock.wall())
            self.messages[message.id] = message
        self._arrived.set()
        return message

    def add_start(self, *, folder: str, grant_root: str, agent: str, prompt: str = "do the thing",
                  session_id: str | None = None, deep_research: bool = False, max_runtime_s: int = 600,
                  isolation: str = "none") -> Message:
        """A task accepted for this machine: its ``start`` message (payload as H sends it;
        ``isolation``: ``none`` or ``worktree``, G7)."""
        operation_id = str(uuid.uuid4())
        with self._lock:
            self.operations[operation_id] = {"cancelled": False, "refuse_grant": None, "refuse_renewal": None}
        return self.add_message("start", operation_id, {
            "task_id": str(uuid.uuid4()), "folder": folder, "grant_root": grant_root, "agent": agent,
            "prompt": prompt, "max_runtime_s": max_runtime_s, "session_id": session_id,
            "deep_research": deep_research, "isolation": isolation})

    def cancel(self, operation_id: str) -> Message:
        """J7: grant and renewal are refused ``cancelled`` from now on; a ``cancel`` message."""
        with self._lock:
            self.operations[operation_id]["cancelled"] = True
        return self.add_message("cancel", operation_id, {})

    def query(self, operation_id: str) -> Message:
        """U1: ask the worker for its local record of ``operation_id``."""
        return self.add_message("query", operation_id, {"query_id": str(uuid.uuid4())})

    def redeliver(self, message_id: str) -> None:
        """Make a message pending and visible again, as if its ack had been lost."""
        with self._lock:
            message = self.messages[message_id]
            message.acked_at, message.visible_at = None, self.clock.wall()
        self._arrived.set()

    def refuse_grant(self, operation_id: str, reason: str) -> None:
        with self._lock:
            self.operations[operation_id]["refuse_grant"] = reason

    def refuse_renewals(self, operation_id: str, reason: str) -> None:
        """L5: the next renewal of this operation's lease is refused with ``reason``."""
        with self._lock:
            self.operations[operation_id]["refuse_renewal"] = reason

    def revoke_token(self) -> None:
        """K1/R3: every call from now on answers 401 ``token_revoked``."""
        with self._lock:
            self.revoked = True
        self._arrived.set()

    def script(self, route: str, *statuses: int) -> None:
        """The next calls of ``route`` (one of ``ROUTES``) answer these statuses, in order
        (0 = network error), before the normal behaviour resumes."""
        assert route in ROUTES, route
        with self._lock:
            self.scripted[route].extend(statuses)

    def hold_pulls(self) -> None:
        """Pulls from now on block (in real time) until ``release_pulls()``: a slow long-poll."""
        self.pull_gate.clear()

    def release_pulls(self) -> None:
        self.pull_gate.set()

    # --- what the test reads --------------------------------------------------------------------

    def calls_to(self, route: str) -> list[Call]:
        with self._lock:
            return [c for c in self.calls if c.route == route]

    def receipts_for(self, operation_id: str) -> list[dict]:
        """Applied receipt bodies of an operation, in arrival order."""
        with self._lock:
            return [body for body, _ in self.receipts.values() if body.get("operation_id") == operation_id]

    def receipt(self, operation_id: str, kind: str) -> dict | None:
        return next((b for b in self.receipts_for(operation_id) if b["kind"] == kind), None)

    def lease_of(self, operation_id: str) -> Lease | None:
        with self._lock:
            return next((lease for lease in self.leases.values() if lease.operation_id == operation_id), None)

    # --- client.Service ---------------------------------------------------------------------------

    def _record(self, route: str, status: int, **args) -> None:
        self.calls.append(Call(route=route, at=self.clock.monotonic(), args=args, status=status))

    def _canned(self, route: str, **args) -> Answer | None:
        """A revoked token's 401 or a scripted answer, recorded; None for normal service."""
        with self._lock:
            if self.revoked:
                self._record(route, 401, **args)
                return error(401, "token_revoked", "machine token revoked or unknown: pair the worker again")
            if self.scripted[route]:
                status = self.scripted[route].popleft()
                self._record(route, status, **args)
                if status == 0:
                    return answer(0)
                codes = {401: "token_revoked", 409: "conflict", 429: "throttled", 400: "invalid"}
                return error(status, codes.get(status, "server_error"))
        return None

    def pull(self, wait_s: float) -> Answer:
        with self._lock:
            self.pulls_in_flight += 1
        try:
            self.pull_gate.wait()
            canned = self._canned("pull", wait_s=wait_s)
            if canned is not None:
                return canned
            end = self.clock.monotonic() + max(0.0, min(MAX_POLL_WAIT_S, wait_s))
            while True:
                with self._lock:
                    self._arrived.clear()
                    now = self.clock.wall()
                    due = [m for m in self.messages.values() if m.acked_at is None and m.visible_at <= now]
                    for message in due:
                        message.visible_at = now + self.visibility_s
                        message.deliveries += 1
                    if due or self.clock.monotonic() >= end or self.revoked:
                        if self.revoked:
                            return self._canned("pull", wait_s=wait_s)
                        self._record("pull", 200, wait_s=wait_s, delivered=[m.id for m in due])
                        return answer(200, {"messages": [m.wire() for m in due]})
                self.clock.wait(self._arrived, end - self.clock.monotonic())
        finally:
            with self._lock:
                self.pulls_in_flight -= 1

    def ack(self, message_id: str) -> Answer:
        canned = self._canned("ack", message_id=message_id)
        if canned is not None:
            return canned
        with self._lock:
            message = self.messages.get(message_id)
        if message is None:
            with self._lock:
                self._record("ack", 404, message_id=message_id)
            return error(404, "not_found", "no such message")
        if self.on_ack is not None:
            self.on_ack(message)
        with self._lock:
            message.acks += 1
            if message.acked_at is None:
                message.acked_at = self.clock.wall()
            self._record("ack", 200, message_id=message_id)
        return answer(200, {"acked": True})

    def _body(self, lease: Lease) -> dict:
        """The lease answer as the API words it: ``expires_at`` in ISO 8601, UTC."""
        expires_at = datetime.fromtimestamp(lease.expires_at, UTC).isoformat()
        return {"lease_id": lease.id, "expires_at": expires_at, **self.terms}

    def lease_grant(self, operation_id: str, *, approval_credential: bool = False) -> Answer:
        canned = self._canned("grant", operation_id=operation_id)
        if canned is not None:
            return canned
        with self._lock:
            now = self.clock.wall()
            op = self.operations.get(operation_id)
            if op is None:
                self._record("grant", 404, operation_id=operation_id)
                return error(404, "not_found", "no such operation")
            refusal = "cancelled" if op["cancelled"] else op["refuse_grant"]
            lease = self.lease_of(operation_id)
            if refusal is None and lease is not None and (lease.refused or now >= lease.expires_at):
                refusal = lease.refused or "expired"  # L1: never a second lease
            if refusal is not None:
                self._record("grant", 409, operation_id=operation_id)
                return error(409, refusal)
            status = 200
            if lease is None:
                lease = Lease(id=str(uuid.uuid4()), operation_id=operation_id,
                              expires_at=now + self.terms["duration_s"])
                self.leases[lease.id] = lease
                status = 201
            self._record("grant", status, operation_id=operation_id, lease_id=lease.id)
            body = self._body(lease)
            if approval_credential:  # Q5: a fresh one per answer, as the service does
                body["approval"] = {"credential": secrets.token_urlsafe(32), "wait_s": self.approval_wait_s}
            return answer(status, body)

    def lease_renew(self, lease_id: str, *, output_tail: str, timeout_s: float) -> Answer:
        canned = self._canned("renew", lease_id=lease_id)
        if canned is not None:
            return canned
        with self._lock:
            now = self.clock.wall()
            lease = self.leases.get(lease_id)
            if lease is None:
                self._record("renew", 404, lease_id=lease_id)
                return error(404, "not_found", "no such lease")
            op = self.operations[lease.operation_id]
            if lease.refused is None:
                if op["cancelled"]:
                    lease.refused = "cancelled"
                elif op["refuse_renewal"]:
                    lease.refused = op["refuse_renewal"]
                elif now >= lease.expires_at:
                    lease.refused = "expired"
            if lease.refused is not None:
                self._record("renew", 409, lease_id=lease_id, reason=lease.refused)
                return error(409, lease.refused)
            lease.expires_at = now + self.terms["duration_s"]
            lease.renewals.append((self.clock.monotonic(), output_tail))
            self._record("renew", 200, lease_id=lease_id)
            return answer(200, self._body(lease))

    def progress(self, body: dict) -> Answer:
        """G4: recorded in ``self.progress_posts``; while ``progress_gate`` is cleared
        every progress call blocks (a slow service), without holding the lock."""
        self.progress_gate.wait()
        canned = self._canned("progress", body=body)
        if canned is not None:
            return canned
        with self._lock:
            self.progress_posts.append((self.clock.monotonic(), body))
            self._record("progress", 200, body=body)
        return answer(200, {"outcome": "applied"})

    def send(self, method: str, path: str, body: dict, timeout_s: float | None = None) -> Answer:
        if method == "POST" and path == RECEIPTS_PATH:
            return self._receipt(body)
        if method == "POST" and path == SYNC_PATH and self.sync_route:
            return self._sync(body)
        marker = MARKER_PATH.match(path)
        if method == "PUT" and marker:
            canned = self._canned("marker", session_id=marker["session"], body=body)
            if canned is not None:
                return canned
            with self._lock:
                self.markers.append({"session_id": marker["session"], **body})
                self._record("marker", 200, session_id=marker["session"], body=body)
            return answer(200, {"outcome": "applied"})
        sweep = SWEEP_PATH.match(path)
        if method == "POST" and sweep:
            canned = self._canned("sweep", device_id=sweep["device"])
            if canned is not None:
                return canned
            with self._lock:
                self.sweeps.append(sweep["device"])
                self._record("sweep", 200, device_id=sweep["device"])
            return answer(200, {"closed": 0})
        if method == "PUT" and path == "/api/worker/profiles/":
            canned = self._canned("profiles", body=body)
            if canned is not None:
                return canned
            with self._lock:  # stored as the service stores them: sorted by name, isolation filled in (B10, G7)
                self.profiles = sorted(({"name": p["name"], "preset": p.get("preset"),
                                         "isolation": p.get("isolation") or "none",
                                         "conversation": p.get("conversation") or "none"}
                                        for p in body.get("profiles", [])),
                                       key=lambda p: p["name"])
                self._record("profiles", 200, body=body)
            return answer(200, {"profiles": self.profiles})
        return error(404, "not_found", f"no route {method} {path}")

    def _sync(self, body: dict) -> Answer:
        """A sync, as the service answers it: a malformed receipt refuses the whole request
        (400, nothing applied); else each lease is renewed and each receipt applied as
        alone (R1), leases first."""
        receipts = body.get("receipts") or []
        renew = body.get("renew") or []
        canned = self._canned("sync", event_ids=[r.get("event_id") for r in receipts],
                              lease_ids=[r.get("lease_id") for r in renew])
        if canned is not None:
            return canned
        with self._lock:
            try:
                for item in receipts:
                    check_receipt(item)
                if len(renew) > shapes.SYNC_ITEMS_MAX or len(receipts) > shapes.SYNC_ITEMS_MAX:
                    raise ProtocolError(f"more than {shapes.SYNC_ITEMS_MAX} items")
            except ProtocolError as exc:
                self._record("sync", 400, event_ids=[r.get("event_id") for r in receipts])
                return error(400, "invalid", f"malformed sync: {exc}")
            self._record("sync", 200, event_ids=[r.get("event_id") for r in receipts],
                         lease_ids=[r.get("lease_id") for r in renew])
            leases = []
            for item in renew:
                one = self.lease_renew(item["lease_id"], output_tail=item.get("output_tail", ""), timeout_s=0)
                leases.append({"status": one.status, "lease": one.body} if one.status == 200 else
                              {"status": one.status, "error": one.error, "detail": ""})
            answers = []
            for item in receipts:
                one = self._receipt(item)
                answers.append({"event_id": item["event_id"], "status": one.status, "answer": one.body})
            return answer(200, {"leases": leases, "receipts": answers})

    def _receipt(self, body: dict) -> Answer:
        event_id = body.get("event_id") if isinstance(body, dict) else None
        canned = self._canned("receipt", event_id=event_id, body=body)
        if canned is not None:
            return canned
        with self._lock:
            if event_id in self.receipts:  # R1: applied zero more times, same answer
                first = self.receipts[event_id][1]
                self._record("receipt", first.status, event_id=event_id, body=body, repeat=True)
                return first
            try:
                check_receipt(body)
            except ProtocolError as exc:
                self._record("receipt", 400, event_id=event_id, body=body)
                return error(400, "invalid", f"malformed receipt: {exc}")
            already_final = any(b["kind"] == "final" for b in self.receipts_for(body["operation_id"]))
            if body["kind"] == "final" and already_final:
                result = answer(200, {"outcome": "not_applied", "reason": "final"})
            else:
                result = answer(200, {"outcome": "applied"})
            self.receipts[event_id] = (body, result)
            self._record("receipt", 200, event_id=event_id, body=body)
            return result

    def close(self) -> None:
        pass
