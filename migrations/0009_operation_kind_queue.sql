-- pgfence 0009 — operation claims: each kind's queue walked on its own.
-- transactional: false
-- depends: 0008_claim_walk_indexes
--
-- An executor claims the kinds it has handlers for. operation_claim found them by walking
-- operation_queued_idx (id) WHERE status = 'queued' in id order and filtering on the kind, so
-- a backlog of another kind (one whose executor is down) ahead in id order was read by every
-- claim: each claim O(that backlog). As for the outbox's channels (0007), a claim for some
-- kinds now walks operation_kind_queued_idx (kind, id) once per kind, up to the batch.
--
-- operation_queued_idx stays for claims across all kinds (p_kinds NULL), but with only
-- status = 'queued' in its predicate the planner took it for the per-kind walks too (an id-order
-- walk filtering on the kind, chosen under statistics analysed with the table idle or busy —
-- tests/test_module_plans.py). Its predicate now also says lease_expires_at IS NULL: true of
-- every queued operation (CHECK operation_lease_iff_running: a lease is set exactly while
-- running; a CHECK cannot be bypassed, so no row to repair), stated only by the all-kinds claim,
-- so no per-kind walk can use it.
--
-- Built CONCURRENTLY (as in 0007, 0008): requests and claims go on during an upgrade. Each
-- statement can be re-run after a failure; a half-built (invalid) index is dropped first.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_kind_queued_idx;
CREATE INDEX CONCURRENTLY operation_kind_queued_idx ON pgfence.operation (kind, id)
  WHERE status = 'queued';
COMMENT ON INDEX pgfence.operation_kind_queued_idx IS
  'Queued operations per kind, oldest first: the walk of operation_claim for the kinds it is given, one per kind.';

DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_queued_all_idx;
CREATE INDEX CONCURRENTLY operation_queued_all_idx ON pgfence.operation (id)
  WHERE status = 'queued' AND lease_expires_at IS NULL;
DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_queued_idx;
ALTER INDEX pgfence.operation_queued_all_idx RENAME TO operation_queued_idx;
COMMENT ON INDEX pgfence.operation_queued_idx IS
  'Queued operations of every kind, oldest first: the walk of operation_claim with kinds NULL. Its predicate includes lease_expires_at IS NULL, true of every queued operation, so that only the query stating it (the all-kinds claim) uses it; claims for some kinds use operation_kind_queued_idx.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 9);
