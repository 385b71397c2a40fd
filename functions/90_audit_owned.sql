-- pgfence functions/90_audit.sql — auditing from psql: one documented view or function per
-- question an operator asks during an incident (docs/psql.md is the guide).
--
--   what is stuck, and since when ........ pgfence.audit_stuck
--   who owns what, until when ............. pgfence.audit_owned, pgfence.audit_owner_of(module, id)
--   what did X do .......................... pgfence.audit_timeline(module, id)
--   which external effects may have been
--   duplicated (or happened unrecorded) .... pgfence.audit_duplicates
--   queue health ........................... pgfence.audit_queue_health
--   documents: conflicts, revisions ........ pgfence.audit_documents
--   retention .............................. CALL pgfence.audit_purge(module, older_than, batch)
--
-- Everything here only reads, except the purge procedure. The views read the tables as their
-- owner; audit_owner_of and audit_timeline are STABLE SECURITY DEFINER. They are granted to
-- pgfence_admin and to the predefined monitoring role pg_monitor (which may read, never write:
-- it gets no table, no transition function and no purge). The purge procedure is for
-- pgfence_admin only.
--
-- Nothing here heals: a plan whose heartbeat lapsed stays 'executing' in these views (with
-- lapsed = true) until plan_get / plan_list / the reaper marks it failed. Reading is harmless.
-- Time: every "overdue", "remaining" and "age" is computed from now(), the database clock;
-- timestamps written inside JSON are UTC text, whatever the session TimeZone.
-- Errors: functions/ERRORS.md (22004, 22023, P0002; 2D000 for a purge CALLed in a transaction).

GRANT USAGE ON SCHEMA pgfence TO pg_monitor;
-- A monitoring login can run the glue (`pgfence status`), which checks the schema version first.
GRANT EXECUTE ON FUNCTION pgfence.schema_version() TO pg_monitor;
-- The modules' own operator views are read-only summaries: readable by monitoring too.
GRANT SELECT ON pgfence.outbox_summary, pgfence.outbox_leases, pgfence.operation_in_flight TO pg_monitor;

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._audit_ts(p_at timestamptz)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
$$;
REVOKE ALL ON FUNCTION pgfence._audit_ts(timestamptz) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._audit_ts(timestamptz) IS
  'Private: an instant as ISO-8601 text in UTC, for JSON written by the audit functions (independent of the session TimeZone).';

