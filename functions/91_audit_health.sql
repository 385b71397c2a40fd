-- pgfence functions/91_audit_health.sql — auditing from psql: doubtful effects, queue health,
-- documents.
--
-- Public: views audit_duplicates (which external effects may have happened twice, or without
--         a receipt), audit_queue_depth (how deep each queue is, cheap at any history size),
--         audit_queue_health (per outbox channel, operation kind, and all plans: the depths with
--         what finished and the rates),
--         audit_documents (conflicts and revisions per document)
-- Read-only views for pgfence_admin and pg_monitor (grants and helpers: 90_audit_owned.sql;
-- the guide: docs/psql.md). \d+ on each view explains every column. Time: now(), the database
-- clock.

-- ---------------------------------------------------------------------------------------------
-- Which external effects may have been duplicated (or happened without a receipt)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_duplicates AS
SELECT 'outbox'::text                                            AS module,
       o.id                                                      AS item_id,
       o.channel                                                 AS queue,
       o.status,
       'lease_lapsed'::text                                      AS reason,
       array_agg(l.attempt::bigint ORDER BY l.attempt)           AS fences,
       array_agg(l.worker ORDER BY l.attempt)                    AS lost_by,
       min(l.lease_expires_at)                                   AS since,
       coalesce(o.idempotency_key, 'pgfence-outbox-' || o.id)    AS idempotency_key,
       CASE o.status
         WHEN 'sent' THEN format('delivered under attempt %s; lapsed attempt(s) %s may have been delivered too: the receiver may have it %s times (same idempotency key)',
                                 o.attempts, string_agg(l.attempt::text, ', ' ORDER BY l.attempt), count(*) + 1)
         WHEN 'dead' THEN format('dead, yet lapsed attempt(s) %s may have been delivered: check the receiver before requeueing',
                                 string_agg(l.attempt::text, ', ' ORDER BY l.attempt))
         WHEN 'failed' THEN format('failed permanently, yet lapsed attempt(s) %s may have been delivered: check the receiver',
                                   string_agg(l.attempt::text, ', ' ORDER BY l.attempt))
         ELSE format('still being retried (attempt %s of %s); lapsed attempt(s) %s may have been delivered already',
                     o.attempts, o.max_attempts, string_agg(l.attempt::text, ', ' ORDER BY l.attempt))
       END                                                       AS check_downstream
FROM pgfence.outbox_lapse l
JOIN pgfence.outbox o ON o.id = l.message_id
GROUP BY o.id
UNION ALL
SELECT 'plan', p.id, '*', p.status, 'external_step_in_doubt',
       ARRAY[p.next_step::bigint], ARRAY[p.worker], p.external_started_at,
       'pgfence-plan-' || p.id || '-step-' || p.next_step,
       format('external step %s (%s to %s) was handed to %s and the run was interrupted before its receipt: it may have happened; check the receiver for the key, then compensate (plan_compensate) or propose the remaining steps again',
              p.next_step, s.action, s.args ->> 'recipient', coalesce(p.worker, 'a worker'))
FROM pgfence.plan p
JOIN pgfence.plan_step s ON s.plan_id = p.id AND s.step_index = p.next_step
WHERE p.external_started_at IS NOT NULL
  AND (p.status = 'failed' OR (p.status = 'executing' AND p.heartbeat_expires_at < now()))
UNION ALL
SELECT 'operation', o.id, o.kind, o.status,
       CASE WHEN o.result ->> 'reason' = 'outcome_unknown' THEN 'outcome_unknown' ELSE 'reissued' END,
       iss.fences, coalesce(iss.actors, ARRAY[o.issued_by]),
       o.issue_started_at,
       coalesce(o.idempotency_key, 'pgfence-operation-' || o.id),
       CASE WHEN o.result ->> 'reason' = 'outcome_unknown'
         THEN format('the external %s call for %s was started (%s time(s)) but no reference was recorded and a repeat could start a second one: check %s in the external system; if nothing runs there, request the operation again',
                     o.kind, o.target, o.issue_count, o.target)
         ELSE format('the external %s call for %s was issued %s times, each with idempotency key %s: check that the external system started only one operation for that key',
                     o.kind, o.target, o.issue_count, coalesce(o.idempotency_key, 'pgfence-operation-' || o.id))
       END
