"""README's conversation example runs as written on a fresh clone (SPEC C1-C5, O1; issue
40): the clone's own ``./run`` (daphne, a paired worker with the demo's ``fake-claude``
live profile), then the shell commands of README's "Conversations" block, each as
written, one after the other in one bash (a second terminal at the top of the clone),
with the answers checked: the task accepted, the message taken (its 201 body, ``seq``
1), the agent's reply to it in the transcript, the messages listed with their states,
the interrupt and the end answered, the task ``succeeded``.

The clone is the working tree's tracked and untracked-but-not-ignored files copied to a
temporary folder (no ``var/``: a fresh one), with the shared ``.venv`` linked in; its
environment is a newcomer's (no ``DATABASE_URL``, ``REDIS_URL`` or ``RUNSTEAD_*`` but
the port, which README's own note swaps in: ``RUNSTEAD_PORT=8001 ./run``,
``SERVER=http://127.0.0.1:8001``).
"""
import hashlib
import json
import os
import queue
import re
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import httpx
import pytest

from tests.live import free_port
from tests.wait import wait_for

pytestmark = pytest.mark.slow

BASE_DIR = Path(__file__).resolve().parent.parent
COMMAND_TIMEOUT_S = 60.0
START_TIMEOUT_S = 120.0  # migrate, demo set-up, daphne, pairing on a loaded 2-core machine


def readme_conversation_commands() -> list[str]:
    """The shell commands of README's conversation example (the code block under
    "## Conversations"), a command continued with ``\\`` joined into one."""
    readme = (BASE_DIR / "README.md").read_text()
    section = readme.split("## Conversations", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```\n(.*?)```", section, re.S).group(1)
    commands, current = [], ""
    for line in block.splitlines():
        current += line + "\n"
        if not line.rstrip().endswith("\\"):
            if current.strip():
                commands.append(current)
            current = ""
    return commands


def fresh_clone(dest: Path) -> Path:
    """The working tree's files (tracked, and new ones not ignored) copied to ``dest``;
    ``.venv`` is the shared one, seen through links, stamped as installed for this
    clone's requirements so ``./run`` installs nothing."""
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=BASE_DIR,
                           capture_output=True, check=True).stdout.decode().split("\0")
    for name in filter(None, files):
        source = BASE_DIR / name
        if not source.is_file():  # deleted in the working tree
            continue
        (dest / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, dest / name)
    venv = dest / ".venv"
    venv.mkdir()
    for entry in (BASE_DIR / ".venv").iterdir():
        if not entry.name.startswith(".installed"):
            (venv / entry.name).symlink_to(entry)
    wanted = hashlib.sha256((dest / "requirements.txt").read_bytes() + (dest / "requirements-dev.txt").read_bytes())
    (venv / ".installed-requirements.sha256").write_text(wanted.hexdigest() + "\n")
    return dest


def newcomer_env(port: int) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("RUNSTEAD_", "DATABASE_", "REDIS_", "DJANGO_", "PYTEST_"))}
    return {**env, "RUNSTEAD_PORT": str(port)}


