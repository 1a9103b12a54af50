"""Owner-named machine pools (SPEC C8: "or a pool name the owner defines").

A pool is a name and a set of the owner's machines. A task naming the pool
(``"machine": "<name>"``) is placed by ``machine_choice.machine_pick`` among the pool's
machines with the rules of ``"machine": "any"``. A pool is configuration, not history:
renaming it, changing its machines or deleting it changes no task (a task keeps the name
it was accepted under in ``machine_choice``), and unpairing a machine leaves it in its
pools (the pick refuses it as ``unpaired``, with the reason shown).

Every change is announced to the owner's boards after commit (B2, issue 44): ``pool``
(``{"type": "pool", "pool": PoolShape, "version"}``) on create and update, ``pool.deleted``
(``{"type": "pool.deleted", "pool_id", "version"}``) on delete, each sent from the
transaction that made the change, so a refused change sends nothing.
"""
import re
import uuid
from datetime import datetime

from django.db import IntegrityError, transaction

from core.broadcast import broadcast
from core.errors import ApplicationError
from tasks_app.models import Machine, Pool
from tasks_app.shapes import pool_deleted_event, pool_event

# A pool name: a letter first, then letters, digits, ``_``, ``.``, ``-``; at most 64
# characters; never ``any`` (any case: it names every machine) nor shaped like a machine
# id (``"machine"`` tries a UUID first, so such a pool could never be named).
POOL_NAME = re.compile(r"^[A-Za-z][A-Za-z0-9_.-]{0,63}$")
POOL_MACHINES_MAX = 100


def pool_name_problem(name: str) -> str | None:
    """Why ``name`` cannot name a pool (a sentence), or None."""
    if not isinstance(name, str) or not POOL_NAME.match(name):
        return "must be 1-64 letters, digits, '_', '.' or '-', starting with a letter"
    if name.lower() == "any":
        return '"any" names every machine; choose another name'
    try:
        uuid.UUID(name)
    except ValueError:
        return None
    return "must not look like a machine id"


def _owned_machines(owner, machine_ids) -> list[Machine]:
    """The owner's machines of ``machine_ids``; 403 ``machine_forbidden`` when one is not
    the owner's (as grants do, A6)."""
    wanted = set(machine_ids)
    machines = list(Machine.objects.filter(owner=owner, pk__in=wanted))
    if len(machines) != len(wanted):
        raise ApplicationError("machine_forbidden", "no such machine among yours", status_code=403)
    return machines


def _exists_error(name: str) -> ApplicationError:
    return ApplicationError("pool_exists", f"you already have a pool named {name!r}", status_code=409)


def pool_create(*, owner, name: str, machine_ids: list, now: datetime) -> Pool:
    """Create the owner's pool ``name`` (validated: ``pool_name_problem``) with the owner's
    machines ``machine_ids`` (UUIDs, may be empty), at ``version`` 1, and send its ``pool``
    event after commit (B2). Raises 403 ``machine_forbidden`` (a machine that is not the
    owner's), 409 ``pool_exists`` (the owner has a pool of that name); nothing is written
    or sent then."""
    machines = _owned_machines(owner, machine_ids)
    try:
        with transaction.atomic():
            pool = Pool.objects.create(owner=owner, name=name, created_at=now, updated_at=now)
            pool.machines.set(machines)
            broadcast(owner.pk, pool_event(pool))
    except IntegrityError:  # pool_owner_name
        raise _exists_error(name)
    return pool


def pool_update(*, pool: Pool, name: str | None = None, machine_ids: list | None = None, now: datetime) -> Pool:
    """Rename the pool and/or replace its machines (each given field; the others stay),
    raise its ``version`` and send its ``pool`` event after commit (B2). Same errors as
    ``pool_create``; nothing is written or sent then. Tasks already accepted under the
    pool keep their machine (C8: the choice never changes)."""
    machines = None if machine_ids is None else _owned_machines(pool.owner, machine_ids)
    try:
        with transaction.atomic():
            # Locked, so concurrent changes take versions one after the other.
            pool = Pool.objects.select_for_update().get(pk=pool.pk)
            if name is not None:
                pool.name = name
            pool.updated_at = now
            pool.version += 1
            pool.save(update_fields=["name", "updated_at", "version"])
            if machines is not None:
                pool.machines.set(machines)
            broadcast(pool.owner_id, pool_event(pool))
    except IntegrityError:
        raise _exists_error(name)
    return pool


def pool_delete(*, pool: Pool) -> None:
    """Delete the pool (its machines and tasks stay as they are) and send ``pool.deleted``
    after commit, at one above the pool's last version (B2), so a board drops it and an
    older ``pool`` event or snapshot cannot bring it back. A pool already gone (a racing
    delete, which sent the event) is left alone."""
    with transaction.atomic():
        locked = Pool.objects.select_for_update().filter(pk=pool.pk).first()
        if locked is None:
            return
        pool_id, owner_id, version = locked.pk, locked.owner_id, locked.version + 1
        locked.delete()
        broadcast(owner_id, pool_deleted_event(pool_id, version=version))


def pool_machine_ids(*, owner, name: str) -> list:
    """C8: the machine ids of the owner's pool ``name``, for acceptance. Raises 400
    ``pool_unknown`` when the owner has no pool of that name; another owner's pool of
    that name gets the same answer (K2: names leak nothing)."""
    pool = Pool.objects.filter(owner=owner, name=name).first()
    if pool is None:
        raise ApplicationError("pool_unknown", f"you have no machine pool named {name!r}",
                               fields={"machine": [f"no machine id, \"any\" or pool of yours: {name!r}"]})
    return list(pool.machines.values_list("pk", flat=True))
