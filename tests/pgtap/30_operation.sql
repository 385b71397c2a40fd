-- pgTAP: Module 3 — operation. Every contract cell of docs/design.md for long external operations:
-- the status machine and its guard, the one-in-flight index, the issue protocol (intent,
-- reference, re-issue rule), the fence on every owner write, the lease check on poll, cancel
-- paths, the reaper, the event log, and each documented SQLSTATE. Two-session cells are in
-- 31_operation_concurrency.sql.
BEGIN;
\ir helpers/setup.sql
SELECT plan(302);

-- SQLSTATE and DETAIL of a statement's error (throws_ok checks the code, this the DETAIL).
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

CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
CREATE FUNCTION pg_temp.op(p_name text) RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM ids WHERE name = p_name $$;
-- Make a lease lapse: back-date the row (the database clock itself is never faked).
CREATE FUNCTION pg_temp.lapse(p_id bigint) RETURNS void LANGUAGE sql AS $$
  UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = p_id $$;

-- =============================================================================================
-- Catalog: signatures, definer, volatility, privileges per role
-- =============================================================================================
CREATE TEMP TABLE fns (fn text, args text[], vol text, roles text[]);
INSERT INTO fns VALUES
  ('operation_request',         ARRAY['text','text','jsonb','text','text'],          'volatile', ARRAY['pgfence_client','pgfence_admin']),
  ('operation_claim',           ARRAY['text','text[]','interval','integer'],         'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_begin_issue',     ARRAY['bigint','integer','boolean','interval'],      'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_record_external', ARRAY['bigint','integer','text','jsonb'],            'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_poll',            ARRAY['bigint','integer','jsonb','interval'],        'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_finish',          ARRAY['bigint','integer','boolean','jsonb','text'],  'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_release',         ARRAY['bigint','integer'],                           'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_cancel',          ARRAY['bigint','text'],                              'volatile', ARRAY['pgfence_client','pgfence_admin']),
  ('operation_reap',            ARRAY['integer'],                                    'volatile', ARRAY['pgfence_executor','pgfence_admin']),
  ('operation_get',             ARRAY['bigint'],                                     'stable',   ARRAY['pgfence_client','pgfence_executor','pgfence_admin']),
  ('operation_list',            ARRAY['text','text','text','integer'],               'stable',   ARRAY['pgfence_client','pgfence_admin']);

SELECT has_function('pgfence', fn, args, fn || ' signature') FROM fns ORDER BY fn;                    -- 11
SELECT is_definer('pgfence', fn, args, fn || ' is SECURITY DEFINER') FROM fns ORDER BY fn;           -- 11
SELECT volatility_is('pgfence', fn, args, vol, fn || ' is ' || vol) FROM fns ORDER BY fn;            -- 11
SELECT function_privs_are('pgfence', fn, args, r.role,
         CASE WHEN r.role = ANY (roles) THEN ARRAY['EXECUTE'] ELSE ARRAY[]::text[] END,
         format('%s: %s %s', fn, r.role, CASE WHEN r.role = ANY (roles) THEN 'may execute' ELSE 'may not execute' END))
FROM fns CROSS JOIN unnest(ARRAY['pgfence_client','pgfence_executor','pgfence_admin']) AS r(role)
ORDER BY fn, r.role;                                                                                  -- 33
SELECT ok(bool_and(p.proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp']), 'every operation function pins search_path')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE '%operation%';
SELECT ok(NOT bool_or(p.prosecdef), 'private helpers and triggers are not SECURITY DEFINER')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND (p.proname LIKE '\_operation%' OR p.proname LIKE 'tg\_operation%');
SELECT has_view('pgfence', 'operation_in_flight', 'operation_in_flight view');
SELECT table_privs_are('pgfence', 'operation_in_flight', 'pgfence_admin', ARRAY['SELECT'], 'admin reads operation_in_flight');
SELECT table_privs_are('pgfence', 'operation', 'pgfence_client', ARRAY[]::text[], 'client has no privilege on the operation table');
SELECT has_index('pgfence', 'operation', 'operation_one_in_flight', ARRAY['kind', 'target'], 'the one-in-flight index exists on (kind, target)');

-- Role behaviour, not only catalog flags.
SET LOCAL ROLE pgfence_client;
SELECT lives_ok($$SELECT * FROM pgfence.operation_request('tap.role', 'x', '{}', 'tap-role-key')$$, 'as pgfence_client: request works (SECURITY DEFINER)');
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('w')$$, '42501', NULL, 'as pgfence_client: claim is refused (42501)');
SELECT throws_ok($$SELECT count(*) FROM pgfence.operation$$, '42501', NULL, 'as pgfence_client: the table is not readable');
RESET ROLE;
SET LOCAL ROLE pgfence_executor;
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('w', ARRAY['tap.none'])$$, 'as pgfence_executor: claim works');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.role', 'y')$$, '42501', NULL, 'as pgfence_executor: request is refused');
SELECT throws_ok($$UPDATE pgfence.operation SET status = 'succeeded'$$, '42501', NULL, 'as pgfence_executor: no direct UPDATE');
RESET ROLE;

-- =============================================================================================
-- Request: idempotency key, one in flight per (kind, target)
-- =============================================================================================
INSERT INTO ids SELECT 'a', id FROM pgfence.operation_request('tap.reset', 'branch-a', '{"to": "main"}', 'tap-key-a', 'alice');
SELECT results_eq(
  $$SELECT status, fence, requested_by, locked_by IS NULL, issue_count, poll_history FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('queued'::text, 0, 'alice'::text, true, 0, '[]'::jsonb)$$,
  'request: queued, fence 0, no owner, nothing issued');
SELECT results_eq($$SELECT id, status, created FROM pgfence.operation_request('tap.reset', 'branch-a', '{"to": "main"}', 'tap-key-a', 'bob')$$,
  $$SELECT pg_temp.op('a'), 'queued'::text, false$$, 'a repeated key returns the same operation with created = false');
SELECT is((SELECT count(*)::int FROM pgfence.operation WHERE target = 'branch-a'), 1, '... and inserts nothing');
SELECT is((SELECT requested_by FROM pgfence.operation WHERE id = pg_temp.op('a')), 'alice', '... the first requester stays on the row');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 'branch-a', '{"to": "other"}', 'tap-key-a')$$, 'PF003', NULL, 'same key, different params: PF003');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 'branch-b', '{"to": "main"}', 'tap-key-a')$$, 'PF003', NULL, 'same key, different target: PF003');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 'branch-a', '{"to": "main"}', 'tap-key-a2')$$, 'PF201', NULL, 'different key, busy target: PF201');
SELECT is(pg_temp.err($$SELECT * FROM pgfence.operation_request('tap.reset', 'branch-a', '{}', 'tap-key-a3')$$),
  format('PF201: Operation %s is queued for tap.reset branch-a (idempotency key tap-key-a, requested by alice at %s).',
         pg_temp.op('a'), (SELECT pgfence._ts(created_at) FROM pgfence.operation WHERE id = pg_temp.op('a'))),
  'the PF201 DETAIL names the operation in flight');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 'branch-a')$$, 'PF201', NULL, 'a request without a key for a busy target: PF201');
