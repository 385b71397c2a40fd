-- pgTAP: the executor registry (functions/50_executor.sql): register, heartbeat, deregister,
-- audit_executors with liveness, executor_serving, the unserved flag of audit_queue_health, and
-- a plan run released to executors: it waits while none serves plans, fails as interrupted
-- only when one does, and registering an executor that serves plans revives it; the gauges of
-- audit_metrics and the per-minute rows of audit_queue_rates.
BEGIN;
\ir helpers/setup.sql
SELECT plan(65);

DELETE FROM pgfence.executor;  -- rows other test runs left (rolled back at the end)
CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
CREATE FUNCTION pg_temp.pid(p_name text) RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM ids WHERE name = p_name $$;

-- =============================================================================================
-- Catalog, roles
-- =============================================================================================
SELECT has_table('pgfence', 'executor', 'the registry table');
SELECT has_function('pgfence', 'executor_register', ARRAY['text','text','integer','text','jsonb','integer','interval'], 'executor_register signature');
SELECT has_function('pgfence', 'executor_heartbeat', ARRAY['text'], 'executor_heartbeat signature');
SELECT has_function('pgfence', 'executor_deregister', ARRAY['text'], 'executor_deregister signature');
SELECT has_function('pgfence', 'executor_serving', ARRAY['text','text'], 'executor_serving signature');
SELECT has_view('pgfence', 'audit_executors', 'the audit view');
SELECT ok((SELECT bool_and(prosecdef AND proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp'])
           FROM pg_proc WHERE pronamespace = 'pgfence'::regnamespace
             AND proname IN ('executor_register', 'executor_heartbeat', 'executor_deregister', 'executor_serving')),
  'all four are SECURITY DEFINER with a pinned search_path');
SELECT function_privs_are('pgfence', 'executor_register', ARRAY['text','text','integer','text','jsonb','integer','interval'],
  'pgfence_executor', ARRAY['EXECUTE'], 'executor may register');
SELECT function_privs_are('pgfence', 'executor_register', ARRAY['text','text','integer','text','jsonb','integer','interval'],
  'pgfence_client', ARRAY[]::text[], 'client may not');
SELECT function_privs_are('pgfence', 'executor_heartbeat', ARRAY['text'], 'pg_monitor', ARRAY[]::text[], 'monitoring may not heartbeat');
SELECT function_privs_are('pgfence', 'executor_serving', ARRAY['text','text'], 'pgfence_client', ARRAY['EXECUTE'], 'any role may ask executor_serving');
SELECT table_privs_are('pgfence', 'audit_executors', 'pg_monitor', ARRAY['SELECT'], 'monitoring reads audit_executors');
SELECT table_privs_are('pgfence', 'executor', 'pgfence_executor', ARRAY[]::text[], 'the table is not readable by the executor role');
SELECT ok((SELECT bool_and(length(split_part(obj_description(p.oid, 'pg_proc'), E'\n', 1)) <= 100)
           FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace
             AND p.proname IN ('executor_register', 'executor_heartbeat', 'executor_deregister', 'executor_serving')),
  'their comments start with a summary line of at most 100 characters');

-- =============================================================================================
-- Register, heartbeat, deregister, liveness
-- =============================================================================================
SET LOCAL ROLE pgfence_executor;
SELECT is(pgfence.executor_register('tap-x1', 'h1', 101, '0.1.0', '{"outbox": ["tap-ex-a"], "operation": ["tap-kind"]}', 8, interval '10 seconds'),
  0, 'register an outbox + operation executor (no plan runs revived)');
SELECT is(pgfence.executor_heartbeat('tap-x1'), true, 'its heartbeat is accepted');
SELECT is(pgfence.executor_heartbeat('tap-nobody'), false, 'an unknown worker''s heartbeat: false (register again)');
RESET ROLE;
SELECT results_eq($$SELECT worker, host, pid, version, modules, concurrency, status, alive, expires_at FROM pgfence.audit_executors$$,
  $$VALUES ('tap-x1'::text, 'h1'::text, 101, '0.1.0'::text, ARRAY['operation', 'outbox'], 8, 'alive'::text, true, now() + interval '30 seconds')$$,
  'audit_executors: alive until three heartbeat intervals after the last one');
SELECT is(pgfence.executor_register('tap-x1', 'h1', 102, '0.1.0', '{"outbox": ["tap-ex-a"], "operation": ["tap-kind"]}', 4, interval '10 seconds'),
  0, 'registering again under the same name (a restart) ...');
SELECT results_eq($$SELECT pid, concurrency, count(*) OVER () FROM pgfence.executor$$, $$VALUES (102, 4, 1::bigint)$$, '... replaces the row');

SELECT is(pgfence.executor_serving('outbox', 'tap-ex-a'), 1, 'executor_serving: the channel it serves');
SELECT is(pgfence.executor_serving('outbox', 'tap-ex-b'), 0, 'not another channel');
SELECT is(pgfence.executor_serving('operation', 'tap-kind'), 1, 'the operation kind it serves');
SELECT is(pgfence.executor_serving('plan', '*'), 0, 'no plans');
SELECT is(pgfence.executor_register('tap-x2', 'h2', 7, '0.1.0', '{"outbox": ["*"]}', 8, interval '10 seconds'), 0, 'a second executor, every channel');
SELECT is(pgfence.executor_serving('outbox', 'tap-ex-b'), 1, '"*" serves every channel');

UPDATE pgfence.executor SET expires_at = now() - interval '1 second' WHERE worker = 'tap-x2';
SELECT results_eq($$SELECT status, alive FROM pgfence.audit_executors WHERE worker = 'tap-x2'$$,
  $$VALUES ('lapsed'::text, false)$$, 'silent past its deadline: lapsed');
SELECT is(pgfence.executor_serving('outbox', 'tap-ex-b'), 0, 'a lapsed executor serves nothing');
SELECT is(pgfence.executor_heartbeat('tap-x2'), true, 'a lapsed executor''s heartbeat revives it');
SELECT is((SELECT status FROM pgfence.audit_executors WHERE worker = 'tap-x2'), 'alive', '... alive again');
SELECT is(pgfence.executor_deregister('tap-x2'), true, 'deregister at shutdown');
SELECT is(pgfence.executor_deregister('tap-x2'), false, 'twice: false');
SELECT results_eq($$SELECT status, alive, stopped_at FROM pgfence.audit_executors WHERE worker = 'tap-x2'$$,
  $$VALUES ('stopped'::text, false, now())$$, 'stopped, still listed');
SELECT is(pgfence.executor_heartbeat('tap-x2'), false, 'a stopped executor''s heartbeat: false');

-- =============================================================================================
-- Errors (and that a refused call changed nothing)
-- =============================================================================================
SELECT throws_ok($$SELECT pgfence.executor_register(NULL, 'h', 1, 'v', '{"outbox": ["*"]}', 1, '1s')$$, '22004', NULL, 'register without a worker: 22004');
SELECT throws_ok($$SELECT pgfence.executor_register('w', 'h', 1, 'v', NULL, 1, '1s')$$, '22004', NULL, 'register without serves: 22004');
SELECT throws_ok($$SELECT pgfence.executor_register('', 'h', 1, 'v', '{"outbox": ["*"]}', 1, '1s')$$, '22023', NULL, 'an empty worker: 22023');
SELECT throws_ok($$SELECT pgfence.executor_register('w', 'h', 1, 'v', '["outbox"]', 1, '1s')$$, '22023', NULL, 'serves not an object: 22023');
SELECT throws_ok($$SELECT pgfence.executor_register('w', 'h', 1, 'v', '{"mail": ["*"]}', 1, '1s')$$, '22023', NULL, 'an unknown module: 22023');
SELECT throws_ok($$SELECT pgfence.executor_register('w', 'h', 1, 'v', '{"outbox": []}', 1, '1s')$$, '22023', NULL, 'no queues: 22023');
SELECT throws_ok($$SELECT pgfence.executor_register('w', 'h', 1, 'v', '{"outbox": ["*"]}', 0, '1s')$$, '22023', NULL, 'concurrency 0: 22023');
SELECT throws_ok($$SELECT pgfence.executor_register('w', 'h', 1, 'v', '{"outbox": ["*"]}', 1, '2 hours')$$, '22023', NULL, 'a heartbeat over an hour: 22023');
SELECT throws_ok($$SELECT pgfence.executor_heartbeat(NULL)$$, '22004', NULL, 'heartbeat without a worker: 22004');
SELECT throws_ok($$SELECT pgfence.executor_serving('mail', '*')$$, '22023', NULL, 'executor_serving of an unknown module: 22023');
SELECT is((SELECT count(*)::int FROM pgfence.executor WHERE worker = 'w'), 0, 'the refused registrations wrote nothing');

-- =============================================================================================
-- audit_queue_health: unserved queues
-- =============================================================================================
SELECT pgfence.outbox_enqueue('tap-ex-a', 'r', '{}');
SELECT pgfence.outbox_enqueue('tap-ex-b', 'r', '{}');
SELECT results_eq($$SELECT queue, executors, unserved FROM pgfence.audit_queue_health WHERE module = 'outbox' AND queue LIKE 'tap-ex-%' ORDER BY queue$$,
  $$VALUES ('tap-ex-a'::text, 1, false), ('tap-ex-b', 0, true)$$,
  'a channel with due messages and no live executor is flagged unserved; a served one is not');

-- =============================================================================================
-- audit_metrics (the database-side gauges) and audit_queue_rates (the console's charts)
-- =============================================================================================
SELECT table_privs_are('pgfence', 'audit_metrics', 'pgfence_executor', ARRAY['SELECT'], 'executors may read audit_metrics (they serve it on /metrics)');
SELECT table_privs_are('pgfence', 'audit_metrics', 'pgfence_client', ARRAY[]::text[], 'clients may not');
SELECT table_privs_are('pgfence', 'audit_queue_rates', 'pg_monitor', ARRAY['SELECT'], 'monitoring reads audit_queue_rates');
SELECT results_eq($$SELECT queue, status, value FROM pgfence.audit_metrics WHERE metric = 'pgfence_queue_depth' AND queue LIKE 'tap-ex-%' AND status = 'ready' ORDER BY queue$$,
  $$VALUES ('tap-ex-a'::text, 'ready'::text, 1::float8), ('tap-ex-b', 'ready', 1)$$, 'audit_metrics: depth by status per queue');
SELECT results_eq($$SELECT queue, value FROM pgfence.audit_metrics WHERE metric = 'pgfence_queue_unserved' AND queue LIKE 'tap-ex-%' ORDER BY queue$$,
  $$VALUES ('tap-ex-a'::text, 0::float8), ('tap-ex-b', 1)$$, 'audit_metrics: the unserved flag as a gauge');
SELECT results_eq($$SELECT status, value FROM pgfence.audit_metrics WHERE metric = 'pgfence_executors' ORDER BY status$$,
  $$VALUES ('alive'::text, 1::float8), ('lapsed', 0), ('stopped', 1)$$, 'audit_metrics: executors by status');
SELECT is((SELECT count(*)::int FROM pgfence.audit_metrics WHERE metric IN ('pgfence_stuck_items', 'pgfence_possible_duplicates_24h')), 6,
  'stuck items and possible duplicates: one sample per module each');
SELECT is((SELECT count(*)::int FROM pgfence.audit_metrics WHERE value IS NULL OR metric !~ '^pgfence_[a-z0-9_]+$'), 0, 'every sample has a value and a Prometheus name');
UPDATE pgfence.outbox SET status = 'processing', locked_by = 'tap', attempts = 1, lease_expires_at = now() + interval '1 minute' WHERE channel = 'tap-ex-a';
UPDATE pgfence.outbox SET status = 'sent', finished_at = now(), lease_expires_at = NULL WHERE channel = 'tap-ex-a';
SELECT results_eq($$SELECT queue, minute, done, failed FROM pgfence.audit_queue_rates WHERE queue LIKE 'tap-ex-%'$$,
  $$VALUES ('tap-ex-a'::text, date_trunc('minute', now()), 1::bigint, 0::bigint)$$, 'audit_queue_rates: finished per minute');
SELECT results_eq($$SELECT per_second_1m, per_second_15m, finished FROM pgfence.audit_queue_health WHERE queue = 'tap-ex-a'$$,
  $$VALUES (0.02::numeric, 0.00::numeric, 1::bigint)$$, 'audit_queue_health: 1- and 15-minute rates, finished');

-- =============================================================================================
-- A plan run released to executors while none serves plans waits; an executor revives it
-- =============================================================================================
SELECT pgfence.plan_register_action('tap-ex-hook', NULL, 'an external step');
INSERT INTO ids SELECT 'w', pgfence.plan_propose('[{"action": "tap-ex-hook", "args": {"recipient": "http://127.0.0.1:9/x"}}]', 'tap-agent');
SELECT pgfence.plan_approve(pg_temp.pid('w'), 'tap-alice');
SELECT pgfence.plan_start(pg_temp.pid('w'), 'tap-cli');
SELECT is(pgfence.plan_release(pg_temp.pid('w'), 'tap-cli', (SELECT run_token FROM pgfence.plan WHERE id = pg_temp.pid('w'))),
  true, 'a SQL runner hands the external step to executors (plan_release)');
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = pg_temp.pid('w');
SELECT pgfence.plan_reap();
SELECT results_eq($$SELECT status, worker FROM pgfence.plan WHERE id = pg_temp.pid('w')$$,
  $$VALUES ('executing'::text, NULL::text)$$, 'its heartbeat lapsed with no executor serving plans: the reaper leaves it waiting');
SELECT results_eq($$SELECT ready, lapsed, executors, unserved FROM pgfence.audit_queue_health WHERE module = 'plan'$$,
  $$VALUES (1::bigint, 0::bigint, 0, true)$$, 'audit_queue_health: ready, not lapsed, and unserved');
SELECT is((SELECT status FROM pgfence.plan_get(pg_temp.pid('w'))), 'executing', 'plan_get (which heals) leaves it waiting too');
SELECT is(pgfence.executor_register('tap-x3', 'h3', 9, '0.1.0', '{"plan": ["*"]}', 2, interval '10 seconds'),
  1, 'an executor that serves plans registers: it revives the waiting run');
SELECT results_eq($$SELECT status, worker, heartbeat_expires_at FROM pgfence.plan WHERE id = pg_temp.pid('w')$$,
  $$VALUES ('executing'::text, NULL::text, now() + interval '120 seconds')$$, '... a fresh heartbeat, still released');
SELECT results_eq($$SELECT id, next_kind FROM pgfence.plan_claim('tap-x3', 10)$$,
  $$VALUES (pg_temp.pid('w'), 'external'::text)$$, '... so that its claim takes it');
SELECT pgfence.plan_release(pg_temp.pid('w'), 'tap-x3', (SELECT run_token FROM pgfence.plan WHERE id = pg_temp.pid('w')));
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = pg_temp.pid('w');
SELECT is(pgfence.plan_reap(), 1, 'released again and lapsed while an executor serves plans: the reaper fails it');
SELECT results_eq($$SELECT status, failure FROM pgfence.plan WHERE id = pg_temp.pid('w')$$,
  $$VALUES ('failed'::text, 'interrupted'::text)$$, '... as interrupted, as before the registry');

SELECT * FROM finish();
ROLLBACK;
