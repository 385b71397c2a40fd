-- pgfence functions/95_audit_metrics.sql — the database-side gauges, for any exporter.
--
-- Public: view audit_metrics (one row per gauge sample: metric, module, queue, status, value),
--         view audit_queue_rates (finished per minute over the last hour: the console charts)
-- Served by the executor's /metrics (--metrics-port) and `pgfence metrics`, next to the
-- executor's own counters; any exporter (postgres_exporter's custom queries, a Telegraf
-- query, a Grafana PostgreSQL panel) can read the same rows. Metric names follow Prometheus
-- conventions (docs/metrics.md has the table). Read-only, for pgfence_admin, pg_monitor and
-- pgfence_executor (an executor serves them on /metrics).
-- The depths read only live and failed rows through partial indexes (migration 0021), never the
-- sent or finished history; stuck items, duplicates and executors come from audit_stuck,
-- audit_duplicates and audit_executors. Time: now(), the database clock.

CREATE OR REPLACE VIEW pgfence.audit_metrics AS
-- The depths read only live and failed rows, each through its partial index (migration 0021):
-- never the sent or finished history, however much of it is kept before a purge.
WITH ob_pending AS (  -- outbox_channel_due_idx
  SELECT o.channel AS queue,
         count(*) FILTER (WHERE o.next_attempt_at <= clock_timestamp()) AS ready,
         count(*) FILTER (WHERE o.next_attempt_at > clock_timestamp())  AS deferred,
         min(o.next_attempt_at) FILTER (WHERE o.next_attempt_at <= clock_timestamp()) AS oldest_ready_at
  FROM pgfence.outbox o WHERE o.status = 'pending' GROUP BY o.channel
), ob_flight AS (  -- outbox_lease_idx
  SELECT o.channel AS queue, count(*) AS in_flight,
         count(*) FILTER (WHERE o.lease_expires_at < now()) AS lapsed
  FROM pgfence.outbox o WHERE o.status = 'processing' GROUP BY o.channel
), ob_failed AS (  -- outbox_failed_idx
  SELECT o.channel AS queue, count(*) FILTER (WHERE o.status = 'failed') AS failed,
         count(*) FILTER (WHERE o.status = 'dead') AS dead
  FROM pgfence.outbox o WHERE o.status IN ('failed', 'dead') GROUP BY o.channel
), ob AS (  -- every channel with a live or failed message, or configured
  SELECT c.queue, coalesce(p.ready, 0) AS ready, coalesce(p.deferred, 0) AS deferred,
         coalesce(f.in_flight, 0) AS in_flight, coalesce(f.lapsed, 0) AS lapsed,
         coalesce(d.failed, 0) AS failed, coalesce(d.dead, 0) AS dead,
         clock_timestamp() - p.oldest_ready_at AS oldest_ready_age  -- ready by the clock, as the claim decides
  FROM (SELECT queue FROM ob_pending UNION SELECT queue FROM ob_flight UNION SELECT queue FROM ob_failed
        UNION SELECT ch.channel FROM pgfence.outbox_channel ch WHERE ch.channel <> '*') c
  LEFT JOIN ob_pending p USING (queue) LEFT JOIN ob_flight f USING (queue) LEFT JOIN ob_failed d USING (queue)
), pl AS (  -- plan_status_idx: live and failed runs only
  SELECT count(*) FILTER (WHERE p.status = 'approved'
                             OR (p.status = 'executing' AND p.worker IS NULL
                                 AND (p.heartbeat_expires_at >= now() OR x.executors = 0))) AS ready,
         count(*) FILTER (WHERE p.status = 'pending') AS deferred,
         count(*) FILTER (WHERE p.status = 'executing' AND p.worker IS NOT NULL) AS in_flight,
         count(*) FILTER (WHERE p.status = 'executing' AND p.heartbeat_expires_at < now()
                            AND (p.worker IS NOT NULL OR x.executors > 0)) AS lapsed,
         count(*) FILTER (WHERE p.status = 'failed') AS failed,
         now() - min(p.approved_at) FILTER (WHERE p.status = 'approved') AS oldest_ready_age,
         count(*) FILTER (WHERE p.status = 'approved' OR (p.status = 'executing' AND p.worker IS NULL)) AS waiting,
         min(x.executors) AS executors
  FROM pgfence.plan p
  CROSS JOIN (SELECT pgfence._executor_serving('plan', '*') AS executors) x
  WHERE p.status IN ('approved', 'pending', 'executing', 'failed')
), op AS (  -- operation_kind_queued_idx, operation_one_in_flight, operation_failed_idx
  SELECT o.kind AS queue, count(*) FILTER (WHERE o.status = 'queued') AS ready,
         count(*) FILTER (WHERE o.status = 'running') AS in_flight,
         count(*) FILTER (WHERE o.status = 'running' AND o.lease_expires_at < now()) AS lapsed,
         count(*) FILTER (WHERE o.status = 'failed') AS failed,
         now() - min(o.created_at) FILTER (WHERE o.status = 'queued') AS oldest_ready_age
  FROM pgfence.operation o WHERE o.status IN ('queued', 'running', 'failed') GROUP BY o.kind
), q AS (
  SELECT 'outbox'::text AS module, ob.queue, ob.ready, ob.deferred, ob.in_flight, ob.lapsed,
         ob.failed, ob.dead, ob.oldest_ready_age,
         ob.ready > 0 AND pgfence._executor_serving('outbox', ob.queue) = 0 AS unserved
  FROM ob
  UNION ALL
  SELECT 'plan', '*', pl.ready, pl.deferred, pl.in_flight, pl.lapsed, pl.failed, NULL::bigint,
         pl.oldest_ready_age, pl.waiting > 0 AND pl.executors = 0
  FROM pl WHERE pl.deferred + pl.waiting + pl.in_flight + pl.failed > 0
  UNION ALL
  SELECT 'operation', op.queue, op.ready, NULL::bigint, op.in_flight, op.lapsed, op.failed, NULL::bigint,
         op.oldest_ready_age, op.ready > 0 AND pgfence._executor_serving('operation', op.queue) = 0
  FROM op
),
     m(module) AS (VALUES ('outbox'), ('plan'), ('operation'))
