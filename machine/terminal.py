"""The terminal wrapper (SPEC T3, T5): ``python -m machine.terminal AGENT [ARGS...]``
(installed as ``runstead-term``).

It runs the agent CLI's terminal UI in a pseudo-terminal it owns (``ptyprocess``) and
passes everything through unchanged: the person's terminal is put in raw mode, so every
key (Ctrl-C included) reaches the CLI as the byte it is; output goes back as it comes
(colours and all); the window size is copied at start and on every SIGWINCH; the
wrapper exits with the CLI's exit status (128 + N for a signal).

It also hands the owner's messages to the session (T3). The CLI's hooks, which see
``RUNSTEAD_TERMINAL`` (this wrapper's folder) in their environment, write there which
session runs and whether a turn is open (``machine.hooks.entry.terminal_state``); the
machine's worker records each message for that session in the local inbox
(``machine.inbox``). A message is typed only when no turn is open and the keyboard has
been quiet for ``RUNSTEAD_TERMINAL_QUIET_S`` (default 3 s) with nothing typed since the
last Enter (the person's half-typed line is never mixed with a message; the terminal's
own answers to the CLI's queries are not typing, ``typing``): taken from the
inbox (a rename: at most once), written as one bracketed paste, then Enter, then marked
done and reported ``delivered`` through the hooks' outbox. Anything the person types
during those few milliseconds is held and passed on after the Enter. The text holds no
control character but newline and tab (the service refuses them, T2, and they are
dropped here again), so nothing in it can end the paste or act as a key. A message this
wrapper took but may not have typed (it was killed in between) is reported
``undelivered`` by the next wrapper of that session, never typed again. An interrupt
(T5) sends the CLI's interrupt key (Esc for Claude Code and Codex, Ctrl-C otherwise).

Codex 0.169's terminal UI runs its turns in a background app-server shared by every
Codex terminal of the user (started by the first, outliving it; observed offline): its
hooks would not run in this wrapper's environment, so ``codex`` gets ``--no-daemon``
(unless the person asked for ``--no-daemon`` or ``--remote``).

An interrupted turn fires no hook (observed with Claude Code 2.1.328: Esc during a Bash
call, no ``Stop``, no ``PostToolUseFailure``), so the hooks' state would say "busy"
until the next prompt. The wrapper therefore counts a turn as over once it sent the
interrupt key, or the person pressed it alone, and the CLI's output has then been
still for ``INTERRUPT_SETTLE_S`` (a working CLI animates its spinner), as long as no hook
wrote the state since (a hook that did has the last word); it then runs the hook itself
with RunStead's own ``RunsteadInterrupted`` event, which ends the turn on the service too.
"""
from __future__ import annotations

import os
import re
import select
import signal
import sys
import time

from machine import inbox
from machine.settings import env_float

QUIET_S = 3.0  # T3: RUNSTEAD_TERMINAL_QUIET_S's default
TICK_S = 0.1
ENTER_DELAY_S = 0.15  # between the end of the paste and Enter: a TUI reads a paste as one input first
INTERRUPT_SETTLE_S = 1.0  # after an interrupt key: output still this long -> the turn is over
PASTE_START, PASTE_END = b"\x1b[200~", b"\x1b[201~"
INTERRUPT_KEYS = {"claude": b"\x1b", "codex": b"\x1b"}
TERMINAL_ENV = "RUNSTEAD_TERMINAL"
# Keys after which the person's input line is empty again (Enter, Ctrl-C, Ctrl-U).
LINE_CLEARED = (b"\r", b"\n", b"\x03", b"\x15")
# An escape sequence in the input: CSI (with its parameters), OSC and DCS strings (to BEL
# or ST), SS3, or ESC and one character.
ESCAPE = re.compile(rb"\x1b(?:\[[0-?]*[ -/]*[@-~]|\][^\x07\x1b]*(?:\x07|\x1b\\)?|P[^\x1b]*(?:\x1b\\)?|O.|.)?", re.S)
# The terminal's own answers to the CLI's queries (device attributes, cursor position,
# status, keyboard protocol, modes, colours) and focus events: not the person typing.
REPLY = re.compile(rb"\x1b(?:\[[?>=]?[0-9;:$]*[cRnyu]|\[\?[0-9;]*\$y|\[[IO]|\].*|P.*)\Z", re.S)
# Keys that fill the input line with something (history up and down).
FILLS_LINE = (b"\x1b[A", b"\x1b[B", b"\x1bOA", b"\x1bOB")


