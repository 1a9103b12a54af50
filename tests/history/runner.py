"""The history run (issue 42): the whole service under a seeded client mix and seeded
faults, every operation recorded, then settled and handed to the checker.

What runs, all real processes: the run's own redis-server; three daphnes on one database
(the test database under pytest, a scratch one under ``bench/history.py``) behind one
address (``tests.proxies.Balancer``, the proxy's balancing); two or more
paired workers (``manage.py worker``), each reaching that address through its own
``faults.Partition`` (the tests' blackholing proxy, with a switch); every agent is
``tests/history/agent.py``, which logs its own side of the record. Short real timings
(``tests.worker_harness.SHORT_TIMINGS``: a 3 s lease renewed every 0.5 s).

Workers' profiles: ``task`` (the agent's plain argv), ``cl`` (the ``claude`` preset with
``approvals = "ask"``: a prompt with ``[[ask]]`` runs the real task hook, which asks the
owner and waits) and ``conv`` (the ``claude`` preset: live conversations).

The client mix (``clients`` threads, each its own seeded choice): submit with new keys
(plain, asking, worktree, follow-up, conversation), replays of earlier submits (answered
or not), racing duplicates (two threads, one key, released together), a key reused with
another body; cancel; read; decisions on pending approvals from two clients at once (and
a replay); merge/discard of worktree tasks from two clients at once; conversation
messages (new keys, replays, racing keys), interrupts, ends; session messages (T2, new
keys and replays) to the hooked session of each machine, whose agent side is the real
Stop hook (``hook_loop``, T4); a message of either kind withdrawn at once ``WITHDRAW_P``
of the time (C10, racing its delivery). A thread (``s3_loop``) writes sessions as the
hooks would: a turn, a held job in it, the turn's end, the job's finish, a wake turn,
reading the session all along (S3). A grant revoked and granted
again about every ``REVOKE_EVERY_S``, and one unpair and re-pair of a machine, on a
seeded schedule (``admin``). A reader thread reads tasks all along
(the observations of ``states``).

Then the settle: faults healed, conversations ended, pending approvals decided, reads
until every acknowledged task is final or ``unknown`` (or ``settle_s`` passed), a last
full read of each, the repositories' base branches, the agents' logs. Waits are on facts
(reads), never fixed sleeps; the only sleeps are a fault's own length and a poll's pace.

For the checker's own proof (``tests/test_history.py``): ``service_fault`` names faults
injected into the daphnes (``tests/history/inject/sitecustomize.py``), ``mix`` replaces
the client mix, ``admin=False`` leaves out the revocations and the unpair, ``lease_s``
lengthens the service's lease, and ``until`` keeps the mix going past ``duration_s``
(at most ``until_s`` more) until it has made the facts a fault shows in (``FACTS``,
counted as answers come and, for ``message_received``, from the agents' logs).
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx

from machine import simulated_sleep
from tests.history import faults
from tests.history.record import Recorder
from tests.wait import wait_for

AGENT = Path(__file__).resolve().parent / "agent.py"
FINAL = ("succeeded", "failed", "failed_lease_lost", "cancelled", "not_started", "abandoned")
CLIENT_TIMEOUT_S = 8.0
POLL_S = 0.2
REPAIR_ATTEMPTS = 10  # tries at pairing a machine again under faults
DAPHNE_RESTARTS = 3  # tries at starting a killed daphne again on its port
SERVICE_ENV = {
    "RUNSTEAD_ACCEPT_RATE": "100000/min",
    "RUNSTEAD_APPROVAL_RATE": "100000/min",
    "RUNSTEAD_PROGRESS_RATE": "100000/min",
    "RUNSTEAD_LONGPOLL_KEEPALIVE_S": "0.3",
    "RUNSTEAD_APPROVAL_WAIT_S": "20",
    "RUNSTEAD_LOG_LEVEL": "WARNING",
}
WORKER_EXTRA = {"RUNSTEAD_WORKER_PULL_IDLE_S": "1.5", "RUNSTEAD_LOG_LEVEL": "INFO"}
# (operation, weight): the client mix
MIX = (("submit", 22), ("submit_ask", 5), ("submit_wt", 5), ("submit_follow", 3), ("submit_conv", 3),
       ("replay", 8), ("race", 5), ("reuse", 2), ("cancel", 8), ("read", 6), ("decide", 8), ("integrate", 6),
       ("message", 12), ("message_replay", 3), ("message_race", 3), ("interrupt", 2), ("end", 1),
       ("smessage", 5), ("smessage_replay", 2), ("withdraw_late", 3))
WITHDRAW_P = 0.3  # a sent message (conversation or session) is withdrawn at once this often (C10)
HOOK_EVERY_S = 1.5  # a hooked session's turn ends (its Stop hook runs) about this often
S3_STEP_S = 0.4  # the held-job client's pace between its writes
MAX_OPEN_TASKS = 24  # no new submit while this many tasks are unfinished: the workers keep up
REVOKE_EVERY_S = 12.0  # a grant revoked and granted again about this often (each ends its never-leased tasks, P3)
# What the client mix produced, counted as the answers come (``Run.facts``; ``until``):
FACTS = (
    "replayed",  # an idempotent replay answered 2xx (A2)
    "message_kept",  # a conversation message accepted (new key) and not withdrawn at once (C2, C3)
    "message_received",  # a kept conversation message's text its agent logged it read (C3: the agents' side)
    "smessage_withdrawn",  # a session message's withdraw answered 200 (T2, C10)
    "held_read",  # a session read while a held job was pending and no turn ran (S3)
)


def config_toml(root: Path, agent_log: Path, sleep_file: Path) -> str:
    # The launcher reads the simulated sleep too (it enforces the lease with the machine's
    # clocks): the profile's environment reaches it (the worker's RUNSTEAD_* do not).
    env = f'env = {{ HISTORY_AGENT_LOG = "{agent_log}", {simulated_sleep.ENV} = "{sleep_file}" }}\n'
    return (f'allowed_roots = ["{root}"]\nmax_concurrent = 8\nprevent_idle_sleep = false\n\n'
            f'[profiles.task]\nargv = ["{sys.executable}", "{AGENT}", "{{prompt}}"]\n{env}\n'
            f'[profiles.cl]\npreset = "claude"\nbinary = "{AGENT}"\napprovals = "ask"\n{env}\n'
            f'[profiles.conv]\npreset = "claude"\nbinary = "{AGENT}"\n{env}')


def git(repo: Path, *args: str) -> str:
    identity = ["-c", "user.name=history", "-c", "user.email=history@example.com"]
    return subprocess.run(["git", *identity, *args], cwd=repo, check=True, capture_output=True, text=True).stdout


STEER_SHARE = 0.3  # of conversation messages sent with "delivery": "steer" (C9)


class Machine:
    """One paired worker: its ``LiveSetup``, its partition proxy, its grant."""

    def __init__(self, setup, proxy: faults.Partition, agent_log: Path):
        self.setup, self.proxy = setup, proxy
        self.id = setup.machine_id
        self.grant = {"id": setup.grant_id, "path": str(setup.root)}
        git(setup.repo, "init", "-q")
        (setup.repo / "README").write_text("history\n")
        git(setup.repo, "add", "-A")
        git(setup.repo, "commit", "-q", "-m", "init")
        # The machine's simulated sleeps (clock_jump, ``machine.simulated_sleep``): test only.
        self.sleep_file = setup.root.parent / "simulated-sleep.json"
        # The hook state directory this machine's worker fills (session messages, T2) and
        # its hooked session's Stop hook reads (T4).
        self.hook_dir = setup.root.parent / "hooks"
        self.session: str | None = None  # the hooked session on this machine (``hooked_session``)
        self.agent_session = f"history-{uuid.uuid4()}"
        setup.config.write_text(config_toml(setup.root, agent_log, self.sleep_file))

    def worker(self):
        return self.setup.workers[-1] if self.setup.workers else None

    def start_worker(self):
        return self.setup.start_worker(env={**WORKER_EXTRA, simulated_sleep.ENV: str(self.sleep_file),
                                            "RUNSTEAD_HOOK_DIR": str(self.hook_dir)})


class Run:
    """One seeded run; ``go()`` returns the record's path. Needs Django set up on the run's
    database (its rows committed: ``transactional_db`` under pytest)."""

    def __init__(self, tmp: Path, *, seed: int, duration_s: float, workers: int = 2, clients: int = 3,
                 fault_every_s: float = 2.5, settle_s: float = 60.0, claude: bool = False,
                 service_fault: str | None = None, mix: tuple = MIX, admin: bool = True,
                 until: dict[str, int] | None = None, until_s: float = 60.0, lease_s: float | None = None):
        self.tmp, self.seed, self.duration_s = Path(tmp), seed, duration_s
        self.n_workers, self.n_clients = workers, clients
        self.fault_every_s, self.settle_s = fault_every_s, settle_s
        self.record_path = self.tmp / f"history-{seed}.jsonl"
        self.rec = Recorder(self.record_path)
        self.agent_log = self.tmp / "agents"
        self.agent_log.mkdir(parents=True, exist_ok=True)
        self.lock = threading.Lock()
        self.tasks: dict[str, dict] = {}  # id -> {"kind", "machine", "state"}
        self.sent: list[tuple[str, dict, str]] = []  # (key, body, kind) of every submit
        self.messages: list[tuple[str, str, dict]] = []  # (task, key, body)
        self.ended: set[str] = set()
        self.smessages: list[tuple[str, str, dict]] = []  # (session, key, body)
        self.accepted_messages: list[str] = []  # ".../messages/{seq}/" of every message answered 201
        self.hooks_done = threading.Event()  # the settle's last Stop hooks have run
        self.integrated: set[str] = set()
        self.stop = threading.Event()
        self.figures: dict = {}
        self.servers, self.machines = [], []
        self.claude, self.model_api, self.claude_tasks = claude, None, []
        self.service_fault = service_fault  # comma-separated: tests/history/inject/sitecustomize.py
        self.mix, self.admin_ops = mix, admin
        # Facts the client mix must have produced before the run stops (``FACTS``), each
        # at least this often; waited for past ``duration_s``, at most ``until_s`` more.
        self.until, self.until_s = until or {}, until_s
        self.facts = dict.fromkeys(FACTS, 0)
        self.kept_texts: set[str] = set()  # the texts of the ``message_kept`` messages
        self.lease_s = lease_s  # the service's lease (default SHORT_TIMINGS' 3 s, which the faults are made for)

    # --- recording calls ------------------------------------------------------------------

    def call(self, http: httpx.Client, client: str, f: str, method: str, path: str, *, json=None, key=None,
             args=None):
        """One operation, recorded on completion; (status or None, parsed body or None)."""
        headers = {"Idempotency-Key": key} if key else {}
        t0 = time.time()
        status = text = None
        replayed = False
        try:
            answer = http.request(method, path, json=json, headers=headers)
            status, text = answer.status_code, answer.text
            replayed = answer.headers.get("Idempotent-Replayed") == "true"
        except httpx.HTTPError:
            pass
        self.rec.op(id=self.rec.new_id(), client=client, f=f, method=method, path=path, key=key, json=json,
                    args=args or {}, t0=t0, t1=time.time(), status=status, body=text, replayed=replayed)
        if replayed and status is not None and status < 300:
            self.fact("replayed")
        try:
            parsed = httpx.Response(200, text=text).json() if text else None
        except ValueError:
            parsed = None
        return status, parsed

    def fact(self, name: str) -> None:
        with self.lock:
            self.facts[name] += 1

    def facts_met(self) -> bool:
        received = self.received() if "message_received" in self.until else 0
        with self.lock:
            self.facts["message_received"] = received
            return all(self.facts[name] >= n for name, n in self.until.items())

    def received(self) -> int:
        """How many kept conversation messages the agents' logs say were read (each once)."""
        with self.lock:
            kept = set(self.kept_texts)
        seen = set()
        for path in self.agent_log.glob("*.jsonl"):
            for line in path.read_text().splitlines():
                try:
                    entry = json.loads(line)
                except ValueError:
                    continue  # a line being written
                if entry.get("ev") == "message" and entry.get("text") in kept:
                    seen.add(entry["text"])
        return len(seen)

    def client(self) -> httpx.Client:
        return httpx.Client(base_url=self.balancer.url, timeout=CLIENT_TIMEOUT_S,
                            headers={"Authorization": f"Token {self.token}"})

    # --- set-up ---------------------------------------------------------------------------

    def start(self) -> None:
        from django.contrib.auth import get_user_model
        from django.db import connection
        from rest_framework.authtoken.models import Token

        from tasks_app.models import Budget
        from tests.live import database_env, free_port, start_daphne
        from tests.proxies import Balancer
        from tests.worker_harness import SHORT_TIMINGS, LiveSetup

        self.redis = faults.OwnRedis(free_port(), self.tmp / "redis.log")
        self.env = {**SHORT_TIMINGS, **SERVICE_ENV, "REDIS_URL": f"redis://127.0.0.1:{self.redis.port}/0",
                    "RUNSTEAD_CHANNEL_PREFIX": f"history{os.getpid()}"}
        if self.lease_s:
            self.env["RUNSTEAD_LEASE_DURATION_S"] = str(self.lease_s)
        if self.service_fault:
            self.env.update(HISTORY_SERVICE_FAULT=self.service_fault, PYTHONPATH=str(Path(__file__).parent / "inject"))
        self.database = database_env()
        self.servers = [start_daphne(self.env, log_dir=self.tmp) for _ in range(3)]
        self.balancer = Balancer([s.port for s in self.servers])
        owner = get_user_model().objects.create_user(f"history-{self.seed}-{uuid.uuid4().hex[:6]}")
        self.token = Token.objects.create(user=owner).key
        Budget.objects.update_or_create(owner=owner, defaults={"limit_s": 10.0 ** 9})
        for i in range(self.n_workers):
            proxy = faults.Partition(int(self.balancer.url.rsplit(":", 1)[1]))
            setup = LiveSetup(f"http://127.0.0.1:{proxy.port}", owner, self.tmp / f"w{i}")
            self.machines.append(Machine(setup, proxy, self.agent_log))
        if self.claude:
            self.add_claude(self.machines[0])
        connection.close()  # the run's faults kill database connections; this process reconnects when it needs one
        for machine in self.machines:
            machine.start_worker()
        with self.client() as http:
            for machine in self.machines:
                self.wait(lambda m=machine: self.profiles_known(http, m.id), 60, f"machine {machine.id} reports its profiles")
                self.hooked_session(http, machine)

    def add_claude(self, machine: Machine) -> None:
        """A ``claude`` profile on ``machine``: the real Claude Code offline against the
        fake Messages API (``tests.model_apis.AnthropicAPI``), whose request log is the
        agent's side of the record for its live conversation."""
        from tests.claude_cli import CLI_ENV_KEYS, claude_bin, claude_env
        from tests.model_apis import AnthropicAPI

        self.model_api = AnthropicAPI().__enter__()
        env = claude_env(home=self.tmp / "claude-home", api=self.model_api)
        profile_env = ", ".join([*(f'{k} = "{env[k]}"' for k in CLI_ENV_KEYS),
                                 f'{simulated_sleep.ENV} = "{machine.sleep_file}"'])  # its launcher sleeps too
        with open(machine.setup.config, "a") as config:
            config.write(f'\n[profiles.claude]\npreset = "claude"\nbinary = "{claude_bin()}"\n'
                         'extra_args = ["--permission-mode", "bypassPermissions"]\n'
                         f"env = {{ {profile_env} }}\n")

    def claude_loop(self) -> None:
        """Live conversations with the real CLI, one at a time, each opened when the last
        one is over (a lease lost to a long partition ends one), at most one a minute of
        the run (4 at least): messages one after
        another (each once the previous is answered, or after 15 s), a replay of each,
        a racing pair now and then; the last one is ended in the settle."""
        rng = random.Random(f"claude-{self.seed}")
        machine = self.machines[0]
        self.claude_tasks = []
        with self.client() as http:
            while not self.stop.is_set() and len(self.claude_tasks) < max(4, self.duration_s // 60):
                body = {"machine": machine.id, "folder": str(machine.setup.repo), "agent": "claude",
                        "mode": "conversation", "prompt": f"claude-{uuid.uuid4().hex[:8]}", "exclusive": False,
                        "max_runtime_s": 600}
                status, answer = self.call(http, "claude", "submit", "POST", "/api/tasks/", json=body,
                                           key=uuid.uuid4().hex)
                if status != 201:
                    continue
                task = answer["id"]
                self.claude_tasks.append(task)
                with self.lock:
                    self.tasks[task] = {"kind": "claude", "machine": machine.id, "state": answer["state"]}
                self.converse(http, rng, task)

    def converse(self, http, rng, task: str) -> None:
        path = f"/api/tasks/{task}/messages/"
        while not self.stop.is_set():
            key, sent = uuid.uuid4().hex, {"text": f"claude-msg-{uuid.uuid4().hex[:8]}"}
            if rng.random() < STEER_SHARE:
                sent["delivery"] = "steer"
            if rng.random() < 0.3:
                with self.client() as other:
                    self.race(lambda h, n: self.call(h, n, "message", "POST", path, json=sent, key=key),
                              (http, "claude"), (other, "claudeb"))
            status, _ = self.call(http, "claude", "message", "POST", path, json=sent, key=key)
            if status == 409:
                return  # the conversation is over (final, unknown, cancel requested)
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and not self.stop.is_set():
                status, listed = self.call(http, "claude", "messages", "GET", path)
                if status == 200 and all(m["state"] in ("answered", "undelivered") for m in listed["results"]):
                    break
                time.sleep(0.5)

    def claude_record(self) -> None:
        """The fake model API's request log as the agent's side of the real CLI's
        conversation: each user text that began a turn, in the order the API saw them."""
        from tests.conversation_support import turns_started
        from tests.history.record import load

        if self.model_api is None:
            return
        # Each conversation's prompt and messages carry its own tag: the text says the task.
        tags = {}
        for op in load(self.record_path):
            if op["type"] == "op" and op["f"] == "submit" and op["status"] == 201 and op["client"] == "claude":
                tags[op["json"]["prompt"]] = json.loads(op["body"])["id"]
            elif op["type"] == "op" and op["f"] == "message" and op["client"].startswith("claude"):
                tags[op["json"]["text"]] = op["path"].split("/")[-3]
        for text in turns_started(self.model_api):
            self.rec.write({"type": "agent", "ev": "message", "text": text, "pid": -1, "op": None,
                            "task": tags.get(text), "t": None, "via": "model_api"})
        self.model_api.__exit__(None, None, None)

    # --- session messages through the real Stop hook (T2, T4) -----------------------------

    def hooked_session(self, http, machine: Machine) -> None:
        """A Claude Code session on ``machine`` reached through its Stop hook (channel
        ``hook``): the hook's configuration (server: the machine's own link, partitioned
        with its worker), the session bound to the machine."""
        from machine.hooks import store
        from machine.hooks.mapping import session_uuid

        store.write_config(machine.hook_dir, server=machine.setup.url, token=self.token,
                           extra={"machine": str(machine.id)})
        machine.session = str(session_uuid("claude", machine.agent_session))
        body = {"id": machine.session, "agent": "claude", "machine": str(machine.id), "channel": "hook",
                "cwd": str(machine.setup.repo)}
        self.wait(lambda: self.call(http, "setup", "session", "POST", "/api/sessions/", json=body)[0] in (200, 201),
                  30, f"session {machine.session} bound to machine {machine.id}")

    def hook_loop(self) -> None:
        """The hooked sessions' agents: each turn's end runs the real ``Stop`` hook
        (``python -m machine.hooks claude``) as Claude Code does; a block it prints is the
        message the agent receives (the reason's text), logged before anything else (the
        agents' side of the record; one file per session, ``via: stop_hook``); a block is
        followed by the ``stop_hook_active`` re-fire of the turn it continued. Runs until
        the settle says the last messages are through (``hooks_done``)."""
        from machine.hooks.deliver import REASON_PREFIX
        from tests.hooks_support import fixture, hook_env

        logs = {m.id: open(self.agent_log / f"session-{m.id}.jsonl", "a") for m in self.machines}
        try:
            while not self.hooks_done.is_set():
                for machine in self.machines:
                    if machine.session is None:
                        continue
                    active = False
                    while True:
                        payload = fixture("claude", "stop", session_id=machine.agent_session, cwd=str(machine.setup.repo),
                                          stop_hook_active=active)
                        done = subprocess.run([sys.executable, "-m", "machine.hooks", "claude"],
                                              input=json.dumps(payload).encode(), capture_output=True, timeout=30,
                                              env=hook_env(machine.hook_dir), cwd="/")
                        printed = done.stdout.strip()
                        if not printed:
                            break
                        reason = json.loads(printed)["reason"]
                        log = logs[machine.id]
                        log.write(json.dumps({"ev": "message", "pid": -2, "op": None, "t": time.time(),
                                              "task": machine.session, "text": reason.removeprefix(REASON_PREFIX),
                                              "via": "stop_hook"}) + "\n")
                        log.flush()
                        os.fsync(log.fileno())
                        active = True
                self.hooks_done.wait(HOOK_EVERY_S)
        finally:
            for log in logs.values():
                log.close()

    def smessage(self, http, name, rng, what):
        """A session message (T2) to a hooked session: new, or a replay of an earlier one;
        a new one withdrawn at once ``WITHDRAW_P`` of the time (C10: racing its claim)."""
        if what == "smessage_replay":
            with self.lock:
                if not self.smessages:
                    return
                session, key, body = rng.choice(self.smessages)
            self.call(http, name, "smessage", "POST", f"/api/sessions/{session}/messages/", json=body, key=key)
            return
        sessions = [m.session for m in self.machines if m.session]
        if not sessions:
            return
        session, key = rng.choice(sessions), uuid.uuid4().hex
        body = {"text": f"smsg-{uuid.uuid4().hex[:8]}"}
        with self.lock:
            self.smessages.append((session, key, body))
        path = f"/api/sessions/{session}/messages/"
        status, answer = self.call(http, name, "smessage", "POST", path, json=body, key=key)
        if self.maybe_withdraw(http, name, rng, path, status, answer):
            self.fact("smessage_withdrawn")

    def maybe_withdraw(self, http, name, rng, path, status, answer) -> bool | None:
        """Note an accepted message; withdraw it at once ``WITHDRAW_P`` of the time (C10).
        None: not accepted; else whether it was withdrawn (the withdraw answered 200)."""
        if status != 201 or not answer:
            return None
        with self.lock:
            self.accepted_messages.append(f"{path}{answer['seq']}/")
        if rng.random() < WITHDRAW_P:
            status, _ = self.call(http, name, "withdraw", "POST", f"{path}{answer['seq']}/withdraw/")
            return status == 200
        return False

    def withdraw_late(self, http, name, rng) -> None:
        """Withdraw one of the last accepted messages, whatever became of it: one delivered
        meanwhile is refused (409 ``message_not_sent``), so both sides of C10's race show."""
        with self.lock:
            recent = self.accepted_messages[-20:]
        if recent:
            path = rng.choice(recent) + "withdraw/"
            status, _ = self.call(http, name, "withdraw", "POST", path)
            if status == 200 and path.startswith("/api/sessions/"):
                self.fact("smessage_withdrawn")

    # --- held jobs: busy/idle never blips (S3) --------------------------------------------

    def s3_loop(self) -> None:
        """Sessions written as a Claude Code session's hooks would (through the API, each
        write retried until answered, in order, as the hook outbox does): a turn opens, a
        held job starts in it, the turn ends, the job finishes (``wakes`` true or false),
        a wake turn runs and ends. Each write's and every read's times are recorded
        (``args``: session, turn, job) so the checker can say when the session had to be
        busy (S3); reads in between, all along. A new session per cycle."""
        rng = random.Random(f"s3-{self.seed}")
        device = f"history:claude:{uuid.uuid4().hex[:8]}"
        with self.client() as http:
            while not self.stop.is_set():
                session = str(uuid.uuid4())
                if not self.s3_write(http, "session", "POST", "/api/sessions/", {"id": session, "agent": "claude"},
                                     {"session": session}):
                    continue
                base = f"/api/sessions/{session}/"
                turn, job, wakes = uuid.uuid4().hex, f"job-{uuid.uuid4().hex[:8]}", rng.random() < 0.7
                steps = [("marker", "PUT", base + "marker/", {"turn_id": turn, "device_id": device, "state": "running"},
                          {"turn": turn, "state": "running"}),
                         ("job", "POST", base + "jobs/", {"job_id": job, "mode": "held"}, {"job": job}),
                         ("marker", "PUT", base + "marker/", {"turn_id": turn, "device_id": device, "state": "ended"},
                          {"turn": turn, "state": "ended"}),
                         ("job_finish", "POST", f"{base}jobs/{job}/finish/", {"wakes": wakes},
                          {"job": job, "wakes": wakes})]
                if wakes:
                    wake = uuid.uuid4().hex
                    steps += [("marker", "PUT", base + "marker/", {"turn_id": wake, "device_id": device,
                                                                     "state": "running"}, {"turn": wake, "state": "running"}),
                              ("marker", "PUT", base + "marker/", {"turn_id": wake, "device_id": device,
                                                                     "state": "ended"}, {"turn": wake, "state": "ended"})]
                held = False  # a held job pending and no turn running: only the job keeps it busy (S3)
                for f, method, path, sent, args in steps:
                    for _ in range(rng.randint(0, 2)):
                        status, _ = self.call(http, "s3", "sread", "GET", base, args={"session": session})
                        if held and status == 200:
                            self.fact("held_read")
                        time.sleep(S3_STEP_S * rng.random())
                    if not self.s3_write(http, f, method, path, sent, {"session": session, **args}):
                        break  # never answered: the cycle stops here (the checker counts from what was sent)
                    held = (f == "marker" and args["state"] == "ended" and args["turn"] == turn) or (
                        held and f == "job_finish" and wakes)
                self.call(http, "s3", "sread", "GET", base, args={"session": session})

    def s3_write(self, http, f, method, path, sent, args) -> bool:
        for _ in range(20):
            status, _ = self.call(http, "s3", f, method, path, json=sent, args=args)
            if status is not None and status < 300:
                return True
            if self.stop.is_set() or (status is not None and status < 500 and status != 429):
                return False
            time.sleep(POLL_S)
        return False

    def profiles_known(self, http, machine_id) -> bool:
        answer = http.get("/api/machines/")
        rows = answer.json().get("results", []) if answer.status_code == 200 else []
        return any(m["id"] == machine_id and any(p.get("conversation") == "live" for p in m.get("profiles") or [])
                   for m in rows)

    @staticmethod
    def wait(predicate, timeout_s: float, what: str):
        """``tests.wait.wait_for``, an HTTP error counting as "not yet"."""
        wait_for(predicate, timeout_s=timeout_s, interval_s=POLL_S, what=what, ignore=(httpx.HTTPError,))

    # --- the client mix -------------------------------------------------------------------

    def pick(self, rng, kinds=None, live=True):
        with self.lock:
            rows = [(i, t) for i, t in self.tasks.items() if (kinds is None or t["kind"] in kinds)
                    and (not live or t["state"] not in FINAL)]
        return rng.choice(rows) if rows else (None, None)

    def submit(self, http, name, rng, kind: str, key=None, body=None):
        machine = rng.choice(self.machines)
        tag = uuid.uuid4().hex[:8]
        if body is None:
            body = {"machine": machine.id, "folder": str(machine.setup.repo), "agent": "task", "exclusive": False,
                    "max_runtime_s": 300}
            if kind == "plain":
                exit_code = "[[exit:3]]" if rng.random() < 0.1 else ""
                body["prompt"] = f"h-{tag} [[sleep:{rng.choice([0.2, 0.5, 1, 2, 4])}]]{exit_code}"
            elif kind == "ask":
                body.update(agent="cl", prompt=f"ask-{tag} [[ask]][[sleep:0.3]]")
            elif kind == "wt":
                body.update(isolation="worktree", prompt=f"wt-{tag} [[commit:c-{tag}]][[sleep:0.2]]")
            elif kind == "follow":
                before, _ = self.pick(rng, ("ask", "follow"), live=False)
                if before is None:
                    return None
                body.update(agent="cl", prompt=f"follow-{tag} [[sleep:0.3]]", continue_task=before,
                            machine=self.tasks[before]["machine"],
                            folder=str(self.machine(self.tasks[before]["machine"]).setup.repo))
            elif kind == "conv":
                body.update(agent="conv", mode="conversation", prompt=f"conv-{tag} [[sleep:0.3]]")
        key = key or uuid.uuid4().hex
        with self.lock:
            self.sent.append((key, body, kind))
        return self.send(http, name, key, body, kind)

    def send(self, http, name, key, body, kind):
        status, answer = self.call(http, name, "submit", "POST", "/api/tasks/", json=body, key=key)
        if status == 201 and answer:
            with self.lock:
                self.tasks.setdefault(answer["id"], {"kind": kind, "machine": body["machine"], "state": answer["state"]})
        return status

    def machine(self, machine_id) -> Machine:
        return next(m for m in self.machines if m.id == machine_id)

    def race(self, fn, *argsets):
        """Run ``fn(*args)`` for each argset in threads released together; wait for all."""
        barrier = threading.Barrier(len(argsets))
        threads = [threading.Thread(target=lambda a=a: (barrier.wait(), fn(*a))) for a in argsets]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def op(self, http, name, rng, what: str) -> None:
        if what.startswith("submit") and self.open_tasks() >= MAX_OPEN_TASKS:
            what = "read"
        if what.startswith("submit"):
            self.submit(http, name, rng, {"submit": "plain"}.get(what, what.removeprefix("submit_")))
        elif what in ("replay", "reuse") and self.sent:
            with self.lock:
                key, body, kind = rng.choice(self.sent)
            if what == "reuse":
                body = {**body, "prompt": body["prompt"] + " again"}
            self.send(http, name, key, body, kind)
        elif what == "race":
            key, body = uuid.uuid4().hex, None
            machine = rng.choice(self.machines)
            body = {"machine": machine.id, "folder": str(machine.setup.repo), "agent": "task", "exclusive": False,
                    "prompt": f"h-{uuid.uuid4().hex[:8]} [[sleep:0.5]]", "max_runtime_s": 300}
            with self.client() as other:
                self.race(lambda h, n: self.submit(h, n, rng, "plain", key=key, body=body), (http, name),
                          (other, name + "b"))
        elif what == "cancel":
            task, _ = self.pick(rng, ("plain", "ask", "follow", "wt"))
            if task:
                self.call(http, name, "cancel", "POST", f"/api/tasks/{task}/cancel/")
        elif what == "read":
            task, _ = self.pick(rng, live=False)
            if task:
                self.read(http, name, task)
        elif what == "decide":
            self.decide(http, name, rng)
        elif what == "integrate":
            self.integrate(http, name, rng)
        elif what.startswith("message"):
            self.message(http, name, rng, what)
        elif what.startswith("smessage"):
            self.smessage(http, name, rng, what)
        elif what == "withdraw_late":
            self.withdraw_late(http, name, rng)
        elif what in ("interrupt", "end"):
            task, _ = self.pick(rng, ("conv",))
            if task and task not in self.ended:
                if what == "end":
                    self.ended.add(task)
                self.call(http, name, what, "POST", f"/api/tasks/{task}/{what}/")

    def open_tasks(self) -> int:
        with self.lock:
            return sum(1 for t in self.tasks.values() if t["state"] not in (*FINAL, "unknown"))

    def read(self, http, name, task):
        status, answer = self.call(http, name, "read", "GET", f"/api/tasks/{task}/")
        if status == 200 and answer:
            with self.lock:
                self.tasks[task]["state"] = answer["state"]
                self.tasks[task]["integration"] = answer.get("integration")
        return answer if status == 200 else None

    def decide(self, http, name, rng):
        status, answer = self.call(http, name, "approvals", "GET", "/api/approvals/?state=pending")
        if status != 200:
            return
        for approval in (answer or {}).get("results", [])[:2]:
            path = f"/api/approvals/{approval['id']}/decision/"
            args = {"approval": approval["id"]}
            first, second = rng.choice([("allow", "deny"), ("deny", "allow"), ("allow", "allow")])
            keys = (uuid.uuid4().hex, uuid.uuid4().hex)
            with self.client() as other:
                self.race(lambda h, n, b, k: self.call(h, n, "decide", "POST", path, json={"behavior": b}, key=k,
                                                       args=args),
                          (http, name, first, keys[0]), (other, name + "b", second, keys[1]))
            self.call(http, name, "decide", "POST", path, json={"behavior": first}, key=keys[0], args=args)

    def integrate(self, http, name, rng):
        with self.lock:
            done = [i for i, t in self.tasks.items() if t["kind"] == "wt" and t["state"] == "succeeded"
                    and i not in self.integrated]
        if not done:
            return
        task = rng.choice(done)
        self.integrated.add(task)
        path = f"/api/tasks/{task}/integrate/"
        first, second = rng.choice([("merge", "merge"), ("merge", "discard"), ("discard", "merge")])
        keys = (uuid.uuid4().hex, uuid.uuid4().hex)
        with self.client() as other:
            self.race(lambda h, n, a, k: self.call(h, n, "integrate", "POST", path, json={"action": a}, key=k),
                      (http, name, first, keys[0]), (other, name + "b", second, keys[1]))
        self.call(http, name, "integrate", "POST", path, json={"action": first}, key=keys[0])

    def message(self, http, name, rng, what):
        if what == "message_replay":
            with self.lock:
                if not self.messages:
                    return
                task, key, body = rng.choice(self.messages)
            self.call(http, name, "message", "POST", f"/api/tasks/{task}/messages/", json=body, key=key)
            return
        task, _ = self.pick(rng, ("conv",))
        if not task or task in self.ended:
            return
        key = uuid.uuid4().hex
        body = {"text": f"msg-{uuid.uuid4().hex[:8]} [[sleep:{rng.choice([0.1, 0.3, 1.0])}]]"}
        if rng.random() < STEER_SHARE:
            body["delivery"] = "steer"  # C9: into the running turn, or the next one; never lost, never twice
        with self.lock:
            self.messages.append((task, key, body))
        path = f"/api/tasks/{task}/messages/"
        if what == "message_race":
            with self.client() as other:
                self.race(lambda h, n: self.call(h, n, "message", "POST", path, json=body, key=key),
                          (http, name), (other, name + "b"))
        else:
            status, answer = self.call(http, name, "message", "POST", path, json=body, key=key)
            if self.maybe_withdraw(http, name, rng, path, status, answer) is False:
                self.fact("message_kept")
                with self.lock:
                    self.kept_texts.add(body["text"])

    def revoke(self, http, name, machine: Machine):
        """Revoke the machine's grant, then grant its folder again (a new grant)."""
        with self.lock:
            grant = dict(machine.grant)
        self.call(http, name, "revoke", "POST", f"/api/grants/{grant['id']}/revoke/",
                  args={"machine": machine.id, "path": grant["path"]})
        status, answer = self.call(http, name, "grant", "POST", "/api/grants/",
                                   json={"machine": machine.id, "path": grant["path"]})
        if status == 201:
            with self.lock:
                machine.grant = {"id": answer["id"], "path": grant["path"]}

    def repair(self, http, name, machine: Machine):
        """Unpair the machine (its worker is refused and stops, P3, R3), pair it again
        (a new generation), write its new identity, start its worker again."""
        from machine.worker.client import pair
        from machine.worker.store import StateDir

        self.call(http, name, "unpair", "POST", f"/api/machines/{machine.id}/unpair/", args={"machine": machine.id})
        # Pairing again can meet a fault (a daphne killed, the database's connections cut):
        # as the owner would, ask for a new code and try again. A code whose answer was lost
        # may have been used: the next attempt takes a new one.
        for _ in range(REPAIR_ATTEMPTS):
            status, answer = self.call(http, name, "repair", "POST", "/api/machines/pairing-codes/",
                                       json={"machine": machine.id})
            if status == 201:
                paired = pair(self.balancer.url, answer["code"], "test-laptop")
                if paired.status == 201 and paired.body:
                    break
            time.sleep(POLL_S)
        else:
            return  # it stays unpaired: its tasks end by the facts (P3), which the checker reads
        worker = machine.worker()
        if worker is not None and worker.poll() is None:
            worker.kill()
            worker.wait(10)
        StateDir(str(machine.setup.state_dir)).write_identity(
            machine_id=paired.body["machine_id"], generation=paired.body["generation"], name="test-laptop",
            server=machine.setup.url, token=paired.body["token"])
        status, grants = self.call(http, name, "grants", "GET", "/api/grants/")
        live = [g for g in (grants or {}).get("results", []) if g.get("machine") == machine.id
                and not g.get("revoked_at") and g.get("path") == machine.grant["path"]]
        if not live:
            self.revoke(http, name, machine)
        machine.start_worker()

    def admin(self, rng) -> None:
        """The owner's rare operations on a seeded schedule, until the run's end: one
        unpair and re-pair (at 30-60 % of the run), a grant revoked and granted again
        about every ``REVOKE_EVERY_S``."""
        began = time.monotonic()
        events = [(self.duration_s * rng.uniform(0.3, 0.6), "repair")]
        at = REVOKE_EVERY_S * rng.uniform(0.3, 1.0)
        while at < self.duration_s:
            events.append((at, "revoke"))
            at += REVOKE_EVERY_S * rng.uniform(0.7, 1.3)
        if not self.admin_ops:
            events = []
        with self.client() as http:
            for at, what in sorted(events):
                while time.monotonic() - began < at:
                    time.sleep(POLL_S)
                machine = rng.choice(self.machines)
                (self.repair if what == "repair" else self.revoke)(http, "admin", machine)
        while time.monotonic() - began < self.duration_s:
            time.sleep(POLL_S)
        # The facts ``until`` asks for (the mix is random: a short run may not have made them yet).
        while not self.facts_met() and time.monotonic() - began < self.duration_s + self.until_s:
            time.sleep(POLL_S)

    def client_loop(self, index: int) -> None:
        name = f"c{index}"
        rng = random.Random(f"client-{self.seed}-{index}")
        kinds, weights = zip(*self.mix)
        with self.client() as http:
            while not self.stop.is_set():
                self.op(http, name, rng, rng.choices(kinds, weights)[0])

    def reader_loop(self) -> None:
        rng = random.Random(f"reader-{self.seed}")
        with self.client() as http:
            while not self.stop.is_set():
                task, _ = self.pick(rng)
                if task:
                    self.read(http, "reader", task)
                time.sleep(0.05)

    # --- faults ---------------------------------------------------------------------------

    def fault_loop(self, plan) -> None:
        began = time.monotonic()
        for at, kind, length in plan:
            while time.monotonic() - began < at:
                if self.stop.wait(0.05):
                    return
            t0 = time.time()
            try:
                detail = self.inject(kind, length)
            except Exception as error:  # noqa: BLE001  the run goes on; the record says what failed
                detail = {"error": repr(error)[:300]}
            self.rec.fault(kind, t0, **(detail or {}))

    def inject(self, kind: str, length: float) -> dict:
        from tests.live import start_daphne

        rng = random.Random(f"inject-{self.seed}-{kind}-{length}")
        if kind == "kill_daphne":
            i = rng.randrange(len(self.servers))
            old = self.servers[i]
            old.process.kill()
            old.process.wait(10)
            time.sleep(length)
            for attempt in range(1, DAPHNE_RESTARTS + 1):
                try:  # under a heavy load a daphne can take longer than start_daphne waits
                    self.servers[i] = start_daphne(self.env, log_dir=self.tmp, port=old.port)
                    return {"server": i, "attempts": attempt}
                except (AssertionError, RuntimeError):
                    if attempt == DAPHNE_RESTARTS:
                        raise
        if kind == "kill_worker":
            machine = rng.choice(self.machines)
            worker = machine.worker()
            if worker is not None and worker.poll() is None:
                worker.kill()
                worker.wait(10)
            time.sleep(length)
            machine.start_worker()
            return {"machine": machine.id}
        if kind == "kill_agent":
            pid = self.live_agent(rng)
            try:
                os.kill(pid, 9)
            except (TypeError, OSError):
                pid = None  # none running, or it ended meanwhile
            return {"pid": pid}
        if kind == "kill_launcher":
            pid, claude = self.live_launcher(rng)
            try:
                os.kill(pid, 9)
            except (TypeError, OSError):
                pid = claude = None  # no live conversation now, or it ended meanwhile
            return {"pid": pid, "claude": claude}
        if kind == "clock_jump":
            # L5's sleep case: the machine sleeps ``length`` seconds (its monotonic clock
            # stands still while wall time and the service go on), then wakes.
            machine = rng.choice(self.machines)
            simulated_sleep.add_pause(str(machine.sleep_file), length)
            time.sleep(length)
            return {"machine": machine.id, "slept_s": length}
        if kind in ("partition_short", "partition_long"):
            machine = rng.choice(self.machines)
            machine.proxy.partition()
            time.sleep(length)
            machine.proxy.heal()
            return {"machine": machine.id, "length_s": length}
        if kind == "redis_restart":
            self.redis.restart(down_s=length)
            return {}
        if kind == "pg_kill":
            return {"killed": faults.pg_kill(self.database["DATABASE_URL"], self.database["DATABASE_URL"].rsplit("/", 1)[1])}
        raise ValueError(kind)

    def live_launcher(self, rng) -> tuple[int | None, bool | None]:
        """``(pid, whether its agent is the real Claude Code)`` of a launcher that holds a
        live agent (``--inbox``: a live conversation), the real Claude Code's first when one
        runs; ``(None, None)``: none runs."""
        import psutil

        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            argv = proc.info["cmdline"] or []
            if any(a.endswith("launcher.py") for a in argv[:4]) and "--inbox" in argv and self._ours(argv):
                found.append((str(AGENT) in argv, proc.info["pid"]))  # (not Claude, pid)
        if not found:
            return None, None
        test_agent, pid = sorted(found)[0] if self.claude else rng.choice(sorted(found))
        return pid, not test_agent

    def live_agent(self, rng) -> int | None:
        import psutil

        pids = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            if str(AGENT) in (proc.info["cmdline"] or []):
                try:
                    parent = proc.parent()
                    launched_by = parent.cmdline() if parent is not None else []
                except psutil.Error:
                    continue
                if self._ours(launched_by):
                    pids.append(proc.info["pid"])
        return rng.choice(sorted(pids)) if pids else None

    def _ours(self, argv: list[str]) -> bool:
        """Whether a launcher's ``argv`` names an operation folder of this run's workers
        (the machine may run other tests' launchers and agents: never touch those)."""
        return any(a.startswith(str(self.tmp) + os.sep) for a in argv)

    # --- the run --------------------------------------------------------------------------

    def go(self) -> Path:
        started = time.monotonic()
        plan = faults.schedule(self.seed, self.duration_s, every_s=self.fault_every_s)
        self.rec.write({"type": "run", "seed": self.seed, "duration_s": self.duration_s, "plan": plan})
        try:
            self.start()
            threads = [threading.Thread(target=self.client_loop, args=(i,), daemon=True) for i in range(self.n_clients)]
            threads += [threading.Thread(target=self.reader_loop, daemon=True),
                        threading.Thread(target=self.s3_loop, daemon=True)]
            hooks = threading.Thread(target=self.hook_loop, daemon=True)
            hooks.start()
            if self.claude:
                threads += [threading.Thread(target=self.claude_loop, daemon=True)]
            fault_thread = threading.Thread(target=self.fault_loop, args=(plan,), daemon=True)
            for t in [*threads, fault_thread]:
                t.start()
            self.admin(random.Random(f"admin-{self.seed}"))
            self.stop.set()
            fault_thread.join(30)
            for t in threads:
                t.join(30)
            self.settle()
            self.hooks_done.set()
            hooks.join(60)
        finally:
            self.hooks_done.set()
            self.close()
        lines = self.figures
        lines["wall_s"] = round(time.monotonic() - started, 1)
        self.rec.write({"type": "run", "figures": lines})
        self.rec.close()
        return self.record_path

    def settle(self) -> None:
        """Heal, end conversations, decide what is pending, read until every task is
        final or ``unknown``; then the last full reads, base branches, agents' logs."""
        for machine in self.machines:
            machine.proxy.heal()
            worker = machine.worker()
            if worker is None or worker.poll() is not None:
                machine.start_worker()
        rng = random.Random(f"settle-{self.seed}")
        with self.client() as http:
            with self.lock:
                conversations = [i for i, t in self.tasks.items() if t["kind"] in ("conv", "claude")]
            for task in conversations:
                # Ended here even when a client ended it during the run: that answer may
                # have been lost (ending twice is the same answer, C5). A 5xx (a killed
                # database connection) is tried again, as a client would.
                for _ in range(20):
                    status, _ = self.call(http, "settle", "end", "POST", f"/api/tasks/{task}/end/")
                    if status is not None and status < 500:
                        break
                    time.sleep(POLL_S)
            deadline = time.monotonic() + self.settle_s
            while time.monotonic() < deadline:
                self.decide(http, "settle", rng)
                with self.lock:
                    open_ = [i for i, t in self.tasks.items() if t["state"] not in (*FINAL, "unknown")]
                for task in open_:
                    self.read(http, "settle", task)
                with self.lock:
                    if all(t["state"] in (*FINAL, "unknown") for t in self.tasks.values()):
                        break
                time.sleep(POLL_S)
            # Session messages: the Stop hooks keep running until none is still ``sent``
            # (each is delivered by a claim, withdrawn, or, its machine gone, undelivered).
            # Its own time: the Stop hook hands over one message per turn.
            sessions = [m.session for m in self.machines if m.session]
            deadline = time.monotonic() + self.settle_s / 2
            while time.monotonic() < deadline and not all(self.session_settled(http, s) for s in sessions):
                time.sleep(POLL_S)
            for session in sessions:
                self.call(http, "final", "smessages", "GET", f"/api/sessions/{session}/messages/")
            for task in list(self.tasks):
                self.read(http, "final", task)
                if self.tasks[task]["kind"] in ("conv", "claude"):
                    self.call(http, "final", "messages", "GET", f"/api/tasks/{task}/messages/")
        for machine in self.machines:
            self.rec.write({"type": "repo", "machine": machine.id,
                            "subjects": git(machine.setup.repo, "log", "--format=%s").split("\n")[:-1]})

    def session_settled(self, http, session: str) -> bool:
        status, answer = self.call(http, "settle", "smessages", "GET", f"/api/sessions/{session}/messages/")
        return status == 200 and all(m["state"] != "sent" for m in answer["results"])

    def close(self) -> None:
        from tests.hooks_support import stop_sender

        for machine in self.machines:
            machine.setup.close()
            machine.proxy.close()
            if machine.hook_dir.exists():
                stop_sender(machine.hook_dir)  # the detached sender the Stop hooks started
        starts = self.rec.agent_logs(self.agent_log) if self.agent_log.exists() else 0
        self.claude_record()
        if getattr(self, "balancer", None):
            self.balancer.close()
        for server in self.servers:
            server.stop()
        if getattr(self, "redis", None):
            self.redis.kill()
        from django.db import connection

        connection.close()
        if hasattr(connection, "close_pool"):
            connection.close_pool()  # its idle connections may have been killed (pg_kill): a new pool on next use
        from tests.history.record import load

        lines = load(self.record_path)
        ops = [x for x in lines if x["type"] == "op"]
        self.figures.update(
            operations=len(ops), indeterminate=sum(1 for o in ops if o["status"] is None), facts=dict(self.facts),
            by_kind={f: sum(1 for o in ops if o["f"] == f) for f in sorted({o["f"] for o in ops})},
            faults=sum(1 for x in lines if x["type"] == "fault"),
            by_fault={k: sum(1 for x in lines if x["type"] == "fault" and x["what"] == k) for k in faults.KINDS},
            tasks=len(self.tasks), agent_lines=starts,
            agent_starts=sum(1 for x in lines if x["type"] == "agent" and x["ev"] == "start"),
            agent_messages=sum(1 for x in lines if x["type"] == "agent" and x["ev"] == "message"),
            final_states={s: sum(1 for t in self.tasks.values() if t["state"] == s)
                          for s in sorted({t["state"] for t in self.tasks.values()})})

    def summary(self) -> str:
        f = self.figures
        return (f"seed {self.seed}: {f.get('operations')} operations ({f.get('indeterminate')} indeterminate) "
                f"{f.get('by_kind')}; {f.get('faults')} faults {f.get('by_fault')}; {f.get('tasks')} tasks "
                f"{f.get('final_states')}; {f.get('agent_starts')} agent starts, {f.get('agent_messages')} messages "
                f"received; facts {f.get('facts')}; {f.get('wall_s')} s")
