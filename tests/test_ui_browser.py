"""The browser chat page (``api/ui.py``, ``api/static/``): routes, and a two-turn chat in headless Chromium.

The browser test needs Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromium``,
``/usr/bin/chromedriver``) and the ``selenium`` package; it is skipped when one is missing.
Selenium is pointed at the system driver, so it never tries to download one.
``RKV_UI_SCREENSHOT=path.png`` also copies the screenshot there (how ``docs/screenshot.png`` is made).
"""
from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api.backend import Backend
from api.routes import create_app
from api.ui import STATIC_DIR

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


class IdleBackend(Backend):
    """Enough of a backend for routes that never reach it."""

    kind = "idle"
    replica = "idle-replica"
    model_name = "none"

    def _none(self, *args, **kwargs):
        raise NotImplementedError

    create_session = import_session = resume = get_session = export_session = _none
    delete_session = cancel = list_sessions = chat = stats = _none


def test_page_and_assets_are_served_without_external_urls():
    with TestClient(create_app(IdleBackend())) as client:
        page = client.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert 'id="new-session"' in page.text and 'src="static/app.js"' in page.text
        assert page.headers["x-replica"] == "idle-replica"
        for name, kind in [("app.js", "text/javascript"), ("style.css", "text/css")]:
            r = client.get(f"/static/{name}")
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), name
            assert r.content == (STATIC_DIR / name).read_bytes()
        for bad in ["/static/missing.js", "/static/.hidden.js", "/static/ui.py", "/static/index.py"]:
            r = client.get(bad)
            assert r.status_code == 404 and r.json()["error"]["code"] == "not_found", bad
        for bad in ["/static/..%2Fui.py", "/static/../ui.py", "/static/%2e%2e/ui.py"]:
            r = client.get(bad)
            assert r.status_code == 404 and "APIRouter" not in r.text, bad
        assert client.get("/healthz").status_code == 200  # the API routes are untouched
        assert "/" not in client.get("/openapi.json").json()["paths"]

    for path in STATIC_DIR.iterdir():  # nothing is loaded from another origin (no CDN, no web fonts)
        text = path.read_text()
        assert not re.search(r"""(src|href)\s*=\s*["']?(https?:)?//""", text), path.name
        assert not re.search(r"""(url\(|import\s*\(?|fetch\()\s*["']?(https?:)?//""", text), path.name


def _driver(tmp_path):
    webdriver = pytest.importorskip("selenium.webdriver", reason="selenium is not installed (pip install selenium)")
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = str(CHROMIUM)
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--disable-background-networking", "--disable-component-update", "--disable-sync",
                "--no-first-run", "--disable-extensions", "--window-size=1440,900",
                f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(executable_path=str(CHROMEDRIVER)))


@pytest.mark.slow
@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                    reason="needs /usr/bin/chromium and /usr/bin/chromedriver (apt-get install chromium chromium-driver)")
def test_two_turn_chat_in_a_browser_shows_streamed_replies_and_memory_tiers(loaded, tmp_path, monkeypatch):
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from serving_helpers import local_server

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not fetch drivers or browsers
    started = time.monotonic()
    with local_server(loaded) as server:
        driver = _driver(tmp_path)
        try:
            wait = WebDriverWait(driver, 60, poll_frequency=0.1)
            css = lambda sel: driver.find_elements(By.CSS_SELECTOR, sel)  # noqa: E731

            def until(condition, what):
                try:
                    return wait.until(lambda _: condition())
                except TimeoutException:
                    errors = [e.text for e in css(".error")]
                    raise AssertionError(f"timed out waiting for {what}; errors shown: {errors}") from None

            driver.get(server.url + "/")
            until(lambda: "test-replica" in driver.find_element(By.ID, "server-info").text, "the health line")

            Select(driver.find_element(By.ID, "mode")).select_by_value("tiered")
            driver.find_element(By.ID, "budget").send_keys("64")
            max_tokens = driver.find_element(By.ID, "max-tokens")
            max_tokens.clear()
            max_tokens.send_keys("16")
            driver.find_element(By.ID, "new-session").click()
            until(lambda: len(css(".session-item")) == 1 and driver.find_element(By.ID, "message").is_enabled(),
                  "the new session")
            assert driver.find_element(By.ID, "session-mode").text == "tiered"
            assert driver.find_element(By.ID, "session-budget").text == "64"

            for turn, text in enumerate(["My name is Ada. Please remember it.", "What is my name?"], start=1):
                driver.find_element(By.ID, "message").send_keys(text)
                until(lambda: driver.find_element(By.ID, "send").is_enabled(), "the send button")
                driver.find_element(By.ID, "send").click()
                until(lambda n=turn: len(css('.msg.assistant[data-state="done"]')) == n, f"reply {turn}")
                until(lambda: driver.find_element(By.ID, "usage").get_attribute("data-state") == "done",
                      f"the usage of turn {turn}")
                until(lambda n=turn: driver.find_element(By.ID, "session-turns").text == str(n),
                      f"the session detail after turn {turn}")

            replies = [e.text for e in css(".assistant-message")]
            assert len(replies) == 2 and all(r.strip() for r in replies), replies
            assert [e.text for e in css(".user-message")] == ["My name is Ada. Please remember it.",
                                                               "What is my name?"]
            generated = int(driver.find_element(By.ID, "usage-generated").text)
            assert 1 <= generated <= 16
            prompt = int(driver.find_element(By.ID, "usage-prompt").text.replace(",", ""))
            prefilled = int(driver.find_element(By.ID, "usage-prefilled").text.replace(",", ""))
            assert prefilled < prompt  # the second turn reused the cached history

            device_bytes = driver.find_element(By.ID, "device-bytes")
            assert int(device_bytes.get_attribute("data-bytes")) > 0
            assert re.match(r"^[0-9.]+ (B|KiB|MiB|GiB)$", device_bytes.text) and device_bytes.text != "0 B"
            assert driver.find_element(By.ID, "bar-device").size["width"] > 0
            history = int(driver.find_element(By.ID, "history-tokens").text.replace(",", ""))
            on_device = int(driver.find_element(By.ID, "device-tokens").text.replace(",", ""))
            assert history >= prompt and 0 < on_device <= history
            assert css(".error") == [], [e.text for e in css(".error")]
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert severe == [], severe

            shot = tmp_path / "ui.png"
            assert driver.save_screenshot(str(shot))
            assert shot.stat().st_size > 10_000 and shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            if os.environ.get("RKV_UI_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["RKV_UI_SCREENSHOT"])
        finally:
            driver.quit()
    assert time.monotonic() - started < 120
