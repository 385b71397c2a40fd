"""The document session's save machine (pgfence.documents.session.TRANSITIONS) as a table, and
the one race its explicit moves closed.

The table: every phase is reachable from a fresh session and can get back to clean; an edit is
taken in every phase; only a save in flight is answered; the stored version replaces anything
but a save in flight; a UI sees each phase as one SessionState. The session's own behaviour is
tested against the real database by tests/test_document_session.py and the Hypothesis machine of
tests/test_document_stateful.py (each move outside the table would raise there).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from document_support import create, save_as, stored
from pgfence.documents import DocumentSession, Draft, DraftStore, SessionBusy, SessionState
from pgfence.documents.session import STATE_OF, TRANSITIONS, Event, Phase
from pgfence_demo.faults import FaultyLink

ANSWERS = {Event.SAVED, Event.SAVED_OLDER, Event.CONFLICT, Event.NO_ANSWER, Event.REFUSED,
           Event.REFUSED_OLDER}


def reachable(start: Phase) -> set[Phase]:
    seen, todo = {start}, [start]
    while todo:
        phase = todo.pop()
        for (frm, _), to in TRANSITIONS.items():
            if frm is phase and to not in seen:
                seen.add(to)
                todo.append(to)
    return seen


def test_every_phase_is_reachable_and_leads_back_to_clean() -> None:
    assert reachable(Phase.CLEAN) == set(Phase)
    for phase in Phase:
        assert Phase.CLEAN in reachable(phase), phase


def test_edits_are_taken_everywhere_and_only_a_save_in_flight_is_answered() -> None:
    for phase in Phase:
        assert (phase, Event.EDIT) in TRANSITIONS, phase
    for (phase, event), to in TRANSITIONS.items():
        if event in ANSWERS:
            assert phase is Phase.SAVING, (phase, event)
        if event is Event.SEND:
            assert phase in (Phase.DIRTY, Phase.RETRYING) and to is Phase.SAVING
        if to is Phase.SAVING:
            assert event in (Event.SEND, Event.EDIT), (phase, event)
    assert {e for (_, e) in TRANSITIONS} == set(Event), "every event moves something"


def test_the_stored_version_replaces_anything_but_a_save_in_flight() -> None:
    for phase in Phase:
        if phase is Phase.SAVING:
            assert (phase, Event.RELOADED) not in TRANSITIONS
        else:
            assert TRANSITIONS[phase, Event.RELOADED] is Phase.CLEAN
    assert {p for (p, e) in TRANSITIONS if e is Event.TAKE} == {Phase.CLEAN}
    assert {p for (p, e) in TRANSITIONS if e is Event.REBASED} == {Phase.CONFLICT}


def test_a_ui_sees_each_phase_as_one_state() -> None:
    assert set(STATE_OF) == set(Phase)
    assert STATE_OF[Phase.RETRYING] is STATE_OF[Phase.REFUSED] is SessionState.ERROR
    assert set(STATE_OF.values()) == set(SessionState) - {SessionState.CLOSED}


def test_an_edit_made_while_adopt_fetches_the_drafts_base_is_kept(db: str, tmp_path: Path) -> None:
    """adopt() fetches the version a sibling draft was based on; an edit typed meanwhile makes
    the session dirty, so the adoption is refused (SessionBusy) instead of overwriting it."""
    doc = create(db, {"a": 0})
    assert save_as(db, doc, {"a": 1}).ok                   # the draft's base (1) is not stored
    drafts = tmp_path / "drafts.sqlite3"
    with DraftStore(drafts) as store:
        store.put(Draft(scope="s", user="ann", document_id=doc, writer_id="crashed", kind="record",
                        base_version=1, content_json='{"a":"draft"}', snapshot_id="old:1",
                        updated_at=time.time()))

    async def main() -> None:
        async with FaultyLink(db) as link:
            s = await DocumentSession.open(doc, user="ann", dsn=link.dsn, drafts=drafts, scope="s",
                                           debounce_ms=60_000,
                                           connect_kwargs={"prepare_threshold": None})
            (offered,) = s.sibling_drafts
            held = link.hold_next_response(b"document_revision")
            adopting = asyncio.create_task(s.adopt(offered))
            await asyncio.wait_for(held.captured.wait(), 5)
            s.edit({"a": "typed meanwhile"})
            held.release()
            with pytest.raises(SessionBusy):
                await adopting
            assert s.content == {"a": "typed meanwhile"} and s.state is SessionState.DIRTY
            assert s.sibling_drafts == [offered], "the sibling's draft is still offered"
            with DraftStore(drafts) as store:
                mine = store.get("s", "ann", doc, s.writer_id)
                theirs = store.get("s", "ann", doc, "crashed")
            assert mine is not None and mine.content == {"a": "typed meanwhile"}
            assert theirs is not None and theirs.content == {"a": "draft"}
            assert await s.flush(5) == 3
            await s.close()

    asyncio.run(main())
    assert stored(db, doc).content == {"a": "typed meanwhile"}
