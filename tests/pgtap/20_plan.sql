-- pgTAP: Module 2 — plan. Every contract cell of docs/design.md for approved plans, plus each
-- documented SQLSTATE. Cells that need a second session (lost races, CALL plan_execute, which
-- commits) are in 21_plan_concurrency.sql.
BEGIN;
\ir helpers/setup.sql
SELECT plan(444);

-- Fixtures: a small table, SQL actions on it, an external action (rolled back at the end).
CREATE TABLE public.tap_plan_t (k text PRIMARY KEY, v integer NOT NULL CHECK (v >= 0));
CREATE FUNCTION public.tap_plan_put(p jsonb) RETURNS jsonb LANGUAGE sql SET search_path = public AS $$
  INSERT INTO tap_plan_t (k, v) VALUES (p ->> 'k', (p ->> 'v')::int) RETURNING jsonb_build_object('put', k);
$$;
-- Writes a row, then fails: the row must vanish with the failed step.
CREATE FUNCTION public.tap_plan_boom(p jsonb) RETURNS jsonb LANGUAGE plpgsql SET search_path = public AS $$
BEGIN
  INSERT INTO tap_plan_t (k, v) VALUES (p ->> 'k', 1);
  RETURN jsonb_build_object('ratio', 1 / 0);
END $$;
CREATE FUNCTION public.tap_plan_wrong_sig(p json) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{}'::jsonb $$;
CREATE FUNCTION public.tap_plan_noop(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
CREATE FUNCTION public.tap_plan_other(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
CREATE FUNCTION pg_temp.pid(p_name text) RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM ids WHERE name = p_name $$;
-- The run token the plan's owner holds now (security definer: also under SET ROLE tests).
CREATE FUNCTION pg_temp.tok(p_name text) RETURNS bigint LANGUAGE sql SECURITY DEFINER AS $$
  SELECT p.run_token FROM pgfence.plan p WHERE p.id = (SELECT id FROM ids WHERE name = p_name) $$;

-- =============================================================================================
-- Catalog: signatures, definer, volatility, search_path, privileges
-- =============================================================================================
SELECT has_function('pgfence', 'plan_register_action', ARRAY['text','regprocedure','text'], 'plan_register_action signature');
SELECT has_function('pgfence', 'plan_retire_action', ARRAY['text'], 'plan_retire_action signature');
SELECT has_function('pgfence', 'plan_propose', ARRAY['jsonb','text','interval','text','bigint'], 'plan_propose signature');
SELECT has_function('pgfence', 'plan_compensate', ARRAY['bigint','jsonb','text','interval','text'], 'plan_compensate signature');
SELECT has_function('pgfence', 'plan_approve', ARRAY['bigint','text'], 'plan_approve signature');
SELECT has_function('pgfence', 'plan_reject', ARRAY['bigint','text','text'], 'plan_reject signature');
SELECT has_function('pgfence', 'plan_start', ARRAY['bigint','text','interval'], 'plan_start signature');
SELECT has_function('pgfence', 'plan_claim', ARRAY['text','integer','boolean','interval'], 'plan_claim signature');
SELECT has_function('pgfence', 'plan_release', ARRAY['bigint','text','bigint'], 'plan_release signature (id, worker, run token)');
SELECT has_function('pgfence', 'plan_heartbeat', ARRAY['bigint','text','bigint'], 'plan_heartbeat signature (id, worker, run token)');
SELECT has_function('pgfence', 'plan_run_step', ARRAY['bigint','text','bigint','boolean'], 'plan_run_step signature (id, worker, run token, external only)');
SELECT has_function('pgfence', 'plan_record_step', ARRAY['bigint','integer','text','bigint','boolean','jsonb','text'], 'plan_record_step signature (id, step, worker, run token, ...)');
SELECT hasnt_function('pgfence', 'plan_run_step', ARRAY['bigint','text','boolean'], 'the unfenced plan_run_step is gone (migration 0010)');
SELECT hasnt_function('pgfence', 'plan_record_step', ARRAY['bigint','integer','text','boolean','jsonb','text'], 'the unfenced plan_record_step is gone');
SELECT hasnt_function('pgfence', 'plan_heartbeat', ARRAY['bigint','text'], 'the unfenced plan_heartbeat is gone');
SELECT hasnt_function('pgfence', 'plan_release', ARRAY['bigint','text'], 'the unfenced plan_release is gone');
SELECT function_returns('pgfence', 'plan_start', ARRAY['bigint','text','interval'], 'bigint', 'plan_start returns the run token');
SELECT has_function('pgfence', 'plan_execute', ARRAY['bigint','text','interval','text','jsonb'], 'plan_execute signature');
SELECT is((SELECT prokind::text FROM pg_proc WHERE oid = 'pgfence.plan_execute(bigint,text,interval,text,jsonb)'::regprocedure), 'p',
  'plan_execute is a procedure (it commits after every step)');
SELECT has_function('pgfence', 'plan_get', ARRAY['bigint'], 'plan_get signature');
SELECT has_function('pgfence', 'plan_steps', ARRAY['bigint'], 'plan_steps signature');
SELECT has_function('pgfence', 'plan_list', ARRAY['text','integer'], 'plan_list signature');
SELECT has_function('pgfence', 'plan_reap', ARRAY['integer'], 'plan_reap signature');
SELECT has_function('pgfence', 'plan_reap_stale', ARRAY['integer'], 'plan_reap_stale, its deprecated old name, is still there');
SELECT has_view('pgfence', 'plan_receipts', 'plan_receipts view');
SELECT has_view('pgfence', 'plan_actions', 'plan_actions view');

SELECT isnt_definer('pgfence', 'plan_run_step', ARRAY['bigint','text','bigint','boolean'], 'plan_run_step is NOT security definer: actions run with the executing role''s privileges');
SELECT isnt_definer('pgfence', 'plan_execute', ARRAY['bigint','text','interval','text','jsonb'], 'plan_execute is NOT security definer');
SELECT is_definer('pgfence', '_plan_step_begin', ARRAY['bigint','text','bigint'], 'the lock-and-check helper is security definer');
SELECT is_definer('pgfence', '_plan_step_finish', ARRAY['bigint','text','bigint','integer','boolean','jsonb','jsonb'], 'the receipt-writing helper is security definer');
SELECT is(
  (SELECT array_agg(p.proname::text ORDER BY p.proname) FROM pg_proc p
   WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE 'plan\_%' AND NOT p.prosecdef),
  ARRAY['plan_execute', 'plan_run_step'],
  'every other public plan function is security definer');
SELECT ok(bool_and(coalesce(p.proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp'], false)),
  'every plan function but plan_execute pins search_path')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE '%plan%' AND p.proname <> 'plan_execute';
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'pgfence.plan_execute(bigint,text,interval,text,jsonb)'::regprocedure), NULL,
  'plan_execute has no SET clause (a procedure with one cannot COMMIT)');
SELECT volatility_is('pgfence', 'plan_get', ARRAY['bigint'], 'volatile', 'plan_get is volatile (it heals lazily)');
SELECT volatility_is('pgfence', 'plan_run_step', ARRAY['bigint','text','bigint','boolean'], 'volatile', 'plan_run_step is volatile');

SELECT function_privs_are('pgfence', 'plan_propose', ARRAY['jsonb','text','interval','text','bigint'], 'pgfence_client', ARRAY['EXECUTE'], 'client may propose');
SELECT function_privs_are('pgfence', 'plan_propose', ARRAY['jsonb','text','interval','text','bigint'], 'pgfence_executor', ARRAY[]::text[], 'executor may not propose');
SELECT function_privs_are('pgfence', 'plan_compensate', ARRAY['bigint','jsonb','text','interval','text'], 'pgfence_client', ARRAY['EXECUTE'], 'client may propose a compensation');
SELECT function_privs_are('pgfence', 'plan_approve', ARRAY['bigint','text'], 'pgfence_client', ARRAY[]::text[], 'client may not approve');
SELECT function_privs_are('pgfence', 'plan_approve', ARRAY['bigint','text'], 'pgfence_executor', ARRAY[]::text[], 'executor may not approve');
SELECT function_privs_are('pgfence', 'plan_approve', ARRAY['bigint','text'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may approve');
SELECT function_privs_are('pgfence', 'plan_reject', ARRAY['bigint','text','text'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may reject');
SELECT function_privs_are('pgfence', 'plan_register_action', ARRAY['text','regprocedure','text'], 'pgfence_executor', ARRAY[]::text[], 'executor may not register actions');
SELECT function_privs_are('pgfence', 'plan_register_action', ARRAY['text','regprocedure','text'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may register actions');
SELECT function_privs_are('pgfence', 'plan_start', ARRAY['bigint','text','interval'], 'pgfence_client', ARRAY[]::text[], 'client may not start a run');
SELECT function_privs_are('pgfence', 'plan_start', ARRAY['bigint','text','interval'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may start a run');
SELECT function_privs_are('pgfence', 'plan_run_step', ARRAY['bigint','text','bigint','boolean'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may run steps');
SELECT function_privs_are('pgfence', '_plan_step_begin', ARRAY['bigint','text','bigint'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may call the step helper that plan_run_step uses');
SELECT function_privs_are('pgfence', '_plan_step_begin', ARRAY['bigint','text','bigint'], 'pgfence_client', ARRAY[]::text[], 'client may not');
SELECT function_privs_are('pgfence', 'plan_execute', ARRAY['bigint','text','interval','text','jsonb'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may CALL plan_execute');
SELECT function_privs_are('pgfence', 'plan_execute', ARRAY['bigint','text','interval','text','jsonb'], 'pgfence_client', ARRAY[]::text[], 'client may not CALL plan_execute');
SELECT function_privs_are('pgfence', 'plan_record_step', ARRAY['bigint','integer','text','bigint','boolean','jsonb','text'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may record steps');
SELECT function_privs_are('pgfence', 'plan_record_step', ARRAY['bigint','integer','text','bigint','boolean','jsonb','text'], 'pgfence_client', ARRAY[]::text[], 'client may not record steps');
SELECT function_privs_are('pgfence', 'plan_heartbeat', ARRAY['bigint','text','bigint'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may heartbeat');
SELECT function_privs_are('pgfence', 'plan_reap', ARRAY['integer'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may run the reaper');
SELECT function_privs_are('pgfence', 'plan_reap_stale', ARRAY['integer'], 'pgfence_executor', ARRAY['EXECUTE'], '... and its deprecated old name');
SELECT function_privs_are('pgfence', 'plan_get', ARRAY['bigint'], 'pgfence_client', ARRAY['EXECUTE'], 'client may read a plan');
SELECT table_privs_are('pgfence', 'plan_receipts', 'pgfence_client', ARRAY['SELECT'], 'client reads plan_receipts');
SELECT table_privs_are('pgfence', 'plan_actions', 'pgfence_client', ARRAY['SELECT'], 'client reads the allow-list');
SELECT table_privs_are('pgfence', 'plan', 'pgfence_executor', ARRAY[]::text[], 'executor has no privilege on the plan table');
SELECT table_privs_are('pgfence', 'plan_step', 'pgfence_admin', ARRAY[]::text[], 'admin has no privilege on the receipts table');

-- =============================================================================================
-- Allow-list
-- =============================================================================================
SELECT is(pgfence.plan_register_action('tap-put', 'public.tap_plan_put(jsonb)', 'insert a row into tap_plan_t'), true, 'register a sql action');
SELECT is(pgfence.plan_register_action('tap-boom', 'public.tap_plan_boom(jsonb)', 'insert, then divide by zero'), true, 'register a failing sql action');
SELECT is(pgfence.plan_register_action('tap-hook', NULL, 'POST to a webhook'), true, 'register an external action (no function)');
SELECT is(pgfence.plan_register_action('tap-put', 'public.tap_plan_put(jsonb)', 'insert one row'), false, 're-registering the same function is not new (description updated)');
SELECT is((SELECT description FROM pgfence.plan_actions WHERE name = 'tap-put'), 'insert one row', '... and the description changed');
SELECT results_eq($$SELECT kind, function FROM pgfence.plan_actions WHERE name IN ('tap-put', 'tap-hook') ORDER BY name$$,
  $$VALUES ('external'::text, NULL::text), ('sql', 'tap_plan_put(jsonb)')$$, 'plan_actions shows kind and function');
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-put', 'public.tap_plan_other(jsonb)', 'x')$$, 'PF102', NULL, 're-pointing an action at another function: PF102');
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-put', NULL, 'x')$$, 'PF102', NULL, 'changing an action''s kind: PF102');
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-wrong', 'public.tap_plan_wrong_sig(json)', 'x')$$, '22023', NULL, 'a function that is not (jsonb) RETURNS jsonb: 22023');
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-own', 'pgfence._plan_normalize_steps(jsonb)', 'x')$$, '22023', NULL, 'pgfence''s own function: 22023');
SELECT throws_ok($$SELECT pgfence.plan_register_action('Bad Name', NULL, 'x')$$, '22023', NULL, 'bad action name: 22023');
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-x', NULL, NULL)$$, '22004', NULL, 'missing description: 22004');
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-x', NULL, '')$$, '22023', NULL, 'empty description: 22023');
SELECT is(pgfence.plan_register_action('tap-noop', 'public.tap_plan_noop(jsonb)', 'return the args'), true, 'register tap-noop');
SELECT is(pgfence.plan_retire_action('tap-noop'), true, 'retire an action');
SELECT is(pgfence.plan_retire_action('tap-noop'), false, 'retiring it again returns false');
SELECT throws_ok($$SELECT pgfence.plan_retire_action('tap-nothing')$$, 'P0002', NULL, 'retire an unknown action: P0002');

-- =============================================================================================
-- Propose: validation up front, normalisation, idempotency
-- =============================================================================================
INSERT INTO ids SELECT 'p1', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "a", "v": 1}, "note": "first"},
    {"action": "tap-put", "args": {"k": "b", "v": 2}},
    {"action": "tap-put", "args": {"k": "c", "v": 3}}]', 'tap-agent');
SELECT results_eq(
  $$SELECT status, step_count, next_step, proposed_by, expires_at, approved_by IS NULL, worker IS NULL FROM pgfence.plan WHERE id = pg_temp.pid('p1')$$,
  $$VALUES ('pending'::text, 3, 1, 'tap-agent'::text, now() + interval '1 day', true, true)$$,
  'propose: pending, 3 steps, expires after the default ttl of 1 day');
SELECT is((SELECT steps -> 0 FROM pgfence.plan_get(pg_temp.pid('p1'))),
  '{"action": "tap-put", "kind": "sql", "function": "public.tap_plan_put(jsonb)", "args": {"k": "a", "v": 1}, "note": "first"}'::jsonb,
  'steps are frozen normalised: kind and function of the action recorded with the step');
INSERT INTO ids SELECT 'noargs', pgfence.plan_propose('[{"action": "tap-hook", "args": {"recipient": "http://127.0.0.1:9/x"}}, {"action": "tap-put"}]', 'tap-agent');
SELECT is((SELECT steps -> 1 -> 'args' FROM pgfence.plan_get(pg_temp.pid('noargs'))), '{}'::jsonb, 'a step without args gets {}');
SELECT results_eq($$SELECT step_index, action, kind, function, args, outcome FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('p1') ORDER BY step_index$$,
  $$VALUES (1, 'tap-put'::text, 'sql'::text, 'public.tap_plan_put(jsonb)'::text, '{"k": "a", "v": 1}'::jsonb, NULL::text),
           (2, 'tap-put', 'sql', 'public.tap_plan_put(jsonb)', '{"k": "b", "v": 2}', NULL),
           (3, 'tap-put', 'sql', 'public.tap_plan_put(jsonb)', '{"k": "c", "v": 3}', NULL)$$,
  'one row per step, numbered from 1, without a receipt yet');

INSERT INTO ids SELECT 'key', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "key", "v": 1}}]', 'tap-agent', interval '1 hour', 'tap-plan-key-1');
SELECT is(pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "key", "v": 1}}]', 'tap-agent', interval '1 hour', 'tap-plan-key-1'), pg_temp.pid('key'),
  'a repeated idempotency key returns the existing plan');
SELECT is((SELECT count(*)::int FROM pgfence.plan WHERE idempotency_key = 'tap-plan-key-1'), 1, '... and inserts nothing');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "other", "v": 1}}]', 'tap-agent', interval '1 hour', 'tap-plan-key-1')$$,
  'PF003', NULL, 'the same key with other steps: PF003');

SELECT throws_ok($$SELECT pgfence.plan_propose(NULL, 'tap-agent')$$, '22004', NULL, 'NULL steps: 22004');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}]', NULL)$$, '22004', NULL, 'NULL proposer: 22004');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}]', '')$$, '22023', NULL, 'empty proposer: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('{"action": "tap-put"}', 'tap-agent')$$, '22023', NULL, 'steps not an array: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[]', 'tap-agent')$$, '22023', NULL, 'no steps: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}, 42]', 'tap-agent')$$, '22023', NULL, 'a step that is not an object: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put", "sql": "DROP TABLE x"}]', 'tap-agent')$$, '22023', NULL, 'a step with an unknown key: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put", "args": [1]}]', 'tap-agent')$$, '22023', NULL, 'args not an object: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"args": {}}]', 'tap-agent')$$, '22023', NULL, 'a step without an action: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}, {"action": "tap-drop-everything"}]', 'tap-agent')$$, 'PF101', NULL, 'an action not on the allow-list: PF101');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-noop"}]', 'tap-agent')$$, 'PF101', NULL, 'a retired action: PF101');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-hook", "args": {"payload": {}}}]', 'tap-agent')$$, '22023', NULL, 'an external step without a recipient: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-hook", "args": {"recipient": "x", "payload": [1]}}]', 'tap-agent')$$, '22023', NULL, 'an external payload that is not an object: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}]', 'tap-agent', NULL)$$, '22004', NULL, 'NULL ttl: 22004');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}]', 'tap-agent', interval '0')$$, '22023', NULL, 'ttl 0: 22023');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put"}]', 'tap-agent', interval '1 day', '')$$, '22023', NULL, 'empty idempotency key: 22023');
SELECT is((SELECT count(*)::int FROM pgfence.plan), 3, 'refused proposals wrote nothing');

