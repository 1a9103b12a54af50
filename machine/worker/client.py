"""The worker's view of the control service (SPEC H, R3, R4). httpx only; no Django.

``Service`` is everything the worker loop asks of the service; ``HttpService`` speaks it
over HTTP (every request carries ``Authorization: Machine <token>``), and
``machine.worker.testing.InMemoryService`` implements it in memory for tests. A worker
gets a ``connect()`` factory and opens one ``Service`` per thread.

``Answer.kind`` classifies a reply the way R3 says: ``ok``, ``final`` (4xx other than
401/429: never retried), ``revoked`` (401: stop and ask to be paired again) or ``retry``
(429, 5xx, network).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Protocol
from collections.abc import Callable

import httpx

from machine.protocol import LONG_POLL_MAX_S, PULL_IDLE_TIMEOUT_S

BACKOFF_BASE_S = 1.0  # the first retry waits 0.5-1 s (R4; ``machine.protocol.Backoff``)
REQUEST_TIMEOUT_S = 10.0
PROGRESS_TIMEOUT_S = 5.0  # G4: a stuck progress call gives up; the next replaces it
MAX_POLL_WAIT_S = float(LONG_POLL_MAX_S)  # the service's long-poll maximum (H)


@dataclass
class Answer:
    status: int  # 0 for a network error
    body: dict | None
    text: str

    @property
    def kind(self) -> str:
        if self.status == 0 or self.status == 429 or self.status >= 500:
            return "retry"
        if self.status == 401:
            return "revoked"
        if 200 <= self.status < 300:
            return "ok"
        return "final"

    @property
    def error(self) -> str | None:
        if isinstance(self.body, dict):
            return self.body.get("error")
        return None


class ServiceClient:
    """One httpx client (use one per thread). ``request`` never raises for HTTP or
    network trouble; it returns an ``Answer`` with status 0 for a network error."""

    def __init__(self, server: str, token: str | None, timeout_s: float = REQUEST_TIMEOUT_S):
        headers = {"Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Machine {token}"
        self.http = httpx.Client(base_url=server.rstrip("/"), headers=headers, timeout=timeout_s)

    def close(self) -> None:
        self.http.close()

    def request(self, method: str, path: str, body: dict | None = None,
                timeout_s: float | httpx.Timeout | None = None) -> Answer:
        kwargs = {}
        if body is not None:
            kwargs["content"] = json.dumps(body).encode()
            kwargs["headers"] = {"Content-Type": "application/json"}
        if timeout_s is not None:
            kwargs["timeout"] = timeout_s
        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as exc:
            return Answer(status=0, body=None, text=f"{type(exc).__name__}: {exc}")
        try:
            parsed = response.json()
        except ValueError:
            parsed = None
        return Answer(status=response.status_code, body=parsed if isinstance(parsed, dict) else None, text=response.text)


class Service(Protocol):
    """What the worker loop asks of the control service. No method raises for HTTP or
    network trouble: each returns an ``Answer`` (status 0 for a network error)."""

    def pull(self, wait_s: float) -> Answer:
        """``GET /api/worker/messages/?wait=`` -> ``{"messages": [{id, kind, operation_id,
        payload}]}``; long-polls up to ``wait_s`` (at most ``LONG_POLL_MAX_S``) seconds (W2)."""

    def ack(self, message_id: str) -> Answer:
        """``POST /api/worker/messages/{id}/ack/`` (idempotent, W2)."""

    def lease_grant(self, operation_id: str, *, approval_credential: bool = False) -> Answer:
        """``POST /api/worker/leases/`` -> 201/200 lease terms, 409 ``{"error": reason}`` (L1);
        with ``approval_credential`` (Q5) the terms carry ``approval: {credential, wait_s}``."""

    def lease_renew(self, lease_id: str, *, output_tail: str, timeout_s: float) -> Answer:
        """``POST /api/worker/leases/{id}/renew/`` -> lease terms, 409 refusal (L2, L5, L10)."""

    def progress(self, body: dict) -> Answer:
        """G4: ``POST /api/worker/progress/`` (best effort, never retried)."""

    def send(self, method: str, path: str, body: dict, timeout_s: float | None = None) -> Answer:
        """One durable outbox row: a receipt (``POST /api/worker/receipts/``, R1-R3), a
        session marker (``PUT /api/sessions/{id}/marker/``, M8) or a device sweep (M5);
        ``timeout_s``: shorter than the default for a caller that must not wait long (C10's
        claim, on the run's thread)."""

    def close(self) -> None:
        """Release the connection."""


Connect = Callable[[], Service]


class HttpService:
    """``Service`` over HTTP: one httpx client, so one instance per thread. A pull gives
    up after ``pull_idle_s`` seconds without a byte (the service sends a space every
    ``LONG_POLL_KEEPALIVE_S`` while it waits): a half-open connection costs that, not the
    whole wait (D1)."""

    def __init__(self, server: str, token: str | None, timeout_s: float = REQUEST_TIMEOUT_S,
                 pull_idle_s: float = PULL_IDLE_TIMEOUT_S):
        self.client = ServiceClient(server, token, timeout_s=timeout_s)
        self.pull_timeout = httpx.Timeout(timeout_s, read=pull_idle_s)

    def pull(self, wait_s: float) -> Answer:
        wait = max(0.0, min(MAX_POLL_WAIT_S, wait_s))
        return self.client.request("GET", f"/api/worker/messages/?wait={wait:g}", timeout_s=self.pull_timeout)

    def ack(self, message_id: str) -> Answer:
        return self.client.request("POST", f"/api/worker/messages/{message_id}/ack/", {})

    def lease_grant(self, operation_id: str, *, approval_credential: bool = False) -> Answer:
        body = {"operation_id": operation_id}
        if approval_credential:
            body["approval_credential"] = True
        return self.client.request("POST", "/api/worker/leases/", body)

    def lease_renew(self, lease_id: str, *, output_tail: str, timeout_s: float) -> Answer:
        return self.client.request("POST", f"/api/worker/leases/{lease_id}/renew/", {"output_tail": output_tail},
                                   timeout_s=timeout_s)

    def progress(self, body: dict) -> Answer:
        return self.client.request("POST", "/api/worker/progress/", body, timeout_s=PROGRESS_TIMEOUT_S)

    def send(self, method: str, path: str, body: dict, timeout_s: float | None = None) -> Answer:
        return self.client.request(method, path, body, timeout_s=timeout_s)

    def close(self) -> None:
        self.client.close()


def http_connect(server: str, token: str | None, pull_idle_s: float = PULL_IDLE_TIMEOUT_S) -> Connect:
    """A ``connect()`` factory for a real service at ``server``."""
    return lambda: HttpService(server, token, pull_idle_s=pull_idle_s)


def pair(server: str, code: str, name: str) -> Answer:
    """``POST /api/worker/pair/`` -> 201 ``{machine_id, token, generation}``."""
    client = ServiceClient(server, token=None)
    try:
        return client.request("POST", "/api/worker/pair/", {"code": code, "name": name})
    finally:
        client.close()
