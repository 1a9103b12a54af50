"""The Idempotency-Key machinery (SPEC A1-A4, A7, Q2), for every owner request that must
take effect once, whichever app it belongs to: task acceptance, a conversation's message
(C2), a worktree task's merge or discard (G7), an approval's decision (Q2).

A view parses the key (``parse_idempotency_key``), then answers with ``respond_once``,
handing it the service call as ``work``. The service returns data, ``(status, body,
ties)``; this module alone renders it, stores it and speaks HTTP.

Per owner, scope and key the records model (``tasks_app.models.IdempotencyRecord``)
keeps a digest of the canonical request and the full response. The scope keeps the keys
of different operations apart (``task`` for acceptance, ``message:<task id>``,
``approval:<id>``): the same key sent to two operations is two records, never a replay
of the other's answer. ``respond_once`` claims the key first (P2: ``INSERT ... ON
CONFLICT DO NOTHING``, which waits for a racing inserter of the same key), then either
replays a committed record byte-equal (A2; 422 for another body, A3) or runs the work and
stores its rendered answer, all in one transaction: a refusal raised by the work rolls
the claim back, so nothing is stored and the same key works once the cause is gone (A5).
"""
from collections.abc import Callable
from datetime import datetime
from typing import Any

from django.db import connection, transaction
from django.db.models import Model
from django.http import HttpResponse
from rest_framework.renderers import JSONRenderer

from core.deadlocks import retry_on_deadlock
from core.errors import ApplicationError
from machine.protocol import json_digest

PENDING_STATUS = 0  # a claimed key whose response is written later in the same transaction
CLAIM_ATTEMPTS = 3

# What idempotent work returns: ``(status, body, ties)``: the HTTP status, the JSON-able
# body, and further fields of the stored record (``{"task": task}``: the task whose final
# state starts the record's retention window, A7; ``{}``: kept for the window from its
# creation).
Answer = tuple[int, Any, dict[str, Any]]


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
    """A2: SHA-256 hex of the canonical body (the parsed JSON as sent, keys sorted)."""
    return json_digest(data)


def rendered(body) -> str:
    """The JSON text of ``body`` as DRF renders a response (compact, UTF-8): what an
    idempotent answer stores and a replay repeats byte-equal (A2; the receipts' R1 too)."""
    return JSONRenderer().render(body).decode()


@retry_on_deadlock
def respond_once(records: type[Model], *, owner, scope: str, key: str, digest: str, now: datetime,
                 work: Callable[[], Answer]) -> HttpResponse:
    """Run ``work() -> (status, body, ties)`` at most once per (owner, ``scope``, key)
    and answer with what it returned, or with the stored answer of an earlier request
    with the same ``digest`` (a replay: the first answer's bytes and status, with
    ``Idempotent-Replayed: true``, A2). The claim, the work's effect and the stored
    answer are one transaction (A4, A5). ``records`` is the model that keeps them (fields
    ``owner``, ``scope``, ``key``, ``body_digest``, ``response_status``,
    ``response_body``, ``created_at``, and the ``ties``). Raises ApplicationError 422
    ``idempotency_key_reused`` (another digest), 409 ``conflict`` (the key vanished
    twice under the A7 cleanup), and whatever ``work`` raises (nothing stored then)."""
    with transaction.atomic():
        # P2: the key first. A racing inserter of the same key makes this wait for its
        # commit (then we replay) or its rollback (then we proceed on our own) (A4).
        record_id = record = None
        for _ in range(CLAIM_ATTEMPTS):
            record_id = _claim_key(records, owner_id=owner.pk, scope=scope, key=key, digest=digest, now=now)
            if record_id is not None:
                break
            # The key is taken by a committed record; read it in a fresh statement (READ
            # COMMITTED). It can vanish in between only through the A7 cleanup: claim again.
            record = records.objects.filter(owner=owner, scope=scope, key=key).first()
            if record is not None:
                break
        if record_id is None:
            if record is None:
                raise ApplicationError("conflict", "the Idempotency-Key changed hands meanwhile, retry", status_code=409)
            if record.body_digest != digest:
                raise ApplicationError(
                    "idempotency_key_reused", "this Idempotency-Key was used with a different body", status_code=422
                )
            return _http(record.response_status, record.response_body, replayed=True)
        status, answer, ties = work()
        body = rendered(answer)
        records.objects.filter(pk=record_id).update(response_status=status, response_body=body, **ties)
    return _http(status, body, replayed=False)


def _http(status: int, body: str, *, replayed: bool) -> HttpResponse:
    response = HttpResponse(body, status=status, content_type="application/json")
    if replayed:
        response["Idempotent-Replayed"] = "true"
    return response


def _claim_key(records: type[Model], *, owner_id, scope, key, digest, now) -> int | None:
    table = records._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (owner_id, scope, key, body_digest, response_status, response_body, created_at) "
            "VALUES (%s, %s, %s, %s, %s, '', %s) ON CONFLICT (owner_id, scope, key) DO NOTHING RETURNING id",
            [owner_id, scope, key, digest, PENDING_STATUS, now],
        )
        row = cursor.fetchone()
    return row[0] if row else None
