"""Worker profile reports (SPEC B10): the worker tells the service its profile names and
presets (G1) at start, so the board's task form offers them."""
from datetime import datetime

from django.db import transaction
from django.db.models import F

from tasks_app.models import Machine
from tasks_app.services.pairing import machine_publish

MAX_PROFILES = 100
MAX_REPOSITORIES = 200  # C8: as many as the worker reports (machine/worker/repositories.py)
MAX_CONCURRENT = 1000


def machine_profiles_report(*, machine: Machine, profiles: list[dict], now: datetime,
                            max_concurrent: int | None = None, repositories: list[dict] | None = None) -> Machine:
    """Store ``profiles`` (``[{"name": str, "preset": str | None, "isolation": "none" |
    "worktree", "conversation": "live" | "resume" | "none"}]``, sorted by name; G7, C1:
    acceptance reads ``isolation`` and ``conversation``) on the machine. A change bumps ``version`` and publishes the machine after commit (B2);
    the same list again changes nothing. C8: ``max_concurrent`` and ``repositories``
    (``[{"path", "remote", "root_commit"}]``), when given, replace what was stored (a worker
    that sends neither leaves them as they were); acceptance reads them to pick a machine
    for ``"machine": "any"``. Returns the machine as stored."""
    cleaned = sorted(({"name": p["name"], "preset": p.get("preset"), "isolation": p.get("isolation") or "none",
                       "conversation": p.get("conversation") or "none"}
                      for p in profiles), key=lambda p: p["name"])
    with transaction.atomic():
        row = Machine.objects.select_for_update().get(pk=machine.pk)
        changes = {"profiles": cleaned}
        if max_concurrent is not None:
            changes["max_concurrent"] = max_concurrent
        if repositories is not None:
            changes["repositories"] = sorted(({"path": r["path"], "remote": r.get("remote"),
                                               "root_commit": r.get("root_commit")} for r in repositories),
                                             key=lambda r: r["path"])
        if all(getattr(row, name) == value for name, value in changes.items()):
            return row
        Machine.objects.filter(pk=row.pk).update(**changes, profiles_reported_at=now, version=F("version") + 1)
        row.refresh_from_db()
        machine_publish(row, now=now)
        return row
