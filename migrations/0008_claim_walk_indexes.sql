-- pgfence 0008 — plan and operation claims: an index per walk, that no other query can take.
-- transactional: false
-- depends: 0007_outbox_due_index
--
-- Same hazard as 0007: a plan kept for the life of an executor's session, chosen under
-- statistics that no longer hold, must not read the history on every call
-- (tests/test_module_plans.py reads the plans through auto_explain).
--
-- plan_claim takes the oldest approved plans and the oldest runs released by their owner, in id
-- order. Walked through plan_status_idx (status, id) or the primary key, the planner priced the
-- primary key lower whenever the statistics said approved plans were common (analysed while a
-- batch waited), and every claim then walked the primary key from the oldest plan, reading
-- the whole history. Two small indexes hold exactly the candidates, in id order, so the walk
-- reads only them.
--
-- operation_claim (lapsed leases, for a takeover) and operation_reap walked
-- operation_one_in_flight (kind, target) WHERE status IN ('queued', 'running') whole instead of
-- operation_lease_idx: both predicates follow from status = 'running', and analysed with
-- nothing in flight the planner took the other one, reading every queued and running operation
-- per claim. The lease index's predicate is now lease_expires_at IS NOT NULL — the same rows:
-- CHECK operation_lease_iff_running sets a lease exactly while running — which those walks
-- prove from lease_expires_at < now() without naming the status, so no other partial index
-- applies to them.

-- Built CONCURRENTLY (as in 0007): proposals, approvals and claims go on during an upgrade.
-- Each statement can be re-run after a failure; a half-built (invalid) index is dropped first.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.plan_approved_idx;
CREATE INDEX CONCURRENTLY plan_approved_idx ON pgfence.plan (id) WHERE status = 'approved';
COMMENT ON INDEX pgfence.plan_approved_idx IS
  'Approved plans waiting for an executor, oldest first: the walk of plan_claim.';
DROP INDEX CONCURRENTLY IF EXISTS pgfence.plan_released_idx;
CREATE INDEX CONCURRENTLY plan_released_idx ON pgfence.plan (id) WHERE status = 'executing' AND worker IS NULL;
COMMENT ON INDEX pgfence.plan_released_idx IS
  'Runs released by their owner (executing, worker NULL) waiting for another worker, oldest first: the walk of plan_claim.';

DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_lease_set_idx;
CREATE INDEX CONCURRENTLY operation_lease_set_idx ON pgfence.operation (lease_expires_at)
  WHERE lease_expires_at IS NOT NULL;
DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_lease_idx;
ALTER INDEX pgfence.operation_lease_set_idx RENAME TO operation_lease_idx;
COMMENT ON INDEX pgfence.operation_lease_idx IS
  'Running operations by lease deadline (a lease is set exactly while running, CHECK operation_lease_iff_running): the lapsed-lease walks of operation_claim and operation_reap, which state lease_expires_at < now() and not the status, so that they cannot use operation_one_in_flight.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 8);
