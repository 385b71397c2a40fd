-- pgTAP: outbox ordering keys and per-key limits (functions/16_outbox_keys.sql), and the
-- operator's verbs of issue 17: outbox_cancel, the per-channel payload bound (PF004), the
-- TRUNCATE guard (PF005). One session for the rules (the enqueue's decision is a deferred
-- trigger: SET CONSTRAINTS ... IMMEDIATE makes it run at the end of each statement, since this
-- file never commits), then eight dblink peers claiming and settling at once over committed
-- keys (channels 'tap-k-peer*', deleted at the end). The races between an enqueue's commit and
-- a settle, and between a cancel and a claim: tests/isolation/specs/outbox-keys.spec. The
-- hand-off of outbox_settle_and_claim (the key's next message claimed by the settling worker):
-- its section below, and its races in tests/isolation/specs/outbox-key-hand-off.spec.
BEGIN;
\ir helpers/setup.sql
SELECT plan(185);
SET CONSTRAINTS pgfence.outbox_key_enqueued IMMEDIATE;

-- =============================================================================================
-- Catalog, roles
-- =============================================================================================
SELECT has_function('pgfence', 'outbox_cancel', ARRAY['bigint','text','text'], 'outbox_cancel signature');
SELECT ok((SELECT prosecdef FROM pg_proc WHERE oid = 'pgfence.outbox_cancel(bigint,text,text)'::regprocedure),
  'outbox_cancel is SECURITY DEFINER');
SELECT function_privs_are('pgfence', 'outbox_cancel', ARRAY['bigint','text','text'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may cancel');
SELECT function_privs_are('pgfence', 'outbox_cancel', ARRAY['bigint','text','text'], 'pgfence_executor', ARRAY[]::text[], 'executor may not cancel');
SELECT function_privs_are('pgfence', 'outbox_cancel', ARRAY['bigint','text','text'], 'pgfence_client', ARRAY[]::text[], 'client may not cancel');
SELECT has_table('pgfence', 'outbox_key', 'table outbox_key');
SELECT has_column('pgfence', 'outbox', 'ordering_key', 'outbox.ordering_key');
SELECT col_default_is('pgfence', 'outbox_channel', 'max_payload_bytes', '1048576', 'payloads are bounded at 1 MiB by default');
SELECT is((SELECT key_max_in_flight FROM pgfence.outbox_channel WHERE channel = '*'), 1, 'by default one message of a key at a time');
SELECT is((SELECT key_dead_policy FROM pgfence.outbox_channel WHERE channel = '*'), 'block', 'by default a dead message blocks its key');

-- =============================================================================================
-- outbox_cancel
-- =============================================================================================
CREATE TEMP TABLE c AS
SELECT pgfence.outbox_enqueue('tap-k-cancel', 'r', '{}'::jsonb) AS a,
       pgfence.outbox_enqueue('tap-k-cancel', 'r', '{}'::jsonb) AS b;
SELECT ok(pgfence.outbox_cancel((SELECT a FROM c), 'alice', 'customer withdrew'), 'cancel a pending message: true');
SELECT results_eq($$SELECT status, finished_at IS NOT NULL, last_error FROM pgfence.outbox WHERE id = (SELECT a FROM c)$$,
  $$VALUES ('canceled'::text, true, 'canceled by alice: customer withdrew'::text)$$, 'it is canceled, finished, and says who and why');
SELECT results_eq($$SELECT event, from_status, to_status, actor FROM pgfence.event WHERE module = 'outbox' AND item_id = (SELECT a FROM c)$$,
  $$VALUES ('transition'::text, 'pending'::text, 'canceled'::text, 'alice'::text)$$,
  'its event is written although the channel does not log events, with the canceller as actor');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-cancel'])), 1, 'a claim takes only the other message');
SELECT ok(NOT pgfence.outbox_cancel((SELECT b FROM c), 'alice', 'too late'), 'cancel a processing message: false (the claim came first)');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT b FROM c)), 'processing', 'and it is still processing');
SELECT ok(NOT pgfence.outbox_cancel((SELECT a FROM c), 'bob', 'again'), 'cancel a canceled message: false');
SELECT ok(pgfence.outbox_mark_sent((SELECT b FROM c), 1), 'the claimed one is delivered');
SELECT ok(NOT pgfence.outbox_cancel((SELECT b FROM c), 'alice', 'after'), 'cancel a sent message: false');
SELECT throws_ok($$SELECT pgfence.outbox_cancel(NULL, 'alice', 'x')$$, '22004', NULL, 'cancel without an id: 22004');
SELECT throws_ok($$SELECT pgfence.outbox_cancel(-1, 'alice', 'x')$$, 'P0002', NULL, 'cancel of an unknown id: P0002');
SELECT throws_ok(format($$SELECT pgfence.outbox_cancel(%s, '', 'x')$$, (SELECT b FROM c)), '22023', NULL, 'cancel without a name: 22023');
SELECT throws_ok(format($$SELECT pgfence.outbox_cancel(%s, 'alice', NULL)$$, (SELECT b FROM c)), '22023', NULL, 'cancel without a reason: 22023');
SELECT throws_ok(format($$UPDATE pgfence.outbox SET status = 'pending', finished_at = NULL WHERE id = %s$$, (SELECT a FROM c)),
  'PF001', NULL, 'a canceled message never changes again (PF001)');
SELECT is(pgfence.outbox_requeue((SELECT a FROM c)), false, 'requeue of a canceled message: false');

-- =============================================================================================
-- Payload bound (PF004)
-- =============================================================================================
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-k-size', 'r', jsonb_build_object('blob', repeat('x', 2 * 1024 * 1024)))$$,
  'PF004', NULL, 'a 2 MiB payload is over the default bound: PF004');
SELECT lives_ok($$SELECT pgfence.outbox_enqueue('tap-k-size', 'r', jsonb_build_object('blob', repeat('x', 100 * 1024)))$$,
  'a 100 KiB payload is accepted');
SELECT lives_ok($$SELECT pgfence.outbox_configure_channel('tap-k-size', p_max_payload_bytes => 100)$$, 'an admin lowers the bound of one channel');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-k-size', 'r', jsonb_build_object('blob', repeat('x', 200)))$$,
  'PF004', NULL, 'over the channel''s bound: PF004');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue_many('tap-k-size', ARRAY['r', 'r'], ARRAY['{}'::jsonb, jsonb_build_object('blob', repeat('x', 200))])$$,
  'PF004', NULL, 'enqueue_many with one payload over the bound: PF004');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-k-size'), 1, 'and nothing of it was enqueued');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-k-size', p_max_payload_bytes => 0)$$, '22023', NULL, 'a bound below 1: 22023');

-- =============================================================================================
-- TRUNCATE guard (PF005)
-- =============================================================================================
SELECT throws_ok($$TRUNCATE pgfence.outbox$$, 'PF005', NULL, 'TRUNCATE outbox: PF005');
SELECT throws_ok($$TRUNCATE pgfence.event$$, 'PF005', NULL, 'TRUNCATE event: PF005');
SELECT throws_ok($$TRUNCATE pgfence.outbox_lapse$$, 'PF005', NULL, 'TRUNCATE outbox_lapse: PF005');
SELECT throws_ok($$TRUNCATE pgfence.plan, pgfence.plan_step$$, 'PF005', NULL, 'TRUNCATE plan: PF005');
SELECT throws_ok($$TRUNCATE pgfence.plan_step$$, 'PF005', NULL, 'TRUNCATE plan_step: PF005');
SELECT throws_ok($$TRUNCATE pgfence.operation$$, 'PF005', NULL, 'TRUNCATE operation: PF005');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-k-cancel'), 2, 'the refused TRUNCATE removed nothing');
SET LOCAL pgfence.purging = on;
SELECT lives_ok($$TRUNCATE pgfence.outbox_lapse$$, 'the owner''s deliberate reset (pgfence.purging on) is allowed');
SET LOCAL pgfence.purging = off;

