"""The Idempotency-Key machinery (SPEC A1-A4, A7, Q2), for every owner request that must
take effect once: task acceptance, a worktree task's merge or discard (G7), an approval's
decision (Q2).

Per owner, scope and key the service stores a digest of the canonical request and the
full response. The scope keeps the keys of different operations apart (``task`` for
acceptance, ``integrate:<task id>``, ``approval:<id>``): the same key sent to two
operations is two records, never a replay of the other's answer. ``run_once`` claims
the key first (P2: ``INSERT ... ON CONFLICT DO NOTHING``, which waits for a racing
inserter of the same key), then either replays a committed record byte-equal (A2; 422
for another body, A3) or runs the work and stores its answer, all in one transaction: a
refusal raised by the work rolls the claim back, so nothing is stored and the same key
works once the cause is gone (A5).
"""
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.http import HttpResponse
from rest_framework.renderers import JSONRenderer

from core.errors import ApplicationError
from tasks_app.models import IdempotencyRecord, Task
from machine.protocol import json_digest
from tasks_app.services.locking import retry_on_deadlock

PENDING_STATUS = 0  # a claimed key whose response is written later in the same transaction
CLAIM_ATTEMPTS = 3
SCOPE_TASK = "task"  # acceptance (A1)


@dataclass(frozen=True)
class StoredResponse:
    """An answer kept for a key: HTTP status, the exact body bytes, and whether it is a replay."""

    status: int
    body: str
    replayed: bool

    def http(self) -> HttpResponse:
        """The answer as a view sends it: the stored body byte-equal, with
        ``Idempotent-Replayed: true`` when it is a replay (A2)."""
        response = HttpResponse(self.body, status=self.status, content_type="application/json")
        if self.replayed:
            response["Idempotent-Replayed"] = "true"
        return response


def parse_idempotency_key(raw: str | None) -> str:
    """A1: 1-255 printable ASCII; a double-quoted value (structured-field form) is unquoted.
    Raises ApplicationError 400 ``idempotency_key_missing`` / ``idempotency_key_invalid``."""
    if raw is None or raw == "":
        raise ApplicationError("idempotency_key_missing", "the Idempotency-Key header is required")
    key = raw
    if len(key) >= 2 and key[0] == key[-1] == '"':
        key = key[1:-1]
    if not 1 <= len(key) <= 255 or any(not 0x20 <= ord(c) <= 0x7E for c in key) or '"' in key:
        raise ApplicationError("idempotency_key_invalid", "Idempotency-Key must be 1-255 printable ASCII characters")
    return key


def body_digest(data) -> str:
    """A2: SHA-256 of the canonical body (the parsed JSON as sent, keys sorted)."""
    return json_digest(data)


@retry_on_deadlock
def run_once(*, owner, key: str, digest: str, now: datetime,
             work: Callable[[], tuple[int, dict, Task | None]], scope: str = SCOPE_TASK) -> StoredResponse:
    """Run ``work() -> (status, body, task)`` at most once per (owner, ``scope``, key)
    and answer with what it returned, or with the stored answer of an earlier request
    with the same ``digest`` (a replay). ``task`` ties the record to the task whose final
    state starts its retention window (A7); a record without one lives for the retention
    window from its creation. Raises ApplicationError 422 ``idempotency_key_reused``
    (another digest) and whatever ``work`` raises (nothing stored then)."""
    with transaction.atomic():
        # P2: the key first. A racing inserter of the same key makes this wait for its
        # commit (then we replay) or its rollback (then we proceed on our own) (A4).
        record_id = record = None
        for _ in range(CLAIM_ATTEMPTS):
            record_id = _claim_key(owner_id=owner.pk, scope=scope, key=key, digest=digest, now=now)
            if record_id is not None:
                break
            # The key is taken by a committed record; read it in a fresh statement (READ
            # COMMITTED). It can vanish in between only through the A7 cleanup: claim again.
            record = IdempotencyRecord.objects.filter(owner=owner, scope=scope, key=key).first()
            if record is not None:
                break
        if record_id is None:
            if record is None:
                raise ApplicationError("conflict", "the Idempotency-Key changed hands meanwhile, retry", status_code=409)
            if record.body_digest != digest:
                raise ApplicationError(
                    "idempotency_key_reused", "this Idempotency-Key was used with a different body", status_code=422
                )
            return StoredResponse(record.response_status, record.response_body, replayed=True)
        status, answer, task = work()
        body = JSONRenderer().render(answer).decode()
        IdempotencyRecord.objects.filter(pk=record_id).update(response_status=status, response_body=body, task=task)
        return StoredResponse(status, body, replayed=False)


def _claim_key(*, owner_id, scope, key, digest, now) -> int | None:
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (owner_id, scope, key, body_digest, response_status, response_body, created_at) "
            "VALUES (%s, %s, %s, %s, %s, '', %s) ON CONFLICT (owner_id, scope, key) DO NOTHING RETURNING id",
            [owner_id, scope, key, digest, PENDING_STATUS, now],
        )
        row = cursor.fetchone()
    return row[0] if row else None