CREATE OR REPLACE FUNCTION pgfence._audit_check_item(p_module text, p_id bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_module IS NULL OR p_id IS NULL THEN
    RAISE EXCEPTION 'audit: module and id are required'
      USING ERRCODE = '22004', HINT = 'Pass the module (outbox, plan, operation or document) and the item''s id.';
  END IF;
  IF p_module NOT IN ('outbox', 'plan', 'operation', 'document') THEN
    RAISE EXCEPTION 'audit: unknown module "%"', p_module
      USING ERRCODE = '22023', HINT = 'One of outbox, plan, operation, document.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_check_item(text, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._audit_check_item(text, bigint) IS
  'Private: validates the (module, id) pair of audit_owner_of / audit_timeline; raises 22004 (NULL) or 22023 (unknown module).';

-- ---------------------------------------------------------------------------------------------
-- Who owns what, until when
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_owned AS
SELECT 'outbox'::text                          AS module,
       o.id                                    AS item_id,
       o.channel                               AS queue,
       o.status,
       o.locked_by                             AS owner,
       o.attempts::bigint                      AS fence,
       o.claimed_at,
       o.claimed_at                            AS last_seen_at,
       o.lease_expires_at                      AS expires_at,
       o.lease_expires_at - now()              AS remaining,
       o.lease_expires_at < now()              AS lapsed
FROM pgfence.outbox o
WHERE o.status = 'processing'
UNION ALL
SELECT 'plan', p.id, '*', p.status, p.worker, p.run_token, p.started_at, p.heartbeat_at,
       p.heartbeat_expires_at, p.heartbeat_expires_at - now(), p.heartbeat_expires_at < now()
FROM pgfence.plan p
WHERE p.status = 'executing'
UNION ALL
SELECT 'operation', o.id, o.kind, o.status, o.locked_by, o.fence::bigint, o.claimed_at,
       o.lease_expires_at - o.lease, o.lease_expires_at, o.lease_expires_at - now(),
       o.lease_expires_at < now()
FROM pgfence.operation o
WHERE o.status = 'running';
REVOKE ALL ON pgfence.audit_owned FROM PUBLIC;
GRANT SELECT ON pgfence.audit_owned TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_owned IS
  'Who owns what right now, until when (database clock): every outbox message being delivered (processing), plan being executed and operation running. queue = the outbox channel or operation kind (''*'' for plans); owner = the worker (NULL for a plan released between steps and waiting for another worker); fence = the token the owner must present (outbox attempt, plan run token, operation fence); claimed_at = when the current claim started (plans: when the run started); last_seen_at = the owner''s last sign of life (outbox: the claim; plan: the last heartbeat or step; operation: the last lease extension); expires_at = lease or heartbeat deadline; remaining = expires_at - now() (negative once lapsed); lapsed = the deadline has passed (see pgfence.audit_stuck). For one item use pgfence.audit_owner_of(module, id).';

CREATE OR REPLACE FUNCTION pgfence.audit_owner_of(p_module text, p_id bigint)
RETURNS TABLE (
  module       text,
  item_id      bigint,
  queue        text,
  status       text,
  owned        boolean,
  owner        text,
  fence        bigint,
  claimed_at   timestamptz,
  last_seen_at timestamptz,
  expires_at   timestamptz,
  remaining    interval,
  lapsed       boolean,
  last_owner   text
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  PERFORM pgfence._audit_check_item(p_module, p_id);
  IF p_module = 'outbox' THEN
    RETURN QUERY
    SELECT 'outbox'::text, o.id, o.channel, o.status, o.status = 'processing',
           o.locked_by, o.attempts::bigint,
           CASE WHEN o.status = 'processing' THEN o.claimed_at END,
           CASE WHEN o.status = 'processing' THEN o.claimed_at END,
           o.lease_expires_at, o.lease_expires_at - now(), coalesce(o.lease_expires_at < now(), false),
           coalesce(o.locked_by,
                    (SELECT e.actor FROM pgfence.event e
                     WHERE e.module = 'outbox' AND e.item_id = o.id AND e.event = 'claim'
                     ORDER BY e.id DESC LIMIT 1))
    FROM pgfence.outbox o WHERE o.id = p_id;
  ELSIF p_module = 'plan' THEN
    RETURN QUERY
    SELECT 'plan'::text, p.id, '*'::text, p.status, p.status = 'executing',
           CASE WHEN p.status = 'executing' THEN p.worker END,
           CASE WHEN p.status = 'executing' THEN p.run_token END,
           CASE WHEN p.status = 'executing' THEN p.started_at END,
           CASE WHEN p.status = 'executing' THEN p.heartbeat_at END,
           CASE WHEN p.status = 'executing' THEN p.heartbeat_expires_at END,
           CASE WHEN p.status = 'executing' THEN p.heartbeat_expires_at - now() END,
           p.status = 'executing' AND p.heartbeat_expires_at < now(),
           p.worker
    FROM pgfence.plan p WHERE p.id = p_id;
  ELSIF p_module = 'operation' THEN
    RETURN QUERY
    SELECT 'operation'::text, o.id, o.kind, o.status, o.status = 'running',
           CASE WHEN o.status = 'running' THEN o.locked_by END, o.fence::bigint,
           CASE WHEN o.status = 'running' THEN o.claimed_at END,
           CASE WHEN o.status = 'running' THEN o.lease_expires_at - o.lease END,
           o.lease_expires_at, o.lease_expires_at - now(), coalesce(o.lease_expires_at < now(), false),
           o.locked_by
    FROM pgfence.operation o WHERE o.id = p_id;
  ELSE
    RETURN QUERY
    SELECT 'document'::text, d.id, d.kind, d.status, false, NULL::text, d.version, NULL::timestamptz,
           d.saved_at, NULL::timestamptz, NULL::interval, false, d.saved_by
    FROM pgfence.document d WHERE d.id = p_id;
  END IF;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'audit_owner_of: no % with id %', p_module, p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id; purged items are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.audit_owner_of(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.audit_owner_of(text, bigint) TO pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence.audit_owner_of(text, bigint) IS
  'Who owns one item, until when: module outbox | plan | operation | document and its id. owned = the item is in its owned status (outbox processing, plan executing, operation running; a document is never owned: its fence is the version a save must present); owner, fence, claimed_at, last_seen_at, expires_at, remaining and lapsed as in pgfence.audit_owned; last_owner = the current or last worker (for a finished outbox message only known from the event log, when its channel logs events; for a document: who saved the current version). Reads only: a lapsed plan is reported, not healed. Errors: 22004 (module or id NULL), 22023 (unknown module), P0002 (no such item).';

-- ---------------------------------------------------------------------------------------------
-- What is stuck, and since when
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_stuck AS
SELECT 'outbox'::text                          AS module,
       o.id                                    AS item_id,
       o.channel                               AS queue,
       o.status,
       o.locked_by                             AS owner,
       o.attempts::bigint                      AS fence,
       o.claimed_at,
       o.claimed_at                            AS last_seen_at,
       o.lease_expires_at                      AS expired_at,
       now() - o.lease_expires_at              AS overdue,
       CASE WHEN o.attempts >= o.max_attempts
         THEN format('outbox_reclaim_stale makes it dead (attempt %s of %s used); %s may have delivered it',
                     o.attempts, o.max_attempts, o.locked_by)
         ELSE format('outbox_reclaim_stale puts it back to pending, attempt %s of %s after backoff; %s may have delivered it (possible duplicate)',
                     o.attempts + 1, o.max_attempts, o.locked_by)
       END                                     AS next
FROM pgfence.outbox o
WHERE o.status = 'processing' AND o.lease_expires_at < now()
UNION ALL
SELECT 'plan', p.id, '*', p.status, p.worker, p.run_token, p.started_at, p.heartbeat_at,
       p.heartbeat_expires_at, now() - p.heartbeat_expires_at,
       format('the next read (plan_get, plan_list) or plan_reap_stale marks it failed (interrupted) at step %s of %s',
              p.next_step, p.step_count)
       || CASE WHEN p.external_started_at IS NOT NULL
            THEN format('; external step %s was in flight: it may have happened (key %s)',
                        p.next_step, 'pgfence-plan-' || p.id || '-step-' || p.next_step)
            WHEN p.worker IS NULL THEN '; it was released between steps and no worker took it over'
            ELSE '' END
FROM pgfence.plan p
WHERE p.status = 'executing' AND p.heartbeat_expires_at < now()
UNION ALL
SELECT 'operation', o.id, o.kind, o.status, o.locked_by, o.fence::bigint, o.claimed_at,
       o.lease_expires_at - o.lease, o.lease_expires_at, now() - o.lease_expires_at,
       CASE
         WHEN o.issue_started_at IS NULL
           THEN 'operation_reap puts it back to queued: no external call was started'
         WHEN o.external_ref IS NOT NULL
           THEN format('the next operation_claim takes it over and only polls external reference %s', o.external_ref)
         WHEN o.issue_idempotent
           THEN 'the next operation_claim takes it over and re-issues the call with the idempotency key (the external API deduplicates)'
         ELSE format('operation_reap fails it as outcome unknown: the external call was started without an idempotency key and no reference was recorded; check %s by hand',
                     o.target)
       END
FROM pgfence.operation o
WHERE o.status = 'running' AND o.lease_expires_at < now();
REVOKE ALL ON pgfence.audit_stuck FROM PUBLIC;
GRANT SELECT ON pgfence.audit_stuck TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_stuck IS
  'What is stuck, and since when: every owned item whose lease or heartbeat has lapsed by the database clock — outbox messages processing past their lease, plans executing past their heartbeat deadline (including runs released and never taken over; plans heal lazily, so they are listed until the next read or reaper marks them failed), operations running past their lease. owner = the worker that went silent; fence = its token (outbox attempt, plan run token, operation fence); claimed_at / last_seen_at = when it took the item / last showed life; expired_at = the deadline; overdue = now() - expired_at; next = what pgfence does about it on its own (the reaper or the next claim) and what may already have happened outside. Empty when nothing is stuck. Usually self-healing within one reaper interval; a row that stays means no executor is running the reaper for that module.';

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
  'Which external effects may have been duplicated, or may have happened without a receipt, so an operator can check downstream. outbox lease_lapsed: a message claimed under an attempt whose lease lapsed and that the reaper took back (from the reaper''s receipts in pgfence.outbox_lapse, whatever the channel''s log_events setting): that worker may have delivered it before it died, so a sent message may have reached the receiver more than once. plan external_step_in_doubt: an external step handed to a worker whose run was interrupted before it recorded the outcome. operation reissued: the external call was issued more than once (always with the idempotency key); operation outcome_unknown: a call was started without the key and no reference was recorded. fences = the attempts / fence tokens / step under which the effect was attempted; lost_by = the workers that held them; since = when the doubt began; idempotency_key = the key the receiver or external API saw (deduplicate or search on it); check_downstream = what to verify.';

-- ---------------------------------------------------------------------------------------------
-- Queue health
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.audit_queue_health AS
SELECT 'outbox'::text                                                                       AS module,
       o.channel                                                                            AS queue,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at <= now())           AS ready,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > now())            AS deferred,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > now() AND o.attempts > 0) AS in_backoff,
       count(*) FILTER (WHERE o.status = 'processing')                                       AS in_flight,
       count(*) FILTER (WHERE o.status = 'processing' AND o.lease_expires_at < now())        AS lapsed,
       now() - min(o.next_attempt_at) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at <= now()) AS oldest_ready_age,
       min(o.next_attempt_at) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > now()) AS next_due_at,
       count(*) FILTER (WHERE o.status = 'sent' AND o.finished_at >= now() - interval '5 minutes') AS done_5m,
       count(*) FILTER (WHERE o.status IN ('failed', 'dead') AND o.finished_at >= now() - interval '5 minutes') AS failed_5m,
       round(count(*) FILTER (WHERE o.finished_at >= now() - interval '5 minutes') / 300.0, 2) AS per_second_5m,
       count(*) FILTER (WHERE o.status = 'failed')                                           AS failed,
       count(*) FILTER (WHERE o.status = 'dead')                                             AS dead
