"""``python manage.py turn --server URL --token OWNER_TOKEN --session ID -- <agent command...>``

Terminal wrapper for any one-shot agent CLI: one run of the command is one turn, so the
turn reaches every other device's board (M1, M5, M6). With device id
``<hostname>:<session id>`` (M5: two terminals on one laptop never close each other's
markers) it

1. sweeps its device id (a previous run that was killed leaves no ghost),
2. writes ``running`` with a fresh ``turn_id``,
3. runs the command without a shell, in the foreground, with the terminal's stdin,
   stdout and stderr,
4. writes ``ended`` when the command exits (any exit code), on Ctrl-C and on
   SIGTERM / SIGHUP, and exits with the command's status (128 + signal number when it
   died from a signal).

Markers are display-only (M8): the writes go through the hook outbox (SPEC I1; the same
durable queue and detached sender as ``python -m machine.hooks``), so when the
service cannot be reached the command still runs, with a warning on stderr, and the
writes are delivered in order once it is back (R4). Before the command starts the
wrapper waits up to ``--start-wait`` seconds for the sweep and ``running`` to arrive;
before it exits, up to ``--ended-wait`` seconds for ``ended``. Server and token may come
from ``RUNSTEAD_SERVER`` and ``RUNSTEAD_TOKEN``; the outbox lives in ``--state-dir``
(``RUNSTEAD_HOOK_DIR``, default ``~/.runstead/hooks``).
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from urllib.parse import quote

from django.core.management.base import BaseCommand, CommandError

from machine.hooks import launch, store

START_WAIT_S = 2.0
ENDED_WAIT_S = 15.0
FLUSH_POLL_S = 0.02
KILL_GRACE_S = 10.0
POLL_S = 0.1
FORWARDED = (signal.SIGTERM, signal.SIGHUP)


class TurnClient:
    """The three writes a turn makes (M5 sweep, M1 running / ended), queued in the hook
    outbox with this wrapper's own server and token, and delivered by the sender."""

    def __init__(self, server: str, token: str, session_id: uuid.UUID, device_id: str, state_dir: Path):
        self.server, self.token = server.rstrip("/"), token
        self.session_id = session_id
        self.device_id = device_id
        self.state_dir = store.ensure_state_dir(state_dir)
        self.outbox = store.Outbox(self.state_dir)

    def _queue(self, writes: list[dict]) -> list[int]:
        seqs = self.outbox.enqueue(writes, server=self.server, token=self.token)
        launch.ensure_sender(self.state_dir)
        return seqs

    def sweep(self) -> list[int]:
        return self._queue([{"method": "POST", "path": f"/api/devices/{quote(self.device_id, safe=':')}/sweep/",
                             "body": None}])

    def marker(self, *, turn_id: str, state: str, device_name: str, deep_research: bool) -> list[int]:
        body = {
            "turn_id": turn_id, "device_id": self.device_id, "device_name": device_name, "state": state,
            "deep_research": deep_research,
        }
        return self._queue([{"method": "PUT", "path": f"/api/sessions/{self.session_id}/marker/", "body": body}])

    def flush(self, seqs: list[int], timeout_s: float) -> bool:
        """Waits up to ``timeout_s`` seconds until the sender has delivered ``seqs``."""
        deadline = time.monotonic() + timeout_s
        while self.outbox.pending(seqs):
            if time.monotonic() >= deadline:
                return False
            launch.ensure_sender(self.state_dir)
            time.sleep(FLUSH_POLL_S)
        return True

    def close(self):
        self.outbox.close()


