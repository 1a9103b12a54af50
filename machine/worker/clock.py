"""The worker's clocks and waits (SPEC 1 "clock", L3, L4, L9, R4, W8).

Lease math needs two clocks that can disagree: ``monotonic()`` (stops while a Mac sleeps,
never jumps) and ``wall()`` (keeps counting through sleep, may jump either way). Worker
code takes a ``Clock`` and reads time and waits only through it, so a test passes a
``FakeClock`` it moves by hand and nothing waits out a real interval. Seconds everywhere.

Waiting: ``clock.wait(event, timeout)`` returns True once ``event`` is set and False when
``timeout`` seconds of this clock have passed, or earlier (a spurious wake-up). Callers
therefore loop on their own absolute deadline (``clock.monotonic() < end``) and re-check
the world (a process that ended, a flag) after every return. ``clock.sleep(s)`` waits
the full ``s``.
"""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from typing import Protocol

from machine import simulated_sleep

# FakeClock: how long (real seconds) one wait blocks before a spurious return, so loops
# that poll real processes keep polling while fake time stands still.
FAKE_REAL_SLICE_S = 0.005


class Clock(Protocol):
    # True when readings are the operating system's own, so times another process
    # recorded (the launcher's exit.json) can be compared with them.
    shares_system_time: bool

    def monotonic(self) -> float: ...

    def wall(self) -> float: ...

    def wait(self, event: threading.Event | None, timeout: float) -> bool: ...

    def sleep(self, seconds: float) -> None: ...


class SystemClock:
    """The real clocks: ``time.monotonic()`` and ``time.time()`` (seconds). (A test can
    simulate a sleep of the machine: ``machine.simulated_sleep``, off unless its
    environment variable is set.)"""

    shares_system_time = True

    def monotonic(self) -> float:
        return simulated_sleep.monotonic()

    def wall(self) -> float:
        return time.time()

    def wait(self, event: threading.Event | None, timeout: float) -> bool:
        """``event.wait(timeout)``; with no event, a plain sleep that returns False."""
        timeout = max(0.0, timeout)
        if event is None:
            time.sleep(timeout)
            return False
        return event.wait(timeout)

    def sleep(self, seconds: float) -> None:
        time.sleep(max(0.0, seconds))


class FakeClock:
    """A clock for tests: both readings move only when the test says so.

    - ``advance(s)``: normal running time, both clocks move by ``s``;
    - ``suspend(s)``: the laptop sleeps: wall time moves, the monotonic clock does not;
    - ``jump_wall(s)``: a wall-clock adjustment (negative = backward).

    A ``wait`` blocks until its event is set or fake time passes its end, returning
    spuriously every ``FAKE_REAL_SLICE_S`` real seconds (callers re-check). ``waiters()``
    names the threads waiting now and the fake instant each waits for, so a test can
    advance exactly to a thread's next step (``advance_to(thread_name)``).
    """

    shares_system_time = False  # a launcher's recorded exit times cannot be placed on it

    def __init__(self, monotonic: float = 1000.0, wall: float = 1_700_000_000.0):
        self._lock = threading.Lock()
        self._mono = float(monotonic)
        self._wall = float(wall)
        self._waiting: dict[str, float] = {}

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

    def suspend(self, seconds: float) -> None:
        """System sleep: wall time moves, the monotonic clock does not."""
        with self._lock:
            self._wall += seconds

    def jump_wall(self, seconds: float) -> None:
        """A wall-clock adjustment (negative = backward); monotonic unaffected."""
        with self._lock:
            self._wall += seconds

    def wait(self, event: threading.Event | None, timeout: float) -> bool:
        name = threading.current_thread().name
        with self._lock:
            end = self._mono + max(0.0, timeout)
            self._waiting[name] = end
        try:
            if event is not None and event.is_set():
                return True
            if self.monotonic() >= end:
                return False
            if event is None:
                time.sleep(FAKE_REAL_SLICE_S)
                return False
            return event.wait(FAKE_REAL_SLICE_S)
        finally:
            with self._lock:
                if self._waiting.get(name) == end:
                    del self._waiting[name]

    def sleep(self, seconds: float) -> None:
        end = self.monotonic() + max(0.0, seconds)
        while self.monotonic() < end:
            self.wait(None, end - self.monotonic())

    # --- for tests -------------------------------------------------------------------------

    def waiters(self) -> dict[str, float]:
        """Thread name -> the fake monotonic instant it waits for (threads waiting now)."""
        with self._lock:
            return dict(self._waiting)

    def wait_for_waiter(self, prefix: str, real_timeout_s: float = 10.0, after: float | None = None) -> float:
        """Block (real time) until a thread whose name starts with ``prefix`` waits for an
        instant later than ``after`` (default: now); return that instant."""
        end = time.monotonic() + real_timeout_s
        while time.monotonic() < end:
            floor = self.monotonic() if after is None else after
            ends = [e for n, e in self.waiters().items() if n.startswith(prefix) and e > floor]
            if ends:
                return min(ends)
            time.sleep(FAKE_REAL_SLICE_S)
        raise AssertionError(f"no thread {prefix!r} started waiting within {real_timeout_s} s: {self.waiters()}")

    def advance_to(self, prefix: str, real_timeout_s: float = 10.0) -> float:
        """Advance exactly to the instant thread ``prefix`` waits for; returns the step (s)."""
        target = self.wait_for_waiter(prefix, real_timeout_s)
        step = target - self.monotonic()
        self.advance(step)
        return step


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
