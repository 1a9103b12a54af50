"""Approvals: the agent asks, the owner answers once, from anywhere (SPEC Q1-Q5).

All domain logic of ``Approval`` rows lives here; an approval leaves ``pending`` once, by
compare-and-set (``_settle``), and never changes again. Every change, in the transaction
that made it: the approval's ``version`` rises, an ``approval`` board event is sent after
commit and its ``approval`` notification is written (Q6), the waiting long-polls of the approval are woken after commit (Q3), and its
session's attention (I6) or its task's attention, counts and timeline (Q5) follow.

Lock order (P2 extended): idempotency key -> budget -> task -> session -> approval. The
target of an approval (its task or its session) is locked before the approval row is
changed, the order in which a task that ends withdraws its approvals (``receivers``), so
a decision racing with the end of its task cannot deadlock.

The home is ``sessions_app`` because an approval belongs to a session (interactive) or to
a task (headless): this is the lowest layer that sees both, and the hooks that ask live
here too. Times are UTC; durations seconds.
"""
import logging
import threading
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import IntegrityError, transaction
from django.db.models import F

from core import clock
from core.broadcast import broadcast
from core.deadlocks import retry_on_deadlock
from core.errors import ApplicationError
from core.idempotency import Answer
from core.longpoll import Wait, notify_after_commit
from notifications.services import notify_approval
from sessions_app.models import (
    DECIDED_BY_SYSTEM,
    DECIDED_BY_TERMINAL,
    DECIDED_BY_TIMEOUT,
    Approval,
    ApprovalScope,
    ApprovalState,
    Session,
)
from sessions_app.services import session_approval_attention, session_create
from sessions_app.shapes import approval_dict, approval_event, approval_title
from tasks_app.models import FINAL_STATES, Task
from machine.protocol import APPROVAL_INPUT_KEEP_BYTES, cut_json, json_digest
from tasks_app.services.approvals import task_approval_noted, task_lock

log = logging.getLogger("runstead.approvals")

# Issue 44: at most one read of the approval long-polls' starts per second (per event
# loop). A wait is registered before its start is read, so a decision meanwhile wakes it
# at once; only a decision made between two waits of a hook waits for the read (< 1 s,
# Q3's 2 s p99 holds). The worker's pulls batch every RUNSTEAD_LONGPOLL_START_BATCH_S.
APPROVAL_STARTS_EVERY_S = 1.0

EXPIRE_BATCH = 200
_SETTLED_WORDS = {
    ApprovalState.ALLOWED: "allowed",
    ApprovalState.DENIED: "denied",
    ApprovalState.ANSWERED_IN_TERMINAL: "answered in the terminal",
    ApprovalState.EXPIRED: "expired",
    ApprovalState.WITHDRAWN: "withdrawn",
}


def _folder_name(cwd: str) -> str:
    return cwd.rstrip("/").rsplit("/", 1)[-1] if cwd else ""


# --- create (Q1) ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Ask:
    """What an asking hook sends (Q1): ``key`` (its idempotency key), ``session_id`` or
    ``task_id`` (exactly one), ``agent``, ``tool_name``, ``tool_input`` (parsed JSON, as
    asked), ``cwd`` (absolute or blank) and ``suggestions`` (the CLI's
    ``permission_suggestions``, a list)."""

    key: str
    session_id: uuid.UUID | None
    task_id: uuid.UUID | None
    agent: str
    tool_name: str
    tool_input: object
    cwd: str
    suggestions: list


