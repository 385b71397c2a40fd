-- pgfence functions/21_plan_helpers.sql — plans (module 2): private helpers.
--
-- Argument checks shared by the plan functions (_plan_check_name, _plan_check_heartbeat,
-- _plan_check_token, _plan_require), the step idempotency key (_plan_step_key), the heal of
-- lapsed runs and overdue proposals (_plan_heal, used by the reads and the reaper), the owner's
-- lock (_plan_lock), the validation and rendering of a plan's steps (_plan_normalize_steps,
-- _plan_steps_json), and whether a row's lock is this transaction's (_plan_locked_here, the
-- PF107 check of _plan_step_finish).
-- Not an API: every function here starts with _ and is called by the plan_* functions only
-- (_plan_step_key is also granted to the group roles: plan_run_step and the plan_receipts view
-- call it as the reader). Errors: functions/ERRORS.md.

CREATE OR REPLACE FUNCTION pgfence._plan_check_name(p_value text, p_what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_value IS NULL THEN
    RAISE EXCEPTION 'plan: % is required', p_what
      USING ERRCODE = '22004', DETAIL = 'Every plan transition records who made it (the event log, the audit views).',
            HINT = 'Name who does this: a person, a script or a worker (host:pid).';
  END IF;
  IF p_value = '' OR length(p_value) > 200 THEN
    RAISE EXCEPTION 'plan: % must be a non-empty name of at most 200 characters', p_what
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_value)),
            HINT = 'Use something an operator can trace.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_name(text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_check_name(text, text) IS
  'Private: validates a proposer, approver or worker name.
Raises 22004 (NULL) or 22023 (empty, > 200 characters).';

