"""Task acceptance, exactly once (SPEC A1-A8, P1, P2)."""
import hashlib
import json
import posixpath
import unicodedata
import uuid
from dataclasses import dataclass
from datetime import datetime

from django.db import connection, transaction
from django.db.models import F
from rest_framework.renderers import JSONRenderer

from config.errors import ApplicationError
from tasks_app.models import (
    FINAL_STATES,
    Budget,
    Grant,
    IdempotencyRecord,
    Machine,
    Operation,
    Task,
)
from tasks_app.services.locking import advisory_xact_lock, for_key_share, retry_on_deadlock
from tasks_app.services.transitions import task_created
from tasks_app.shapes import actor_owner, task_dict
from tasks_app.signals import task_session_claimed

PENDING_STATUS = 0  # a claimed key whose response is written later in the same transaction
CLAIM_ATTEMPTS = 3


@dataclass(frozen=True)
class StoredResponse:
    """An acceptance answer: HTTP status, the exact body bytes, and whether it is a replay."""

    status: int
    body: str
    replayed: bool


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
    canonical = json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def folder_problem(folder: str) -> str | None:
    """Why ``folder`` is not an acceptable absolute path (K4), or None."""
    if not folder.startswith("/"):
        return "must be an absolute path"
    if ".." in folder.split("/") or "\x00" in folder:
        return "must not contain '..' or NUL"
    return None


def normalize_folder(folder: str) -> str:
    """An absolute, normalised POSIX path. Raises ApplicationError 400 ``invalid`` for a
    relative path or one with ``..`` components (K4)."""
    problem = folder_problem(folder)
    if problem:
        raise ApplicationError("invalid", f"folder {problem}", fields={"folder": [problem]})
    return posixpath.normpath(folder).replace("//", "/")


def path_within(path: str, root: str) -> bool:
    """True when ``path`` is ``root`` or below it (both normalised absolute paths)."""
    root = root.rstrip("/") or "/"
    return path == root or path.startswith(root if root == "/" else root + "/")


def folder_lock_key(folder: str) -> str:
    """How A8 compares folders: Unicode NFC and case-folded. The worker usually runs on a
    Mac, whose default file system treats ``Repo`` and ``repo`` (and NFC/NFD spellings of
    ``café``) as one folder; the service cannot tell, so it assumes they may be, and two
    exclusive tasks never share a folder under different spellings. Paths are stored and
    sent to the worker exactly as given."""
    return unicodedata.normalize("NFC", folder).casefold()


def task_accept(*, owner, key: str, raw_body: dict, data: dict, now: datetime, serialize=task_dict) -> StoredResponse:
    """Accept a task exactly once per (owner, idempotency key) (A1-A5).

    ``raw_body`` is the parsed JSON as sent (for the digest, A2); ``data`` the validated
    fields (machine, folder, agent, prompt, session, deep_research, max_runtime_s,
    exclusive). ``serialize(task) -> dict`` renders the 201 body (the task shape). One transaction writes
    the task, operation, idempotency record, budget reservation, folder lock and outbox
    ``start`` message, or nothing (A5). Refusals (A6) raise ApplicationError and store
    nothing. Returns the stored response (a replay for a known key with the same body).
    """
    digest = body_digest(raw_body)
    return _accept(owner=owner, key=key, digest=digest, data=data, now=now, serialize=serialize)


@retry_on_deadlock
def _accept(*, owner, key, digest, data, now, serialize) -> StoredResponse:
    with transaction.atomic():
        # P2: the key first. A racing inserter of the same key makes this wait for its
        # commit (then we replay) or its rollback (then we proceed on our own) (A4).
        record_id = record = None
        for _ in range(CLAIM_ATTEMPTS):
            record_id = _claim_key(owner_id=owner.pk, key=key, digest=digest, now=now)
            if record_id is not None:
                break
            # The key is taken by a committed record; read it in a fresh statement (READ
            # COMMITTED). It can vanish in between only through the A7 cleanup: claim again.
            record = IdempotencyRecord.objects.filter(owner=owner, key=key).first()
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

        task = _create_task(owner=owner, data=data, now=now)
        body = JSONRenderer().render(serialize(task)).decode()
        IdempotencyRecord.objects.filter(pk=record_id).update(response_status=201, response_body=body, task=task)
        return StoredResponse(201, body, replayed=False)


