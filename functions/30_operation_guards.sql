-- pgfence functions/30_operation_guards.sql — operations (module 3): guards, events, helpers.
--
-- An application asks for something slow in another system (reset a database branch, provision
-- a resource, run an export). pgfence makes sure the external call is made once, that at most
-- one operation per (kind, target) is in flight, and that a crashed owner is replaced by one that
-- only polls. Files: 30 guards, events and helpers, 31 request and cancel (clients), 32 claim and
-- reap (executors), 33 the issue protocol (the owner), 34 reads.
-- Here: tg_operation_guard (PF001/PF002, for hand-written SQL too), the purge-only delete,
-- tg_operation_event (the event log), the private helpers, the table's comment. No public
-- functions. Time: leases from now(); JSON timestamps in UTC. Errors: functions/ERRORS.md (PF2xx).

-- The table (created by migration 0004; its comment lives here, re-applied by every migrate).
COMMENT ON TABLE pgfence.operation IS
  'Long external operations: one row per request, its status, owner, fence, intent and reference.
E.g. reset a database branch. Status machine queued -> running -> succeeded | failed | canceled (queued -> canceled; running -> queued only by the reaper, when no external call was started). At most one queued/running operation per (kind, target). fence is the owner''s token. The external call is recorded as an intent (issue_*) before it is made and by its reference (external_ref) right after; a new owner that finds a reference only polls it. Not an API: use the pgfence.operation_* functions.';

-- ---------------------------------------------------------------------------------------------
-- The operation machine, held by tg_operation_guard against any UPDATE (psql included):
--
--   queued --claim--> running --finish--> succeeded | failed | canceled      (terminal)
--   queued | running with no external call issued yet --cancel--> canceled
--   running with the call issued --cancel--> cancel requested, honoured by the owner's next poll
--   running --claim after the lease lapsed--> running (new owner, fence + 1)
--   running --reap, lease lapsed, no external call started--> queued
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_operation_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    -- Reached only through the WHEN condition of operation_insert_guard: not a fresh request.
    RAISE EXCEPTION 'operation: a new operation starts queued with fence 0, no owner, no lease, nothing issued, polled, canceled or finished'
      USING ERRCODE = 'PF001',
            DETAIL = format('The new row has status %s, fence %s, owner %s.', NEW.status, NEW.fence, coalesce(NEW.locked_by, 'none')),
            HINT = 'Use pgfence.operation_request(); an operation reaches any other state only through the operation_* functions.';
  END IF;
  IF NEW.id IS DISTINCT FROM OLD.id
     OR NEW.kind IS DISTINCT FROM OLD.kind
     OR NEW.target IS DISTINCT FROM OLD.target
     OR NEW.params IS DISTINCT FROM OLD.params
     OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
     OR NEW.requested_by IS DISTINCT FROM OLD.requested_by
     OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
    RAISE EXCEPTION 'operation %: kind, target, params, idempotency_key, requested_by and created_at never change', OLD.id
      USING ERRCODE = 'PF002', DETAIL = 'They are the request: what the client asked for, and what its idempotency key names.',
            HINT = 'Request a new operation instead.';
  END IF;
  IF NEW.fence < OLD.fence OR NEW.issue_count < OLD.issue_count OR NEW.poll_count < OLD.poll_count THEN
    RAISE EXCEPTION 'operation %: fence, issue_count and poll_count never decrease', OLD.id
      USING ERRCODE = 'PF002',
            DETAIL = format('fence %s -> %s, issue_count %s -> %s, poll_count %s -> %s.',
                            OLD.fence, NEW.fence, OLD.issue_count, NEW.issue_count, OLD.poll_count, NEW.poll_count),
            HINT = 'A fence token that went down would let a replaced owner write again.';
  END IF;
  IF (OLD.issue_started_at IS NOT NULL AND (NEW.issue_started_at IS DISTINCT FROM OLD.issue_started_at
                                            OR NEW.issued_by IS DISTINCT FROM OLD.issued_by
                                            OR NEW.issue_idempotent IS DISTINCT FROM OLD.issue_idempotent))
     OR (OLD.external_ref IS NOT NULL AND (NEW.external_ref IS DISTINCT FROM OLD.external_ref
                                          OR NEW.external_recorded_at IS DISTINCT FROM OLD.external_recorded_at
                                          OR NEW.external_detail IS DISTINCT FROM OLD.external_detail))
     OR (OLD.cancel_requested_at IS NOT NULL AND (NEW.cancel_requested_at IS DISTINCT FROM OLD.cancel_requested_at
                                                 OR NEW.cancel_requested_by IS DISTINCT FROM OLD.cancel_requested_by)) THEN
    RAISE EXCEPTION 'operation %: a recorded intent, external reference or cancel request is frozen', OLD.id
      USING ERRCODE = 'PF002',
            DETAIL = format('intent at %s, external_ref %s, cancel requested at %s', OLD.issue_started_at, OLD.external_ref, OLD.cancel_requested_at),
            HINT = 'These record what already happened outside the database; they are never rewritten.';
  END IF;
  IF NOT (
       (OLD.status = 'queued'  AND NEW.status = 'running'  AND NEW.fence = OLD.fence + 1)
    OR (OLD.status = 'queued'  AND NEW.status IN ('queued', 'canceled') AND NEW.fence = OLD.fence)
    OR (OLD.status = 'running' AND NEW.status = 'running'  AND NEW.fence = OLD.fence)
    OR (OLD.status = 'running' AND NEW.status = 'running'  AND NEW.fence = OLD.fence + 1
                               AND OLD.lease_expires_at < now())
    OR (OLD.status = 'running' AND NEW.status = 'queued'   AND NEW.fence = OLD.fence
                               AND OLD.issue_started_at IS NULL AND OLD.lease_expires_at < now())
    OR (OLD.status = 'running' AND NEW.status IN ('succeeded', 'failed', 'canceled') AND NEW.fence = OLD.fence)
  ) THEN
    RAISE EXCEPTION 'illegal operation transition for operation %: % -> % (fence % -> %)',
      OLD.id, OLD.status, NEW.status, OLD.fence, NEW.fence
      USING ERRCODE = 'PF001',
            DETAIL = 'Allowed: queued->running (fence+1), queued->canceled, running->running (same fence; fence+1 only after the lease lapsed), running->queued (lease lapsed, no external call started), running->succeeded|failed|canceled. A finished operation never changes again.',
            HINT = 'Use the pgfence.operation_* functions; they make only legal moves.';
  END IF;
  NEW.updated_at := now();
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_operation_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_operation_guard() IS
  'Trigger: holds the operation state machine and the frozen request, for any writer.
