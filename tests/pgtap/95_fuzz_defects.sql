-- pgTAP: the defects that fuzzing every public function found (issue 11), one cell per case, with
-- the arguments that broke it. The two that need concurrent sessions (lock order of the bulk
-- outbox calls) are in 13_outbox_lock_order.sql; the fuzzer itself is tests/test_fuzz.py.
-- Everything is rolled back; the purge (which commits) runs in a dblink peer.
BEGIN;
\ir helpers/setup.sql
SELECT plan(49);

-- =============================================================================================
-- A PostgreSQL error leaked from inside instead of a documented SQLSTATE
-- =============================================================================================

-- 1. document_save retried with an existing save_id and expected_version = 2^63-1: the replay
--    computed expected_version + 1 (22003) before its check.
CREATE TEMP TABLE d AS SELECT pgfence.document_create('record', '{"a": 1}', 'tap-fuzz') AS id;
SELECT is((SELECT outcome FROM pgfence.document_save((SELECT id FROM d), 1, '{"a": 2}', 'tap-fuzz', 'tap-fuzz-s1')), 'saved',
  'a save with save_id tap-fuzz-s1 (version 2)');
SELECT throws_ok(format($$SELECT * FROM pgfence.document_save(%s, 9223372036854775807, '{"a": 2}', 'tap-fuzz', 'tap-fuzz-s1')$$, (SELECT id FROM d)),
  'PF003', NULL, 'document_save retried with that save_id and expected_version 2^63-1: PF003 (the save_id names another base version), not 22003');
SELECT throws_ok(format($$SELECT * FROM pgfence.document_save(%s, 9223372036854775807, '{"a": 3}', 'tap-fuzz')$$, (SELECT id FROM d)),
  'PF303', NULL, 'document_save without save_id and expected_version 2^63-1: PF303 (never issued)');
SELECT results_eq(format($$SELECT outcome, version, replayed FROM pgfence.document_save(%s, 1, '{"a": 2}', 'tap-fuzz', 'tap-fuzz-s1')$$, (SELECT id FROM d)),
  $$VALUES ('saved'::text, 2::bigint, true)$$, 'the genuine retry is still answered from the receipt');

-- 2. document_delete on a deleted document with that version: 22003 from the same arithmetic.
SELECT is((SELECT outcome FROM pgfence.document_delete((SELECT id FROM d), 2, 'tap-fuzz')), 'deleted', 'the document is deleted (tombstone version 3)');
SELECT throws_ok(format($$SELECT * FROM pgfence.document_delete(%s, 9223372036854775807, 'tap-fuzz')$$, (SELECT id FROM d)),
  'PF303', NULL, 'document_delete of a deleted document with expected_version 2^63-1: PF303, not 22003');
SELECT results_eq(format($$SELECT outcome, version, replayed FROM pgfence.document_delete(%s, 2, 'tap-fuzz')$$, (SELECT id FROM d)),
  $$VALUES ('deleted'::text, 3::bigint, true)$$, 'a repeated delete on version 2 is still a replay');
SELECT results_eq(format($$SELECT outcome, version FROM pgfence.document_delete(%s, 1, 'tap-fuzz')$$, (SELECT id FROM d)),
  $$VALUES ('conflict'::text, 3::bigint)$$, 'a delete on an older version is still a conflict');

-- 3. CALL audit_purge('outbox', '7000 years') -> 22008 timestamp out of range: an older_than
--    reaching before 4713 BC now purges nothing. (A peer: the procedure commits.)
SELECT tap_helpers.peer('p');
SELECT is((SELECT purged FROM dblink('p', $$CALL pgfence.audit_purge('outbox', interval '7000 years')$$) AS t(purged bigint)), 0::bigint,
  'audit_purge(outbox, 7000 years): purges nothing, no 22008');
SELECT is((SELECT purged FROM dblink('p', $$CALL pgfence.audit_purge('document', interval '100000000 years', 10)$$) AS t(purged bigint)), 0::bigint,
  'audit_purge(document, 100000000 years): purges nothing');