-- =============================================================================================
-- Approve / reject / expire
-- =============================================================================================
SELECT throws_ok(format('SELECT pgfence.plan_approve(%s, %L)', pg_temp.pid('p1'), 'tap-agent'), 'PF103', NULL, 'the proposer cannot approve: PF103');
SELECT is(pgfence.plan_approve(pg_temp.pid('p1'), 'tap-alice'), 'approved', 'approve a pending plan');
SELECT results_eq($$SELECT status, approved_by, approved_at FROM pgfence.plan WHERE id = pg_temp.pid('p1')$$,
  $$VALUES ('approved'::text, 'tap-alice'::text, now())$$, 'approved: who and when');
SELECT is(pgfence.plan_approve(pg_temp.pid('p1'), 'tap-bob'), NULL, 'a second approval is a lost race (NULL)');
SELECT is((SELECT approved_by FROM pgfence.plan WHERE id = pg_temp.pid('p1')), 'tap-alice', '... and changes nothing');
SELECT is(pgfence.plan_reject(pg_temp.pid('p1'), 'tap-bob', 'too late'), false, 'rejecting an approved plan is a lost race (false)');
SELECT throws_ok($$SELECT pgfence.plan_approve(-1, 'tap-alice')$$, 'P0002', NULL, 'approve an unknown plan: P0002');
SELECT throws_ok($$SELECT pgfence.plan_approve(NULL, 'tap-alice')$$, '22004', NULL, 'approve NULL id: 22004');
SELECT throws_ok(format('SELECT pgfence.plan_approve(%s, NULL)', pg_temp.pid('key')), '22004', NULL, 'approve without an approver: 22004');

INSERT INTO ids SELECT 'rej', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "r", "v": 1}}]', 'tap-agent');
SELECT throws_ok(format('SELECT pgfence.plan_reject(%s, %L, NULL)', pg_temp.pid('rej'), 'tap-alice'), '22004', NULL, 'reject without a reason: 22004');
SELECT is(pgfence.plan_reject(pg_temp.pid('rej'), 'tap-alice', 'writes to the wrong table'), true, 'reject a pending plan');
SELECT results_eq($$SELECT status, rejected_by, reject_reason, finished_at IS NOT NULL FROM pgfence.plan WHERE id = pg_temp.pid('rej')$$,
  $$VALUES ('rejected'::text, 'tap-alice'::text, 'writes to the wrong table'::text, true)$$, 'rejected: who, why, finished');
SELECT is(pgfence.plan_approve(pg_temp.pid('rej'), 'tap-bob'), NULL, 'a rejected plan cannot be approved (NULL)');
SELECT is(pgfence.plan_start(pg_temp.pid('rej'), 'tap-w1'), NULL, 'a rejected plan cannot start');
SELECT throws_ok($$SELECT pgfence.plan_reject(-1, 'tap-alice', 'x')$$, 'P0002', NULL, 'reject an unknown plan: P0002');

-- expiry: proposed 2 days ago with a 1-day ttl (back-dated; triggers off only for this fixture)
INSERT INTO ids SELECT 'exp', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "e", "v": 1}}]', 'tap-agent');
INSERT INTO ids SELECT 'exp2', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "e2", "v": 1}}]', 'tap-agent');
INSERT INTO ids SELECT 'exp3', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "e3", "v": 1}}]', 'tap-agent');
SET LOCAL session_replication_role = replica;
UPDATE pgfence.plan SET proposed_at = now() - interval '2 days', expires_at = now() - interval '1 day'
WHERE id IN (pg_temp.pid('exp'), pg_temp.pid('exp2'), pg_temp.pid('exp3'));
SET LOCAL session_replication_role = origin;
SELECT is(pgfence.plan_approve(pg_temp.pid('exp'), 'tap-alice'), 'expired', 'approving after expires_at returns expired ...');
SELECT results_eq($$SELECT status, approved_by IS NULL, finished_at IS NOT NULL FROM pgfence.plan WHERE id = pg_temp.pid('exp')$$,
  $$VALUES ('expired'::text, true, true)$$, '... and the plan is expired, not approved');
SELECT is(pgfence.plan_start(pg_temp.pid('exp'), 'tap-w1'), NULL, 'an expired plan cannot start');
SELECT is((SELECT status FROM pgfence.plan_get(pg_temp.pid('exp2'))), 'expired', 'plan_get expires a pending plan past expires_at (lazy)');
SELECT is(pgfence.plan_reap(), 1, 'the reaper expires the other one');
SELECT is((SELECT status FROM pgfence.plan WHERE id = pg_temp.pid('exp3')), 'expired', '... which is now expired');

-- =============================================================================================
-- Start: approved -> executing, one owner, heartbeat from the database clock
-- =============================================================================================
SELECT is(pgfence.plan_start(pg_temp.pid('key'), 'tap-w1'), NULL, 'a pending plan cannot start (NULL)');
SELECT is(pgfence.plan_start(pg_temp.pid('p1'), 'tap-w1'), 1::bigint, 'start an approved plan: its first run token');
SELECT results_eq(
  $$SELECT status, worker, started_at, heartbeat_interval, heartbeat_expires_at FROM pgfence.plan WHERE id = pg_temp.pid('p1')$$,
  $$VALUES ('executing'::text, 'tap-w1'::text, now(), interval '120 seconds', now() + interval '120 seconds')$$,
  'executing by tap-w1, default heartbeat 120 s from now()');
SELECT is(pgfence.plan_start(pg_temp.pid('p1'), 'tap-w2'), NULL, 'a second worker loses (NULL)');
SELECT is(pgfence.plan_start(pg_temp.pid('p1'), 'tap-w1'), 2::bigint, 'the owner''s name asking again re-enters the run: a new token');
SELECT throws_ok($$SELECT pgfence.plan_start(-1, 'tap-w1')$$, 'P0002', NULL, 'start an unknown plan: P0002');
SELECT throws_ok(format('SELECT pgfence.plan_start(%s, %L, interval %L)', pg_temp.pid('p1'), 'tap-w1', '0.5 seconds'), '22023', NULL, 'heartbeat under 1 s: 22023');
SELECT throws_ok(format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('p1'), ''), '22023', NULL, 'empty worker: 22023');

-- =============================================================================================
-- Run steps: receipt with the effect; a stale worker runs nothing
-- =============================================================================================
SELECT results_eq($$SELECT step_index, action, outcome, status, output FROM pgfence.plan_run_step(pg_temp.pid('p1'), 'tap-w1', pg_temp.tok('p1'))$$,
  $$VALUES (1, 'tap-put'::text, 'ok'::text, 'executing'::text, '{"put": "a"}'::jsonb)$$, 'run step 1: ok with the action''s output');
SELECT is((SELECT v FROM public.tap_plan_t WHERE k = 'a'), 1, 'step 1''s effect is there');
SELECT results_eq($$SELECT step_index, outcome, worker, output FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('p1')$$,
  $$VALUES (1, 'ok'::text, 'tap-w1'::text, '{"put": "a"}'::jsonb)$$, '... with its receipt, in the same transaction');
SELECT results_eq($$SELECT step_index, outcome, status FROM pgfence.plan_run_step(pg_temp.pid('p1'), 'tap-w2', pg_temp.tok('p1'))$$,
  $$VALUES (NULL::int, NULL::text, 'executing'::text)$$, 'another worker is refused: outcome NULL');
SELECT is((SELECT count(*)::int FROM public.tap_plan_t), 1, '... and nothing ran');
SELECT is((SELECT next_step FROM pgfence.plan WHERE id = pg_temp.pid('p1')), 2, 'the plan waits at step 2');
SELECT results_eq($$SELECT step_index, outcome FROM pgfence.plan_run_step(pg_temp.pid('p1'), 'tap-w1', pg_temp.tok('p1'))$$, $$VALUES (2, 'ok'::text)$$, 'step 2 ok');
SELECT results_eq($$SELECT step_index, outcome, status FROM pgfence.plan_run_step(pg_temp.pid('p1'), 'tap-w1', pg_temp.tok('p1'))$$,
  $$VALUES (3, 'ok'::text, 'executed'::text)$$, 'the last ok step makes the plan executed');
SELECT results_eq($$SELECT status, next_step, finished_at IS NOT NULL, failure FROM pgfence.plan WHERE id = pg_temp.pid('p1')$$,
  $$VALUES ('executed'::text, 4, true, NULL::text)$$, 'executed: next_step past the end, finished');
SELECT is((SELECT array_agg(k ORDER BY k) FROM public.tap_plan_t), ARRAY['a','b','c'], 'all three effects committed');

-- terminal repeat: runs nothing, answers from its receipts
SELECT results_eq($$SELECT step_index, outcome, status FROM pgfence.plan_run_step(pg_temp.pid('p1'), 'tap-w1', pg_temp.tok('p1'))$$,
  $$VALUES (NULL::int, NULL::text, 'executed'::text)$$, 'an executed plan asked to run again: refused, status executed');
