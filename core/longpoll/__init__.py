"""The long-poll engine (D1, D2, W5, Q3; STYLE 13): "take, or wait for a wake-up, then
take", performed without a thread or a database connection while it waits. The contract
(what a view declares, what the engine guarantees, the settings it reads) is in
``core/longpoll/README.md``.

- a service returns a ``Wait`` and wakes its key with ``notify_after_commit(key)``;
- a view declares ``long_poll = LongPoll(wait=..., render=..., quick_auth=..., query=...)``
  and answers ``self.long_poll.answer(subject, wait_s)``;
- ``config/asgi.py`` routes the views through ``LongPollRouter``, and
  ``config/server_hooks.py`` calls ``stop_all()`` at shutdown.
"""
from core.longpoll.perform import take_or_wait, take_or_wait_sync
from core.longpoll.registry import Wait, notify, notify_after_commit, stop_all, waiting
from core.longpoll.router import LongPollRouter
from core.longpoll.view import LongPoll, QuickAuth

__all__ = [
    "LongPoll",
    "LongPollRouter",
    "QuickAuth",
    "Wait",
    "notify",
    "notify_after_commit",
    "stop_all",
    "take_or_wait",
    "take_or_wait_sync",
    "waiting",
]
