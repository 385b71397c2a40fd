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

DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_due_attempts_idx;
CREATE INDEX CONCURRENTLY outbox_due_attempts_idx ON pgfence.outbox (next_attempt_at, id)
  WHERE status = 'pending' AND attempts < max_attempts;
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_due_idx;
ALTER INDEX pgfence.outbox_due_attempts_idx RENAME TO outbox_due_idx;
COMMENT ON INDEX pgfence.outbox_due_idx IS
  'Due order across all channels (claims and next_due with channels NULL). Its predicate includes attempts < max_attempts, true of every pending message, so that only queries stating it (the all-channels ones) use it; one-channel walks use outbox_channel_due_idx.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 7);
