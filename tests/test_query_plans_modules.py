"""The plans the plan, operation and document functions really run, read with auto_explain.

The same hazard as in tests/test_query_plans_outbox.py: a PL/pgSQL statement keeps its plan for the
life of a session (a generic plan after five calls, or at once with plan_cache_mode =
force_generic_plan), and the first calls plan it with constants folded in (custom plans). A
plan chosen under unlucky statistics can then read a whole index or table on every call. Each
test builds one statistics state — a table analysed while empty and filled since, analysed with
only finished history (nothing in flight), analysed while much was in flight, or analysed with
only history and then many runs or operations in flight (2,000 or more, with live heartbeats and
leases: the claims must not read them) — calls the
functions an executor or a client calls per item, in a session forced to custom plans and in one
forced to generic plans, and checks every scan of the module's tables. Scan names (see
``support.PlanScans``): an index scan by its index, ``<index> (walk)`` when it has no index
condition (it reads the index in order until its LIMIT, or all of it), ``Seq Scan``.
"""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from support import PlanScans


def cases(*stats: str) -> Any:
    """Each statistics state, in a session of custom plans and in one of generic plans."""
    def mark(test: Any) -> Any:
        test = pytest.mark.parametrize("cache", ["force_custom_plan", "force_generic_plan"],
                                       ids=["custom", "generic"])(test)
        return pytest.mark.timeout(180)(pytest.mark.parametrize("stats", stats)(test))
    return mark


IN_FLIGHT = cases("stats-of-empty-table", "analyzed-idle", "analyzed-busy", "many-in-flight")


def _session(db: str, cache: str, relations: set[str]) -> tuple[psycopg.Connection[Any], PlanScans]:
    conn = psycopg.connect(db, autocommit=True)
    conn.execute(f"SET plan_cache_mode = {cache}")
    return conn, PlanScans(conn, relations, walks=True)


def _no_autovacuum(conn: psycopg.Connection[Any], *tables: str) -> None:
    # An autoanalyze in the middle of a test would replace the statistics state under test.
    for table in tables:
        conn.execute(f"ALTER TABLE pgfence.{table} SET (autovacuum_enabled = off)")


# ---------------------------------------------------------------------------------------------
# Plans
# ---------------------------------------------------------------------------------------------
PLAN_PK, STATUS_ID, STEP_PK = "plan_pkey", "plan_status_idx", "plan_step_pkey"
BY_ID = {PLAN_PK, STATUS_ID, STEP_PK}
# the claim's walks: indexes that hold only their candidates, read in id order up to the batch
CLAIM = {"plan_approved_idx (walk)", "plan_released_idx (walk)", PLAN_PK, STEP_PK}


def _plans(conn: psycopg.Connection[Any], n: int, state: str) -> None:
    """n new plans in state executed | pending | approved | executing (owned by w1) |
    released (executing, worker NULL, next step external)."""
    steps = ('[{"action": "ext", "args": {"recipient": "r"}}, {"action": "noop"}]'
             if state == "released" else '[{"action": "noop"}, {"action": "noop"}]')
    moves = {
        "executed": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w0');"
                    " PERFORM pgfence.plan_run_step(v, 'w0', 1); PERFORM pgfence.plan_run_step(v, 'w0', 1);",
        # executed with a heartbeat of a second: its deadline is in the past a second later
        "executed-lapsed": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w0', '1 second');"
                           " PERFORM pgfence.plan_run_step(v, 'w0', 1); PERFORM pgfence.plan_run_step(v, 'w0', 1);",
        "in-flight": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w9', '1 day');",
        "pending": "",
        "approved": "PERFORM pgfence.plan_approve(v, 'bob');",
        "executing": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w1');",
        "released": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w1');"
                    " PERFORM pgfence.plan_release(v, 'w1', 1);",
    }[state]
    conn.execute(f"""DO $$ DECLARE v bigint; BEGIN FOR i IN 1..{n} LOOP
                       v := pgfence.plan_propose('{steps}', 'alice'); {moves}
                     END LOOP; END $$""")


