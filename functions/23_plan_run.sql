-- pgfence functions/23_plan_run.sql — plans (module 2): taking a run, and keeping it.
--
-- Public: plan_start (take one run by id), plan_claim (executors: take the oldest runs),
-- plan_release (hand a run over between steps), plan_heartbeat (the owner is alive).
-- A take makes a worker the owner and returns the run's fence token, the run token
-- (plan.run_token, bumped by every take: a start, a claim, a takeover of a released run, a
-- re-entry under the owner's own name, which also writes a 'reenter' event). Every owner write
-- locks the plan row and is refused unless the plan is still executing by that worker, under
-- that token, with a live heartbeat: a second process under the same name fences the first out.
-- A lapsed heartbeat fails the plan (interrupted) at the next lock-and-check, read or reaper run,
-- by the database clock. A released run (worker NULL) must be taken before its heartbeat lapses.

CREATE OR REPLACE FUNCTION pgfence.plan_start(
  p_id        bigint,
  p_worker    text,
  p_heartbeat interval DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v       pgfence.plan;
  v_token bigint;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_heartbeat(p_heartbeat);
  PERFORM pgfence._set_actor(p_worker);
  -- Lock first, to know what this take replaces: _plan_lock raises 22004 / P0002 and marks a
  -- lapsed run failed (interrupted), which is then refused like any terminal plan.
  v := pgfence._plan_lock(p_id);
  IF NOT (v.status = 'approved'
          OR (v.status = 'executing' AND (v.worker IS NULL OR v.worker = p_worker))) THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN NULL;
  END IF;
  UPDATE pgfence.plan p
  SET status = 'executing',
      worker = p_worker,
      run_token = p.run_token + 1,
      started_at = coalesce(p.started_at, now()),
      heartbeat_interval = coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds'),
      heartbeat_at = now(),
      heartbeat_expires_at = now() + coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds')
  WHERE p.id = p_id
  RETURNING p.run_token INTO v_token;
  IF v.status = 'executing' AND v.worker = p_worker THEN
    -- The owner's name takes its own live run again (a restarted worker resuming "its" plans,
    -- or a second process under the same name): the holder of the previous token is fenced out.
    PERFORM pgfence._event('plan', p_id, 'reenter', 'executing', 'executing', NULL,
      jsonb_strip_nulls(jsonb_build_object(
        'worker', p_worker, 'token', v_token, 'previous_token', v.run_token, 'step', v.next_step,
        'external_in_flight', CASE WHEN v.external_started_at IS NOT NULL THEN true END)),
      p_worker);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_token;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_start(bigint, text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_start(bigint, text, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_start(bigint, text, interval) IS
  'Take a run and return its new fence token (pass it to plan_run_step and the other owner calls).
Of concurrent callers exactly one wins: approved -> executing owned by p_worker, a takeover of an executing plan that its owner released (worker NULL), or a re-entry by the owner''s own name into its live run, which writes a reenter event and fences out whoever held the previous token (a second process under the same name, or the worker''s own earlier incarnation). Every take bumps plan.run_token. The heartbeat deadline is now() + p_heartbeat (NULL = the plan''s interval, 120 seconds at first). Returns NULL when refused (another owner, not approved, terminal, or heartbeat lapsed — which marks it failed/interrupted): a lost race, not an error. In psql: SELECT pgfence.plan_start(42, ''me'') -> 1, then SELECT * FROM pgfence.plan_run_step(42, ''me'', 1). Errors: 22004/22023 (worker name, heartbeat outside 1 s..1 day), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_claim(
  p_worker        text,
  p_batch         integer DEFAULT 1,
  p_external_only boolean DEFAULT false,
  p_heartbeat     interval DEFAULT NULL
)
RETURNS TABLE (id bigint, next_step integer, step_count integer, next_kind text, heartbeat_interval interval,
               run_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  -- parameters in the UPDATE by id, literals in the walks: docs/query-plans.md#plan
  c_approved  CONSTANT text := 'approved';
  c_executing CONSTANT text := 'executing';
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_heartbeat(p_heartbeat);
  IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000 OR p_external_only IS NULL THEN
    RAISE EXCEPTION 'plan_claim: batch must be between 1 and 1000 and external_only true or false'
      USING ERRCODE = '22023', DETAIL = format('Got batch %s, external_only %s.', coalesce(p_batch::text, 'NULL'), coalesce(p_external_only::text, 'NULL')),
            HINT = 'Claim 1 to 1000 runs at a time; external_only is true only for an executor that runs no SQL actions.';
  END IF;
  PERFORM pgfence._set_actor(p_worker);
  -- Two walks in id order, each stopping after p_batch rows that it locks: approved plans and
  -- runs released by their owner. The oldest p_batch of both are taken by primary key; the
  -- others are unlocked when this transaction ends a moment later. The next step's kind is looked
  -- up by key, row by row. Query plans: docs/query-plans.md#plan.
  RETURN QUERY
  WITH taken AS (
    UPDATE pgfence.plan p
    SET status = 'executing',
        worker = p_worker,
        run_token = p.run_token + 1,
        started_at = coalesce(p.started_at, now()),
        heartbeat_interval = coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds'),
        heartbeat_at = now(),
        heartbeat_expires_at = now() + coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds')
    WHERE p.id = ANY (ARRAY(
            SELECT r.id
            FROM unnest(
              ARRAY(SELECT a.id FROM pgfence.plan a
                    WHERE a.status = 'approved' AND NOT p_external_only
                    ORDER BY a.id
                    LIMIT p_batch
                    FOR UPDATE SKIP LOCKED)
              || ARRAY(SELECT e.id FROM pgfence.plan e
                       -- the heartbeat as a difference: a filter, never an index condition on
                       -- plan_heartbeat_idx, which holds every live run (docs/query-plans.md#plan)
                       WHERE e.status = 'executing' AND e.worker IS NULL
                         AND e.heartbeat_expires_at - now() >= interval '0'
                         AND (NOT p_external_only
                              OR (SELECT s.kind FROM pgfence.plan_step s
                                  WHERE s.plan_id = e.id AND s.step_index = e.next_step) = 'external')
                       ORDER BY e.id
                       LIMIT p_batch
                       FOR UPDATE SKIP LOCKED)) AS r(id)
            ORDER BY r.id
            LIMIT p_batch))
      AND (p.status = c_approved OR (p.status = c_executing AND p.worker IS NULL AND p.heartbeat_expires_at >= now()))
    RETURNING p.id, p.next_step, p.step_count,
              (SELECT s.kind FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.step_index = p.next_step) AS next_kind,
              p.heartbeat_interval, p.run_token
  )
  SELECT t.id, t.next_step, t.step_count, t.next_kind, t.heartbeat_interval, t.run_token FROM taken t ORDER BY t.id;
  PERFORM pgfence._set_actor(NULL);
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_claim(text, integer, boolean, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_claim(text, integer, boolean, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_claim(text, integer, boolean, interval) IS
  'Executors: take up to p_batch approved or released runs, oldest first, each under a new run token.
FOR UPDATE SKIP LOCKED (oldest plan first), so concurrent executors never take the same one: approved plans, and executing plans released by their owner. p_external_only: take only released runs whose next step is external (an executor that performs external effects but runs no SQL actions). Each taken run is owned by p_worker with a heartbeat as in plan_start, under a new run token. Returns (id, next_step, step_count, next_kind, heartbeat_interval, run_token): pass run_token to plan_run_step and the other owner calls. Errors: 22004/22023 (worker, batch outside 1..1000, heartbeat).';

CREATE OR REPLACE FUNCTION pgfence.plan_release(p_id bigint, p_worker text, p_token bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  PERFORM pgfence._set_actor(p_worker);
  v := pgfence._plan_lock(p_id);
  IF v.status <> 'executing' OR v.worker IS DISTINCT FROM p_worker OR v.run_token <> p_token THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN false;
  END IF;
  UPDATE pgfence.plan p
  SET worker = NULL, external_started_at = NULL, step_begun = NULL, step_begun_xact = NULL,
      heartbeat_at = now(), heartbeat_expires_at = now() + p.heartbeat_interval
  WHERE p.id = p_id;
  PERFORM pgfence._set_actor(NULL);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_release(bigint, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_release(bigint, text, bigint) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_release(bigint, text, bigint) IS
  'The owner (p_worker with run token p_token) hands its run over between two steps.
E.g. a SQL runner reaching an external step, or an executor shutting down: the plan stays executing with worker NULL, and another worker must take it (plan_start / plan_claim, which issue the next token) within one heartbeat interval or it fails as interrupted — while a live executor serves plans (pgfence.audit_executors); with none, the run waits for one (executor_register revives it). NOTIFY pgfence_plan {"id","status","next": kind of the next step} at commit. Call it only before starting or after recording a step. Returns false if p_worker does not own a live run under p_token (lost race, fenced out). Errors: 22004 (worker, token), 22023 (worker, a token below 1), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_heartbeat(p_id bigint, p_worker text, p_token bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  v := pgfence._plan_lock(p_id);
  IF v.status <> 'executing' OR v.worker IS DISTINCT FROM p_worker OR v.run_token <> p_token THEN
    RETURN false;
  END IF;
  UPDATE pgfence.plan p
  SET heartbeat_at = now(), heartbeat_expires_at = now() + p.heartbeat_interval
  WHERE p.id = p_id;
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) IS
  'The owner of a run (p_worker, run token p_token) says it is alive; false = stop, the run is lost.
E.g. every third of the heartbeat interval while an external step runs: the deadline moves to now() + the plan''s heartbeat interval. Returns false if p_worker no longer owns a live run under p_token (taken again under a newer token, released, terminal); a lapsed heartbeat is not revived: the plan becomes failed (interrupted) and the worker must stop. Errors: 22004 (worker, token), 22023 (worker, a token below 1), P0002 (unknown plan).';
