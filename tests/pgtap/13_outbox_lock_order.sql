-- pgTAP: Module 1 — outbox, the bulk calls take their locks in one canonical order (issue 11,
-- case 12): two overlapping outbox_enqueue_many calls with the same idempotency keys in
-- different orders, and two outbox_mark_sent_many calls over the same (id, attempt) pairs in
-- different orders, used to deadlock (40P01). Each case is set up so that the old input-order
-- locking deadlocks every time: a third session holds the middle key / row while both calls
-- start, so each has taken a different end before it waits; when the third session lets go,
-- each wants what the other holds. In one canonical order the second call waits for the first.
-- Fixtures are committed through dblink peers on channels 'tap-lo-*' and deleted at the end.
BEGIN;
\ir helpers/setup.sql
SELECT plan(14);

SELECT tap_helpers.peer('lo_a');
SELECT tap_helpers.peer('lo_b');
SELECT tap_helpers.peer('lo_c');

-- Wait (bounded: at most 10 s) until a peer's backend waits for a lock; pg_locks is read live.
CREATE TEMP TABLE peer_pid (peer text PRIMARY KEY, pid integer);
INSERT INTO peer_pid SELECT n, tap_helpers.peer_value(n, 'SELECT pg_backend_pid()')::integer FROM unnest(ARRAY['lo_a', 'lo_b']) n;
CREATE FUNCTION pg_temp.wait_blocked(p_peer text) RETURNS boolean LANGUAGE plpgsql AS $$
DECLARE
  v_pid integer := (SELECT pid FROM peer_pid WHERE peer = p_peer);
BEGIN
  FOR i IN 1 .. 1000 LOOP
    IF EXISTS (SELECT 1 FROM pg_catalog.pg_locks l WHERE l.pid = v_pid AND NOT l.granted) THEN
      RETURN true;
    END IF;
    PERFORM pg_sleep(0.01);
  END LOOP;
  RETURN false;
END $$;

-- =============================================================================================
-- outbox_enqueue_many: keys (c, b, a) and (a, b, c)
-- =============================================================================================
SELECT dblink_exec('lo_c', 'BEGIN');
SELECT tap_helpers.peer_value('lo_c', $$SELECT pgfence.outbox_enqueue('tap-lo-keys', 'r', '{}', 'tap-lo-b')$$);
SELECT dblink_exec('lo_a', 'BEGIN');
SELECT dblink_send_query('lo_a', $$SELECT * FROM pgfence.outbox_enqueue_many('tap-lo-keys', ARRAY['r', 'r', 'r'],
  ARRAY['{"by": "a"}', '{"by": "a"}', '{"by": "a"}']::jsonb[], ARRAY['tap-lo-c', 'tap-lo-b', 'tap-lo-a']) AS t(id)$$);
SELECT ok(pg_temp.wait_blocked('lo_a'), 'call A (keys c, b, a) waits for the session holding key b');
SELECT dblink_exec('lo_b', 'BEGIN');
SELECT dblink_send_query('lo_b', $$SELECT * FROM pgfence.outbox_enqueue_many('tap-lo-keys', ARRAY['r', 'r', 'r'],
  ARRAY['{"by": "b"}', '{"by": "b"}', '{"by": "b"}']::jsonb[], ARRAY['tap-lo-a', 'tap-lo-b', 'tap-lo-c']) AS t(id)$$);
SELECT ok(pg_temp.wait_blocked('lo_b'), 'call B (keys a, b, c) waits too');
SELECT dblink_exec('lo_c', 'ROLLBACK');
CREATE TEMP TABLE got_a AS SELECT row_number() OVER () AS i, id FROM dblink_get_result('lo_a', false) AS t(id bigint);
SELECT is(dblink_error_message('lo_a'), 'OK', 'call A finishes without an error (no deadlock)');
SELECT * FROM dblink_get_result('lo_a', false) AS t(id bigint);
SELECT dblink_exec('lo_a', 'COMMIT');
CREATE TEMP TABLE got_b AS SELECT row_number() OVER () AS i, id FROM dblink_get_result('lo_b', false) AS t(id bigint);
SELECT is(dblink_error_message('lo_b'), 'OK', 'call B, which waited for A, finishes without an error');
SELECT * FROM dblink_get_result('lo_b', false) AS t(id bigint);
SELECT dblink_exec('lo_b', 'COMMIT');
SELECT is((SELECT array_agg(id ORDER BY i) FROM got_b), (SELECT array_agg(id ORDER BY i DESC) FROM got_a),
  'B gets the ids A inserted, key for key (its keys in the reverse order)');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-lo-keys'), 3, 'three messages, one per key');

