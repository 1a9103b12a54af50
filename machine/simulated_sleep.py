"""TEST ONLY: a simulated system sleep of the worker's machine (SPEC L3, L5, L9; issue 42).

On a laptop that sleeps, the monotonic clock stops while wall time goes on. A test cannot
make the real machine sleep, so the history run (``tests/history/``) simulates it: with
``RUNSTEAD_TEST_SIMULATED_SLEEP_FILE`` naming a file (unset in production: then
``monotonic`` IS ``time.monotonic`` and nothing is read), the worker's ``SystemClock``
and the launcher read their monotonic clock through ``monotonic()``, which stands still
during every pause listed in that file and afterwards runs ``length_s`` behind the
system's for each pause that is over: exactly what a sleep of ``length_s`` leaves behind.
It never goes backward.

The file: JSON ``[[start_mono, length_s], ...]``, ``start_mono`` on the system's
``time.monotonic()`` (CLOCK_MONOTONIC: one clock for every process of the machine), seconds.
Re-read when its size or modification time changes. Standard library only (the launcher
loads it, ``machine/launcher.py``).
"""
import json
import os
import time

ENV = "RUNSTEAD_TEST_SIMULATED_SLEEP_FILE"
_path = os.environ.get(ENV, "")
_seen: tuple = ()
_pauses: list = []


def _read() -> list:
    global _seen, _pauses
    try:
        st = os.stat(_path)
    except OSError:
        return _pauses
    stamp = (st.st_mtime_ns, st.st_size)
    if stamp != _seen:
        try:
            with open(_path) as f:
                _pauses = [(float(a), float(b)) for a, b in json.load(f)]
            _seen = stamp
        except (OSError, ValueError, TypeError):
            pass  # written at this instant (writers replace it atomically): the last reading holds
    return _pauses


def _paused_monotonic() -> float:
    now = time.monotonic()
    return now - sum(min(max(0.0, now - start), length) for start, length in _read())


monotonic = _paused_monotonic if _path else time.monotonic


def add_pause(path: str, length_s: float, start_mono: float | None = None) -> None:
    """Append a pause of ``length_s`` seconds starting now (or at ``start_mono``) to the
    file at ``path``, atomically (for the test that simulates the sleep)."""
    try:
        with open(path) as f:
            pauses = json.load(f)
    except (OSError, ValueError):
        pauses = []
    pauses.append([time.monotonic() if start_mono is None else start_mono, float(length_s)])
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(pauses, f)
    os.replace(tmp, path)
