"""The web page in a real headless Chromium (Debian's ``chromium``, driven by playwright):
chat streams, a second background conversation shows two busy slots, stop frees the slot
and its KV blocks. The same run takes screenshots: into a temporary directory, or, with
``SLOTSERVE_SCREENSHOTS=DIR`` (`make screenshots`: docs/img), the README's (tests never
change tracked files).

The browser is required, never skipped: `make test` installs it when missing, and a
machine without it fails here loudly.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from playwright.sync_api import Page, sync_playwright

from tests.server.conftest import ServerProcess

API_KEY = "web-test-key"
# Without the background-networking flags Chromium dials out at start-up, and this closed
# network refuses those connections; a fresh profile (user_data_dir) keeps runs independent.
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
TIMEOUT_MS = 30_000


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail(
            "Chromium is missing: the web page's browser test needs Debian's `chromium` "
            "(`make test` installs it: apt-get install -y chromium)"
        )
    return path


@pytest.fixture(scope="module")
def web_server() -> Iterator[ServerProcess]:
    server = ServerProcess(
        "bundled",
        "--max-seqs",
        "4",
        "--max-context",
        "1024",
        "--kv-layout",
        "cell",
        "--api-key",
        API_KEY,
    )
    yield server
    assert server.stop() == 0
    assert "Traceback" not in server.output(), server.output()


@pytest.fixture
def page(tmp_path: Path) -> Iterator[Page]:
    with sync_playwright() as playwright:
        context = playwright.chromium.launch_persistent_context(
            str(tmp_path / "profile"),
            executable_path=chromium_path(),
            headless=True,
            args=CHROMIUM_FLAGS,
            viewport={"width": 1440, "height": 1000},
        )
        context.set_default_timeout(TIMEOUT_MS)
        try:
            yield context.pages[0] if context.pages else context.new_page()
        finally:
            context.close()


BUSY = "#slots tbody tr:not([data-state='idle'])"


def send(page: Page, text: str, priority: str, max_tokens: int) -> None:
    """Type ``text`` into the selected conversation with these settings, and send it."""
    panel = page.locator(".conversation:not([hidden])")
    panel.locator(".priority").select_option(priority)
    panel.locator(".temperature").fill("0")
    panel.locator(".max-tokens").fill(str(max_tokens))
    panel.locator(".prompt").fill(text)
    panel.locator(".send").click()


@pytest.fixture
def screenshots(tmp_path: Path) -> Path:
    """Where the screenshots go: ``$SLOTSERVE_SCREENSHOTS`` if set, else a temporary dir."""
    chosen = os.environ.get("SLOTSERVE_SCREENSHOTS")
    return Path(chosen) if chosen else tmp_path


@pytest.mark.slow
def test_chat_dashboard_and_stop_in_a_real_browser(
    web_server: ServerProcess, page: Page, screenshots: Path
) -> None:
    # 1. The page loads, asks for the key once, and its dashboard feed goes live.
    page.goto(web_server.url + "/")
    page.locator("#key-input").fill(API_KEY)
    page.locator("#key-form button[type=submit]").click()
    page.wait_for_selector("#feed-status[data-state='live']")
    page.wait_for_function("document.querySelector('#model-name').textContent.includes('SmolLM')")

    # 2. A short interactive message streams in, rendered as Markdown (the model answers
    # with a numbered list), and gets its footer (TTFT, tok/s, tokens).
    chat1 = page.locator(".conversation[data-conversation='1']")
    send(page, "Name three fruits as a bulleted list, nothing else.", "interactive", 32)
    first = chat1.locator(".msg.assistant").first
    page.wait_for_function(
        "document.querySelector('.msg.assistant .body').textContent.trim().length > 0"
    )
    page.wait_for_function("document.querySelector('.msg.assistant .footer').textContent")
    assert "TTFT" in first.locator(".footer").inner_text()
    # The renderer itself, on fixed input (the model's wording may vary by CPU kernel):
    # lists and code become markup, HTML in a reply stays text.
    rendered = page.evaluate(
        "import('/web/markdown.js').then(m => m.renderMarkdown("
        "'1. a\\n2. **b**\\n\\n```\\nx < 1\\n```\\n<img src=x onerror=alert(1)>'))"
    )
    assert rendered == (
        "<ol><li>a</li><li><strong>b</strong></li></ol><pre><code>x &lt; 1</code></pre>"
        "<p>&lt;img src=x onerror=alert(1)&gt;</p>"
    )

    # 3. A long interactive answer, then a second, background conversation: two busy slots.
    send(page, "Write a long story about a lighthouse keeper and a storm.", "interactive", 900)
    page.wait_for_function(
        "[...document.querySelectorAll('.conversation[data-conversation=\"1\"] .msg.assistant')]"
        '.length === 2 && document.querySelectorAll(\'.conversation[data-conversation="1"] '
        ".msg.assistant')[1].textContent.trim().length > 20"
    )
    page.locator("#new-tab").click()
    send(page, "Write a long essay about the history of tea.", "background", 900)
    page.wait_for_function(f'document.querySelectorAll("{BUSY}").length === 2', timeout=TIMEOUT_MS)
    classes = page.locator(BUSY).evaluate_all("rows => rows.map(r => r.dataset.class).sort()")
    assert classes == ["background", "interactive"]
    used_while_busy = int(page.locator("#tile-kv").get_attribute("data-used"))
    assert used_while_busy > 0
    page.wait_for_timeout(1500)  # let the latency charts gather a few points
    screenshots.mkdir(parents=True, exist_ok=True)
    page.locator("#dashboard").screenshot(path=str(screenshots / "web-dashboard.png"))

    # 4. Stop the background conversation: its slot goes idle and its blocks are freed.
    page.locator(".conversation[data-conversation='2'] .stop").click()
    page.wait_for_function(f'document.querySelectorAll("{BUSY}").length === 1')
    page.wait_for_function(
        f"Number(document.querySelector('#tile-kv').dataset.used) < {used_while_busy}"
    )
    # Then the interactive one: every slot idle, the pool empty, the cancels counted.
    page.locator("#tabs .tab", has_text="Chat 1").click()
    page.locator(".conversation[data-conversation='1'] .stop").click()
    page.wait_for_function(f'document.querySelectorAll("{BUSY}").length === 0')
    # (the prefix cache, on by default, may keep the conversations' prompts: only its
    # snapshots hold blocks now)
    page.wait_for_function(
        "document.querySelector('#tile-kv').dataset.used === "
        "document.querySelector('#tile-kv').dataset.cached"
    )
    page.wait_for_function("Number(document.querySelector('#tile-cancel').textContent) >= 2")
    assert "stopped" in chat1.locator(".msg.assistant .footer").nth(1).inner_text()
    page.locator("#chat").screenshot(path=str(screenshots / "web-chat.png"))
    assert (screenshots / "web-chat.png").stat().st_size > 10_000  # a picture, not a blank
