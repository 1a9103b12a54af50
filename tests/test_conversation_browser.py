"""The task page as a chat on a phone (SPEC C2-C6, B9): headless Debian Chromium
(Playwright) at 390 px against a real daphne and a real worker running the demo's live
profile (``fake-claude``) or the real Claude Code in streaming-input mode, offline against
the fake Messages API. Screenshots go to var/test-output/screenshots/."""
import pytest

from tests.browser import chromium, new_page, shot  # noqa: F401  (fixtures)
from tests.claude_cli import fake_model_api  # noqa: F401  (fixture)
from tests.conversation_support import (conversation_setup, fake_claude_setup, open_conversation, turns_started,
                                        wait_states)
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


VIEWPORT_H = PHONE["viewport"]["height"]


def box_on_screen(page):
    """The message box is inside the viewport, and the newest bubble is not under it."""
    box = page.locator("#chat-text").bounding_box()
    assert box and box["y"] >= 0 and box["y"] + box["height"] <= VIEWPORT_H, box
    assert box["x"] >= 0 and box["x"] + box["width"] <= PHONE["viewport"]["width"], box
    newest, form = page.evaluate("""[document.querySelector('#chat-log').lastElementChild.getBoundingClientRect().bottom,
                                     document.querySelector('#chat-form').getBoundingClientRect().top]""")
    assert newest <= form + 1, (newest, form)


def test_c2_c4_b9_phone_chat_replies_under_their_messages_box_in_view_stopped_by_you(
        live_daphne, new_page, make_owner, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    setup = fake_claude_setup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path)
    try:
        task_id = setup.submit("fake-claude", prompt="look around the repository", mode="conversation")
        page = new_page(setup.url, setup.owner, **PHONE)
        page.goto(f"{setup.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        chat = page.locator("#chat-log")
        # The chat comes first; the run's transcript, timeline and receipts are one tap away.
        expect(page.locator("#run-details")).not_to_have_attribute("open", "")
        expect(page.locator("#transcript")).to_be_hidden()
        expect(page.locator("#task-prompt")).to_be_hidden()
        expect(chat.locator(".reply[data-seq='0']")).to_contain_text(
            "Done: 'look around the repository' is handled", timeout=30000)
        texts = ["also update the changelog", "now the readme, please", "and a summary at the end"]
        for seq, text in enumerate(texts, start=1):
            page.fill("#chat-text", text)
            page.click("#chat-send")
            bubble = chat.locator(f".msg[data-seq='{seq}']")
            expect(bubble).to_contain_text(text)
            box_on_screen(page)
            expect(bubble).to_have_attribute("data-state", "answered", timeout=30000)
            expect(bubble.locator(".msg-state")).to_have_text("answered")
            reply = chat.locator(f".reply[data-seq='{seq}']")
            expect(reply).to_contain_text(f"Done: {text!r} is handled")
            expect(reply).not_to_contain_text("look around the repository")  # no other turn's words
            tools = reply.locator("details.reply-tool")
            expect(tools).to_have_count(1)  # the tool call, folded into one line
            expect(tools.locator("summary")).to_contain_text("Bash")
            box_on_screen(page)
            # The thread alternates: this reply comes right after its message.
            assert page.evaluate(f"document.querySelector(\".msg[data-seq='{seq}']\").nextElementSibling"
                                 f".matches(\".reply[data-seq='{seq}']\")")
        shot(page, "c2-chat-three-turns-390.png")
        # The board's card of the conversation between turns: waiting for you, no timer.
        board = new_page(setup.url, setup.owner, **PHONE)
        board.goto(f"{setup.url}/")
        card = board.locator(f"li.task[data-task-id='{task_id}']")
        expect(card.locator(".conversation-waiting")).to_contain_text("waiting for you")
        expect(card).not_to_contain_text("running for")
        shot(board, "c6-board-waiting-for-you-390.png")
        # Stop a turn while its tool call runs: "stopped by you", not the CLI's raw lines.
        page.fill("#chat-text", "a long one")
        page.click("#chat-send")
        fourth = chat.locator(".reply[data-seq='4']")
        expect(fourth.locator("details.reply-tool")).to_have_count(1, timeout=30000)
        page.click("#chat-interrupt")
        expect(fourth.locator(".reply-stopped")).to_have_text("stopped by you", timeout=30000)
        expect(chat).not_to_contain_text("Request interrupted")
        expect(chat).not_to_contain_text("error_during_execution")
        box_on_screen(page)
        no_horizontal_scroll(page)
        shot(page, "c4-chat-stopped-by-you-390.png")
        # The full transcript is still there, one tap away.
        page.click("#run-details > summary")
        expect(page.locator("#transcript")).to_be_visible()
        expect(page.locator("#receipts-body")).not_to_contain_text("{")
        page.click("#chat-end")
        task = setup.wait_final(task_id, timeout=60)
        assert task["state"] == "succeeded", task
        assert task["usage"]["turns"] >= 9, task["usage"]  # G2: every turn counted
        no_horizontal_scroll(page)
    finally:
        setup.close()


def test_c10_phone_chat_withdraw_and_edit_a_waiting_message(live_daphne, new_page, make_owner, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    setup = fake_claude_setup(live_daphne(**SHORT_TIMINGS), make_owner(), tmp_path, pause_s=3.0)
    try:
        task_id = setup.submit("fake-claude", prompt="look around the repository", mode="conversation")
        page = new_page(setup.url, setup.owner, **PHONE)
        page.goto(f"{setup.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        chat = page.locator("#chat")
        expect(chat.locator(".msg[data-seq='0']")).to_have_attribute("data-state", "delivered", timeout=30000)
        # Turn 0 runs (two model turns 3 s apart): what is sent now waits on the machine.
        for seq, text in ((1, "delete everything"), (2, "first draft")):
            page.fill("#chat-text", text)
            page.click("#chat-send")
            expect(chat.locator(f".msg[data-seq='{seq}']")).to_have_attribute("data-state", "sent")
        expect(chat.locator(".msg[data-seq='0'] .msg-withdraw")).to_have_count(0)  # the prompt: no
        chat.locator(".msg[data-seq='1'] .msg-withdraw").click()
        expect(chat.locator(".msg[data-seq='1']")).to_have_attribute("data-state", "withdrawn")
        expect(chat.locator(".msg[data-seq='1'] .msg-state")).to_have_text("withdrawn")
        expect(chat.locator(".msg[data-seq='1'] .msg-withdraw")).to_have_count(0)
        chat.locator(".msg[data-seq='2'] .msg-edit").click()
        expect(chat.locator(".msg[data-seq='2']")).to_have_attribute("data-state", "withdrawn")
        expect(page.locator("#chat-text")).to_have_value("first draft")
        page.fill("#chat-text", "second draft")
        page.click("#chat-send")
        third = chat.locator(".msg[data-seq='3']")
        expect(third).to_have_attribute("data-state", "answered", timeout=60000)
        expect(third.locator(".msg-withdraw")).to_have_count(0)
        shot(page, "c10-withdraw-edit.png")
        no_horizontal_scroll(page)
        got = wait_states(setup, task_id, {0: "answered", 1: "withdrawn", 2: "withdrawn", 3: "answered"})
        assert [m["text"] for m in got if m["state"] == "answered"] == ["look around the repository", "second draft"]
    finally:
        setup.close()
