-- pgTAP: the operation claim hint (functions/32_operation_claim.sql,
-- docs/design.md#operation-claim-hint). A claim walks its kinds' queue from its session's hint, an
-- id below which no fresh request of the scope is queued, instead of the front; a request gets its
-- id after its xid, so it lands above any hint that may be used; requeued operations (old ids,
-- below the hint) are taken from their own index; what the hint cannot see (a skipped locked row)
-- is found by the full walk at least once per pgfence.claim_full_walk_ms.
-- As tests/pgtap/12_outbox_claim_hint.sql: the claims run in a real second session ('cl',
-- autocommit: a hint moves only across transactions), 'ad' commits the fixtures, 'wr' holds a
-- writer's transaction open; no BEGIN ... ROLLBACK (a hint never passes a transaction that had
-- its xid before the candidate, and a pgTAP transaction holds one from its first statement).
-- Every kind is this file's own (tap.oh-*), its operations purged at the end.
\ir helpers/setup.sql
SELECT plan(32);

SELECT tap_helpers.peer('cl'), tap_helpers.peer('ad'), tap_helpers.peer('wr');
-- the safety net out of the way, except where it is the subject
SELECT dblink_exec('cl', $$SET pgfence.claim_full_walk_ms = 60000$$);

-- A claim of p_batch operations of p_kind (NULL = all kinds) in 'cl' (its own transaction):
-- the ids, in the order returned.
CREATE FUNCTION pg_temp.oclaim(p_kinds text[], p_batch int) RETURNS bigint[] LANGUAGE sql AS $f$
  SELECT coalesce(x, '{}')::bigint[] FROM dblink('cl', format(
    $$SELECT array_agg(id)::text FROM pgfence.operation_claim('tap-oh-cl', %L::text[], '1 hour', %s)$$,
    p_kinds, p_batch)) AS t(x text)
$f$;
-- 'cl's hint state of a scope (6 numbers, NULL elements = none), NULL when it has none.
CREATE FUNCTION pg_temp.ostate(p_scope text) RETURNS bigint[] LANGUAGE sql AS $f$
  SELECT string_to_array(x, ',', '')::bigint[]
  FROM dblink('cl', format($$SELECT current_setting(%L, true)$$, 'pgfence.operation_claim_hint_' || p_scope)) AS t(x text)
$f$;
CREATE FUNCTION pg_temp.ohint(p_kind text) RETURNS bigint LANGUAGE sql AS $f$
  SELECT (pg_temp.ostate(md5(p_kind)))[1]
$f$;
-- n operations of p_kind requested and committed by p_peer; their ids.
CREATE FUNCTION pg_temp.oreq(p_kind text, p_n int, p_peer text DEFAULT 'ad') RETURNS bigint[] LANGUAGE sql AS $f$
  SELECT x::bigint[] FROM dblink(p_peer, format(
    $$SELECT array_agg(r.id ORDER BY g)::text FROM generate_series(1, %s) g,
             LATERAL pgfence.operation_request(%L, format('t-%%s-%%s', g, clock_timestamp())) r$$, p_n, p_kind)) AS t(x text)
$f$;
CREATE FUNCTION pg_temp.oval(p_peer text, p_sql text) RETURNS bigint LANGUAGE sql AS $f$
  SELECT x::bigint FROM dblink(p_peer, p_sql) AS t(x text)
$f$;

-- ---------------------------------------------------------------------------------------------
-- Soundness premises: ids from a sequence without a cache; requests take their xid before
-- ---------------------------------------------------------------------------------------------
SELECT is((SELECT cache_size FROM pg_sequences
           WHERE format('%I.%I', schemaname, sequencename)::regclass = pg_get_serial_sequence('pgfence.operation', 'id')::regclass),
          1::bigint, 'operation ids come from a sequence with CACHE 1 (a cache would hand out ids below a hint)');
SELECT ok(pg_get_functiondef('pgfence.operation_request(text, text, jsonb, text, text)'::regprocedure)
            ~ 'v_xid := pg_current_xact_id\(\);\s+FOR v_try IN 1\.\.5 LOOP\s+INSERT INTO pgfence\.operation',
          'operation_request takes its xid before its INSERT draws the id');

