-- pgTAP: Module 3 — operation, the cells that need two sessions at once.
-- Fixtures are committed through dblink peers on kinds 'tap-conc.*' and deleted at the end.
BEGIN;
\ir helpers/setup.sql
SELECT plan(21);

-- SQLSTATE and DETAIL of a statement's error.
CREATE FUNCTION pg_temp.err(p_sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  v_state text;
  v_detail text;
BEGIN
  EXECUTE p_sql;
  RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
  GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_detail = PG_EXCEPTION_DETAIL;
  RETURN v_state || ': ' || coalesce(v_detail, '');
END $$;

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

-- =============================================================================================
-- The same idempotency key from two concurrent transactions: one operation, same id, no error
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE k1 AS SELECT * FROM dblink('c1',
  $$SELECT id, created FROM pgfence.operation_request('tap-conc.reset', 'same-key', '{"to": "main"}', 'tap-conc-key-A', 'c1')$$) AS t(id bigint, created boolean);
SELECT dblink_send_query('c2',
  $$SELECT id, created FROM pgfence.operation_request('tap-conc.reset', 'same-key', '{"to": "main"}', 'tap-conc-key-A', 'c2')$$);
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'the second request waits for the first transaction');
SELECT dblink_exec('c1', 'COMMIT');
CREATE TEMP TABLE k2 AS SELECT * FROM dblink_get_result('c2') AS t(id bigint, created boolean);
SELECT * FROM dblink_get_result('c2') AS t(id bigint, created boolean);  -- drain
SELECT results_eq($$SELECT id, created FROM k2$$, $$SELECT id, false FROM k1$$,
  'after the first commits, the second gets the same operation with created = false (no unique_violation)');
SELECT is((SELECT created FROM k1), true, 'the first one created it');
SELECT is((SELECT count(*)::int FROM pgfence.operation WHERE idempotency_key = 'tap-conc-key-A'), 1, 'exactly one operation exists for the key');
SELECT is((SELECT requested_by FROM pgfence.operation WHERE idempotency_key = 'tap-conc-key-A'), 'c1', 'it is the first transaction''s');

-- the first one rolls back: the waiter creates its own
SELECT dblink_exec('c1', 'BEGIN');
SELECT * FROM dblink('c1', $$SELECT id FROM pgfence.operation_request('tap-conc.reset', 'rollback', '{}', 'tap-conc-key-B', 'c1')$$) AS t(id bigint);
SELECT dblink_send_query('c2', $$SELECT id, created FROM pgfence.operation_request('tap-conc.reset', 'rollback', '{}', 'tap-conc-key-B', 'c2')$$);
SELECT pg_sleep(0.3);
SELECT dblink_exec('c1', 'ROLLBACK');
CREATE TEMP TABLE k3 AS SELECT * FROM dblink_get_result('c2') AS t(id bigint, created boolean);
SELECT * FROM dblink_get_result('c2') AS t(id bigint, created boolean);
SELECT results_eq($$SELECT o.id, o.requested_by, k3.created FROM pgfence.operation o JOIN k3 USING (id) WHERE o.idempotency_key = 'tap-conc-key-B'$$,
  $$VALUES ((SELECT id FROM k3), 'c2'::text, true)$$,
  'if the first transaction rolls back, the waiting one creates the operation');

-- =============================================================================================
-- Two different requests for one target at once: the second is refused naming the first
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE busy1 AS SELECT * FROM dblink('c1',
  $$SELECT id FROM pgfence.operation_request('tap-conc.reset', 'busy', '{}', 'tap-conc-key-C1', 'c1')$$) AS t(id bigint);
SELECT dblink_send_query('c2', $$SELECT id FROM pgfence.operation_request('tap-conc.reset', 'busy', '{}', 'tap-conc-key-C2', 'c2')$$);
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'a different request for the same target waits on the one-in-flight index');
SELECT dblink_exec('c1', 'COMMIT');
SELECT is(pg_temp.err($$SELECT * FROM dblink_get_result('c2') AS t(id bigint)$$),
  format('PF201: Operation %s is queued for tap-conc.reset busy (idempotency key tap-conc-key-C1, requested by c1 at %s).',
         (SELECT id FROM busy1), (SELECT pgfence._operation_ts(created_at) FROM pgfence.operation WHERE id = (SELECT id FROM busy1))),
  'once the first commits, the waiting request fails with PF201 naming the operation in flight');
SELECT * FROM dblink_get_result('c2', false) AS t(id bigint);  -- drain
SELECT is((SELECT count(*)::int FROM pgfence.operation WHERE kind = 'tap-conc.reset' AND target = 'busy'), 1, 'only the first operation exists');

-- A REPEATABLE READ snapshot that cannot see the committed holder of the key: 40001, retry
SELECT dblink_exec('c1', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT * FROM dblink('c1', 'SELECT 1') AS t(x int);  -- the snapshot is taken here
SELECT * FROM dblink('c0', $$SELECT id FROM pgfence.operation_request('tap-conc.reset', 'rr', '{}', 'tap-conc-key-RR')$$) AS t(id bigint);
SELECT throws_ok($$SELECT * FROM dblink('c1', 'SELECT id FROM pgfence.operation_request(''tap-conc.reset'', ''rr'', ''{}'', ''tap-conc-key-RR'')') AS t(id bigint)$$,
  '40001', NULL, 'under REPEATABLE READ, a key committed after the snapshot is 40001 (retry the transaction)');
SELECT dblink_exec('c1', 'ROLLBACK');

-- =============================================================================================
-- Two executors claiming at once never get the same operation
-- =============================================================================================
SELECT * FROM dblink('c0', $$SELECT count(*) FROM generate_series(1, 6) g, pgfence.operation_request('tap-conc.claim', 'target-' || g)$$) AS t(n bigint);
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE got1 AS SELECT * FROM dblink('c1', $$SELECT id FROM pgfence.operation_claim('tap-c1', ARRAY['tap-conc.claim'], NULL, 3)$$) AS t(id bigint);
CREATE TEMP TABLE got2 AS SELECT * FROM dblink('c2', $$SELECT id FROM pgfence.operation_claim('tap-c2', ARRAY['tap-conc.claim'], NULL, 10)$$) AS t(id bigint);
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT count(*)::int FROM got1), 3, 'executor 1 claims 3 of 6');
SELECT is((SELECT count(*)::int FROM got2), 3, 'executor 2, claiming while executor 1 holds its rows, gets the other 3 (SKIP LOCKED)');
SELECT is((SELECT count(*)::int FROM got1 JOIN got2 USING (id)), 0, 'no operation was claimed twice');

