-- pgTAP: Module 1 — outbox. Every contract cell of docs/design.md for the outbox, plus each
-- documented SQLSTATE. Concurrency cells use real second sessions (dblink, see helpers/).
BEGIN;
\ir helpers/setup.sql
SELECT plan(180);

-- =============================================================================================
-- Catalog: signatures, definer, volatility, privileges
-- =============================================================================================
SELECT has_function('pgfence', 'outbox_enqueue', ARRAY['text','text','jsonb','text','timestamp with time zone','integer','text'], 'outbox_enqueue signature');
SELECT has_function('pgfence', 'outbox_enqueue_many', ARRAY['text','text[]','jsonb[]','text[]','timestamp with time zone','integer','text[]'], 'outbox_enqueue_many signature');
SELECT has_function('pgfence', 'outbox_claim', ARRAY['text','integer','text[]','interval'], 'outbox_claim signature');
SELECT has_function('pgfence', 'outbox_mark_sent', ARRAY['bigint','integer','jsonb'], 'outbox_mark_sent signature');
SELECT has_function('pgfence', 'outbox_mark_sent_many', ARRAY['bigint[]','integer[]','jsonb[]'], 'outbox_mark_sent_many signature');
SELECT has_function('pgfence', 'outbox_mark_failed', ARRAY['bigint','integer','text','boolean','interval'], 'outbox_mark_failed signature');
SELECT has_function('pgfence', 'outbox_reap', ARRAY['integer'], 'outbox_reap signature');
SELECT has_function('pgfence', 'outbox_reclaim_stale', ARRAY['integer'], 'outbox_reclaim_stale (deprecated) signature');
SELECT has_function('pgfence', 'outbox_requeue', ARRAY['bigint','integer'], 'outbox_requeue signature');
SELECT has_function('pgfence', 'outbox_configure_channel', ARRAY['text','integer','interval','interval','interval','boolean','integer','integer','double precision','integer','text','text'], 'outbox_configure_channel signature');
SELECT has_function('pgfence', 'outbox_get', ARRAY['bigint'], 'outbox_get signature');
SELECT has_function('pgfence', 'outbox_next_due', ARRAY['text[]'], 'outbox_next_due signature');
SELECT has_view('pgfence', 'outbox_summary', 'outbox_summary view');
SELECT has_view('pgfence', 'outbox_leases', 'outbox_leases view');