class Shell:
    """One bash reading commands from its stdin, as a terminal would: ``run(command)``
    returns what the command printed and its exit status."""

    def __init__(self, cwd: Path, env: dict):
        self.process = subprocess.Popen(["bash", "--noprofile", "--norc"], cwd=cwd, env=env, text=True,
                                        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.lines: queue.Queue = queue.Queue()
        self.errors: list[str] = []
        threading.Thread(target=self._read, args=(self.process.stdout, self.lines.put), daemon=True).start()
        threading.Thread(target=self._read, args=(self.process.stderr, self.errors.append), daemon=True).start()

    @staticmethod
    def _read(stream, put):
        for line in stream:
            put(line)

    def run(self, command: str) -> tuple[str, int]:
        # curl prints no newline after its answer: the marker goes on a line of its own.
        self.process.stdin.write(command + '\n__rc=$?; echo; echo "__RC__ $__rc"\n')
        self.process.stdin.flush()
        out = []
        while True:
            try:
                line = self.lines.get(timeout=COMMAND_TIMEOUT_S)
            except queue.Empty:
                raise AssertionError(f"no end of {command!r} in {COMMAND_TIMEOUT_S} s; printed {out}, "
                                     f"stderr {self.errors[-20:]}") from None
            if line.startswith("__RC__ "):
                return "".join(out), int(line.split()[1])
            out.append(line)

    def close(self):
        self.process.stdin.close()
        self.process.wait(10)


def stop_run(run: subprocess.Popen, clone: Path) -> None:
    """Ctrl-C for ``./run`` (twice: the agents too), then whatever it started and left
    running in the clone (its daphne and worker run in their own sessions) by id."""
    for _ in range(2):
        if run.poll() is None:
            run.send_signal(signal.SIGINT)
            try:
                run.wait(30)
            except subprocess.TimeoutExpired:
                continue
    if run.poll() is None:
        run.kill()
        run.wait(10)
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if cwd == str(clone) or cwd.startswith(str(clone) + os.sep):
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass


@pytest.mark.skipif(bool(os.environ.get("DATABASE_URL")), reason="README's ./run is the embedded default whatever "
                    "the environment says: the SQLite pass runs it, the PostgreSQL pass would repeat it")
def test_c_o1_readme_conversation_commands_run_as_written_on_a_fresh_clone(tmp_path):
    commands = readme_conversation_commands()
    clone = fresh_clone(tmp_path / "clone")
    port = free_port()
    env = newcomer_env(port)
    server = f"http://127.0.0.1:{port}"
    run_log = tmp_path / "run.out"
    with open(run_log, "wb") as out:
        run = subprocess.Popen(["./run"], cwd=clone, env=env, stdin=subprocess.DEVNULL, stdout=out,
                               stderr=subprocess.STDOUT)
    shell = None

    def logs() -> str:
        parts = [run_log.read_text(errors="replace")]
        for name in ("daphne.log", "worker.log"):
            path = clone / "var" / name
            parts.append(f"--- {name} ---\n" + (path.read_text(errors="replace")[-4000:] if path.exists() else ""))
        return "\n".join(parts)

    try:
        wait_for(lambda: "RunStead is running" in run_log.read_text(errors="replace") or run.poll() is not None,
                 timeout_s=START_TIMEOUT_S, what="./run to start", detail=logs)
        assert run.poll() is None, logs()
        demo = json.loads((clone / "var" / "demo.json").read_text())
        api = httpx.Client(base_url=server, headers={"Authorization": f"Token {demo['token']}"}, timeout=10)

        def live_profile() -> bool:  # "with ./run going": its worker has told the service its profiles
            body = api.get("/api/machines/").json()
            machines = body["results"] if isinstance(body, dict) else body
            return any(p.get("name") == "fake-claude" and p.get("conversation") == "live"
                       for m in machines for p in m.get("profiles") or [])

        wait_for(live_profile, timeout_s=30, what="the worker's fake-claude profile", detail=logs)

        shell = Shell(clone, env)
        echoed = None
        for command in commands:
            if command.startswith("SERVER="):  # README's own note for another port
                command = command.replace("http://127.0.0.1:8000", server)
            printed, status = shell.run(command)
            assert status == 0, (command, printed, shell.errors[-20:], logs())
            if command.startswith("echo "):
                echoed = printed.strip()
            if command.startswith("TASK="):
                task_id = shell.run('echo "$TASK"')[0].strip()
                task = api.get(f"/api/tasks/{task_id}/").json()
                assert task["mode"] == "conversation" and task["agent"] == "fake-claude", task
                wait_for(lambda: messages(api, task_id).get(0) == "answered", timeout_s=60,
                         what="the agent's answer to the prompt", detail=logs)
            if "/messages/" in command and "-X POST" in command:
                sent = json.loads(printed)  # the 201 body: the message, numbered
                assert sent["seq"] == 1 and sent["text"] == "also update the changelog", sent
                wait_for(lambda: messages(api, task_id).get(1) == "answered", timeout_s=60,
                         what="the agent's answer to the message", detail=logs)
                # the transcript comes with the run's progress (G4, its own thread, once a second),
                # the answered state with a receipt: the reply may follow the state by a moment
                wait_for(lambda: "Done: 'also update the changelog' is handled" in json.dumps(
                    api.get(f"/api/tasks/{task_id}/entries/").json()), timeout_s=30,
                    what="the reply in the transcript", detail=logs)
            elif "/messages/" in command:
                listed = json.loads(printed)["results"]
                assert [(m["seq"], m["state"]) for m in listed] == [(0, "answered"), (1, "answered")], listed
            elif "/interrupt/" in command or "/end/" in command:
                assert json.loads(printed)["id"] == task_id, printed
        assert echoed == f"{server}/tasks/{task_id}/"
        page = api.get(f"/tasks/{task_id}/")  # the chat the echo names (session login: the token is no login)
        assert page.status_code in (200, 302), page.status_code
        final = wait_for(lambda: api.get(f"/api/tasks/{task_id}/").json(),
                         until=lambda t: t["state"] not in ("accepted", "delivered", "starting", "running"),
                         timeout_s=60, what="the conversation to end", detail=logs)
        assert final["state"] == "succeeded", final
        assert final["usage"]["turns"] >= 2, final["usage"]  # both turns counted (G2)
    finally:
        if shell is not None:
            shell.close()
        stop_run(run, clone)


def messages(api: httpx.Client, task_id: str) -> dict[int, str]:
    return {m["seq"]: m["state"] for m in api.get(f"/api/tasks/{task_id}/messages/").json()["results"]}
