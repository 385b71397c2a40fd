-- pgTAP: Module 2 — plan, the cells that need real second sessions: lost races between two
-- starters, SKIP LOCKED claims, CALL plan_execute (it commits, so it runs in a peer), a runner
-- killed in the middle of a step, lazy heal next to a live step, NOTIFY.
-- Fixtures are committed through dblink peers (names tap-pc-*), and deleted at the end. The
-- main session only reads committed fixtures, never locks them.
BEGIN;
\ir helpers/setup.sql
SELECT plan(51);

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

SELECT dblink_exec('c0', $$
  CREATE TABLE public.tap_pc_t (k text PRIMARY KEY, txid bigint NOT NULL, pid int NOT NULL);
  CREATE FUNCTION public.tap_pc_put(p jsonb) RETURNS jsonb LANGUAGE plpgsql SET search_path = public AS $f$
  BEGIN
    PERFORM pg_sleep(coalesce((p ->> 'sleep')::float8, 0));
    INSERT INTO tap_pc_t VALUES (p ->> 'k', txid_current(), pg_backend_pid());
    RETURN jsonb_build_object('k', p ->> 'k', 'txid', txid_current());
  END $f$;
  DO $d$ BEGIN
    PERFORM pgfence.plan_register_action('tap-pc-put', 'public.tap_pc_put(jsonb)', 'insert a row, after an optional sleep');
    PERFORM pgfence.plan_register_action('tap-pc-hook', NULL, 'an external step');
  END $d$;
$$);
CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
CREATE FUNCTION pg_temp.pid(p_name text) RETURNS bigint LANGUAGE sql AS $$ SELECT id FROM ids WHERE name = p_name $$;
-- Propose and approve a plan through c0 (committed); steps as JSON text.
CREATE FUNCTION pg_temp.approved(p_name text, p_steps text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v bigint;
BEGIN
  v := tap_helpers.peer_value('c0', format('SELECT pgfence.plan_propose(%L, %L)', p_steps, 'tap-pc-agent'))::bigint;
  PERFORM tap_helpers.peer_value('c0', format('SELECT pgfence.plan_approve(%s, %L)', v, 'tap-pc-alice'));
  INSERT INTO ids VALUES (p_name, v);
  RETURN v;
END $$;

-- =============================================================================================
-- Two plan_start calls at once: one wins, the other returns NULL (no error)
-- =============================================================================================
SELECT pg_temp.approved('race', '[{"action": "tap-pc-put", "args": {"k": "race"}}]');
SELECT dblink_exec('c1', 'BEGIN');
SELECT is(tap_helpers.peer_value('c1', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('race'), 'tap-pc-w1')), '1',
  'session 1 starts the plan: run token 1 (transaction still open)');
SELECT dblink_send_query('c2', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('race'), 'tap-pc-w2'));
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'session 2 waits on the row');
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT x FROM dblink_get_result('c2') AS t(x bigint)), NULL, 'after session 1 commits, session 2 loses: NULL, not an error');
SELECT * FROM dblink_get_result('c2') AS t(x bigint);  -- drain: the connection is usable again
SELECT results_eq(format('SELECT status, worker FROM pgfence.plan WHERE id = %s', pg_temp.pid('race')),
  $$VALUES ('executing'::text, 'tap-pc-w1'::text)$$, 'exactly one owner');

-- =============================================================================================
-- Two processes under one worker name (a pod that "resumes its own plans" after a restart while
-- its first incarnation still runs): the second take fences out the first, and writes an event
-- =============================================================================================
SELECT pg_temp.approved('pod', '[{"action": "tap-pc-hook", "args": {"recipient": "http://127.0.0.1:9/pod"}},
                                 {"action": "tap-pc-put", "args": {"k": "pod2"}}]');
SELECT is(tap_helpers.peer_value('c1', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('pod'), 'pod-9')), '1',
  'session 1, as pod-9, takes the run: token 1');
SELECT is(tap_helpers.peer_value('c1', format('SELECT outcome FROM pgfence.plan_run_step(%s, %L, 1)', pg_temp.pid('pod'), 'pod-9')), 'external',
  'session 1 is handed the external step 1 (it is in flight now)');
SELECT is(tap_helpers.peer_value('c2', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('pod'), 'pod-9')), '2',
  'session 2, also as pod-9, while session 1''s heartbeat is live: it re-enters under token 2');