SELECT ok(bool_and(p.prosecdef), 'every public outbox function is SECURITY DEFINER')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE 'outbox\_%';
SELECT ok(bool_and(p.proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp']), 'every outbox function pins search_path')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE '%outbox%';
SELECT volatility_is('pgfence', 'outbox_claim', ARRAY['text','integer','text[]','interval'], 'volatile', 'outbox_claim is volatile');
SELECT volatility_is('pgfence', 'outbox_get', ARRAY['bigint'], 'stable', 'outbox_get is stable');

SELECT function_privs_are('pgfence', 'outbox_enqueue', ARRAY['text','text','jsonb','text','timestamp with time zone','integer','text'], 'pgfence_client', ARRAY['EXECUTE'], 'client may enqueue');
SELECT function_privs_are('pgfence', 'outbox_enqueue', ARRAY['text','text','jsonb','text','timestamp with time zone','integer','text'], 'pgfence_executor', ARRAY[]::text[], 'executor may not enqueue');
SELECT function_privs_are('pgfence', 'outbox_claim', ARRAY['text','integer','text[]','interval'], 'pgfence_client', ARRAY[]::text[], 'client may not claim');
SELECT function_privs_are('pgfence', 'outbox_claim', ARRAY['text','integer','text[]','interval'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may claim');
SELECT function_privs_are('pgfence', 'outbox_mark_sent', ARRAY['bigint','integer','jsonb'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may mark sent');
SELECT function_privs_are('pgfence', 'outbox_mark_failed', ARRAY['bigint','integer','text','boolean','interval'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may mark failed');
SELECT function_privs_are('pgfence', 'outbox_reap', ARRAY['integer'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may run the reaper');
SELECT function_privs_are('pgfence', 'outbox_reclaim_stale', ARRAY['integer'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may run the reaper by its former name');
SELECT function_privs_are('pgfence', 'outbox_requeue', ARRAY['bigint','integer'], 'pgfence_executor', ARRAY[]::text[], 'executor may not requeue');
SELECT function_privs_are('pgfence', 'outbox_requeue', ARRAY['bigint','integer'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may requeue');
SELECT function_privs_are('pgfence', 'outbox_configure_channel', ARRAY['text','integer','interval','interval','interval','boolean','integer','integer','double precision','integer','text','text'], 'pgfence_client', ARRAY[]::text[], 'client may not configure channels');
SELECT table_privs_are('pgfence', 'outbox_summary', 'pgfence_admin', ARRAY['SELECT'], 'admin reads outbox_summary');
SELECT table_privs_are('pgfence', 'outbox', 'pgfence_client', ARRAY[]::text[], 'client has no privilege on the outbox table');

-- Role behaviour, not just catalog flags.
SET LOCAL ROLE pgfence_client;
SELECT lives_ok($$SELECT pgfence.outbox_enqueue('tap-role', 'r', '{}')$$, 'as pgfence_client: enqueue works (SECURITY DEFINER)');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_claim('w')$$, '42501', NULL, 'as pgfence_client: claim is refused (42501)');
SELECT throws_ok($$SELECT count(*) FROM pgfence.outbox$$, '42501', NULL, 'as pgfence_client: the table is not readable');
RESET ROLE;
SET LOCAL ROLE pgfence_executor;
SELECT lives_ok($$SELECT * FROM pgfence.outbox_claim('w', 1, ARRAY['tap-none'])$$, 'as pgfence_executor: claim works');
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'sent'$$, '42501', NULL, 'as pgfence_executor: no direct UPDATE');
RESET ROLE;

-- =============================================================================================
-- Enqueue
-- =============================================================================================
SELECT lives_ok($$SELECT pgfence.outbox_configure_channel('tap-a', 3, '1 second', '1 minute', '5 minutes')$$, 'configure channel tap-a');
CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
INSERT INTO ids SELECT 'm1', pgfence.outbox_enqueue('tap-a', 'https://example.test/hook', '{"n": 1}');
SELECT results_eq(
  $$SELECT status, attempts, max_attempts, next_attempt_at BETWEEN now() AND clock_timestamp(), locked_by IS NULL FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'm1')$$,
  $$VALUES ('pending'::text, 0, 3, true, true)$$,
  'enqueue: pending, 0 attempts, channel max_attempts, due now (the clock after its xid: docs/design.md#claim-hint)');
INSERT INTO ids SELECT 'other', pgfence.outbox_enqueue('tap-other', 'r', '{}');
SELECT is((SELECT max_attempts FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'other')), 10,
  'a channel without settings uses the ''*'' defaults (10 attempts)');

-- idempotency key
INSERT INTO ids SELECT 'k1', pgfence.outbox_enqueue('tap-a', 'r1', '{"v": 1}', 'tap-key-1');
SELECT is(pgfence.outbox_enqueue('tap-a', 'r1', '{"v": 2}', 'tap-key-1'), (SELECT id FROM ids WHERE name = 'k1'), 'repeated idempotency key returns the existing id');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE idempotency_key = 'tap-key-1'), 1, '... and inserts nothing');
SELECT is((SELECT payload FROM pgfence.outbox WHERE idempotency_key = 'tap-key-1'), '{"v": 1}'::jsonb, '... the first payload wins');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'someone-else', '{}', 'tap-key-1')$$, 'PF003', NULL, 'same key, other recipient: PF003');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-b', 'r1', '{}', 'tap-key-1')$$, 'PF003', NULL, 'same key, other channel: PF003');

-- 100 kB payload (NOTIFY only carries channel + id)
SELECT lives_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', jsonb_build_object('blob', repeat('x', 100 * 1024)))$$, '100 kB payload enqueues');

-- invalid input: documented SQLSTATEs, nothing written
SELECT throws_ok($$SELECT pgfence.outbox_enqueue(NULL, 'r', '{}')$$, '22004', NULL, 'NULL channel: 22004');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', NULL)$$, '22004', NULL, 'NULL payload: 22004');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('Bad Channel', 'r', '{}')$$, '22023', NULL, 'bad channel name: 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', '', '{}')$$, '22023', NULL, 'empty recipient: 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', '[1,2]')$$, '22023', NULL, 'payload not an object: 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', '{}', '')$$, '22023', NULL, 'empty idempotency key: 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', '{}', NULL, NULL, 0)$$, '22023', NULL, 'max_attempts 0: 22023');

-- enqueue_many
CREATE TEMP TABLE many AS
SELECT row_number() OVER () AS i, id FROM pgfence.outbox_enqueue_many('tap-many', ARRAY['a','b','a','d'],
  ARRAY['{"i":1}','{"i":2}','{"i":3}','{"i":4}']::jsonb[], ARRAY['tap-mk-1', NULL, 'tap-mk-1', 'tap-key-x']) AS id;
SELECT is((SELECT count(*)::int FROM many), 4, 'enqueue_many returns one id per input element');
SELECT is((SELECT id FROM many WHERE i = 1), (SELECT id FROM many WHERE i = 3), 'a key repeated inside one call yields the same id');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-many'), 3, 'enqueue_many inserts each distinct message once');
SELECT ok((SELECT id FROM many WHERE i = 1) < (SELECT id FROM many WHERE i = 2) AND (SELECT id FROM many WHERE i = 2) < (SELECT id FROM many WHERE i = 4), 'ids come back in input order');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue_many('tap-many', ARRAY['a','b'], ARRAY['{}','[]']::jsonb[])$$, '22023', NULL, 'enqueue_many: an invalid element is 22023');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-many'), 3, '... and nothing of that call was enqueued');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue_many('tap-many', ARRAY['a','b'], ARRAY['{}']::jsonb[])$$, '22023', NULL, 'enqueue_many: arrays of different lengths are 22023');

-- =============================================================================================
-- Claim: ordering, lease from the database clock, attempts bumped
-- =============================================================================================
-- due times a few ms ahead (a past deliver_at is due when enqueued: docs/design.md#claim-hint)
CREATE TEMP TABLE t0 AS SELECT clock_timestamp() + interval '40 ms' AS t;
INSERT INTO ids SELECT 'o3', pgfence.outbox_enqueue('tap-order', 'r', '{"o":3}', NULL, (SELECT t FROM t0) + interval '30 ms');
INSERT INTO ids SELECT 'o1', pgfence.outbox_enqueue('tap-order', 'r', '{"o":1}', NULL, (SELECT t FROM t0) + interval '10 ms');
INSERT INTO ids SELECT 'o2a', pgfence.outbox_enqueue('tap-order', 'r', '{"o":2}', NULL, (SELECT t FROM t0) + interval '20 ms');
INSERT INTO ids SELECT 'o2b', pgfence.outbox_enqueue('tap-order', 'r', '{"o":2}', NULL, (SELECT t FROM t0) + interval '20 ms');
INSERT INTO ids SELECT 'future', pgfence.outbox_enqueue('tap-order', 'r', '{"o":9}', NULL, now() + interval '1 hour');
SELECT pg_sleep(greatest(extract(epoch FROM (SELECT t FROM t0) + interval '40 ms' - clock_timestamp()), 0)::float8);
SELECT results_eq(
  $$SELECT id FROM pgfence.outbox_claim('tap-w1', 10, ARRAY['tap-order'])$$,
  $$SELECT id FROM ids WHERE name IN ('o1','o2a','o2b','o3') ORDER BY CASE name WHEN 'o1' THEN 1 WHEN 'o2a' THEN 2 WHEN 'o2b' THEN 3 ELSE 4 END$$,
  'claim returns due messages ordered by due time, then id; a future one is not due');
SELECT results_eq(
  $$SELECT status, attempts, locked_by, lease_expires_at, claimed_at FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o1')$$,
  $$VALUES ('processing'::text, 1, 'tap-w1'::text, now() + interval '5 minutes', now())$$,
  'claim: processing, attempts 1, owner stamped, lease = now() + channel lease');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w2', 10, ARRAY['tap-order'])), 0, 'claimed rows are not claimable again');
SELECT is((SELECT attempt FROM pgfence.outbox_claim('tap-w1', 1, ARRAY['tap-a'], interval '30 seconds') WHERE id = (SELECT id FROM ids WHERE name = 'm1')), 1,
  'claim returns the attempt number (fence token)');
SELECT is((SELECT lease_expires_at FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'm1')), now() + interval '30 seconds', 'an explicit lease overrides the channel''s');
-- the lease without p_lease: the channel's, else the '*' row's, on each path of the claim's
-- UPDATE: one message (a look-up for its row), a batch of one channel (one look-up before the
-- UPDATE), of several (per row)
SELECT pgfence.outbox_configure_channel('tap-lease', p_lease => '7 minutes');
SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-lease', array_fill('r'::text, ARRAY[4]), array_fill('{}'::jsonb, ARRAY[4]));
SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-nolease', array_fill('r'::text, ARRAY[4]), array_fill('{}'::jsonb, ARRAY[4]));
SELECT results_eq(
  $$SELECT lease, lease_expires_at FROM pgfence.outbox_claim('tap-wl', 1, ARRAY['tap-lease'])$$,
  $$VALUES (interval '7 minutes', now() + interval '7 minutes')$$,
  'one message: its channel''s lease (returned and stored)');
SELECT results_eq(
  $$SELECT lease FROM pgfence.outbox_claim('tap-wl', 1, ARRAY['tap-nolease'])$$,
  $$SELECT lease FROM pgfence.outbox_channel WHERE channel = '*'$$,
  'one message of a channel without settings: the ''*'' lease');
SELECT results_eq(
  $$SELECT lease, lease_expires_at FROM pgfence.outbox_claim('tap-wl', 2, ARRAY['tap-lease'])$$,
  $$VALUES (interval '7 minutes', now() + interval '7 minutes'), (interval '7 minutes', now() + interval '7 minutes')$$,
  'one channel, several messages: the channel''s lease');
SELECT results_eq(
  $$SELECT lease FROM pgfence.outbox_claim('tap-wl', 2, ARRAY['tap-nolease'])$$,
  $$SELECT lease FROM pgfence.outbox_channel, generate_series(1, 2) WHERE channel = '*'$$,
  'one channel without settings, several messages: the ''*'' lease');
SELECT results_eq(
  $$SELECT channel, lease FROM pgfence.outbox_claim('tap-wl', 2, ARRAY['tap-nolease', 'tap-lease']) ORDER BY channel$$,
  $$VALUES ('tap-lease'::text, interval '7 minutes'), ('tap-nolease', (SELECT lease FROM pgfence.outbox_channel WHERE channel = '*'))$$,
  'several channels: each message its channel''s lease, else the ''*'' one');
CREATE TEMP TABLE nd AS SELECT clock_timestamp() AS before, pgfence.outbox_next_due(ARRAY['tap-order']) AS due, clock_timestamp() AS after;
SELECT ok((SELECT nd.due BETWEEN o.next_attempt_at - nd.after AND o.next_attempt_at - nd.before
           FROM nd, pgfence.outbox o WHERE o.id = (SELECT id FROM ids WHERE name = 'future')),
  'outbox_next_due = time until the earliest pending message (from the clock)');
SELECT is(pgfence.outbox_next_due(ARRAY['tap-nothing']), NULL, 'outbox_next_due is NULL with nothing pending');

SELECT throws_ok($$SELECT * FROM pgfence.outbox_claim('', 1)$$, '22023', NULL, 'claim: empty worker is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_claim('w', 0)$$, '22023', NULL, 'claim: batch 0 is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_claim('w', 1, NULL, interval '-1 second')$$, '22023', NULL, 'claim: negative lease is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_claim('w', 1, NULL, interval '1 day 1 second')$$, '22023', NULL, 'claim: a lease beyond 1 day is 22023 (as for a channel; never a 22008 overflow)');

-- =============================================================================================
-- Fence: mark_sent / mark_failed with a stale attempt change nothing
-- =============================================================================================
SELECT is(pgfence.outbox_mark_sent((SELECT id FROM ids WHERE name = 'o1'), 7), false, 'mark_sent with a wrong attempt returns false');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o1')), 'processing', '... and changes nothing');
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o1'), 7, 'boom'), NULL, 'mark_failed with a wrong attempt returns NULL');
SELECT is(pgfence.outbox_mark_sent((SELECT id FROM ids WHERE name = 'o1'), 1, '{"http": 200}'), true, 'mark_sent with the claim''s attempt returns true');
SELECT results_eq(
  $$SELECT status, receipt, finished_at IS NOT NULL, locked_by IS NULL, lease_expires_at IS NULL FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o1')$$,
  $$VALUES ('sent'::text, '{"http": 200}'::jsonb, true, true, true)$$, 'sent: receipt stored, lease released');
SELECT is(pgfence.outbox_mark_sent((SELECT id FROM ids WHERE name = 'o1'), 1), false, 'a second mark_sent is a lost race (false)');
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o1'), 1, 'late failure'), NULL, 'mark_failed on a sent message is NULL');
SELECT is(pgfence.outbox_requeue((SELECT id FROM ids WHERE name = 'o1')), false, 'requeue of a sent message is refused (false)');
SELECT is(pgfence.outbox_reap(), 0, 'the reaper has nothing to take');
SELECT results_eq($$SELECT status, attempts FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o1')$$,
  $$VALUES ('sent'::text, 1)$$, 'a sent message never changes state again');
SELECT throws_ok($$SELECT pgfence.outbox_mark_sent(-1, 1)$$, 'P0002', NULL, 'mark_sent: unknown id is P0002');
SELECT throws_ok($$SELECT pgfence.outbox_mark_sent((SELECT id FROM ids WHERE name = 'o2a'), NULL)$$, '22004', NULL, 'mark_sent: NULL attempt is 22004');
SELECT throws_ok($$SELECT pgfence.outbox_mark_failed(-1, 1, 'x')$$, 'P0002', NULL, 'mark_failed: unknown id is P0002');
SELECT throws_ok($$SELECT pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o2a'), 1, NULL)$$, '22004', NULL, 'mark_failed: NULL error is 22004');
SELECT throws_ok($$SELECT pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o2a'), 1, 'x', true, interval '-1 second')$$, '22023', NULL, 'mark_failed: negative retry_after is 22023');

-- retryable failure: pending again, spaced by backoff, never beyond the cap
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o2a'), 1, 'HTTP 503'), 'pending', 'retryable failure: pending again');
SELECT ok((SELECT next_attempt_at BETWEEN now() + interval '0.5 second' AND now() + interval '1 second' FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o2a')),
  'first retry waits backoff(1) = [base/2, base]');
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o2b'), 1, 'HTTP 429', true, interval '10 days'), 'pending', 'retry_after is honoured ...');
SELECT ok((SELECT next_attempt_at <= now() + interval '1 hour' AND next_attempt_at > now() + interval '59 minutes' FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o2b')),
  '... but never beyond the channel cap (1 hour by default)');
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'o3'), 1, 'HTTP 410 Gone', false), 'failed', 'permanent failure: failed');
SELECT is((SELECT last_error FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o3')), 'HTTP 410 Gone', '... with the error kept');

-- =============================================================================================
-- Attempts are counted at claim: a handler that dies every time ends dead, not in a loop
-- =============================================================================================
INSERT INTO ids SELECT 'crashy', pgfence.outbox_enqueue('tap-a', 'r', '{"crash": true}');   -- tap-a: max_attempts 3
CREATE TEMP TABLE crash_log (round int, claimed int, reclaimed int, status text);
DO $$
DECLARE v_id bigint := (SELECT id FROM ids WHERE name = 'crashy'); v_round int; v_claimed int; v_reclaimed int;
BEGIN
  FOR v_round IN 1..5 LOOP  -- more rounds than max_attempts: must stop at 3
    UPDATE pgfence.outbox SET next_attempt_at = now() - interval '1 second' WHERE id = v_id AND status = 'pending';
    -- batch 10: back-dating does not move a message ahead of the others due (it is made due at
    -- the clock: docs/design.md#claim-hint); the others stay claimed (their leases run)
    SELECT count(*) INTO v_claimed FROM pgfence.outbox_claim('tap-crash', 10, ARRAY['tap-a']) c WHERE c.id = v_id;
    -- the worker "dies": its lease lapses (back-dated: the clock is never faked)
    UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second' WHERE id = v_id AND status = 'processing';
    v_reclaimed := pgfence.outbox_reap();
    INSERT INTO crash_log SELECT v_round, v_claimed, v_reclaimed, status FROM pgfence.outbox WHERE id = v_id;
  END LOOP;
END $$;
SELECT results_eq($$SELECT claimed, status FROM crash_log ORDER BY round$$,
  $$VALUES (1, 'pending'::text), (1, 'pending'), (1, 'dead'), (0, 'dead'), (0, 'dead')$$,
  'a message whose worker dies every time is claimed max_attempts (3) times, then dead');
SELECT results_eq($$SELECT attempts, finished_at IS NOT NULL, last_error LIKE 'lease expired: worker tap-crash%' FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'crashy')$$,
  $$VALUES (3, true, true)$$, 'dead after 3 attempts, with the lease-expiry reason');

-- last retryable failure goes to dead
INSERT INTO ids SELECT 'onelife', pgfence.outbox_enqueue('tap-a', 'r', '{}', NULL, NULL, 1);
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w1', 1, ARRAY['tap-a']) c WHERE c.id = (SELECT id FROM ids WHERE name = 'onelife')), 1, 'claim a 1-attempt message');
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM ids WHERE name = 'onelife'), 1, 'HTTP 500'), 'dead', 'the last allowed attempt failing goes to dead');

-- requeue grants more attempts; the fence keeps counting
SELECT is(pgfence.outbox_requeue((SELECT id FROM ids WHERE name = 'onelife'), 2), true, 'requeue a dead message');
SELECT results_eq($$SELECT status, attempts, max_attempts, finished_at IS NULL FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'onelife')$$,
  $$VALUES ('pending'::text, 1, 3, true)$$, 'requeue: pending, attempts kept (fence never reused), 2 more allowed');
SELECT is((SELECT attempt FROM pgfence.outbox_claim('tap-w1', 1, ARRAY['tap-a']) c WHERE c.id = (SELECT id FROM ids WHERE name = 'onelife')), 2, 'the next claim gets attempt 2');
SELECT throws_ok($$SELECT pgfence.outbox_requeue(-1)$$, 'P0002', NULL, 'requeue: unknown id is P0002');
SELECT throws_ok($$SELECT pgfence.outbox_requeue((SELECT id FROM ids WHERE name = 'onelife'), 0)$$, '22023', NULL, 'requeue: extra_attempts 0 is 22023');

-- =============================================================================================
-- Reaper: only lapsed leases, by the database clock
-- =============================================================================================
INSERT INTO ids SELECT 'live', pgfence.outbox_enqueue('tap-reap', 'r', '{}');
INSERT INTO ids SELECT 'lapsed', pgfence.outbox_enqueue('tap-reap', 'r', '{}');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w3', 2, ARRAY['tap-reap'])), 2, 'claim two');
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 millisecond' WHERE id = (SELECT id FROM ids WHERE name = 'lapsed');
SELECT is(pgfence.outbox_reap(), 1, 'the reaper takes only the lapsed lease');
SELECT results_eq($$SELECT name, status FROM ids JOIN pgfence.outbox USING (id) WHERE name IN ('live','lapsed') ORDER BY name$$,
  $$VALUES ('lapsed'::text, 'pending'::text), ('live', 'processing')$$, 'lapsed -> pending, live lease untouched');
SELECT is(pgfence.outbox_mark_sent((SELECT id FROM ids WHERE name = 'lapsed'), 1), false, 'the old owner of a reclaimed message is fenced out');
SELECT throws_ok($$SELECT pgfence.outbox_reap(0)$$, '22023', NULL, 'outbox_reap(0) is 22023');

-- the reaper's former name: a deprecated wrapper that still works
INSERT INTO ids SELECT 'old-name', pgfence.outbox_enqueue('tap-reap-old', 'r', '{}');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w4', 1, ARRAY['tap-reap-old'])), 1, 'claim one for the reaper''s former name');
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 millisecond' WHERE id = (SELECT id FROM ids WHERE name = 'old-name');
SELECT is(pgfence.outbox_reclaim_stale(), 1, 'outbox_reclaim_stale (deprecated) still reaps: it calls outbox_reap');
SELECT results_eq($$SELECT status, attempts FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'old-name')$$,
  $$VALUES ('pending'::text, 1)$$, '... the lapsed message is pending again, its attempt counted');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_lapse WHERE message_id = (SELECT id FROM ids WHERE name = 'old-name')), 1,
  '... with its lapse receipt');
SELECT throws_ok($$SELECT pgfence.outbox_reclaim_stale(0)$$, '22023', NULL, 'outbox_reclaim_stale(0) is 22023, as outbox_reap(0) is');
SELECT ok(obj_description('pgfence.outbox_reclaim_stale(integer)'::regprocedure, 'pg_proc') LIKE 'Deprecated: use pgfence.outbox_reap.%',
  'its COMMENT says it is deprecated and names the function to use');

-- =============================================================================================
-- Trigger: illegal moves refused even from hand-written SQL
-- =============================================================================================
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'sent', finished_at = now() WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF001', NULL, 'hand UPDATE pending -> sent: PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'pending', finished_at = NULL WHERE id = (SELECT id FROM ids WHERE name = 'o1')$$, 'PF001', NULL, 'hand UPDATE sent -> pending: PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET last_error = 'edited' WHERE id = (SELECT id FROM ids WHERE name = 'o1')$$, 'PF001', NULL, 'any hand UPDATE of a sent message: PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'processing', locked_by = 'x', lease_expires_at = now() WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF001', NULL, 'claim without bumping attempts: PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET payload = '{"evil": 1}' WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF002', NULL, 'changing a payload: PF002');
SELECT throws_ok($$UPDATE pgfence.outbox SET attempts = 0 WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF002', NULL, 'lowering attempts (the fence): PF002');
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'bogus' WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF001', NULL, 'an unknown status: refused');
SELECT col_has_check('pgfence', 'outbox', 'status', 'the status set is a CHECK constraint');
SELECT throws_ok($$INSERT INTO pgfence.outbox (channel, recipient, payload, max_attempts, status, finished_at) VALUES ('tap-a', 'r', '{}', 1, 'sent', now())$$, 'PF001', NULL, 'a hand INSERT of a sent message: PF001');
SELECT throws_ok($$INSERT INTO pgfence.outbox (channel, recipient, payload, max_attempts, attempts) VALUES ('tap-a', 'r', '{}', 5, 3)$$, 'PF001', NULL, 'a hand INSERT with attempts already used: PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'sent', finished_at = NULL, locked_by = NULL, lease_expires_at = NULL WHERE id = (SELECT id FROM ids WHERE name = 'live')$$, 'PF001', NULL, 'processing -> sent without finished_at (invariant): PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET lease_expires_at = NULL WHERE id = (SELECT id FROM ids WHERE name = 'live')$$, 'PF001', NULL, 'processing without a lease (invariant): PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET max_attempts = 0 WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF001', NULL, 'attempts above max_attempts (invariant): PF001');
SELECT throws_ok($$UPDATE pgfence.outbox SET recipient = recipient WHERE id = (SELECT id FROM ids WHERE name = 'o2a')$$, 'PF002', NULL, 'even writing the same recipient back: PF002');

-- =============================================================================================
-- mark_sent_many: every row fenced
-- =============================================================================================
CREATE TEMP TABLE batch AS SELECT id, attempt FROM pgfence.outbox_claim('tap-w4', 3, ARRAY['tap-many']);
SELECT is((SELECT count(*)::int FROM batch), 3, 'claim a batch of 3');
SELECT is(
  (SELECT array_agg(x ORDER BY x) FROM pgfence.outbox_mark_sent_many(
     (SELECT array_agg(id ORDER BY id) FROM batch),
     (SELECT array_agg(CASE WHEN id = (SELECT min(id) FROM batch) THEN attempt + 1 ELSE attempt END ORDER BY id) FROM batch)) AS x),
  (SELECT array_agg(id ORDER BY id) FROM batch WHERE id <> (SELECT min(id) FROM batch)),
  'mark_sent_many marks only the rows whose fence matches');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT min(id) FROM batch)), 'processing', 'the stale element is untouched');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_mark_sent_many(ARRAY[1,2]::bigint[], ARRAY[1]::int[])$$, '22023', NULL, 'mark_sent_many: length mismatch is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_mark_sent_many(ARRAY[-5]::bigint[], ARRAY[1]::int[])$$, 'P0002', NULL, 'mark_sent_many: unknown id is P0002');

