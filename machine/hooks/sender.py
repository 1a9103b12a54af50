"""The detached sender: delivers the outbox's writes in order (SPEC I1, R3, R4).

``python -m machine.hooks.sender --state-dir DIR``. One sender per state directory
(an ``flock`` on ``sender.lock``, which holds its pid); a second one exits at once. It
delivers with ``machine.outbox.deliver`` (the worker's loop too): the oldest write,
deleted once the service answered finally (2xx, or a 4xx other than 429: logged and
dropped, never retried), and otherwise the same write retried (the writes are idempotent
on the service) after ``machine.protocol.Backoff`` (R4, by the write's failed tries:
exponential with equal jitter from ``RUNSTEAD_HOOK_BACKOFF_BASE_S``, 0.5 s, capped at
``RUNSTEAD_HOOK_BACKOFF_MAX_S``, 60 s), so later writes never overtake it. It exits once
the outbox has been empty for ``RUNSTEAD_HOOK_SENDER_IDLE_S`` (30 s), or after failing
for ``RUNSTEAD_HOOK_SENDER_GIVE_UP_S`` (24 h) with the writes kept for the next sender.
These variables are read strictly (``machine.settings``): a bad value ends the sender
with its reason in ``sender.log``.
At its start and every ``PRUNE_EVERY_S`` (a day) while it runs it prunes the agent
session states untouched for 7 days (I1, ``store.Outbox.prune_sessions``).

``machine.hooks.launch.ensure_sender`` (called by the hook after it queued
something) starts one, detached, when none runs. No Django here (``machine.protocol``
is Django-free).
"""
import argparse
import os
import sys
import time
from datetime import datetime
from pathlib import Path

from machine.hooks import store
from machine.hooks.launch import try_lock
from machine.outbox import deliver
from machine.protocol import BACKOFF_CAP_S, Backoff
from machine.settings import env_float

BACKOFF_BASE_S = 0.5
IDLE_EXIT_S = 30.0
GIVE_UP_S = 86400.0
POLL_S = 0.05
HTTP_TIMEOUT_S = 10.0
PRUNE_EVERY_S = 86400.0


