-- pgfence 0033 — operation claims: requeued operations have an index of their own.
-- transactional: false
-- depends: 0032_outbox_key_probe_indexes
--
-- Issue 14: operation_claim now walks each queue from its session's claim hint, an id below
-- which no fresh request of its kinds is queued (docs/design.md#operation-claim-hint), instead
-- of from the front of operation_queued_idx / operation_kind_queued_idx, where the dead entries
-- of every claimed operation stay while a snapshot older than them is open. A fresh request gets
-- its id after its xid (operation_request), so it lands above the hint; an operation that the
-- reaper puts back (running -> queued: its lease lapsed before its external call) keeps its old
-- id, below the hint. Those are exactly the queued operations with fence > 0: the guard
-- (tg_operation_guard) lets a row be inserted only with fence 0, queued -> running bump the
-- fence, and nothing lower it. So the claim takes them from this index, walked from its front
-- (it holds only requeued operations, a handful: the ones a crashed owner had claimed), right
-- after the lapsed leases and before the queue.
--
-- Built CONCURRENTLY (as in 0007-0009): requests and claims go on during an upgrade. It can be
-- re-run after a failure; a half-built (invalid) index is dropped first.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_requeued_idx;
CREATE INDEX CONCURRENTLY operation_requeued_idx ON pgfence.operation (id)
  WHERE status = 'queued' AND fence > 0;
COMMENT ON INDEX pgfence.operation_requeued_idx IS
  'Requeued operations (queued with fence > 0: the reaper put them back), oldest first: walked from the front by every operation_claim, whose queue walks start at the claim hint and would not see their old ids.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 33);
