"""Session services (SPEC M, S). All domain logic of sessions lives here.

Every function takes ``now`` (the service clock, UTC, read once by the caller) and runs in
one short transaction. Lock order: session (``FOR NO KEY UPDATE``, so the ``FOR KEY SHARE``
that inserting a task or a marker takes on the session row never conflicts with it) ->
marker / job rows. Tasks are never locked while a session lock is held (the task code
locks budget -> task -> session), so the two orders cannot deadlock.
"""
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta

from django.conf import settings
from django.db import transaction
from django.db.models import Exists, F, OuterRef, Q

from core.broadcast import broadcast
from core.errors import ApplicationError
from sessions_app.models import Attention, EndedTurn, Job, JobMode, Marker, MarkerState, Session, SessionStatus
from notifications.services import notify_session_attention, notify_session_idle
from sessions_app.messages import messages_answer
from sessions_app.rules import counting_jobs_q, running_markers_q
from sessions_app.shapes import marker_event, session_deleted_event, session_status_event
from tasks_app.models import FINAL_STATES, LEASED_STATES, NEVER_LEASED_STATES, Task, TaskState
from tasks_app.services.cancel import task_cancel

# Task states that keep a session busy (S1; ``unknown`` does not), and in which a
# machine's turn takes the task's expiry class (M2).
BUSY_TASK_STATES = tuple(sorted(NEVER_LEASED_STATES | LEASED_STATES))


def busy_tasks_q() -> Q:
    """S1's task part (as a Task filter): a task in a busy state, except a live
    conversation that runs (C6: between its turns its session is idle; each turn's
    marker makes it busy)."""
    return Q(state__in=BUSY_TASK_STATES) & ~Q(conversation="live", state=TaskState.RUNNING)
SWEEP_BATCH = 200


# --- reading (S1) ----------------------------------------------------------------------


def session_is_busy(*, session_id: uuid.UUID, now: datetime) -> bool:
    """S1 on the service clock: a marker RUNNING by M3, or a task of the session in
    accepted/delivered/starting/running, or a held job that still counts."""
    if Marker.objects.filter(running_markers_q(now), session_id=session_id).exists():
        return True
    if Task.objects.filter(busy_tasks_q(), session_id=session_id).exists():
        return True
    return Job.objects.filter(counting_jobs_q(now), session_id=session_id).exists()


# --- sessions ---------------------------------------------------------------------------


def _session_get_or_create(
    *, owner, session_id: uuid.UUID, now: datetime, title: str, agent: str = "", cwd: str = "", **binding
) -> tuple[Session, bool]:
    session, created = Session.objects.get_or_create(
        id=session_id,
        defaults={"owner": owner, "title": title, "agent": agent, "cwd": cwd, "status_since": now, "created_at": now,
                  **binding},
    )
    if session.owner_id != owner.pk:
        raise ApplicationError("not_found", "no such session", status_code=404)
    return session, created


def session_get_or_create(*, owner, session_id: uuid.UUID, now: datetime, title: str = "") -> Session:
    """The owner's session ``session_id``, created (idle) when the id is new.

    Raises ApplicationError 404 ``not_found`` when the id belongs to another owner (K2).
    """
    return _session_get_or_create(owner=owner, session_id=session_id, now=now, title=title)[0]


