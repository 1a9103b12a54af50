"""Counters shared by every service process, for per-process caches (K1, D).

A process that caches something another process can invalidate (a machine token that is
revoked on another daphne) reads the counter of its ``name`` before it trusts the cache
and forgets the cache when the counter moved; whatever invalidates it calls ``bump``.

The counters live in Redis (``REDIS_URL``, under the channel layer's prefix), which every
process of a deployment shares. Without Redis (the embedded default, one process with an
in-memory layer) there is nothing to share them with: ``read`` answers None and callers
do not cache.
"""
import logging
import threading

from django.conf import settings

log = logging.getLogger("runstead.epoch")

TIMEOUT_S = 0.5  # a Redis that does not answer this fast is treated as unavailable

_client = None
_client_lock = threading.Lock()
_unreachable = False  # logged once per outage, not once per read


class EpochUnavailable(Exception):
    """Redis is configured but did not answer: the other processes were not told."""


def _redis():
    global _client
    if not settings.REDIS_URL:
        return None
    with _client_lock:
        if _client is None:
            import redis

            _client = redis.Redis.from_url(settings.REDIS_URL, socket_timeout=TIMEOUT_S,
                                           socket_connect_timeout=TIMEOUT_S)
        return _client


def _key(name: str) -> str:
    prefix = settings.CHANNEL_LAYERS["default"].get("CONFIG", {}).get("prefix", "runstead")
    return f"{prefix}:epoch:{name}"


def read(name: str) -> int | None:
    """The counter ``name`` now (0 before its first bump), or None when there is no
    shared counter (no Redis) or Redis did not answer: then do not trust a cache."""
    client = _redis()
    if client is None:
        return None
    global _unreachable
    try:
        value = int(client.get(_key(name)) or 0)
    except Exception as exc:  # redis-py raises its own ConnectionError, TimeoutError, ...
        if not _unreachable:
            log.warning("epoch %s: Redis did not answer (%s); caches are not used until it does", name, exc)
        _unreachable = True
        return None
    if _unreachable:
        log.warning("epoch %s: Redis answers again; caches are used again", name)
        _unreachable = False
    return value


def bump(name: str) -> None:
    """Move the counter ``name`` on, so every process forgets what it cached under it.
    Raises ``EpochUnavailable`` when Redis is configured and did not answer; a no-op
    without Redis."""
    client = _redis()
    if client is None:
        return
    try:
        client.incr(_key(name))
    except Exception as exc:
        raise EpochUnavailable(f"epoch {name}: Redis did not answer ({exc})") from exc
