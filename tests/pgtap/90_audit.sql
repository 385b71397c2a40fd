-- pgTAP: auditing (functions/90_audit_*.sql). Each view and function against crafted states of
-- every module (leases and heartbeats lapse because the rows are back-dated, never by faking
-- the clock), the event log's transactionality, what the monitoring role may and may not do,
-- and the purge. Everything is rolled back at the end; the cells that need a second session (a
-- real rolled-back transaction, CALL audit_purge, which commits) use dblink peers and clean up.
BEGIN;
\ir helpers/setup.sql
SELECT plan(161);

CREATE FUNCTION public.tap_audit_noop(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
SELECT pgfence.plan_register_action('tap-au.noop', 'public.tap_audit_noop(jsonb)', 'does nothing (audit tests)');
SELECT pgfence.plan_register_action('tap-au.hook', NULL, 'an external webhook (audit tests)');
CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
CREATE FUNCTION pg_temp.id(p_name text) RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM ids WHERE name = p_name $$;
CREATE FUNCTION pg_temp.events(p_module text, p_id bigint) RETURNS integer LANGUAGE sql AS $$
  SELECT count(*)::int FROM pgfence.event WHERE module = p_module AND item_id = p_id $$;
-- A two-step SQL plan proposed by tap-agent and approved by tap-ops.
CREATE FUNCTION pg_temp.approved_plan() RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v bigint;
BEGIN
  v := pgfence.plan_propose('[{"action": "tap-au.noop", "args": {"n": 1}}, {"action": "tap-au.noop", "args": {"n": 2}}]', 'tap-agent');
  PERFORM pgfence.plan_approve(v, 'tap-ops');
  RETURN v;
END $$;

-- =============================================================================================
-- Catalog: views, signatures, definer, volatility, privileges
-- =============================================================================================
SELECT has_view('pgfence', 'audit_stuck', 'audit_stuck view');
SELECT has_view('pgfence', 'audit_owned', 'audit_owned view');
SELECT has_view('pgfence', 'audit_duplicates', 'audit_duplicates view');
SELECT has_view('pgfence', 'audit_queue_health', 'audit_queue_health view');
SELECT has_view('pgfence', 'audit_queue_depth', 'audit_queue_depth view');
SELECT has_view('pgfence', 'audit_documents', 'audit_documents view');
SELECT has_function('pgfence', 'audit_owner_of', ARRAY['text','bigint'], 'audit_owner_of(module, id) signature');
SELECT has_function('pgfence', 'audit_timeline', ARRAY['text','bigint'], 'audit_timeline(module, id) signature');
SELECT is((SELECT prokind::text FROM pg_proc WHERE oid = 'pgfence.audit_purge(text,interval,integer,bigint)'::regprocedure), 'p',
  'audit_purge is a procedure (it commits after every batch)');
SELECT is_definer('pgfence', 'audit_owner_of', ARRAY['text','bigint'], 'audit_owner_of is security definer');
SELECT is_definer('pgfence', 'audit_timeline', ARRAY['text','bigint'], 'audit_timeline is security definer');
SELECT is_definer('pgfence', '_audit_purge_batch', ARRAY['text','timestamp with time zone','bigint','integer'], 'the purge batch helper is security definer');
SELECT volatility_is('pgfence', 'audit_owner_of', ARRAY['text','bigint'], 'stable', 'audit_owner_of is stable (reads only)');
SELECT volatility_is('pgfence', 'audit_timeline', ARRAY['text','bigint'], 'stable', 'audit_timeline is stable (reads only)');
SELECT ok(bool_and(p.proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp']), 'every audit function pins search_path')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE '%audit%' AND p.prokind = 'f';
SELECT isnt_definer('pgfence', 'audit_purge', ARRAY['text','interval','integer','bigint'], 'audit_purge is not security definer (it could not COMMIT); its batches are');
SELECT is((SELECT proconfig FROM pg_proc WHERE oid = 'pgfence.audit_purge(text,interval,integer,bigint)'::regprocedure), NULL,
  'audit_purge has no SET clause (a procedure with one cannot COMMIT)');
SELECT function_privs_are('pgfence', 'audit_timeline', ARRAY['text','bigint'], 'pg_monitor', ARRAY['EXECUTE'], 'pg_monitor may read timelines');
SELECT function_privs_are('pgfence', 'audit_timeline', ARRAY['text','bigint'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may read timelines');
SELECT function_privs_are('pgfence', 'audit_timeline', ARRAY['text','bigint'], 'pgfence_client', ARRAY[]::text[], 'client may not read timelines');
SELECT function_privs_are('pgfence', 'audit_owner_of', ARRAY['text','bigint'], 'pg_monitor', ARRAY['EXECUTE'], 'pg_monitor may ask who owns an item');
SELECT function_privs_are('pgfence', 'audit_owner_of', ARRAY['text','bigint'], 'pgfence_executor', ARRAY[]::text[], 'executor may not');
SELECT function_privs_are('pgfence', 'audit_purge', ARRAY['text','interval','integer','bigint'], 'pgfence_admin', ARRAY['EXECUTE'], 'admin may purge');
SELECT function_privs_are('pgfence', 'audit_purge', ARRAY['text','interval','integer','bigint'], 'pg_monitor', ARRAY[]::text[], 'pg_monitor may not purge');
SELECT function_privs_are('pgfence', '_audit_purge_batch', ARRAY['text','timestamp with time zone','bigint','integer'], 'pg_monitor', ARRAY[]::text[], 'pg_monitor may not run a purge batch');
SELECT is(
  (SELECT array_agg(v ORDER BY v) FROM unnest(ARRAY['audit_stuck','audit_owned','audit_duplicates','audit_queue_health','audit_queue_depth',
                                                    'audit_documents','outbox_summary','outbox_leases','operation_in_flight']) AS v
   WHERE NOT (has_table_privilege('pg_monitor', 'pgfence.' || v, 'SELECT') AND has_table_privilege('pgfence_admin', 'pgfence.' || v, 'SELECT'))),
  NULL, 'pg_monitor and pgfence_admin may read every audit and summary view');
SELECT is(
  (SELECT array_agg(v ORDER BY v) FROM unnest(ARRAY['audit_stuck','audit_owned','audit_duplicates','audit_queue_health','audit_queue_depth','audit_documents']) AS v
   WHERE has_table_privilege('pgfence_client', 'pgfence.' || v, 'SELECT') OR has_table_privilege('pgfence_executor', 'pgfence.' || v, 'SELECT')),
  NULL, 'clients and executors may not read the audit views');
SELECT is(
  (SELECT array_agg(c.relname::text ORDER BY 1) FROM pg_class c
   WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind = 'r'
     AND (has_table_privilege('pg_monitor', c.oid, 'SELECT') OR has_table_privilege('pg_monitor', c.oid, 'INSERT')
          OR has_table_privilege('pg_monitor', c.oid, 'UPDATE') OR has_table_privilege('pg_monitor', c.oid, 'DELETE'))),
  NULL, 'pg_monitor reads or writes no pgfence table directly');
SELECT is(
  (SELECT array_agg(p.oid::regprocedure::text ORDER BY 1) FROM pg_proc p
   WHERE p.pronamespace = 'pgfence'::regnamespace AND has_function_privilege('pg_monitor', p.oid, 'EXECUTE')
     AND p.provolatile = 'v'),
  NULL, 'pg_monitor may execute no volatile pgfence routine (no transition, no reaper, no purge)');

-- =============================================================================================
-- What is stuck / who owns it: a lapsed outbox lease, a stale plan, an operation past its lease
-- =============================================================================================
INSERT INTO ids SELECT 'msg', pgfence.outbox_enqueue('tap-au-dup', 'https://example.test/a', '{"n": 1}', 'tap-au-dup-1');
INSERT INTO ids SELECT 'live', pgfence.outbox_enqueue('tap-au-live', 'https://example.test/b', '{"n": 2}');
SELECT ok((SELECT count(*) = 1 FROM pgfence.outbox_claim('tap-w1', 1, ARRAY['tap-au-dup'], '1 minute')), 'tap-w1 claims the message (attempt 1)');
SELECT ok((SELECT count(*) = 1 FROM pgfence.outbox_claim('tap-w9', 1, ARRAY['tap-au-live'], '10 minutes')), 'tap-w9 claims another one, lease 10 minutes');
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '90 seconds' WHERE id = pg_temp.id('msg');

INSERT INTO ids SELECT 'stale', pg_temp.approved_plan();
SELECT ok(pgfence.plan_start(pg_temp.id('stale'), 'tap-pw', '10 seconds') IS NOT NULL, 'tap-pw starts the plan');
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '30 seconds' WHERE id = pg_temp.id('stale');

INSERT INTO ids SELECT 'op', id FROM pgfence.operation_request('tap-au.reset', 'br-1', '{}', 'tap-au-op1', 'alice');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-ow', ARRAY['tap-au.reset'], '1 minute')), 1, 'tap-ow claims the operation (fence 1)');
UPDATE pgfence.operation SET lease_expires_at = now() - interval '45 seconds' WHERE id = pg_temp.id('op');

SELECT results_eq(
  $$SELECT module, item_id, status, owner, fence, overdue, expired_at FROM pgfence.audit_stuck ORDER BY module$$,
  $$VALUES ('operation', pg_temp.id('op'), 'running', 'tap-ow', 1::bigint, interval '45 seconds', now() - interval '45 seconds'),
           ('outbox', pg_temp.id('msg'), 'processing', 'tap-w1', 1::bigint, interval '90 seconds', now() - interval '90 seconds'),
           ('plan', pg_temp.id('stale'), 'executing', 'tap-pw', 1::bigint, interval '30 seconds', now() - interval '30 seconds')$$,
  'audit_stuck lists exactly the lapsed outbox lease, the stale plan and the operation past its lease, with owner, fence and how long overdue');
SELECT results_eq(
  $$SELECT queue, claimed_at, last_seen_at FROM pgfence.audit_stuck ORDER BY module$$,
  $$VALUES ('tap-au.reset', now(), now() - interval '105 seconds'), ('tap-au-dup', now(), now()), ('*', now(), now())$$,
  'audit_stuck: the queue (kind, channel, * for plans), when the item was claimed and when its owner was last seen (operation: lease end - lease length)');
SELECT ok((SELECT next LIKE 'outbox_reap puts it back to pending, attempt 2 of 10%possible duplicate%' FROM pgfence.audit_stuck WHERE module = 'outbox'),
  'audit_stuck says what happens next to the outbox message (and that it may have been delivered)');
SELECT ok((SELECT next LIKE '%marks it failed (interrupted) at step 1 of 2' FROM pgfence.audit_stuck WHERE module = 'plan'),
  '... to the plan');
SELECT ok((SELECT next LIKE 'operation_reap puts it back to queued: no external call was started' FROM pgfence.audit_stuck WHERE module = 'operation'),
  '... to the operation');
SELECT results_eq(
  $$SELECT module, item_id, owner, lapsed, remaining FROM pgfence.audit_owned ORDER BY module, item_id$$,
  $$VALUES ('operation', pg_temp.id('op'), 'tap-ow', true, interval '-45 seconds'),
           ('outbox', pg_temp.id('msg'), 'tap-w1', true, interval '-90 seconds'),
           ('outbox', pg_temp.id('live'), 'tap-w9', false, interval '10 minutes'),
           ('plan', pg_temp.id('stale'), 'tap-pw', true, interval '-30 seconds')$$,
  'audit_owned lists every owned item with its owner and remaining lease (negative once lapsed); only the lapsed ones are stuck');
SELECT results_eq(
  $$SELECT owned, owner, fence, expires_at, lapsed, last_owner FROM pgfence.audit_owner_of('outbox', pg_temp.id('live'))$$,
  $$VALUES (true, 'tap-w9', 1::bigint, now() + interval '10 minutes', false, 'tap-w9')$$,
  'audit_owner_of: who owns a message, under which fence, until when');
SELECT results_eq(
  $$SELECT status, owned, owner, lapsed FROM pgfence.audit_owner_of('plan', pg_temp.id('stale'))$$,
  $$VALUES ('executing', true, 'tap-pw', true)$$,
  'audit_owner_of reports a stale plan as executing and lapsed ...');
SELECT is((SELECT status FROM pgfence.plan p WHERE p.id = pg_temp.id('stale')), 'executing', '... and does not heal it (reading changes nothing)');
SELECT results_eq(
  $$SELECT owned, owner, fence, lapsed, last_owner FROM pgfence.audit_owner_of('operation', pg_temp.id('op'))$$,
  $$VALUES (true, 'tap-ow', 1::bigint, true, 'tap-ow')$$,
  'audit_owner_of: an operation past its lease');

-- The reapers run: nothing is stuck any more.
SELECT is(pgfence.outbox_reap(), 1, 'the outbox reaper takes the lapsed lease back');
SELECT is(pgfence.plan_reap(), 1, 'the plan reaper marks the stale plan interrupted');
SELECT is(pgfence.operation_reap(), 1, 'the operation reaper requeues the operation that never called out');
SELECT is((SELECT count(*)::int FROM pgfence.audit_stuck), 0, 'after the reapers, audit_stuck is empty');
SELECT results_eq(
  $$SELECT status, owned, owner, fence, last_owner FROM pgfence.audit_owner_of('outbox', pg_temp.id('msg'))$$,
  $$VALUES ('pending', false, NULL::text, 1::bigint, NULL::text)$$,
  'audit_owner_of: a reclaimed message is owned by nobody (attempt 1 is spent)');
SELECT results_eq(
  $$SELECT worker, attempt, outcome, lease_expires_at FROM pgfence.outbox_lapse WHERE message_id = pg_temp.id('msg')$$,
  $$VALUES ('tap-w1', 1, 'pending', now() - interval '90 seconds')$$,
  'the reaper left a lapse receipt: who lost which attempt, and when its lease ran out');

-- =============================================================================================
-- Which effects may have been duplicated
-- =============================================================================================
-- The message is claimed a second time and sent: tap-w1 may have delivered attempt 1 as well.
UPDATE pgfence.outbox SET next_attempt_at = now() WHERE id = pg_temp.id('msg');
SELECT is((SELECT attempt FROM pgfence.outbox_claim('tap-w2', 1, ARRAY['tap-au-dup'])), 2, 'tap-w2 claims it again (attempt 2)');
SELECT ok(pgfence.outbox_mark_sent(pg_temp.id('msg'), 2, '{"http": 200}'), 'and sends it');
SELECT results_eq(
  $$SELECT module, status, reason, fences, lost_by, since, idempotency_key FROM pgfence.audit_duplicates WHERE module = 'outbox'$$,
  $$VALUES ('outbox', 'sent', 'lease_lapsed', ARRAY[1::bigint], ARRAY['tap-w1'], now() - interval '90 seconds', 'tap-au-dup-1')$$,
  'a message claimed twice then sent is listed: attempt 1 lost its lease, tap-w1 held it, the receiver deduplicates on the key');
SELECT ok((SELECT check_downstream LIKE 'delivered under attempt 2; lapsed attempt(s) 1 may have been delivered too%2 times%' FROM pgfence.audit_duplicates WHERE module = 'outbox'),
  'check_downstream: the receiver may have it twice');
SELECT is((SELECT count(*)::int FROM pgfence.audit_duplicates WHERE module = 'outbox' AND item_id = pg_temp.id('live')), 0,
  'a message delivered under its first claim is not listed');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'outbox' AND item_id = pg_temp.id('msg')), 0,
  '(its channel logs no events: the listing comes from the reaper''s receipt alone)');

-- A plan whose external step was in flight when its run was interrupted.
INSERT INTO ids SELECT 'ext', pgfence.plan_propose(
  '[{"action": "tap-au.noop", "args": {}}, {"action": "tap-au.hook", "args": {"recipient": "https://shop.test/hook", "payload": {"e": 1}}}]', 'tap-agent');
SELECT pgfence.plan_approve(pg_temp.id('ext'), 'tap-ops');
SELECT ok(pgfence.plan_start(pg_temp.id('ext'), 'tap-px') IS NOT NULL, 'tap-px starts a plan with an external step 2');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.id('ext'), 'tap-px', 1)), 'ok', 'step 1 (SQL) runs');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.id('ext'), 'tap-px', 1)), 'external', 'step 2 is handed to the worker to perform');
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '5 seconds' WHERE id = pg_temp.id('ext');
SELECT results_eq(
  $$SELECT status, reason, fences, lost_by, idempotency_key FROM pgfence.audit_duplicates WHERE module = 'plan'$$,
  $$VALUES ('executing', 'external_step_in_doubt', ARRAY[2::bigint], ARRAY['tap-px'], 'pgfence-plan-' || pg_temp.id('ext') || '-step-2')$$,
  'an external step in flight past the heartbeat is listed as in doubt, before any reaper ran');
