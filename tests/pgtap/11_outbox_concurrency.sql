-- pgTAP: Module 1 — outbox, the cells that need two sessions at once.
-- Fixtures are committed through dblink peers on channels 'tap-conc-*' and deleted at the end.
BEGIN;
\ir helpers/setup.sql
SELECT plan(17);

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

-- =============================================================================================
-- Two sessions claiming at once never get the same row
-- =============================================================================================
SELECT tap_helpers.peer_value('c0', $$SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-conc-claim', array_fill('r'::text, ARRAY[6]), array_fill('{}'::jsonb, ARRAY[6]))$$);
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE got1 AS SELECT * FROM dblink('c1', $$SELECT id FROM pgfence.outbox_claim('tap-c1', 3, ARRAY['tap-conc-claim'])$$) AS t(id bigint);
-- c1 still holds its row locks (transaction open) while c2 claims
CREATE TEMP TABLE got2 AS SELECT * FROM dblink('c2', $$SELECT id FROM pgfence.outbox_claim('tap-c2', 10, ARRAY['tap-conc-claim'])$$) AS t(id bigint);
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT count(*)::int FROM got1), 3, 'session 1 claims 3 of 6');
SELECT is((SELECT count(*)::int FROM got2), 3, 'session 2, claiming while session 1 holds its rows, gets the other 3 (SKIP LOCKED, no wait)');
SELECT is((SELECT count(*)::int FROM got1 JOIN got2 USING (id)), 0, 'no row was claimed by both sessions');
SELECT is((SELECT count(DISTINCT id)::int FROM (SELECT id FROM got1 UNION ALL SELECT id FROM got2) u), 6, 'together they claimed every row once');

-- =============================================================================================
-- A repeated idempotency key from two concurrent transactions: one row, same id, no error
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE k1 AS SELECT * FROM dblink('c1', $$SELECT pgfence.outbox_enqueue('tap-conc-key', 'r', '{"from": 1}', 'tap-conc-key-A')$$) AS t(id bigint);
SELECT dblink_send_query('c2', $$SELECT pgfence.outbox_enqueue('tap-conc-key', 'r', '{"from": 2}', 'tap-conc-key-A')$$);
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'the second transaction waits on the first one''s key');
SELECT dblink_exec('c1', 'COMMIT');
CREATE TEMP TABLE k2 AS SELECT * FROM dblink_get_result('c2') AS t(id bigint);
SELECT is((SELECT id FROM k2), (SELECT id FROM k1), 'after the first commits, the second gets the same id (no unique_violation)');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE idempotency_key = 'tap-conc-key-A'), 1, 'exactly one row exists for the key');
SELECT is((SELECT payload FROM pgfence.outbox WHERE idempotency_key = 'tap-conc-key-A'), '{"from": 1}'::jsonb, 'the first transaction''s payload wins');

-- the first one rolls back: the waiter inserts its own row
SELECT dblink_exec('c1', 'BEGIN');
SELECT * FROM dblink('c1', $$SELECT pgfence.outbox_enqueue('tap-conc-key', 'r', '{"from": 1}', 'tap-conc-key-B')$$) AS t(id bigint);
SELECT dblink_send_query('c2', $$SELECT pgfence.outbox_enqueue('tap-conc-key', 'r', '{"from": 2}', 'tap-conc-key-B')$$);
SELECT pg_sleep(0.3);
SELECT dblink_exec('c1', 'ROLLBACK');
CREATE TEMP TABLE k3 AS SELECT * FROM dblink_get_result('c2') AS t(id bigint);
SELECT results_eq($$SELECT id, payload FROM pgfence.outbox WHERE idempotency_key = 'tap-conc-key-B'$$,
  $$SELECT id, '{"from": 2}'::jsonb FROM k3$$,
  'if the first transaction rolls back, the waiting one inserts its own message');

-- =============================================================================================
-- The reaper never touches a row completed between its read and its write
-- =============================================================================================
CREATE TEMP TABLE race AS SELECT * FROM dblink('c0', $$SELECT pgfence.outbox_enqueue('tap-conc-reap', 'r', '{}')$$) AS t(id bigint);
SELECT * FROM dblink('c0', $$SELECT attempt FROM pgfence.outbox_claim('tap-slow', 1, ARRAY['tap-conc-reap'])$$) AS t(a int);
SELECT dblink_exec('c0', format('UPDATE pgfence.outbox SET lease_expires_at = now() - interval ''1 second'' WHERE id = %s', (SELECT id FROM race)));
-- the slow owner finishes just as the lease lapses: its mark holds the row lock, not yet committed
SELECT dblink_exec('c1', 'BEGIN');
SELECT is((SELECT ok FROM dblink('c1', format('SELECT pgfence.outbox_mark_sent(%s, 1)', (SELECT id FROM race))) AS t(ok boolean)), true,
  'the slow owner''s mark_sent succeeds (lapsed but not yet reclaimed)');
SELECT is((SELECT n FROM dblink('c2', 'SELECT pgfence.outbox_reclaim_stale()') AS t(n int)), 0,
  'the reaper running meanwhile skips the row being marked');
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT n FROM dblink('c2', 'SELECT pgfence.outbox_reclaim_stale()') AS t(n int)), 0,
  'after the commit the reaper re-reads the row and leaves it alone');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT id FROM race)), 'sent', 'the message is sent, not sent-and-reclaimed');

-- =============================================================================================
-- NOTIFY carries only the channel and the id, even for a 100 kB payload
-- =============================================================================================
SELECT dblink_exec('c2', 'LISTEN pgfence_outbox');
CREATE TEMP TABLE big AS SELECT * FROM dblink('c0',
  $$SELECT pgfence.outbox_enqueue('tap-conc-big', 'r', jsonb_build_object('blob', repeat('x', 100 * 1024)))$$) AS t(id bigint);
SELECT * FROM dblink('c2', 'SELECT 1') AS t(x int);   -- let c2 read its socket
CREATE TEMP TABLE heard AS SELECT * FROM dblink_get_notify('c2');
SELECT is((SELECT count(*)::int FROM heard WHERE notify_name = 'pgfence_outbox'), 1, 'the listener got one notification');
SELECT is((SELECT extra::jsonb FROM heard), jsonb_build_object('channel', 'tap-conc-big', 'id', (SELECT id FROM big)),
  'its payload is {"channel", "id"} only');
SELECT cmp_ok((SELECT length(extra) FROM heard), '<', 100, 'a few bytes, not the 100 kB payload');

-- a message delayed into the future sends no NOTIFY (the executor's due-time sleep finds it)
SELECT * FROM dblink('c0', $$SELECT pgfence.outbox_enqueue('tap-conc-big', 'r', '{}', NULL, now() + interval '1 hour')$$) AS t(id bigint);
SELECT * FROM dblink('c2', 'SELECT 1') AS t(x int);
SELECT is((SELECT count(*)::int FROM dblink_get_notify('c2')), 0, 'no NOTIFY for a message that is not due yet');

-- clean up committed fixtures
SELECT dblink_exec('c0', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox WHERE channel LIKE 'tap-conc-%'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