-- =============================================================================================
-- mark_sent_and_claim: settle one message and claim the next in one statement
-- =============================================================================================
SELECT has_function('pgfence', 'outbox_mark_sent_and_claim', ARRAY['bigint','integer','jsonb','text','integer','text[]','interval'], 'outbox_mark_sent_and_claim signature');
SELECT function_privs_are('pgfence', 'outbox_mark_sent_and_claim', ARRAY['bigint','integer','jsonb','text','integer','text[]','interval'], 'pgfence_executor', ARRAY['EXECUTE'], 'executor may mark-and-claim');
SELECT function_privs_are('pgfence', 'outbox_mark_sent_and_claim', ARRAY['bigint','integer','jsonb','text','integer','text[]','interval'], 'pgfence_client', ARRAY[]::text[], 'client may not mark-and-claim');
INSERT INTO ids SELECT 'msc' || g, pgfence.outbox_enqueue('tap-msc', 'r', jsonb_build_object('g', g), NULL, now() - (10 - g) * interval '1 second') FROM generate_series(1, 4) g;
SELECT is((SELECT id FROM pgfence.outbox_claim('tap-w5', 1, ARRAY['tap-msc'])), (SELECT id FROM ids WHERE name = 'msc1'), 'mark_sent_and_claim: the loop starts with a plain claim');
SELECT results_eq(
  $$SELECT id, attempt, previous_sent FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM ids WHERE name = 'msc1'), 1, '{"http": 200}', 'tap-w5', 1, ARRAY['tap-msc'])$$,
  $$SELECT id, 1, true FROM ids WHERE name = 'msc2'$$,
  'mark_sent_and_claim: marks msc1 (previous_sent true) and claims the next due, msc2');