SELECT is((SELECT purged FROM dblink('p', $$CALL pgfence.audit_purge('plan', interval '71582788 mons -2147483640 days')$$) AS t(purged bigint)), 0::bigint,
  'audit_purge with an interval of 0 by comparison whose months alone reach before 4713 BC: no 22008');
SELECT tap_helpers.close_peers();

-- 4. backoff with a denormal jitter: 22003 underflow in (1 - jitter/2).
SELECT is(pgfence.backoff(1, '1 second', '1 hour', 5e-324), interval '1 second', 'backoff(1, 1 s, 1 h, 5e-324) = 1 second, no underflow');
SELECT is(pgfence.backoff(30, '1 second', '1 hour', 5e-324), interval '1 hour', 'backoff(30, ..., 5e-324) = the cap');

-- 5. document_register_kind with a 1001-2000 character description: 23514 from the table's CHECK.
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-fuzz-k1', 'attributes', p_description => repeat('x', 1001))$$,
  '22023', NULL, 'document_register_kind: a 1001-character description is 22023, not 23514');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-fuzz-k1', 'attributes', p_description => repeat('x', 2000))$$,
  '22023', NULL, 'document_register_kind: a 2000-character description is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('record', p_description => repeat('x', 1001))$$,
  '22023', NULL, 'document_register_kind: a built-in kind''s description over 1000 characters is 22023');
SELECT is((SELECT length(description) FROM pgfence.document_register_kind('tap-fuzz-k1', 'attributes', p_description => repeat('中', 1000))), 1000,
  'a description of 1000 characters (3000 bytes) is registered');

-- 6. operation_request with a 1024-character target of multi-byte characters: 54000 (index row
--    size exceeds the btree maximum); the limit was in characters, the index is in bytes.
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap-fuzz.k', repeat('中', 1024))$$,
  '22023', NULL, 'operation_request: a target of 1024 CJK characters (3072 bytes) is 22023, not 54000');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap-fuzz.k', repeat('中', 683))$$,
  '22023', NULL, 'a target of 683 CJK characters (2049 bytes) is 22023');
SELECT is((SELECT created FROM pgfence.operation_request('tap-fuzz.k', repeat('中', 682))), true,
  'a target of 682 CJK characters (2046 bytes) is requested');
SELECT is((SELECT created FROM pgfence.operation_request('tap-fuzz.k', repeat('é', 1024))), true,
  'a target of 1024 two-byte characters (2048 bytes) is requested');
SELECT is((SELECT created FROM pgfence.operation_request('tap-fuzz.k', repeat('x', 1024))), true,
  'a target of 1024 ASCII characters is requested');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap-fuzz.k', repeat('x', 1025))$$,
  '22023', NULL, 'a target of 1025 characters is 22023');

-- =============================================================================================
-- A success that broke the documented contract
-- =============================================================================================

-- 7. backoff "never exceeds the cap and never overflows".
SELECT is(pgfence.backoff(1, '300000 years', '300000 years', 0), interval '300000 years',
  'backoff(1, 300000 years, 300000 years, 0) is the cap, not a negative interval');
SELECT ok(pgfence.backoff(1, '300000 years', '300000 years', 0.5) BETWEEN interval '225000 years' AND interval '300000 years',
  'with jitter 0.5 it is 3/4 of the cap');
SELECT ok(pgfence.backoff(1, '1 year', '1 year', 0) <= interval '1 year', 'backoff(1, 1 year, 1 year, 0) does not exceed its cap (was 1.5% above)');
SELECT is(pgfence.backoff(1, '1 year', '1 year', 0), interval '1 year', '... and equals it, as PostgreSQL compares intervals');
SELECT ok((SELECT bool_and(b > interval '0' AND b <= interval '1 mon')
           FROM (SELECT pgfence.backoff(n, '1 day', '1 mon') AS b FROM generate_series(1, 40) n) s),
  'backoff with a cap of 1 month: every attempt within (0, cap]');
