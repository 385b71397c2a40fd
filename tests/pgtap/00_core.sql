-- pgTAP: core — schema version, backoff, catalog documentation, privileges across all modules.
BEGIN;
\ir helpers/setup.sql
SELECT plan(30);

-- schema_version
SELECT has_function('pgfence', 'schema_version', ARRAY[]::text[], 'schema_version() exists');
SELECT ok(pgfence.schema_version() >= 2, 'schema_version() reports the migrated version');
SELECT is_definer('pgfence', 'schema_version', ARRAY[]::text[], 'schema_version() is SECURITY DEFINER (roles cannot read pgfence.meta)');
SELECT function_privs_are('pgfence', 'schema_version', ARRAY[]::text[], 'pgfence_client', ARRAY['EXECUTE'], 'client may read the schema version');

-- roles
SELECT has_role('pgfence_client', 'role pgfence_client exists');
SELECT has_role('pgfence_executor', 'role pgfence_executor exists');
SELECT has_role('pgfence_admin', 'role pgfence_admin exists');
SELECT is((SELECT count(*)::int FROM pg_roles WHERE rolname LIKE 'pgfence\_%' AND rolcanlogin), 0, 'group roles are NOLOGIN');

-- backoff: exponential, capped, jittered, no overflow
SELECT is(pgfence.backoff(1, '1 second', '1 hour', 0), interval '1 second', 'backoff(1) = base');
SELECT is(pgfence.backoff(4, '1 second', '1 hour', 0), interval '8 seconds', 'backoff(4) = base * 2^3');
SELECT is(pgfence.backoff(5000, '1 second', '1 hour', 0), interval '1 hour', 'backoff(5000) is the cap, no overflow');
SELECT is(pgfence.backoff(2147483647, '1 second', '1 hour', 0), interval '1 hour', 'backoff(max int) is the cap');
SELECT ok(pgfence.backoff(0, '2 seconds', '1 hour', 0) = interval '2 seconds', 'backoff(0) is treated as the first attempt');
SELECT is(pgfence.backoff(5000, '1 second', '1 hour', 0.999999), make_interval(secs => 3600 * (1 - 0.999999 / 2)), 'jitter shortens by at most half');
SELECT ok((SELECT bool_and(b BETWEEN interval '30 minutes' AND interval '1 hour')
           FROM (SELECT pgfence.backoff(5000, '1 second', '1 hour') AS b FROM generate_series(1, 200)) s),
          'random jitter at the cap stays within [cap/2, cap]');
SELECT ok((SELECT count(DISTINCT pgfence.backoff(10, '1 second', '1 hour')) FROM generate_series(1, 50)) > 1,
          'backoff is jittered: equal attempts give different delays');
SELECT throws_ok($$SELECT pgfence.backoff(NULL, '1 second', '1 hour')$$, '22004', NULL, 'backoff: NULL attempt is 22004');
SELECT throws_ok($$SELECT pgfence.backoff(1, '0 seconds', '1 hour')$$, '22023', NULL, 'backoff: base 0 is 22023');
SELECT throws_ok($$SELECT pgfence.backoff(1, '1 hour', '1 second')$$, '22023', NULL, 'backoff: cap < base is 22023');
SELECT throws_ok($$SELECT pgfence.backoff(1, '1 second', '1 hour', 1.0)$$, '22023', NULL, 'backoff: jitter 1.0 is 22023');

-- documentation in the catalog: every public function and view has a COMMENT
SELECT is(
  (SELECT array_agg(p.oid::regprocedure::text ORDER BY 1) FROM pg_proc p
   WHERE p.pronamespace = 'pgfence'::regnamespace AND obj_description(p.oid, 'pg_proc') IS NULL),
  NULL, 'every function in schema pgfence has COMMENT ON');
SELECT is(
  (SELECT array_agg(c.relname::text ORDER BY 1) FROM pg_class c
   WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('v', 'r', 'm')
     AND c.relname NOT LIKE '\_yoyo%' AND c.relname <> 'yoyo_lock'
     AND obj_description(c.oid, 'pg_class') IS NULL),
  NULL, 'every pgfence table and view has COMMENT ON');

-- privileges: nothing for PUBLIC, no table granted to any pgfence role
SELECT is(
  (SELECT array_agg(p.oid::regprocedure::text ORDER BY 1) FROM pg_proc p
   WHERE p.pronamespace = 'pgfence'::regnamespace AND has_function_privilege('public', p.oid, 'EXECUTE')),
  NULL, 'PUBLIC may execute no pgfence function');
SELECT is(
  (SELECT array_agg(DISTINCT c.relname::text ORDER BY c.relname::text) FROM pg_class c
   CROSS JOIN unnest(ARRAY['pgfence_client', 'pgfence_executor', 'pgfence_admin']) AS r(role)
   WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind = 'r'
     AND (has_table_privilege(r.role, c.oid, 'INSERT') OR has_table_privilege(r.role, c.oid, 'UPDATE')
          OR has_table_privilege(r.role, c.oid, 'DELETE') OR has_table_privilege(r.role, c.oid, 'SELECT'))),
  NULL, 'no pgfence role reads or writes any table directly');

-- the event log: every event names its login and transaction; append-only; deleted only by a purge
SELECT pgfence._event('plan', -1, 'tap_core', NULL, NULL, NULL, NULL, 'tap-actor');
SELECT results_eq($$SELECT actor, db_user, txid = pg_current_xact_id() FROM pgfence.event WHERE item_id = -1 AND event = 'tap_core'$$,
  $$VALUES ('tap-actor'::text, session_user::text COLLATE "default", true)$$,
  'an event records the actor passed, the database login (db_user) and the transaction');
SELECT throws_ok($$UPDATE pgfence.event SET actor = 'someone_else' WHERE item_id = -1$$, 'PF002', NULL, 'UPDATE of an event: PF002 (append-only)');
SELECT throws_ok($$DELETE FROM pgfence.event WHERE item_id = -1$$, 'PF002', NULL, 'DELETE of an event outside a purge: PF002');
SELECT throws_ok($$DELETE FROM pgfence.event$$, 'PF002', NULL, 'DELETE FROM pgfence.event: PF002');
SAVEPOINT before_purge;
SET LOCAL pgfence.purging = on;
SELECT lives_ok($$DELETE FROM pgfence.event WHERE item_id = -1$$, 'with pgfence.purging on (as the purge sets it) events can be deleted');
ROLLBACK TO SAVEPOINT before_purge;
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE item_id = -1), 1, 'the refused statements left the event as it was');

SELECT * FROM finish();
ROLLBACK;
