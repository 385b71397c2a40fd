"""DocumentSession against the real database: the cells of the session's state machine.

Network failures are made at the connection level with FaultyLink (a TCP proxy in front of the
real server that drops, holds or refuses): the statements always run on the real server.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import textwrap
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import psycopg
import pytest

from document_support import create, save_as, stored, versions
from pgfence.documents import (
    ConflictPending,
    DocumentDeleted,
    DocumentSession,
    DraftStore,
    MergeConflict,
    SaveRefused,
    SessionBusy,
    SessionClosed,
    SessionState,
    StateChange,
    SyncDocumentSession,
    api,
)
from pgfence.errors import NotFound
from pgfence_demo.faults import FaultyLink

T = TypeVar("T")
NO_PREPARE = {"prepare_threshold": None}  # keep statement text on the wire for FaultyLink(match=)


def run(coro: Awaitable[T]) -> T:
    return asyncio.run(coro)  # type: ignore[arg-type]


async def wait_for(pred: Callable[[], bool], timeout: float = 10.0) -> None:
    async with asyncio.timeout(timeout):
        while not pred():
            await asyncio.sleep(0.005)


@pytest.fixture()
def drafts_path(tmp_path: Path) -> Path:
    return tmp_path / "drafts.sqlite3"


async def opened(doc: int, dsn: str, drafts: Path, **kw: Any) -> DocumentSession:
    kw.setdefault("user", "ann")
    kw.setdefault("debounce_ms", 20)
    kw.setdefault("retry_base_ms", 20)
    kw.setdefault("retry_cap_ms", 200)
    return await DocumentSession.open(doc, dsn=dsn, drafts=drafts, **kw)


# ---------------------------------------------------------------------------------------------
# saving
# ---------------------------------------------------------------------------------------------
def test_edit_is_drafted_first_then_saved_and_the_draft_deleted(db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "a"})

    async def main() -> None:
        s = await opened(doc, db, drafts_path, debounce_ms=10_000)
        s.edit({"title": "b"})
        # written before anything was sent: the debounce is 10 s, nothing is in flight
        with DraftStore(drafts_path) as store:
            d = store.get(s.scope, "ann", doc, s.writer_id)
        assert d is not None and d.content == {"title": "b"} and d.base_version == 1
        assert s.state is SessionState.DIRTY and stored(db, doc).version == 1
        assert await s.flush(5) == 2
        assert s.state is SessionState.CLEAN and not s.pending
        with DraftStore(drafts_path) as store:
            assert store.get(s.scope, "ann", doc, s.writer_id) is None
        await s.close()

    run(main())
    assert stored(db, doc).content == {"title": "b"}


def test_edits_debounce_into_one_save_of_the_latest_snapshot(db: str, drafts_path: Path) -> None:
    doc = create(db, {"n": 0})

    async def main() -> None:
        s = await opened(doc, db, drafts_path, debounce_ms=150)
        for i in range(1, 6):
            s.edit({"n": i})
            await asyncio.sleep(0.01)
        await wait_for(lambda: s.state is SessionState.CLEAN)
        await s.close()

    run(main())
    assert versions(db, doc) == [1, 2], "five quick edits make one version"
    assert stored(db, doc).content == {"n": 5}


def test_edit_during_save_stays_pending_and_success_does_not_clear_it(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "a"})

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path, connect_kwargs=NO_PREPARE,
                             debounce_ms=10_000)
            held = link.hold_next_response(b"document_save")
            s.edit({"title": "first"})
            flushing = asyncio.create_task(s.flush(10))
            await asyncio.wait_for(held.captured.wait(), 5)
            assert s.state is SessionState.SAVING
            # the server has committed "first"; its answer is held while we edit again
            assert stored(db, doc).content == {"title": "first"}
            s.edit({"title": "second"})
            assert s.state is SessionState.SAVING and s.pending
            held.release()
            assert await flushing == 2, "flush waits only for edits made before it"
            # the success of "first" moved the base forward and kept "second" pending
            assert s.version == 2 and s.pending and s.state is SessionState.DIRTY
            assert s.content == {"title": "second"}
            with DraftStore(drafts_path) as store:
                d = store.get(s.scope, "ann", doc, s.writer_id)
            assert d is not None and d.content == {"title": "second"} and d.base_version == 2
            await s.flush(10)
            assert s.version == 3 and not s.pending
            await s.close()

    run(main())
    assert versions(db, doc) == [1, 2, 3]
    assert stored(db, doc).content == {"title": "second"}


def test_lost_response_is_retried_with_the_same_save_id_and_reported_saved(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "a"})
    states: list[StateChange] = []

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path, connect_kwargs=NO_PREPARE,
                             on_state=states.append)
            dropped = link.drop_next_response(b"document_save")
            s.edit({"title": "b"})
            assert await s.flush(10) == 2
            assert dropped.is_set() and link.dropped == 1
            await s.close()

    run(main())
    assert [c.state for c in states].count(SessionState.ERROR) == 1
    err = next(c for c in states if c.state is SessionState.ERROR)
    assert isinstance(err.error, psycopg.OperationalError) and err.retry_in is not None
    assert versions(db, doc) == [1, 2], "saved once, not twice, and no false conflict"
    with psycopg.connect(db, autocommit=True) as c:
        events = [r[0] for r in c.execute(
            "SELECT event FROM pgfence.event WHERE module = 'document' AND item_id = %s"
            " ORDER BY id",
            (doc,))]
    assert events == ["create", "save", "replay"]


def test_network_down_retries_with_backoff_until_it_is_back(db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "a"})

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path)
            link.down()
            s.edit({"title": "offline edit"})
            await wait_for(lambda: s.state is SessionState.ERROR)
            snap = s.snapshot()
            assert snap.pending and snap.retry_in is not None and snap.error is not None
            await asyncio.sleep(0.3)
            assert stored(db, doc).version == 1
            link.up()
            assert await s.flush(10) == 2
            await s.close()

    run(main())
    assert stored(db, doc).content == {"title": "offline edit"}


def test_refused_save_is_not_retried_until_the_next_edit(db: str, drafts_path: Path) -> None:
    with psycopg.connect(db, autocommit=True) as c:
        api.register_kind(c, "tiny", "attributes", max_bytes=40)
    doc = create(db, {"t": "x"}, kind="tiny")

    async def main() -> None:
        s = await opened(doc, db, drafts_path)
        s.edit({"t": "x" * 100})
        with pytest.raises(SaveRefused) as info:
            await s.flush(5)
        assert isinstance(info.value.__cause__, api.ContentTooLarge)
        snap = s.snapshot()
        assert snap.state is SessionState.ERROR and snap.retry_in is None
        await asyncio.sleep(0.2)
        assert versions(db, doc) == [1], "a refusal is not retried"
        s.edit({"t": "short"})
        assert await s.flush(5) == 2
        await s.close()

    run(main())


def test_state_changes_are_observable_as_callback_and_async_iterator(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})
    seen: list[SessionState] = []

    async def main() -> list[SessionState]:
        s = await opened(doc, db, drafts_path, on_state=lambda c: seen.append(c.state))
        got: list[SessionState] = []

        async def watch() -> None:
            async for change in s.changes():
                got.append(change.state)

        watcher = asyncio.create_task(watch())
        await asyncio.sleep(0)
        s.edit({"a": 2})
        await s.flush(5)
        await s.close()
        await asyncio.wait_for(watcher, 5)
        return got

    got = run(main())
    expected = [SessionState.CLEAN, SessionState.DIRTY, SessionState.SAVING, SessionState.CLEAN,
                SessionState.CLOSED]
    assert seen == expected
    assert got == expected


# ---------------------------------------------------------------------------------------------
# conflicts
# ---------------------------------------------------------------------------------------------
def test_record_conflict_rebases_by_attribute(db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "plan", "owner": "ann", "due": "May"})

    async def main() -> None:
        a = await opened(doc, db, drafts_path, user="ann")
        b = await opened(doc, db, drafts_path, user="bob")
        a.edit({**a.content, "title": "Q3 plan"})
        assert await a.flush(5) == 2
        b.edit({**b.content, "owner": "bob"})
        with pytest.raises(ConflictPending) as info:
            await b.flush(5)
        c = info.value.conflict
        assert b.state is SessionState.CONFLICT
        assert (c.base_version, c.stored_version, c.stored_by) == (1, 2, "ann")
        assert c.base == {"title": "plan", "owner": "ann", "due": "May"}
        assert c.local == {"title": "plan", "owner": "bob", "due": "May"}
        assert c.stored == {"title": "Q3 plan", "owner": "ann", "due": "May"}
        await asyncio.sleep(0.1)
        assert stored(db, doc).version == 2, "no automatic rebase"
        merged = await b.rebase()
        assert merged.clean
        assert await b.flush(5) == 3
        await a.close()
        await b.close()

    run(main())
    assert stored(db, doc).content == {"title": "Q3 plan", "owner": "bob", "due": "May"}


def test_record_conflict_on_one_attribute_needs_a_resolver(db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "plan", "owner": "ann"})

    async def main() -> None:
        a = await opened(doc, db, drafts_path, user="ann")
        b = await opened(doc, db, drafts_path, user="bob")
        a.edit({"title": "ann's title", "owner": "ann"})
        await a.flush(5)
        b.edit({"title": "bob's title", "owner": "bob"})
        with pytest.raises(ConflictPending):
            await b.flush(5)
        with pytest.raises(MergeConflict) as info:
            await b.rebase()
        assert info.value.merged.conflicts == [
            {"key": "title", "base": "plan", "local": "bob's title", "stored": "ann's title"}]
        assert b.state is SessionState.CONFLICT, "an unresolved merge changes nothing"

        def resolve(r: Any) -> Any:
            return {**r.merged.content, "title": r.local["title"] + " (and ann's)"}

        await b.rebase(resolve)
        assert await b.flush(5) == 3
        await a.close()
        await b.close()

    run(main())
    assert stored(db, doc).content == {"title": "bob's title (and ann's)", "owner": "bob"}


def test_sheet_conflict_stays_a_conflict(db: str, drafts_path: Path) -> None:
    doc = create(db, {"A1": 1, "B1": 2}, kind="sheet")

    async def main() -> None:
        a = await opened(doc, db, drafts_path, user="ann")
        b = await opened(doc, db, drafts_path, user="bob")
        a.edit({"A1": 10, "B1": 2})
        await a.flush(5)
        b.edit({"A1": 1, "B1": 20})
        with pytest.raises(ConflictPending):
            await b.flush(5)
        with pytest.raises(MergeConflict) as info:
            await b.rebase()
        assert info.value.merged.content is None
        assert [c["key"] for c in info.value.merged.conflicts] == ["A1", "B1"]
        assert b.state is SessionState.CONFLICT
        with DraftStore(drafts_path) as store:
            d = store.get(b.scope, "bob", doc, b.writer_id)
        assert d is not None and d.content == {"A1": 1, "B1": 20} and d.base_version == 1
        # the user gives up their copy: fetch first, then replace, then drop the draft
        assert await b.discard_and_reload()
        assert b.state is SessionState.CLEAN and b.content == {"A1": 10, "B1": 2}
        assert b.version == 2
        with DraftStore(drafts_path) as store:
            assert store.get(b.scope, "bob", doc, b.writer_id) is None
        await a.close()
        await b.close()

    run(main())
    assert versions(db, doc) == [1, 2]


def test_discard_and_reload_keeps_local_state_when_the_fetch_fails(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"x": 1})

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path)
            save_as(db, doc, {"x": 2})
            s.edit({"x": 3})
            with pytest.raises(ConflictPending):
                await s.flush(5)
            link.down()
            with pytest.raises(psycopg.OperationalError):
                await s.discard_and_reload()
            assert s.state is SessionState.CONFLICT and s.content == {"x": 3}
            with DraftStore(drafts_path) as store:
                assert store.get(s.scope, "ann", doc, s.writer_id) is not None
            link.up()
            assert await s.discard_and_reload()
            assert s.content == {"x": 2} and s.state is SessionState.CLEAN
            await s.close()

    run(main())


def test_a_deleted_document_is_a_conflict_that_keeps_the_local_copy(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"x": 1})

    async def main() -> None:
        s = await opened(doc, db, drafts_path)
        with psycopg.connect(db, autocommit=True) as c:
            assert api.delete(c, doc, 1, "admin").outcome == "deleted"
        s.edit({"x": 2})
        with pytest.raises(ConflictPending) as info:
            await s.flush(5)
        assert info.value.conflict.deleted and info.value.conflict.stored_version == 2
        with pytest.raises(DocumentDeleted):
            await s.rebase()
        with pytest.raises(DocumentDeleted):
            await s.discard_and_reload()
        assert s.content == {"x": 2}
        assert not await s.close(timeout=1)

    run(main())
    with DraftStore(drafts_path) as store:
        (d,) = store.list(document_id=doc)
    assert d.content == {"x": 2}


# ---------------------------------------------------------------------------------------------
# stale reads
# ---------------------------------------------------------------------------------------------
def test_out_of_order_read_answer_is_dropped(db: str, drafts_path: Path) -> None:
    doc = create(db, {"v": 1})

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path, connect_kwargs=NO_PREPARE)
            save_as(db, doc, {"v": 2})
            held = link.hold_next_response(b"document_get")
            slow = asyncio.create_task(s.refresh())          # read #2 answers version 2 ...
            await asyncio.wait_for(held.captured.wait(), 5)
            save_as(db, doc, {"v": 3})
            assert await s.refresh()                         # ... read #3 answers version 3
            assert s.version == 3
            held.release()
            assert await slow is False, "the older answer is dropped"
            assert s.stale_reads_dropped == 1, "... by the read-sequence guard"
            assert s.version == 3 and s.content == {"v": 3}
            await s.close()

    run(main())


def test_read_that_started_before_a_local_edit_is_dropped(db: str, drafts_path: Path) -> None:
    doc = create(db, {"v": 1})

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path, connect_kwargs=NO_PREPARE,
                             debounce_ms=10_000)
            save_as(db, doc, {"v": 2})
            held = link.hold_next_response(b"document_get")
            slow = asyncio.create_task(s.refresh())
            await asyncio.wait_for(held.captured.wait(), 5)
            s.edit({"v": "mine"})
            held.release()
            assert await slow is False
            assert s.stale_reads_dropped == 1
            assert s.content == {"v": "mine"} and s.version == 1 and s.pending
            # the same guard protects discard_and_reload: an edit made during it wins
            held = link.hold_next_response(b"document_get")
            discarding = asyncio.create_task(s.discard_and_reload())
            await asyncio.wait_for(held.captured.wait(), 5)
            s.edit({"v": "mine, later"})
            held.release()
            assert await discarding is False
            assert s.stale_reads_dropped == 2
            assert s.content == {"v": "mine, later"}
            await s.close(timeout=0.5)

    run(main())


# ---------------------------------------------------------------------------------------------
# closing and drafts
# ---------------------------------------------------------------------------------------------
def test_close_flushes_pending_edits(db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})

    async def main() -> None:
        async with await opened(doc, db, drafts_path, debounce_ms=60_000) as s:
            s.edit({"a": 2})
            s.edit({"a": 3})
        assert s.state is SessionState.CLOSED
        with pytest.raises(SessionClosed):
            s.edit({"a": 4})

    run(main())
    assert stored(db, doc).content == {"a": 3}
    with DraftStore(drafts_path) as store:
        assert store.list(document_id=doc) == []


def test_failed_flush_at_close_leaves_the_draft_for_the_next_session(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await opened(doc, link.dsn, drafts_path, writer_id="laptop")
            link.down()
            s.edit({"a": "unsaved"})
            assert await s.close(timeout=0.5) is False
            assert s.state is SessionState.CLOSED
        with DraftStore(drafts_path) as store:
            (d,) = store.list(document_id=doc)
        assert (d.writer_id, d.content, d.base_version) == ("laptop", {"a": "unsaved"}, 1)
        # the same writer comes back: its own draft is restored and saved through the CAS
        s2 = await opened(doc, db, drafts_path, writer_id="laptop")
        assert s2.restored_draft == d and s2.content == {"a": "unsaved"}
        assert await s2.flush(5) == 2
        await s2.close()

    run(main())
    assert stored(db, doc).content == {"a": "unsaved"}
    with DraftStore(drafts_path) as store:
        assert store.list(document_id=doc) == []


def _crash_writer(dsn: str, doc: int, drafts: Path, content: Any) -> None:
    """A real process edits, then dies by SIGKILL before its (60 s) debounce."""
    code = textwrap.dedent(f"""
        import asyncio, os, signal, sys
        from pgfence.documents import DocumentSession
        async def main():
            s = await DocumentSession.open({doc}, user="ann", dsn={dsn!r}, drafts={str(drafts)!r},
                                           debounce_ms=60_000)
            s.edit({content!r})
            sys.stdout.write("edited\\n"); sys.stdout.flush()
            await asyncio.sleep(60)
        asyncio.run(main())
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "edited\n"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.timeout(60)
def test_crashed_writers_draft_is_offered_never_applied_and_can_be_adopted(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"title": "plan", "notes": ""})
    _crash_writer(db, doc, drafts_path, {"title": "plan", "notes": "typed before the crash"})
    save_as(db, doc, {"title": "Q3 plan", "notes": ""})   # the document moved on meanwhile

    async def main() -> None:
        s = await opened(doc, db, drafts_path)
        (offered,) = s.sibling_drafts
        assert offered.content == {"title": "plan", "notes": "typed before the crash"}
        assert offered.base_version == 1
        assert s.content == {"title": "Q3 plan", "notes": ""} and not s.pending, \
            "a sibling draft is never applied silently"
        await s.adopt(offered)
        # based on version 1: the CAS answers conflict, the record merge takes both changes
        with pytest.raises(ConflictPending):
            await s.flush(5)
        await s.rebase()
        assert await s.flush(5) == 3
        with DraftStore(drafts_path) as store:
            assert store.list(document_id=doc) == []
        await s.close()

    run(main())
    assert stored(db, doc).content == {"title": "Q3 plan", "notes": "typed before the crash"}


