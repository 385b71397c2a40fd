-- pgTAP: outbox_settle_and_claim (functions/19_outbox_batch.sql), the executor's claim round:
-- settle a batch of deliveries and claim the next batch in one statement. Catalog and roles,
-- the settlement row, fenced marks, the claim, batch 0, next_due, each documented SQLSTATE
-- (and that a failed call changes nothing), and two real sessions claiming at once (dblink;
-- fixtures committed there on channels 'tap-sc-peer*' and deleted at the end).
BEGIN;
\ir helpers/setup.sql
SELECT plan(43);

-- =============================================================================================
-- Catalog, roles
-- =============================================================================================
SELECT has_function('pgfence', 'outbox_settle_and_claim',
  ARRAY['bigint[]','integer[]','jsonb[]','text','integer','text[]','interval'], 'outbox_settle_and_claim signature');
SELECT ok((SELECT prosecdef FROM pg_proc WHERE oid = 'pgfence.outbox_settle_and_claim(bigint[],integer[],jsonb[],text,integer,text[],interval)'::regprocedure),
  'it is SECURITY DEFINER');
SELECT ok((SELECT proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp'] FROM pg_proc WHERE oid = 'pgfence.outbox_settle_and_claim(bigint[],integer[],jsonb[],text,integer,text[],interval)'::regprocedure),
  'it pins search_path');
SELECT ok((SELECT NOT EXISTS (SELECT 1 FROM unnest(proconfig) c WHERE c LIKE 'pgfence.%') FROM pg_proc WHERE oid = 'pgfence.outbox_settle_and_claim(bigint[],integer[],jsonb[],text,integer,text[],interval)'::regprocedure),
  'no SET pgfence.* clause (see 99_owner)');
SELECT volatility_is('pgfence', 'outbox_settle_and_claim', ARRAY['bigint[]','integer[]','jsonb[]','text','integer','text[]','interval'], 'volatile', 'it is volatile');
SELECT function_privs_are('pgfence', 'outbox_settle_and_claim', ARRAY['bigint[]','integer[]','jsonb[]','text','integer','text[]','interval'],
  'pgfence_executor', ARRAY['EXECUTE'], 'executor may settle and claim');
SELECT function_privs_are('pgfence', 'outbox_settle_and_claim', ARRAY['bigint[]','integer[]','jsonb[]','text','integer','text[]','interval'],
  'pgfence_admin', ARRAY['EXECUTE'], 'admin may settle and claim');
SELECT function_privs_are('pgfence', 'outbox_settle_and_claim', ARRAY['bigint[]','integer[]','jsonb[]','text','integer','text[]','interval'],
  'pgfence_client', ARRAY[]::text[], 'client may not');
SELECT ok(length(split_part(obj_description('pgfence.outbox_settle_and_claim(bigint[],integer[],jsonb[],text,integer,text[],interval)'::regprocedure, 'pg_proc'), E'\n', 1)) <= 100,
  'its comment starts with a summary line of at most 100 characters');

SET LOCAL ROLE pgfence_client;
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'w', 1, ARRAY['tap-sc-none'])$$,
  '42501', NULL, 'as pgfence_client: refused (42501)');
RESET ROLE;
SET LOCAL ROLE pgfence_executor;
SELECT lives_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'w', 1, ARRAY['tap-sc-none'])$$,
  'as pgfence_executor: it works');
RESET ROLE;

-- =============================================================================================
-- Claim only, then settle and claim, then settle only
-- =============================================================================================
CREATE TEMP TABLE q AS
SELECT array_agg(i ORDER BY i) AS ids
FROM pgfence.outbox_enqueue_many('tap-sc', array_fill('r'::text, ARRAY[5]),
  ARRAY['{"n":1}','{"n":2}','{"n":3}','{"n":4}','{"n":5}']::jsonb[]) i;

