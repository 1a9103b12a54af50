"""Agent processes: spawn, identity, bounded stop (SPEC W4, W5, X2, X3, L4, L8).

A process is identified by (pid, ``create_time``), compared with a tolerance because
``create_time`` can shift by a fraction of a second after clock adjustments; a pid reused
by another process does not match. Zombies count as ended.

Stopping covers every process the task started: the process group (the launcher leads
it), descendants seen while it ran, and processes whose environment carries the task's
``RUNSTEAD_OPERATION_ID`` (children that called ``setsid()`` or double-forked). It is a
bounded best effort: SIGTERM, a grace period, then SIGKILL rounds until none is left or
the bound passes; whatever survives is named.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass

import psutil

from machine.protocol import OUTPUT_TAIL_MAX_CHARS

from .clock import SYSTEM_CLOCK, Clock

TAG_ENV = "RUNSTEAD_OPERATION_ID"
START_TIME_TOLERANCE_S = 1.0
KILL_ROUNDS_BOUND_S = 3.0
POLL_S = 0.05
TAIL_LINES = 20
TAIL_CHARS = OUTPUT_TAIL_MAX_CHARS
CAFFEINATE_REAP_S = 2.0  # bound on reaping caffeinate once no agent runs (a real process)
LAUNCHER_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "launcher.py")


@dataclass(frozen=True)
class ProcRef:
    pid: int
    create_time: float

    def as_list(self) -> list:
        return [self.pid, self.create_time]


def identify(pid: int) -> ProcRef | None:
    """The live (non-zombie) process at ``pid`` as a ProcRef, or None."""
    try:
        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE:
            return None
        return ProcRef(pid, p.create_time())
    except (psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError):
        return None


def alive(ref: ProcRef, tolerance_s: float = START_TIME_TOLERANCE_S) -> bool:
    """True when ``ref.pid`` is live AND started at ``ref.create_time`` (within tolerance)."""
    now = identify(ref.pid)
    return now is not None and abs(now.create_time - ref.create_time) <= tolerance_s


def descendants(ref: ProcRef, *, shared: bool = False) -> list[ProcRef]:
    """Live descendants of a verified process (empty if it is gone or not the same).
    ``shared``: from the machine's process tree as read at most ``TREE_MAX_AGE_S`` ago
    by any run of this worker (``_shared_tree``: the runs' L8 snapshots share one scan of
    every process instead of one each); a stop reads it afresh."""
    if not alive(ref):
        return []
    out = []
    try:
        children = _children_of(ref.pid, _shared_tree()) if shared else psutil.Process(ref.pid).children(recursive=True)
        for child in children:
            try:
                if child.status() != psutil.STATUS_ZOMBIE:
                    out.append(ProcRef(child.pid, child.create_time()))
            except psutil.Error:
                continue
    except psutil.Error:
        pass
    return out


TREE_MAX_AGE_S = 1.0  # how stale the shared process tree of the runs' snapshots may be (L8)
_tree_lock = threading.Lock()
_tree: tuple[float, dict[int, list[int]]] = (float("-inf"), {})


def _shared_tree() -> dict[int, list[int]]:
    """``{ppid: [pid, ...]}`` of every process, read at most ``TREE_MAX_AGE_S`` ago
    (monotonic seconds; one ``/proc`` scan serves every run that asks meanwhile)."""
    global _tree
    with _tree_lock:
        at, tree = _tree
        now = SYSTEM_CLOCK.monotonic()
        if now - at > TREE_MAX_AGE_S:
            tree = {}
            for proc in psutil.process_iter(["ppid"]):
                tree.setdefault(proc.info["ppid"], []).append(proc.pid)
            _tree = (now, tree)
        return tree


def _children_of(pid: int, tree: dict[int, list[int]]) -> list[psutil.Process]:
    """The descendants of ``pid`` in ``tree`` (``_shared_tree``), as processes."""
    out, todo = [], list(tree.get(pid, ()))
    while todo:
        child = todo.pop()
        try:
            out.append(psutil.Process(child))
        except psutil.Error:
            continue
        todo += tree.get(child, ())
    return out


def tagged(operation_id: str) -> list[ProcRef]:
    """Live processes whose environment has ``RUNSTEAD_OPERATION_ID=<operation_id>``."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        if p.pid in (me, 0, 1):
            continue
        try:
            if p.environ().get(TAG_ENV) == operation_id and p.status() != psutil.STATUS_ZOMBIE:
                out.append(ProcRef(p.pid, p.create_time()))
        except (psutil.Error, OSError):
            continue
    return out


