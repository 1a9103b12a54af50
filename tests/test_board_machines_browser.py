"""Machines on the board in a real browser (B10): pair a machine by running the command
the board shows, grant and revoke a folder, with confirmations. Headless Debian Chromium
against a real daphne (tests/live.py)."""
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.browser import chromium, new_page, shot, wait_live  # noqa: F401  (fixtures)
from tests.live import BASE_DIR, live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def run_shown_command(command: str, state_dir: Path) -> subprocess.CompletedProcess:
    """The board's command as a person would paste it, with this test's interpreter for
    ``python`` and a private state directory instead of ``~/.runstead``."""
    argv = shlex.split(command)
    assert argv[:3] == ["python", "manage.py", "pair_worker"], argv
    return subprocess.run([sys.executable, *argv[1:], "--state-dir", str(state_dir)], cwd=BASE_DIR,
                          capture_output=True, text=True, timeout=60)


def test_b10_pair_a_machine_from_the_board_and_it_appears_live(live_daphne, new_page, owner, tmp_path):
    from playwright.sync_api import expect

    from tasks_app.auth import token_digest
    from tasks_app.models import Machine
    from machine.worker.store import StateDir

    url = live_daphne()
    page = new_page(url, owner, viewport={"width": 390, "height": 844}, is_mobile=True, has_touch=True)
    dialogs = []
    page.on("dialog", lambda d: (dialogs.append(d.message), d.accept()))
    page.goto(url + "/")
    wait_live(page)
    page.fill("#pair-form [name=name]", "work-mac")
    page.click("#pair-form button[type=submit]")
    expect(page.locator("#pairing")).to_be_visible()
    expect(page.locator("#pair-expiry")).to_contain_text("expires in 9:5")  # 10 min (K1), counting down
    assert dialogs and "pairing code" in dialogs[0]
    command = page.locator("#pair-command").text_content()
    code = page.locator("#pair-code").text_content()
    assert command == f"python manage.py pair_worker --server {url} --code {code} --name work-mac"
    shot(page, "machines-pairing-phone.png")

    result = run_shown_command(command, tmp_path / "state")
    assert result.returncode == 0, result.stderr

    machine = Machine.objects.get(owner=owner, name="work-mac")
    expect(page.locator("#pair-result")).to_have_text("Paired: work-mac is connected.")
    expect(page.locator(f"#machine-list li[data-machine-id='{machine.id}']")).to_contain_text("work-mac")
    expect(page.locator(f"#manage-list li[data-manage-machine='{machine.id}']")).to_be_visible()
    # What the shown command kept is this machine's identity: its id, generation, name and
    # server, and the very token whose digest the service stores for it (K1).
    identity = StateDir(str(tmp_path / "state")).read_identity()
    assert (identity.machine_id, identity.generation, identity.name, identity.server) == (
        str(machine.id), machine.generation, "work-mac", url)
    assert token_digest(identity.token) == machine.token_hash


def test_b10_grant_and_revoke_a_folder_with_confirmations(live_daphne, new_page, owner, machine, tmp_path):
    from playwright.sync_api import expect

    from tasks_app.models import Grant

    folder = tmp_path / "projects"
    folder.mkdir()
    url = live_daphne()
    page = new_page(url, owner)
    answers = iter([False, True, True])  # the first confirmation is declined: nothing happens
    dialogs = []

    def on_dialog(d):
        dialogs.append(d.message)
        d.accept() if next(answers) else d.dismiss()

    page.on("dialog", on_dialog)
    page.goto(url + "/")
    wait_live(page)
    row = page.locator(f"#manage-list li[data-manage-machine='{machine.id}']")
    row.locator("input[name=path]").fill(str(folder))
    row.locator(".grant-form button").click()
    expect(page.locator("#manage-status")).to_have_text("")
    assert Grant.objects.count() == 0
    row.locator(".grant-form button").click()
    expect(page.locator("#manage-status")).to_have_text(f"Granted {folder} to laptop.")
    grant_row = row.locator(f"li[data-grant-path='{folder}']")
    expect(grant_row).to_be_visible()
    grant = Grant.objects.get(machine=machine, path=str(folder), revoked_at__isnull=True)
    # The task form now offers the granted folder for this machine.
    expect(page.locator(f"#task-form select[name=folder] option[value='{folder}']")).to_have_count(1)
    shot(page, "machines-grant-desktop.png")
    grant_row.locator("button[data-action=revoke]").click()
    expect(grant_row).to_have_count(0)
    grant.refresh_from_db()
    assert grant.revoked_at is not None
    assert [d.split("?")[0] for d in dialogs] == [f"Let laptop run agents in {folder} and below"] * 2 + [
        f"Revoke laptop's access to {folder}"]


