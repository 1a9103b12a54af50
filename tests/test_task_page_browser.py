"""The task page in a real browser (SPEC B9, G4, U3): headless Debian Chromium (Playwright)
against a real daphne; live progress from a real worker running the fake Claude, and an
``unknown`` task settled by a decision made on the page."""
import re
import subprocess
import uuid
from pathlib import Path

import httpx
import pytest

from tasks_app.models import Task, TaskEvent
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.browser import chromium, new_page  # noqa: F401  (fixtures)
from tests.wait import wait_for
from tests.worker_harness import BROWSER_TIMINGS, SHORT_TIMINGS, LiveSetup

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

FAKE_CLAUDE = Path(__file__).resolve().parent.parent / "scripts" / "fake_claude.py"
PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}


def no_horizontal_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def test_b9_g4_task_page_shows_progress_live(live_daphne, new_page, make_owner, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    setup = LiveSetup(live_daphne(**BROWSER_TIMINGS), make_owner(), tmp_path)
    try:
        subprocess.run(["git", "init", "-q", str(setup.repo)], check=True)
        subprocess.run(["git", "-C", str(setup.repo), "-c", "user.name=t", "-c", "user.email=t@e", "commit", "-q",
                        "--allow-empty", "-m", "root"], check=True)
        setup.config.write_text(
            f'allowed_roots = ["{setup.root}"]\n[profiles.claude]\npreset = "claude"\nbinary = "{FAKE_CLAUDE}"\n'
            'env = { FAKE_CLAUDE_PAUSE_S = "1.2", FAKE_CLAUDE_TURNS = "5" }\n')
        setup.start_worker()
        task_id = setup.submit("claude", prompt="fix the failing test " + "x" * 300)
        setup.wait_state(task_id, "running")
        page = new_page(setup.url, setup.owner, **PHONE)
        page.goto(f"{setup.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        page.evaluate("window.__sameDocument = true")
        expect(page.locator("#run")).to_be_visible()
        transcript = page.locator("#transcript")
        expect(transcript.locator("li[data-kind=prompt]")).to_contain_text("fix the failing test")
        # rising while it works (updates may coalesce: some count short of the final five)
        expect(page.locator("#run-usage")).to_contain_text(re.compile(r"\b[1-4] turns?\b"), timeout=15000)
        expect(transcript.locator("li[data-kind=message]").first).to_contain_text("Turn 1")
        call = transcript.locator("li[data-kind=tool_call]").first  # one line: tool, command, status
        expect(call.locator(".tool-name")).to_have_text("Bash")
        expect(call.locator(".tool-text")).to_contain_text("git add NOTES.md")
        expect(call).to_have_attribute("data-status", "ok")
        expect(call.locator(".tool-output")).to_be_hidden()  # the output is behind a tap
        call.locator("summary").click()
        expect(call.locator(".tool-output")).to_be_visible()
        page.wait_for_function("window.runsteadTask.progressEvents >= 2")  # pushed, not reloaded (they may coalesce)
        expect(transcript).not_to_contain_text('{"type"')  # never the raw stream
        no_horizontal_scroll(page)
        expect(page.locator("#task-state")).to_have_text("succeeded", timeout=20000)
        expect(transcript.locator("li[data-kind=message]").last).to_contain_text("Done:")  # the final receipt's tail
        numbers = page.evaluate("Array.from(window.runsteadTask.entries.keys()).sort((a, b) => a - b)")
        assert numbers == list(range(1, len(numbers) + 1)), numbers  # the whole run, no gap
        expect(call.locator(".tool-output")).to_be_visible()  # an opened call stays open across updates
        page.click("#raw-toggle")
        expect(page.locator("#raw")).to_contain_text('"type": "result"')  # one tap away
        expect(transcript).to_be_hidden()
        page.click("#raw-toggle")
        expect(transcript).to_be_visible()
        expect(page.locator("#result-body")).to_contain_text("ok (success)")
        expect(page.locator("#git-line")).to_contain_text("4 commits")
        expect(page.locator("#timeline-body")).to_contain_text("lease granted")
        expect(page.locator("#receipts-body")).to_contain_text("final")
        assert page.evaluate("window.__sameDocument") is True  # all of it without a reload
        no_horizontal_scroll(page)
    finally:
        setup.close()


def test_u3_unknown_task_settled_by_a_decision_on_the_page(live_daphne, new_page, owner, machine, grant):  # noqa: F811
    from playwright.sync_api import expect

    url = live_daphne(**SHORT_TIMINGS)
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10)
    worker = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10)
    try:
        created = api.post("/api/tasks/", json={"machine": str(machine.id), "folder": grant.path, "agent": "claude",
                                                "prompt": "refactor"}, headers={"Idempotency-Key": str(uuid.uuid4())})
        task_id = created.json()["id"]
        (message,) = worker.get("/api/worker/messages/?wait=0").json()["messages"]
        worker.post(f"/api/worker/messages/{message['id']}/ack/")
        assert worker.post("/api/worker/leases/", json={"operation_id": message["operation_id"]}).status_code == 201
        # The worker goes silent: the 3 s lease lapses and the sweep makes the task unknown (L6).
        wait_for(lambda: api.get(f"/api/tasks/{task_id}/").json()["state"] == "unknown", timeout_s=15,
                 what="the task to become unknown")
        page = new_page(url, owner, **PHONE)
        page.goto(f"{url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        expect(page.locator("#decide")).to_be_visible()
        no_horizontal_scroll(page)
        page.click("#decide button[value=abandoned]")
        expect(page.locator("#task-state")).to_have_text("abandoned")
        expect(page.locator("#decide")).to_be_hidden()
        expect(page.locator("#timeline-body")).to_contain_text("owner decision: abandoned")
        task = Task.objects.get(pk=task_id)
        assert (task.state, task.decided_by_id) == ("abandoned", owner.pk) and task.decided_at is not None
        event = TaskEvent.objects.filter(task=task).last()
        assert (event.reason, event.actor) == ("owner decision: abandoned", "owner:alice")
    finally:
        api.close()
        worker.close()


def test_b9_board_task_cards_link_to_the_task_page(live_daphne, new_page, owner, machine, grant):  # noqa: F811
    url = live_daphne()
    with httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10) as api:
        task_id = api.post("/api/tasks/", json={"machine": str(machine.id), "folder": grant.path, "agent": "claude",
                                                "prompt": "p"}, headers={"Idempotency-Key": str(uuid.uuid4())}).json()["id"]
    page = new_page(url, owner)
    page.goto(url + "/")
    page.wait_for_selector(f"li[data-task-id='{task_id}'] a.task-link")
    page.click(f"li[data-task-id='{task_id}'] a.task-link")
    page.wait_for_url(f"{url}/tasks/{task_id}/")
    assert page.locator("#task-prompt").text_content() == "p"