SELECT results_eq(
  $$SELECT name, status, receipt, locked_by FROM ids JOIN pgfence.outbox USING (id) WHERE name IN ('msc1', 'msc2') ORDER BY name$$,
  $$VALUES ('msc1'::text, 'sent'::text, '{"http": 200}'::jsonb, NULL::text), ('msc2', 'processing', NULL, 'tap-w5')$$,
  'mark_sent_and_claim: msc1 sent with its receipt, msc2 owned by the worker, both in one statement');
SELECT results_eq(
  $$SELECT id, previous_sent FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM ids WHERE name = 'msc1'), 1, '{"http": 500}', 'tap-w5', 2, ARRAY['tap-msc'])$$,
  $$SELECT id, false FROM ids WHERE name IN ('msc3', 'msc4') ORDER BY name$$,
  'mark_sent_and_claim: a stale mark (already sent) is a lost race, previous_sent false, and the claim (batch 2) still happens in due order');
SELECT is((SELECT receipt FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'msc1')), '{"http": 200}'::jsonb, 'mark_sent_and_claim: the stale mark changed nothing');
SELECT results_eq(
  $$SELECT id IS NULL, attempt IS NULL, previous_sent FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM ids WHERE name = 'msc2'), 1, NULL, 'tap-w5', 1, ARRAY['tap-msc'])$$,
  $$VALUES (true, true, true)$$,
  'mark_sent_and_claim: nothing due -> exactly one row, claim columns NULL, carrying previous_sent');
