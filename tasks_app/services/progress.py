"""Live progress of a running task (SPEC G4).

``progress_apply`` keeps the newest progress a worker posted (bounded) on the task and
pushes a ``task.progress`` board event after commit. Progress never changes state and is
not a receipt: no history row, nothing durable on the worker; a lost one is replaced by
the next. A ``seq`` not above the last is ignored (answer ``not_applied``/``stale_seq``);
progress for a final task is refused (``not_applied``/``final``, like R3's "no longer
relevant: stop resending"). The compare-and-set on ``progress_seq`` makes two racing
posts of one operation keep the higher seq.

The transcript (G4, B9): a post's ``entries`` are appended to the task's
``TranscriptEntry`` rows by ``transcript_append`` (each ``n`` once, the last
``ENTRIES_KEPT`` kept), and the applied progress (on the task and in the event) carries
the entries that were new. The final receipt brings the entries no post delivered
(``receipts._apply_final`` appends them the same way).
"""
from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import F

from core.broadcast import broadcast
from core.errors import ApplicationError
from tasks_app.models import FINAL_STATES, Machine, Operation, Task, TranscriptEntry
from machine.protocol import ENTRIES_KEPT
from machine.protocol import OUTPUT_TAIL_MAX_CHARS as OUTPUT_TAIL_MAX
from tasks_app.shapes import ProgressAnswerShape, ProgressShape, task_progress_event

LAST_MESSAGE_MAX_BYTES = 4096


def _cap_bytes(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


def transcript_append(task: Task, entries: list[dict]) -> list[dict]:
    """Keep ``entries`` (validated, rising ``n``) in the task's transcript: a number
    already kept is left as it was, and only the last ``ENTRIES_KEPT`` entries of the task
    stay. Returns the entries that were new, in order. The caller holds the transaction
    and the task's row lock (one writer per task at a time)."""
    if not entries:
        return []
    known = set(TranscriptEntry.objects.filter(task=task, n__in=[e["n"] for e in entries]).values_list("n", flat=True))
    new = [e for e in entries if e["n"] not in known]
    TranscriptEntry.objects.bulk_create([TranscriptEntry(task=task, n=e["n"], data=e) for e in new])
    cut = (TranscriptEntry.objects.filter(task=task).order_by("-n").values_list("n", flat=True)[ENTRIES_KEPT:ENTRIES_KEPT + 1])
    if cut:
        TranscriptEntry.objects.filter(task=task, n__lte=cut[0]).delete()
    return new


def progress_apply(*, machine: Machine, operation_id, seq: int, output_tail: str, last_message: str | None,
                   usage: dict | None, entries: list[dict] = (), now: datetime) -> ProgressAnswerShape:
    """Store ``{seq, at, last_message, output_tail, usage, entries}`` as the task's
    progress when ``seq`` is above the stored one and the task is not final, and append
    ``entries`` (validated transcript entries) to its transcript; the stored ``entries``
    are those that were new. Returns the answer body (``{"outcome": "applied"}`` or
    ``{"outcome": "not_applied", "reason": ...}``; a post not applied keeps none of its
    entries). Raises ApplicationError 404 ``not_found`` for an operation that is not this
    machine's."""
    try:
        operation = Operation.objects.select_related("task").get(pk=operation_id, task__machine=machine)
    except (Operation.DoesNotExist, ValueError):
        raise ApplicationError("not_found", "no such operation for this machine", status_code=404)
    task = operation.task
    progress: ProgressShape = {
        "seq": seq,
        "at": now.isoformat(),
        "last_message": _cap_bytes(last_message, LAST_MESSAGE_MAX_BYTES) if last_message else None,
        "output_tail": (output_tail or "")[-OUTPUT_TAIL_MAX:],
        "usage": usage,
        "entries": [],
    }
    with transaction.atomic():
        # The compare-and-set takes the task's row lock: transcript_append below runs alone.
        updated = (Task.objects.filter(pk=task.pk, progress_seq__lt=seq).exclude(state__in=FINAL_STATES)
                   .update(progress=progress, progress_seq=seq, version=F("version") + 1, updated_at=now))
        if not updated:
            current = Task.objects.filter(pk=task.pk).values("state", "progress_seq").first()
            if current["state"] in FINAL_STATES:
                return {"outcome": "not_applied", "reason": "final"}
            return {"outcome": "not_applied", "reason": "stale_seq"}
        progress["entries"] = transcript_append(task, list(entries))
        if progress["entries"]:
            Task.objects.filter(pk=task.pk).update(progress=progress)
        version = Task.objects.filter(pk=task.pk).values_list("version", flat=True).get()
        broadcast(task.owner_id, task_progress_event(task.pk, progress, version))
    return {"outcome": "applied"}


TRANSCRIPT_PAGE_MAX = 200  # B9: the page shows the last 200 entries, "load earlier" the 200 before


def transcript_page(task: Task, *, before: int | None = None, after: int | None = None,
                    limit: int = TRANSCRIPT_PAGE_MAX) -> tuple[list[dict], dict | None]:
    """A page of the task's transcript (G4, B9), always in reading order (rising ``n``):
    the last ``limit`` entries (or the last ``limit`` numbered below ``before``), or the
    first ``limit`` numbered above ``after`` (a follower catching up). Returns
    ``(entries, next)``: ``next`` is the query of the page beyond, in the same direction
    (``{"before": n}`` or ``{"after": n}``), or None at the end. Entries are a sequence
    the worker numbered, so the keyset is ``n`` rather than (created_at, id)."""
    rows = TranscriptEntry.objects.filter(task=task)
    if after is not None:
        page = list(rows.filter(n__gt=after).order_by("n").values_list("data", flat=True)[:limit + 1])
        more = len(page) > limit
        page = page[:limit]
        return page, ({"after": page[-1]["n"]} if more else None)
    if before is not None:
        rows = rows.filter(n__lt=before)
    page = list(rows.order_by("-n").values_list("data", flat=True)[:limit + 1])
    more = len(page) > limit
    page = page[:limit][::-1]
    return page, ({"before": page[0]["n"]} if more else None)
