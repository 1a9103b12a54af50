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
once whatever the worker's crashes. The worker rings ``op_dir/inbox.bell`` (a FIFO,
``machine.files.bell_ring``) after each file, and once more when it adopts the run after
a restart (a crash between a file and its ring); the launcher waits on that bell, and
looks for the next file by itself at least every ``RUNSTEAD_INBOX_POLL_S`` seconds (30.0):
a ring is a wake-up, never the only way a file is found, and a conversation that waits
costs no polling (issue 43). Before them, ``op_dir/opening`` (when the worker wrote one before the
spawn: a CLI's handshake, e.g. Codex app-server's ``initialize`` and ``thread/start``,
``machine/worker/live_agents.py``) is written to the agent's stdin as it is, once.

The lease (SPEC L3, L4, L8): the worker writes each grant's and renewal's deadline to
``op_dir/lease.json`` (``{sent_mono, sent_wall, duration_s, margin_s, kill_grace_s}``,
``renewer.LeasePart.record_deadline``). A worker that lives enforces it itself, from
``deadline - kill_grace_s`` on; one that died leaves nobody to, and a live conversation's
agent waits on its stdin forever. So with ``--inbox`` the launcher watches the file too
(a one-shot task's agent ends by itself, and a restarted worker stops a leftover, X3) (when
the deadline is due, and every ``LEASE_LOOK_S`` at most) and once the recorded deadline has
passed with no newer one, computed as the worker does (``duration_s - margin_s -
max(monotonic elapsed, wall elapsed)`` since the send times: the same machine's clocks, so
a sleep never extends it, L7), it ends the agent: its input closed (with ``--inbox``), then
``kill_grace_s`` later SIGTERM to the group (the launcher's handler ignores it), then
``kill_grace_s`` later SIGKILL to the agent; ``exit.json`` then says ``"lease_stop": true``,
and the group's stragglers get SIGKILL last (the launcher with them). A worker that comes
back before the deadline adopts the agent as before (X3) and its renewals move the
deadline on. No ``lease.json``: nothing enforced (a worker on a test's fake clock).

Runs as a script (``python -I``, by its path: no environment, no current folder on the
import path), outside Django; it puts the checkout root at the END of ``sys.path`` itself
to load ``machine.files`` and ``machine.settings`` (standard library only): the standard
library still wins any name, and neither the agent's environment nor its folder can put a
module in (``machine`` comes from the checkout, as for the worker that started it).
"""
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from machine import simulated_sleep  # noqa: E402  (test only: time.monotonic unless a test simulates a sleep)
from machine.files import bell_drain, bell_open, write_atomic  # noqa: E402
from machine.settings import env_float  # noqa: E402

INBOX_POLL_S = env_float("RUNSTEAD_INBOX_POLL_S", 30.0, minimum=0)
BELL = "inbox.bell"  # the FIFO the worker rings after each inbox file (module docstring)
LEASE_CHECK_S = 0.5  # how often the lease watch looks for a lease.json not written yet
# With a deadline recorded, the watch sleeps until it is due, reading lease.json again at
# least this often (a renewal moves the deadline; a wall-clock jump, the machine asleep,
# counts within this): 100 open conversations do not wake their launchers 200 times a second.
LEASE_LOOK_S = 5.0


class Feed:
    """The agent's stdin, shared by the inbox feeder and the lease watch: ``closed``
    under ``lock``, after which nothing is written."""

    def __init__(self, child):
        self.child, self.lock, self.closed = child, threading.Lock(), False

    def close(self):
        with self.lock:
            if not self.closed:
                self.closed = True
                try:
                    self.child.stdin.close()
                except (OSError, ValueError):
                    pass


def _write_json(path, data):
    """``data`` as the JSON file ``path`` (mode 0600), atomic and durable."""
    write_atomic(path, json.dumps(data))


def _feed(op_dir, feed):
    """The inbox, in order, to the agent's stdin (module docstring); ends with the agent."""
    child = feed.child
    inbox = os.path.join(op_dir, "inbox")
    try:
        with open(os.path.join(op_dir, "opening"), "rb") as f:
            opening = f.read()
    except FileNotFoundError:
        opening = b""
    if opening:
        try:
            child.stdin.write(opening)
            child.stdin.flush()
        except (OSError, ValueError):
            return  # the agent closed its input or is gone
    written = os.open(os.path.join(op_dir, "written.log"), os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    bell = bell_open(os.path.join(op_dir, BELL))
    n = 0
    try:
        while child.poll() is None:
            bell_drain(bell)  # rings before this look are answered by it
            try:
                with open(os.path.join(inbox, f"{n:010d}.json")) as f:
                    item = json.load(f)
            except (FileNotFoundError, ValueError):
                select.select([bell], [], [], INBOX_POLL_S)
                continue
            with feed.lock:
                if feed.closed:
                    return  # the lease watch closed it (module docstring)
                try:
                    if item.get("close"):
                        feed.closed = True
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
        os.close(bell)


def _lease_left(op_dir):
    """``(seconds left, kill_grace_s)`` of the deadline in ``lease.json``, or None."""
    try:
        with open(os.path.join(op_dir, "lease.json")) as f:
            lease = json.load(f)
        elapsed = max(simulated_sleep.monotonic() - float(lease["sent_mono"]), time.time() - float(lease["sent_wall"]))
        return float(lease["duration_s"]) - float(lease["margin_s"]) - elapsed, float(lease["kill_grace_s"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _watch_lease(op_dir, child, feed, ended, stopped):
    """End the agent once the recorded lease deadline has passed (module docstring);
    ``ended`` is set by ``main`` when the agent is gone (a real blocking wait, no polling);
    ``stopped`` is set here when the lease ended it."""
    while not ended.is_set():
        got = _lease_left(op_dir)
        if got is None or got[0] > 0:
            ended.wait(LEASE_CHECK_S if got is None else min(LEASE_LOOK_S, got[0]))
            continue
        grace = got[1]
        stopped.set()
        sys.stderr.write("runstead launcher: the lease deadline passed with no renewal: ending the agent\n")
        if feed is not None:
            feed.close()
        for step in (lambda: os.killpg(os.getpgid(0), signal.SIGTERM), child.kill):
            if ended.wait(grace):
                return
            try:
                step()
            except OSError:
                pass
        return


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
            {"exit_code": 127, "signal": None, "exit_wall": time.time(), "exit_mono": simulated_sleep.monotonic(),
             "agent_pid": None, "spawn_error": f"{type(exc).__name__}: {exc}"},
        )
        sys.stderr.write(f"runstead launcher: cannot start agent: {exc}\n")
        return 127
    _write_json(os.path.join(op_dir, "launcher.json"), {"launcher_pid": os.getpid(), "agent_pid": child.pid})
    feed = Feed(child) if inbox else None
    if inbox:
        threading.Thread(target=_feed, args=(op_dir, feed), daemon=True).start()
    ended, lease_stop = threading.Event(), threading.Event()
    if inbox:
        threading.Thread(target=_watch_lease, args=(op_dir, child, feed, ended, lease_stop), daemon=True).start()
    code = child.wait()
    ended.set()
    exit_wall, exit_mono = time.time(), simulated_sleep.monotonic()
    facts = {
        "exit_code": code if code >= 0 else None,
        "signal": -code if code < 0 else None,
        "exit_wall": exit_wall,
        "exit_mono": exit_mono,
        "agent_pid": child.pid,
    }
    if lease_stop.is_set():
        facts["lease_stop"] = True
    _write_json(os.path.join(op_dir, "exit.json"), facts)
    if lease_stop.is_set():
        os.killpg(os.getpgid(0), signal.SIGKILL)  # L8: what is left of the group, the launcher last
    return code if code >= 0 else 128 + (-code)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
