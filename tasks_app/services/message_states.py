"""A conversation message's states (SPEC C3), below ``transitions``, which calls
``messages_follow_task`` in every task transition (a plain call: the task core follows
its own conversations; other apps hear the task through ``tasks_app/signals.py``).

A message's state only moves forward, ``sent`` -> ``delivered`` -> ``consumed`` ->
``answered`` (any of them may be skipped), or ``sent`` -> ``undelivered``, or ``sent`` ->
``withdrawn`` (C10, only while no worker has claimed it: ``message_claim``,
``message_withdrawn``); every change bumps its ``version`` and sends a ``message`` board
event after commit (B2).

C9: ``consumed`` is the agent showing it took the message (Claude Code's replayed user
line), with ``turn_seq``, the ``seq`` of the message whose turn took it: the message's own
(it opened a turn, and goes on to ``answered`` when that turn ends: one ``answered``
message per agent turn) or an earlier one's (it joined that running turn: ``consumed`` is
then where it stays).
"""
from datetime import datetime

from django.db.models import F

from core.broadcast import broadcast
from tasks_app.models import FINAL_STATES, ConversationMessage, ConversationMessageState, Task, TaskState
from tasks_app.shapes import message_event

S = ConversationMessageState
# C3: the order of a message's states; ``undelivered`` only from ``sent``.
STATE_RANK = {S.SENT: 0, S.DELIVERED: 1, S.CONSUMED: 2, S.ANSWERED: 3}
# A resume conversation whose first task ended thus is over: nothing to resume.
RESUME_DEAD_STATES = frozenset({TaskState.CANCELLED, TaskState.NOT_STARTED, TaskState.ABANDONED})


def message_advance(message: ConversationMessage, to: str, *, now: datetime, turn_seq: int | None = None) -> bool:
    """Move ``message`` to state ``to`` when that is forward of where it stands (C3, C9);
    ``turn_seq`` (with ``consumed``; default the message's own ``seq``): whose turn took it.
    A message ``answered`` without a ``consumed`` before took its own turn. True when it
    moved."""
    if to == S.UNDELIVERED:
        earlier = [S.SENT]
    else:
        earlier = [state for state, rank in STATE_RANK.items() if rank < STATE_RANK[to]]
    stamps = {"delivered_at": now} if to == S.DELIVERED else {"answered_at": now} if to == S.ANSWERED else {}
    if to in (S.CONSUMED, S.ANSWERED):
        stamps["delivered_at"] = message.delivered_at or now
    if to == S.CONSUMED:
        stamps.update(consumed_at=now, turn_seq=message.seq if turn_seq is None else turn_seq)
    if to == S.ANSWERED and message.turn_seq is None:
        stamps["turn_seq"] = message.seq
    if not ConversationMessage.objects.filter(pk=message.pk, state__in=earlier).update(
            state=to, version=F("version") + 1, **stamps):
        return False
    message.refresh_from_db()
    message_publish(message)
    return True


def message_claim(message: ConversationMessage, *, now: datetime) -> str:
    """C10: the worker's claim of ``message``'s delivery, made before it writes the message
    to the agent: a compare-and-set ``claimed_at`` NULL -> now on a ``sent`` message (its
    state stays ``sent`` until the ``delivered`` receipt). Returns ``claimed`` (this call
    claimed it), ``stale`` (claimed before, or already further: a retried claim, go on),
    ``withdrawn`` or ``undelivered`` (never write it). No board event: nothing the owner
    sees changed, except that withdraw now answers ``already_delivered``."""
    if ConversationMessage.objects.filter(pk=message.pk, state=S.SENT, claimed_at__isnull=True).update(
            claimed_at=now, version=F("version") + 1):
        return "claimed"
    message.refresh_from_db()
    return message.state if message.state in (S.WITHDRAWN, S.UNDELIVERED) else "stale"


def message_withdrawn(message: ConversationMessage, *, now: datetime) -> bool:
    """C10: ``sent`` -> ``withdrawn`` by compare-and-set against ``message_claim`` (the
    same row, ``state = sent AND claimed_at IS NULL`` in one UPDATE: of a racing claim and
    withdraw exactly one matches). True when this call withdrew it."""
    if not ConversationMessage.objects.filter(pk=message.pk, state=S.SENT, claimed_at__isnull=True).update(
            state=S.WITHDRAWN, version=F("version") + 1):
        return False
    message.refresh_from_db()
    message_publish(message)
    return True


def messages_follow_task(task: Task, *, now: datetime) -> None:
    """Called in every task transition (``transitions``), inside its transaction; acts
    on a conversation task or a follow-up (which may carry a resume conversation's
    message). A live conversation that became final leaves its messages never written
    ``undelivered`` (C3); a resume conversation's message follows its carrier:
    ``delivered`` when the follow-up runs, then ``answered`` (it ended with its agent's
    answer) or ``undelivered`` (it never started, or was cancelled)."""
    if task.mode != "conversation" and task.continued_from_id is None:
        return
    if task.conversation == "live":
        if task.state in FINAL_STATES:
            for message in ConversationMessage.objects.filter(task=task, state=S.SENT):
                message_advance(message, S.UNDELIVERED, now=now)
        return
    message = ConversationMessage.objects.filter(carrier=task).first()
    if message is not None:
        if task.state in (TaskState.STARTING, TaskState.RUNNING):
            message_advance(message, S.DELIVERED, now=now)
        elif task.state in RESUME_DEAD_STATES:
            message_advance(message, S.UNDELIVERED, now=now)
        elif task.state in FINAL_STATES:
            message_advance(message, S.ANSWERED, now=now)


def message_publish(message: ConversationMessage) -> None:
    """B2: the message's ``message`` board event, sent after commit."""
    broadcast(message.task.owner_id, message_event(message))
