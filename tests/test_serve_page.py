"""The web page at `/` in a real headless browser (Debian's chromium driven by Playwright): against a live server
of the default model with an API key, the page takes the key, lists the methods, streams a reply to a typed prompt
with each token coloured by who drafted it (prompt lookup on a reply that repeats the prompt, the target's own
tokens) and shows a tokens/s figure that moves while the reply streams.

Skipped, with the reason, where chromium or Playwright is missing; `.ci/run` installs both (scripts/setup.sh) and
sets DRAFTVERIFY_BROWSER_TESTS=1, under which a missing browser fails instead."""

from __future__ import annotations

import os
import shutil

import pytest
from test_serve import WAIT_S, serving, url_of

from draftverify import Engine

pytestmark = pytest.mark.slow

KEY = "page-secret"
# prompt lookup drafts in every round where the text repeats itself, so the reply below has drafted tokens to
# colour (auto's choice among its candidates follows its measured prices, which a busy machine moves)
METHODS = "prompt-lookup,autoregressive"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
SAY = "Repeat after me three times: the quick brown fox jumps over the lazy dog."


def chromium() -> str:
    """The browser to drive, or a skip (a failure where the CI requires the browser tests) saying what is missing."""
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    missing = None
    try:
        import playwright.sync_api  # noqa: F401
    except ImportError:
        missing = "Playwright for Python is not installed: pip install 'draftverify[test]'"
    if path is None:
        missing = "no chromium on PATH: apt-get install chromium (scripts/setup.sh does, as root)"
    if missing and os.environ.get("DRAFTVERIFY_BROWSER_TESTS") == "1":
        pytest.fail(missing)
    if missing:
        pytest.skip(missing)
    return path


@pytest.fixture(scope="module")
def page_url(smollm):
    with serving(Engine(smollm), METHODS, api_keys=(KEY,)) as (client, _):
        yield url_of(client)


@pytest.fixture
def page():
    path = chromium()
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=path, args=CHROMIUM_ARGS)
        try:
            yield browser.new_page()
        finally:
            browser.close()


def test_the_page_streams_a_reply_coloured_by_drafter(page, page_url):
    page.set_default_timeout(10 * WAIT_S * 1000)
    page.goto(page_url + "/")  # open without the key
    page.fill("#api-key", KEY)
    page.dispatch_event("#api-key", "change")
    page.wait_for_function("document.querySelectorAll('#method option').length >= 2")
    assert page.eval_on_selector_all("#method option", "os => os.map(o => o.value)") == [
        "prompt-lookup",
        "autoregressive",
    ]
    page.select_option("#method", "prompt-lookup")
    page.fill("#max-tokens", "48")
    page.evaluate(  # every value the tokens/s figure takes while the reply streams
        """() => { window.tps = [];
        new MutationObserver(() => window.tps.push(document.getElementById('tps').textContent))
            .observe(document.getElementById('tps'), {childList: true, characterData: true, subtree: true}); }"""
    )
    page.fill("#prompt", SAY)
    page.click("#send")
    page.wait_for_function("document.getElementById('status').textContent.startsWith('done')")
    assert not page.query_selector(".error")
    tokens = page.eval_on_selector_all(".assistant .tok", "ts => ts.map(t => [t.className, t.textContent])")
    classes = {c for c, _ in tokens}
    assert "tok by-target" in classes and "tok by-prompt-lookup" in classes, classes
    reply = page.text_content(".assistant")
    assert "quick brown fox" in reply and "".join(text for _, text in tokens) == reply
    assert int(page.text_content("#tokens")) >= len(tokens)  # with the reply's end, a token of no text
    tps = page.evaluate("window.tps")
    assert len(tps) >= 2 and all(float(x) > 0 for x in tps), tps  # set anew as chunks arrived
    assert page.text_content("#acceptance").endswith("%")
    assert "drafted by prompt-lookup" in page.text_content("#legend")
