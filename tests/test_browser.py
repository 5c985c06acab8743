"""End to end in a real browser: Debian's chromium driven by playwright, against `python app.py`.

Set SPECARENA_SCREENSHOT=assets/screenshot.png to refresh the README's screenshot from this run.
"""

from __future__ import annotations

import os
import shutil

import pytest

pytestmark = [pytest.mark.browser, pytest.mark.bundled]

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--no-first-run"]  # fmt: skip
LONG = "Write a long story about a lighthouse keeper who talks to the sea, with many chapters."


@pytest.fixture(scope="module")
def page(live_app):
    from playwright.sync_api import sync_playwright

    if not os.path.exists(CHROMIUM):
        pytest.fail("chromium is missing: install it with `apt-get install chromium` (tests/run.sh does)")
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1800})
        page.set_default_timeout(240_000)
        page.goto(live_app)
        page.wait_for_selector("#run")
        yield page
        browser.close()


def wait_status(page, *parts: str) -> None:
    condition = " && ".join(f"s.includes({part!r})" for part in parts)
    page.wait_for_function(f"() => {{ const s = document.querySelector('#status').innerText; return {condition}; }}")


def test_default_preset_runs_and_renders_everything(page):
    page.click("#run")
    wait_status(page, "run 1")
    page.wait_for_selector("#summary .sa-badge")
    assert "outputs identical" in page.inner_text("#summary")
    assert page.locator("#spec-pane .sa-acc").count() > 0
    assert page.inner_text("#baseline-pane .sa-text").strip()
    assert "tok/s" in page.inner_text("#spec-pane .sa-stats")
    page.wait_for_selector("#live-chart .js-plotly-plot")
    page.wait_for_selector("#memory-chart .js-plotly-plot")
    assert page.locator("#live-chart .main-svg").count() > 0
    # hovering a token shows p and q
    assert "p=" in page.locator("#spec-pane .sa-acc").first.get_attribute("title")
    # rejected drafts are hidden until asked for
    rejected = page.locator("#spec-pane .sa-text .sa-rej")
    if rejected.count():
        assert not rejected.first.is_visible()
        page.click("#show-rejected input")
        assert rejected.first.is_visible()
        page.click("#show-rejected input")
    if os.environ.get("SPECARENA_SCREENSHOT"):
        page.screenshot(path=os.environ["SPECARENA_SCREENSHOT"], full_page=True)


def test_stop_mid_run_then_recover(page):
    page.fill("#prompt textarea", LONG)
    page.click("#parameters")
    page.fill("#max-new-tokens input[type=number]", "400")
    page.press("#max-new-tokens input[type=number]", "Enter")
    page.click("#run")
    wait_status(page, "run 2", "running baseline")
    page.wait_for_function("() => document.querySelector('#baseline-pane .sa-text').innerText.length > 20")
    page.click("#stop")
    wait_status(page, "run 2", "stopped by user")
    assert "stopped" in page.inner_text("#baseline-pane .sa-stats")
    # the app is ready for the next run
    page.fill("#max-new-tokens input[type=number]", "12")
    page.press("#max-new-tokens input[type=number]", "Enter")
    page.click("#run")
    wait_status(page, "run 3", "running speculative")
    page.wait_for_function("() => document.querySelector('#spec-pane .sa-stats').innerText.includes('length')")
    assert "12 tokens" in page.inner_text("#spec-pane .sa-stats")
