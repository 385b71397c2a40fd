-- pgfence functions/90_audit_owned.sql — auditing from psql: who owns what, what is stuck.
--
-- Public: views audit_owned (every owned item, until when), audit_stuck (the lapsed ones, and
--         what happens next); audit_owner_of(module, id) for one item
-- Also the monitoring grants of every audit file, and the private helpers of 91-93.
-- The audit files answer the questions an operator asks during an incident, one view or
-- function each (docs/psql.md is the guide); 91 duplicates, queue health, documents; 92 the
-- timeline of one item; 93 the purge. Everything reads only, except CALL audit_purge; nothing
-- heals (a lapsed plan stays executing here, lapsed = true, until a read or the reaper marks it
-- failed). For pgfence_admin and pg_monitor, which may read, never write. Time: now(), the
-- database clock; timestamps inside JSON are UTC text. Errors: functions/ERRORS.md.

GRANT USAGE ON SCHEMA pgfence TO pg_monitor;
-- A monitoring login can run the glue (`pgfence status`), which checks the schema version first.
GRANT EXECUTE ON FUNCTION pgfence.schema_version() TO pg_monitor;
-- The modules' own operator views are read-only summaries: readable by monitoring too.
GRANT SELECT ON pgfence.outbox_summary, pgfence.outbox_leases, pgfence.operation_in_flight TO pg_monitor;

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
-- The one list of module names the audit functions and the purge accept.
CREATE OR REPLACE FUNCTION pgfence._audit_check_module(p_module text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_module IS NULL THEN
    RAISE EXCEPTION 'audit: module is required'
      USING ERRCODE = '22004', DETAIL = 'The module says which table the id or the purge is about.',
            HINT = 'One of outbox, plan, operation, document.';
  END IF;
  IF p_module NOT IN ('outbox', 'plan', 'operation', 'document') THEN
    RAISE EXCEPTION 'audit: unknown module "%"', p_module
      USING ERRCODE = '22023', DETAIL = 'pgfence has four modules.',
            HINT = 'One of outbox, plan, operation, document.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_check_module(text) FROM PUBLIC;
-- audit_purge is not security definer (it commits): it calls this with the caller's privileges.
GRANT EXECUTE ON FUNCTION pgfence._audit_check_module(text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence._audit_check_module(text) IS
  'Private: raises unless p_module is outbox, plan, operation or document.
Errors: 22004 (NULL), 22023 (unknown module).';

CREATE OR REPLACE FUNCTION pgfence._audit_check_item(p_module text, p_id bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'audit: module and id are required'
      USING ERRCODE = '22004', DETAIL = 'A NULL id names no item.',
            HINT = 'Pass the module (outbox, plan, operation or document) and the item''s id.';
  END IF;
  PERFORM pgfence._audit_check_module(p_module);
END
$$;
REVOKE ALL ON FUNCTION pgfence._audit_check_item(text, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._audit_check_item(text, bigint) IS
  'Private: validates the (module, id) pair of audit_owner_of and audit_timeline.
Errors: 22004 (module or id NULL), 22023 (unknown module).';

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
  'Who owns what right now, until when (database clock): every item that has an owner.
Every outbox message being delivered (processing), plan being executed and operation running,
one row each (\d+ explains each column). The lapsed ones are also in pgfence.audit_stuck; for
one item use pgfence.audit_owner_of(module, id).';

COMMENT ON COLUMN pgfence.audit_owned.module IS 'outbox, plan or operation.';
COMMENT ON COLUMN pgfence.audit_owned.item_id IS 'The message''s, plan''s or operation''s id.';
COMMENT ON COLUMN pgfence.audit_owned.queue IS
  'The outbox channel or the operation kind; ''*'' for plans.';
COMMENT ON COLUMN pgfence.audit_owned.status IS
  'The owned status: processing (outbox), executing (plan), running (operation).';
COMMENT ON COLUMN pgfence.audit_owned.owner IS
  'The worker; NULL for a plan released between steps and waiting for another worker.';
COMMENT ON COLUMN pgfence.audit_owned.fence IS
  'The fence token the owner must present: outbox attempt, plan run token, operation fence.';
COMMENT ON COLUMN pgfence.audit_owned.claimed_at IS
  'When the current claim started (plans: when the run started).';
COMMENT ON COLUMN pgfence.audit_owned.last_seen_at IS
  'The owner''s last sign of life (outbox: the claim; plan: its last heartbeat or step; operation: its last lease extension).';
COMMENT ON COLUMN pgfence.audit_owned.expires_at IS
  'The lease or heartbeat deadline (database clock).';
COMMENT ON COLUMN pgfence.audit_owned.remaining IS 'expires_at - now(); negative once lapsed.';
COMMENT ON COLUMN pgfence.audit_owned.lapsed IS
  'The deadline has passed: the owner went silent (see pgfence.audit_stuck).';

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
      USING ERRCODE = 'P0002', DETAIL = 'It never existed, or a purge deleted it.',
            HINT = 'Check the id; purged items are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.audit_owner_of(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.audit_owner_of(text, bigint) TO pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence.audit_owner_of(text, bigint) IS
  'Who owns one item, until when: module outbox | plan | operation | document and its id.
owned = the item is in its owned status (outbox processing, plan executing, operation running; a
document is never owned: its fence is the version a save must present); owner, fence,
claimed_at, last_seen_at, expires_at, remaining and lapsed as in pgfence.audit_owned; last_owner
= the current or last worker (for a finished outbox message only known from the event log, when
its channel logs events; for a document: who saved the current version). Reads only: a lapsed
plan is reported, not healed.
Errors: 22004 (module or id NULL), 22023 (unknown module), P0002 (no such item).';

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
         THEN format('outbox_reap makes it dead (attempt %s of %s used); %s may have delivered it',
                     o.attempts, o.max_attempts, o.locked_by)
         ELSE format('outbox_reap puts it back to pending, attempt %s of %s after backoff; %s may have delivered it (possible duplicate)',
                     o.attempts + 1, o.max_attempts, o.locked_by)
       END                                     AS next
FROM pgfence.outbox o
WHERE o.status = 'processing' AND o.lease_expires_at < now()
UNION ALL
-- Ordering keys held by a failed or dead message (key_dead_policy block; never a derived host key)
-- with messages waiting.
SELECT 'outbox', o.id, o.channel, o.status, NULL::text, o.attempts::bigint, o.claimed_at,
       o.updated_at, o.finished_at, now() - o.finished_at,
       format('key %s blocked by %s message %s (%s waiting behind it): outbox_requeue(%s) retries it first, outbox_cancel(%s, by, reason) gives the key to the next',
              o.ordering_key, o.status, o.id, w.n, o.id, o.id)
FROM pgfence.outbox o
CROSS JOIN LATERAL (
  SELECT count(*) AS n FROM pgfence.outbox x
  WHERE x.channel = o.channel AND x.ordering_key = o.ordering_key
    AND x.status <> 'sent' AND x.status <> 'canceled' AND x.status = 'waiting') w
WHERE o.ordering_key IS NOT NULL AND o.status <> 'sent' AND o.status <> 'canceled'
  AND o.status IN ('failed', 'dead') AND w.n > 0
  AND coalesce((SELECT c.key_dead_policy FROM pgfence.outbox_channel c WHERE c.channel = o.channel),
               (SELECT c.key_dead_policy FROM pgfence.outbox_channel c WHERE c.channel = '*')) = 'block'
  AND NOT (starts_with(o.ordering_key, 'host:')  -- a derived host key (limit_key host) never blocks
           AND (SELECT c.limit_key FROM pgfence.outbox_channel c WHERE c.channel IN (o.channel, '*')
                ORDER BY c.channel = '*' LIMIT 1) IS NOT DISTINCT FROM 'host')
UNION ALL
SELECT 'plan', p.id, '*', p.status, p.worker, p.run_token, p.started_at, p.heartbeat_at,
       p.heartbeat_expires_at, now() - p.heartbeat_expires_at,
       format('the next read (plan_get, plan_list) or plan_reap marks it failed (interrupted) at step %s of %s',
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
WHERE o.status = 'running' AND o.lease_expires_at < now()
UNION ALL
-- what holds back cleanup past pgfence.cleanup_warn_after (89_audit_cleanup.sql)
SELECT 'database', b.pid::bigint, b.kind, b.state, b.holder, b.xid_age::bigint, b.since, NULL::timestamptz,
       b.since + pgfence._audit_cleanup_warn_after(), b.age - pgfence._audit_cleanup_warn_after(),
       format('%s holds back VACUUM of every pgfence table (xmin %s, %s transactions ago%s): dead rows and index entries pile up and claims slow down; %s',
              CASE WHEN b.pid IS NOT NULL THEN format('%s pid %s (%s)', b.kind, b.pid, b.holder)
                   ELSE format('%s %s', b.kind, b.holder) END,
              b.xmin, b.xid_age, CASE WHEN b.age IS NOT NULL THEN format(', open for %s', date_trunc('second', b.age)) ELSE '' END,
              CASE b.kind WHEN 'transaction' THEN 'end it (COMMIT or ROLLBACK), or pg_terminate_backend(pid)'
                          WHEN 'prepared transaction' THEN 'COMMIT PREPARED or ROLLBACK PREPARED it'
                          ELSE 'reconnect its consumer, or pg_drop_replication_slot() it' END)
FROM pgfence.audit_cleanup_blockers b
WHERE b.warn;
REVOKE ALL ON pgfence.audit_stuck FROM PUBLIC;
GRANT SELECT ON pgfence.audit_stuck TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_stuck IS
  'What is stuck, and since when: every owned item whose lease or heartbeat lapsed (database clock).
Outbox messages processing past their lease, plans executing past their heartbeat deadline
(including runs released and never taken over; plans heal lazily, so they are listed until the
next read or reaper marks them failed), operations running past their lease, outbox ordering
keys blocked by a failed or dead message with messages waiting behind it (those need an
operator: next says what to do), and (module database) what holds back VACUUM longer than
pgfence.cleanup_warn_after (audit_cleanup_blockers rows with warn: item_id = pid, queue = kind,
fence = xid age). \d+ explains each column. Empty when nothing is stuck. Lapsed leases usually
heal within one reaper interval; a row that stays means no executor is running the reaper for
that module.';
COMMENT ON COLUMN pgfence.audit_stuck.module IS 'outbox, plan or operation; database for what holds back cleanup.';
COMMENT ON COLUMN pgfence.audit_stuck.item_id IS 'The message''s, plan''s or operation''s id (database: the holder''s pid, if any).';
COMMENT ON COLUMN pgfence.audit_stuck.queue IS
  'The outbox channel or the operation kind; ''*'' for plans (database: transaction, replication slot, prepared transaction).';
COMMENT ON COLUMN pgfence.audit_stuck.status IS
  'The owned status it is stuck in: processing, executing or running (failed or dead: a blocked ordering key; database: e.g. idle in transaction).';
COMMENT ON COLUMN pgfence.audit_stuck.owner IS
  'The worker that went silent (NULL: a plan released between steps that no worker took over, or a blocked ordering key).';
COMMENT ON COLUMN pgfence.audit_stuck.fence IS
  'Its fence token: outbox attempt, plan run token, operation fence (database: the xid age it holds).';
COMMENT ON COLUMN pgfence.audit_stuck.claimed_at IS
  'When it took the item (plans: when the run started).';
COMMENT ON COLUMN pgfence.audit_stuck.last_seen_at IS
  'When it last showed life (claim, heartbeat or step, lease extension).';
COMMENT ON COLUMN pgfence.audit_stuck.expired_at IS 'The lease or heartbeat deadline that passed (a blocked ordering key: when its message failed or died; database: since + pgfence.cleanup_warn_after).';
COMMENT ON COLUMN pgfence.audit_stuck.overdue IS 'now() - expired_at.';
COMMENT ON COLUMN pgfence.audit_stuck.next IS
  'What pgfence does about it on its own (the reaper or the next claim), and what may already have happened outside.';
