"""Live progress of a running task (SPEC G4).

``progress_apply`` keeps the newest progress a worker posted (bounded) on the task and
pushes a ``task.progress`` board event after commit. Progress never changes state and is
not a receipt: no history row, nothing durable on the worker; a lost one is replaced by
the next. A ``seq`` not above the last is ignored (answer ``not_applied``/``stale_seq``);
progress for a final task is refused (``not_applied``/``final``, like R3's "no longer
relevant: stop resending"). The compare-and-set on ``progress_seq`` makes two racing
posts of one operation keep the higher seq.
"""
from __future__ import annotations

from datetime import datetime

from django.db import transaction
from django.db.models import F

from config.broadcast import broadcast
from config.errors import ApplicationError
from tasks_app.models import FINAL_STATES, Machine, Operation, Task
from tasks_app.protocol import OUTPUT_TAIL_MAX_CHARS as OUTPUT_TAIL_MAX

LAST_MESSAGE_MAX_BYTES = 4096


def _cap_bytes(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return text if len(data) <= limit else data[:limit].decode("utf-8", errors="ignore")


def progress_event(task_id, progress: dict, version: int) -> dict:
    """The ``task.progress`` board event (H); ``server_time`` is added by the broadcast."""
    return {"type": "task.progress", "task_id": str(task_id), "progress": progress, "version": version}


def progress_apply(*, machine: Machine, operation_id, seq: int, output_tail: str, last_message: str | None,
                   usage: dict | None, now: datetime) -> dict:
    """Store ``{seq, at, last_message, output_tail, usage}`` as the task's progress when
    ``seq`` is above the stored one and the task is not final. Returns the answer body
    (``{"outcome": "applied"}`` or ``{"outcome": "not_applied", "reason": ...}``). Raises
    ApplicationError 404 ``not_found`` for an operation that is not this machine's."""
    try:
        operation = Operation.objects.select_related("task").get(pk=operation_id, task__machine=machine)
    except (Operation.DoesNotExist, ValueError):
        raise ApplicationError("not_found", "no such operation for this machine", status_code=404)
    task = operation.task
    progress = {
        "seq": seq,
        "at": now.isoformat(),
        "last_message": _cap_bytes(last_message, LAST_MESSAGE_MAX_BYTES) if last_message else None,
        "output_tail": (output_tail or "")[-OUTPUT_TAIL_MAX:],
        "usage": usage,
    }
    with transaction.atomic():
        updated = (Task.objects.filter(pk=task.pk, progress_seq__lt=seq).exclude(state__in=FINAL_STATES)
                   .update(progress=progress, progress_seq=seq, version=F("version") + 1, updated_at=now))
        if not updated:
            current = Task.objects.filter(pk=task.pk).values("state", "progress_seq").first()
            if current["state"] in FINAL_STATES:
                return {"outcome": "not_applied", "reason": "final"}
            return {"outcome": "not_applied", "reason": "stale_seq"}
        version = Task.objects.filter(pk=task.pk).values_list("version", flat=True).get()
        broadcast(task.owner_id, progress_event(task.pk, progress, version))
    return {"outcome": "applied"}