-- =============================================================================================
-- Ordering keys: one at a time, in enqueue order
-- =============================================================================================
CREATE TEMP TABLE k AS
SELECT pgfence.outbox_enqueue('tap-k-order', 'r', '{"n": 1}', NULL, NULL, NULL, 'order-42') AS m1,
       pgfence.outbox_enqueue('tap-k-order', 'r', '{"n": 2}', NULL, NULL, NULL, 'order-42') AS m2,
       pgfence.outbox_enqueue('tap-k-order', 'r', '{"n": 3}', NULL, NULL, NULL, 'order-42') AS m3,
       pgfence.outbox_enqueue('tap-k-order', 'r', '{"n": 0}') AS free;
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE channel = 'tap-k-order' ORDER BY id$$,
  $$VALUES ('pending'::text), ('waiting'), ('waiting'), ('pending')$$,
  'the key''s first message is pending, the later ones wait; a keyless one is pending');
SELECT results_eq($$SELECT id FROM pgfence.outbox_claim('tap-w1', 10, ARRAY['tap-k-order']) ORDER BY id$$,
  $$SELECT m1 FROM k UNION ALL SELECT free FROM k$$, 'a claim of 10 gets the key''s first and the keyless one only');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w2', 10, ARRAY['tap-k-order'])), 0, 'a second claimer gets nothing of the key');
SELECT is(pgfence.outbox_mark_failed((SELECT m1 FROM k), 1, 'receiver down'), 'pending', 'the first fails, retryable: pending again');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM k)), 'waiting', 'the retry holds the key: the second still waits');
UPDATE pgfence.outbox SET next_attempt_at = now() WHERE id = (SELECT m1 FROM k);
SELECT results_eq($$SELECT id, attempt FROM pgfence.outbox_claim('tap-w1', 10, ARRAY['tap-k-order'])$$,
  $$SELECT m1, 2 FROM k$$, 'once due, the retry is claimed again (attempt 2), not the second');
SELECT ok(pgfence.outbox_mark_sent((SELECT m1 FROM k), 2), 'the first is delivered');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE id IN (SELECT m2 FROM k UNION ALL SELECT m3 FROM k) ORDER BY id$$,
  $$VALUES ('pending'::text), ('waiting')$$, 'in the same statement the second takes the key''s turn');
SELECT results_eq($$SELECT id FROM pgfence.outbox_claim('tap-w1', 10, ARRAY['tap-k-order'])$$,
  $$SELECT m2 FROM k$$, 'and is claimed next');
SELECT ok(pgfence.outbox_mark_sent((SELECT m2 FROM k), 1), 'the second is delivered');
SELECT ok(pgfence.outbox_cancel((SELECT m3 FROM k), 'alice', 'not needed'), 'the third is canceled while its turn');
SELECT ok(NOT EXISTS (SELECT 1 FROM pgfence.outbox_key WHERE channel = 'tap-k-order'), 'a key with nothing left is forgotten');
SELECT results_eq($$SELECT ordering_key FROM pgfence.outbox_get((SELECT m3 FROM k))$$, $$VALUES ('order-42'::text)$$,
  'outbox_get shows the ordering key');
SELECT throws_ok(format($$UPDATE pgfence.outbox SET ordering_key = 'other' WHERE id = %s$$, (SELECT m3 FROM k)),
  'PF002', NULL, 'the ordering key is frozen (PF002)');
SELECT throws_ok($$INSERT INTO pgfence.outbox (channel, recipient, payload, max_attempts, ordering_key) VALUES ('tap-k-order', 'r', '{}', 1, 'x')$$,
  'PF001', NULL, 'a hand-written keyed INSERT that is not waiting: PF001');
SELECT throws_ok($$INSERT INTO pgfence.outbox (channel, recipient, payload, max_attempts, status) VALUES ('tap-k-order', 'r', '{}', 1, 'waiting')$$,
  'PF001', NULL, 'a keyless message cannot wait: PF001');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-k-order', 'r', '{}', NULL, NULL, NULL, '')$$, '22023', NULL, 'an empty ordering key: 22023');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue('tap-k-order', 'r', '{}', NULL, NULL, NULL, repeat('k', 256))$$, '22023', NULL, 'an ordering key over 255 characters: 22023');

-- enqueue_many: element i's key; repeated idempotency keys change nothing
CREATE TEMP TABLE km AS
SELECT array_agg(id ORDER BY ord) AS ids FROM pgfence.outbox_enqueue_many('tap-k-many', ARRAY['r','r','r','r'],
  ARRAY['{}','{}','{}','{}']::jsonb[], ARRAY['i1', 'i2', NULL, 'i1'], NULL, NULL, ARRAY['a', 'a', 'b', 'a']) WITH ORDINALITY AS t(id, ord);
SELECT results_eq($$SELECT ordering_key, status FROM pgfence.outbox WHERE channel = 'tap-k-many' ORDER BY id$$,
  $$VALUES ('a'::text, 'pending'::text), ('a', 'waiting'), ('b', 'pending')$$,
  'enqueue_many: each key''s first is pending, the others wait (a repeated idempotency key inserts nothing)');
SELECT is((SELECT ids[4] = ids[1] FROM km), true, 'the repeated idempotency key answers the first id');
SELECT throws_ok($$SELECT pgfence.outbox_enqueue_many('tap-k-many', ARRAY['r'], ARRAY['{}']::jsonb[], NULL, NULL, NULL, ARRAY['a', 'b'])$$,
  '22023', NULL, 'enqueue_many with ordering_keys of another length: 22023');

-- =============================================================================================
-- Dead-key policy: block (default) and release; audit_stuck
-- =============================================================================================
SELECT pgfence.outbox_configure_channel('tap-k-dead', p_max_attempts => 1) IS NOT NULL AS configured;
CREATE TEMP TABLE d AS
SELECT pgfence.outbox_enqueue('tap-k-dead', 'r', '{}', NULL, NULL, NULL, 'kd') AS m1,
       pgfence.outbox_enqueue('tap-k-dead', 'r', '{}', NULL, NULL, NULL, 'kd') AS m2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-dead'])), 1, 'block: the first is claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT m1 FROM d), 1, 'boom'), 'dead', 'and dies (no attempt left)');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM d)), 'waiting', 'block: the next still waits');
SELECT results_eq($$SELECT item_id, status, next LIKE 'key kd blocked by dead message %' FROM pgfence.audit_stuck WHERE queue = 'tap-k-dead'$$,
  $$SELECT m1, 'dead'::text, true FROM d$$, 'audit_stuck: key blocked by dead message N');
SELECT ok(pgfence.outbox_requeue((SELECT m1 FROM d)), 'the operator requeues the dead message');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE channel = 'tap-k-dead' ORDER BY id$$,
  $$VALUES ('pending'::text), ('waiting')$$, 'it takes the key''s turn first again; the next still waits');