SELECT is(tap_helpers.peer_value('c1', format('SELECT coalesce(outcome, ''refused'') FROM pgfence.plan_run_step(%s, %L, 1)', pg_temp.pid('pod'), 'pod-9')), 'refused',
  'session 1 (token 1) is no longer handed the step in flight');
SELECT is(tap_helpers.peer_value('c1', format('SELECT pgfence.plan_heartbeat(%s, %L, 1)', pg_temp.pid('pod'), 'pod-9')), 'f',
  'session 1''s heartbeat is refused: it learns that it lost the run');
SELECT is(tap_helpers.peer_value('c1', format('SELECT pgfence.plan_record_step(%s, 1, %L, 1, true, %L)', pg_temp.pid('pod'), 'pod-9', '{"by": "session 1"}')), 'f',
  'session 1''s report of the external step is refused');
SELECT is(tap_helpers.peer_value('c2', format('SELECT outcome FROM pgfence.plan_run_step(%s, %L, 2)', pg_temp.pid('pod'), 'pod-9')), 'external',
  'session 2 (token 2) is the owner: it is handed the external step (same idempotency key, at least once)');
SELECT is(tap_helpers.peer_value('c2', format('SELECT pgfence.plan_record_step(%s, 1, %L, 2, true, %L)', pg_temp.pid('pod'), 'pod-9', '{"by": "session 2"}')), 't',
  'session 2 records it');
SELECT is(tap_helpers.peer_value('c1', format('SELECT coalesce(outcome, ''refused'') FROM pgfence.plan_run_step(%s, %L, 1)', pg_temp.pid('pod'), 'pod-9')), 'refused',
  'session 1 still cannot run the next (SQL) step');
SELECT is(tap_helpers.peer_value('c2', format('SELECT outcome || ''/'' || status FROM pgfence.plan_run_step(%s, %L, 2)', pg_temp.pid('pod'), 'pod-9')), 'ok/executed',
  'session 2 runs it and the plan is executed');
SELECT results_eq(format($$SELECT step_index, output ->> 'by' FROM pgfence.plan_receipts WHERE plan_id = %s AND kind = 'external'$$, pg_temp.pid('pod')),
  $$VALUES (1, 'session 2'::text)$$, 'the receipt of the external step is session 2''s');
SELECT results_eq(format($$SELECT event, actor, (detail ->> 'previous_token')::int, (detail ->> 'token')::int, (detail ->> 'external_in_flight')::boolean
                            FROM pgfence.event WHERE module = 'plan' AND item_id = %s AND event IN ('start', 'reenter') ORDER BY id$$, pg_temp.pid('pod')),
  $$VALUES ('start'::text, 'pod-9'::text, NULL::int, 1, NULL::boolean), ('reenter', 'pod-9', 1, 2, true)$$,
  'the event log shows the start and the re-entry, with both tokens and the external step in flight');

-- =============================================================================================
-- plan_claim: two executors never take the same plan (SKIP LOCKED, no waiting)
-- =============================================================================================
SELECT pg_temp.approved('claim-a', '[{"action": "tap-pc-put", "args": {"k": "ca"}}]');
SELECT pg_temp.approved('claim-b', '[{"action": "tap-pc-put", "args": {"k": "cb"}}]');
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE got1 AS SELECT * FROM dblink('c1', $$SELECT id FROM pgfence.plan_claim('tap-pc-w1', 1)$$) AS t(id bigint);
CREATE TEMP TABLE got2 AS SELECT * FROM dblink('c2', $$SELECT id FROM pgfence.plan_claim('tap-pc-w2', 5)$$) AS t(id bigint);
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT array_agg(id) FROM got1), ARRAY[pg_temp.pid('claim-a')], 'executor 1 claims the oldest approved plan');
SELECT is((SELECT array_agg(id) FROM got2), ARRAY[pg_temp.pid('claim-b')], 'executor 2, claiming meanwhile, skips it and takes the other one');

-- =============================================================================================
-- CALL plan_execute: one transaction per step; a terminal plan answers from its receipts
-- =============================================================================================
SELECT pg_temp.approved('exec', '[{"action": "tap-pc-put", "args": {"k": "x1"}}, {"action": "tap-pc-put", "args": {"k": "x2"}},
                                  {"action": "tap-pc-put", "args": {"k": "x3"}}]');
CREATE TEMP TABLE call1 AS SELECT * FROM dblink('c0', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('exec'), 'tap-pc-runner'))
  AS t(status text, receipts jsonb);