-- ---------------------------------------------------------------------------------------------
-- The hint moves up behind the claims, per scope, and the walk starts there
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE mv AS SELECT pg_temp.oreq('tap.oh-move', 30) AS ids;
SELECT pg_temp.oclaim('{tap.oh-move}', 10)::text AS mv1 \gset
SELECT pg_temp.oclaim('{tap.oh-move}', 10)::text AS mv2 \gset
SELECT pg_temp.oclaim('{tap.oh-move}', 10)::text AS mv3 \gset
SELECT is(ARRAY[:'mv1'::bigint[], :'mv2'::bigint[], :'mv3'::bigint[]], (SELECT ARRAY[ids[1:10], ids[11:20], ids[21:30]] FROM mv),
  'three claims of 10 get the 30, each once, in request order');
SELECT ok(pg_temp.ohint('tap.oh-move') > (SELECT ids[10] FROM mv), 'the hint of the kind is above the operations claimed two claims ago');
SELECT is(pg_temp.oclaim('{tap.oh-move}', 10), '{}'::bigint[], 'nothing is left');
-- a set of kinds: one scope whatever the order and repeats; the union claimed in id order
CREATE TEMP TABLE ms AS SELECT pg_temp.oreq('tap.oh-set1', 10) || pg_temp.oreq('tap.oh-set2', 10) AS ids;
SELECT pg_temp.oclaim('{tap.oh-set2,tap.oh-set1}', 8)::text AS ms1 \gset
SELECT pg_temp.oclaim('{tap.oh-set1,tap.oh-set2,tap.oh-set1}', 8)::text AS ms2 \gset
SELECT pg_temp.oclaim('{tap.oh-set1,tap.oh-set2}', 8)::text AS ms3 \gset
SELECT is(:'ms1'::bigint[] || :'ms2'::bigint[] || :'ms3'::bigint[], (SELECT ids FROM ms), 'claims of a kind set get the union in id order, each once');
SELECT is((pg_temp.ostate(md5('tap.oh-set1,tap.oh-set2')))[1], (SELECT ids[16] FROM ms),
  'the set has one hint, moved behind them (to the second claim''s last: the third, short, saw all)');
SELECT is(pg_temp.ostate(md5('tap.oh-set2,tap.oh-set1')), NULL, '... named by the sorted set');
-- all kinds: its own scope
CREATE TEMP TABLE al AS SELECT pg_temp.oreq('tap.oh-all', 6) AS ids;
SELECT ok(pg_temp.oclaim(NULL, 3) IS NOT NULL AND pg_temp.oclaim(NULL, 3) IS NOT NULL AND pg_temp.oclaim(NULL, 3) IS NOT NULL,
  'claims of all kinds');
SELECT isnt(pg_temp.ostate('all'), NULL, 'all kinds have a scope of their own (pgfence.operation_claim_hint_all)');
SELECT is((SELECT count(*)::int FROM pgfence.operation WHERE id = ANY ((SELECT ids FROM al)::bigint[]) AND status = 'queued'), 0,
  '... and got every operation of the kind');

-- ---------------------------------------------------------------------------------------------
-- A writer that had its xid before the hint and commits after: the hint waits for it
-- ---------------------------------------------------------------------------------------------
SELECT dblink_exec('wr', 'BEGIN');
SELECT pg_temp.oval('wr', $$SELECT id FROM pgfence.operation_request('tap.oh-early', 'early')$$) AS early_id \gset
CREATE TEMP TABLE ea AS SELECT pg_temp.oreq('tap.oh-early', 20) AS ids;
SELECT pg_temp.oclaim('{tap.oh-early}', 5)::text AS ea1 \gset
SELECT pg_temp.oclaim('{tap.oh-early}', 5)::text AS ea2 \gset
SELECT pg_temp.oclaim('{tap.oh-early}', 5)::text AS ea3 \gset
SELECT pg_temp.oclaim('{tap.oh-early}', 5)::text AS ea4 \gset
SELECT is(:'ea1'::bigint[] || :'ea2'::bigint[] || :'ea3'::bigint[] || :'ea4'::bigint[], (SELECT ids FROM ea),
  'claims get the committed requests, not the open writer''s');