SELECT is((SELECT count(*)::int FROM pgfence.audit_stuck WHERE queue = 'tap-k-dead'), 0, 'the key is no longer listed as stuck');
SELECT is((SELECT attempt FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-dead'])), 2, 'claimed again (attempt 2)');
SELECT is(pgfence.outbox_mark_failed((SELECT m1 FROM d), 2, 'rejected', false), 'failed', 'a permanent failure holds the key too');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM d)), 'waiting', 'block: the next still waits behind the failed one');
SELECT ok(pgfence.outbox_cancel((SELECT m1 FROM d), 'alice', 'give up'), 'the operator cancels the failed one');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM d)), 'pending', 'which gives the key to the next');

SELECT pgfence.outbox_configure_channel('tap-k-rel', p_max_attempts => 1, p_key_dead_policy => 'release') IS NOT NULL AS configured;
CREATE TEMP TABLE rl AS
SELECT pgfence.outbox_enqueue('tap-k-rel', 'r', '{}', NULL, NULL, NULL, 'kr') AS m1,
       pgfence.outbox_enqueue('tap-k-rel', 'r', '{}', NULL, NULL, NULL, 'kr') AS m2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-rel'])), 1, 'release: the first is claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT m1 FROM rl), 1, 'boom'), 'dead', 'and dies');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM rl)), 'pending', 'release: the key moves on to the next');
SELECT is((SELECT count(*)::int FROM pgfence.audit_stuck WHERE queue = 'tap-k-rel'), 0, 'release: nothing stuck');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-k-rel', p_key_dead_policy => 'maybe')$$, '22023', NULL, 'an unknown dead-key policy: 22023');

-- switching block -> release frees a blocked key at once
SELECT pgfence.outbox_configure_channel('tap-k-sw', p_max_attempts => 1) IS NOT NULL AS configured;
CREATE TEMP TABLE sw AS
SELECT pgfence.outbox_enqueue('tap-k-sw', 'r', '{}', NULL, NULL, NULL, 'ks') AS m1,
       pgfence.outbox_enqueue('tap-k-sw', 'r', '{}', NULL, NULL, NULL, 'ks') AS m2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-sw'])), 1, 'switch: the first is claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT m1 FROM sw), 1, 'boom'), 'dead', 'and dies, blocking its key');
SELECT pgfence.outbox_configure_channel('tap-k-sw', p_key_dead_policy => 'release') IS NOT NULL AS configured;
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM sw)), 'pending', 'the policy change to release promotes the next at once');

-- =============================================================================================
-- Per-key limits: max_in_flight, rate, fairness
-- =============================================================================================
SELECT pgfence.outbox_configure_channel('tap-k-lim', p_key_max_in_flight => 2) IS NOT NULL AS configured;
SELECT pgfence.outbox_enqueue_many('tap-k-lim', array_fill('r'::text, ARRAY[5]), array_fill('{}'::jsonb, ARRAY[5]), NULL, NULL, NULL, array_fill('host-a'::text, ARRAY[5])) IS NOT NULL;
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-k-lim' AND status = 'pending'), 2, 'max_in_flight 2: two of the key are pending');
CREATE TEMP TABLE lim AS SELECT id, attempt FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-lim']);
SELECT is((SELECT count(*)::int FROM lim), 2, 'a claim of 10 gets two');
SELECT is((SELECT min(id) FROM lim), (SELECT min(id) FROM pgfence.outbox WHERE channel = 'tap-k-lim'), 'the oldest two');
SELECT ok(pgfence.outbox_mark_sent((SELECT min(id) FROM lim), 1), 'one of them is delivered');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-k-lim' AND status IN ('pending', 'processing')), 2,
  'the next takes its place: still two in flight');

SELECT pgfence.outbox_configure_channel('tap-k-rate', p_key_max_in_flight => 3, p_key_rate => 1) IS NOT NULL AS configured;
SELECT pgfence.outbox_enqueue_many('tap-k-rate', array_fill('r'::text, ARRAY[3]), array_fill('{}'::jsonb, ARRAY[3]), NULL, NULL, NULL, array_fill('host-b'::text, ARRAY[3])) IS NOT NULL;
-- From the first message's due time, within 50 ms: a message made pending is due no earlier than
-- the clock as it is (the claim hint: docs/design.md#claim-hint), so the first is a little later
-- than the bucket's time when its turn is decided a moment after the enqueue.
SELECT results_eq($$SELECT abs(extract(epoch FROM next_attempt_at - first_value(next_attempt_at) OVER (ORDER BY id)) - v.e) < 0.05
                    FROM pgfence.outbox o, (VALUES (0, 0), (1, 1), (2, 2)) v(i, e)
                    WHERE o.channel = 'tap-k-rate' AND v.i = (SELECT count(*) FROM pgfence.outbox p WHERE p.channel = o.channel AND p.id < o.id)
                    ORDER BY o.id$$,
  $$VALUES (true), (true), (true)$$,
  'rate 1/s: the key''s messages are due one second apart (token bucket on now())');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-rate'])), 1, 'a claim now gets only the one due now');
SELECT pgfence.outbox_configure_channel('tap-k-burst', p_key_max_in_flight => 4, p_key_rate => 10, p_key_burst => 2) IS NOT NULL AS configured;
SELECT pgfence.outbox_enqueue_many('tap-k-burst', array_fill('r'::text, ARRAY[4]), array_fill('{}'::jsonb, ARRAY[4]), NULL, NULL, NULL, array_fill('host-c'::text, ARRAY[4])) IS NOT NULL;
SELECT results_eq($$SELECT abs(extract(epoch FROM next_attempt_at - first_value(next_attempt_at) OVER (ORDER BY id)) - v.e) < 0.05
                    FROM pgfence.outbox o, (VALUES (0, 0), (1, 0), (2, 0.1), (3, 0.2)) v(i, e)
                    WHERE o.channel = 'tap-k-burst' AND v.i = (SELECT count(*) FROM pgfence.outbox p WHERE p.channel = o.channel AND p.id < o.id)
                    ORDER BY o.id$$,
  $$VALUES (true), (true), (true), (true)$$,
  'rate 10/s, burst 2: two at once, then one every 100 ms');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-k-rate', p_key_rate => -1)$$, '22023', NULL, 'a negative rate: 22023');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-k-rate', p_key_rate => 5e-324)$$, '22023', NULL,
  'a rate below one per 10^6 s: 22023 (it would overflow the bucket''s interval)');
SELECT is((SELECT key_rate FROM pgfence.outbox_channel WHERE channel = 'tap-k-rate'), 1::float8, '... and the rate is unchanged');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-k-rate', p_key_max_in_flight => 0)$$, '22023', NULL, 'max_in_flight 0: 22023');

-- fairness: a key with 50 due messages does not starve a key with 1
SELECT pgfence.outbox_enqueue_many('tap-k-fair', array_fill('r'::text, ARRAY[50]), array_fill('{}'::jsonb, ARRAY[50]), NULL, NULL, NULL, array_fill('busy'::text, ARRAY[50])) IS NOT NULL;
SELECT pgfence.outbox_enqueue('tap-k-fair', 'r', '{}', NULL, NULL, NULL, 'quiet') IS NOT NULL;
SELECT results_eq($$SELECT o.ordering_key FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-fair']) c JOIN pgfence.outbox o USING (id) ORDER BY 1$$,
  $$VALUES ('busy'::text), ('quiet')$$, 'fair: one claim of 10 serves both keys, the busy one no more than its limit');

