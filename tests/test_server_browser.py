"""The demo page in headless Chromium (Debian's `chromium` + `chromium-driver`, driven by Selenium).

The page must load the voices, stream an utterance over the WebSocket, play every sample of it
through Web Audio, and show TTFB and RTF. A screenshot is kept: `artifacts/server-demo.png` (or
`$KAZEIA_ARTIFACTS`) and the test's tmp dir. Skipped where Chromium, its driver or Selenium is missing.
"""

import os
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("fastapi")
pytest.importorskip("selenium")
from selenium import webdriver
from server_support import LiveServer

from kazeia.server import ServerConfig, create_app
from kazeia.server.guard import loopback_hosts

CHROMIUM, DRIVER = shutil.which("chromium"), shutil.which("chromedriver")
ARTIFACTS = Path(os.environ.get("KAZEIA_ARTIFACTS", Path(__file__).resolve().parent.parent / "artifacts"))
FRAMES = 24  # 1.92 s of audio
pytestmark = pytest.mark.skipif(not (CHROMIUM and DRIVER), reason="needs the chromium and chromium-driver packages")


@pytest.fixture
def browser(tmp_path, monkeypatch):
    monkeypatch.setenv("SE_OFFLINE", "true")  # Selenium must never fetch a browser or driver
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--window-size=1000,900",
        f"--user-data-dir={tmp_path / 'profile'}",
    ):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=webdriver.ChromeService(executable_path=DRIVER))
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _wait(driver, script: str, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = driver.execute_script(script)
        if value:
            return value
        time.sleep(0.1)
    state = driver.execute_script("return window.kazeiaDemo")
    raise AssertionError(f"timed out waiting for {script!r}; page state: {state}")


@pytest.mark.parametrize("key", [None, "demo-key-0123"], ids=["open", "api-key"])
def test_demo_page_streams_and_plays_audio(engines, browser, tmp_path, key):
    # As `kazeia serve` runs it on 127.0.0.1: loopback Host names only, the page's own origin; with
    # a key, the page is opened as /#api_key=KEY and sends it on every request and the socket.
    config = ServerConfig("tiny-custom", allowed_hosts=loopback_hosts("127.0.0.1"), api_key=key)
    app = create_app(engines["0.6B-custom"], config)
    with LiveServer(app) as server:
        browser.get(server.url + "/" + (f"#api_key={key}" if key else ""))
        _wait(browser, "return document.getElementById('voice').options.length > 0", 30)
        assert browser.title == "Kazeia"
        assert "tiny-custom" in browser.find_element("id", "model").text
        browser.find_element("id", "voice").send_keys("vivian")
        browser.find_element("id", "seed").send_keys("3")
        browser.find_element("id", "max-new-tokens").send_keys(str(FRAMES + 1))
        text = browser.find_element("id", "text")
        text.clear()
        text.send_keys("Hello from a headless browser.")
        browser.find_element("id", "speak").click()
        _wait(browser, "return window.kazeiaDemo.status === 'done' || window.kazeiaDemo.error")
        state = browser.execute_script("return window.kazeiaDemo")
        shot = tmp_path / "server-demo.png"
        browser.save_screenshot(str(shot))
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        shutil.copy(shot, ARTIFACTS / "server-demo.png")
        ttfb, rtf = browser.find_element("id", "ttfb").text, browser.find_element("id", "rtf").text
        record = app.state.kazeia.worker.records[-1]

    assert state["error"] is None, state
    assert record.status == "completed" and 1 <= record.frames <= FRAMES
    audio_s = record.frames * 0.08  # every frame generated was received and played
    assert state["receivedS"] == pytest.approx(audio_s) and state["playedS"] == pytest.approx(audio_s)
    assert state["ttfbMs"] > 0 and state["serverRtf"] > 0
    assert float(ttfb) == pytest.approx(state["ttfbMs"], abs=0.5)
    assert float(rtf) == pytest.approx(state["rtf"], abs=0.005)