CREATE OR REPLACE FUNCTION pgfence._plan_check_heartbeat(p_heartbeat interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_heartbeat IS NOT NULL AND (p_heartbeat < interval '1 second' OR p_heartbeat > interval '1 day') THEN
    RAISE EXCEPTION 'plan: heartbeat must be between 1 second and 1 day, got %', p_heartbeat
      USING ERRCODE = '22023', DETAIL = 'A run whose owner stays silent longer than its heartbeat counts as interrupted.',
            HINT = 'Pass NULL for the default (120 seconds), or the longest silence you accept before the run counts as interrupted.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_heartbeat(interval) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_check_heartbeat(interval) IS
  'Private: validates a heartbeat interval (1 second .. 1 day, NULL = default); raises 22023.';

CREATE OR REPLACE FUNCTION pgfence._plan_check_token(p_token bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_token IS NULL THEN
    RAISE EXCEPTION 'plan: the run token is required'
      USING ERRCODE = '22004', DETAIL = 'Owner calls are fenced by the token of the take that made the caller the owner.',
            HINT = 'Pass the token that pgfence.plan_start returned (or the run_token column of pgfence.plan_claim).';
  END IF;
  IF p_token < 1 THEN
    RAISE EXCEPTION 'plan: run tokens start at 1, got %', p_token
      USING ERRCODE = '22023', DETAIL = 'Token 0 marks a run that nobody took under a token (approved, or executing since before migration 0010).',
            HINT = 'Take the run with pgfence.plan_start or plan_claim and pass the token it returns.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_token(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_check_token(bigint) IS
  'Private: checks the run token (the fence token of a plan run) an owner call passes.
Raises 22004 when an owner call passes no run token, 22023 for a token below 1 (never issued).';

CREATE OR REPLACE FUNCTION pgfence._plan_require(p_id bigint)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'plan: plan id is required'
      USING ERRCODE = '22004', DETAIL = 'Every plan call names the plan it acts on.',
            HINT = 'Pass the id that pgfence.plan_propose returned (pgfence plan list shows them).';
  END IF;
  PERFORM 1 FROM pgfence.plan WHERE id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'plan: no plan with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No plan has this id: it was never proposed, or it was purged.',
            HINT = 'Check the id (pgfence plan list).';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_require(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_require(bigint) IS
  'Private: raises 22004 for a NULL plan id and P0002 when no plan has this id.
Used on the lost-race path to tell a stale call from an unknown id.';

CREATE OR REPLACE FUNCTION pgfence._plan_step_key(p_id bigint, p_step integer)
RETURNS text
-- PL/pgSQL: a SQL function with a SET clause is not inlined, and is then planned on every call
-- (once per step of every plan_run_step); this expression takes PL/pgSQL's simple-expression path.
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RETURN 'pgfence-plan-' || p_id || '-step-' || p_step;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_step_key(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_step_key(bigint, integer) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_step_key(bigint, integer) IS
  'Private: the idempotency key of a plan step, pgfence-plan-<plan id>-step-<step index>.
The same for every delivery of that step, whichever worker performs it. Executable by the group roles because plan_run_step (not security definer) and the plan_receipts view call it as the reader.';

-- Heal plans that nobody can finish any more: executing with a lapsed heartbeat -> failed
-- (interrupted), except a run released to executors while no live executor serves plans (it
-- waits for one: functions/50_executor.sql); pending past expires_at -> expired. Rows locked right now are skipped: a live
-- step transaction holds its plan's row, so that plan is not stale.
CREATE OR REPLACE FUNCTION pgfence._plan_heal(p_id bigint, p_max_rows integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_count integer;
BEGIN
  WITH stale AS (
    SELECT p.id FROM pgfence.plan p
    WHERE (p_id IS NULL OR p.id = p_id)
      AND ((p.status = 'executing' AND p.heartbeat_expires_at < now())
           OR (p.status = 'pending' AND p.expires_at <= now()))
    ORDER BY p.id
    LIMIT p_max_rows
    FOR UPDATE SKIP LOCKED
  ), healed AS (
    UPDATE pgfence.plan p
    SET status = CASE WHEN p.status = 'pending' THEN 'expired' ELSE 'failed' END,
        failure = CASE WHEN p.status = 'executing' THEN 'interrupted' END,
        step_begun = NULL, step_begun_xact = NULL,
        finished_at = now()
    FROM stale
    WHERE p.id = stale.id
      AND ((p.status = 'executing' AND p.heartbeat_expires_at < now()
            -- a run released to executors (no owner) waits while no live executor serves
            -- plans (asked only for the lapsed candidates)
            AND (p.worker IS NOT NULL OR pgfence._plan_served()))
           OR (p.status = 'pending' AND p.expires_at <= now()))
    RETURNING p.id
  )
  SELECT count(*) INTO v_count FROM healed;
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_heal(bigint, integer) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_heal(bigint, integer) IS
  'Private: fails lapsed runs (interrupted) and expires overdue proposals; returns how many.
Executing plans whose heartbeat lapsed become failed (interrupted) — a released run (no owner) only while a live executor serves plans (pgfence._plan_served), else it waits —, pending plans past expires_at become expired; one plan (p_id) or up to p_max_rows. Skips rows locked by a live transaction. Returns how many it changed.';

-- Lock one plan for an owner write, healing it first if its heartbeat lapsed.
CREATE OR REPLACE FUNCTION pgfence._plan_lock(p_id bigint)
RETURNS pgfence.plan
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'plan: plan id is required'
      USING ERRCODE = '22004', DETAIL = 'Every plan call names the plan it acts on.',
            HINT = 'Pass the id of the run (plan_start took it by id; plan_claim returns it).';
  END IF;
  SELECT * INTO v FROM pgfence.plan p WHERE p.id = p_id FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'plan: no plan with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No plan has this id: it was never proposed, or it was purged.',
            HINT = 'Check the id (pgfence plan list).';
  END IF;
  IF v.status = 'executing' AND v.heartbeat_expires_at < now()
     AND (v.worker IS NOT NULL OR pgfence._plan_served()) THEN
    UPDATE pgfence.plan p
    SET status = 'failed', failure = 'interrupted', finished_at = now(),
        step_begun = NULL, step_begun_xact = NULL
    WHERE p.id = p_id
    RETURNING * INTO v;
  END IF;
  RETURN v;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_lock(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_lock(bigint) IS
  'Private: locks one plan row for an owner write, failing a lapsed run (interrupted) first.
SELECT ... FOR UPDATE of one plan (22004 for a NULL id, P0002 if unknown); if it is executing with a lapsed heartbeat it becomes failed (interrupted) first, so a stale owner finds it failed (a released run only while a live executor serves plans). Returns the locked row.';

-- Validate and normalise proposed steps: [{"action", "kind", "function", "args", "note"}].
CREATE OR REPLACE FUNCTION pgfence._plan_normalize_steps(p_steps jsonb)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_n   integer;
  v_bad record;
  v_out jsonb;
BEGIN
  IF p_steps IS NULL THEN
    RAISE EXCEPTION 'plan: steps are required'
      USING ERRCODE = '22004', DETAIL = 'A plan is a JSON array of 1 to 10000 steps.',
            HINT = 'Pass a JSON array of {"action": name, "args": {...}} objects.';
  END IF;
  IF jsonb_typeof(p_steps) <> 'array' THEN
    RAISE EXCEPTION 'plan: steps must be a JSON array, got %', jsonb_typeof(p_steps)
      USING ERRCODE = '22023', DETAIL = 'A plan is a JSON array of 1 to 10000 steps.',
            HINT = 'Pass a JSON array of {"action": name, "args": {...}} objects.';
  END IF;
  v_n := jsonb_array_length(p_steps);
  IF v_n NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'plan: a plan has 1 to 10000 steps, got %', v_n
      USING ERRCODE = '22023', DETAIL = 'One approval covers every step of a plan; 10000 steps is the most it covers.',
            HINT = 'Split a longer plan into several plans.';
  END IF;
  SELECT s.i, s.problem INTO v_bad
  FROM (
    SELECT e.i, CASE
      WHEN jsonb_typeof(e.step) <> 'object' THEN 'is not a JSON object'
      WHEN EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(e.step) = 'object' THEN e.step END) k
                   WHERE k NOT IN ('action', 'args', 'note'))
        THEN 'has keys other than action, args, note'
      WHEN jsonb_typeof(e.step -> 'action') IS DISTINCT FROM 'string' THEN 'has no "action" string'
      WHEN e.step ? 'args' AND jsonb_typeof(e.step -> 'args') NOT IN ('object', 'null')
        THEN '"args" is not a JSON object'
      WHEN e.step ? 'note' AND (jsonb_typeof(e.step -> 'note') <> 'string' OR length(e.step ->> 'note') > 2000)
        THEN '"note" is not a string of at most 2000 characters'
      END AS problem
    FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  ) s
  WHERE s.problem IS NOT NULL
  ORDER BY s.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % %', v_bad.i, v_bad.problem
      USING ERRCODE = '22023', DETAIL = format('Step %s of %s; steps are numbered from 1.', v_bad.i, v_n),
            HINT = 'Each step is {"action": "<registered action>", "args": {...}, "note": "optional text"}.';
  END IF;
  SELECT e.i, e.step ->> 'action' AS action INTO v_bad
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  LEFT JOIN pgfence.plan_action a ON a.name = e.step ->> 'action' AND a.retired_at IS NULL
  WHERE a.name IS NULL
  ORDER BY e.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % names action "%", which is not on the allow-list', v_bad.i, v_bad.action
      USING ERRCODE = 'PF101',
            DETAIL = 'A plan can call only actions registered with pgfence.plan_register_action and not retired.',
            HINT = 'See the view pgfence.plan_actions for what is allowed; an administrator registers new actions.';
  END IF;
  SELECT e.i, e.step ->> 'action' AS action, a.function::text AS function INTO v_bad
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  JOIN pgfence.plan_action a ON a.name = e.step ->> 'action' AND a.kind = 'sql'
  WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc pr WHERE pr.oid = a.function)
  ORDER BY e.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % names action "%", whose function no longer exists', v_bad.i, v_bad.action
      USING ERRCODE = '42883',
            DETAIL = format('The action was registered with function %s, which was dropped since.', v_bad.function),
            HINT = 'An administrator re-creates the function and registers the action again (pgfence.plan_register_action), or retires it.';
  END IF;
  SELECT e.i, CASE
      WHEN jsonb_typeof(e.step -> 'args' -> 'recipient') IS DISTINCT FROM 'string'
           OR e.step -> 'args' ->> 'recipient' = '' OR length(e.step -> 'args' ->> 'recipient') > 2048
        THEN 'needs args.recipient, a string of 1-2048 characters'
      WHEN (e.step -> 'args') ? 'payload' AND jsonb_typeof(e.step -> 'args' -> 'payload') <> 'object'
        THEN 'args.payload must be a JSON object'
      WHEN EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(e.step -> 'args') = 'object' THEN e.step -> 'args' END) k
                   WHERE k NOT IN ('recipient', 'payload'))
        THEN 'args may hold only recipient and payload'
      END AS problem, e.step ->> 'action' AS action INTO v_bad
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  JOIN pgfence.plan_action a ON a.name = e.step ->> 'action' AND a.kind = 'external'
  WHERE jsonb_typeof(e.step -> 'args') IS DISTINCT FROM 'object'
     OR jsonb_typeof(e.step -> 'args' -> 'recipient') IS DISTINCT FROM 'string'
     OR e.step -> 'args' ->> 'recipient' = '' OR length(e.step -> 'args' ->> 'recipient') > 2048
     OR ((e.step -> 'args') ? 'payload' AND jsonb_typeof(e.step -> 'args' -> 'payload') <> 'object')
     OR EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(e.step -> 'args') = 'object' THEN e.step -> 'args' END) k
                   WHERE k NOT IN ('recipient', 'payload'))
  ORDER BY e.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % (external action "%") %', v_bad.i, v_bad.action,
      coalesce(v_bad.problem, 'needs args {"recipient": ..., "payload": {...}}')
      USING ERRCODE = '22023', DETAIL = format('Step %s of %s; steps are numbered from 1.', v_bad.i, v_n),
            HINT = 'An external step''s args are {"recipient": "<url or address>", "payload": {...}}; the executor delivers payload to recipient.';
  END IF;
  SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
           'action', a.name,
           'kind', a.kind,
           'function', a.function::text,
           'note', e.step ->> 'note'))
         || jsonb_build_object('args', coalesce(nullif(e.step -> 'args', 'null'::jsonb), '{}'::jsonb))
         ORDER BY e.i)
  INTO v_out
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  JOIN pgfence.plan_action a ON a.name = e.step ->> 'action';
  RETURN v_out;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_normalize_steps(jsonb) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_normalize_steps(jsonb) IS
  'Private: validates proposed steps and returns them normalised, each action''s kind frozen in.
