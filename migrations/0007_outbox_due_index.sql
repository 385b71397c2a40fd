-- pgfence 0007 — outbox: the all-channels due index can no longer be taken for a one-channel walk.
-- transactional: false
-- depends: 0006_audit
--
-- A claim for some channels must walk outbox_channel_due_idx (channel, next_attempt_at, id):
-- it reads only that channel's due messages. outbox_due_idx (next_attempt_at, id), meant for
-- claims across all channels, gives the same order once the channel is fixed, and the planner
-- chose it when the statistics showed few channels; the plan is generic and kept for the life
-- of the session, so every claim then walked the due messages of every other channel (a
-- backlog on a channel nobody serves made each claim O(backlog)). Its predicate now also
-- requires attempts < max_attempts: true of every pending message (tg_outbox_guard refuses a
-- pending message with no attempt left), stated by the all-channels claim and next_due
-- queries, and absent from the per-channel ones, which therefore cannot use it.
--
-- Built CONCURRENTLY (so not in a transaction): enqueues and claims go on while it builds. Each
-- statement can be re-run after a failure: a half-built (invalid) index is dropped first.

-- The new predicate relies on the invariant; a row that breaks it (only possible with the
-- triggers bypassed, e.g. session_replication_role = replica) would be skipped by the
-- all-channels claim, so the upgrade stops and says how to repair it.
DO $$
DECLARE
  v_bad bigint[];
BEGIN
  SELECT array_agg(o.id ORDER BY o.id) INTO v_bad FROM (
    SELECT id FROM pgfence.outbox
    WHERE status = 'pending' AND attempts >= max_attempts LIMIT 20) o;
  IF v_bad IS NOT NULL THEN
    RAISE EXCEPTION 'outbox messages % are pending with no attempt left (attempts >= max_attempts)', v_bad
      USING ERRCODE = 'PF001',
            HINT = 'They were written with the triggers bypassed. Give each an attempt with SELECT pgfence.outbox_requeue(id, 1), then run pgfence migrate again.';
  END IF;
END
$$;

DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_due_attempts_idx;
CREATE INDEX CONCURRENTLY outbox_due_attempts_idx ON pgfence.outbox (next_attempt_at, id)
  WHERE status = 'pending' AND attempts < max_attempts;
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_due_idx;
ALTER INDEX pgfence.outbox_due_attempts_idx RENAME TO outbox_due_idx;
COMMENT ON INDEX pgfence.outbox_due_idx IS
  'Due order across all channels (claims and next_due with channels NULL). Its predicate includes attempts < max_attempts, true of every pending message, so that only queries stating it (the all-channels ones) use it; one-channel walks use outbox_channel_due_idx.';

-- Databases created before the idempotency-key index became partial (migration 0002 was
-- changed before its first release) still have a full one, with an entry for every keyless
-- row version; this gives every database the same partial index. A second unique index exists
-- for a moment: a key stays unique throughout.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_idempotency_key_partial_idx;
CREATE UNIQUE INDEX CONCURRENTLY outbox_idempotency_key_partial_idx ON pgfence.outbox (idempotency_key)
  WHERE idempotency_key IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_idempotency_key_idx;
ALTER INDEX pgfence.outbox_idempotency_key_partial_idx RENAME TO outbox_idempotency_key_idx;

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 7);
