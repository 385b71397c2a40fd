-- pgfence functions/24_plan_steps.sql — plans (module 2): running steps and writing receipts.
--
-- Public: plan_run_step (run the next step of an owned run: a SQL action, or hand out an
-- external one), plan_record_step (executors: the receipt of an external step), plan_execute
-- (CALL: every SQL step of a plan, one transaction each). Private, behind plan_run_step:
-- _plan_step_begin and _plan_step_finish (security definer), _plan_check_approved,
-- _plan_commit_step (and _plan_locked_here, functions/21). No retries: a failed step is a receipt, a new attempt
-- is a new proposal, and an undo is a compensating plan (plan_compensate). External steps are
-- performed by the executor (outbox transports, idempotency key pgfence-plan-<id>-step-<n>)
-- and reported with plan_record_step. The handshake below is the protocol of a SQL step.
-- Query plans: docs/query-plans.md#plan.

-- =============================================================================================
-- The SQL-step receipt handshake: one SQL step is one transaction of the caller, in which
-- plan_run_step(id, worker, token) — NOT security definer: the action runs with the caller's
-- privileges — does, in this order:
--
--   1. _plan_step_begin(id, worker, token)   security definer. One SELECT ... FOR NO KEY UPDATE
--        of the plan row and of its next step's row, only if it is executing by `worker` under
--        run `token` (the fence token of plan_start / plan_claim, migration 0010) with a live
--        heartbeat; otherwise refused (only the status comes back; _plan_lock fails a lapsed run
--        as interrupted). Both rows stay locked until the transaction ends, and the lock on the
--        step's row is the begin stamp (no write: nothing else locks a plan_step row). It
--        returns the step, its function, and what step 2 checks.
--   2. _plan_check_approved(...)              in a subtransaction: the action is not retired
--        (PF101), its function exists (42883), its definition's md5 is the one recorded at
--        proposal (PF108). The md5 is computed only when the function's pg_proc row is not
--        the version (oid, xmin) recorded at proposal or the plan is not version_checked
--        (migration 0034: plan_approve's cross-check).
--   3. the action: EXECUTE f(args)            same subtransaction. An error from 2 or 3 rolls
--        back only the subtransaction (the action's effects) and becomes the error receipt.
--   4. _plan_step_finish(id, worker, token, step, ok, output, error)   security definer.
--        Refused (NULL) unless the plan is still executing by worker under token; PF107 unless
--        this transaction began this step (the step's row, without a receipt, is locked by this
--        transaction or a subtransaction of it: _plan_locked_here); refused unless it is
--        the next step and a SQL one; for an ok receipt check 2 again. Then _plan_commit_step
--        writes the receipt and moves the plan on: next step, executed, or failed (step_error).
--        The common case is one statement: _plan_commit_step checks all of that in its WHERE
--        (PF107 as "the step row's xmax is this transaction's xid"); only when it matches
--        nothing does the finish read the rows to say which (the slow path, also for a step
--        begun inside a savepoint).
--   Under every other writer: tg_plan_step_guard (a receipt only for the next step of an
--   executing plan, by its owner, written once) and tg_plan_guard (next_step moves only over an
--   ok receipt; step_error needs the error receipt; the run token never goes back).
--   _plan_commit_step's one statement holds the same rules in its WHERE and SET and is the one
--   writer those triggers skip (its rows' fresh receipt_nonce, see there).
--
-- What each check prevents:
--   * owner, token, heartbeat (1 and 4): an owner fenced out by a newer take (even under its own
--     name) or a silent one (heartbeat lapsed) runs nothing and writes no receipt.
--   * the row lock (1): a heartbeat, release, takeover or heal of the run waits for the step.
--   * approved is what runs (2, and 4 for ok): a retired action or a dropped or replaced function
--     never runs and never gets an ok receipt, even if it changed between 1 and 4.
--   * begun in this transaction (4, PF107): no receipt outside the transaction that began the
--     step, and none for another step than the one begun.
--   * the guards: hand-written SQL (psql, the owner role) cannot skip a step or forge a receipt.
--     They run for every statement but _plan_commit_step's own. A bypass by a session setting
--     alone was tried and dropped, since a client could set it before calling any definer
--     function that writes these tables; the skip now also needs the row's receipt_nonce to
--     change to the setting's fresh value, which only _plan_commit_step writes.
-- Who may call what: plan_run_step, _plan_step_begin and _plan_step_finish are granted to
-- pgfence_executor and pgfence_admin; the tables to nobody. External steps' receipts are written
-- by plan_record_step (PF105 for a SQL step); plan_execute calls plan_run_step in a loop.
-- Remaining trust: a role granted both helpers can call 1 and 4 in one transaction without
-- running the action between them, and write an ok receipt of its choosing for an unchanged,
-- unretired action: grant pgfence_executor only to executor logins trusted to run what plans say.
-- Actions run with search_path = pg_catalog, pgfence, pg_temp: write them with qualified names or
-- give them their own SET search_path.
-- =============================================================================================

-- Checks 2 and 4 (ok): what was approved is what runs.
CREATE OR REPLACE FUNCTION pgfence._plan_check_approved(
  p_action       text,
  p_retired      boolean,
  p_function     text,
  p_md5_approved text,
  p_md5_now      text
)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_retired THEN
    RAISE EXCEPTION 'action "%" was retired after the plan was approved', p_action
      USING ERRCODE = 'PF101', DETAIL = 'A retired action is off the allow-list: an approved step of it records this error instead of running.',
            HINT = 'Propose a new plan with an action on the allow-list.';
  END IF;
  IF p_md5_now IS NULL THEN
    RAISE EXCEPTION 'the function of action "%" no longer exists', p_action
      USING ERRCODE = '42883', DETAIL = 'The function the action was registered with was dropped after the plan was proposed; nothing of this step is committed.',
            HINT = 'An administrator re-registers the action once its function is back.';
  END IF;
  IF p_md5_now IS DISTINCT FROM p_md5_approved THEN
    RAISE EXCEPTION 'the function of action "%" changed since the plan was proposed', p_action
      USING ERRCODE = 'PF108',
            DETAIL = format('%s: definition md5 %s at proposal, %s now.', p_function, p_md5_approved, p_md5_now),
            HINT = 'Nothing of this step is committed. Propose the plan again, so that an approver approves the new definition, or restore the approved definition before running other plans that use it.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_approved(text, boolean, text, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_check_approved(text, boolean, text, text, text) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_check_approved(text, boolean, text, text, text) IS
  'Private: refuses to run or receipt a step whose action was retired, dropped or replaced.
Raises PF101 (p_retired), 42883 (p_md5_now NULL: the function was dropped) or PF108 (the md5 of the function''s definition differs from the one recorded at proposal; p_function names it in the DETAIL). Called by plan_run_step before the action runs (the error becomes the step''s receipt) and by _plan_step_finish before an ok receipt. Executable by the roles that run steps, since plan_run_step runs with the caller''s privileges.';

-- Write a step's receipt and move the plan on. One statement writes the receipt, moves the plan
-- on (a receipt logs no event: it is the step's row, migration 0034), and checks in its WHERE
-- what it relies on: the plan p_id is
-- executing by p_worker under run token p_token at step p_step, and the step has no receipt yet.
-- With p_begun_here (the fast path of _plan_step_finish, which then needs no statement of its
-- own) also: the step is a SQL one, this transaction's top level holds the lock on its row that
-- _plan_step_begin took (its xmax is this transaction's xid: nothing else could put it there,
-- so that is the PF107 proof without the plan row's lock), and for an ok receipt its action is
-- not retired and its function's pg_proc row is the version recorded at proposal, or else its
-- definition has the md5 recorded at proposal. A statement that
-- matches nothing writes nothing: then NULL with p_begun_here (the caller finds out why), PF001
-- without (the callers, plan_record_step and _plan_step_finish's slow path, checked all of it
-- under the plan row's lock already).
-- The statement does what the row triggers tg_plan_step_guard and tg_plan_guard would (the
-- checks in its WHERE and SET, the receipt's login db_user = session_user) and what the row checks they hold (migration 0030) demand, so both rows are marked with
-- receipt_nonce, a fresh value (run token and step) that is also the transaction-local setting
-- pgfence.plan_writing for this statement only, and those triggers skip exactly these rows
-- (20_plan_guards.sql explains why no other writer can get that). What the statement guarantees:
--   * the receipt is written once (outcome IS NULL in its WHERE), for the plan's next step, by
--     the run's owner; the frozen step columns are not in its SET; outcome ok carries the output
--     only, error the error only (an object with a message: the callers pass one), worker,
--     login (db_user) and times are set (started_at is the transaction's or the external step's start, finished_at
--     the clock: plan_step_times stays declared);
--   * the plan moves only over this receipt (the plan's UPDATE joins the receipt's RETURNING):
--     one step on over an ok receipt, failed (step_error) at an error receipt, executed after the
--     last ok step (next_step = step_count + 1), finished_at then and only then; the frozen plan
--     columns, approval, start and run token are not in its SET; the heartbeat is stamped;
--     external_started_at and the begin stamp are cleared; updated_at is stamped as tg_plan_guard
--     does;
--   * plan_event_update (finish, fail) is not skipped: it is an AFTER trigger on a status change
--     and runs as before, under actor p_worker (set for the statement, cleared after).
CREATE OR REPLACE FUNCTION pgfence._plan_commit_step(
  p_id         bigint,
  p_step       integer,
  p_worker     text,
  p_token      bigint,
  p_ok         boolean,
  p_output     jsonb,
  p_error      jsonb,
  p_begun_here boolean
)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_status text;
  -- The nonce is the run token and the step as a uuid (<token hex 16><step hex 16>): never the
  -- value either row has. A step row gets one receipt; the plan row was last marked by the commit
  -- of an earlier step or of another run (a lower step or a lower token), and the random uuids
  -- written before carry a version nibble. It must be fresh, not secret (no other writer changes
  -- receipt_nonce, 20_plan_guards.sql), and is cheaper than gen_random_uuid() (its strong random
  -- bytes were about 3% of a step's CPU).
  v_nonce  uuid := (pg_catalog.lpad(pg_catalog.to_hex(coalesce(p_token, 0)), 16, '0')
                    || pg_catalog.lpad(pg_catalog.to_hex(coalesce(p_step, 0)), 16, '0'))::uuid;
  c_executing CONSTANT text := 'executing';  -- a parameter, not a literal: docs/query-plans.md#plan
BEGIN
  -- The heartbeat is stamped with clock_timestamp(): a long step's transaction started (now())
  -- long ago, and the next deadline must count from the moment the step ended. The deadline
  -- (heartbeat_expires_at, indexed by plan_heartbeat_idx for the reaper) is kept as it is while
  -- it lies within a beat's slack (a tenth of the interval, at most 1 s) below the fresh one:
  -- an update that changes no indexed column is HOT (no new index entries), so a run of quick
  -- steps rewrites the indexes about once a second instead of once per step. The deadline is
  -- then never later than a fresh one, and at most the slack earlier: a run is never kept alive
  -- longer than its interval, only possibly declared lapsed up to the slack sooner.
  -- (One PERFORM per call: a PERFORM of one expression is evaluated without a query.)
  PERFORM pg_catalog.set_config('pgfence.plan_writing', v_nonce::text, true);
  PERFORM pg_catalog.set_config('pgfence.actor', p_worker, true);
  WITH receipt AS (
    UPDATE pgfence.plan_step s
    SET outcome = CASE WHEN p_ok THEN 'ok' ELSE 'error' END,
        output = CASE WHEN p_ok THEN p_output END,
        error = CASE WHEN NOT p_ok THEN p_error END,
        worker = p.worker,
        started_at = CASE WHEN s.kind = 'external' THEN coalesce(p.external_started_at, pg_catalog.now())
                          ELSE pg_catalog.now() END,
        finished_at = pg_catalog.clock_timestamp(),
        db_user = pg_catalog.session_user(),
        receipt_nonce = v_nonce
    FROM pgfence.plan p
    WHERE s.plan_id = p_id AND s.step_index = p_step AND s.outcome IS NULL
      AND p.id = p_id AND p.status = c_executing AND p.worker = p_worker AND p.run_token = p_token
      AND p.next_step = p_step
      AND (p_begun_here IS NOT TRUE
           OR (s.kind = 'sql' AND s.xmax = pg_catalog.pg_current_xact_id()::xid
               AND (NOT p_ok OR EXISTS (
                     -- approved is what runs: the function's pg_proc row is the version recorded
                     -- at proposal in a version_checked plan (no md5 needed; READ COMMITTED only, this statement's snapshot
                     -- being younger than the action: see _plan_step_begin), or its definition
                     -- hashes as then
                     SELECT FROM pgfence.plan_action a
                     JOIN pg_catalog.pg_proc pr ON pr.oid = a.function
                     WHERE a.name = s.action AND a.retired_at IS NULL
                       AND ((p.version_checked AND pr.oid = s.function_oid AND pr.xmin = pg_catalog.xid(s.function_xmin)
                             AND pg_catalog.current_setting('transaction_isolation') = 'read committed'
                             AND pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::text::bigint - s.function_xmin::text::bigint <= 4294967296)
                            OR pg_catalog.md5(pg_catalog.pg_get_functiondef(pr.oid)) = s.function_md5)))))
    RETURNING s.step_index, s.worker, pg_catalog.clock_timestamp() + p.heartbeat_interval AS fresh
  ), moved AS (
    UPDATE pgfence.plan p
    SET status = CASE WHEN NOT p_ok THEN 'failed'
                      WHEN p.next_step = p.step_count THEN 'executed'
                      ELSE 'executing' END,
        failure = CASE WHEN NOT p_ok THEN 'step_error' END,
        next_step = CASE WHEN p_ok THEN p.next_step + 1 ELSE p.next_step END,
        external_started_at = NULL,
        step_begun = NULL, step_begun_xact = NULL,
        heartbeat_at = pg_catalog.clock_timestamp(),
        heartbeat_expires_at = CASE
          WHEN p.heartbeat_expires_at <= r.fresh
               AND p.heartbeat_expires_at >= r.fresh - least(p.heartbeat_interval / 10, interval '1 second')
          THEN p.heartbeat_expires_at ELSE r.fresh END,
        finished_at = CASE WHEN NOT p_ok OR p.next_step = p.step_count THEN pg_catalog.clock_timestamp() END,
        updated_at = pg_catalog.now(),
        receipt_nonce = v_nonce
    FROM receipt r
    -- p.status is not restated: the receipt's statement read this row (executing, p_worker's)
    -- and it is locked by this transaction (the callers' lock).
    WHERE p.id = p_id AND r.step_index = p.next_step AND r.worker IS NOT DISTINCT FROM p.worker
    RETURNING p.status
  )
  SELECT m.status INTO v_status FROM moved m;
  PERFORM pg_catalog.set_config('pgfence.plan_writing', '', true);
  PERFORM pg_catalog.set_config('pgfence.actor', '', true);
  IF v_status IS NULL AND p_begun_here IS NOT TRUE THEN
    -- Not reached through the callers (they lock and check the run first): refuse rather than
    -- write half of it. The raise rolls the statement back.
    RAISE EXCEPTION '_plan_commit_step: step % of plan % cannot take a receipt now', p_step, p_id
      USING ERRCODE = 'PF001', DETAIL = 'A receipt is written once, for the next step of an executing plan, by its owner.',
            HINT = 'Receipts are written only by plan_run_step / plan_record_step.';
  END IF;
  RETURN v_status;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_commit_step(bigint, integer, text, bigint, boolean, jsonb, jsonb, boolean) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_commit_step(bigint, integer, text, bigint, boolean, jsonb, jsonb, boolean) IS
  'Private: writes the receipt of step p_step of plan p_id and moves the plan on, in one statement.
Only if the plan is executing by p_worker under run token p_token at step p_step and the step has no receipt; with p_begun_here also only for a SQL step whose row this transaction''s top level locked (_plan_step_begin: the PF107 proof) and, for an ok receipt, whose action is unretired with its function''s definition unchanged (its pg_proc row the version recorded at proposal in a version_checked plan, else the md5). The receipt is ok with output, or error, with the worker and the login (db_user); the plan goes to its next step with a renewed heartbeat (kept within a slack of a tenth of the interval, at most 1 s, below a fresh one, so that the update stays HOT), to executed after the last ok step, or to failed (step_error) after an error (no receipt event: the receipt is the row). The statement does what tg_plan_step_guard and tg_plan_guard would and what the row checks they hold demand, and marks both rows with a fresh receipt_nonce equal to the setting pgfence.plan_writing for that statement only, so those triggers skip exactly these rows. Returns the plan''s new status; when nothing matched nothing is written: NULL with p_begun_here, PF001 without (the caller checked it all under the row lock).';

CREATE OR REPLACE FUNCTION pgfence._plan_step_begin(
  p_id     bigint,
  p_worker text,
  p_token  bigint,
  OUT step_index integer,
  OUT action     text,
  OUT kind       text,
  OUT fn_schema  text,
  OUT fn_name    text,
  OUT retired    boolean,
  OUT fn_md5     text,
  OUT fn_md5_now text,
  OUT args       jsonb,
  OUT status     text
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  v      pgfence.plan;
  c_executing CONSTANT text := 'executing';  -- a parameter, not a literal: docs/query-plans.md#plan
BEGIN
  -- The argument checks as expressions; their helpers run only to raise the precise error.
  IF p_worker IS NULL OR p_worker = '' OR length(p_worker) > 200 OR p_token IS NULL OR p_token < 1 THEN
    PERFORM pgfence._plan_check_name(p_worker, 'worker');
    PERFORM pgfence._plan_check_token(p_token);
  END IF;
  -- Handshake step 1, in one statement: lock the run and its next step if p_worker owns it under
  -- p_token with a live heartbeat, with what step 2 checks. Both rows stay locked until the
  -- transaction ends; the lock on the step's row is the begin stamp that _plan_step_finish checks
  -- (PF107): nothing else locks a plan_step row, and a row lock costs no new row version.
  -- Straight into the OUT parameters: one statement (each PL/pgSQL statement costs its set-up
  -- again in every transaction, and a step is one).
  -- The md5 of the definition is computed only when the function's pg_proc row is not the
  -- version recorded at proposal (its oid and xmin: any CREATE OR REPLACE or ALTER writes a new
  -- version with a new xmin, and freezing keeps xmin); while it is, its definition is the one
  -- hashed then (migration 0034). Only under READ COMMITTED: the row is read with the statement's
  -- snapshot, while the action runs the definition the catalog caches have now; a REPEATABLE
  -- READ / SERIALIZABLE snapshot can be older than a replacement the action then runs
  -- (tests/test_plan.py), so there the md5 is always computed, as before 0034. And only while
  -- the snapshot's xmax is at most 2^32 after the recorded row's full xid: xmin is 32 bits, and
  -- a replacement 2^32 transactions later gets the recorded one again (every row the snapshot
  -- sees is below its xmax; tests/test_plan_xid_wrap.py). And only when the plan is
  -- version_checked: plan_approve, in a later transaction, found the recorded row current with the
  -- recorded md5 (the proposal took the md5 from the catalog cache and the xmin from its
  -- snapshot, which a replacement committing at that moment can make disagree).
  SELECT p.status, p.next_step, s.action, s.kind, s.args, s.function_md5,
         a.retired_at IS NOT NULL, n.nspname, pr.proname,
         CASE WHEN s.kind = 'sql' THEN
           CASE WHEN p.version_checked AND pr.oid = s.function_oid AND pr.xmin = pg_catalog.xid(s.function_xmin)
                     AND pg_catalog.current_setting('transaction_isolation') = 'read committed'
                     AND pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::text::bigint - s.function_xmin::text::bigint <= 4294967296
                THEN s.function_md5
                ELSE md5(pg_catalog.pg_get_functiondef(pr.oid)) END END
    INTO status, step_index, action, kind, args, fn_md5, retired, fn_schema, fn_name, fn_md5_now
  FROM pgfence.plan p
  JOIN pgfence.plan_step s ON s.plan_id = p.id AND s.step_index = p.next_step
  LEFT JOIN pgfence.plan_action a ON a.name = s.action
  LEFT JOIN pg_catalog.pg_proc pr ON pr.oid = a.function
  LEFT JOIN pg_catalog.pg_namespace n ON n.oid = pr.pronamespace
  WHERE p.id = p_id AND p.status = c_executing AND p.worker = p_worker AND p.run_token = p_token
    AND p.heartbeat_expires_at >= now()
  FOR NO KEY UPDATE OF p, s;
  IF NOT FOUND THEN
    -- Refused (step_index NULL): not executing, not by this worker under this token, or its
    -- heartbeat lapsed. _plan_lock raises 22004 / P0002 and marks a lapsed run failed
    -- (interrupted).
    PERFORM pgfence._set_actor(p_worker);
    v := pgfence._plan_lock(p_id);
    status := v.status;
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;
  IF kind = 'external' THEN
    -- An external step: in flight since (external_started_at), with a fresh heartbeat. What
    -- step 2 checks is for SQL steps only (NULL here).
    retired := NULL;
    UPDATE pgfence.plan p
    SET external_started_at = coalesce(p.external_started_at, now()),
        heartbeat_at = now(),
        heartbeat_expires_at = now() + p.heartbeat_interval
    WHERE p.id = p_id;
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_step_begin(bigint, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_step_begin(bigint, text, bigint) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_step_begin(bigint, text, bigint) IS
  'Handshake step 1, for plan_run_step: lock a run p_worker owns under p_token, hand out its step.
Security definer, so that plan_run_step itself need not be: locks the plan row and the step''s row for the rest of the transaction, heals a lapsed heartbeat, and returns the next step (action, kind, the function to call, whether the action was retired, the md5 of the function''s definition at proposal and now — computed only when the function''s pg_proc row is not the version recorded at proposal, the plan is not version_checked (plan_approve) or the transaction is not READ COMMITTED —, args) if p_worker owns the executing run under run token p_token; otherwise only the status (refused). For an external step it stamps external_started_at; for a SQL step it writes nothing: the lock it holds on the step''s row (plan_step) is what _plan_step_finish checks, so that step is the only one it will then receipt, in this transaction. Not for direct use. Trust: granted to pgfence_executor because plan_run_step runs with the caller''s privileges; see the handshake in functions/24_plan_steps.sql for what that role is trusted with.';

CREATE OR REPLACE FUNCTION pgfence._plan_step_finish(
  p_id     bigint,
  p_worker text,
  p_token  bigint,
  p_step   integer,
  p_ok     boolean,
  p_output jsonb,
  p_error  jsonb
)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v      pgfence.plan;
  v_step record;
  v_out  text;
BEGIN
  IF p_ok IS NULL OR p_step IS NULL OR (NOT p_ok AND p_error IS NULL) THEN
    RAISE EXCEPTION '_plan_step_finish: step, ok and (for an error) error are required'
      USING ERRCODE = '22004', DETAIL = 'A receipt names the step _plan_step_begin handed out, its outcome, and for an error what happened.',
            HINT = 'Run SQL steps with pgfence.plan_run_step or CALL pgfence.plan_execute; this helper is not for direct use.';
  END IF;
  IF NOT p_ok AND (pg_catalog.jsonb_typeof(p_error) IS DISTINCT FROM 'object' OR NOT p_error ? 'message') THEN
    -- The receipt's row check plan_step_error_iff, which the step's commit skips with the guard
    -- trigger that holds it (functions/20_plan_guards.sql): plan_run_step always passes a message.
    PERFORM pgfence._check_violated('plan_step', 'plan_step_error_iff',
      format('An error receipt is an object with a message; got %s.', p_error),
      'Run SQL steps with pgfence.plan_run_step or CALL pgfence.plan_execute; this helper is not for direct use.');
  END IF;
  -- Handshake step 4, the fast path: one statement that checks the owner, the token, the step,
  -- that this transaction's top level began it (PF107) and for an ok receipt the approval, and
  -- writes the receipt (_plan_commit_step with p_begun_here). It matches nothing when any of
  -- that fails, or when the step was begun in a subtransaction (savepoints, pgTAP): then the
  -- slow path below finds out which, in the order a caller sees (refused, PF107, approval).
  v_out := pgfence._plan_commit_step(p_id, p_step, p_worker, p_token, p_ok, p_output, p_error, true);
  IF v_out IS NOT NULL THEN
    RETURN v_out;
  END IF;
  -- The slow path. Same transaction as step 1: the row lock is ours already, nobody healed it
  -- since; the owner check binds the receipt to the worker and token passed here.
  -- One statement: the plan row (locked), the step p_step and its action.
  -- The md5 as in step 1: only when the function's pg_proc row is not the version recorded at
  -- proposal, the plan is not version_checked, or the transaction is not READ COMMITTED.
  SELECT p AS plan, s.kind, s.action, s.function_md5, s.outcome, s.xmax AS locker, a.retired_at,
         a.function::text AS function,
         CASE WHEN p_ok AND s.kind = 'sql' THEN
           CASE WHEN p.version_checked AND pr.oid = s.function_oid AND pr.xmin = pg_catalog.xid(s.function_xmin)
                     AND pg_catalog.current_setting('transaction_isolation') = 'read committed'
                     AND pg_catalog.pg_snapshot_xmax(pg_catalog.pg_current_snapshot())::text::bigint - s.function_xmin::text::bigint <= 4294967296
                THEN s.function_md5
                ELSE md5(pg_catalog.pg_get_functiondef(a.function)) END END AS md5_now
    INTO v_step
  FROM pgfence.plan p
  LEFT JOIN pgfence.plan_step s ON s.plan_id = p.id AND s.step_index = p_step
  LEFT JOIN pgfence.plan_action a ON a.name = s.action
  LEFT JOIN pg_catalog.pg_proc pr ON pr.oid = a.function
  WHERE p.id = p_id
  FOR NO KEY UPDATE OF p;
  v := v_step.plan;
  IF v.status IS DISTINCT FROM 'executing' OR v.worker IS DISTINCT FROM p_worker
     OR v.run_token IS DISTINCT FROM p_token THEN
    RETURN NULL;
  END IF;
  -- PF107: _plan_step_begin locked this step's row in this transaction. The row's xmax names the
  -- (sub)transaction that last locked it; we hold the plan row's lock, which every taker of a
  -- step row lock (_plan_step_begin) held with it, so a locker still in progress is this
  -- transaction or one of its subtransactions (pgTAP and savepoints call plan_run_step inside
  -- one); a committed or aborted one is an earlier transaction, and 0 means never begun. A
  -- receipted step keeps the lock of the transaction that receipted it: it is not begun either
  -- (_plan_step_begin hands out only the next step, which has no receipt).
  IF v_step.outcome IS NOT NULL OR v_step.locker IS NULL
     OR NOT (v_step.locker = pg_catalog.pg_current_xact_id()::xid OR pgfence._plan_locked_here(v_step.locker)) THEN
    RAISE EXCEPTION '_plan_step_finish: plan % step % was not begun in this transaction', p_id, p_step
      USING ERRCODE = 'PF107',
            DETAIL = format('The row of step %s was last locked by transaction %s; this is transaction %s.',
                            p_step, coalesce(v_step.locker::text, 'none (no such step)'), pg_catalog.pg_current_xact_id()),
            HINT = 'Run SQL steps with pgfence.plan_run_step or CALL pgfence.plan_execute: a receipt is written only in the transaction that ran the step.';
  END IF;
  IF v.next_step <> p_step OR v_step.kind IS DISTINCT FROM 'sql' THEN
    RETURN NULL;
  END IF;
  -- An ok receipt only for a step that plan_run_step would have run: check 2 again (it also
  -- closes the window between steps 1 and 4, when a function is replaced meanwhile).
  IF p_ok THEN
    PERFORM pgfence._plan_check_approved(v_step.action, v_step.retired_at IS NOT NULL, v_step.function,
                                         v_step.function_md5, v_step.md5_now);
  END IF;
  RETURN pgfence._plan_commit_step(p_id, p_step, p_worker, p_token, p_ok, p_output, p_error, false);
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) IS
  'Handshake step 4, for plan_run_step: write the receipt of the SQL step begun in this transaction.
Security definer: writes the receipt of SQL step p_step in the step''s own transaction and moves the plan on (next step, executed, or failed on an error). Only for the step that _plan_step_begin handed out in this same transaction (PF107 otherwise: no receipt for a step that was not run here). An ok receipt is refused for a step whose action was retired (PF101), whose function was dropped (42883) or whose function''s definition differs from the one fingerprinted at proposal (PF108): the whole transaction, with the step''s effects, rolls back. Returns the plan''s new status, or NULL if p_worker does not own the executing run under run token p_token or the step is not its next SQL step. Not for direct use. Trust level: the action runs inside plan_run_step with the caller''s privileges (it is not security definer, by design), so a role granted both helpers (pgfence_executor, pgfence_admin) can still, in one transaction, call _plan_step_begin and then this function without running the action in between, and write an ok receipt with an output of its choosing for an unchanged, unretired action. Grant pgfence_executor only to executor logins that you trust to run what plans say; what these checks guarantee is that no receipt is written outside the transaction that began the step, for another step, or for a changed action.';

CREATE OR REPLACE FUNCTION pgfence.plan_run_step(
  p_id            bigint,
  p_worker        text,
  p_token         bigint,
  p_external_only boolean DEFAULT false,
  OUT step_index      integer,
  OUT action          text,
  OUT outcome         text,
  OUT status          text,
  OUT output          jsonb,
  OUT error           jsonb,
  OUT args            jsonb,
  OUT idempotency_key text
)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
  v       record;
  v_state text;
  v_msg   text;
  v_det   text;
  v_hint  text;
  v_ctx   text;
BEGIN
  v := pgfence._plan_step_begin(p_id, p_worker, p_token);  -- handshake step 1
  status := v.status;
  IF v.step_index IS NULL THEN
    RETURN;  -- refused: not executing, or not by this worker under this token (lost race / stale worker)
  END IF;
  step_index := v.step_index;
  action := v.action;
  -- _plan_step_key's text, inline: a call of a function with a SET clause costs a GUC save and
  -- restore (and a search_path recompute) per step.
  idempotency_key := 'pgfence-plan-' || p_id || '-step-' || v.step_index;
  IF v.kind = 'external' THEN
    outcome := 'external';  -- the executor performs it and calls plan_record_step
    args := v.args;
    RETURN;
  END IF;
  IF p_external_only THEN
    -- A runner that performs only external effects hands a SQL step to a SQL runner.
    PERFORM pgfence.plan_release(p_id, p_worker, p_token);
    outcome := 'released';
    RETURN;
  END IF;
  -- Handshake steps 2 and 3, in a subtransaction, with the privileges of the role calling this
  -- function (it is not security definer): if the check or the action raises, only the action's
  -- effects are rolled back, and the error receipt below commits with the step.
  BEGIN
    IF v.retired OR v.fn_md5_now IS NULL OR v.fn_md5_now IS DISTINCT FROM v.fn_md5 THEN  -- only to raise
      PERFORM pgfence._plan_check_approved(v.action, v.retired, quote_ident(v.fn_schema) || '.' || quote_ident(v.fn_name),
                                           v.fn_md5, v.fn_md5_now);
    END IF;
    EXECUTE format('SELECT %I.%I($1)', v.fn_schema, v.fn_name) INTO output USING v.args;
    outcome := 'ok';
  EXCEPTION WHEN OTHERS OR query_canceled OR assert_failure THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT,
                            v_det = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT,
                            v_ctx = PG_EXCEPTION_CONTEXT;
    outcome := 'error';
    output := NULL;
    error := jsonb_strip_nulls(jsonb_build_object(
      'sqlstate', v_state, 'message', v_msg, 'detail', nullif(v_det, ''),
      'hint', nullif(v_hint, ''), 'context', nullif(left(v_ctx, 4000), '')));
  END;
  -- handshake step 4
  status := pgfence._plan_step_finish(p_id, p_worker, p_token, v.step_index, outcome = 'ok', output, error);
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_run_step(bigint, text, bigint, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_run_step(bigint, text, bigint, boolean) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_run_step(bigint, text, bigint, boolean) IS
  'Run the next step of a run p_worker owns under run token p_token (from plan_start / plan_claim).
In the caller''s transaction (one step per transaction): lock the plan row and refuse unless it is still executing by p_worker under p_token with a live heartbeat (a newer take, even under the same name, fences out the older token); run the SQL action with the privileges of the calling role (this function is NOT security definer) inside a subtransaction; write the receipt in the same transaction — ok with the action''s output, or error with SQLSTATE and message (the action''s effects rolled back, the plan failed, earlier steps stay committed). After the last ok step the plan is executed. A step whose action was retired (PF101), whose function was dropped (42883) or replaced since the proposal (PF108: the md5 of its definition differs) does not run: its receipt is that error. For an external step nothing runs: outcome ''external'' with its args and idempotency key, for the executor to perform and report with plan_record_step. p_external_only (an executor that runs no SQL actions): at a SQL step nothing runs and the run is released for a SQL runner (outcome ''released''). Returns (step_index, action, outcome ok|error|external|released, status, output, error, args, idempotency_key); outcome NULL = refused (lost race, stale worker or token, terminal plan): nothing ran. The protocol: functions/24_plan_steps.sql, the handshake. In psql: SELECT * FROM pgfence.plan_run_step(42, ''me'', 1). Errors: 22004 (worker, token), 22023 (worker, a token below 1), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_record_step(
  p_id         bigint,
  p_step_index integer,
  p_worker     text,
  p_token      bigint,
  p_ok         boolean,
  p_output     jsonb DEFAULT NULL,
  p_error      text DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  IF p_step_index IS NULL OR p_ok IS NULL THEN
    RAISE EXCEPTION 'plan_record_step: step_index and ok are required'
      USING ERRCODE = '22004', DETAIL = 'A receipt names the step it records and whether it succeeded.',
            HINT = 'Pass the step_index that plan_run_step handed you, and true or false.';
  END IF;
  IF NOT p_ok AND (p_error IS NULL OR p_error = '') THEN
    RAISE EXCEPTION 'plan_record_step: a failed step needs its error text'
      USING ERRCODE = '22004', DETAIL = 'An error receipt keeps what the transport reported, for whoever looks at the failed plan.',
            HINT = 'Pass what the transport reported.';
  END IF;
  PERFORM pgfence._set_actor(p_worker);
  v := pgfence._plan_lock(p_id);
  IF p_step_index < 1 OR p_step_index > v.step_count THEN
    RAISE EXCEPTION 'plan_record_step: plan % has steps 1..%, not %', p_id, v.step_count, p_step_index
      USING ERRCODE = '22023', DETAIL = 'Steps are numbered from 1 to the plan''s step count.',
            HINT = 'Record the step_index that plan_run_step handed you.';
  END IF;
  IF v.status <> 'executing' OR v.worker IS DISTINCT FROM p_worker OR v.run_token <> p_token
     OR p_step_index < v.next_step THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN false;  -- stale worker or token, terminal plan, or a step recorded already
  END IF;
  IF p_step_index > v.next_step THEN
    RAISE EXCEPTION 'plan_record_step: plan % is at step %, not %', p_id, v.next_step, p_step_index
      USING ERRCODE = 'PF104', DETAIL = 'Steps run, and are recorded, one at a time in order.',
            HINT = 'Steps run in order; record the step plan_run_step handed you.';
  END IF;
  IF (SELECT s.kind FROM pgfence.plan_step s WHERE s.plan_id = p_id AND s.step_index = p_step_index) <> 'external' THEN
    RAISE EXCEPTION 'plan_record_step: step % of plan % is a SQL action', p_step_index, p_id
      USING ERRCODE = 'PF105', DETAIL = 'A SQL step''s receipt is written in the transaction of its effect, which only plan_run_step runs.',
            HINT = 'SQL steps are run, and receipted in their own transaction, by plan_run_step / CALL plan_execute.';
  END IF;
  PERFORM pgfence._plan_commit_step(p_id, p_step_index, p_worker, p_token, p_ok, p_output,
    CASE WHEN NOT p_ok THEN jsonb_build_object('message', left(p_error, 8000)) END, false);
  PERFORM pgfence._set_actor(NULL);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) IS
  'Executors: record the outcome of an external step, as owner p_worker under run token p_token.
The same lock-and-refuse rule as plan_run_step: the receipt (ok with output, or error with the transport''s message) is written only if p_worker still owns the executing run under p_token with a live heartbeat and p_step_index is its next step; an error fails the plan; the last ok step makes it executed. Returns false when refused (stale worker or token — a lapsed heartbeat has made the plan failed/interrupted, or the run was taken again —, terminal plan, or a step already recorded): nothing changed. In psql: SELECT pgfence.plan_record_step(42, 2, ''me'', 1, true, ''{"http_status": 200}''). Errors: 22004 (missing argument, token; error text for a failure), 22023 (step outside the plan, a token below 1), P0002 (unknown plan), PF104 (not the next step), PF105 (a SQL step: run by plan_run_step).';

CREATE OR REPLACE PROCEDURE pgfence.plan_execute(
  p_id        bigint,
  p_worker    text,
  p_heartbeat interval DEFAULT NULL,
  INOUT status   text DEFAULT NULL,
  INOUT receipts jsonb DEFAULT NULL
)
LANGUAGE plpgsql
-- No SET clause and not security definer: a procedure with either cannot COMMIT, and the
-- actions must run with the caller's privileges. Every name is schema-qualified.
AS $$
#variable_conflict use_variable
DECLARE
  v_token bigint;
  v_step  record;
BEGIN
  v_token := pgfence.plan_start(p_id, p_worker, p_heartbeat);
  COMMIT;
  IF v_token IS NOT NULL THEN
    LOOP
      v_step := pgfence.plan_run_step(p_id, p_worker, v_token);  -- an expression: no query per step
      COMMIT;  -- each step (effect + receipt) is its own transaction
      EXIT WHEN v_step.outcome IS DISTINCT FROM 'ok' OR v_step.status <> 'executing';
    END LOOP;
    IF v_step.outcome = 'external' THEN
      -- A SQL session cannot perform an external effect: hand the run to an executor.
      PERFORM pgfence.plan_release(p_id, p_worker, v_token);
      COMMIT;
    END IF;
  END IF;
  SELECT g.status INTO status FROM pgfence.plan_get(p_id) g;
  SELECT coalesce(jsonb_agg(to_jsonb(r) - 'plan_id' ORDER BY r.step_index), '[]'::jsonb) INTO receipts
  FROM pgfence.plan_receipts r WHERE r.plan_id = p_id;
END
$$;
REVOKE ALL ON PROCEDURE pgfence.plan_execute(bigint, text, interval, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE pgfence.plan_execute(bigint, text, interval, text, jsonb) TO pgfence_executor, pgfence_admin;
COMMENT ON PROCEDURE pgfence.plan_execute(bigint, text, interval, text, jsonb) IS
  'Run a plan''s SQL steps from psql: take the run, then one step per transaction until it stops.
CALL pgfence.plan_execute(id, worker): take the run (plan_start, under a new run token) and run its SQL steps one by one, committing after each, so every committed step has its receipt and a crash loses at most the step in flight (rolled back whole). Stops at an error (plan failed), at the end (executed), when the run is lost (heartbeat lapsed, another owner), or at an external step, which it releases to an executor. A plan that is terminal, or owned by someone else, runs nothing. Returns (status, receipts): the plan''s status and every receipt so far. Must be called outside an explicit transaction block (autocommit), since it commits. Errors: those of plan_start — 22004 (id or worker NULL), 22023 (bad worker, heartbeat outside 1 s..1 day), P0002 (unknown plan) —, 2D000 (inside a transaction block).';
