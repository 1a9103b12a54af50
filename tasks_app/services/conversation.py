"""Talking to a running agent: conversation tasks (SPEC C1-C7).

A task accepted with ``"mode": "conversation"`` keeps its agent open between turns
(``conversation: "live"``: the CLI's streaming input, C1) or carries each message as a
follow-up of the conversation (``"resume"``, G6). Here:

- ``message_accept``: ``POST /api/tasks/{id}/messages/`` under the Idempotency-Key rules
  (A1-A4, ``core.idempotency`` with scope ``message:<task id>``): the message is numbered in
  acceptance order (``seq``, under the task's row lock, C2) and in the same transaction a
  ``message`` outbox message goes to the worker (live) or a follow-up task is accepted for
  it (resume, as ``POST /api/tasks/`` with ``continue_task``);
- ``task_interrupt`` and ``task_end``: the ``interrupt`` (C4) and ``end`` (C5) messages;
- ``message_receipt_apply``: the worker's ``message`` receipts (C3, C9): a message's state
  only moves forward, ``sent`` -> ``delivered`` -> ``consumed`` -> ``answered``, or
  ``sent`` -> ``undelivered`` (``message_states``);
  a ``claimed`` receipt is the worker's claim of a delivery it is about to write (C10);
- ``message_withdraw`` (C10): ``sent`` -> ``withdrawn`` while no worker has claimed it.

Withdraw against delivery (C10), exactly once: the worker (``machine/worker/conversation.py``)
sends a ``message`` receipt ``{"state": "claimed"}`` and waits for its answer before it
gives the message its inbox place; it writes the message only when the answer is
``applied`` (it claimed it) or ``stale`` (its own earlier claim, retried after a crash;
receipts are answered byte-equal per event id, R1). Claim and withdraw are the same
compare-and-set on the message row (``sent`` and ``claimed_at`` NULL), so under any
interleaving exactly one of them matches: a withdrawn message is never claimed, hence
never written, and a claimed one answers withdraw 409 ``already_delivered``. The
agent sees a message only if the claim won.
- ``message_states.messages_follow_task``: called by every task transition: a live
  conversation that ends leaves its unwritten messages ``undelivered``; a resume
  conversation's message follows the follow-up that carries it.

Every change bumps the message's ``version`` and sends a ``message`` board event after
commit (B2).
"""
import uuid
from datetime import datetime

from django.db import transaction

from core.actors import actor_owner
from core.errors import ApplicationError
from core.idempotency import Answer
from tasks_app.models import (
    FINAL_STATES,
    ConversationMessage,
    ConversationMessageState as S,
    Machine,
    MessageDelivery,
    MessageKind,
    Task,
    TaskState,
)
from tasks_app.services.acceptance import create_task
from tasks_app.services.message_states import (
    RESUME_DEAD_STATES,
    message_advance,
    message_claim,
    message_publish,
    message_withdrawn,
)
from tasks_app.services.transitions import message_send, task_publish, task_record
from tasks_app.shapes import conversation_message_dict, task_dict


def message_scope(task_id) -> str:
    """The idempotency scope of one task's messages: a key names one message of one task."""
    return f"message:{task_id}"


def message_accept(*, owner, task_id, text: str, now: datetime, delivery: str = "queue") -> Answer:
    """C2, C9: accept message ``text`` into conversation task ``task_id``, to be delivered as
    ``delivery`` (``queue``: its own turn after the current one; ``steer``: into the
    running turn as soon as the agent can take it); the view runs this
    once per Idempotency-Key through ``core.idempotency.respond_once`` (scope
    ``message_scope(task_id)``), inside its transaction. Returns ``(201, message shape,
    {"task": task})`` (``conversation_message_dict``). Refusals store nothing (A5):
    404 ``not_found`` (not the owner's), 409 ``not_conversation``, ``already_final``,
    ``task_unknown`` (the outcome is not known: decide it first, U3),
    ``cancel_requested``, ``conversation_ended`` (C5), ``steer_unsupported`` (C9: a steer
    where the task's agent cannot take one: ``steer_supported``), and in a resume conversation what
    acceptance refuses (``budget_exhausted``, ``folder_not_granted``, ...). Size and
    emptiness are checked by the view (C7)."""
    carrier = None
    task = _open_task(owner, task_id, lock=False)
    if delivery == MessageDelivery.STEER and not steer_supported(task):
        raise ApplicationError("steer_unsupported", "this task's agent cannot take a message into a running turn "
                               '(only a live Claude Code conversation can, for now): send it with "delivery": '
                               '"queue"', status_code=409)
    if task.conversation == "resume":
        if task.state in RESUME_DEAD_STATES:
            raise ApplicationError("already_final", f"the conversation's task is {task.state}: there is no agent "
                                   "session to continue", status_code=409)
        carrier = _follow_up(owner, task, text, now)  # P2: machine, grant, budget, then the task below
    task = _open_task(owner, task_id, lock=True)
    if task.conversation == "live" and (refusal := _live_refusal(task)) is not None:
        raise refusal
    seq = task.message_seq + 1
    Task.objects.filter(pk=task.pk).update(message_seq=seq)
    message = ConversationMessage.objects.create(task=task, seq=seq, text=text, carrier=carrier, created_at=now,
                                                 delivery=delivery)
    if task.conversation == "live":
        message_send(task, kind=MessageKind.MESSAGE, now=now, message_id=str(message.id), seq=seq, text=text,
                     delivery=delivery)
    task_record(task, reason=f"message {seq} sent", actor=actor_owner(owner), now=now)
    task_publish(task, now=now)  # its ``messages_sent`` changed: board rows follow
    message_publish(message)
    return 201, conversation_message_dict(message), {"task": task}