BEFORE UPDATE trigger on pgfence.operation: refuses any status move outside the operation machine (PF001) and any change to the request, a lowered fence, or a rewritten intent / external reference / cancel request (PF002), even from a hand-written UPDATE. Also BEFORE INSERT, filtered by a WHEN condition: a new row that is not a fresh request (queued, fence 0, no owner, lease, intent, reference, polled state, cancel request, result, error, start or finish) is refused (PF001).';

CREATE OR REPLACE TRIGGER operation_guard
  BEFORE UPDATE ON pgfence.operation
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_operation_guard();
-- A hand-written INSERT must be a fresh request. The WHEN condition is evaluated without a
-- function call, so operation_request's insert runs no PL/pgSQL here.
CREATE OR REPLACE TRIGGER operation_insert_guard
  BEFORE INSERT ON pgfence.operation
  FOR EACH ROW
  WHEN (NEW.status <> 'queued' OR NEW.fence <> 0
        OR NEW.locked_by IS NOT NULL OR NEW.claimed_at IS NOT NULL
        OR NEW.lease IS NOT NULL OR NEW.lease_expires_at IS NOT NULL
        OR NEW.issue_started_at IS NOT NULL OR NEW.issued_by IS NOT NULL OR NEW.issue_count <> 0
        OR NEW.last_issue_at IS NOT NULL OR NEW.issue_idempotent IS NOT NULL
        OR NEW.external_ref IS NOT NULL OR NEW.external_recorded_at IS NOT NULL OR NEW.external_detail IS NOT NULL
        OR NEW.external_state IS NOT NULL OR NEW.polled_at IS NOT NULL OR NEW.poll_count <> 0
        OR NEW.poll_history <> '[]'::jsonb
        OR NEW.cancel_requested_at IS NOT NULL OR NEW.cancel_requested_by IS NOT NULL
        OR NEW.result IS NOT NULL OR NEW.error IS NOT NULL
        OR NEW.started_at IS NOT NULL OR NEW.finished_at IS NOT NULL)
  EXECUTE FUNCTION pgfence.tg_operation_guard();
