"""Worker profile reports (SPEC B10): the worker tells the service its profile names and
presets (G1) at start, so the board's task form offers them."""
from datetime import datetime

from django.db import transaction
from django.db.models import F

from tasks_app.models import Machine
from tasks_app.services.pairing import machine_publish

MAX_PROFILES = 100


def machine_profiles_report(*, machine: Machine, profiles: list[dict], now: datetime) -> Machine:
    """Store ``profiles`` (``[{"name": str, "preset": str | None, "isolation": "none" |
    "worktree", "conversation": "live" | "resume" | "none"}]``, sorted by name; G7, C1:
    acceptance reads ``isolation`` and ``conversation``) on the machine. A change bumps ``version`` and publishes the machine after commit (B2);
    the same list again changes nothing. Returns the machine as stored."""
    cleaned = sorted(({"name": p["name"], "preset": p.get("preset"), "isolation": p.get("isolation") or "none",
                       "conversation": p.get("conversation") or "none"}
                      for p in profiles), key=lambda p: p["name"])
    with transaction.atomic():
        row = Machine.objects.select_for_update().get(pk=machine.pk)
        if row.profiles == cleaned:
            return row
        Machine.objects.filter(pk=row.pk).update(profiles=cleaned, profiles_reported_at=now, version=F("version") + 1)
        row.refresh_from_db()
        machine_publish(row, now=now)
        return row
