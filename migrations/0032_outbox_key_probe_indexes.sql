-- pgfence 0032 — outbox: two partial indexes for the hand-off's probes of a key (schema version 32).
-- transactional: false
-- depends: 0031_document_checks_in_guards
--
-- Issue 17: on a channel with key_max_in_flight 1 and no key_rate (the default) the hand-off
-- (functions/16_outbox_keys.sql) asks two questions per settled key instead of walking every
-- unfinished message of the key (outbox_key_idx): which is the key's oldest waiting message,
-- and does any message other than the settled one hold a turn. outbox_key_waiting_idx answers
-- the first with one entry (a message enters it when it is enqueued or requeued waiting, so the
-- claim and settle paths do not write it); outbox_key_live_idx the second with the few entries
-- of the messages in flight or blocking (pending, processing, failed, dead). Both predicates
-- are stated only by the hand-off's probes.
--
-- Built CONCURRENTLY (as in 0007-0009, 0021): enqueues and claims go on during an upgrade.
-- Each statement can be re-run after a failure; a half-built (invalid) index is dropped first.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_key_waiting_idx;
CREATE INDEX CONCURRENTLY outbox_key_waiting_idx ON pgfence.outbox (channel, ordering_key, id)
  WHERE status = 'waiting';
COMMENT ON INDEX pgfence.outbox_key_waiting_idx IS
  'Waiting keyed messages per (channel, key) in id order: the hand-off''s probe for a key''s next message.';

DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_key_live_idx;
CREATE INDEX CONCURRENTLY outbox_key_live_idx ON pgfence.outbox (channel, ordering_key)
  WHERE ordering_key IS NOT NULL AND status IN ('pending', 'processing', 'failed', 'dead');
COMMENT ON INDEX pgfence.outbox_key_live_idx IS
  'Keyed messages holding or blocking a turn per (channel, key): the hand-off''s probe for another holder.';

-- Together the two hold what outbox_key_idx held (a keyed message that is neither sent nor
-- canceled is waiting, or pending, processing, failed or dead), so the key decisions read them
-- too and outbox_key_idx goes: a hand-off (waiting -> processing) writes one index entry fewer.
-- Between this statement and the new functions (pgfence migrate loads them next) an old
-- function's key walk finds no index of its own and reads the table.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_key_idx;

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 32);