SELECT lives_ok($$INSERT INTO ids SELECT 'a-other-kind', id FROM pgfence.operation_request('tap.snapshot', 'branch-a')$$, 'another kind on the same target is a different (kind, target)');
SELECT is((SELECT requested_by FROM pgfence.operation WHERE id = pg_temp.op('a-other-kind')), session_user::text COLLATE "default", 'requested_by defaults to session_user');
SELECT throws_ok($$INSERT INTO pgfence.operation (kind, target, params, requested_by) VALUES ('tap.reset', 'branch-a', '{}', 'hand')$$, '23505', NULL,
  'the partial unique index refuses a second in-flight row even from a hand-written INSERT');

-- invalid input: documented SQLSTATEs
SELECT throws_ok($$SELECT * FROM pgfence.operation_request(NULL, 't')$$, '22004', NULL, 'NULL kind: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', NULL)$$, '22004', NULL, 'NULL target: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 't', NULL)$$, '22004', NULL, 'NULL params: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('Bad Kind', 't')$$, '22023', NULL, 'bad kind: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', '')$$, '22023', NULL, 'empty target: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 't', '[1]')$$, '22023', NULL, 'params not an object: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 't', '{}', '')$$, '22023', NULL, 'empty idempotency key: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.reset', 't', '{}', NULL, repeat('x', 201))$$, '22023', NULL, 'requested_by over 200 chars: 22023');

-- =============================================================================================
-- Claim
-- =============================================================================================
INSERT INTO ids SELECT 'b', id FROM pgfence.operation_request('tap.reset', 'branch-b', '{}', 'tap-key-b');
CREATE TEMP TABLE c1 AS SELECT * FROM pgfence.operation_claim('tap-w1', ARRAY['tap.reset'], '1 minute', 1);
SELECT results_eq($$SELECT id, fence, issue_started, issue_count, external_ref, taken_over_from, lease, idempotency_key FROM c1$$,
  $$SELECT pg_temp.op('a'), 1, false, 0, NULL::text, NULL::text, interval '1 minute', 'tap-key-a'::text$$,
  'claim takes the oldest queued operation: fence 1, nothing issued, the lease asked for');
SELECT results_eq($$SELECT status, locked_by, lease_expires_at = now() + interval '1 minute', started_at = now() FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('running'::text, 'tap-w1'::text, true, true)$$, 'the claimed operation is running, owned, with a lease from now() (database clock)');
SELECT is((SELECT count(*)::int FROM pgfence.operation_claim('tap-w1', ARRAY['tap.nothing'])), 0, 'claim of a kind with no work returns no row');
SELECT results_eq($$SELECT id, idempotency_key, lease FROM pgfence.operation_claim('tap-w2', ARRAY['tap.snapshot'], NULL, 5)$$,
  $$SELECT pg_temp.op('a-other-kind'), 'pgfence-operation-' || pg_temp.op('a-other-kind'), interval '2 minutes'$$,
  'kinds filter; lease NULL = 2 minutes; no request key -> pgfence-operation-<id> is the key to pass on');
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('')$$, '22023', NULL, 'claim: empty worker is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('w', NULL, '0 seconds')$$, '22023', NULL, 'claim: lease 0 is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('w', NULL, '2 days')$$, '22023', NULL, 'claim: lease over 1 day is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('w', NULL, NULL, 0)$$, '22023', NULL, 'claim: batch 0 is 22023');

-- The claim's parameter order (issue 13): operation_claim(p_worker, p_kinds, p_lease, p_batch)
-- stays, unlike (worker, batch, filter, lease) of outbox_claim and plan_claim. Every call shape
-- clients use resolves to it; an overload in the other order would make some of them ambiguous.
SAVEPOINT claim_shapes;
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape')$$, 'claim shape: worker only (every default)');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', NULL)$$, 'claim shape: worker, kinds NULL');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', ARRAY['tap.none'], '1 minute')$$, 'claim shape: worker, kinds, lease');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', NULL, '1 hour', 1)$$, 'claim shape: all four positional, untyped literals');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', '{tap.none}', '1 hour', 2)$$, 'claim shape: an untyped array literal');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape'::text, NULL::text[], NULL::interval, 3::int)$$, 'claim shape: the glue''s, every argument cast');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim(p_worker => 'tap-shape', p_batch => 2)$$, 'claim shape: named worker and batch');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', p_kinds => ARRAY['tap.none'], p_batch => 3)$$, 'claim shape: positional worker, named kinds and batch');
SELECT lives_ok($$SELECT * FROM pgfence.operation_claim(p_batch => 1, p_lease => '1 minute', p_kinds => ARRAY['tap.none'], p_worker => 'tap-shape')$$,
  'claim shape: all four named, in any order');
CREATE FUNCTION pgfence.operation_claim(p_worker text, p_batch integer, p_kinds text[] DEFAULT NULL, p_lease interval DEFAULT '2 minutes')
RETURNS SETOF bigint LANGUAGE sql AS $$ SELECT NULL::bigint WHERE false $$;
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', p_batch => 1)$$, '42725', NULL,
  'beside an overload in the (worker, batch, kinds, lease) order, a named call is ambiguous (42725): the order stays');
SELECT throws_ok($$SELECT * FROM pgfence.operation_claim('tap-shape', NULL)$$, '42725', NULL,
  '... and so is (worker, NULL)');
ROLLBACK TO SAVEPOINT claim_shapes;

-- Each kind's queue is walked on its own (operation_kind_queued_idx, migration 0009): a backlog
-- of a kind nobody claims, ahead in id order, changes nothing; several kinds are claimed oldest
-- first across them.
SELECT is((SELECT count(*)::int FROM generate_series(1, 3000) g, pgfence.operation_request('tap.kq-b', 'b-' || g)), 3000,
  '3000 queued operations of a kind nobody claims (tap.kq-b)');
