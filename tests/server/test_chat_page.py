"""The chat page at / of loom serve (loom/server/static/chat.html)."""

from __future__ import annotations

import re
import shutil
import subprocess
import time

import httpx
import pytest

from loom.server.security import SecurityConfig
from tests.server.conftest import make_fake_front, serve


def test_the_page_is_served_without_the_key_and_has_no_external_assets() -> None:
    front, _ = make_fake_front(step_delay_s=0.001)
    with serve(front, security=SecurityConfig(api_key="k")) as live, \
            httpx.Client(base_url=live.base_url, timeout=10) as c:
        r = c.get("/")
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
        page = r.text
        assert "/v1/chat/completions" in page and 'id="api_key"' in page
        assert not re.search(r'(src|href)="(https?:)?//', page)  # nothing fetched from elsewhere
        assert c.get("/v1/models").status_code == 401  # the API itself stays guarded


def _page_script() -> str:
    from loom.server.api_server import CHAT_PAGE

    return CHAT_PAGE.read_text().split("<script>", 1)[1].split("</script>", 1)[0]


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_the_pages_sse_parser_in_node() -> None:
    """parseSSE splits complete events, keeps a partial one, skips [DONE]."""
    script = _page_script()
    parser = script[script.index("function parseSSE"):script.index("function headers")]
    test = parser + r'''
const [a, rest] = parseSSE('data: {"x": 1}\n\ndata: [DONE]\n\ndata: {"y"');
const [b, rest2] = parseSSE(rest + ': 2}\n\n');
console.log(JSON.stringify([a, rest, b, rest2]));
'''
    out = subprocess.run(["node", "-e", test], capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.strip() == '[[{"x":1}],"data: {\\"y\\"",[{"y":2}],""]'


def _browser():  # noqa: ANN202
    webdriver = pytest.importorskip("selenium.webdriver")
    from selenium.webdriver.chrome.service import Service

    binary = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if binary is None or driver is None:
        pytest.skip("no headless Chromium and chromedriver installed (Debian: apt-get install chromium "
                    "chromium-driver)")
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(arg)
    return webdriver.Chrome(service=Service(driver), options=options)


def test_a_chat_in_headless_chromium() -> None:
    """Type a message, send it, watch the streamed reply appear; a second turn carries the history; a wrong
    key shows the server's error."""
    from selenium.webdriver.common.by import By

    front, fake = make_fake_front(step_delay_s=0.001)
    browser = _browser()
    try:
        with serve(front, security=SecurityConfig(api_key="k")) as live:
            browser.get(live.base_url + "/")
            browser.find_element(By.ID, "api_key").send_keys("k")
            browser.find_element(By.ID, "max_tokens").clear()
            browser.find_element(By.ID, "max_tokens").send_keys("8")
            browser.find_element(By.ID, "prompt").send_keys("hello")
            browser.find_element(By.ID, "send").click()
            deadline = time.monotonic() + 20

            def replies() -> list[str]:
                return [e.text for e in browser.find_elements(By.CSS_SELECTOR, ".msg.assistant")]

            while time.monotonic() < deadline and not (replies() and replies()[-1]):
                time.sleep(0.1)
            assert replies() and replies()[-1], browser.page_source[-500:]
            assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
            browser.find_element(By.ID, "prompt").send_keys("again")
            browser.find_element(By.ID, "send").click()
            while time.monotonic() < deadline and len([r for r in replies() if r]) < 2:
                time.sleep(0.1)
            assert len([r for r in replies() if r]) == 2
            browser.execute_script("localStorage.clear()")
            key = browser.find_element(By.ID, "api_key")
            key.clear()
            key.send_keys("wrong")
            browser.find_element(By.ID, "prompt").send_keys("hi")
            browser.find_element(By.ID, "send").click()
            while time.monotonic() < deadline and not browser.find_elements(By.CSS_SELECTOR, ".msg.error"):
                time.sleep(0.1)
            errors = browser.find_elements(By.CSS_SELECTOR, ".msg.error")
            assert errors and "API key" in errors[0].text
    finally:
        browser.quit()
