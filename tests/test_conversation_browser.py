"""The task page as a chat on a phone (SPEC C2-C5, B9): headless Debian Chromium
(Playwright) at 390 px against a real daphne, a real worker and the real Claude Code in
streaming-input mode, offline against the fake Messages API."""
import pytest

from tests.browser import chromium, new_page  # noqa: F401  (fixtures)
from tests.claude_cli import fake_model_api  # noqa: F401  (fixture)
from tests.conversation_support import conversation_setup, open_conversation, turns_started, wait_states
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.worker_harness import SHORT_TIMINGS

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}
LONG_TOOL = '[[bash:python3 -c "import time; time.sleep(60)"; echo slept]] long tool'


def no_horizontal_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def test_c2_c4_c5_phone_chat_send_interrupt_end(live_daphne, new_page, make_owner, tmp_path,  # noqa: F811
                                                fake_model_api):  # noqa: F811
    from playwright.sync_api import expect

    setup = conversation_setup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path, fake_model_api)
    try:
        task_id = open_conversation(setup, "hello from the board")
        page = new_page(setup.url, setup.owner, **PHONE)
        page.goto(f"{setup.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        page.evaluate("window.__sameDocument = true")
        chat = page.locator("#chat")
        expect(chat).to_be_visible()
        expect(page.locator("#reply")).to_be_hidden()  # messages go to the chat, not a follow-up
        first = chat.locator(".msg[data-seq='0']")
        expect(first).to_contain_text("hello from the board")
        expect(first).to_have_attribute("data-state", "answered", timeout=60000)
        expect(page.locator("#transcript")).to_contain_text("ok: hello from the board")
        # The message box fits the phone and sits on screen.
        box = page.locator("#chat-text").bounding_box()
        assert box["x"] >= 0 and box["x"] + box["width"] <= 390, box
        page.fill("#chat-text", "also update the changelog")
        page.click("#chat-send")
        second = chat.locator(".msg[data-seq='1']")
        expect(second).to_contain_text("also update the changelog")
        expect(second).to_have_attribute("data-state", "answered", timeout=60000)
        expect(page.locator("#chat-text")).to_have_value("")
        expect(page.locator("#transcript")).to_contain_text("ok: also update the changelog")
        # A long tool call: "Stop this turn" shows while it runs and stops it.
        page.fill("#chat-text", LONG_TOOL)
        page.locator("#chat-text").press("Control+Enter")
        third = chat.locator(".msg[data-seq='2']")
        expect(third).to_have_attribute("data-state", "delivered", timeout=30000)
        expect(page.locator("#chat-interrupt")).to_be_visible()
        expect(page.locator("#transcript li[data-kind=tool_call]").last).to_have_attribute(
            "data-status", "running", timeout=30000)
        page.click("#chat-interrupt")
        expect(third).to_have_attribute("data-state", "answered", timeout=30000)
        expect(page.locator("#chat-interrupt")).to_be_hidden()
        assert setup.task(task_id)["state"] == "running"
        no_horizontal_scroll(page)
        page.click("#chat-end")
        expect(page.locator("#chat-form")).to_be_hidden()
        expect(page.locator("#chat-mode")).to_have_text("ended")
        task = setup.wait_final(task_id, timeout=60)
        assert task["state"] == "succeeded", task
        assert task["agent_result"]["subtype"] == "interrupted"  # the owner's stop, not the agent failing
        expect(page.locator("#task-state")).to_have_text("succeeded")
        assert turns_started(fake_model_api) == ["hello from the board", "also update the changelog", LONG_TOOL]
        wait_states(setup, task_id, {0: "answered", 1: "answered", 2: "answered"})
        assert page.evaluate("window.__sameDocument") is True  # all of it without a reload
        no_horizontal_scroll(page)
    finally:
        setup.close()