def _claim_key(*, owner_id, key, digest, now) -> int | None:
    table = IdempotencyRecord._meta.db_table
    with connection.cursor() as cursor:
        cursor.execute(
            f"INSERT INTO {table} (owner_id, key, body_digest, response_status, response_body, created_at) "
            "VALUES (%s, %s, %s, %s, '', %s) ON CONFLICT (owner_id, key) DO NOTHING RETURNING id",
            [owner_id, key, digest, PENDING_STATUS, now],
        )
        row = cursor.fetchone()
    return row[0] if row else None


def _continued_task(*, owner, machine, task_id) -> Task | None:
    """G6: the task a follow-up continues: a final task of the same owner and machine whose
    facts carry an agent session id. Anything else (another owner's task included) is the
    same 400 ``continue_invalid``, so ids leak nothing."""
    if task_id is None:
        return None
    task = Task.objects.filter(pk=task_id, owner=owner, machine=machine, state__in=FINAL_STATES).exclude(
        agent_session_id="").first()
    if task is None:
        raise ApplicationError("continue_invalid", "continue_task must be a final task of yours on this machine "
                               "whose agent reported a session id")
    return task


def _create_task(*, owner, data, now) -> Task:
    folder = normalize_folder(data["folder"])
    machine_id = data["machine"]
    # P1/P2: machine, then grant (FOR KEY SHARE), then the folder-lock check, then budget.
    machines = for_key_share(Machine.objects.filter(pk=machine_id, owner=owner))
    if not machines:
        raise ApplicationError("machine_forbidden", "no such machine among yours", status_code=403)
    machine = machines[0]
    # A6: a bad follow-up is a bad body (400), checked once the machine is known to be the owner's.
    continued_from = _continued_task(owner=owner, machine=machine, task_id=data.get("continue_task"))
    grants = for_key_share(Grant.objects.filter(machine_id=machine.pk, revoked_at__isnull=True).order_by("pk"))
    covering = [g for g in grants if path_within(folder, g.path)]
    if not covering:
        raise ApplicationError("folder_not_granted", "this machine has no grant for that folder", status_code=403)
    grant = max(covering, key=lambda g: len(g.path))
    if not machine.paired:
        raise ApplicationError("machine_unpaired", "the machine is not paired", status_code=409)

    if data["exclusive"]:
        advisory_xact_lock(f"folder-lock:{machine.pk}")  # A8: per-machine
        mine = folder_lock_key(folder)
        for holder in Task.objects.filter(machine=machine, holds_lock=True).only("id", "folder"):
            theirs = folder_lock_key(holder.folder)
            if path_within(mine, theirs) or path_within(theirs, mine):
                raise ApplicationError(
                    "folder_locked",
                    "an unfinished exclusive task holds this folder, an ancestor or a descendant",
                    status_code=409,
                    task_id=str(holder.id),
                )

    reserve = float(data["max_runtime_s"])
    budget = Budget.objects.select_for_update().filter(owner=owner).first()
    if budget is None or budget.limit_s - budget.reserved_s - budget.spent_s < reserve:
        raise ApplicationError("budget_exhausted", "not enough budget left for max_runtime_s", status_code=409)
    Budget.objects.filter(pk=budget.pk).update(reserved_s=F("reserved_s") + reserve)

    session_id = data.get("session")
    if session_id:
        # The sessions app makes sure the owner's session exists, or refuses (K2).
        task_session_claimed.send(sender=Task, owner=owner, session_id=session_id, now=now)

    task = Task.objects.create(
        id=uuid.uuid4(),
        owner=owner,
        machine=machine,
        grant=grant,
        session_id=session_id or None,
        folder=folder,
        agent=data["agent"],
        prompt=data["prompt"],
        deep_research=data["deep_research"],
        max_runtime_s=data["max_runtime_s"],
        exclusive=data["exclusive"],
        holds_lock=data["exclusive"],
        reserved_s=reserve,
        continued_from=continued_from,
        created_at=now,
        updated_at=now,
    )
    Operation.objects.create(task=task, created_at=now)
    task_created(task, actor=actor_owner(owner), now=now)
    return task
