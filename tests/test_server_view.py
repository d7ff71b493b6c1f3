"""The live acceptance view in a real browser: headless Chromium (Debian's `chromium`, installed by
scripts/test.sh) loads `/` from a loopback server over the tiny random target, a prompt is typed
and submitted, and the streamed answer appears token by token in at least two colours — accepted
lookup drafts and the target's own tokens — with τ, tokens/s, acceptance bars and, on request,
plain decoding's speed. A screenshot is saved (under pytest's tmp dir; also to $D3D_VIEW_SCREENSHOT
when set).

Lookup on a repetitive prompt makes the tiny random model's drafts land deterministically (its
untrained drafter's rarely do), so both colours appear in every run.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("uvicorn")
d3d_server = pytest.importorskip("d3d.server")

from d3d.devtools import Chromium, find_chromium  # noqa: E402
from test_generation import tiny_pipeline  # noqa: E402
from test_server import expected, running  # noqa: E402

PROMPT = "hello hello hello hello"
EXECUTABLE = find_chromium()
pytestmark = pytest.mark.skipif(
    EXECUTABLE is None, reason="Chromium is not installed: scripts/test.sh installs Debian's chromium package "
                               "where it can (apt-get install chromium)")


@pytest.fixture(scope="module")
def pipeline():
    return tiny_pipeline(eos_token_ids=[])


@pytest.fixture(scope="module")
def page(pipeline):
    """The view loaded in headless Chromium: (browser, base URL)."""
    with running(d3d_server.create_app(pipeline, "tiny")) as url, Chromium(EXECUTABLE) as browser:
        browser.open(f"{url}/")
        yield browser, url


def fill(browser: Chromium, **fields: str) -> None:
    for name, value in fields.items():
        browser.evaluate(f"document.getElementById({json.dumps(name)}).value = {json.dumps(value)}")


STATE = """JSON.stringify({
  origins: [...document.querySelectorAll('#output .tok')].map(s => s.className.replace('tok ', '')),
  colours: [...new Set([...document.querySelectorAll('#output .tok')].map(s => getComputedStyle(s).backgroundColor))],
  text: document.getElementById('output').textContent,
  tau: document.getElementById('tau').textContent, speed: document.getElementById('speed').textContent,
  ar: document.getElementById('ar').textContent, bars: document.querySelectorAll('#bars div').length,
  status: document.getElementById('status').textContent})"""


def state(browser: Chromium) -> dict:
    return json.loads(browser.evaluate(STATE))


def test_a_prompt_streams_coloured_tokens_with_tau(page, pipeline, tmp_path):
    browser, _ = page
    fill(browser, prompt=PROMPT, mode="text", method="lookup", temperature="0", max_tokens="60")
    browser.evaluate("document.getElementById('run').click()")
    browser.wait_for("document.getElementById('status').textContent.startsWith('done')", 30)
    shown = state(browser)
    screenshot = browser.screenshot(tmp_path / "server-view.png")
    if os.environ.get("D3D_VIEW_SCREENSHOT"):
        shutil.copy(screenshot, os.environ["D3D_VIEW_SCREENSHOT"])
    assert {"lookup", "target"} <= set(shown["origins"])
    assert len(shown["colours"]) >= 2  # the two origins really are drawn differently
    assert shown["text"] == expected(pipeline, PROMPT, chat=False, max_new_tokens=60, method="ar")[0]
    assert float(shown["tau"]) > 1.0 and float(shown["speed"]) > 0
    assert shown["bars"] >= 1
    assert screenshot.stat().st_size > 10_000  # a real rendering, not an empty image


def test_plain_decoding_speed_on_request(page):
    browser, _ = page
    fill(browser, prompt=PROMPT, mode="text", method="lookup", temperature="0", max_tokens="30")
    browser.evaluate("document.getElementById('run').click()")
    browser.wait_for("document.getElementById('status').textContent.startsWith('done')", 30)
    browser.evaluate("document.getElementById('compare').click()")
    status = browser.wait_for("document.getElementById('status').textContent.startsWith('plain decoding:') && "
                              "document.getElementById('status').textContent", 30)
    assert "same text" in status and "as fast" in status
    assert float(state(browser)["ar"]) > 0


def test_errors_are_shown_not_swallowed(page):
    """A refused request (here: an empty raw prompt) shows the server's message in the page."""
    browser, _ = page
    fill(browser, prompt="", mode="text", method="lookup", max_tokens="10")
    browser.evaluate("document.getElementById('run').click()")
    message = browser.wait_for("document.getElementById('status').className === 'error' && "
                               "document.getElementById('status').textContent", 30)
    assert "the prompt is empty" in message