FROM pgfence.operation o
LEFT JOIN LATERAL (
  SELECT array_agg(e.fence ORDER BY e.id) AS fences, array_agg(e.actor ORDER BY e.id) AS actors
  FROM pgfence.event e
  WHERE e.module = 'operation' AND e.item_id = o.id AND e.event IN ('issue', 'reissue')
) iss ON true
WHERE o.issue_count > 1 OR o.result ->> 'reason' = 'outcome_unknown';
REVOKE ALL ON pgfence.audit_duplicates FROM PUBLIC;
GRANT SELECT ON pgfence.audit_duplicates TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_duplicates IS
  'Which external effects may have happened twice, or without a receipt: what to check downstream.
outbox lease_lapsed: a message claimed under an attempt whose lease lapsed and that the reaper
took back (from the reaper''s receipts in pgfence.outbox_lapse, whatever the channel''s log_events
setting): that worker may have delivered it before it died, so a sent message may have reached
the receiver more than once. plan external_step_in_doubt: an external step handed to a worker
whose run was interrupted before it recorded the outcome. operation reissued: the external call
was issued more than once (always with the idempotency key); operation outcome_unknown: a call
was started without the key and no reference was recorded. \d+ explains each column.';
COMMENT ON COLUMN pgfence.audit_duplicates.module IS 'outbox, plan or operation.';
COMMENT ON COLUMN pgfence.audit_duplicates.item_id IS 'The message''s, plan''s or operation''s id.';
COMMENT ON COLUMN pgfence.audit_duplicates.queue IS
  'The outbox channel or the operation kind; ''*'' for plans.';
COMMENT ON COLUMN pgfence.audit_duplicates.status IS 'The item''s status now.';
COMMENT ON COLUMN pgfence.audit_duplicates.reason IS
  'lease_lapsed (outbox), external_step_in_doubt (plan), reissued or outcome_unknown (operation).';
COMMENT ON COLUMN pgfence.audit_duplicates.fences IS
  'The attempts / fence tokens / step under which the effect was attempted.';
COMMENT ON COLUMN pgfence.audit_duplicates.lost_by IS 'The workers that held them.';
COMMENT ON COLUMN pgfence.audit_duplicates.since IS
  'When the doubt began (the first lapsed lease, the external step''s start, the first issue).';
COMMENT ON COLUMN pgfence.audit_duplicates.idempotency_key IS
  'The key the receiver or external API saw: deduplicate or search on it.';
COMMENT ON COLUMN pgfence.audit_duplicates.check_downstream IS
  'What to verify in the receiving system, in words.';