def _plan_state(conn: psycopg.Connection[Any], stats: str) -> None:
    _no_autovacuum(conn, "plan", "plan_step")
    conn.execute("CREATE FUNCTION public.tp_noop(jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{}'::jsonb $$")
    conn.execute("SELECT pgfence.plan_register_action('noop', 'public.tp_noop(jsonb)', 'does nothing')")
    conn.execute("SELECT pgfence.plan_register_action('ext', NULL, 'an external effect')")
    in_flight = {"pending": 200, "approved": 100, "executing": 100, "released": 50}
    if stats == "stats-of-empty-table":
        conn.execute("VACUUM ANALYZE pgfence.plan, pgfence.plan_step")
        _plans(conn, 1500, "executed")
    elif stats == "analyzed-idle":  # analysed with only finished plans: nothing in flight
        _plans(conn, 1500, "executed")
        conn.execute("ANALYZE pgfence.plan, pgfence.plan_step")
    elif stats == "many-in-flight":
        # Analysed with only a history whose heartbeats lapsed long ago: every live deadline is
        # past the statistics, so "heartbeat_expires_at >= now()" looks like it matches nothing
        # and plan_heartbeat_idx like the cheapest way to the released runs; then many runs in
        # flight (live heartbeats), which that index holds, every one of them.
        _plans(conn, 600, "executed-lapsed")
        conn.execute("SELECT pg_sleep(1.1)")
        conn.execute("ANALYZE pgfence.plan, pgfence.plan_step")
        _plans(conn, 1500, "in-flight")
    else:  # analyzed-busy: analysed while most plans were in flight; history comes later
        in_flight = {"pending": 600, "approved": 400, "executing": 400, "released": 200}
    for state, n in in_flight.items():
        _plans(conn, n, state)
    if stats == "analyzed-busy":
        conn.execute("ANALYZE pgfence.plan, pgfence.plan_step")
        _plans(conn, 300, "executed")


def _ids(conn: psycopg.Connection[Any], where: str) -> list[int]:
    return [r[0] for r in conn.execute(f"SELECT id FROM pgfence.plan WHERE {where} ORDER BY id")]