STEER_PRESETS = frozenset({"claude", "codex"})
"""C9: the presets whose live conversation takes a message into the running turn (Claude
Code: stdin written mid-turn is folded in at the next tool boundary and echoed with
``--replay-user-messages``, docs/claude-stream-input.md; Codex: the app-server's
``turn/steer``, docs/codex-app-server.md)."""


def steer_supported(task: Task) -> bool:
    """C9: whether ``task``'s agent can be steered: a live conversation whose profile, as
    its machine last reported it, runs a preset of ``STEER_PRESETS``."""
    if task.conversation != "live" or task.machine_id is None:
        return False
    profiles = Machine.objects.filter(pk=task.machine_id).values_list("profiles", flat=True).first() or []
    return any(p.get("name") == task.agent and p.get("preset") in STEER_PRESETS for p in profiles)


def _open_task(owner, task_id, *, lock: bool) -> Task:
    tasks = Task.objects.filter(pk=task_id, owner=owner)
    task = (tasks.select_for_update() if lock else tasks).first()
    if task is None:
        raise ApplicationError("not_found", "no such task", status_code=404)
    if task.mode != "conversation":
        raise ApplicationError("not_conversation", "the task was not started as a conversation "
                               '(submit it with "mode": "conversation"); send a follow-up instead', status_code=409)
    if task.conversation_ended_at is not None:
        raise ApplicationError("conversation_ended", "the conversation was ended", status_code=409)
    return task


def _live_refusal(task: Task) -> ApplicationError | None:
    if task.state in FINAL_STATES:
        return ApplicationError("already_final", f"the task is already {task.state}", status_code=409)
    if task.state == TaskState.UNKNOWN:
        return ApplicationError("task_unknown", "the task's outcome is unknown: decide it first", status_code=409)
    if task.cancel_requested_at is not None:
        return ApplicationError("cancel_requested", "the task is being cancelled", status_code=409)
    return None


def _follow_up(owner, task: Task, text: str, now: datetime) -> Task:
    """A resume conversation's message as a follow-up task (G6, G8): queued behind the
    conversation's last unfinished task, or accepted at once."""
    data = {"machine": task.machine_id, "folder": task.folder, "agent": task.agent, "prompt": text,
            "session": task.session_id, "deep_research": task.deep_research, "max_runtime_s": task.max_runtime_s,
            "exclusive": task.exclusive, "continue_task": task.pk}
    return create_task(owner=owner, data=data, now=now)


def task_interrupt(*, owner, task_id, now: datetime) -> dict:
    """C4: stop the live conversation's current turn and keep the agent: an ``interrupt``
    message ``{operation_id, interrupt_id}`` for the worker (which sends the CLI's own
    interrupt; between turns it does nothing). Returns the task. Refusals: 404
    ``not_found``; 409 ``not_conversation``, ``interrupt_unsupported`` (a resume
    conversation: each turn is its own process, cancel it), ``already_final``,
    ``task_unknown``, ``cancel_requested``, ``conversation_ended``."""
    with transaction.atomic():
        task = _open_task(owner, task_id, lock=True)
        if task.conversation != "live":
            raise ApplicationError("interrupt_unsupported", "this agent's CLI has no live input to interrupt: "
                                   "cancel the follow-up that runs instead", status_code=409)
        if (refusal := _live_refusal(task)) is not None:
            raise refusal
        message_send(task, kind=MessageKind.INTERRUPT, now=now, interrupt_id=str(uuid.uuid4()))
        task_record(task, reason="interrupt requested", actor=actor_owner(owner), now=now)
        return task_dict(task)


