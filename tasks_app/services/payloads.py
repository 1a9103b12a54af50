"""The payload of each outbox message kind, built from the task (SPEC H, W2): one builder
per kind, each typed by its shape in ``machine.protocol.shapes``, which ``message_send``
checks before it writes the message (so the service never sends a field the worker's
shape does not name, STYLE 18)."""
from django.conf import settings

from machine.protocol.shapes import (
    CancelPayload,
    EndPayload,
    InterruptPayload,
    IntegratePayload,
    MessagePayload,
    QueryPayload,
    StartPayload,
)
from tasks_app.models import MessageKind, Task


def start_payload(task: Task) -> StartPayload:
    """``start`` (H, W4): what the worker needs to run the task's agent, with C1/C5's
    live-conversation keys and G6/G7/G8's follow-up keys where they apply."""
    payload: StartPayload = {
        "operation_id": str(task.operation.id),
        "task_id": str(task.id),
        "folder": task.folder,
        "grant_root": task.grant.path,
        "agent": task.agent,
        "prompt": task.prompt,
        "max_runtime_s": task.max_runtime_s,
        "session_id": str(task.session_id) if task.session_id else None,
        "deep_research": task.deep_research,
        "isolation": task.isolation,  # G7: what acceptance decided (and locked by)
    }
    if task.conversation == "live":  # C1, C5: the agent stays open for messages
        prompt_message = task.messages.filter(seq=0).values_list("id", flat=True).first()
        payload.update(mode="conversation", idle_s=settings.RUNSTEAD_CONVERSATION_IDLE_S,
                       prompt_message_id=str(prompt_message) if prompt_message else None)
    if task.continued_from_id:  # G6: the agent session this follow-up continues
        payload["agent_session_id"] = task.continued_from.agent_session_id
        if task.branch_of_id:  # G7, G8: in the worktree of the task it follows
            payload["worktree_of"] = str(task.continued_from.operation.id)
    return payload


def cancel_payload(task: Task) -> CancelPayload:
    """``cancel`` (J7)."""
    return {"operation_id": str(task.operation.id)}


def query_payload(task: Task, *, query_id: str) -> QueryPayload:
    """``query`` (U1): the worker answers with a ``report`` carrying ``query_id``."""
    return {"operation_id": str(task.operation.id), "query_id": query_id}


def integrate_payload(task: Task, *, integration_id: str, action: str, branch: str, base: str | None,
                      base_branch: str | None, head: str | None) -> IntegratePayload:
    """``integrate`` (G7): merge or discard the task's branch, from its final git evidence."""
    return {"operation_id": str(task.operation.id), "integration_id": integration_id, "action": action,
            "branch": branch, "base": base, "base_branch": base_branch, "head": head}


def message_payload(task: Task, *, message_id: str, seq: int, text: str, delivery: str = "queue") -> MessagePayload:
    """``message`` (C2, C9): the owner's message ``seq`` for the live agent; ``delivery``
    only when it is ``steer`` (an older worker then reads it as queued, its own turn)."""
    payload = {"operation_id": str(task.operation.id), "message_id": message_id, "seq": seq, "text": text}
    return {**payload, "delivery": "steer"} if delivery == "steer" else payload


def interrupt_payload(task: Task, *, interrupt_id: str) -> InterruptPayload:
    """``interrupt`` (C4)."""
    return {"operation_id": str(task.operation.id), "interrupt_id": interrupt_id}


def end_payload(task: Task, *, reason: str, last_seq: int) -> EndPayload:
    """``end`` (C5): close the agent's input after message ``last_seq``."""
    return {"operation_id": str(task.operation.id), "reason": reason, "last_seq": last_seq}


# The builder of each kind; ``message_send(task, kind=..., **extra)`` calls it with ``extra``.
BUILDERS = {
    MessageKind.START: start_payload,
    MessageKind.CANCEL: cancel_payload,
    MessageKind.QUERY: query_payload,
    MessageKind.INTEGRATE: integrate_payload,
    MessageKind.MESSAGE: message_payload,
    MessageKind.INTERRUPT: interrupt_payload,
    MessageKind.END: end_payload,
}
