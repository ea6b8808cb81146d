"""The browser chat page (``api/ui.py``, ``api/static/``): routes, and a two-turn chat in headless Chromium.

The browser test needs Debian's ``chromium`` and ``chromium-driver`` (``/usr/bin/chromium``,
``/usr/bin/chromedriver``) and the ``selenium`` package; it is skipped when one is missing.
Selenium is pointed at the system driver, so it never tries to download one.
``RKV_UI_SCREENSHOT=path.png`` also copies the screenshot there (how ``docs/screenshot.png`` is made).
"""
from __future__ import annotations

import math
import os
import re
import shutil
import time
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from api.routes import create_app
from api.ui import STATIC_DIR

CHROMIUM = Path("/usr/bin/chromium")
CHROMEDRIVER = Path("/usr/bin/chromedriver")


class IdleService:
    """Enough of a session service for routes that never reach it."""

    kind = "idle"
    replica = "idle-replica"
    model_name = "none"

    async def start(self) -> None:
        pass

    async def close(self) -> None:
        pass


def test_page_and_assets_are_served_without_external_urls():
    with TestClient(create_app(IdleService())) as client:
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
    from selenium import webdriver
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
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from serving_helpers import local_server

    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium Manager must not fetch drivers or browsers
    started = time.monotonic()
    with local_server(loaded) as server:
        driver = _driver(tmp_path)
        try:
            # The page re-renders lists as details arrive: a found element may go stale, so retry.
            wait = WebDriverWait(driver, 60, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException])
            css = lambda sel: driver.find_elements(By.CSS_SELECTOR, sel)  # noqa: E731

            def session_ids() -> list[str]:  # read in one script: no stale elements
                return driver.execute_script(
                    "return [...document.querySelectorAll('.session-item')].map(e => e.dataset.sessionId)")

            def until(condition, what):
                try:
                    return wait.until(lambda _: condition())
                except TimeoutException:
                    errors = [e.text for e in css(".error")]
                    raise AssertionError(f"timed out waiting for {what}; errors shown: {errors}") from None

            driver.get(server.url + "/")
            until(lambda: "test-replica" in driver.find_element(By.ID, "server-info").text, "the health line")
            # A saved API key rides along (Bearer header, ?api_key= on the socket); this server ignores it.
            driver.find_element(By.ID, "api-key").send_keys("test-key")
            driver.find_element(By.ID, "save-key").click()
            until(lambda: driver.execute_script("return localStorage.getItem('rkv-mt.apiKey')") == "test-key",
                  "the saved API key")

            Select(driver.find_element(By.ID, "mode")).select_by_value("tiered")
            driver.find_element(By.ID, "budget").send_keys("64")
            max_tokens = driver.find_element(By.ID, "max-tokens")
            max_tokens.clear()
            max_tokens.send_keys("16")
            driver.find_element(By.ID, "new-session").click()
            until(lambda: len(session_ids()) == 1 and driver.find_element(By.ID, "message").is_enabled(),
                  "the new session")
            assert driver.find_element(By.ID, "session-mode").text == "tiered"
            assert driver.find_element(By.ID, "session-budget").text == "64"
            # The sampling panel shows the server's defaults (this suite's servers are greedy); a value set
            # there is this session's, sent with each message and shown back from the turn's `done`.
            driver.find_element(By.CSS_SELECTOR, "#sampling summary").click()
            assert driver.find_element(By.ID, "s-temperature").get_attribute("placeholder") == "0"
            assert driver.find_element(By.ID, "s-top_k").get_attribute("placeholder") == "20"
            driver.find_element(By.ID, "s-repetition_penalty").send_keys("1.2")

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
            assert driver.find_element(By.ID, "usage-sampling").text == "greedy, repetition 1.2"
            stored = driver.execute_script("return JSON.parse(localStorage.getItem('rkv-mt.sessions'))[0].sampling")
            assert stored == {"repetition_penalty": 1.2}
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
            (first,) = session_ids()

            # A second session: the cancel button stops a long reply, which stays marked cancelled.
            Select(driver.find_element(By.ID, "mode")).select_by_value("snapkv")
            driver.find_element(By.ID, "budget").clear()
            driver.find_element(By.ID, "new-session").click()
            until(lambda: len(session_ids()) == 2 and not css(".msg"), "the second session")
            assert driver.find_element(By.ID, "session-mode").text == "snapkv"
            max_tokens.clear()
            max_tokens.send_keys("400")
            driver.find_element(By.ID, "message").send_keys("Write a long story about the sea.")
            driver.find_element(By.ID, "send").click()
            until(lambda: css(".msg.assistant.streaming .assistant-message")
                  and css(".assistant-message")[0].text.strip(), "the first delta")
            driver.find_element(By.ID, "cancel").click()
            until(lambda: css('.msg.assistant[data-state="cancelled"]'), "the cancelled reply")
            assert driver.find_element(By.ID, "usage-finish").text == "cancelled"
            assert int(driver.find_element(By.ID, "usage-generated").text) < 400

            # Switching back reloads the first session's transcript and memory over REST, and resumes it.
            until(lambda: driver.find_element(By.CSS_SELECTOR, f'.session-item[data-session-id="{first}"]').click()
                  or True, "a click on the first session")
            until(lambda: len(css('.msg.assistant[data-state="done"]')) == 2
                  and driver.find_element(By.ID, "session-turns").text == "2", "the first session's transcript")
            assert [e.text for e in css(".assistant-message")] == replies
            until(lambda: int(driver.find_element(By.ID, "device-bytes").get_attribute("data-bytes")) > 0,
                  "the first session's memory")
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert severe == [] and css(".error") == [], (severe, [e.text for e in css(".error")])

            # Deleting it in the page leaves the second one selected.
            driver.find_element(By.ID, "delete-session").click()
            wait.until(lambda d: d.switch_to.alert).accept()
            until(lambda: len(session_ids()) == 1 and session_ids() != [first], "the deletion")
            (second,) = session_ids()
            assert [s["session_id"] for s in httpx.get(f"{server.url}/v1/sessions").json()["sessions"]] == [second]
            until(lambda: driver.find_element(By.ID, "session-title").text == second, "the second session selected")

            # Server errors are shown: the session is deleted behind the page's back, then used.
            token = driver.execute_script(
                "return JSON.parse(localStorage.getItem('rkv-mt.sessions'))"
                ".find(s => s.session_id === arguments[0]).token", second)
            assert httpx.delete(f"{server.url}/v1/sessions/{second}",
                                headers={"x-session-token": token}).status_code == 204
            max_tokens.clear()
            max_tokens.send_keys("4")
            driver.find_element(By.ID, "message").send_keys("Hello?")
            driver.find_element(By.ID, "send").click()
            until(lambda: css('.error[data-code="session_not_found"]'), "the session_not_found error")
            assert css('.error[data-code="session_not_found"]')[0].is_displayed()
            assert driver.find_element(By.ID, "send").is_enabled()  # the page stays usable
        finally:
            driver.quit()
    assert time.monotonic() - started < 120