-- A key that a concurrent transaction commits while the call waits for it: its id, not NULL
-- (the ids were read in the insert's own statement, whose snapshot predates that commit).
SELECT dblink_exec('lo_c', 'BEGIN');
CREATE TEMP TABLE held AS SELECT * FROM dblink('lo_c', $$SELECT * FROM pgfence.outbox_enqueue_many('tap-lo-keys', ARRAY['r'],
  ARRAY['{}']::jsonb[], ARRAY['tap-lo-d']) AS t(id)$$) AS t(id bigint);
SELECT dblink_send_query('lo_a', $$SELECT * FROM pgfence.outbox_enqueue_many('tap-lo-keys', ARRAY['r', 'r'],
  ARRAY['{}', '{}']::jsonb[], ARRAY['tap-lo-e', 'tap-lo-d']) AS t(id)$$);
SELECT ok(pg_temp.wait_blocked('lo_a'), 'a call with key d waits for the transaction that holds it');
SELECT dblink_exec('lo_c', 'COMMIT');
CREATE TEMP TABLE waited AS SELECT row_number() OVER () AS i, id FROM dblink_get_result('lo_a', false) AS t(id bigint);
SELECT * FROM dblink_get_result('lo_a', false) AS t(id bigint);
SELECT is((SELECT id FROM waited WHERE i = 2), (SELECT id FROM held),
  'after that transaction commits, the call returns its message id for key d (not NULL)');

-- =============================================================================================
-- outbox_mark_sent_many: pairs (3, 2, 1) and (1, 2, 3)
-- =============================================================================================
CREATE TEMP TABLE ms AS SELECT * FROM dblink('lo_c', $$SELECT * FROM pgfence.outbox_enqueue_many('tap-lo-mark',
  ARRAY['r', 'r', 'r'], ARRAY['{}', '{}', '{}']::jsonb[]) AS t(id)$$) AS t(id bigint);
SELECT is((SELECT count(*)::int FROM dblink('lo_c', $$SELECT id FROM pgfence.outbox_claim('tap-lo-w', 3, ARRAY['tap-lo-mark'])$$) AS t(id bigint)), 3,
  'three messages claimed (attempt 1)');
SELECT dblink_exec('lo_c', 'BEGIN');
SELECT tap_helpers.peer_value('lo_c', format('SELECT id FROM pgfence.outbox WHERE id = %s FOR UPDATE', (SELECT id FROM ms ORDER BY id OFFSET 1 LIMIT 1)));
SELECT dblink_exec('lo_a', 'BEGIN');
SELECT dblink_send_query('lo_a', format('SELECT * FROM pgfence.outbox_mark_sent_many(%L::bigint[], ARRAY[1, 1, 1]) AS t(id)',
  (SELECT array_agg(id ORDER BY id DESC) FROM ms)));
SELECT ok(pg_temp.wait_blocked('lo_a'), 'mark A (ids descending) waits for the session holding the middle row');
SELECT dblink_exec('lo_b', 'BEGIN');
SELECT dblink_send_query('lo_b', format('SELECT * FROM pgfence.outbox_mark_sent_many(%L::bigint[], ARRAY[1, 1, 1]) AS t(id)',
  (SELECT array_agg(id ORDER BY id) FROM ms)));
SELECT ok(pg_temp.wait_blocked('lo_b'), 'mark B (ids ascending) waits too');
SELECT dblink_exec('lo_c', 'ROLLBACK');
CREATE TEMP TABLE marked_a AS SELECT * FROM dblink_get_result('lo_a', false) AS t(id bigint);
SELECT is(dblink_error_message('lo_a'), 'OK', 'mark A finishes without an error (no deadlock)');
SELECT * FROM dblink_get_result('lo_a', false) AS t(id bigint);
SELECT dblink_exec('lo_a', 'COMMIT');
CREATE TEMP TABLE marked_b AS SELECT * FROM dblink_get_result('lo_b', false) AS t(id bigint);
SELECT is(dblink_error_message('lo_b'), 'OK', 'mark B finishes without an error');
SELECT * FROM dblink_get_result('lo_b', false) AS t(id bigint);
SELECT dblink_exec('lo_b', 'COMMIT');
SELECT is((SELECT count(*)::int FROM marked_a) * 10 + (SELECT count(*)::int FROM marked_b), 30,
  'A marked all three sent; B found its claims stale (a lost race, no error)');

-- clean up committed fixtures
SELECT dblink_exec('lo_c', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox WHERE channel LIKE 'tap-lo-%'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
