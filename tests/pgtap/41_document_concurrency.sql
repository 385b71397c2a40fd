-- pgTAP: Module 4 — documents, the cells that need two sessions at once (dblink peers).
-- Fixtures are committed by the peers (documents created by 'tap-conc') and removed at the end
-- with session_replication_role = replica: the guards refuse any DELETE, on purpose.
BEGIN;
\ir helpers/setup.sql
SELECT plan(20);

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

CREATE TEMP TABLE doc AS
SELECT * FROM dblink('c0', $$SELECT pgfence.document_create('record', '{"n": 0}', 'tap-conc')$$) AS t(id bigint);
-- dblink wants one more dblink_get_result (an empty one) before a connection is reused.
CREATE FUNCTION pg_temp.drain(p_conn text) RETURNS void LANGUAGE plpgsql AS $f$
BEGIN
  PERFORM * FROM dblink_get_result(p_conn) AS t(x text);
END $f$;
CREATE FUNCTION pg_temp.q(p_sql text) RETURNS text LANGUAGE sql AS $f$ SELECT format(p_sql, (SELECT id FROM doc)) $f$;

-- =============================================================================================
-- Two saves on the same version at the same time: exactly one wins, the other is a conflict
-- that carries the winner's content
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE s1 AS SELECT * FROM dblink('c1', pg_temp.q($$SELECT outcome, version FROM pgfence.document_save(%s, 1, '{"n": 1, "by": "c1"}', 'c1')$$))
  AS t(outcome text, version bigint);
SELECT dblink_send_query('c2', pg_temp.q($$SELECT outcome, version, content FROM pgfence.document_save(%s, 1, '{"n": 1, "by": "c2"}', 'c2')$$));
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'the second save on version 1 waits for the first one''s row lock');
SELECT dblink_exec('c1', 'COMMIT');
CREATE TEMP TABLE s2 AS SELECT * FROM dblink_get_result('c2') AS t(outcome text, version bigint, content jsonb);
SELECT pg_temp.drain('c2');
SELECT results_eq($$SELECT outcome, version FROM s1$$, $$VALUES ('saved'::text, 2::bigint)$$, 'the first save wins: version 2');
SELECT results_eq($$SELECT outcome, version, content FROM s2$$, $$VALUES ('conflict'::text, 2::bigint, '{"n": 1, "by": "c1"}'::jsonb)$$,
  'the waiting save is answered conflict with version 2 and the winner''s content (no lost update, no error)');
SELECT results_eq($$SELECT version, content FROM pgfence.document_get((SELECT id FROM doc))$$,
  $$VALUES (2::bigint, '{"n": 1, "by": "c1"}'::jsonb)$$, 'the stored document is the winner''s');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM doc) AND event = 'conflict' AND actor = 'c2'), 1,
  'the loser''s conflict is in the event log');

-- =============================================================================================
-- A retry sent while the first attempt is still running (same save_id): answered from the
-- first attempt's receipt once it commits — saved, never a false conflict
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
SELECT * FROM dblink('c1', pg_temp.q($$SELECT outcome FROM pgfence.document_save(%s, 2, '{"n": 2}', 'c1', 'tap-conc-twin')$$)) AS t(outcome text);
SELECT dblink_send_query('c2', pg_temp.q($$SELECT outcome, version, replayed FROM pgfence.document_save(%s, 2, '{"n": 2}', 'c1', 'tap-conc-twin')$$));
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'the retry waits for the first attempt');
SELECT dblink_exec('c1', 'COMMIT');
SELECT results_eq($$SELECT * FROM dblink_get_result('c2') AS t(outcome text, version bigint, replayed boolean)$$,
  $$VALUES ('saved'::text, 3::bigint, true)$$, 'the retry is answered saved, version 3, from the receipt');
SELECT pg_temp.drain('c2');
SELECT is((SELECT count(*)::int FROM pgfence.document_history((SELECT id FROM doc))), 3, 'one version was made, not two');

