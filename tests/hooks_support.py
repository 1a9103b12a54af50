"""Helpers for the hook tests (SPEC I): fixtures, the hook command as a real subprocess,
and stopping the detached senders a test started."""
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from sessions_app.hooks import sender as hook_sender
from tests.worker_harness import wait_for

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
             env: dict | None = None, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m sessions_app.hooks AGENT`` as the CLI runs it: the payload on stdin
    (or, ``argv_payload``, as the last argument like Codex ``notify``)."""
    argv = [sys.executable, "-m", "sessions_app.hooks", agent]
    data = stdin
    if argv_payload:
        argv.append(json.dumps(payload))
        data = b""
    elif data is None:
        data = json.dumps(payload).encode()
    return subprocess.run(
        argv, input=data, capture_output=True, timeout=30, env=env or hook_env(state_dir), cwd=cwd or "/",
    )


def stop_sender(state_dir: Path, timeout_s: float = 5.0) -> None:
    """Stops the sender running for ``state_dir`` (by the pid in its lock file), if any."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pid = hook_sender.sender_pid(Path(state_dir))
        if pid is None:
            return
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        time.sleep(0.05)
    raise AssertionError(f"sender for {state_dir} did not stop")


def wait_until(predicate, timeout: float = 20.0, step: float = 0.02):
    """``predicate()``'s first truthy value, polled every ``step`` s for ``timeout`` s."""
    return wait_for(predicate, timeout=timeout, interval=step)