@pytest.mark.timeout(60)
def test_sibling_draft_can_be_discarded(db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})
    _crash_writer(db, doc, drafts_path, {"a": "lost cause"})

    async def main() -> None:
        s = await opened(doc, db, drafts_path)
        (offered,) = s.sibling_drafts
        s.edit({"a": 2})
        with pytest.raises(SessionBusy):
            await s.adopt(offered)
        assert s.discard_draft(offered)
        assert s.sibling_drafts == []
        await s.close()

    run(main())
    with DraftStore(drafts_path) as store:
        assert store.list(document_id=doc) == []
    assert stored(db, doc).content == {"a": 2}


def test_drafts_of_different_writers_never_overwrite_each_other(
        db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 0})

    async def main() -> None:
        async with FaultyLink(db) as link:
            one = await opened(doc, link.dsn, drafts_path, writer_id="tab-1")
            two = await opened(doc, link.dsn, drafts_path, writer_id="tab-2")
            link.down()
            one.edit({"a": "from tab 1"})
            two.edit({"a": "from tab 2"})
            assert not await one.close(timeout=0.3)
            assert not await two.close(timeout=0.3)
        with DraftStore(drafts_path) as store:
            got = {d.writer_id: d.content for d in store.list(document_id=doc)}
        assert got == {"tab-1": {"a": "from tab 1"}, "tab-2": {"a": "from tab 2"}}
        three = await opened(doc, db, drafts_path, writer_id="tab-3")
        assert sorted(d.writer_id for d in three.sibling_drafts) == ["tab-1", "tab-2"]
        await three.close()

    run(main())