SELECT is(pgfence.plan_start(pg_temp.pid('p1'), 'tap-w1'), NULL, 'an executed plan cannot start again');
SELECT is((SELECT count(*)::int FROM public.tap_plan_t), 3, '... nothing ran again');
SELECT is((SELECT array_agg(state ORDER BY step_index) FROM pgfence.plan_steps(pg_temp.pid('p1'))), ARRAY['ok','ok','ok'], 'plan_steps: all receipts ok');
SELECT is((SELECT idempotency_key FROM pgfence.plan_steps(pg_temp.pid('p1')) WHERE step_index = 2), 'pgfence-plan-' || pg_temp.pid('p1') || '-step-2',
  'each step''s idempotency key is plan id + step index');
SELECT throws_ok(format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('p1'), 'tap-w1'), '2D000', NULL, 'CALL plan_execute inside a transaction block: 2D000 (it commits per step)');

-- =============================================================================================
-- A failing step: its effects roll back, its error receipt commits, earlier steps stay
-- =============================================================================================
INSERT INTO ids SELECT 'f', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "f1", "v": 1}}, {"action": "tap-put", "args": {"k": "f2", "v": 2}},
    {"action": "tap-boom", "args": {"k": "f3"}}, {"action": "tap-put", "args": {"k": "f4", "v": 4}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('f'), 'tap-alice'), 'approved', 'approve the failing plan');
SELECT isnt(pgfence.plan_start(pg_temp.pid('f'), 'tap-w1'), NULL, 'start it');
SELECT results_eq($$SELECT step_index, outcome FROM pgfence.plan_run_step(pg_temp.pid('f'), 'tap-w1', pg_temp.tok('f'))$$, $$VALUES (1, 'ok'::text)$$, 'step 1 ok');
SELECT results_eq($$SELECT step_index, outcome FROM pgfence.plan_run_step(pg_temp.pid('f'), 'tap-w1', pg_temp.tok('f'))$$, $$VALUES (2, 'ok'::text)$$, 'step 2 ok');
SELECT results_eq($$SELECT step_index, outcome, status, error ->> 'sqlstate' FROM pgfence.plan_run_step(pg_temp.pid('f'), 'tap-w1', pg_temp.tok('f'))$$,
  $$VALUES (3, 'error'::text, 'failed'::text, '22012'::text)$$, 'step 3 raises: error receipt with SQLSTATE 22012, plan failed');
SELECT is((SELECT count(*)::int FROM public.tap_plan_t WHERE k = 'f3'), 0, 'the failing step''s own write was rolled back');
SELECT is((SELECT array_agg(k ORDER BY k) FROM public.tap_plan_t WHERE k LIKE 'f%'), ARRAY['f1','f2'], 'steps 1-2 stay committed; step 4 never ran');
SELECT results_eq($$SELECT step_index, outcome, sqlstate, message FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('f') ORDER BY step_index$$,
  $$VALUES (1, 'ok'::text, NULL::text, NULL::text), (2, 'ok', NULL, NULL), (3, 'error', '22012', 'division by zero')$$,
  'receipts: ok, ok, error with SQLSTATE and message');
SELECT results_eq($$SELECT status, failure, next_step FROM pgfence.plan WHERE id = pg_temp.pid('f')$$,
  $$VALUES ('failed'::text, 'step_error'::text, 3)$$, 'failed (step_error) at step 3');
SELECT is((SELECT array_agg(state ORDER BY step_index) FROM pgfence.plan_steps(pg_temp.pid('f'))), ARRAY['ok','ok','error','not_run'], 'plan_steps: ok, ok, error, not_run');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('f'), 'tap-w1', pg_temp.tok('f'))$$,
  $$VALUES (NULL::text, 'failed'::text)$$, 'a failed plan runs nothing more');

-- =============================================================================================
-- Privileges: the action runs as the executing role, never as pgfence's owner
-- =============================================================================================
CREATE TABLE public.tap_plan_secret (x text);
REVOKE ALL ON public.tap_plan_secret FROM PUBLIC;
CREATE FUNCTION public.tap_plan_secret_write(p jsonb) RETURNS jsonb LANGUAGE sql SET search_path = public AS $$
  INSERT INTO tap_plan_secret VALUES (p ->> 'x') RETURNING jsonb_build_object('wrote', x);
$$;
CREATE ROLE tap_plan_weak NOLOGIN IN ROLE pgfence_executor;
CREATE ROLE tap_plan_strong NOLOGIN IN ROLE pgfence_executor;
GRANT INSERT, SELECT ON public.tap_plan_secret TO tap_plan_strong;
GRANT SELECT ON ids TO tap_plan_weak, tap_plan_strong;
SELECT is(pgfence.plan_register_action('tap-secret', 'public.tap_plan_secret_write(jsonb)', 'write the secret table'), true, 'register an action on a protected table');
INSERT INTO ids SELECT 'priv', pgfence.plan_propose('[{"action": "tap-secret", "args": {"x": "weak"}}]', 'tap-agent');
INSERT INTO ids SELECT 'priv2', pgfence.plan_propose('[{"action": "tap-secret", "args": {"x": "strong"}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('priv'), 'tap-alice') || pgfence.plan_approve(pg_temp.pid('priv2'), 'tap-alice'), 'approvedapproved', 'approve both');
SET LOCAL ROLE tap_plan_weak;
SELECT isnt(pgfence.plan_start(pg_temp.pid('priv'), 'tap-weak'), NULL, 'as a role without INSERT on the table: start');
SELECT results_eq($$SELECT outcome, status, error ->> 'sqlstate', error ->> 'message' FROM pgfence.plan_run_step(pg_temp.pid('priv'), 'tap-weak', pg_temp.tok('priv'))$$,
  $$VALUES ('error'::text, 'failed'::text, '42501'::text, 'permission denied for table tap_plan_secret'::text)$$,
  'the action the executing role may not perform becomes an error receipt (42501 on the table), not a success');
RESET ROLE;
SELECT is((SELECT count(*)::int FROM public.tap_plan_secret), 0, '... and wrote nothing, although pgfence''s owner could have');
SET LOCAL ROLE tap_plan_strong;
SELECT isnt(pgfence.plan_start(pg_temp.pid('priv2'), 'tap-strong'), NULL, 'as a role with INSERT: start');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('priv2'), 'tap-strong', pg_temp.tok('priv2'))$$,
  $$VALUES ('ok'::text, 'executed'::text)$$, 'the same action succeeds for a role that may perform it');
SELECT throws_ok($$SELECT count(*) FROM pgfence.plan_step$$, '42501', NULL, 'the executing role still cannot read the receipts table directly');
RESET ROLE;

-- =============================================================================================
-- External steps: handed out by plan_run_step, recorded by plan_record_step
-- =============================================================================================
INSERT INTO ids SELECT 'x', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "x1", "v": 1}},
    {"action": "tap-hook", "args": {"recipient": "http://127.0.0.1:9/hook", "payload": {"n": 2}}},
    {"action": "tap-put", "args": {"k": "x3", "v": 3}},
    {"action": "tap-hook", "args": {"recipient": "http://127.0.0.1:9/hook"}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('x'), 'tap-alice'), 'approved', 'approve a plan with external steps');
SELECT isnt(pgfence.plan_start(pg_temp.pid('x'), 'tap-w1'), NULL, 'start it');
SELECT is((SELECT (outcome, idempotency_key)::text FROM pgfence.plan_run_step(pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x'))),
  format('(ok,%s)', pgfence._plan_step_key(pg_temp.pid('x'), 1)), 'step 1 (sql) ok, with the idempotency key of _plan_step_key');
SELECT results_eq(
  $$SELECT step_index, action, outcome, status, args, idempotency_key FROM pgfence.plan_run_step(pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x'))$$,
  $$VALUES (2, 'tap-hook'::text, 'external'::text, 'executing'::text,
            '{"recipient": "http://127.0.0.1:9/hook", "payload": {"n": 2}}'::jsonb, 'pgfence-plan-' || pg_temp.pid('x') || '-step-2')$$,
  'an external step is handed out, not run: args and idempotency key = plan id + step index');
SELECT is((SELECT external_started_at FROM pgfence.plan WHERE id = pg_temp.pid('x')), now(), '... and marked in flight');
SELECT is((SELECT state FROM pgfence.plan_steps(pg_temp.pid('x')) WHERE step_index = 2), 'running', 'plan_steps shows it running');
SELECT results_eq($$SELECT step_index, outcome FROM pgfence.plan_run_step(pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x'))$$,
  $$VALUES (2, 'external'::text)$$, 'asking again hands out the same external step (nothing runs past it)');
SELECT is(pgfence.plan_record_step(pg_temp.pid('x'), 2, 'tap-w2', pg_temp.tok('x'), true, '{"http_status": 200}'), false, 'record by another worker: refused (false)');
SELECT throws_ok(format('SELECT pgfence.plan_record_step(%s, 3, %L, %s, true)', pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x')), 'PF104', NULL, 'record a step after the next one: PF104');
SELECT throws_ok(format('SELECT pgfence.plan_record_step(%s, 9, %L, %s, true)', pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x')), '22023', NULL, 'record a step outside the plan: 22023');
SELECT throws_ok(format('SELECT pgfence.plan_record_step(%s, 2, %L, %s, false)', pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x')), '22004', NULL, 'record a failure without its error: 22004');
SELECT throws_ok($$SELECT pgfence.plan_record_step(-1, 1, 'tap-w1', 1, true)$$, 'P0002', NULL, 'record for an unknown plan: P0002');
SELECT is(pgfence.plan_record_step(pg_temp.pid('x'), 2, 'tap-w1', pg_temp.tok('x'), true, '{"http_status": 200}'), true, 'the owner records the external step');
SELECT results_eq($$SELECT outcome, kind, output, worker FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('x') AND step_index = 2$$,
  $$VALUES ('ok'::text, 'external'::text, '{"http_status": 200}'::jsonb, 'tap-w1'::text)$$, 'its receipt');
SELECT results_eq($$SELECT next_step, external_started_at IS NULL FROM pgfence.plan WHERE id = pg_temp.pid('x')$$,
  $$VALUES (3, true)$$, 'the plan moved to step 3; nothing in flight');
SELECT is(pgfence.plan_record_step(pg_temp.pid('x'), 2, 'tap-w1', pg_temp.tok('x'), true, '{"http_status": 200}'), false, 'recording it again (redelivered report): false, nothing changes');
SELECT throws_ok(format('SELECT pgfence.plan_record_step(%s, 3, %L, %s, true)', pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x')), 'PF105', NULL, 'record a SQL step: PF105');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x'))), 'ok', 'step 3 (sql) ok');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('x'), 'tap-w1', pg_temp.tok('x'))), 'external', 'step 4 handed out');
SELECT is(pgfence.plan_record_step(pg_temp.pid('x'), 4, 'tap-w1', pg_temp.tok('x'), false, NULL, 'HTTP 410 Gone'), true, 'record an external failure');
SELECT results_eq($$SELECT status, failure, next_step FROM pgfence.plan WHERE id = pg_temp.pid('x')$$,
  $$VALUES ('failed'::text, 'step_error'::text, 4)$$, 'an external error fails the plan at that step');
SELECT is((SELECT message FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('x') AND step_index = 4), 'HTTP 410 Gone', 'with the transport''s message');

-- =============================================================================================
-- Heartbeat, lazy heal, reaper; a stale worker is refused afterwards
-- =============================================================================================
INSERT INTO ids SELECT 'hb', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "h1", "v": 1}}, {"action": "tap-put", "args": {"k": "h2", "v": 2}}]', 'tap-agent');
INSERT INTO ids SELECT 'hb2', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "i1", "v": 1}}, {"action": "tap-put", "args": {"k": "i2", "v": 1}}]', 'tap-agent');
INSERT INTO ids SELECT 'hb3', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "j1", "v": 1}}, {"action": "tap-hook", "args": {"recipient": "http://127.0.0.1:9/j"}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('hb'), 'tap-alice') || pgfence.plan_approve(pg_temp.pid('hb2'), 'tap-alice') || pgfence.plan_approve(pg_temp.pid('hb3'), 'tap-alice'),
  'approvedapprovedapproved', 'approve three plans');