class Sender:
    """The delivery loop over one state directory. ``transport(method, url, headers,
    body) -> status`` raises OSError-like errors on network failure (default: httpx)."""

    def __init__(self, state_dir: Path, *, idle_exit_s: float | None = None, backoff_base_s: float | None = None,
                 backoff_max_s: float | None = None, give_up_s: float | None = None, transport=None,
                 prune_every_s: float = PRUNE_EVERY_S, session_retention_s: float = store.SESSION_RETENTION_S):
        self.state_dir = Path(state_dir)
        self.prune_every_s, self.session_retention_s = prune_every_s, session_retention_s
        self.next_prune = 0.0  # monotonic: at once when the run starts
        self.idle_exit_s = idle_exit_s if idle_exit_s is not None else env_float(
            "RUNSTEAD_HOOK_SENDER_IDLE_S", IDLE_EXIT_S)
        self.backoff = Backoff(
            base_s=backoff_base_s if backoff_base_s is not None else env_float(
                "RUNSTEAD_HOOK_BACKOFF_BASE_S", BACKOFF_BASE_S),
            cap_s=backoff_max_s if backoff_max_s is not None else env_float(
                "RUNSTEAD_HOOK_BACKOFF_MAX_S", BACKOFF_CAP_S),
        )
        self.give_up_s = give_up_s if give_up_s is not None else env_float("RUNSTEAD_HOOK_SENDER_GIVE_UP_S", GIVE_UP_S)
        self._transport = transport
        self._http = None
        self.lock: int | None = None  # sender.lock, held while running
        self.delivered = 0
        self.idle_since = self.failing_since = None  # monotonic

    def log(self, message: str) -> None:
        store.log_line(self.state_dir, store.SENDER_LOG, f"sender[{os.getpid()}] {message}")

    def transport(self, method: str, url: str, headers: dict, body) -> int:
        if self._transport is not None:
            return self._transport(method, url, headers, body)
        import httpx

        if self._http is None:
            self._http = httpx.Client(timeout=HTTP_TIMEOUT_S)
        try:
            response = self._http.request(method, url, headers=headers, json=body)
        except httpx.HTTPError as error:
            raise ConnectionError(str(error)) from error
        if response.status_code >= 400:
            self.last_error_body = response.text[:300]
        elif body and body.get("state") == "running" and url.endswith("/marker/"):
            self.learn_marker_class(response)
        return response.status_code

    def learn_marker_class(self, response) -> None:
        """I7: keep the class (``expires_at - started_at``, M2) of the ``running`` marker
        the service just answered, for the tool hooks' "past half of its class"."""
        try:
            marker = response.json().get("marker") or {}
            started = datetime.fromisoformat(marker["started_at"])
            expires = datetime.fromisoformat(marker["expires_at"])
        except (ValueError, KeyError, TypeError, AttributeError):
            return
        class_s = (expires - started).total_seconds()
        if class_s > 0:
            store.write_marker_class(self.state_dir, class_s)

    def prune(self, outbox: store.Outbox) -> None:
        """Prune old agent session states when due (at the start, then daily)."""
        if time.monotonic() < self.next_prune:
            return
        self.next_prune = time.monotonic() + self.prune_every_s
        pruned = outbox.prune_sessions(older_than_s=self.session_retention_s)
        if pruned:
            self.log(f"pruned {pruned} agent session state(s) untouched for {self.session_retention_s:.0f} s")

    def deliver(self, row: store.Row) -> str:
        """One attempt: ``done``, ``dropped`` (a final refusal), ``retry`` or ``no_config``."""
        config = store.read_config(self.state_dir)
        server = row.server or config.get("server")
        token = row.token or config.get("token")
        if not server or not token:
            return "no_config"
        headers = {"Authorization": f"Token {token}"}
        try:
            status = self.transport(row.method, server.rstrip("/") + row.path, headers, row.body)
        except (ConnectionError, OSError) as error:
            self.last_error = str(error)
            return "retry"
        if status < 300:
            return "done"
        if status == 429 or status >= 500:
            self.last_error = f"HTTP {status}"
            return "retry"
        self.log(f"dropped {row.method} {row.path}: HTTP {status} {getattr(self, 'last_error_body', '')}")
        return "dropped"

    def run(self) -> int:
        """Holds the lock and delivers until idle. Returns how many writes it delivered."""
        if not self._lock():
            return 0
        outbox = store.Outbox(self.state_dir)
        self.idle_since = time.monotonic()
        try:
            deliver(outbox, lambda row: self.send(outbox, row), backoff=self.backoff, pause=self.pause,
                    idle=lambda: self.wait_for_writes(outbox))
            return self.delivered
        finally:
            outbox.close()
            if self.lock is not None:
                os.close(self.lock)
            if self._http is not None:
                self._http.close()

    def _lock(self) -> bool:
        """Take ``sender.lock`` and write this pid into it; False when another sender holds it."""
        self.lock = try_lock(self.state_dir)
        if self.lock is None:
            return False
        os.ftruncate(self.lock, 0)
        os.write(self.lock, str(os.getpid()).encode())
        return True

    def send(self, outbox: store.Outbox, row: store.Row) -> tuple[str, str]:
        """``deliver`` as ``machine.outbox.deliver`` takes it (after pruning when due)."""
        self.prune(outbox)
        outcome = self.deliver(row)
        if outcome == "no_config":
            self.log("no server or token configured (run manage.py install_hooks); writes kept")
            return "stop", ""
        if outcome == "retry":
            return "retry", ""
        self.delivered += outcome == "done"
        self.failing_since = None
        self.idle_since = time.monotonic()
        return ("done" if outcome == "done" else "final"), ""

    def pause(self, delay: float, row: store.Row) -> bool:
        """R4's wait before the same write again; False (stop, writes kept) once failing
        for ``give_up_s``."""
        now = time.monotonic()
        self.failing_since = self.failing_since or now
        if now - self.failing_since >= self.give_up_s:
            self.log(f"giving up for now after {now - self.failing_since:.0f} s: {self.last_error}; writes kept")
            return False
        if row.attempts == 0:
            self.log(f"{row.method} {row.path}: {self.last_error}; retrying")
        time.sleep(delay)
        return True

    def wait_for_writes(self, outbox: store.Outbox) -> bool:
        """Nothing queued: look again every ``POLL_S`` until idle for ``idle_exit_s``;
        then False (exit), unless a write came while the lock was let go."""
        self.prune(outbox)
        if time.monotonic() - self.idle_since < self.idle_exit_s:
            time.sleep(POLL_S)
            return True
        # Release, then look once more: a hook that queued a write while we held the lock
        # saw a sender running and started none.
        os.close(self.lock)
        self.lock = None
        return outbox.head() is not None and self._lock()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Deliver queued RunStead hook writes (SPEC I1).")
    parser.add_argument("--state-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    state_dir = store.ensure_state_dir(args.state_dir or store.default_state_dir())
    try:
        Sender(state_dir).run()
    except Exception as error:  # noqa: BLE001 - a sender never dies noisily; the next hook restarts one
        store.log_line(state_dir, store.SENDER_LOG, f"sender[{os.getpid()}] crashed: {error!r}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
