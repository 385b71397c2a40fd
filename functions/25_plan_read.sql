-- pgfence functions/25_plan_read.sql — plans (module 2): reads and the reaper.
--
-- Public: the view plan_receipts (every committed receipt), plan_get (one plan with its frozen
-- steps), plan_steps (every step with its state), plan_list (the newest plans), plan_reap (the
-- reaper, on the executors' timer) and plan_reap_stale (its deprecated old name).
-- The reads heal lazily: a run whose heartbeat lapsed reads as failed (interrupted) and a
-- proposal past expires_at as expired (_plan_heal), so the answer depends only on the database
-- clock, whether or not a reaper runs. Rows a live step transaction holds are skipped.
-- Errors: functions/ERRORS.md. Query plans: docs/query-plans.md#plan.

CREATE OR REPLACE VIEW pgfence.plan_receipts AS
SELECT s.plan_id, s.step_index, s.action, s.kind, s.outcome, s.output,
       s.error ->> 'sqlstate' AS sqlstate, s.error ->> 'message' AS message, s.error,
       s.worker, s.started_at, s.finished_at, s.finished_at - s.started_at AS duration,
       pgfence._plan_step_key(s.plan_id, s.step_index) AS idempotency_key
FROM pgfence.plan_step s
WHERE s.outcome IS NOT NULL;
REVOKE ALL ON pgfence.plan_receipts FROM PUBLIC;
GRANT SELECT ON pgfence.plan_receipts TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON VIEW pgfence.plan_receipts IS
  'Receipts of every plan step that committed an outcome: ok with its output, or error.
Ok with the action''s output, or error with SQLSTATE and message; who ran it, when, how long, and the step''s idempotency key (pgfence-plan-<id>-step-<n>). A step without a receipt did not commit.';
COMMENT ON COLUMN pgfence.plan_receipts.plan_id IS 'The plan.';
COMMENT ON COLUMN pgfence.plan_receipts.step_index IS 'The step, numbered from 1.';
COMMENT ON COLUMN pgfence.plan_receipts.action IS 'The action the step named (pgfence.plan_actions).';
COMMENT ON COLUMN pgfence.plan_receipts.kind IS 'sql (run by plan_run_step) or external (performed by an executor, recorded by plan_record_step).';
COMMENT ON COLUMN pgfence.plan_receipts.outcome IS 'ok or error; committed in the step''s own transaction (sql) or with the executor''s report (external).';
COMMENT ON COLUMN pgfence.plan_receipts.output IS 'For ok: what the action returned (sql) or what the executor reported (external).';
COMMENT ON COLUMN pgfence.plan_receipts.sqlstate IS 'For an error of a sql step: its SQLSTATE (e.g. PF108, 23514); NULL for an external step''s error.';
COMMENT ON COLUMN pgfence.plan_receipts.message IS 'For an error: its message (the transport''s for an external step).';
COMMENT ON COLUMN pgfence.plan_receipts.error IS 'For an error: the whole error as JSON (sqlstate, message, detail, hint, context).';
COMMENT ON COLUMN pgfence.plan_receipts.worker IS 'The owner that ran (sql) or recorded (external) the step.';
COMMENT ON COLUMN pgfence.plan_receipts.started_at IS 'When the step began (an external step: when it was handed to its executor).';
COMMENT ON COLUMN pgfence.plan_receipts.finished_at IS 'When the receipt was written (clock time of the step''s end).';
COMMENT ON COLUMN pgfence.plan_receipts.duration IS 'finished_at - started_at.';
COMMENT ON COLUMN pgfence.plan_receipts.idempotency_key IS 'pgfence-plan-<plan id>-step-<step index>: the key every delivery of the step carries.';

CREATE OR REPLACE FUNCTION pgfence.plan_get(p_id bigint)
RETURNS TABLE (
  id bigint, status text, failure text, step_count integer, next_step integer,
  proposed_by text, proposed_at timestamptz, expires_at timestamptz, idempotency_key text,
  compensates bigint, compensated_by bigint[], approved_by text, approved_at timestamptz,
  rejected_by text, rejected_at timestamptz, reject_reason text, worker text,
  started_at timestamptz, heartbeat_interval interval, heartbeat_at timestamptz,
  heartbeat_expires_at timestamptz, external_started_at timestamptz, finished_at timestamptz,
  updated_at timestamptz, steps jsonb
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  PERFORM pgfence._plan_require(p_id);
  PERFORM pgfence._plan_heal(p_id, 1);   -- lazy heal: a lapsed run reads as failed (interrupted)
  RETURN QUERY
  SELECT p.id, p.status, p.failure, p.step_count, p.next_step, p.proposed_by, p.proposed_at,
         p.expires_at, p.idempotency_key, p.compensates,
         (SELECT array_agg(c.id ORDER BY c.id) FROM pgfence.plan c WHERE c.compensates = p.id),
         p.approved_by, p.approved_at, p.rejected_by, p.rejected_at, p.reject_reason, p.worker,
         p.started_at, p.heartbeat_interval, p.heartbeat_at, p.heartbeat_expires_at,
         p.external_started_at, p.finished_at, p.updated_at, pgfence._plan_steps_json(p.id)
  FROM pgfence.plan p WHERE p.id = p_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_get(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_get(bigint) IS
  'One plan: status, progress, who proposed, approved or owns it, and its frozen steps.
Status (failure reason if failed), progress, who proposed / approved / rejected it and when, the owner and its heartbeat, the compensating plans, and the frozen steps. Heals lazily: a run whose heartbeat lapsed is marked failed (interrupted) and a pending plan past expires_at expired before it is read (unless a live step transaction holds the row). Errors: 22004 (id NULL), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_steps(p_id bigint)
RETURNS TABLE (
  step_index integer, action text, kind text, args jsonb, note text, state text,
  output jsonb, sqlstate text, message text, worker text, started_at timestamptz,
  finished_at timestamptz, duration interval, idempotency_key text
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  PERFORM pgfence._plan_require(p_id);
  PERFORM pgfence._plan_heal(p_id, 1);
  RETURN QUERY
  SELECT s.step_index, s.action, s.kind, s.args, s.note,
         CASE
           WHEN s.outcome IS NOT NULL THEN s.outcome
           WHEN s.step_index = p.next_step AND p.status = 'executing' AND p.external_started_at IS NOT NULL THEN 'running'
           WHEN s.step_index = p.next_step AND p.status = 'executing' THEN 'next'
           WHEN p.status IN ('pending', 'approved', 'executing') THEN 'waiting'
           WHEN s.step_index = p.next_step AND p.failure = 'interrupted' AND p.external_started_at IS NOT NULL
             THEN 'unknown'
           ELSE 'not_run' END,
         s.output, s.error ->> 'sqlstate', s.error ->> 'message', s.worker, s.started_at,
         s.finished_at, s.finished_at - s.started_at,
         pgfence._plan_step_key(p.id, s.step_index)
  FROM pgfence.plan p
  JOIN pgfence.plan_step s ON s.plan_id = p.id
  WHERE p.id = p_id
  ORDER BY s.step_index;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_steps(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_steps(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_steps(bigint) IS
  'Every step of a plan with its receipt and its state (ok, error, next, running, waiting, ...).
state ok | error (committed receipts), next (the step an executing run does next), running (an external step handed to its executor), waiting (not reached yet), unknown (an external step in flight when the run was interrupted: it may have happened), not_run (the plan ended before it). Heals lazily like plan_get. Errors: 22004 (id NULL), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_list(
  p_status text DEFAULT NULL,
  p_limit  integer DEFAULT 100
)
RETURNS TABLE (
  id bigint, status text, failure text, step_count integer, steps_done integer,
  proposed_by text, proposed_at timestamptz, expires_at timestamptz, approved_by text,
  worker text, heartbeat_expires_at timestamptz, compensates bigint, finished_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_status IS NOT NULL AND p_status NOT IN ('pending', 'approved', 'rejected', 'expired', 'executing', 'executed', 'failed') THEN
    RAISE EXCEPTION 'plan_list: unknown status "%"', p_status
      USING ERRCODE = '22023', DETAIL = 'p_status keeps the plans of one status; NULL lists them all.',
            HINT = 'One of pending, approved, rejected, expired, executing, executed, failed.';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'plan_list: limit must be between 1 and 10000'
      USING ERRCODE = '22023', DETAIL = format('Got %s.', coalesce(p_limit::text, 'NULL')),
            HINT = 'Pass 1 to 10000 (the default is 100), or narrow the list by status.';
  END IF;
  PERFORM pgfence._plan_heal(NULL, 1000);
  RETURN QUERY
  SELECT p.id, p.status, p.failure, p.step_count,
         CASE WHEN p.status = 'executed' THEN p.step_count
              WHEN p.status IN ('executing', 'failed') THEN p.next_step - 1 ELSE 0 END,
         p.proposed_by, p.proposed_at, p.expires_at, p.approved_by, p.worker,
         CASE WHEN p.status = 'executing' THEN p.heartbeat_expires_at END,
         p.compensates, p.finished_at
  FROM pgfence.plan p
  WHERE p_status IS NULL OR p.status = p_status
  ORDER BY p.id DESC
  LIMIT p_limit;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_list(text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_list(text, integer) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_list(text, integer) IS
  'The newest plans (highest id first), optionally of one status, without their steps.
Progress (steps_done = ok receipts), proposer, approver, owner and heartbeat deadline. Heals lapsed runs and expired proposals first, like plan_get. Errors: 22023 (unknown status, limit outside 1..10000).';

-- ---------------------------------------------------------------------------------------------
-- The reaper (<module>_reap, like outbox_reap and operation_reap)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_reap(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_count integer;
BEGIN
  IF p_max_rows IS NULL OR p_max_rows < 1 THEN
    RAISE EXCEPTION 'plan_reap: max_rows must be positive, got %', p_max_rows
      USING ERRCODE = '22023', DETAIL = 'max_rows is how many plans one call may change.',
            HINT = 'Pass a positive number, or omit it for 1000.';
  END IF;
  PERFORM pgfence._set_actor('reaper');
  v_count := pgfence._plan_heal(NULL, p_max_rows);
  PERFORM pgfence._set_actor(NULL);
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_reap(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_reap(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_reap(integer) IS
  'Reaper: lapsed runs become failed (interrupted), overdue proposals expired; returns how many.
Executing plans whose heartbeat lapsed (database clock) become failed with reason interrupted — their committed steps keep their receipts, nothing is retried, and the old owner is refused from then on — and pending plans past expires_at become expired. At most max_rows; skips rows a live transaction holds. Run by executors on a timer; safe for a DBA to call. Errors: 22023 (max_rows < 1).';

CREATE OR REPLACE FUNCTION pgfence.plan_reap_stale(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE sql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT pgfence.plan_reap(p_max_rows);
$$;
REVOKE ALL ON FUNCTION pgfence.plan_reap_stale(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_reap_stale(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_reap_stale(integer) IS
  'Deprecated: use pgfence.plan_reap. The plan reaper under its old name (issue 13 renamed it).
Calls pgfence.plan_reap(p_max_rows) and returns its count; kept so that executors and scripts of earlier releases keep working. Errors: 22023 (max_rows < 1).';
