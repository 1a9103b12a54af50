"""SPEC Q6 in a real browser: the board's approval inbox (headless Debian Chromium driven
by Playwright against a real daphne on the test database, tests/live.py).

Approvals are asked through daphne's own API (as the hook does), so their ``approval``
events reach the page through the in-memory channel layer; answers are taps on the list
at 390 px, checked against the API afterwards."""
import re
import uuid

import pytest

from machine.hooks.mapping import session_uuid
from tests.browser import api, chromium, new_page, shot, wait_live  # noqa: F401  (fixtures)
from tests.live import module_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"width": 390, "height": 844}
DESKTOP = {"width": 1280, "height": 900}
LINGER_MS = 5000  # a row answered from the page shows its outcome this long, then goes (static/approvals.js)
BASH = {"command": "rm -rf build && make", "description": "Clean and build"}
SUGGESTIONS = [{"type": "addRules", "rules": [{"toolName": "Bash", "ruleContent": "make:*"}], "behavior": "allow",
                "destination": "session"}]
HOSTILE_COMMAND = "echo '<img src=x onerror=alert(1)>' </script><script>alert(2)</script>"
HOSTILE = {"command": HOSTILE_COMMAND, "description": "Print <b>markup</b> & </script>"}


def new_session() -> str:
    return str(session_uuid("claude", f"q6-board-{uuid.uuid4()}"))


def ask(client, *, session=None, tool_input=None, cwd="/Users/alice/src/shop", suggestions=SUGGESTIONS) -> dict:
    response = client.post("/api/approvals/", json={
        "key": f"claude:{uuid.uuid4()}", "session": session or new_session(), "agent": "claude", "tool_name": "Bash",
        "tool_input": tool_input or BASH, "cwd": cwd, "suggestions": suggestions})
    assert response.status_code == 201, response.text
    return response.json()


def decide(client, approval_id, **body):
    return client.post(f"/api/approvals/{approval_id}/decision/", json=body or {"behavior": "allow"},
                       headers={"Idempotency-Key": str(uuid.uuid4())})


def board_page(new_page, url, owner, viewport=PHONE, **options):
    """The board, live, with a clock the test can move past the inbox's linger (time
    flows as usual until it does)."""
    page = new_page(url, owner, viewport=viewport, **options)
    page.clock.install()
    page.dialogs = []
    page.on("dialog", lambda d: (page.dialogs.append(d.message), d.dismiss()))
    page.goto(url + "/")
    wait_live(page)
    return page


def row_of(page, approval_id):
    return page.locator(f"li[data-approval-id='{approval_id}']")


def past_linger(*pages):
    for page in pages:
        page.clock.fast_forward(LINGER_MS + 2000)


def test_q6_inbox_lists_live_shows_input_as_text_and_allows_from_the_list_at_390px(
        module_daphne, transactional_db, new_page, owner):
    from playwright.sync_api import expect

    url = module_daphne()
    phone = board_page(new_page, url, owner, color_scheme="light")
    assert phone.locator("#approvals").is_hidden()  # nothing pending: no inbox
    session = new_session()
    with api(url, owner) as client:
        approval = ask(client, session=session, tool_input=HOSTILE)
        row = row_of(phone, approval["id"])
        expect(row).to_be_visible()  # live: the approval event, no reload
        # The input, monospace and scrollable, as text: the characters are there, nothing ran.
        expect(row.locator("pre.approval-input")).to_have_text(HOSTILE_COMMAND)
        expect(row.locator(".description")).to_have_text(HOSTILE["description"])
        assert phone.locator("#approvals img, #approvals script, #approvals b").count() == 0
        style = row.locator("pre.approval-input").evaluate(
            "p => { const s = getComputedStyle(p); return [s.fontFamily, s.overflowY]; }")
        assert "mono" in style[0] and style[1] == "auto"
        expect(row).to_contain_text("Claude Code")
        expect(row).to_contain_text("shop")  # the folder (its session's title is the folder's name)
        expect(row).to_contain_text("/Users/alice/src/shop")
        expect(row.locator(".age")).to_contain_text(re.compile(r"\d+s ago · 9m \d+s left"))  # of 600 s (Q3)
        assert phone.title() == "(1) RunStead"
        # Above everything else; the session needs you (I6: attention approval).
        assert phone.evaluate("document.querySelector('main').firstElementChild.id") == "approvals"
        expect(phone.locator(f"li[data-session-id='{session}']")).to_have_class(re.compile(r"\bneeds-you\b"))
        expect(phone.locator("#approvals-count")).to_have_text("1")
        assert phone.evaluate("document.documentElement.scrollWidth") <= PHONE["width"]  # B6: no sideways scroll

        second = ask(client, tool_input={"file_path": "/Users/alice/src/shop/.env", "content": "X=1"})
        expect(row_of(phone, second["id"])).to_be_visible()
        expect(phone.locator("#approvals-count")).to_have_text("2")
        shot(phone, "q6-inbox-phone-light.png")
        light_bg = phone.evaluate("getComputedStyle(document.body).backgroundColor")
        phone.emulate_media(color_scheme="dark")
        assert phone.evaluate("getComputedStyle(document.body).backgroundColor") != light_bg
        shot(phone, "q6-inbox-phone-dark.png")
        phone.emulate_media(color_scheme="light")
        phone.set_viewport_size(DESKTOP)
        expect(phone.locator("#approvals")).to_have_css("grid-column-start", "1")
        shot(phone, "q6-inbox-desktop.png")
        phone.set_viewport_size(PHONE)
        other = board_page(new_page, url, owner)  # another device, live
        expect(row_of(other, approval["id"])).to_be_visible()

        row.locator("button.allow").click()
        expect(row.locator(".outcome")).to_have_text("Allowed by you")
        expect(row.locator("button.allow")).to_be_hidden()
        decided = client.get(f"/api/approvals/{approval['id']}/").json()
        assert (decided["state"], decided["decided_by"], decided["scope"]) == ("allowed", "owner:alice", "once")
        expect(row_of(other, approval["id"])).to_have_count(0)  # answered elsewhere: dropped at once (Q4)
        past_linger(phone)
        expect(row).to_have_count(0)
        expect(row_of(phone, second["id"])).to_be_visible()  # the other one still waits
        expect(phone.locator("#approvals-count")).to_have_text("1")
    assert phone.dialogs == [] and other.dialogs == []