SELECT results_eq(
  $$SELECT id IS NULL, previous_sent FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM ids WHERE name = 'msc3'), 99, NULL, 'tap-w5', 1, ARRAY['tap-msc'])$$,
  $$VALUES (true, false)$$,
  'mark_sent_and_claim: a wrong fence and nothing due -> one row, previous_sent false');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'msc3')), 'processing', 'mark_sent_and_claim: the wrongly fenced message is untouched');
INSERT INTO ids SELECT 'msc5', pgfence.outbox_enqueue('tap-msc', 'r', '{}');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_mark_sent_and_claim(-1, 1, NULL, 'tap-w5', 1, ARRAY['tap-msc'])$$, 'P0002', NULL, 'mark_sent_and_claim: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM ids WHERE name = 'msc3'), NULL, NULL, 'tap-w5')$$, '22004', NULL, 'mark_sent_and_claim: attempt NULL is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM ids WHERE name = 'msc3'), 1, NULL, 'tap-w5', 0, ARRAY['tap-msc'])$$, '22023', NULL, 'mark_sent_and_claim: batch 0 is 22023 (from the claim)');
SELECT results_eq($$SELECT name, status FROM ids JOIN pgfence.outbox USING (id) WHERE name IN ('msc3', 'msc5') ORDER BY name$$,
  $$VALUES ('msc3'::text, 'processing'::text), ('msc5', 'pending')$$,
  'mark_sent_and_claim: after an error nothing is half-done (msc3 not marked by the failed call, msc5 not claimed)');

