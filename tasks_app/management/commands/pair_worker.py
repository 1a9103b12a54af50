"""``python manage.py pair_worker --server URL --code CODE [--name NAME] [--state-dir DIR]`` (SPEC O4, K1).

Exchanges a one-time pairing code for a machine token and keeps it in DIR (mode 0700,
token file 0600). NAME defaults to the hostname. Re-pairing overwrites the token; the
local database (operations, queued receipts) stays.
"""
import socket

from django.core.management.base import BaseCommand, CommandError


class Command(BaseCommand):
    help = "Pair this host with a RunStead service using a one-time pairing code."
    requires_system_checks = []
    requires_migrations_checks = False

    def add_arguments(self, parser):
        parser.add_argument("--server", required=True)
        parser.add_argument("--code", required=True)
        parser.add_argument("--name", default=None)
        parser.add_argument("--state-dir", default="~/.runstead")

    def handle(self, *args, **options):
        from machine.worker.client import pair
        from machine.worker.store import StateDir

        name = options["name"] or socket.gethostname()
        answer = pair(options["server"], options["code"].strip(), name)
        if answer.status != 201 or not answer.body or "token" not in answer.body:
            detail = (answer.body or {}).get("detail") or answer.text[:300] or "no answer"
            raise CommandError(f"pairing failed ({answer.status or 'network error'}): {detail}")
        state = StateDir(options["state_dir"])
        state.write_identity(
            machine_id=str(answer.body["machine_id"]), generation=int(answer.body["generation"]), name=name,
            server=options["server"].rstrip("/"), token=answer.body["token"],
        )
        self.stdout.write(f"paired as {name} (machine {answer.body['machine_id']}, generation "
                          f"{answer.body['generation']}); state in {state.path}")
