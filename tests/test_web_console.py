"""The read-only console of ``pgfence serve`` in Debian's headless Chromium against a real
database: every page shows what the audit views hold (queues with their charts, a stuck item, a
possible duplicate, executors, an item's timeline), values as text never as markup, behind the
authentication hook. A screenshot of each page goes to the test artifacts directory
($PGFENCE_TEST_ARTIFACTS, default tests/artifacts/console/)."""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from selenium import webdriver
from selenium.webdriver.common.by import By

from pgfence import outbox
from pgfence.web import DEMO_USER_HEADER, ServerThread, serve_app, trusted_header_auth
from web_support import chromium, wait_js

ARTIFACTS = Path(os.environ.get("PGFENCE_TEST_ARTIFACTS",
                                Path(__file__).resolve().parent / "artifacts")) / "console"


@pytest.fixture(scope="module")
def driver() -> Iterator[webdriver.Chrome]:
    with chromium() as d:
        yield d


@pytest.fixture()
def site(db: str) -> Iterator[str]:
    app = serve_app(dsn=db, authenticate=trusted_header_auth(DEMO_USER_HEADER))
    with ServerThread(app) as server:
        yield server.url


def seed(conn: psycopg.Connection) -> dict[str, int]:
    """Sent messages (the chart), a stuck one, a possible duplicate, an unserved channel, and
    two registered executors (one named with markup)."""
    for n in range(12):
        mid = outbox.enqueue(conn, "orders", "https://shop.test/hook", {"n": n})
        (m,) = outbox.claim(conn, "w-1", 1, ["orders"])
        outbox.mark_sent(conn, m.id, m.attempt, None)
    stuck = outbox.enqueue(conn, "mail", "ann@shop.test", {"n": 1})
    outbox.claim(conn, "w-frozen", 1, ["mail"])
    dup = outbox.enqueue(conn, "hooks", "https://shop.test/h", {"n": 2}, idempotency_key="dup-1")
    outbox.claim(conn, "w-lost", 1, ["hooks"])
    conn.execute("UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 minute' "
                 "WHERE id = %s", (dup,))
    assert outbox.reap(conn) == 1  # w-lost's claim: a possible duplicate from now on
    # w-frozen's claim lapses after the reaper ran: stuck until the next one.
    conn.execute("UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 minute' "
                 "WHERE id = %s", (stuck,))
    outbox.enqueue(conn, "unserved", "r", {})
    for worker in ("exec-a", "<b>exec-markup</b>"):
        conn.execute("SELECT pgfence.executor_register(%s, 'host-1', 42, '0.1.0', "
                     "'{\"outbox\": [\"orders\"]}', 4, '10 seconds')", (worker,))
    return {"stuck": stuck, "dup": dup, "mid": mid}


def show(driver: webdriver.Chrome, url: str, page: str, shot: str) -> str:
    driver.get(url)
    wait_js(driver, "document.body.dataset.ready", lambda v: v == page, 15, f"page {page}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    assert driver.save_screenshot(str(ARTIFACTS / f"{shot}.png"))
    return str(driver.find_element(By.ID, "page").text)


@pytest.mark.timeout(120)
def test_every_console_page_shows_the_audit_views(driver: webdriver.Chrome, site: str,
                                                  conn: psycopg.Connection) -> None:
    ids = seed(conn)
    base = f"{site}/console/?user=ann"
    text = show(driver, f"{base}#queues", "queues", "queues")
    assert "orders" in text and "unserved" in text and "1 stuck" in text
    charts = driver.find_elements(By.CSS_SELECTOR, ".chart")
    titles = {c.get_attribute("data-queue"): c.text for c in charts}
    assert "outbox orders: 12 finished in the last hour" in titles["outbox orders"]
    bars = driver.find_elements(By.CSS_SELECTOR, '.chart[data-queue="outbox orders"] rect')
    assert len(bars) >= 1

    text = show(driver, f"{base}#stuck", "stuck", "stuck")
    assert "w-frozen" in text and str(ids["stuck"]) in text

    text = show(driver, f"{base}#duplicates", "duplicates", "duplicates")
    assert "lease_lapsed" in text and "dup-1" in text and "w-lost" in text

    text = show(driver, f"{base}#executors", "executors", "executors")
    assert "exec-a" in text and "<b>exec-markup</b>" in text, "markup is shown as text"
    assert not driver.find_elements(By.CSS_SELECTOR, "#page td b")

    text = show(driver, f"{base}#timeline/outbox/{ids['dup']}", "timeline", "timeline")
    assert f"outbox#{ids['dup']}" in text and "lease_lapsed" in text and "enqueue" in text


@pytest.mark.timeout(60)
def test_the_console_is_behind_the_authentication_hook(driver: webdriver.Chrome, site: str) -> None:
    try:
        urllib.request.urlopen(f"{site}/console/api/overview", timeout=10)
        raise AssertionError("answered without credentials")
    except urllib.error.HTTPError as exc:
        assert exc.code == 401
    req = urllib.request.Request(f"{site}/console/api/overview", headers={DEMO_USER_HEADER: "ann"})
    with urllib.request.urlopen(req, timeout=10) as resp:
        body = json.loads(resp.read())
    assert set(body) == {"queues", "rates", "stuck", "duplicates", "executors", "now"}
    text = show(driver, f"{site}/console/#queues", "error", "unauthenticated")
    assert "401" in text
    assert driver.find_element(By.ID, "auth").is_displayed(), "it asks for a token"
