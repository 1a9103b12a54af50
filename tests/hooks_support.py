"""Helpers for the hook tests (SPEC I): fixtures, the hook command as a real subprocess,
stopping the detached senders a test started, and the board socket read per session."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import psutil

from machine.hooks import launch as hook_launch
from tests.live import BoardSocket
from tests.wait import wait_for

BASE_DIR = Path(__file__).resolve().parents[1]
FIXTURES = BASE_DIR / "tests" / "fixtures" / "hooks"


def fixture(agent: str, name: str, **overrides) -> dict:
    """A recorded payload with keys replaced (``session_id``, ``cwd``, ... ; for Codex
    notify and opencode the ids live under other keys, pass them as given)."""
    data = json.loads((FIXTURES / agent / f"{name}.json").read_text())
    data.update(overrides)
    return data


def hook_env(state_dir: Path, **extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("DJANGO", "RUNSTEAD_"))}
    env.update({"RUNSTEAD_HOOK_DIR": str(state_dir), "PYTHONPATH": str(BASE_DIR)})
    env.update({k: str(v) for k, v in extra.items()})
    return env


def run_hook(agent: str, payload, state_dir: Path, *, argv_payload: bool = False, stdin: bytes | None = None,
             env: dict | None = None, cwd: Path | None = None, argv: list[str] = ()) -> subprocess.CompletedProcess:
    """``python -m machine.hooks AGENT [ARGV...]`` as the CLI runs it: the payload on
    stdin (or, ``argv_payload``, as the last argument like Codex ``notify``)."""
    argv = [sys.executable, "-m", "machine.hooks", agent, *argv]
    data = stdin
    if argv_payload:
        argv.append(json.dumps(payload))
        data = b""
    elif data is None:
        data = json.dumps(payload).encode()
    return subprocess.run(
        argv, input=data, capture_output=True, timeout=30, env=env or hook_env(state_dir), cwd=cwd or "/",
    )


def start_hook(agent: str, payload, state_dir: Path, *, env: dict | None = None) -> subprocess.Popen:
    """The hook command started (not waited for), the payload on its stdin (closed):
    for a hook that waits, like Claude Code's ``PermissionRequest`` (Q3). Read it with
    ``finish_hook``."""
    proc = subprocess.Popen([sys.executable, "-m", "machine.hooks", agent], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env or hook_env(state_dir), cwd="/")
    proc.stdin.write(json.dumps(payload).encode())
    proc.stdin.close()
    proc.stdin = None  # communicate() must not flush it
    return proc


def finish_hook(proc: subprocess.Popen, timeout: float = 30.0) -> tuple[int, bytes, bytes]:
    """``(exit status, stdout, stderr)`` of a hook started by ``start_hook`` once it exits
    (killed and failed after ``timeout`` s)."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"the hook still ran after {timeout} s: {out!r} {err!r}") from None
    return proc.returncode, out, err


def stop_sender(state_dir: Path, timeout_s: float = 5.0) -> None:
    """Stops the sender running for ``state_dir`` (by the pid in its lock file), if any."""
    def stopped() -> bool:  # gone, or asked (again) to stop
        pid = hook_launch.sender_pid(Path(state_dir))
        if pid is None:
            return True
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        return False

    wait_for(stopped, timeout_s=timeout_s, what=f"the sender for {state_dir} to stop")
    # A sender a hook launched just before this call may not hold the lock yet: found by
    # its command line instead (left alone, it retries an undeliverable write for minutes
    # after the test, as two did in a CI run).
    for process in psutil.process_iter(["cmdline"]):
        cmdline = process.info["cmdline"] or []
        if "machine.hooks.sender" in cmdline and str(state_dir) in cmdline:
            try:
                process.kill()
            except psutil.NoSuchProcess:
                pass


def wrapper_state(state_dir: Path) -> str:
    """What the terminal wrapper and the hooks under ``state_dir`` left to read when a
    terminal test fails (T3): each wrapper's ``state.json``, the inbox's files by state,
    and the tails of the hooks' and the wrapper's logs."""
    state_dir = Path(state_dir)
    parts = []
    for path in sorted((state_dir / "terminals").glob("*/state.json")):
        parts.append(f"{path.relative_to(state_dir)}: {path.read_text(errors='replace')}")
    root = state_dir / "inbox"
    if root.is_dir():
        parts.append("inbox: " + ", ".join(str(p.relative_to(root)) for p in sorted(root.rglob("*")) if p.is_file()))
    for name in ("hook.log", "terminal.log"):
        path = state_dir / name
        if path.exists():
            parts.append(f"--- {name} ---\n" + path.read_text(errors="replace")[-3000:])
    return "\n".join(parts) or f"nothing under {state_dir}"


class Board(BoardSocket):
    """The owner's board socket, read per session."""

    def of(self, session_id) -> list[tuple]:
        """The session's marker events as ``("marker", state, turn_id)`` and its status
        changes as ``("status", status)``, in arrival order. A ``session.status`` event
        that repeats the status (a title or attention change, I6) is not a change."""
        out = []
        status = None
        for e in list(self.events):
            if e.get("session_id") != str(session_id):
                continue
            if e["type"] == "marker":
                out.append(("marker", e["state"], e["turn_id"]))
            elif e["type"] == "session.status" and e["status"] != status:
                status = e["status"]
                out.append(("status", e["status"]))
        return out

    def wait_for(self, session_id, last, timeout=20.0, since: int = 0) -> list[tuple]:
        """The session's sequence once it has more than ``since`` entries and ends with
        ``last`` (``since``: the length already seen, so an earlier ``last`` does not count)."""
        return wait_for(lambda: self.of(session_id), until=lambda seq: len(seq) > since and seq[-1] == last,
                        timeout_s=timeout, what=f"{last} last on the board for session {session_id}")