def test_b10_submit_a_task_by_choosing_a_reported_profile(live_daphne, new_page, owner, machine, grant):
    import httpx
    from playwright.sync_api import expect

    from tasks_app.models import Task

    url = live_daphne()
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    expect(page.locator("#profile-note")).to_be_visible()  # nothing reported yet
    worker = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10)
    reported = worker.put("/api/worker/profiles/", json={"profiles": [
        {"name": "claude", "preset": "claude"}, {"name": "fast", "preset": "codex"}]})
    assert reported.status_code == 200, reported.text
    agent = page.locator("#task-form select[name=agent]")
    expect(agent.locator("option")).to_have_count(2)  # arrived live, by the machine event
    expect(page.locator("#profile-note")).to_be_hidden()
    agent.select_option("fast")
    page.locator("#task-form select[name=folder]").select_option(grant.path)
    page.fill("#task-form [name=prompt]", "by profile")
    page.click("#task-form button[type=submit]")
    page.wait_for_function("document.getElementById('form-status').textContent === 'Task accepted.'")
    task = Task.objects.get(owner=owner)
    assert (task.agent, task.folder, task.machine_id) == ("fast", grant.path, machine.id)
    shot(page, "task-form-profiles-desktop.png")


def test_c8_the_task_form_offers_the_owners_pools_and_submits_one(live_daphne, new_page, owner, machine, grant):
    """B8, C8: the form lists "any machine" and the owner's pools (from the snapshot); a
    task submitted for a pool is placed on one of its machines and keeps the pool's name."""
    from django.utils import timezone
    from playwright.sync_api import expect

    from tasks_app.models import Machine, Pool, Task

    Machine.objects.filter(pk=machine.pk).update(
        max_concurrent=2, last_heard_at=timezone.now(),
        profiles=[{"name": "fast", "preset": "codex", "isolation": "none", "conversation": "none"}])
    pool = Pool.objects.create(owner=owner, name="desks", created_at=timezone.now(), updated_at=timezone.now())
    pool.machines.set([machine])
    url = live_daphne()
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    select = page.locator("#task-form select[name=machine]")
    expect(select.locator("option")).to_have_text([machine.name, "any machine", "pool desks"])
    select.select_option("desks")
    expect(page.locator("#task-form select[name=agent] option")).to_have_text(["fast (codex)"])
    page.locator("#task-form select[name=folder]").select_option(grant.path)
    page.fill("#task-form [name=prompt]", "on a pool")
    page.click("#task-form button[type=submit]")
    page.wait_for_function("document.getElementById('form-status').textContent === 'Task accepted.'")
    task = Task.objects.get(owner=owner)
    assert (task.machine_id, task.machine_choice, task.folder) == (machine.id, "desks", grant.path)


def test_b2_c8_a_pool_made_changed_and_deleted_elsewhere_reaches_an_open_boards_task_form(
        live_daphne, new_page, owner, machine):
    """Issue 44: the owner changes pools from another device (the API); the open board's
    machine choices follow from the ``pool`` and ``pool.deleted`` events alone (no
    snapshot is fetched meanwhile); a chosen pool renamed elsewhere stays chosen."""
    import httpx
    from playwright.sync_api import expect

    url = live_daphne()
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    hydrations = page.evaluate("window.runsteadBoard.hydrations")
    select = page.locator("#task-form select[name=machine]")
    expect(select.locator("option")).to_have_text([machine.name, "any machine"])
    other_device = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10)
    made = other_device.post("/api/pools/", json={"name": "desks", "machines": [str(machine.id)]})
    assert made.status_code == 201, made.text
    expect(select.locator("option")).to_have_text([machine.name, "any machine", "pool desks"])
    select.select_option("desks")
    assert other_device.patch(f"/api/pools/{made.json()['id']}/", json={"name": "gpus"}).status_code == 200
    expect(select.locator("option")).to_have_text([machine.name, "any machine", "pool gpus"])
    expect(select).to_have_value("gpus")  # the same pool stays chosen under its new name
    assert other_device.delete(f"/api/pools/{made.json()['id']}/").status_code == 204
    expect(select.locator("option")).to_have_text([machine.name, "any machine"])
    assert page.evaluate("window.runsteadBoard.hydrations") == hydrations
