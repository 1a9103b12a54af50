"""The run as a person reads it, in a real browser (SPEC B9, G4, B6, K): headless Chromium
against a real daphne, the worker's side driven through the machine API. Text the agent
controls (a message, a command, a result, an error, the prompt) holding ``<script>`` and
``<img onerror>`` shows those characters and runs nothing, on the task page and on the
board card; the card shows the last message in two lines and never raw JSON; "load
earlier" reads the entries before the last 200; screenshots of the card and the page
(phone light and dark, desktop) go to var/test-output/screenshots/."""
import json
import uuid

import httpx
import pytest

from tests.browser import api, chromium, new_page, shot  # noqa: F401  (fixtures)
from tests.live import live_daphne  # noqa: F401  (fixture)

pytestmark = [pytest.mark.surface, pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True}
DESKTOP = {"viewport": {"width": 1280, "height": 900}}
SCRIPT = '<script>window.__pwned = "script"</script>'
IMG = '<img src=x onerror="window.__pwned = \'img\'">'
EVIL = f"{SCRIPT} and {IMG}"


class Worker:
    """The worker's side of one task through the machine API of the live server."""

    def __init__(self, url, machine, task_id):
        self.http = httpx.Client(base_url=url, headers={"Authorization": f"Machine {machine.test_token}"}, timeout=10)
        self.machine, self.seq = machine, 0
        (message,) = self.http.get("/api/worker/messages/?wait=0").json()["messages"]
        self.op = message["operation_id"]
        self.http.post(f"/api/worker/messages/{message['id']}/ack/")
        assert self.http.post("/api/worker/leases/", json={"operation_id": self.op}).status_code == 201
        self.receipt("running", {"pid": 4242, "pgid": 4242, "process_start_time": 1.0})

    def receipt(self, kind, facts):
        body = {"event_id": str(uuid.uuid4()), "generation": self.machine.generation, "operation_id": self.op,
                "kind": kind, "slept_s": 0.0, "facts": facts}
        response = self.http.post("/api/worker/receipts/", json=body)
        assert response.json() == {"outcome": "applied"}, response.text

    def progress(self, entries, last_message, turns):
        self.seq += 1
        body = {"operation_id": self.op, "seq": self.seq, "last_message": last_message,
                "output_tail": "\n".join(json.dumps({"type": "assistant", "n": e["n"]}) for e in entries),
                "usage": {"turns": turns, "tool_calls": 1, "input_tokens": 2400, "output_tokens": 180,
                          "cost_usd": 0.0123},
                "entries": entries}
        assert self.http.post("/api/worker/progress/", json=body).json() == {"outcome": "applied"}

    def final(self, entries):
        self.receipt("final", {
            "process_started": True, "exit_code": 0, "signal": None, "lease_id": None, "ended_within_lease": True,
            "runtime_s": 42.0, "stop_reason": "exit", "survivors": [], "output_tail": '{"type": "result"}\n',
            "agent_result": {"is_error": False, "subtype": "success", "summary": f"Fixed it. {IMG}"},
            "usage": {"turns": 3, "tool_calls": 2, "input_tokens": 5000, "output_tokens": 300, "cost_usd": 0.02},
            "agent_session_id": "s-1", "entries": entries})


def first_entries():
    return [
        {"n": 1, "kind": "prompt", "text": f"fix the login bug {SCRIPT}"},
        {"n": 2, "kind": "message", "text": f"Looking at it.\nLine two {IMG}\nLine three",
         "usage": {"input_tokens": 1200, "output_tokens": 90}},
        {"n": 3, "kind": "tool_call", "tool": "Bash", "text": f"grep -rn '{IMG}' src/ && echo {SCRIPT}"},
        {"n": 4, "kind": "tool_result", "tool": "Bash", "status": "ok", "call": 3,
         "text": f"src/login.py:12: {SCRIPT}\nsrc/page.html:3: {IMG}"},
        {"n": 5, "kind": "tool_call", "tool": "Edit", "text": "src/login.py"},
    ]


def assert_nothing_ran(page, root):
    assert page.evaluate("window.__pwned === undefined"), page.evaluate("window.__pwned")
    assert page.locator(f"{root} img, {root} script").count() == 0


