"""The task page (SPEC B9): ``/tasks/{id}/``, login required, owner-scoped (404 for
another owner's task), live over the board's socket (static/task.js).

``/tasks/{id}/data/`` answers the page's JSON (``{task, timeline, receipts, git_line,
entries, entries_next, queue, server_time}``: ``entries`` the last 200 of the transcript
(G4), ``entries_next`` the ``GET /api/tasks/{id}/entries/`` query for the page before
them, or null; ``queue`` the follow-ups queued behind the task, in order, ``[{id,
prompt}]``, G8) so the page can re-read after a ``task`` event; ``/tasks/{id}/decide/``
takes the U3 decisions with the CSRF token and calls the same service functions as the
admin (``tasks_app.services.decisions``), which record who and when.
"""
from __future__ import annotations

import uuid
from urllib.parse import urlencode

from django.contrib.auth.decorators import login_required
from django.http import JsonResponse
from django.shortcuts import get_object_or_404, redirect, render
from django.views.decorators.http import require_GET, require_POST

from core import clock
from core.errors import ApplicationError
from core.wire import iso
from tasks_app.agent_facts import describe_git
from tasks_app.models import Machine, Task, TaskState
from tasks_app.services.decisions import DECISIONS, task_ask_again, task_decide
from tasks_app.services.progress import transcript_page
from tasks_app.shapes import task_dict

# L9: a receipt whose slept_s is at least this is shown as "paused by sleep".
SLEEP_SHOWN_S = 5.0
PAGE_RECEIPTS = 50


def timeline(task: Task) -> list[dict]:
    """B9/U4: the task's history in time order, ``[{"at", "kind", "text"}]`` with kinds
    ``event`` (transitions and recorded receipts), ``lease`` (grant, renewals, expiry or
    end), ``receipt``, ``sleep`` (a gap that ``slept_s`` explains: L9), ``decision`` and
    ``approval`` (Q5: each approval asked, and who answered it when). A machine is named
    by its name, not its id (``machine:<uuid>`` becomes ``demo-worker``)."""
    items = []
    events = list(task.events.all())
    names = actor_names([event.actor for event in events], owner=task.owner_id)
    for event in events:
        kind = "decision" if event.reason.startswith("owner decision") else "event"
        if event.reason.startswith("approval "):
            kind = "approval"
        change = f"{event.old_state or '-'} → {event.new_state}" if event.new_state and event.new_state != event.old_state \
            else ""
        text = " ".join(p for p in (change, event.reason, f"({names.get(event.actor, event.actor)})") if p)
        items.append({"at": event.at, "kind": kind, "text": text})
    for lease in task.leases.all():
        items.append({"at": lease.granted_at, "kind": "lease",
                      "text": f"lease granted for {lease.duration_s:g} s, renewed every {lease.renew_every_s:g} s"})
        if lease.renewals and lease.last_renewed_at:
            items.append({"at": lease.last_renewed_at, "kind": "lease",
                          "text": f"lease renewed {lease.renewals} time{'s' if lease.renewals != 1 else ''} (last here)"})
        if lease.refused_reason:
            items.append({"at": lease.last_renewed_at or lease.granted_at, "kind": "lease",
                          "text": f"renewal refused: {lease.refused_reason}"})
        if lease.ended_at:
            items.append({"at": lease.ended_at, "kind": "lease", "text": f"lease ended: {lease.end_reason or 'ended'}"})
    for receipt in task.receipts.all()[:PAGE_RECEIPTS]:
        slept = (receipt.body or {}).get("slept_s")
        if isinstance(slept, (int, float)) and slept >= SLEEP_SHOWN_S:
            items.append({"at": receipt.received_at, "kind": "sleep",
                          "text": f"paused by sleep: the laptop slept {slept:.0f} s before this {receipt.kind} receipt"})
        items.append({"at": receipt.received_at, "kind": "receipt", "text": f"{receipt.kind} receipt"})
    order = {"sleep": 0, "lease": 1, "receipt": 2, "event": 3, "decision": 3, "approval": 3}
    items.sort(key=lambda i: (i["at"], order[i["kind"]]))
    return [{**i, "at": iso(i["at"])} for i in items]


