"""A stand-in terminal UI for the wrapper's tests (SPEC T3): raw mode, every byte it
reads appended to ``RAW_AGENT_LOG`` as ``repr`` lines; acting as its own hooks, it writes
the wrapper's ``state.json`` (session ``RAW_AGENT_SESSION``, idle); the window size it sees
on each SIGWINCH goes to the log; ``q`` exits with status 7."""
import json
import os
import signal
import sys
import termios
import tty

log_path, session_id = os.environ["RAW_AGENT_LOG"], os.environ["RAW_AGENT_SESSION"]


def log(line: str) -> None:
    with open(log_path, "a") as handle:
        handle.write(line + "\n")


signal.signal(signal.SIGWINCH, lambda *_: log(f"size {os.get_terminal_size(0).columns}x{os.get_terminal_size(0).lines}"))
tty.setraw(0)
old = termios.tcgetattr(0)
with open(os.path.join(os.environ["RUNSTEAD_TERMINAL"], "state.json"), "w") as handle:
    json.dump({"session_id": session_id, "busy": False}, handle)
sys.stdout.write("\x1b[38;5;208mraw agent ready\x1b[0m\r\n")
sys.stdout.flush()
log(f"size {os.get_terminal_size(0).columns}x{os.get_terminal_size(0).lines}")
while True:
    data = os.read(0, 4096)
    if not data:
        break
    log(repr(data))
    if data == b"q":
        sys.stdout.write("bye\r\n")
        sys.stdout.flush()
        sys.exit(7)
