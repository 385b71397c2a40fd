-- pgTAP: outbox_mark_sent_and_claim against real concurrent sessions (dblink): the reaper holding
-- the row, the reaper running while a settle is uncommitted, and two settling workers at once.
-- Fixtures are committed through peers on channels 'tap-settle-*' and deleted at the end.
BEGIN;
\ir helpers/setup.sql
SELECT plan(13);

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

-- ---------------------------------------------------------------------------------------------
-- The reaper takes the row back while the owner settles it: the owner waits, then loses the race
-- (previous_sent false) and still claims the next message; the reclaimed one is not re-claimed.
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE s AS SELECT * FROM dblink('c0', $$SELECT array_agg(i ORDER BY i) FROM pgfence.outbox_enqueue_many('tap-settle-a', ARRAY['r','r'], ARRAY['{"n":1}','{"n":2}']::jsonb[]) i$$) AS t(ids bigint[]);
SELECT is((SELECT id FROM dblink('c0', $$SELECT id FROM pgfence.outbox_claim('tap-owner', 1, ARRAY['tap-settle-a'])$$) AS t(id bigint)),
  (SELECT ids[1] FROM s), 'the owner holds the first message');
SELECT dblink_exec('c0', format('UPDATE pgfence.outbox SET lease_expires_at = now() - interval ''1 second'' WHERE id = %s', (SELECT ids[1] FROM s)));
SELECT dblink_exec('c1', 'BEGIN');
SELECT is((SELECT n FROM dblink('c1', 'SELECT pgfence.outbox_reclaim_stale()') AS t(n int)), 1, 'the reaper takes the lapsed claim back (its transaction still open)');
SELECT dblink_send_query('c2', format($$SELECT id, attempt, previous_sent FROM pgfence.outbox_mark_sent_and_claim(%s, 1, '{"late": true}', 'tap-owner', 5, ARRAY['tap-settle-a'])$$, (SELECT ids[1] FROM s)));
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'the owner''s settle waits on the reaper''s row lock');
SELECT dblink_exec('c1', 'COMMIT');
CREATE TEMP TABLE r1 AS SELECT * FROM dblink_get_result('c2') AS t(id bigint, attempt int, previous_sent boolean);
SELECT * FROM dblink_get_result('c2') AS t(id bigint, attempt int, previous_sent boolean);  -- frees c2
SELECT results_eq($$SELECT id, attempt, previous_sent FROM r1$$,
  $$SELECT ids[2], 1, false FROM s$$,
  'after the reaper commits: previous_sent false (lost race), and only the second message is claimed (the first is backing off)');
SELECT results_eq($$SELECT status, attempts, receipt FROM pgfence.outbox WHERE id = (SELECT ids[1] FROM s)$$,
  $$VALUES ('pending'::text, 1, NULL::jsonb)$$,
  'the reclaimed message is pending for a retry, no receipt from the late settle');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_lapse WHERE message_id = (SELECT ids[1] FROM s)), 1, 'one lapse receipt');

-- ---------------------------------------------------------------------------------------------
-- The reaper runs while a settle is uncommitted: it skips the row, and finds nothing after
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE s2 AS SELECT * FROM dblink('c0', $$SELECT array_agg(i ORDER BY i) FROM pgfence.outbox_enqueue_many('tap-settle-b', ARRAY['r','r'], ARRAY['{}','{}']::jsonb[]) i$$) AS t(ids bigint[]);
SELECT * FROM dblink('c0', $$SELECT id FROM pgfence.outbox_claim('tap-owner-b', 1, ARRAY['tap-settle-b'])$$) AS t(id bigint);
SELECT dblink_exec('c0', format('UPDATE pgfence.outbox SET lease_expires_at = now() - interval ''1 second'' WHERE id = %s', (SELECT ids[1] FROM s2)));
SELECT dblink_exec('c1', 'BEGIN');
SELECT results_eq(format($$SELECT * FROM dblink('c1', 'SELECT id, previous_sent FROM pgfence.outbox_mark_sent_and_claim(%s, 1, NULL, ''tap-owner-b'', 1, ARRAY[''tap-settle-b''])') AS t(id bigint, previous_sent boolean)$$, (SELECT ids[1] FROM s2)),
  $$SELECT ids[2], true FROM s2$$,
  'the lapsed-but-not-reclaimed owner settles (true) and claims the next one');
SELECT is((SELECT n FROM dblink('c2', 'SELECT pgfence.outbox_reclaim_stale()') AS t(n int)), 0, 'the reaper meanwhile skips the row being settled');
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT n FROM dblink('c2', 'SELECT pgfence.outbox_reclaim_stale()') AS t(n int)), 0, 'after the commit it re-reads the row and leaves it alone');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE id IN (SELECT unnest(ids) FROM s2) ORDER BY id$$,
  $$VALUES ('sent'::text), ('processing')$$, 'sent, and the next one owned: nothing reclaimed');

-- ---------------------------------------------------------------------------------------------
-- Two workers settle at once: neither waits for the other, no message is claimed twice
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE s3 AS SELECT * FROM dblink('c0', $$SELECT array_agg(i ORDER BY i) FROM pgfence.outbox_enqueue_many('tap-settle-c', array_fill('r'::text, ARRAY[6]), array_fill('{}'::jsonb, ARRAY[6])) i$$) AS t(ids bigint[]);
CREATE TEMP TABLE h1 AS SELECT * FROM dblink('c1', $$SELECT id, attempt FROM pgfence.outbox_claim('tap-w1', 1, ARRAY['tap-settle-c'])$$) AS t(id bigint, attempt int);
CREATE TEMP TABLE h2 AS SELECT * FROM dblink('c2', $$SELECT id, attempt FROM pgfence.outbox_claim('tap-w2', 1, ARRAY['tap-settle-c'])$$) AS t(id bigint, attempt int);
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE n1 AS SELECT * FROM dblink('c1', format($$SELECT id, previous_sent FROM pgfence.outbox_mark_sent_and_claim(%s, %s, NULL, 'tap-w1', 2, ARRAY['tap-settle-c'])$$, (SELECT id FROM h1), (SELECT attempt FROM h1))) AS t(id bigint, previous_sent boolean);
-- c1 holds its two new claims uncommitted; c2 settles and claims in the meantime, without waiting
CREATE TEMP TABLE n2 AS SELECT * FROM dblink('c2', format($$SELECT id, previous_sent FROM pgfence.outbox_mark_sent_and_claim(%s, %s, NULL, 'tap-w2', 10, ARRAY['tap-settle-c'])$$, (SELECT id FROM h2), (SELECT attempt FROM h2))) AS t(id bigint, previous_sent boolean);
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT bool_and(previous_sent) FROM (SELECT previous_sent FROM n1 UNION ALL SELECT previous_sent FROM n2) u), true, 'both settles succeed');
SELECT is((SELECT count(*)::int FROM n1 JOIN n2 USING (id)), 0, 'no message claimed by both (SKIP LOCKED)');
SELECT is((SELECT count(*)::int FROM n1) + (SELECT count(*)::int FROM n2), 4, 'together they claimed the other four');

-- clean up committed fixtures
SELECT dblink_exec('c0', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox_lapse WHERE message_id IN (SELECT id FROM pgfence.outbox WHERE channel LIKE 'tap-settle-%'); DELETE FROM pgfence.outbox WHERE channel LIKE 'tap-settle-%'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
