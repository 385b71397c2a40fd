-- pgTAP: the outbox claim floor (functions/16_outbox_floor.sql): the claims walk from it, every
-- write that makes a message pending below it lowers it, it is raised only to a value no pending
-- message is below, and the reaper heals a bypassed write. The floor lives in sequences, which
-- a ROLLBACK does not undo: each test sets the state it needs, and the file ends with a reset.
-- A second session that wrote a pending message and is still open keeps an armed floor from
-- being raised (dblink). With a
-- pinned snapshot and concurrent claimers: tests/test_outbox_floor.py.
BEGIN;
\ir helpers/setup.sql
SELECT plan(33);

CREATE FUNCTION pg_temp.floor_at() RETURNS timestamptz LANGUAGE sql
  AS $$ SELECT pgfence._outbox_at(last_value) FROM pgfence.outbox_floor_seq $$;
CREATE FUNCTION pg_temp.guard_at() RETURNS timestamptz LANGUAGE sql
  AS $$ SELECT pgfence._outbox_at(last_value) FROM pgfence.outbox_floor_guard_seq $$;
CREATE FUNCTION pg_temp.arm() RETURNS bigint LANGUAGE sql
  AS $$ SELECT last_value FROM pgfence.outbox_floor_arm_seq $$;
CREATE FUNCTION pg_temp.floor_id() RETURNS bigint LANGUAGE sql
  AS $$ SELECT last_value FROM pgfence.outbox_floor_id_seq $$;
-- floor and guard at (p_at, p_id), armed at a time never reached: no claim moves them
CREATE FUNCTION pg_temp.set_floor(p_at timestamptz, p_id bigint DEFAULT -9223372036854775808) RETURNS void LANGUAGE sql AS $$
  SELECT pgfence._outbox_floor_write(pgfence._outbox_us(p_at), p_id),
         setval('pgfence.outbox_floor_guard_seq', pgfence._outbox_us(p_at)),
         setval('pgfence.outbox_floor_guard_id_seq', p_id),
         setval('pgfence.outbox_floor_arm_seq', 1),
         setval('pgfence.outbox_floor_armed_at_seq', 9223372036854775000) $$;
CREATE FUNCTION pg_temp.claim_ids(p_batch integer) RETURNS bigint[] LANGUAGE sql AS $$
  SELECT coalesce(array_agg(c.id ORDER BY c.id), '{}') FROM pgfence.outbox_claim('tap-floor-w', p_batch, ARRAY['tap-floor']) c $$;
CREATE TEMP TABLE fl (name text PRIMARY KEY, id bigint);
SELECT pgfence.outbox_configure_channel('tap-floor', p_backoff_base => interval '1 second', p_backoff_cap => interval '1 second');

-- conversions
SELECT ok(bool_and(pgfence._outbox_at(pgfence._outbox_us(t)) = t),
          'microseconds since 2000 and back is exact (past, now, microsecond, far future, -infinity)')
FROM (VALUES (now()), (timestamptz '1900-03-04 05:06:07.123456+03'), (timestamptz '2500-01-01 00:00:00.000001+00'),
             (timestamptz '-infinity')) v(t);
SELECT is(pgfence._outbox_us('-infinity'), (-9223372036854775808)::bigint, '-infinity is the minimum: no floor');
SELECT pgfence._outbox_floor_reset();
SELECT is(pg_temp.floor_at(), '-infinity'::timestamptz, 'a reset floor is -infinity');

-- the walk starts at the floor
INSERT INTO fl SELECT 'm1', pgfence.outbox_enqueue('tap-floor', 'r', '{}');
SELECT pg_temp.set_floor(now() + interval '1 hour');  -- a floor above a pending message (never done by pgfence)
SELECT is(pg_temp.claim_ids(10), '{}'::bigint[], 'a claim does not look below the floor (one channel) ...');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-floor-w', 10) WHERE channel = 'tap-floor'), 0, '... nor across all channels');
SELECT is(pgfence.outbox_next_due(ARRAY['tap-floor']), NULL::interval, '... and outbox_next_due starts there too');