-- =============================================================================================
-- Time zone independence: enqueue in Asia/Kolkata, claim in UTC
-- =============================================================================================
SET LOCAL TIME ZONE 'Asia/Kolkata';
INSERT INTO ids SELECT 'tz-now', pgfence.outbox_enqueue('tap-tz', 'r', '{}');
INSERT INTO ids SELECT 'tz-later', pgfence.outbox_enqueue('tap-tz', 'r', '{}', NULL, '2999-01-01 00:00:00+05:30');
SET LOCAL TIME ZONE 'UTC';
SELECT results_eq($$SELECT id, lease_expires_at - now() FROM pgfence.outbox_claim('tap-tz', 10, ARRAY['tap-tz'])$$,
  $$SELECT id, interval '5 minutes' FROM ids WHERE name = 'tz-now'$$,
  'enqueued in Asia/Kolkata, claimed in UTC: due now, 5-minute lease, the future one is not due');
SELECT is((SELECT next_attempt_at FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'tz-later')), '2998-12-31 18:30:00+00'::timestamptz,
  'deliver_at is stored as an instant, whatever the session zone');

-- =============================================================================================
-- Operator surface
-- =============================================================================================
SELECT is((SELECT messages::int FROM pgfence.outbox_summary WHERE channel = 'tap-reap' AND status = 'processing'), 1, 'outbox_summary counts per channel and status');
SELECT is((SELECT held::int FROM pgfence.outbox_leases WHERE worker = 'tap-w3' AND channel = 'tap-reap'), 1, 'outbox_leases shows who holds what');
SELECT is((SELECT status FROM pgfence.outbox_get((SELECT id FROM ids WHERE name = 'live'))), 'processing', 'outbox_get returns the message');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_get(-1)$$, 'P0002', NULL, 'outbox_get: unknown id is P0002');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-a', 0)$$, '22023', NULL, 'configure_channel: max_attempts 0 is 22023');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-a', NULL, '1 hour', '1 second')$$, '22023', NULL, 'configure_channel: cap < base is 22023');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('NOT OK')$$, '22023', NULL, 'configure_channel: bad name is 22023');