def task_end(*, owner, task_id, now: datetime) -> dict:
    """C5: end the conversation: no more messages are accepted; a live one gets an ``end``
    message ``{reason, last_seq}`` (the worker closes the agent's input once messages 0 ..
    ``last_seq`` are written, and the agent finishes by itself). Ending twice is the same answer. Returns the task.
    Refusals: 404 ``not_found``; 409 ``not_conversation``, ``already_final`` (live)."""
    with transaction.atomic():
        task = Task.objects.select_for_update().filter(pk=task_id, owner=owner).first()
        if task is None:
            raise ApplicationError("not_found", "no such task", status_code=404)
        if task.mode != "conversation":
            raise ApplicationError("not_conversation", "the task was not started as a conversation", status_code=409)
        if task.conversation_ended_at is None:
            if task.conversation == "live" and task.state in FINAL_STATES:
                raise ApplicationError("already_final", f"the task is already {task.state}", status_code=409)
            Task.objects.filter(pk=task.pk).update(conversation_ended_at=now)
            if task.conversation == "live" and task.state != TaskState.UNKNOWN:
                message_send(task, kind=MessageKind.END, now=now, reason="owner", last_seq=task.message_seq)
            task_record(task, reason="conversation ended by its owner", actor=actor_owner(owner), now=now)
            task_publish(task, now=now)
        return task_dict(Task.objects.get(pk=task.pk))


def message_withdraw(*, owner, task_id, seq: int, now: datetime) -> dict:
    """C10: withdraw message ``seq`` (from 1) of the owner's conversation task: ``sent``
    -> ``withdrawn`` unless the worker claimed its delivery first (module docstring).
    Returns the message shape; withdrawing a withdrawn message again is the same answer.
    Refusals change nothing: 404 ``not_found`` (not the owner's task, no such message),
    409 ``already_delivered`` (claimed, delivered or answered: the agent has it or is
    getting it), ``already_final`` (``undelivered``: the task ended first),
    ``prompt_not_withdrawable`` (message 0 is the task's prompt, which the worker writes
    with the agent's start: cancel the task instead), ``withdraw_unsupported`` (a resume
    conversation: its message is a follow-up task, cancel that)."""
    with transaction.atomic():
        # The task's row lock first, as a receipt takes it before the message (no deadlock).
        task = Task.objects.select_for_update().filter(pk=task_id, owner=owner).first()
        message = task and ConversationMessage.objects.filter(task=task, seq=seq).first()
        if message is None:
            raise ApplicationError("not_found", "no such message", status_code=404)
        if task.conversation != "live":
            raise ApplicationError("withdraw_unsupported", "in a resume conversation each message is a follow-up "
                                   "task: cancel the follow-up that carries it", status_code=409)
        if seq == 0:
            raise ApplicationError("prompt_not_withdrawable", "message 0 is the task's prompt: cancel the task instead",
                                   status_code=409)
        if message_withdrawn(message, now=now):
            task_record(task, reason=f"message {seq} withdrawn", actor=actor_owner(owner), now=now)
            task_publish(task, now=now)  # its ``turn`` (C6) may have changed: board cards follow
            return conversation_message_dict(message)
        message.refresh_from_db()
        if message.state == S.WITHDRAWN:
            return conversation_message_dict(message)
        if message.state == S.UNDELIVERED:
            raise ApplicationError("already_final", f"message {seq} was not delivered: the task ended first",
                                   status_code=409)
        raise ApplicationError("already_delivered", f"message {seq} is already with the agent ({message.state})",
                               status_code=409)


def message_receipt_apply(task: Task, facts: dict, *, actor: str, now: datetime) -> dict:
    """C3: apply a ``message`` receipt's facts ``{message_id, state}`` (state
    ``delivered``, ``answered`` or ``undelivered``; ``consumed`` with ``turn_seq``, C9):
    a compare-and-set that only moves
    forward. Returns the R3 answer: applied, or not_applied ``unknown_message`` /
    ``stale`` (the message is already there or further). State ``claimed`` (C10) is the
    worker's claim before it writes: applied, or not_applied ``stale`` (claimed before:
    write it), ``withdrawn`` or ``undelivered`` (never write it)."""
    message = ConversationMessage.objects.filter(pk=facts["message_id"], task=task).first()
    if message is None:
        task_record(task, reason="message receipt for an unknown message", actor=actor, now=now)
        return {"outcome": "not_applied", "reason": "unknown_message"}
    if facts["state"] == "claimed":
        outcome = message_claim(message, now=now)
        if outcome != "claimed":
            return {"outcome": "not_applied", "reason": outcome}
        task_record(task, reason=f"message {message.seq} claimed for delivery", actor=actor, now=now)
        return {"outcome": "applied"}
    if not message_advance(message, facts["state"], now=now, turn_seq=facts.get("turn_seq")):
        return {"outcome": "not_applied", "reason": "stale"}
    task_record(task, reason=f"message {message.seq} {facts['state']}", actor=actor, now=now)
    if task.conversation == "live":
        task_publish(task, now=now)  # its ``turn`` (C6) may have changed: board cards follow
    return {"outcome": "applied"}


def conversation_messages(task: Task) -> list[ConversationMessage]:
    """The task's messages in ``seq`` order (at most ``MESSAGES_LISTED``, the latest)."""
    latest = ConversationMessage.objects.filter(task=task).order_by("-seq")[:MESSAGES_LISTED]
    return sorted(latest, key=lambda m: m.seq)


MESSAGES_LISTED = 500