@retry_on_deadlock
def approval_create(*, owner, ask: Ask, now: datetime) -> tuple[Approval, bool]:
    """``POST /api/approvals/`` (Q1): the approval of ``ask``, created pending (expiring
    ``RUNSTEAD_APPROVAL_WAIT_S`` from now) or, for a key the owner used before, the row
    it made (``created`` False), so a retried request makes no second row.

    A session approval creates the owner's session when its id is new (title: the
    folder's name, like the hook's own ``SessionStart``) and, being the session's next
    ``PermissionRequest``, answers its earlier pending approvals ``answered_in_terminal``
    (Q4). A task approval needs the owner's unfinished task. Refusals: 404
    ``not_found`` for another owner's session or task (K2), 409 ``task_final``, 422
    ``approval_key_reused`` for a known key naming another session or task."""
    kept_input, truncated = cut_json(ask.tool_input, APPROVAL_INPUT_KEEP_BYTES)
    with transaction.atomic():
        known = Approval.objects.filter(owner=owner, key=ask.key).first()
        if known is not None:
            return _known(known, ask), False
        task = session = None
        if ask.task_id is not None:
            task = task_lock(task_id=ask.task_id, owner=owner)
            if task.state in FINAL_STATES:
                raise ApplicationError("task_final", "the task is final: it asks nothing more", status_code=409)
        else:
            session_create(owner=owner, session_id=ask.session_id, title=_folder_name(ask.cwd), agent=ask.agent,
                           cwd=ask.cwd, now=now)
            session = _lock_session(ask.session_id)
        try:
            with transaction.atomic():
                approval = Approval.objects.create(
                    owner=owner, key=ask.key, session=session, task=task, machine_id=task.machine_id if task else None,
                    agent=ask.agent, tool_name=ask.tool_name, tool_input=kept_input,
                    tool_input_digest=json_digest(ask.tool_input), tool_input_truncated=truncated, cwd=ask.cwd,
                    suggestions=ask.suggestions, created_at=now,
                    expires_at=now + timedelta(seconds=settings.RUNSTEAD_APPROVAL_WAIT_S),
                )
        except IntegrityError:  # a racing request with the same key committed first
            return _known(Approval.objects.get(owner=owner, key=ask.key), ask), False
        if session is not None:
            earlier = Approval.objects.filter(session=session, state=ApprovalState.PENDING).exclude(pk=approval.pk)
            for other in earlier:
                _settle(other, to=ApprovalState.ANSWERED_IN_TERMINAL, decided_by=DECIDED_BY_TERMINAL, now=now)
        approval.refresh_from_db()
        _announce(approval, now=now)
        _follow(approval, session=session, task=task, now=now, actor=f"agent:{ask.agent}", asked=1)
        return approval, True


def _known(approval: Approval, ask: Ask) -> Approval:
    same = (approval.session_id, approval.task_id) == (ask.session_id, ask.task_id)
    if not same:
        raise ApplicationError("approval_key_reused", "this key was used for another session or task",
                               status_code=422)
    return approval


def _lock_session(session_id) -> Session:
    return Session.objects.select_for_update(no_key=True).get(pk=session_id)


def _lock_target(approval: Approval) -> tuple[Session | None, Task | None]:
    """Lock the approval's task or session (before the approval row: the lock order)."""
    if approval.task_id is not None:
        return None, task_lock(task_id=approval.task_id, owner=approval.owner)
    return _lock_session(approval.session_id), None


# --- the waiting hook's long-poll (Q3) ------------------------------------------------------


def approval_key(approval_id) -> str:
    """The ``core.longpoll`` key of one approval's long-polls, woken by ``_settle``."""
    return f"approval.{approval_id}"


def approval_wait(*, approval: Approval, wait_s: float) -> Wait:
    """``GET /api/approvals/{id}/?wait=S`` (Q3) as a ``core.longpoll.Wait``: its result is
    the approval as it stands, as soon as it is no longer ``pending`` or after ``wait_s``
    seconds (0 = at once). Each take expires it when past ``expires_at`` (so an expiry is
    seen by the next take: a wake-up or the safety re-check); every way out of pending
    (``_settle``) wakes the waiters after commit, in this process and others. Many
    hooks may wait on one approval (not exclusive). Under ASGI the starts of an event
    loop are read together (``approvals_starts``): ``approval`` (the subject, also the
    ``empty`` result) is then refreshed in place. The caller has authorised the read;
    ``approval`` needs only its ``pk`` (the fast path's is a bare ``Approval(pk=...)``).
    A hook's wait that starts again after its previous one timed out, with no wake-up of
    the approval since, begins from that wait's result without a read (``Wait.resume``)."""

    def take(first: bool) -> Approval:
        current = Approval.objects.select_related("owner", "session", "task").get(pk=approval.pk)
        approval_expire_due(current, now=clock.now())
        return current

    def resume(last: Approval) -> Approval | None:
        # The hook's previous wait timed out on a pending approval and nothing woke it since
        # (every decision does, ``_settle``): it is still pending, unless now past its expiry.
        if last.state != ApprovalState.PENDING or last.expires_at <= clock.now():
            return None
        _refresh_from(approval, last)
        return approval

    return Wait(key=approval_key(approval.pk), take=take, timeout_s=wait_s,
                done=lambda current: current.state != ApprovalState.PENDING, ready=approvals_ready,
                starts=approvals_starts, subject=approval, empty=approval, starts_every_s=APPROVAL_STARTS_EVERY_S,
                resume=resume)