SELECT 'pgfence_queue_depth'::text AS metric, q.module, q.queue, s.status,
       s.value::double precision AS value
FROM q
CROSS JOIN LATERAL (VALUES ('ready', q.ready), ('deferred', q.deferred), ('in_flight', q.in_flight),
                           ('lapsed', q.lapsed), ('failed', q.failed), ('dead', q.dead)) AS s(status, value)
WHERE s.value IS NOT NULL
UNION ALL
SELECT 'pgfence_oldest_ready_age_seconds', q.module, q.queue, NULL,
       coalesce(extract(epoch FROM q.oldest_ready_age), 0)::double precision
FROM q
UNION ALL
SELECT 'pgfence_queue_unserved', q.module, q.queue, NULL, q.unserved::int::double precision
FROM q
UNION ALL
SELECT 'pgfence_stuck_items', m.module, NULL, NULL,
       (SELECT count(*) FROM pgfence.audit_stuck s WHERE s.module = m.module)::double precision
FROM m
UNION ALL
SELECT 'pgfence_possible_duplicates_24h', m.module, NULL, NULL,
       (SELECT count(*) FROM pgfence.audit_duplicates d
        WHERE d.module = m.module AND d.since >= now() - interval '24 hours')::double precision
FROM m
UNION ALL
SELECT 'pgfence_executors', NULL, NULL, st.status,
       (SELECT count(*) FROM pgfence.audit_executors e WHERE e.status = st.status)::double precision
FROM (VALUES ('alive'), ('lapsed'), ('stopped')) AS st(status)
UNION ALL
-- what holds back VACUUM (audit_cleanup_blockers): the oldest holder's xmin age, the longest open
SELECT 'pgfence_cleanup_blocker_xid_age', NULL, NULL, NULL,
       coalesce((SELECT max(b.xid_age) FROM pgfence.audit_cleanup_blockers b), 0)::double precision
UNION ALL
SELECT 'pgfence_cleanup_blocker_age_seconds', NULL, NULL, NULL,
       coalesce((SELECT extract(epoch FROM max(b.age)) FROM pgfence.audit_cleanup_blockers b), 0)::double precision;
