"""Picking the machine of a ``"machine": "any"`` task inside acceptance (SPEC C8).

A machine can take the task when it is paired (P), heard from recently (B7's one rule,
``machine_is_offline``), its worker reported the task's profile and its
``max_concurrent`` (B10, W8), it has the folder's repository with an active grant
covering it there, its unfinished started-or-starting tasks leave room under
``max_concurrent``, and (for an exclusive task outside a worktree) no exclusive task
holds the folder there (A8). Among those the least loaded wins (then the name, then the
id, so the pick is deterministic).

The folder's repository: the owner's machines report the identity of the repositories
under their allowed roots (``machine/worker/repositories.py``): the repository whose work
tree holds the folder (on whichever of the owner's machines reported that path) gives an
identity, and a machine has it when it reported a repository of the same identity, at
any path (same root commit, or same ``origin`` URL once normalised); the task runs in the
same sub-folder of that machine's copy, and that path is the task's ``folder``. A folder
in no reported repository matches by its path alone: a machine with a grant covering it.

Locks (P1, P2): ``FOR KEY SHARE`` on all of the owner's machines (in id order) and on
their active grants, then ``FOR UPDATE`` on the owner's budget row, then the load count
and the per-machine folder locks. Every acceptance of the owner holds that budget row
until it commits, and a machine has one owner, so two racing picks count each other's
tasks: no machine is given more than ``max_concurrent``. An unpairing or a revocation
(``FOR UPDATE`` on its row) and a pick that depends on it serialize as in P1.
"""
import posixpath
import re
from dataclasses import dataclass
from datetime import datetime

from django.db.models import Count

from core.errors import ApplicationError
from tasks_app.models import Budget, Grant, Machine, Task, TaskState
from tasks_app.services.folders import folder_lock_holder, path_within
from tasks_app.services.locking import for_key_share
from tasks_app.shapes import iso, machine_is_offline

ANY = "any"  # a pool name (``PoolName``) narrows the same pick to the pool's machines

# C8: the states in which a task holds one of its machine's ``max_concurrent`` slots (or
# soon will). ``unknown`` is left out: the service cannot tell whether it still runs, and
# counting it would close a machine until its owner decides (U3).
LOAD_STATES = (TaskState.ACCEPTED, TaskState.DELIVERED, TaskState.STARTING, TaskState.RUNNING)


@dataclass
class Pick:
    """The chosen machine, its active grants (locked), the owner's budget row (locked)
    and the task's folder on that machine."""

    machine: Machine
    grants: list
    budget: Budget | None
    folder: str


_SCP = re.compile(r"^(?:[^@/]+@)?([^:/]+):(.*)$")


def normalize_remote(url: str | None) -> str | None:
    """An ``origin`` URL as ``host/path``, lower-cased, without scheme, user, port,
    trailing ``/`` or ``.git``: ``git@github.com:o/r.git`` and ``https://github.com/o/r``
    are one repository. None for none."""
    if not url:
        return None
    url = url.strip()
    if "://" in url:
        rest = url.split("://", 1)[1]
        host, _, path = rest.partition("/")
        host = host.rsplit("@", 1)[-1].split(":", 1)[0]
    elif (m := _SCP.match(url)) is not None:
        host, path = m.group(1), m.group(2)
    else:  # a local path as remote
        host, path = "", url
    path = path.strip("/")
    if path.endswith(".git"):
        path = path[:-4]
    return f"{host}/{path}".lower()


def same_repository(a: dict, b: dict) -> bool:
    """C8: two reported repositories are one when their root commits are equal, or their
    ``origin`` URLs are once normalised."""
    if a.get("root_commit") and a.get("root_commit") == b.get("root_commit"):
        return True
    remote = normalize_remote(a.get("remote"))
    return remote is not None and remote == normalize_remote(b.get("remote"))


def _repository_of(folder: str, machines) -> tuple[dict, str] | None:
    """The reported repository whose work tree holds ``folder`` (the deepest one, over
    all ``machines``) and the folder's path inside it ("" for its top), or None."""
    best = None
    for machine in machines:
        for repo in machine.repositories or []:
            if path_within(folder, repo["path"]) and (best is None or len(repo["path"]) > len(best["path"])):
                best = repo
    if best is None:
        return None
    return best, posixpath.relpath(folder, best["path"]) if folder != best["path"] else ""