def approvals_starts(waits: list[Wait]) -> set[str]:
    """The starts of approval long-polls (``approval_wait``'s) that began together on one
    event loop (issue 44: 1,000 waiting hooks, each starting again every ~25 s, cost no
    transaction each): ONE query reads their approvals (one per 500); each wait's
    subject, a pending approval not yet past ``expires_at``, is refreshed in place from
    it and is the wait's first result, without a take. Returns the keys of the others
    (decided, due to expire, or gone), whose first take reads, expires or fails as
    without this."""
    ids = list({str(wait.subject.pk) for wait in waits})
    rows: dict = {}
    for start in range(0, len(ids), 500):
        batch = Approval.objects.select_related("session", "task").in_bulk(ids[start : start + 500])
        rows.update((str(pk), row) for pk, row in batch.items())
    now = clock.now()
    take = set()
    for wait in waits:
        row = rows.get(str(wait.subject.pk))
        if row is None or row.state != ApprovalState.PENDING or row.expires_at <= now:
            take.add(wait.key)
        else:
            _refresh_from(wait.subject, row)
    return take


def _refresh_from(approval: Approval, row: Approval) -> None:
    """``approval`` (a wait's own instance) made equal to ``row``, its related rows too."""
    for field in Approval._meta.concrete_fields:
        setattr(approval, field.attname, getattr(row, field.attname))
    for name in ("session", "task"):
        if name in row._state.fields_cache:
            approval._state.fields_cache[name] = row._state.fields_cache[name]


class ApprovalOwners:
    """This process's approval id -> owner id, for the approval long-poll's fast path
    (issue 44): an approval's owner never changes, so an entry never goes stale (an
    approval deleted with its session is found gone by the wait's start). ``warm(ids)``
    reads the uncached ones in one query; ``owner(id)`` answers without I/O (None: not
    read yet, or no such approval). At most ``MAX_ENTRIES``, the oldest forgotten first."""

    MAX_ENTRIES = 100_000

    def __init__(self):
        self._lock = threading.Lock()
        self._owners: dict[str, int] = {}

    def owner(self, approval_id: str) -> int | None:
        with self._lock:
            return self._owners.get(approval_id)

    def warm(self, approval_ids: list[str]) -> None:
        with self._lock:
            missing = [i for i in set(approval_ids) if i not in self._owners]
        if missing:
            log.debug("approval owners: %d missed", len(missing))
        found = {}
        for start in range(0, len(missing), 500):
            found.update(Approval.objects.filter(pk__in=missing[start : start + 500]).values_list("pk", "owner_id"))
        with self._lock:
            for pk, owner_id in found.items():
                while len(self._owners) >= self.MAX_ENTRIES:
                    del self._owners[next(iter(self._owners))]
                self._owners[str(pk)] = owner_id

    def forget(self) -> None:
        with self._lock:
            self._owners.clear()


approval_owners = ApprovalOwners()


