"""``manage.py submit_task PROMPT``: submit a task over HTTP, as an API client would.

Sends ``POST /api/tasks/`` with a fresh Idempotency-Key (or ``--key``) and prints one
line: the task's id, state and page (``task ID accepted: SERVER/tasks/ID/``), or the
refusal (``HTTP 400 invalid: detail``); ``--json`` prints the answer itself. Defaults (server, token, machine, folder) come from ``var/demo.json``, written by
./run, so in the embedded demo only the prompt is needed.

- ``--continue TASK``: a follow-up of TASK (``continue_task``, G6; queued behind it while
  it still runs, G8);
- ``--isolation worktree|none``: the task's ``isolation`` (G7; absent: the profile's);
- ``--conversation``: ``"mode": "conversation"`` (C1): the agent stays open for messages
  (``POST /api/tasks/{id}/messages/``, or the task page's chat);
- ``--follow``: then print the task's state changes and transcript lines as they arrive
  (``tasks_app.follow``; a spinner line on a terminal, plain lines when piped) and exit
  0 on ``succeeded``, 1 on any other final state, 2 on ``unknown``;
- ``--json``: machine-readable output: the task JSON (one line), and with ``--follow``
  one JSON object a line.

A refused submission exits 1 with the error. A network error says how to retry with the
same key (A2 replays it, so a retry never makes a second task).
"""
import json
import sys
import uuid

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tasks_app.follow import Follower, json_line, printable
from machine.protocol import DEFAULT_MAX_RUNTIME_S


class Command(BaseCommand):
    help = "Submit a task to a RunStead service (POST /api/tasks/), and optionally follow it to its end."

    def add_arguments(self, parser):
        parser.add_argument("prompt")
        parser.add_argument("--server")
        parser.add_argument("--token")
        parser.add_argument("--machine")
        parser.add_argument("--folder")
        parser.add_argument("--agent", help="the worker profile (default: the continued task's with --continue, "
                                              "else demo)")
        parser.add_argument("--max-runtime", type=int, default=DEFAULT_MAX_RUNTIME_S, help="seconds")
        parser.add_argument("--key", help="Idempotency-Key (default: a new UUID)")
        parser.add_argument("--continue", dest="continue_task", metavar="TASK",
                            help="a follow-up of this task: resumes its agent session (queued while it runs)")
        parser.add_argument("--isolation", choices=["worktree", "none"],
                            help="run in a worktree on its own branch (default: the profile's setting)")
        parser.add_argument("--conversation", action="store_true",
                            help="a conversation: the agent stays open for messages (C1)")
        parser.add_argument("--follow", action="store_true",
                            help="print state changes and transcript lines until the task ends; "
                                 "exit 0 succeeded, 1 other final state, 2 unknown")
        parser.add_argument("--json", dest="as_json", action="store_true", help="JSON output (one object a line with --follow)")

    def handle(self, *args, prompt, server, token, machine, folder, agent, max_runtime, key, continue_task, isolation,
               follow, as_json, conversation=False, **options):
        demo = {}
        demo_file = settings.VAR_DIR / "demo.json"
        if demo_file.exists():
            demo = json.loads(demo_file.read_text())
        server = server or demo.get("server")
        token = token or demo.get("token")
        machine = machine or demo.get("machine")
        folder = folder or demo.get("demo_dir")
        if not all([server, token, machine, folder]):
            raise CommandError("need --server, --token, --machine and --folder (or run ./run first)")
        key = key or str(uuid.uuid4())
        headers = {"Authorization": f"Token {token}"}
        if agent is None:
            agent = self.continued_agent(server, headers, continue_task) if continue_task else "demo"
        body = {"machine": machine, "folder": folder, "agent": agent, "prompt": prompt, "max_runtime_s": max_runtime}
        if continue_task:
            body["continue_task"] = continue_task
        if isolation:
            body["isolation"] = isolation
        if conversation:
            body["mode"] = "conversation"
        try:
            response = httpx.post(f"{server.rstrip('/')}/api/tasks/", json=body,
                                  headers={**headers, "Idempotency-Key": key}, timeout=30)
        except httpx.HTTPError as exc:
            # The same key may be sent again once the service is reachable (A2 replays it).
            raise CommandError(f"could not reach {server}: {exc} (retry with --key {key})") from None
        try:
            answer = response.json()
        except ValueError:
            answer = response.text
        accepted = response.status_code < 400 and isinstance(answer, dict) and "id" in answer
        if as_json:
            self.stdout.write(json_line(answer))
        elif accepted:
            self.stdout.write(printable(f"task {answer['id']} {answer.get('state', '')}: "
                                        f"{server.rstrip('/')}/tasks/{answer['id']}/ (Idempotency-Key {key})"))
        else:
            detail = answer if not isinstance(answer, dict) else \
                " ".join(str(answer.get(k)) for k in ("error", "detail", "fields") if answer.get(k))
            self.stdout.write(printable(f"HTTP {response.status_code} {detail}"[:2000]))
        if not accepted:
            error = answer.get("error") if isinstance(answer, dict) else None
            if response.status_code == 401:  # not a refusal of the task: the token was not taken
                raise CommandError(f"not signed in ({error or 401}): the token was rotated or revoked; pass --token "
                                   f"(or restart ./run, which writes the current one to var/demo.json)")
            raise CommandError(f"task refused: {error or response.status_code}")
        if not follow:
            return
        self.stdout.flush()
        out = self.stdout._out

        def write(text: str) -> None:
            out.write(text)
            out.flush()

        tty = hasattr(out, "isatty") and out.isatty()
        status = Follower(server=server, token=token, task=answer, write=write, tty=tty,
                          json_mode=as_json).run()
        sys.exit(status)

    @staticmethod
    def continued_agent(server: str, headers: dict, task_id: str) -> str:
        """The profile of the task a follow-up continues (GET /api/tasks/{id}/), so that
        ``--continue`` resumes with the same agent unless ``--agent`` says otherwise (G6)."""
        try:
            response = httpx.get(f"{server.rstrip('/')}/api/tasks/{task_id}/", headers=headers, timeout=30)
        except httpx.HTTPError as exc:
            raise CommandError(f"could not reach {server}: {exc}") from None
        if response.status_code != 200:
            raise CommandError(f"--continue {task_id}: HTTP {response.status_code} (give --agent, or a task of yours)")
        return response.json()["agent"]