SELECT is(pg_temp.ohint('tap.oh-early'), NULL, 'while a writer older than every candidate is open, no candidate is promoted');
SELECT dblink_exec('wr', 'COMMIT');
SELECT is(pg_temp.oclaim('{tap.oh-early}', 10), ARRAY[:early_id::bigint], 'once it commits, the next claim gets it (its id is below the candidates)');

-- ---------------------------------------------------------------------------------------------
-- A writer that began before the hint (its snapshot taken) and requests after: its id is above
-- ---------------------------------------------------------------------------------------------
SELECT dblink_exec('wr', 'BEGIN ISOLATION LEVEL REPEATABLE READ');
SELECT pg_temp.oval('wr', $$SELECT count(*) FROM pgfence.operation$$) IS NOT NULL AS snapshot_taken;
CREATE TEMP TABLE la AS SELECT pg_temp.oreq('tap.oh-late', 20) AS ids;
SELECT pg_temp.oclaim('{tap.oh-late}', 5) IS NOT NULL AS c FROM generate_series(1, 4);
SELECT ok(pg_temp.ohint('tap.oh-late') > (SELECT ids[10] FROM la), 'the hint moved above ten claimed operations');
SELECT pg_temp.oval('wr', $$SELECT id FROM pgfence.operation_request('tap.oh-late', 'late')$$) AS late_id \gset
SELECT dblink_exec('wr', 'COMMIT');
SELECT ok(:late_id > pg_temp.ohint('tap.oh-late'), 'a request from a transaction begun before the hint gets an id above it');
SELECT is(pg_temp.oclaim('{tap.oh-late}', 10), ARRAY[:late_id::bigint], '... and the next claim gets it');

-- ---------------------------------------------------------------------------------------------
-- A requeued operation keeps its old id, below the hint: taken from its own index, first
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE rq AS SELECT pg_temp.oreq('tap.oh-requeue', 21) AS ids;
SELECT is(pg_temp.oval('ad', $$SELECT id FROM pgfence.operation_claim('tap-oh-ad', '{tap.oh-requeue}', '1 hour', 1)$$),
  (SELECT ids[1] FROM rq), 'another worker claims the first');
SELECT pg_temp.oclaim('{tap.oh-requeue}', 5) IS NOT NULL AS c FROM generate_series(1, 3);
SELECT ok(pg_temp.ohint('tap.oh-requeue') > (SELECT ids[1] FROM rq), 'the hint passes it');
SELECT dblink_exec('ad', format($$UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = %s$$, (SELECT ids[1] FROM rq)));
SELECT is(pg_temp.oval('ad', $$SELECT pgfence.operation_reap()$$), 1::bigint, 'its lease lapses before its call: the reaper requeues it');
SELECT is(pg_temp.oclaim('{tap.oh-requeue}', 2), (SELECT ARRAY[ids[1], ids[17]] FROM rq),
  'the next claim gets it first (below the hint), then the queue from the hint');

-- ---------------------------------------------------------------------------------------------
-- A candidate taken by a transaction that had its xid before its walk (a lapsed lease locked
-- first) still passes: a later claim's walk gives it its bound
-- ---------------------------------------------------------------------------------------------
SELECT (pg_temp.oreq('tap.oh-bound', 1))[1] AS bound_first \gset
SELECT is(pg_temp.oclaim('{tap.oh-bound}', 1), ARRAY[:bound_first::bigint], 'cl claims one ...');
SELECT dblink_exec('ad', format($$UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = %s$$, :bound_first));
CREATE TEMP TABLE bd AS SELECT pg_temp.oreq('tap.oh-bound', 20) AS ids;
SELECT is(pg_temp.oclaim('{tap.oh-bound}', 5), (SELECT ARRAY[:bound_first::bigint] || ids[1:4] FROM bd),
  '... its lease lapses: the next claim takes it over first (its xid before the queue walk), then four');
