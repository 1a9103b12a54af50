"""Rate limits as a brake (K1, K3): DRF throttles (the apps key them by owner or machine,
e.g. tasks_app/api/throttling.py), with their
rates read from settings on every request (so tests and operators set them through the
environment), answering 429 ``{"error": "rate_limited", "detail", "retry_after_s"}`` with
a ``Retry-After`` header (seconds) through ``core.exception_handler``.

They count in Django's cache (per process with the default local-memory cache), which is
a brake against a runaway client, not a security boundary (FACTS: DRF throttling).
``KeyedRate`` is the same brake without a cache round trip, for code on an event loop
(the board's WebSocket handshakes, board/consumers.py).
"""
from django.conf import settings
from rest_framework.throttling import SimpleRateThrottle


class SettingsRateThrottle(SimpleRateThrottle):
    """A DRF ``SimpleRateThrottle`` whose rate (``"N/period"``, period ``s``, ``min``,
    ``hour`` or ``day``) is the Django setting named ``rate_setting``, read per request."""

    rate_setting = ""

    def get_rate(self):
        return getattr(settings, self.rate_setting)


PERIODS_S = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}


def parse_rate(rate: str) -> tuple[int, float]:
    """``"N/period"`` (period ``s``, ``min``, ``hour``, ``day``, read by its first letter
    as DRF does) -> ``(N, period in seconds)``. Raises ``ValueError`` on anything else."""
    count, _, period = rate.partition("/")
    if not count.strip().isdigit() or not period.strip() or period.strip()[0] not in PERIODS_S:
        raise ValueError(f"not a rate (N/s, N/min, N/hour, N/day): {rate!r}")
    return int(count), PERIODS_S[period.strip()[0]]


class KeyedRate:
    """A brake for one process, without I/O (safe on an event loop): a token bucket per
    key holding at most N tokens that refills at N per period (``rate`` as
    ``parse_rate`` reads it), so a burst of N passes and then one per period/N.
    ``allow(key, rate)`` -> ``(True, 0.0)``, or ``(False, seconds until one more
    passes)``. At most ``max_keys`` keys are remembered: past that, the buckets that
    have refilled are forgotten (a full bucket and a new one are the same)."""

    def __init__(self, *, max_keys: int = 10_000, clock=None):
        import time

        self.max_keys = max_keys
        self.clock = clock or time.monotonic
        self.buckets: dict = {}  # key -> (tokens, at)

    def allow(self, key, rate: str) -> tuple[bool, float]:
        capacity, period_s = parse_rate(rate)
        now = self.clock()
        per_s = capacity / period_s
        tokens, at = self.buckets.get(key, (float(capacity), now))
        tokens = min(float(capacity), tokens + (now - at) * per_s)
        if tokens < 1.0:
            self.buckets[key] = (tokens, now)
            return False, (1.0 - tokens) / per_s if per_s else period_s
        self.buckets[key] = (tokens - 1.0, now)
        if len(self.buckets) > self.max_keys:
            self._forget_full(capacity, per_s, now)
        return True, 0.0

    def _forget_full(self, capacity: int, per_s: float, now: float) -> None:
        full = [k for k, (tokens, at) in self.buckets.items() if tokens + (now - at) * per_s >= capacity]
        for key in full:
            del self.buckets[key]
        if len(self.buckets) > self.max_keys:  # still over: forget the longest idle
            for key, _ in sorted(self.buckets.items(), key=lambda item: item[1][1])[: len(self.buckets) - self.max_keys]:
                del self.buckets[key]

    def clear(self) -> None:
        self.buckets.clear()