SELECT is((SELECT status FROM call1), 'executed', 'CALL plan_execute runs the plan to executed');
SELECT is((SELECT jsonb_array_length(receipts) FROM call1), 3, '... and returns its three receipts');
SELECT is((SELECT count(DISTINCT txid)::int FROM public.tap_pc_t WHERE k LIKE 'x_'), 3, 'each step committed in its own transaction');
SELECT is((SELECT array_agg((r ->> 'output')::jsonb ->> 'txid' ORDER BY (r ->> 'step_index')::int) FROM call1, jsonb_array_elements(receipts) r),
  (SELECT array_agg(txid::text ORDER BY k) FROM public.tap_pc_t WHERE k LIKE 'x_'),
  'each receipt was written in the transaction of its step''s effect');
CREATE TEMP TABLE call2 AS SELECT * FROM dblink('c0', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('exec'), 'tap-pc-other'))
  AS t(status text, receipts jsonb);
SELECT is((SELECT status FROM call2), 'executed', 'CALL on an executed plan: still executed');
SELECT is((SELECT receipts FROM call2), (SELECT receipts FROM call1), '... it returns the same receipts');
SELECT is((SELECT count(*)::int FROM public.tap_pc_t WHERE k LIKE 'x_'), 3, '... and runs nothing');

-- =============================================================================================
-- Two runners CALL plan_execute on the same plan at once: one runs it, each step runs once
-- =============================================================================================
SELECT pg_temp.approved('duel', '[{"action": "tap-pc-put", "args": {"k": "d1", "sleep": 0.1}}, {"action": "tap-pc-put", "args": {"k": "d2", "sleep": 0.1}},
                                  {"action": "tap-pc-put", "args": {"k": "d3", "sleep": 0.1}}]');
SELECT dblink_send_query('c1', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('duel'), 'tap-pc-d1'));
SELECT dblink_send_query('c2', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('duel'), 'tap-pc-d2'));
CREATE TEMP TABLE duel AS
  SELECT 'c1' AS who, * FROM dblink_get_result('c1') AS t(status text, receipts jsonb)
  UNION ALL SELECT 'c2', * FROM dblink_get_result('c2') AS t(status text, receipts jsonb);
SELECT * FROM dblink_get_result('c1') AS t(status text, receipts jsonb);
SELECT * FROM dblink_get_result('c2') AS t(status text, receipts jsonb);
SELECT is((SELECT d.status FROM duel d WHERE 'tap-pc-d' || right(d.who, 1) = (SELECT min(worker) FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('duel'))),
  'executed', 'the call that won the run returns executed (the other one ran nothing and returned the status it saw)');
SELECT is((SELECT count(DISTINCT worker)::int FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('duel')), 1, 'all receipts are by one worker: one runner ran it');
SELECT is((SELECT count(*)::int FROM public.tap_pc_t WHERE k LIKE 'd_'), 3, 'each step ran exactly once');

-- =============================================================================================
-- An operator cancels a running step (pg_cancel_backend): error receipt 57014, not a hang
-- =============================================================================================
SELECT pg_temp.approved('cancel', '[{"action": "tap-pc-put", "args": {"k": "q1"}}, {"action": "tap-pc-put", "args": {"k": "q2", "sleep": 60}},
                                    {"action": "tap-pc-put", "args": {"k": "q3"}}]');
CREATE TEMP TABLE canceled_pid AS SELECT tap_helpers.peer_value('c1', 'SELECT pg_backend_pid()')::int AS pid;
SELECT dblink_send_query('c1', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('cancel'), 'tap-pc-canceled'));
DO $$
BEGIN
  FOR i IN 1..200 LOOP
    EXIT WHEN EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = (SELECT pid FROM canceled_pid) AND wait_event = 'PgSleep');
    PERFORM pg_sleep(0.05);
  END LOOP;
END $$;
SELECT ok(pg_cancel_backend((SELECT pid FROM canceled_pid)), 'cancel the session running step 2');
CREATE TEMP TABLE canceled AS SELECT * FROM dblink_get_result('c1') AS t(status text, receipts jsonb);
SELECT * FROM dblink_get_result('c1') AS t(status text, receipts jsonb);
SELECT is((SELECT status FROM canceled), 'failed', 'the CALL returns: the plan failed at the canceled step');
SELECT is((SELECT array_agg(r ->> 'outcome' || coalesce('/' || (r ->> 'sqlstate'), '') ORDER BY (r ->> 'step_index')::int)
           FROM canceled, jsonb_array_elements(receipts) r), ARRAY['ok', 'error/57014'],
  'step 2 has an error receipt with SQLSTATE 57014 (query_canceled); step 3 never ran');
