"""Helpers for the worker's tests (tests/test_worker_*.py).

- ``make_worker``: an in-process ``Worker`` on a temporary state directory, with any
  clock (a ``FakeClock`` for lease math), talking to an unreachable server unless told
  otherwise. For tests that drive ``watch``/``recover`` directly with real processes.
- ``LiveSetup``: a real daphne (``tests.live``) with short lease timings, an owner, a
  machine paired through ``manage.py pair_worker``, a grant, a worker config with test
  agent profiles (``tests/agents/agent.py``), and helpers to run ``manage.py worker`` as
  a real subprocess, submit tasks and wait for states.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import httpx
import psutil

from machine.worker.config import parse_config
from machine.worker.loop import Worker, WorkerOptions
from machine.worker.store import StateDir, Store
from tests.wait import wait_for

BASE_DIR = Path(__file__).resolve().parent.parent
AGENT = BASE_DIR / "tests" / "agents" / "agent.py"
UNREACHABLE = "http://127.0.0.1:9"

SHORT_TIMINGS = {
    "RUNSTEAD_LEASE_DURATION_S": "3",
    "RUNSTEAD_LEASE_RENEW_S": "0.5",
    "RUNSTEAD_LEASE_MARGIN_S": "0.5",
    "RUNSTEAD_KILL_GRACE_S": "0.5",
    "RUNSTEAD_SWEEP_INTERVAL_S": "0.2",
    "RUNSTEAD_EMBEDDED_SWEEP": "1",
    "RUNSTEAD_MESSAGE_VISIBILITY_S": "1",
}
# For browser tests whose subject is not the lease: once, in a loaded CI pass (Chromium,
# two runners, SQLite's serialized writers), a renewal of a 3 s lease came too late and
# the worker stopped a healthy conversation at its deadline. Renewals stay every 0.5 s;
# only the slack before the deadline grows.
BROWSER_TIMINGS = {**SHORT_TIMINGS, "RUNSTEAD_LEASE_DURATION_S": "10"}
WORKER_ENV = {"RUNSTEAD_WORKER_POLL_S": "0.5", "RUNSTEAD_WORKER_BACKOFF_BASE_S": "0.2", "PYTHONUNBUFFERED": "1"}
LIVE_STATES = ("accepted", "delivered", "starting", "running")

PROFILES = {
    "quick": {"AGENT_SLEEP_S": "0.5"},
    "brief": {"AGENT_SLEEP_S": "1"},
    "fail": {"AGENT_SLEEP_S": "0.2", "AGENT_EXIT": "3"},
    "slow": {"AGENT_SLEEP_S": "2"},
    "long": {"AGENT_SLEEP_S": "30"},
    "tree": {"AGENT_SLEEP_S": "30", "AGENT_CHILDREN": "tree"},
    "setsid": {"AGENT_SLEEP_S": "30", "AGENT_CHILDREN": "setsid"},
    "forks": {"AGENT_SLEEP_S": "30", "AGENT_CHILDREN": "forks", "AGENT_FORKS": "150"},
    "stubborn": {"AGENT_SLEEP_S": "30", "AGENT_IGNORE_TERM": "1"},
}


def config_toml(*, roots: list[str], files: dict, profiles: dict = PROFILES, max_concurrent: int = 4,
                profile_keys: dict | None = None) -> str:
    """A worker config whose profiles run the test agent with ``profiles[name]`` as extra
    environment; ``profile_keys[name]`` adds TOML keys to a profile (``{"isolation": "worktree"}``)."""
    lines = [f"allowed_roots = {json.dumps(roots)}", f"max_concurrent = {max_concurrent}", "prevent_idle_sleep = true", ""]
    for name, env in profiles.items():
        full = {**files, **env}
        env_toml = ", ".join(f"{k} = {json.dumps(v)}" for k, v in full.items())
        lines += [f"[profiles.{name}]", f"argv = {json.dumps([sys.executable, str(AGENT), '{prompt}'])}",
                  f"env = {{ {env_toml} }}"]
        lines += [f"{k} = {json.dumps(v)}" for k, v in ((profile_keys or {}).get(name) or {}).items()] + [""]
    return "\n".join(lines)


def make_worker(tmp_path: Path, clock, *, roots=None, server: str = UNREACHABLE, files=None, connect=None,
                options: WorkerOptions | None = None, profiles: dict = PROFILES, max_concurrent: int = 4,
                **worker_args) -> Worker:
    """An in-process worker on ``tmp_path/state`` (identity written on first use, kept
    after). ``connect``: a ``Service`` factory (e.g. ``lambda: InMemoryService(...)``);
    default HTTP to ``server``."""
    import tomllib

    state = StateDir(str(tmp_path / "state"))
    state.ensure()
    if state.read_identity() is None:
        state.write_identity(machine_id=str(uuid.uuid4()), generation=1, name="unit", server=server,
                             token="tok-" + uuid.uuid4().hex)
    files = files or {"AGENT_STARTS": str(tmp_path / "starts"), "AGENT_PIDS": str(tmp_path / "pids")}
    config = parse_config(tomllib.loads(config_toml(roots=roots or [str(tmp_path)], files=files, profiles=profiles,
                                                    max_concurrent=max_concurrent)))
    return Worker(state=state, store=Store(state.db_path), identity=state.read_identity(), config=config,
                  options=options or WorkerOptions(server=server), clock=clock, connect=connect, **worker_args)


def count_lines(path: Path) -> int:
    try:
        return len([line for line in path.read_text().splitlines() if line.strip()])
    except FileNotFoundError:
        return 0


def recorded_pids(path: Path) -> list[tuple[int, str]]:
    try:
        return [(int(a), b) for a, b in (line.split(maxsplit=1) for line in path.read_text().splitlines() if line.strip())]
    except FileNotFoundError:
        return []


def live_pids(pids) -> list[int]:
    """Those of ``pids`` that are alive and not zombies."""
    out = []
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                out.append(pid)
        except psutil.NoSuchProcess:
            pass
    return out


def manage_env(extra: dict | None = None) -> dict:
    from tests.live import database_env

    env = {**os.environ, **database_env(), **WORKER_ENV}
    env.pop("RUNSTEAD_WORKER_FAULT", None)
    env.update(extra or {})
    return env


class LiveSetup:
    """A paired worker state directory against a real daphne with short timings."""

    def __init__(self, url: str, owner, tmp_path: Path, profiles: dict = PROFILES, max_concurrent: int = 4,
                 pair_via_command: bool = False, profile_keys: dict | None = None, files: dict | None = None):
        self.url = url
        self.owner = owner
        self.tmp = tmp_path
        self.api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=15)
        self.root = tmp_path / "root"
        self.repo = self.root / "repo"
        self.repo.mkdir(parents=True)
        self.starts_file = tmp_path / "starts"
        self.pids_file = tmp_path / "pids"
        self.state_dir = tmp_path / "state"
        code = self.api.post("/api/machines/pairing-codes/", json={"name": "test-laptop"}).json()["code"]
        if pair_via_command:
            out = subprocess.run(
                [sys.executable, "manage.py", "pair_worker", "--server", url, "--code", code, "--name", "test-laptop",
                 "--state-dir", str(self.state_dir)],
                cwd=BASE_DIR, env=manage_env(), capture_output=True, text=True, timeout=60,
            )
            assert out.returncode == 0, out.stderr
        else:  # what the command does, without a second Django start-up
            from machine.worker.client import pair

            answer = pair(url, code, "test-laptop")
            assert answer.status == 201, answer.text
            StateDir(str(self.state_dir)).write_identity(
                machine_id=answer.body["machine_id"], generation=answer.body["generation"], name="test-laptop",
                server=url, token=answer.body["token"])
        self.machine_id = json.loads((self.state_dir / "machine.json").read_text())["machine_id"]
        resp = self.api.post("/api/grants/", json={"machine": self.machine_id, "path": str(self.root)})
        assert resp.status_code == 201, resp.text
        self.grant_id = resp.json()["id"]
        self.config = tmp_path / "worker.toml"
        self.config.write_text(config_toml(
            roots=[str(self.root)],
            files={"AGENT_STARTS": str(self.starts_file), "AGENT_PIDS": str(self.pids_file), **(files or {})},
            profiles=profiles, max_concurrent=max_concurrent, profile_keys=profile_keys))
        self.workers: list[subprocess.Popen] = []
        self.log_path = tmp_path / "worker.log"

    # --- worker processes -----------------------------------------------------------------

    def start_worker(self, *, fault: str | None = None, once: bool = False, env: dict | None = None) -> subprocess.Popen:
        extra = dict(env or {})
        if fault:
            extra["RUNSTEAD_WORKER_FAULT"] = fault
        args = [sys.executable, "manage.py", "worker", "--server", self.url, "--state-dir", str(self.state_dir),
                "--config", str(self.config)]
        if once:
            args.append("--once")
        log = open(self.log_path, "ab")
        log.write(f"\n===== worker start (fault={fault}) =====\n".encode())
        log.flush()
        proc = subprocess.Popen(args, cwd=BASE_DIR, env=manage_env(extra), stdout=log, stderr=subprocess.STDOUT)
        log.close()
        self.workers.append(proc)
        return proc

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-6000:]
        except FileNotFoundError:
            return ""

    def stop_workers(self) -> None:
        for proc in self.workers:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)

    def close(self) -> None:
        self.stop_workers()
        # Agents of a killed worker are the test's leftovers: end them.
        for pid in live_pids([p for p, _ in recorded_pids(self.pids_file)]):
            try:
                os.kill(pid, 9)
            except OSError:
                pass
        # Launchers outlive their worker by design (a live conversation's agent survives a
        # worker crash, C3): each leads its own process group, ended here with its agent.
        ops = str(self.state_dir / "ops") + os.sep
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if any(arg.startswith(ops) for arg in proc.info["cmdline"] or ()):
                try:
                    os.killpg(proc.info["pid"], 9)
                except OSError:
                    pass
        self.api.close()

    # --- service --------------------------------------------------------------------------

    def submit(self, agent: str = "quick", folder: Path | None = None, **extra) -> str:
        body = {"machine": self.machine_id, "folder": str(folder or self.repo), "agent": agent,
                "prompt": "do the thing", **extra}
        resp = self.api.post("/api/tasks/", json=body, headers={"Idempotency-Key": str(uuid.uuid4())})
        assert resp.status_code == 201, resp.text
        return resp.json()["id"]

    def task(self, task_id: str) -> dict:
        return self.api.get(f"/api/tasks/{task_id}/").json()

    def wait_state(self, task_id: str, states, timeout: float = 20.0) -> dict:
        states = (states,) if isinstance(states, str) else tuple(states)
        return wait_for(lambda: self.task(task_id), until=lambda task: task.get("state") in states, timeout_s=timeout,
                        interval_s=0.1, what=f"the task to reach {states}",
                        detail=lambda: f"--- worker log ---\n{self.log()}")

    def wait_final(self, task_id: str, timeout: float = 20.0) -> dict:
        return self.wait_state(task_id, ("succeeded", "failed", "failed_lease_lost", "cancelled", "not_started",
                                         "abandoned"), timeout)

    def starts(self) -> int:
        return count_lines(self.starts_file)

    def agent_pids(self) -> list[tuple[int, str]]:
        return recorded_pids(self.pids_file)

    # --- "it never ran again" (X4, W3): a --once run that has exited ---------------------

    def redeliver_start(self, task_id: str) -> int:
        """Make the task's ``start`` message visible and unacknowledged again, as if the
        service had never seen the ack (W2); returns its delivery count so far."""
        from django.utils import timezone

        from tasks_app.models import OutboxMessage

        message = OutboxMessage.objects.get(operation__task_id=task_id, kind="start")
        OutboxMessage.objects.filter(pk=message.pk).update(acked_at=None, visible_at=timezone.now())
        return message.deliveries

    def start_redelivered_and_acked(self, task_id: str, deliveries: int) -> bool:
        from tasks_app.models import OutboxMessage

        message = OutboxMessage.objects.get(operation__task_id=task_id, kind="start")
        return message.acked_at is not None and message.deliveries == deliveries + 1

    def run_once(self, timeout: float = 60.0) -> int:
        """Run ``manage.py worker --once`` to its end: it recovers, pulls once, handles
        what came (waiting for anything it started), flushes its reports and exits.
        Returns its exit status. No other worker of this state directory may be running."""
        assert all(proc.poll() is not None for proc in self.workers), "another worker still runs"
        return self.start_worker(once=True).wait(timeout=timeout)

    def local_record(self, task_id: str) -> dict | None:
        """The worker's local record of the task's operation (its SQLite store), or None."""
        from tasks_app.models import Operation

        if not (self.state_dir / "worker.sqlite3").exists():
            return None  # the worker has not made its store yet
        store = Store(str(self.state_dir / "worker.sqlite3"))
        try:
            row = store.get(str(Operation.objects.get(task_id=task_id).id))
            return dict(row) if row is not None else None
        finally:
            store.close()