INSERT INTO ids SELECT 'kq-a1', id FROM pgfence.operation_request('tap.kq-a', 'a1');
INSERT INTO ids SELECT 'kq-c1', id FROM pgfence.operation_request('tap.kq-c', 'c1');
INSERT INTO ids SELECT 'kq-a2', id FROM pgfence.operation_request('tap.kq-a', 'a2');
INSERT INTO ids SELECT 'kq-c2', id FROM pgfence.operation_request('tap.kq-c', 'shared');
INSERT INTO ids SELECT 'kq-a3', id FROM pgfence.operation_request('tap.kq-a', 'shared');  -- same target, other kind
INSERT INTO ids SELECT 'kq-a4', id FROM pgfence.operation_request('tap.kq-a', 'a4');
SELECT results_eq($$SELECT id, fence, taken_over_from FROM pgfence.operation_claim('tap-kq1', ARRAY['tap.kq-a'], NULL, 1)$$,
  $$SELECT pg_temp.op('kq-a1'), 1, NULL::text$$, 'one kind: its oldest queued operation, past 3000 of another kind ahead of it');
SELECT results_eq($$SELECT id FROM pgfence.operation_claim('tap-kq1', ARRAY['tap.kq-c', 'tap.kq-a', 'tap.kq-c'], NULL, 3)$$,
  $$VALUES (pg_temp.op('kq-c1')), (pg_temp.op('kq-a2')), (pg_temp.op('kq-c2'))$$,
  'several kinds (one named twice): the oldest of all of them, in request order, each once, up to the batch');
SELECT results_eq($$SELECT id FROM pgfence.operation_claim('tap-kq2', ARRAY['tap.kq-a', 'tap.kq-c'], NULL, 5)$$,
  $$VALUES (pg_temp.op('kq-a3')), (pg_temp.op('kq-a4'))$$,
  'what is running is not claimed again; the same target under another kind is its own operation');
SELECT throws_ok($$SELECT * FROM pgfence.operation_request('tap.kq-a', 'a1')$$, 'PF201', NULL,
  'a second request for a running (kind, target) is refused: a claim never hands out two for one target');
SELECT pg_temp.lapse(pg_temp.op('kq-a2'));
INSERT INTO ids SELECT 'kq-a5', id FROM pgfence.operation_request('tap.kq-a', 'a5');
SELECT results_eq($$SELECT id, fence, taken_over_from FROM pgfence.operation_claim('tap-kq3', ARRAY['tap.kq-c', 'tap.kq-a'], NULL, 2)$$,
  $$VALUES (pg_temp.op('kq-a2'), 2, 'tap-kq1'::text), (pg_temp.op('kq-a5'), 1, NULL)$$,
  'a lapsed lease of the kinds first (a takeover, fence 2), then their queue');
SELECT results_eq($$SELECT event, actor FROM pgfence.event WHERE module = 'operation' AND item_id IN (SELECT id FROM ids WHERE name LIKE 'kq-%') AND event IN ('claim', 'takeover') ORDER BY id$$,
  $$VALUES ('claim'::text, 'tap-kq1'::text), ('claim', 'tap-kq1'), ('claim', 'tap-kq1'), ('claim', 'tap-kq1'),
           ('claim', 'tap-kq2'), ('claim', 'tap-kq2'), ('takeover', 'tap-kq3'), ('claim', 'tap-kq3')$$,
  'each claim and takeover is logged once, by its claimer');
SELECT is((SELECT count(*)::int FROM pgfence.operation WHERE kind = 'tap.kq-b' AND status = 'queued' AND fence = 0), 3000,
  'the other kind''s backlog is untouched');
SAVEPOINT all_kinds;
CREATE TEMP TABLE kq_oldest AS SELECT min(id) AS id FROM pgfence.operation WHERE status = 'queued';
SELECT results_eq($$SELECT id FROM pgfence.operation_claim('tap-kq4', NULL, NULL, 1)$$, $$SELECT id FROM kq_oldest$$,
  'all kinds (NULL): the oldest queued operation of any kind');
ROLLBACK TO SAVEPOINT all_kinds;

-- =============================================================================================
-- Issue protocol: intent, reference, poll, finish (operation a, owner tap-w1, fence 1)
-- =============================================================================================
SELECT throws_ok(format('SELECT pgfence.operation_record_external(%s, 1, %L)', pg_temp.op('a'), 'ext-a'), 'PF202', NULL, 'record_external before an intent: PF202');
SELECT throws_ok(format('SELECT pgfence.operation_poll(%s, 1, %L)', pg_temp.op('a'), '{"s":"x"}'), 'PF202', NULL, 'poll before a reference: PF202');
SELECT throws_ok(format('SELECT pgfence.operation_finish(%s, 1, true)', pg_temp.op('a')), 'PF202', NULL, 'finish(succeeded) before a reference: PF202');
SELECT throws_ok(format('SELECT pgfence.operation_begin_issue(%s, 1, NULL)', pg_temp.op('a')), '22004', NULL, 'begin_issue: idempotent NULL is 22004');
SELECT throws_ok(format('SELECT pgfence.operation_begin_issue(%s, NULL, true)', pg_temp.op('a')), '22004', NULL, 'begin_issue: fence NULL is 22004');
SELECT throws_ok('SELECT pgfence.operation_begin_issue(-1, 1, true)', 'P0002', NULL, 'begin_issue: unknown id is P0002');
SELECT throws_ok(format('SELECT pgfence.operation_begin_issue(%s, 1, true, %L)', pg_temp.op('a'), '-1 second'), '22023', NULL, 'begin_issue: negative lease is 22023');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('a'), 2, false), NULL, 'begin_issue with a wrong fence: NULL (do not call out)');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('a'), 1, false, '90 seconds'), 'issue', 'begin_issue: ''issue'' (first call)');
SELECT results_eq($$SELECT issue_started_at = now(), issued_by, issue_count, issue_idempotent, lease_expires_at = now() + interval '90 seconds' FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES (true, 'tap-w1'::text, 1, false, true)$$, 'the intent is recorded (who, when, whether the key is passed) and the lease extended');
SELECT is(pgfence.operation_record_external(pg_temp.op('a'), 2, 'ext-a'), false, 'record_external with a wrong fence: false');
SELECT is(pgfence.operation_record_external(pg_temp.op('a'), 1, 'ext-a', '{"accepted": true}'), true, 'record_external: true');
SELECT results_eq($$SELECT external_ref, external_detail, external_recorded_at = now() FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('ext-a'::text, '{"accepted": true}'::jsonb, true)$$, 'the reference and the API''s answer are on the row');
SELECT is(pgfence.operation_record_external(pg_temp.op('a'), 1, 'ext-a'), true, 'recording the same reference again is harmless');
SELECT throws_ok(format('SELECT pgfence.operation_record_external(%s, 1, %L)', pg_temp.op('a'), 'ext-other'), 'PF002', NULL, 'a different reference: PF002');
SELECT throws_ok(format('SELECT pgfence.operation_record_external(%s, 1, NULL)', pg_temp.op('a')), '22004', NULL, 'record_external: NULL ref is 22004');
SELECT throws_ok(format('SELECT pgfence.operation_record_external(%s, 1, %L)', pg_temp.op('a'), ''), '22023', NULL, 'record_external: empty ref is 22023');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('a'), 1, false), 'poll', 'begin_issue once a reference exists: ''poll'' (never call again)');