def session_create(
    *, owner, session_id: uuid.UUID | None, title: str, now: datetime, agent: str = "", cwd: str = "",
    machine_id: uuid.UUID | None = None, channel: str | None = None,
) -> tuple[Session, bool]:
    """``POST /api/sessions/``: create (with I6's ``agent`` and ``cwd``, T1's ``machine``
    and ``channel``), idempotent on ``session_id`` (an existing session of the owner is
    returned unchanged, except that a ``machine`` or ``channel`` given re-binds it, T1: a
    session resumed under the terminal wrapper). Returns ``(session, created)``; 404 for
    another owner's id, 403 ``machine_forbidden`` for a machine that is not the owner's."""
    from tasks_app.models import Machine

    if machine_id is not None and not Machine.objects.filter(pk=machine_id, owner=owner).exists():
        raise ApplicationError("machine_forbidden", "no such machine of yours", status_code=403)
    binding = {key: value for key, value in (("machine_id", machine_id), ("channel", channel)) if value is not None}
    if session_id is None:
        session = Session.objects.create(
            owner=owner, title=title, agent=agent, cwd=cwd, status_since=now, created_at=now, **binding
        )
        return session, True
    with transaction.atomic():
        session, created = _session_get_or_create(owner=owner, session_id=session_id, now=now, title=title,
                                                  agent=agent, cwd=cwd, **binding)
        if not created and binding:
            session = session_lock(owner=owner, session_id=session_id)
            _session_change_locked(session, {k: v for k, v in binding.items() if getattr(session, k) != v})
    return session, created


def session_lock(*, owner, session_id: uuid.UUID) -> Session:
    """The owner's session, locked ``FOR NO KEY UPDATE`` (a no-op on SQLite, where the
    transaction is ``BEGIN IMMEDIATE``). Must run inside ``transaction.atomic()``;
    404 ``not_found`` for a missing or another owner's id (K2)."""
    session = Session.objects.select_for_update(no_key=True).filter(pk=session_id, owner=owner).first()
    if session is None:
        raise ApplicationError("not_found", "no such session", status_code=404)
    return session


def session_update(
    *, owner, session_id: uuid.UUID, now: datetime, title: str | None = None, attention: str | None = None,
    attention_message: str = "",
) -> Session:
    """``PATCH /api/sessions/{id}/``: rename (``title``) and/or set the session's attention
    (I6: ``permission`` with ``attention_message``, or ``""`` to clear it; a cleared one
    keeps no message, ``attention_since`` is the service time it was set). While one of
    the session's approvals is pending its attention is ``approval`` and only the
    approvals change it (Q3): an attention given here is then ignored. A change is a
    compare-and-set on the row's ``version`` (it rises by one) under the session lock, and
    is published once as a ``session.status`` event after commit (the status itself does
    not change); the same values again change and publish nothing. Setting attention also
    emits the N1 ``attention`` notification. 404 for a missing or another owner's id."""
    with transaction.atomic():
        session = session_lock(owner=owner, session_id=session_id)
        changes = {}
        if title is not None and title != session.title:
            changes["title"] = title
        if attention is not None and session.attention != Attention.APPROVAL:
            changes.update(_attention_changes(session, attention, attention_message if attention else "", now))
        raised = changes.get("attention", Attention.NONE) != Attention.NONE
        if _session_change_locked(session, changes) and raised:
            notify_session_attention(session, now=now)
        return session


def _attention_changes(session: Session, attention: str, message: str, now: datetime) -> dict:
    if attention != session.attention:
        return {"attention": attention, "attention_message": message, "attention_since": now if attention else None}
    if message != session.attention_message:
        return {"attention_message": message}
    return {}


def _session_change_locked(session: Session, changes: dict) -> bool:
    """Apply ``changes`` to a session row the caller has locked, by compare-and-set on
    its ``version`` (it rises by one), and publish ``session.status`` after commit (I6).
    Returns whether anything changed; ``session`` is refreshed."""
    if not changes:
        return False
    won = Session.objects.filter(pk=session.pk, version=session.version).update(version=F("version") + 1, **changes)
    if won != 1:  # the lock makes this unreachable; a lost race must not publish
        raise ApplicationError("conflict", "the session changed meanwhile; try again", status_code=409)
    session.refresh_from_db()
    broadcast(session.owner_id, session_status_event(session))
    return True