-- the first attempt rolls back: the retry makes the save itself
SELECT dblink_exec('c1', 'BEGIN');
SELECT * FROM dblink('c1', pg_temp.q($$SELECT outcome FROM pgfence.document_save(%s, 3, '{"n": 3}', 'c1', 'tap-conc-rb')$$)) AS t(outcome text);
SELECT dblink_send_query('c2', pg_temp.q($$SELECT outcome, version, replayed FROM pgfence.document_save(%s, 3, '{"n": 3}', 'c1', 'tap-conc-rb')$$));
SELECT pg_sleep(0.3);
SELECT dblink_exec('c1', 'ROLLBACK');
SELECT results_eq($$SELECT * FROM dblink_get_result('c2') AS t(outcome text, version bigint, replayed boolean)$$,
  $$VALUES ('saved'::text, 4::bigint, false)$$, 'if the first attempt rolled back, the retry saves version 4 itself');
SELECT pg_temp.drain('c2');
SELECT results_eq($$SELECT save_id, content FROM pgfence.document_revision((SELECT id FROM doc), 4)$$,
  $$VALUES ('tap-conc-rb'::text, '{"n": 3}'::jsonb)$$, '... with its save_id as the receipt');

-- =============================================================================================
-- Delete racing a save
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
SELECT * FROM dblink('c1', pg_temp.q($$SELECT outcome FROM pgfence.document_delete(%s, 4, 'c1')$$)) AS t(outcome text);
SELECT dblink_send_query('c2', pg_temp.q($$SELECT outcome, version, deleted FROM pgfence.document_save(%s, 4, '{"n": 4}', 'c2')$$));
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'a save racing a delete waits');
SELECT dblink_exec('c1', 'COMMIT');
SELECT results_eq($$SELECT * FROM dblink_get_result('c2') AS t(outcome text, version bigint, deleted boolean)$$,
  $$VALUES ('conflict'::text, 5::bigint, true)$$, 'the save is answered conflict against the tombstone (version 5, deleted)');
SELECT pg_temp.drain('c2');
SELECT results_eq($$SELECT version, deleted FROM pgfence.document_get((SELECT id FROM doc))$$,
  $$VALUES (5::bigint, true)$$, 'the document stays deleted at version 5');

-- two identical deletes at once: the second one is answered deleted (replayed)
CREATE TEMP TABLE doc2 AS
SELECT * FROM dblink('c0', $$SELECT pgfence.document_create('sheet', '[1]', 'tap-conc')$$) AS t(id bigint);
SELECT dblink_exec('c1', 'BEGIN');
SELECT * FROM dblink('c1', format($$SELECT outcome FROM pgfence.document_delete(%s, 1, 'c1')$$, (SELECT id FROM doc2))) AS t(outcome text);
SELECT dblink_send_query('c2', format($$SELECT outcome, version, replayed FROM pgfence.document_delete(%s, 1, 'c1')$$, (SELECT id FROM doc2)));
SELECT pg_sleep(0.3);
SELECT dblink_exec('c1', 'COMMIT');
SELECT results_eq($$SELECT * FROM dblink_get_result('c2') AS t(outcome text, version bigint, replayed boolean)$$,
  $$VALUES ('deleted'::text, 2::bigint, true)$$, 'a delete retried while the first is running is answered deleted (replayed)');
SELECT pg_temp.drain('c2');

-- =============================================================================================
-- Create with the same idempotency key from two transactions: one document
-- =============================================================================================
SELECT dblink_exec('c1', 'BEGIN');
CREATE TEMP TABLE k1 AS SELECT * FROM dblink('c1', $$SELECT pgfence.document_create('record', '{"k": 1}', 'tap-conc', 'tap-conc-create')$$) AS t(id bigint);
SELECT dblink_send_query('c2', $$SELECT pgfence.document_create('record', '{"k": 1}', 'tap-conc', 'tap-conc-create')$$);
SELECT pg_sleep(0.3);
SELECT is(dblink_is_busy('c2'), 1, 'the second create waits on the first one''s key');
SELECT dblink_exec('c1', 'COMMIT');
SELECT is((SELECT id FROM dblink_get_result('c2') AS t(id bigint)), (SELECT id FROM k1), 'it gets the same document id');
SELECT pg_temp.drain('c2');

