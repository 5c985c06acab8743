"""Heads on the page, in a real browser (issue 57 items 5 and 6): a head drafter without a head is refused with a
pointer to the Lab's Forge and keeps the last result; the heads list under the draft field offers a forged head and
fills the draft field; the Forge's "use this head on the Playground" goes to the Playground and says what it filled.

The app here has a heads folder of its own (SPECARENA_CACHE in a temporary folder, the rest of the cache linked), so
that what it offers is what these tests put there, whatever heads this machine has forged.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.test_app import head_folder
from tests.test_browser import (
    STATUS,
    browser,  # noqa: F401 - a fixture
    choose,
    field_message,
    open_page,
    set_max_new_tokens,
    status,
    wait_status,
)

pytestmark = [pytest.mark.browser, pytest.mark.bundled]


@pytest.fixture(scope="module")
def lab_app(tmp_path_factory):
    """(URL, heads folder) of an app whose heads folder starts empty; the bundled model and the measured caches are
    the machine's own, linked."""
    from engine.settings import cache_dir
    from tests.conftest import app_server

    cache = tmp_path_factory.mktemp("cache")
    cache_dir().mkdir(parents=True, exist_ok=True)
    for entry in cache_dir().iterdir():
        if entry.name != "heads":
            (cache / entry.name).symlink_to(entry)
    (cache / "heads").mkdir()
    with app_server(SPECARENA_CACHE=str(cache)) as url:
        yield url, cache / "heads"


@pytest.fixture
def lab_page(browser, lab_app):  # noqa: F811 - the fixture imported above
    page = open_page(browser, lab_app[0], width=1400, height=900)
    page.set_default_timeout(300_000)  # its first run loads the model
    yield page
    page.close()


def test_a_head_drafter_without_a_head_is_refused_toward_the_forge_and_keeps_the_last_result(lab_page):
    page = lab_page
    page.fill("#field-prompt [data-testid=textbox]", "List three colours, one per line.")
    set_max_new_tokens(page, 8)
    page.click("#run")
    wait_status(page, "run 1", "done in")
    shown = {pane: page.inner_text(pane) for pane in ("#baseline-pane", "#spec-pane", "#summary")}
    assert "speedup" in shown["#summary"]
    choose(page, "drafter", "EAGLE-3 head")
    page.wait_for_selector("#heads-note .sa-hint")  # none for this target: where one comes from
    assert "Forge a head" in page.inner_text("#heads-note") and not page.is_visible("#heads")
    page.click("#run")
    page.wait_for_selector("#form-error [data-field=draft]")
    message = field_message(page, "draft")
    assert "needs a head" in message and "Lab tab's Forge" in message, message
    assert status(page).startswith("not started")
    # the refused press took nothing away: the last run's panes and summary are as they were
    assert {pane: page.inner_text(pane) for pane in shown} == shown
    assert page.locator("#live-chart .js-plotly-plot .trace").count() > 0


def test_the_heads_list_offers_a_forged_head_and_picking_it_fills_the_draft_field(lab_page, lab_app):
    heads = lab_app[1]
    folder = head_folder(heads, "forged-for-bundled", target="bundled:smollm2-135m-instruct", when=1_760_000_000)
    try:
        choose(lab_page, "drafter", "EAGLE-3 head")
        lab_page.wait_for_selector("#heads", state="visible")
        assert lab_page.inner_text("#heads-note").strip() == ""  # a list to pick from, no pointer elsewhere
        lab_page.click("#heads input")
        option = lab_page.locator("li[data-testid=dropdown-option]:has-text('forged-for-bundled')")
        assert option.count() == 1 and option.inner_text().startswith("forged 2025-10-")
        option.click()
        lab_page.wait_for_function(f"() => document.querySelector('#field-draft [data-testid=textbox]')"
                                   f".value === {folder!r}")  # fmt: skip
    finally:
        for file in Path(folder).iterdir():
            file.unlink()
        Path(folder).rmdir()


def test_use_this_head_goes_to_the_playground_and_says_what_it_filled(lab_page):
    """A forge of a minute on the bundled model (no measurement after it), then its button."""
    page = lab_page
    page.click("button[role=tab]:has-text('Lab')")
    page.click("#lab-forge .label-wrap")
    page.wait_for_selector("#lab-field-forge_minutes", state="visible")
    page.fill("#lab-field-forge_minutes input[type=number]", "1")
    page.press("#lab-field-forge_minutes input[type=number]", "Tab")
    page.uncheck("#lab-field-forge_pays input")
    page.click("#lab-forge-run")
    page.wait_for_function("() => document.querySelector('#lab-forge-status .sa-status').innerText"
                           ".includes('done: the head is in')", timeout=480_000)  # fmt: skip
    folder = page.inner_text("#lab-forge-status .sa-status").split("done: the head is in", 1)[1].strip()
    page.click("#lab-forge-use")
    page.wait_for_function("() => document.querySelector('button[role=tab][aria-selected=true]')"
                           ".innerText.trim() === 'Playground'")  # fmt: skip
    wait_status(page, "filled from the forged head")
    line = status(page)
    filled = rf"drafter EAGLE-3 head, draft {re.escape(folder)}(, γ \d+)?, tree width \d+; press Run"
    assert re.search(filled, line), line
    assert page.is_visible(STATUS)  # on the tab now shown
    assert page.input_value("#field-draft [data-testid=textbox]") == folder
    assert "EAGLE-3 head" in page.input_value("#field-drafter input")