SELECT is(pgfence.plan_reap(), 1, 'the reaper interrupts the plan');
SELECT results_eq(
  $$SELECT status, reason, since FROM pgfence.audit_duplicates WHERE module = 'plan'$$,
  $$VALUES ('failed', 'external_step_in_doubt', now())$$,
  '... and it stays listed once failed (interrupted): the step may have happened');

-- An operation re-issued after a takeover, and one whose outcome is unknown.
INSERT INTO ids SELECT 'reissued', id FROM pgfence.operation_request('tap-au.re', 'br-3', '{}', 'tap-au-op3', 'alice');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-o1', ARRAY['tap-au.re'])), 1, 'tap-o1 claims');
SELECT is(pgfence.operation_begin_issue(pg_temp.id('reissued'), 1, true), 'issue', 'tap-o1 issues the call with the key');
UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = pg_temp.id('reissued');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-o2', ARRAY['tap-au.re'])), 2, 'tap-o2 takes over (fence 2)');
SELECT is(pgfence.operation_begin_issue(pg_temp.id('reissued'), 2, true), 'reissue', 'and re-issues with the key');
INSERT INTO ids SELECT 'unknown', id FROM pgfence.operation_request('tap-au.unk', 'br-2', '{}', NULL, 'alice');
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-o3', ARRAY['tap-au.unk'])), 1, 'tap-o3 claims another');
SELECT is(pgfence.operation_begin_issue(pg_temp.id('unknown'), 1, false), 'issue', 'and calls out without an idempotency key');
UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = pg_temp.id('unknown');
SELECT is(pgfence.operation_reap(), 1, 'the reaper fails it as outcome unknown');
SELECT results_eq(
  $$SELECT item_id, status, reason, fences, lost_by, idempotency_key FROM pgfence.audit_duplicates WHERE module = 'operation' ORDER BY item_id$$,
  $$VALUES (pg_temp.id('reissued'), 'running', 'reissued', ARRAY[1, 2]::bigint[], ARRAY['tap-o1', 'tap-o2'], 'tap-au-op3'),
           (pg_temp.id('unknown'), 'failed', 'outcome_unknown', ARRAY[1]::bigint[], ARRAY['tap-o3'], 'pgfence-operation-' || pg_temp.id('unknown'))$$,
  'operations re-issued (under fences 1 and 2) or of unknown outcome are listed; a takeover that only polls is not');