def test_q6_deny_with_an_instruction_and_allow_for_this_session_from_the_list(
        module_daphne, transactional_db, new_page, owner):
    from playwright.sync_api import expect

    url = module_daphne()
    phone = board_page(new_page, url, owner)
    with api(url, owner) as client:
        denied, for_session = ask(client), ask(client)
        row = row_of(phone, denied["id"])
        expect(row.locator(".deny-box")).to_be_hidden()
        row.locator("button.deny").click()  # reveals the instruction field
        field = row.locator("textarea[name=message]")
        expect(field).to_be_visible()
        expect(field).to_be_focused()
        expect(row.locator("button.deny")).to_be_hidden()  # one Deny at a time: the one that sends
        expect(row.locator("button.allow")).to_be_hidden()
        field.fill("use make clean, never rm -rf")
        shot(phone, "q6-inbox-phone-deny.png")
        row.locator("button.send-deny").click()
        expect(row.locator(".outcome")).to_have_text("Denied by you: “use make clean, never rm -rf”")
        body = client.get(f"/api/approvals/{denied['id']}/").json()
        assert (body["state"], body["message"], body["decided_by"]) == (
            "denied", "use make clean, never rm -rf", "owner:alice")

        other = row_of(phone, for_session["id"])
        other.locator("button.allow-session").click()
        expect(other.locator(".outcome")).to_have_text("Allowed for this session by you")
        body = client.get(f"/api/approvals/{for_session['id']}/").json()
        assert (body["state"], body["scope"]) == ("allowed", "session")

        # Without suggestions there is no rule to keep for the session: only Allow and Deny.
        bare = ask(client, suggestions=[])
        expect(row_of(phone, bare["id"]).locator("button.allow")).to_be_visible()
        expect(row_of(phone, bare["id"]).locator("button.allow-session")).to_have_count(0)
    assert phone.dialogs == []


def test_q6_two_phones_tap_at_once_one_wins_the_other_shows_the_winners_answer(
        module_daphne, transactional_db, new_page, owner):
    from playwright.sync_api import expect

    from sessions_app.models import Approval
    from tasks_app.models import IdempotencyRecord

    url = module_daphne()
    first, second = board_page(new_page, url, owner), board_page(new_page, url, owner)
    with api(url, owner) as client:
        approval = ask(client)
    for page in (first, second):
        expect(row_of(page, approval["id"]).locator("button.allow")).to_be_visible()
    tap = "sel => document.querySelector(sel).click()"
    selector = f"li[data-approval-id='{approval['id']}'] "
    first.evaluate(tap, selector + "button.allow")  # returns once the request is on its way
    second.evaluate(tap, selector + "button.allow-session")
    outcomes = []
    for page in (first, second):
        out = row_of(page, approval["id"]).locator(".outcome")
        expect(out).to_have_text(re.compile(r"^(Already decided: )?Allowed.* by (you|alice)$"))
        outcomes.append(out.text_content())
    row = Approval.objects.get(pk=approval["id"])
    assert row.state == "allowed" and row.decided_by == "owner:alice"
    winner_text = "Allowed for this session by" if row.scope == "session" else "Allowed by"
    mine = [text for text in outcomes if text.endswith("by you")]
    theirs = [text for text in outcomes if not text.endswith("by you")]
    assert len(mine) == 1 and len(theirs) == 1, outcomes  # one winner, the other learnt it
    assert mine[0] == f"{winner_text} you"
    assert theirs[0] in (f"Already decided: {winner_text} alice", f"{winner_text} alice")
    assert (outcomes.index(mine[0]) == 0) == (row.scope == "once")  # the winner's own choice
    assert IdempotencyRecord.objects.filter(scope=f"approval:{approval['id']}", response_status=200).count() == 1


