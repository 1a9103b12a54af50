"""The session page as a chat on a phone (SPEC T6, with T1, T2, T5, Q6, B4): headless
Chromium at 390 px against a real daphne. A session is bound to its machine through the
API as the hooks would report it; a message sent from the page reads "sent", then "with
the agent" once the machine reports its delivery through the delivery route as the
wrapper does, then a turn end carrying Claude Code's last assistant message shows the
reply under it; the delivery line in words; a pending approval answered inline; every
change arrives over the board socket (no reload); the board's session card leads here
and says in words how a message reaches the session now (T1), live.
Screenshots go to var/test-output/screenshots/."""
import uuid

import httpx
import pytest

from tests.browser import api, chromium, new_page, shot  # noqa: F401  (fixtures)
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}


def no_horizontal_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def box_on_screen(page):
    box = page.locator("#chat-text").bounding_box()
    assert box and 0 <= box["y"] and box["y"] + box["height"] <= PHONE["viewport"]["height"], box
    assert 0 <= box["x"] and box["x"] + box["width"] <= PHONE["viewport"]["width"], box


def test_t6_phone_session_chat_sent_with_the_agent_reply_delivery_line_and_approval(
        live_daphne, new_page, make_owner, make_machine):  # noqa: F811
    from playwright.sync_api import expect

    url = live_daphne()
    owner = make_owner()
    machine = make_machine(owner)
    owner_client = api(url, owner)
    machine_client = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10)
    session_id = str(uuid.uuid4())
    bound = owner_client.post("/api/sessions/", json={
        "id": session_id, "title": "fix the flaky test", "agent": "claude", "cwd": "/home/me/repo",
        "machine": str(machine.id), "channel": "terminal"})
    assert bound.status_code in (200, 201), bound.text
    marker = {"turn_id": "turn-1", "device_id": "laptop:claude:1", "device_name": "laptop"}

    board = new_page(url, owner, **PHONE)
    board.goto(f"{url}/")
    card = board.locator(f"li.session[data-session-id='{session_id}']")
    expect(card.locator(".reach")).to_have_text("A message arrives now, at the prompt.")  # T1, in words
    owner_client.post("/api/sessions/", json={"id": session_id, "machine": str(machine.id), "channel": "hook"})
    expect(card.locator(".reach")).to_have_text("A message arrives when this turn ends.")  # live
    owner_client.post("/api/sessions/", json={"id": session_id, "machine": str(machine.id), "channel": "terminal"})
    expect(card.locator(".reach")).to_have_text("A message arrives now, at the prompt.")
    no_horizontal_scroll(board)
    card.locator("a.session-link").click()
    board.wait_for_url(f"{url}/sessions/{session_id}/")

    page = new_page(url, owner, **PHONE)
    sockets, deaf = [], {"on": False, "dropped": []}

    def route(ws):  # the page's real socket, through Playwright: it can go deaf and be dropped
        server = ws.connect_to_server()

        def heard(message):
            if deaf["on"]:
                deaf["dropped"].append(str(message))
            else:
                ws.send(message)
        server.on_message(heard)
        sockets.append(ws)

    page.route_web_socket("**/ws/board/", route)
    page.goto(f"{url}/sessions/{session_id}/")
    page.wait_for_selector("#conn[data-state=live]")
    page.evaluate("window.__sameDocument = true")
    expect(page.locator("#reach")).to_have_text("A message arrives now, at the prompt.")
    expect(page.locator("#session-title")).to_have_text("fix the flaky test")
    box_on_screen(page)

    page.fill("#chat-text", "run the tests again, please")
    page.click("#chat-send")
    bubble = page.locator("#chat-log .msg[data-seq='1']")
    expect(bubble).to_have_attribute("data-state", "sent")
    expect(bubble.locator(".msg-state")).to_have_text("sent")
    expect(page.locator("#chat-text")).to_have_value("")
    box_on_screen(page)

    # The wrapper typed it: its machine reports the delivery (T3), then the turn runs.
    resp = machine_client.post(f"/api/sessions/{session_id}/messages/1/delivery/", json={"state": "delivered"})
    assert resp.status_code == 200, resp.text
    expect(bubble.locator(".msg-state")).to_have_text("with the agent")
    assert owner_client.put(f"/api/sessions/{session_id}/marker/", json={**marker, "state": "running"}).status_code == 200
    expect(page.locator("#chat-interrupt")).to_be_visible()  # T5: a turn runs under the wrapper
    expect(page.locator("#chat-log .reply[data-seq='1'] .reply-working")).to_be_visible()

    # A pending approval of this session shows inline and is answered from the chat (Q6).
    asked = owner_client.post("/api/approvals/", json={
        "key": "approval-1", "session": session_id, "agent": "claude", "tool_name": "Bash",
        "tool_input": {"command": "pytest -x", "description": "Run the tests"}})
    assert asked.status_code in (200, 201), asked.text
    approval = page.locator(f"#chat-approvals .chat-approval[data-id='{asked.json()['id']}']")
    expect(approval).to_contain_text("$ pytest -x")
    approval.locator("button.approve").click()
    expect(page.locator("#chat-approvals")).to_be_hidden()
    decided = owner_client.get(f"/api/approvals/{asked.json()['id']}/").json()
    assert decided["state"] != "pending", decided

    # The turn ends; Claude Code's Stop carries its last assistant message (T6).
    reply = "All 12 tests pass now.\nThe flaky one waited on a fixed sleep; it waits on the file now."
    ended = owner_client.put(f"/api/sessions/{session_id}/marker/",
                             json={**marker, "state": "ended", "reply": reply})
    assert ended.status_code == 200, ended.text
    expect(bubble.locator(".msg-state")).to_have_text("answered")
    shown = page.locator("#chat-log .reply[data-seq='1'] .reply-text")
    expect(shown).to_have_text(reply)
    expect(page.locator("#chat-interrupt")).to_be_hidden()
    box_on_screen(page)
    no_horizontal_scroll(page)
    shot(page, "t6-session-chat-390.png")

    # Re-bound without the wrapper: the delivery line says when now (T1), live.
    owner_client.post("/api/sessions/", json={"id": session_id, "machine": str(machine.id), "channel": "hook"})
    expect(page.locator("#reach")).to_have_text("A message arrives when this turn ends.")

    # B4: an event lost while the socket was deaf is read again on reconnect.
    reloads = page.evaluate("window.runsteadSession.reloads")
    deaf["on"] = True
    assert owner_client.post(f"/api/sessions/{session_id}/messages/", json={"text": "sent while you were away"},
                             headers={"Idempotency-Key": str(uuid.uuid4())}).status_code == 201
    # (Playwright runs the route's handlers inside its own calls: each check makes one.)
    wait_for(lambda: page.evaluate("1") and any("sent while you were away" in m for m in deaf["dropped"]), timeout_s=10,
             what="the page's socket missed the message's event")
    deaf["on"] = False
    sockets[-1].close()
    expect(page.locator("#chat-log .msg[data-seq='2']")).to_contain_text("sent while you were away")
    assert page.evaluate("window.runsteadSession.reloads") > reloads
    assert page.evaluate("window.__sameDocument") is True  # all of it without a reload
    no_horizontal_scroll(page)


def test_t6_an_unreachable_session_says_how_to_reach_it(live_daphne, new_page, make_owner):  # noqa: F811
    from playwright.sync_api import expect

    url = live_daphne()
    owner = make_owner()
    created = api(url, owner).post("/api/sessions/", json={"title": "web", "agent": "claude"}).json()
    page = new_page(url, owner, **PHONE)
    page.goto(f"{url}/")  # the board's card says it too (T1)
    expect(page.locator(f"li.session[data-session-id='{created['id']}'] .reach")).to_have_text(
        "cannot reach this session: start it with `runstead-term claude`")
    no_horizontal_scroll(page)
    page.goto(f"{url}/sessions/{created['id']}/")
    page.wait_for_selector("#conn[data-state=live]")
    expect(page.locator("#reach")).to_have_text("cannot reach this session: start it with `runstead-term claude`")
    expect(page.locator("#chat-send")).to_be_disabled()
    box_on_screen(page)
    no_horizontal_scroll(page)
