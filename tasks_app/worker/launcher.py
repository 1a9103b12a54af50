"""The launcher: a tiny process between the worker and the agent (SPEC X3).

Usage: ``python -I launcher.py OP_DIR -- ARGV...``

The worker spawns this in a new session (so it leads the task's process group); it
starts the agent in the same group, writes ``launcher.json`` (its pid and the agent's),
waits, and writes ``exit.json`` ``{"exit_code", "signal", "exit_wall", "exit_mono",
"agent_pid"[, "spawn_error"]}`` atomically, then exits with the agent's code (128 + signal
for a signal). A restarted worker reads ``exit.json`` to report the real exit status of an
agent that ended while the worker was down.

It survives SIGTERM/SIGINT/SIGHUP sent to the group (they are meant for the agent) so it
can record the outcome; SIGKILL ends it too, and then the worker reports what it knows.
Standard library only: this file runs as a script, outside Django and the package.
"""
import json
import os
import signal
import subprocess
import sys
import time


def _write_atomic(path, data):
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    try:
        dir_fd = os.open(os.path.dirname(path), os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass


def main(argv):
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: launcher.py OP_DIR -- ARGV...\n")
        return 2
    op_dir, command = argv[0], argv[2:]
    # Handlers (not SIG_IGN): the agent gets default dispositions back at exec.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(command, close_fds=True)
    except OSError as exc:
        _write_atomic(
            os.path.join(op_dir, "exit.json"),
            {"exit_code": 127, "signal": None, "exit_wall": time.time(), "exit_mono": time.monotonic(),
             "agent_pid": None, "spawn_error": f"{type(exc).__name__}: {exc}"},
        )
        sys.stderr.write(f"runstead launcher: cannot start agent: {exc}\n")
        return 127
    _write_atomic(os.path.join(op_dir, "launcher.json"), {"launcher_pid": os.getpid(), "agent_pid": child.pid})
    code = child.wait()
    exit_wall, exit_mono = time.time(), time.monotonic()
    facts = {
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "exit_wall": exit_wall,
        "exit_mono": exit_mono,
        "agent_pid": child.pid,
    }
    _write_atomic(os.path.join(op_dir, "exit.json"), facts)
    return code if code >= 0 else 128 + (-code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