def test_q6_a_board_that_reconnects_shows_what_is_still_pending(module_daphne, transactional_db, new_page, owner):
    """The page's socket is routed to nothing (no event reaches it): only the B4
    hydration of each (re)connect brings approvals in and takes answered ones out."""
    from playwright.sync_api import expect

    url = module_daphne()
    page = new_page(url, owner, viewport=PHONE)
    page.clock.install()
    sockets = []
    page.route_web_socket("**/ws/board/", lambda ws: sockets.append(ws))  # open, but never connected on
    page.goto(url + "/")
    wait_live(page)
    with api(url, owner) as client:
        waiting, answered = ask(client), ask(client)
        assert decide(client, answered["id"]).status_code == 200
        hydrations = page.evaluate("window.runsteadBoard.hydrations")
        assert row_of(page, waiting["id"]).count() == 0  # no event came
        sockets[-1].close()  # the connection drops; the board reconnects and hydrates
        page.wait_for_function(f"window.runsteadBoard.hydrations > {hydrations}")
        expect(row_of(page, waiting["id"])).to_be_visible()
        expect(row_of(page, answered["id"])).to_have_count(0)

        assert decide(client, waiting["id"], behavior="deny").status_code == 200
        hydrations = page.evaluate("window.runsteadBoard.hydrations")
        sockets[-1].close()
        page.wait_for_function(f"window.runsteadBoard.hydrations > {hydrations}")
        expect(row_of(page, waiting["id"])).to_have_count(0)  # answered elsewhere: dropped at once (Q4)
        expect(page.locator("#approvals")).to_be_hidden()


def test_q6_a_tasks_approval_names_its_machine_links_the_task_and_allows_for_the_run(
        module_daphne, transactional_db, new_page, owner, machine, grant):
    from playwright.sync_api import expect

    from tests.conftest import owner_api
    from tests.factories import grant_lease, receipt, submit

    task_id = submit(owner, machine, grant.path, prompt="upgrade the dependencies").json()["id"]
    assert grant_lease(machine, task_id).status_code == 201
    assert receipt(machine, task_id, "running", {"pid": 4242, "pgid": 4242, "process_start_time": 1.0}).status_code == 200
    asked = owner_api(owner).post("/api/approvals/", {
        "key": f"task:{uuid.uuid4()}", "task": task_id, "agent": "claude", "tool_name": "Bash", "tool_input": BASH,
        "cwd": grant.path}, format="json")
    assert asked.status_code == 201, asked.content
    url = module_daphne()
    page = board_page(new_page, url, owner)  # the page's embedded snapshot lists it (B4)
    row = row_of(page, asked.json()["id"])
    expect(row.locator("a.where")).to_have_text(re.compile(r"^task on laptop"))
    assert row.locator("a.where").get_attribute("href") == f"/tasks/{task_id}/"
    expect(page.locator(f"li[data-task-id='{task_id}']")).to_contain_text("waiting for you")
    row.locator("button.allow-session").click()
    expect(row.locator(".outcome")).to_have_text("Allowed for this run by you")
    with api(url, owner) as client:
        body = client.get(f"/api/approvals/{asked.json()['id']}/").json()
        assert (body["state"], body["scope"]) == ("allowed", "session")
        assert client.get(f"/api/tasks/{task_id}/").json()["state"] == "running"
    expect(page.locator(f"li[data-task-id='{task_id}']")).not_to_contain_text("waiting for you")
    assert page.dialogs == []


# Wraps the real Notification constructor so the test sees every call the page makes.
CAPTURE_NOTIFICATIONS = """
(() => {
  const Real = window.Notification;
  window.__notes = [];
  function Captured(title, options) {
    window.__notes.push({title: title, tag: options.tag, body: options.body, silent: !!options.silent});
    return new Real(title, options);
  }
  Object.defineProperty(Captured, "permission", {get: () => Real.permission});
  Captured.requestPermission = (...a) => Real.requestPermission(...a);
  window.Notification = Captured;
})();
"""


def test_q6_the_open_boards_notification_of_a_question_is_replaced_by_its_answer(
        module_daphne, transactional_db, new_page, owner):
    """N2's board channel, kind approval: the question and its answer carry the approval
    id as their tag, so the answer replaces the question (quietly) on this device."""
    url = module_daphne()
    page = new_page(url, owner, viewport=PHONE, permissions=["notifications"])
    page.add_init_script(CAPTURE_NOTIFICATIONS)
    page.goto(url + "/")
    wait_live(page)
    with api(url, owner) as client:
        approval = ask(client)
        page.wait_for_function("window.__notes.length === 1")
        row_of(page, approval["id"]).locator("button.allow").click()
        page.wait_for_function("window.__notes.length === 2")
    question, answer = page.evaluate("window.__notes")
    assert question == {"title": "Bash waits for your approval", "tag": approval["id"], "silent": False,
                        "body": "shop\nrm -rf build && make"}
    assert answer == {"title": "Bash: allowed", "tag": approval["id"], "silent": True, "body": "by alice"}