-- poll
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 1, '{"status": "queued"}', '45 seconds'), 'continue', 'poll: ''continue''');
SELECT results_eq($$SELECT external_state, poll_count, polled_at = now(), lease_expires_at = now() + interval '45 seconds', lease FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('{"status": "queued"}'::jsonb, 1, true, true, interval '45 seconds')$$, 'poll stores the state and extends the lease by p_lease');
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 1, '{"status": "queued"}'), 'continue', 'poll the same state again');
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 1, '{"status": "running"}'), 'continue', 'poll a new state');
SELECT results_eq($$SELECT e->'state', (e->>'polls')::int, e->>'fence' FROM pgfence.operation, jsonb_array_elements(poll_history) WITH ORDINALITY AS h(e, i) WHERE id = pg_temp.op('a') ORDER BY i$$,
  $$VALUES ('{"status": "queued"}'::jsonb, 2, '1'::text), ('{"status": "running"}'::jsonb, 1, '1')$$,
  'history: one entry per distinct consecutive state, with its poll count');
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 1, NULL), 'continue', 'poll with a NULL state is a heartbeat');
SELECT results_eq($$SELECT external_state, poll_count, jsonb_array_length(poll_history) FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('{"status": "running"}'::jsonb, 3, 2)$$, '... it keeps the last state and the history');
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 2, '{"status": "done"}'), NULL, 'poll with a wrong fence: NULL');
SELECT throws_ok(format('SELECT pgfence.operation_poll(%s, 1, %L)', pg_temp.op('a'), jsonb_build_object('blob', repeat('x', 70000))), '22023', NULL, 'poll: state over 64 kB is 22023');
SELECT throws_ok(format('SELECT pgfence.operation_poll(%s, 1, NULL, %L)', pg_temp.op('a'), '0 seconds'), '22023', NULL, 'poll: lease 0 is 22023');
SELECT throws_ok('SELECT pgfence.operation_poll(-1, 1, NULL)', 'P0002', NULL, 'poll: unknown id is P0002');
SELECT throws_ok(format('SELECT pgfence.operation_poll(%s, NULL, NULL)', pg_temp.op('a')), '22004', NULL, 'poll: NULL fence is 22004');

-- lease check on poll: a lapsed lease is refused and nothing is stored
SELECT pg_temp.lapse(pg_temp.op('a'));
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 1, '{"status": "late"}'), NULL, 'poll after the lease lapsed: NULL, even with the right fence');
SELECT results_eq($$SELECT external_state, poll_count, lease_expires_at < now() FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('{"status": "running"}'::jsonb, 3, true)$$, '... nothing stored, the lease not extended');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('a'), 1, true), NULL, 'begin_issue after the lease lapsed: NULL (do not call out)');
UPDATE pgfence.operation SET lease_expires_at = now() + interval '1 minute' WHERE id = pg_temp.op('a');

-- history is bounded
SELECT is((SELECT count(*)::int FROM generate_series(1, 60) g WHERE pgfence.operation_poll(pg_temp.op('a'), 1, jsonb_build_object('status', 'running', 'progress', g)) = 'continue'),
  60, '60 polls with distinct states');
SELECT results_eq($$SELECT jsonb_array_length(poll_history), poll_history->0->'state'->>'progress', poll_history->-1->'state'->>'progress', poll_count FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES (50, '11'::text, '60'::text, 63)$$, 'the history keeps the last 50 states; poll_count counts all');

-- finish
SELECT is(pgfence.operation_finish(pg_temp.op('a'), 2, true), NULL, 'finish with a wrong fence: NULL');
SELECT throws_ok(format('SELECT pgfence.operation_finish(%s, 1, NULL)', pg_temp.op('a')), '22004', NULL, 'finish: succeeded NULL is 22004');
SELECT is(pgfence.operation_finish(pg_temp.op('a'), 1, true, '{"branch": "reset"}'), 'succeeded', 'finish: succeeded');
SELECT results_eq($$SELECT status, result, error, finished_at = now(), lease_expires_at, locked_by FROM pgfence.operation WHERE id = pg_temp.op('a')$$,
  $$VALUES ('succeeded'::text, '{"branch": "reset"}'::jsonb, NULL::text, true, NULL::timestamptz, 'tap-w1'::text)$$,
  'succeeded: result stored, lease gone, last owner kept');
SELECT is(pgfence.operation_finish(pg_temp.op('a'), 1, false), NULL, 'a second finish: NULL (already finished)');
SELECT is(pgfence.operation_poll(pg_temp.op('a'), 1, '{}'), NULL, 'poll after finish: NULL');
SELECT results_eq($$SELECT id, status, created, result FROM pgfence.operation_request('tap.reset', 'branch-a', '{"to": "main"}', 'tap-key-a')$$,
  $$SELECT pg_temp.op('a'), 'succeeded'::text, false, '{"branch": "reset"}'::jsonb$$,
  'a repeat of a finished request answers from its row and starts nothing');
SELECT is((SELECT count(*)::int FROM pgfence.operation_claim('tap-w9', ARRAY['tap.reset'], NULL, 10) WHERE id = pg_temp.op('a')), 0, '... and it is not claimable again');
INSERT INTO ids SELECT 'a2', id FROM pgfence.operation_request('tap.reset', 'branch-a', '{"to": "main"}', 'tap-key-a-second');
SELECT isnt(pg_temp.op('a2'), pg_temp.op('a'), 'once the first finished, a new request for the target is accepted');

-- failed and canceled endings
INSERT INTO ids SELECT 'f', id FROM pgfence.operation_request('tap.fail', 'f1');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-w1', ARRAY['tap.fail'])), 1, 'claim f');
SELECT is(pgfence.operation_finish(pg_temp.op('f'), 1, false, NULL, 'params rejected by the API'), 'failed', 'finish(false) before any call: failed');
SELECT results_eq($$SELECT status, error FROM pgfence.operation WHERE id = pg_temp.op('f')$$, $$VALUES ('failed'::text, 'params rejected by the API'::text)$$, 'the error is stored');

