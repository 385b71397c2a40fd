-- pgfence functions/91_audit_health.sql — auditing from psql: doubtful effects, queue health,
-- documents.
--
-- Public: views audit_duplicates (which external effects may have happened twice, or without
--         a receipt), audit_queue_health (per outbox channel, operation kind, and all plans),
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
-- Queue health
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
)
SELECT 'outbox'::text                                                                       AS module,
       o.channel                                                                            AS queue,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at <= clock_timestamp())           AS ready,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > clock_timestamp())            AS deferred,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > clock_timestamp() AND o.attempts > 0) AS in_backoff,
       count(*) FILTER (WHERE o.status = 'processing')                                       AS in_flight,
       count(*) FILTER (WHERE o.status = 'processing' AND o.lease_expires_at < now())        AS lapsed,
       clock_timestamp() - min(o.next_attempt_at) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at <= clock_timestamp()) AS oldest_ready_age,
       min(o.next_attempt_at) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > clock_timestamp()) AS next_due_at,
       count(*) FILTER (WHERE o.status = 'sent' AND o.finished_at >= now() - interval '5 minutes') AS done_5m,
       count(*) FILTER (WHERE o.status IN ('failed', 'dead') AND o.finished_at >= now() - interval '5 minutes') AS failed_5m,
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '5 minutes') / 300.0, 2) AS per_second_5m,
       count(*) FILTER (WHERE o.status = 'failed')                                           AS failed,
       count(*) FILTER (WHERE o.status = 'dead')                                             AS dead,
       (SELECT t.n_dead_tup FROM pg_catalog.pg_stat_user_tables t WHERE t.relid = 'pgfence.outbox'::regclass) AS dead_rows,
       (SELECT c.held_by FROM cleanup c)                                                     AS cleanup_held_by,
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '1 minute') / 60.0, 2)  AS per_second_1m,
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '15 minutes') / 900.0, 2) AS per_second_15m,
       pgfence._executor_serving('outbox', o.channel)                                       AS executors,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at <= clock_timestamp()) > 0
         AND pgfence._executor_serving('outbox', o.channel) = 0                             AS unserved,
       count(*) FILTER (WHERE o.status IN ('sent', 'failed', 'dead'))                       AS finished
FROM pgfence.outbox o
GROUP BY o.channel
UNION ALL
SELECT 'plan', '*',
       count(*) FILTER (WHERE p.status = 'approved'
                           OR (p.status = 'executing' AND p.worker IS NULL
                               AND (p.heartbeat_expires_at >= now() OR x.executors = 0))),
       count(*) FILTER (WHERE p.status = 'pending'),
       NULL::bigint,
       count(*) FILTER (WHERE p.status = 'executing' AND p.worker IS NOT NULL),
       count(*) FILTER (WHERE p.status = 'executing' AND p.heartbeat_expires_at < now()
                          AND (p.worker IS NOT NULL OR x.executors > 0)),
       now() - min(p.approved_at) FILTER (WHERE p.status = 'approved'),
       NULL::timestamptz,
       count(*) FILTER (WHERE p.status = 'executed' AND p.finished_at >= now() - interval '5 minutes'),
       count(*) FILTER (WHERE p.status = 'failed' AND p.finished_at >= now() - interval '5 minutes'),
       round(count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '5 minutes') / 300.0, 2),
       count(*) FILTER (WHERE p.status = 'failed'),
       NULL::bigint,
       (SELECT t.n_dead_tup FROM pg_catalog.pg_stat_user_tables t WHERE t.relid = 'pgfence.plan'::regclass),
       (SELECT c.held_by FROM cleanup c),
       round(count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '1 minute') / 60.0, 2),
       round(count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '15 minutes') / 900.0, 2),
       min(x.executors),
       count(*) FILTER (WHERE p.status = 'approved' OR (p.status = 'executing' AND p.worker IS NULL)) > 0
         AND min(x.executors) = 0,
       count(*) FILTER (WHERE p.status IN ('executed', 'failed'))
