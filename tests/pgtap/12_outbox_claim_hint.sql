-- pgTAP: the claim hint (functions/12_outbox_claim.sql, docs/design.md#claim-hint). A claim walks
-- its due index from its session's hint instead of the front; no write that makes a message
-- pending may land below a hint the claim may use, and what the hint cannot see (a skipped
-- locked row) is found by the full walk at least once per pgfence.claim_full_walk_ms.
-- The claims run in a real second session ('cl', autocommit: a hint moves only across
-- transactions); 'ad' commits the fixtures, 'wr' holds a writer's transaction open. Every
-- channel is this file's own (tap-h-*), deleted at the end.
-- No BEGIN ... ROLLBACK here, unlike the other files: a hint never passes a transaction that
-- had its xid before the hint's candidate (that is the point), and a pgTAP transaction holds
-- one from its first statement. So each statement here commits on its own; what it leaves is
-- in temporary tables and functions (pg_temp), and the peers' rows are deleted at the end.
\ir helpers/setup.sql
SELECT plan(49);

SELECT tap_helpers.peer('cl'), tap_helpers.peer('ad'), tap_helpers.peer('wr');
-- the safety net out of the way, except where it is the subject
SELECT dblink_exec('cl', $$SET pgfence.claim_full_walk_ms = 60000$$);

-- A claim of p_batch in 'cl' (its own transaction): the ids, in claim order.
CREATE FUNCTION pg_temp.hclaim(p_channel text, p_batch int) RETURNS bigint[] LANGUAGE sql AS $f$
  SELECT coalesce(x, '{}')::bigint[] FROM dblink('cl', format(
    $$SELECT array_agg(id)::text FROM pgfence.outbox_claim('tap-h-cl', %s, ARRAY[%L])$$, p_batch, p_channel)) AS t(x text)
$f$;
-- 'cl's hint of a channel: (due, id), NULL when it has none.
CREATE FUNCTION pg_temp.hint(p_channel text) RETURNS TABLE (at timestamptz, id bigint) LANGUAGE sql AS $f$
  SELECT 'epoch'::timestamptz + interval '1 microsecond' * s[1], s[2]
  FROM (SELECT string_to_array(x, ',', '')::bigint[] AS s
        FROM dblink('cl', format($$SELECT current_setting(%L, true)$$, pgfence._outbox_claim_hint_name(ARRAY[p_channel]))) AS t(x text)) q
$f$;
-- Is 'cl's hint of the channel above message p_id (as committed)?
CREATE FUNCTION pg_temp.hint_above(p_channel text, p_id bigint) RETURNS boolean LANGUAGE sql AS $f$
  SELECT (h.at, h.id) > (m.at, p_id)
  FROM pg_temp.hint(p_channel) h,
       dblink('ad', format($$SELECT next_attempt_at FROM pgfence.outbox WHERE id = %s$$, p_id)) AS m(at timestamptz)
$f$;
-- n messages enqueued and committed by 'ad'; their ids.
CREATE FUNCTION pg_temp.henq(p_channel text, p_n int) RETURNS bigint[] LANGUAGE sql AS $f$
  SELECT x::bigint[] FROM dblink('ad', format(
    $$SELECT array_agg(i)::text FROM pgfence.outbox_enqueue_many(%L, array_fill('r'::text, ARRAY[%s]), array_fill('{}'::jsonb, ARRAY[%s])) i$$,
    p_channel, p_n, p_n)) AS t(x text)
$f$;
CREATE FUNCTION pg_temp.hval(p_peer text, p_sql text) RETURNS bigint LANGUAGE sql AS $f$
  SELECT x::bigint FROM dblink(p_peer, p_sql) AS t(x text)
$f$;

-- ---------------------------------------------------------------------------------------------
-- The hint moves up behind the claims, and the walk starts there
-- ---------------------------------------------------------------------------------------------
SELECT is(pgfence._outbox_claim_hint_name(NULL), 'pgfence.claim_hint_all', 'all channels have one hint');
SELECT is(pgfence._outbox_claim_hint_name(ARRAY['a']), 'pgfence.claim_hint_' || md5('a'), 'one channel has its own');
SELECT is(pgfence._outbox_claim_hint_name(ARRAY['b', 'a', 'b']), pgfence._outbox_claim_hint_name(ARRAY['a', 'b']), 'a set of channels has one, whatever the order and repeats');
CREATE TEMP TABLE mv AS SELECT pg_temp.henq('tap-h-move', 30) AS ids;
SELECT pg_temp.hclaim('tap-h-move', 10)::text AS mvc1 \gset
SELECT pg_temp.hclaim('tap-h-move', 10)::text AS mvc2 \gset
SELECT pg_temp.hclaim('tap-h-move', 10)::text AS mvc3 \gset
SELECT is(ARRAY[:'mvc1'::bigint[], :'mvc2'::bigint[], :'mvc3'::bigint[]], (SELECT array[ids[1:10], ids[11:20], ids[21:30]] FROM mv), 'three claims of 10 get the 30, each once, in due order');
SELECT ok(pg_temp.hint_above('tap-h-move', (SELECT ids[10] FROM mv)), 'the hint is above the messages claimed two claims ago');
-- a set of channels: the hint of the set moves, the union is claimed in due order
CREATE TEMP TABLE ms AS SELECT pg_temp.henq('tap-h-set1', 10) || pg_temp.henq('tap-h-set2', 10) AS ids;
SELECT x::bigint[] AS ms1 FROM dblink('cl', $$SELECT array_agg(id)::text FROM pgfence.outbox_claim('tap-h-cl', 8, ARRAY['tap-h-set2', 'tap-h-set1'])$$) AS t(x text) \gset
SELECT x::bigint[] AS ms2 FROM dblink('cl', $$SELECT array_agg(id)::text FROM pgfence.outbox_claim('tap-h-cl', 8, ARRAY['tap-h-set1', 'tap-h-set2'])$$) AS t(x text) \gset
SELECT x::bigint[] AS ms3 FROM dblink('cl', $$SELECT array_agg(id)::text FROM pgfence.outbox_claim('tap-h-cl', 8, ARRAY['tap-h-set1', 'tap-h-set2'])$$) AS t(x text) \gset
SELECT is(:'ms1'::bigint[] || :'ms2'::bigint[] || :'ms3'::bigint[], (SELECT ids FROM ms), 'claims of a channel set get the union in due order, each once');
SELECT is((SELECT x FROM dblink('cl', format($$SELECT split_part(current_setting(%L), ',', 2)$$, pgfence._outbox_claim_hint_name(ARRAY['tap-h-set1', 'tap-h-set2']))) AS t(x text)),
  (SELECT ids[16]::text FROM ms), 'and the set''s hint moved behind them (to the second claim''s last: the third, short, saw all)');

-- ---------------------------------------------------------------------------------------------
-- A writer that had its xid before the hint and commits after: the hint waits for it
-- ---------------------------------------------------------------------------------------------
SELECT dblink_exec('wr', 'BEGIN');
SELECT pg_temp.hval('wr', $$SELECT pgfence.outbox_enqueue('tap-h-early', 'r', '{}')$$) AS early_id \gset
CREATE TEMP TABLE ea AS SELECT pg_temp.henq('tap-h-early', 20) AS ids;
SELECT pg_temp.hclaim('tap-h-early', 5)::text AS eac1 \gset
SELECT pg_temp.hclaim('tap-h-early', 5)::text AS eac2 \gset
SELECT pg_temp.hclaim('tap-h-early', 5)::text AS eac3 \gset
SELECT pg_temp.hclaim('tap-h-early', 5)::text AS eac4 \gset
SELECT is(cardinality(:'eac1'::bigint[] || :'eac2'::bigint[] || :'eac3'::bigint[] || :'eac4'::bigint[]), 20, 'claims get the committed messages, not the open writer''s');
SELECT is((SELECT id FROM pg_temp.hint('tap-h-early')), NULL, 'while a writer older than every candidate is open, no candidate is promoted');
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok(:early_id = ANY (pg_temp.hclaim('tap-h-early', 10)), 'once it commits, the next claim gets its message (due below the candidates)');

-- ---------------------------------------------------------------------------------------------
-- A writer that began before the hint and writes after it: a past deliver_at is due at the clock
-- ---------------------------------------------------------------------------------------------
SELECT dblink_exec('wr', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT pg_temp.hval('wr', $$SELECT count(*) FROM pgfence.outbox_channel$$) IS NOT NULL AS snapshot_taken;
CREATE TEMP TABLE la AS SELECT pg_temp.henq('tap-h-late', 20) AS ids;
SELECT pg_temp.hclaim('tap-h-late', 5)::text AS lac1 \gset
SELECT pg_temp.hclaim('tap-h-late', 5)::text AS lac2 \gset
SELECT pg_temp.hclaim('tap-h-late', 5)::text AS lac3 \gset
SELECT pg_temp.hclaim('tap-h-late', 5)::text AS lac4 \gset
SELECT ok(pg_temp.hint_above('tap-h-late', (SELECT ids[10] FROM la)), 'the hint moved above ten claimed messages');
SELECT pg_temp.hval('wr', $$SELECT pgfence.outbox_enqueue('tap-h-late', 'r', '{}', NULL, '2000-01-01')$$) AS late_id \gset
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok(pg_temp.hint_above('tap-h-late', :late_id) IS FALSE, 'a message due in 2000, enqueued now, is stamped above the hint');
SELECT ok(:late_id = ANY (pg_temp.hclaim('tap-h-late', 10)), '... and the next claim gets it');

-- ---------------------------------------------------------------------------------------------
-- A retry with (almost) no backoff, the reaper, a requeue, a key's next turn: above the hint
-- ---------------------------------------------------------------------------------------------
SELECT tap_helpers.peer_value('ad', $$SELECT 1 FROM pgfence.outbox_configure_channel('tap-h-retry', 3, interval '1 microsecond', interval '1 microsecond')$$) AS configured;
SELECT dblink_exec('wr', 'BEGIN');  -- now() of the writer is before the messages and the hint
SELECT tap_helpers.peer_value('wr', 'SELECT 1') AS began;
CREATE TEMP TABLE rt AS SELECT pg_temp.henq('tap-h-retry', 21) AS ids;
SELECT is(pg_temp.hval('ad', $$SELECT id FROM pgfence.outbox_claim('tap-h-ad', 1, ARRAY['tap-h-retry'])$$), (SELECT ids[1] FROM rt), 'another worker claims the first');
SELECT pg_temp.hclaim('tap-h-retry', 5)::text AS rtc1 \gset
SELECT pg_temp.hclaim('tap-h-retry', 5)::text AS rtc2 \gset
SELECT pg_temp.hclaim('tap-h-retry', 5)::text AS rtc3 \gset
SELECT ok(pg_temp.hint_above('tap-h-retry', (SELECT ids[1] FROM rt)), 'the hint passes it');
SELECT is(pg_temp.hval('wr', format($$SELECT (pgfence.outbox_mark_failed(%s, 1, 'boom', true) = 'pending')::int$$, (SELECT ids[1] FROM rt))), 1::bigint, 'it fails, retryable, 1 µs backoff, in a transaction begun before');
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok(pg_temp.hint_above('tap-h-retry', (SELECT ids[1] FROM rt)) IS FALSE, 'its retry is due above the hint');
SELECT ok((SELECT ids[1] FROM rt) = ANY (pg_temp.hclaim('tap-h-retry', 10)), '... and the next claim gets it');

SELECT tap_helpers.peer_value('ad', $$SELECT 1 FROM pgfence.outbox_configure_channel('tap-h-reap', 3, interval '1 microsecond', interval '1 microsecond')$$) AS configured;
SELECT dblink_exec('wr', 'BEGIN');
SELECT tap_helpers.peer_value('wr', 'SELECT 1') AS began;
CREATE TEMP TABLE rp AS SELECT pg_temp.henq('tap-h-reap', 21) AS ids;
SELECT is(pg_temp.hval('ad', $$SELECT id FROM pgfence.outbox_claim('tap-h-ad', 1, ARRAY['tap-h-reap'])$$), (SELECT ids[1] FROM rp), 'another worker claims the first');
SELECT pg_temp.hclaim('tap-h-reap', 5)::text AS rpc1 \gset
SELECT pg_temp.hclaim('tap-h-reap', 5)::text AS rpc2 \gset
SELECT pg_temp.hclaim('tap-h-reap', 5)::text AS rpc3 \gset
SELECT dblink_exec('ad', format($$UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second' WHERE id = %s$$, (SELECT ids[1] FROM rp)));
SELECT ok(pg_temp.hval('wr', $$SELECT pgfence.outbox_reap()$$) >= 1, 'its lease lapses and the reaper takes it back, in a transaction begun before');
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok((SELECT ids[1] FROM rp) = ANY (pg_temp.hclaim('tap-h-reap', 10)), '... and the next claim gets it (its old due time was below the hint)');

SELECT tap_helpers.peer_value('ad', $$SELECT 1 FROM pgfence.outbox_configure_channel('tap-h-rq', 1)$$) AS configured;
SELECT dblink_exec('wr', 'BEGIN');
SELECT tap_helpers.peer_value('wr', 'SELECT 1') AS began;
CREATE TEMP TABLE rq AS SELECT pg_temp.henq('tap-h-rq', 21) AS ids;
SELECT is(pg_temp.hval('ad', $$SELECT id FROM pgfence.outbox_claim('tap-h-ad', 1, ARRAY['tap-h-rq'])$$), (SELECT ids[1] FROM rq), 'another worker claims the first');
SELECT tap_helpers.peer_value('ad', format($$SELECT pgfence.outbox_mark_failed(%s, 1, 'no', false)$$, (SELECT ids[1] FROM rq))) AS failed;
SELECT pg_temp.hclaim('tap-h-rq', 5)::text AS rqc1 \gset
SELECT pg_temp.hclaim('tap-h-rq', 5)::text AS rqc2 \gset
SELECT pg_temp.hclaim('tap-h-rq', 5)::text AS rqc3 \gset
SELECT is(pg_temp.hval('wr', format($$SELECT pgfence.outbox_requeue(%s)::int$$, (SELECT ids[1] FROM rq))), 1::bigint, 'it failed for good; an operator requeues it, in a transaction begun before');
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok((SELECT ids[1] FROM rq) = ANY (pg_temp.hclaim('tap-h-rq', 10)), '... and the next claim gets it');

SELECT pg_temp.hval('ad', $$SELECT pgfence.outbox_enqueue('tap-h-key', 'r', '{}', NULL, NULL, NULL, 'k')$$) AS k1 \gset
SELECT pg_temp.hval('ad', $$SELECT pgfence.outbox_enqueue('tap-h-key', 'r', '{}', NULL, NULL, NULL, 'k')$$) AS k2 \gset
CREATE TEMP TABLE ky AS SELECT pg_temp.henq('tap-h-key', 20) AS ids;
SELECT ok(:k1 = ANY (pg_temp.hclaim('tap-h-key', 5)), 'the key''s first message is claimed');
SELECT pg_temp.hclaim('tap-h-key', 5)::text AS kyc1 \gset
SELECT pg_temp.hclaim('tap-h-key', 5)::text AS kyc2 \gset
SELECT pg_temp.hclaim('tap-h-key', 5)::text AS kyc3 \gset
SELECT ok(pg_temp.hint_above('tap-h-key', (SELECT ids[5] FROM ky)), 'the hint passes messages enqueued after the key''s second');
SELECT is(pg_temp.hval('cl', format($$SELECT pgfence.outbox_mark_sent(%s, 1)::int$$, :k1)), 1::bigint, 'the first is sent: the key''s turn passes to the second');
SELECT ok(:k2 = ANY (pg_temp.hclaim('tap-h-key', 10)), '... and the next claim gets it (due when its turn came)');

-- ---------------------------------------------------------------------------------------------
-- A row skipped because it was locked: its locker holds an xid, so the hint waits for it
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE rb AS SELECT pg_temp.henq('tap-h-rb', 21) AS ids;
SELECT dblink_exec('wr', 'BEGIN');
SELECT is(pg_temp.hval('wr', $$SELECT id FROM pgfence.outbox_claim('tap-h-wr', 1, ARRAY['tap-h-rb'])$$), (SELECT ids[1] FROM rb), 'a claimer locks the first ...');
SELECT pg_temp.hclaim('tap-h-rb', 5)::text AS rbc1 \gset
SELECT pg_temp.hclaim('tap-h-rb', 5)::text AS rbc2 \gset
SELECT pg_temp.hclaim('tap-h-rb', 5)::text AS rbc3 \gset
SELECT ok(coalesce(pg_temp.hint_above('tap-h-rb', (SELECT ids[1] FROM rb)), false) IS FALSE, '... the others'' claims skip it, and the hint does not pass it while it is locked');
SELECT dblink_exec('wr', 'ROLLBACK');
SELECT ok((SELECT ids[1] FROM rb) = ANY (pg_temp.hclaim('tap-h-rb', 10)), 'the claimer rolls back: the next claim gets it');

CREATE TEMP TABLE lk AS SELECT pg_temp.henq('tap-h-lock', 21) AS ids;
SELECT dblink_exec('wr', 'BEGIN');
SELECT is(pg_temp.hval('wr', format($$SELECT id FROM pgfence.outbox WHERE id = %s FOR UPDATE$$, (SELECT ids[1] FROM lk))), (SELECT ids[1] FROM lk), 'an operator locks the first by hand');
SELECT pg_temp.hclaim('tap-h-lock', 5)::text AS lkc1 \gset
SELECT pg_temp.hclaim('tap-h-lock', 5)::text AS lkc2 \gset
SELECT pg_temp.hclaim('tap-h-lock', 5)::text AS lkc3 \gset
SELECT ok(coalesce(pg_temp.hint_above('tap-h-lock', (SELECT ids[1] FROM lk)), false) IS FALSE, 'the hint does not pass it while it is locked');
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok((SELECT ids[1] FROM lk) = ANY (pg_temp.hclaim('tap-h-lock', 10)), 'after the lock, the next claim gets it');

-- ---------------------------------------------------------------------------------------------
-- The safety net: a message below the hint (as if the hint had missed it) is claimed by the
-- first claim after pgfence.claim_full_walk_ms; a forged or stale setting never raises
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE sn AS SELECT pg_temp.henq('tap-h-net', 3) AS ids;
SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, %L, false)$$, pgfence._outbox_claim_hint_name(ARRAY['tap-h-net']),
  (SELECT format('%s,%s,,,,,,%s', (extract(epoch FROM o.next_attempt_at) * 1000000)::bigint, o.id,
                 (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)
   FROM dblink('ad', format($$SELECT next_attempt_at, id FROM pgfence.outbox WHERE id = %s$$, (SELECT ids[2] FROM sn))) AS o(next_attempt_at timestamptz, id bigint))));
SELECT dblink_exec('cl', $$SET pgfence.claim_full_walk_ms = 300$$);
SELECT is(pg_temp.hclaim('tap-h-net', 10), (SELECT ids[2:3] FROM sn), 'with a hint above the first, a claim starts at the hint ...');
SELECT pg_sleep(0.35);
SELECT is(pg_temp.hclaim('tap-h-net', 10), (SELECT ids[1:1] FROM sn), '... and the first claim after the bound walks from the front');

CREATE TEMP TABLE fg AS SELECT pg_temp.henq('tap-h-forge', 2) AS ids;
SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, 'not a hint', false)$$, pgfence._outbox_claim_hint_name(ARRAY['tap-h-forge'])));
SELECT is(cardinality(pg_temp.hclaim('tap-h-forge', 1)), 1, 'a malformed hint reads as none');
SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, '999999999999999999,1,,,,,,1', false)$$, pgfence._outbox_claim_hint_name(ARRAY['tap-h-forge'])));
SELECT is(cardinality(pg_temp.hclaim('tap-h-forge', 1)), 1, 'a hint after the clock reads as none');
SELECT dblink_exec('cl', $$SET pgfence.claim_full_walk_ms = 'soon'$$);
SELECT is(cardinality(pg_temp.hclaim('tap-h-forge', 1)), 0, 'a malformed bound is the default (and nothing is left)');