def session_approval_attention(session: Session, *, pending: int, message: str, now: datetime) -> bool:
    """Q3 for a session row the caller has locked: its attention is ``approval`` (with
    ``message``) while ``pending`` approvals wait, and ``""`` once none does (a
    ``permission`` attention given meanwhile is covered by the approval and cleared with
    it). Published as ``session.status`` like any attention change; no N1 ``attention``
    notification (approvals have their own kind). Returns whether it changed."""
    if pending:
        changes = _attention_changes(session, Attention.APPROVAL, message, now)
    elif session.attention == Attention.APPROVAL:
        changes = _attention_changes(session, Attention.NONE, "", now)
    else:
        changes = {}
    return _session_change_locked(session, changes)


def session_delete(*, owner, session_id: uuid.UUID, now: datetime) -> None:
    """``DELETE /api/sessions/{id}/``: removes the session with its markers, jobs and turn
    records; its tasks stay, detached from it (``session`` becomes null). Publishes
    ``session.deleted`` so open boards drop it."""
    with transaction.atomic():
        # Tasks first (task -> session, the task code's lock order), then the session.
        Task.objects.filter(session_id=session_id, owner=owner).update(session=None)
        session = session_lock(owner=owner, session_id=session_id)
        version = session.version + 1
        session.delete()
        broadcast(owner.pk, session_deleted_event(session_id, version=version))


def _refresh_locked(session: Session, now: datetime, *, observed_end: bool = True) -> bool:
    """S1 then S2 for a session row the caller has locked: compare-and-set the stored
    status on (id, status, version); only the winner publishes ``session.status``.

    N1: a change to idle is announced (a notification, and ``announced: true`` on the
    event for B5's sound) only when ``observed_end``: the caller saw an end (an ``ended``
    write, a job's finish, a task's state). A busy that lapsed (an expired marker or
    held job, found by the sweep or a hydration) or a device sweep announces nothing:
    nobody saw that session finish."""
    new_status = SessionStatus.BUSY if session_is_busy(session_id=session.pk, now=now) else SessionStatus.IDLE
    if new_status == session.status:
        return False
    won = Session.objects.filter(pk=session.pk, status=session.status, version=session.version).update(
        status=new_status, status_since=now, version=F("version") + 1
    )
    if won != 1:
        return False
    session.status, session.status_since, session.version = new_status, now, session.version + 1
    announced = new_status == SessionStatus.IDLE and observed_end
    broadcast(session.owner_id, session_status_event(session, announced=announced))
    if announced:
        # N1: true idle, in the winning transaction; its board event follows the status.
        notify_session_idle(session, now=now)
    return True


def session_refresh_status(*, session_id: uuid.UUID, now: datetime, observed_end: bool = True) -> bool:
    """Re-evaluate S1 for one session and store/publish a change by compare-and-set (S2).

    Called inside the transaction of every change that can flip it (task state, marker,
    job), after that change, so the last committer always evaluates with every change
    visible. Locks the session row (``FOR NO KEY UPDATE``). Returns whether this call
    changed (and will publish) the status; False for a missing session. ``observed_end``:
    see ``_refresh_locked`` (N1).
    """
    with transaction.atomic():
        session = Session.objects.select_for_update(no_key=True).filter(pk=session_id).first()
        if session is None:
            return False
        return _refresh_locked(session, now, observed_end=observed_end)


def lapsed_sessions_q(now: datetime) -> Q:
    """Busy sessions for which S1 is false at ``now`` (as a Session filter): no marker
    RUNNING by M3, no task in a busy state, no held job that still counts."""
    return Q(status=SessionStatus.BUSY) & ~Q(
        Exists(Marker.objects.filter(running_markers_q(now), session=OuterRef("pk")))
        | Exists(Task.objects.filter(busy_tasks_q(), session=OuterRef("pk")))
        | Exists(Job.objects.filter(counting_jobs_q(now), session=OuterRef("pk")))
    )


