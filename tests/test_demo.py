"""The embedded demo's set-up (O1): ``./run`` pairs again when its saved pairing is not
one this database knows (a deleted ``var/db.sqlite3``), instead of starting a worker
whose token answers 401."""
import io
import json

import pytest
from django.contrib.auth import get_user_model
from django.core.management import call_command

from core import clock
from tasks_app.models import Grant, Machine
from tasks_app.services.pairing import machine_pair, pairing_code_create
from machine.worker.store import StateDir


def _grant(state_dir, demo_dir) -> dict:
    out = io.StringIO()
    call_command("demo_setup", "--grant", "--state-dir", str(state_dir), "--demo-dir", str(demo_dir), stdout=out)
    return json.loads(out.getvalue())


@pytest.mark.django_db
def test_o1_demo_grant_names_the_state_dirs_machine_or_none(tmp_path, pinned):
    state, demo = tmp_path / "worker", tmp_path / "demo-repo"
    demo.mkdir()
    call_command("demo_setup", "--state-dir", str(state), "--demo-dir", str(demo), stdout=io.StringIO())
    assert _grant(state, demo) == {"machine": None}  # never paired

    owner = get_user_model().objects.get(username="demo")
    code, _ = pairing_code_create(owner=owner, name="demo-worker", now=clock.now())
    machine, token = machine_pair(code=code, name="demo-worker", client="127.0.0.1", now=clock.now())
    StateDir(str(state)).write_identity(machine_id=str(machine.pk), generation=machine.generation,
                                        name="demo-worker", server="http://testserver", token=token)
    assert _grant(state, demo) == {"machine": str(machine.pk)}
    assert _grant(state, demo) == {"machine": str(machine.pk)}  # idempotent
    assert Grant.objects.filter(machine=machine, path=str(demo.resolve()), revoked_at=None).count() == 1

    Machine.objects.all().delete()  # what a deleted database looks like from the state dir
    assert _grant(state, demo) == {"machine": None}