SELECT isnt(pgfence.plan_start(pg_temp.pid('hb'), 'tap-w1', interval '30 seconds'), NULL, 'start with a 30 s heartbeat');
SELECT is(pgfence.plan_heartbeat(pg_temp.pid('hb'), 'tap-w1', pg_temp.tok('hb')), true, 'the owner heartbeats');
SELECT is((SELECT heartbeat_expires_at FROM pgfence.plan WHERE id = pg_temp.pid('hb')), now() + interval '30 seconds', 'deadline = now() + its interval');
SELECT is(pgfence.plan_heartbeat(pg_temp.pid('hb'), 'tap-w2', pg_temp.tok('hb')), false, 'another worker''s heartbeat is refused');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hb'), 'tap-w1', pg_temp.tok('hb'))), 'ok', 'step 1 ok');
SELECT ok((SELECT heartbeat_expires_at >= now() + interval '30 seconds' FROM pgfence.plan WHERE id = pg_temp.pid('hb')), 'a receipt stamps the heartbeat too');
-- A receipt keeps a deadline within the slack (a tenth of the interval, at most 1 s) below a
-- fresh one, so that the step's update of the plan row changes no indexed column (HOT); it is
-- never later than a fresh deadline. The clock is not faked: the deadline is moved by hand and
-- compared with clock_timestamp() around the step.
INSERT INTO ids SELECT 'hs', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "s1", "v": 1}}, {"action": "tap-put", "args": {"k": "s2", "v": 1}}, {"action": "tap-put", "args": {"k": "s3", "v": 1}}, {"action": "tap-put", "args": {"k": "s4", "v": 1}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('hs'), 'tap-alice'), 'approved', 'approve a plan for the deadline slack');
SELECT isnt(pgfence.plan_start(pg_temp.pid('hs'), 'tap-w1', interval '30 seconds'), NULL, 'start it with a 30 s heartbeat (slack 1 s)');
CREATE TEMP TABLE hs_t (what text PRIMARY KEY, at timestamptz);
UPDATE pgfence.plan SET heartbeat_expires_at = clock_timestamp() + interval '29.7 seconds' WHERE id = pg_temp.pid('hs')
  RETURNING heartbeat_expires_at AS kept \gset
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hs'), 'tap-w1', pg_temp.tok('hs'))), 'ok', 'a step with the deadline 0.3 s below a fresh one');
SELECT is((SELECT heartbeat_expires_at FROM pgfence.plan WHERE id = pg_temp.pid('hs')), :'kept'::timestamptz, '... keeps the deadline (within the slack)');
SELECT ok((SELECT heartbeat_at >= :'kept'::timestamptz - interval '29.7 seconds' FROM pgfence.plan WHERE id = pg_temp.pid('hs')), '... and still stamps heartbeat_at');
UPDATE pgfence.plan SET heartbeat_expires_at = clock_timestamp() + interval '25 seconds' WHERE id = pg_temp.pid('hs');
INSERT INTO hs_t VALUES ('before', clock_timestamp());
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hs'), 'tap-w1', pg_temp.tok('hs'))), 'ok', 'a step with the deadline 5 s below a fresh one');
INSERT INTO hs_t VALUES ('after', clock_timestamp());
SELECT ok((SELECT p.heartbeat_expires_at >= b.at + interval '30 seconds' AND p.heartbeat_expires_at <= a.at + interval '30 seconds'
           FROM pgfence.plan p, hs_t b, hs_t a WHERE p.id = pg_temp.pid('hs') AND b.what = 'before' AND a.what = 'after'),
  '... renews it from the moment the step ended (outside the slack)');
UPDATE pgfence.plan SET heartbeat_expires_at = clock_timestamp() + interval '60 seconds' WHERE id = pg_temp.pid('hs');
DELETE FROM hs_t;
INSERT INTO hs_t VALUES ('before', clock_timestamp());
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hs'), 'tap-w1', pg_temp.tok('hs'))), 'ok', 'a step with a deadline later than a fresh one');
INSERT INTO hs_t VALUES ('after', clock_timestamp());
SELECT ok((SELECT p.heartbeat_expires_at >= b.at + interval '30 seconds' AND p.heartbeat_expires_at <= a.at + interval '30 seconds'
           FROM pgfence.plan p, hs_t b, hs_t a WHERE p.id = pg_temp.pid('hs') AND b.what = 'before' AND a.what = 'after'),
  '... brings it back to a fresh one: a receipt never keeps a run alive longer than its interval');
SELECT is((SELECT array_agg(reloptions::text ORDER BY relname) FROM pg_class WHERE relnamespace = 'pgfence'::regnamespace AND relname IN ('plan', 'plan_step')),
  ARRAY['{fillfactor=90}', '{fillfactor=70}'], 'plan and plan_step pages leave room for HOT step updates (migration 0027)');
-- The step's commit in one statement (migration 0027): who may skip the plan triggers.
SELECT is((SELECT array_agg(p.proname::text ORDER BY p.proname) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace AND p.prosrc ~ '(receipt_nonce|plan_writing)'),
          ARRAY['_plan_commit_step'],
  'only _plan_commit_step changes receipt_nonce or sets pgfence.plan_writing (the trigger bypass)');
SELECT is((SELECT array_agg(r.rolname::text ORDER BY r.rolname) FROM pg_roles r
           WHERE NOT r.rolsuper AND r.rolname NOT IN ('pgfence_definer', 'pg_write_all_data')
             AND r.oid NOT IN (SELECT c.relowner FROM pg_class c
                               WHERE c.oid IN ('pgfence.plan'::regclass, 'pgfence.plan_step'::regclass))
             AND (has_table_privilege(r.oid, 'pgfence.plan', 'INSERT, UPDATE, DELETE, TRUNCATE')
                  OR has_table_privilege(r.oid, 'pgfence.plan_step', 'INSERT, UPDATE, DELETE, TRUNCATE'))),
          NULL,
  'no role but the tables'' owner and pgfence_definer (and the superuser-granted pg_write_all_data) may write plans or steps');
SELECT is((SELECT array_agg(tgname::text ORDER BY tgname) FROM pg_trigger
           WHERE tgrelid IN ('pgfence.plan'::regclass, 'pgfence.plan_step'::regclass) AND NOT tgisinternal
             AND pg_get_triggerdef(oid) ~ 'NOT \(new\.receipt_nonce IS DISTINCT FROM old\.receipt_nonce\)'),
          ARRAY['plan_guard', 'plan_step_guard'],
  'plan_guard and plan_step_guard are skipped only for a row whose receipt_nonce changed (to the setting''s value)');
SELECT is((SELECT array_agg(tgname::text ORDER BY tgname) FROM pg_trigger
           WHERE tgrelid = 'pgfence.plan_step'::regclass AND NOT tgisinternal),
          ARRAY['plan_step_guard', 'plan_step_new_guard', 'plan_step_no_truncate', 'plan_step_purge_only'],
  'no trigger logs receipts (migration 0034: a receipt is its step''s row; plan_step_event is gone)');
SELECT is((SELECT count(*)::int FROM pg_trigger WHERE tgrelid = 'pgfence.plan_step'::regclass AND tgname = 'plan_step_new_guard'
           AND tgtype & 4 <> 0 AND tgqual IS NULL), 1, 'every INSERT of a step is guarded (plan_step_new_guard, no WHEN)');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hs'), 'tap-w1', pg_temp.tok('hs'))), 'ok', 'fast path: the last step');
SELECT is(current_setting('pgfence.plan_writing', true), '', 'fast path: the setting is cleared after the commit (the nonce does not leak)');
SELECT results_eq($$SELECT status, next_step, updated_at = now(), receipt_nonce IS NOT NULL FROM pgfence.plan WHERE id = pg_temp.pid('hs')$$,
  $$VALUES ('executed'::text, 5, true, true)$$, 'fast path: executed in the same statement, updated_at stamped as the guard does');
SELECT results_eq($$SELECT event, actor, fence, detail FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('hs') AND event IN ('receipt', 'finish') ORDER BY id DESC$$,
  $$VALUES ('finish'::text, 'tap-w1'::text, NULL::bigint, '{"steps": 4, "worker": "tap-w1"}'::jsonb)$$,
  'fast path: the finish event (plan_event_update still runs, actor the worker), and no receipt event (migration 0034)');
SELECT results_eq($$SELECT step_index, outcome, output, worker, db_user = session_user, started_at = now(), finished_at >= started_at FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('hs') ORDER BY step_index$$,
  $$VALUES (1, 'ok'::text, '{"put": "s1"}'::jsonb, 'tap-w1'::text, true, true, true), (2, 'ok', '{"put": "s2"}', 'tap-w1', true, true, true),
           (3, 'ok', '{"put": "s3"}', 'tap-w1', true, true, true), (4, 'ok', '{"put": "s4"}', 'tap-w1', true, true, true)$$,
  'fast path: each receipt is its step''s row, with worker, times and the login that wrote it (db_user)');
-- A caller that knows the rows' nonces and pre-sets the setting to one gains nothing: a hand
-- UPDATE that does not change receipt_nonce, or changes it to another value, is still guarded.
SELECT set_config('pgfence.plan_writing', (SELECT receipt_nonce::text FROM pgfence.plan WHERE id = pg_temp.pid('hs')), true);
SELECT throws_ok($$UPDATE pgfence.plan SET next_step = 2 WHERE id = pg_temp.pid('hs')$$, 'PF002', NULL,
  'a pre-set setting equal to the plan''s nonce: a hand UPDATE of the plan is still guarded');
SELECT throws_ok($$UPDATE pgfence.plan SET next_step = 2, receipt_nonce = gen_random_uuid() WHERE id = pg_temp.pid('hs')$$, 'PF002', NULL,
  'a new nonce that is not the setting''s value: still guarded');
SELECT set_config('pgfence.plan_writing', (SELECT receipt_nonce::text FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('hs') AND step_index = 4), true);
SELECT throws_ok($$UPDATE pgfence.plan_step SET output = '{"forged": true}' WHERE plan_id = pg_temp.pid('hs') AND step_index = 4$$, 'PF002', NULL,
  'a pre-set setting equal to the receipt''s nonce: a hand UPDATE of the receipt is still guarded');
SELECT set_config('pgfence.plan_writing', '', true);
-- the worker dies: back-date its heartbeat (the clock is never faked)
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = pg_temp.pid('hb');
SELECT results_eq($$SELECT status, failure, next_step FROM pgfence.plan_get(pg_temp.pid('hb'))$$,
  $$VALUES ('failed'::text, 'interrupted'::text, 2)$$, 'plan_get heals lazily: failed (interrupted) at step 2');
SELECT is((SELECT array_agg(state ORDER BY step_index) FROM pgfence.plan_steps(pg_temp.pid('hb'))), ARRAY['ok','not_run'], 'the committed step keeps its receipt');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('hb'), 'tap-w1', pg_temp.tok('hb'))$$,
  $$VALUES (NULL::text, 'failed'::text)$$, 'the worker that comes back cannot run a step');
SELECT is(pgfence.plan_heartbeat(pg_temp.pid('hb'), 'tap-w1', pg_temp.tok('hb')), false, '... nor heartbeat');
SELECT is((SELECT count(*)::int FROM public.tap_plan_t WHERE k = 'h2'), 0, 'step 2 never ran');
SELECT is((SELECT detail ->> 'reason' FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('hb') AND event = 'fail'), 'interrupted', 'the fail event says interrupted');

-- the owner's own lock-and-check heals too: a lapsed run is not resumed by a late worker
SELECT isnt(pgfence.plan_start(pg_temp.pid('hb2'), 'tap-w1'), NULL, 'start hb2');
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = pg_temp.pid('hb2');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('hb2'), 'tap-w1', pg_temp.tok('hb2'))$$,
  $$VALUES (NULL::text, 'failed'::text)$$, 'plan_run_step after a lapse: refused, and the plan is failed');
SELECT is((SELECT failure FROM pgfence.plan WHERE id = pg_temp.pid('hb2')), 'interrupted', '... (interrupted)');
SELECT is(pgfence.plan_start(pg_temp.pid('hb2'), 'tap-w1'), NULL, 'and cannot be started again');

-- an external step in flight when the run lapses: outcome unknown; the late report is refused
SELECT isnt(pgfence.plan_start(pg_temp.pid('hb3'), 'tap-w1'), NULL, 'start hb3');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hb3'), 'tap-w1', pg_temp.tok('hb3'))), 'ok', 'step 1 ok');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('hb3'), 'tap-w1', pg_temp.tok('hb3'))), 'external', 'step 2 (external) handed out');
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = pg_temp.pid('hb3');
SELECT is(pgfence.plan_reap_stale(), 1, 'the reaper fails the lapsed run (called by its deprecated name plan_reap_stale, a wrapper of plan_reap)');
SELECT is(split_part(obj_description('pgfence.plan_reap_stale(integer)'::regprocedure, 'pg_proc'), E'\n', 1) LIKE 'Deprecated: use pgfence.plan_reap.%', true,
  'plan_reap_stale says it is deprecated, and what to call instead');
SELECT is((SELECT array_agg(state ORDER BY step_index) FROM pgfence.plan_steps(pg_temp.pid('hb3'))), ARRAY['ok','unknown'],
  'the external step in flight is shown as unknown (it may have happened)');
SELECT is(pgfence.plan_record_step(pg_temp.pid('hb3'), 2, 'tap-w1', pg_temp.tok('hb3'), true, '{}'), false, 'the stale worker''s late report is refused');
SELECT is((SELECT count(*)::int FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('hb3')), 1, '... and wrote no receipt');
SELECT is(pgfence.plan_reap(), 0, 'the reaper has nothing more to do');
SELECT throws_ok($$SELECT pgfence.plan_reap(0)$$, '22023', NULL, 'plan_reap(0): 22023');
SELECT throws_ok($$SELECT pgfence.plan_heartbeat(-1, 'tap-w1', 1)$$, 'P0002', NULL, 'heartbeat for an unknown plan: P0002');

-- =============================================================================================
-- The run token: every take bumps it; an older token is refused, whatever the worker's name
-- =============================================================================================
INSERT INTO ids SELECT 'tok', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "t1", "v": 1}}, {"action": "tap-hook", "args": {"recipient": "http://127.0.0.1:9/t"}},
    {"action": "tap-put", "args": {"k": "t3", "v": 3}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('tok'), 'tap-alice'), 'approved', 'approve tok');