SELECT pg_temp.oclaim('{tap.oh-bound}', 5) IS NOT NULL AS c FROM generate_series(1, 3);
SELECT ok(pg_temp.ohint('tap.oh-bound') >= (SELECT ids[4] FROM bd), 'claims without a lapsed lease still move the hint past that candidate');

-- ---------------------------------------------------------------------------------------------
-- A row skipped because it was locked: its locker holds an xid, so the hint waits for it
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE rb AS SELECT pg_temp.oreq('tap.oh-rb', 21) AS ids;
SELECT dblink_exec('wr', 'BEGIN');
SELECT is(pg_temp.oval('wr', $$SELECT id FROM pgfence.operation_claim('tap-oh-wr', '{tap.oh-rb}', '1 hour', 1)$$),
  (SELECT ids[1] FROM rb), 'a claimer locks the first ...');
SELECT pg_temp.oclaim('{tap.oh-rb}', 5) IS NOT NULL AS c FROM generate_series(1, 3);
SELECT ok(coalesce(pg_temp.ohint('tap.oh-rb') <= (SELECT ids[1] FROM rb), true), '... the others'' claims skip it, and the hint does not pass it while it is locked');
SELECT dblink_exec('wr', 'ROLLBACK');
SELECT ok((SELECT ids[1] FROM rb) = ANY (pg_temp.oclaim('{tap.oh-rb}', 10)), 'the claimer rolls back: the next claim gets it');

-- ---------------------------------------------------------------------------------------------
-- The safety net: an operation below the hint (as if the hint had missed it) is claimed by the
-- first claim after pgfence.claim_full_walk_ms; a forged or stale setting never raises
-- ---------------------------------------------------------------------------------------------
CREATE TEMP TABLE sn AS SELECT pg_temp.oreq('tap.oh-net', 3) AS ids;
SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, %L, false)$$, 'pgfence.operation_claim_hint_' || md5('tap.oh-net'),
  format('%s,,,,,%s', (SELECT ids[2] FROM sn), (extract(epoch FROM clock_timestamp()) * 1000000)::bigint)));
SELECT dblink_exec('cl', $$SET pgfence.claim_full_walk_ms = 300$$);
SELECT is(pg_temp.oclaim('{tap.oh-net}', 10), (SELECT ids[2:3] FROM sn), 'with a hint above the first, a claim starts at the hint ...');
SELECT pg_sleep(0.35);
SELECT is(pg_temp.oclaim('{tap.oh-net}', 10), (SELECT ids[1:1] FROM sn), '... and the first claim after the bound walks from the front');

CREATE TEMP TABLE fg AS SELECT pg_temp.oreq('tap.oh-forge', 3) AS ids;
SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, 'not a hint', false)$$, 'pgfence.operation_claim_hint_' || md5('tap.oh-forge')));
SELECT is(pg_temp.oclaim('{tap.oh-forge}', 1), (SELECT ids[1:1] FROM fg), 'a malformed hint reads as none');
SELECT tap_helpers.peer_value('cl', format($$SELECT set_config(%L, %L, false)$$, 'pgfence.operation_claim_hint_' || md5('tap.oh-forge'),
  format('%s,,,,,999999999999999999', (SELECT ids[3] FROM fg))));
SELECT is(pg_temp.oclaim('{tap.oh-forge}', 1), (SELECT ids[2:2] FROM fg), 'a full walk stamped after the clock: a walk from the front');
SELECT dblink_exec('cl', $$SET pgfence.claim_full_walk_ms = 'soon'$$);
SELECT is(pg_temp.oclaim('{tap.oh-forge}', 5), (SELECT ids[3:3] FROM fg), 'a malformed bound is the default');

SELECT dblink_exec('ad', $$SET pgfence.purging = on; DELETE FROM pgfence.operation WHERE kind LIKE 'tap.oh-%'$$);
SELECT tap_helpers.close_peers();
SELECT * FROM finish();
