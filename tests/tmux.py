"""A real terminal for interactive agent CLIs in tests (SPEC Q8): one tmux server per
test on its own socket, one window running the program, its screen read as text.

``.ci/run`` installs tmux (Debian package); without it a test is skipped locally and
fails under ``CI=true`` (``tests.agent_clis.missing``).

Usage::

    with Terminal(tmp_path / "tmux.sock", argv, env=env, cwd=work) as term:
        term.wait_for("manual mode on")
        term.type("hello")
        term.key("Enter")
"""
from __future__ import annotations

import shlex
import shutil
import subprocess
from pathlib import Path

from tests.agent_clis import missing
from tests.wait import wait_for


def tmux_bin() -> str:
    """The ``tmux`` binary (skips the test locally, fails it under ``CI=true``)."""
    found = shutil.which("tmux")
    if not found:
        missing("tmux is not installed")
    return found


class Terminal:
    """``argv`` running in a detached tmux session of ``width`` x ``height`` cells, with
    exactly ``env`` (``env -i``) in ``cwd``; its own server on ``socket``."""

    def __init__(self, socket: Path, argv: list[str], *, env: dict, cwd: Path, width: int = 160, height: int = 50):
        self.tmux = tmux_bin()
        self.socket = str(socket)
        command = shlex.join(["env", "-i", *(f"{k}={v}" for k, v in env.items()), *argv])
        self._run("new-session", "-d", "-s", "main", "-x", str(width), "-y", str(height), "-c", str(cwd), command)

    def _run(self, *args: str) -> str:
        result = subprocess.run([self.tmux, "-S", self.socket, *args], capture_output=True, text=True, timeout=20)
        if result.returncode != 0:
            raise RuntimeError(f"tmux {' '.join(args[:2])}: {result.stderr.strip()}")
        return result.stdout

    def screen(self) -> str:
        """What the window shows now (plain text, trailing blank lines dropped)."""
        try:
            return self._run("capture-pane", "-p", "-t", "main").rstrip()
        except RuntimeError as error:  # the program exited and the session with it
            return f"<no screen: {error}>"

    def wait_for(self, text: str, timeout: float = 60.0, detail=None) -> str:
        """The screen once it shows ``text``; fails with the last screen after ``timeout`` s
        (and ``detail()``'s text, as ``tests.wait.wait_for``)."""
        return wait_for(self.screen, until=lambda screen: text in screen, timeout_s=timeout, interval_s=0.1,
                        what=f"{text!r} on the screen", detail=detail)

    def type(self, text: str) -> None:
        """Types ``text`` literally (no key names)."""
        self._run("send-keys", "-t", "main", "-l", text)

    def submit(self, text: str, accepted, attempts: int = 3, settle_s: float = 5.0) -> None:
        """Types ``text``, waits until the screen shows it, then presses Enter until
        ``accepted()`` holds (a TUI can take an Enter that follows typed text at once for
        part of a paste and keep the text in its composer: Codex 0.169.0 does)."""
        self.type(text)
        self.wait_for(text[-30:])
        self.press("Enter", accepted, attempts=attempts, settle_s=settle_s)

    def press(self, name: str, accepted, attempts: int = 3, settle_s: float = 5.0) -> None:
        """Presses key ``name`` until ``accepted()`` holds, at most ``attempts`` times,
        ``settle_s`` apart (Claude Code's permission dialog ignores keys for a moment
        after it opens, against answering it by accident)."""
        for _ in range(attempts):
            self.key(name)
            try:
                wait_for(accepted, timeout_s=settle_s, interval_s=0.1, what=f"{name} to be taken")
                return
            except AssertionError:
                pass  # not taken yet: press again
        raise AssertionError(f"{name} was not taken after {attempts} presses:\n{self.screen()}")

    def key(self, name: str) -> None:
        """Presses one key by tmux's name (``Enter``, ``Escape``, ``C-c``)."""
        self._run("send-keys", "-t", "main", name)

    def close(self) -> None:
        """Ends the server and every program in it."""
        try:
            self._run("kill-server")
        except (RuntimeError, subprocess.TimeoutExpired):
            pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
