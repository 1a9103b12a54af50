"""``manage.py submit_task PROMPT``: submit a task over HTTP, as an API client would.

Sends ``POST /api/tasks/`` with a fresh Idempotency-Key (or ``--key``) and prints the
answer. Defaults (server, token, machine, folder) come from ``var/demo.json``, written by
./run, so in the embedded demo only the prompt is needed.
"""
import json
import uuid

import httpx
from django.conf import settings
from django.core.management.base import BaseCommand, CommandError

from tasks_app.protocol import DEFAULT_MAX_RUNTIME_S


class Command(BaseCommand):
    help = "Submit a task to a RunStead service (POST /api/tasks/)."

    def add_arguments(self, parser):
        parser.add_argument("prompt")
        parser.add_argument("--server")
        parser.add_argument("--token")
        parser.add_argument("--machine")
        parser.add_argument("--folder")
        parser.add_argument("--agent", default="demo")
        parser.add_argument("--max-runtime", type=int, default=DEFAULT_MAX_RUNTIME_S, help="seconds")
        parser.add_argument("--key", help="Idempotency-Key (default: a new UUID)")

    def handle(self, *args, prompt, server, token, machine, folder, agent, max_runtime, key, **options):
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
        try:
            response = httpx.post(
                f"{server.rstrip('/')}/api/tasks/",
                json={"machine": machine, "folder": folder, "agent": agent, "prompt": prompt, "max_runtime_s": max_runtime},
                headers={"Authorization": f"Token {token}", "Idempotency-Key": key},
                timeout=30,
            )
        except httpx.HTTPError as exc:
            # The same key may be sent again once the service is reachable (A2 replays it).
            raise CommandError(f"could not reach {server}: {exc} (retry with --key {key})") from None
        self.stdout.write(f"HTTP {response.status_code} (Idempotency-Key {key})")
        try:
            body = response.json()
        except ValueError:
            body = response.text
        self.stdout.write(json.dumps(body, indent=2))
        if response.status_code >= 400:
            error = body.get("error") if isinstance(body, dict) else None
            raise CommandError(f"task refused: {error or response.status_code}")