-- =============================================================================================
-- Many writers, each loop reads and saves by CAS (retrying on conflict): no lost update,
-- gap-free history
-- =============================================================================================
CREATE TEMP TABLE doc3 AS
SELECT * FROM dblink('c0', $$SELECT pgfence.document_create('record', '{"c1": 0, "c2": 0}', 'tap-conc')$$) AS t(id bigint);
CREATE FUNCTION pg_temp.increment_loop(p_doc bigint, p_key text, p_n int) RETURNS text LANGUAGE sql AS $f$
  SELECT format($t$DO $do$
    DECLARE v_ver bigint; v_content jsonb; v_out text; v_done int := 0;
    BEGIN
      WHILE v_done < %s LOOP
        SELECT version, content INTO v_ver, v_content FROM pgfence.document_get(%s);
        SELECT outcome INTO v_out FROM pgfence.document_save(%s, v_ver,
          jsonb_set(v_content, ARRAY[%L], to_jsonb((v_content ->> %L)::int + 1)), %L);
        IF v_out = 'saved' THEN v_done := v_done + 1; END IF;
        COMMIT;
      END LOOP;
    END $do$$t$, p_n, p_doc, p_doc, p_key, p_key, p_key)
$f$;
SELECT dblink_send_query('c1', pg_temp.increment_loop((SELECT id FROM doc3), 'c1', 200));
SELECT dblink_send_query('c2', pg_temp.increment_loop((SELECT id FROM doc3), 'c2', 200));
SELECT * FROM dblink_get_result('c1') AS t(x text);
SELECT * FROM dblink_get_result('c2') AS t(x text);
SELECT pg_temp.drain('c1'), pg_temp.drain('c2');
SELECT is((SELECT content FROM pgfence.document_get((SELECT id FROM doc3))), '{"c1": 200, "c2": 200}'::jsonb,
  'two sessions x 200 read-modify-CAS increments: both counters are 200 (no lost update)');
SELECT results_eq(
  $$SELECT count(*), min(version), max(version) FROM pgfence.document_history((SELECT id FROM doc3), 10000)$$,
  $$VALUES (401::bigint, 1::bigint, 401::bigint)$$, 'history is 401 versions, 1..401, gap-free');
SELECT is((SELECT count(*)::int FROM pgfence.event e WHERE e.module = 'document' AND e.item_id = (SELECT id FROM doc3) AND e.event = 'save'
           AND (e.detail ->> 'based_on')::bigint <> e.fence - 1), 0,
  'every saved version was a CAS on its predecessor (event log: based_on = version - 1)');

-- clean up the committed fixtures (the guards refuse DELETE; replica mode skips them)
SELECT dblink_exec('c0', $$SET session_replication_role = replica$$);
SELECT dblink_exec('c0', $$DELETE FROM pgfence.event WHERE module = 'document' AND item_id IN (SELECT id FROM pgfence.document WHERE created_by = 'tap-conc')$$);
SELECT dblink_exec('c0', $$DELETE FROM pgfence.document_revision WHERE document_id IN (SELECT id FROM pgfence.document WHERE created_by = 'tap-conc')$$);
SELECT dblink_exec('c0', $$DELETE FROM pgfence.document WHERE created_by = 'tap-conc'$$);
SELECT dblink_exec('c0', $$RESET session_replication_role$$);
SELECT is((SELECT count(*)::int FROM dblink('c0', $$SELECT 1 FROM pgfence.document WHERE created_by = 'tap-conc'$$) AS t(x int)), 0, 'fixtures removed');
SELECT tap_helpers.close_peers();

SELECT * FROM finish();
ROLLBACK;