@IN_FLIGHT
def test_plan_statements_use_their_index(db: str, conn: psycopg.Connection[Any], stats: str,
                                         cache: str) -> None:
    _plan_state(conn, stats)
    running = _ids(conn, "status = 'executing' AND worker = 'w1'")
    pending = _ids(conn, "status = 'pending'")
    session, plans = _session(db, cache, {"plan", "plan_step"})
    with session:
        rows, scans = plans.scans("SELECT id, next_kind FROM pgfence.plan_claim('w2', 2)")
        assert len(rows) == 2
        assert scans == CLAIM, "claim: walk the candidates' own indexes, take by id (never the history)"
        rows, scans = plans.scans("SELECT id, next_kind FROM pgfence.plan_claim('w3', 1, true)")
        assert [kind for _, kind in rows] == ["external"]
        assert scans == CLAIM, "external-only claim: the next step looked up by key, not a scan of every step"
        (released,), = [(i,) for i, _ in rows]

        # By id: the primary key, or plan_status_idx (status, id) — with id = p_id and the status
        # both stated, a scan of it always has both as its condition: a lookup as well. plan_step
        # by its key (in generic plans the guard trigger's receipt checks show up even when they
        # do not run).
        _, scans = plans.scans("SELECT pgfence.plan_heartbeat(%s, 'w1', 1)", (running[0],))
        assert scans - {STEP_PK} == {PLAN_PK}
        rows, scans = plans.scans("SELECT outcome FROM pgfence.plan_run_step(%s, 'w1', 1)", (running[0],))
        assert rows == [("ok",)]
        assert scans <= BY_ID and STEP_PK in scans, \
            "step: lock and stamp the run by id, never a scan of plan_heartbeat_idx"
        rows, scans = plans.scans("SELECT outcome FROM pgfence.plan_run_step(%s, 'w3', 2)", (released,))
        assert rows == [("external",)]
        assert scans <= BY_ID and STEP_PK in scans
        rows, scans = plans.scans("SELECT pgfence.plan_record_step(%s, 1, 'w3', 2, true)", (released,))
        assert rows == [(True,)]
        # the lock by id, the step by key; the commit's statement also names the status (by id)
        assert scans <= BY_ID and {PLAN_PK, STEP_PK} <= scans
        rows, scans = plans.scans("SELECT pgfence.plan_release(%s, 'w1', 1)", (running[1],))
        assert rows == [(True,)]
        assert scans == {PLAN_PK, STEP_PK}
        rows, scans = plans.scans("SELECT pgfence.plan_start(%s, 'w4')", (running[1],))
        assert rows == [(2,)], "a takeover of the released run: the run's second token"
        assert scans - {STEP_PK} == {PLAN_PK}

        rows, scans = plans.scans("SELECT pgfence.plan_approve(%s, 'bob')", (pending[0],))
        assert rows == [("approved",)]
        assert scans <= BY_ID and scans & {PLAN_PK, STATUS_ID}, \
            "approve by id, never a scan of plan_pending_expiry_idx"
        rows, scans = plans.scans("SELECT pgfence.plan_reject(%s, 'bob', 'no')", (pending[1],))
        assert rows == [(True,)]
        assert scans <= BY_ID and scans & {PLAN_PK, STATUS_ID}, \
            "reject by id, never a scan of plan_pending_expiry_idx"

        _, scans = plans.scans("SELECT pgfence.plan_reap()")
        assert scans <= {"Bitmap(plan_heartbeat_idx|plan_pending_expiry_idx)", "plan_heartbeat_idx",
                         "plan_pending_expiry_idx", PLAN_PK}, "reaper: only lapsed runs and expired proposals"


# ---------------------------------------------------------------------------------------------
# Operations
# ---------------------------------------------------------------------------------------------
# the queue walk of all kinds starts at the claim hint (docs/design.md#operation-claim-hint): an index
# condition id >= hint on operation_queued_idx, not a walk from its front
OP_PK, OP_LEASE, OP_QUEUE = "operation_pkey", "operation_lease_idx", "operation_queued_idx"
# a claim for some kinds walks each kind's queue: an index condition on the kind, never a walk of
# the queue of every kind (a backlog of a kind nobody serves would be read by every claim)
OP_KIND_QUEUE = "operation_kind_queued_idx"
# requeued operations (queued, fence > 0) keep their old ids, below the hint: every claim walks
# their own index from the front, after the lapsed leases (its plan is there even when the lapsed
# leases fill the batch and the walk never runs)
OP_REQUEUED = "operation_requeued_idx (walk)"


def _operations(conn: psycopg.Connection[Any], n: int, kind: str, state: str) -> None:
    """n (at most 1000) new operations of kind in state succeeded | queued | running (owned by
    w1, issued, with a reference) | requeued (claimed by w1, lease lapsed before the call, put
    back by the reaper: queued with fence 1; kind must have nothing lapsed or queued)."""
    conn.execute(f"""DO $$ DECLARE r record; BEGIN
      FOR i IN 1..{n} LOOP
        PERFORM pgfence.operation_request('{kind}', '{state}-' || i || '-' || clock_timestamp());
      END LOOP;
      FOR r IN SELECT * FROM pgfence.operation_claim('w1', ARRAY['{kind}'], '1 hour', 1000)
               WHERE '{state}' <> 'queued' LOOP
        IF '{state}' = 'requeued' THEN
          UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 minute' WHERE id = r.id;
          CONTINUE;
        END IF;
        PERFORM pgfence.operation_begin_issue(r.id, r.fence, true);
        PERFORM pgfence.operation_record_external(r.id, r.fence, 'ref-' || r.id);
        IF '{state}' = 'succeeded' THEN
          PERFORM pgfence.operation_finish(r.id, r.fence, true);
        END IF;
      END LOOP;
      IF '{state}' = 'requeued' THEN
        PERFORM pgfence.operation_reap();
      END IF; END $$""")


