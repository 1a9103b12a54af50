"""A headless run that asks its owner (SPEC Q5, W5).

A profile with ``approvals = "ask"`` (``preset = "claude"``) runs its task with Claude
Code's ``PermissionRequest`` hook added for that run only, through the CLI's own per-run
setting (``--settings '<json>'``, right after the executable), never by writing the
user's configuration (a profile's own ``argv`` needs the element ``{binary}``). The hook is
``python -m machine.hooks claude --task`` on this checkout; inside a task it asks
through the task's approval credential (``machine/hooks/task_approval.py``), and an
entry of the owner's own configuration prints nothing there.

The credential comes with the lease (``approval_credential`` in the grant request, Q5),
goes into the agent's environment only (never into argv, which other local users can
read, nor into the worker's database or log), beside the service URL and the run's hook
folder. The machine token never does (W5: ``process.agent_env``).

A profile of the opencode preset with ``approvals = "ask"`` asks in its live conversation
only (``Preset.live_asks``): no ``--settings``; the same environment goes to the bridge
(``machine/opencode_bridge.py``), which answers opencode's ``permission.asked`` through
``task_approval.decide`` and keeps the credential out of the server's environment.
"""
from __future__ import annotations

import json
import math
import os
import shlex
import sys

from machine.protocol import hook_python

APPROVALS = ("off", "ask")
PROJECT_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.realpath(__file__))))
HOOK_TIMEOUT_MARGIN_S = 30  # the hook's timeout is this much above the service's approval_wait_s (Q3)
HOOK_DIR = "approvals"  # in the operation directory: the hook's per-turn request counts

# The names machine.hooks.task_approval reads (W5: no owner or machine token among them).
CREDENTIAL_ENV = "RUNSTEAD_TASK_CREDENTIAL"
SERVER_ENV = "RUNSTEAD_TASK_SERVER"
HOOK_DIR_ENV = "RUNSTEAD_TASK_HOOK_DIR"
HOOK_WAIT_ENV = "RUNSTEAD_HOOK_APPROVAL_WAIT_S"  # the hook's own longest wait
HOOK_WAIT_MARGIN_S = 5  # ... this much above approval_wait_s: the service's expiry is what the hook sees


def hook_command() -> str:
    """The hook's command line (a shell string, as Claude Code runs hook commands): this
    interpreter, this checkout on ``PYTHONPATH``, ``--task``: inside a task only this
    entry asks; an entry ``install_hooks`` wrote in the owner's configuration (for
    interactive sessions) prints nothing there."""
    return shlex.join(["/usr/bin/env", f"PYTHONPATH={PROJECT_ROOT}", *hook_python(sys.executable, PROJECT_ROOT),
                       "claude", "--task"])


def claude_settings(*, wait_s: float) -> str:
    """The ``--settings`` JSON of a run that asks (Q5): a ``PermissionRequest`` hook for
    every tool, its ``timeout`` (seconds) above ``wait_s``, the service's
    ``approval_wait_s``, so the approval expires before the CLI gives up on the hook."""
    timeout = math.ceil(wait_s) + HOOK_TIMEOUT_MARGIN_S
    hook = {"type": "command", "command": hook_command(), "timeout": timeout}
    return json.dumps({"hooks": {"PermissionRequest": [{"matcher": "*", "hooks": [hook]}]}}, separators=(",", ":"))


def settings_args(*, wait_s: float) -> tuple[str, str]:
    """The arguments that go right after the executable (``Profile.command``'s
    ``after_binary``): ``--settings <json>``."""
    return ("--settings", claude_settings(wait_s=wait_s))


def asking_env(*, credential: str, server: str, op_dir: str, wait_s: float) -> dict:
    """What the agent's environment gains for a run that asks (module docstring); the
    hook waits at most ``wait_s`` (the service's ``approval_wait_s``) plus a margin. The
    hook folder is made here, mode 0700."""
    hook_dir = os.path.join(op_dir, HOOK_DIR)
    os.makedirs(hook_dir, mode=0o700, exist_ok=True)
    return {CREDENTIAL_ENV: credential, SERVER_ENV: server, HOOK_DIR_ENV: hook_dir,
            HOOK_WAIT_ENV: f"{wait_s + HOOK_WAIT_MARGIN_S:g}"}