-- =============================================================================================
-- Takeover after a lapsed lease: the fence on every owner write
-- =============================================================================================
INSERT INTO ids SELECT 't', id FROM pgfence.operation_request('tap.take', 't1', '{}', 'tap-key-t');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-old', ARRAY['tap.take'])), 1, 'old owner claims (fence 1)');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('t'), 1, false), 'issue', 'old owner records intent');
SELECT is(pgfence.operation_record_external(pg_temp.op('t'), 1, 'ext-t'), true, 'old owner records the reference');
SELECT is((SELECT count(*)::int FROM pgfence.operation_claim('tap-new', ARRAY['tap.take'])), 0, 'a live lease is not taken over');
SELECT pg_temp.lapse(pg_temp.op('t'));
CREATE TEMP TABLE t2 AS SELECT * FROM pgfence.operation_claim('tap-new', ARRAY['tap.take']);
SELECT results_eq($$SELECT id, fence, issue_started, issue_count, external_ref, taken_over_from FROM t2$$,
  $$SELECT pg_temp.op('t'), 2, true, 1, 'ext-t'::text, 'tap-old'::text$$,
  'takeover: fence 2, the new owner learns the call was made and its reference, and who it replaced');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('t'), 1, true), NULL, 'old owner: begin_issue is fenced out');
SELECT is(pgfence.operation_record_external(pg_temp.op('t'), 1, 'ext-t'), false, 'old owner: record_external is fenced out');
SELECT is(pgfence.operation_poll(pg_temp.op('t'), 1, '{"status": "stale"}'), NULL, 'old owner: poll is fenced out');
SELECT is(pgfence.operation_finish(pg_temp.op('t'), 1, true), NULL, 'old owner: finish is fenced out');
SELECT is(pgfence.operation_release(pg_temp.op('t'), 1), false, 'old owner: release is fenced out');
SELECT results_eq($$SELECT status, fence, locked_by, poll_count FROM pgfence.operation WHERE id = pg_temp.op('t')$$,
  $$VALUES ('running'::text, 2, 'tap-new'::text, 0)$$, '... none of them changed the row');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('t'), 2, false), 'poll', 'new owner: begin_issue says poll, it never calls again');
SELECT is(pgfence.operation_poll(pg_temp.op('t'), 2, '{"status": "running"}'), 'continue', 'new owner polls');
SELECT is((SELECT issue_count FROM pgfence.operation WHERE id = pg_temp.op('t')), 1, 'the external call was issued once');

-- a lapsed lease that nobody took over: reference and outcome are still accepted (they happened)
INSERT INTO ids SELECT 'late', id FROM pgfence.operation_request('tap.late', 'l1');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-slow', ARRAY['tap.late'])), 1, 'claim late');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('late'), 1, false), 'issue', 'intent for late');
SELECT pg_temp.lapse(pg_temp.op('late'));
SELECT is(pgfence.operation_record_external(pg_temp.op('late'), 1, 'ext-late'), true, 'record_external after the lease lapsed but before a takeover: accepted');
SELECT is(pgfence.operation_finish(pg_temp.op('late'), 1, true), 'succeeded', 'finish after the lease lapsed but before a takeover: accepted');

-- =============================================================================================
-- The re-issue rule: an intent without a reference
-- =============================================================================================
-- (1) both calls pass the key: re-issue
INSERT INTO ids SELECT 'ri', id FROM pgfence.operation_request('tap.ri', 'r1', '{}', 'tap-key-ri');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-old', ARRAY['tap.ri'])), 1, 'claim ri');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri'), 1, true), 'issue', 'intent with a key-passing transport');
SELECT pg_temp.lapse(pg_temp.op('ri'));
SELECT results_eq($$SELECT fence, issue_started, external_ref FROM pgfence.operation_claim('tap-new', ARRAY['tap.ri'])$$,
  $$VALUES (2, true, NULL::text)$$, 'the new owner learns: issued, no reference');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri'), 2, true), 'reissue', 'both pass the idempotency key: ''reissue''');
SELECT results_eq($$SELECT status, issue_count, issued_by, last_issue_at = now() FROM pgfence.operation WHERE id = pg_temp.op('ri')$$,
  $$VALUES ('running'::text, 2, 'tap-old'::text, true)$$, 'issue_count 2; the first issuer is kept');
-- the cap on re-issues
SELECT is((SELECT count(*)::int FROM generate_series(3, 10) g WHERE pgfence.operation_begin_issue(pg_temp.op('ri'), 2, true) = 'reissue'), 8, 're-issues up to 10 issues in all');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri'), 2, true), 'failed', 'the 11th: failed (outcome unknown)');
SELECT results_eq($$SELECT status, result->>'reason', (result->>'issues')::int, error LIKE 'outcome unknown: %issued 10 times%' FROM pgfence.operation WHERE id = pg_temp.op('ri')$$,
  $$VALUES ('failed'::text, 'outcome_unknown'::text, 10, true)$$, '... with reason outcome_unknown and a clear message');

-- (2) the first call passed the key, the new owner's transport does not: fail
INSERT INTO ids SELECT 'ri2', id FROM pgfence.operation_request('tap.ri2', 'r2');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-old', ARRAY['tap.ri2'])), 1, 'claim ri2');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri2'), 1, true), 'issue', 'intent (key passed)');
SELECT pg_temp.lapse(pg_temp.op('ri2'));
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-new', ARRAY['tap.ri2'])), 2, 'takeover');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri2'), 2, false), 'failed', 'new owner cannot pass the key: ''failed''');
SELECT ok((SELECT error LIKE 'outcome unknown: tap-old started the external tap.ri2 call for r2 at %this owner''s transport does not pass the idempotency key%Check r2 in the external system by hand.' FROM pgfence.operation WHERE id = pg_temp.op('ri2')),
  'the message says who started what, when, why a repeat is unsafe, and what to check');

-- (3) the first call did not pass the key: fail, whatever the new owner can do
INSERT INTO ids SELECT 'ri3', id FROM pgfence.operation_request('tap.ri3', 'r3');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-old', ARRAY['tap.ri3'])), 1, 'claim ri3');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri3'), 1, false), 'issue', 'intent (key not passed)');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ri3'), 1, true), 'failed', 'an earlier call without the key, no reference: ''failed'' even for a key-passing retry');
SELECT is((SELECT status FROM pgfence.operation WHERE id = pg_temp.op('ri3')), 'failed', 'ri3 failed');