-- =============================================================================================
-- One decision per statement over all its keys (in the global lock order); a deleted blocker
-- =============================================================================================
CREATE TEMP TABLE mk AS
SELECT * FROM pgfence.outbox_enqueue_many('tap-k-set', array_fill('r'::text, ARRAY[6]), array_fill('{}'::jsonb, ARRAY[6]),
                                          NULL, NULL, NULL, ARRAY['kc', 'kb', 'ka', 'kc', 'kb', 'ka']) AS t(id);
SELECT results_eq($$SELECT ordering_key, status FROM pgfence.outbox WHERE channel = 'tap-k-set' ORDER BY id$$,
  $$VALUES ('kc'::text, 'pending'::text), ('kb', 'pending'), ('ka', 'pending'), ('kc', 'waiting'), ('kb', 'waiting'), ('ka', 'waiting')$$,
  'a 6-message enqueue over 3 keys: the first of each key is pending');
SELECT results_eq($$SELECT ordering_key, decisions FROM pgfence.outbox_key WHERE channel = 'tap-k-set' ORDER BY 1$$,
  $$VALUES ('ka'::text, 0::bigint), ('kb', 0), ('kc', 0)$$,
  'its commit decided each key once (the first row''s firing decides all the keys, the others nothing)');
CREATE TEMP TABLE mkc AS SELECT id, attempt FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-set']);
SELECT is((SELECT count(*)::int FROM pgfence.outbox_mark_sent_many((SELECT array_agg(id ORDER BY id DESC) FROM mkc),
                                                                  (SELECT array_agg(attempt ORDER BY id DESC) FROM mkc))), 3,
  'one mark_sent_many settles the three in flight');
SELECT results_eq($$SELECT ordering_key, status FROM pgfence.outbox WHERE channel = 'tap-k-set' AND status <> 'sent' ORDER BY id$$,
  $$VALUES ('kc'::text, 'pending'::text), ('kb', 'pending'), ('ka', 'pending')$$,
  'and its one decision gives each key''s turn to its next message');
SELECT results_eq($$SELECT ordering_key, decisions FROM pgfence.outbox_key WHERE channel = 'tap-k-set' ORDER BY 1$$,
  $$VALUES ('ka'::text, 1::bigint), ('kb', 1), ('kc', 1)$$,
  'one decision per key for the whole statement');

-- the notes the enqueue functions leave for the decision at commit are used up by it
SELECT is(current_setting('pgfence.outbox_keys_enqueued', true), '', 'no key is left noted after the decision');

-- an operator deleting a blocker by hand hands the key's turn on
SELECT pgfence.outbox_configure_channel('tap-k-del', p_max_attempts => 1) IS NOT NULL AS configured;
CREATE TEMP TABLE dl AS
SELECT pgfence.outbox_enqueue('tap-k-del', 'r', '{}', NULL, NULL, NULL, 'kdel') AS m1,
       pgfence.outbox_enqueue('tap-k-del', 'r', '{}', NULL, NULL, NULL, 'kdel') AS m2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-del'])), 1, 'delete: the first is claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT m1 FROM dl), 1, 'boom'), 'dead', 'and dies, blocking its key');
SELECT set_config('pgfence.purging', 'on', true) AS purging;
DELETE FROM pgfence.outbox WHERE id = (SELECT m1 FROM dl);
SELECT set_config('pgfence.purging', 'off', true) AS purging;
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT m2 FROM dl)), 'pending', 'deleting the dead blocker by hand promotes the next at once');
SELECT is((SELECT count(*)::int FROM pgfence.audit_stuck WHERE queue = 'tap-k-del'), 0, 'nothing is listed as stuck');

-- =============================================================================================
-- Forgetting the keys that end without their locks first (_outbox_keys_forget; the settle's
-- statement trigger calls it before the decision; its races: tests/isolation/specs/outbox-key-forget.spec
-- and outbox-key-forget-order.spec)
-- =============================================================================================
SELECT has_function('pgfence', '_outbox_keys_forget', ARRAY['text[]','text[]'], '_outbox_keys_forget signature');
SELECT pgfence.outbox_configure_channel('tap-k-fg2', p_key_dead_policy => 'release') IS NOT NULL AS configured;
CREATE TEMP TABLE fg AS
SELECT pgfence.outbox_enqueue('tap-k-fg', 'r', '{}', NULL, NULL, NULL, 'w') AS w1,
       pgfence.outbox_enqueue('tap-k-fg', 'r', '{}', NULL, NULL, NULL, 'w') AS w2,
       pgfence.outbox_enqueue('tap-k-fg', 'r', '{}', NULL, NULL, NULL, 'p') AS p1,
       pgfence.outbox_enqueue('tap-k-fg', 'r', '{}', NULL, NULL, NULL, 'd') AS d1,
       pgfence.outbox_enqueue('tap-k-fg2', 'r', '{}', NULL, NULL, NULL, 'd') AS r1;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-fg2'])), 1, 'forget: the release channel''s message is claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT r1 FROM fg), 1, 'no such mailbox', false), 'failed', 'and fails for good (released: no turn held)');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-fg'])), 3, 'the block channel''s three keys are claimed (''w'' has one more waiting)');
SELECT is(pgfence.outbox_mark_failed((SELECT d1 FROM fg), 1, 'no such mailbox', false), 'failed', 'the block channel''s ''d'' fails for good (blocks its key)');
-- rows for keys with nothing left, as a decision committed by another session would leave them
-- for this one: 'x' (nothing at all), 'r' (a bucket still refilling), and the release channel's 'd'
INSERT INTO pgfence.outbox_key (channel, ordering_key) VALUES ('tap-k-fg', 'x'), ('tap-k-fg2', 'd');
INSERT INTO pgfence.outbox_key (channel, ordering_key, tat) VALUES ('tap-k-fg', 'r', now() + interval '1 hour');
SELECT results_eq(
  $$SELECT u.c, u.k FROM pgfence._outbox_keys_forget(ARRAY['tap-k-fg', 'tap-k-fg', 'tap-k-fg', 'tap-k-fg', 'tap-k-fg', 'tap-k-fg', 'tap-k-fg2', 'tap-k-fg'],
                                                      ARRAY['w', 'p', 'd', 'x', 'r', 'none', 'd', 'x']) f,
           unnest(f.rest_channels, f.rest_keys) AS u(c, k) ORDER BY 1, 2$$,
  $$VALUES ('tap-k-fg'::text, 'd'::text), ('tap-k-fg', 'none'), ('tap-k-fg', 'p'), ('tap-k-fg', 'r'), ('tap-k-fg', 'w'), ('tap-k-fg', 'x'), ('tap-k-fg2', 'd')$$,
  'all or nothing: with a key left to the decision (one waiting, one with a turn held, one without a row, one whose bucket refills) every key is, once');
SELECT results_eq($$SELECT channel, ordering_key FROM pgfence.outbox_key WHERE channel LIKE 'tap-k-fg%' ORDER BY 1, 2$$,
  $$VALUES ('tap-k-fg'::text, 'd'::text), ('tap-k-fg', 'p'), ('tap-k-fg', 'r'), ('tap-k-fg', 'w'), ('tap-k-fg', 'x'), ('tap-k-fg2', 'd')$$,
  'and no row is deleted (the decision takes every lock in the global order)');