def typing(data: bytes) -> tuple[bool, bool | None]:
    """What ``data`` read from the person's terminal says about the person: ``(a key was
    pressed, the input line is dirty after it)``, None when the keys leave the line as it
    was. The terminal's answers to the CLI's queries (sent at start-up and on focus) are
    neither: Claude Code asks several, and they must not hold a message back."""
    pressed, dirty, at = False, None, 0
    for match in [*ESCAPE.finditer(data), None]:
        for byte in data[at:match.start() if match else len(data)]:
            key = bytes([byte])
            pressed = True
            if key in LINE_CLEARED:
                dirty = False
            elif byte >= 0x20 or key == b"\t":
                dirty = True
        if match is None:
            break
        at = match.end()
        sequence = match.group()
        if REPLY.match(sequence):
            continue
        pressed = True
        if sequence in FILLS_LINE or sequence == PASTE_START:
            dirty = True
    return pressed, dirty


def inert(text: str) -> str:
    """``text`` with every control character but newline and tab removed (C0, DEL, C1):
    nothing in it can act as a key or end the bracketed paste."""
    return "".join(c for c in text if c in "\n\t" or not (ord(c) < 0x20 or 0x7F <= ord(c) <= 0x9F))


def paste(text: str) -> bytes:
    """The bytes that type ``text`` as one bracketed paste (Enter follows separately)."""
    return PASTE_START + inert(text).replace("\n", "\r").encode() + PASTE_END


def own_process(agent: str, argv: list[str]) -> list[str]:
    """``argv`` with what keeps the agent's turns in the process this wrapper runs (so its
    hooks see ``RUNSTEAD_TERMINAL``): ``--no-daemon`` for Codex."""
    if agent == "codex" and not any(a in ("--no-daemon", "--remote") or a.startswith("--remote=") for a in argv[1:]):
        return [argv[0], "--no-daemon", *argv[1:]]
    return list(argv)