SELECT is((SELECT run_token FROM pgfence.plan WHERE id = pg_temp.pid('tok')), 0::bigint, 'an approved plan has token 0: nobody holds it');
SELECT is(pgfence.plan_start(pg_temp.pid('tok'), 'pod-9'), 1::bigint, 'pod-9 takes the run: token 1');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('tok'), 'pod-9', 1)), 'ok', 'token 1 runs step 1');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('tok'), 'pod-9', 1)), 'external', 'token 1 is handed external step 2');
SELECT is(pgfence.plan_start(pg_temp.pid('tok'), 'pod-9'), 2::bigint, 'a second process named pod-9 re-enters the live run: token 2');
SELECT results_eq($$SELECT actor, from_status, to_status, detail FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('tok') AND event = 'reenter'$$,
  $$VALUES ('pod-9'::text, 'executing'::text, 'executing'::text,
            '{"worker": "pod-9", "token": 2, "previous_token": 1, "step": 2, "external_in_flight": true}'::jsonb)$$,
  'the re-entry is an event: who, the new and the previous token, the step, and that an external step was in flight');
SELECT results_eq($$SELECT step_index, outcome, status FROM pgfence.plan_run_step(pg_temp.pid('tok'), 'pod-9', 1)$$,
  $$VALUES (NULL::int, NULL::text, 'executing'::text)$$, 'the holder of token 1 is refused: nothing handed out, although its name is the owner''s');
SELECT is(pgfence.plan_heartbeat(pg_temp.pid('tok'), 'pod-9', 1), false, '... its heartbeat is refused');
SELECT is(pgfence.plan_record_step(pg_temp.pid('tok'), 2, 'pod-9', 1, true, '{"by": "token 1"}'), false, '... its report of the external step is refused');
SELECT is(pgfence.plan_release(pg_temp.pid('tok'), 'pod-9', 1), false, '... and so is its release');
SELECT is(pgfence.plan_heartbeat(pg_temp.pid('tok'), 'pod-9', 3), false, 'a token not issued yet is refused too');
SELECT is(pgfence.plan_heartbeat(pg_temp.pid('tok'), 'pod-9', 2), true, 'token 2 is the owner: its heartbeat counts');
SELECT is(pgfence.plan_record_step(pg_temp.pid('tok'), 2, 'pod-9', 2, true, '{"by": "token 2"}'), true, 'token 2 records the external step');
SELECT is((SELECT output FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('tok') AND step_index = 2), '{"by": "token 2"}'::jsonb, '... its receipt is the one written');
SELECT is(pgfence.plan_release(pg_temp.pid('tok'), 'pod-9', 2), true, 'token 2 releases the run');
SELECT is(pgfence.plan_start(pg_temp.pid('tok'), 'tap-w3'), 3::bigint, 'a takeover of the released run: token 3');
SELECT is((SELECT detail ->> 'token' FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('tok') AND event = 'take'), '3', 'the take event names the new token');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('tok') AND event = 'reenter'), 1, 'a takeover under another name is a take, not a re-entry');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('tok'), 'tap-w3', 3)$$, $$VALUES ('ok'::text, 'executed'::text)$$, 'token 3 finishes the plan');
SELECT throws_ok(format('SELECT * FROM pgfence.plan_run_step(%s, %L, NULL)', pg_temp.pid('tok'), 'tap-w3'), '22004', NULL, 'plan_run_step without a token: 22004');
SELECT throws_ok(format('SELECT pgfence.plan_record_step(%s, 2, %L, NULL, true)', pg_temp.pid('tok'), 'tap-w3'), '22004', NULL, 'plan_record_step without a token: 22004');
SELECT throws_ok(format('SELECT pgfence.plan_heartbeat(%s, %L, NULL)', pg_temp.pid('tok'), 'tap-w3'), '22004', NULL, 'plan_heartbeat without a token: 22004');
SELECT throws_ok(format('SELECT pgfence.plan_release(%s, %L, NULL)', pg_temp.pid('tok'), 'tap-w3'), '22004', NULL, 'plan_release without a token: 22004');
SELECT throws_ok(format('UPDATE pgfence.plan SET run_token = 1 WHERE id = %s', pg_temp.pid('tok')), 'PF002', NULL, 'the run token never goes back: PF002');
SELECT throws_ok(format('SELECT pgfence.plan_heartbeat(%s, %L, 0)', pg_temp.pid('tok'), 'tap-w3'), '22023', NULL, 'token 0 is never issued: 22023');
SELECT is((SELECT array_agg(step_index::text || ':' || worker ORDER BY step_index) FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('tok')),
  ARRAY['1:pod-9', '2:pod-9', '3:tap-w3'], 'receipts: steps 1 and 2 by pod-9 (tokens 1 and 2), step 3 by tap-w3');

-- =============================================================================================
-- Release and take over; claim with SKIP LOCKED; external-only takers
-- =============================================================================================
INSERT INTO ids SELECT 'rel', pgfence.plan_propose(
  '[{"action": "tap-put", "args": {"k": "r1", "v": 1}}, {"action": "tap-hook", "args": {"recipient": "http://127.0.0.1:9/r"}},
    {"action": "tap-put", "args": {"k": "r3", "v": 3}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('rel'), 'tap-alice'), 'approved', 'approve rel');
SELECT is((SELECT count(*)::int FROM pgfence.plan_claim('tap-ext', 10, true)), 0, 'an external-only claimer does not take approved plans');
SELECT results_eq($$SELECT id, next_step, step_count, next_kind, run_token FROM pgfence.plan_claim('tap-w1', 10)$$,
  $$VALUES (pg_temp.pid('rel'), 1, 3, 'sql'::text, 1::bigint)$$, 'plan_claim takes the approved plan, with its first run token');
SELECT is((SELECT worker FROM pgfence.plan WHERE id = pg_temp.pid('rel')), 'tap-w1', 'claimed by tap-w1');
SELECT is((SELECT count(*)::int FROM pgfence.plan_claim('tap-w2', 10)), 0, 'nothing left to claim');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('rel'), 'tap-w1', pg_temp.tok('rel'))), 'ok', 'step 1 ok');
SELECT is(pgfence.plan_release(pg_temp.pid('rel'), 'tap-w2', pg_temp.tok('rel')), false, 'only the owner can release');
SELECT is(pgfence.plan_release(pg_temp.pid('rel'), 'tap-w1', pg_temp.tok('rel')), true, 'the owner releases before the external step');
SELECT results_eq($$SELECT status, worker, heartbeat_expires_at FROM pgfence.plan WHERE id = pg_temp.pid('rel')$$,
  $$VALUES ('executing'::text, NULL::text, now() + interval '120 seconds')$$, 'released: executing without owner, to be taken within a heartbeat');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('rel'), 'tap-w1', pg_temp.tok('rel'))$$,
  $$VALUES (NULL::text, 'executing'::text)$$, 'the former owner is refused');
SELECT results_eq($$SELECT id, next_kind, run_token FROM pgfence.plan_claim('tap-ext', 10, true)$$,
  $$VALUES (pg_temp.pid('rel'), 'external'::text, 2::bigint)$$, 'an external-only claimer takes the released run whose next step is external, under the next token');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('rel'), 'tap-ext', pg_temp.tok('rel'), true)), 'external', 'it is handed the external step');
SELECT is(pgfence.plan_record_step(pg_temp.pid('rel'), 2, 'tap-ext', pg_temp.tok('rel'), true, '{"http_status": 204}'), true, '... records it');
SELECT results_eq($$SELECT step_index, outcome, status FROM pgfence.plan_run_step(pg_temp.pid('rel'), 'tap-ext', pg_temp.tok('rel'), true)$$,
  $$VALUES (3, 'released'::text, 'executing'::text)$$, 'an external-only runner reaching a SQL step runs nothing and releases the run');
SELECT results_eq($$SELECT worker, next_step FROM pgfence.plan WHERE id = pg_temp.pid('rel')$$,
  $$VALUES (NULL::text, 3)$$, '... released, still at step 3');
SELECT is((SELECT count(*)::int FROM public.tap_plan_t WHERE k = 'r3'), 0, '... and step 3 did not run');
SELECT is((SELECT count(*)::int FROM pgfence.plan_claim('tap-ext', 10, true)), 0, 'an external-only claimer leaves a run whose next step is SQL');
SELECT isnt(pgfence.plan_start(pg_temp.pid('rel'), 'tap-w3'), NULL, 'a SQL runner takes it over with plan_start');
SELECT results_eq($$SELECT outcome, status FROM pgfence.plan_run_step(pg_temp.pid('rel'), 'tap-w3', pg_temp.tok('rel'))$$,
  $$VALUES ('ok'::text, 'executed'::text)$$, 'and finishes it');
SELECT results_eq($$SELECT step_index, worker FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('rel') ORDER BY step_index$$,
  $$VALUES (1, 'tap-w1'::text), (2, 'tap-ext'), (3, 'tap-w3')$$, 'each receipt names the worker that ran the step');
SELECT throws_ok($$SELECT * FROM pgfence.plan_claim('tap-w1', 0)$$, '22023', NULL, 'plan_claim batch 0: 22023');

-- =============================================================================================
-- Retired action after approval; dropped function
-- =============================================================================================
SELECT is(pgfence.plan_register_action('tap-other', 'public.tap_plan_other(jsonb)', 'echo'), true, 'register tap-other');
INSERT INTO ids SELECT 'ret', pgfence.plan_propose('[{"action": "tap-other", "args": {"a": 1}}]', 'tap-agent');
INSERT INTO ids SELECT 'drop', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "d", "v": 1}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('ret'), 'tap-alice') || pgfence.plan_approve(pg_temp.pid('drop'), 'tap-alice'), 'approvedapproved', 'approve both');
SELECT is(pgfence.plan_retire_action('tap-other'), true, 'retire its action after approval');
SELECT isnt(pgfence.plan_start(pg_temp.pid('ret'), 'tap-w1'), NULL, 'start it');
SELECT is((SELECT retired FROM pgfence._plan_step_begin(pg_temp.pid('ret'), 'tap-w1', pg_temp.tok('ret'))), true, 'the step of the retired action, begun by hand ...');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'tap-w1', %s, 1, true, '{}', NULL)$$, pg_temp.pid('ret'), pg_temp.tok('ret')),
  'PF101', NULL, '... gets no ok receipt: PF101 (the check plan_run_step makes before running it)');
SELECT results_eq($$SELECT outcome, error ->> 'sqlstate' FROM pgfence.plan_run_step(pg_temp.pid('ret'), 'tap-w1', pg_temp.tok('ret'))$$,
  $$VALUES ('error'::text, 'PF101'::text)$$, 'a step of a retired action records an error receipt (PF101) instead of running');
SAVEPOINT before_drop;
DROP FUNCTION public.tap_plan_put(jsonb);
SELECT isnt(pgfence.plan_start(pg_temp.pid('drop'), 'tap-w1'), NULL, 'start a plan whose function was dropped');
SELECT is((SELECT fn_name FROM pgfence._plan_step_begin(pg_temp.pid('drop'), 'tap-w1', pg_temp.tok('drop'))), NULL, 'its step, begun by hand, has no function to call ...');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'tap-w1', %s, 1, true, '{}', NULL)$$, pg_temp.pid('drop'), pg_temp.tok('drop')),
  '42883', NULL, '... and gets no ok receipt: 42883');
SELECT results_eq($$SELECT outcome, error ->> 'sqlstate' FROM pgfence.plan_run_step(pg_temp.pid('drop'), 'tap-w1', pg_temp.tok('drop'))$$,
  $$VALUES ('error'::text, '42883'::text)$$, 'a dropped function records an error receipt (42883)');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "gone", "v": 1}}]', 'tap-agent')$$, '42883', NULL,
  'proposing a step whose action''s function was dropped: 42883');
ROLLBACK TO SAVEPOINT before_drop;

-- =============================================================================================
-- Compensation: a new plan, with its own approval, referencing the one it undoes
-- =============================================================================================
SELECT throws_ok(format($$SELECT pgfence.plan_compensate(%s, '[{"action": "tap-put", "args": {"k": "u", "v": 1}}]', 'tap-agent')$$, pg_temp.pid('key')),
  'PF106', NULL, 'compensating a pending plan: PF106');
SELECT throws_ok($$SELECT pgfence.plan_compensate(-1, '[{"action": "tap-put"}]', 'tap-agent')$$, 'P0002', NULL, 'compensating an unknown plan: P0002');
SELECT throws_ok($$SELECT pgfence.plan_compensate(NULL, '[{"action": "tap-put"}]', 'tap-agent')$$, '22004', NULL, 'compensating NULL: 22004');
INSERT INTO ids SELECT 'comp', pgfence.plan_compensate(pg_temp.pid('f'), '[{"action": "tap-put", "args": {"k": "undo-f", "v": 0}}]', 'tap-agent');
SELECT results_eq($$SELECT status, compensates FROM pgfence.plan_get(pg_temp.pid('comp'))$$,
  $$VALUES ('pending'::text, pg_temp.pid('f'))$$, 'the compensating plan is pending (needs its own approval) and references the failed one');
SELECT is((SELECT compensated_by FROM pgfence.plan_get(pg_temp.pid('f'))), ARRAY[pg_temp.pid('comp')], 'plan_get of the original lists its compensation');
SELECT is((SELECT array_agg(k ORDER BY k) FROM public.tap_plan_t WHERE k LIKE 'f%'), ARRAY['f1','f2'], 'proposing a compensation rolls nothing back');

