"""HTTP to the control service (SPEC H, R3, R4). httpx only; no Django.

Every request carries ``Authorization: Machine <token>``. ``Answer.kind`` classifies a
reply the way R3 says: ``ok``, ``final`` (4xx other than 401/429: never retried),
``revoked`` (401: stop and ask to be paired again) or ``retry`` (429, 5xx, network).
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass

import httpx

BACKOFF_BASE_S = 1.0
BACKOFF_CAP_S = 60.0
REQUEST_TIMEOUT_S = 10.0


class Backoff:
    """Exponential backoff with jitter, capped (R4), in seconds.

    Attempt n waits a random time in ``[d/2, d]`` with ``d = min(cap, base * 2**n)``
    ("equal jitter"): never more than ``cap``, never less than the previous attempt's
    lower bound, so waits grow until they reach the cap.
    """

    def __init__(self, base_s: float = BACKOFF_BASE_S, cap_s: float = BACKOFF_CAP_S, rng=random.random):
        self.base_s = base_s
        self.cap_s = cap_s
        self.rng = rng

    def delay(self, attempt: int) -> float:
        d = min(self.cap_s, self.base_s * (2 ** min(attempt, 62)))
        return d / 2 + self.rng() * d / 2


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

    def request(self, method: str, path: str, body: dict | None = None, timeout_s: float | None = None) -> Answer:
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


def pair(server: str, code: str, name: str) -> Answer:
    """``POST /api/worker/pair/`` -> 201 ``{machine_id, token, generation}``."""
    client = ServiceClient(server, token=None)
    try:
        return client.request("POST", "/api/worker/pair/", {"code": code, "name": name})
    finally:
        client.close()
