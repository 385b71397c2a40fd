"""Hypothesis stateful test: several DocumentSessions on one record, against the real database.

Random edits, flushes (some with the save's response dropped by the network), conflicts,
rebases (the record merge plus "local wins" on a conflicting attribute), discards, refreshes,
and restarts (the network goes down, close() cannot flush, the writer comes back with the same
writer id and its draft). After every step:

- every acknowledged save is in the history exactly as the session confirmed it;
- the history is gap-free and every version was a compare-and-swap on its predecessor;
- no lost update: each version differs from its predecessor only in attributes whose new value
  was typed by the writer who saved it (values are unique per edit), i.e. no writer ever put
  back a stale value over someone else's saved edit.
"""

from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import psycopg
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from pgfence.documents import (
    ConflictPending,
    DraftStore,
    LoopThread,
    Rebase,
    SessionState,
    SyncDocumentSession,
    api,
)
from pgfence_demo.faults import FaultyLink

WRITERS = 3
KEYS = ["a", "b", "c", "d"]


def local_wins(r: Rebase) -> Any:
    """The kind's merge, and the local value wherever both sides changed an attribute."""
    content = dict(r.merged.content)
    for c in r.merged.conflicts:
        if "local" in c:
            content[c["key"]] = c["local"]
        else:
            content.pop(c["key"], None)
    return content