-- =============================================================================================
-- Status machine guard: hand-written UPDATEs
-- =============================================================================================
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET args = '{"k": "evil", "v": 1}' WHERE plan_id = %s$$, pg_temp.pid('key')), 'PF002', NULL, 'changing a step''s args: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET action = 'tap-boom' WHERE plan_id = %s$$, pg_temp.pid('key')), 'PF002', NULL, 'changing a step''s action: PF002');
SELECT throws_ok(format($$DELETE FROM pgfence.plan_step WHERE plan_id = %s$$, pg_temp.pid('key')), 'PF002', NULL, 'deleting a step: PF002');
SELECT throws_ok(format($$INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function, args) VALUES (%s, 2, 'tap-put', 'sql', 'x', '{}')$$, pg_temp.pid('key')),
  'PF001', NULL, 'adding a step to a proposed plan: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan SET step_count = 2 WHERE id = %s$$, pg_temp.pid('key')), 'PF002', NULL, 'changing the step count: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan SET expires_at = expires_at + interval '1 day' WHERE id = %s$$, pg_temp.pid('key')), 'PF002', NULL, 'extending its expiry: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan SET approved_by = 'mallory' WHERE id = %s$$, pg_temp.pid('p1')), 'PF002', NULL, 'changing who approved: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan SET status = 'executing', worker = 'x', started_at = now(), heartbeat_interval = '1 minute', heartbeat_at = now(), heartbeat_expires_at = now() WHERE id = %s$$, pg_temp.pid('key')),
  'PF001', NULL, 'pending -> executing without approval: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan SET status = 'executing', finished_at = NULL WHERE id = %s$$, pg_temp.pid('p1')), 'PF001', NULL, 'executed -> executing: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan SET status = 'pending', failure = NULL, finished_at = NULL, approved_by = NULL, approved_at = NULL WHERE id = %s$$, pg_temp.pid('f')),
  'PF002', NULL, 'a failed plan back to pending: refused');
SELECT throws_ok(format($$UPDATE pgfence.plan SET reject_reason = 'edited' WHERE id = %s$$, pg_temp.pid('rej')), 'PF001', NULL, 'any change to a rejected plan: PF001');
INSERT INTO ids SELECT 'g', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "g1", "v": 1}}, {"action": "tap-put", "args": {"k": "g2", "v": 1}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('g'), 'tap-alice'), 'approved', 'approve g');
SELECT isnt(pgfence.plan_start(pg_temp.pid('g'), 'tap-w1'), NULL, 'start g');
SELECT throws_ok(format($$UPDATE pgfence.plan SET next_step = 2 WHERE id = %s$$, pg_temp.pid('g')), 'PF001', NULL, 'skipping a step without its receipt: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan SET worker = 'tap-thief' WHERE id = %s$$, pg_temp.pid('g')), 'PF001', NULL, 'handing a run to another worker without a release: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan SET status = 'failed', failure = 'step_error', finished_at = now() WHERE id = %s$$, pg_temp.pid('g')), 'PF001', NULL, 'step_error without an error receipt: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET outcome = 'ok', worker = 'tap-w1', started_at = now(), finished_at = now() WHERE plan_id = %s AND step_index = 2$$, pg_temp.pid('g')),
  'PF001', NULL, 'a hand-written receipt for a step that is not next: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET outcome = 'ok', worker = 'tap-w9', started_at = now(), finished_at = now() WHERE plan_id = %s AND step_index = 1$$, pg_temp.pid('g')),
  'PF001', NULL, 'a receipt by a worker that does not own the run: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET outcome = 'ok', worker = 'tap-w1', started_at = now(), finished_at = now() WHERE plan_id = %s AND step_index = 1$$, pg_temp.pid('key')),
  'PF001', NULL, 'a receipt for a plan that is not executing: PF001');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET outcome = 'ok', error = NULL WHERE plan_id = %s AND step_index = 3$$, pg_temp.pid('f')), 'PF002', NULL, 'editing a receipt: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET db_user = 'forged' WHERE plan_id = %s AND step_index = 3$$, pg_temp.pid('f')), 'PF002', NULL, 'editing a receipt''s login: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET function_xmin = '1234' WHERE plan_id = %s AND step_index = 2$$, pg_temp.pid('g')), 'PF002', NULL,
  'forging the recorded row version of a step''s function (function_xmin): PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan_step SET function_oid = 'public.tap_plan_t'::regclass::oid WHERE plan_id = %s AND step_index = 2$$, pg_temp.pid('g')), 'PF002', NULL,
  '... and its oid (function_oid): PF002');
SAVEPOINT hand_receipt;
UPDATE pgfence.plan_step SET outcome = 'ok', worker = 'tap-w1', started_at = now(), finished_at = now(), db_user = 'forged'
WHERE plan_id = pg_temp.pid('g') AND step_index = 1;
SELECT is((SELECT db_user FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('g') AND step_index = 1), session_user::text,
  'a hand-written receipt (by the owner, for the next step) gets the login that wrote it, whatever it says (tg_plan_step_guard)');
ROLLBACK TO SAVEPOINT hand_receipt;
SELECT is((SELECT db_user FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('g') AND step_index = 2), NULL, '... a step without a receipt has none');
SELECT throws_ok(format($$UPDATE pgfence.plan SET next_step = 1 WHERE id = %s$$, pg_temp.pid('f')), 'PF002', NULL, 'next_step going back: PF002');
SET LOCAL session_replication_role = replica;  -- past the insert guard, down to the CHECK
SELECT throws_ok($$INSERT INTO pgfence.plan (step_count, proposed_by, expires_at, status) VALUES (1, 'x', now() + interval '1 day', 'bogus')$$, '23514', NULL, 'the status CHECK refuses unknown values');
SET LOCAL session_replication_role = origin;

-- Row checks held by the guard triggers since migration 0030 (they were CHECK constraints): a
-- hand-written write that breaks one fails as before, 23514 with the constraint's name.
CREATE FUNCTION pg_temp.check_fails(p_sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  v_state text;
  v_table text;
  v_name  text;
BEGIN
  EXECUTE p_sql;
  RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
  GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_table = TABLE_NAME, v_name = CONSTRAINT_NAME;
  RETURN v_state || CASE WHEN v_state = '23514' THEN ' ' || v_table || '.' || v_name ELSE '' END;
END $$;
INSERT INTO ids SELECT 'ck_p', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "ck", "v": 1}}]', 'tap-agent');
INSERT INTO ids SELECT 'ck_a', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "ck", "v": 1}}]', 'tap-agent');
SELECT pgfence.plan_approve(pg_temp.pid('ck_a'), 'tap-approver');
INSERT INTO ids SELECT 'ck_e', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "ck1", "v": 1}}, {"action": "tap-put", "args": {"k": "ck2", "v": 1}}]', 'tap-agent');
SELECT pgfence.plan_approve(pg_temp.pid('ck_e'), 'tap-approver');
SELECT pgfence.plan_start(pg_temp.pid('ck_e'), 'tap-ck');
SELECT is((SELECT array_agg(conname::text ORDER BY conname) FROM pg_constraint WHERE conrelid = 'pgfence.plan'::regclass AND contype = 'c'),
  ARRAY['plan_expires_after_proposal', 'plan_failure_check', 'plan_idempotency_key_check', 'plan_run_token_nonnegative', 'plan_status_check', 'plan_step_count'],
  'plan keeps its simple CHECKs declared; the multi-column ones are held by plan_guard (migration 0030)');
SELECT is((SELECT array_agg(conname::text ORDER BY conname) FROM pg_constraint WHERE conrelid = 'pgfence.plan_step'::regclass AND contype = 'c'),
  ARRAY['plan_step_kind_check', 'plan_step_outcome_check', 'plan_step_step_index_check', 'plan_step_times'],
  'plan_step keeps its simple CHECKs declared; the others are held by plan_step_guard / plan_step_new_guard');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET status = 'approved' WHERE id = %s$$, pg_temp.pid('ck_p'))),
  '23514 plan.plan_approved_iff', 'approved without an approver: 23514 plan_approved_iff');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET status = 'executed', finished_at = now() WHERE id = %s$$, pg_temp.pid('ck_e'))),
  '23514 plan.plan_executed_all_steps', 'executed before its last step: 23514 plan_executed_all_steps');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET status = 'approved', approved_by = 'x', approved_at = now(), external_started_at = now() WHERE id = %s$$, pg_temp.pid('ck_p'))),
  '23514 plan.plan_external_in_flight', 'an external step in flight on a plan that is not running: 23514 plan_external_in_flight');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET failure = 'interrupted' WHERE id = %s$$, pg_temp.pid('ck_e'))),
  '23514 plan.plan_failure_iff_failed', 'a failure on a running plan: 23514 plan_failure_iff_failed');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET finished_at = now() WHERE id = %s$$, pg_temp.pid('ck_e'))),
  '23514 plan.plan_finished_iff_terminal', 'a finish time on a running plan: 23514 plan_finished_iff_terminal');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET heartbeat_at = NULL WHERE id = %s$$, pg_temp.pid('ck_e'))),
  '23514 plan.plan_heartbeat_while_executing', 'a running plan without a heartbeat: 23514 plan_heartbeat_while_executing');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET next_step = 4 WHERE id = %s$$, pg_temp.pid('ck_e'))),
  'PF001', 'next_step past the end: refused by the plan machine before plan_next_step_range (PF001, as before 0030)');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET status = 'rejected', finished_at = now() WHERE id = %s$$, pg_temp.pid('ck_p'))),
  '23514 plan.plan_rejected_iff', 'rejected without who, when and why: 23514 plan_rejected_iff');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET status = 'executing', worker = 'x', heartbeat_at = now(), heartbeat_expires_at = now() + interval '1 hour' WHERE id = %s$$, pg_temp.pid('ck_a'))),
  '23514 plan.plan_started_iff', 'executing without a start: 23514 plan_started_iff');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan SET step_begun = 1 WHERE id = %s$$, pg_temp.pid('ck_e'))),
  '23514 plan.plan_step_begun_whole', 'half a begin stamp: 23514 plan_step_begun_whole');
SELECT is(pg_temp.check_fails(format($$INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function, function_md5, args) VALUES (%s, 1, 'tap-put', 'sql', 'f', 'md5', '[]')$$, pg_temp.pid('ck_p'))),
  '23514 plan_step.plan_step_args_check', 'a step whose args are not an object: 23514 plan_step_args_check');
SELECT is(pg_temp.check_fails(format($$INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function, args) VALUES (%s, 1, 'tap-put', 'sql', 'f', '{}')$$, pg_temp.pid('ck_p'))),
  '23514 plan_step.plan_step_fingerprint_iff_sql', 'a sql step without its fingerprint: 23514 plan_step_fingerprint_iff_sql');
SELECT is(pg_temp.check_fails(format($$INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function, args) VALUES (%s, 1, 'tap-hook', 'external', 'f', '{}')$$, pg_temp.pid('ck_p'))),
  '23514 plan_step.plan_step_function_iff_sql', 'an external step with a function: 23514 plan_step_function_iff_sql');
SELECT is(pg_temp.check_fails(format($$INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, args, output) VALUES (%s, 1, 'tap-hook', 'external', '{}', '{}')$$, pg_temp.pid('ck_p'))),
  '23514 plan_step.plan_step_no_result_without_receipt', 'an output without a receipt: 23514 plan_step_no_result_without_receipt');
SELECT is(pg_temp.check_fails(format($$INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, args, worker) VALUES (%s, 1, 'tap-hook', 'external', '{}', 'x')$$, pg_temp.pid('ck_p'))),
  '23514 plan_step.plan_step_receipt_whole', 'half a receipt on a new step: 23514 plan_step_receipt_whole');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan_step SET outcome = 'error', error = '{}', worker = 'tap-ck', started_at = now(), finished_at = now() WHERE plan_id = %s AND step_index = 1$$, pg_temp.pid('ck_e'))),
  '23514 plan_step.plan_step_error_iff', 'an error receipt without a message, by hand: 23514 plan_step_error_iff');
SELECT is(pg_temp.check_fails(format($$UPDATE pgfence.plan_step SET worker = 'tap-ck' WHERE plan_id = %s AND step_index = 1$$, pg_temp.pid('ck_e'))),
  '23514 plan_step.plan_step_receipt_whole', 'half a receipt by hand: 23514 plan_step_receipt_whole');
SELECT is(pg_temp.check_fails(format($$SELECT pgfence._plan_step_finish(%s, 'tap-ck', %s, 1, false, NULL, '{"no": "message"}')$$, pg_temp.pid('ck_e'), pg_temp.tok('ck_e'))),
  '23514 plan_step.plan_step_error_iff', 'an error receipt without a message through _plan_step_finish (whose commit skips the guard): 23514 plan_step_error_iff');
