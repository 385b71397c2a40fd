-- pgTAP: what holds back cleanup (functions/89_audit_cleanup.sql): a real second session holding
-- a REPEATABLE READ snapshot is listed by audit_cleanup_blockers with its pid, xmin, xid age and
-- age, warned past pgfence.cleanup_warn_after, and shown by audit_stuck and audit_queue_health;
-- audit_table_health counts the hot tables' dead rows. (pg_stat_activity is read once per
-- transaction: each check first clears that snapshot.)
BEGIN;
\ir helpers/setup.sql
SELECT plan(16);

SELECT has_view('pgfence', 'audit_cleanup_blockers', 'audit_cleanup_blockers view');
SELECT has_view('pgfence', 'audit_table_health', 'audit_table_health view');
SELECT is(pgfence._audit_cleanup_warn_after(), interval '5 minutes', 'the warning threshold defaults to 5 minutes');

SELECT tap_helpers.peer('holder');
SELECT dblink_exec('holder', $$SET application_name = 'tap-cleanup-holder'$$);
SELECT tap_helpers.peer_value('holder', 'SELECT pg_backend_pid()') AS holder_pid \gset
SELECT dblink_exec('holder', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT tap_helpers.peer_value('holder', 'SELECT count(*) FROM pgfence.outbox');  -- takes the snapshot
SELECT pgfence.outbox_enqueue('tap-cleanup', 'r', '{}');

SELECT pg_stat_clear_snapshot();
SELECT results_eq(
  format($$SELECT kind, holder, state, xmin IS NOT NULL, xid_age >= 0, since IS NOT NULL, warn
           FROM pgfence.audit_cleanup_blockers WHERE pid = %s$$, :holder_pid),
  $$VALUES ('transaction', 'tap-cleanup-holder', 'idle in transaction', true, true, true, false)$$,
  'a session holding a snapshot is listed: kind, holder (application_name), state, xmin, xid age, since; not yet warned');
SELECT ok((SELECT count(*) = 0 FROM pgfence.audit_cleanup_blockers WHERE pid = pg_backend_pid()),
  'the reading session itself is not listed');
SELECT is((SELECT count(*)::int FROM pgfence.audit_stuck WHERE module = 'database'), 0,
  'audit_stuck lists no holder before the threshold');

SET LOCAL pgfence.cleanup_warn_after = '-1 hour';  -- any age is past it
SELECT pg_stat_clear_snapshot();
SELECT ok((SELECT warn FROM pgfence.audit_cleanup_blockers WHERE pid = :holder_pid), 'past pgfence.cleanup_warn_after it is warned');
SELECT results_eq(
  format($$SELECT queue, status, owner, fence >= 0, next LIKE 'transaction pid %s (tap-cleanup-holder) holds back VACUUM of every pgfence table%%'
           FROM pgfence.audit_stuck WHERE module = 'database' AND item_id = %s$$, :holder_pid, :holder_pid),
  $$VALUES ('transaction', 'idle in transaction', 'tap-cleanup-holder', true, true)$$,
  'audit_stuck lists it (module database): kind, state, holder, xid age, and what to do');
SELECT ok((SELECT cleanup_held_by LIKE 'transaction pid %' FROM pgfence.audit_queue_health
           WHERE module = 'outbox' AND queue = 'tap-cleanup'), 'audit_queue_health names the oldest holder');
SELECT ok((SELECT count(*) > 0 FROM pgfence.audit_queue_health WHERE module = 'outbox' AND queue = 'tap-cleanup' AND dead_rows >= 0),
  'and the dead rows of the module''s table');
SET LOCAL pgfence.cleanup_warn_after = 'soon';
SELECT throws_ok($$SELECT bool_or(warn) FROM pgfence.audit_cleanup_blockers$$, '22007', NULL, 'a threshold that is not an interval is 22007');
RESET pgfence.cleanup_warn_after;

SELECT dblink_exec('holder', 'COMMIT');
SELECT pg_stat_clear_snapshot();
SELECT is((SELECT count(*)::int FROM pgfence.audit_cleanup_blockers WHERE pid = :holder_pid), 0, 'once it commits it is gone');
SELECT tap_helpers.close_peers();

SELECT results_eq(
  $$SELECT table_bytes > 0, index_bytes > 0, dead_rows >= 0, live_rows >= 0 FROM pgfence.audit_table_health WHERE table_name = 'outbox'$$,
  $$VALUES (true, true, true, true)$$, 'audit_table_health: the outbox''s sizes and dead and live rows');
SELECT is((SELECT array_agg(table_name ORDER BY table_name) FROM pgfence.audit_table_health),
  ARRAY['document', 'document_revision', 'event', 'operation', 'outbox', 'outbox_lapse', 'plan', 'plan_step'],
  'audit_table_health covers the hot tables');

SET ROLE pg_monitor;
SELECT lives_ok($$SELECT count(*) FROM pgfence.audit_cleanup_blockers$$, 'pg_monitor reads audit_cleanup_blockers');
SELECT lives_ok($$SELECT count(*) FROM pgfence.audit_table_health$$, 'pg_monitor reads audit_table_health');
RESET ROLE;

SELECT * FROM finish();
ROLLBACK;