FROM pgfence.outbox o
GROUP BY o.channel
UNION ALL
SELECT 'plan', '*',
       count(*) FILTER (WHERE p.status = 'approved'
                           OR (p.status = 'executing' AND p.worker IS NULL AND p.heartbeat_expires_at >= now())),
       count(*) FILTER (WHERE p.status = 'pending'),
       NULL::bigint,
       count(*) FILTER (WHERE p.status = 'executing' AND p.worker IS NOT NULL),
       count(*) FILTER (WHERE p.status = 'executing' AND p.heartbeat_expires_at < now()),
       now() - min(p.approved_at) FILTER (WHERE p.status = 'approved'),
       NULL::timestamptz,
       count(*) FILTER (WHERE p.status = 'executed' AND p.finished_at >= now() - interval '5 minutes'),
       count(*) FILTER (WHERE p.status = 'failed' AND p.finished_at >= now() - interval '5 minutes'),
       round(count(*) FILTER (WHERE p.status IN ('executed', 'failed') AND p.finished_at >= now() - interval '5 minutes') / 300.0, 2),
       count(*) FILTER (WHERE p.status = 'failed'),
       NULL::bigint
FROM pgfence.plan p
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
       NULL::bigint
FROM pgfence.operation o
GROUP BY o.kind;
REVOKE ALL ON pgfence.audit_queue_health FROM PUBLIC;
GRANT SELECT ON pgfence.audit_queue_health TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_queue_health IS
  'Queue health, one row per outbox channel, per operation kind, and one for all plans (queue ''*''), by the database clock. ready = waiting and due now (outbox: pending and due; plan: approved, or released between steps; operation: queued); deferred = waiting but not due (outbox: pending with a future due time — backoff or deliver_at; plan: proposals awaiting approval); in_backoff = outbox messages waiting out a retry backoff (pending, attempts > 0, not yet due); in_flight = owned right now; lapsed = owned past the lease / heartbeat (see audit_stuck); oldest_ready_age = how long the longest-waiting ready item has waited (since due, approved or requested); next_due_at = the next deferred outbox message''s due time; done_5m / failed_5m = finished successfully / unsuccessfully (outbox failed or dead, plan or operation failed) in the last 5 minutes, from the rows'' finished_at, so it works with the event log off; per_second_5m = everything finished in the last 5 minutes / 300; failed, dead = totals still in the table (until purged). NULL = does not apply to the module. Counts every row: after a long run without purge this scans the whole outbox, like outbox_summary.';

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
  'Documents, one row each, for the two questions about them: which see conflicts (ORDER BY conflicts_1h DESC) and which are written most (ORDER BY revisions DESC). version = the current version; revisions = how many versions are kept (every write — create, save, delete — is one revision, so it equals version); writes_24h, conflicts_1h, conflicts_24h, replays_24h = create/save/delete events, compare-and-swap saves refused as conflict (a writer saved on a stale version), and retried saves answered from their receipt (a lost response), in the last hour / 24 hours of the event log (database clock); last_conflict_at / _by = the latest conflict and who hit it. Drafts are client-side and not listed. Reads the last 24 hours of the event log (index on event.at).';

