-- pgfence functions/32_operation_claim.sql — operations (module 3): claim and reap (executors).
--
-- Public: operation_claim (take the orphans whose lease lapsed, then the queue, bumping each
-- one's fence token) and operation_reap (settle lapsed leases that need no owner: requeue, or
-- fail as "outcome unknown"). Both run on the executors' timer; the reaper is safe for a DBA.
-- Fence: `fence` is bumped by every claim; owner writes (33_operation_issue.sql) match
-- `fence = p_fence AND status = 'running'` under a row lock, so a replaced owner changes nothing.
-- Parameter order: operation_claim(p_worker, p_kinds, p_lease, p_batch) is the one claim not in
-- the (worker, batch, filter, lease) order of outbox_claim and plan_claim; an overload in that
-- order would make named calls ambiguous (42725, tests/pgtap/30_operation.sql), so it stays.
-- Both are pinned to one generic plan with index access only: docs/query-plans.md#operation.
-- The claim walks each queue from its session's claim hint (the outbox's, with the id as the
-- key), requeued operations from their own index: docs/design.md#operation-claim-hint.

CREATE OR REPLACE FUNCTION pgfence.operation_claim(
  p_worker text,
  p_kinds  text[] DEFAULT NULL,
  p_lease  interval DEFAULT '2 minutes',
  p_batch  integer DEFAULT 1
)
RETURNS TABLE (
  id               bigint,
  kind             text,
  target           text,
  params           jsonb,
  idempotency_key  text,
  fence            integer,
  lease            interval,
  lease_expires_at timestamptz,
  issue_started    boolean,
  issue_count      integer,
  external_ref     text,
  external_state   jsonb,
  cancel_requested boolean,
  taken_over_from  text,
  created_at       timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  v_lease interval := coalesce(p_lease, interval '2 minutes');
  v_got   integer;
  v_ids   bigint[];
  v_n     integer;
  -- the claim hint (docs/design.md#operation-claim-hint)
  v_name  text;         -- its session setting, NULL = none (a one-kind array holding NULL)
  v_raw   text;
  v_st    bigint[];     -- its state: hint id, candidate id, candidate xid bound, candidate's
                        -- transaction, passed (0/1), last full walk (µs); NULL elements = none
  v_full  boolean;      -- this walk starts at the front
  v_own   bigint;       -- this transaction's xid before the walk
  v_now_us bigint;
  v_from  bigint := -9223372036854775808;
  v_l     bigint;       -- the last id claimed from the queue
BEGIN
  IF p_worker IS NULL OR p_worker = '' OR length(p_worker) > 200 THEN
    RAISE EXCEPTION 'operation_claim: worker must be a non-empty name of at most 200 characters'
      USING ERRCODE = '22023', DETAIL = 'The worker''s name is recorded as the owner (locked_by) and in the event log.',
            HINT = 'Use something an operator can trace, e.g. host:pid.';
  END IF;
  PERFORM pgfence._operation_check_lease(p_lease);
  IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'operation_claim: batch must be between 1 and 1000, got %', p_batch
      USING ERRCODE = '22023', DETAIL = 'One claim takes 1 to 1000 operations.',
            HINT = 'Pass a batch between 1 and 1000, or omit it for 1.';
  END IF;
  PERFORM pgfence._set_actor(p_worker);

  -- First the orphans (running, lease lapsed: their external call may be in flight, resume
  -- them), then the requeued ones (the reaper put them back: their lease lapsed before their
  -- external call), then the queue in request order. SKIP LOCKED: concurrent claimers never
  -- collide. The requeued keep their old ids, below the claim hint the queue walks start at
  -- (docs/design.md#operation-claim-hint), so they have their own index, walked from its front
  -- (operation_requeued_idx: queued with fence > 0, only they are). The Append stops at the
  -- batch: no requeued row is locked once the orphans fill it. Query plans:
  -- docs/query-plans.md#operation
  RETURN QUERY
  WITH lapsed AS (
    SELECT o.id, o.locked_by AS prev_owner FROM pgfence.operation o
    WHERE o.lease_expires_at < now()  -- running, lease lapsed: a lease is set only while running
      AND (p_kinds IS NULL OR o.kind = ANY (p_kinds))
    ORDER BY o.lease_expires_at, o.id
    LIMIT p_batch
    FOR UPDATE SKIP LOCKED
  ), requeued AS (
    -- locked_by is NULL: the reaper clears it (so taken_over_from is NULL, as for the queue)
    SELECT o.id, o.locked_by AS prev_owner FROM pgfence.operation o
    WHERE o.status = 'queued' AND o.fence > 0 AND (p_kinds IS NULL OR o.kind = ANY (p_kinds))
    ORDER BY o.id
    LIMIT p_batch
    FOR UPDATE SKIP LOCKED
  ), cand AS (
    SELECT l.id, l.prev_owner FROM lapsed l
    UNION ALL
    SELECT r.id, r.prev_owner FROM requeued r
    LIMIT p_batch
  ), upd AS (
    -- status: running already for an orphan; started_at: set at the first claim of either
    UPDATE pgfence.operation o
    SET status = 'running', fence = o.fence + 1, locked_by = p_worker, claimed_at = now(),
        lease = v_lease, lease_expires_at = now() + v_lease
    WHERE o.id = ANY (ARRAY(SELECT c.id FROM cand c))  -- by primary key
    RETURNING o.*, (SELECT c.prev_owner FROM cand c WHERE c.id = o.id) AS prev_owner
  )
  SELECT u.id, u.kind, u.target, u.params, coalesce(u.idempotency_key, 'pgfence-operation-' || u.id),
         u.fence, u.lease, u.lease_expires_at, u.issue_started_at IS NOT NULL, u.issue_count,
         u.external_ref, u.external_state, u.cancel_requested_at IS NOT NULL, u.prev_owner, u.created_at
  FROM upd u ORDER BY u.id;
  GET DIAGNOSTICS v_got = ROW_COUNT;
  IF v_got >= p_batch THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;

  -- The queue, oldest first, locked here and claimed by primary key below: all kinds in id
  -- order, or each kind's own queue walked once per distinct kind up to the batch, then the
  -- oldest of those, so a backlog of a kind this executor does not serve is never read. At most
  -- p_batch rows are locked per kind; those not claimed are released when this transaction ends
  -- (a moment later: executors claim in autocommit). Query plans: docs/query-plans.md#operation
  -- The claim hint (docs/design.md#operation-claim-hint, the outbox's algorithm with the id as
  -- the key): each scope (all kinds, one kind, a set of kinds) walks its queue from its session's
  -- hint, an id below which no fresh request of the scope is queued (a requeued one, below it,
  -- was taken above), instead of the front of the queue index (the entries of claimed
  -- operations stay there while a snapshot older than them is open); from the front once the
  -- last full walk is older than pgfence.claim_full_walk_ms (default 1000, at most 60000; 0 =
  -- always). Read here, after the lapsed and requeued ones: their locks may have given this
  -- transaction its xid. Written with as few PL/pgSQL expressions as it can be: each one is set
  -- up again in every transaction (the hint costs ~40-55 µs of a ~500 µs claim; as two helper
  -- functions it cost the same).
  v_name := CASE WHEN p_kinds IS NULL THEN 'pgfence.operation_claim_hint_all'
                 WHEN cardinality(p_kinds) = 1 THEN 'pgfence.operation_claim_hint_' || md5(p_kinds[1])
                 -- a set of kinds: the same set in any order, with repeats, is the same scope
                 ELSE 'pgfence.operation_claim_hint_' || md5(array_to_string(ARRAY(
                        SELECT DISTINCT u.k FROM unnest(p_kinds) AS u(k) WHERE u.k IS NOT NULL ORDER BY 1), ',')) END;
  IF v_name IS NOT NULL THEN
    v_now_us := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
    v_raw := current_setting(v_name, true);
    -- 6 optional fields of up to 18 digits ("digits, and no run of 19", as the outbox's check);
    -- none or malformed: none
    v_st := CASE WHEN v_raw ~ '^(-?[0-9]+)?(,(-?[0-9]+)?){5}$' AND v_raw !~ '[0-9]{19}'
                 THEN string_to_array(v_raw, ',', '')::bigint[] ELSE '{NULL,NULL,NULL,NULL,NULL,NULL}' END;
    -- from the front: no hint, no full walk yet, the last one at least the bound ago, or one
    -- after the clock (forged, or the clock stepped back)
    v_full := v_st[1] IS NULL OR v_st[6] IS NULL OR v_now_us - v_st[6] NOT BETWEEN 0 AND 1000 * CASE
                WHEN current_setting('pgfence.claim_full_walk_ms', true) ~ '^[0-9]{1,5}$'
                THEN least(current_setting('pgfence.claim_full_walk_ms', true)::bigint, 60000) ELSE 1000 END - 1;
    v_from := CASE WHEN v_full THEN -9223372036854775808 ELSE v_st[1] END;
    v_own := pg_current_xact_id_if_assigned()::text::bigint;
    IF v_st[2] IS NOT NULL AND v_st[5] IS DISTINCT FROM 1 THEN
      -- A candidate taken in a transaction that already had its xid gets its bound from the
      -- xid of a later transaction of this session (assigned after the candidate's walk).
      v_st[3] := coalesce(v_st[3], CASE WHEN v_own <> v_st[4] THEN v_own END);
      -- Passed: every transaction that had an xid when the candidate's walk took its snapshot
      -- has ended (all of them are below the bound), so all their writes are visible now.
      v_st[5] := CASE WHEN pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= v_st[3] THEN 1 ELSE 0 END;
    END IF;
  END IF;
  IF p_kinds IS NULL THEN
    v_ids := ARRAY(
      SELECT o.id FROM pgfence.operation o
      -- no lease: true of every queued operation (CHECK operation_lease_iff_running); stated
      -- for the index (operation_queued_idx)
      WHERE o.status = 'queued' AND o.lease_expires_at IS NULL AND o.id >= v_from
      ORDER BY o.id
      LIMIT p_batch - v_got
      FOR UPDATE SKIP LOCKED);
  ELSE
    v_ids := ARRAY(
      SELECT b.id
      FROM (SELECT DISTINCT u.k FROM unnest(p_kinds) AS u(k)) ks
      CROSS JOIN LATERAL (
        -- "kind = ks.k ORDER BY id", written so that only operation_kind_queued_idx gives
        -- the order (docs/query-plans.md#operation)
        SELECT o.id FROM pgfence.operation o
        WHERE o.kind = ANY (ARRAY[ks.k]) AND o.status = 'queued' AND o.id >= v_from
        ORDER BY o.kind, o.id
        LIMIT p_batch - v_got
        FOR UPDATE SKIP LOCKED) b
      ORDER BY b.id
      LIMIT p_batch - v_got);
  END IF;
  v_n := cardinality(v_ids);
  IF v_name IS NOT NULL THEN
    v_l := v_ids[v_n];  -- NULL when none
    v_st := CASE
      -- The candidate's bound has passed: no writer can queue a fresh request below it any
      -- more, and this walk saw every one that did. Everything this walk passed is done: the
      -- hint moves to the candidate (all queued claimed: the candidate is used up) ...
      WHEN v_st[5] = 1 AND (v_n < p_batch - v_got OR v_st[2] <= v_l) THEN ARRAY[v_st[2], NULL, NULL, NULL, NULL, v_st[6]]
      -- ... or to the last claimed id
      WHEN v_st[5] = 1 THEN ARRAY[v_l, v_st[2], v_st[3], v_st[4], v_st[5], v_st[6]]
      -- A full walk that ended below the hint found requests the hint skipped (a locked row):
      -- walk from here next time.
      WHEN v_full AND v_n = p_batch - v_got AND v_l < v_st[1] THEN ARRAY[v_l, v_st[2], v_st[3], v_st[4], v_st[5], v_st[6]]
      ELSE v_st END;
    IF v_full THEN
      v_st[6] := v_now_us;
    END IF;
    IF v_st[2] IS NULL THEN
      IF v_n > 0 THEN
        -- The next candidate: this walk's last id (not below the hint), bounded by an xid
        -- assigned after this walk's snapshot: this transaction's, when the walk assigned it.
        v_st := ARRAY[v_st[1], greatest(v_l, v_st[1]),
                      CASE WHEN v_own IS NULL THEN pg_current_xact_id_if_assigned()::text::bigint END,
                      pg_current_xact_id_if_assigned()::text::bigint, 0, v_st[6]];
      END IF;
    ELSIF v_st[3] IS NULL THEN
      -- A candidate still without a bound (taken by a transaction that had its xid before its
      -- walk): this later transaction's xid, when its walk assigned one, is a bound. Without
      -- this step such a candidate would wait for a claim that has its xid before its walk,
      -- which only lapsed or requeued operations give: the hint would stop moving.
      v_st[3] := CASE WHEN pg_current_xact_id_if_assigned()::text::bigint <> v_st[4]
                      THEN pg_current_xact_id_if_assigned()::text::bigint END;
    END IF;
    -- an assignment, not PERFORM: a simple expression, no SPI query
    v_raw := set_config(v_name, array_to_string(v_st, ',', ''), false);
  END IF;
  IF v_n = 0 THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;
  RETURN QUERY
  WITH upd AS (
    UPDATE pgfence.operation o
    SET status = 'running', fence = o.fence + 1, locked_by = p_worker, claimed_at = now(),
        lease = v_lease, lease_expires_at = now() + v_lease, started_at = coalesce(o.started_at, now())
    WHERE o.id = ANY (v_ids)  -- by primary key, as above
    RETURNING o.*
  )
  SELECT u.id, u.kind, u.target, u.params, coalesce(u.idempotency_key, 'pgfence-operation-' || u.id),
         u.fence, u.lease, u.lease_expires_at, u.issue_started_at IS NOT NULL, u.issue_count,
         u.external_ref, u.external_state, u.cancel_requested_at IS NOT NULL, NULL::text, u.created_at
  FROM upd u ORDER BY u.id;
  PERFORM pgfence._set_actor(NULL);
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_claim(text, text[], interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_claim(text, text[], interval, integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_claim(text, text[], interval, integer) IS
  'Claim up to p_batch operations of p_kinds (NULL = all): lapsed leases first, then the queue.
First running ones whose lease lapsed by the database clock (a takeover: taken_over_from names the old owner), then ones the reaper requeued, then queued ones in request order (walked from this session''s claim hint for these kinds, and from the front at least once per pgfence.claim_full_walk_ms: docs/design.md#operation-claim-hint); FOR UPDATE SKIP LOCKED, so concurrent claimers never share one. Bumps the fence and returns it: the token for begin_issue / record_external / poll / finish / release. issue_started and external_ref say whether the external call was already made: with a reference, only poll it; otherwise call operation_begin_issue, which decides. idempotency_key is the one to pass to the external API (pgfence-operation-<id> when the request had none). Parameter order (worker, kinds, lease, batch), unlike outbox_claim and plan_claim (worker, batch, filter, lease): kept, since an overload in their order would make named calls ambiguous. Errors: 22023 (empty worker, lease outside (0, 1 day], batch outside 1..1000).';

-- ---------------------------------------------------------------------------------------------
-- The reaper (<module>_reap, like outbox_reap and plan_reap)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_reap(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_count integer;
  c_running CONSTANT text := 'running';  -- a parameter, not a literal: docs/query-plans.md#operation
BEGIN
  IF p_max_rows IS NULL OR p_max_rows < 1 THEN
    RAISE EXCEPTION 'operation_reap: max_rows must be positive, got %', p_max_rows
      USING ERRCODE = '22023', DETAIL = 'max_rows is how many operations one call may change.',
            HINT = 'Pass a positive number, or omit it for 1000.';
  END IF;
  PERFORM pgfence._set_actor('reaper');
  -- Lapsed leases the reaper can settle without an owner. With an external reference, or an
  -- intent whose call passed the idempotency key, the operation stays running for the next
  -- claim (it resumes polling / re-issues with the key).
  WITH stale AS (
    SELECT o.id FROM pgfence.operation o
    WHERE o.lease_expires_at < now()  -- running, lease lapsed: a lease is set only while running
      AND (o.issue_started_at IS NULL OR (o.external_ref IS NULL AND NOT o.issue_idempotent))
    ORDER BY o.lease_expires_at
    LIMIT p_max_rows
    FOR UPDATE SKIP LOCKED
  ), reaped AS (
    UPDATE pgfence.operation o
    SET status = CASE WHEN o.issue_started_at IS NULL THEN 'queued' ELSE 'failed' END,
        locked_by = CASE WHEN o.issue_started_at IS NULL THEN NULL ELSE o.locked_by END,
        lease_expires_at = NULL,
        finished_at = CASE WHEN o.issue_started_at IS NULL THEN NULL ELSE now() END,
        result = CASE WHEN o.issue_started_at IS NULL THEN o.result
                      ELSE jsonb_build_object('reason', 'outcome_unknown', 'intent_at', pgfence._ts(o.issue_started_at),
                                              'issued_by', o.issued_by, 'issues', o.issue_count) END,
        error = CASE WHEN o.issue_started_at IS NULL
          THEN format('lease of %s lapsed at %s before the external call; requeued', o.locked_by, pgfence._ts(o.lease_expires_at))
          ELSE format('outcome unknown: %s started the external %s call for %s at %s and its lease lapsed at %s before an external reference was recorded; the call did not pass the idempotency key, so calling again could start a second operation. Check %s in the external system by hand.',
                      o.issued_by, o.kind, o.target, pgfence._ts(o.last_issue_at), pgfence._ts(o.lease_expires_at), o.target) END
    WHERE o.id = ANY (ARRAY(SELECT s.id FROM stale s))  -- by primary key, as in operation_claim
      AND o.status = c_running AND o.lease_expires_at < now()
    RETURNING o.id, o.kind, o.status
  )
  SELECT count(*) INTO v_count FROM reaped;
  IF v_count > 0 THEN
    PERFORM pg_notify('pgfence_operation', json_build_object('kind', NULL, 'id', NULL, 'reaped', v_count)::text);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_reap(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_reap(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_reap(integer) IS
  'Reaper: settles lapsed leases that need no owner (requeue, or fail as outcome unknown).
For operations whose lease lapsed by the database clock: one whose external call was never issued goes back to queued; one whose call was issued without the idempotency key and left no reference fails as "outcome unknown" (a repeat could start a second operation). Others (a reference, or an intent whose call passed the key) stay running for the next operation_claim, which resumes them. Skips rows locked by an owner''s write; takes at most max_rows. Returns how many it changed. Run by executors on a timer; safe for a DBA to call. Errors: 22023 (max_rows < 1).';