SELECT is((SELECT count(*)::int FROM pgfence.audit_duplicates WHERE module = 'operation' AND item_id = pg_temp.id('op')), 0,
  'an operation requeued before any external call is not listed');

-- =============================================================================================
-- What did X do: timelines
-- =============================================================================================
SELECT is(
  (SELECT array_agg(source || ':' || event) FROM pgfence.audit_timeline('outbox', pg_temp.id('msg'))),
  ARRAY['row:enqueue', 'lapse:lease_lapsed', 'row:claim', 'row:finish', 'row:current'],
  'outbox timeline without the event log: enqueue, the lapsed attempt, the last claim, the finish, the current state');
SELECT results_eq(
  $$SELECT fence, actor, detail ->> 'worker' FROM pgfence.audit_timeline('outbox', pg_temp.id('msg')) WHERE event = 'lease_lapsed'$$,
  $$VALUES (1::bigint, 'reaper', 'tap-w1')$$, '... the lapse names the attempt and the worker that lost it');
SELECT is((SELECT detail -> 'receipt' FROM pgfence.audit_timeline('outbox', pg_temp.id('msg')) WHERE event = 'finish'), '{"http": 200}'::jsonb,
  '... the finish carries the delivery receipt');

SELECT lives_ok($$SELECT pgfence.outbox_configure_channel('tap-au-log', p_log_events => true)$$, 'channel tap-au-log logs events');
INSERT INTO ids SELECT 'logged', pgfence.outbox_enqueue('tap-au-log', 'https://example.test/c', '{"n": 3}');
SELECT ok((SELECT count(*) = 1 FROM pgfence.outbox_claim('tap-w3', 1, ARRAY['tap-au-log'])), 'tap-w3 claims the logged message');
SELECT is(pgfence.outbox_mark_failed(pg_temp.id('logged'), 1, 'HTTP 503', true), 'pending', 'the receiver answers 503: retry later');
SELECT is(
  (SELECT array_agg(source || ':' || event || ':' || coalesce(to_status, '') || ':' || coalesce(actor, '')) FROM pgfence.audit_timeline('outbox', pg_temp.id('logged'))),
  ARRAY['event:enqueue:pending:' || session_user, 'event:claim:processing:tap-w3', 'event:transition:pending:tap-w3', 'row:current:pending:'],
  'outbox timeline from the event log: who did each transition, then the current state');