-- =============================================================================================
-- Event log, per channel (outbox_channel.log_events)
-- =============================================================================================
SELECT lives_ok($$SELECT pgfence.outbox_configure_channel('tap-log', p_log_events => true)$$, 'turn the event log on for channel tap-log');
INSERT INTO ids SELECT 'logged', pgfence.outbox_enqueue('tap-log', 'r', '{}');
INSERT INTO ids SELECT 'unlogged', pgfence.outbox_enqueue('tap-nolog', 'r', '{}');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-logger', 5, ARRAY['tap-log', 'tap-nolog'])), 2, 'claim one logged and one unlogged message');
SELECT is(pgfence.outbox_mark_sent((SELECT id FROM ids WHERE name = 'logged'), 1, '{"ok": true}'), true, 'mark the logged one sent');
SELECT results_eq(
  $$SELECT format('%s %s->%s by %s fence %s', event, from_status, to_status, actor, fence) FROM pgfence.event WHERE module = 'outbox' AND item_id = (SELECT id FROM ids WHERE name = 'logged') ORDER BY id$$,
  ARRAY[format('enqueue ->pending by %s fence 0', session_user) COLLATE "default",
        'claim pending->processing by tap-logger fence 1',
        'transition processing->sent by tap-logger fence 1']::text[],
  'enqueue, claim and sent are logged with actor and fence');
