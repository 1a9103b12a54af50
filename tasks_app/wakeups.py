"""Waking a machine's waiting long-polls (D1): low level, imported by the services that
make a message visible and by the long-poll endpoint that waits (``tasks_app/longpoll.py``).

It imports neither: the services call ``machine_notify_after_commit``; the endpoint
registers one registry of waiting pulls per event loop here (``registry_for``), which
``wake_local`` and ``stop_all`` reach from any thread.
"""
import logging
import threading

from asgiref.sync import async_to_sync
from channels.layers import get_channel_layer
from django.db import transaction

log = logging.getLogger("runstead.longpoll")

# Event loop -> its registry of waiting pulls (``tasks_app.longpoll.Waiters``: has
# ``loop``, ``wake(machine_id)`` and ``stop()``).
_registries: dict = {}
_lock = threading.Lock()


def machine_group(machine_id) -> str:
    """Channels group of one machine's waiting pulls."""
    return f"machine.{machine_id}"


def layer_is_remote() -> bool:
    """Whether the channel layer reaches other processes (Redis), not only this one."""
    layer = get_channel_layer()
    return layer is not None and not layer.__class__.__name__.startswith("InMemory")


def registry_for(loop, factory):
    """The registry of waiting pulls of ``loop``, made with ``factory(loop)`` on first use."""
    with _lock:
        registry = _registries.get(loop)
        if registry is None:
            registry = _registries[loop] = factory(loop)
        return registry


def _each_registry(call) -> None:
    with _lock:
        registries = list(_registries.values())
    for registry in registries:
        if not registry.loop.is_closed():
            registry.loop.call_soon_threadsafe(call, registry)


def wake_local(machine_id) -> None:
    """Wake this process's pulls of ``machine_id`` from any thread (D1)."""
    _each_registry(lambda registry: registry.wake(str(machine_id)))


def stop_all() -> None:
    """The server is stopping: every waiting pull answers (empty) at once."""
    _each_registry(lambda registry: registry.stop())


def machine_notify(machine_id) -> None:
    """Wake the machine's waiting pulls: those of this process directly, those of other
    processes through the channel layer group ``machine.<id>`` (Redis). Best effort: a
    layer failure is logged and the long-poll's safety re-check delivers instead (D1);
    nothing that calls this depends on Redis being up."""
    wake_local(machine_id)
    if not layer_is_remote():
        return
    try:
        async_to_sync(get_channel_layer().group_send)(
            machine_group(machine_id), {"type": "machine.wake", "machine_id": str(machine_id)}
        )
    except Exception as exc:
        log.warning("machine wake-up over the channel layer failed (%s); the re-check delivers", exc)


def machine_notify_after_commit(machine_id) -> None:
    """``machine_notify`` once the current transaction commits (D1: the message is
    visible to the pull it wakes)."""
    transaction.on_commit(lambda: machine_notify(machine_id), robust=True)
