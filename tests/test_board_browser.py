"""The board in a real browser (B1-B8): headless Debian Chromium driven by Playwright's
sync API against a real daphne subprocess on the test database (tests/live.py).

With the in-memory channel layer a broadcast reaches the browser only from inside the
daphne process, so every change is driven through daphne's HTTP API.
"""
import uuid
from datetime import timedelta

import httpx
import pytest
from django.utils import timezone

from tests.browser import api, chromium, new_page, wait_live  # noqa: F401  (fixtures)
from tests.live import live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.browser, pytest.mark.django_db(transaction=True)]


def test_b2_task_change_is_pushed_without_reload(live_daphne, new_page, owner, machine, grant):
    from playwright.sync_api import expect

    url = live_daphne()
    page = new_page()
    page.goto(url + "/")
    assert "/accounts/login/" in page.url  # B1: login required
    page.fill("input[name=username]", "alice")
    page.fill("input[name=password]", "pw")
    page.click("button[type=submit]")
    page.wait_for_url(url + "/")
    wait_live(page)
    page.evaluate("window.__sameDocument = true")

    with api(url, owner) as client:
        created = client.post(
            "/api/tasks/",
            json={"machine": str(machine.id), "folder": grant.path, "agent": "claude", "prompt": "fix the build"},
            headers={"Idempotency-Key": str(uuid.uuid4())},
        )
        assert created.status_code == 201, created.text
        task_id = created.json()["id"]
        row = page.locator(f"li[data-task-id='{task_id}']")
        expect(row).to_have_attribute("data-state", "accepted")
        expect(row).to_contain_text("fix the build")
        expect(row).to_contain_text("laptop")

        worker = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10)
        (message,) = worker.get("/api/worker/messages/?wait=0").json()["messages"]
        assert worker.post(f"/api/worker/messages/{message['id']}/ack/").status_code == 200
        expect(row).to_have_attribute("data-state", "delivered")
        lease = worker.post("/api/worker/leases/", json={"operation_id": message["operation_id"]})
        assert lease.status_code == 201, lease.text
        expect(row).to_have_attribute("data-state", "starting")
        expect(row).to_contain_text("running for")  # live runtime from the leasing event

        assert client.post(f"/api/tasks/{task_id}/cancel/").status_code == 200
        expect(row).to_contain_text("cancel requested")  # J7: a leased task waits for its facts
        facts = {"process_started": False, "stop_reason": "cancel", "lease_id": lease.json()["lease_id"],
                 "survivors": [], "output_tail": ""}
        receipt = worker.post("/api/worker/receipts/", json={
            "event_id": "e1", "generation": machine.generation, "operation_id": message["operation_id"],
            "kind": "final", "facts": facts})
        assert receipt.status_code == 200, receipt.text
    expect(row).to_have_attribute("data-state", "not_started")
    assert page.evaluate("window.__sameDocument") is True  # no reload happened
    assert page.evaluate("window.runsteadBoard.messages") >= 5


def test_b3_marker_disappears_on_expiry_with_no_server_message(live_daphne, new_page, owner):
    from playwright.sync_api import expect

    from sessions_app.models import Marker, Session

    now = timezone.now()
    session = Session.objects.create(owner=owner, title="long turn", status="busy", status_since=now, created_at=now)
    Marker.objects.create(session=session, device_id="mac-1", device_name="Mac", turn_id="t1", state="running",
                          started_at=now, expires_at=now + timedelta(seconds=30))
    url = live_daphne(RUNSTEAD_MARKER_GRACE_S="1")
    page = new_page(url, owner)
    # The browser's clock is an hour behind the service: only the server_time correction
    # (M3) makes the marker expire about 30 s later (room for a slow start of the page).
    page.clock.install(time=now - timedelta(hours=1))
    page.goto(url + "/")
    wait_live(page)
    badge = page.locator(f"li[data-session-id='{session.id}'] .badge.running[data-device-id='mac-1']")
    expect(badge).to_contain_text("RUNNING")
    expect(badge).to_contain_text("Mac")
    messages = page.evaluate("window.runsteadBoard.messages")

    # Past expires_at + grace (31 s), and short of the page's 60 s snapshot timer, whose
    # fresh server_time would re-anchor the clock to real time (seen once in CI).
    page.clock.fast_forward(40_000)

    expect(badge).to_have_count(0)
    assert page.evaluate("window.runsteadBoard.messages") == messages  # nothing came from the server
    assert Marker.objects.get(session=session).state == "running"  # expiry is a read-side decision