SELECT is((SELECT detail->'receipt' FROM pgfence.event WHERE module = 'outbox' AND item_id = (SELECT id FROM ids WHERE name = 'logged') AND to_status = 'sent'), '{"ok": true}'::jsonb,
  'the sent event carries the delivery receipt');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'outbox' AND item_id = (SELECT id FROM ids WHERE name = 'unlogged')), 0,
  'a channel without log_events writes no events');
SAVEPOINT before_failed_transition;
SELECT pgfence.outbox_requeue((SELECT id FROM ids WHERE name = 'crashy'));
ROLLBACK TO SAVEPOINT before_failed_transition;
SELECT lives_ok($$SELECT pgfence.outbox_configure_channel('tap-a', p_log_events => true)$$, 'log channel tap-a too');
SAVEPOINT before_rollback;
SELECT pgfence.outbox_requeue((SELECT id FROM ids WHERE name = 'crashy'));
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE item_id = (SELECT id FROM ids WHERE name = 'crashy') AND to_status = 'pending' AND from_status = 'dead'), 1, 'requeue is logged inside its transaction ...');
ROLLBACK TO SAVEPOINT before_rollback;
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE item_id = (SELECT id FROM ids WHERE name = 'crashy') AND from_status = 'dead'), 0, '... and a rolled-back transition leaves no event');

-- =============================================================================================
-- Review findings: no poisoned rows, bounded settings, finite times, keys within one call
-- =============================================================================================
SELECT throws_ok($$UPDATE pgfence.outbox SET status = 'pending', finished_at = NULL WHERE id = (SELECT id FROM ids WHERE name = 'crashy')$$, 'PF001', NULL,
  'a dead message with no attempt left cannot be put back to pending by hand (it would poison every claim)');
INSERT INTO ids SELECT 'extra', pgfence.outbox_enqueue('tap-a', 'r', '{}', NULL, now() + interval '1 hour', 2);
SELECT is(pgfence.outbox_requeue((SELECT id FROM ids WHERE name = 'extra'), 3), true, 'requeue a pending message with extra attempts');
SELECT results_eq($$SELECT max_attempts, next_attempt_at <= clock_timestamp() FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'extra')$$,
  $$VALUES (5, true)$$, '... it gets them and is due now');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-a', p_lease => interval '300000 years')$$, '22023', NULL, 'configure: a lease beyond 1 day is 22023');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-a', p_backoff_cap => interval '1 year')$$, '22023', NULL, 'configure: a backoff cap beyond 30 days is 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', '{}', NULL, 'infinity')$$, '22023', NULL, 'enqueue: deliver_at infinity is 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-a', 'r', '{}', NULL, '-infinity')$$, '22023', NULL, 'enqueue: deliver_at -infinity is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_enqueue_many('tap-a', ARRAY['r'], ARRAY['{}']::jsonb[], NULL, 'infinity')$$, '22023', NULL, 'enqueue_many: deliver_at infinity is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.outbox_enqueue_many('tap-dup', ARRAY['alice', 'bob'], ARRAY['{"to":"alice"}', '{"to":"bob"}']::jsonb[], ARRAY['same-key', 'same-key'])$$,
  'PF003', NULL, 'enqueue_many: one key for two recipients within a call is PF003');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-dup'), 0, '... and nothing is enqueued');
SELECT is((SELECT oldest_due_age FROM pgfence.outbox_summary WHERE channel = 'tap-tz' AND status = 'pending'), NULL::interval,
  'outbox_summary: oldest_due_age is NULL when nothing pending is due yet');

SELECT throws_ok($$DELETE FROM pgfence.outbox WHERE id = (SELECT id FROM ids WHERE name = 'o1')$$, 'PF002', NULL, 'a hand DELETE of a message (outside a purge): PF002');
SELECT * FROM finish();
ROLLBACK;