SELECT is((SELECT array_agg(k ORDER BY k) FROM public.tap_pc_t WHERE k LIKE 'q_'), ARRAY['q1'], '... and the canceled step left no effect');

-- =============================================================================================
-- A runner killed in the middle of a step: committed steps keep their receipts, the step in
-- flight leaves neither effect nor receipt, the run is marked interrupted, the worker is refused
-- =============================================================================================
SELECT pg_temp.approved('kill', '[{"action": "tap-pc-put", "args": {"k": "k1"}}, {"action": "tap-pc-put", "args": {"k": "k2", "sleep": 60}},
                                  {"action": "tap-pc-put", "args": {"k": "k3"}}]');
CREATE TEMP TABLE victim AS SELECT tap_helpers.peer_value('c1', 'SELECT pg_backend_pid()')::int AS pid;
SELECT dblink_send_query('c1', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('kill'), 'tap-pc-killed'));
-- wait (bounded) until step 2 is sleeping inside its transaction
DO $$
BEGIN
  FOR i IN 1..200 LOOP
    EXIT WHEN EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = (SELECT pid FROM victim) AND wait_event = 'PgSleep');
    PERFORM pg_sleep(0.05);
  END LOOP;
END $$;
SELECT is((SELECT count(*)::int FROM pgfence.plan_receipts WHERE plan_id = pg_temp.pid('kill')), 1, 'while step 2 runs, step 1''s receipt is committed');
SELECT ok(pg_terminate_backend((SELECT pid FROM victim), 5000), 'kill the runner in the middle of step 2');
SELECT tap_helpers.peer('c1');  -- reconnect the killed peer
SELECT results_eq(format('SELECT step_index, outcome FROM pgfence.plan_receipts WHERE plan_id = %s', pg_temp.pid('kill')),
  $$VALUES (1, 'ok'::text)$$, 'only step 1 has a receipt');
SELECT is((SELECT array_agg(k ORDER BY k) FROM public.tap_pc_t WHERE k LIKE 'k_'), ARRAY['k1'], 'and only step 1''s effect exists: no step is effected without a receipt');
SELECT results_eq(format('SELECT status, worker FROM pgfence.plan WHERE id = %s', pg_temp.pid('kill')),
  $$VALUES ('executing'::text, 'tap-pc-killed'::text)$$, 'until its heartbeat lapses the plan is still executing by the dead runner');
SELECT dblink_exec('c0', format('UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval ''1 second'' WHERE id = %s', pg_temp.pid('kill')));
SELECT is(tap_helpers.peer_value('c2', format('SELECT status || ''/'' || failure FROM pgfence.plan_get(%s)', pg_temp.pid('kill'))), 'failed/interrupted',
  'after the lapse, plan_get reports failed (interrupted)');
SELECT is(tap_helpers.peer_value('c2', format('SELECT coalesce(outcome, ''refused'') FROM pgfence.plan_run_step(%s, %L, 1)', pg_temp.pid('kill'), 'tap-pc-killed')), 'refused',
  'a runner with the dead one''s name that comes back is refused');
SELECT is((SELECT count(*)::int FROM public.tap_pc_t WHERE k LIKE 'k_'), 1, '... and ran nothing');

-- =============================================================================================
-- Lazy heal and the reaper leave alone a run whose row a live step transaction holds
-- =============================================================================================
SELECT pg_temp.approved('held', '[{"action": "tap-pc-put", "args": {"k": "h1"}}]');
SELECT tap_helpers.peer_value('c0', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('held'), 'tap-pc-slow'));
SELECT dblink_exec('c0', format('UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval ''1 second'' WHERE id = %s', pg_temp.pid('held')));
SELECT dblink_exec('c1', 'BEGIN');
SELECT tap_helpers.peer_value('c1', format('SELECT 1 FROM pgfence.plan WHERE id = %s FOR UPDATE', pg_temp.pid('held')));  -- as a long step does
SELECT dblink_exec('c2', $$SET statement_timeout = '3s'$$);
SELECT is(tap_helpers.peer_value('c2', format('SELECT status FROM pgfence.plan_get(%s)', pg_temp.pid('held'))), 'executing',
  'plan_get does not wait for, nor heal, a row held by a live step transaction');