-- ... also when each claims several kinds (one walk per kind, SKIP LOCKED in each)
CREATE TEMP TABLE kq AS SELECT * FROM dblink('c0', $$SELECT g, (pgfence.operation_request(CASE WHEN g % 2 = 1 THEN 'tap-conc.kx' ELSE 'tap-conc.ky' END, 'kq-' || g)).id FROM generate_series(1, 6) g$$) AS t(g int, id bigint);
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE kgot1 AS SELECT * FROM dblink('c1', $$SELECT id FROM pgfence.operation_claim('tap-c1', ARRAY['tap-conc.kx'], NULL, 1)$$) AS t(id bigint);
CREATE TEMP TABLE kgot2 AS SELECT * FROM dblink('c2', $$SELECT id FROM pgfence.operation_claim('tap-c2', ARRAY['tap-conc.ky', 'tap-conc.kx'], NULL, 3)$$) AS t(id bigint);
SELECT dblink_exec('c1', 'COMMIT');
SELECT results_eq($$SELECT id FROM kgot1$$, $$SELECT id FROM kq WHERE g = 1$$, 'executor 1 holds the oldest of kind kx');
SELECT results_eq($$SELECT id FROM kgot2$$, $$SELECT id FROM kq WHERE g IN (2, 3, 4) ORDER BY id$$,
  'executor 2, claiming kinds ky and kx meanwhile, skips it and gets the next three oldest of both kinds, in order');

-- =============================================================================================
-- An owner's write in progress blocks a takeover: the fence is checked under the row lock
-- =============================================================================================
CREATE TEMP TABLE f AS SELECT * FROM dblink('c0',
  $$SELECT id FROM pgfence.operation_request('tap-conc.fence', 'f1')$$) AS t(id bigint);
SELECT * FROM dblink('c0', $$SELECT fence FROM pgfence.operation_claim('tap-slow', ARRAY['tap-conc.fence'])$$) AS t(fence int);
SELECT * FROM dblink('c0', format($$SELECT pgfence.operation_begin_issue(%s, 1, false) || ' ' || pgfence.operation_record_external(%s, 1, 'ext-f')$$, (SELECT id FROM f), (SELECT id FROM f))) AS t(x text);
SELECT dblink_exec('c0', format($$UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = %s$$, (SELECT id FROM f)));
-- the slow owner finishes just as its lease lapses: its finish holds the row lock, uncommitted
SELECT dblink_exec('c1', 'BEGIN');
SELECT is((SELECT s FROM dblink('c1', format('SELECT pgfence.operation_finish(%s, 1, true)', (SELECT id FROM f))) AS t(s text)), 'succeeded',
  'the slow owner''s finish is accepted (lapsed, not yet taken over)');
SELECT is((SELECT count(*)::int FROM dblink('c2', $$SELECT id FROM pgfence.operation_claim('tap-heir', ARRAY['tap-conc.fence'])$$) AS t(id bigint)), 0,
  'a claimer meanwhile skips the row being finished');
SELECT is((SELECT n FROM dblink('c2', 'SELECT pgfence.operation_reap()') AS t(n int)), 0, 'so does the reaper');
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT count(*)::int FROM dblink('c2', $$SELECT id FROM pgfence.operation_claim('tap-heir', ARRAY['tap-conc.fence'])$$) AS t(id bigint)), 0,
  'after the commit there is nothing to take over');
SELECT is((SELECT status FROM pgfence.operation WHERE id = (SELECT id FROM f)), 'succeeded', 'the operation succeeded once, under fence 1');

-- =============================================================================================
-- NOTIFY on request carries only the kind and the id
-- =============================================================================================
SELECT dblink_exec('c2', 'LISTEN pgfence_operation');
CREATE TEMP TABLE n AS SELECT * FROM dblink('c0', $$SELECT id FROM pgfence.operation_request('tap-conc.notify', 'n1', jsonb_build_object('blob', repeat('x', 10000)))$$) AS t(id bigint);
SELECT * FROM dblink('c2', 'SELECT 1') AS t(x int);
CREATE TEMP TABLE heard AS SELECT * FROM dblink_get_notify('c2');
SELECT is((SELECT extra::jsonb FROM heard WHERE notify_name = 'pgfence_operation'), jsonb_build_object('kind', 'tap-conc.notify', 'id', (SELECT id FROM n)),
  'the listener hears {"kind", "id"} at commit');

-- clean up committed fixtures (events too)
SELECT dblink_exec('c0', 'SET pgfence.purging = on');  -- the delete guards let only a purge delete
SELECT dblink_exec('c0', $$DELETE FROM pgfence.event WHERE module = 'operation' AND item_id IN (SELECT id FROM pgfence.operation WHERE kind LIKE 'tap-conc.%')$$);
SELECT dblink_exec('c0', $$DELETE FROM pgfence.operation WHERE kind LIKE 'tap-conc.%'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
