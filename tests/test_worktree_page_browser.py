"""A worktree task's branch on its page and card (SPEC G7, B6, B9) in headless Chromium,
against a real daphne and a real worker whose test agent commits on the task's branch:
the diff file by file (monospace, coloured, a long line scrolls inside its file, never the
page; collapsed past 20 files), agent-written text shown as text (a diff line holding
``<script>`` or ``<img onerror>`` shows those characters and runs nothing), and merge and
discard from the page. Screenshots in var/test-output/screenshots/."""
import pytest

from tests.browser import chromium, new_page, shot  # noqa: F401  (fixtures)
from tests.git_support import git
from tests.live import live_daphne  # noqa: F401  (fixture)
from tests.wait import wait_for
from tests.worker_harness import BROWSER_TIMINGS, LiveSetup

pytestmark = [pytest.mark.browser, pytest.mark.slow, pytest.mark.django_db(transaction=True)]

PHONE = {"viewport": {"width": 390, "height": 844}, "is_mobile": True, "has_touch": True}
DESKTOP = {"viewport": {"width": 1280, "height": 900}}
SCRIPT_LINE = "<script>window.__pwned = 'script'</script>"
IMG_LINE = "<img src=x onerror=\"window.__pwned = 'img'\">"
LONG_LINE = "const value = " + "'a long line that a phone must scroll sideways inside its file' + " * 6 + "'end';"


@pytest.fixture
def live(live_daphne, make_owner, tmp_path):  # noqa: F811
    setup = LiveSetup(live_daphne(**BROWSER_TIMINGS), make_owner(), tmp_path, profiles={"plain": {}})
    git(setup.repo, "init", "-q", "-b", "main")
    (setup.repo / "index.html").write_text("<html>\n<body>\n</body>\n</html>\n")
    git(setup.repo, "add", "-A")
    git(setup.repo, "commit", "-qm", "initial")
    setup.start_worker()
    yield setup
    setup.close()


def worktree_task(live, prompt: str) -> str:
    task = live.wait_final(live.submit("plain", isolation="worktree", prompt=prompt), timeout=60)
    assert task["state"] == "succeeded", live.log()
    return task["id"]


def no_page_scroll(page):
    widths = page.evaluate("[document.documentElement.scrollWidth, document.documentElement.clientWidth]")
    assert widths[0] <= widths[1], widths


def test_g7_the_diff_file_by_file_as_text_then_merge_from_the_page(live, new_page):  # noqa: F811
    from playwright.sync_api import expect

    page_html = f"<html>\\n<body>\\n{SCRIPT_LINE}\\n{IMG_LINE}\\n</body>\\n</html>\\n"
    task_id = worktree_task(live, f"[[write:index.html:{page_html}]][[write:src/app.js:{LONG_LINE}\\n]]"
                                  "[[commit:agent: <b>bold</b> page]]")
    for scheme in ("light", "dark"):
        page = new_page(live.url, live.owner, color_scheme=scheme, **PHONE)
        page.goto(f"{live.url}/tasks/{task_id}/")
        page.wait_for_selector("#conn[data-state=live]")
        expect(page.locator("#branch")).to_be_visible()
        expect(page.locator("#branch-line")).to_contain_text(f"runstead/{task_id[:8]} from main")
        files = page.locator("#diff details.diff-file")
        expect(files).to_have_count(2)
        assert page.evaluate("Array.from(document.querySelectorAll('#diff details')).every(d => d.open)")
        expect(page.locator("#diff-summary")).to_contain_text("2 files changed, +3 −0")
        lines = page.locator("#diff .dl.add").all_text_contents()
        assert f"+{SCRIPT_LINE}" in lines and f"+{IMG_LINE}" in lines  # the characters, as text
        assert page.locator("#diff script, #diff img, #branch b").count() == 0
        assert page.evaluate("window.__pwned") is None  # and nothing ran
        style = page.evaluate("""() => {
            const add = document.querySelector('#diff .dl.add'), ctx = document.querySelector('#diff .dl.ctx');
            const pre = document.querySelector('#diff [data-path="src/app.js"] pre.diff');
            return {add: getComputedStyle(add).backgroundColor, ctx: getComputedStyle(ctx).backgroundColor,
                    del: getComputedStyle(document.documentElement).getPropertyValue('--diff-del-bg').trim(),
                    font: getComputedStyle(add).fontFamily, scrolls: pre.scrollWidth > pre.clientWidth,
                    overflow: getComputedStyle(pre).overflowX};
        }""")
        assert style["add"] == ("rgb(230, 255, 236)" if scheme == "light" else "rgb(18, 54, 31)"), style
        assert style["add"] != style["ctx"] and style["del"] in ("#ffebe9", "#3d1418")
        assert "monospace" in style["font"] and style["scrolls"] and style["overflow"] == "auto"
        no_page_scroll(page)  # the long line scrolls inside its file, not the page
        shot(page, f"g7-task-diff-phone-{scheme}.png")

    page.evaluate("window.__sameDocument = true")
    page.click("#merge-button")
    expect(page.locator("#integration")).to_contain_text("Merged into main", timeout=30000)
    expect(page.locator("#integrate-actions")).to_be_hidden()
    assert page.evaluate("window.__sameDocument") is True  # live, no reload
    commit = git(live.repo, "rev-parse", "main")
    expect(page.locator("#integration")).to_contain_text(commit[:12])
    assert SCRIPT_LINE in (live.repo / "index.html").read_text()
    expect(page.locator("#timeline-body")).to_contain_text("owner decision: merge branch")
    shot(page, "g7-task-merged-phone-dark.png")

    board = new_page(live.url, live.owner, **PHONE)
    board.goto(f"{live.url}/")
    card = board.locator(f"li[data-task-id='{task_id}'] .branch")
    expect(card).to_have_text(f"runstead/{task_id[:8]} · merged {commit[:12]}")
    no_page_scroll(board)
    shot(board, "g7-board-card-merged-phone.png")


def test_g7_past_twenty_files_the_diff_starts_collapsed_and_discard_asks_twice(live, new_page):  # noqa: F811
    from playwright.sync_api import expect

    writes = "".join(f"[[write:many/f{i:02}.txt:line {i}\\n]]" for i in range(25))
    task_id = worktree_task(live, writes + "[[commit:agent: many files]]")
    page = new_page(live.url, live.owner, **DESKTOP)
    page.goto(f"{live.url}/tasks/{task_id}/")
    page.wait_for_selector("#conn[data-state=live]")
    expect(page.locator("#diff details.diff-file")).to_have_count(25)
    assert page.evaluate("Array.from(document.querySelectorAll('#diff details')).every(d => !d.open)")
    expect(page.locator("#diff-summary")).to_contain_text("25 files changed, +25 −0 · collapsed")
    page.click("#diff details[data-path='many/f07.txt'] summary")
    expect(page.locator("#diff details[data-path='many/f07.txt'] .dl.add")).to_have_text("+line 7")
    shot(page, "g7-task-diff-collapsed-desktop.png")
    page.click("#discard-button")
    expect(page.locator("#discard-button")).to_have_text("Tap again to discard")
    assert live.task(task_id)["integration"] is None  # one tap decides nothing
    page.click("#discard-button")
    expect(page.locator("#integration")).to_contain_text("Discarded by", timeout=30000)
    branch = f"runstead/{task_id[:8]}"
    wait_for(lambda: git(live.repo, "branch", "--list", branch) == "", what="the branch removed")
