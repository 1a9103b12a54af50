"""Row locks of the task services (P1, P2); their deadlock retry is ``core.deadlocks``.

Lock order everywhere: idempotency key -> machine -> grant -> budget -> task -> lease.
The per-machine folder-lock (``advisory_xact_lock("folder-lock:<machine>")``, A8) comes
after the budget row: acceptance takes it there, and so does a queued follow-up's
promotion (G8), which runs inside a final transition that holds the budget row and the
followed task's row.
On SQLite every transaction is ``BEGIN IMMEDIATE`` (settings), so writers serialize and
the row-lock helpers below have nothing to add there.
"""
import hashlib

from django.db import connection, transaction

from tasks_app.models import Budget


def is_postgres() -> bool:
    return connection.vendor == "postgresql"


def for_key_share(queryset) -> list:
    """Evaluate ``queryset`` taking ``FOR KEY SHARE`` on its rows (PostgreSQL); Django has
    no shared row lock (ticket #10088). Must run inside ``transaction.atomic()``.

    Rows a concurrent ``FOR UPDATE`` holder changes are re-checked against the WHERE
    clause once it commits, so a filter such as ``revoked_at IS NULL`` sees the revocation
    (P1). Returns model instances.
    """
    if not connection.in_atomic_block:
        raise transaction.TransactionManagementError("for_key_share() needs an atomic block")
    if not is_postgres():
        return list(queryset)
    sql, params = queryset.query.sql_with_params()
    return list(queryset.model.objects.raw(f"{sql} FOR KEY SHARE", params))


def advisory_xact_lock(name: str) -> None:
    """Transaction-scoped exclusive lock on ``name`` (PostgreSQL advisory lock; on SQLite
    the IMMEDIATE transaction already excludes other writers). Used as the per-machine
    folder-lock check of A8."""
    if not is_postgres():
        return
    key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
    with connection.cursor() as cursor:
        cursor.execute("SELECT pg_advisory_xact_lock(%s)", [key])


def lock_budget(owner_id) -> None:
    """``FOR UPDATE`` on the owner's budget row. Taken before any task row by every
    transaction that may settle a budget, keeping the P2 order budget -> task."""
    Budget.objects.select_for_update().filter(owner_id=owner_id).first()
