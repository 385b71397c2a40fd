-- pgfence 0021 — the gauges read indexes, not whole tables; a floor on key rates (schema version 21).
-- transactional: false
-- depends: 0018_outbox_limit_key 0019_trace_context
--
-- pgfence.audit_metrics (what every executor's /metrics and `pgfence metrics` read on each
-- scrape) counted its depths through audit_queue_health, which aggregates every row of the
-- outbox, plan and operation tables: with a million sent messages kept (no purge yet) one read
-- took 4-5 s, per scrape, per executor. The depths it serves are of live and failed rows only
-- (ready, deferred, in flight, lapsed, failed, dead): the live ones have partial indexes already
-- (outbox_channel_due_idx, outbox_lease_idx, plan_status_idx, operation_kind_queued_idx,
-- operation_one_in_flight); these two give the failed ones theirs. A row enters them only when
-- it fails for good, so the claim and settle paths do not write them.
--
-- Built CONCURRENTLY (as in 0007-0009): enqueues and claims go on during an upgrade. Each
-- statement can be re-run after a failure; a half-built (invalid) index is dropped first.
DROP INDEX CONCURRENTLY IF EXISTS pgfence.outbox_failed_idx;
CREATE INDEX CONCURRENTLY outbox_failed_idx ON pgfence.outbox (channel)
  WHERE status IN ('failed', 'dead');
COMMENT ON INDEX pgfence.outbox_failed_idx IS
  'Failed and dead messages per channel: the failed and dead depths of audit_metrics, without reading sent history.';

DROP INDEX CONCURRENTLY IF EXISTS pgfence.operation_failed_idx;
CREATE INDEX CONCURRENTLY operation_failed_idx ON pgfence.operation (kind)
  WHERE status = 'failed';
COMMENT ON INDEX pgfence.operation_failed_idx IS
  'Failed operations per kind: the failed depth of audit_metrics, without reading finished history.';

-- A key rate is at least one per 10^6 s (11.6 days): a smaller positive rate (5e-324 was
-- accepted) overflowed the token bucket's interval in the key decision (22003).
UPDATE pgfence.outbox_channel SET key_rate = 0.000001 WHERE key_rate < 0.000001;
ALTER TABLE pgfence.outbox_channel DROP CONSTRAINT IF EXISTS outbox_channel_key_rate_check;
ALTER TABLE pgfence.outbox_channel ADD CONSTRAINT outbox_channel_key_rate_check
  CHECK (key_rate >= 0.000001 AND key_rate <= 1000000);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 21);
