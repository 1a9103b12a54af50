"""Notifications on the board in a real browser (N1, N2, B5, B6): Web Notifications at
true idle only, the PWA's manifest and service worker, the settings panel on a phone.
Headless Debian Chromium against a real daphne (tests/live.py), as in test_board_browser."""
import json
import uuid

import httpx
import pytest

from tests.browser import api, chromium, new_page, shot, wait_live  # noqa: F401  (fixtures)
from tests.live import live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.django_db(transaction=True)]

# Wraps the real Notification constructor so the test sees every call the page makes.
CAPTURE_NOTIFICATIONS = """
(() => {
  const Real = window.Notification;
  window.__notes = [];
  function Captured(title, options) {
    window.__notes.push({title: title, tag: options && options.tag, body: options && options.body});
    return new Real(title, options);
  }
  Object.defineProperty(Captured, "permission", {get: () => Real.permission});
  Captured.requestPermission = (...a) => Real.requestPermission(...a);
  window.Notification = Captured;
})();
"""


def test_n1_web_notification_once_at_true_idle_not_at_a_wake_blip(live_daphne, new_page, owner):
    from playwright.sync_api import expect

    url = live_daphne()
    page = new_page(url, owner, permissions=["notifications"])
    page.add_init_script(CAPTURE_NOTIFICATIONS)
    page.goto(url + "/")
    wait_live(page)
    assert page.evaluate("Notification.permission") == "granted"
    sid = str(uuid.uuid4())
    row = page.locator(f"li[data-session-id='{sid}']")

    with api(url, owner) as client:
        def marker(turn, state):
            body = {"turn_id": turn, "device_id": "term-1", "device_name": "Terminal", "state": state}
            response = client.put(f"/api/sessions/{sid}/marker/", json=body)
            assert response.status_code == 200 and response.json()["outcome"] == "applied", response.text

        marker("turn-1", "running")
        assert client.post(f"/api/sessions/{sid}/jobs/", json={"job_id": "bg", "mode": "held"}).status_code == 201
        expect(row).to_have_attribute("data-status", "busy")
        marker("turn-1", "ended")  # the turn ends while its background job runs: no idle (S3)
        expect(row.locator(".badge.running")).to_have_count(0)  # the page has the marker event
        finished = client.post(f"/api/sessions/{sid}/jobs/bg/finish/", json={"wakes": True})
        assert finished.status_code == 200, finished.text
        marker("turn-2", "running")  # the job's completion wakes a turn
        expect(row.locator(".badge.running")).to_have_count(1)
        assert page.evaluate("window.__notes") == []
        assert page.evaluate("window.runsteadBoard.doneCount") == 0
        marker("turn-2", "ended")  # now truly idle
        expect(row).to_have_attribute("data-status", "idle")
        page.wait_for_function("window.__notes.length === 1")
        notes = page.evaluate("window.__notes")
        assert notes[0]["title"].endswith("is idle")
        assert page.evaluate("window.runsteadBoard.doneCount") == 1  # and the done sound once (B5)
        assert page.evaluate("window.runsteadNotify.shown") == 1


def test_n2_pwa_manifest_and_service_worker_scope_root(live_daphne, new_page, owner):
    url = live_daphne()
    manifest = httpx.get(url + "/manifest.webmanifest")
    assert manifest.headers["content-type"] == "application/manifest+json"
    body = manifest.json()
    assert (body["start_url"], body["scope"], body["display"]) == ("/", "/", "standalone")
    for icon in body["icons"]:
        fetched = httpx.get(url + icon["src"])
        assert fetched.status_code == 200 and fetched.content[:4] == b"\x89PNG", icon
    page = new_page(url, owner)
    page.goto(url + "/")
    wait_live(page)
    scope = page.evaluate("navigator.serviceWorker.ready.then(r => r.scope)")
    assert scope == url + "/"
    assert page.evaluate("document.querySelector('link[rel=manifest]').href") == url + "/manifest.webmanifest"


def test_n1_settings_panel_saves_and_shows_the_secret_once_on_a_phone(live_daphne, new_page, owner):
    from playwright.sync_api import expect

    url = live_daphne()
    for scheme in ("light", "dark"):
        page = new_page(url, owner, viewport={"width": 390, "height": 844}, color_scheme=scheme, is_mobile=True, has_touch=True)
        page.goto(url + "/")
        wait_live(page)
        form = page.locator("#notify-form")
        expect(form.locator("[name=session_idle]")).to_be_checked()
        if scheme == "light":
            form.locator("[name=task_succeeded]").uncheck()
            form.locator("[name=webhook_url]").fill("https://ntfy.example/my-topic")
            form.locator("button[type=submit]").click()
            expect(page.locator("#notify-status")).to_have_text("Saved.")
            expect(page.locator("#webhook-secret")).to_be_visible()
            assert len(page.locator("#webhook-secret-value").text_content()) == 64
        else:
            expect(form.locator("[name=task_succeeded]")).not_to_be_checked()
            expect(form.locator("[name=webhook_url]")).to_have_value("https://ntfy.example/my-topic")
            expect(page.locator("#webhook-secret")).to_be_hidden()  # shown once only
        widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
        assert widths[0] <= widths[1], widths
        small = page.evaluate("""Array.from(document.querySelectorAll('#notify-panel button, #notify-panel label.check'))
            .filter(e => e.offsetParent !== null && e.getBoundingClientRect().height < 44).map(e => e.outerHTML.slice(0, 80))""")
        assert small == []
        page.locator("#notify-panel").scroll_into_view_if_needed()
        shot(page, f"notifications-phone-{scheme}.png")
    with api(url, owner) as client:
        assert json.loads(client.get("/api/notifications/settings/").text)["kinds"]["task_succeeded"] is False