def _operation_state(conn: psycopg.Connection[Any], stats: str) -> None:
    _no_autovacuum(conn, "operation")
    in_flight = [(300, "other", "queued"), (200, "mine", "running"), (50, "mine", "queued")]
    if stats == "stats-of-empty-table":
        conn.execute("VACUUM ANALYZE pgfence.operation")
        _operations(conn, 1000, "hist", "succeeded")
        _operations(conn, 1000, "hist", "succeeded")
    elif stats == "analyzed-idle":  # analysed with only finished operations: nothing in flight
        _operations(conn, 1000, "hist", "succeeded")
        _operations(conn, 1000, "hist", "succeeded")
        conn.execute("ANALYZE pgfence.operation")
    elif stats == "many-in-flight":  # analysed with only history; then many running at once
        _operations(conn, 1000, "hist", "succeeded")
        conn.execute("ANALYZE pgfence.operation")
        in_flight = [(300, "other", "queued"), (1000, "mine", "running"), (1000, "mine", "running"),
                     (50, "mine", "queued")]
    else:  # analyzed-busy: analysed while most operations were in flight
        in_flight = [(800, "other", "queued"), (800, "mine", "running"), (400, "mine", "queued")]
    for n, kind, state in in_flight:
        _operations(conn, n, kind, state)
    if stats == "analyzed-busy":
        conn.execute("ANALYZE pgfence.operation")
        _operations(conn, 300, "hist", "succeeded")
    # Two leases lapse, for the claims to take over and the reaper to find.
    conn.execute("""UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 minute'
                    WHERE id IN (SELECT id FROM pgfence.operation WHERE status = 'running'
                                 ORDER BY id LIMIT 2)""")


