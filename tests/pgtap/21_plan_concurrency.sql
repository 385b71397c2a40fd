-- pgTAP: Module 2 — plan, the cells of one session that commits, so that they run in a dblink
-- peer: CALL plan_execute (one transaction per step), a runner killed in the middle of a step,
-- a receipt written only in the transaction that began its step. The races between two
-- sessions (two starters, two processes under one name, SKIP LOCKED claims, two CALLs at once,
-- a canceled step, lazy heal next to a live step, NOTIFY) are isolation specs:
-- tests/isolation/specs/plan-concurrency.spec.
-- Fixtures are committed through dblink peers (names tap-pc-*), and deleted at the end. The
-- main session only reads committed fixtures, never locks them; it holds one advisory lock, the
-- gate that keeps the killed runner in the middle of its step (tap_pc_put's "gate" argument).
BEGIN;
\ir helpers/setup.sql
SELECT plan(31);

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

SELECT dblink_exec('c0', $$
  CREATE TABLE public.tap_pc_t (k text PRIMARY KEY, txid bigint NOT NULL, pid int NOT NULL);
  CREATE FUNCTION public.tap_pc_put(p jsonb) RETURNS jsonb LANGUAGE plpgsql SET search_path = public AS $f$
  BEGIN
    IF p ? 'gate' THEN
      PERFORM pg_advisory_xact_lock_shared((p ->> 'gate')::bigint);  -- wait while someone holds the gate
    END IF;
    INSERT INTO tap_pc_t VALUES (p ->> 'k', txid_current(), pg_backend_pid());
    RETURN jsonb_build_object('k', p ->> 'k', 'txid', txid_current());
  END $f$;
  DO $d$ BEGIN
    PERFORM pgfence.plan_register_action('tap-pc-put', 'public.tap_pc_put(jsonb)', 'insert a row, after waiting for an optional gate');
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
-- A runner killed in the middle of a step: committed steps keep their receipts, the step in
-- flight leaves neither effect nor receipt, the run is marked interrupted, the worker is refused
-- =============================================================================================
-- Step 2 waits for the gate (advisory lock 21) that this session holds until its ROLLBACK.
SELECT pg_advisory_xact_lock(21);
SELECT pg_temp.approved('kill', '[{"action": "tap-pc-put", "args": {"k": "k1"}}, {"action": "tap-pc-put", "args": {"k": "k2", "gate": 21}},
                                  {"action": "tap-pc-put", "args": {"k": "k3"}}]');
CREATE TEMP TABLE victim AS SELECT tap_helpers.peer_value('c1', 'SELECT pg_backend_pid()')::int AS pid;
SELECT dblink_send_query('c1', format('CALL pgfence.plan_execute(%s, %L)', pg_temp.pid('kill'), 'tap-pc-killed'));
-- Wait until step 2 waits for this session's lock, inside its transaction: the lock table says
-- so (pg_blocking_pids), read afresh on each round; bounded (1000 rounds).
CREATE FUNCTION pg_temp.blocked_by_me(p_pid integer) RETURNS boolean LANGUAGE plpgsql AS $$
BEGIN
  FOR i IN 1 .. 1000 LOOP
    IF pg_backend_pid() = ANY (pg_blocking_pids(p_pid)) THEN
      RETURN true;
    END IF;
    PERFORM pg_sleep(0.01);
  END LOOP;
  RETURN false;
END $$;
SELECT ok(pg_temp.blocked_by_me((SELECT pid FROM victim)), 'the runner is in step 2, waiting for the gate this session holds');
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
-- A receipt is written only in the transaction that began the step
-- =============================================================================================
SELECT pg_temp.approved('stamp', '[{"action": "tap-pc-put", "args": {"k": "s1"}}]');
SELECT is(tap_helpers.peer_value('c1', format('SELECT pgfence.plan_start(%s, %L)', pg_temp.pid('stamp'), 'tap-pc-stamp')), '1', 'start stamp');
SELECT is(tap_helpers.peer_value('c1', format('SELECT step_index FROM pgfence._plan_step_begin(%s, %L, 1)', pg_temp.pid('stamp'), 'tap-pc-stamp')), '1',
  'one transaction begins step 1 and commits without running it');
SELECT results_eq(format('SELECT step_begun, next_step, (SELECT outcome FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.step_index = 1) FROM pgfence.plan p WHERE id = %s', pg_temp.pid('stamp')),
  $$VALUES (NULL::integer, 1, NULL::text)$$, '... it wrote nothing: its stamp was its lock on the step''s row, gone with its commit');
SELECT throws_ok(format($q$SELECT * FROM dblink('c1', %L) AS t(x text)$q$,
                        format('SELECT pgfence._plan_step_finish(%s, %L, 1, 1, true, %L, NULL)', pg_temp.pid('stamp'), 'tap-pc-stamp', '{"k": "forged"}')),
  'PF107', NULL, 'a later transaction cannot write the receipt of that step: PF107');
SELECT is(tap_helpers.peer_value('c1', format('SELECT outcome FROM pgfence.plan_run_step(%s, %L, 1)', pg_temp.pid('stamp'), 'tap-pc-stamp')), 'ok',
  'plan_run_step in a new transaction begins it again, runs it and writes the receipt');
SELECT results_eq(format('SELECT r.output ->> ''k'', (SELECT count(*)::int FROM public.tap_pc_t WHERE k = ''s1'') FROM pgfence.plan_receipts r WHERE r.plan_id = %s', pg_temp.pid('stamp')),
  $$VALUES ('s1'::text, 1)$$, '... the receipt is the real one, with the step''s effect');

-- =============================================================================================
-- The approval's cross-check (migration 0034): a plan proposed and approved in two transactions
-- is version_checked when every recorded function row is still current with its recorded md5;
-- only then do its steps skip the md5 by row version
-- =============================================================================================
SELECT dblink_exec('c0', $$
  CREATE FUNCTION public.tap_pc_ver(p jsonb) RETURNS jsonb LANGUAGE sql AS $f$ SELECT jsonb_build_object('ver', 1) $f$;
  DO $d$ BEGIN PERFORM pgfence.plan_register_action('tap-pc-ver', 'public.tap_pc_ver(jsonb)', 'answer with a version'); END $d$;
$$);
-- Propose through c0, run p_between through c0, approve through c0: three transactions.
CREATE FUNCTION pg_temp.approved_after(p_name text, p_steps text, p_between text) RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v bigint;
BEGIN
  v := tap_helpers.peer_value('c0', format('SELECT pgfence.plan_propose(%L, %L)', p_steps, 'tap-pc-agent'))::bigint;
  PERFORM dblink_exec('c0', format(p_between, v));  -- %1$s: the plan's id
  PERFORM tap_helpers.peer_value('c0', format('SELECT pgfence.plan_approve(%s, %L)', v, 'tap-pc-alice'));
  INSERT INTO ids VALUES (p_name, v);
  RETURN v;
END $$;
CREATE FUNCTION pg_temp.run_step(p_name text) RETURNS text LANGUAGE sql AS $$
  SELECT tap_helpers.peer_value('c1', format(
    'SELECT concat_ws(%L, outcome, output, error ->> %L) FROM pgfence.plan_run_step(%s, %L, pgfence.plan_start(%s, %L))',
    ' ', 'sqlstate', pg_temp.pid(p_name), 'tap-pc-ver', pg_temp.pid(p_name), 'tap-pc-ver'))
$$;
SELECT pg_temp.approved('ver-ok', '[{"action": "tap-pc-ver"}]');
SELECT results_eq(format('SELECT p.version_checked, s.function_xmin IS NOT NULL FROM pgfence.plan p JOIN pgfence.plan_step s ON s.plan_id = p.id WHERE p.id = %s', pg_temp.pid('ver-ok')),
  $$VALUES (true, true)$$, 'proposed, then approved in another transaction, its function row unchanged: version_checked');
SELECT dblink_exec('c0', format($$BEGIN; SET LOCAL session_replication_role = replica;
  UPDATE pgfence.plan_step SET function_md5 = md5('not the definition') WHERE plan_id = %s; COMMIT$$, pg_temp.pid('ver-ok')));
SELECT is(pg_temp.run_step('ver-ok'), 'ok {"ver": 1}', '... its step skips the md5 (a spoilt recorded md5 is not even read) and runs');
INSERT INTO ids SELECT 'ver-rr', tap_helpers.peer_value('c0', $q$SELECT pgfence.plan_propose('[{"action": "tap-pc-ver"}]', 'tap-pc-agent')$q$)::bigint;
SELECT dblink_exec('c0', format($$BEGIN ISOLATION LEVEL REPEATABLE READ;
  DO $d$ BEGIN PERFORM pgfence.plan_approve(%s, 'tap-pc-alice'); END $d$; COMMIT$$, pg_temp.pid('ver-rr')));
SELECT results_eq(format('SELECT status, version_checked FROM pgfence.plan WHERE id = %s', pg_temp.pid('ver-rr')),
  $$VALUES ('approved'::text, false)$$, 'approved under REPEATABLE READ (a snapshot that can be older than the cache): not version_checked');
-- The hole the cross-check closes: the proposal's md5 (from the catalog cache) and row version
-- (from its snapshot) disagree when a replacement commits between becoming visible and sending
-- its cache invalidations. Here made by hand: the recorded md5 spoilt between proposal and approval.
SELECT pg_temp.approved_after('ver-md5', '[{"action": "tap-pc-ver"}]',
  $r$BEGIN; SET LOCAL session_replication_role = replica;
     UPDATE pgfence.plan_step SET function_md5 = md5('an older definition') WHERE plan_id = %1$s; COMMIT$r$);
SELECT is((SELECT version_checked FROM pgfence.plan WHERE id = pg_temp.pid('ver-md5')), false,
  'its recorded row current but its definition not hashing to the recorded md5 at approval: not version_checked');
SELECT is(pg_temp.run_step('ver-md5'), 'error PF108', '... its step computes the md5 although its row is the recorded version: error receipt PF108');
SELECT pg_temp.approved_after('ver-diff', '[{"action": "tap-pc-ver"}]',
  $r$CREATE OR REPLACE FUNCTION public.tap_pc_ver(p jsonb) RETURNS jsonb LANGUAGE sql AS $f$ SELECT jsonb_build_object('ver', 2, 'evil', true) $f$ $r$);
SELECT is((SELECT version_checked FROM pgfence.plan WHERE id = pg_temp.pid('ver-diff')), false,
  'its function replaced by another definition between proposal and approval: approved, not version_checked');
SELECT is(pg_temp.run_step('ver-diff'), 'error PF108', '... its step computes the md5: error receipt PF108');
SELECT pg_temp.approved_after('ver-same', '[{"action": "tap-pc-ver"}]',
  $r$CREATE OR REPLACE FUNCTION public.tap_pc_ver(p jsonb) RETURNS jsonb LANGUAGE sql AS $f$ SELECT jsonb_build_object('ver', 2, 'evil', true) $f$ $r$);
SELECT is((SELECT version_checked FROM pgfence.plan WHERE id = pg_temp.pid('ver-same')), false,
  'replaced by an identical definition between proposal and approval (a new row version): not version_checked');
SELECT is(pg_temp.run_step('ver-same'), 'ok {"ver": 2, "evil": true}', '... its step computes the md5, the same: it runs');

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
DROP FUNCTION public.tap_pc_ver(jsonb);
