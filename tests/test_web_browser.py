"""The browser session module (pgfence-documents.js) in headless Chromium against a real
``pgfence serve`` app and PostgreSQL. Faults come from a real HTTP proxy between the browser and
the server (tests/http_faults.py) or from the browser itself (a crashed renderer): nothing in
the page is mocked. Every wait has a timeout.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver

from http_faults import HttpFaultProxy
from pgfence.web import DEMO_USER_HEADER, ServerThread, serve_app, trusted_header_auth
from web_support import (
    JsError,
    chromium,
    create,
    drafts_in,
    events_of,
    js,
    open_session,
    save_as,
    stored,
    versions,
    wait_js,
)


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    with chromium() as d:
        yield d


@pytest.fixture()
def browser(driver: webdriver.Chrome) -> Iterator[webdriver.Chrome]:
    """The module's Chromium, left with one tab after the test."""
    yield driver
    handles = driver.window_handles
    for h in handles[1:]:
        driver.switch_to.window(h)
        driver.close()
    driver.switch_to.window(handles[0])
    driver.get("about:blank")


@pytest.fixture()
def site(db: str) -> Iterator[tuple[str, HttpFaultProxy]]:
    """``pgfence serve --demo``'s app on a thread, and the fault proxy in front of it; every
    test gets a new origin (new port), so a new localStorage."""
    app = serve_app(dsn=db, authenticate=trusted_header_auth(DEMO_USER_HEADER), demo=True)
    with ServerThread(app) as server, HttpFaultProxy(server.port) as proxy:
        yield proxy.url, proxy


def new_tab(driver: webdriver.Chrome) -> str:
    driver.switch_to.new_window("tab")
    return driver.current_window_handle


def state(driver: webdriver.Chrome) -> str:
    return driver.execute_script("return s.state;")


def wait_state(driver: webdriver.Chrome, want: str, timeout: float = 10.0) -> None:
    wait_js(driver, "s.state", lambda v: v == want, timeout, f"state {want}")


def test_page_loads_module_and_opens_a_session(browser: webdriver.Chrome, db: str,
                                               site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, "record", {"title": "a"})
    snap = open_session(browser, base, doc, "ann")
    assert snap["state"] == "clean" and snap["version"] == 1
    js(browser, "s.edit({...s.content, title: 'b'}); return await s.flush(5000);")
    assert stored(db, doc).content == {"title": "b"} and stored(db, doc).saved_by == "ann"
    assert drafts_in(browser) == []