@IN_FLIGHT
def test_operation_statements_use_their_index(db: str, conn: psycopg.Connection[Any], stats: str,
                                              cache: str) -> None:
    _operation_state(conn, stats)
    running = conn.execute("SELECT id, fence FROM pgfence.operation WHERE status = 'running'"
                           " AND lease_expires_at > now() ORDER BY id LIMIT 3").fetchall()
    queued = conn.execute("SELECT id FROM pgfence.operation WHERE status = 'queued' ORDER BY id DESC"
                          " LIMIT 1").fetchone()
    assert queued is not None
    oldest = dict(conn.execute("SELECT kind, array_agg(id ORDER BY id) FROM pgfence.operation"
                               " WHERE status = 'queued' GROUP BY kind"))
    assert max(oldest["other"]) < min(oldest["mine"]), "the other kind's backlog is ahead in id order"
    session, plans = _session(db, cache, {"operation"})
    with session:
        rows, scans = plans.scans("SELECT id, fence, taken_over_from FROM pgfence.operation_claim("
                                  "'w2', '{mine}', '1 hour', 2)")
        assert [prev for _, _, prev in rows] == ["w1", "w1"], "the two lapsed leases, taken over"
        assert scans == {OP_LEASE, OP_REQUEUED, OP_PK}, "claim: lapsed leases by operation_lease_idx, taken by id"
        rows, scans = plans.scans("SELECT id, fence FROM pgfence.operation_claim('w2', NULL, '1 hour', 1)")
        assert len(rows) == 1
        assert scans == {OP_LEASE, OP_REQUEUED, OP_QUEUE, OP_PK}, "no lapsed lease left: then the queue in order"
        (new_id, new_fence), = rows
        assert new_id == oldest["other"][0], "all kinds: the oldest queued operation"
        rows, scans = plans.scans("SELECT id FROM pgfence.operation_claim('w2', '{mine}', '1 hour', 2)")
        assert [r[0] for r in rows] == oldest["mine"][:2], "one kind: its oldest, past the other backlog"
        assert scans == {OP_LEASE, OP_REQUEUED, OP_KIND_QUEUE, OP_PK}, "one kind: only that kind's queue is read"
        rows, scans = plans.scans("SELECT id FROM pgfence.operation_claim("
                                  "'w2', '{mine,other,mine,none}', '1 hour', 3)")
        assert [r[0] for r in rows] == oldest["other"][1:4], "several kinds: the oldest of them, in id order"
        assert scans == {OP_LEASE, OP_REQUEUED, OP_KIND_QUEUE, OP_PK}, "several kinds: each kind's queue walked once"

        _, scans = plans.scans("SELECT pgfence.operation_begin_issue(%s, %s, true)", (new_id, new_fence))
        assert scans == {OP_PK}
        _, scans = plans.scans("SELECT pgfence.operation_record_external(%s, %s, 'ref')", (new_id, new_fence))
        assert scans == {OP_PK}
        rows, scans = plans.scans("SELECT pgfence.operation_poll(%s, %s, '{\"s\": 1}')", running[0])
        assert rows == [("continue",)]
        assert scans == {OP_PK}
        rows, scans = plans.scans("SELECT pgfence.operation_finish(%s, %s, true)", running[0])
        assert rows == [("succeeded",)]
        assert scans == {OP_PK}
        rows, scans = plans.scans("SELECT pgfence.operation_release(%s, %s)", running[1])
        assert rows == [(True,)]
        assert scans == {OP_PK}
        rows, scans = plans.scans("SELECT pgfence.operation_cancel(%s)", queued)
        assert rows == [("canceled",)]
        assert scans == {OP_PK}
        _, scans = plans.scans("SELECT id FROM pgfence.operation_get(%s)", (new_id,))
        assert scans == {OP_PK}

        conn.execute("UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 minute'"
                     " WHERE id = %s", (running[2][0],))
        rows, scans = plans.scans("SELECT pgfence.operation_reap()")
        assert rows == [(0,)], "a lapsed lease with a reference stays running for the next claim"
        # (the UPDATE of the rows found may look them up by id or again by lease)
        assert OP_LEASE in scans and scans <= {OP_LEASE, OP_PK}, "reaper: only lapsed leases"

        # Requeued operations, made after these plans were chosen: claimed first, from their own
        # index (their ids are below the queue's and below the claim hint)
        _operations(conn, 3, "req", "requeued")
        requeued = [r[0] for r in conn.execute("SELECT id FROM pgfence.operation WHERE status = 'queued'"
                                               " AND fence > 0 ORDER BY id")]
        assert len(requeued) == 3
        rows, scans = plans.scans("SELECT id, fence FROM pgfence.operation_claim('w2', '{req}', '1 hour', 2)")
        assert rows == [(i, 2) for i in requeued[:2]], "one kind: its requeued operations, oldest first"
        assert scans == {OP_LEASE, OP_REQUEUED, OP_PK}, "requeued: by operation_requeued_idx, taken by id"
        rows, scans = plans.scans("SELECT id FROM pgfence.operation_claim('w2', NULL, '1 hour', 4)")
        # the released and the lapsed one (running[1], running[2]), the last requeued, the queue's oldest
        first = sorted([running[1][0], running[2][0], requeued[2]])
        assert [r[0] for r in rows] == [*first, oldest["other"][4]], "all kinds: lapsed and requeued, then the queue"
        assert scans == {OP_LEASE, OP_REQUEUED, OP_QUEUE, OP_PK}


# ---------------------------------------------------------------------------------------------
# Documents
# ---------------------------------------------------------------------------------------------
DOC_PK, KIND_PK = "document_pkey", "document_kind_pkey"
REV_PK, REV_SAVE_ID = "document_revision_pkey", "document_revision_save_id_key"