-- every write that makes a message pending below the floor lowers it
SELECT pg_temp.set_floor(now());
INSERT INTO fl SELECT 'past', pgfence.outbox_enqueue('tap-floor', 'r', '{}', NULL, now() - interval '1 hour');
SELECT is(pg_temp.floor_at(), now() - interval '1 hour', 'an enqueue due before the floor lowers it to its due time');
SELECT is(pg_temp.guard_at(), now() - interval '1 hour', '... and the guard with it');
SELECT is(pg_temp.claim_ids(1), ARRAY[(SELECT id FROM fl WHERE name = 'past')], '... so it is claimed first');
SELECT pg_temp.set_floor(now());
SELECT is((SELECT count(*)::int FROM pgfence.outbox_enqueue_many('tap-floor', ARRAY['a', 'b'], ARRAY['{}', '{}']::jsonb[], NULL, now() - interval '2 hours')), 2, 'enqueue_many, due 2 hours ago ...');
SELECT is(pg_temp.floor_at(), now() - interval '2 hours', '... lowers the floor (one check per statement)');
-- one due time for a whole batch: the id orders them, and the floor carries it
CREATE TEMP TABLE batch AS
  SELECT b AS id FROM pgfence.outbox_enqueue_many('tap-floor-b', ARRAY['a', 'b', 'c'], ARRAY['{}', '{}', '{}']::jsonb[]) b;
SELECT pg_temp.set_floor(now(), (SELECT min(id) + 1 FROM batch));
SELECT is((SELECT array_agg(c.id ORDER BY c.id) FROM pgfence.outbox_claim('tap-floor-w', 10, ARRAY['tap-floor-b']) c),
          (SELECT array_agg(id ORDER BY id) FROM batch WHERE id > (SELECT min(id) FROM batch)),
          'a floor (due time, id) in a batch due at one time skips the messages before its id ...');
SELECT is(pg_temp.floor_id(), (SELECT min(id) + 1 FROM batch), '... and reads back whole');
SELECT pg_temp.set_floor(now());
INSERT INTO fl SELECT 'later', pgfence.outbox_enqueue('tap-floor', 'r', '{}', NULL, now() + interval '1 minute');
SELECT is(pg_temp.floor_at(), now(), 'an enqueue due after the floor leaves it');

-- a retry: mark_failed makes the message pending at now() + backoff (1 s)
SELECT pg_temp.set_floor(now() + interval '1 minute');
SELECT ok(pgfence.outbox_mark_failed((SELECT id FROM fl WHERE name = 'past'), 1, 'boom') = 'pending', 'a retryable failure ...');
SELECT is(pg_temp.floor_at(), (SELECT next_attempt_at FROM pgfence.outbox WHERE id = (SELECT id FROM fl WHERE name = 'past')),
          '... due before the floor lowers it to the retry''s due time');
-- a requeue (operator): pending again, due now
SELECT pg_temp.set_floor('-infinity');
INSERT INTO fl SELECT 'rq', c.id FROM pgfence.outbox_claim('tap-floor-w', 1, ARRAY['tap-floor']) c;
SELECT is(pgfence.outbox_mark_failed((SELECT id FROM fl WHERE name = 'rq'), 1, 'no', false), 'failed', 'a permanent failure ...');
SELECT pg_temp.set_floor(now() + interval '1 minute');
SELECT ok(pgfence.outbox_requeue((SELECT id FROM fl WHERE name = 'rq')), '... requeued by an operator ...');
SELECT is(pg_temp.floor_at(), now(), '... lowers the floor to now');
-- a reap: the lease lapsed, pending again after the backoff
SELECT pg_temp.set_floor('-infinity');
INSERT INTO fl SELECT 'reap', c.id FROM pgfence.outbox_claim('tap-floor-w', 1, ARRAY['tap-floor']) c;
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second' WHERE id = (SELECT id FROM fl WHERE name = 'reap');
SELECT pg_temp.set_floor(now() + interval '1 hour');
SELECT ok(pgfence.outbox_reap() >= 1, 'a lapsed lease reaped ...');
SELECT ok(pg_temp.floor_at() <= (SELECT next_attempt_at FROM pgfence.outbox WHERE id = (SELECT id FROM fl WHERE name = 'reap')),
          '... lowers the floor to at most the retry''s due time');
