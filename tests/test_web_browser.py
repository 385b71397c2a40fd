"""The browser session module (pgfence-documents.js) in headless Chromium against a real
``pgfence serve`` app and PostgreSQL. Faults come from a real HTTP proxy between the browser and
the server (tests/http_faults.py) or from the browser itself (a crashed renderer): nothing in
the page is mocked. Every wait has a timeout.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import WebDriverException

from document_support import create, events_of, save_as, stored, versions
from http_faults import HttpFaultProxy
from pgfence.web import DEMO_USER_HEADER, ServerThread, serve_app, trusted_header_auth
from web_support import JsError, chromium, drafts_in, js, open_session, wait_js


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
        with contextlib.suppress(WebDriverException):   # a crashed tab may refuse
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
    doc = create(db, {"title": "a"})
    snap = open_session(browser, base, doc, "ann")
    assert snap["state"] == "clean" and snap["version"] == 1
    js(browser, "s.edit({...s.content, title: 'b'}); return await s.flush(5000);")
    assert stored(db, doc).content == {"title": "b"} and stored(db, doc).saved_by == "ann"
    assert drafts_in(browser) == []


def test_two_tabs_on_one_record_conflict_rebase_merges_disjoint_attributes_and_waits_on_the_same_one(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, {"title": "Q3", "owner": "ann", "budget": 100})
    tab_a = browser.current_window_handle
    open_session(browser, base, doc, "ann")
    tab_b = new_tab(browser)
    open_session(browser, base, doc, "bob")

    browser.switch_to.window(tab_a)
    assert js(browser, "s.edit({...s.content, title: 'Q3 final'}); return await s.flush(5000);") == 2
    browser.switch_to.window(tab_b)
    js(browser, "s.edit({...s.content, budget: 150});")
    err = js(browser, "try { await s.flush(5000); return null; } catch (e) { return [e.name, "
                      "e.conflict.storedVersion, e.conflict.stored, e.conflict.storedBy]; }")
    assert err == ["ConflictPending", 2, {"title": "Q3 final", "owner": "ann", "budget": 100}, "ann"]
    assert state(browser) == "conflict"
    assert stored(db, doc).version == 2                      # nothing was overwritten
    # no automatic rebase: the tab stays in conflict until asked
    assert state(browser) == "conflict" and versions(db, doc) == [1, 2]

    merged = js(browser, "const m = await s.rebase(); return [m.clean, m.content];")
    assert merged == [True, {"title": "Q3 final", "owner": "ann", "budget": 150}]
    assert js(browser, "return await s.flush(5000);") == 3
    assert stored(db, doc).content == {"title": "Q3 final", "owner": "ann", "budget": 150}

    # both change the owner: the same attribute
    browser.switch_to.window(tab_a)
    assert js(browser, "return await s.refresh();") is True
    js(browser, "s.edit({...s.content, owner: 'ann & team'}); await s.flush(5000);")
    browser.switch_to.window(tab_b)
    js(browser, "s.edit({...s.content, owner: 'bob'});")
    assert js(browser, "try { await s.flush(5000); } catch (e) { return e.name; }") == "ConflictPending"
    got = js(browser, "try { await s.rebase(); return null; } catch (e) { "
                      "return [e.name, e.merged.conflicts]; }")
    assert got == ["MergeConflict", [{"key": "owner", "base": "ann", "local": "bob",
                                      "stored": "ann & team"}]]
    assert state(browser) == "conflict" and stored(db, doc).version == 4
    # the person picks: keep both names
    js(browser, "await s.rebase(({merged}) => ({...merged.content, owner: 'bob + ann & team'}));")
    assert js(browser, "return await s.flush(5000);") == 5
    assert stored(db, doc).content["owner"] == "bob + ann & team"
    assert drafts_in(browser) == []


def test_a_sheet_conflict_never_merges(browser: webdriver.Chrome, db: str,
                                       site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, {"A1": 1, "B1": 2}, kind="sheet")
    open_session(browser, base, doc, "bob")
    assert save_as(db, doc, {"A1": 10, "B1": 2}, "ann").ok   # ann sets A1
    js(browser, "s.edit({A1: 1, B1: 20});")                   # bob sets B1 on version 1
    assert js(browser, "try { await s.flush(5000); } catch (e) { return e.name; }") == "ConflictPending"
    got = js(browser, "try { await s.rebase(); return null; } catch (e) { "
                      "return [e.name, e.merged.content, e.merged.conflicts.map(c => c.key)]; }")
    assert got == ["MergeConflict", None, ["A1", "B1"]]
    assert state(browser) == "conflict"
    assert stored(db, doc).content == {"A1": 10, "B1": 2} and versions(db, doc) == [1, 2]
    # the person keeps their copy on top of the stored version
    js(browser, "await s.rebase(({local}) => local); await s.flush(5000);")
    assert stored(db, doc).content == {"A1": 1, "B1": 20} and stored(db, doc).version == 3


def test_a_dropped_answer_of_a_committed_save_is_retried_with_the_same_key(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, proxy = site
    doc = create(db, {"title": "a"})
    open_session(browser, base, doc, "ann")
    dropped = proxy.drop_next("PUT", f"/documents/{doc}")
    js(browser, "s.edit({title: 'b'});")
    assert js(browser, "return await s.flush(10000);") == 2
    assert dropped.is_set()
    puts = proxy.requests("PUT", f"/documents/{doc}")
    assert [p[3] for p in puts][:1] == ["dropped"] and len(puts) == 2
    assert puts[0][2] == puts[1][2] and puts[0][2]            # the same Idempotency-Key
    assert "200" in puts[1][3]
    assert versions(db, doc) == [1, 2]                        # one version, not two
    assert events_of(db, doc, "replay") == 1 and events_of(db, doc, "conflict") == 0
    assert js(browser, "return events.filter(e => e.type === 'saved').map(e => e.detail);") == [
        {"version": 2, "replayed": True}]
    # the session saw no answer (outcome unknown), went offline, and retried by itself
    assert js(browser, "return states;") == ["dirty", "saving", "offline", "saving", "clean"]
    assert state(browser) == "clean" and drafts_in(browser) == []


def test_a_tab_killed_during_the_debounce_leaves_a_draft_offered_on_reload_not_applied(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, {"title": "a", "notes": ""})
    spare = browser.current_window_handle
    new_tab(browser)
    open_session(browser, base, doc, "carol", debounceMs=60000, flushOnHide=False)
    js(browser, "s.edit({...s.content, notes: 'typed, never saved'});")
    assert state(browser) == "dirty"
    # the renderer dies: no pagehide, no flush, no JS at all
    with pytest.raises(WebDriverException, match="crash"):
        browser.execute_cdp_cmd("Page.crash", {})
    assert stored(db, doc).version == 1
    browser.switch_to.window(spare)
    open_session(browser, base, doc, "carol")
    offered = js(browser, "return s.siblingDrafts.map(d => [d.content, d.baseVersion]);")
    assert offered == [[{"title": "a", "notes": "typed, never saved"}, 1]]
    # offered, not applied: the session shows the stored version and has nothing pending
    assert js(browser, "return [s.content, s.pending, s.state];") == [{"title": "a", "notes": ""},
                                                                       False, "clean"]
    assert stored(db, doc).version == 1
    js(browser, "await s.adopt(s.siblingDrafts[0]); await s.flush(5000);")
    assert stored(db, doc).content == {"title": "a", "notes": "typed, never saved"}
    assert drafts_in(browser) == []                           # deleted once saved


def test_two_tabs_drafts_survive_each_other(browser: webdriver.Chrome, db: str,
                                            site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, {"a": 0, "b": 0})
    tab_a = browser.current_window_handle
    open_session(browser, base, doc, "ann", debounceMs=60000, flushOnHide=False)
    js(browser, "s.edit({...s.content, a: 1});")
    tab_b = new_tab(browser)
    open_session(browser, base, doc, "ann", debounceMs=60000, flushOnHide=False)
    js(browser, "s.edit({...s.content, b: 2});")
    drafts = drafts_in(browser)
    assert sorted(d["contentJson"] for d in drafts) == ['{"a":0,"b":2}', '{"a":1,"b":0}']
    assert len({d["writerId"] for d in drafts}) == 2
    # a's save deletes only a's draft
    browser.switch_to.window(tab_a)
    assert js(browser, "return await s.flush(5000);") == 2
    assert [d["contentJson"] for d in drafts_in(browser)] == ['{"a":0,"b":2}']
    # b's save conflicts: its draft stays until it is saved
    browser.switch_to.window(tab_b)
    assert js(browser, "try { await s.flush(5000); } catch (e) { return e.name; }") == "ConflictPending"
    assert [d["contentJson"] for d in drafts_in(browser)] == ['{"a":0,"b":2}']
    js(browser, "await s.rebase(); await s.flush(5000);")
    assert stored(db, doc).content == {"a": 1, "b": 2} and drafts_in(browser) == []


def test_an_older_read_answer_arriving_after_a_newer_one_is_dropped(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, proxy = site
    doc = create(db, {"title": "v1"})
    open_session(browser, base, doc, "ann")
    held = proxy.hold_next("GET", f"/documents/{doc}")
    browser.execute_script("window.first = s.refresh();")     # read #1: its answer is held
    assert held.captured.wait(10)
    assert save_as(db, doc, {"title": "v2"}, "server-writer").ok
    assert js(browser, "return await s.refresh();") is True   # read #2 applies version 2
    held.release()                                            # read #1's (version 1) arrives
    assert js(browser, "return await window.first;") is False
    assert js(browser, "return [s.version, s.content, s.staleReadsDropped];") == [
        2, {"title": "v2"}, 1]


def test_discard_and_reload_while_the_server_is_unreachable_keeps_the_local_copy(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, proxy = site
    doc = create(db, {"title": "a"})
    open_session(browser, base, doc, "ann", requestTimeoutMs=3000)
    proxy.down()
    js(browser, "s.edit({title: 'mine'});")
    wait_state(browser, "offline")                            # the save got no answer
    err = js(browser, "try { await s.discardAndReload(); return null; } catch (e) { return e.name; }")
    assert err == "NetworkError"
    assert js(browser, "return [s.content, s.pending];") == [{"title": "mine"}, True]
    assert [d["contentJson"] for d in drafts_in(browser)] == ['{"title":"mine"}']
    proxy.up()
    assert js(browser, "return await s.flush(10000);") == 2   # the retry goes through
    assert stored(db, doc).content == {"title": "mine"} and drafts_in(browser) == []


def test_closing_the_tab_sends_the_pending_save_with_keepalive(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, {"title": "a"})
    new_tab(browser)
    open_session(browser, base, doc, "ann", debounceMs=60000)
    js(browser, "s.edit({title: 'closing'});")
    browser.close()                                           # pagehide: fetch keepalive
    browser.switch_to.window(browser.window_handles[0])
    deadline_ok = wait_for_version(db, doc, 2)
    assert deadline_ok and stored(db, doc).content == {"title": "closing"}


def wait_for_version(db: str, doc: int, version: int, timeout: float = 10.0) -> bool:
    from support import wait_for
    return bool(wait_for(lambda: stored(db, doc).version == version, timeout,
                         f"document {doc} at version {version}"))


_: Any = JsError


def open_demo(browser: webdriver.Chrome, url: str) -> int:
    """Load the demo page at ``url``, wait until its record is open; return the record's id."""
    browser.get(url)
    wait_js(browser, "window.demo && demo.record.session.state", lambda v: v == "clean",
            what="the demo page to open its documents")
    return int(browser.execute_script("return demo.record.session.documentId;"))


