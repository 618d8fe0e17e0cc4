"""The chat page at / in a real browser: headless Chromium (Debian's chromium and
chromium-driver) driven by selenium. Types a message, presses Enter, waits for the streamed
answer and the tok/s line, and saves a screenshot to $BUILD_DIR/tests/web-chat.png.

Skips, saying why, when Chromium cannot be found or installed (apt-get, as root).
"""
from __future__ import annotations

import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BUILD_DIR

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
DRIVER_NAMES = ("chromedriver",)


def _find(names):
    for n in names:
        p = shutil.which(n) or (f"/usr/bin/{n}" if os.path.exists(f"/usr/bin/{n}") else None)
        if p:
            return p
    return None


def _install_chromium() -> str:
    """apt-get install chromium chromium-driver; returns why it could not, or ''."""
    if os.geteuid() != 0:
        return "not root, so apt-get cannot install them (run scripts/setup.sh)"
    if not shutil.which("apt-get"):
        return "no apt-get on this system"
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    cmd = ["apt-get", "install", "-y", "-qq", "chromium", "chromium-driver"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
        if r.returncode != 0:
            subprocess.run(["apt-get", "update", "-qq"], capture_output=True, timeout=300, env=env)
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    except subprocess.TimeoutExpired:
        return "apt-get install chromium chromium-driver timed out"
    if r.returncode != 0:
        return f"apt-get install chromium chromium-driver failed: {(r.stderr or r.stdout).strip()[-300:]}"
    return ""


@pytest.fixture(scope="module")
def browser():
    browser_bin, driver_bin = _find(CHROMIUM_NAMES), _find(DRIVER_NAMES)
    if not (browser_bin and driver_bin):
        why = _install_chromium()
        browser_bin, driver_bin = _find(CHROMIUM_NAMES), _find(DRIVER_NAMES)
        if not (browser_bin and driver_bin):
            pytest.skip(f"headless Chromium is not available: {why or 'chromium or chromedriver still missing'}")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = browser_bin
    for a in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu", "--window-size=1000,760",
              "--no-first-run", "--no-default-browser-check", "--disable-extensions", "--proxy-server=direct://",
              "--proxy-bypass-list=*"):
        opts.add_argument(a)
    os.environ.setdefault("SE_OFFLINE", "true")  # selenium-manager must not try to download drivers
    try:
        driver = webdriver.Chrome(service=Service(executable_path=driver_bin), options=opts)
    except Exception as e:  # noqa: BLE001 - a browser that does not start is an environment problem
        pytest.skip(f"headless Chromium did not start: {type(e).__name__}: {str(e).strip()[:300]}")
    driver.set_page_load_timeout(30)
    yield driver
    driver.quit()


def _chat_in_page(driver, url: str, message: str, timeout: float = 120) -> dict:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait

    driver.get(url + "/")
    assert driver.title == "llmq chat"
    wait = WebDriverWait(driver, 30)
    # The header shows the model id once /v1/models answered.
    wait.until(lambda d: d.find_element(By.ID, "model").text not in ("", "connecting…"))
    model_label = driver.find_element(By.ID, "model").text
    box = driver.find_element(By.ID, "input")
    box.click()
    box.send_keys(message)
    t0 = time.monotonic()
    box.send_keys(Keys.ENTER)
    WebDriverWait(driver, timeout).until(
        lambda d: d.find_elements(By.CSS_SELECTOR, ".msg.assistant[data-done='1'], .msg.error[data-done='1']"))
    elapsed = time.monotonic() - t0
    user = driver.find_elements(By.CSS_SELECTOR, ".msg.user")
    reply = driver.find_elements(By.CSS_SELECTOR, ".msg[data-done='1']")[-1]
    stats = driver.find_elements(By.CSS_SELECTOR, ".stats")
    return {"model": model_label, "user": [u.text for u in user], "reply_class": reply.get_attribute("class"),
            "reply": reply.text, "stats": stats[-1].text if stats else None, "seconds": elapsed,
            "input_after": box.get_attribute("value"), "send_disabled": driver.find_element(By.ID, "send").get_attribute("disabled")}