-- Operations are deleted only by a purge (tg_purge_only, functions/00_core.sql).
CREATE OR REPLACE TRIGGER operation_purge_only
  BEFORE DELETE ON pgfence.operation
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION pgfence.tg_purge_only();

-- ---------------------------------------------------------------------------------------------
-- Event log: operations are few and slow, so one row trigger writes each change it sees.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_operation_event()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_actor text := nullif(current_setting('pgfence.actor', true), '');
BEGIN
  IF TG_OP = 'INSERT' THEN
    PERFORM pgfence._event('operation', NEW.id, 'request', NULL, NEW.status, NEW.fence,
      jsonb_build_object('kind', NEW.kind, 'target', NEW.target, 'idempotency_key', NEW.idempotency_key,
                         'params', NEW.params),
      coalesce(v_actor, NEW.requested_by));
    RETURN NULL;
  END IF;
  v_actor := coalesce(v_actor, CASE WHEN NEW.status = 'running' THEN NEW.locked_by ELSE OLD.locked_by END);
  IF NEW.fence <> OLD.fence THEN
    PERFORM pgfence._event('operation', NEW.id,
      CASE WHEN OLD.status = 'queued' THEN 'claim' ELSE 'takeover' END, OLD.status, NEW.status, NEW.fence,
      jsonb_strip_nulls(jsonb_build_object(
        'lease_expires_at', pgfence._ts(NEW.lease_expires_at),
        'previous_owner', CASE WHEN OLD.status = 'running' THEN OLD.locked_by END,
        'previous_lease_expired_at', CASE WHEN OLD.status = 'running' THEN pgfence._ts(OLD.lease_expires_at) END,
        'issue_started', NEW.issue_started_at IS NOT NULL,
        'external_ref', NEW.external_ref)),
      v_actor);
  END IF;
  IF NEW.issue_count > OLD.issue_count THEN
    PERFORM pgfence._event('operation', NEW.id, CASE WHEN NEW.issue_count = 1 THEN 'issue' ELSE 'reissue' END,
      OLD.status, NEW.status, NEW.fence,
      jsonb_strip_nulls(jsonb_build_object(
        'issue', NEW.issue_count, 'idempotent', NEW.issue_idempotent,
        'idempotency_key', coalesce(NEW.idempotency_key, 'pgfence-operation-' || NEW.id),
        -- re-issued although a cancel was requested: the key finds the first call's operation,
        -- whose reference the owner then records, polls, and cancels
        'cancel_pending', CASE WHEN NEW.cancel_requested_at IS NOT NULL THEN true END,
        'cancel_requested_by', NEW.cancel_requested_by)),
      v_actor);
  END IF;
  IF NEW.external_ref IS DISTINCT FROM OLD.external_ref THEN
    PERFORM pgfence._event('operation', NEW.id, 'external_ref', OLD.status, NEW.status, NEW.fence,
      jsonb_strip_nulls(jsonb_build_object('external_ref', NEW.external_ref, 'response', NEW.external_detail)),
      v_actor);
  END IF;
  IF NEW.external_state IS DISTINCT FROM OLD.external_state THEN
    PERFORM pgfence._event('operation', NEW.id, 'poll', OLD.status, NEW.status, NEW.fence,
      jsonb_build_object('state', NEW.external_state, 'poll_count', NEW.poll_count), v_actor);
  END IF;
  IF NEW.cancel_requested_at IS DISTINCT FROM OLD.cancel_requested_at AND NEW.status = 'running' THEN
    PERFORM pgfence._event('operation', NEW.id, 'cancel_request', OLD.status, NEW.status, NEW.fence,
      NULL, coalesce(nullif(current_setting('pgfence.actor', true), ''), NEW.cancel_requested_by));
  END IF;
  IF NEW.status <> OLD.status AND NEW.fence = OLD.fence THEN
    PERFORM pgfence._event('operation', NEW.id,
      CASE NEW.status WHEN 'queued' THEN 'requeue' WHEN 'canceled' THEN 'cancel' ELSE 'finish' END,
      OLD.status, NEW.status, NEW.fence,
      jsonb_strip_nulls(jsonb_build_object('result', NEW.result, 'error', NEW.error,
                                           'external_ref', NEW.external_ref)),
      CASE WHEN NEW.status = 'canceled' AND OLD.status = 'queued'
           THEN coalesce(nullif(current_setting('pgfence.actor', true), ''), NEW.cancel_requested_by)
           ELSE v_actor END);
  END IF;
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_operation_event() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_operation_event() IS
  'Trigger: writes the operation event log (request, claim, issue, poll, finish, ...) as rows change.