def _documents(conn: psycopg.Connection[Any], n: int, saves: int, save_ids: bool) -> None:
    save_id = "'s-' || v || '-' || j" if save_ids else "NULL"
    conn.execute(f"""DO $$ DECLARE v bigint; BEGIN FOR i IN 1..{n} LOOP
                       v := pgfence.document_create('record', '{{"a": 0}}', 'u');
                       FOR j IN 1..{saves} LOOP
                         PERFORM pgfence.document_save(v, j, jsonb_build_object('a', j), 'u', {save_id});
                       END LOOP;
                     END LOOP; END $$""")


@cases("stats-of-empty-table", "analyzed-without-save-ids")
def test_document_statements_use_their_index(db: str, conn: psycopg.Connection[Any], stats: str,
                                             cache: str) -> None:
    _no_autovacuum(conn, "document", "document_revision")
    if stats == "stats-of-empty-table":
        conn.execute("VACUUM ANALYZE pgfence.document, pgfence.document_revision")
    # many small documents and one with a long history (revisions of one id: the pkey prefix)
    _documents(conn, 500, 3, save_ids=stats == "stats-of-empty-table")
    _documents(conn, 1, 1500, save_ids=stats == "stats-of-empty-table")
    if stats == "analyzed-without-save-ids":
        conn.execute("ANALYZE pgfence.document, pgfence.document_revision")
    (doc, version), = conn.execute("SELECT id, version FROM pgfence.document ORDER BY version DESC LIMIT 1")
    session, plans = _session(db, cache, {"document", "document_revision", "document_kind"})
    with session:
        save = "SELECT outcome, version FROM pgfence.document_save(%s, %s, '{\"b\": 1}', 'u', %s)"
        rows, scans = plans.scans(save, (doc, version, "new-save"))
        assert rows == [("saved", version + 1)]
        assert scans == {DOC_PK, KIND_PK, REV_SAVE_ID}, "save: the document by id, the receipt by save_id"
        rows, scans = plans.scans(save, (doc, version, "new-save"))
        assert rows == [("saved", version + 1)], "a retry answered from its receipt"
        assert scans == {DOC_PK, KIND_PK, REV_SAVE_ID}
        rows, scans = plans.scans(save, (doc, version, "other-save"))
        assert rows == [("conflict", version + 1)]
        assert scans == {DOC_PK, KIND_PK, REV_SAVE_ID}
        rows, scans = plans.scans(save, (doc, version + 1, None))
        assert rows == [("saved", version + 2)]
        # the save's one statement (migration 0024) keeps its receipt probe in a generic plan as an
        # InitPlan that a NULL save_id never runs (`save_id IS NULL OR NOT EXISTS ...`)
        assert {DOC_PK, KIND_PK} <= scans <= {DOC_PK, KIND_PK, REV_SAVE_ID}
        _, scans = plans.scans("SELECT version FROM pgfence.document_get(%s)", (doc,))
        assert scans == {DOC_PK}
        _, scans = plans.scans("SELECT version FROM pgfence.document_revision(%s, 7)", (doc,))
        assert scans == {REV_PK}
        _, scans = plans.scans("SELECT version FROM pgfence.document_history(%s, 10)", (doc,))
        # a read page: this document's revisions, in index order or gathered and sorted
        assert scans in ({DOC_PK, REV_PK}, {DOC_PK, f"Bitmap({REV_PK})"})
        create = "SELECT pgfence.document_create('record', '{}', 'u', 'key-1')"
        (created,), = plans.scans(create)[0]
        rows, scans = plans.scans(create)
        assert rows == [(created,)], "a repeated create answered by its idempotency key"
        assert scans == {"document_idempotency_key_key", DOC_PK, REV_PK, KIND_PK}
        rows, scans = plans.scans("SELECT outcome FROM pgfence.document_delete(%s, 1, 'u')", (created,))
        assert rows == [("deleted",)]
        assert scans == {DOC_PK}
