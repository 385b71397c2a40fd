-- pgfence functions/93_audit_purge.sql — retention: purge finished items in short batches.
--
-- Public: CALL audit_purge(module, older_than, batch_size) -> purged
-- The only delete of the modules' items, their receipts and events: the tables refuse any
-- other DELETE (tg_purge_only, 01_core_events.sql) unless pgfence.purging is on, which only the
-- batch function _audit_purge_batch sets, for the length of one call. The procedure commits
-- after every batch (so CALL it in autocommit, 2D000 otherwise), so every lock is short; rows
-- locked by someone else (a requeue) are skipped, never waited for. For pgfence_admin only.
-- Errors: functions/ERRORS.md. Plans: docs/query-plans.md#audit.

CREATE OR REPLACE FUNCTION pgfence._audit_purge_batch(
  p_module text,
  p_cutoff timestamptz,
  p_after  bigint,
  p_batch  integer,
  OUT last_id bigint,
  OUT purged  integer,
  OUT done    boolean
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
-- The modules' tables refuse DELETE unless pgfence.purging is on (tg_purge_only). It is on for
-- this call only: set at the start, put back as it was before returning, so it cannot leak into
-- the rest of a caller's transaction (an error rolls the setting back with the batch). Not a
-- SET clause: on PostgreSQL 15 a SET clause naming a custom setting makes CREATE FUNCTION need
-- GRANT SET ON PARAMETER, which a non-superuser owner does not have.
AS $$
-- Walks the item table by primary key from p_after, p_batch rows at a time (why:
-- docs/query-plans.md#audit). Items are created in id order, and an item finishes after it was
-- created: once a whole window was created after the cutoff, nothing further can be old enough
-- (done). Rows locked by someone (a concurrent requeue) are skipped, never waited for.
DECLARE
  v_ids     bigint[];
  v_scanned integer;
  v_min_at  timestamptz;
  v_n       integer := 0;
  v_purging text := pg_catalog.current_setting('pgfence.purging', true);
BEGIN
  PERFORM pg_catalog.set_config('pgfence.purging', 'on', true);
  IF p_module = 'outbox' THEN
    SELECT max(w.id), count(*), min(w.created_at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT o.id, o.created_at FROM pgfence.outbox o WHERE o.id > p_after ORDER BY o.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      SELECT array_agg(c.id) INTO v_ids FROM (
        SELECT o.id FROM pgfence.outbox o
        WHERE o.id > p_after AND o.id <= last_id
          AND o.status IN ('sent', 'failed', 'dead', 'canceled') AND o.finished_at < p_cutoff
          -- a failed or dead message that holds its ordering key stays until an operator acts
          AND (o.ordering_key IS NULL OR o.status IN ('sent', 'canceled') OR NOT EXISTS (
                 SELECT 1 FROM pgfence.outbox w
                 WHERE w.channel = o.channel AND w.ordering_key = o.ordering_key
                   AND w.status <> 'sent' AND w.status <> 'canceled' AND w.status = 'waiting'))
        FOR UPDATE SKIP LOCKED) c;
      IF v_ids IS NOT NULL THEN
        DELETE FROM pgfence.outbox o
        WHERE o.id = ANY (v_ids) AND o.status IN ('sent', 'failed', 'dead', 'canceled') AND o.finished_at < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        DELETE FROM pgfence.outbox_lapse l WHERE l.message_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = l.message_id);
        DELETE FROM pgfence.event e WHERE e.module = 'outbox' AND e.item_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = e.item_id);
      END IF;
    END IF;
  ELSIF p_module = 'plan' THEN
    SELECT max(w.id), count(*), min(w.proposed_at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT p.id, p.proposed_at FROM pgfence.plan p WHERE p.id > p_after ORDER BY p.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      SELECT array_agg(c.id) INTO v_ids FROM (
        SELECT p.id FROM pgfence.plan p
        WHERE p.id > p_after AND p.id <= last_id
          AND p.status IN ('executed', 'failed', 'rejected', 'expired') AND p.finished_at < p_cutoff
        FOR UPDATE SKIP LOCKED) c;
      -- A plan that a kept plan compensates stays (foreign key), and so does, transitively, the
      -- plan it compensates; they go in a later purge, after the kept one.
      IF v_ids IS NOT NULL THEN
        WITH RECURSIVE blocked(id) AS (
          SELECT c.compensates FROM pgfence.plan c
          WHERE c.compensates = ANY (v_ids) AND NOT c.id = ANY (v_ids)
          UNION
          SELECT c.compensates FROM pgfence.plan c JOIN blocked b ON c.id = b.id
          WHERE c.compensates = ANY (v_ids)
        )
        SELECT array_agg(u.id) INTO v_ids FROM unnest(v_ids) AS u(id)
        WHERE NOT EXISTS (SELECT 1 FROM blocked b WHERE b.id = u.id);
      END IF;
      IF v_ids IS NOT NULL THEN
        DELETE FROM pgfence.plan p
        WHERE p.id = ANY (v_ids)
          AND p.status IN ('executed', 'failed', 'rejected', 'expired') AND p.finished_at < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        DELETE FROM pgfence.event e WHERE e.module = 'plan' AND e.item_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.plan p WHERE p.id = e.item_id);
      END IF;
    END IF;
  ELSIF p_module = 'operation' THEN
    SELECT max(w.id), count(*), min(w.created_at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT o.id, o.created_at FROM pgfence.operation o WHERE o.id > p_after ORDER BY o.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      SELECT array_agg(c.id) INTO v_ids FROM (
        SELECT o.id FROM pgfence.operation o
        WHERE o.id > p_after AND o.id <= last_id
          AND o.status IN ('succeeded', 'failed', 'canceled') AND o.finished_at < p_cutoff
        FOR UPDATE SKIP LOCKED) c;
      IF v_ids IS NOT NULL THEN
        DELETE FROM pgfence.operation o
        WHERE o.id = ANY (v_ids) AND o.status IN ('succeeded', 'failed', 'canceled') AND o.finished_at < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        DELETE FROM pgfence.event e WHERE e.module = 'operation' AND e.item_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.operation o WHERE o.id = e.item_id);
      END IF;
    END IF;
  ELSIF p_module = 'document' THEN
    -- Documents are never deleted (a deleted one keeps its tombstone, and every version is a
    -- revision: the save receipts). Only their events age out.
    SELECT max(w.id), count(*), min(w.at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT e.id, e.at FROM pgfence.event e WHERE e.id > p_after ORDER BY e.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      DELETE FROM pgfence.event e
      WHERE e.id > p_after AND e.id <= last_id AND e.module = 'document' AND e.at < p_cutoff;
      GET DIAGNOSTICS v_n = ROW_COUNT;
    END IF;
  ELSE
    RAISE EXCEPTION 'purge: unknown module "%"', p_module
      USING ERRCODE = '22023', DETAIL = 'pgfence has four modules; nothing was purged.',
            HINT = 'One of outbox, plan, operation, document (CALL pgfence.audit_purge checks it first).';
  END IF;
  purged := v_n;
  done := v_scanned < p_batch OR v_min_at >= p_cutoff;
  last_id := coalesce(last_id, p_after);
  PERFORM pg_catalog.set_config('pgfence.purging', coalesce(v_purging, ''), true);
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_purge_batch(text, timestamptz, bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._audit_purge_batch(text, timestamptz, bigint, integer) TO pgfence_admin;
COMMENT ON FUNCTION pgfence._audit_purge_batch(text, timestamptz, bigint, integer) IS
  'Private: one purge batch of CALL audit_purge: the module''s next p_batch items after p_after.
Deletes those that are terminal (outbox sent | failed | dead; plan executed | failed | rejected |
expired; operation succeeded | failed | canceled) and finished before p_cutoff, skipping rows
locked right now and plans that a kept plan compensates, with their events (and outbox lapse
receipts, plan steps). For module document it deletes document events older than p_cutoff.
Returns the last id looked at, how many items (events, for documents) it deleted, and whether
the walk is done. Runs with pgfence.purging = on (set at its start and put back before it
returns: only for the duration of the call), the one setting under which the modules'' delete
guards let rows go. Security definer for the procedure, which cannot be; granted to
pgfence_admin.
Errors: 22023 (unknown module).';

CREATE OR REPLACE FUNCTION pgfence._audit_check_purge(p_older_than interval, p_batch_size integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_older_than IS NULL OR p_batch_size IS NULL THEN
    RAISE EXCEPTION 'purge: older_than and batch_size are required'
      USING ERRCODE = '22004', DETAIL = 'NULL keeps no retention period and no batch size; nothing was purged.',
            HINT = 'Omit them for the defaults.';
  END IF;
  IF p_older_than < interval '0' THEN
    RAISE EXCEPTION 'purge: older_than must not be negative, got %', p_older_than
      USING ERRCODE = '22023', DETAIL = 'older_than is how long finished items are kept; nothing was purged.',
            HINT = 'Pass how long finished items are kept, e.g. interval ''7 days''.';
  END IF;
  IF p_batch_size NOT BETWEEN 1 AND 100000 THEN
    RAISE EXCEPTION 'purge: batch_size must be between 1 and 100000, got %', p_batch_size
      USING ERRCODE = '22023', DETAIL = 'batch_size is how many items one transaction looks at; nothing was purged.',
            HINT = 'Each batch is one short transaction; the default suits most tables.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_check_purge(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._audit_check_purge(interval, integer) TO pgfence_admin;
COMMENT ON FUNCTION pgfence._audit_check_purge(interval, integer) IS
  'Private: validates the retention period and batch size of CALL audit_purge.
Errors: 22004 (NULL), 22023 (negative older_than, batch_size outside 1..100000).';

-- The procedure: not security definer and without SET clauses, because a procedure with
-- either cannot COMMIT; every name is schema-qualified. Each batch is its own transaction.
-- (One procedure for all modules rather than outbox_purge, plan_purge, ...: the modules'
-- suites check that every outbox_* / plan_* routine is security definer, which this cannot be.)
CREATE OR REPLACE PROCEDURE pgfence.audit_purge(
  p_module     text,
  p_older_than interval DEFAULT NULL,
  p_batch_size integer DEFAULT NULL,
  INOUT purged bigint DEFAULT NULL
)
LANGUAGE plpgsql
AS $$
DECLARE
  v_older  interval;
  v_batch  integer;
  v_cutoff timestamptz;
  v_after  bigint := 0;
  v        record;
BEGIN
  PERFORM pgfence._audit_check_module(p_module);
  -- Documented defaults: the outbox is high volume, the others are an audit trail.
  v_older := coalesce(p_older_than, CASE p_module WHEN 'outbox' THEN interval '7 days' ELSE interval '90 days' END);
  v_batch := coalesce(p_batch_size, CASE p_module WHEN 'plan' THEN 100 WHEN 'document' THEN 5000 ELSE 1000 END);
  PERFORM pgfence._audit_check_purge(v_older, v_batch);
  BEGIN
    v_cutoff := now() - v_older;
  EXCEPTION WHEN datetime_field_overflow THEN
    -- older than the earliest timestamp PostgreSQL has (4713 BC): nothing is that old
    v_cutoff := '-infinity';
  END;
  purged := 0;
  LOOP
    SELECT * INTO v FROM pgfence._audit_purge_batch(p_module, v_cutoff, v_after, v_batch);
    purged := purged + v.purged;
    COMMIT;
    EXIT WHEN v.done;
    v_after := v.last_id;
  END LOOP;
END
$$;
REVOKE ALL ON PROCEDURE pgfence.audit_purge(text, interval, integer, bigint) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE pgfence.audit_purge(text, interval, integer, bigint) TO pgfence_admin;
COMMENT ON PROCEDURE pgfence.audit_purge(text, interval, integer, bigint) IS
  'Retention: delete a module''s items that finished more than older_than ago, with their events.
CALL pgfence.audit_purge(module [, older_than [, batch_size]]). Deletes the module''s terminal items that finished more than older_than ago (database clock,
fixed when the call starts) together with their events: outbox messages sent, failed or dead
(and the reaper''s lapse receipts; default older_than 7 days, batch_size 1000); plans executed,
failed, rejected or expired, with their steps and receipts (90 days, 100: a plan may have 10000
steps), keeping a plan that a kept plan compensates until that one goes; operations succeeded,
failed or canceled (90 days, 1000). Pending, processing, approved, executing, queued and running
items are never touched. For module document it deletes document events older than older_than
(90 days, 5000); documents and their revisions are never deleted (a deleted document keeps its
tombstone; revisions are the save receipts). Walks the table batch_size rows per transaction and
commits after each, so every lock is short and rows locked by someone else (a requeue) are
skipped. Returns purged = items deleted (events, for documents); an older_than reaching before
the earliest timestamp (4713 BC) purges nothing. Must be called outside an explicit transaction
block (it commits).
Errors: 22004 (module NULL), 22023 (unknown module, negative older_than, batch_size outside
1..100000), 2D000 (inside a transaction block).';
