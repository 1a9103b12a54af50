"""The one sender of board events (B2): after commit, to the owner's group only.

Low level on purpose: both apps send through it (task and machine events from
``tasks_app``, session and marker events from ``sessions_app``), and it imports neither.
"""
import logging

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

from core import clock

log = logging.getLogger("runstead.broadcast")


def owner_group(owner_id) -> str:
    """Channels group name of one owner's boards."""
    return f"owner.{owner_id}"


def broadcast(owner_id, event: dict) -> None:
    """Send ``event`` (a dict with ``type`` such as ``session.status``, ``marker``,
    ``task``, ``machine`` and the row's ``version``) to the owner's group once the current
    transaction commits; adds ``server_time`` (ISO-8601 UTC). Best effort: the board
    re-hydrates on reconnect (B4)."""
    broadcast_all([(owner_id, event)])


def broadcast_all(events: list[tuple]) -> None:
    """``broadcast`` of many ``(owner_id, event)`` at once (a wave of machines coming
    back, B7): after commit, one call onto the event loop and ONE group message per owner
    (``board.events``, its events in order; ``board.event`` for a lone one), which each
    process's board feed sends on as one frame per event. Issue 22: 1,000 machines
    coming back took 0.55 s as 1,000 broadcasts, in the transaction of their pull starts."""
    if not events:
        return

    def send():
        layer = get_channel_layer()
        if layer is None:
            return
        server_time = clock.now().isoformat()
        by_owner: dict = {}
        for owner_id, event in events:
            by_owner.setdefault(owner_id, []).append({**event, "server_time": server_time})
        async_to_sync(_send_all)(layer, by_owner)

    transaction.on_commit(send, robust=True)


async def _send_all(layer, by_owner: dict) -> None:
    for owner_id, sent in by_owner.items():
        message = {"type": "board.event", "event": sent[0]} if len(sent) == 1 else {"type": "board.events", "events": sent}
        await layer.group_send(owner_group(owner_id), message)
