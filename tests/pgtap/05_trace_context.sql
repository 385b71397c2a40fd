-- pgTAP: the W3C trace context (migration 0019, functions/05_trace_context.sql): the column
-- defaults of outbox, plan and operation read the transaction settings pgfence.traceparent and
-- pgfence.tracestate; a malformed value raises 22023 and writes nothing; trace_contexts (the
-- executor's read per claimed batch) and its grants.
BEGIN;
\ir helpers/setup.sql
SELECT plan(48);

CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
GRANT SELECT ON ids TO PUBLIC;  -- read by pg_temp.tid under SET ROLE
CREATE FUNCTION pg_temp.tid(p_name text) RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM ids WHERE name = p_name $$;
CREATE FUNCTION pg_temp.outbox_rows() RETURNS bigint LANGUAGE sql AS $$ SELECT count(*) FROM pgfence.outbox WHERE channel LIKE 'tap-tr%' $$;

-- =============================================================================================
-- Catalog, roles
-- =============================================================================================
SELECT has_function('pgfence', 'trace_contexts', ARRAY['text','bigint[]'], 'trace_contexts signature');
SELECT ok((SELECT prosecdef AND proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp']
           FROM pg_proc WHERE oid = 'pgfence.trace_contexts(text, bigint[])'::regprocedure),
  'trace_contexts is SECURITY DEFINER with a pinned search_path');
SELECT function_privs_are('pgfence', 'trace_contexts', ARRAY['text','bigint[]'], 'pgfence_executor', ARRAY['EXECUTE'], 'the executor may read trace contexts');
SELECT function_privs_are('pgfence', 'trace_contexts', ARRAY['text','bigint[]'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may');
SELECT function_privs_are('pgfence', 'trace_contexts', ARRAY['text','bigint[]'], 'pgfence_client', ARRAY[]::text[], 'a client may not');
SELECT function_privs_are('pgfence', '_traceparent', ARRAY[]::text[], 'pgfence_client', ARRAY[]::text[], '_traceparent is not granted to anyone');
SELECT ok((SELECT bool_and(p.prolang = (SELECT l.oid FROM pg_language l WHERE l.lanname = 'sql') AND NOT p.prosecdef AND p.proconfig IS NULL AND p.provolatile = 's')
           FROM pg_proc p WHERE p.oid IN ('pgfence._traceparent()'::regprocedure, 'pgfence._tracestate()'::regprocedure)),
  'the defaults are inlinable: stable SQL, no SET clause, not SECURITY DEFINER');
SELECT ok((SELECT bool_and(length(split_part(obj_description(p.oid, 'pg_proc'), E'\n', 1)) <= 100)
           FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace
             AND p.proname IN ('trace_contexts', '_traceparent', '_tracestate', '_trace_check')),
  'their comments start with a summary line of at most 100 characters');
-- (deparsed under the setup's search_path, which has pgfence: hence no schema in the text)
SELECT col_default_is('pgfence', 'outbox', 'traceparent', '_traceparent()', 'outbox.traceparent defaults to the setting');
SELECT col_default_is('pgfence', 'outbox', 'tracestate', '_tracestate()', 'outbox.tracestate defaults to the setting');
SELECT col_default_is('pgfence', 'plan', 'traceparent', '_traceparent()', 'plan.traceparent defaults to the setting');
SELECT col_default_is('pgfence', 'operation', 'traceparent', '_traceparent()', 'operation.traceparent defaults to the setting');
SELECT col_is_null('pgfence', 'outbox', 'traceparent', 'the columns are nullable');

-- =============================================================================================
-- Without the setting: NULL
-- =============================================================================================
INSERT INTO ids SELECT 'none', pgfence.outbox_enqueue('tap-tr', 'r', '{}');
SELECT results_eq($$SELECT traceparent, tracestate FROM pgfence.outbox WHERE id = pg_temp.tid('none')$$,
  $$VALUES (NULL::text, NULL::text)$$, 'no setting: no trace context');
SET LOCAL pgfence.traceparent = '';
INSERT INTO ids SELECT 'empty', pgfence.outbox_enqueue('tap-tr', 'r', '{}');
SELECT is((SELECT traceparent FROM pgfence.outbox WHERE id = pg_temp.tid('empty')), NULL, 'an empty setting: NULL');
SET LOCAL pgfence.tracestate = 'vendor=alone';
INSERT INTO ids SELECT 'state-alone', pgfence.outbox_enqueue('tap-tr', 'r', '{}');
SELECT is((SELECT tracestate FROM pgfence.outbox WHERE id = pg_temp.tid('state-alone')), NULL,
  'a tracestate without a traceparent is not kept');

-- =============================================================================================
-- With the setting: every outbox message, plan and operation the transaction inserts carries it
-- =============================================================================================
SET LOCAL pgfence.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
SET LOCAL pgfence.tracestate = 'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7';
INSERT INTO ids SELECT 'one', pgfence.outbox_enqueue('tap-tr', 'r', '{}');
SELECT results_eq($$SELECT traceparent, tracestate FROM pgfence.outbox WHERE id = pg_temp.tid('one')$$,
  $$VALUES ('00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'::text, 'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7'::text)$$,
  'outbox_enqueue: the message carries the traceparent and tracestate');
INSERT INTO ids SELECT 'many-' || ord, id FROM pgfence.outbox_enqueue_many('tap-tr', ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[]) WITH ORDINALITY AS e(id, ord);
SELECT is((SELECT count(*) FROM pgfence.outbox WHERE id IN (pg_temp.tid('many-1'), pg_temp.tid('many-2'))
             AND traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'), 2::bigint,
  'outbox_enqueue_many: every message carries it');
SELECT is(pgfence.plan_register_action('tap-tr.hook', NULL, 'an external step'), true, 'an external action');
INSERT INTO ids SELECT 'plan', pgfence.plan_propose('[{"action": "tap-tr.hook", "args": {"recipient": "r"}}]', 'tap-agent');
SELECT is((SELECT traceparent FROM pgfence.plan WHERE id = pg_temp.tid('plan')),
  '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', 'plan_propose: the plan carries it');
INSERT INTO ids SELECT 'op', id FROM pgfence.operation_request('tap-tr.op', 'target-1');
SELECT is((SELECT tracestate FROM pgfence.operation WHERE id = pg_temp.tid('op')),
  'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7', 'operation_request: the operation carries it');
SELECT lives_ok($$SELECT set_config('pgfence.traceparent', '01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00', true),
                         pgfence.outbox_enqueue('tap-tr', 'r', '{"v": 1}')$$,
  'a later version with the same fields and flags 00 is accepted');

-- =============================================================================================
-- A malformed value: 22023, nothing written
-- =============================================================================================
RESET pgfence.tracestate;
CREATE TEMP TABLE before AS SELECT pg_temp.outbox_rows() AS n;
SET LOCAL pgfence.traceparent = '00-4BF92F3577B34DA6A3CE929D0E0E4736-00F067AA0BA902B7-01';
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'uppercase hex: 22023');
SET LOCAL pgfence.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7';
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'no flags: 22023');
SET LOCAL pgfence.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra';
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'trailing fields: 22023');
SET LOCAL pgfence.traceparent = 'ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'version ff: 22023');
SET LOCAL pgfence.traceparent = '00-00000000000000000000000000000000-00f067aa0ba902b7-01';
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'an all-zero trace id: 22023');
SET LOCAL pgfence.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01';
SELECT throws_ok($$SELECT * FROM pgfence.outbox_enqueue_many('tap-tr', ARRAY['a'], ARRAY['{}']::jsonb[])$$, '22023', NULL,
  'an all-zero parent id: 22023 (enqueue_many)');
SELECT throws_ok($$SELECT pgfence.plan_propose('[{"action": "tap-tr.hook", "args": {"recipient": "r"}}]', 'tap-agent')$$, '22023', NULL,
  'plan_propose: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap-tr.op', 'target-2')$$, '22023', NULL, 'operation_request: 22023');
