-- pgfence functions/22_plan_propose.sql — plans (module 2): the allow-list, proposals, decisions.
--
-- What a plan may do and who decides it runs. Public: plan_register_action and
-- plan_retire_action (administrators: the allow-list), the view plan_actions; plan_propose and
-- plan_compensate (clients: a plan, or one that undoes another); plan_approve and plan_reject
-- (administrators, four eyes). What was approved is what runs: each sql step records, at
-- proposal, the md5 of its function's definition (pg_get_functiondef) with its pg_proc row's oid
-- and xmin, checked again before the step runs (24_plan_steps.sql); plan_approve cross-checks them
-- (plan.version_checked: only then may the steps skip the md5) and refuses (PF103) the proposer's name and the
-- proposing login (plan.proposed_db_user) unless that login is a superuser; every event records
-- its login (event.db_user) next to the actor name. Query plans: docs/query-plans.md#plan.

-- ---------------------------------------------------------------------------------------------
-- The allow-list
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_register_action(
  p_name        text,
  p_function    regprocedure,
  p_description text
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_kind     text := CASE WHEN p_function IS NULL THEN 'external' ELSE 'sql' END;
  v_proc     record;
  v_old      pgfence.plan_action;
BEGIN
  IF p_name IS NULL OR p_description IS NULL THEN
    RAISE EXCEPTION 'plan_register_action: name and description are required'
      USING ERRCODE = '22004', DETAIL = 'Approvers read an action''s description when they approve a plan that names it.',
            HINT = 'Describe what the action does: approvers read it.';
  END IF;
  IF NOT pgfence._is_name(p_name) THEN
    RAISE EXCEPTION 'plan_register_action: invalid action name "%"', p_name
      USING ERRCODE = '22023', DETAIL = 'Plan steps name actions by this name; nothing was registered.',
            HINT = 'Action names are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit (an external action''s name is also the executor''s route).';
  END IF;
  IF p_description = '' OR length(p_description) > 2000 THEN
    RAISE EXCEPTION 'plan_register_action: description must be 1-2000 characters'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_description)),
            HINT = 'Describe what the action does in a few sentences: approvers read it.';
  END IF;
  IF p_function IS NOT NULL THEN
    SELECT p.prokind, p.pronargs, p.proargtypes, p.prorettype, p.proretset, n.nspname INTO v_proc
    FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE p.oid = p_function;
    IF NOT FOUND THEN
      -- a regprocedure is only an OID: '999999'::regprocedure names nothing
      RAISE EXCEPTION 'plan_register_action: function % does not exist', p_function::oid
        USING ERRCODE = '42883', DETAIL = 'No function has this OID; a step of this action could never run.',
              HINT = 'Pass an existing function (args jsonb) RETURNS jsonb, e.g. ''myschema.my_action(jsonb)''::regprocedure.';
    END IF;
    IF v_proc.prokind <> 'f' OR v_proc.pronargs <> 1 OR v_proc.proargtypes[0] <> 'jsonb'::regtype
       OR v_proc.prorettype <> 'jsonb'::regtype OR v_proc.proretset THEN
      RAISE EXCEPTION 'plan_register_action: % is not a function (args jsonb) RETURNS jsonb', p_function
        USING ERRCODE = '22023', DETAIL = 'plan_run_step calls the function with the step''s args and keeps its result as the receipt''s output.',
              HINT = 'A SQL action takes the step''s args as one jsonb argument and returns a jsonb result (the receipt''s output).';
    END IF;
    IF v_proc.nspname = 'pgfence' THEN
      RAISE EXCEPTION 'plan_register_action: % is pgfence''s own function', p_function
        USING ERRCODE = '22023', DETAIL = 'pgfence''s functions are the machinery that runs plans, not actions a plan may call.',
              HINT = 'Actions are your functions, in your schemas.';
    END IF;
  END IF;
  SELECT * INTO v_old FROM pgfence.plan_action a WHERE a.name = p_name FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO pgfence.plan_action (name, kind, function, description, registered_by)
    VALUES (p_name, v_kind, p_function, p_description, session_user)
    ON CONFLICT (name) DO NOTHING;
    IF FOUND THEN
      RETURN true;
    END IF;
    SELECT * INTO v_old FROM pgfence.plan_action a WHERE a.name = p_name FOR UPDATE;
  END IF;
  -- An existing name keeps its kind and function, unless the function was dropped since.
  IF v_old.kind <> v_kind
     OR (v_old.function IS DISTINCT FROM p_function
         AND EXISTS (SELECT 1 FROM pg_catalog.pg_proc p WHERE p.oid = v_old.function)) THEN
    RAISE EXCEPTION 'plan_register_action: action "%" is already registered as % %', p_name, v_old.kind,
      coalesce(v_old.function::text, '')
      USING ERRCODE = 'PF102',
            DETAIL = 'Approved plans name this action; re-pointing it would run something nobody approved.',
            HINT = 'Register the new function under a new action name (and retire the old one with pgfence.plan_retire_action).';
  END IF;
  UPDATE pgfence.plan_action a
  SET description = p_description, function = p_function, retired_at = NULL
  WHERE a.name = p_name;
  RETURN false;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_register_action(text, regprocedure, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_register_action(text, regprocedure, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_register_action(text, regprocedure, text) IS
  'Administrators: put an action on the allow-list (a sql function, or an external effect).
p_function = a function (args jsonb) RETURNS jsonb makes a sql action, run by plan_run_step with the privileges of the executing role; p_function NULL makes an external action, performed by the executor through the transport routed for the action''s name (step args {"recipient", "payload"}). Returns true when the name is new, false when it existed (the description is updated and a retired action is back in use). Errors: 22004 (missing name/description), 22023 (bad name or description, wrong function signature, a pgfence function), PF102 (the name is already registered to another kind or to another function that still exists), 42883 (p_function names no function).';

CREATE OR REPLACE FUNCTION pgfence.plan_retire_action(p_name text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  UPDATE pgfence.plan_action a SET retired_at = now() WHERE a.name = p_name AND a.retired_at IS NULL;
  IF FOUND THEN
    RETURN true;
  END IF;
  PERFORM 1 FROM pgfence.plan_action a WHERE a.name = p_name;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'plan_retire_action: no action named "%"', p_name
      USING ERRCODE = 'P0002', DETAIL = 'No action was ever registered under this name.',
            HINT = 'See the view pgfence.plan_actions.';
  END IF;
  RETURN false;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_retire_action(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_retire_action(text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_retire_action(text) IS
  'Administrators: take an action off the allow-list; approved plans then do not run its steps.
New proposals naming it are refused (PF101); an approved plan that reaches a step of it records an error receipt (PF101) instead of running it. Returns false if it was already retired. Errors: P0002 (unknown action).';

CREATE OR REPLACE VIEW pgfence.plan_actions AS
SELECT a.name, a.kind, a.function::text AS function, a.description, a.registered_by,
       a.registered_at, a.retired_at
FROM pgfence.plan_action a;
REVOKE ALL ON pgfence.plan_actions FROM PUBLIC;
GRANT SELECT ON pgfence.plan_actions TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON VIEW pgfence.plan_actions IS
  'The plan action allow-list: what a proposer may name in a step, and what each action does.
What a proposer may name in a step (retired_at NULL), its kind (sql function or external effect), the function a sql action calls, and the description approvers read.';
COMMENT ON COLUMN pgfence.plan_actions.name IS
  'The action''s name, as plan steps write it ({"action": name}); for an external action also the executor''s route.';
COMMENT ON COLUMN pgfence.plan_actions.kind IS
  'sql (a function plan_run_step calls in the step''s transaction) or external (an effect the executor performs).';
COMMENT ON COLUMN pgfence.plan_actions.function IS
  'For kind sql: the function a step calls with its args, f(args jsonb) RETURNS jsonb; NULL for external.';
COMMENT ON COLUMN pgfence.plan_actions.description IS
  'What the action does, in the words of whoever registered it: what approvers read.';
COMMENT ON COLUMN pgfence.plan_actions.registered_by IS
  'The database login that registered the action.';
COMMENT ON COLUMN pgfence.plan_actions.registered_at IS
  'When the action was first registered.';
COMMENT ON COLUMN pgfence.plan_actions.retired_at IS
  'When it was retired (plan_retire_action): no new proposal may name it, approved steps of it fail. NULL = in use.';

-- ---------------------------------------------------------------------------------------------
-- Propose
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_propose(
  p_steps           jsonb,
  p_proposed_by     text,
  p_ttl             interval DEFAULT interval '1 day',
  p_idempotency_key text DEFAULT NULL,
  p_compensates     bigint DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_steps      jsonb;
  v_id         bigint;
  v_old        record;
  v_comp_state text;
BEGIN
  PERFORM pgfence._plan_check_name(p_proposed_by, 'proposed_by');
  IF p_ttl IS NULL THEN
    RAISE EXCEPTION 'plan_propose: ttl is required'
      USING ERRCODE = '22004', DETAIL = 'ttl is how long the plan may wait for approval.',
            HINT = 'Omit it for the default (1 day).';
  END IF;
  IF p_ttl <= interval '0' OR p_ttl > interval '366 days' THEN
    RAISE EXCEPTION 'plan_propose: ttl must be positive and at most 366 days, got %', p_ttl
      USING ERRCODE = '22023', DETAIL = 'A plan that is not approved within its ttl expires and can never run.',
            HINT = 'ttl is how long the plan may wait for approval.';
  END IF;
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'plan_propose: idempotency_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_idempotency_key)),
            HINT = 'Use one stable key per proposal (a retry sends the same one), or NULL.';
  END IF;
  IF p_compensates IS NOT NULL THEN
    SELECT p.status INTO v_comp_state FROM pgfence.plan p WHERE p.id = p_compensates;
    IF NOT FOUND THEN
      RAISE EXCEPTION 'plan_propose: no plan % to compensate', p_compensates
        USING ERRCODE = 'P0002', DETAIL = 'compensates names the executed or failed plan this one undoes.',
              HINT = 'Check the id of the plan to undo.';
    END IF;
    IF v_comp_state NOT IN ('executed', 'failed') THEN
      RAISE EXCEPTION 'plan_propose: plan % is %; only an executed or failed plan can be compensated', p_compensates, v_comp_state
        USING ERRCODE = 'PF106',
              DETAIL = 'A pending, approved, rejected or expired plan ran nothing; an executing one is still changing.',
              HINT = 'Reject a plan that should not run; wait for an executing one to end (or for its heartbeat to lapse).';
    END IF;
  END IF;
  v_steps := pgfence._plan_normalize_steps(p_steps);
  PERFORM pgfence._set_actor(p_proposed_by);

  INSERT INTO pgfence.plan AS p (step_count, proposed_by, expires_at, idempotency_key, compensates)
  VALUES (jsonb_array_length(v_steps), p_proposed_by, now() + p_ttl, p_idempotency_key, p_compensates)
  ON CONFLICT (idempotency_key) DO NOTHING
  RETURNING p.id INTO v_id;
  IF v_id IS NOT NULL THEN
    -- Each sql step keeps a fingerprint of its function's definition (once per action, not per
    -- step): a step whose function was replaced after the approval does not run (PF108). With it
    -- the identity of the pg_proc row version hashed (oid, xmin), so that a step skips the md5
    -- while that version is the function's row (migration 0034); not for a row this transaction
    -- wrote itself, which could still change under the same xmin: those steps always hash. The
    -- md5 comes from the catalog cache and the xmin from this snapshot, which a replacement
    -- committing right now can make disagree: plan_approve cross-checks them (version_checked).
    WITH fp AS MATERIALIZED (
      SELECT a.name, md5(pg_catalog.pg_get_functiondef(pr.oid)) AS function_md5, pr.oid AS function_oid,
             CASE WHEN NOT pgfence._plan_locked_here(pr.xmin) THEN pgfence._plan_row_xid(pr.xmin) END AS function_xmin
      FROM pgfence.plan_action a
      LEFT JOIN pg_catalog.pg_proc pr ON pr.oid = a.function
      WHERE a.kind = 'sql' AND a.name IN (SELECT DISTINCT x ->> 'action' FROM jsonb_array_elements(v_steps) AS x)
    )
    INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function, function_md5,
                                   function_oid, function_xmin, args, note)
    SELECT v_id, e.i, e.step ->> 'action', e.step ->> 'kind', e.step ->> 'function', fp.function_md5,
           fp.function_oid, fp.function_xmin, e.step -> 'args', e.step ->> 'note'
    FROM jsonb_array_elements(v_steps) WITH ORDINALITY AS e(step, i)
    LEFT JOIN fp ON fp.name = e.step ->> 'action';
    PERFORM pgfence._set_actor(NULL);
    RETURN v_id;
  END IF;
  SELECT p.id, pgfence._plan_steps_json(p.id) AS steps, p.proposed_by, p.compensates INTO v_old
  FROM pgfence.plan p WHERE p.idempotency_key = p_idempotency_key;
  IF v_old.id IS NULL THEN
    RAISE EXCEPTION 'plan_propose: idempotency key "%" is held by a transaction this snapshot cannot see', p_idempotency_key
      USING ERRCODE = '40001', DETAIL = 'Under REPEATABLE READ or SERIALIZABLE a plan committed after the snapshot was taken is invisible here.',
            HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
  END IF;
  IF v_old.steps IS DISTINCT FROM v_steps OR v_old.proposed_by IS DISTINCT FROM p_proposed_by
     OR v_old.compensates IS DISTINCT FROM p_compensates THEN
    RAISE EXCEPTION 'plan_propose: idempotency key "%" already names plan %, with other steps or another proposer', p_idempotency_key, v_old.id
      USING ERRCODE = 'PF003',
            DETAIL = format('Plan %s was proposed by %s; this call differs in its steps, proposer or compensated plan.', v_old.id, v_old.proposed_by),
            HINT = 'An idempotency key identifies one proposal; use a new key for a different plan.';
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_old.id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_propose(jsonb, text, interval, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_propose(jsonb, text, interval, text, bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_propose(jsonb, text, interval, text, bigint) IS
  'Propose a plan: steps on the allow-list, validated and frozen until a person approves them.
p_steps is a JSON array of {"action", "args", "note"} (1..10000 steps, numbered from 1), every action on the allow-list; all steps are validated up front and frozen (normalised with each action''s kind and function). It waits for approval until now() + ttl. A repeated idempotency key returns the existing plan and inserts nothing. compensates = the executed or failed plan this one undoes (plan_compensate). The proposing database login (session_user) is recorded with the plan: that login cannot approve it (plan_approve). Each sql step records the md5 of its function''s definition (pg_get_functiondef) and the identity of its pg_proc row version (oid, xmin; not for a row this transaction wrote): if the function is replaced before the step runs, the step is not run (PF108); while the row is that version, in a plan that plan_approve marked version_checked, the step skips the md5. Returns the plan id; NOTIFY pgfence_plan at commit. Errors: 22004 (missing steps/proposer/ttl), 22023 (malformed steps, ttl outside (0, 366 days], bad key), PF101 (an action not on the allow-list), 42883 (a sql action whose function was dropped), P0002 (unknown plan to compensate), PF106 (that plan is not executed or failed), PF003 (key already names another plan), 40001 (key held by an invisible transaction: retry).';

CREATE OR REPLACE FUNCTION pgfence.plan_compensate(
  p_id              bigint,
  p_steps           jsonb,
  p_by              text,
  p_ttl             interval DEFAULT interval '1 day',
  p_idempotency_key text DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'plan_compensate: the id of the plan to undo is required'
      USING ERRCODE = '22004', DETAIL = 'A compensating plan names the executed or failed plan it undoes.',
            HINT = 'Pass the id of the plan to undo; a plan that undoes nothing is proposed with pgfence.plan_propose.';
  END IF;
  RETURN pgfence.plan_propose(p_steps, p_by, p_ttl, p_idempotency_key, p_id);
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_compensate(bigint, jsonb, text, interval, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_compensate(bigint, jsonb, text, interval, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_compensate(bigint, jsonb, text, interval, text) IS
  'Propose a compensating plan that undoes plan p_id (executed or failed); returns its id.
p_id is executed, or failed after some steps committed: a new plan with its own steps, approval and receipts that references the one it undoes; no step of the original is rolled back. Same rules as plan_propose. Errors: those of plan_propose — 22004 (p_id, steps, proposer or ttl NULL), 22023 (malformed steps, ttl, key), PF101 (an action not on the allow-list), 42883 (a sql action whose function was dropped), P0002 (unknown plan p_id), PF106 (that plan is not executed or failed), PF003 (key already names another plan), 40001 (key held by an invisible transaction: retry).';

-- ---------------------------------------------------------------------------------------------
-- Approve, reject
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_approve(p_id bigint, p_by text)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  c_pending CONSTANT text := 'pending';  -- a parameter, not a literal: docs/query-plans.md#plan
  v_status   text;
  v_proposer text;
  v_login    text;
  -- Four eyes are two logins: the names passed in are whatever the caller says. A superuser
  -- login is exempt (it could change the tables or the function anyway).
  v_super    boolean := coalesce((SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = session_user), false);
BEGIN
  PERFORM pgfence._plan_check_name(p_by, 'approver');
  PERFORM pgfence._set_actor(p_by);
  -- version_checked: the cross-check of the steps' recorded function row versions
  -- (_plan_version_check, run for the matched row only); tg_plan_guard lets only this statement,
  -- marked by the setting, write it.
  PERFORM pg_catalog.set_config('pgfence.plan_version_checking', p_id::text, true);
  UPDATE pgfence.plan p
  SET status = CASE WHEN p.expires_at <= now() THEN 'expired' ELSE 'approved' END,
      approved_by = CASE WHEN p.expires_at > now() THEN p_by END,
      approved_at = CASE WHEN p.expires_at > now() THEN now() END,
      finished_at = CASE WHEN p.expires_at <= now() THEN now() END,
      version_checked = CASE WHEN p.expires_at > now() THEN pgfence._plan_version_check(p.id) ELSE false END
  WHERE p.id = p_id AND p.status = c_pending AND p.proposed_by <> p_by
    AND (v_super OR p.proposed_db_user <> session_user::text)
  RETURNING p.status INTO v_status;
  PERFORM pg_catalog.set_config('pgfence.plan_version_checking', '', true);
  IF v_status IS NOT NULL THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN v_status;
  END IF;
  PERFORM pgfence._plan_require(p_id);
  SELECT p.status, p.proposed_by, p.proposed_db_user INTO v_status, v_proposer, v_login FROM pgfence.plan p WHERE p.id = p_id;
  IF v_status = 'pending' AND v_proposer = p_by THEN
    RAISE EXCEPTION 'plan_approve: % proposed plan % and cannot approve it too', p_by, p_id
      USING ERRCODE = 'PF103', DETAIL = 'Four eyes: the approver is another person than the proposer.',
            HINT = 'Another person must approve it (four eyes).';
  END IF;
  IF v_status = 'pending' AND v_login = session_user::text AND NOT v_super THEN
    RAISE EXCEPTION 'plan_approve: database login % proposed plan % (as %) and cannot approve it too (as %)', v_login, p_id, v_proposer, p_by
      USING ERRCODE = 'PF103',
            DETAIL = 'Four eyes are two database logins: the approver''s name is whatever the caller passes.',
            HINT = 'Another person approves it from their own login (pgfence_admin).';
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_approve(bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_approve(bigint, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_approve(bigint, text) IS
  'Approve a pending plan (four eyes: not by its proposer''s name or login); returns the new status.
One conditional UPDATE: returns ''approved'', or ''expired'' when called after its expires_at (the plan moves to expired and can never run), or NULL when the plan is no longer pending (already decided: a lost race, nothing changed). At commit NOTIFY pgfence_plan wakes executors. Approving also cross-checks the steps'' recorded function row versions (_plan_version_check: in another transaction than the proposal, under READ COMMITTED, every recorded pg_proc row still current and its definition still hashing to the recorded md5) and marks the plan version_checked when they all hold: only then do its steps skip the md5 of the approval check by row version; otherwise they compute it (the approval itself succeeds either way). Four eyes: refused when the approver name is the proposer name, and when the approving database login (session_user) is the one that proposed (plan.proposed_db_user), whatever names are passed, unless that login is a superuser. Errors: 22004/22023 (approver name), P0002 (unknown plan), PF103 (the approver is the proposer, by name or by login).';

CREATE OR REPLACE FUNCTION pgfence.plan_reject(p_id bigint, p_by text, p_reason text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  c_pending CONSTANT text := 'pending';  -- a parameter, not a literal: docs/query-plans.md#plan
  v_status text;
BEGIN
  PERFORM pgfence._plan_check_name(p_by, 'rejecter');
  IF p_reason IS NULL THEN
    RAISE EXCEPTION 'plan_reject: a reason is required'
      USING ERRCODE = '22004', DETAIL = 'The reason is kept with the plan and in its reject event.',
            HINT = 'Say why, for the proposer and the audit log.';
  END IF;
  IF p_reason = '' OR length(p_reason) > 2000 THEN
    RAISE EXCEPTION 'plan_reject: reason must be 1-2000 characters'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_reason)),
            HINT = 'Say why in at most 2000 characters, for the proposer and the audit log.';
  END IF;
  PERFORM pgfence._set_actor(p_by);
  UPDATE pgfence.plan p
  SET status = CASE WHEN p.expires_at <= now() THEN 'expired' ELSE 'rejected' END,
      rejected_by = CASE WHEN p.expires_at > now() THEN p_by END,
      rejected_at = CASE WHEN p.expires_at > now() THEN now() END,
      reject_reason = CASE WHEN p.expires_at > now() THEN p_reason END,
      finished_at = now()
  WHERE p.id = p_id AND p.status = c_pending
  RETURNING p.status INTO v_status;
  IF v_status IS NULL THEN
    PERFORM pgfence._plan_require(p_id);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_status IS NOT DISTINCT FROM 'rejected';
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_reject(bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_reject(bigint, text, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_reject(bigint, text, text) IS
  'Reject a pending plan with a reason; true if this call rejected it.
Returns false if it was no longer pending (lost race) or had passed its expires_at (it becomes expired instead). Errors: 22004 (missing approver or reason), 22023 (bad name, reason longer than 2000), P0002 (unknown plan).';
