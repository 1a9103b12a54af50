"""History (B11) and follow-ups (B12) on the board in a real browser: headless Debian
Chromium against a real daphne (tests/live.py), at 390x844 and on a desktop, light and
dark (B6)."""
import uuid

import pytest

from tests.browser import SCREENSHOTS, api, chromium, new_page, shot, wait_live  # noqa: F401  (fixtures)
from tests.live import live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True}
PAGE_SIZE = 20  # static/history.js


def submit(url, owner, machine, grant, prompt):
    """POST /api/tasks/ to the live daphne (so its board pushes the task), 60 s each so a
    long history stays inside the default budget."""
    with api(url, owner) as client:
        response = client.post("/api/tasks/", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
            "machine": str(machine.id), "folder": grant.path, "agent": "demo", "prompt": prompt,
            "exclusive": False, "max_runtime_s": 60})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def make_history(url, owner, machine, grant, count):
    """``count`` tasks "task 00".., every fifth cancelled, and one "find the needle"; returns
    their ids in the documented order (newest first, ties broken by id)."""
    from tasks_app.models import Task

    for i in range(count):
        task_id = submit(url, owner, machine, grant, f"task {i:02d}")
        if i % 5 == 0:
            with api(url, owner) as client:
                assert client.post(f"/api/tasks/{task_id}/cancel/").status_code == 200
    submit(url, owner, machine, grant, "find the needle here")
    return [str(t.id) for t in Task.objects.order_by("-created_at", "-id")]