SET LOCAL pgfence.traceparent = 'not a traceparent';
SELECT throws_like($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '%is not a W3C traceparent: "not a traceparent"%',
  'the message names the value');
SET LOCAL pgfence.traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01';
SELECT set_config('pgfence.tracestate', 'a=1' || repeat('x', 510), true);
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'a tracestate over 512 characters: 22023');
SELECT set_config('pgfence.tracestate', E'a=1\nb=2', true);
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-tr', 'r', '{}')$$, '22023', NULL, 'a control character in the tracestate: 22023');
SELECT is(pg_temp.outbox_rows(), (SELECT n FROM before), 'nothing was written by the refused calls');
SELECT is((SELECT count(*) FROM pgfence.operation WHERE target = 'target-2'), 0::bigint, 'no operation either');
RESET pgfence.traceparent;
RESET pgfence.tracestate;

-- =============================================================================================
-- Frozen: the trace context is never updated (PF002), not even by the tables' owner
-- =============================================================================================
SELECT throws_ok($$UPDATE pgfence.outbox SET traceparent = NULL WHERE id = pg_temp.tid('one')$$, 'PF002', NULL,
  'an UPDATE of an outbox message''s traceparent: PF002');
SELECT throws_ok($$UPDATE pgfence.plan SET tracestate = 'x=1' WHERE id = pg_temp.tid('plan')$$, 'PF002', NULL,
  'of a plan''s tracestate: PF002');