def group_members(pgid: int, not_before_wall: float | None) -> list[ProcRef]:
    """Live processes in group ``pgid`` created no earlier than ``not_before_wall``
    (minus tolerance), so a recycled group id is never taken for ours."""
    me = os.getpid()
    out = []
    for p in psutil.process_iter():
        if p.pid in (me, 0, 1):
            continue
        try:
            if os.getpgid(p.pid) != pgid or p.status() == psutil.STATUS_ZOMBIE:
                continue
            created = p.create_time()
        except (psutil.Error, OSError):
            continue
        if not_before_wall is not None and created < not_before_wall - START_TIME_TOLERANCE_S:
            continue
        out.append(ProcRef(p.pid, created))
    return out


def _signal(ref: ProcRef, sig: int) -> None:
    if alive(ref):
        try:
            os.kill(ref.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def signal_group(leader: ProcRef | None, pgid: int | None, sig: int) -> bool:
    """``killpg`` only when the leader is verified alive (its group is then ours)."""
    if leader is None or pgid is None or not alive(leader):
        return False
    try:
        os.killpg(pgid, sig)
        return True
    except (ProcessLookupError, PermissionError):
        return False


def describe(ref: ProcRef) -> dict:
    """A survivor as named in the final receipt (L8)."""
    out = {"pid": ref.pid, "process_start_time": ref.create_time}
    try:
        p = psutil.Process(ref.pid)
        out["name"] = p.name()
        out["cmdline"] = " ".join(p.cmdline())[:200]
    except psutil.Error:
        pass
    return out


@dataclass
class Target:
    """Everything known about one task's processes, for ``stop``."""

    operation_id: str
    leader: ProcRef | None = None
    pgid: int | None = None
    spawned_wall: float | None = None
    known: tuple = ()

    def collect(self) -> dict:
        found = {}
        for ref in self.known:
            if alive(ref):
                found[ref.pid] = ref
        if self.leader is not None and alive(self.leader):
            found[self.leader.pid] = self.leader
            # The group is ours only while its verified leader lives: a dead leader's
            # group id may belong to someone else now (members of ours carry the tag).
            if self.pgid is not None and self.spawned_wall is not None:
                for ref in group_members(self.pgid, self.spawned_wall):
                    found.setdefault(ref.pid, ref)
        for ref in tagged(self.operation_id):
            found.setdefault(ref.pid, ref)
        for ref in list(found.values()):
            for child in descendants(ref):
                found.setdefault(child.pid, child)
        return found


def stop(target: Target, *, grace_s: float, bound_s: float = KILL_ROUNDS_BOUND_S, term: bool = True,
         clock: Clock = SYSTEM_CLOCK, on_term=None) -> list[dict]:
    """Bounded best-effort stop (L4, L8): SIGTERM to the group and every found process,
    up to ``grace_s`` for them to go, then SIGKILL rounds for up to ``bound_s`` (seconds of
    ``clock``; it polls every ``POLL_S``).

    Returns the survivors (``describe``), empty when everything is gone.
    """
    found = target.collect()
    if term and grace_s > 0:
        signal_group(target.leader, target.pgid, signal.SIGTERM)
        for ref in found.values():
            _signal(ref, signal.SIGTERM)
        if on_term:
            on_term()
        end = clock.monotonic() + grace_s
        while True:
            if not any(alive(r) for r in found.values()) and not target.collect():
                return []
            if clock.monotonic() >= end:
                break
            clock.wait(None, min(POLL_S, end - clock.monotonic()))
    end = clock.monotonic() + bound_s
    while True:
        signal_group(target.leader, target.pgid, signal.SIGKILL)
        found = {pid: ref for pid, ref in found.items() if alive(ref)}
        for pid, ref in target.collect().items():
            found.setdefault(pid, ref)
        if not found:
            return []
        for ref in found.values():
            _signal(ref, signal.SIGKILL)
        clock.wait(None, POLL_S)
        found = {pid: ref for pid, ref in found.items() if alive(ref)}
        if not found and not target.collect():
            return []
        if clock.monotonic() >= end:
            return [describe(r) for r in found.values()]


def agent_env(base: dict, *, profile_env: dict, operation_id: str, task_id: str, token: str | None) -> dict:
    """The agent's environment: the worker's minus every ``RUNSTEAD_*`` variable and
    anything holding the machine token (W5), plus the profile's, plus the tag (L8)."""
    env = {k: v for k, v in base.items() if not k.startswith("RUNSTEAD_") and (not token or token not in v)}
    env.update(profile_env)
    env[TAG_ENV] = operation_id
    env["RUNSTEAD_TASK_ID"] = task_id
    return env


def spawn(*, argv: list[str], cwd: str, env: dict, op_dir: str, stdin_text: str | None,
          inbox: bool = False) -> tuple[subprocess.Popen, ProcRef]:
    """Start the launcher (and through it the agent) in a new session and process group.
    ``inbox``: the agent reads a live conversation from the launcher's inbox (C3,
    ``launcher.py``) instead of ``stdin_text``.

    stdout and stderr go to ``op_dir/output.log``. No shell (K4). ``PWD`` is set to ``cwd``:
    some agents take their folder from it rather than from the process (opencode 1.18.33
    ran its tools in the worker's own folder), and the worker's own would be wrong.
    """
    env = {**env, "PWD": cwd}
    log = open(os.path.join(op_dir, "output.log"), "ab")
    stdin = subprocess.DEVNULL
    if stdin_text is not None:
        prompt_path = os.path.join(op_dir, "prompt")
        with open(prompt_path, "w") as f:
            f.write(stdin_text)
        stdin = open(prompt_path, "rb")
    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", LAUNCHER_PATH, op_dir, *(["--inbox"] if inbox else []), "--", *argv],
            cwd=cwd, env=env, stdin=stdin, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True, close_fds=True,
        )
    finally:
        log.close()
        if stdin is not subprocess.DEVNULL:
            stdin.close()
    try:
        ref = ProcRef(proc.pid, psutil.Process(proc.pid).create_time())
    except psutil.Error:
        # Gone already: a start time no live process has, so nothing is ever taken for it.
        ref = ProcRef(proc.pid, 0.0)
    return proc, ref


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def output_tail(op_dir: str, lines: int = TAIL_LINES, chars: int = TAIL_CHARS) -> str:
    """The last lines of the agent's output, bounded (L10)."""
    path = os.path.join(op_dir, "output.log")
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - chars * 4))
            data = f.read()
    except OSError:
        return ""
    text = data.decode("utf-8", errors="replace")
    return "\n".join(text.splitlines()[-lines:])[-chars:]