def no_horizontal_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def test_b9_agent_text_renders_as_text_and_runs_nothing(live_daphne, new_page, owner, machine, grant):  # noqa: F811
    from playwright.sync_api import expect

    url = live_daphne()
    with api(url, owner) as client:
        task_id = client.post("/api/tasks/", json={"machine": str(machine.id), "folder": grant.path, "agent": "claude",
                                                   "prompt": f"fix the login bug {SCRIPT}"},
                              headers={"Idempotency-Key": str(uuid.uuid4())}).json()["id"]
    worker = Worker(url, machine, task_id)
    worker.progress(first_entries(), last_message=f"Looking at it.\nLine two {IMG}\nLine three\nLine four", turns=2)

    page = new_page(url, owner, **PHONE)
    page.goto(f"{url}/tasks/{task_id}/")
    page.wait_for_selector("#conn[data-state=live]")
    transcript = page.locator("#transcript")
    message = transcript.locator("li[data-kind=message]").first
    expect(message.locator(".entry-text")).to_have_text(f"Looking at it.\nLine two {IMG}\nLine three")
    assert message.locator(".entry-text").evaluate("e => e.innerText.split('\\n').length") == 3  # line breaks kept
    expect(message.locator(".turn-usage")).to_have_text("turn: 1200 in / 90 out")
    call = transcript.locator("li[data-kind=tool_call]").first
    expect(call.locator(".tool-text")).to_have_text(f"grep -rn '{IMG}' src/ && echo {SCRIPT}")
    expect(call).to_have_attribute("data-status", "ok")
    call.locator("summary").click()
    expect(call.locator(".tool-output")).to_have_text(f"src/login.py:12: {SCRIPT}\nsrc/page.html:3: {IMG}")
    expect(transcript.locator("li[data-kind=tool_call]").nth(1)).to_have_attribute("data-status", "running")
    expect(transcript.locator("li[data-kind=prompt]")).to_contain_text(SCRIPT)
    assert_nothing_ran(page, "#transcript")

    board = new_page(url, owner, **PHONE)
    board.goto(f"{url}/")
    card = board.locator(f"li[data-task-id='{task_id}']")
    expect(card.locator(".last-message")).to_contain_text("Line four")  # four lines, shown in two
    # Two lines at most, once laid out (the board re-renders every second; under load the
    # first render can be measured before its styles apply: wait for the fact, with a deadline).
    board.wait_for_function(
        f"""() => {{ const e = document.querySelector("li[data-task-id='{task_id}'] .last-message");
                    return e && e.getBoundingClientRect().height <= 2.2 * parseFloat(getComputedStyle(e).lineHeight); }}""",
        timeout=10_000)
    expect(card).not_to_contain_text('{"type"')  # never raw JSON
    shot(board, "board-card-running-phone-light.png")
    assert_nothing_ran(board, f"li[data-task-id='{task_id}']")

    # Live: the result of the Edit and an error arrive while the page is open.
    worker.progress([{"n": 6, "kind": "tool_result", "tool": "Edit", "status": "error", "call": 5, "text": IMG},
                     {"n": 7, "kind": "error", "text": f"rate limited {SCRIPT}"}], last_message="Retrying.", turns=3)
    expect(transcript.locator("li[data-kind=tool_call]").nth(1)).to_have_attribute("data-status", "error")
    expect(transcript.locator("li[data-kind=error]")).to_contain_text(f"rate limited {SCRIPT}")
    expect(call.locator(".tool-output")).to_be_visible()  # still open after the update
    no_horizontal_scroll(page)
    shot(page, "task-page-transcript-phone-light.png")
    assert_nothing_ran(page, "#transcript")

    expect(card.locator(".last-message")).to_have_text("Retrying.")
    expect(card.locator(".usage")).to_contain_text("3 turns")

    worker.final([{"n": 8, "kind": "message", "text": f"Fixed it. {IMG}"}])
    expect(page.locator("#task-state")).to_have_text("succeeded")
    expect(transcript.locator("li[data-kind=message]").last).to_have_text(f"Fixed it. {IMG}")
    expect(card.locator(".last-message")).to_have_text(f"Fixed it. {IMG}")
    assert_nothing_ran(page, "#transcript")
    assert_nothing_ran(board, f"li[data-task-id='{task_id}']")

    for name, options in (("phone-dark", {**PHONE, "color_scheme": "dark"}), ("desktop", DESKTOP)):
        for path, shot_name in ((f"/tasks/{task_id}/", f"task-page-transcript-{name}.png"), ("/", f"board-card-{name}.png")):
            view = new_page(url, owner, **options)
            view.goto(url + path)
            view.wait_for_selector("#conn[data-state=live]")
            if path != "/":
                view.locator("#transcript li[data-kind=tool_call] summary").first.click()
                expect(view.locator("#transcript li[data-kind=message]").last).to_have_text(f"Fixed it. {IMG}")
            no_horizontal_scroll(view)
            shot(view, shot_name)
            assert view.evaluate("window.__pwned === undefined")


def test_b9_load_earlier_reads_the_entries_before_the_last_200(live_daphne, new_page, owner, machine, grant):  # noqa: F811
    from playwright.sync_api import expect

    url = live_daphne()
    with api(url, owner) as client:
        task_id = client.post("/api/tasks/", json={"machine": str(machine.id), "folder": grant.path, "agent": "claude",
                                                   "prompt": "a long run"},
                              headers={"Idempotency-Key": str(uuid.uuid4())}).json()["id"]
    worker = Worker(url, machine, task_id)
    for start in range(1, 300, 50):  # 300 entries
        worker.progress([{"n": n, "kind": "message", "text": f"m{n}"} for n in range(start, start + 50)],
                        last_message=f"m{start + 49}", turns=start)
    page = new_page(url, owner, **PHONE)
    page.goto(f"{url}/tasks/{task_id}/")
    page.wait_for_selector("#conn[data-state=live]")
    entries = page.locator("#transcript li")
    expect(entries).to_have_count(200)
    expect(entries.first).to_have_text("m101")
    page.click("#load-earlier")
    expect(entries).to_have_count(300)
    expect(entries.first).to_have_text("m1")
    expect(page.locator("#load-earlier")).to_be_hidden()
    # A lost event leaves a gap: the page reads what it missed.
    page.evaluate("window.runsteadTask.entries.delete(300); window.runsteadTask.entries.delete(299)")
    worker.progress([{"n": 301, "kind": "message", "text": "m301"}], last_message="m301", turns=301)
    expect(entries.last).to_have_text("m301")
    expect(entries).to_have_count(301)
    assert page.evaluate("window.runsteadTask.catchUps") >= 1