def test_sync_wrapper(db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})
    with SyncDocumentSession.open(doc, user="ann", dsn=db, drafts=drafts_path,
                                  debounce_ms=20) as s:
        s.edit({"a": 2})
        assert s.flush(5) == 2
        assert s.state is SessionState.CLEAN and s.content == {"a": 2}
        save_as(db, doc, {"a": 3})
        assert s.refresh() and s.content == {"a": 3}
        s.edit({"a": 4})
    assert stored(db, doc).content == {"a": 4}


def test_open_unknown_or_deleted_document(db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})
    with psycopg.connect(db, autocommit=True) as c:
        api.delete(c, doc, 1, "admin")
    with pytest.raises(NotFound):
        run(opened(-1, db, drafts_path))
    with pytest.raises(DocumentDeleted):
        run(opened(doc, db, drafts_path))


def test_draft_content_is_exactly_what_was_saved(db: str, drafts_path: Path) -> None:
    doc = create(db, {"a": 1})
    payload = {"a": "ünïcødé ✓", "n": [1, 2.5, None, True], "nested": {"k": "v"}}

    async def main() -> None:
        s = await opened(doc, db, drafts_path, debounce_ms=60_000)
        s.edit(payload)
        with DraftStore(drafts_path) as store:
            d = store.get(s.scope, "ann", doc, s.writer_id)
        assert d is not None and json.loads(d.content_json) == payload
        await s.close()

    run(main())
    with psycopg.connect(db, autocommit=True) as c:
        assert api.revision(c, doc, 2).content == payload