# The page's colours per state (api/static/memory_map.js, MAP_COLORS), as [r, g, b].
MAP_COLORS = {"device": "#3b5bdb", "host": "#f08c00", "redis": "#c92a2a", "evicted": "#ced4da",
              "unfed": "#f1f3f5", "lost": "#212529", "readmitted": "#40c057"}
RGB = {state: [int(hex_[i : i + 2], 16) for i in (1, 3, 5)] for state, hex_ in MAP_COLORS.items()}
PAGE_BYTES = 32 * 64 * 2 * 4  # one cold page of the bundled model: 32 tokens of one KV head, keys and values, fp32
STORY = ("Mara kept the lighthouse on the north cape for eleven winters. The spare key to the lamp room "
         "hangs on a hook shaped like a fish, behind the third step of the iron stair. Every evening she "
         "wound the clockwork, trimmed the wick and wrote the weather in a green book. Ships passed far out, "
         "and sometimes a gull rested on the rail and watched her work until the light turned. ") * 3


def _runs(flat: list[int], states: list[str]) -> list[tuple[str, int, int]]:
    out, at = [], 0
    for state, length in zip(flat[::2], flat[1::2]):
        out.append((states[state], at, at + length))
        at += length
    return out


@pytest.mark.slow
@pytest.mark.skipif(not (CHROMIUM.exists() and CHROMEDRIVER.exists()),
                    reason="needs /usr/bin/chromium and /usr/bin/chromedriver (apt-get install chromium chromium-driver)")