AFTER INSERT/UPDATE row trigger on pgfence.operation: writes the event log in the same transaction: request, claim, takeover, issue, reissue, external_ref, poll (only when the polled state changed), cancel_request, requeue, cancel, finish (operation_release logs its own ''release''); with actor, fence and details (UTC timestamps).';

CREATE OR REPLACE TRIGGER operation_event
  AFTER INSERT OR UPDATE ON pgfence.operation
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_operation_event();

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._operation_lock(p_id bigint)
RETURNS pgfence.operation
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_row pgfence.operation;
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'operation: id is required'
      USING ERRCODE = '22004', DETAIL = 'Every operation call names the operation it acts on.',
            HINT = 'Pass the id that pgfence.operation_request returned (operation_claim hands it to executors).';
  END IF;
  SELECT o.* INTO v_row FROM pgfence.operation o WHERE o.id = p_id FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'operation: no operation with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No operation has this id: it was never requested, or it was purged.',
            HINT = 'Check the id; purged operations are gone.';
  END IF;
  RETURN v_row;
END
$$;
REVOKE ALL ON FUNCTION pgfence._operation_lock(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._operation_lock(bigint) IS
  'Private: locks one operation row (FOR UPDATE) and returns it; 22004 / P0002 for a bad id.
22004 for a NULL id, P0002 for an unknown one. Every owner write starts here, so fence, status and lease are checked under the lock.';

CREATE OR REPLACE FUNCTION pgfence._operation_check_lease(p_lease interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_lease IS NOT NULL AND (p_lease <= interval '0' OR p_lease > interval '1 day') THEN
    RAISE EXCEPTION 'operation: lease must be positive and at most 1 day, got %', p_lease
      USING ERRCODE = '22023', DETAIL = 'The lease is how long the owner may stay silent before another executor takes the operation over.',
            HINT = 'Pass e.g. interval ''2 minutes'' (longer than your poll interval and your external call timeout), or NULL for the current one.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._operation_check_lease(interval) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._operation_check_lease(interval) IS
  'Private: validates a lease (0 < lease <= 1 day, or NULL); raises 22023.';

CREATE OR REPLACE FUNCTION pgfence._operation_owned(p_row pgfence.operation, p_fence integer, p_check_lease boolean)
RETURNS boolean
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_fence IS NULL THEN
    RAISE EXCEPTION 'operation %: fence (the token from operation_claim) is required', p_row.id
      USING ERRCODE = '22004', DETAIL = 'Owner calls are fenced by the token of the claim that made the caller the owner.',
            HINT = 'Pass the fence that pgfence.operation_claim returned with the operation.';
  END IF;
  RETURN p_row.status = 'running' AND p_row.fence = p_fence
         AND (NOT p_check_lease OR p_row.lease_expires_at >= now());
END
$$;
REVOKE ALL ON FUNCTION pgfence._operation_owned(pgfence.operation, integer, boolean) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._operation_owned(pgfence.operation, integer, boolean) IS
  'Private: is the holder of fence p_fence still the owner (running, same fence, lease not lapsed)?
The lease is checked only with p_check_lease, by the database clock. 22004 for a NULL fence.';