SELECT is(pgfence.backoff(2147483647, '1 microsecond', '178000000 years', 0), interval '178000000 years',
  'attempt 2^31-1 from 1 microsecond reaches a cap of 178 million years, no overflow');
SELECT is(pgfence.backoff(3, '1 mon -29 days', '1 year', 0), interval '4 days', 'a mixed-sign base (1 month - 29 days = 1 day) doubles as 1 day');
SELECT is(pgfence.backoff(3, '1 second', '1 hour', 0)::text, '00:00:04', 'a result that fits is a plain time interval (independent of the TimeZone)');

-- 8. outbox_claim / outbox_mark_sent_and_claim with a one-element channel array whose lower bound
--    is not 1, or a 1x1 two-dimensional one, claimed nothing although a message was due.
CREATE TEMP TABLE m AS SELECT pgfence.outbox_enqueue('tap-fuzz-ch', 'r', '{}') AS id;
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-fuzz-w', 1, '[0:0]={tap-fuzz-ch}'::text[])), 1,
  'outbox_claim with ''[0:0]={c}'' claims the due message of channel c');
SELECT pgfence.outbox_enqueue('tap-fuzz-ch', 'r', '{}');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-fuzz-w', 1, '{{tap-fuzz-ch}}'::text[])), 1,
  'outbox_claim with a 1x1 array ''{{c}}'' claims it too');
SELECT pgfence.outbox_enqueue('tap-fuzz-ch', 'r', '{}');
SELECT is((SELECT count(id)::int FROM pgfence.outbox_mark_sent_and_claim((SELECT id FROM m), 1, NULL, 'tap-fuzz-w', 1, '[5:5]={tap-fuzz-ch}'::text[])), 1,
  'outbox_mark_sent_and_claim with ''[5:5]={c}'' claims the next one');
SELECT pgfence.outbox_enqueue('tap-fuzz-ch2', 'r', '{}');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_claim('tap-fuzz-w', 5, '[2:3]={tap-fuzz-none,tap-fuzz-ch2}'::text[])), 1,
  'a two-element array with lower bound 2 claims from both channels');

-- =============================================================================================
-- The audit trail and the allow-lists
-- =============================================================================================

-- 9. With the event log on, a repeated idempotency key wrote an enqueue event for a message id
--    that never existed (the BEFORE INSERT trigger fired for the row ON CONFLICT then skipped).
SELECT pgfence.outbox_configure_channel('tap-fuzz-log', p_log_events => true);
SELECT pgfence.outbox_enqueue('tap-fuzz-log', 'r', '{}', 'tap-fuzz-key-1');
SELECT pgfence.outbox_enqueue('tap-fuzz-log', 'r', '{}', 'tap-fuzz-key-1');
SELECT pgfence.outbox_enqueue_many('tap-fuzz-log', ARRAY['r', 'r', 'q', 'r'], ARRAY['{}', '{}', '{}', '{}']::jsonb[],
                                   ARRAY['tap-fuzz-key-2', 'tap-fuzz-key-2', 'tap-fuzz-key-3', 'tap-fuzz-key-1']);
SELECT is((SELECT count(*)::int FROM pgfence.event e WHERE e.module = 'outbox' AND e.event = 'enqueue'
           AND NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = e.item_id)), 0,
  'no enqueue event names a message id that does not exist (a retry, a key repeated inside enqueue_many)');
SELECT is((SELECT count(*)::int FROM pgfence.event e JOIN pgfence.outbox o ON o.id = e.item_id
           WHERE e.module = 'outbox' AND e.event = 'enqueue' AND o.channel = 'tap-fuzz-log'), 3,
  'one enqueue event per message inserted: 3 keys, 3 messages, 3 events');
SELECT is((SELECT count(*)::int FROM pgfence.outbox WHERE channel = 'tap-fuzz-log'), 3, '3 messages exist');
SELECT is((SELECT count(*)::int FROM pgfence.outbox o WHERE o.channel = 'tap-fuzz-log'
           AND (SELECT count(*) FROM pgfence.audit_timeline('outbox', o.id) t WHERE t.event = 'enqueue') = 1), 3,
  'each one''s timeline starts with exactly one enqueue');

