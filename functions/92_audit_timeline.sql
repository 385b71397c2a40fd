-- pgfence functions/92_audit_timeline.sql — auditing from psql: what did one item do.
--
-- Public: audit_timeline(module, id) -> the item's timeline, oldest first, ending with a row
--         for its current state
-- The event log is the main source (who did what, under which fence token, in the same
-- transaction as the change); where a module keeps better receipts they are used instead (a
-- plan step's receipt, the outbox reaper's lapse receipts), and an outbox message whose
-- channel does not log events is rebuilt from its row. STABLE SECURITY DEFINER, for
-- pgfence_admin and pg_monitor; reads only. Errors: functions/ERRORS.md.

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
             jsonb_build_object('worker', l.worker, 'claimed_at', pgfence._ts(l.claimed_at),
                                'lease_expired_at', pgfence._ts(l.lease_expires_at),
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
             jsonb_build_object('error', m.last_error, 'next_attempt_at', pgfence._ts(m.next_attempt_at)),
             NULL, 1, m.attempts * 10 + 3
      FROM m WHERE NOT (SELECT yes FROM logged) AND m.status = 'pending' AND m.attempts > 0
      UNION ALL
      SELECT now(), 'row', 'current', NULL, m.status, m.locked_by, m.attempts::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'attempts', m.attempts, 'max_attempts', m.max_attempts,
               'next_attempt_at', CASE WHEN m.status = 'pending' THEN pgfence._ts(m.next_attempt_at) END,
               'lease_expires_at', pgfence._ts(m.lease_expires_at),
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
      -- Receipts come from the steps themselves (complete outputs and errors, worker, times and
      -- login); receipts written before migration 0034 also have a 'receipt' event, left out.
      SELECT e.at, 'event'::text AS source, e.event, e.from_status, e.to_status, e.actor, e.fence,
             e.detail, e.db_user, 1 AS grp, e.id AS ord
      FROM pgfence.event e
      WHERE e.module = 'plan' AND e.item_id = p_id AND e.event <> 'receipt'
      UNION ALL
      SELECT s.finished_at, 'receipt', 'step_' || s.outcome, NULL, NULL, s.worker, s.step_index::bigint,
             jsonb_strip_nulls(jsonb_build_object(
               'step', s.step_index, 'action', s.action, 'kind', s.kind, 'outcome', s.outcome,
               'sqlstate', s.error ->> 'sqlstate', 'message', s.error ->> 'message', 'error', s.error,
               'output', s.output, 'started_at', pgfence._ts(s.started_at),
               'idempotency_key', CASE WHEN s.kind = 'external' THEN 'pgfence-plan-' || s.plan_id || '-step-' || s.step_index END)),
             -- the login that wrote the receipt: the step's db_user; before migration 0034, the
             -- receipt's event (written in the same transaction)
             coalesce(s.db_user,
                      (SELECT e.db_user FROM pgfence.event e
                       WHERE e.module = 'plan' AND e.item_id = s.plan_id AND e.event = 'receipt' AND e.fence = s.step_index
                       ORDER BY e.id DESC LIMIT 1)),
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
               'heartbeat_expires_at', CASE WHEN p.status = 'executing' THEN pgfence._ts(p.heartbeat_expires_at) END,
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
               'lease_expires_at', pgfence._ts(o.lease_expires_at),
               'lease_lapsed', CASE WHEN o.status = 'running' THEN o.lease_expires_at < now() END,
               'issue_count', o.issue_count, 'external_ref', o.external_ref,
               'external_state', o.external_state, 'polled_at', pgfence._ts(o.polled_at),
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
                                                  'saved_at', pgfence._ts(d.saved_at),
                                                  'created_by', d.created_by, 'save_id', d.save_id)),
             NULL, 2, 0
      FROM pgfence.document d WHERE d.id = p_id)
    SELECT t.at, t.source, t.event, t.from_status, t.to_status, t.actor, t.fence, t.detail, t.db_user
    FROM t ORDER BY t.grp, t.at, t.ord;
  END IF;
  GET DIAGNOSTICS v_rows = ROW_COUNT;
  IF v_rows = 0 THEN
    RAISE EXCEPTION 'audit_timeline: no % with id %', p_module, p_id
      USING ERRCODE = 'P0002', DETAIL = 'No such item and no event for it: it never existed, or a purge deleted it.',
            HINT = 'Check the id; purged items and their events are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.audit_timeline(text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.audit_timeline(text, bigint) TO pgfence_admin, pg_monitor;
COMMENT ON FUNCTION pgfence.audit_timeline(text, bigint) IS
  'What did one item do: its timeline, oldest first, ending with its current state.
module outbox | plan | operation | document. Columns: at, source, event, from_status, to_status,
actor, fence, detail, db_user (the database login whose transaction wrote an event or a plan
receipt: actor is the name it passed, db_user who it really was; NULL for rows rebuilt from the
item''s row). source event = a row of pgfence.event (transitions with who made them - actor -
and under which fence, errors with SQLSTATE in detail), written in the same transaction as the
change; receipt = a plan step''s receipt (outcome, output, error SQLSTATE and message); lapse =
the outbox reaper''s receipt of a lapsed lease; row = what the item''s row says (for outbox
messages whose channel does not log events: enqueue, the latest claim, the finish with receipt
or error, a scheduled retry; a plan''s external step in flight or in doubt; and always a last row
event = current, at = now(), with the item''s state: attempts, lease, last error, receipt, polled
external state, ...). Operation events include every polled external state change; document
events are create, save, delete, conflict and replay (who, under which version - the fence -,
based on which version). Reads only.
Errors: 22004 (module or id NULL), 22023 (unknown module), P0002 (no such item and no event for
it).';