-- ---------------------------------------------------------------------------------------------
-- outbox_next_due walks from the same hint, read the same way (its own inline copy of the
-- state check): a forged or stale setting reads as none
-- ---------------------------------------------------------------------------------------------
CREATE FUNCTION pg_temp.hnext(p_channel text) RETURNS interval LANGUAGE sql AS $f$
  SELECT x::interval FROM dblink('cl', format($$SELECT pgfence.outbox_next_due(ARRAY[%L])::text$$, p_channel)) AS t(x text)
$f$;
CREATE FUNCTION pg_temp.hset(p_channel text, p_state text) RETURNS text LANGUAGE sql AS $f$
  SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, %L, false)$$, pgfence._outbox_claim_hint_name(ARRAY[p_channel]), p_state))
$f$;
CREATE TEMP TABLE nd AS SELECT pg_temp.henq('tap-h-nd', 1) AS ids;
SELECT pg_temp.hval('ad', $$SELECT pgfence.outbox_enqueue('tap-h-nd', 'r', '{}', NULL, now() + interval '1 hour')$$);
CREATE TEMP TABLE nd_key AS
  SELECT (extract(epoch FROM o.next_attempt_at) * 1000000)::bigint AS us, o.id, (extract(epoch FROM clock_timestamp()) * 1000000)::bigint AS now_us
  FROM dblink('ad', format($$SELECT next_attempt_at, id FROM pgfence.outbox WHERE id = %s$$, (SELECT ids[1] FROM nd))) AS o(next_attempt_at timestamptz, id bigint);