CREATE TEMP TABLE r1 AS
SELECT row_number() OVER () AS k, * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-w', 2, ARRAY['tap-sc']);
SELECT is((SELECT count(*)::int FROM r1), 3, 'empty arrays, batch 2: two claimed rows and the settlement row');
SELECT results_eq($$SELECT id, attempt, payload, sent, next_due FROM r1 WHERE id IS NOT NULL ORDER BY k$$,
  $$SELECT ids[1], 1, '{"n":1}'::jsonb, NULL::bigint[], NULL::interval FROM q UNION ALL SELECT ids[2], 1, '{"n":2}', NULL, NULL FROM q$$,
  'the claimed rows come first, oldest due first, attempt = the fence token, sent and next_due NULL');
SELECT results_eq($$SELECT id, sent, next_due FROM r1 WHERE k = 3$$,
  $$VALUES (NULL::bigint, '{}'::bigint[], interval '0')$$,
  'the settlement row is last: nothing settled, and more is due now (next_due 0)');
SELECT results_eq($$SELECT status, locked_by FROM pgfence.outbox WHERE id IN (SELECT id FROM r1) ORDER BY id$$,
  $$VALUES ('processing'::text, 'tap-w'::text), ('processing', 'tap-w')$$, 'the claimed rows are processing, owned by the worker');

CREATE TEMP TABLE r2 AS
SELECT row_number() OVER () AS k, * FROM pgfence.outbox_settle_and_claim(
  ARRAY[(SELECT ids[1] FROM q), (SELECT ids[2] FROM q)], ARRAY[1, 7], ARRAY['{"http": 200}', NULL]::jsonb[], 'tap-w', 2, ARRAY['tap-sc']);
SELECT results_eq($$SELECT sent FROM r2 WHERE id IS NULL$$, $$SELECT ARRAY[ids[1]] FROM q$$,
  'sent lists only the message whose fence matched');
SELECT results_eq($$SELECT status, attempts, receipt FROM pgfence.outbox WHERE id = (SELECT ids[1] FROM q)$$,
  $$VALUES ('sent'::text, 1, '{"http": 200}'::jsonb)$$, 'settled under its fence, with its receipt');
SELECT results_eq($$SELECT status, locked_by FROM pgfence.outbox WHERE id = (SELECT ids[2] FROM q)$$,
  $$VALUES ('processing'::text, 'tap-w'::text)$$, 'a stale fence (attempt 7) changes nothing: a lost race, not an error');
SELECT results_eq($$SELECT id FROM r2 WHERE id IS NOT NULL ORDER BY k$$, $$SELECT unnest(ids[3:4]) FROM q$$,
  'and the next two messages are claimed in the same call');

CREATE TEMP TABLE r3 AS
SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT ids[3] FROM q)], ARRAY[1], NULL, '', 0, ARRAY['tap-sc']);
SELECT results_eq($$SELECT id, sent, next_due FROM r3$$, $$SELECT NULL::bigint, ARRAY[ids[3]], interval '0' FROM q$$,
  'batch 0 settles only: one row, and the worker is not read (empty is fine)');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT ids[5] FROM q)), 'pending', 'batch 0 claimed nothing');

CREATE TEMP TABLE r4 AS
SELECT row_number() OVER () AS k, * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-w', 10, ARRAY['tap-sc']);
SELECT results_eq($$SELECT id, next_due FROM r4 ORDER BY k$$,
  $$SELECT ids[5], NULL::interval FROM q UNION ALL SELECT NULL, NULL$$,
  'the last message claimed; then next_due is NULL: nothing is pending any more');