-- A step begun in a subtransaction (its row locked by the subtransaction's xid) misses the
-- commit's one-statement fast path and is receipted by _plan_step_finish's slow path.
SAVEPOINT ck_sub;
SELECT results_eq(format($$SELECT outcome, status FROM pgfence.plan_run_step(%s, 'tap-ck', %s)$$, pg_temp.pid('ck_e'), pg_temp.tok('ck_e')),
  $$VALUES ('ok'::text, 'executing'::text)$$, 'a step begun inside a savepoint: receipted (slow path)');
RELEASE SAVEPOINT ck_sub;
SELECT results_eq(format($$SELECT outcome, status FROM pgfence.plan_run_step(%s, 'tap-ck', %s)$$, pg_temp.pid('ck_e'), pg_temp.tok('ck_e')),
  $$VALUES ('ok'::text, 'executed'::text)$$, 'the next step in the top-level transaction: receipted (fast path), the plan executed');
SELECT results_eq(format($$SELECT step_index, outcome, worker FROM pgfence.plan_step WHERE plan_id = %s ORDER BY 1$$, pg_temp.pid('ck_e')),
  $$VALUES (1, 'ok'::text, 'tap-ck'::text), (2, 'ok'::text, 'tap-ck'::text)$$, '... one receipt each, by the owner');

-- hand-written INSERT and DELETE: a plan is born pending, and disappears only in a purge
SELECT throws_ok($$INSERT INTO pgfence.plan (status, step_count, proposed_by, expires_at, approved_by, approved_at, worker, started_at,
                                             heartbeat_interval, next_step, finished_at)
                   VALUES ('executed', 1, 'mallory', now() + interval '1 day', 'mallory', now(), 'mallory', now(), '1 minute', 2, now())$$,
  'PF001', NULL, 'hand INSERT of an executed plan: PF001');
SELECT throws_ok($$INSERT INTO pgfence.plan (step_count, proposed_by, expires_at, approved_by, approved_at)
                   VALUES (1, 'mallory', now() + interval '1 day', 'mallory', now())$$,
  'PF001', NULL, 'hand INSERT of a pending plan that claims an approval: PF001');
SELECT throws_ok($$INSERT INTO pgfence.plan (step_count, proposed_by, expires_at, proposed_db_user)
                   VALUES (1, 'mallory', now() + interval '1 day', 'someone_else')$$,
  'PF001', NULL, 'hand INSERT naming another login as the proposer''s: PF001');
SELECT lives_ok($$INSERT INTO pgfence.plan (step_count, proposed_by, expires_at) VALUES (1, 'tap-hand', now() + interval '1 day')$$,
  'a hand INSERT in the initial state passes the guard (no PL/pgSQL on that path: WHEN-filtered trigger)');
SELECT throws_ok(format($$DELETE FROM pgfence.plan WHERE id = %s$$, pg_temp.pid('x')), 'PF002', NULL, 'hand DELETE of a plan: PF002');
SELECT is((SELECT count(*)::int FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('x') AND outcome IS NOT NULL), 4, '... its receipts are still there');
SAVEPOINT before_purge;
SET LOCAL pgfence.purging = on;
SELECT lives_ok(format($$DELETE FROM pgfence.plan WHERE id = %s$$, pg_temp.pid('x')), 'with pgfence.purging on (as audit_purge sets it) a plan can be deleted');
SELECT is((SELECT count(*)::int FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('x')), 0, '... with its steps and receipts');
ROLLBACK TO SAVEPOINT before_purge;
SELECT is(current_setting('pgfence.purging', true) IS DISTINCT FROM 'on', true, 'the purge setting was transaction-local (rolled back)');

-- =============================================================================================
-- Receipts only from plan_run_step: _plan_step_finish needs _plan_step_begin in its transaction
-- =============================================================================================
CREATE ROLE tap_plan_exec NOLOGIN IN ROLE pgfence_executor;
GRANT SELECT ON ids TO tap_plan_exec;
GRANT SELECT, INSERT ON public.tap_plan_t TO tap_plan_exec;
INSERT INTO ids SELECT 'forge', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "forge1", "v": 1}}, {"action": "tap-put", "args": {"k": "forge2", "v": 1}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('forge'), 'tap-alice'), 'approved', 'approve forge');
SET LOCAL ROLE tap_plan_exec;
SELECT isnt(pgfence.plan_start(pg_temp.pid('forge'), 'evil'), NULL, 'an executor login starts the run');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'evil', %s, 1, true, '{"qty": 999999}', NULL)$$, pg_temp.pid('forge'), pg_temp.tok('forge')),
  'PF107', NULL, 'writing an ok receipt without running the step (no _plan_step_begin in this transaction): PF107');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'evil', %s, 1, false, NULL, '{"message": "fake"}')$$, pg_temp.pid('forge'), pg_temp.tok('forge')),
  'PF107', NULL, '... an error receipt likewise: PF107');
RESET ROLE;
SELECT results_eq($$SELECT status, next_step, (SELECT count(*)::int FROM pgfence.plan_receipts r WHERE r.plan_id = p.id) FROM pgfence.plan p WHERE id = pg_temp.pid('forge')$$,
  $$VALUES ('executing'::text, 1, 0)$$, '... the plan did not move and has no receipt');
SELECT is((SELECT count(*)::int FROM public.tap_plan_t WHERE k LIKE 'forge%'), 0, '... and nothing ran');
SET LOCAL ROLE tap_plan_exec;
SELECT results_eq($$SELECT step_index, outcome, status FROM pgfence.plan_run_step(pg_temp.pid('forge'), 'evil', pg_temp.tok('forge'))$$,
  $$VALUES (1, 'ok'::text, 'executing'::text)$$, 'plan_run_step itself still writes the receipt (begin and finish in one transaction)');
RESET ROLE;
SELECT results_eq($$SELECT step_begun, step_begun_xact FROM pgfence.plan WHERE id = pg_temp.pid('forge')$$,
  $$VALUES (NULL::integer, NULL::xid8)$$, '... and no begin stamp is stored (the lock on the step''s row is the stamp)');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'evil', %s, 2, true, '{}', NULL)$$, pg_temp.pid('forge'), pg_temp.tok('forge')),
  'PF107', NULL, 'a stamp of step 1 does not let step 2 be receipted: PF107');
SELECT is((SELECT step_index FROM pgfence._plan_step_begin(pg_temp.pid('forge'), 'evil', pg_temp.tok('forge'))), 2, 'the remaining trust: _plan_step_begin hands out step 2 ...');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'evil', %s, 1, true, '{}', NULL)$$, pg_temp.pid('forge'), pg_temp.tok('forge')),
  'PF107', NULL, '... a receipt for another step than the one begun: PF107');
SELECT is(pgfence._plan_step_finish(pg_temp.pid('forge'), 'evil', pg_temp.tok('forge'), 2, true, '{"put": "forge2"}', NULL), 'executed',
  '... and a role that calls both helpers in one transaction is trusted to run the action in between (documented)');
-- The begin stamp is the lock on the step's row, taken by the (sub)transaction that began it.
INSERT INTO ids SELECT 'forge-sp', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "forgesp", "v": 1}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('forge-sp'), 'tap-alice'), 'approved', 'approve forge-sp');
SELECT isnt(pgfence.plan_start(pg_temp.pid('forge-sp'), 'evil'), NULL, 'start forge-sp');
SAVEPOINT sp_begin;
SELECT is((SELECT step_index FROM pgfence._plan_step_begin(pg_temp.pid('forge-sp'), 'evil', pg_temp.tok('forge-sp'))), 1, 'a begin in a savepoint ...');
ROLLBACK TO SAVEPOINT sp_begin;
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'evil', %s, 1, true, '{}', NULL)$$, pg_temp.pid('forge-sp'), pg_temp.tok('forge-sp')),
  'PF107', NULL, '... rolled back to the savepoint did not begin the step: PF107');
SAVEPOINT sp_begin2;
SELECT is((SELECT step_index FROM pgfence._plan_step_begin(pg_temp.pid('forge-sp'), 'evil', pg_temp.tok('forge-sp'))), 1, 'a begin in a savepoint that is released ...');
RELEASE SAVEPOINT sp_begin2;
SELECT is(pgfence._plan_step_finish(pg_temp.pid('forge-sp'), 'evil', pg_temp.tok('forge-sp'), 1, true, '{"put": "forgesp"}', NULL), 'executed',
  '... began it in this transaction: the receipt is written');

-- =============================================================================================
-- An approved plan runs what was approved: the action function's definition is fingerprinted
-- =============================================================================================
CREATE FUNCTION public.tap_plan_mut(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('version', 1) $$;
SELECT is(pgfence.plan_register_action('tap-mut', 'public.tap_plan_mut(jsonb)', 'answer with a version'), true, 'register tap-mut');
INSERT INTO ids SELECT 'mut', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "m1", "v": 1}}, {"action": "tap-mut"}, {"action": "tap-put", "args": {"k": "m3", "v": 1}}]', 'tap-agent');
INSERT INTO ids SELECT 'mut-same', pgfence.plan_propose('[{"action": "tap-mut"}]', 'tap-agent');
SELECT results_eq($$SELECT step_index, function_md5 FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('mut') ORDER BY step_index$$,
  $$VALUES (1, md5(pg_get_functiondef('public.tap_plan_put(jsonb)'::regprocedure))),
           (2, md5(pg_get_functiondef('public.tap_plan_mut(jsonb)'::regprocedure))),
           (3, md5(pg_get_functiondef('public.tap_plan_put(jsonb)'::regprocedure)))$$,
  'each SQL step records the md5 of its function''s definition at proposal');
SELECT is((SELECT function_md5 FROM pgfence.plan_step WHERE plan_id = pg_temp.pid('noargs') AND step_index = 1), NULL, '... an external step has none');
SELECT is(pgfence.plan_approve(pg_temp.pid('mut'), 'tap-alice') || pgfence.plan_approve(pg_temp.pid('mut-same'), 'tap-alice'), 'approvedapproved', 'approve both');
CREATE OR REPLACE FUNCTION public.tap_plan_mut(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('version', 2, 'evil', true) $$;
SELECT isnt(pgfence.plan_start(pg_temp.pid('mut'), 'tap-w1'), NULL, 'start mut after its function was replaced');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.pid('mut'), 'tap-w1', pg_temp.tok('mut'))), 'ok', 'step 1 (unchanged function) runs');
SELECT results_eq($$SELECT step_index, outcome, status, output, error ->> 'sqlstate' FROM pgfence.plan_run_step(pg_temp.pid('mut'), 'tap-w1', pg_temp.tok('mut'))$$,
  $$VALUES (2, 'error'::text, 'failed'::text, NULL::jsonb, 'PF108'::text)$$,
  'a step whose function changed since the proposal does not run: error receipt PF108, the plan fails');
SELECT results_eq($$SELECT status, failure, next_step FROM pgfence.plan WHERE id = pg_temp.pid('mut')$$,
  $$VALUES ('failed'::text, 'step_error'::text, 2)$$, '... failed (step_error) at step 2, like any failing step');