def _has_profile(machine: Machine, agent: str) -> bool:
    return any(isinstance(p, dict) and p.get("name") == agent for p in machine.profiles or [])


class PoolName(str):
    """C8: a ``"machine"`` value naming one of the owner's pools (validated as a pool name
    by the API; whether the owner has that pool is acceptance's question)."""


def machine_pick(*, owner, folder: str, agent: str, isolation_of, exclusive: bool, now: datetime,
                 among: list | None = None) -> Pick:
    """C8: choose the machine of a ``"machine": "any"`` task (see the module docstring),
    inside the caller's acceptance transaction; for a task naming a pool, ``among`` is
    the pool's machine ids and only those are candidates (and listed in a refusal). ``isolation_of(machine)`` says the task's
    isolation on that machine (its own, or the profile's, G7): a worktree task takes no
    folder lock. Raises 409 ``no_machine_available`` with ``machines``:
    ``[{"id", "name", "reason", ...}]``, why each of the owner's machines cannot take it
    (``unpaired``, ``offline`` with ``last_heard_at``, ``profile_not_reported``,
    ``limits_not_reported``, ``repository_not_found``, ``folder_not_granted`` with
    ``folder``, ``full`` with ``load`` and ``max_concurrent``, ``folder_locked`` with
    ``task_id``)."""
    candidates = Machine.objects.filter(owner=owner)
    covering = Grant.objects.filter(machine__owner=owner, revoked_at__isnull=True)
    if among is not None:
        candidates, covering = candidates.filter(pk__in=among), covering.filter(machine__in=among)
    if among == []:  # an empty pool: nothing to lock (an empty IN is no SQL to lock with)
        machines, grants = [], []
    else:
        machines = for_key_share(candidates.order_by("pk"))
        grants = for_key_share(covering.order_by("pk"))
    budget = Budget.objects.select_for_update().filter(owner=owner).first()
    # After the budget row: every racing acceptance of this owner has committed or waits.
    load = dict(Task.objects.filter(machine__in=[m.pk for m in machines], state__in=LOAD_STATES)
                .values_list("machine_id").annotate(n=Count("pk")).values_list("machine_id", "n"))
    found = _repository_of(folder, machines)
    refusals, fits = [], []
    for machine in machines:
        def refuse(reason, **facts):
            refusals.append({"id": str(machine.pk), "name": machine.name, "reason": reason, **facts})

        if not machine.paired:
            refuse("unpaired")
            continue
        if machine_is_offline(machine.last_heard_at, now):
            refuse("offline", last_heard_at=iso(machine.last_heard_at))
            continue
        if not _has_profile(machine, agent):
            refuse("profile_not_reported")
            continue
        if machine.max_concurrent is None:
            refuse("limits_not_reported")
            continue
        if found is None:
            there = folder
        else:
            repo, sub = found
            copies = sorted(r["path"] for r in machine.repositories or [] if same_repository(r, repo))
            if not copies:
                refuse("repository_not_found")
                continue
            # The same path when this machine has the repository there too, else its first copy.
            top = repo["path"] if repo["path"] in copies else copies[0]
            there = posixpath.join(top, sub) if sub else top
        mine = [g for g in grants if g.machine_id == machine.pk]
        if not any(path_within(there, g.path) for g in mine):
            refuse("folder_not_granted", folder=there)
            continue
        n = load.get(machine.pk, 0)
        if n >= machine.max_concurrent:
            refuse("full", load=n, max_concurrent=machine.max_concurrent)
            continue
        fits.append((n, machine.name, str(machine.pk), machine, there, mine))
    for n, _name, _pk, machine, there, mine in sorted(fits, key=lambda f: f[:3]):
        if exclusive and isolation_of(machine) != "worktree":
            holder = folder_lock_holder(machine.pk, there)  # A8, under the per-machine lock
            if holder is not None:
                refusals.append({"id": str(machine.pk), "name": machine.name, "reason": "folder_locked",
                                 "task_id": str(holder.id)})
                continue
        return Pick(machine=machine, grants=mine, budget=budget, folder=there)
    raise ApplicationError("no_machine_available", "none of your machines can take this task now",
                           status_code=409, machines=sorted(refusals, key=lambda r: (r["name"], r["id"])))