SELECT is((SELECT detail ->> 'error' FROM pgfence.audit_timeline('outbox', pg_temp.id('logged')) WHERE event = 'transition'), 'HTTP 503',
  '... with the error of the failed attempt');

INSERT INTO ids SELECT 'done', pg_temp.approved_plan();
SELECT ok(pgfence.plan_start(pg_temp.id('done'), 'tap-pd') IS NOT NULL, 'tap-pd runs a plan');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.id('done'), 'tap-pd', 1)), 'ok', 'step 1');
SELECT is((SELECT status FROM pgfence.plan_run_step(pg_temp.id('done'), 'tap-pd', 1)), 'executed', 'step 2: executed');
SELECT is(
  (SELECT array_agg(source || ':' || event || ':' || coalesce(actor, '')) FROM pgfence.audit_timeline('plan', pg_temp.id('done'))),
  ARRAY['event:propose:tap-agent', 'event:approve:tap-ops', 'event:start:tap-pd', 'receipt:step_ok:tap-pd',
        'receipt:step_ok:tap-pd', 'event:finish:tap-pd', 'row:current:tap-pd'],
  'plan timeline: transitions with who made them, each step''s receipt, the current state');
SELECT is((SELECT array_agg(detail -> 'output' ORDER BY fence) FROM pgfence.audit_timeline('plan', pg_temp.id('done')) WHERE source = 'receipt'),
  ARRAY['{"n": 1}'::jsonb, '{"n": 2}'::jsonb], '... receipts carry the step outputs');
