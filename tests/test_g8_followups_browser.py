"""Queued follow-ups in a real browser (SPEC G8, B1, B9, Q5): headless Debian Chromium
(Playwright) against a real daphne, at phone size. While a task is still working, its
page's reply box says the instruction "will run next" and queues it; the board's card of
that task shows the queue ("1 queued" and the next prompt); the card says "waiting for
you" once an approval of the task is pending."""
import uuid

import httpx
import pytest

from tasks_app.models import Task
from tests.browser import chromium, new_page, shot, wait_live  # noqa: F401  (fixtures)
from tests.live import live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}


def no_horizontal_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def test_g8_the_reply_box_of_a_running_task_queues_the_next_instruction_and_the_card_shows_the_queue(
        live_daphne, new_page, owner, machine, grant):  # noqa: F811
    from playwright.sync_api import expect

    url = live_daphne()
    api = httpx.Client(base_url=url, headers={"Authorization": f"Token {owner.auth_token.key}"}, timeout=10)
    worker = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10)
    try:
        task_id = api.post("/api/tasks/", json={"machine": str(machine.id), "folder": grant.path, "agent": "claude",
                                                "prompt": "refactor the parser"},
                           headers={"Idempotency-Key": str(uuid.uuid4())}).json()["id"]
        (message,) = worker.get("/api/worker/messages/?wait=0").json()["messages"]
        worker.post(f"/api/worker/messages/{message['id']}/ack/")
        assert worker.post("/api/worker/leases/", json={"operation_id": message["operation_id"]}).status_code == 201

        page = new_page(url, owner, **PHONE)
        page.goto(f"{url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        expect(page.locator("#task-state")).to_have_text("starting")
        expect(page.locator("#reply")).to_be_visible()
        expect(page.locator("#reply-label")).to_contain_text("will run next")
        page.fill("#reply-prompt", "then add tests for <script>alert(1)</script>")
        page.click("#reply-button")
        expect(page.locator("#reply-status")).to_have_text("Queued: it will run next.")
        expect(page.locator("#reply-queue li")).to_have_count(1)
        expect(page.locator("#reply-queue li")).to_contain_text("then add tests for <script>")  # as text
        queued = Task.objects.get(continued_from_id=task_id)
        assert (queued.state, str(queued.queued_behind_id), queued.reserved_s) == ("queued", task_id, 0)
        assert queued.prompt == "then add tests for <script>alert(1)</script>"
        no_horizontal_scroll(page)
        shot(page, "g8-task-page-reply-queued-phone.png")

        page.goto(url + "/")
        wait_live(page)
        card = page.locator(f"li[data-task-id='{task_id}']")
        expect(card.locator(".queued-count")).to_have_text("1 queued")
        expect(card.locator(".queued-prompt")).to_contain_text("next: then add tests for <script>")
        queued_card = page.locator(f"li[data-task-id='{queued.pk}']")
        expect(queued_card.locator(".badge.state-queued")).to_have_text("queued")
        expect(queued_card).to_contain_text("will run after")
        # Q5 on the card: an approval of the task pending -> "waiting for you", live.
        asked = api.post("/api/approvals/", json={"key": f"k-{uuid.uuid4()}", "task": task_id, "agent": "claude",
                                                  "tool_name": "Bash", "tool_input": {"command": "make"},
                                                  "cwd": grant.path})
        assert asked.status_code == 201, asked.text
        expect(card.locator(".badge.needs-you")).to_have_text("waiting for you")
        expect(card).to_contain_text("an approval is pending")
        no_horizontal_scroll(page)
        shot(page, "g8-board-card-queue-phone.png")
    finally:
        api.close()
        worker.close()
