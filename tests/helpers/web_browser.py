"""The web pages in a real headless browser: Debian's ``chromium`` driven by ``playwright``
(the ``browser`` fixture skips, with the reason, when either is missing). Screenshots go to
``ARTIFACTS`` (``test-artifacts/web/``; ``LLMKIT_TEST_ARTIFACTS`` overrides)."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARTIFACTS = Path(os.environ.get("LLMKIT_TEST_ARTIFACTS", REPO / "test-artifacts")) / "web"
CHROMIUM_ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--no-first-run"]


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    """A persistent chromium context with a fresh user-data dir."""
    if not os.path.exists(CHROMIUM):
        pytest.skip("Debian's chromium is not installed (apt-get install chromium)")
    sync_api = pytest.importorskip("playwright.sync_api",
                                   reason="the playwright package is not installed")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        context = p.chromium.launch_persistent_context(
            str(tmp_path_factory.mktemp("chromium-profile")), executable_path=CHROMIUM,
            args=CHROMIUM_ARGS, headless=True, viewport={"width": 1280, "height": 860})
        context.set_default_timeout(90_000)  # a busy 2-core box can stall a page for tens of s
        try:
            yield context
        finally:
            context.close()


def open_page(browser, server, path: str):
    page = browser.new_page()
    problems: list[str] = []
    page.on("console", lambda m: problems.append(m.text) if m.type == "error" else None)
    page.on("pageerror", lambda e: problems.append(str(e)))
    page.goto(server.url(path))
    return page, problems


def record_first(page, element_id: str, snapshot_js: str) -> None:
    """From now on, keep the first non-null value of ``snapshot_js`` (a JS function body of no
    arguments) seen right after the element ``element_id`` changes, for ``recorded``.

    A MutationObserver runs after the page's handler has finished drawing one event, so the
    snapshot is whole and taken as it happens; polling from the test (each animation frame of a
    background tab, or a timer) can miss a state that a fast CPU passes through within a second.
    """
    page.evaluate("""([id, body]) => {
        const snapshot = new Function(body);
        window.firstRecorded = null;
        new MutationObserver(() => {
            if (window.firstRecorded === null) window.firstRecorded = snapshot();
        }).observe(document.getElementById(id), {childList: true, subtree: true,
                                                  characterData: true});
    }""", [element_id, snapshot_js])


def recorded(page):
    """The snapshot ``record_first`` kept, waiting for it (the context's timeout)."""
    return page.wait_for_function("() => window.firstRecorded", polling=100).json_value()