SELECT is((SELECT array_agg(k ORDER BY k) FROM public.tap_plan_t WHERE k LIKE 'm_'), ARRAY['m1'], '... step 3 never ran');
SELECT ok((SELECT message LIKE '%tap-mut%changed%' FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('mut') AND step_index = 2), '... and the receipt says which action changed');
CREATE OR REPLACE FUNCTION public.tap_plan_mut(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('version', 1) $$;
SELECT isnt(pgfence.plan_start(pg_temp.pid('mut-same'), 'tap-w1'), NULL, 'start mut-same once the approved definition is back');
SELECT results_eq($$SELECT outcome, output FROM pgfence.plan_run_step(pg_temp.pid('mut-same'), 'tap-w1', pg_temp.tok('mut-same'))$$,
  $$VALUES ('ok'::text, '{"version": 1}'::jsonb)$$, 'the same definition again runs (the fingerprint is of the definition, not of the catalog row)');
INSERT INTO ids SELECT 'mut-forge', pgfence.plan_propose('[{"action": "tap-mut"}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('mut-forge'), 'tap-alice'), 'approved', 'approve mut-forge');
CREATE OR REPLACE FUNCTION public.tap_plan_mut(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('version', 3) $$;
SELECT isnt(pgfence.plan_start(pg_temp.pid('mut-forge'), 'tap-w1'), NULL, 'start mut-forge after another replacement');
SELECT is((SELECT step_index FROM pgfence._plan_step_begin(pg_temp.pid('mut-forge'), 'tap-w1', pg_temp.tok('mut-forge'))), 1, 'begin its step by hand ...');
SELECT throws_ok(format($$SELECT pgfence._plan_step_finish(%s, 'tap-w1', %s, 1, true, '{"version": 3}', NULL)$$, pg_temp.pid('mut-forge'), pg_temp.tok('mut-forge')),
  'PF108', NULL, '... an ok receipt for a step whose function changed is refused even then: PF108');
-- The check skips the md5 while the function's pg_proc row is the version recorded at proposal
-- (oid and xmin, migration 0034). tap_plan_row is committed by a peer session, so its row is not
-- this transaction's and proposals record it; a row this transaction wrote is not recorded.
-- (After VACUUM FREEZE pg_proc: tests/test_plan.py, since a freeze needs no older open snapshot.)
SELECT tap_helpers.peer('c0');
SELECT dblink_exec('c0', $$CREATE FUNCTION public.tap_plan_row(p jsonb) RETURNS jsonb LANGUAGE sql AS $f$ SELECT jsonb_build_object('row', 1) $f$ $$);
SELECT is(pgfence.plan_register_action('tap-row', 'public.tap_plan_row(jsonb)', 'answer with a row number'), true, 'register tap-row (its function committed by a peer)');
INSERT INTO ids SELECT 'row-' || n, pgfence.plan_propose('[{"action": "tap-row"}]', 'tap-agent')
FROM unnest(ARRAY['same', 'md5', 'ident', 'repl', 'mid', 'ret', 'drop']) AS n;
SELECT results_eq($$SELECT s.function_oid, s.function_xmin::text, s.function_md5 FROM pgfence.plan_step s WHERE s.plan_id = pg_temp.pid('row-same')$$,
  $$SELECT p.oid, p.xmin::text, md5(pg_get_functiondef(p.oid)) FROM pg_proc p WHERE p.oid = 'public.tap_plan_row(jsonb)'::regprocedure$$,
  'a sql step records its function''s pg_proc row version (oid, xmin) with the md5');
SELECT results_eq($$SELECT s.function_oid, s.function_xmin IS NULL FROM pgfence.plan_step s WHERE s.plan_id = pg_temp.pid('mut') AND s.step_index = 2$$,
  $$VALUES ('public.tap_plan_mut(jsonb)'::regprocedure::oid, true)$$,
  '... but no xmin for a row the proposing transaction wrote itself (it could change under that xmin): the md5 decides');
SELECT is((SELECT string_agg(pgfence.plan_approve(id, 'tap-alice'), ',') FROM ids WHERE name LIKE 'row-%'), 'approved,approved,approved,approved,approved,approved,approved', 'approve the row-* plans');
SELECT is((SELECT count(*)::int FROM pgfence.plan p JOIN ids ON ids.id = p.id WHERE ids.name LIKE 'row-%' AND p.version_checked), 0,
  'proposed and approved in one transaction: not version_checked (the proposal''s cache and snapshot are this transaction''s); the steps compute the md5');
SAVEPOINT row_sub_propose;
INSERT INTO ids SELECT 'row-sub', pgfence.plan_propose('[{"action": "tap-row"}]', 'tap-agent');
RELEASE SAVEPOINT row_sub_propose;
SAVEPOINT row_sub_approve;
SELECT is(pgfence.plan_approve(pg_temp.pid('row-sub'), 'tap-alice'), 'approved', 'proposed in one subtransaction, approved in another ...');
RELEASE SAVEPOINT row_sub_approve;
SELECT results_eq($$SELECT p.version_checked, s.function_xmin IS NOT NULL FROM pgfence.plan p JOIN pgfence.plan_step s ON s.plan_id = p.id WHERE p.id = pg_temp.pid('row-sub')$$,
  $$VALUES (false, true)$$, '... of the same transaction: not version_checked either');
SELECT throws_ok(format($$UPDATE pgfence.plan SET version_checked = true WHERE id = %s$$, pg_temp.pid('row-sub')), 'PF002', NULL,
  'a hand-written version_checked: PF002');
SELECT throws_ok(format($$UPDATE pgfence.plan SET status = 'approved', approved_by = 'me', approved_at = now(), version_checked = true WHERE id = %s$$, pg_temp.pid('key')), 'PF002', NULL,
  '... also in a hand-written approval: PF002 (only plan_approve, after its cross-check)');
SELECT throws_ok($$INSERT INTO pgfence.plan (step_count, proposed_by, expires_at, version_checked) VALUES (1, 'me', now() + interval '1 hour', true)$$, 'PF001', NULL,
  '... nor in a new plan: PF001');
SELECT results_eq($$SELECT outcome, output FROM pgfence.plan_run_step(pg_temp.pid('row-sub'), 'tap-w1', pgfence.plan_start(pg_temp.pid('row-sub'), 'tap-w1'))$$,
  $$VALUES ('ok'::text, '{"row": 1}'::jsonb)$$, 'a plan that is not version_checked runs its step (the md5 decides: unchanged)');
SELECT results_eq($$SELECT outcome, output FROM pgfence.plan_run_step(pg_temp.pid('row-same'), 'tap-w1', pgfence.plan_start(pg_temp.pid('row-same'), 'tap-w1'))$$,
  $$VALUES ('ok'::text, '{"row": 1}'::jsonb)$$, 'the recorded row version: the step runs');
SET LOCAL session_replication_role = replica;  -- past the guard: spoil the recorded md5 (of a version_checked plan, as an approval in another transaction makes it: 21_plan_concurrency.sql)
UPDATE pgfence.plan_step SET function_md5 = md5('not the definition') WHERE plan_id = pg_temp.pid('row-md5');
UPDATE pgfence.plan SET version_checked = true WHERE id = pg_temp.pid('row-md5');
SET LOCAL session_replication_role = origin;
-- (not through results_eq, which runs its query in a subtransaction: this transaction wrote the
-- step's row, so a subtransaction's lock on it would take the slow path)
SELECT isnt(pgfence.plan_start(pg_temp.pid('row-md5'), 'tap-w1'), NULL, 'start row-md5');
SELECT is((SELECT (outcome, output)::text FROM pgfence.plan_run_step(pg_temp.pid('row-md5'), 'tap-w1', pg_temp.tok('row-md5'))),
  '(ok,"{""row"": 1}")', '... and no md5 is computed for it, at begin nor at finish (a spoilt md5 is not even read)');
SELECT is(pgfence.plan_retire_action('tap-row'), true, 'retire tap-row');
SELECT results_eq($$SELECT outcome, error ->> 'sqlstate' FROM pgfence.plan_run_step(pg_temp.pid('row-ret'), 'tap-w1', pgfence.plan_start(pg_temp.pid('row-ret'), 'tap-w1'))$$,
  $$VALUES ('error'::text, 'PF101'::text)$$, 'retired, its row the recorded version: error receipt PF101');
SELECT is(pgfence.plan_register_action('tap-row', 'public.tap_plan_row(jsonb)', 'answer with a row number'), false, 'register tap-row again (back in use)');
SELECT isnt(pgfence.plan_start(pg_temp.pid('row-mid'), 'tap-w1'), NULL, 'start row-mid');
SELECT is((SELECT fn_md5_now FROM pgfence._plan_step_begin(pg_temp.pid('row-mid'), 'tap-w1', pg_temp.tok('row-mid'))), md5(pg_get_functiondef('public.tap_plan_row(jsonb)'::regprocedure)),
  'begin a step by hand with the recorded row version ...');
CREATE OR REPLACE FUNCTION public.tap_plan_row(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('row', 1) $$;
SELECT is(pgfence._plan_step_finish(pg_temp.pid('row-mid'), 'tap-w1', pg_temp.tok('row-mid'), 1, true, '{"row": 1}', NULL), 'executed',
  '... replaced by an identical definition before the finish (a new row version): the md5 says unchanged, the receipt is written');
SELECT results_eq($$SELECT outcome, output FROM pgfence.plan_run_step(pg_temp.pid('row-ident'), 'tap-w1', pgfence.plan_start(pg_temp.pid('row-ident'), 'tap-w1'))$$,
  $$VALUES ('ok'::text, '{"row": 1}'::jsonb)$$, 'replaced by an identical definition (CREATE OR REPLACE, new xmin): the md5 decides, the step runs');
CREATE OR REPLACE FUNCTION public.tap_plan_row(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('row', 2, 'evil', true) $$;
SELECT results_eq($$SELECT outcome, error ->> 'sqlstate', status FROM pgfence.plan_run_step(pg_temp.pid('row-repl'), 'tap-w1', pgfence.plan_start(pg_temp.pid('row-repl'), 'tap-w1'))$$,
  $$VALUES ('error'::text, 'PF108'::text, 'failed'::text)$$, 'replaced by another definition: error receipt PF108, the plan fails');
DROP FUNCTION public.tap_plan_row(jsonb);
SELECT results_eq($$SELECT outcome, error ->> 'sqlstate' FROM pgfence.plan_run_step(pg_temp.pid('row-drop'), 'tap-w1', pgfence.plan_start(pg_temp.pid('row-drop'), 'tap-w1'))$$,
  $$VALUES ('error'::text, '42883'::text)$$, 'dropped: error receipt 42883');

-- =============================================================================================
-- Four eyes by database login, not only by the name passed in
-- =============================================================================================
CREATE ROLE tap_plan_mallory NOLOGIN IN ROLE pgfence_client, pgfence_admin;
CREATE ROLE tap_plan_trent NOLOGIN IN ROLE pgfence_admin;
GRANT SELECT, INSERT ON ids TO tap_plan_mallory, tap_plan_trent;
SET LOCAL SESSION AUTHORIZATION tap_plan_mallory;
INSERT INTO ids SELECT 'eyes', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "eyes", "v": 1}}]', 'mallory');
SELECT throws_ok(format($$SELECT pgfence.plan_approve(%s, 'definitely-not-mallory')$$, pg_temp.pid('eyes')), 'PF103', NULL,
  'the login that proposed cannot approve under another name: PF103');
SELECT throws_ok(format($$SELECT pgfence.plan_approve(%s, 'mallory')$$, pg_temp.pid('eyes')), 'PF103', NULL, '... nor under its own: PF103');
RESET SESSION AUTHORIZATION;
SELECT is((SELECT status FROM pgfence.plan WHERE id = pg_temp.pid('eyes')), 'pending', '... the plan is still pending');
SET LOCAL SESSION AUTHORIZATION tap_plan_trent;
SELECT throws_ok(format($$SELECT pgfence.plan_approve(%s, 'mallory')$$, pg_temp.pid('eyes')), 'PF103', NULL, 'another login approving under the proposer''s name: PF103 (as before)');
SELECT is(pgfence.plan_approve(pg_temp.pid('eyes'), 'trent'), 'approved', 'another login approves under another name');
RESET SESSION AUTHORIZATION;
SELECT results_eq($$SELECT proposed_by, proposed_db_user, approved_by FROM pgfence.plan WHERE id = pg_temp.pid('eyes')$$,
  $$VALUES ('mallory'::text, 'tap_plan_mallory'::text, 'trent'::text)$$, 'the plan records the proposing login next to the proposer''s name');
SELECT results_eq($$SELECT event, actor, db_user FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('eyes') ORDER BY id$$,
  $$VALUES ('propose'::text, 'mallory'::text, 'tap_plan_mallory'::text), ('approve', 'trent', 'tap_plan_trent')$$,
  'every event records the database login (db_user) next to the actor');
SELECT throws_ok(format($$UPDATE pgfence.plan SET proposed_db_user = 'tap_plan_trent' WHERE id = %s$$, pg_temp.pid('eyes')), 'PF002', NULL, 'the proposing login never changes: PF002');
INSERT INTO ids SELECT 'eyes-su', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "eyes-su", "v": 1}}]', 'tap-agent');
SELECT is(pgfence.plan_approve(pg_temp.pid('eyes-su'), 'tap-alice'), 'approved', 'a superuser login may approve its own proposal under another name (it could do anything anyway)');

-- =============================================================================================
-- Event log: every transition and receipt, in the same transaction
-- =============================================================================================
SELECT results_eq(
  $$SELECT format('%s %s->%s by %s', event, from_status, to_status, actor) FROM pgfence.event
    WHERE module = 'plan' AND item_id = pg_temp.pid('f') AND event <> 'receipt' ORDER BY id$$,
  ARRAY['propose ->pending by tap-agent', 'approve pending->approved by tap-alice',
        'start approved->executing by tap-w1', 'fail executing->failed by tap-w1']::text[],
  'propose, approve, start, fail: logged with their actors');
SELECT results_eq(
  $$SELECT fence::int, detail ->> 'outcome', detail ->> 'sqlstate', actor, db_user = session_user, at IS NOT NULL FROM pgfence.audit_timeline('plan', pg_temp.pid('f'))
    WHERE source = 'receipt' ORDER BY fence$$,
  $$VALUES (1, 'ok'::text, NULL::text, 'tap-w1'::text, true, true), (2, 'ok', NULL, 'tap-w1', true, true),
           (3, 'error', '22012', 'tap-w1', true, true)$$,
  'each receipt is in the timeline (from its step''s row), the error with its SQLSTATE, with worker, login and time');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'plan' AND event = 'receipt'), 0,
  '... and no receipt writes an event row (migration 0034)');
SELECT results_eq(
  $$SELECT event, actor FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('rel') AND event IN ('release', 'take') ORDER BY id$$,
  $$VALUES ('release'::text, 'tap-w1'::text), ('take', 'tap-ext'), ('release', 'tap-ext'), ('take', 'tap-w3')$$,
  'releases and takeovers are logged');
SELECT is((SELECT actor FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('exp3') AND event = 'expire'), 'reaper', 'the reaper''s expiry is logged as the reaper');
SAVEPOINT before_rollback;
SELECT pgfence.plan_reject(pg_temp.pid('key'), 'tap-alice', 'rolled back');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('key') AND event = 'reject'), 1, 'a reject is logged inside its transaction ...');
ROLLBACK TO SAVEPOINT before_rollback;
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'plan' AND item_id = pg_temp.pid('key') AND event = 'reject'), 0, '... and a rolled-back transition leaves no event');

-- =============================================================================================
-- Reads and time zones
-- =============================================================================================
SELECT throws_ok($$SELECT * FROM pgfence.plan_get(-1)$$, 'P0002', NULL, 'plan_get: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.plan_get(NULL)$$, '22004', NULL, 'plan_get: NULL id is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.plan_steps(-1)$$, 'P0002', NULL, 'plan_steps: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.plan_list('bogus')$$, '22023', NULL, 'plan_list: unknown status is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.plan_list(NULL, 0)$$, '22023', NULL, 'plan_list: limit 0 is 22023');
SELECT results_eq($$SELECT id, steps_done FROM pgfence.plan_list('failed') WHERE id IN (pg_temp.pid('f'), pg_temp.pid('hb')) ORDER BY id$$,
  $$VALUES (pg_temp.pid('f'), 2), (pg_temp.pid('hb'), 1)$$, 'plan_list: failed plans with the steps that committed');
SET LOCAL TIME ZONE 'Asia/Kolkata';
INSERT INTO ids SELECT 'tz', pgfence.plan_propose('[{"action": "tap-put", "args": {"k": "tz", "v": 1}}]', 'tap-agent', interval '2 hours');
SET LOCAL TIME ZONE 'UTC';
SELECT is((SELECT expires_at - proposed_at FROM pgfence.plan WHERE id = pg_temp.pid('tz')), interval '2 hours', 'expiry is an instant 2 hours after proposal, whatever the session zone');

SELECT tap_helpers.close_peers();
SELECT * FROM finish();
ROLLBACK;
-- committed by a peer (the approval check's row-version cases)
DROP FUNCTION IF EXISTS public.tap_plan_row(jsonb);