SELECT is(
  (SELECT array_agg(source || ':' || coalesce(db_user, '-')) FROM pgfence.audit_timeline('plan', pg_temp.id('done'))),
  (SELECT array_agg(x || session_user) FROM unnest(ARRAY['event:', 'event:', 'event:', 'receipt:', 'receipt:', 'event:']) AS x) || ARRAY['row:-'],
  '... and the database login (db_user) of every event and receipt; rows rebuilt from the item have none');
SELECT is(
  (SELECT array_agg(source || ':' || event) FROM pgfence.audit_timeline('plan', pg_temp.id('ext')) WHERE source <> 'row' OR event = 'current'),
  ARRAY['event:propose', 'event:approve', 'event:start', 'receipt:step_ok', 'event:fail', 'row:current'],
  'plan timeline of the interrupted run: started, step 1 ok, failed ...');
SELECT results_eq(
  $$SELECT fence, actor, detail ->> 'idempotency_key' FROM pgfence.audit_timeline('plan', pg_temp.id('ext')) WHERE event = 'step_in_doubt'$$,
  $$VALUES (2::bigint, 'tap-px', 'pgfence-plan-' || pg_temp.id('ext') || '-step-2')$$,
  '... and external step 2 in doubt, with the key the receiver saw');
SELECT is(
  (SELECT array_agg(source || ':' || event || ':' || coalesce(fence::text, '')) FROM pgfence.audit_timeline('operation', pg_temp.id('reissued'))),
  ARRAY['event:request:0', 'event:claim:1', 'event:issue:1', 'event:takeover:2', 'event:reissue:2', 'row:current:2'],
  'operation timeline: request, claim, issue, takeover, re-issue with their fences, then the current state');