class Command(BaseCommand):
    help = "Run one agent turn and publish it as a RUNNING marker (SPEC M)."
    requires_system_checks = []
    requires_migrations_checks = False

    def add_arguments(self, parser):
        parser.add_argument("--server", default=os.environ.get("RUNSTEAD_SERVER"), help="service URL (RUNSTEAD_SERVER)")
        parser.add_argument("--token", default=os.environ.get("RUNSTEAD_TOKEN"), help="owner API token (RUNSTEAD_TOKEN)")
        parser.add_argument("--session", required=True, type=uuid.UUID, help="chat session id (UUID)")
        parser.add_argument("--device-name", default=socket.gethostname(), help="shown on the board (hostname)")
        parser.add_argument("--deep-research", action="store_true", help="60-minute expiry class (M2)")
        parser.add_argument(
            "--start-wait", type=float, default=START_WAIT_S,
            help="seconds to wait for `running` to be delivered before the command starts",
        )
        parser.add_argument(
            "--ended-wait", "--ended-retry", dest="ended_wait", type=float, default=ENDED_WAIT_S,
            help="seconds to wait for `ended` to be delivered before exiting (it stays queued)",
        )
        parser.add_argument(
            "--state-dir", type=Path, default=None, help="hook state dir with the outbox (RUNSTEAD_HOOK_DIR)"
        )
        parser.add_argument("--kill-grace", type=float, default=KILL_GRACE_S, help="seconds before SIGKILL")
        parser.add_argument("argv", nargs=argparse.REMAINDER, help="-- the agent command and its arguments")

    def handle(self, *args, **options):
        argv = list(options["argv"])
        if argv[:1] == ["--"]:
            argv = argv[1:]
        if not argv:
            raise CommandError("give the agent command after --")
        if not options["server"] or not options["token"]:
            raise CommandError("--server and --token (or RUNSTEAD_SERVER and RUNSTEAD_TOKEN) are required")
        session_id = options["session"]
        device_id = f"{socket.gethostname()}:{session_id}"
        state_dir = options["state_dir"] or store.default_state_dir()
        client = TurnClient(options["server"], options["token"], session_id, device_id, state_dir)
        try:
            return_code = run_turn(
                client, argv, device_name=options["device_name"], deep_research=options["deep_research"],
                kill_grace_s=options["kill_grace"], start_wait_s=options["start_wait"],
                ended_wait_s=options["ended_wait"], warn=self.warn,
            )
        finally:
            client.close()
        sys.stdout.flush()
        sys.exit(return_code)

    def warn(self, message: str):
        self.stderr.write(f"runstead turn: {message}")


def run_turn(client: TurnClient, argv: list[str], *, device_name: str, deep_research: bool, kill_grace_s: float,
             start_wait_s: float, ended_wait_s: float, warn) -> int:
    """Sweep, ``running``, run ``argv``, ``ended``. Returns the exit status for the shell."""
    received: list[int] = []
    child: subprocess.Popen | None = None

    def on_signal(signum, frame):
        received.append(signum)
        # Ctrl-C already reached the agent through the terminal's process group; sending
        # it again would read as a second Ctrl-C (force quit) to many CLIs.
        if child is not None and child.poll() is None and signum in FORWARDED:
            child.send_signal(signum)

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, *FORWARDED)}
    turn_id = str(uuid.uuid4())
    try:
        seqs = client.sweep()
        seqs += client.marker(turn_id=turn_id, state="running", device_name=device_name, deep_research=deep_research)
        if not client.flush(seqs, start_wait_s):
            warn("could not publish the running turn yet (queued; it is sent when the service answers)")
        if received:
            return 128 + received[0]
        try:
            child = subprocess.Popen(argv)
        except OSError as error:
            warn(f"cannot run {argv[0]!r}: {error}")
            return 127
        return_code = wait_child(child, received, kill_grace_s)
    finally:
        seqs = client.marker(turn_id=turn_id, state="ended", device_name=device_name, deep_research=deep_research)
        if not client.flush(seqs, ended_wait_s):
            warn("could not publish the end of the turn yet (queued; it is sent when the service answers)")
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return 128 - return_code if return_code < 0 else return_code


def wait_child(child: subprocess.Popen, received: list[int], kill_grace_s: float) -> int:
    """Waits for the agent. Once a signal arrived, the agent gets ``kill_grace_s`` to exit,
    then SIGTERM, then after the same grace SIGKILL."""
    deadline = None
    escalation = [signal.SIGTERM, signal.SIGKILL]
    while True:
        try:
            return child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            pass
        if received and deadline is None:
            deadline = time.monotonic() + kill_grace_s
        if deadline is not None and time.monotonic() >= deadline and escalation:
            child.send_signal(escalation.pop(0))
            deadline = time.monotonic() + kill_grace_s