def test_b2_event_older_than_shown_is_ignored(live_daphne, new_page, owner, machine, grant):
    """Events are injected into the page's real socket (Playwright WebSocket routing);
    a snapshot older than what is shown does not roll the row back either (B4)."""
    import json

    from playwright.sync_api import expect

    from tasks_app.models import Task

    now = timezone.now()
    task = Task.objects.create(owner=owner, machine=machine, grant=grant, folder=grant.path, agent="claude",
                               prompt="p", state="running", version=5, created_at=now, updated_at=now)
    url = live_daphne()
    page = new_page(url, owner)
    page.clock.install()
    sockets = []

    def route(ws):
        ws.connect_to_server()  # server messages still flow to the page
        sockets.append(ws)

    page.route_web_socket("**/ws/board/", route)
    page.goto(url + "/")
    wait_live(page)
    row = page.locator(f"li[data-task-id='{task.id}']")
    expect(row).to_have_attribute("data-state", "running")

    def push(state, version):
        shape = {"id": str(task.id), "state": state, "machine": str(machine.id), "folder": grant.path,
                 "agent": "claude", "prompt": "p", "created_at": now.isoformat(), "version": version}
        sockets[-1].send(json.dumps({"type": "task", "task": shape, "version": version,
                                     "server_time": timezone.now().isoformat()}))

    push("accepted", 4)
    push("succeeded", 4)
    page.wait_for_function("window.runsteadBoard.messages === 2")
    expect(row).to_have_attribute("data-state", "running")  # both older or equal: ignored
    push("succeeded", 6)
    expect(row).to_have_attribute("data-state", "succeeded")

    hydrations = page.evaluate("window.runsteadBoard.hydrations")
    page.clock.fast_forward(61_000)  # B4: the 60 s safety-net snapshot (the DB still says v5)
    page.wait_for_function(f"window.runsteadBoard.hydrations > {hydrations}")
    expect(row).to_have_attribute("data-state", "succeeded")


def test_b6_phone_viewport_has_no_horizontal_scroll_in_dark_scheme(live_daphne, new_page, owner, machine, grant):
    from tasks_app.models import Task

    now = timezone.now()
    long_word = "x" * 400
    Task.objects.create(owner=owner, machine=machine, grant=grant, folder=grant.path + "/" + long_word, agent="claude",
                        prompt=long_word, output_tail=("y" * 300 + "\n") * 10, state="unknown",
                        created_at=now, updated_at=now, decision_asked_at=now)
    # N1, U2: an unknown task whose worker's record may still settle it is not listed first.
    Task.objects.create(owner=owner, machine=machine, grant=grant, folder=grant.path, agent="claude", prompt="p",
                        state="unknown", created_at=now, updated_at=now, decision_due_at=now + timedelta(seconds=120))
    url = live_daphne()
    page = new_page(url, owner, viewport={"width": 390, "height": 844}, color_scheme="dark", is_mobile=True)
    page.goto(url + "/")
    wait_live(page)
    page.wait_for_selector("#decisions li[data-state=unknown] a.decide")
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths
    href = page.get_attribute("#decisions a.decide", "href")
    assert href.endswith(f"/tasks/{Task.objects.get(decision_asked_at__isnull=False).id}/")  # B9: on the task page
    assert page.locator("#decisions li").count() == 1
    page.wait_for_selector("#task-list li[data-state=unknown] .awaiting-report")
    assert page.locator("#task-list li[data-state=unknown] a.decide").count() == 0
    background = page.evaluate("getComputedStyle(document.body).backgroundColor")
    assert background == "rgb(17, 20, 24)"  # the dark scheme's --bg


def test_b7_machine_goes_offline_on_the_page_timer_and_waiting_task_says_so(live_daphne, new_page, owner, machine, grant):
    from playwright.sync_api import expect

    from tasks_app.models import Machine, Task

    now = timezone.now()
    Machine.objects.filter(pk=machine.pk).update(last_heard_at=now - timedelta(seconds=10))
    task = Task.objects.create(owner=owner, machine=machine, grant=grant, folder=grant.path, agent="claude",
                               prompt="p", state="accepted", created_at=now, updated_at=now)
    url = live_daphne(RUNSTEAD_MACHINE_OFFLINE_S="30")
    page = new_page(url, owner)
    page.clock.install()
    page.goto(url + "/")
    wait_live(page)
    machine_row = page.locator(f"li[data-machine-id='{machine.id}']")
    task_row = page.locator(f"li[data-task-id='{task.id}']")
    expect(machine_row).to_have_attribute("data-online", "true")
    expect(machine_row).to_contain_text("last heard")
    expect(task_row.locator(".note.offline")).to_have_count(0)

    page.clock.fast_forward(25_000)  # 35 s since last heard > 30 s threshold

    expect(machine_row).to_have_attribute("data-online", "false")
    expect(machine_row).to_contain_text("offline since")
    expect(task_row.locator(".note.offline")).to_contain_text("waiting for laptop, offline since")