-- =============================================================================================
-- Cancel
-- =============================================================================================
INSERT INTO ids SELECT 'cq', id FROM pgfence.operation_request('tap.cancel', 'c-queued');
SELECT is(pgfence.operation_cancel(pg_temp.op('cq'), 'carol'), 'canceled', 'cancel a queued operation: canceled at once');
SELECT results_eq($$SELECT status, cancel_requested_by, finished_at IS NOT NULL, error FROM pgfence.operation WHERE id = pg_temp.op('cq')$$,
  $$VALUES ('canceled'::text, 'carol'::text, true, 'canceled by carol before the external call was issued'::text)$$, 'queued -> canceled, by whom');
SELECT is(pgfence.operation_cancel(pg_temp.op('cq')), NULL, 'cancel of a finished operation: NULL, nothing changes');

INSERT INTO ids SELECT 'cr', id FROM pgfence.operation_request('tap.cancel', 'c-running-not-issued');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-w1', ARRAY['tap.cancel'])), 1, 'claim cr');
SELECT is(pgfence.operation_cancel(pg_temp.op('cr'), 'carol'), 'canceled', 'cancel a running operation before its call: canceled at once');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cr'), 1, true), NULL, '... its owner''s begin_issue then says NULL: it never calls out');

INSERT INTO ids SELECT 'ci', id FROM pgfence.operation_request('tap.cancel', 'c-issued');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-w1', ARRAY['tap.cancel'])), 1, 'claim ci');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('ci'), 1, true), 'issue', 'ci issued');
SELECT is(pgfence.operation_record_external(pg_temp.op('ci'), 1, 'ext-ci'), true, 'ci reference');
SELECT is(pgfence.operation_cancel(pg_temp.op('ci'), 'carol'), 'cancel_requested', 'cancel a running, issued operation: cancel requested');
SELECT is((SELECT status FROM pgfence.operation WHERE id = pg_temp.op('ci')), 'running', '... it keeps running until its owner acts');
SELECT is(pgfence.operation_cancel(pg_temp.op('ci'), 'dave'), 'cancel_requested', 'a second cancel request is harmless');
SELECT is((SELECT cancel_requested_by FROM pgfence.operation WHERE id = pg_temp.op('ci')), 'carol', '... the first request is kept');
SELECT is(pgfence.operation_poll(pg_temp.op('ci'), 1, '{"status": "running"}'), 'cancel', 'the owner''s next poll reports the cancel request');
SELECT is(pgfence.operation_poll(pg_temp.op('ci'), 1, '{"status": "canceled"}'), 'cancel', '... on every poll until it finishes');
SELECT is(pgfence.operation_finish(pg_temp.op('ci'), 1, false, '{"external": "canceled"}'), 'canceled', 'finish(false) after a cancel request: canceled');
SELECT is((SELECT error FROM pgfence.operation WHERE id = pg_temp.op('ci')), 'canceled at the request of carol', 'the error says who asked');

INSERT INTO ids SELECT 'cs', id FROM pgfence.operation_request('tap.cancel', 'c-too-late');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-w1', ARRAY['tap.cancel'])), 1, 'claim cs');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cs'), 1, true), 'issue', 'cs issued');
SELECT is(pgfence.operation_record_external(pg_temp.op('cs'), 1, 'ext-cs'), true, 'cs reference');
SELECT is(pgfence.operation_cancel(pg_temp.op('cs')), 'cancel_requested', 'cancel requested for cs');
SELECT is(pgfence.operation_finish(pg_temp.op('cs'), 1, true), 'succeeded', 'the external side had already succeeded: succeeded, not canceled');
SELECT throws_ok('SELECT pgfence.operation_cancel(-1)', 'P0002', NULL, 'cancel: unknown id is P0002');
SELECT throws_ok('SELECT pgfence.operation_cancel(NULL)', '22004', NULL, 'cancel: NULL id is 22004');

-- A cancel requested while an intent has no reference, then a takeover: the re-issue rule holds,
-- and the log says a cancel was pending.
INSERT INTO ids SELECT 'cxk', id FROM pgfence.operation_request('tap.cxl', 'cx-key');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-dead', ARRAY['tap.cxl'])), 1, 'claim cxk');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cxk'), 1, true), 'issue', 'cxk: intent, then the call with the key; the owner dies before recording the reference');
SELECT is(pgfence.operation_cancel(pg_temp.op('cxk'), 'carol'), 'cancel_requested', 'a cancel is requested meanwhile');
SELECT pg_temp.lapse(pg_temp.op('cxk'));
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-heir', ARRAY['tap.cxl'])), 2, 'a new owner takes it over');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cxk'), 2, true), 'reissue',
  'intent without reference, cancel pending, key passed: reissue (the key finds what the first call may have started)');
SELECT results_eq($$SELECT (detail ->> 'cancel_pending')::boolean, detail ->> 'cancel_requested_by' FROM pgfence.event
                    WHERE module = 'operation' AND item_id = pg_temp.op('cxk') AND event = 'reissue'$$,
  $$VALUES (true, 'carol'::text)$$, '... and the reissue event records that a cancel was pending, and who asked');
SELECT is(pgfence.operation_record_external(pg_temp.op('cxk'), 2, 'ext-cxk'), true, 'the reference is recorded');
SELECT is(pgfence.operation_poll(pg_temp.op('cxk'), 2, '{"status": "running"}'), 'cancel', '... and the next poll tells the owner to cancel it');

INSERT INTO ids SELECT 'cxn', id FROM pgfence.operation_request('tap.cxl', 'cx-no-key');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-dead', ARRAY['tap.cxl'])), 1, 'claim cxn');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cxn'), 1, false), 'issue', 'cxn: intent, a call without the key; the owner dies');
SELECT is(pgfence.operation_cancel(pg_temp.op('cxn'), 'carol'), 'cancel_requested', 'a cancel is requested meanwhile');
SELECT pg_temp.lapse(pg_temp.op('cxn'));
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-heir', ARRAY['tap.cxl'])), 2, 'a new owner takes it over');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cxn'), 2, true), 'failed', 'intent without reference, cancel pending, no key: failed (outcome unknown), as without a cancel');
SELECT results_eq($$SELECT status, (result ->> 'cancel_pending')::boolean, error LIKE '%carol had asked to cancel it%' FROM pgfence.operation WHERE id = pg_temp.op('cxn')$$,
  $$VALUES ('failed'::text, true, true)$$, '... its result and error say a cancel was pending');
SELECT is((SELECT detail -> 'result' ->> 'cancel_pending' FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('cxn') AND event = 'finish'), 'true',
  '... and so does the event');

