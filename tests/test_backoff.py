"""R4: one backoff policy (``machine.protocol.Backoff``, equal jitter, capped at 60 s),
and the three retriers that use it: the worker, the notify loop and the hook sender."""
import random
from pathlib import Path

import pytest

from notifications import delivery
from machine.hooks.sender import Sender
from machine.protocol import BACKOFF_CAP_S, Backoff
from machine.worker.clock import SYSTEM_CLOCK
from tests.worker_harness import make_worker

pytestmark = pytest.mark.backend_independent  # neither database nor layer (pytest.ini)


def window(base_s: float, cap_s: float, n: int) -> tuple[float, float]:
    d = min(cap_s, base_s * 2.0**n)
    return d / 2, d


def test_r4_equal_jitter_stays_in_half_to_full_window_seeded():
    """Seeded: every delay lies in ``[d/2, d]`` with ``d = min(cap, base * 2**n)``, and
    the draws really spread over that window (jitter, not a constant)."""
    backoff = Backoff(base_s=1.0, cap_s=60.0, rng=random.Random(18).random)
    for n in range(40):
        low, high = window(1.0, 60.0, n)
        draws = [backoff.delay(n) for _ in range(200)]
        assert all(low <= d <= high for d in draws), n
        # 200 uniform draws cover most of the window: both its lower and upper fifths.
        assert min(draws) < low + (high - low) / 5 and max(draws) > high - (high - low) / 5, n


def test_r4_extremes_grow_then_hold_at_the_cap():
    """The rng's extremes give the window's edges: the floor and ceiling double per
    attempt until the ceiling reaches the cap, then hold at ``[cap/2, cap]``."""
    floor = [Backoff(base_s=1.0, rng=lambda: 0.0).delay(n) for n in range(10)]
    ceiling = [Backoff(base_s=1.0, rng=lambda: 1.0).delay(n) for n in range(10)]
    assert floor == [0.5, 1, 2, 4, 8, 16, 30, 30, 30, 30]
    assert ceiling == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]
    assert BACKOFF_CAP_S == 60.0  # SPEC R4's cap, the default


def test_r4_seeded_delays_are_reproducible_and_capped_after_a_long_outage():
    """The same seed gives the same delays; an attempt number from a day-long outage
    (or a negative one, counted as the first) neither overflows nor escapes the window."""
    a = Backoff(base_s=0.5, cap_s=60.0, rng=random.Random(7).random)
    b = Backoff(base_s=0.5, cap_s=60.0, rng=random.Random(7).random)
    attempts = [-3, 0, 1, 5, 10, 100, 10_000]
    delays = [a.delay(n) for n in attempts]
    assert delays == [b.delay(n) for n in attempts]
    assert 0.25 <= delays[0] <= 0.5 and 0.25 <= delays[1] <= 0.5
    assert all(30.0 <= d <= 60.0 for d in delays[4:])


def worker_backoff(tmp_path: Path) -> Backoff:
    worker = make_worker(tmp_path, SYSTEM_CLOCK)
    # The poll, the lease grant and the outbox all retry through the worker's one policy.
    assert worker.poller.backoff is worker.runner.backoff is worker.sender.backoff is worker.backoff
    return worker.backoff


@pytest.mark.parametrize("retrier", ["worker", "notify", "hook sender"])
def test_r4_each_retrier_uses_the_one_policy_with_the_60_s_cap(retrier, tmp_path: Path, monkeypatch):
    """The worker's, the notify loop's and the hook sender's default backoff are all
    ``Backoff`` with R4's cap; they differ only by base (first retry)."""
    for name in ("RUNSTEAD_HOOK_BACKOFF_BASE_S", "RUNSTEAD_HOOK_BACKOFF_MAX_S"):
        monkeypatch.delenv(name, raising=False)
    backoff = {
        "worker": lambda: worker_backoff(tmp_path),
        "notify": lambda: delivery.BACKOFF,
        "hook sender": lambda: Sender(tmp_path).backoff,
    }[retrier]()
    assert type(backoff) is Backoff and backoff.cap_s == 60.0
    assert all(backoff.delay(n) <= 60.0 for n in range(64))
    assert backoff.delay(20) >= 30.0