-- ---------------------------------------------------------------------------------------------
-- What did X do: the timeline of one item
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.audit_timeline(p_module text, p_id bigint)
RETURNS TABLE (
  at          timestamptz,
  source      text,
  event       text,
  from_status text,
  to_status   text,
  actor       text,
  fence       bigint,
  detail      jsonb,
  db_user     text
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_rows bigint;
BEGIN
  PERFORM pgfence._audit_check_item(p_module, p_id);
  IF p_module = 'outbox' THEN
    RETURN QUERY
    WITH m AS (SELECT o.* FROM pgfence.outbox o WHERE o.id = p_id),
    ev AS (SELECT e.* FROM pgfence.event e WHERE e.module = 'outbox' AND e.item_id = p_id),
    logged AS (SELECT EXISTS (SELECT 1 FROM ev) AS yes),
    t AS (
      SELECT e.at, 'event'::text AS source, e.event, e.from_status, e.to_status, e.actor, e.fence,
             e.detail, e.db_user, 1 AS grp, e.id AS ord
      FROM ev e
      UNION ALL
      -- Without the event log: what the row and the reaper's lapse receipts tell.
      SELECT m.created_at, 'row', 'enqueue', NULL, 'pending', NULL, 0::bigint,
             jsonb_strip_nulls(jsonb_build_object('channel', m.channel, 'recipient', m.recipient,
                                                  'idempotency_key', m.idempotency_key,
                                                  'max_attempts', m.max_attempts)),
             NULL::text, 1, 0::bigint
      FROM m WHERE NOT (SELECT yes FROM logged)
      UNION ALL
      SELECT l.reclaimed_at, 'lapse', 'lease_lapsed', 'processing', l.outcome, 'reaper', l.attempt::bigint,
             jsonb_build_object('worker', l.worker, 'claimed_at', pgfence._audit_ts(l.claimed_at),
                                'lease_expired_at', pgfence._audit_ts(l.lease_expires_at),
                                'note', 'the worker may have delivered this attempt'),
             NULL, 1, l.attempt * 10 + 2
      FROM pgfence.outbox_lapse l WHERE l.message_id = p_id AND NOT (SELECT yes FROM logged)
      UNION ALL
      SELECT m.claimed_at, 'row', 'claim', 'pending', 'processing', m.locked_by, m.attempts::bigint,
             jsonb_build_object('attempt', m.attempts, 'max_attempts', m.max_attempts,
                                'note', 'the latest claim; earlier claims are not kept on the row'),
             NULL, 1, m.attempts * 10 + 1
      FROM m WHERE NOT (SELECT yes FROM logged) AND m.claimed_at IS NOT NULL
      UNION ALL
      SELECT m.finished_at, 'row', 'finish', 'processing', m.status, NULL, m.attempts::bigint,
             jsonb_strip_nulls(jsonb_build_object('receipt', m.receipt, 'error', m.last_error)),
             NULL, 1, m.attempts * 10 + 3
      FROM m WHERE NOT (SELECT yes FROM logged) AND m.finished_at IS NOT NULL
      UNION ALL
      SELECT m.updated_at, 'row', 'retry', NULL, 'pending', NULL, m.attempts::bigint,
             jsonb_build_object('error', m.last_error, 'next_attempt_at', pgfence._audit_ts(m.next_attempt_at)),
             NULL, 1, m.attempts * 10 + 3
      FROM m WHERE NOT (SELECT yes FROM logged) AND m.status = 'pending' AND m.attempts > 0
      UNION ALL
      SELECT now(), 'row', 'current', NULL, m.status, m.locked_by, m.attempts::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'attempts', m.attempts, 'max_attempts', m.max_attempts,
               'next_attempt_at', CASE WHEN m.status = 'pending' THEN pgfence._audit_ts(m.next_attempt_at) END,
               'lease_expires_at', pgfence._audit_ts(m.lease_expires_at),
               'lease_lapsed', CASE WHEN m.status = 'processing' THEN m.lease_expires_at < now() END,
               'last_error', m.last_error, 'receipt', m.receipt, 'log_events', m.log_events,
               'lapsed_attempts', (SELECT array_agg(l.attempt ORDER BY l.attempt) FROM pgfence.outbox_lapse l
                                   WHERE l.message_id = m.id))),
             NULL, 2, 0
      FROM m)
    SELECT t.at, t.source, t.event, t.from_status, t.to_status, t.actor, t.fence, t.detail, t.db_user
    FROM t ORDER BY t.grp, t.at, t.ord;

  ELSIF p_module = 'plan' THEN
    RETURN QUERY
    WITH p AS (SELECT pl.* FROM pgfence.plan pl WHERE pl.id = p_id),
    t AS (
      -- Receipts come from the steps themselves (complete outputs and errors), not from the
      -- 'receipt' events that mirror them.
      SELECT e.at, 'event'::text AS source, e.event, e.from_status, e.to_status, e.actor, e.fence,
             e.detail, e.db_user, 1 AS grp, e.id AS ord
      FROM pgfence.event e
      WHERE e.module = 'plan' AND e.item_id = p_id AND e.event <> 'receipt'
      UNION ALL
      SELECT s.finished_at, 'receipt', 'step_' || s.outcome, NULL, NULL, s.worker, s.step_index::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'step', s.step_index, 'action', s.action, 'kind', s.kind, 'outcome', s.outcome,
               'sqlstate', s.error ->> 'sqlstate', 'message', s.error ->> 'message', 'error', s.error,
               'output', s.output, 'started_at', pgfence._audit_ts(s.started_at),
               'idempotency_key', CASE WHEN s.kind = 'external' THEN 'pgfence-plan-' || s.plan_id || '-step-' || s.step_index END)),
             -- the login that wrote the receipt: from the receipt's event (same transaction)
             (SELECT e.db_user FROM pgfence.event e
              WHERE e.module = 'plan' AND e.item_id = s.plan_id AND e.event = 'receipt' AND e.fence = s.step_index
              ORDER BY e.id DESC LIMIT 1),
             1, 0
      FROM pgfence.plan_step s
      WHERE s.plan_id = p_id AND s.outcome IS NOT NULL
      UNION ALL
      SELECT p.external_started_at, 'row',
             CASE WHEN p.status = 'executing' AND p.heartbeat_expires_at >= now() THEN 'step_started' ELSE 'step_in_doubt' END,
             NULL, NULL, p.worker, p.next_step::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'step', p.next_step, 'action', s.action, 'kind', s.kind, 'recipient', s.args ->> 'recipient',
               'idempotency_key', 'pgfence-plan-' || p.id || '-step-' || p.next_step,
               'note', CASE WHEN p.status = 'executing' AND p.heartbeat_expires_at >= now()
                         THEN 'handed to the executor; its receipt is not written yet'
                         ELSE 'the run was interrupted before this external step was recorded: it may have happened' END)),
             NULL, 1, 0
      FROM p JOIN pgfence.plan_step s ON s.plan_id = p.id AND s.step_index = p.next_step
      WHERE p.external_started_at IS NOT NULL
      UNION ALL
      SELECT now(), 'row', 'current', NULL, p.status, p.worker, NULL::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'failure', p.failure, 'next_step', p.next_step, 'step_count', p.step_count,
               'steps_ok', (SELECT count(*) FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.outcome = 'ok'),
               'heartbeat_expires_at', CASE WHEN p.status = 'executing' THEN pgfence._audit_ts(p.heartbeat_expires_at) END,
               'heartbeat_lapsed', CASE WHEN p.status = 'executing' THEN p.heartbeat_expires_at < now() END,
               'compensates', p.compensates,
               'compensated_by', (SELECT array_agg(c.id ORDER BY c.id) FROM pgfence.plan c WHERE c.compensates = p.id))),
             NULL, 2, 0
      FROM p)
    SELECT t.at, t.source, t.event, t.from_status, t.to_status, t.actor, t.fence, t.detail, t.db_user
    FROM t ORDER BY t.grp, t.at, t.ord;

  ELSIF p_module = 'operation' THEN
    RETURN QUERY
    WITH t AS (
      SELECT e.at, 'event'::text AS source, e.event, e.from_status, e.to_status, e.actor, e.fence,
             e.detail, e.db_user, 1 AS grp, e.id AS ord
      FROM pgfence.event e
      WHERE e.module = 'operation' AND e.item_id = p_id
      UNION ALL
      SELECT now(), 'row', 'current', NULL, o.status, o.locked_by, o.fence::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'kind', o.kind, 'target', o.target,
               'lease_expires_at', pgfence._audit_ts(o.lease_expires_at),
               'lease_lapsed', CASE WHEN o.status = 'running' THEN o.lease_expires_at < now() END,
               'issue_count', o.issue_count, 'external_ref', o.external_ref,
               'external_state', o.external_state, 'polled_at', pgfence._audit_ts(o.polled_at),
               'poll_count', o.poll_count,
               'cancel_requested_by', o.cancel_requested_by, 'result', o.result, 'error', o.error)),
             NULL, 2, 0
      FROM pgfence.operation o WHERE o.id = p_id)
    SELECT t.at, t.source, t.event, t.from_status, t.to_status, t.actor, t.fence, t.detail, t.db_user
    FROM t ORDER BY t.grp, t.at, t.ord;

  ELSE
    RETURN QUERY
    WITH t AS (
      SELECT e.at, 'event'::text AS source, e.event, e.from_status, e.to_status, e.actor, e.fence,
             e.detail, e.db_user, 1 AS grp, e.id AS ord
      FROM pgfence.event e
      WHERE e.module = 'document' AND e.item_id = p_id
      UNION ALL
      SELECT now(), 'row', 'current', NULL, d.status, d.saved_by, d.version,
             jsonb_strip_nulls(jsonb_build_object('kind', d.kind, 'version', d.version,
                                                  'saved_at', pgfence._audit_ts(d.saved_at),
                                                  'created_by', d.created_by, 'save_id', d.save_id)),
             NULL, 2, 0
      FROM pgfence.document d WHERE d.id = p_id)
    SELECT t.at, t.source, t.event, t.from_status, t.to_status, t.actor, t.fence, t.detail, t.db_user
    FROM t ORDER BY t.grp, t.at, t.ord;
  END IF;
  GET DIAGNOSTICS v_rows = ROW_COUNT;
  IF v_rows = 0 THEN
    RAISE EXCEPTION 'audit_timeline: no % with id %', p_module, p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id; purged items and their events are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.audit_timeline(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.audit_timeline(text, bigint) TO pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence.audit_timeline(text, bigint) IS
  'What did one item do: its timeline, oldest first, ending with its current state. Columns at, source, event, from_status, to_status, actor, fence, detail, db_user (the database login whose transaction wrote an event or a plan receipt: actor is the name it passed, db_user who it really was; NULL for rows rebuilt from the item''s row). module outbox | plan | operation | document (create, save, delete, conflict and replay events: who, under which version — the fence —, based on which version). source event = a row of pgfence.event (transitions with who made them — actor — and under which fence, errors with SQLSTATE in detail), written in the same transaction as the change; receipt = a plan step''s receipt (outcome, output, error SQLSTATE and message); lapse = the outbox reaper''s receipt of a lapsed lease; row = what the item''s row says (for outbox messages whose channel does not log events: enqueue, the latest claim, the finish with receipt or error, a scheduled retry; a plan''s external step in flight or in doubt; and always a last row event = current, at = now(), with the item''s state: attempts, lease, last error, receipt, polled external state, ...). Operation events include every polled external state change. Reads only. Errors: 22004 (module or id NULL), 22023 (unknown module), P0002 (no such item and no event for it).';

-- ---------------------------------------------------------------------------------------------
-- Retention: purge terminal items (and their events) in short batches
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._audit_purge_batch(
  p_module text,
  p_cutoff timestamptz,
  p_after  bigint,
  p_batch  integer,
  OUT last_id bigint,
  OUT purged  integer,
  OUT done    boolean
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
-- The modules' tables refuse DELETE unless pgfence.purging is on (tg_purge_only). It is on for
-- this call only: set at the start, put back as it was before returning, so it cannot leak into
-- the rest of a caller's transaction (an error rolls the setting back with the batch). Not a
-- SET clause: on PostgreSQL 15 a SET clause naming a custom setting makes CREATE FUNCTION need
-- GRANT SET ON PARAMETER, which a non-superuser owner does not have.
AS $$
-- Walks the item table by primary key from p_after, p_batch rows at a time, so that every
-- batch costs the same whatever the table size (no index on finished_at is needed, and none is
-- maintained on the outbox hot path). Items are created in id order, and an item finishes after
-- it was created: once a whole window was created after the cutoff, nothing further can be old
-- enough (done). Rows locked by someone (a concurrent requeue) are skipped, never waited for.
DECLARE
  v_ids     bigint[];
  v_scanned integer;
  v_min_at  timestamptz;
  v_n       integer := 0;
  v_purging text := pg_catalog.current_setting('pgfence.purging', true);
BEGIN
  PERFORM pg_catalog.set_config('pgfence.purging', 'on', true);
  IF p_module = 'outbox' THEN
    SELECT max(w.id), count(*), min(w.created_at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT o.id, o.created_at FROM pgfence.outbox o WHERE o.id > p_after ORDER BY o.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      SELECT array_agg(c.id) INTO v_ids FROM (
        SELECT o.id FROM pgfence.outbox o
        WHERE o.id > p_after AND o.id <= last_id
          AND o.status IN ('sent', 'failed', 'dead') AND o.finished_at < p_cutoff
        FOR UPDATE SKIP LOCKED) c;
      IF v_ids IS NOT NULL THEN
        DELETE FROM pgfence.outbox o
        WHERE o.id = ANY (v_ids) AND o.status IN ('sent', 'failed', 'dead') AND o.finished_at < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        DELETE FROM pgfence.outbox_lapse l WHERE l.message_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = l.message_id);
        DELETE FROM pgfence.event e WHERE e.module = 'outbox' AND e.item_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = e.item_id);
      END IF;
    END IF;
  ELSIF p_module = 'plan' THEN
    SELECT max(w.id), count(*), min(w.proposed_at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT p.id, p.proposed_at FROM pgfence.plan p WHERE p.id > p_after ORDER BY p.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      SELECT array_agg(c.id) INTO v_ids FROM (
        SELECT p.id FROM pgfence.plan p
        WHERE p.id > p_after AND p.id <= last_id
          AND p.status IN ('executed', 'failed', 'rejected', 'expired') AND p.finished_at < p_cutoff
        FOR UPDATE SKIP LOCKED) c;
      -- A plan that a kept plan compensates stays (foreign key), and so does, transitively, the
      -- plan it compensates; they go in a later purge, after the kept one.
      IF v_ids IS NOT NULL THEN
        WITH RECURSIVE blocked(id) AS (
          SELECT c.compensates FROM pgfence.plan c
          WHERE c.compensates = ANY (v_ids) AND NOT c.id = ANY (v_ids)
          UNION
          SELECT c.compensates FROM pgfence.plan c JOIN blocked b ON c.id = b.id
          WHERE c.compensates = ANY (v_ids)
        )
        SELECT array_agg(u.id) INTO v_ids FROM unnest(v_ids) AS u(id)
        WHERE NOT EXISTS (SELECT 1 FROM blocked b WHERE b.id = u.id);
      END IF;
      IF v_ids IS NOT NULL THEN
        DELETE FROM pgfence.plan p
        WHERE p.id = ANY (v_ids)
          AND p.status IN ('executed', 'failed', 'rejected', 'expired') AND p.finished_at < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        DELETE FROM pgfence.event e WHERE e.module = 'plan' AND e.item_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.plan p WHERE p.id = e.item_id);
      END IF;
    END IF;
  ELSIF p_module = 'operation' THEN
    SELECT max(w.id), count(*), min(w.created_at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT o.id, o.created_at FROM pgfence.operation o WHERE o.id > p_after ORDER BY o.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      SELECT array_agg(c.id) INTO v_ids FROM (
        SELECT o.id FROM pgfence.operation o
        WHERE o.id > p_after AND o.id <= last_id
          AND o.status IN ('succeeded', 'failed', 'canceled') AND o.finished_at < p_cutoff
        FOR UPDATE SKIP LOCKED) c;
      IF v_ids IS NOT NULL THEN
        DELETE FROM pgfence.operation o
        WHERE o.id = ANY (v_ids) AND o.status IN ('succeeded', 'failed', 'canceled') AND o.finished_at < p_cutoff;
        GET DIAGNOSTICS v_n = ROW_COUNT;
        DELETE FROM pgfence.event e WHERE e.module = 'operation' AND e.item_id = ANY (v_ids)
          AND NOT EXISTS (SELECT 1 FROM pgfence.operation o WHERE o.id = e.item_id);
      END IF;
    END IF;
  ELSIF p_module = 'document' THEN
    -- Documents are never deleted (a deleted one keeps its tombstone, and every version is a
    -- revision: the save receipts). Only their events age out.
    SELECT max(w.id), count(*), min(w.at) INTO last_id, v_scanned, v_min_at
    FROM (SELECT e.id, e.at FROM pgfence.event e WHERE e.id > p_after ORDER BY e.id LIMIT p_batch) w;
    IF v_scanned > 0 THEN
      DELETE FROM pgfence.event e
      WHERE e.id > p_after AND e.id <= last_id AND e.module = 'document' AND e.at < p_cutoff;
      GET DIAGNOSTICS v_n = ROW_COUNT;
    END IF;
  ELSE
    RAISE EXCEPTION 'purge: unknown module "%"', p_module USING ERRCODE = '22023';
  END IF;
  purged := v_n;
  done := v_scanned < p_batch OR v_min_at >= p_cutoff;
  last_id := coalesce(last_id, p_after);
  PERFORM pg_catalog.set_config('pgfence.purging', coalesce(v_purging, ''), true);
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_purge_batch(text, timestamptz, bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._audit_purge_batch(text, timestamptz, bigint, integer) TO pgfence_admin;
COMMENT ON FUNCTION pgfence._audit_purge_batch(text, timestamptz, bigint, integer) IS
  'Private, one purge batch (CALL pgfence.audit_purge calls it and COMMIT after each): looks at the next p_batch items of the module after id p_after and deletes those that are terminal (outbox sent | failed | dead; plan executed | failed | rejected | expired; operation succeeded | failed | canceled) and finished before p_cutoff, skipping rows locked right now and plans that a kept plan compensates, with their events (and outbox lapse receipts, plan steps). For module document it deletes document events older than p_cutoff. Returns the last id looked at, how many items (events for documents) it deleted, and whether the walk is done. Runs with pgfence.purging = on (set at its start and put back before it returns: only for the duration of the call), the one setting under which the modules'' delete guards let rows go. Security definer for the procedure, which cannot be; granted to pgfence_admin.';

CREATE OR REPLACE FUNCTION pgfence._audit_check_purge(p_older_than interval, p_batch_size integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_older_than IS NULL OR p_batch_size IS NULL THEN
    RAISE EXCEPTION 'purge: older_than and batch_size are required'
      USING ERRCODE = '22004', HINT = 'Omit them for the defaults.';
  END IF;
  IF p_older_than < interval '0' THEN
    RAISE EXCEPTION 'purge: older_than must not be negative, got %', p_older_than
      USING ERRCODE = '22023', HINT = 'Pass how long finished items are kept, e.g. interval ''7 days''.';
  END IF;
  IF p_batch_size NOT BETWEEN 1 AND 100000 THEN
    RAISE EXCEPTION 'purge: batch_size must be between 1 and 100000, got %', p_batch_size
      USING ERRCODE = '22023', HINT = 'Each batch is one short transaction; the default suits most tables.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_check_purge(interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._audit_check_purge(interval, integer) TO pgfence_admin;
COMMENT ON FUNCTION pgfence._audit_check_purge(interval, integer) IS
  'Private: validates the arguments of audit_purge; raises 22004 (NULL) or 22023 (negative older_than, batch_size outside 1..100000).';

-- The procedure: not security definer and without SET clauses, because a procedure with
-- either cannot COMMIT; every name is schema-qualified. Each batch is its own transaction.
-- (One procedure for all modules rather than outbox_purge, plan_purge, ...: the modules'
-- suites check that every outbox_* / plan_* routine is security definer, which this cannot be.)
CREATE OR REPLACE PROCEDURE pgfence.audit_purge(
  p_module     text,
  p_older_than interval DEFAULT NULL,
  p_batch_size integer DEFAULT NULL,
  INOUT purged bigint DEFAULT NULL
)
LANGUAGE plpgsql
AS $$
DECLARE
  v_older  interval;
  v_batch  integer;
  v_cutoff timestamptz;
  v_after  bigint := 0;
  v        record;
BEGIN
  IF p_module IS NULL THEN
    RAISE EXCEPTION 'audit_purge: module is required'
      USING ERRCODE = '22004', HINT = 'One of outbox, plan, operation, document.';
  END IF;
  IF p_module NOT IN ('outbox', 'plan', 'operation', 'document') THEN
    RAISE EXCEPTION 'audit_purge: unknown module "%"', p_module
      USING ERRCODE = '22023', HINT = 'One of outbox, plan, operation, document.';
  END IF;
  -- Documented defaults: the outbox is high volume, the others are an audit trail.
  v_older := coalesce(p_older_than, CASE p_module WHEN 'outbox' THEN interval '7 days' ELSE interval '90 days' END);
  v_batch := coalesce(p_batch_size, CASE p_module WHEN 'plan' THEN 100 WHEN 'document' THEN 5000 ELSE 1000 END);
  PERFORM pgfence._audit_check_purge(v_older, v_batch);
  BEGIN
    v_cutoff := now() - v_older;
  EXCEPTION WHEN datetime_field_overflow THEN
    -- older than the earliest timestamp PostgreSQL has (4713 BC): nothing is that old
    v_cutoff := '-infinity';
  END;
  purged := 0;
  LOOP
    SELECT * INTO v FROM pgfence._audit_purge_batch(p_module, v_cutoff, v_after, v_batch);
    purged := purged + v.purged;
    COMMIT;
    EXIT WHEN v.done;
    v_after := v.last_id;
  END LOOP;
END
$$;
REVOKE ALL ON PROCEDURE pgfence.audit_purge(text, interval, integer, bigint) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE pgfence.audit_purge(text, interval, integer, bigint) TO pgfence_admin;
COMMENT ON PROCEDURE pgfence.audit_purge(text, interval, integer, bigint) IS
  'Retention: CALL pgfence.audit_purge(module [, older_than [, batch_size]]). Deletes the module''s terminal items that finished more than older_than ago (database clock, fixed when the call starts) together with their events: outbox messages sent, failed or dead (and the reaper''s lapse receipts; default older_than 7 days, batch_size 1000); plans executed, failed, rejected or expired, with their steps and receipts (90 days, 100: a plan may have 10000 steps), keeping a plan that a kept plan compensates until that one goes; operations succeeded, failed or canceled (90 days, 1000). Pending, processing, approved, executing, queued and running items are never touched. For module document it deletes document events older than older_than (90 days, 5000); documents and their revisions are never deleted (a deleted document keeps its tombstone; revisions are the save receipts). Walks the table batch_size rows per transaction and commits after each, so every lock is short and rows locked by someone else (a requeue) are skipped. Returns purged = items deleted (events, for documents); an older_than reaching before the earliest timestamp (4713 BC) purges nothing. Must be called outside an explicit transaction block (it commits). Errors: 22004 (module NULL), 22023 (unknown module, negative older_than, batch_size outside 1..100000), 2D000 (inside a transaction block).';