SELECT results_eq($$SELECT rest_channels, rest_keys FROM pgfence._outbox_keys_forget(ARRAY['tap-k-fg', 'tap-k-fg2', 'tap-k-fg'], ARRAY['x', 'd', 'x'])$$,
  $$VALUES (NULL::text[], NULL::text[])$$, 'every key ends: nothing is left to the decision');
SELECT results_eq($$SELECT channel, ordering_key FROM pgfence.outbox_key WHERE channel LIKE 'tap-k-fg%' ORDER BY 1, 2$$,
  $$VALUES ('tap-k-fg'::text, 'd'::text), ('tap-k-fg', 'p'), ('tap-k-fg', 'r'), ('tap-k-fg', 'w')$$,
  'forgotten: the keys with nothing waiting and no turn held (a failed message under release holds none), each once');
SELECT results_eq($$SELECT rest_channels, rest_keys FROM pgfence._outbox_keys_forget(ARRAY['tap-k-fg', NULL], ARRAY[NULL, 'w'])$$,
  $$VALUES (NULL::text[], NULL::text[])$$, 'NULL elements are skipped: nothing left to decide');
SELECT ok(pgfence.outbox_mark_sent((SELECT w1 FROM fg), 1), '''w'': the first is delivered (its next one is promoted)');
SELECT ok(pgfence.outbox_cancel((SELECT w2 FROM fg), 'alice', 'not needed'), 'and the next one is canceled');
SELECT ok(NOT EXISTS (SELECT 1 FROM pgfence.outbox_key WHERE channel = 'tap-k-fg' AND ordering_key = 'w'),
  'and the cancel''s statement forgets the key');

-- =============================================================================================
-- A default limit key: the recipient's host (channel setting limit_key host)
-- =============================================================================================
SELECT is((SELECT limit_key FROM pgfence.outbox_channel WHERE channel = '*'), NULL, 'by default no limit key: a keyless message is not limited');
CREATE TEMP TABLE he1 AS SELECT pgfence.outbox_enqueue('tap-k-nohost', 'https://a.example.com/x', '{}') AS id;
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT id FROM he1)), 'pending',
  'on such a channel a keyless message to a URL is pending at once, with no key');
SELECT pgfence.outbox_configure_channel('tap-k-host', p_max_attempts => 1, p_key_max_in_flight => 2, p_limit_key => 'host') IS NOT NULL AS configured;
SELECT is((SELECT limit_key FROM pgfence.outbox_channel WHERE channel = 'tap-k-host'), 'host', 'configure sets limit_key host');
SELECT pgfence.outbox_enqueue_many('tap-k-host',
  ARRAY['https://A.Example.com/hook', 'https://a.example.com:8443/x?y=1', 'https://user:pw@a.example.com/z', 'http://b.example.org',
        'not a url', 'https://a.example.com/explicit', 'http://[2001:db8::1]:80/v6'],
  array_fill('{}'::jsonb, ARRAY[7]), NULL, NULL, NULL, ARRAY[NULL, NULL, NULL, NULL, NULL, 'order-1', NULL]) IS NOT NULL;
SELECT results_eq($$SELECT ordering_key, status FROM pgfence.outbox WHERE channel = 'tap-k-host' ORDER BY id$$,
  $$VALUES ('host:a.example.com'::text, 'pending'::text), ('host:a.example.com', 'pending'), ('host:a.example.com', 'waiting'),
           ('host:b.example.org', 'pending'), (NULL, 'pending'), ('order-1', 'pending'), ('host:[2001:db8::1]', 'pending')$$,
  'limit_key host: a keyless message is keyed by its recipient''s host (lower-cased, no port or user), at most 2 of a host in flight; no URL: no key; an explicit key is kept');
CREATE TEMP TABLE he2 AS SELECT pgfence.outbox_enqueue('tap-k-host', 'https://a.example.com/one', '{}') AS id;
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT id FROM he2)), 'waiting',
  'outbox_enqueue derives the host key too (a third message to the host waits)');
CREATE TEMP TABLE hc AS SELECT c.id, c.attempt, o.ordering_key FROM pgfence.outbox_claim('tap-w', 20, ARRAY['tap-k-host']) c JOIN pgfence.outbox o USING (id);
SELECT is((SELECT count(*)::int FROM hc WHERE ordering_key = 'host:a.example.com'), 2, 'a claim of 20 gets only 2 of host a.example.com');
SELECT is((SELECT count(*)::int FROM hc), 6, 'and every other message');
SELECT is(pgfence.outbox_mark_failed((SELECT min(id) FROM hc WHERE ordering_key = 'host:a.example.com'), 1, 'boom'), 'dead',
  'a message to host a dies (key_dead_policy is block)');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-k-host' AND ordering_key = 'host:a.example.com' AND status IN ('pending', 'processing')), 2,
  'yet the host''s next message takes its place: a derived host key limits, it does not block');
SELECT is((SELECT count(*)::int FROM pgfence.audit_stuck WHERE queue = 'tap-k-host'), 0, 'and audit_stuck lists no blocked host');
SELECT pgfence.outbox_configure_channel('tap-k-hrate', p_key_max_in_flight => 3, p_key_rate => 1, p_limit_key => 'host') IS NOT NULL AS configured;
SELECT pgfence.outbox_enqueue_many('tap-k-hrate', ARRAY['https://r.example/1', 'https://r.example/2', 'https://s.example/1'], array_fill('{}'::jsonb, ARRAY[3])) IS NOT NULL;
SELECT results_eq($$SELECT ordering_key, abs(extract(epoch FROM next_attempt_at - first_value(next_attempt_at) OVER (ORDER BY id)) - v.e) < 0.05
                    FROM pgfence.outbox o, (VALUES (0, 0), (1, 1), (2, 0)) v(i, e)
                    WHERE o.channel = 'tap-k-hrate' AND v.i = (SELECT count(*) FROM pgfence.outbox p WHERE p.channel = o.channel AND p.id < o.id)
                    ORDER BY o.id$$,
  $$VALUES ('host:r.example'::text, true), ('host:r.example', true), ('host:s.example', true)$$,
  'the key rate applies per host: 1/s to r.example, s.example at once');
SELECT pgfence.outbox_enqueue_many('tap-k-hfair', array_fill('https://busy.example/x'::text, ARRAY[50]), array_fill('{}'::jsonb, ARRAY[50])) IS NOT NULL
FROM pgfence.outbox_configure_channel('tap-k-hfair', p_limit_key => 'host');
SELECT pgfence.outbox_enqueue('tap-k-hfair', 'https://quiet.example/x', '{}') IS NOT NULL;
SELECT results_eq($$SELECT o.ordering_key FROM pgfence.outbox_claim('tap-w', 10, ARRAY['tap-k-hfair']) c JOIN pgfence.outbox o USING (id) ORDER BY 1$$,
  $$VALUES ('host:busy.example'::text), ('host:quiet.example')$$, 'fair across hosts: one claim of 10 serves the quiet host too');
SELECT is(pgfence._outbox_host_key('mailto:someone@example.com'), NULL, 'a mailto: recipient has no host key');
SELECT is(pgfence._outbox_host_key('https:///path'), NULL, 'a URL with an empty host has no host key');
SELECT is((SELECT limit_key FROM pgfence.outbox_configure_channel('tap-k-host', p_limit_key => 'none')), NULL, 'limit_key none clears it');
CREATE TEMP TABLE he3 AS SELECT pgfence.outbox_enqueue('tap-k-host', 'https://a.example.com/after', '{}') AS id;
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT id FROM he3)), 'pending',
  'after which a keyless message to a busy host is not limited');
SELECT throws_ok($$SELECT pgfence.outbox_configure_channel('tap-k-host', p_limit_key => 'ip')$$, '22023', NULL, 'an unknown limit key: 22023');

-- =============================================================================================
-- The hand-off: outbox_settle_and_claim gives the key's next message to the settling worker
-- =============================================================================================
SELECT pgfence.outbox_configure_channel('tap-k-hand', p_lease => interval '7 minutes', p_log_events => true) IS NOT NULL AS configured;
CREATE TEMP TABLE ho AS
SELECT pgfence.outbox_enqueue('tap-k-hand', 'r', '{"n": 1}', NULL, NULL, NULL, 'h') AS h1,
       pgfence.outbox_enqueue('tap-k-hand', 'r', '{"n": 2}', NULL, NULL, NULL, 'h') AS h2,
       pgfence.outbox_enqueue('tap-k-hand', 'r', '{"n": 3}', NULL, NULL, NULL, 'h') AS h3,
       pgfence.outbox_enqueue('tap-k-hand', 'r', '{"n": 1}', NULL, NULL, NULL, 'g') AS g1,
       pgfence.outbox_enqueue('tap-k-hand', 'r', '{"n": 2}', NULL, NULL, NULL, 'g') AS g2;
SELECT results_eq($$SELECT id FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-hw', 10, ARRAY['tap-k-hand']) WHERE id IS NOT NULL ORDER BY id$$,
  $$SELECT h1 FROM ho UNION ALL SELECT g1 FROM ho$$, 'hand-off: a round with nothing to settle claims each key''s first message');
CREATE TEMP TABLE hd AS SELECT decisions FROM pgfence.outbox_key WHERE channel = 'tap-k-hand' AND ordering_key = 'h';
CREATE TEMP TABLE hr2 AS
SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT h1 FROM ho)], ARRAY[1], ARRAY['{"ok": 1}'::jsonb], 'tap-hw2', 10, ARRAY['tap-k-hand']);
SELECT results_eq($$SELECT id, attempt, lease FROM hr2 WHERE id IS NOT NULL$$,
  $$SELECT h2, 1, interval '7 minutes' FROM ho$$,
  'settling h1 hands the key''s next message h2 to the settling worker: attempt 1, the channel''s lease');
SELECT results_eq($$SELECT sent FROM hr2 WHERE id IS NULL$$, $$SELECT ARRAY[h1] FROM ho$$, 'and reports h1 sent');
SELECT results_eq($$SELECT id, status, locked_by, receipt, claimed_at = now(), lease_expires_at = now() + interval '7 minutes'
                    FROM pgfence.outbox WHERE ordering_key = 'h' ORDER BY id$$,
  $$SELECT h1, 'sent'::text, NULL::text, '{"ok": 1}'::jsonb, true, NULL::boolean FROM ho
    UNION ALL SELECT h2, 'processing', 'tap-hw2', NULL, true, true FROM ho
    UNION ALL SELECT h3, 'waiting', NULL, NULL, NULL, NULL FROM ho$$,
  'h1 sent with its receipt; h2 owned by the worker, fenced and leased from now(); h3 still waits (order)');
SELECT results_eq($$SELECT event, from_status, to_status, fence::int, actor FROM pgfence.event
                    WHERE module = 'outbox' AND item_id IN (SELECT h1 FROM ho UNION ALL SELECT h2 FROM ho) AND fence > 0 ORDER BY item_id, id$$,
  $$VALUES ('claim'::text, 'pending'::text, 'processing'::text, 1, 'tap-hw'::text),
           ('transition', 'processing', 'sent', 1, 'tap-hw'),
           ('claim', 'waiting', 'processing', 1, 'tap-hw2')$$,
  'events: h1''s claim and its delivery by its worker, h2''s claim from waiting by the new worker');
SELECT is((SELECT decisions FROM pgfence.outbox_key WHERE channel = 'tap-k-hand' AND ordering_key = 'h'), (SELECT decisions FROM hd),
  'key_max_in_flight 1: the hand-off takes no key lock, and the settle''s trigger does not decide the key either');
CREATE TEMP TABLE hr3 AS
SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT g1 FROM ho)], ARRAY[5], NULL, 'tap-hw2', 10, ARRAY['tap-k-hand']);
SELECT results_eq($$SELECT count(id)::int, (SELECT sent FROM hr3 WHERE id IS NULL) FROM hr3$$, $$VALUES (0, '{}'::bigint[])$$,
  'a stale attempt (fence) settles nothing and hands nothing off');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE ordering_key = 'g' ORDER BY id$$, $$VALUES ('processing'::text), ('waiting')$$,
  '... g1 is still processing under its owner, g2 still waits');
CREATE TEMP TABLE hr4 AS
SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT g1 FROM ho), (SELECT h2 FROM ho)], ARRAY[1, 1], NULL, 'tap-hw', 1, ARRAY['tap-k-hand']);
SELECT results_eq($$SELECT id FROM hr4 WHERE id IS NOT NULL$$, $$SELECT h3 FROM ho$$,
  'batch 1, two keys settled: one key (the earliest due, then oldest) is handed off');
SELECT results_eq($$SELECT array_agg(s ORDER BY s) FROM hr4, unnest(hr4.sent) s$$, $$SELECT array_agg(x ORDER BY x) FROM ho, unnest(ARRAY[g1, h2]) x$$, 'both settled messages are sent');
SELECT results_eq($$SELECT status, locked_by FROM pgfence.outbox WHERE id = (SELECT g2 FROM ho)$$, $$VALUES ('pending'::text, NULL::text)$$,
  'the other key''s next message is promoted to pending, as without a hand-off');

-- key_max_in_flight: one leaves, one enters; a failed message still holds its turn (block)
SELECT pgfence.outbox_configure_channel('tap-k-hand2', p_key_max_in_flight => 2) IS NOT NULL AS configured;
CREATE TEMP TABLE hm AS
SELECT array_agg(id ORDER BY ord) AS m FROM pgfence.outbox_enqueue_many('tap-k-hand2', array_fill('r'::text, ARRAY[6]),
  array_fill('{}'::jsonb, ARRAY[6]), NULL, NULL, NULL, array_fill('m'::text, ARRAY[6])) WITH ORDINALITY AS t(id, ord);
SELECT results_eq($$SELECT id FROM pgfence.outbox_settle_and_claim('{}', '{}', NULL, 'tap-hw', 10, ARRAY['tap-k-hand2']) WHERE id IS NOT NULL ORDER BY id$$,
  $$SELECT unnest(m[1:2]) FROM hm$$, 'max_in_flight 2: a round claims the key''s first two');
SELECT is(pgfence.outbox_mark_failed((SELECT m[1] FROM hm), 1, 'refused', false), 'failed', 'the first fails for good (it holds its turn: block)');
CREATE TEMP TABLE hd2 AS SELECT decisions FROM pgfence.outbox_key WHERE channel = 'tap-k-hand2' AND ordering_key = 'm';
SELECT results_eq($$SELECT id FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT m[2] FROM hm)], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-hand2']) WHERE id IS NOT NULL$$,
  $$SELECT m[3] FROM hm$$, 'settling the second hands off only the third: the failed one still counts');
SELECT is((SELECT decisions FROM pgfence.outbox_key WHERE channel = 'tap-k-hand2' AND ordering_key = 'm'), (SELECT decisions + 1 FROM hd2),
  'key_max_in_flight 2: the hand-off locks the key as a decision does (counted once), the trigger does not decide it again');
SELECT ok(pgfence.outbox_cancel((SELECT m[1] FROM hm), 'alice', 'given up'), 'the failed one is canceled: its turn is free');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE channel = 'tap-k-hand2' ORDER BY id$$,
  $$VALUES ('canceled'::text), ('sent'), ('processing'), ('pending'), ('waiting'), ('waiting')$$,
  '... and its decision promotes the fourth to pending: two in flight');
SELECT results_eq($$SELECT id FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT m[3] FROM hm)], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-hand2']) WHERE id IS NOT NULL ORDER BY id$$,
  $$SELECT unnest(ARRAY[m[4], m[5]]) FROM hm$$, 'settling the third hands off the fifth, and the pending fourth is claimed');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-k-hand2' AND status IN ('pending', 'processing')), 2,
  'never more than max_in_flight in flight');
SELECT throws_ok(format($$SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[%s], ARRAY[1], NULL, '', 10, ARRAY['tap-k-hand2'])$$, (SELECT m[4] FROM hm)),
  '22023', NULL, 'a hand-off checks the worker as a claim does: 22023');
SELECT throws_ok(format($$SELECT * FROM pgfence.outbox_settle_and_claim(ARRAY[%s], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-hand2'], interval '2 days')$$, (SELECT m[4] FROM hm)),
  '22023', NULL, '... and the lease: 22023');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE id IN (SELECT m[4] FROM hm UNION ALL SELECT m[6] FROM hm) ORDER BY id$$,
  $$VALUES ('processing'::text), ('waiting')$$, '... and nothing was settled or handed off');
SELECT throws_ok(format($$UPDATE pgfence.outbox SET status = 'processing', locked_by = 'x', lease_expires_at = now() + interval '1 minute' WHERE id = %s$$, (SELECT m[6] FROM hm)),
  'PF001', NULL, 'waiting -> processing without a new attempt (fence token): PF001');

-- the keyless path does not call the key decision's statement trigger; a client's setting of its
-- hint cannot make a keyed settle skip its decision
SET LOCAL track_functions = 'all';
CREATE TEMP TABLE hz AS SELECT coalesce((SELECT calls FROM pg_stat_xact_user_functions
  WHERE schemaname = 'pgfence' AND funcname = 'tg_outbox_keys_turns_ended'), 0) AS calls;
SELECT pgfence.outbox_enqueue('tap-k-hand6', 'r', '{}') IS NOT NULL;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_settle_and_claim((SELECT array_agg(c.id) FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-hand6']) c),
  ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-hand6']) WHERE sent IS NOT NULL AND cardinality(sent) = 1), 1, 'a keyless claim and settle');
SELECT is(coalesce((SELECT calls FROM pg_stat_xact_user_functions WHERE schemaname = 'pgfence' AND funcname = 'tg_outbox_keys_turns_ended'), 0),
  (SELECT calls FROM hz), '... do not call tg_outbox_keys_turns_ended (its WHEN is false)');
CREATE TEMP TABLE hy AS
SELECT pgfence.outbox_enqueue('tap-k-hand6', 'r', '{}', NULL, NULL, NULL, 'y') AS y1,
       pgfence.outbox_enqueue('tap-k-hand6', 'r', '{}', NULL, NULL, NULL, 'y') AS y2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-hand6'])), 1, 'a keyed message is claimed');
SET LOCAL pgfence.outbox_keys_turns_ended = 'off';
SELECT ok(pgfence.outbox_mark_sent((SELECT y1 FROM hy), 1), 'with the hint preset by the client, the message is delivered');
SELECT is((SELECT status FROM pgfence.outbox WHERE id = (SELECT y2 FROM hy)), 'pending', '... and its key''s next message promoted all the same');

-- no hand-off: a next message not yet due, a key with a rate, a round that does not route the channel
CREATE TEMP TABLE hn AS
SELECT pgfence.outbox_enqueue('tap-k-hand3', 'r', '{}', NULL, NULL, NULL, 'n') AS n1,
       pgfence.outbox_enqueue('tap-k-hand3', 'r', '{}', NULL, now() + interval '1 hour', NULL, 'n') AS n2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-hand3'])), 1, 'the first of a key with a later message is claimed');
SELECT results_eq($$SELECT count(id)::int FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT n1 FROM hn)], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-hand3'])$$,
  $$VALUES (0)$$, 'a next message due in an hour is not handed off');
SELECT results_eq($$SELECT status, next_attempt_at > now() FROM pgfence.outbox WHERE id = (SELECT n2 FROM hn)$$, $$VALUES ('pending'::text, true)$$,
  '... it is promoted to pending, due when it was');
SELECT pgfence.outbox_configure_channel('tap-k-hand4', p_key_rate => 0.01) IS NOT NULL AS configured;
CREATE TEMP TABLE hq AS
SELECT pgfence.outbox_enqueue('tap-k-hand4', 'r', '{}', NULL, NULL, NULL, 'q') AS q1,
       pgfence.outbox_enqueue('tap-k-hand4', 'r', '{}', NULL, NULL, NULL, 'q') AS q2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-hand4'])), 1, 'the first of a rate-limited key is claimed');
SELECT results_eq($$SELECT count(id)::int FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT q1 FROM hq)], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-hand4'])$$,
  $$VALUES (0)$$, 'a key with a rate is never handed off');
SELECT results_eq($$SELECT status, next_attempt_at > now() FROM pgfence.outbox WHERE id = (SELECT q2 FROM hq)$$, $$VALUES ('pending'::text, true)$$,
  '... its next message is promoted to pending, due when the token bucket allows');
CREATE TEMP TABLE hch AS
SELECT pgfence.outbox_enqueue('tap-k-hand5', 'r', '{}', NULL, NULL, NULL, 'c') AS c1,
       pgfence.outbox_enqueue('tap-k-hand5', 'r', '{}', NULL, NULL, NULL, 'c') AS c2;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-hand5'])), 1, 'the first of a key is claimed');
SELECT results_eq($$SELECT count(id)::int, max(sent[1]) FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT c1 FROM hch)], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-other'])$$,
  $$SELECT 0, c1 FROM hch$$, 'a round that does not route the key''s channel settles it but hands nothing off');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE id = (SELECT c2 FROM hch)$$, $$VALUES ('pending'::text)$$,
  '... the key''s next message is promoted to pending');

-- the lean hand-off (key_max_in_flight 1, no rate): another message holding or blocking the key's
-- turn besides the settled one means no hand-off (migration 0032's outbox_key_live_idx)
SELECT pgfence.outbox_configure_channel('tap-k-lean', p_key_max_in_flight => 2) IS NOT NULL AS configured;
CREATE TEMP TABLE hl AS SELECT array_agg(id ORDER BY ord) AS m FROM pgfence.outbox_enqueue_many('tap-k-lean',
  array_fill('r'::text, ARRAY[6]), array_fill('{}'::jsonb, ARRAY[6]), NULL, NULL, NULL,
  ARRAY['l', 'l', 'l', 'b', 'b', 'b']) WITH ORDINALITY AS e(id, ord);
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-lean'])), 4, 'limit 2: two of each key claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT m[4] FROM hl), 1, 'rejected', false), 'failed', 'the first of key b fails for good (it blocks: block)');
SELECT pgfence.outbox_configure_channel('tap-k-lean', p_key_max_in_flight => 1) IS NOT NULL AS configured;
SELECT results_eq($$SELECT count(id)::int, max(cardinality(sent)) FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT m[2] FROM hl), (SELECT m[5] FROM hl)],
    ARRAY[1, 1], NULL, 'tap-hw', 10, ARRAY['tap-k-lean'])$$,
  $$VALUES (0, 2)$$, 'limit lowered to 1: settling the second of each key hands nothing off (another message in flight; a failed blocker)');
SELECT results_eq($$SELECT status FROM pgfence.outbox WHERE channel = 'tap-k-lean' ORDER BY id$$,
  $$VALUES ('processing'::text), ('sent'), ('waiting'), ('failed'), ('sent'), ('waiting')$$,
  '... and the decision promotes nothing either: each key''s turn is held');
SELECT pgfence.outbox_configure_channel('tap-k-lean2', p_key_dead_policy => 'release') IS NOT NULL AS configured;
CREATE TEMP TABLE hr AS SELECT array_agg(id ORDER BY ord) AS m FROM pgfence.outbox_enqueue_many('tap-k-lean2',
  array_fill('r'::text, ARRAY[3]), array_fill('{}'::jsonb, ARRAY[3]), NULL, NULL, NULL,
  ARRAY['r', 'r', 'r']) WITH ORDINALITY AS e(id, ord);
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-lean2'])), 1, 'release: the first of the key is claimed');
SELECT is(pgfence.outbox_mark_failed((SELECT m[1] FROM hr), 1, 'rejected', false), 'failed', '... fails for good and releases the key');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-hw', 10, ARRAY['tap-k-lean2'])), 1, '... so the second is claimed');
SELECT results_eq($$SELECT id FROM pgfence.outbox_settle_and_claim(ARRAY[(SELECT m[2] FROM hr)], ARRAY[1], NULL, 'tap-hw', 10, ARRAY['tap-k-lean2'])
    WHERE id IS NOT NULL$$,
  $$SELECT m[3] FROM hr$$, 'settling the second hands the third off: a failed message does not hold a released key');

-- =============================================================================================
-- Eight sessions at once over committed keys: never more than max_in_flight of a key in flight,
-- and each key's messages claimed in enqueue order
-- =============================================================================================
SELECT tap_helpers.peer('kp' || i) FROM generate_series(0, 8) i;
SELECT x FROM dblink('kp0', $$SELECT 1 FROM pgfence.outbox_configure_channel('tap-k-peer', p_key_max_in_flight => 2)$$) AS t(x int);
SELECT is((SELECT n FROM dblink('kp0', $$SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-k-peer', array_fill('r'::text, ARRAY[120]), array_fill('{}'::jsonb, ARRAY[120]), NULL, NULL, NULL, ARRAY(SELECT 'key-' || (i % 6) FROM generate_series(1, 120) i))$$) AS t(n bigint)),
  120::bigint, 'a peer commits 120 messages over 6 keys (max_in_flight 2)');
SELECT x FROM dblink('kp0', $$SELECT 1 FROM pgfence.outbox_configure_channel('tap-k-peerh', p_key_max_in_flight => 2, p_limit_key => 'host')$$) AS t(x int);
SELECT is((SELECT n FROM dblink('kp0', $$SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-k-peerh', ARRAY(SELECT 'https://h' || (i % 6) || '.example/hook' FROM generate_series(1, 120) i), array_fill('{}'::jsonb, ARRAY[120]))$$) AS t(n bigint)),
  120::bigint, 'and 120 keyless messages to 6 hosts on a channel limited per host (limit_key host, max_in_flight 2)');
CREATE TEMP TABLE rounds (round int, peer int, id bigint, attempt int);
DO $$
DECLARE
  v_round int := 0;
  v_peer int;
BEGIN
  LOOP
    v_round := v_round + 1;
    -- eight open transactions claim at once, each holding its claims uncommitted
    FOR v_peer IN 1..8 LOOP
      PERFORM dblink_exec('kp' || v_peer, 'BEGIN');
      INSERT INTO rounds SELECT v_round, v_peer, t.id, t.attempt
      FROM dblink('kp' || v_peer, format($q$SELECT id, attempt FROM pgfence.outbox_claim('tap-kp%s', 3, ARRAY['tap-k-peer', 'tap-k-peerh'])$q$, v_peer))
             AS t(id bigint, attempt int);
    END LOOP;
    FOR v_peer IN 1..8 LOOP
      PERFORM dblink_exec('kp' || v_peer, 'COMMIT');
    END LOOP;
    EXIT WHEN NOT EXISTS (SELECT 1 FROM rounds WHERE round = v_round) OR v_round > 100;
    -- then each settles its own claims, autocommit as an executor does (a settle takes the
    -- key's row lock: a second one of the same key waits for the first to commit)
    FOR v_peer IN 1..8 LOOP
      PERFORM * FROM dblink('kp' || v_peer, format($q$SELECT count(*) FROM pgfence.outbox_mark_sent_many(%L, %L)$q$,
        (SELECT coalesce(array_agg(id), '{}') FROM rounds WHERE round = v_round AND peer = v_peer),
        (SELECT coalesce(array_agg(attempt), '{}') FROM rounds WHERE round = v_round AND peer = v_peer))) AS t(n bigint);
    END LOOP;
  END LOOP;
END $$;
SELECT is((SELECT count(DISTINCT id)::int FROM rounds), 240, 'every message was claimed');
SELECT is((SELECT count(*)::int FROM rounds), 240, 'none twice');
SELECT is((SELECT max(n)::int FROM (SELECT round, count(*) AS n FROM rounds r
                                     JOIN dblink('kp0', $$SELECT id, ordering_key FROM pgfence.outbox WHERE channel LIKE 'tap-k-peer%'$$) AS o(id bigint, ordering_key text) USING (id)
                                     GROUP BY round, o.ordering_key) x), 2,
  'in no round were more than 2 of one key (or of one host) in flight across the eight sessions');
SELECT is((SELECT count(*)::int FROM (
             SELECT o.ordering_key, r.round, r.id, lag(r.round) OVER (PARTITION BY o.ordering_key ORDER BY r.id) AS prev_round
             FROM rounds r JOIN dblink('kp0', $$SELECT id, ordering_key FROM pgfence.outbox WHERE channel LIKE 'tap-k-peer%'$$) AS o(id bigint, ordering_key text) USING (id)) x
           WHERE x.round < x.prev_round), 0,
  'each key''s messages were claimed in enqueue order (no later id in an earlier round)');
SELECT dblink_exec('kp0', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox WHERE channel LIKE 'tap-k-peer%'; DELETE FROM pgfence.outbox_key WHERE channel LIKE 'tap-k-peer%'; DELETE FROM pgfence.outbox_channel WHERE channel LIKE 'tap-k-peer%'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