SELECT is(tap_helpers.peer_value('c2', 'SELECT pgfence.plan_reap_stale()'), '0', 'the reaper skips it too');
SELECT dblink_exec('c1', 'ROLLBACK');
SELECT is(tap_helpers.peer_value('c2', format('SELECT status || ''/'' || failure FROM pgfence.plan_get(%s)', pg_temp.pid('held'))), 'failed/interrupted',
  'once the row is free, the lapsed run is healed');

-- =============================================================================================
-- A receipt is written only in the transaction that began the step
-- =============================================================================================
SELECT pg_temp.approved('stamp', '[{"action": "tap-pc-put", "args": {"k": "s1"}}]');
SELECT is(tap_helpers.peer_value('c1', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('stamp'), 'tap-pc-stamp')), '1', 'start stamp');
SELECT is(tap_helpers.peer_value('c1', format('SELECT step_index FROM pgfence._plan_step_begin(%s, %L, 1)', pg_temp.pid('stamp'), 'tap-pc-stamp')), '1',
  'one transaction begins step 1 and commits without running it');
SELECT results_eq(format('SELECT step_begun, step_begun_xact IS NOT NULL FROM pgfence.plan WHERE id = %s', pg_temp.pid('stamp')),
  $$VALUES (1, true)$$, '... its stamp is committed');
SELECT throws_ok(format($q$SELECT * FROM dblink('c1', %L) AS t(x text)$q$,
                        format('SELECT pgfence._plan_step_finish(%s, %L, 1, 1, true, %L, NULL)', pg_temp.pid('stamp'), 'tap-pc-stamp', '{"k": "forged"}')),
  'PF107', NULL, 'a later transaction cannot write the receipt of that step: PF107');
SELECT is(tap_helpers.peer_value('c1', format('SELECT outcome FROM pgfence.plan_run_step(%s, %L, 1)', pg_temp.pid('stamp'), 'tap-pc-stamp')), 'ok',
  'plan_run_step in a new transaction begins it again, runs it and writes the receipt');
SELECT results_eq(format('SELECT r.output ->> ''k'', (SELECT count(*)::int FROM public.tap_pc_t WHERE k = ''s1'') FROM pgfence.plan_receipts r WHERE r.plan_id = %s', pg_temp.pid('stamp')),
  $$VALUES ('s1'::text, 1)$$, '... the receipt is the real one, with the step''s effect');

-- =============================================================================================
-- NOTIFY pgfence_plan: on approval and on release, with the id only
-- =============================================================================================
SELECT dblink_exec('c2', 'LISTEN pgfence_plan');
SELECT pg_temp.approved('note', '[{"action": "tap-pc-hook", "args": {"recipient": "http://127.0.0.1:9/n"}}]');
SELECT * FROM dblink('c2', 'SELECT 1') AS t(x int);
CREATE TEMP TABLE heard AS SELECT * FROM dblink_get_notify('c2');
SELECT is((SELECT array_agg(extra::jsonb ORDER BY extra) FROM heard WHERE notify_name = 'pgfence_plan'),
  ARRAY[jsonb_build_object('id', pg_temp.pid('note'), 'status', 'approved', 'next', NULL),
        jsonb_build_object('id', pg_temp.pid('note'), 'status', 'pending')],
  'the listener heard the proposal and the approval: id and status only');
SELECT tap_helpers.peer_value('c0', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('note'), 'tap-pc-sql'));
SELECT tap_helpers.peer_value('c0', format('SELECT pgfence.plan_release(%s, %L, 1)', pg_temp.pid('note'), 'tap-pc-sql'));
SELECT * FROM dblink('c2', 'SELECT 1') AS t(x int);
SELECT is((SELECT extra::jsonb FROM dblink_get_notify('c2') WHERE notify_name = 'pgfence_plan'),
  jsonb_build_object('id', pg_temp.pid('note'), 'status', 'executing', 'next', 'external'),
  'a release tells executors that an external step waits');

-- clean up committed fixtures
SELECT dblink_exec('c0', format($$
  SET pgfence.purging = on;  -- the delete guards let only a purge delete plans and events
  DELETE FROM pgfence.event WHERE module = 'plan' AND item_id IN (%1$s);
  DELETE FROM pgfence.plan WHERE id IN (%1$s);
  DELETE FROM pgfence.plan_action WHERE name LIKE 'tap-pc-%%';
$$, (SELECT string_agg(id::text, ',') FROM ids)));
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
-- The fixture table is dropped once this session's locks on it are gone.
DROP TABLE public.tap_pc_t;
DROP FUNCTION public.tap_pc_put(jsonb);
