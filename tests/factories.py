"""Small helpers for service tests: submit a task, walk it through the worker protocol,
valid notification settings and push subscription bodies, a digest of every table."""
import base64
import hashlib
import itertools
import uuid

from django.db import connection

from tests.conftest import machine_api, owner_api
from tests.notify_support import ALL_ON

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


def notification_settings() -> dict:
    """A valid ``PUT /api/notifications/settings/`` body (N2): every kind on, board only."""
    return {"kinds": dict(ALL_ON), "webhook_url": None, "board": True, "push": False}


def push_subscription() -> dict:
    """A ``POST /api/push/subscriptions/`` body whose keys have the right sizes (a P-256
    point, 16 bytes of auth)."""
    b64 = lambda raw: base64.urlsafe_b64encode(raw).decode().rstrip("=")  # noqa: E731
    return {"endpoint": "https://push.example.com/abc", "keys": {"p256dh": b64(b"\x04" + bytes(64)), "auth": b64(bytes(16))}}


def table_digest() -> dict:
    """Row count and a digest of every row of every table (sorted), per table: equal
    before and after means a request changed nothing. ``{table: (rows, hex digest)}``;
    digests compare only with digests of the same backend.

    On PostgreSQL the server computes every table's in one statement (its rows as text,
    sorted, MD5): one round trip instead of one per table, which was 84 % of the
    isolation matrix's time there (1,800 digests of ~40 tables). On SQLite (in this
    process) each table is read and hashed here (SHA-256 of the rows' ``repr``)."""
    out = {}
    tables = sorted(connection.introspection.table_names())
    with connection.cursor() as cursor:
        if connection.vendor == "postgresql":
            quote = connection.ops.quote_name
            cursor.execute(" UNION ALL ".join(
                f"SELECT %s, count(*), md5(coalesce(string_agg(digest_row::text, E'\\n' ORDER BY digest_row::text), '')) "
                f"FROM {quote(t)} digest_row"
                for t in tables), tables)
            return {table: (count, digest) for table, count, digest in cursor.fetchall()}
        for table in tables:
            cursor.execute(f'SELECT * FROM "{table}"')
            rows = sorted(repr(r) for r in cursor.fetchall())
            out[table] = (len(rows), hashlib.sha256("\n".join(rows).encode()).hexdigest())
    return out