def make_machine(dsn: str, lt: LoopThread, tmp: Path) -> type[RuleBasedStateMachine]:
    counter = itertools.count()

    class Sessions(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.run_id = next(counter)
            self.drafts = tmp / f"drafts-{self.run_id}.sqlite3"
            with psycopg.connect(dsn, autocommit=True) as c:
                self.doc = api.create(c, "record", {k: "init" for k in KEYS}, "setup")
            self.links = [lt.run(FaultyLink(dsn).start()) for _ in range(WRITERS)]
            self.sessions = [self._open(i) for i in range(WRITERS)]
            self.seq = itertools.count()
            self.acked: dict[int, tuple[str, Any]] = {}   # version -> (user, content)

        def _open(self, i: int) -> SyncDocumentSession:
            return SyncDocumentSession.open(
                self.doc, loop_thread=lt, user=f"w{i}", writer_id=f"writer-{i}",
                dsn=self.links[i].dsn, drafts=self.drafts, debounce_ms=60_000,
                retry_base_ms=5, retry_cap_ms=50, connect_kwargs={"prepare_threshold": None})

        def _ack(self, i: int, before: int) -> None:
            """Record the session's own save: the version moved during its flush/close (no
            read runs concurrently with it in this machine)."""
            s = self.sessions[i]
            if s.version > before:
                self.acked[s.version] = (f"w{i}", lt.call(lambda: s.session.confirmed))

        def _no_false_conflict(self, i: int) -> None:
            c = self.sessions[i].conflict
            assert c is not None
            assert not (c.stored_by == f"w{i}" and c.stored == c.local), \
                "a conflict against this writer's own committed save (a retry lost its save_id)"

        # ------------------------------------------------------------------------------------
        @rule(i=st.integers(0, WRITERS - 1), key=st.sampled_from(KEYS))
        def edit(self, i: int, key: str) -> None:
            s = self.sessions[i]
            content = s.content
            content[key] = f"w{i}-{next(self.seq)}"
            s.edit(content)

        @rule(i=st.integers(0, WRITERS - 1), drop=st.booleans())
        def flush(self, i: int, drop: bool) -> None:
            s = self.sessions[i]
            if drop and s.pending and s.state is not SessionState.CONFLICT:
                self.links[i].drop_next_response(b"document_save")
            before = s.version
            try:
                s.flush(timeout=20)
            except ConflictPending:
                assert s.state is SessionState.CONFLICT
                self._no_false_conflict(i)
                return
            assert not s.pending
            self._ack(i, before)

        @precondition(lambda self: any(s.state is SessionState.CONFLICT for s in self.sessions))
        @rule(i=st.integers(0, WRITERS - 1))
        def rebase(self, i: int) -> None:
            s = self.sessions[i]
            if s.state is not SessionState.CONFLICT:
                return
            conflict = s.conflict
            assert conflict is not None and not conflict.deleted
            s.rebase(local_wins)
            assert s.version == conflict.stored_version

        @rule(i=st.integers(0, WRITERS - 1))
        def discard(self, i: int) -> None:
            s = self.sessions[i]
            assert s.discard_and_reload()
            assert s.state is SessionState.CLEAN and not s.pending
            with psycopg.connect(dsn, autocommit=True) as c:
                assert s.content == api.get(c, self.doc).content or s.version < api.get(
                    c, self.doc).version

        @rule(i=st.integers(0, WRITERS - 1))
        def refresh(self, i: int) -> None:
            s = self.sessions[i]
            before = (s.version, s.content, s.pending)
            if s.refresh():
                assert not before[2] and s.version > before[0]
            else:
                assert (s.version, s.content) == before[:2]

        @rule(i=st.integers(0, WRITERS - 1), after_commit=st.booleans())
        def restart_offline(self, i: int, after_commit: bool) -> None:
            """The network fails (before the save, or right after the server committed it and
            before the answer arrived); close cannot flush and leaves the draft; the writer
            comes back with the same writer id."""
            s = self.sessions[i]
            local, pending = s.content, s.pending
            before = s.version
            if after_commit and pending and s.state is not SessionState.CONFLICT:
                self.links[i].drop_next_response(b"document_save", then_down=True)
            else:
                self.links[i].down()
            flushed = s.close(timeout=0.3)
            self.links[i].up()
            if flushed:
                self._ack(i, before)
            self.sessions[i] = s2 = self._open(i)
            if pending and not flushed:
                assert s2.session.restored_draft is not None, "the unsaved edit was kept"
                assert s2.content == local, "... exactly as it was"
                before = s2.version
                try:
                    s2.flush(timeout=20)
                except ConflictPending:
                    self._no_false_conflict(i)
                else:
                    self._ack(i, before)

        # ------------------------------------------------------------------------------------
        @invariant()
        def history_is_a_cas_chain_without_lost_updates(self) -> None:
            # One REPEATABLE READ snapshot: a rebase's save may be committing in the background.
            with psycopg.connect(dsn) as c:
                c.isolation_level = psycopg.IsolationLevel.REPEATABLE_READ
                current = api.get(c, self.doc)
                revs = [api.revision(c, self.doc, v) for v in range(1, current.version + 1)]
                bad_chain = c.execute(
                    "SELECT count(*) FROM pgfence.event WHERE module = 'document' AND item_id = %s"
                    " AND event = 'save' AND (detail ->> 'based_on')::bigint <> fence - 1",
                    (self.doc,)).fetchone()
                saves = c.execute(
                    "SELECT count(*) FROM pgfence.event WHERE module = 'document' AND item_id = %s"
                    " AND event = 'save'", (self.doc,)).fetchone()
            assert [r.version for r in revs] == list(range(1, current.version + 1))
            assert bad_chain == (0,) and saves == (current.version - 1,)
            for version, (user, content) in self.acked.items():
                assert revs[version - 1].content == content, f"acknowledged v{version} changed"
                assert revs[version - 1].saved_by == user
            for prev, rev in itertools.pairwise(revs):
                for key in KEYS:
                    if rev.content.get(key) != prev.content.get(key):
                        assert str(rev.content.get(key)).startswith(rev.saved_by + "-"), (
                            f"v{rev.version} by {rev.saved_by} changed {key} to "
                            f"{rev.content.get(key)!r}, which that writer never typed")

        def teardown(self) -> None:
            try:
                for i, s in enumerate(self.sessions):
                    flushed = s.close(timeout=20)
                    assert flushed or s.conflict is not None, \
                        "close flushes unless the save is answered conflict"
                    if not flushed:
                        local = lt.call(lambda s=s: s.session.content)
                        with DraftStore(self.drafts) as store:
                            d = store.get(s.session.scope, f"w{i}", self.doc, f"writer-{i}")
                        assert d is not None and d.content == local, "the conflict's draft is kept"
            finally:
                for link in self.links:
                    lt.run(link.close())

    return Sessions


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_sessions_never_lose_an_acknowledged_edit(db: str, tmp_path: Path) -> None:
    with LoopThread() as lt:
        machine = make_machine(db, lt, tmp_path)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=30, stateful_step_count=30, deadline=None,
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]))
