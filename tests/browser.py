"""Helpers for the browser tests (B, N, U pages in headless Chromium): the Playwright
browser and page fixtures, an owner's API client, the board's "live" wait and screenshots.

Headless Debian Chromium (``/usr/bin/chromium``, FACTS.md) driven by Playwright's sync API
against a real daphne subprocess (``tests/live.py``). Usage::

    from tests.browser import chromium, new_page  # noqa: F401  (fixtures)
"""
import os
from pathlib import Path

import httpx
import pytest
from django.test import Client

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-dev-shm-usage", "--disable-background-networking", "--disable-gpu"]
WAIT_MS = 10000
SCREENSHOTS = Path(__file__).resolve().parent.parent / "var" / "test-output" / "screenshots"


@pytest.fixture(scope="module")
def chromium():
    # Playwright's sync API runs an event loop in this thread; the test's own ORM calls are
    # still plain synchronous calls.
    previous = os.environ.get("DJANGO_ALLOW_ASYNC_UNSAFE")
    os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = "true"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield browser
        browser.close()
    if previous is None:
        os.environ.pop("DJANGO_ALLOW_ASYNC_UNSAFE", None)
    else:
        os.environ["DJANGO_ALLOW_ASYNC_UNSAFE"] = previous


@pytest.fixture
def new_page(chromium):
    """A factory: ``new_page(url=None, user=None, **context_options) -> Page`` in a fresh
    browser context (logged in as ``user`` at ``url`` when given); closed after the test."""
    contexts = []

    def make(url=None, user=None, **context_options):
        context = chromium.new_context(**context_options)
        context.set_default_timeout(WAIT_MS)
        contexts.append(context)
        if user is not None:
            client = Client()
            client.force_login(user)
            context.add_cookies([{"name": "sessionid", "value": client.cookies["sessionid"].value, "url": url}])
        return context.new_page()

    yield make
    for context in contexts:
        # A route handler still running as its page closes would raise in the next test
        # (seen in CI: "Route.fulfill: Fetch response has been disposed").
        for page in context.pages:
            page.unroute_all(behavior="ignoreErrors")
        context.close()


def api(url, user) -> httpx.Client:
    """``user``'s token-authenticated API client on ``url``."""
    return httpx.Client(base_url=url, headers={"Authorization": f"Token {user.auth_token.key}"}, timeout=10)


def wait_live(page):
    """The socket is open and the on-connect snapshot (B4) is applied, so no late snapshot
    resets the clock correction under a test's fast-forward."""
    page.wait_for_selector("#conn[data-state=live]")
    page.wait_for_function("window.runsteadBoard.hydrations >= 1")


def shot(page, name):
    """A full-page screenshot to ``var/test-output/screenshots/<name>``."""
    SCREENSHOTS.mkdir(parents=True, exist_ok=True)
    page.screenshot(path=str(SCREENSHOTS / name), full_page=True)