REVOKE ALL ON pgfence.audit_metrics FROM PUBLIC;
GRANT SELECT ON pgfence.audit_metrics TO pgfence_admin, pgfence_executor, pg_monitor;  -- executors serve it on /metrics
COMMENT ON VIEW pgfence.audit_metrics IS
  'The database-side gauges, one row per sample: what /metrics and `pgfence metrics` serve.
Depth by status, oldest ready age, unserved queues (per module and queue), stuck items and
possible duplicates of the last 24 hours (per module), executors by status, and what holds back
VACUUM (the oldest holder''s xmin age, the longest open; 0: nothing). A NULL label does
not apply. Cheap to scrape: the depths read live and failed rows through partial indexes, never
the sent or finished history; a queue appears while it has such rows or is configured.
docs/metrics.md lists every metric. \d+ explains each column.';
COMMENT ON COLUMN pgfence.audit_metrics.metric IS
  'The Prometheus metric name (a gauge): pgfence_queue_depth, pgfence_oldest_ready_age_seconds, pgfence_queue_unserved, pgfence_stuck_items, pgfence_possible_duplicates_24h, pgfence_executors, pgfence_cleanup_blocker_xid_age, pgfence_cleanup_blocker_age_seconds.';
COMMENT ON COLUMN pgfence.audit_metrics.module IS 'Label module: outbox, plan or operation (NULL for executors).';
COMMENT ON COLUMN pgfence.audit_metrics.queue IS
  'Label queue: the outbox channel or operation kind, ''*'' for plans (NULL for per-module gauges).';
COMMENT ON COLUMN pgfence.audit_metrics.status IS
  'Label status: ready, deferred, in_flight, lapsed, failed, dead (depth); alive, lapsed, stopped (executors).';
COMMENT ON COLUMN pgfence.audit_metrics.value IS 'The sample (a count, or seconds).';

-- ---------------------------------------------------------------------------------------------
-- Finished per minute over the last hour (the charts of the web console)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_queue_rates AS
SELECT 'outbox'::text AS module, o.channel AS queue, date_trunc('minute', o.finished_at) AS minute,
       count(*) FILTER (WHERE o.status = 'sent') AS done,
       count(*) FILTER (WHERE o.status IN ('failed', 'dead')) AS failed
FROM pgfence.outbox o
WHERE o.finished_at >= date_trunc('minute', now()) - interval '59 minutes'
GROUP BY 1, 2, 3
UNION ALL
SELECT 'plan', '*', date_trunc('minute', p.finished_at),
       count(*) FILTER (WHERE p.status = 'executed'), count(*) FILTER (WHERE p.status = 'failed')
FROM pgfence.plan p
WHERE p.finished_at >= date_trunc('minute', now()) - interval '59 minutes'
  AND p.status IN ('executed', 'failed')
GROUP BY 1, 2, 3
UNION ALL
SELECT 'operation', o.kind, date_trunc('minute', o.finished_at),
       count(*) FILTER (WHERE o.status = 'succeeded'), count(*) FILTER (WHERE o.status = 'failed')
FROM pgfence.operation o
WHERE o.finished_at >= date_trunc('minute', now()) - interval '59 minutes'
GROUP BY 1, 2, 3;
REVOKE ALL ON pgfence.audit_queue_rates FROM PUBLIC;
GRANT SELECT ON pgfence.audit_queue_rates TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_queue_rates IS
  'Items finished per minute over the last hour, per module and queue: the console''s charts.
One row per minute that finished something (the current minute included; minutes without any
are absent). Reads the rows finished in the last hour (finished_at), whatever the event log
setting. \d+ explains each column.';
COMMENT ON COLUMN pgfence.audit_queue_rates.module IS 'outbox, plan or operation.';
COMMENT ON COLUMN pgfence.audit_queue_rates.queue IS 'The outbox channel or operation kind; ''*'' for plans.';
COMMENT ON COLUMN pgfence.audit_queue_rates.minute IS 'The minute (date_trunc, database clock).';
COMMENT ON COLUMN pgfence.audit_queue_rates.done IS 'Finished successfully in that minute (sent, executed, succeeded).';
COMMENT ON COLUMN pgfence.audit_queue_rates.failed IS 'Finished unsuccessfully in that minute (failed or dead).';
