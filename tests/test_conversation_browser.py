"""The task page as a chat on a phone (SPEC C2-C6, B9): headless Debian Chromium
(Playwright) at 390 px against a real daphne and a real worker running the demo's live
profile (``fake-claude``) or the real Claude Code in streaming-input mode, offline against
the fake Messages API. Screenshots go to var/test-output/screenshots/."""
import re
import uuid

import pytest

from tests.browser import chromium, new_page, shot  # noqa: F401  (fixtures)
from tests.claude_cli import fake_model_api  # noqa: F401  (fixture)
from tests.conversation_support import (conversation_setup, fake_claude_setup, open_conversation, turns_started,
                                        wait_states)
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.worker_harness import BROWSER_TIMINGS

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}
LONG_TOOL = '[[bash:python3 -c "import time; time.sleep(60)"; echo slept]] long tool'


def no_horizontal_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def test_c2_c4_c5_b9_phone_chat_with_the_real_claude_code(live_daphne, new_page, make_owner, tmp_path,  # noqa: F811
                                                          fake_model_api):  # noqa: F811
    """The real Claude Code in streaming-input mode (offline, fake Messages API): three
    messages sent from the page, each reply under its message, the box on screen after
    every send, "waiting for you" on the board between turns, a stopped turn reads
    "stopped by you", no horizontal scroll; screenshots kept."""
    from playwright.sync_api import expect

    setup = conversation_setup(live_daphne(**BROWSER_TIMINGS), make_owner(), tmp_path, fake_model_api)
    try:
        task_id = open_conversation(setup, "hello from the board")
        page = new_page(setup.url, setup.owner, **PHONE)
        page.goto(f"{setup.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        page.evaluate("window.__sameDocument = true")
        chat = page.locator("#chat-log")
        expect(page.locator("#chat")).to_be_visible()
        expect(page.locator("#reply")).to_be_hidden()  # messages go to the chat, not a follow-up
        expect(page.locator("#transcript")).to_be_hidden()  # one tap away, under Run details
        first = chat.locator(".msg[data-seq='0']")
        expect(first).to_contain_text("hello from the board")
        expect(first).to_have_attribute("data-state", "answered", timeout=60000)
        expect(chat.locator(".reply[data-seq='0']")).to_contain_text("ok: hello from the board")
        box_on_screen(page)
        board = new_page(setup.url, setup.owner, **PHONE)
        texts = ["also update the changelog", "now the readme, please", "and a summary at the end"]
        for seq, text in enumerate(texts, start=1):
            page.fill("#chat-text", text)
            page.click("#chat-send")
            bubble = chat.locator(f".msg[data-seq='{seq}']")
            expect(bubble).to_contain_text(text)
            box_on_screen(page)
            expect(bubble).to_have_attribute("data-state", "answered", timeout=60000)
            expect(bubble.locator(".msg-state")).to_have_text("answered")
            expect(page.locator("#chat-text")).to_have_value("")
            reply = chat.locator(f".reply[data-seq='{seq}']")
            expect(reply).to_contain_text(f"ok: {text}")
            expect(reply).not_to_contain_text("hello from the board")  # no other turn's words
            assert page.evaluate(f"document.querySelector(\".msg[data-seq='{seq}']\").nextElementSibling"
                                 f".matches(\".reply[data-seq='{seq}']\")")
            box_on_screen(page)
            # Between turns the board's card says the agent waits, not a timer.
            board.goto(f"{setup.url}/")
            card = board.locator(f"li.task[data-task-id='{task_id}']")
            expect(card.locator(".conversation-waiting")).to_contain_text("waiting for you")
            expect(card).not_to_contain_text("running for")
        no_horizontal_scroll(page)
        shot(page, "c2-real-claude-chat-three-turns-390.png")
        shot(board, "c6-real-claude-board-waiting-for-you-390.png")
        # A long tool call: "Stop this turn" shows while it runs and stops it.
        page.fill("#chat-text", LONG_TOOL)
        page.locator("#chat-text").press("Control+Enter")
        stopped = chat.locator(".msg[data-seq='4']")
        expect(stopped).to_have_attribute("data-state", "delivered", timeout=30000)
        expect(stopped.locator(".msg-state")).to_have_text("with the agent")
        box_on_screen(page)
        reply = chat.locator(".reply[data-seq='4']")
        expect(reply.locator("details.reply-tool")).to_have_count(1, timeout=30000)  # the tool call, one line
        expect(page.locator("#chat-interrupt")).to_be_visible()
        page.click("#chat-interrupt")
        expect(reply.locator(".reply-stopped")).to_have_text("stopped by you", timeout=30000)
        expect(stopped).to_have_attribute("data-state", "answered", timeout=30000)
        expect(page.locator("#chat-interrupt")).to_be_hidden()
        expect(chat).not_to_contain_text("Request interrupted")
        expect(chat).not_to_contain_text("error_during_execution")
        assert setup.task(task_id)["state"] == "running"
        box_on_screen(page)
        no_horizontal_scroll(page)
        shot(page, "c4-real-claude-stopped-by-you-390.png")
        page.click("#chat-end")
        expect(page.locator("#chat-form")).to_be_hidden()
        expect(page.locator("#chat-mode")).to_have_text("ended")
        task = setup.wait_final(task_id, timeout=60)
        assert task["state"] == "succeeded", task
        assert task["agent_result"]["subtype"] == "interrupted"  # the owner's stop, not the agent failing
        expect(page.locator("#task-state")).to_have_text("succeeded")
        assert turns_started(fake_model_api) == ["hello from the board", *texts, LONG_TOOL]
        wait_states(setup, task_id, {seq: "answered" for seq in range(5)})
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

    setup = fake_claude_setup(live_daphne(**BROWSER_TIMINGS), make_owner(), tmp_path, slow_prompt="a long one")
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


UUID = r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"
LONG_MESSAGE = "\n".join(f"line {n} of a long message" for n in range(1, 41))


def pending_approval(task_id: str, machine_id: str):
    """A pending Edit approval of the task, as the task's hook would have asked it (Q2)."""
    from datetime import timedelta

    from core import clock
    from sessions_app.models import Approval
    from tasks_app.models import Task

    task = Task.objects.get(pk=task_id)
    now = clock.now()
    return Approval.objects.create(
        owner=task.owner, key=f"test:{task_id}", task=task, machine_id=machine_id, agent="claude",
        tool_name="Edit", tool_input={"file_path": "/repo/CHANGELOG.md", "old_string": "## 1.0",
                                      "new_string": "## 1.1\n- the chat"},
        tool_input_digest="0" * 64, created_at=now, expires_at=now + timedelta(minutes=10))


def not_alarming(page, seq: int) -> str:
    """Message ``seq``'s state, read at once with its colour, which is not an error's red."""
    text, color = page.evaluate("s => { const e = document.querySelector(`.msg[data-seq='${s}'] .msg-state`);"
                                " return [e.textContent, getComputedStyle(e).color]; }", seq)
    r, g, b = map(int, re.findall(r"\d+", color)[:3])
    assert not (r > 150 and g < 110 and b < 110), (text, color)
    return text


def test_c2_c7_b9_newcomer_sees_words_not_ids_states_in_words_long_message_folded_approval_shows_change(
        live_daphne, new_page, make_owner, tmp_path):  # noqa: F811
    """Issue 40's "words, not codes" as a newcomer reads the page: no UUID or JSON on it
    until "Run details" is opened, and there machines by name; the message states
    "sent", "with the agent", "answered", "not delivered" in colours that do not alarm;
    a 40-line message folded (its bubble shorter than the screen, "Show all" opens it);
    an approval in the chat shows the file and its edit as - / + lines."""
    from playwright.sync_api import expect

    setup = fake_claude_setup(live_daphne(**BROWSER_TIMINGS), make_owner(), tmp_path, pause_s=3)
    try:
        task_id = setup.submit("fake-claude", prompt="look around the repository", mode="conversation")
        wait_states(setup, task_id, {0: "answered"})
        pending_approval(task_id, setup.machine_id)
        page = new_page(setup.url, setup.owner, **PHONE)
        page.goto(f"{setup.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        chat = page.locator("#chat-log")
        expect(chat.locator(".msg[data-seq='0'] .msg-state")).to_have_text("answered")
        assert not_alarming(page, 0) == "answered"
        # Everything agent-controlled reads as isolated text (C7): a reply's direction its own.
        isolation = page.evaluate("""[...document.querySelectorAll('#chat-log .reply-text, #chat-log .msg-text')]
            .map(e => [getComputedStyle(e).unicodeBidi, e.getAttribute('dir')])""")
        assert isolation and all(pair == ["isolate", "auto"] for pair in isolation), isolation
        # The approval says what will change, in words: the file, the edit as - / + lines.
        approval = page.locator("#chat-approvals .chat-approval")
        expect(approval).to_contain_text("Edit")
        expect(approval).to_contain_text("/repo/CHANGELOG.md")
        expect(approval.locator(".approval-change")).to_have_text("- ## 1.0\n+ ## 1.1\n+ - the chat")
        expect(approval).not_to_contain_text("{")
        expect(approval.locator("ol, ul")).to_have_count(0)  # no stray list numbering
        # Words, not codes: nothing on the page reads as a UUID or JSON until the details open.
        text = page.evaluate("document.body.innerText")
        assert not re.search(UUID, text), re.findall(UUID, text)
        assert '{"' not in text, text
        shot(page, "q2-chat-approval-shows-the-change-390.png")
        page.click("#chat-approvals .chat-approval .deny")
        expect(approval).to_have_count(0)
        # A long message folds: the bubble stays shorter than the screen, "Show all" opens it.
        page.fill("#chat-text", LONG_MESSAGE)
        page.click("#chat-send")
        long = chat.locator(".msg[data-seq='1']")
        expect(long.locator(".msg-state")).to_have_text("with the agent", timeout=30000)
        assert not_alarming(page, 1) == "with the agent"
        expect(long.locator(".msg-text")).to_have_class(re.compile(r"\bfolded\b"))
        height = page.evaluate("document.querySelector(\".msg[data-seq='1']\").getBoundingClientRect().height")
        assert 0 < height < VIEWPORT_H / 2, height
        # A message sent during a turn waits on the machine: "sent".
        page.fill("#chat-text", "and then the tests")
        page.click("#chat-send")
        waiting = chat.locator(".msg[data-seq='2']")
        expect(waiting.locator(".msg-state")).to_have_text("sent")
        assert not_alarming(page, 2) == "sent"
        box_on_screen(page)
        shot(page, "c2-chat-states-and-fold-390.png")
        long.get_by_role("button", name="Show all").click()
        expect(long.locator(".msg-text")).not_to_have_class(re.compile(r"\bfolded\b"))
        expect(long).to_contain_text("line 40 of a long message")
        # The task ends before it is written: "not delivered".
        cancel = setup.api.post(f"/api/tasks/{task_id}/cancel/", headers={"Idempotency-Key": str(uuid.uuid4())})
        assert cancel.status_code in (200, 202), cancel.text
        expect(waiting.locator(".msg-state")).to_have_text("not delivered", timeout=30000)
        assert not_alarming(page, 2) == "not delivered"
        setup.wait_final(task_id, timeout=60)
        # One tap away: the timeline and receipts, machines by name, no JSON.
        page.click("#run-details > summary")
        expect(page.locator("#timeline-body")).to_contain_text("test-laptop")
        details = page.evaluate("document.querySelector('#run-details').innerText")
        assert not re.search(r"machine:\s*" + UUID, details), details
        expect(page.locator("#receipts-body")).not_to_contain_text('{"')
        header = page.locator("#task-facts").inner_text() + page.locator(".card").first.inner_text()
        assert setup.machine_id not in header and "test-laptop" in header, header
        no_horizontal_scroll(page)
        shot(page, "c2-chat-run-details-390.png")
    finally:
        setup.close()


def test_c9_c10_phone_chat_withdraw_and_edit_a_waiting_message_and_send_one_now(live_daphne, new_page, make_owner, tmp_path):  # noqa: F811
    from playwright.sync_api import expect

    setup = fake_claude_setup(live_daphne(**BROWSER_TIMINGS), make_owner(), tmp_path, pause_s=3.0)
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
        # C9: the composer offers "next" (the default) or "now"; each bubble says which.
        expect(third.locator(".msg-delivery")).to_have_text("next")
        page.check("#chat-delivery input[value=steer]")
        page.fill("#chat-text", "now, please")
        page.click("#chat-send")
        fourth = chat.locator(".msg[data-seq='4']")
        expect(fourth).to_have_attribute("data-delivery", "steer")
        expect(fourth.locator(".msg-delivery")).to_have_text("now")
        expect(page.locator("#chat-delivery input[value=queue]")).to_be_checked()  # back to the default
        expect(fourth).not_to_have_attribute("data-state", "sent", timeout=30000)  # no turn ran: written at once
        shot(page, "c10-withdraw-edit.png")
        no_horizontal_scroll(page)
        got = wait_states(setup, task_id, {0: "answered", 1: "withdrawn", 2: "withdrawn", 3: "answered"})
        assert [m["text"] for m in got if m["state"] == "answered"] == ["look around the repository", "second draft"]
        assert got[4]["delivery"] == "steer"
    finally:
        setup.close()
