"""Shared by the web tests: the server on a thread, a headless Chromium, JS calls with timeouts."""

from __future__ import annotations

import json
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from selenium import webdriver
from selenium.webdriver.chrome.service import Service

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                "--no-first-run", "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--window-size=1200,900"]
USER_HEADER = "X-Pgfence-User"


@contextmanager
def chromium() -> Iterator[webdriver.Chrome]:
    """Debian's headless Chromium through the system chromedriver, with a fresh profile."""
    with tempfile.TemporaryDirectory(prefix="pgfence-chromium-") as profile:
        options = webdriver.ChromeOptions()
        options.binary_location = CHROMIUM
        for flag in [*CHROME_FLAGS, f"--user-data-dir={profile}"]:
            options.add_argument(flag)
        driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
        try:
            driver.set_script_timeout(20)
            driver.set_page_load_timeout(20)
            yield driver
        finally:
            driver.quit()


_WRAP = """
const done = arguments[arguments.length - 1];
const args = Array.from(arguments).slice(0, -1);
(async (...args) => { %s })(...args).then(
  (v) => done({ok: v === undefined ? null : v}),
  (e) => done({err: (e && e.name) + ": " + (e && e.message)}));
"""


class JsError(AssertionError):
    """A JS call in the page rejected."""


def js(driver: webdriver.Chrome, body: str, *args: Any) -> Any:
    """Run ``body`` (an async function body, ``args`` as ``args[i]``) in the current tab and
    return its JSON result; raise :class:`JsError` with the JS error's name and message."""
    out = driver.execute_async_script(_WRAP % body, *args)
    if "err" in out:
        raise JsError(out["err"])
    return out["ok"]


def open_session(driver: webdriver.Chrome, base: str, doc: int, user: str,
                 **opts: Any) -> dict[str, Any]:
    """Load the index page of ``base`` in the current tab and open ``window.s`` on ``doc``.
    ``window.states`` collects every state, ``window.events`` every other event."""
    driver.get(f"{base}/")
    return js(driver, """
      const [doc, user, opts, header] = args;
      window.m = await import("/static/pgfence-documents.js");
      window.states = []; window.events = [];
      window.s = await m.DocumentSession.open(doc, {user, headers: {[header]: user},
        retryBaseMs: 50, retryCapMs: 400, ...opts});
      s.addEventListener("state", (e) => states.push(e.detail.state));
      for (const t of ["saved", "conflict", "error", "staleread", "drafts"])
        s.addEventListener(t, (e) => events.push({type: t,
          detail: e.detail && (e.detail.error ? String(e.detail.error) : e.detail)}));
      return s.snapshot();
    """, doc, user, opts, USER_HEADER)


def wait_js(driver: webdriver.Chrome, expr: str, want: Callable[[Any], bool] = bool,
            timeout: float = 10.0, what: str = "") -> Any:
    """Poll the JS expression ``expr`` until ``want(value)``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = driver.execute_script(f"return {expr};")
        if want(value):
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what or expr}: "
                                 f"last value {value!r}")
        time.sleep(0.02)


def drafts_in(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    """Every pgfence draft in this origin's localStorage."""
    raw = driver.execute_script("""
      const out = [];
      for (let i = 0; i < localStorage.length; i++) {
        const k = localStorage.key(i);
        if (k.startsWith("pgfence:draft:")) out.push(localStorage.getItem(k));
      }
      return out;""")
    return [json.loads(r) for r in raw]
