"""T4: a Claude Code session without the terminal wrapper gets a waiting message at the
end of its turn, through its ``Stop`` hook (SPEC T4, I1).

The machine's worker records each message for the session in the local inbox
(``machine.inbox``). A ``Stop`` hook with nothing waiting there (one ``listdir``) makes no
network call (I1). With one waiting, and not on the ``stop_hook_active`` re-fire, it takes
the oldest (a local rename: of two hooks one wins), then claims it on the service by
compare-and-set (``POST .../messages/{seq}/delivery/`` ``{"state": "delivered", "claim"}``,
within ``CLAIM_TIMEOUT_S``): won, it prints ``{"decision": "block", "reason": TEXT}`` and
the agent goes on with TEXT in the same turn (the claim is the delivery); refused (the
message was withdrawn, or claimed elsewhere) or unreachable, it prints nothing and the
turn ends as it would. An unreachable claim puts the message back to wait; the next
``Stop`` claims it again under the same claim id, which the service answers 200 if the
first claim had in fact been recorded.
"""
import json

from machine import inbox

CLAIM_TIMEOUT_S = 1.0  # connect and answer, each: no answer within 2 s, nothing claimed (T4)
REASON_PREFIX = "Message from your phone (RunStead): "


def stop_delivery(state_dir: str, *, session_id: str, payload: dict, config: dict,
                  timeout_s: float = CLAIM_TIMEOUT_S) -> str | None:
    """The JSON to print for this ``Stop`` (a block carrying the message), or None."""
    if payload.get("stop_hook_active"):
        return None  # the re-fire of a turn a block continued: let it end
    if not inbox.waiting(state_dir, session_id):
        return None  # I1: the common Stop, decided from the local state alone
    server, token = config.get("server"), config.get("token")
    if not server or not token:
        return None
    taken = inbox.take(state_dir, session_id)
    if taken is None:
        return None
    name, message = taken
    from machine.hooks.approval import Refused, Unreachable, request

    path = f"/api/sessions/{session_id}/messages/{int(message['seq'])}/delivery/"
    body = {"state": "delivered", "claim": f"stop-{message['message_id']}"}
    try:
        answer = request(server, token, "POST", path, body, timeout_s=timeout_s)
    except Refused:
        inbox.move(state_dir, session_id, name, inbox.GONE)
        return None
    except Unreachable:
        inbox.move(state_dir, session_id, name, inbox.WAIT)
        return None
    inbox.move(state_dir, session_id, name, inbox.DONE)
    return json.dumps({"decision": "block", "reason": REASON_PREFIX + str(answer.get("text", message["text"]))})