Validates every step up front (22004, 22023, PF101 for an action not on the allow-list, 42883 for a sql action whose function was dropped) and returns them normalised with each action''s kind and function frozen in.';

CREATE OR REPLACE FUNCTION pgfence._plan_steps_json(p_id bigint)
RETURNS jsonb
LANGUAGE sql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
           'action', s.action, 'kind', s.kind, 'function', s.function, 'note', s.note))
         || jsonb_build_object('args', s.args)
         ORDER BY s.step_index)
  FROM pgfence.plan_step s WHERE s.plan_id = p_id;
$$;
REVOKE ALL ON FUNCTION pgfence._plan_steps_json(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_steps_json(bigint) IS
  'Private: a plan''s frozen steps as the JSON array plan_propose normalised them to.
What plan_get returns, and what a repeated idempotency key is compared with.';

-- The approval check's row version (migration 0034): the full transaction id of a function's
-- pg_proc row, for plan_propose to record.
CREATE OR REPLACE FUNCTION pgfence._plan_row_xid(p_xmin xid)
RETURNS xid8
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_snap pg_snapshot := pg_catalog.pg_current_snapshot();  -- the caller's statement's (STABLE)
  v_top  bigint;
  v_xid  bigint;
BEGIN
  IF p_xmin IS NULL THEN
    RETURN NULL;
  END IF;
  -- The latest full xid with these 32 bits below the snapshot's xmax (every row the caller sees
  -- was written below it). A newer row version with the same 32-bit xmin needs a transaction
  -- 2^32 after it; the steps' checks skip the md5 only while their snapshot's xmax is at most
  -- 2^32 after it (functions/24_plan_steps.sql), so they see no such row.
  v_top := pg_catalog.pg_snapshot_xmax(v_snap)::text::bigint - 1;
  v_xid := v_top - ((v_top - p_xmin::text::bigint) & 4294967295);
  -- Recorded only for a transaction that had ended when the caller's snapshot was taken (and not
  -- a permanent xid): one still in progress (another transaction's subtransaction, or the row is
  -- older than 2^32 transactions and this xid is not its writer) could still write a row with
  -- these 32 bits, which the steps would take for this one. Below the snapshot's xmin every
  -- transaction had ended (and its commit status may be truncated away: not asked); above it,
  -- pg_current_snapshot lists no subtransactions, so the status is asked too.
  IF v_xid < 3 THEN
    RETURN NULL;
  END IF;
  IF v_xid >= pg_catalog.pg_snapshot_xmin(v_snap)::text::bigint
     AND (NOT pg_catalog.pg_visible_in_snapshot(v_xid::text::xid8, v_snap)
          OR pg_catalog.pg_xact_status(v_xid::text::xid8) IS DISTINCT FROM 'committed') THEN
    RETURN NULL;
  END IF;
  RETURN v_xid::text::xid8;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_row_xid(xid) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_row_xid(xid) IS
  'Private: the full transaction id of a committed pg_proc row''s xmin p_xmin, for plan_propose.
