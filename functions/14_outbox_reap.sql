-- pgfence functions/14_outbox_reap.sql — outbox (module 1): the reaper of lapsed leases.
--
-- Public: outbox_reap(max_rows) -> how many lapsed claims it took back
--         outbox_reclaim_stale(max_rows): deprecated, the former name (calls outbox_reap)
-- Run by executors on a timer (pgfence_executor); safe for a DBA to call. A message whose
-- lease lapsed by the database clock goes back to pending after a backoff (the attempt counts
-- as failed), or to dead when no attempt is left, and leaves a lapse receipt in
-- pgfence.outbox_lapse: the lost worker may have delivered it (audit_duplicates lists them).
-- Errors: functions/ERRORS.md. Plans: docs/query-plans.md#outbox.

CREATE OR REPLACE FUNCTION pgfence.outbox_reap(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_ids   bigint[];
  v_count integer;
  c_processing CONSTANT text := 'processing';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  IF p_max_rows IS NULL OR p_max_rows < 1 THEN
    RAISE EXCEPTION 'outbox_reap: max_rows must be positive, got %', p_max_rows
      USING ERRCODE = '22023', DETAIL = 'max_rows bounds how many lapsed claims one call takes back; nothing was reaped.',
            HINT = 'Omit it for the default (1000), or pass a positive batch size.';
  END IF;
  PERFORM pgfence._set_actor('reaper');
  -- SKIP LOCKED: a row being marked right now is left alone. FOR UPDATE re-reads a row that was
  -- committed after our snapshot and drops it unless it is still processing and lapsed; the
  -- UPDATE below checks both again under the lock.
  SELECT array_agg(s.id) INTO v_ids
  FROM (
    SELECT o.id FROM pgfence.outbox o
    WHERE o.status = 'processing' AND o.lease_expires_at < now()
    ORDER BY o.lease_expires_at
    LIMIT p_max_rows
    FOR UPDATE SKIP LOCKED
  ) s;
  IF v_ids IS NULL THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN 0;
  END IF;
  -- The lapse receipt (pgfence.outbox_lapse, migration 0006): the rows are locked by us, so
  -- this sees exactly the rows the UPDATE below takes back.
  INSERT INTO pgfence.outbox_lapse (message_id, attempt, worker, claimed_at, lease_expires_at, outcome)
  SELECT o.id, o.attempts, o.locked_by, o.claimed_at, o.lease_expires_at,
         CASE WHEN o.attempts >= o.max_attempts THEN 'dead' ELSE 'pending' END
  FROM pgfence.outbox o
  WHERE o.id = ANY (v_ids) AND o.status = c_processing AND o.lease_expires_at < now()
  ON CONFLICT (message_id, attempt) DO NOTHING;
  UPDATE pgfence.outbox o
  SET status = CASE WHEN o.attempts >= o.max_attempts THEN 'dead' ELSE 'pending' END,
      next_attempt_at = CASE WHEN o.attempts >= o.max_attempts THEN o.next_attempt_at
        ELSE now() + (SELECT pgfence.backoff(o.attempts, st.backoff_base, st.backoff_cap)
                      FROM pgfence._outbox_settings(o.channel) st) END,
      finished_at = CASE WHEN o.attempts >= o.max_attempts THEN now() END,
      last_error = format('lease expired: worker %s did not finish attempt %s by %s',
                          o.locked_by, o.attempts, o.lease_expires_at),
      locked_by = NULL, lease_expires_at = NULL, updated_at = now()
  WHERE o.id = ANY (v_ids) AND o.status = c_processing AND o.lease_expires_at < now();
  GET DIAGNOSTICS v_count = ROW_COUNT;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_reap(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_reap(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_reap(integer) IS
  'Reaper: lapsed outbox leases back to pending (or dead); returns how many it took back.
A message whose lease lapsed by the database clock goes back to pending after a backoff (counted
as a failed attempt), or to dead when no attempts remain; each one leaves a lapse receipt in
pgfence.outbox_lapse (a possible duplicate delivery, listed by pgfence.audit_duplicates). Takes
at most max_rows; skips rows locked by a concurrent mark and never touches a row finished
between its read and its write. Run by executors on a timer; safe for a DBA to call.
Errors: 22023 (max_rows NULL or < 1).';

-- The reaper's former name (the reapers are named <module>_reap since schema 12's functions),
-- kept so that callers of older pgfence versions go on working.
CREATE OR REPLACE FUNCTION pgfence.outbox_reclaim_stale(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT pgfence.outbox_reap(p_max_rows);
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_reclaim_stale(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_reclaim_stale(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_reclaim_stale(integer) IS
  'Deprecated: use pgfence.outbox_reap. The outbox reaper under its former name.
Calls pgfence.outbox_reap(p_max_rows) and returns its answer.
Errors: 22023 (max_rows NULL or < 1).';