def approvals_ready(keys: list[str]) -> set[str]:
    """Of ``keys`` (``approval_key`` of approvals), those whose approval is no longer
    pending, is past ``expires_at`` now, or is gone: the one safety re-check (D1, Q3) for
    all the approval long-polls of an event loop, one query per 500 approvals, instead of
    one take per waiting hook every ``RUNSTEAD_LONGPOLL_RECHECK_S`` (500 hooks: 100
    queries/s). Each woken wait's take then reads it (and expires it when due)."""
    prefix = approval_key("")
    by_id = {key.removeprefix(prefix): key for key in keys if key.startswith(prefix)}
    ids = list(by_id)
    now = clock.now()
    waiting = set()
    for start in range(0, len(ids), 500):
        waiting.update(
            str(pk) for pk in Approval.objects.filter(pk__in=ids[start : start + 500], state=ApprovalState.PENDING,
                                                      expires_at__gt=now).values_list("pk", flat=True)
        )
    return {key for pk, key in by_id.items() if pk not in waiting}


# --- the one way out of pending ----------------------------------------------------------


def _settle(approval: Approval, *, to: str, decided_by: str, now: datetime, message: str = "", scope: str = "") -> bool:
    """Compare-and-set ``approval`` from ``pending`` to ``to`` (Q2); the winner publishes
    the ``approval`` event and wakes its long-polls after commit. The caller holds the
    transaction and the target's lock, and updates the target after (``_follow``).
    Returns whether this call decided it; ``approval`` is refreshed either way."""
    won = Approval.objects.filter(pk=approval.pk, state=ApprovalState.PENDING).update(
        state=to, decided_at=now, decided_by=decided_by, message=message, scope=scope, version=F("version") + 1
    )
    approval.refresh_from_db()
    if won:
        _announce(approval, now=now)
        notify_after_commit(approval_key(approval.pk))
    return bool(won)


def _announce(approval: Approval, *, now: datetime) -> None:
    """Q6, after each change, in its transaction: the ``approval`` board event and the
    ``approval`` notification (the question when created, its answer when settled)."""
    broadcast(approval.owner_id, approval_event(approval))
    notify_approval(approval, title=approval_title(approval), now=now)


def _follow(approval: Approval, *, session: Session | None, task: Task | None, now: datetime, actor: str,
            asked: int = 0, allowed: int = 0, denied: int = 0) -> None:
    """After a change of ``approval``: its session's attention (I6, Q3), or its task's
    attention, counts and timeline row (Q5). The target is locked by the caller."""
    if session is not None:
        pending = Approval.objects.filter(session=session, state=ApprovalState.PENDING).order_by("-created_at")
        newest = pending.first()
        session_approval_attention(session, pending=pending.count(), now=now,
                                   message=f"{newest.tool_name} waits for your approval" if newest else "")
        return
    if approval.state == ApprovalState.PENDING:
        reason = f"approval asked: {approval.tool_name}"
    else:
        reason = f"approval {_SETTLED_WORDS[approval.state]}: {approval.tool_name}"
        if approval.state == ApprovalState.ALLOWED and approval.scope == ApprovalScope.SESSION:
            reason += " (for the rest of the run)"
    pending = Approval.objects.filter(task=task, state=ApprovalState.PENDING).exists()
    task_approval_noted(task, pending=pending, reason=reason, actor=actor, now=now, asked=asked, allowed=allowed,
                        denied=denied)


# --- answers (Q2, Q4) and ends ------------------------------------------------------------


def decision_scope(approval_id) -> str:
    """The idempotency scope of one approval's decisions (Q2)."""
    return f"approval:{approval_id}"


def approval_to_decide(*, owner, approval_id, now: datetime) -> Approval:
    """Q2, before the decision: the owner's approval ``approval_id``, expired first (in
    its own transaction) when it is pending past its ``expires_at``, so an answer after
    the wait is ``already_decided`` with ``state: expired``. 404 for another owner's id."""
    approval = Approval.objects.select_related("owner").filter(pk=approval_id, owner=owner).first()
    if approval is None:
        raise ApplicationError("not_found", "no such approval", status_code=404)
    approval_expire_due(approval, now=now)
    return approval


