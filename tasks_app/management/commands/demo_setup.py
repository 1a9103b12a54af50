"""``manage.py demo_setup``: the embedded demo (O1) used by ./run.

Creates (idempotently) the demo owner with a budget and an API token, a demo git
repository with tests, and the worker's local config; prints them as JSON. With
``--pairing-code`` it prints a fresh pairing code instead; with ``--grant`` it grants the
demo repository to every paired machine of the demo owner.
"""
import json
import subprocess
import sys
from pathlib import Path

from django.conf import settings
from django.contrib.auth import get_user_model
from django.core.management.base import BaseCommand
from rest_framework.authtoken.models import Token

from core import clock
from tasks_app.auth import token_digest
from tasks_app.models import Budget, Machine
from tasks_app.services.pairing import pairing_code_create
from tasks_app.services.revocation import grant_create
from machine.worker.store import StateDir

DEMO_USER = "demo"
DEMO_PASSWORD = "demo"
CALC = '''def add(a, b):
    return a + b


def mul(a, b):
    return a * b
'''
TESTS = '''import unittest

from calc import add, mul


class CalcTest(unittest.TestCase):
    def test_add(self):
        self.assertEqual(add(2, 3), 5)

    def test_mul(self):
        self.assertEqual(mul(4, 5), 20)


if __name__ == "__main__":
    unittest.main()
'''


class Command(BaseCommand):
    help = "Create the demo owner, repository and worker config (embedded default)."

    def add_arguments(self, parser):
        parser.add_argument("--demo-dir", default=str(settings.VAR_DIR / "demo-repo"))
        parser.add_argument("--state-dir", default=str(settings.VAR_DIR / "worker"))
        parser.add_argument("--pairing-code", action="store_true")
        parser.add_argument("--grant", action="store_true")

    def handle(self, *args, demo_dir, state_dir, pairing_code, grant, **options):
        demo_dir = Path(demo_dir).resolve()
        user = self._owner()
        now = clock.now()
        if pairing_code:
            code, _ = pairing_code_create(owner=user, name="demo-worker", now=now)
            self.stdout.write(code)
            return
        if grant:
            # The machine this state directory is paired as, if its token is still valid
            # here (a deleted database leaves a stale token behind: ./run pairs again).
            identity = StateDir(state_dir).read_identity()
            machine = None
            if identity is not None:
                machine = Machine.objects.filter(
                    pk=identity.machine_id, owner=user, paired=True, token_hash=token_digest(identity.token)
                ).first()
            if machine is not None:  # idempotent: an active grant is returned again
                grant_create(owner=user, machine_id=machine.id, path=str(demo_dir), now=now)
            self.stdout.write(json.dumps({"machine": str(machine.id) if machine else None}))
            return
        self._repo(demo_dir)
        config = Path(state_dir).resolve().with_name("worker-config.toml")
        config.parent.mkdir(parents=True, exist_ok=True)
        config.write_text(
            f"allowed_roots = [{json.dumps(str(demo_dir))}]\n"
            "max_concurrent = 2\n\n"
            "[profiles.demo]\n"
            f"argv = [{json.dumps(sys.executable)}, {json.dumps(str(settings.BASE_DIR / 'scripts' / 'demo_agent.py'))}, \"{{prompt}}\"]\n"
            "\n"
            "# G1: Claude Code's preset, run by a stand-in that speaks its stream-json (no account needed)\n"
            "[profiles.fake-claude]\n"
            'preset = "claude"\n'
            f"binary = {json.dumps(str(settings.BASE_DIR / 'scripts' / 'fake_claude.py'))}\n"
        )
        token, _ = Token.objects.get_or_create(user=user)
        self.stdout.write(
            json.dumps({"username": DEMO_USER, "password": DEMO_PASSWORD, "token": token.key,
                        "demo_dir": str(demo_dir), "worker_config": str(config)})
        )

    def _owner(self):
        user, created = get_user_model().objects.get_or_create(
            username=DEMO_USER, defaults={"is_staff": True, "is_superuser": True}
        )
        if created:
            user.set_password(DEMO_PASSWORD)
            user.save()
        Budget.objects.get_or_create(owner=user, defaults={"limit_s": settings.RUNSTEAD_DEFAULT_BUDGET_S})
        return user

    def _repo(self, demo_dir: Path):
        if (demo_dir / ".git").exists():
            return
        demo_dir.mkdir(parents=True, exist_ok=True)
        (demo_dir / "calc.py").write_text(CALC)
        (demo_dir / "test_calc.py").write_text(TESTS)
        git = ["git", "-c", "user.name=RunStead demo", "-c", "user.email=demo@runstead.invalid"]
        subprocess.run(["git", "init", "-q", str(demo_dir)], check=True)
        subprocess.run([*git, "-C", str(demo_dir), "add", "."], check=True)
        subprocess.run([*git, "-C", str(demo_dir), "commit", "-qm", "demo repository"], check=True)