-- ---------------------------------------------------------------------------------------------
-- Queue depth
-- ---------------------------------------------------------------------------------------------
-- The depth of every queue, read through the partial indexes of the live and failed rows only
-- (migration 0021), never the sent or finished history. One definition of "ready", "lapsed" and
-- "unserved" for audit_queue_health (below) and audit_metrics (95_audit_metrics.sql).
CREATE OR REPLACE VIEW pgfence.audit_queue_depth AS
WITH clock AS (  -- read once: an outbox message is due by the clock, as the claim decides
  SELECT clock_timestamp() AS t  -- (docs/design.md#claim-hint: due times are stamped at the clock)
), ob_pending AS (  -- outbox_channel_due_idx
  SELECT o.channel AS queue,
         count(*) FILTER (WHERE o.next_attempt_at <= k.t) AS ready,
         count(*) FILTER (WHERE o.next_attempt_at > k.t)  AS deferred,
         count(*) FILTER (WHERE o.next_attempt_at > k.t AND o.attempts > 0) AS in_backoff,
         min(o.next_attempt_at) FILTER (WHERE o.next_attempt_at <= k.t) AS oldest_ready_at,
         min(o.next_attempt_at) FILTER (WHERE o.next_attempt_at > k.t)  AS next_due_at,
         min(k.t) AS at
  FROM pgfence.outbox o CROSS JOIN clock k WHERE o.status = 'pending' GROUP BY o.channel
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
         coalesce(p.in_backoff, 0) AS in_backoff,
         coalesce(f.in_flight, 0) AS in_flight, coalesce(f.lapsed, 0) AS lapsed,
         coalesce(d.failed, 0) AS failed, coalesce(d.dead, 0) AS dead,
         p.at - p.oldest_ready_at AS oldest_ready_age, p.next_due_at,
         pgfence._executor_serving('outbox', c.queue) AS executors
  FROM (SELECT queue FROM ob_pending UNION SELECT queue FROM ob_flight UNION SELECT queue FROM ob_failed
        UNION SELECT ch.channel FROM pgfence.outbox_channel ch WHERE ch.channel <> '*') c
  LEFT JOIN ob_pending p USING (queue) LEFT JOIN ob_flight f USING (queue) LEFT JOIN ob_failed d USING (queue)
), pl AS (  -- plan_status_idx: live and failed runs only
  -- A run released to executors (executing, no worker) is ready while its heartbeat holds or
  -- while no executor serves plans (it waits for one: _plan_served); lapsed only past its
  -- heartbeat with a worker, or with executors that should have taken it.
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
)
SELECT 'outbox'::text AS module, ob.queue, ob.ready, ob.deferred, ob.in_backoff, ob.in_flight,
       ob.lapsed, ob.failed, ob.dead, ob.oldest_ready_age, ob.next_due_at, ob.executors,
       ob.ready > 0 AND ob.executors = 0 AS unserved
FROM ob
UNION ALL
SELECT 'plan', '*', pl.ready, pl.deferred, NULL::bigint, pl.in_flight, pl.lapsed, pl.failed,
       NULL::bigint, pl.oldest_ready_age, NULL::timestamptz, pl.executors,
       pl.waiting > 0 AND pl.executors = 0
FROM pl WHERE pl.deferred + pl.waiting + pl.in_flight + pl.failed > 0
UNION ALL
SELECT 'operation', e.queue, e.ready, NULL::bigint, NULL::bigint, e.in_flight, e.lapsed, e.failed,
       NULL::bigint, e.oldest_ready_age, NULL::timestamptz, e.executors,
       e.ready > 0 AND e.executors = 0
FROM (SELECT op.*, pgfence._executor_serving('operation', op.queue) AS executors FROM op) e;
REVOKE ALL ON pgfence.audit_queue_depth FROM PUBLIC;
GRANT SELECT ON pgfence.audit_queue_depth TO pgfence_admin, pg_monitor;  -- executors read it through audit_metrics
COMMENT ON VIEW pgfence.audit_queue_depth IS
  'How deep every queue is now, cheaply: one row per outbox channel, operation kind, and all plans.
Reads only live and failed rows through partial indexes, never the sent or finished history,
so it costs the same at any history size. A queue appears while it has live or failed rows (an
outbox channel also while configured). audit_queue_health adds the finished counts and rates;
audit_metrics serves these depths. The plans'' row has queue ''*''; NULL = does not apply.
\d+ explains each column.';
COMMENT ON COLUMN pgfence.audit_queue_depth.module IS 'outbox, plan or operation.';
COMMENT ON COLUMN pgfence.audit_queue_depth.queue IS
  'The outbox channel or the operation kind; ''*'' for all plans.';
COMMENT ON COLUMN pgfence.audit_queue_depth.ready IS
  'Waiting and due now (outbox: pending and due; plan: approved, or released between steps; operation: queued).';
COMMENT ON COLUMN pgfence.audit_queue_depth.deferred IS
  'Waiting but not due (outbox: pending with a future due time, backoff or deliver_at; plan: proposals awaiting approval).';
COMMENT ON COLUMN pgfence.audit_queue_depth.in_backoff IS
  'Outbox: messages waiting out a retry backoff (pending, attempts > 0, not yet due).';
COMMENT ON COLUMN pgfence.audit_queue_depth.in_flight IS
  'Owned right now (processing, executing with a worker, running).';
COMMENT ON COLUMN pgfence.audit_queue_depth.lapsed IS
  'Owned past the lease or heartbeat (see pgfence.audit_stuck).';
COMMENT ON COLUMN pgfence.audit_queue_depth.failed IS 'Failed items still in the table (until purged).';
COMMENT ON COLUMN pgfence.audit_queue_depth.dead IS 'Outbox: dead messages still in the table (until purged).';
COMMENT ON COLUMN pgfence.audit_queue_depth.oldest_ready_age IS
  'How long the longest-waiting ready item has waited (since due, approved or requested).';
COMMENT ON COLUMN pgfence.audit_queue_depth.next_due_at IS
  'Outbox: the next deferred message''s due time.';
COMMENT ON COLUMN pgfence.audit_queue_depth.executors IS
  'Live executors serving this queue (pgfence.audit_executors: registered, heard from within three heartbeat intervals).';
COMMENT ON COLUMN pgfence.audit_queue_depth.unserved IS
  'True when the queue has ready work and no live executor serves it: nothing will take it until one starts.';

-- ---------------------------------------------------------------------------------------------
-- Queue health: the depths above and what finished, with rates
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_queue_health AS
WITH cleanup AS (  -- the oldest holder of cleanup (89_audit_cleanup.sql), one line
  SELECT format('%s%s%s, xmin age %s%s', b.kind,
                CASE WHEN b.pid IS NOT NULL THEN format(' pid %s', b.pid) ELSE format(' %s', b.holder) END,
                CASE WHEN b.age IS NOT NULL THEN format(' open %s', date_trunc('second', b.age)) ELSE '' END,
                b.xid_age, CASE WHEN b.warn THEN ' (warn)' ELSE '' END) AS held_by
  FROM pgfence.audit_cleanup_blockers b
  ORDER BY b.xid_age DESC
  LIMIT 1
), finished AS (  -- what finished: reads every row of the three tables (see the comment below)
  SELECT 'outbox'::text AS module, o.channel AS queue,
         count(*) FILTER (WHERE o.status = 'sent' AND o.finished_at >= now() - interval '5 minutes') AS done_5m,
         count(*) FILTER (WHERE o.status IN ('failed', 'dead') AND o.finished_at >= now() - interval '5 minutes') AS failed_5m,
         count(*) FILTER (WHERE o.finished_at >= now() - interval '1 minute')   AS n_1m,
         count(*) FILTER (WHERE o.finished_at >= now() - interval '5 minutes')  AS n_5m,
         count(*) FILTER (WHERE o.finished_at >= now() - interval '15 minutes') AS n_15m,
         count(*) FILTER (WHERE o.status IN ('sent', 'failed', 'dead'))        AS finished
  FROM pgfence.outbox o GROUP BY o.channel
  UNION ALL
  SELECT 'plan', '*',
         count(*) FILTER (WHERE p.status = 'executed' AND p.finished_at >= now() - interval '5 minutes'),
         count(*) FILTER (WHERE p.status = 'failed' AND p.finished_at >= now() - interval '5 minutes'),
         count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '1 minute'),
         count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '5 minutes'),
         count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '15 minutes'),
         count(*) FILTER (WHERE p.status IN ('executed', 'failed'))
  FROM pgfence.plan p HAVING count(*) > 0
  UNION ALL
  SELECT 'operation', o.kind,
         count(*) FILTER (WHERE o.status = 'succeeded' AND o.finished_at >= now() - interval '5 minutes'),
         count(*) FILTER (WHERE o.status = 'failed' AND o.finished_at >= now() - interval '5 minutes'),
         count(*) FILTER (WHERE o.finished_at >= now() - interval '1 minute'),
         count(*) FILTER (WHERE o.finished_at >= now() - interval '5 minutes'),
         count(*) FILTER (WHERE o.finished_at >= now() - interval '15 minutes'),
         count(*) FILTER (WHERE o.status IN ('succeeded', 'failed'))
  FROM pgfence.operation o GROUP BY o.kind
), q AS (  -- every queue with rows (finished) or live work / configuration (depth)
  SELECT coalesce(d.module, f.module) AS module, coalesce(d.queue, f.queue) AS queue,
         d.ready, d.deferred, d.in_backoff, d.in_flight, d.lapsed, d.failed, d.dead,
         d.oldest_ready_age, d.next_due_at, d.executors, d.unserved,
         f.done_5m, f.failed_5m, f.n_1m, f.n_5m, f.n_15m, f.finished AS n_finished
  FROM pgfence.audit_queue_depth d FULL JOIN finished f ON f.module = d.module AND f.queue = d.queue
)
SELECT q.module,
       q.queue,
       coalesce(q.ready, 0)                                                               AS ready,
       CASE WHEN q.module <> 'operation' THEN coalesce(q.deferred, 0) END                 AS deferred,
       CASE WHEN q.module = 'outbox' THEN coalesce(q.in_backoff, 0) END                   AS in_backoff,
       coalesce(q.in_flight, 0)                                                           AS in_flight,
       coalesce(q.lapsed, 0)                                                              AS lapsed,
       q.oldest_ready_age                                                                 AS oldest_ready_age,
       q.next_due_at                                                                      AS next_due_at,
       coalesce(q.done_5m, 0)                                                             AS done_5m,
       coalesce(q.failed_5m, 0)                                                           AS failed_5m,
       round(coalesce(q.n_5m, 0) / 300.0, 2)                                              AS per_second_5m,
       coalesce(q.failed, 0)                                                              AS failed,
       CASE WHEN q.module = 'outbox' THEN coalesce(q.dead, 0) END                         AS dead,
       (SELECT t.n_dead_tup FROM pg_catalog.pg_stat_user_tables t
        WHERE t.relid = ('pgfence.' || q.module)::regclass)                               AS dead_rows,
       (SELECT c.held_by FROM cleanup c)                                                  AS cleanup_held_by,
       round(coalesce(q.n_1m, 0) / 60.0, 2)                                               AS per_second_1m,
       round(coalesce(q.n_15m, 0) / 900.0, 2)                                             AS per_second_15m,
       coalesce(q.executors, pgfence._executor_serving(q.module, q.queue))                AS executors,
       coalesce(q.unserved, false)                                                        AS unserved,
       coalesce(q.n_finished, 0)                                                          AS finished