-- A cancel request recorded although no call was ever started (operation_cancel itself cancels
-- such an operation at once; here it is written by hand): begin_issue cancels, never calls.
INSERT INTO ids SELECT 'cxq', id FROM pgfence.operation_request('tap.cxl', 'cx-never-issued');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-w1', ARRAY['tap.cxl'])), 1, 'claim cxq');
UPDATE pgfence.operation SET cancel_requested_at = now(), cancel_requested_by = 'carol' WHERE id = pg_temp.op('cxq');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cxq'), 1, true), 'canceled', 'cancel requested, nothing issued: begin_issue answers canceled');
SELECT results_eq($$SELECT status, issue_count, issue_started_at IS NULL, finished_at IS NOT NULL, error FROM pgfence.operation WHERE id = pg_temp.op('cxq')$$,
  $$VALUES ('canceled'::text, 0, true, true, 'canceled at the request of carol before the external call was issued'::text)$$,
  '... the operation is canceled, with no intent recorded (no external call)');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('cxq'), 1, true), NULL, '... and asking again: not the owner of a live operation any more (NULL)');

-- =============================================================================================
-- Reaper and release
-- =============================================================================================
INSERT INTO ids SELECT 'r-none', id FROM pgfence.operation_request('tap.reap', 'none');
INSERT INTO ids SELECT 'r-plain', id FROM pgfence.operation_request('tap.reap', 'plain');
INSERT INTO ids SELECT 'r-key', id FROM pgfence.operation_request('tap.reap', 'key');
INSERT INTO ids SELECT 'r-ref', id FROM pgfence.operation_request('tap.reap', 'ref');
INSERT INTO ids SELECT 'r-live', id FROM pgfence.operation_request('tap.reap', 'live');
SELECT is((SELECT count(*)::int FROM pgfence.operation_claim('tap-dead', ARRAY['tap.reap'], NULL, 10)), 5, 'claim five');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('r-plain'), 1, false), 'issue', 'r-plain: intent without the key');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('r-key'), 1, true), 'issue', 'r-key: intent with the key');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('r-ref'), 1, false), 'issue', 'r-ref: intent');
SELECT is(pgfence.operation_record_external(pg_temp.op('r-ref'), 1, 'ext-r'), true, 'r-ref: reference');
SELECT pg_temp.lapse(id) FROM ids WHERE name IN ('r-none', 'r-plain', 'r-key', 'r-ref');
SELECT is(pgfence.operation_reap(), 2, 'the reaper settles two lapsed operations');
SELECT results_eq($$SELECT name, status, locked_by, result->>'reason' FROM ids JOIN pgfence.operation USING (id) WHERE name LIKE 'r-%' ORDER BY name$$,
  $$VALUES ('r-key'::text, 'running'::text, 'tap-dead'::text, NULL::text), ('r-live', 'running', 'tap-dead', NULL),
           ('r-none', 'queued', NULL, NULL), ('r-plain', 'failed', 'tap-dead', 'outcome_unknown'), ('r-ref', 'running', 'tap-dead', NULL)$$,
  'no call -> queued; call without key, no ref -> failed (outcome unknown); key or ref -> left for a takeover; live lease untouched');
SELECT ok((SELECT error LIKE 'lease of tap-dead lapsed at %Z before the external call; requeued' FROM pgfence.operation WHERE id = pg_temp.op('r-none')), 'a requeue says why');
SELECT is(pgfence.operation_begin_issue(pg_temp.op('r-none'), 1, false), NULL, 'the dead owner of a requeued operation is fenced out');
SELECT is(pgfence.operation_reap(), 0, 'a second reap finds nothing');
SELECT throws_ok('SELECT pgfence.operation_reap(0)', '22023', NULL, 'reap(0) is 22023');

SELECT is(pgfence.operation_release(pg_temp.op('r-live'), 1), true, 'release: the owner ends its lease now');
SELECT results_eq($$SELECT id, fence, taken_over_from FROM pgfence.operation_claim('tap-heir', ARRAY['tap.reap'], NULL, 10) ORDER BY id$$,
  $$SELECT id, 2, CASE WHEN name = 'r-none' THEN NULL ELSE 'tap-dead' END FROM ids WHERE name IN ('r-key', 'r-ref', 'r-live', 'r-none') ORDER BY id$$,
  'released and lapsed operations are taken over at once, the requeued one claimed afresh (all fence 2)');
SELECT throws_ok('SELECT pgfence.operation_release(-1, 1)', 'P0002', NULL, 'release: unknown id is P0002');

-- =============================================================================================
-- The guard: illegal moves refused even from hand-written SQL
-- =============================================================================================
SELECT throws_ok(format($$UPDATE pgfence.operation SET status = 'succeeded', finished_at = now() WHERE id = %s$$, pg_temp.op('a2')), 'PF001', NULL, 'hand UPDATE queued -> succeeded: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET status = 'running', locked_by = 'x', lease_expires_at = now() WHERE id = %s$$, pg_temp.op('a2')), 'PF001', NULL, 'claim without bumping the fence: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET error = 'edited' WHERE id = %s$$, pg_temp.op('a')), 'PF001', NULL, 'any change to a finished operation: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET status = 'running', finished_at = NULL, lease_expires_at = now() WHERE id = %s$$, pg_temp.op('f')), 'PF001', NULL, 'failed -> running: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET fence = fence + 1 WHERE id = %s$$, pg_temp.op('t')), 'PF001', NULL, 'a takeover (fence + 1) while the lease is live: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET status = 'queued', lease_expires_at = NULL, lease = lease WHERE id = %s$$, pg_temp.op('t')), 'PF001', NULL, 'running -> queued after the call was issued: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET status = 'bogus' WHERE id = %s$$, pg_temp.op('a2')), 'PF001', NULL, 'an unknown status: PF001');
SELECT throws_ok(format($$UPDATE pgfence.operation SET params = '{"evil": 1}' WHERE id = %s$$, pg_temp.op('a2')), 'PF002', NULL, 'changing params: PF002');
SELECT throws_ok(format($$UPDATE pgfence.operation SET target = 'elsewhere' WHERE id = %s$$, pg_temp.op('a2')), 'PF002', NULL, 'changing the target: PF002');
SELECT throws_ok(format($$UPDATE pgfence.operation SET fence = 0 WHERE id = %s$$, pg_temp.op('t')), 'PF002', NULL, 'lowering the fence: PF002');
SELECT throws_ok(format($$UPDATE pgfence.operation SET external_ref = 'forged' WHERE id = %s$$, pg_temp.op('t')), 'PF002', NULL, 'rewriting the external reference: PF002');
SELECT throws_ok(format($$UPDATE pgfence.operation SET issue_started_at = NULL, issued_by = NULL, issue_idempotent = NULL, last_issue_at = NULL, issue_count = 0 WHERE id = %s$$, pg_temp.op('t')), 'PF002', NULL, 'erasing an intent: PF002');
SET LOCAL session_replication_role = replica;  -- past the insert guard, down to the CHECK
SELECT throws_ok($$INSERT INTO pgfence.operation (kind, target, params, requested_by, status) VALUES ('tap.x', 'x', '{}', 'me', 'bogus')$$, '23514', NULL, 'the status CHECK refuses unknown values');
SET LOCAL session_replication_role = origin;
SELECT throws_ok($$INSERT INTO pgfence.operation (kind, target, params, requested_by, status, issue_started_at, issued_by, issue_count,
                                                  last_issue_at, issue_idempotent, external_ref, external_recorded_at, finished_at, result)
                   VALUES ('tap.hand', 'h1', '{}', 'mallory', 'succeeded', now(), 'mallory', 1, now(), true, 'ext-forged', now(), now(), '{"ok": true}')$$,
  'PF001', NULL, 'hand INSERT of a succeeded operation: PF001');