SELECT lives_ok($$SELECT pgfence.outbox_enqueue('tap-sc', 'r', '{}', NULL, now() + interval '1 hour')$$, 'a message due in an hour');
SELECT ok((SELECT next_due BETWEEN interval '59 minutes' AND interval '1 hour'
           FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-w', 10, ARRAY['tap-sc']) WHERE id IS NULL),
  'next_due is the wait until it is due (and nothing was claimed)');
SELECT ok((SELECT count(id) = 0 AND max(next_due) BETWEEN interval '59 minutes' AND interval '1 hour'
           FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-w', 3, ARRAY['tap-sc', 'tap-sc-x'])),
  'several channels (the other path of outbox_claim and outbox_next_due): the same answer');

-- =============================================================================================
-- Errors: each documented SQLSTATE, and a failed call changes nothing
-- =============================================================================================
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim(NULL, '{}', NULL, 'w', 1)$$, '22004', NULL, 'ids NULL: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', NULL, NULL, 'w', 1)$$, '22004', NULL, 'attempts NULL: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{1}', '{1,2}', NULL, 'w', 1)$$, '22023', NULL, 'ids and attempts of different lengths: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', '{"{}"}', 'w', 1)$$, '22023', NULL, 'receipts of another length: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'w', -1)$$, '22023', NULL, 'batch -1: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'w', 10001)$$, '22023', NULL, 'batch 10001: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'w', NULL)$$, '22023', NULL, 'batch NULL: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, '', 1)$$, '22023', NULL, 'batch 1 with an empty worker: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'w', 1, NULL, interval '2 days')$$, '22023', NULL, 'a lease over 1 day: 22023');

-- Unknown id next to a good one: nothing marked, nothing claimed.
CREATE TEMP TABLE q2 AS
SELECT array_agg(i ORDER BY i) AS ids FROM pgfence.outbox_enqueue_many('tap-sc-err', ARRAY['r','r'], ARRAY['{}','{}']::jsonb[]) i;
SELECT is((SELECT id FROM pgfence.outbox_claim('tap-w', 1, ARRAY['tap-sc-err'])), (SELECT ids[1] FROM q2), 'one message owned');
SELECT throws_ok(format($$SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[%s, -42], ARRAY[1, 1], NULL, 'tap-w', 5, ARRAY['tap-sc-err'])$$, (SELECT ids[1] FROM q2)),
  'P0002', NULL, 'an unknown id: P0002');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE id IN (SELECT unnest(ids) FROM q2) ORDER BY id$$,
  $$VALUES ('processing'::text), ('pending')$$, 'after the error: the good one is not marked, the next one not claimed');
SELECT throws_ok(format($$SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[%s], ARRAY[1], NULL, '', 5, ARRAY['tap-sc-err'])$$, (SELECT ids[1] FROM q2)),
  '22023', NULL, 'a settle with a bad claim (empty worker): 22023');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT ids[1] FROM q2)), 'processing', 'and the settle of that call rolled back with it');

-- =============================================================================================
-- Two sessions at once: SKIP LOCKED, nobody waits, nothing claimed twice
-- =============================================================================================
SELECT tap_helpers.peer('sc1');
SELECT tap_helpers.peer('sc2');
SELECT is((SELECT n FROM dblink('sc1', $$SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-sc-peer', array_fill('r'::text, ARRAY[6]), array_fill('{}'::jsonb, ARRAY[6]))$$) AS t(n bigint)),
  6::bigint, 'a peer commits six messages');
SELECT dblink_exec('sc1', 'BEGIN');
CREATE TEMP TABLE p1 AS SELECT * FROM dblink('sc1', $$SELECT id FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-p1', 4, ARRAY['tap-sc-peer']) WHERE id IS NOT NULL$$) AS t(id bigint);
-- sc1 holds its four claims uncommitted; sc2 claims meanwhile without waiting
CREATE TEMP TABLE p2 AS SELECT * FROM dblink('sc2', $$SELECT id FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-p2', 4, ARRAY['tap-sc-peer']) WHERE id IS NOT NULL$$) AS t(id bigint);
SELECT dblink_exec('sc1', 'COMMIT');
SELECT is((SELECT count(*)::int FROM p1), 4, 'the first session claims four');
SELECT is((SELECT count(*)::int FROM p2), 2, 'the second, at the same time, claims the other two without waiting');
SELECT is((SELECT count(*)::int FROM p1 JOIN p2 USING (id)), 0, 'none claimed by both');

SELECT dblink_exec('sc1', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox WHERE channel LIKE 'tap-sc-peer%'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
