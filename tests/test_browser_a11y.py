"""An accessibility audit of the page in a real browser: axe-core (axe-playwright-python) on the Playground before a
run, with a field's error showing, after a run, and on the Lab, at a desktop's 1400x900 and a phone's 390x844.

A serious or critical violation fails the test, named by its rule and the elements it was found on. The audit
covers the whole page, Gradio's parts included: what Gradio draws wrong is mended in the page (app.layout's
MEND_GRADIO), so it is ours to keep right.
"""

from __future__ import annotations

import pytest

from tests.test_browser import browser, open_page, settle, sidebar, wait_status  # noqa: F401 - browser: a fixture

pytestmark = [pytest.mark.browser, pytest.mark.bundled]

SIZES = {"desktop": (1400, 900), "phone": (390, 844)}
FAILS = ("serious", "critical")


def violations(page) -> list[str]:
    """Each serious or critical violation on the page as 'rule (impact): element, element, …'."""
    from axe_playwright_python.sync_playwright import Axe

    found = Axe().run(page).response["violations"]
    return [f"{v['id']} ({v['impact']}): " + ", ".join(" ".join(n["target"]) for n in v["nodes"][:6])
            + (f" and {len(v['nodes']) - 6} more" if len(v["nodes"]) > 6 else "")
            for v in found if v["impact"] in FAILS]  # fmt: skip


def audit(page, state: str) -> list[str]:
    return [f"{state}: {line}" for line in violations(page)]


@pytest.mark.parametrize("size", SIZES)
def test_no_serious_violation_on_the_playground_and_the_lab(browser, live_app, size):  # noqa: F811
    width, height = SIZES[size]
    page = open_page(browser, live_app, width=width, height=height)
    page.set_default_timeout(300_000)  # the first run may load the model first
    try:
        found = audit(page, "before a run")
        page.fill("#field-prompt [data-testid=textbox]", "")
        page.click("#run")
        page.wait_for_selector("#err-field-prompt")  # the message under the field, tied to its input
        # Run comes back enabled a moment after the message, its colour fading in: audited mid-fade, its white label
        # stood on a background still turning violet (seen once the refusal came back fast)
        page.wait_for_function("() => !document.querySelector('#run').disabled")
        settle(page)
        found += audit(page, "with the prompt's error showing")
        if size == "phone":
            sidebar(page, True)
        page.fill("#field-max_new_tokens input[type=number]", "8")
        page.press("#field-max_new_tokens input[type=number]", "Tab")
        if size == "phone":
            sidebar(page, False)
        page.fill("#field-prompt [data-testid=textbox]", "List three colours, one per line.")
        page.click("#run")
        wait_status(page, "run 1", "done in")
        page.wait_for_selector("#live-chart .js-plotly-plot")
        # the run has ended when Run is back (a moment after the status line): audited mid-fade, its white label
        # stood on a background still turning violet
        page.wait_for_function("() => !document.querySelector('#run').disabled")
        settle(page)
        found += audit(page, "after a run")
        page.click("button[role=tab]:has-text('Lab')")
        page.wait_for_selector("#lab-run", state="visible")
        settle(page)
        found += audit(page, "on the Lab")
    finally:
        page.close()
    assert not found, "\n".join(found)


def test_the_audit_names_a_mistake_in_what_we_draw(browser, live_app):  # noqa: F811
    """The audit is not blind to our own parts: an aria-label on an element without a role, the mistake mended in
    Gradio's empty plots, put into the summary, is named with its rule and element."""
    page = open_page(browser, live_app, width=1400, height=900)
    try:
        page.evaluate("""() => { const probe = document.createElement('span');
            probe.id = 'sa-probe'; probe.setAttribute('aria-label', 'speedup');
            document.querySelector('#summary .sa-summary').append(probe); }""")
        found = violations(page)
    finally:
        page.close()
    assert any(line.startswith("aria-prohibited-attr (serious): ") and "#sa-probe" in line for line in found), found