def approval_decide(approval: Approval, *, behavior: str, message: str, scope: str, actor: str,
                    now: datetime) -> Answer:
    """``POST /api/approvals/{id}/decision/`` (Q2): ``behavior`` ``allow`` (``scope``
    ``once`` or ``session``) or ``deny`` (with ``message``, the instruction to the agent),
    exactly once: a compare-and-set from ``pending``. The view runs this under the
    owner's Idempotency-Key through ``core.idempotency.respond_once`` (scope
    ``decision_scope``; A1's rules: the same key and body replay the stored 200
    byte-equal; the same key with another body is 422 ``idempotency_key_reused``),
    inside its transaction. Returns ``(200, approval shape, {"task": its task or None})``.
    Any answer after the first, from any key or device, is 409 ``already_decided`` with
    ``approval`` as it stands (``approval_to_decide`` expires it first when due)."""
    to = ApprovalState.ALLOWED if behavior == "allow" else ApprovalState.DENIED
    session, task = _lock_target(approval)
    if not _settle(approval, to=to, decided_by=actor, now=now, message=message, scope=scope):
        raise ApplicationError("already_decided", f"this approval is already {approval.state}", status_code=409,
                               approval=approval_dict(approval))
    _follow(approval, session=session, task=task, now=now, actor=actor,
            allowed=int(to == ApprovalState.ALLOWED), denied=int(to == ApprovalState.DENIED))
    return 200, approval_dict(approval), {"task": task}


def approval_answered_in_terminal(*, owner, approval_id, now: datetime) -> Approval:
    """``POST /api/approvals/{id}/terminal/`` (Q4): the person answered the CLI's own
    dialog, so a pending session approval becomes ``answered_in_terminal`` (decided_by
    ``terminal``); one already decided is returned as it stands (the hooks send this for
    every approval they saw pending, so a repeat is normal). 404 for another owner's id;
    409 ``not_interactive`` for a task's approval (a headless run has no terminal)."""
    approval = Approval.objects.select_related("owner").filter(pk=approval_id, owner=owner).first()
    if approval is None:
        raise ApplicationError("not_found", "no such approval", status_code=404)
    if approval.session_id is None:
        raise ApplicationError("not_interactive", "a task's approval is answered from the board only",
                               status_code=409)
    with transaction.atomic():
        session = _lock_session(approval.session_id)
        if _settle(approval, to=ApprovalState.ANSWERED_IN_TERMINAL, decided_by=DECIDED_BY_TERMINAL, now=now):
            _follow(approval, session=session, task=None, now=now, actor=DECIDED_BY_TERMINAL)
    return approval


def approval_expire_due(approval: Approval, *, now: datetime) -> bool:
    """Q1/Q3: a pending ``approval`` past ``expires_at`` becomes ``expired`` (decided_by
    ``timeout``) in its own transaction; every read path calls this, so expiry never
    waits for the sweep. Returns whether this call expired it (``approval`` is refreshed
    when it did)."""
    if approval.state != ApprovalState.PENDING or approval.expires_at > now:
        return False
    with transaction.atomic():
        session, task = _lock_target(approval)
        if not _settle(approval, to=ApprovalState.EXPIRED, decided_by=DECIDED_BY_TIMEOUT, now=now):
            return False
        _follow(approval, session=session, task=task, now=now, actor=DECIDED_BY_TIMEOUT)
        return True


def approvals_expire(*, now: datetime, batch: int = EXPIRE_BATCH) -> int:
    """The sweep's step (Q1): pending approvals past ``expires_at`` expire, one short
    transaction each; the compare-and-set makes each expire once whatever the number of
    sweepers (O2). Returns how many this call expired (0 = no work found)."""
    due = Approval.objects.filter(state=ApprovalState.PENDING, expires_at__lte=now).select_related("owner")
    return sum(approval_expire_due(approval, now=now) for approval in due.order_by("expires_at")[:batch])


def approvals_withdraw_for_task(*, task: Task, now: datetime) -> int:
    """Q5: ``task`` is final, so its pending approvals become ``withdrawn`` (decided_by
    ``system``), each with a timeline row. Called in the transaction that made the task
    final (the task row is locked there). Returns how many."""
    withdrawn = 0
    for approval in Approval.objects.filter(task=task, state=ApprovalState.PENDING):
        if _settle(approval, to=ApprovalState.WITHDRAWN, decided_by=DECIDED_BY_SYSTEM, now=now):
            _follow(approval, session=None, task=task, now=now, actor=DECIDED_BY_SYSTEM)
            withdrawn += 1
    return withdrawn