The latest full xid below the caller''s snapshot''s xmax with those 32 bits, if that transaction had ended before that snapshot (below its xmin, or visible in it and committed); else NULL (the step then always computes the md5). Caller: plan_propose (migration 0034, plan_step.function_xmin).';

-- The approval's cross-check of the recorded function row versions (migration 0034), for
-- plan_approve to set plan.version_checked. The proposal took each step's md5 from the catalog
-- cache (pg_get_functiondef reads the syscache) and the row's xmin from its snapshot. A committing
-- transaction shows in snapshots (ProcArrayEndTransaction) just before it sends its cache
-- invalidations (AtEOXact_Inval): a CREATE OR REPLACE committing in between pairs the old
-- definition's md5 with the new row's xmin, and a step skipping the md5 on that row would run
-- the new definition. The approval comes later, in another transaction: its snapshot shows the
-- new row and its cache the new definition (sent microseconds after that commit), so the pair
-- no longer matches. Only when every recorded pair matches now do the steps skip the md5.
CREATE OR REPLACE FUNCTION pgfence._plan_version_check(p_id bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_snap pg_snapshot;
BEGIN
  -- Under READ COMMITTED only, as the steps' skip (the statement's snapshot, not an older one).
  IF pg_catalog.current_setting('transaction_isolation') <> 'read committed' THEN
    RETURN false;
  END IF;
  -- Not in the proposing transaction (nor a subtransaction of it): its cache and snapshot are
  -- those of the proposal. The proposal wrote the steps' rows; never updated while pending.
  IF pgfence._plan_locked_here((SELECT s.xmin FROM pgfence.plan_step s WHERE s.plan_id = p_id AND s.step_index = 1)) THEN
    RETURN false;
  END IF;
  v_snap := pg_catalog.pg_current_snapshot();
  -- Every recorded row version (each distinct one once): still the function's row, within the
  -- steps' 2^32 window, and its definition (from the cache, now) hashes to the recorded md5.
  RETURN NOT EXISTS (
    SELECT FROM (SELECT DISTINCT s.function_oid, s.function_xmin, s.function_md5
                 FROM pgfence.plan_step s
                 WHERE s.plan_id = p_id AND s.function_xmin IS NOT NULL) r
    LEFT JOIN pg_catalog.pg_proc pr ON pr.oid = r.function_oid
    WHERE CASE WHEN pr.xmin = pg_catalog.xid(r.function_xmin)
                    AND pg_catalog.pg_snapshot_xmax(v_snap)::text::bigint - r.function_xmin::text::bigint <= 4294967296
               THEN pg_catalog.md5(pg_catalog.pg_get_functiondef(pr.oid)) IS DISTINCT FROM r.function_md5
               ELSE true END);
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_version_check(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_version_check(bigint) IS
  'Private: may plan p_id''s steps skip the md5 of the approval check (plan.version_checked)?
True only under READ COMMITTED, outside the proposing transaction (and its subtransactions), when for every sql step with a recorded function row version (function_oid, function_xmin) the function''s current pg_proc row (this snapshot) is that version, at most 2^32 xids before the snapshot''s xmax, and md5(pg_get_functiondef) now (from the catalog cache) equals the recorded function_md5. Never raises. Caller: plan_approve (migration 0034).';

-- Handshake step 4's PF107 check: is a row's lock (its xmax) held by this transaction?
CREATE OR REPLACE FUNCTION pgfence._plan_locked_here(p_locker xid)
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_cur  bigint;
  v_lock bigint;
BEGIN
  IF p_locker IS NULL OR p_locker = '0'::xid THEN
    RETURN false;
  END IF;
  IF p_locker = pg_catalog.pg_current_xact_id()::xid THEN
    RETURN true;  -- the common case: plan_run_step in the top-level transaction
  END IF;
  -- A subtransaction's xid: widen the 32-bit xid to the epoch nearest this transaction's (a
  -- subtransaction of ours started after it), and ask whether it is still in progress.
  v_cur := pg_catalog.pg_current_xact_id()::text::bigint;
  v_lock := (v_cur & ~4294967295::bigint) | p_locker::text::bigint;
  IF v_lock > v_cur + 2147483648 THEN
    v_lock := v_lock - 4294967296;
  ELSIF v_lock < v_cur - 2147483648 THEN
    v_lock := v_lock + 4294967296;
  END IF;
  IF v_lock < v_cur THEN
    RETURN false;  -- older than this transaction: an earlier one
  END IF;
  BEGIN
    RETURN pg_catalog.pg_xact_status(v_lock::text::xid8) = 'in progress';
  EXCEPTION WHEN invalid_parameter_value THEN
    RETURN false;  -- "in the future": not an xid of this transaction (a multixact)
  END;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_locked_here(xid) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_locked_here(xid) IS
  'Private: whether p_locker (a row''s xmax) is this transaction or a subtransaction of it.
For _plan_step_finish''s PF107 check, on a row whose lockers all held the plan row''s lock (which the caller holds now): then a locker in progress is this transaction. false for NULL or 0.';