def test_the_demo_page_shows_a_conflict_and_its_rebase_button_merges(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    from selenium.webdriver.common.by import By

    base, _ = site
    doc = open_demo(browser, f"{base}/demo/?user=ann")
    query = browser.execute_script("return location.search;")
    tab_a = browser.current_window_handle
    new_tab(browser)
    open_demo(browser, f"{base}/demo/{query.replace('user=ann', 'user=bob')}")
    browser.switch_to.window(tab_a)
    browser.find_element(By.CSS_SELECTOR, "#record input[name=title]").send_keys(" (final)")
    browser.find_element(By.CSS_SELECTOR, '#record [data-act="flush"]').click()
    wait_js(browser, "demo.record.session.version", lambda v: v == 2)
    browser.switch_to.window(browser.window_handles[1])
    budget = browser.find_element(By.CSS_SELECTOR, "#record input[name=budget]")
    budget.clear()
    budget.send_keys("150")
    browser.find_element(By.CSS_SELECTOR, '#record [data-act="flush"]').click()
    wait_js(browser, "document.querySelector('#record .badge').textContent", lambda v: v == "conflict")
    assert "saved by ann" in browser.find_element(By.CSS_SELECTOR, "#record .conflict-box").text
    browser.find_element(By.XPATH, "//section[@id='record']//button[text()='Rebase (merge)']").click()
    wait_js(browser, "demo.record.session.version", lambda v: v == 3)
    assert stored(db, doc).content == {"title": "Q3 plan (final)", "owner": "ann", "budget": 150,
                                       "notes": ""}
    assert browser.find_element(By.CSS_SELECTOR, "#record input[name=title]").get_attribute(
        "value") == "Q3 plan (final)"


def test_edits_debounce_into_one_save_and_an_edit_during_a_save_stays_pending(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, proxy = site
    doc = create(db, {"n": 0})
    open_session(browser, base, doc, "ann", debounceMs=300)
    js(browser, "for (let i = 1; i <= 5; i++) s.edit({n: i});")  # one burst: one latest snapshot
    wait_js(browser, "s.state", lambda v: v == "clean", what="the burst to be saved")
    assert len(proxy.requests("PUT")) == 1 and versions(db, doc) == [1, 2]
    assert stored(db, doc).content == {"n": 5}

    held = proxy.hold_next("PUT", f"/documents/{doc}")
    js(browser, "s.edit({n: 6}); s.flushNow();")
    assert held.captured.wait(10)                              # save of n=6 is in flight
    assert state(browser) == "saving"
    js(browser, "s.edit({n: 7});")                             # an edit during the save
    assert js(browser, "return [s.state, s.pending];") == ["saving", True]
    assert len(proxy.requests("PUT")) == 2                     # still one save in flight
    held.release()
    wait_js(browser, "s.version", lambda v: v == 3, what="the first save's answer")
    # that success did not clear the newer edit: it is saved next, on version 3
    assert js(browser, "return await s.flush(5000);") == 4
    assert stored(db, doc).content == {"n": 7} and versions(db, doc) == [1, 2, 3, 4]
    assert drafts_in(browser) == []


def test_a_save_whose_upload_stalls_is_answered_408_and_retried_with_the_same_key(
        browser: webdriver.Chrome, db: str) -> None:
    app = serve_app(dsn=db, authenticate=trusted_header_auth(DEMO_USER_HEADER), body_timeout=1.0)
    with ServerThread(app) as server, HttpFaultProxy(server.port) as proxy:
        doc = create(db, {"title": "a"})
        open_session(browser, proxy.url, doc, "ann")
        stalled = proxy.stall_next("PUT", f"/documents/{doc}")
        js(browser, "s.edit({title: 'b'});")
        assert js(browser, "return await s.flush(15000);") == 2
        assert stalled.is_set()
        puts = proxy.requests("PUT", f"/documents/{doc}")
        assert [p[3].split(" ")[1] for p in puts] == ["408", "200"]
        assert puts[0][2] == puts[1][2]                           # the same Idempotency-Key
        assert versions(db, doc) == [1, 2] and stored(db, doc).content == {"title": "b"}


def test_the_demo_page_shows_other_users_names_and_values_as_text_never_as_markup(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    from selenium.webdriver.common.by import By

    base, _ = site
    doc = open_demo(browser, f"{base}/demo/?user=ann")
    evil = "<img src=x onerror=window.pwned=1>"
    assert save_as(db, doc, {"title": evil, "owner": "ann", "budget": 100, "notes": ""},
                   user="<img src=x onerror=window.pwned=2>").ok
    browser.find_element(By.CSS_SELECTOR, "#record input[name=title]").send_keys(" (mine)")
    browser.find_element(By.CSS_SELECTOR, '#record [data-act="flush"]').click()
    wait_js(browser, "document.querySelector('#record .badge').textContent", lambda v: v == "conflict")
    browser.find_element(By.XPATH, "//section[@id='record']//button[text()='Rebase (merge)']").click()
    wait_js(browser, "document.querySelectorAll('#record .conflict-box input[type=radio]').length",
            lambda v: v == 2, what="the per-attribute choice")
    box = browser.find_element(By.CSS_SELECTOR, "#record .conflict-box")
    assert "saved by <img src=x onerror=window.pwned=2>" in box.text
    assert evil in box.text
    assert browser.execute_script("return [window.pwned, document.querySelectorAll('#record img').length];") == [None, 0]


def test_two_tabs_asking_for_one_writer_id_never_share_its_draft_slot(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    """An app that keeps its writer id in sessionStorage gets it copied by "duplicate tab":
    the second live tab must not restore and overwrite the first one's draft."""
    base, _ = site
    doc = create(db, {"a": 0, "b": 0})
    tab_a = browser.current_window_handle
    quiet = {"debounceMs": 60000, "flushOnHide": False}
    open_session(browser, base, doc, "ann", writerId="w1", **quiet)
    js(browser, "s.edit({...s.content, a: 1});")
    new_tab(browser)
    snap = open_session(browser, base, doc, "ann", writerId="w1", **quiet)
    assert snap["state"] == "clean" and snap["pending"] is False          # not restored
    assert js(browser, "return [s.writerId !== 'w1', s.requestedWriterId, s.restoredDraft, "
                       "s.siblingDrafts.map(d => [d.writerId, d.content])];") == [
        True, "w1", None, [["w1", {"a": 1, "b": 0}]]]
    js(browser, "s.edit({...s.content, b: 2});")
    assert sorted(d["contentJson"] for d in drafts_in(browser)) == ['{"a":0,"b":2}', '{"a":1,"b":0}']
    # the writer id is free again once its session closed
    browser.switch_to.window(tab_a)
    assert js(browser, "return await s.close(5000);") is True
    js(browser, "window.s3 = await m.DocumentSession.open(args[0], {user: 'ann', writerId: 'w1', "
                "headers: {'X-Pgfence-User': 'ann'}}); return null;", doc)
    assert js(browser, "return [s3.writerId, s3.requestedWriterId];") == ["w1", None]


def test_adopting_a_draft_when_storage_is_full_keeps_the_draft(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    base, _ = site
    doc = create(db, {"title": "a"})
    open_session(browser, base, doc, "ann", writerId="short", debounceMs=60000, flushOnHide=False)
    js(browser, "s.edit({title: 'unsaved work'});")
    # a second session (string id: the same draft key) with a writer id longer than the space
    # left once localStorage is full
    js(browser, """
      window.s2 = await m.DocumentSession.open(String(args[0]), {user: 'ann', writerId: 'w'.repeat(2000),
        headers: {'X-Pgfence-User': 'ann'}, debounceMs: 60000, flushOnHide: false});
      let i = 0;
      for (let size = 1 << 22; size >= 1; ) {
        try { localStorage.setItem(`fill${i++}`, 'x'.repeat(size)); } catch { size >>= 1; }
      }
      return null;""", doc)
    assert js(browser, "return s2.siblingDrafts.map(d => d.content);") == [{"title": "unsaved work"}]
    err = js(browser, "try { await s2.adopt(s2.siblingDrafts[0]); return null; } "
                      "catch (e) { return e.name; }")
    assert err == "QuotaExceededError"
    js(browser, "for (const k of Object.keys(localStorage)) if (k.startsWith('fill')) "
                "localStorage.removeItem(k);")
    assert [(d["writerId"], d["contentJson"]) for d in drafts_in(browser)] == [
        ("short", '{"title":"unsaved work"}')]                            # still there
    assert js(browser, "return [s2.state, s2.siblingDrafts.length];") == ["clean", 1]
    js(browser, "await s2.adopt(s2.siblingDrafts[0]); await s2.flush(5000);")
    assert stored(db, doc).content == {"title": "unsaved work"} and drafts_in(browser) == []
    with pytest.raises(JsError, match="TypeError: documentId must be a positive integer"):
        js(browser, "await m.DocumentSession.open('1e3', {user: 'ann'});")


def test_a_save_refused_401_goes_out_on_the_next_flush_once_the_app_has_a_fresh_token(
        browser: webdriver.Chrome, db: str) -> None:
    """Tokens expire while a tab is open: the refused save must not wait for another edit (a
    tab closing then would send nothing)."""
    import time

    from pgfence.web import bearer_token_auth, sign_token

    secret = b"k" * 32
    app = serve_app(dsn=db, authenticate=bearer_token_auth(secret))
    with ServerThread(app) as server:
        doc = create(db, {"title": "a"})
        browser.get(f"{server.url}/")
        js(browser, """
          window.token = args[0];
          window.m = await import("/static/pgfence-documents.js");
          window.s = await m.DocumentSession.open(args[1], {user: "ann",
            headers: () => ({Authorization: `Bearer ${window.token}`})});
          return null;""", sign_token(secret, "ann"), doc)
        browser.execute_script("window.token = arguments[0];",
                               sign_token(secret, "ann", ttl=1, now=time.time() - 60))
        js(browser, "s.edit({title: 'b'});")
        err = js(browser, "try { await s.flush(5000); return null; } catch (e) { "
                          "return [e.name, e.cause.status, s.state]; }")
        assert err == ["SaveRefused", 401, "error"]
        browser.execute_script("window.token = arguments[0];", sign_token(secret, "ann"))
        assert js(browser, "return await s.flush(5000);") == 2
        assert stored(db, doc).content == {"title": "b"} and stored(db, doc).saved_by == "ann"


def test_reloading_a_tab_restores_its_own_draft_under_its_writer_id(
        browser: webdriver.Chrome, db: str, site: tuple[str, HttpFaultProxy]) -> None:
    """The writer-id lock of the page being unloaded must not make its own reload look like a
    second live tab."""
    base, _ = site
    doc = create(db, {"title": "a"})
    for _ in range(3):
        open_session(browser, base, doc, "ann", writerId="w1", debounceMs=60000, flushOnHide=False)
        js(browser, "s.edit({title: 'typed ' + Math.random()});")
        browser.refresh()                                     # the very next page opens at once
        assert js(browser, """
          const m = await import("/static/pgfence-documents.js");
          window.s = await m.DocumentSession.open(args[0], {user: "ann", writerId: "w1",
            headers: {"X-Pgfence-User": "ann"}, debounceMs: 60000, flushOnHide: false});
          return [s.writerId, s.requestedWriterId, s.restoredDraft !== null,
                  s.siblingDrafts.length, s.pending];""", doc) == ["w1", None, True, 0, True]
        js(browser, "await s.close(5000);")
