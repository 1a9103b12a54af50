"""Starting the detached sender when none runs (SPEC I1, R4): what a hook that queued a
write needs, kept apart from ``sender`` so that the hook imports only ``fcntl`` and
``os`` for it (``sender`` brings ``argparse``, ``datetime`` and the retry schedule, a few
milliseconds of every such hook).

One sender per state directory: it holds ``flock(LOCK_EX)`` on ``sender.lock``, which
holds its pid.
"""
import os
import sys

from machine.hooks import store

PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def try_lock(state_dir: store.StateDir) -> int | None:
    """An open ``sender.lock`` descriptor holding ``flock(LOCK_EX)``, or None when another
    process holds it."""
    return store.try_lock(os.path.join(state_dir, store.LOCK_NAME))


def sender_running(state_dir: store.StateDir) -> bool:
    fd = try_lock(state_dir)
    if fd is None:
        return True
    os.close(fd)
    return False


def sender_pid(state_dir: store.StateDir) -> int | None:
    """The pid the running sender wrote into its lock file (None when none runs)."""
    if not sender_running(state_dir):
        return None
    try:
        with open(os.path.join(state_dir, store.LOCK_NAME)) as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None


def ensure_sender(state_dir: store.StateDir) -> bool:
    """Starts a detached sender (``python -m machine.hooks.sender``, site packages
    on: it sends with httpx) for ``state_dir`` unless one runs: its own session, stdio
    on /dev/null and its log file, so the agent CLI never waits for it. Returns whether
    it started one. Two hooks racing may both start one; the lock lets one of them work."""
    if sender_running(state_dir):
        return False
    argv = [sys.executable, "-m", "machine.hooks.sender", "--state-dir", os.fspath(state_dir)]
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (PROJECT_ROOT, env.get("PYTHONPATH", "")) if p)
    log = os.path.join(state_dir, store.SENDER_LOG)
    actions = [
        (os.POSIX_SPAWN_OPEN, 0, os.devnull, os.O_RDONLY, 0),
        (os.POSIX_SPAWN_OPEN, 1, os.devnull, os.O_WRONLY, 0),
        (os.POSIX_SPAWN_OPEN, 2, log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600),
    ]
    try:
        os.posix_spawn(sys.executable, argv, env, file_actions=actions, setsid=True)
    except (NotImplementedError, TypeError):  # a platform without setsid in posix_spawn
        import subprocess

        with open(log, "ab") as err:
            subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=err,
                             start_new_session=True, close_fds=True)
    return True
