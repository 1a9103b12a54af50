"""Talking to a session started in a terminal (SPEC T1, T2, T4, T5).

- ``message_accept``: ``POST /api/sessions/{id}/messages/`` under the Idempotency-Key rules
  (A1-A4, ``core.idempotency.respond_once`` with scope ``session-message:<id>``): the
  message is numbered in acceptance order (``seq``, under the session's row lock) and in
  the same transaction a ``session_message`` outbox message goes to the session's
  machine (W2), whose worker records it and puts it where the wrapper (T3) or the Stop
  hook (T4) takes it once;
- ``message_delivery``: ``POST /api/sessions/{id}/messages/{seq}/delivery/`` from the
  owner's machine (the hooks' outbox with the owner token, or a machine token): a
  compare-and-set that only moves a message forward. ``delivered`` from ``sent`` is the
  Stop hook's claim (T4: the claim is the delivery; exactly one claimant wins) and the
  wrapper's report that it typed the message (T3);
- ``message_withdraw`` (C10): ``sent`` -> ``withdrawn``, against delivery, one winner;
- ``messages_answer``: a turn of the session ended (an ``ended`` marker write): its
  ``delivered`` messages are ``answered``;
- ``session_interrupt`` (T5): a ``session_interrupt`` outbox message for the wrapper.

States only move forward: ``sent`` -> ``delivered`` -> ``answered``, or ``sent`` ->
``undelivered`` / ``withdrawn``; every change bumps the message's ``version`` and sends a
``session.message`` board event after commit (B2).
"""
import uuid
from datetime import datetime

from django.db import transaction
from django.db.models import F

from core.broadcast import broadcast
from core.errors import ApplicationError
from core.idempotency import Answer
from machine.protocol.shapes import check_message
from sessions_app.models import Channel, Session, SessionMessage, SessionMessageState
from sessions_app.shapes import session_message_dict, session_message_event
from tasks_app.models import MessageKind, OutboxMessage
from core.longpoll import notify_after_commit
from tasks_app.services.transitions import outbox_key

S = SessionMessageState
# The states a message may come from, for each state it may go to.
FORWARD = {
    S.DELIVERED: (S.SENT,),
    S.ANSWERED: (S.SENT, S.DELIVERED),
    S.UNDELIVERED: (S.SENT,),
    S.WITHDRAWN: (S.SENT,),
}
REACHABLE = (Channel.TERMINAL, Channel.HOOK)
MESSAGES_LISTED = 500


def message_scope(session_id) -> str:
    """The idempotency scope of one session's messages (T2)."""
    return f"session-message:{session_id}"


def _session_locked(owner, session_id) -> Session:
    session = Session.objects.select_for_update(no_key=True).filter(pk=session_id, owner=owner).first()
    if session is None:
        raise ApplicationError("not_found", "no such session", status_code=404)
    return session


def _unreachable(session: Session) -> ApplicationError | None:
    if session.machine_id is None or session.channel not in REACHABLE:
        return ApplicationError("session_unreachable", "this session cannot take a message: start it with "
                                f"`runstead-term {session.agent or 'claude'}`, or install the hooks on a paired machine",
                                status_code=409)
    if not session.machine.paired:
        return ApplicationError("machine_unpaired", "the session's machine is no longer paired", status_code=409)
    return None


def message_accept(*, owner, session_id, text: str, now: datetime) -> Answer:
    """T2: accept ``text`` for session ``session_id``; run once per Idempotency-Key by
    ``respond_once`` (scope ``message_scope``), inside its transaction. Returns ``(201,
    session message shape, {})``. Refusals store nothing (A5): 404 ``not_found``, 409
    ``session_unreachable`` (no machine, or channel ``none``/``native``),
    ``machine_unpaired``. The text rules (C7 and no control characters) are the view's."""
    session = _session_locked(owner, session_id)
    if (refusal := _unreachable(session)) is not None:
        raise refusal
    seq = session.message_seq + 1
    Session.objects.filter(pk=session.pk).update(message_seq=seq)
    message = SessionMessage.objects.create(session=session, seq=seq, text=text, channel=session.channel,
                                            created_at=now)
    _send(session, MessageKind.SESSION_MESSAGE, now, session_id=str(session.pk), message_id=str(message.id), seq=seq,
          text=text, channel=session.channel)
    _publish(message)
    return 201, session_message_dict(message), {}


def _send(session: Session, kind: str, now: datetime, **payload) -> OutboxMessage:
    """An outbox message for the session's machine, in the current transaction (W2),
    checked against its kind's shape; the machine's waiting pull is woken after commit (D1)."""
    message = OutboxMessage.objects.create(machine_id=session.machine_id, operation=None, kind=kind,
                                           payload=check_message(kind, payload), created_at=now, visible_at=now)
    notify_after_commit(outbox_key(session.machine_id))
    return message