FROM pgfence.plan p
CROSS JOIN (SELECT pgfence._executor_serving('plan', '*') AS executors) x
HAVING count(*) > 0
UNION ALL
SELECT 'operation', o.kind,
       count(*) FILTER (WHERE o.status = 'queued'),
       NULL::bigint,
       NULL::bigint,
       count(*) FILTER (WHERE o.status = 'running'),
       count(*) FILTER (WHERE o.status = 'running' AND o.lease_expires_at < now()),
       now() - min(o.created_at) FILTER (WHERE o.status = 'queued'),
       NULL::timestamptz,
       count(*) FILTER (WHERE o.status = 'succeeded' AND o.finished_at >= now() - interval '5 minutes'),
       count(*) FILTER (WHERE o.status = 'failed' AND o.finished_at >= now() - interval '5 minutes'),
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '5 minutes') / 300.0, 2),
       count(*) FILTER (WHERE o.status = 'failed'),
       NULL::bigint,
       (SELECT t.n_dead_tup FROM pg_catalog.pg_stat_user_tables t WHERE t.relid = 'pgfence.operation'::regclass),
       (SELECT c.held_by FROM cleanup c),
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '1 minute') / 60.0, 2),
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '15 minutes') / 900.0, 2),
       pgfence._executor_serving('operation', o.kind),
       count(*) FILTER (WHERE o.status = 'queued') > 0
         AND pgfence._executor_serving('operation', o.kind) = 0,
       count(*) FILTER (WHERE o.status IN ('succeeded', 'failed'))
FROM pgfence.operation o
GROUP BY o.kind;
REVOKE ALL ON pgfence.audit_queue_health FROM PUBLIC;
GRANT SELECT ON pgfence.audit_queue_health TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_queue_health IS
  'Queue health by the database clock: one row per outbox channel, per operation kind, all plans.
The plans'' row has queue ''*''. NULL = does not apply to the module. unserved flags due work
that no live executor serves (pgfence.audit_executors); a plan run released to executors while
none serves plans counts as ready (it waits), not lapsed. Counts every row: after a
long run without purge this scans the whole outbox, like outbox_summary. \d+ explains each
column.';
COMMENT ON COLUMN pgfence.audit_queue_health.module IS 'outbox, plan or operation.';
COMMENT ON COLUMN pgfence.audit_queue_health.queue IS
  'The outbox channel or the operation kind; ''*'' for all plans.';
COMMENT ON COLUMN pgfence.audit_queue_health.ready IS
  'Waiting and due now (outbox: pending and due; plan: approved, or released between steps; operation: queued).';
COMMENT ON COLUMN pgfence.audit_queue_health.deferred IS
  'Waiting but not due (outbox: pending with a future due time, backoff or deliver_at; plan: proposals awaiting approval).';
COMMENT ON COLUMN pgfence.audit_queue_health.in_backoff IS
  'Outbox: messages waiting out a retry backoff (pending, attempts > 0, not yet due).';
COMMENT ON COLUMN pgfence.audit_queue_health.in_flight IS
  'Owned right now (processing, executing with a worker, running).';
COMMENT ON COLUMN pgfence.audit_queue_health.lapsed IS
  'Owned past the lease or heartbeat (see pgfence.audit_stuck).';
COMMENT ON COLUMN pgfence.audit_queue_health.oldest_ready_age IS
  'How long the longest-waiting ready item has waited (since due, approved or requested).';
COMMENT ON COLUMN pgfence.audit_queue_health.next_due_at IS
  'Outbox: the next deferred message''s due time.';
COMMENT ON COLUMN pgfence.audit_queue_health.done_5m IS
  'Finished successfully in the last 5 minutes (from the rows'' finished_at: works with the event log off).';
COMMENT ON COLUMN pgfence.audit_queue_health.failed_5m IS
  'Finished unsuccessfully in the last 5 minutes (outbox failed or dead, plan or operation failed).';
COMMENT ON COLUMN pgfence.audit_queue_health.per_second_5m IS
  'Everything finished in the last 5 minutes, per second (count / 300).';
COMMENT ON COLUMN pgfence.audit_queue_health.failed IS
  'Failed items still in the table (until purged).';
COMMENT ON COLUMN pgfence.audit_queue_health.dead IS
  'Outbox: dead messages still in the table (until purged).';
COMMENT ON COLUMN pgfence.audit_queue_health.dead_rows IS
  'Dead row versions in the module''s table not yet vacuumed (pg_stat_user_tables.n_dead_tup; see audit_table_health).';
COMMENT ON COLUMN pgfence.audit_queue_health.cleanup_held_by IS
  'The oldest holder of cleanup in this database (audit_cleanup_blockers): kind, pid, how long, xid age; (warn) past pgfence.cleanup_warn_after; NULL: none.';
COMMENT ON COLUMN pgfence.audit_queue_health.per_second_1m IS
  'Everything finished in the last minute, per second (count / 60): the rate of a drain now.';
COMMENT ON COLUMN pgfence.audit_queue_health.per_second_15m IS
  'Everything finished in the last 15 minutes, per second (count / 900).';
COMMENT ON COLUMN pgfence.audit_queue_health.executors IS
  'Live executors serving this queue (pgfence.audit_executors: registered, heard from within three heartbeat intervals).';
COMMENT ON COLUMN pgfence.audit_queue_health.unserved IS
  'True when the queue has ready work and no live executor serves it: nothing will take it until one starts.';
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