SELECT is(pg_temp.hnext('tap-h-nd'), interval '0', 'next_due: the due message, without a hint');
SELECT pg_temp.hset('tap-h-nd', (SELECT format('%s,%s,,,,,,%s', us, id + 1, now_us) FROM nd_key));
SELECT ok(pg_temp.hnext('tap-h-nd') BETWEEN interval '59 minutes' AND interval '1 hour',
  'next_due walks from the hint: a message below it is not seen (the one due in an hour is)');
SELECT pg_temp.hset('tap-h-nd', (SELECT format(',%s,,,,,,%s', id + 1, now_us) FROM nd_key));
SELECT is(pg_temp.hnext('tap-h-nd'), interval '0', 'next_due: a hint without a due time starts at the front');
SELECT pg_temp.hset('tap-h-nd', (SELECT format('%s,%s,,,,,,%s', us, id + 1, now_us + 3600000000) FROM nd_key));
SELECT is(pg_temp.hnext('tap-h-nd'), interval '0', 'next_due: a state with a time after the clock reads as none');
SELECT pg_temp.hset('tap-h-nd', (SELECT format('%s,%s,,,,,,%s', us, id + 1, now_us) || ',' FROM nd_key));
SELECT is(pg_temp.hnext('tap-h-nd'), interval '0', 'next_due: a malformed state (9 fields) reads as none');

