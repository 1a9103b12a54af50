"""The real Gemini CLI interactive in a tmux window (SPEC I4, I6; tests/tmux.py), offline
against the fake Gemini API (tests/agent_clis.py ``offline("gemini", ...)``).

Observed with Gemini CLI 0.61.0: without ``--yolo`` a shell call shows an approval dialog
("Allow execution of [Shell]?", "1. Allow once" selected: Return allows it) and fires the
``Notification`` hook (``ToolPermission``); ``BeforeTool`` fires before the dialog, not
after the answer. A Return that comes within 30 ms of other keys (its
``FAST_RETURN_TIMEOUT``) is read as a newline typed into the prompt, so ``submit`` waits
until the typed text shows before pressing it.
"""
from __future__ import annotations

import time
from pathlib import Path

from tests.agent_clis import Offline, cli_bin
from tests.tmux import Terminal
from tests.wait import wait_for

READY = "Type your message"  # the prompt's placeholder: the CLI takes input
DIALOG = "Allow execution of"
AFTER_TYPING_S = 0.3  # well past the 30 ms in which a Return would be a typed newline


def gemini_terminal(setup: Offline, *, home: Path, work: Path, socket: Path, args: tuple[str, ...] = ()) -> Terminal:
    """``gemini`` (interactive, the offline ``-m``, then ``args``) in a tmux window in
    ``work`` with only the offline environment (HOME ``home``, trusted folder)."""
    env = {k: v for k, v in setup.process_env({"GEMINI_CLI_TRUST_WORKSPACE": "true"}).items()
           if k in ("PATH", "LANG", "LC_ALL") or k.startswith(("GEMINI_", "GOOGLE_"))}
    env.update({"HOME": str(home), "XDG_CONFIG_HOME": str(home / ".config"), "TERM": "xterm-256color"})
    return Terminal(socket, [cli_bin("gemini"), *setup.extra_args, *args], env=env, cwd=work)


def submit(term: Terminal, text: str, timeout: float = 60.0) -> None:
    """Types ``text`` into the prompt, waits until it shows, then presses Return."""
    term.type(text)
    term.wait_for(text, timeout=timeout)
    time.sleep(AFTER_TYPING_S)
    term.key("Enter")


def wait_closed(term: Terminal, timeout: float = 60.0) -> None:
    """Until the CLI has exited (its tmux session is gone)."""
    wait_for(term.screen, until=lambda screen: screen.startswith("<no screen"), timeout_s=timeout, interval_s=0.1,
             what="the CLI to exit")
