"""The worker's clocks (SPEC 1 "clock", L3, L9).

Lease math needs two clocks that can disagree: ``monotonic()`` (stops while a Mac sleeps,
never jumps) and ``wall()`` (keeps counting through sleep, may jump either way). Worker code
takes a ``Clock``; tests pass a ``FakeClock`` they move by hand. Seconds everywhere.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Protocol


class Clock(Protocol):
    def monotonic(self) -> float: ...

    def wall(self) -> float: ...


class SystemClock:
    """The real clocks: ``time.monotonic()`` and ``time.time()`` (seconds)."""

    def monotonic(self) -> float:
        return time.monotonic()

    def wall(self) -> float:
        return time.time()


class FakeClock:
    """A clock for tests: both readings move only when the test says so.

    ``sleep(s)`` models a laptop sleeping: wall advances, monotonic stands still.
    """

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0):
        self._lock = threading.Lock()
        self._mono = float(monotonic)
        self._wall = float(wall)

    def monotonic(self) -> float:
        with self._lock:
            return self._mono

    def wall(self) -> float:
        with self._lock:
            return self._wall

    def advance(self, seconds: float) -> None:
        """Normal running time: both clocks move by ``seconds``."""
        with self._lock:
            self._mono += seconds
            self._wall += seconds

    def sleep(self, seconds: float) -> None:
        """System sleep: wall time moves, the monotonic clock does not."""
        with self._lock:
            self._wall += seconds

    def jump_wall(self, seconds: float) -> None:
        """A wall-clock adjustment (negative = backward); monotonic unaffected."""
        with self._lock:
            self._wall += seconds


SYSTEM_CLOCK = SystemClock()


def boot_id() -> str:
    """An id of the current boot: monotonic readings are comparable only within one boot.

    Linux: ``/proc/sys/kernel/random/boot_id``. macOS: ``sysctl kern.boottime``. Else the
    boot time from psutil.
    """
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        pass
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "kern.boottime"], capture_output=True, text=True, timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return "darwin:" + out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    import psutil

    return f"boot:{int(psutil.boot_time())}"