def test_b8_double_click_and_resubmit_after_lost_response_create_one_task(live_daphne, new_page, owner, machine, grant):
    from tasks_app.models import Task

    from tasks_app.models import Machine

    Machine.objects.filter(pk=machine.pk).update(profiles=[{"name": "claude", "preset": "claude"}])  # B10
    url = live_daphne()
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    page.fill("#task-form [name=folder_other]", grant.path + "/a")
    page.select_option("#task-form [name=agent]", "claude")
    page.fill("#task-form [name=prompt]", "first")
    key = page.get_attribute("#task-form", "data-idempotency-key")
    assert key

    lost = []

    def lose_first_response(route):
        response = route.fetch()  # the service accepts the task...
        if not lost:
            lost.append(response.status)
            route.abort()  # ...but the browser never hears back
        else:
            route.fulfill(response=response)

    page.route("**/api/tasks/", lose_first_response)
    page.dblclick("#task-form button[type=submit]")
    page.wait_for_selector("#form-status.error")
    assert lost == [201]
    assert page.get_attribute("#task-form", "data-idempotency-key") == key  # kept for the resubmit
    page.click("#task-form button[type=submit]")
    page.wait_for_function("document.getElementById('form-status').textContent === 'Task accepted.'")
    assert Task.objects.filter(owner=owner).count() == 1

    # After a success the form carries a new key: the next submit is a new task.
    assert page.get_attribute("#task-form", "data-idempotency-key") != key
    page.fill("#task-form [name=folder_other]", grant.path + "/b")
    page.fill("#task-form [name=prompt]", "second")
    page.click("#task-form button[type=submit]")
    page.wait_for_function("document.querySelectorAll('#task-list li[data-task-id]').length === 2")
    assert sorted(Task.objects.values_list("prompt", flat=True)) == ["first", "second"]


def test_b5_done_sound_on_busy_to_idle_and_mute_is_remembered(live_daphne, new_page, owner):
    from playwright.sync_api import expect

    url = live_daphne()
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    session_id = str(uuid.uuid4())

    def turn(client, turn_id, state):
        body = {"turn_id": turn_id, "device_id": "term-1", "device_name": "Terminal", "state": state}
        response = client.put(f"/api/sessions/{session_id}/marker/", json=body)
        assert response.status_code == 200 and response.json()["outcome"] == "applied", response.text

    row = page.locator(f"li[data-session-id='{session_id}']")
    with api(url, owner) as client:
        turn(client, "t1", "running")
        expect(row).to_have_attribute("data-status", "busy")
        turn(client, "t1", "ended")
        expect(row).to_have_attribute("data-status", "idle")
        page.wait_for_function("window.runsteadBoard.doneCount === 1")
        assert page.evaluate("window.runsteadBoard.beeps") == 1

        page.click("#mute")
        expect(page.locator("#mute")).to_have_text("Sound: off")
        page.reload()
        wait_live(page)
        expect(page.locator("#mute")).to_have_text("Sound: off")  # remembered across reloads

        turn(client, "t2", "running")
        expect(row).to_have_attribute("data-status", "busy")
        turn(client, "t2", "ended")
        expect(row).to_have_attribute("data-status", "idle")
        page.wait_for_function("window.runsteadBoard.doneCount === 1")  # counted since the reload
        assert page.evaluate("window.runsteadBoard.beeps") == 0  # muted: no sound


def test_i6_b11_needs_you_sessions_come_first_with_agent_title_folder_and_message(live_daphne, new_page, owner):
    from playwright.sync_api import expect

    url = live_daphne()
    client = api(url, owner)
    calm, waiting = str(uuid.uuid4()), str(uuid.uuid4())
    assert client.post("/api/sessions/", json={"id": waiting, "title": "fix login", "agent": "claude",
                                               "cwd": "/Users/me/src/shop"}).status_code == 201
    assert client.post("/api/sessions/", json={"id": calm, "title": "refactor", "agent": "codex",
                                               "cwd": "/Users/me/src/api"}).status_code == 201
    # The calm one is busy (a turn runs); busy sessions would come first without I6.
    client.put(f"/api/sessions/{calm}/marker/", json={"turn_id": "t1", "device_id": "mac:codex:x", "state": "running"})
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    rows = page.locator("#session-list li.session")
    expect(rows.first).to_have_attribute("data-session-id", calm)

    # A permission prompt arrives as an event: that session moves to the top, with its message.
    client.patch(f"/api/sessions/{waiting}/", json={"attention": "permission",
                                                     "attention_message": "Claude needs your permission to use Bash"})
    expect(rows.first).to_have_attribute("data-session-id", waiting)
    top = rows.first
    expect(top.locator(".badge.needs-you")).to_have_text("needs you")
    expect(top.locator(".attention-message")).to_have_text("Claude needs your permission to use Bash")
    expect(top.locator(".agent")).to_contain_text("Claude Code")
    expect(top.locator(".title")).to_have_text("fix login")
    expect(top.locator(".folder")).to_have_text("shop")
    expect(top.locator(".folder")).to_have_attribute("title", "/Users/me/src/shop")

    # Answered (the next prompt clears it): back below the busy one, no "needs you".
    client.patch(f"/api/sessions/{waiting}/", json={"attention": ""})
    expect(rows.first).to_have_attribute("data-session-id", calm)
    expect(page.locator(".badge.needs-you")).to_have_count(0)
    # After a reload the snapshot (B4) tells the same.
    client.patch(f"/api/sessions/{waiting}/", json={"attention": "permission", "attention_message": "again"})
    page.reload()
    wait_live(page)
    expect(rows.first).to_have_attribute("data-session-id", waiting)
    expect(rows.first.locator(".attention-message")).to_have_text("again")
