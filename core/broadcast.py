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

    def send():
        message = {**event, "server_time": clock.now().isoformat()}
        layer = get_channel_layer()
        if layer is None:
            return
        async_to_sync(layer.group_send)(owner_group(owner_id), {"type": "board.event", "event": message})

    transaction.on_commit(send, robust=True)