def sessions_sweep(*, now: datetime, batch: int = SWEEP_BATCH) -> int:
    """S7 and M3 for the periodic sweep: flips to idle the busy sessions whose busy has
    lapsed (an expired marker, a held job past ``RUNSTEAD_JOB_HOLD_MAX_S``), one short
    transaction each, claimed with ``select_for_update(skip_locked=True)`` so several
    processes can sweep at once (O2); each is re-evaluated under its lock and changed by
    compare-and-set, so it is published once. Changes session status, never markers.
    Returns how many sessions changed status (0 = no work found)."""
    candidates = list(
        Session.objects.filter(lapsed_sessions_q(now)).order_by("status_since").values_list("pk", flat=True)[:batch]
    )
    changed = 0
    for session_id in candidates:
        with transaction.atomic():
            session = (
                Session.objects.select_for_update(skip_locked=True, no_key=True)
                .filter(pk=session_id, status=SessionStatus.BUSY)
                .first()
            )
            if session is not None and _refresh_locked(session, now, observed_end=False):
                changed += 1
    return changed


def sessions_active(*, owner, now: datetime) -> list[Session]:
    """S6: the owner's busy sessions, for hydration. A busy that lapsed since the last
    sweep is settled first (same compare-and-set, so it is still published once)."""
    lapsed = list(Session.objects.filter(lapsed_sessions_q(now), owner=owner).values_list("pk", flat=True))
    for session_id in lapsed:
        session_refresh_status(session_id=session_id, now=now, observed_end=False)
    return list(Session.objects.filter(owner=owner, status=SessionStatus.BUSY).order_by("-status_since", "-pk"))


# --- markers (M1-M8) --------------------------------------------------------------------


@dataclass
class MarkerResult:
    """Answer of a marker write: ``outcome`` is ``applied`` or ``not_applied``; ``reason``
    is ``stale_turn`` / ``turn_ended`` (not applied) or ``duplicate`` (a repeat that changed
    nothing)."""

    outcome: str
    reason: str | None
    marker: Marker | None
    session: Session


def marker_expiry_s(*, session_id: uuid.UUID, machine, deep_research: bool) -> float:
    """M2, in seconds: a turn a machine runs for a task of this session uses the task's
    ``max_runtime_s + RUNSTEAD_LEASE_DURATION_S`` (the longest such task); otherwise
    ``RUNSTEAD_MARKER_LONG_S`` (60 min) with ``deep_research``, else
    ``RUNSTEAD_MARKER_DEFAULT_S`` (20 min)."""
    if machine is not None:
        runtimes = list(
            Task.objects.filter(session_id=session_id, machine=machine, state__in=BUSY_TASK_STATES).values_list(
                "max_runtime_s", flat=True
            )
        )
        if runtimes:
            return max(runtimes) + settings.RUNSTEAD_LEASE_DURATION_S
    return settings.RUNSTEAD_MARKER_LONG_S if deep_research else settings.RUNSTEAD_MARKER_DEFAULT_S


def _turn_ended(session: Session, marker: Marker, now: datetime) -> None:
    """Record ``marker``'s turn as ended (M4), once."""
    EndedTurn.objects.get_or_create(
        session=session, turn_id=marker.turn_id, defaults={"device_id": marker.device_id, "ended_at": now}
    )


def _marker_end(session: Session, marker: Marker, now: datetime) -> None:
    """Close one running marker row (M1 ``ended``, M5, M6) and publish it."""
    Marker.objects.filter(pk=marker.pk).update(state=MarkerState.ENDED, ended_at=now, version=F("version") + 1)
    marker.refresh_from_db()
    _turn_ended(session, marker, now)
    broadcast(session.owner_id, marker_event(marker, now=now))


def check_device(*, machine, device_id: str) -> None:
    """M8, K2: a machine token writes and sweeps only its own device id (its machine id);
    owner tokens any. 403 ``forbidden_device`` otherwise."""
    if machine is not None and device_id != str(machine.pk):
        raise ApplicationError(
            "forbidden_device", "a machine token may write only its own device id", status_code=403
        )