FROM q;
REVOKE ALL ON pgfence.audit_queue_health FROM PUBLIC;
GRANT SELECT ON pgfence.audit_queue_health TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_queue_health IS
  'Queue health by the database clock: one row per outbox channel, per operation kind, all plans.
The plans'' row has queue ''*''. NULL = does not apply to the module. The depths (ready,
deferred, in flight, lapsed, failed, dead, unserved) are those of audit_queue_depth; unserved
flags due work that no live executor serves (pgfence.audit_executors); a plan run released to
executors while none serves plans counts as ready (it waits), not lapsed. The finished counts
and rates read every row: after a long run without purge this scans the whole tables, like
outbox_summary (audit_queue_depth and audit_metrics do not). \d+ explains each column.';
-- The columns it shares with audit_queue_depth mean the same: their comments are copied from there.
DO $$
DECLARE r record;
BEGIN
  FOR r IN SELECT a.attname, col_description(a.attrelid, a.attnum) AS txt
           FROM pg_catalog.pg_attribute a
           WHERE a.attrelid = 'pgfence.audit_queue_depth'::regclass AND a.attnum > 0
  LOOP
    EXECUTE format('COMMENT ON COLUMN pgfence.audit_queue_health.%I IS %L', r.attname, r.txt);
  END LOOP;