SELECT throws_ok($$UPDATE pgfence.operation SET traceparent = '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-00' WHERE id = pg_temp.tid('op')$$,
  'PF002', NULL, 'of an operation''s traceparent: PF002');

-- =============================================================================================
-- trace_contexts: what the executor reads per claimed batch
-- =============================================================================================
SET LOCAL ROLE pgfence_executor;
SELECT results_eq($$SELECT id, traceparent, tracestate FROM pgfence.trace_contexts('outbox',
                      ARRAY[pg_temp.tid('none'), pg_temp.tid('one'), pg_temp.tid('many-2'), -1])$$,
  $$VALUES (pg_temp.tid('one'), '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'::text, 'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7'::text),
           (pg_temp.tid('many-2'), '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01'::text, 'congo=t61rcWkgMzE,rojo=00f067aa0ba902b7'::text)$$,
  'outbox: the messages with a trace context (none, unknown ids left out)');
SELECT is((SELECT traceparent FROM pgfence.trace_contexts('plan', ARRAY[pg_temp.tid('plan')])),
  '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', 'plan');
SELECT is((SELECT count(*) FROM pgfence.trace_contexts('operation', ARRAY[pg_temp.tid('op')])), 1::bigint, 'operation');
SELECT is((SELECT count(*) FROM pgfence.trace_contexts('outbox', '{}')), 0::bigint, 'no ids: no rows');
SELECT throws_ok($$SELECT * FROM pgfence.trace_contexts(NULL, ARRAY[1::bigint])$$, '22004', NULL, 'module NULL: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.trace_contexts('outbox', NULL)$$, '22004', NULL, 'ids NULL: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.trace_contexts('document', ARRAY[1::bigint])$$, '22023', NULL, 'an unknown module: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.trace_contexts('outbox', ARRAY(SELECT generate_series(1, 10001)::bigint))$$, '22023', NULL,
  'more than 10000 ids: 22023');
RESET ROLE;
SET LOCAL ROLE pgfence_client;
SELECT throws_ok($$SELECT * FROM pgfence.trace_contexts('outbox', ARRAY[1::bigint])$$, '42501', NULL, 'as pgfence_client: refused (42501)');
SELECT lives_ok($$SELECT set_config('pgfence.traceparent', '00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01', true),
                         pgfence.outbox_enqueue('tap-tr', 'r', '{"v": 2}')$$,
  'as pgfence_client: any SQL client sets the context for its enqueue');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