def actor_names(actors: list[str], *, owner) -> dict[str, str]:
    """``{"machine:<id>": "<its name>"}`` for the owner's machines among ``actors``."""
    ids = {a.split(":", 1)[1] for a in actors if a.startswith("machine:")}
    valid = set()
    for value in ids:
        try:
            valid.add(str(uuid.UUID(value)))
        except ValueError:
            continue
    rows = Machine.objects.filter(pk__in=valid, owner_id=owner).values_list("pk", "name") if valid else []
    return {f"machine:{pk}": name for pk, name in rows}


def receipts(task: Task) -> list[dict]:
    """The last receipts, newest first: ``[{kind, received_at, event_id, slept_s, facts}]``;
    a worktree task's files and diff (G7) are in the task's evidence, shown once."""
    out = []
    for r in task.receipts.all()[:PAGE_RECEIPTS]:
        body = r.body or {}
        out.append({"kind": r.kind, "received_at": iso(r.received_at), "event_id": r.event_id,
                    "slept_s": body.get("slept_s"), "facts": _without_diff(body.get("facts"))})
    return out


def _without_diff(facts):
    git = ((facts or {}).get("evidence") or {}).get("git") if isinstance(facts, dict) else None
    if not isinstance(git, dict) or not ({"diff", "files"} & set(git)):
        return facts
    short = {k: v for k, v in git.items() if k not in ("diff", "files")}
    short["diff"] = "(shown under Branch)"
    return {**facts, "evidence": {**facts["evidence"], "git": short}}


QUEUE_SHOWN = 20


def queue_of(task: Task) -> list[dict]:
    """G8: the follow-ups queued behind ``task``, in the order they will run (at most
    ``QUEUE_SHOWN``): ``[{id, prompt}]``."""
    out, current = [], task
    while len(out) < QUEUE_SHOWN:
        current = Task.objects.filter(queued_behind=current, state=TaskState.QUEUED).only("id", "prompt").first()
        if current is None:
            break
        out.append({"id": str(current.id), "prompt": current.prompt[:500]})
    return out


def page_data(task: Task, *, now) -> dict:
    data = task_dict(task, full=True)
    git = (data.get("evidence") or {}).get("git")
    entries, earlier = transcript_page(task)
    return {"task": data, "timeline": timeline(task), "receipts": receipts(task),
            "git_line": describe_git(git), "entries": entries, "entries_next": earlier, "queue": queue_of(task),
            "server_time": iso(now)}


def _own_task(request, task_id) -> Task:
    return get_object_or_404(Task.objects.select_related("machine"), pk=task_id, owner=request.user)


@login_required
@require_GET
def task_page(request, task_id):
    task = _own_task(request, task_id)
    data = page_data(task, now=clock.now())
    return render(request, "task.html", {"task": task, "machine_name": task.machine.name, "page": data,
                                         "conversation": task.mode == "conversation",
                                         "git_line": data["git_line"],
                                         "decision_error": request.GET.get("error", "")[:200]})


@login_required
@require_GET
def task_page_data(request, task_id):
    task = _own_task(request, task_id)
    return JsonResponse(page_data(task, now=clock.now()))


@login_required
@require_POST
def task_decide_page(request, task_id):
    """U3 on the page: ``decision`` = succeeded | failed | abandoned | ask_again."""
    task = _own_task(request, task_id)
    decision = request.POST.get("decision", "")
    now = clock.now()
    try:
        if decision == "ask_again":
            task_ask_again(task=task, user=request.user, now=now)
        elif decision in DECISIONS:
            task_decide(task=task, decision=decision, user=request.user, now=now)
        else:
            raise ApplicationError("invalid", f"unknown decision {decision!r}")
    except ApplicationError as exc:
        return redirect(f"/tasks/{task.pk}/?{urlencode({'error': exc.detail})}")
    return redirect(f"/tasks/{task.pk}/")