def message_delivery(*, owner, session_id, seq: int, state: str, machine=None, by: str, claim: str | None = None,
                     now: datetime) -> dict:
    """Move message ``seq`` of the session to ``state`` (``delivered``, ``answered``,
    ``undelivered``) by compare-and-set. ``machine``: the calling machine (a machine
    token), which must be the session's (else 404, K2). ``claim``: the Stop hook's own id
    for its claim (T4), recorded as ``delivered_by`` (else ``by``, the actor). Returns the
    message shape (with its text: the Stop hook hands it to the agent); a report of the
    state the message already has is answered the same, except a ``delivered`` with
    another ``claim``. 409 ``message_not_sent`` when it is no longer in a state it could
    move from: the claim went to someone else, or it was withdrawn."""
    with transaction.atomic():
        session = Session.objects.filter(pk=session_id, owner=owner).first()
        if session is None or (machine is not None and session.machine_id != machine.pk):
            raise ApplicationError("not_found", "no such session", status_code=404)
        message = SessionMessage.objects.filter(session=session, seq=seq).first()
        if message is None:
            raise ApplicationError("not_found", "no such message", status_code=404)
        if not message_advance(message, state, now=now, by=claim or by):
            message.refresh_from_db()
            if message.state == state and (claim is None or message.delivered_by == claim):
                return session_message_dict(message)  # a retried report of the same delivery
            raise ApplicationError("message_not_sent", f"message {seq} is {message.state}", status_code=409)
        return session_message_dict(message)


def message_withdraw(*, owner, session_id, seq: int, now: datetime) -> dict:
    """C10 for T2: ``sent`` -> ``withdrawn``, against delivery (one of the two wins).
    409 ``message_not_sent`` when it was delivered (or is final) first."""
    with transaction.atomic():
        session = Session.objects.filter(pk=session_id, owner=owner).first()
        message = session and SessionMessage.objects.filter(session=session, seq=seq).first()
        if not message:
            raise ApplicationError("not_found", "no such message", status_code=404)
        if not message_advance(message, S.WITHDRAWN, now=now, by="owner"):
            message.refresh_from_db()
            if message.state != S.WITHDRAWN:
                raise ApplicationError("message_not_sent", f"message {seq} is {message.state}", status_code=409)
        return session_message_dict(message)


def message_advance(message: SessionMessage, to: str, *, now: datetime, by: str = "", reply: str = "") -> bool:
    """Compare-and-set ``message`` to ``to`` from one of ``FORWARD[to]``; True when this
    call moved it (then it is refreshed and published)."""
    stamps: dict = {}
    if to == S.DELIVERED:
        stamps = {"delivered_at": now, "delivered_by": by[:200]}
    elif to == S.ANSWERED:
        stamps = {"answered_at": now, "reply": reply}
    if not SessionMessage.objects.filter(pk=message.pk, state__in=FORWARD[to]).update(
            state=to, version=F("version") + 1, **stamps):
        return False
    message.refresh_from_db()
    if to == S.ANSWERED and message.delivered_at is None:
        SessionMessage.objects.filter(pk=message.pk).update(delivered_at=now)
        message.delivered_at = now
    _publish(message)
    return True


def messages_answer(session_id, *, now: datetime, reply: str = "") -> int:
    """A turn of the session ended (``ended``, M1): its ``delivered`` messages were taken
    by that turn and are ``answered`` (T2), each with ``reply``, the turn's last assistant
    message when the hook reported it (T6). Returns how many."""
    count = 0
    for message in SessionMessage.objects.filter(session_id=session_id, state=S.DELIVERED):
        count += message_advance(message, S.ANSWERED, now=now, reply=reply)
    return count


def session_messages(*, owner, session_id) -> list[SessionMessage]:
    """The session's messages in ``seq`` order (the latest ``MESSAGES_LISTED``); 404 for another owner's."""
    session = Session.objects.filter(pk=session_id, owner=owner).first()
    if session is None:
        raise ApplicationError("not_found", "no such session", status_code=404)
    latest = SessionMessage.objects.filter(session=session).order_by("-seq")[:MESSAGES_LISTED]
    return sorted(latest, key=lambda m: m.seq)


def session_interrupt(*, owner, session_id, now: datetime) -> Session:
    """T5: a ``session_interrupt`` message for the session's terminal wrapper, which sends
    the CLI's interrupt key once; the session stays. 404 ``not_found``; 409
    ``session_unreachable`` (no machine), ``interrupt_unsupported`` (not under the wrapper)."""
    with transaction.atomic():
        session = _session_locked(owner, session_id)
        if (refusal := _unreachable(session)) is not None:
            raise refusal
        if session.channel != Channel.TERMINAL:
            raise ApplicationError("interrupt_unsupported", "only a session under the terminal wrapper "
                                   f"(`runstead-term {session.agent or 'claude'}`) can be interrupted from here",
                                   status_code=409)
        _send(session, MessageKind.SESSION_INTERRUPT, now, session_id=str(session.pk),
              interrupt_id=str(uuid.uuid4()))
        return session


def _publish(message: SessionMessage) -> None:
    broadcast(message.session.owner_id, session_message_event(message))