def marker_write(
    *,
    owner,
    session_id: uuid.UUID,
    turn_id: str,
    device_id: str,
    state: str,
    now: datetime,
    device_name: str = "",
    deep_research: bool = False,
    machine=None,
    reply: str = "",
) -> MarkerResult:
    """``PUT /api/sessions/{id}/marker/`` (M1-M8). Creates the session when its id is new.

    - ``running``: overwrites the device's row with the new turn, stamping ``started_at``
      = now and ``expires_at`` by M2; consumes the session's finished waking jobs (S3). A
      repeat for the current running turn changes nothing (no renewals, M1); a turn that
      already ended is ``not_applied`` / ``turn_ended`` (M4).
    - ``ended``: closes the row only when it carries this ``turn_id``; otherwise
      ``not_applied`` / ``stale_turn`` (M4), and the turn is remembered as ended.
      ``reply`` (the turn's last assistant message, T6) is kept on the messages it answers.

    Re-evaluates S1. Raises 403 ``forbidden_device`` (M8), 404 for another owner's session.
    """
    check_device(machine=machine, device_id=device_id)
    with transaction.atomic():
        session_get_or_create(owner=owner, session_id=session_id, now=now)
        session = session_lock(owner=owner, session_id=session_id)
        marker = Marker.objects.select_for_update().filter(session=session, device_id=device_id).first()
        already_ended = EndedTurn.objects.filter(session=session, turn_id=turn_id).exists()

        if state == MarkerState.ENDED:
            if marker is None or marker.turn_id != turn_id:
                if not already_ended:
                    EndedTurn.objects.create(session=session, turn_id=turn_id, device_id=device_id, ended_at=now)
                return MarkerResult("not_applied", "stale_turn", marker, session)
            if marker.state == MarkerState.ENDED:
                return MarkerResult("applied", "duplicate", marker, session)
            _marker_end(session, marker, now)
            messages_answer(session.pk, now=now, reply=reply)  # T2: the turn that took them ended
            _refresh_locked(session, now)
            return MarkerResult("applied", None, marker, session)

        # state == running
        if already_ended:
            return MarkerResult("not_applied", "turn_ended", marker, session)
        if marker is not None and marker.turn_id == turn_id:
            return MarkerResult("applied", "duplicate", marker, session)
        expires_at = now + timedelta(
            seconds=marker_expiry_s(session_id=session.pk, machine=machine, deep_research=deep_research)
        )
        fields = {
            "turn_id": turn_id,
            "device_name": device_name,
            "state": MarkerState.RUNNING,
            "deep_research": deep_research,
            "started_at": now,
            "expires_at": expires_at,
            "ended_at": None,
        }
        if marker is None:
            marker = Marker.objects.create(session=session, device_id=device_id, **fields)
        else:
            if marker.state == MarkerState.RUNNING:
                # The device started a new turn: its previous one is over (M4).
                _turn_ended(session, marker, now)
            Marker.objects.filter(pk=marker.pk).update(version=F("version") + 1, **fields)
            marker.refresh_from_db()
        # S3: a running marker started at or after a waking job's finish consumes it.
        Job.objects.filter(
            session=session, wakes=True, consumed_at__isnull=True, finished_at__lte=now
        ).update(consumed_at=now, version=F("version") + 1)
        broadcast(session.owner_id, marker_event(marker, now=now))
        _refresh_locked(session, now)
        return MarkerResult("applied", None, marker, session)


def device_sweep(*, owner, device_id: str, now: datetime, machine=None) -> int:
    """``POST /api/devices/{device_id}/sweep/`` (M5): a device that boots closes every
    ``running`` marker carrying its device id, in the owner's sessions. Returns how many
    it closed. Raises 403 ``forbidden_device`` (M8)."""
    check_device(machine=machine, device_id=device_id)
    with transaction.atomic():
        session_ids = set(
            Marker.objects.filter(session__owner=owner, device_id=device_id, state=MarkerState.RUNNING).values_list(
                "session_id", flat=True
            )
        )
        closed = 0
        # Sessions in id order, so two sweeps never wait on each other in a cycle.
        sessions = Session.objects.select_for_update(no_key=True).filter(pk__in=session_ids).order_by("pk")
        for session in sessions:
            markers = Marker.objects.select_for_update().filter(
                session=session, device_id=device_id, state=MarkerState.RUNNING
            )
            for marker in markers:
                _marker_end(session, marker, now)
                closed += 1
            _refresh_locked(session, now, observed_end=False)  # N1: a crash left them open
        return closed


