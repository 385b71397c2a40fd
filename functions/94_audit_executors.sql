-- pgfence functions/94_audit_executors.sql — auditing from psql: which executors run.
--
-- Public: view audit_executors (every executor in the registry, pgfence.executor, with its
--         liveness: alive, lapsed, stopped)
-- The registry's functions (register, heartbeat, deregister) are in 50_executor.sql. Read-only,
-- for pgfence_admin and pg_monitor. Time: now(), the database clock.

CREATE OR REPLACE VIEW pgfence.audit_executors AS
SELECT x.worker,
       x.host,
       x.pid,
       x.version,
       ARRAY(SELECT k FROM jsonb_object_keys(x.serves) AS k ORDER BY k) AS modules,
       x.serves,
       x.concurrency,
       x.started_at,
       x.last_seen_at,
       now() - x.last_seen_at                                             AS silent_for,
       x.expires_at,
       x.stopped_at,
       CASE WHEN x.stopped_at IS NOT NULL THEN 'stopped'
            WHEN x.expires_at >= now() THEN 'alive'
            ELSE 'lapsed' END                                             AS status,
       x.stopped_at IS NULL AND x.expires_at >= now()                     AS alive
FROM pgfence.executor x;
REVOKE ALL ON pgfence.audit_executors FROM PUBLIC;
GRANT SELECT ON pgfence.audit_executors TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_executors IS
  'Every registered executor: where it runs, what it serves, and whether it is alive.
Alive = not stopped and heard from within three heartbeat intervals (database clock). A lapsed executor was killed, hung, or lost its database; stopped ones deregistered at shutdown. Rows silent for 7 days are deleted by the next registration. \d+ explains each column.';
COMMENT ON COLUMN pgfence.audit_executors.worker IS 'The name it claims under (as in the lease views).';
COMMENT ON COLUMN pgfence.audit_executors.host IS 'Its host name.';
COMMENT ON COLUMN pgfence.audit_executors.pid IS 'Its process id on that host.';
COMMENT ON COLUMN pgfence.audit_executors.version IS 'The pgfence version it runs.';
COMMENT ON COLUMN pgfence.audit_executors.modules IS 'The modules it serves (outbox, plan, operation).';
COMMENT ON COLUMN pgfence.audit_executors.serves IS
  'Module -> the queues it serves: outbox channels, operation kinds, plans ("*" = every one; "external" = external plan steps only).';
COMMENT ON COLUMN pgfence.audit_executors.concurrency IS 'Its delivery slots.';
COMMENT ON COLUMN pgfence.audit_executors.started_at IS 'When it registered (its start).';
COMMENT ON COLUMN pgfence.audit_executors.last_seen_at IS 'Its last heartbeat.';
COMMENT ON COLUMN pgfence.audit_executors.silent_for IS 'How long since.';
COMMENT ON COLUMN pgfence.audit_executors.expires_at IS
  'When it counts as lapsed without another heartbeat (3 heartbeat intervals after the last).';
COMMENT ON COLUMN pgfence.audit_executors.stopped_at IS 'When it deregistered (a clean shutdown).';
COMMENT ON COLUMN pgfence.audit_executors.status IS 'alive, lapsed or stopped.';
COMMENT ON COLUMN pgfence.audit_executors.alive IS 'status = alive.';
