-- pgTAP: Module 4 — documents, many writers at once: two dblink peers run read-modify-CAS loops
-- concurrently, each commit racing the other's, and the result must not depend on how they
-- interleave. The races of two single writes (two saves on one version, a retried save, a save
-- racing a delete, repeated deletes and create keys) are isolation specs, whose interleaving is
-- fixed: tests/isolation/specs/document-concurrency.spec.
-- Fixtures are committed by the peers (documents created by 'tap-conc') and removed at the end
-- with session_replication_role = replica: the guards refuse any DELETE, on purpose.
BEGIN;
\ir helpers/setup.sql
SELECT plan(4);

SELECT tap_helpers.peer('c0');
SELECT tap_helpers.peer('c1');
SELECT tap_helpers.peer('c2');

-- dblink wants one more dblink_get_result (an empty one) before a connection is reused.
CREATE FUNCTION pg_temp.drain(p_conn text) RETURNS void LANGUAGE plpgsql AS $f$
BEGIN
  PERFORM * FROM dblink_get_result(p_conn) AS t(x text);
END $f$;

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