-- A step that raises: its receipt carries the SQLSTATE.
CREATE FUNCTION public.tap_audit_boom(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT jsonb_build_object('x', 1 / 0) $$;
SELECT pgfence.plan_register_action('tap-au.boom', 'public.tap_audit_boom(jsonb)', 'divides by zero (audit tests)');
INSERT INTO ids SELECT 'boom', pgfence.plan_propose('[{"action": "tap-au.boom", "args": {}}]', 'tap-agent');
SELECT pgfence.plan_approve(pg_temp.id('boom'), 'tap-ops');
SELECT ok(pgfence.plan_start(pg_temp.id('boom'), 'tap-pb') IS NOT NULL, 'tap-pb runs a plan whose step raises');
SELECT is((SELECT outcome FROM pgfence.plan_run_step(pg_temp.id('boom'), 'tap-pb', 1)), 'error', 'the step fails');
SELECT results_eq(
  $$SELECT event, detail ->> 'sqlstate', detail ->> 'message' FROM pgfence.audit_timeline('plan', pg_temp.id('boom')) WHERE source = 'receipt'$$,
  $$VALUES ('step_error', '22012', 'division by zero')$$,
  'plan timeline: the error receipt with its SQLSTATE');

SELECT throws_ok($$SELECT * FROM pgfence.audit_timeline(NULL, 1)$$, '22004', NULL, 'audit_timeline: NULL module is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.audit_timeline('outbox', NULL)$$, '22004', NULL, 'audit_timeline: NULL id is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.audit_timeline('queue', 1)$$, '22023', NULL, 'audit_timeline: unknown module is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.audit_timeline('operation', -1)$$, 'P0002', NULL, 'audit_timeline: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.audit_owner_of(NULL, 1)$$, '22004', NULL, 'audit_owner_of: NULL module is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.audit_owner_of('queue', 1)$$, '22023', NULL, 'audit_owner_of: unknown module is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.audit_owner_of('plan', -1)$$, 'P0002', NULL, 'audit_owner_of: unknown id is P0002');

-- =============================================================================================
-- Queue health
-- =============================================================================================
SELECT pgfence.outbox_enqueue('tap-au-qh', 'https://example.test/q', '{"m": 2}', p_deliver_at => now() + interval '1 hour');
SELECT pgfence.outbox_enqueue('tap-au-qh', 'https://example.test/q', '{"m": 3}');
SELECT is((SELECT pgfence.outbox_mark_failed(c.id, c.attempt, 'HTTP 503') FROM pgfence.outbox_claim('tap-wq', 1, ARRAY['tap-au-qh']) c), 'pending', 'm3 failed once: backoff');
SELECT pgfence.outbox_enqueue('tap-au-qh', 'https://example.test/q', '{"m": 4}');
SELECT ok((SELECT count(*) = 1 FROM pgfence.outbox_claim('tap-wq', 1, ARRAY['tap-au-qh'])), 'm4 is being delivered');
SELECT pgfence.outbox_enqueue('tap-au-qh', 'https://example.test/q', '{"m": 5}');
SELECT ok((SELECT pgfence.outbox_mark_sent(c.id, c.attempt) FROM pgfence.outbox_claim('tap-wq', 1, ARRAY['tap-au-qh']) c), 'm5 sent');
SELECT pgfence.outbox_enqueue('tap-au-qh', 'https://example.test/q', '{"m": 6}', p_max_attempts => 1);
SELECT is((SELECT pgfence.outbox_mark_failed(c.id, c.attempt, 'HTTP 503') FROM pgfence.outbox_claim('tap-wq', 1, ARRAY['tap-au-qh']) c), 'dead', 'm6 dead');
SELECT pgfence.outbox_enqueue('tap-au-qh', 'https://example.test/q', '{"m": 1}');
SELECT results_eq(
  $$SELECT ready, deferred, in_backoff, in_flight, lapsed, oldest_ready_age BETWEEN interval '0' AND clock_timestamp() - now(), done_5m, failed_5m, per_second_5m, failed, dead
    FROM pgfence.audit_queue_health WHERE module = 'outbox' AND queue = 'tap-au-qh'$$,
  -- ready by the clock; the message is due since it was enqueued in this transaction (docs/design.md#claim-hint)
  $$VALUES (1::bigint, 2::bigint, 1::bigint, 1::bigint, 0::bigint, true, 1::bigint, 1::bigint, 0.01, 0::bigint, 1::bigint)$$,
  'queue health of a channel: ready, deferred (backoff or deliver_at), in backoff, in flight, finished in the last 5 minutes, dead');
SELECT ok((SELECT next_due_at < now() + interval '1 minute' FROM pgfence.audit_queue_health WHERE module = 'outbox' AND queue = 'tap-au-qh'),
  'next_due_at is the earliest deferred message (the one in backoff, not the one due in an hour)');
SELECT results_eq(
  $$SELECT ready, in_flight, lapsed, done_5m, failed_5m, failed FROM pgfence.audit_queue_health WHERE module = 'operation' AND queue IN ('tap-au.reset', 'tap-au.unk') ORDER BY queue$$,
  $$VALUES (1::bigint, 0::bigint, 0::bigint, 0::bigint, 0::bigint, 0::bigint), (0::bigint, 0::bigint, 0::bigint, 0::bigint, 1::bigint, 1::bigint)$$,
  'queue health per operation kind: the requeued reset is ready again; the unknown outcome counts as failed');
CREATE TEMP TABLE qh_before AS SELECT deferred, ready FROM pgfence.audit_queue_health WHERE module = 'plan';
SELECT pgfence.plan_propose('[{"action": "tap-au.noop"}]', 'tap-agent');
SELECT results_eq(
  $$SELECT deferred, ready FROM pgfence.audit_queue_health WHERE module = 'plan'$$,
  $$SELECT deferred + 1, ready FROM qh_before$$,
  'queue health of plans: a new proposal waits for approval (deferred), it is not ready to run');
SELECT is(
  (SELECT count(*) FROM (
     -- (the oldest ready age is read at each view's own clock: compared as present or not)
     SELECT module, queue, ready, deferred, in_backoff, in_flight, lapsed, failed, dead, oldest_ready_age IS NULL,
            next_due_at, executors, unserved FROM pgfence.audit_queue_depth
     EXCEPT
     SELECT module, queue, ready, deferred, in_backoff, in_flight, lapsed, failed, dead, oldest_ready_age IS NULL,
            next_due_at, executors, unserved FROM pgfence.audit_queue_health) x),
  0::bigint,
  'audit_queue_depth: every row is the depth part of its queue''s audit_queue_health row (one definition of ready, lapsed, unserved)');

-- =============================================================================================
-- Documents: recent conflicts, most revisions, timeline
-- =============================================================================================
INSERT INTO ids SELECT 'doc', pgfence.document_create('record', '{"title": "v1"}', 'tap-alice');
INSERT INTO ids SELECT 'quiet', pgfence.document_create('record', '{"title": "quiet"}', 'tap-carol');
SELECT is((SELECT outcome FROM pgfence.document_save(pg_temp.id('doc'), 1, '{"title": "v2"}', 'tap-alice')), 'saved', 'alice saves version 2');
SELECT is((SELECT outcome FROM pgfence.document_save(pg_temp.id('doc'), 1, '{"title": "bob"}', 'tap-bob')), 'conflict', 'bob saves on stale version 1: conflict');
SELECT is((SELECT outcome FROM pgfence.document_save(pg_temp.id('doc'), 1, '{"title": "bob!"}', 'tap-bob')), 'conflict', 'and again: conflict');
SELECT is((SELECT outcome FROM pgfence.document_save(pg_temp.id('doc'), 2, '{"title": "v3"}', 'tap-alice', 'tap-save-3')), 'saved', 'alice saves version 3');
SELECT ok((SELECT replayed FROM pgfence.document_save(pg_temp.id('doc'), 2, '{"title": "v3"}', 'tap-alice', 'tap-save-3')), 'her retry (lost answer) is replayed from the receipt');
SELECT results_eq(
  $$SELECT document_id, version, revisions, writes_24h, conflicts_1h, conflicts_24h, replays_24h, last_conflict_by, saved_by
    FROM pgfence.audit_documents WHERE document_id IN (pg_temp.id('doc'), pg_temp.id('quiet'))
    ORDER BY conflicts_1h DESC, revisions DESC$$,
  $$VALUES (pg_temp.id('doc'), 3::bigint, 3::bigint, 3::bigint, 2::bigint, 2::bigint, 1::bigint, 'tap-bob', 'tap-alice'),
           (pg_temp.id('quiet'), 1::bigint, 1::bigint, 1::bigint, 0::bigint, 0::bigint, 0::bigint, NULL, 'tap-carol')$$,
  'audit_documents: recent conflicts per document (and who hit the last one), revisions, writes and replayed retries');
SELECT is(
  (SELECT array_agg(source || ':' || event || ':' || coalesce(actor, '') || ':' || fence) FROM pgfence.audit_timeline('document', pg_temp.id('doc'))),
  ARRAY['event:create:tap-alice:1', 'event:save:tap-alice:2', 'event:conflict:tap-bob:2', 'event:conflict:tap-bob:2',
        'event:save:tap-alice:3', 'event:replay:tap-alice:3', 'row:current:tap-alice:3'],
  'document timeline: every write and refused save with who and which version, then the current state');
SELECT results_eq(
  $$SELECT status, owned, owner, fence, last_owner FROM pgfence.audit_owner_of('document', pg_temp.id('doc'))$$,
  $$VALUES ('live', false, NULL::text, 3::bigint, 'tap-alice')$$,
  'audit_owner_of: a document is never owned; its fence is the version a save must present');

-- =============================================================================================
-- The event log is written in the same transaction as the transition
-- =============================================================================================
INSERT INTO ids SELECT 'sp', pg_temp.approved_plan();
SAVEPOINT before_start;
SELECT ok(pgfence.plan_start(pg_temp.id('sp'), 'tap-ps') IS NOT NULL, 'a plan starts inside a savepoint');
SELECT is(pg_temp.events('plan', pg_temp.id('sp')), 3, '... its start event is there (propose, approve, start)');
ROLLBACK TO SAVEPOINT before_start;
SELECT is(pg_temp.events('plan', pg_temp.id('sp')), 2, 'rolled back: the start event went with it');
SAVEPOINT before_claim;
SELECT is((SELECT fence FROM pgfence.operation_claim('tap-os', ARRAY['tap-au.reset'])), 2, 'an operation is claimed inside a savepoint');
ROLLBACK TO SAVEPOINT before_claim;
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'operation' AND item_id = pg_temp.id('op') AND actor = 'tap-os'), 0,
  'rolled back: no claim event');
SELECT tap_helpers.peer('c1');
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE peer_op AS
  SELECT id FROM dblink('c1', $$SELECT id FROM pgfence.operation_request('tap-au.peer', 'rolled-back', '{}', NULL, 'tap-peer')$$) AS t(id bigint);
SELECT is(tap_helpers.peer_value('c1', format('SELECT count(*) FROM pgfence.event WHERE module = %L AND item_id = %s', 'operation', (SELECT id FROM peer_op))), '1',
  'a second session requests an operation: its transaction sees the request event');
SELECT dblink_exec('c1', 'ROLLBACK');
SELECT is(tap_helpers.peer_value('c1', format('SELECT count(*) FROM pgfence.event WHERE module = %L AND item_id = %s', 'operation', (SELECT id FROM peer_op))), '0',
  'that transaction rolled back: no event is left, seen from any session');

-- =============================================================================================
-- The monitoring role reads, never writes
-- =============================================================================================
SELECT pg_temp.id('msg') AS msg_id, pg_temp.id('live') AS live_id, pg_temp.id('logged') AS logged_id, pg_temp.id('op') AS op_id \gset
SET ROLE pg_monitor;
SELECT lives_ok($$SELECT count(*) FROM pgfence.audit_stuck$$, 'pg_monitor reads audit_stuck');
SELECT lives_ok($$SELECT count(*) FROM pgfence.audit_duplicates$$, 'pg_monitor reads audit_duplicates');
SELECT lives_ok($$SELECT count(*) FROM pgfence.audit_queue_health$$, 'pg_monitor reads audit_queue_health');
SELECT lives_ok($$SELECT count(*) FROM pgfence.audit_documents$$, 'pg_monitor reads audit_documents');
SELECT is((SELECT count(*)::int FROM pgfence.audit_owned), 3, 'pg_monitor reads audit_owned');
SELECT is((SELECT count(*)::int FROM pgfence.audit_timeline('outbox', :msg_id)), 5, 'pg_monitor reads a timeline');
SELECT is((SELECT owner FROM pgfence.audit_owner_of('outbox', :live_id)), 'tap-w9', 'pg_monitor asks who owns a message');
SELECT throws_ok($$SELECT count(*) FROM pgfence.outbox$$, '42501', NULL, 'pg_monitor may not read a table directly');
SELECT throws_ok($$SELECT count(*) FROM pgfence.event$$, '42501', NULL, '... not even the event log');
SELECT throws_ok(format('UPDATE pgfence.outbox SET next_attempt_at = now() WHERE id = %s', :logged_id), '42501', NULL, 'pg_monitor may not write a table');
SELECT throws_ok(format('SELECT pgfence.outbox_requeue(%s)', :logged_id), '42501', NULL, 'pg_monitor may not requeue');
SELECT throws_ok($$SELECT pgfence.outbox_reap()$$, '42501', NULL, 'pg_monitor may not run a reaper');
SELECT throws_ok(format('SELECT pgfence.operation_cancel(%s)', :op_id), '42501', NULL, 'pg_monitor may not cancel');
SELECT throws_ok($$CALL pgfence.audit_purge('outbox')$$, '42501', NULL, 'pg_monitor may not purge');
RESET ROLE;

-- =============================================================================================
-- Retention: purge keeps non-terminal items
-- =============================================================================================
SELECT throws_ok($$CALL pgfence.audit_purge(NULL)$$, '22004', NULL, 'audit_purge: NULL module is 22004');
SELECT throws_ok($$CALL pgfence.audit_purge('queue')$$, '22023', NULL, 'audit_purge: unknown module is 22023');
SELECT throws_ok($$CALL pgfence.audit_purge('outbox', interval '-1 day')$$, '22023', NULL, 'audit_purge: negative older_than is 22023');
SELECT throws_ok($$CALL pgfence.audit_purge('outbox', NULL, 0)$$, '22023', NULL, 'audit_purge: batch_size 0 is 22023');
SELECT throws_ok($$CALL pgfence.audit_purge('operation')$$, '2D000', NULL, 'audit_purge inside a transaction block is 2D000 (it commits)');

-- One batch with a cutoff in the future: everything terminal is old enough.
CREATE TEMP TABLE kept_outbox AS SELECT id FROM pgfence.outbox WHERE status IN ('pending', 'processing');
CREATE TEMP TABLE terminal_outbox AS SELECT count(*)::integer AS n FROM pgfence.outbox WHERE status IN ('sent', 'failed', 'dead');
SELECT is((SELECT purged FROM pgfence._audit_purge_batch('outbox', now() + interval '1 day', 0, 1000)), (SELECT n FROM terminal_outbox),
  'an outbox purge batch deletes every terminal message finished before the cutoff');
SELECT is((SELECT array_agg(id ORDER BY id) FROM pgfence.outbox), (SELECT array_agg(id ORDER BY id) FROM kept_outbox),
  '... and keeps every pending and processing one');
SELECT is(current_setting('pgfence.purging', true) IS DISTINCT FROM 'on', true,
  'the batch deletes with pgfence.purging on only for its own duration: the setting does not leak into the caller''s transaction');
SELECT is((SELECT count(*)::int FROM pgfence.outbox_lapse WHERE message_id = pg_temp.id('msg')), 0, '... with the lapse receipts of the purged');
SELECT is(pg_temp.events('outbox', pg_temp.id('logged')), 3, '... and the events of a kept message');
SELECT results_eq($$SELECT last_id, done FROM pgfence._audit_purge_batch('outbox', now() + interval '1 day', 0, 1)$$,
  $$SELECT min(id), false FROM pgfence.outbox$$, 'a batch looks at batch_size messages and says the walk is not done');

INSERT INTO ids SELECT 'undo', pgfence.plan_compensate(pg_temp.id('done'), '[{"action": "tap-au.noop"}]', 'tap-agent');
CREATE TEMP TABLE kept_plans AS SELECT id FROM pgfence.plan WHERE status IN ('pending', 'approved', 'executing') OR id = pg_temp.id('done');
SELECT lives_ok($$SELECT pgfence._audit_purge_batch('plan', now() + interval '1 day', 0, 1000)$$, 'a plan purge batch');
SELECT is((SELECT array_agg(id ORDER BY id) FROM pgfence.plan), (SELECT array_agg(id ORDER BY id) FROM kept_plans),
  'it keeps pending, approved and executing plans, and the executed plan a pending compensation refers to');
SELECT is((SELECT count(*)::int FROM pgfence.plan_step WHERE plan_id = pg_temp.id('ext')) + pg_temp.events('plan', pg_temp.id('ext')), 0,
  'a purged plan''s steps, receipts and events are gone');
SELECT pgfence.plan_reject(pg_temp.id('undo'), 'tap-ops', 'not needed');
SELECT is((SELECT purged FROM pgfence._audit_purge_batch('plan', now() + interval '1 day', 0, 1000)), 2,
  'once the compensation is rejected, both go in one batch');

SELECT is((SELECT purged FROM pgfence._audit_purge_batch('operation', now() + interval '1 day', 0, 1000)), 1, 'an operation purge batch deletes the failed operation');
SELECT is((SELECT array_agg(id ORDER BY id) FROM pgfence.operation), ARRAY[pg_temp.id('op'), pg_temp.id('reissued')],
  '... and keeps the queued and the running one, with their events');
SELECT ok(pg_temp.events('operation', pg_temp.id('op')) > 0 AND pg_temp.events('operation', pg_temp.id('unknown')) = 0, '... events go with their operation');

SELECT is((SELECT purged FROM pgfence._audit_purge_batch('document', now() + interval '1 day', 0, 100000)), 7,
  'a document purge batch deletes the document events older than the cutoff');
SELECT results_eq($$SELECT count(*)::int, sum(version)::int FROM pgfence.document WHERE id IN (pg_temp.id('doc'), pg_temp.id('quiet'))$$,
  $$VALUES (2, 4)$$, '... the documents stay, at their versions');
SELECT is((SELECT count(*)::int FROM pgfence.document_revision WHERE document_id = pg_temp.id('doc')), 3, '... and so do their revisions (the save receipts)');

-- The procedure itself, in a second session (it commits): batches of 2, keeps the pending one.
SELECT is(tap_helpers.peer_value('c1', $$SELECT count(*) FROM pgfence.outbox_enqueue_many('tap-au-purge', ARRAY['a', 'b', 'c', 'd', 'e'], ARRAY['{}', '{}', '{}', '{}', '{}']::jsonb[])$$), '5',
  'a second session commits 5 messages ...');
SELECT is(tap_helpers.peer_value('c1', $$SELECT count(pgfence.outbox_mark_sent(c.id, c.attempt)) FROM pgfence.outbox_claim('tap-au-p', 5, ARRAY['tap-au-purge']) AS c$$), '5',
  '... sends them ...');
SELECT ok(tap_helpers.peer_value('c1', $$SELECT pgfence.outbox_enqueue('tap-au-purge', 'f', '{}')$$) IS NOT NULL, '... and commits a sixth, pending');
SELECT is((SELECT purged FROM dblink('c1', $$CALL pgfence.audit_purge('outbox', interval '0 seconds', 2)$$) AS t(purged bigint)), 5::bigint,
  'CALL audit_purge(outbox, 0 seconds, batch 2) deletes the 5 sent messages in several committed batches');
SELECT is(tap_helpers.peer_value('c1', $$SELECT string_agg(status, ',') FROM pgfence.outbox WHERE channel = 'tap-au-purge'$$), 'pending',
  '... and keeps the pending one');
SELECT dblink_exec('c1', $$SET pgfence.purging = on; DELETE FROM pgfence.outbox WHERE channel = 'tap-au-purge'$$);
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