async def test_the_memory_map_on_the_page_matches_the_api(loaded, redis_url, tmp_path, monkeypatch):
    """A tiered session whose host tier spills to Redis: the canvas shows, cell by cell, the state the
    API gives (device, host, Redis, the last turn's re-admissions), and hovering a band shows its text.
    ``RKV_UI_MAP_SCREENSHOT=path.png`` copies the screenshot there (how docs/memory-map.png is made)."""
    pytest.importorskip("selenium", reason="selenium is not installed (pip install selenium)")
    from selenium.common.exceptions import StaleElementReferenceException, TimeoutException
    from selenium.webdriver.common.action_chains import ActionChains
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.ui import Select, WebDriverWait

    from serving_helpers import local_server

    monkeypatch.setenv("SE_OFFLINE", "true")
    settings = {"redis_url": redis_url, "redis_namespace": f"rkvtest-ui-{time.monotonic_ns()}",
                "host_tier_bytes": 150 * PAGE_BYTES, "page_tokens": 32}
    with local_server(loaded, **settings) as server:
        driver = _driver(tmp_path)
        try:
            wait = WebDriverWait(driver, 90, poll_frequency=0.1, ignored_exceptions=[StaleElementReferenceException])

            def until(condition, what):
                try:
                    return wait.until(lambda _: condition())
                except TimeoutException:
                    errors = [e.text for e in driver.find_elements(By.CSS_SELECTOR, ".error")]
                    raise AssertionError(f"timed out waiting for {what}; errors shown: {errors}") from None

            driver.get(server.url + "/")
            Select(driver.find_element(By.ID, "mode")).select_by_value("tiered")
            driver.find_element(By.ID, "budget").send_keys("64")
            max_tokens = driver.find_element(By.ID, "max-tokens")
            max_tokens.clear()
            max_tokens.send_keys("12")
            driver.find_element(By.ID, "new-session").click()
            until(lambda: driver.find_element(By.ID, "message").is_enabled(), "the new session")
            messages = [STORY + "Please remember this story.", "Now tell me something about the sea, briefly.",
                        "Where does the spare key to the lamp room hang?"]
            for turn, text in enumerate(messages, start=1):
                driver.execute_script("const m = document.getElementById('message'); m.value = arguments[0];", text)
                driver.find_element(By.ID, "send").click()
                until(lambda n=turn: len(driver.find_elements(By.CSS_SELECTOR, '.msg.assistant[data-state="done"]')) == n,
                      f"reply {turn}")
                until(lambda n=turn: driver.find_element(By.ID, "session-turns").text == str(n), f"turn {turn}")

            sid, token = driver.execute_script(
                "const s = JSON.parse(localStorage.getItem('rkv-mt.sessions'))[0]; return [s.session_id, s.token]")
            mm = httpx.get(f"{server.url}/v1/sessions/{sid}/memory-map", headers={"x-session-token": token}).json()
            summary = mm["summary"]
            assert summary["device"] and summary["host"] and summary["redis"] and summary["readmitted"]
            canvas = driver.find_element(By.ID, "map-canvas")
            until(lambda: canvas.get_attribute("data-state") == "drawn"
                  and int(canvas.get_attribute("data-positions")) == summary["positions"], "the map of the last turn")
            for key in ("device", "host", "redis", "readmitted"):
                assert int(canvas.get_attribute(f"data-{key}")) == summary[key], key

            cols = driver.execute_script("return window.rkvMemoryMap.columns()")
            assert cols["positions"] == summary["positions"]
            # The page's own x of a position (JavaScript's Math.round: halves up).
            col = lambda p: cols["left"] + math.floor(p * (cols["width"] - cols["left"]) / cols["positions"] + 0.5)  # noqa: E731
            edges = {col(s["start"]) for s in mm["messages"]}
            checked: dict[str, int] = {}
            for index, row in enumerate(mm["rows"]):
                again = {p for s, ln in zip(row["readmitted"][::2], row["readmitted"][1::2]) for p in range(s, s + ln)}
                for state, start, end in _runs(row["runs"], mm["states"]):
                    p = (start + end) // 2
                    if col(end) - col(start) < 6 or any(abs(col(p) - e) <= 1 for e in edges) or any(
                            abs(col(p) - col(q)) <= 1 for q in again):
                        continue
                    pixel = driver.execute_script("return window.rkvMemoryMap.pixel(arguments[0], arguments[1])", index, p)
                    assert pixel == RGB[state], (row["layer"], row["head"], p, state, pixel)
                    checked[state] = checked.get(state, 0) + 1
                for p in sorted(again)[:3]:  # the last turn's re-admissions stand out
                    if not any(abs(col(p) - e) <= 1 for e in edges):
                        pixel = driver.execute_script("return window.rkvMemoryMap.pixel(arguments[0], arguments[1])",
                                                      index, p)
                        assert pixel == RGB["readmitted"], (row["layer"], row["head"], p, pixel)
                        checked["readmitted"] = checked.get("readmitted", 0) + 1
            assert {"device", "host", "redis", "readmitted"} <= set(checked), checked

            # Hovering a band shows the text of its tokens: the story's cells, in the first row.
            first = mm["messages"][0]
            p = (first["start"] + first["end"]) // 2
            where = driver.execute_script("return window.rkvMemoryMap.cellCentre(0, arguments[0])", p)
            size = canvas.size
            ActionChains(driver).move_to_element_with_offset(
                canvas, round(where["x"] - size["width"] / 2), round(where["y"] - size["height"] / 2)).perform()
            tip = driver.find_element(By.ID, "map-tip")
            until(lambda: tip.is_displayed() and "layer 0, KV head 0" in tip.text, "the hover text")
            assert any(word in tip.text for word in ("lighthouse", "key", "Mara", "winters", "lamp", "ships", "gull"))
            severe = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
            assert severe == [], severe

            shot = tmp_path / "map.png"
            assert driver.save_screenshot(str(shot)) and shot.stat().st_size > 10_000
            if os.environ.get("RKV_UI_MAP_SCREENSHOT"):
                shutil.copyfile(shot, os.environ["RKV_UI_MAP_SCREENSHOT"])
        finally:
            driver.quit()