-- 10. plan_register_action('ghost', '999999'::regprocedure, ...) registered an action whose
--     function does not exist; plan_propose then failed with 42883.
SELECT throws_ok($$SELECT pgfence.plan_register_action('tap-fuzz.ghost', '999999'::regprocedure, 'a function that does not exist')$$,
  '42883', NULL, 'plan_register_action with an OID naming no function: 42883');
SELECT is((SELECT count(*)::int FROM pgfence.plan_actions WHERE name = 'tap-fuzz.ghost'), 0, 'nothing was registered');

-- 11. document_register_kind accepted a merge function OID naming nothing; document_merge then
--     raised 22004 "query string argument of EXECUTE is null".
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-fuzz-k2', 'function', '999999'::regprocedure)$$,
  '42883', NULL, 'document_register_kind with a merge function OID naming nothing: 42883');
CREATE FUNCTION public.tap_fuzz_merge(b jsonb, l jsonb, s jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE
  AS $$ SELECT jsonb_build_object('content', l, 'conflicts', '[]'::jsonb) $$;
SELECT pgfence.document_register_kind('tap-fuzz-k3', 'function', 'public.tap_fuzz_merge(jsonb,jsonb,jsonb)');
DROP FUNCTION public.tap_fuzz_merge(jsonb, jsonb, jsonb);
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('tap-fuzz-k3', '{}', '{}', '{}')$$,
  '42883', NULL, 'document_merge for a kind whose merge function was dropped: 42883, not 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-fuzz-k3', p_max_bytes => 100)$$,
  '42883', NULL, 'changing that kind without a new merge function: 42883');

-- =============================================================================================
-- Documentation
-- =============================================================================================
SELECT throws_ok($$SELECT pgfence.outbox_requeue(NULL)$$, '22004', NULL, 'outbox_requeue(NULL) is 22004');
SELECT matches(substring(obj_description('pgfence.outbox_requeue(bigint,integer)'::regprocedure, 'pg_proc') FROM 'Errors:.*'), '22004',
  '... and its COMMENT lists 22004');

-- The REPEATABLE READ rule (ERRORS.md): a lost row race raises 40001 there, returns in READ COMMITTED.
SELECT tap_helpers.peer('rr');
SELECT tap_helpers.peer('rc');
SELECT tap_helpers.peer('other');
CREATE TEMP TABLE race AS SELECT * FROM dblink('other', $$SELECT pgfence.outbox_enqueue('tap-fuzz-rr', 'r', '{}')$$) AS t(id bigint);
SELECT dblink_exec('rr', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT dblink_exec('rc', 'BEGIN ISOLATION LEVEL READ COMMITTED');
SELECT * FROM dblink('rr', 'SELECT 1') AS t(x int);   -- the snapshot: the message is pending
SELECT is((SELECT count(*)::int FROM dblink('other', $$SELECT id FROM pgfence.outbox_claim('tap-fuzz-other', 1, ARRAY['tap-fuzz-rr'])$$) AS t(id bigint)), 1,
  'another session claims the message (committed)');
SELECT throws_ok($$SELECT * FROM dblink('rr', 'SELECT id FROM pgfence.outbox_claim(''tap-fuzz-rr'', 1, ARRAY[''tap-fuzz-rr''])') AS t(id bigint)$$,
  '40001', NULL, 'REPEATABLE READ: a transition that lost the row race raises 40001 (could not serialize)');
SELECT is((SELECT count(*)::int FROM dblink('rc', $$SELECT id FROM pgfence.outbox_claim('tap-fuzz-rc', 1, ARRAY['tap-fuzz-rr'])$$) AS t(id bigint)), 0,
  'READ COMMITTED: the same lost race claims nothing, no error');
SELECT dblink_exec('rc', 'ROLLBACK');
SELECT dblink_exec('other', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox WHERE channel = 'tap-fuzz-rr'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