def caffeinate_argv(worker_pid: int) -> list[str]:
    """W7: the macOS idle-sleep assertion held while agents run."""
    return ["caffeinate", "-i", "-w", str(worker_pid)]


class IdleSleepGuard:
    """Holds ``caffeinate -i -w <worker pid>`` while at least one agent runs (W7).

    Only on macOS (``platform == "darwin"``) and when ``enabled``; ``spawn`` is injectable
    so a Linux test can check the command without running caffeinate.
    """

    def __init__(self, *, enabled: bool, platform: str = sys.platform, spawn=None, worker_pid: int | None = None):
        self.enabled = enabled and platform == "darwin"
        self.spawn = spawn or (lambda argv: subprocess.Popen(argv, stdin=subprocess.DEVNULL,
                                                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        self.worker_pid = worker_pid or os.getpid()
        self.count = 0
        self.proc = None
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            self.count += 1
            if self.enabled and self.proc is None:
                try:
                    self.proc = self.spawn(caffeinate_argv(self.worker_pid))
                except OSError:
                    self.proc = None

    def release(self) -> None:
        with self._lock:
            self.count = max(0, self.count - 1)
            if self.count == 0 and self.proc is not None:
                try:
                    self.proc.terminate()
                    self.proc.wait(timeout=CAFFEINATE_REAP_S)
                except Exception:
                    pass
                self.proc = None


class OutputFollower:
    """Reads the complete lines appended to ``op_dir/output.log`` since the last read."""

    def __init__(self, op_dir: str):
        self.path = os.path.join(op_dir, "output.log")
        self.offset = 0
        self.partial = b""

    def read_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        data = self.partial + data
        *lines, self.partial = data.split(b"\n")
        return [line.decode("utf-8", errors="replace") for line in lines]

    def rest(self) -> list[str]:
        """Whatever is left after the agent ended, including an unterminated last line."""
        lines = self.read_lines()
        if self.partial:
            lines.append(self.partial.decode("utf-8", errors="replace"))
            self.partial = b""
        return lines