class Wrapper:
    """One agent CLI under a pseudo-terminal; ``run()`` returns its exit status."""

    def __init__(self, argv: list[str], *, state_dir: str | None = None, quiet_s: float | None = None,
                 stdin_fd: int = 0, stdout_fd: int = 1):
        self.agent = os.path.basename(argv[0])
        self.argv = own_process(self.agent, argv)
        self.state_dir = state_dir or inbox.hook_state_dir()
        self.quiet_s = env_float("RUNSTEAD_TERMINAL_QUIET_S", QUIET_S, minimum=0) if quiet_s is None else quiet_s
        self.stdin_fd, self.stdout_fd = stdin_fd, stdout_fd
        self.folder = os.path.join(self.state_dir, "terminals", str(os.getpid()))
        self.last_key = 0.0
        self.line_dirty = False  # the person typed since the last Enter
        self.swept: set[str] = set()
        self.proc = None
        self.last_output = 0.0
        self.interrupted: tuple[float, int] | None = None  # (when, the hooks' state version then)
        self.children: list = []  # hook processes this wrapper started (reaped as they end)

    # --- the session, from the hooks ------------------------------------------------------

    def session(self) -> tuple[str | None, bool]:
        """``(session id, a turn is open)`` as the hooks last wrote them, a turn counted
        over after an interrupt (module docstring)."""
        import json

        try:
            with open(os.path.join(self.folder, "state.json"), "rb") as handle:
                version = os.fstat(handle.fileno()).st_mtime_ns
                data = json.loads(handle.read())
        except (OSError, ValueError):
            return None, True
        session_id = data.get("session_id") if isinstance(data, dict) else None
        if not isinstance(session_id, str):
            return None, True
        busy = bool(data.get("busy"))
        if busy and self.interrupted is not None and self.interrupted[1] == version:
            busy = time.monotonic() - max(self.interrupted[0], self.last_output) < INTERRUPT_SETTLE_S
            if not busy:
                self.interrupted = None
                self._report_interrupted(data.get("agent_session"))
        return session_id, busy

    def _report_interrupted(self, agent_session) -> None:
        """The turn ended by an interrupt: the hook, run as the CLI would run it, ends it
        on the service (its ``ended`` marker through the outbox) and in the state file.
        Not waited for: the terminal goes on."""
        import json
        import subprocess

        from machine.hooks.mapping import INTERRUPTED

        if not isinstance(agent_session, str) or not agent_session or self.agent not in ("claude", "codex"):
            return
        payload = json.dumps({"hook_event_name": INTERRUPTED, "session_id": agent_session})
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ, **{TERMINAL_ENV: self.folder, "RUNSTEAD_HOOK_DIR": self.state_dir,
                                  "PYTHONPATH": os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH", "")) if p)})
        try:
            self.children.append(subprocess.Popen([sys.executable, "-m", "machine.hooks", self.agent, payload], env=env,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                             start_new_session=True))
        except OSError as error:
            from machine.hooks import store

            store.log_line(self.state_dir, "terminal.log", f"interrupt report: {error!r}")

    def _state_version(self) -> int:
        try:
            return os.stat(os.path.join(self.folder, "state.json")).st_mtime_ns
        except OSError:
            return 0

    def _interrupting(self) -> None:
        """The interrupt key went to the CLI now (T5, or the person's own)."""
        self.interrupted = (time.monotonic(), self._state_version())

    def report(self, session_id: str, seq: int, state: str) -> None:
        """Queue what became of message ``seq`` for the service, in the hooks' outbox (R4)."""
        from machine.hooks import launch, store

        try:
            with store.Outbox(self.state_dir) as outbox:
                with outbox.transaction():
                    outbox.append([{"method": "POST", "path": f"/api/sessions/{session_id}/messages/{seq}/delivery/",
                                    "body": {"state": state}}])
            launch.ensure_sender(self.state_dir)
        except Exception as error:  # noqa: BLE001 - the terminal goes on whatever the outbox does
            store.log_line(self.state_dir, "terminal.log", f"report of {session_id} {seq} {state}: {error!r}")

    def sweep(self, session_id: str) -> None:
        """Messages an earlier wrapper took but may not have typed: ``undelivered``, once."""
        self.swept.add(session_id)
        for name in inbox.in_state(self.state_dir, session_id, inbox.TAKE):
            payload = inbox.payload_of(self.state_dir, session_id, name)
            if inbox.move(self.state_dir, session_id, name, inbox.LOST):
                self.report(session_id, int(payload["seq"]), "undelivered")

    # --- the loop --------------------------------------------------------------------------

    def run(self) -> int:
        from ptyprocess import PtyProcess

        os.makedirs(self.folder, mode=0o700, exist_ok=True)
        env = dict(os.environ, **{TERMINAL_ENV: self.folder})
        is_tty = os.isatty(self.stdin_fd)
        size = self._size()
        self.proc = PtyProcess.spawn(self.argv, env=env, dimensions=size)
        old = None
        if is_tty:
            import termios
            import tty

            old = termios.tcgetattr(self.stdin_fd)
            tty.setraw(self.stdin_fd)
        previous = signal.signal(signal.SIGWINCH, lambda *_: self._resize())
        try:
            self._loop()
        finally:
            signal.signal(signal.SIGWINCH, previous)
            if old is not None:
                import termios

                termios.tcsetattr(self.stdin_fd, termios.TCSAFLUSH, old)
            self._cleanup()
        self.proc.wait()
        if self.proc.signalstatus is not None:
            return 128 + self.proc.signalstatus
        return self.proc.exitstatus or 0

    def _size(self) -> tuple[int, int]:
        try:
            cols, rows = os.get_terminal_size(self.stdout_fd)
            return rows, cols
        except OSError:
            return 24, 80

    def _resize(self) -> None:
        if self.proc is not None:
            rows, cols = self._size()
            try:
                self.proc.setwinsize(rows, cols)
            except OSError:
                pass

    def _cleanup(self) -> None:
        for name in ("state.json",):
            try:
                os.unlink(os.path.join(self.folder, name))
            except OSError:
                pass
        try:
            os.rmdir(self.folder)
        except OSError:
            pass

    def _write_out(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.stdout_fd, view):]

    def _loop(self) -> None:
        pty_fd = self.proc.fd
        reading = [pty_fd, self.stdin_fd]
        while True:
            try:
                ready, _, _ = select.select(reading, [], [], TICK_S)
            except InterruptedError:
                continue
            if pty_fd in ready:
                try:
                    data = os.read(pty_fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    return  # the CLI closed its terminal: it ended
                self.last_output = time.monotonic()
                self._write_out(data)
            if self.stdin_fd in ready:
                try:
                    data = os.read(self.stdin_fd, 65536)
                except OSError:
                    data = b""
                if not data:
                    reading = [pty_fd]  # our input ended; the CLI keeps running
                else:
                    self._keys(data)
            self._deliver()

    def _keys(self, data: bytes) -> None:
        pressed, dirty = typing(data)
        if pressed:
            self.last_key = time.monotonic()
        if dirty is not None:
            self.line_dirty = dirty
        if data == INTERRUPT_KEYS.get(self.agent, b"\x03"):
            self._interrupting()
        self.proc.write(data)

    def _deliver(self) -> None:
        self.children = [child for child in self.children if child.poll() is None]
        session_id, busy = self.session()
        if session_id is None:
            return
        if session_id not in self.swept:
            self.sweep(session_id)
        if inbox.take_interrupt(self.state_dir, session_id):
            self.proc.write(INTERRUPT_KEYS.get(self.agent, b"\x03"))
            self._interrupting()
        if busy or self.line_dirty or time.monotonic() - self.last_key < self.quiet_s:
            return
        if not inbox.waiting(self.state_dir, session_id):
            return
        taken = inbox.take(self.state_dir, session_id)
        if taken is None:
            return
        name, message = taken
        self.proc.write(paste(message["text"]))
        held = self._hold(ENTER_DELAY_S)
        self.proc.write(b"\r")
        inbox.move(self.state_dir, session_id, name, inbox.DONE)
        if held:
            self._keys(held)
        self.report(session_id, int(message["seq"]), "delivered")

    def _hold(self, seconds: float) -> bytes:
        """Wait ``seconds`` passing output on and keeping keys back (returned): nothing the
        person types gets between a paste and its Enter."""
        end, held = time.monotonic() + seconds, b""
        while (left := end - time.monotonic()) > 0:
            ready, _, _ = select.select([self.proc.fd, self.stdin_fd], [], [], left)
            if self.proc.fd in ready:
                try:
                    data = os.read(self.proc.fd, 65536)
                except OSError:
                    data = b""
                if data:
                    self.last_output = time.monotonic()
                    self._write_out(data)
            if self.stdin_fd in ready:
                try:
                    held += os.read(self.stdin_fd, 65536)
                except OSError:
                    pass
        return held


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        sys.stderr.write("usage: runstead-term AGENT [ARGS...]   e.g. runstead-term claude\n")
        return 2
    return Wrapper(argv).run()


if __name__ == "__main__":
    sys.exit(main())
