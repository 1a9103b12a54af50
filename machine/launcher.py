"""The launcher: a tiny process between the worker and the agent (SPEC X3).

Usage: ``python -I launcher.py OP_DIR [--inbox] -- ARGV...``

The worker spawns this in a new session (so it leads the task's process group); it
starts the agent in the same group, writes ``launcher.json`` (its pid and the agent's),
waits, and writes ``exit.json`` ``{"exit_code", "signal", "exit_wall", "exit_mono",
"agent_pid"[, "spawn_error"]}`` atomically, then exits with the agent's code (128 + signal
for a signal). A restarted worker reads ``exit.json`` to report the real exit status of an
agent that ended while the worker was down.

It survives SIGTERM/SIGINT/SIGHUP sent to the group (they are meant for the agent) so it
can record the outcome; SIGKILL ends it too, and then the worker reports what it knows.
With ``--inbox`` (a live conversation, SPEC C3) the agent's stdin is a pipe the launcher
holds, so it outlives a worker crash: the launcher writes the files
``op_dir/inbox/<n:010d>.json`` in order n = 0, 1, ... (``{"line": TEXT}``: TEXT and a
newline to the agent's stdin; ``{"close": true}``: close it), each exactly once, and
appends ``n`` to ``op_dir/written.log`` (fsynced) after each. The worker records a file's
number before it writes the file, and rewrites a recorded file it finds missing: the
launcher skips nothing and never takes a number twice, so a line reaches the agent at most
once whatever the worker's crashes. Files are looked for every ``RUNSTEAD_INBOX_POLL_S``
seconds (0.02).

Runs as a script (``python -I``, by its path: no environment, no current folder on the
import path), outside Django; it puts the checkout root at the END of ``sys.path`` itself
to load ``machine.files`` and ``machine.settings`` (standard library only): the standard
library still wins any name, and neither the agent's environment nor its folder can put a
module in (``machine`` comes from the checkout, as for the worker that started it).
"""
import json
import os
import signal
import subprocess
import sys
import threading
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine.files import write_atomic  # noqa: E402
from machine.settings import env_float  # noqa: E402

INBOX_POLL_S = env_float("RUNSTEAD_INBOX_POLL_S", 0.02, minimum=0)


def _write_json(path, data):
    """``data`` as the JSON file ``path`` (mode 0600), atomic and durable."""
    write_atomic(path, json.dumps(data))


def _feed(op_dir, child):
    """The inbox, in order, to ``child.stdin`` (module docstring); ends with the agent."""
    inbox = os.path.join(op_dir, "inbox")
    written = os.open(os.path.join(op_dir, "written.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    n = 0
    try:
        while child.poll() is None:
            try:
                with open(os.path.join(inbox, f"{n:010d}.json")) as f:
                    item = json.load(f)
            except (FileNotFoundError, ValueError):
                time.sleep(INBOX_POLL_S)
                continue
            try:
                if item.get("close"):
                    child.stdin.close()
                else:
                    child.stdin.write((item["line"] + "\n").encode())
                    child.stdin.flush()
            except (OSError, ValueError):
                return  # the agent closed its input or is gone
            os.write(written, f"{n}\n".encode())
            os.fsync(written)
            n += 1
            if item.get("close"):
                return
    finally:
        os.close(written)


def main(argv):
    inbox = len(argv) > 1 and argv[1] == "--inbox"
    if inbox:
        argv = argv[:1] + argv[2:]
    if len(argv) < 3 or argv[1] != "--":
        sys.stderr.write("usage: launcher.py OP_DIR [--inbox] -- ARGV...\n")
        return 2
    op_dir, command = argv[0], argv[2:]
    # Handlers (not SIG_IGN): the agent gets default dispositions back at exec.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, lambda *_: None)
    try:
        child = subprocess.Popen(command, close_fds=True, stdin=subprocess.PIPE if inbox else None)
    except OSError as exc:
        _write_json(
            os.path.join(op_dir, "exit.json"),
            {"exit_code": 127, "signal": None, "exit_wall": time.time(), "exit_mono": time.monotonic(),
             "agent_pid": None, "spawn_error": f"{type(exc).__name__}: {exc}"},
        )
        sys.stderr.write(f"runstead launcher: cannot start agent: {exc}\n")
        return 127
    _write_json(os.path.join(op_dir, "launcher.json"), {"launcher_pid": os.getpid(), "agent_pid": child.pid})
    if inbox:
        threading.Thread(target=_feed, args=(op_dir, child), daemon=True).start()
    code = child.wait()
    exit_wall, exit_mono = time.time(), time.monotonic()
    facts = {
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "exit_wall": exit_wall,
        "exit_mono": exit_mono,
        "agent_pid": child.pid,
    }
    _write_json(os.path.join(op_dir, "exit.json"), facts)
    return code if code >= 0 else 128 + (-code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