-- _outbox_claim_hint_state, the reference of the state check that both functions copy inline
SELECT set_config('pgfence.claim_hint_tap_ref', '5,6,,,,,,7', false);
SELECT is(pgfence._outbox_claim_hint_state('pgfence.claim_hint_tap_ref'), ARRAY[5, 6, NULL, NULL, NULL, NULL, NULL, 7]::bigint[],
  '_outbox_claim_hint_state: 8 fields, empty ones NULL');
SELECT set_config('pgfence.claim_hint_tap_ref', '5,6,,,,,,1234567890123456789', false);
SELECT is(pgfence._outbox_claim_hint_state('pgfence.claim_hint_tap_ref'), NULL, '... a run of 19 digits is malformed');
SELECT set_config('pgfence.claim_hint_tap_ref', '999999999999999999,6,,,,,,7', false);
SELECT is(pgfence._outbox_claim_hint_state('pgfence.claim_hint_tap_ref'), NULL, '... a time after the clock reads as none');

-- A candidate taken by a claim whose transaction had its xid before the walk gets no bound
-- there (that xid is older than the walk's snapshot); the next claim of the session that gets
-- an xid gives it one, so a session that then only claims moves its hint again.
CREATE TEMP TABLE bx AS SELECT pg_temp.henq('tap-h-bx', 30) AS ids;
SELECT dblink_exec('cl', 'BEGIN');
SELECT pg_temp.hval('cl', 'SELECT pg_current_xact_id()::text') > 0 AS bx_xid \gset
SELECT pg_temp.hclaim('tap-h-bx', 10)::text AS bxc1 \gset
SELECT dblink_exec('cl', 'COMMIT');
SELECT pg_temp.hclaim('tap-h-bx', 10)::text AS bxc2 \gset
SELECT pg_temp.hclaim('tap-h-bx', 10)::text AS bxc3 \gset
SELECT is(ARRAY[:'bxc1'::bigint[], :'bxc2'::bigint[], :'bxc3'::bigint[]], (SELECT array[ids[1:10], ids[11:20], ids[21:30]] FROM bx),
  'a claim in a transaction that had its xid, then two plain claims: the 30, each once, in due order');
SELECT is((SELECT id FROM pg_temp.hint('tap-h-bx')), (SELECT ids[10] FROM bx),
  '... and the hint moved to the candidate that claim took (its bound came from the next claim''s xid)');

SELECT dblink_exec('ad', $$SET pgfence.purging = on;
  DELETE FROM pgfence.outbox WHERE channel LIKE 'tap-h-%'; DELETE FROM pgfence.outbox_key WHERE channel LIKE 'tap-h-%';
  DELETE FROM pgfence.outbox_channel WHERE channel LIKE 'tap-h-%'$$);
SELECT tap_helpers.close_peers();
SELECT * FROM finish();