def _screenshot(driver, name: str) -> Path:
    out = BUILD_DIR / "tests" / name
    out.parent.mkdir(parents=True, exist_ok=True)
    driver.save_screenshot(str(out))
    assert out.stat().st_size > 1000
    return out


def test_web_chat_stories(browser, servers, stories_model):
    """stories260K with the chatml template: the page streams an answer and shows tok/s."""
    s = servers.start(stories_model, "--chat-template", "chatml", "--ctx", "256")
    r = _chat_in_page(browser, s.url, "Tell me a story about a dog.")
    print(r)
    assert r["model"] == s.model_id
    assert r["user"] == ["Tell me a story about a dog."]
    assert r["reply_class"] == "msg assistant", f"the page shows an error: {r['reply']}"
    assert r["reply"].strip()
    assert r["stats"] and "tok/s" in r["stats"] and "first token after" in r["stats"], r["stats"]
    assert r["input_after"] == "" and r["send_disabled"] is None
    _screenshot(browser, "web-chat-stories.png")
    shot = _screenshot(browser, "web-chat.png")  # test_web_chat_smollm2 replaces it when SmolLM2 is there
    print(f"screenshot: {shot}")


def test_web_chat_smollm2(browser, servers, smol_model):
    """The real chat model: a second turn in the same conversation; screenshot web-chat.png."""
    # The page asks for at most 512 tokens a reply: two turns always fit 2048 (at 512 a long first
    # reply, sampled at temperature 1, once left no room for the second turn).
    s = servers.start(smol_model, "--ctx", "2048")
    r = _chat_in_page(browser, s.url, "What is the capital of France? Answer in one sentence.", timeout=180)
    print(r)
    assert r["reply_class"] == "msg assistant", f"the page shows an error: {r['reply']}"
    assert r["reply"].strip()
    assert r["stats"] and "tok/s" in r["stats"]
    # A second turn: the page sends the history; two user bubbles, two answers.
    from selenium.webdriver.common.by import By
    from selenium.webdriver.common.keys import Keys
    from selenium.webdriver.support.ui import WebDriverWait
    box = browser.find_element(By.ID, "input")
    box.send_keys("Thank you!")
    box.send_keys(Keys.ENTER)
    WebDriverWait(browser, 180).until(lambda d: len(d.find_elements(By.CSS_SELECTOR, ".msg[data-done='1']")) == 2)
    assert len(browser.find_elements(By.CSS_SELECTOR, ".msg.user")) == 2
    assert len(browser.find_elements(By.CSS_SELECTOR, ".stats")) == 2
    assert not browser.find_elements(By.CSS_SELECTOR, ".msg.error")
    shot = _screenshot(browser, "web-chat.png")
    print(f"screenshot: {shot}")


def test_web_page_with_api_key(browser, servers, stories_model):
    """With --api-key the page loads without a key; chatting without one shows an error
    bubble; with the key typed into the header box it works."""
    from selenium.webdriver.common.by import By
    s = servers.start(stories_model, "--chat-template", "chatml", "--ctx", "128", api_key="page-key")
    browser.get(s.url + "/")
    browser.execute_script("localStorage.removeItem('llmq-key')")
    r = _chat_in_page(browser, s.url, "Hello")
    assert r["reply_class"] == "msg error" and "API key" in r["reply"], r
    key = browser.find_element(By.ID, "key")
    key.send_keys("page-key")
    browser.execute_script("document.getElementById('key').dispatchEvent(new Event('change'))")
    r = _chat_in_page(browser, s.url, "Hello again")
    assert r["reply_class"] == "msg assistant" and r["reply"].strip(), r
    browser.execute_script("localStorage.removeItem('llmq-key')")