-- a hand-written UPDATE moving a pending message's due time back
SELECT pg_temp.set_floor(now());
UPDATE pgfence.outbox SET next_attempt_at = now() - interval '3 hours' WHERE id = (SELECT id FROM fl WHERE name = 'later');
SELECT is(pg_temp.floor_at(), now() - interval '3 hours', 'an UPDATE moving a due time back lowers the floor');

-- a write with the trigger bypassed is found by the reaper's check
SELECT pg_temp.set_floor(now() - interval '3 hours');
SET LOCAL session_replication_role = replica;  -- as replication writes (no trigger fires)
UPDATE pgfence.outbox SET next_attempt_at = now() - interval '4 hours' WHERE id = (SELECT id FROM fl WHERE name = 'm1');
SET LOCAL session_replication_role = origin;
SELECT is(pg_temp.floor_at(), now() - interval '3 hours', 'with the trigger bypassed the floor stays above the message ...');
SELECT ok(NOT (SELECT id FROM fl WHERE name = 'm1') = ANY (pg_temp.claim_ids(100)), '... which a claim then misses');
SELECT is(pgfence.outbox_reap(), 0, 'the reaper (nothing lapsed) ...');
SELECT is(pg_temp.floor_at(), now() - interval '4 hours', '... lowers the floor to it');
SELECT is(pg_temp.claim_ids(1), ARRAY[(SELECT id FROM fl WHERE name = 'm1')], '... and the next claim takes it');

-- raising: publish a guard and arm, then raise only once every older transaction ended
SELECT tap_helpers.peer('old');
SELECT dblink_exec('old', 'BEGIN');
-- another session writes a pending message and stays open (it rolls back at the end)
SELECT tap_helpers.peer_value('old', $$SELECT pgfence.outbox_enqueue('tap-floor-peer', 'r', '{}')$$);
INSERT INTO fl SELECT 'p', pgfence.outbox_enqueue('tap-floor', 'r', '{}', NULL, now() - interval '30 seconds');
SELECT pgfence._outbox_floor_reset();
SELECT pgfence._outbox_floor_move();
SELECT ok(pg_temp.arm() > 0 AND pg_temp.floor_at() = '-infinity', 'the first move publishes a guard and arms, the floor stays');
SELECT pgfence._outbox_floor_move();
SELECT is(pg_temp.floor_at(), '-infinity'::timestamptz, 'not raised while a transaction that wrote a pending message before it was armed is open');
INSERT INTO fl SELECT 'armed', pgfence.outbox_enqueue('tap-floor', 'r', '{}', NULL, pg_temp.guard_at() - interval '1 hour');
SELECT is(pg_temp.guard_at(), (SELECT next_attempt_at FROM pgfence.outbox WHERE id = (SELECT id FROM fl WHERE name = 'armed')),
          'a message written while armed and due before the guard lowers the guard');
SELECT dblink_exec('old', 'ROLLBACK');
SELECT pgfence._outbox_floor_move();
SELECT ok((pg_temp.floor_at(), pg_temp.floor_id())
          = (SELECT next_attempt_at, id FROM pgfence.outbox WHERE status = 'pending' ORDER BY next_attempt_at, id LIMIT 1),
          'raised once it ended, to the earliest pending message (no higher than the guard): nothing is buried');

-- outside READ COMMITTED nothing is moved (a snapshot there may miss commits)
SELECT tap_helpers.peer('fl');
SELECT setval('pgfence.outbox_floor_arm_seq', 0);
SELECT dblink_exec('fl', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT tap_helpers.peer_value('fl', 'SELECT pgfence._outbox_floor()');
SELECT is(pg_temp.arm(), 0::bigint, 'a claim in REPEATABLE READ reads the floor and moves nothing');
SELECT dblink_exec('fl', 'COMMIT');
SELECT tap_helpers.peer_value('fl', 'SELECT pgfence._outbox_floor()');
SELECT ok(pg_temp.arm() > 0, 'one in READ COMMITTED publishes and arms');
SELECT tap_helpers.close_peers();

SELECT pgfence._outbox_floor_reset();
SELECT * FROM finish();
ROLLBACK;
