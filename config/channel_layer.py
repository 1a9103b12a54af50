"""The production channel layer: channels_redis's ``RedisChannelLayer`` whose calls are
retried once at once on a connection error (D, B2).

After a Redis restart, the first call on each pooled connection from before the outage
fails; without the retry the first board handshake (or broadcast) after recovery fails
about half the time. A second failure is real (Redis is down) and propagates: callers
treat the layer as best effort (broadcasts are ``robust`` on_commit callbacks, the long-poll
falls back on its re-check, the board closes with a "retry" code).
"""
from channels_redis.core import RedisChannelLayer
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

RETRIED = (RedisConnectionError, RedisTimeoutError, ConnectionError, OSError)


class RetryingRedisChannelLayer(RedisChannelLayer):
    """``send``, ``receive``, ``group_add``, ``group_discard`` and ``group_send``, each
    retried once on a connection error."""

    async def send(self, channel, message):
        try:
            return await super().send(channel, message)
        except RETRIED:
            return await super().send(channel, message)

    async def receive(self, channel):
        try:
            return await super().receive(channel)
        except RETRIED:
            return await super().receive(channel)

    async def group_add(self, group, channel):
        try:
            return await super().group_add(group, channel)
        except RETRIED:
            return await super().group_add(group, channel)

    async def group_discard(self, group, channel):
        try:
            return await super().group_discard(group, channel)
        except RETRIED:
            return await super().group_discard(group, channel)

    async def group_send(self, group, message):
        try:
            return await super().group_send(group, message)
        except RETRIED:
            return await super().group_send(group, message)