# --- jobs (S3, S4, S7) ------------------------------------------------------------------


def job_start(
    *,
    owner,
    session_id: uuid.UUID,
    job_id: str,
    mode: str | None,
    auto_backgrounded: bool,
    now: datetime,
) -> tuple[Job, bool]:
    """``POST /api/sessions/{id}/jobs/`` (S3, S4): record background work, idempotent on
    ``job_id`` (a repeat returns the existing job unchanged). ``mode`` defaults to
    ``held`` (an auto-backgrounded job counts like a held one); an explicit ``detached``
    never counts. Creates the session when its id is new. Returns ``(job, created)``."""
    with transaction.atomic():
        session_get_or_create(owner=owner, session_id=session_id, now=now)
        session = session_lock(owner=owner, session_id=session_id)
        job = Job.objects.filter(session=session, job_id=job_id).first()
        if job is not None:
            return job, False
        job = Job.objects.create(
            session=session, job_id=job_id, mode=mode or JobMode.HELD, auto_backgrounded=auto_backgrounded,
            created_at=now,
        )
        _refresh_locked(session, now)
        return job, True


def job_finish(*, owner, session_id: uuid.UUID, job_id: str, wakes: bool, now: datetime) -> Job:
    """``POST /api/sessions/{id}/jobs/{job_id}/finish/`` (S3): ``wakes: false`` releases the
    job at once; ``wakes: true`` keeps it counting until a ``running`` marker of the
    session starting at or after now consumes it. A repeat changes nothing.
    404 ``not_found`` for an unknown job."""
    with transaction.atomic():
        session = session_lock(owner=owner, session_id=session_id)
        job = Job.objects.select_for_update().filter(session=session, job_id=job_id).first()
        if job is None:
            raise ApplicationError("not_found", "no such job", status_code=404)
        if job.finished_at is not None or job.cancelled_at is not None:
            return job
        Job.objects.filter(pk=job.pk).update(finished_at=now, wakes=wakes, version=F("version") + 1)
        job.refresh_from_db()
        _refresh_locked(session, now)
        return job


# --- stop (S5) --------------------------------------------------------------------------


@dataclass
class StopResult:
    markers_closed: int
    jobs_cancelled: int
    tasks_cancelled: int
    session: Session


def session_stop(*, owner, session_id: uuid.UUID, actor: str, now: datetime) -> StopResult:
    """``POST /api/sessions/{id}/stop/`` (S5): ends the session's running markers (M6),
    cancels its held jobs, then cancels its unfinished tasks through ``task_cancel`` (J7;
    leased ones wait for their facts, so the session may stay busy until they end).

    The tasks are cancelled after the session transaction commits, one transaction each,
    because the task code locks task -> session and this one must not lock the other way.
    """
    with transaction.atomic():
        session = session_lock(owner=owner, session_id=session_id)
        closed = 0
        for marker in Marker.objects.select_for_update().filter(session=session, state=MarkerState.RUNNING):
            _marker_end(session, marker, now)
            closed += 1
        held = Job.objects.filter(
            Q(finished_at__isnull=True) | Q(wakes=True, consumed_at__isnull=True),
            session=session, mode=JobMode.HELD, cancelled_at__isnull=True,
        )
        jobs_cancelled = held.update(cancelled_at=now, version=F("version") + 1)
        _refresh_locked(session, now)

    tasks_cancelled = 0
    for task in Task.objects.filter(session_id=session_id).exclude(state__in=FINAL_STATES):
        try:
            task_cancel(task=task, actor=actor, now=now)
            tasks_cancelled += 1
        except ApplicationError as error:
            if error.code != "already_final":
                raise
    session.refresh_from_db()
    return StopResult(closed, jobs_cancelled, tasks_cancelled, session)