def panel_shot(page, name):
    """The history panel alone (the whole board is a very long picture)."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.locator("#history-panel").screenshot(path=str(SCREENSHOTS / name))


def listed(page):
    return page.eval_on_selector_all("#history-list > li", "els => els.map(e => e.dataset.historyTaskId)")


def assert_phone_layout(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths
    small = page.evaluate("""Array.from(document.querySelectorAll(
            '#history-panel button, #history-panel select, #history-panel input, #history-panel summary, #history-panel textarea'))
        .filter(e => e.offsetParent !== null && e.getBoundingClientRect().height < 44).map(e => e.outerHTML.slice(0, 80))""")
    assert small == []


def test_b11_history_pages_with_load_more_filters_by_state_and_searches(live_daphne, new_page, owner, machine, grant):
    from playwright.sync_api import expect

    from tasks_app.models import Task

    url = live_daphne()
    order = make_history(url, owner, machine, grant, 25)
    page = new_page(url, owner, **PHONE)
    page.goto(url + "/")
    wait_live(page)
    rows = page.locator("#history-list > li")
    expect(rows).to_have_count(PAGE_SIZE)
    assert listed(page) == order[:PAGE_SIZE]
    more = page.locator("#history-more")
    expect(more).to_be_visible()
    # Keyboard: the button is reachable and Enter loads the next page on the cursor.
    more.focus()
    page.keyboard.press("Enter")
    expect(rows).to_have_count(len(order))
    assert listed(page) == order  # the next page, in order, none repeated
    expect(more).to_be_hidden()
    expect(page.locator("#history-status")).to_have_text(f"{len(order)} tasks shown, all of them")
    assert_phone_layout(page)
    panel_shot(page, "history-phone.png")

    page.locator("#history-filters select[name=state]").select_option("cancelled")
    cancelled = [str(t.id) for t in Task.objects.filter(state="cancelled").order_by("-created_at", "-id")]
    expect(rows).to_have_count(len(cancelled))
    assert listed(page) == cancelled and len(cancelled) == 5
    expect(rows.locator(".badge.state-accepted")).to_have_count(0)
    expect(more).to_be_hidden()

    page.locator("#history-filters select[name=state]").select_option("")
    page.fill("#history-filters [name=q]", "NEEDLE")
    page.keyboard.press("Enter")  # the search field submits the filter form
    needle = Task.objects.get(prompt="find the needle here")
    expect(rows).to_have_count(1)
    assert listed(page) == [str(needle.id)]
    expect(rows.first).to_contain_text("find the needle here")

    # A live task that matches the filters goes on top; one that does not stays out.
    submit(url, owner, machine, grant, "another needle")
    submit(url, owner, machine, grant, "no match")
    newest = Task.objects.get(prompt="another needle")
    expect(rows).to_have_count(2)
    assert listed(page) == [str(newest.id), str(needle.id)]

    page.click("#history-clear")
    expect(rows).to_have_count(PAGE_SIZE)
    assert page.input_value("#history-filters [name=q]") == ""


def test_b6_history_in_the_dark_on_a_phone_and_on_a_desktop(live_daphne, new_page, owner, machine, grant):
    from playwright.sync_api import expect

    url = live_daphne()
    make_history(url, owner, machine, grant, 6)
    page = new_page(url, owner, color_scheme="dark", **PHONE)
    page.goto(url + "/")
    wait_live(page)
    expect(page.locator("#history-list > li")).to_have_count(7)
    assert_phone_layout(page)
    assert page.evaluate("getComputedStyle(document.getElementById('history-panel')).backgroundColor") == "rgb(27, 32, 39)"
    panel_shot(page, "history-phone-dark.png")
    desktop = new_page(url, owner, viewport={"width": 1280, "height": 900})
    desktop.goto(url + "/")
    wait_live(desktop)
    expect(desktop.locator("#history-list > li")).to_have_count(7)
    panel_shot(desktop, "history-desktop.png")
    shot(desktop, "board-with-history-desktop.png")


def finished_with_agent_session(url, owner, machine, grant, session_id):
    """A task in ``session_id`` that ran and ended ``succeeded`` with the agent's own session
    id in its final facts (G2), driven through daphne's worker API. Not exclusive, so its
    follow-ups (which keep its settings) may run side by side in the folder."""
    import httpx

    task_id = None
    with api(url, owner) as client:
        assert client.post("/api/sessions/", json={"id": session_id, "title": "Fix login", "agent": "claude",
                                                   "cwd": grant.path + "/webapp"}).status_code == 201
        response = client.post("/api/tasks/", headers={"Idempotency-Key": str(uuid.uuid4())}, json={
            "machine": str(machine.id), "folder": grant.path, "agent": "claude", "prompt": "fix the login bug",
            "session": session_id, "max_runtime_s": 600, "exclusive": False})
        assert response.status_code == 201, response.text
        task_id = response.json()["id"]
    from tests.factories import final_facts, operation_id

    operation = operation_id(task_id)
    with httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10) as worker:
        assert worker.post("/api/worker/leases/", json={"operation_id": operation}).status_code == 201

        def send(kind, facts):
            body = {"event_id": str(uuid.uuid4()), "generation": machine.generation, "operation_id": operation,
                    "kind": kind, "slept_s": 0.0, "facts": facts}
            answer = worker.post("/api/worker/receipts/", json=body)
            assert answer.json() == {"outcome": "applied"}, answer.text

        send("running", {"pid": 7, "pgid": 7, "process_start_time": 1.0})
        send("final", final_facts(agent_session_id="claude-session-1"))
    return task_id


def test_b12_follow_up_from_a_final_task_creates_one_task_per_form(live_daphne, new_page, owner, machine, grant):
    from playwright.sync_api import expect

    from tasks_app.models import Task

    url = live_daphne()
    session_id = str(uuid.uuid4())
    first = finished_with_agent_session(url, owner, machine, grant, session_id)
    plain = submit(url, owner, machine, grant, "no agent session here")  # accepted: no reply box
    page = new_page(url, owner, **PHONE)
    page.goto(url + "/")
    wait_live(page)
    row = page.locator(f"#history-list > li[data-history-task-id='{first}']")
    expect(row).to_have_attribute("data-state", "succeeded")
    expect(page.locator(f"#history-list > li[data-history-task-id='{plain}'] details.follow-up")).to_have_count(0)
    expect(row.locator(".session-of")).to_have_text("session: Fix login · Claude Code · webapp")  # title, agent, folder
    expect(page.locator(f"#history-filters select[name=session] option[value='{session_id}']")).to_have_text(
        "Fix login · Claude Code · webapp")
    box = row.locator("details.follow-up")
    box.locator("summary").focus()
    page.keyboard.press("Enter")  # keyboard opens the box
    expect(box.locator("textarea")).to_be_visible()
    box.locator("textarea").fill("now add a test for it")
    assert_phone_layout(page)
    box.locator("button[type=submit]").dblclick()
    expect(box.locator("[role=status]")).to_have_text("Follow-up accepted.")
    follow_ups = Task.objects.filter(continued_from_id=first)
    assert follow_ups.count() == 1
    follow_up = follow_ups.get()
    assert (follow_up.machine_id, follow_up.folder, follow_up.agent, str(follow_up.session_id), follow_up.prompt) == (
        machine.id, grant.path, "claude", session_id, "now add a test for it")
    # The new task is on top of the history, marked as a follow-up.
    expect(page.locator("#history-list > li").first).to_have_attribute("data-history-task-id", str(follow_up.id))
    expect(page.locator("#history-status")).to_have_text("3 tasks shown, all of them")
    box.locator("textarea").fill("and update the changelog")
    box.scroll_into_view_if_needed()
    panel_shot(page, "followup-phone.png")

    # The service's answer is lost once: the box keeps its key, so sending again replays.
    lost = []

    def lose_first_answer(route):
        if route.request.method == "POST" and not lost:
            lost.append(route.fetch().status)  # the service accepts it...
            route.abort()  # ...and the page never hears back
        else:
            route.continue_()

    page.route("**/api/tasks/", lose_first_answer)
    box.locator("button[type=submit]").click()
    expect(box.locator("[role=status]")).to_have_text("Network error; send again (it will not create a second task).")
    # G8: the first follow-up has not finished, so the second one queues behind it.
    follow_ups = Task.objects.filter(continued_from__isnull=False)
    assert lost == [201] and follow_ups.count() == 2
    box.locator("button[type=submit]").click()
    expect(box.locator("[role=status]")).to_have_text("Queued: it runs when the one before it has finished.")
    assert follow_ups.count() == 2  # replayed (A2), not a third task
    assert sorted(follow_ups.values_list("prompt", flat=True)) == ["and update the changelog", "now add a test for it"]
    second = follow_ups.get(prompt="and update the changelog")
    assert (second.state, second.queued_behind_id) == ("queued", follow_up.id)

    desktop = new_page(url, owner, viewport={"width": 1280, "height": 900})
    desktop.goto(url + "/")
    wait_live(desktop)
    desk_box = desktop.locator(f"#history-list > li[data-history-task-id='{first}'] details.follow-up")
    desk_box.locator("summary").click()
    desk_box.locator("textarea").fill("one more thing")
    panel_shot(desktop, "followup-desktop.png")