END
$$;
COMMENT ON COLUMN pgfence.audit_queue_health.done_5m IS
  'Finished successfully in the last 5 minutes (from the rows'' finished_at: works with the event log off).';
COMMENT ON COLUMN pgfence.audit_queue_health.failed_5m IS
  'Finished unsuccessfully in the last 5 minutes (outbox failed or dead, plan or operation failed).';
COMMENT ON COLUMN pgfence.audit_queue_health.per_second_5m IS
  'Everything finished in the last 5 minutes, per second (count / 300).';
COMMENT ON COLUMN pgfence.audit_queue_health.dead_rows IS
  'Dead row versions in the module''s table not yet vacuumed (pg_stat_user_tables.n_dead_tup; see audit_table_health).';
COMMENT ON COLUMN pgfence.audit_queue_health.cleanup_held_by IS
  'The oldest holder of cleanup in this database (audit_cleanup_blockers): kind, pid, how long, xid age; (warn) past pgfence.cleanup_warn_after; NULL: none.';
COMMENT ON COLUMN pgfence.audit_queue_health.per_second_1m IS
  'Everything finished in the last minute, per second (count / 60): the rate of a drain now.';
COMMENT ON COLUMN pgfence.audit_queue_health.per_second_15m IS
  'Everything finished in the last 15 minutes, per second (count / 900).';