SELECT throws_ok($$INSERT INTO pgfence.operation (kind, target, params, requested_by, fence) VALUES ('tap.hand', 'h2', '{}', 'mallory', 7)$$,
  'PF001', NULL, 'hand INSERT of a queued operation with a fence: PF001');
SELECT lives_ok($$INSERT INTO pgfence.operation (kind, target, params, requested_by) VALUES ('tap.hand', 'h3', '{}', 'tap-hand')$$,
  'a hand INSERT of a fresh request passes the guard (WHEN-filtered trigger: no PL/pgSQL on that path)');
SELECT throws_ok(format($$DELETE FROM pgfence.operation WHERE id = %s$$, pg_temp.op('f')), 'PF002', NULL, 'hand DELETE of an operation: PF002');
SELECT is((SELECT count(*)::int FROM pgfence.operation WHERE id = pg_temp.op('f')), 1, '... it is still there');
SAVEPOINT before_purge;
SET LOCAL pgfence.purging = on;
SELECT lives_ok(format($$DELETE FROM pgfence.operation WHERE id = %s$$, pg_temp.op('f')), 'with pgfence.purging on (as audit_purge sets it) it can be deleted');
ROLLBACK TO SAVEPOINT before_purge;

-- =============================================================================================
-- Event log
-- =============================================================================================
SELECT results_eq(
  $$SELECT format('%s %s->%s by %s fence %s', event, coalesce(from_status, ''), to_status, actor, fence) FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('t') ORDER BY id$$,
  ARRAY[format('request ->queued by %s fence 0', session_user) COLLATE "default",
        'claim queued->running by tap-old fence 1',
        'issue running->running by tap-old fence 1',
        'external_ref running->running by tap-old fence 1',
        'takeover running->running by tap-new fence 2',
        'poll running->running by tap-new fence 2']::text[],
  'request, claim, intent, reference, takeover and polled state are logged with actor and fence; fenced-out writes leave nothing');
SELECT results_eq(
  $$SELECT detail->>'previous_owner', detail->>'external_ref' FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('t') AND event = 'takeover'$$,
  $$VALUES ('tap-old'::text, 'ext-t'::text)$$, 'the takeover event names the previous owner and the reference it resumes');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('a') AND event = 'poll'), 62,
  'a poll event only when the polled state changed (63 polls, one a repeat; the heartbeat logged nothing)');
SELECT results_eq(
  $$SELECT event, actor FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('ci') AND event IN ('cancel_request', 'cancel') ORDER BY id$$,
  $$VALUES ('cancel_request'::text, 'carol'::text), ('cancel', 'tap-w1')$$, 'the cancel request (by the requester) and the canceled ending (by the owner) are logged');
SELECT results_eq(
  $$SELECT event, actor, detail->'result'->>'reason' FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('r-plain') AND to_status = 'failed'$$,
  $$VALUES ('finish'::text, 'reaper'::text, 'outcome_unknown'::text)$$, 'the reaper''s outcome-unknown failure is logged by ''reaper''');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('r-live') AND event = 'release'), 1, 'release is logged');
SAVEPOINT before_rollback;
SELECT pgfence.operation_cancel(pg_temp.op('a2'), 'eve');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('a2') AND event = 'cancel'), 1, 'a cancel is logged inside its transaction ...');
ROLLBACK TO SAVEPOINT before_rollback;
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.op('a2') AND event = 'cancel'), 0, '... and a rolled-back transition leaves no event');
SELECT is(coalesce(current_setting('pgfence.actor', true), ''), '', 'the actor name does not leak past the function call');

-- =============================================================================================
-- Reading, and time zone independence
-- =============================================================================================
SELECT is((SELECT status FROM pgfence.operation_get(pg_temp.op('t'))), 'running', 'operation_get returns the operation');
SELECT throws_ok('SELECT * FROM pgfence.operation_get(-1)', 'P0002', NULL, 'operation_get: unknown id is P0002');
SELECT throws_ok('SELECT * FROM pgfence.operation_get(NULL)', '22004', NULL, 'operation_get: NULL id is 22004');
SELECT results_eq($$SELECT id FROM pgfence.operation_list('tap.reset', 'branch-a', 'in_flight')$$, $$SELECT pg_temp.op('a2')$$, 'operation_list: in_flight of one target');
SELECT throws_ok($$SELECT * FROM pgfence.operation_list(NULL, NULL, 'bogus')$$, '22023', NULL, 'operation_list: unknown status is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.operation_list(NULL, NULL, NULL, 0)$$, '22023', NULL, 'operation_list: limit 0 is 22023');
SELECT results_eq($$SELECT owner, lease_lapsed, issue_started, external_ref FROM pgfence.operation_in_flight WHERE id = pg_temp.op('t')$$,
  $$VALUES ('tap-new'::text, false, true, 'ext-t'::text)$$, 'operation_in_flight shows owner, lease, intent and reference');

SET LOCAL TIME ZONE 'Asia/Kolkata';
SELECT is(pgfence.operation_poll(pg_temp.op('t'), 2, '{"status": "tz"}', '30 seconds'), 'continue', 'poll in Asia/Kolkata');
SELECT results_eq($$SELECT poll_history->-1->>'first_at', lease_expires_at - now() FROM pgfence.operation WHERE id = pg_temp.op('t')$$,
  $$SELECT to_char(now() AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"'), interval '30 seconds'$$,
  'history timestamps are UTC whatever the session zone; the lease is an instant 30 s from now()');
SET LOCAL TIME ZONE 'UTC';

SELECT * FROM finish();
ROLLBACK;