COMMENT ON COLUMN pgfence.audit_queue_health.finished IS
  'Finished items still in the table (done or failed): two readings a few seconds apart give the rate of a drain now (pgfence status --watch).';

-- ---------------------------------------------------------------------------------------------
-- Documents: recent conflicts, most revisions
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_documents AS
SELECT d.id                                  AS document_id,
       d.kind,
       d.status,
       d.version,
       d.version                             AS revisions,
       coalesce(a.writes_24h, 0)             AS writes_24h,
       coalesce(a.conflicts_1h, 0)           AS conflicts_1h,
       coalesce(a.conflicts_24h, 0)          AS conflicts_24h,
       coalesce(a.replays_24h, 0)            AS replays_24h,
       a.last_conflict_at,
       a.last_conflict_by,
       d.saved_by,
       d.saved_at
FROM pgfence.document d
LEFT JOIN (
  SELECT e.item_id,
         count(*) FILTER (WHERE e.event IN ('create', 'save', 'delete'))                      AS writes_24h,
         count(*) FILTER (WHERE e.event = 'conflict' AND e.at >= now() - interval '1 hour')  AS conflicts_1h,
         count(*) FILTER (WHERE e.event = 'conflict')                                         AS conflicts_24h,
         count(*) FILTER (WHERE e.event = 'replay')                                           AS replays_24h,
         max(e.at) FILTER (WHERE e.event = 'conflict')                                        AS last_conflict_at,
         (array_agg(e.actor ORDER BY e.id DESC) FILTER (WHERE e.event = 'conflict'))[1]       AS last_conflict_by
  FROM pgfence.event e
  WHERE e.module = 'document' AND e.at >= now() - interval '24 hours'
  GROUP BY e.item_id
) a ON a.item_id = d.id;
REVOKE ALL ON pgfence.audit_documents FROM PUBLIC;
GRANT SELECT ON pgfence.audit_documents TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_documents IS
  'Documents, one row each: which see conflicts, and which are written most.
ORDER BY conflicts_1h DESC for the first question, ORDER BY revisions DESC for the second. Drafts
are client-side and not listed. Reads the last 24 hours of the event log (index on event.at).
\d+ explains each column.';
COMMENT ON COLUMN pgfence.audit_documents.document_id IS 'The document''s id.';
COMMENT ON COLUMN pgfence.audit_documents.kind IS
  'Its kind (record, sheet, or one registered with document_register_kind).';
COMMENT ON COLUMN pgfence.audit_documents.status IS 'live or deleted.';
COMMENT ON COLUMN pgfence.audit_documents.version IS 'The current version.';
COMMENT ON COLUMN pgfence.audit_documents.revisions IS
  'How many versions are kept: every write (create, save, delete) is one revision, so it equals version.';
COMMENT ON COLUMN pgfence.audit_documents.writes_24h IS
  'Create, save and delete events in the last 24 hours (saves only of kinds whose log_saves is on: document_kinds).';
COMMENT ON COLUMN pgfence.audit_documents.conflicts_1h IS
  'Compare-and-swap saves refused as conflict (a writer saved on a stale version) in the last hour.';
COMMENT ON COLUMN pgfence.audit_documents.conflicts_24h IS 'The same in the last 24 hours.';
COMMENT ON COLUMN pgfence.audit_documents.replays_24h IS
  'Retried saves answered from their receipt (a lost response) in the last 24 hours.';
COMMENT ON COLUMN pgfence.audit_documents.last_conflict_at IS
  'The latest conflict (within 24 hours).';
COMMENT ON COLUMN pgfence.audit_documents.last_conflict_by IS
  'Who hit it (the actor of the conflict event).';
COMMENT ON COLUMN pgfence.audit_documents.saved_by IS 'Who saved the current version.';
COMMENT ON COLUMN pgfence.audit_documents.saved_at IS 'When.';

