-- pgfence functions/30_operation.sql — Module 3: long external operations.
--
-- An application asks for something slow in another system (reset a database branch, provision
-- a resource, run an export). pgfence makes sure the external call is made once, that at most
-- one operation per (kind, target) is in flight, and that a crashed owner is replaced by one
-- that only polls. Status machine (enforced by tg_operation_guard, not only by these functions):
--
--   queued --claim--> running --finish--> succeeded | failed | canceled      (terminal)
--   queued | running with no external call issued yet --cancel--> canceled
--   running with the call issued --cancel--> cancel requested, honoured by the owner's next poll
--   running --claim after the lease lapsed--> running (new owner, fence + 1)
--   running --reap, lease lapsed, no external call started--> queued
--
-- The issue protocol, all under the owner's fence:
--   1. operation_begin_issue(id, fence, idempotent)  records the INTENT before calling out;
--   2. the owner calls the external API (passing the idempotency key if it can);
--   3. operation_record_external(id, fence, ref)     records the REFERENCE right after;
--   4. operation_poll(id, fence, state)              on an interval: extends the lease, keeps
--                                                    the polled state, reports a cancel request;
--   5. operation_finish(id, fence, succeeded, ...)   when the external side is done.
-- A new owner that finds a reference only polls (begin_issue answers 'poll'). One that finds an
-- intent without a reference re-issues only if both the first call and its own pass the
-- idempotency key; otherwise the operation fails as "outcome unknown" for a person to check.
-- A pending cancel request does not change that rule (the key finds what the first call may
-- have started, and its reference is what lets the owner cancel it), but the reissue event and
-- the outcome-unknown result say cancel_pending. With a cancel request and no call ever started,
-- begin_issue cancels the operation ('canceled') and nothing is called.
-- Rows: a hand-written INSERT must be a fresh request (PF001); operations are deleted only by the
-- purge (PF002 otherwise, see tg_purge_only).
--
-- Fence: `fence` is bumped by every claim; owner writes match `fence = p_fence AND status =
-- 'running'` under a row lock, so an owner that was replaced changes nothing (NULL / false).
-- Time: leases from now(), the database clock; JSON timestamps are written in UTC.
-- Plans (tests/test_module_plans.py reads them through auto_explain): operation_claim and
-- operation_reap are pinned to one generic plan with index access only (SET plan_cache_mode =
-- force_generic_plan, enable_seqscan / enable_bitmapscan off, like the outbox's claim), so a
-- plan made on an empty table is not a sequential scan kept for the executor's life. Their
-- lapsed-lease walks state lease_expires_at < now() and not the status: a lease is set exactly
-- while running (CHECK operation_lease_iff_running), operation_lease_idx is on that (migration
-- 0008), and operation_one_in_flight (status IN ('queued', 'running')) cannot be proven from
-- it. With status = 'running' it could, and analysed with nothing in flight the planner walked
-- all of it — every queued and running operation — on every claim. The queue walk of a claim
-- for some kinds reads each kind's queue only (operation_kind_queued_idx, migration 0009), so a
-- backlog of a kind no running executor serves is not read by every claim; the all-kinds walk
-- states lease_expires_at IS NULL, which only operation_queued_idx's predicate asks for.
-- Errors: functions/ERRORS.md (this module: PF201, PF202).

-- ---------------------------------------------------------------------------------------------
-- Status machine guard
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
      USING ERRCODE = 'PF001', HINT = 'Use pgfence.operation_request(); an operation reaches any other state only through the operation_* functions.';
  END IF;
  IF NEW.id IS DISTINCT FROM OLD.id
     OR NEW.kind IS DISTINCT FROM OLD.kind
     OR NEW.target IS DISTINCT FROM OLD.target
     OR NEW.params IS DISTINCT FROM OLD.params
     OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
     OR NEW.requested_by IS DISTINCT FROM OLD.requested_by
     OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
    RAISE EXCEPTION 'operation %: kind, target, params, idempotency_key, requested_by and created_at never change', OLD.id
      USING ERRCODE = 'PF002', HINT = 'Request a new operation instead.';
  END IF;
  IF NEW.fence < OLD.fence OR NEW.issue_count < OLD.issue_count OR NEW.poll_count < OLD.poll_count THEN
    RAISE EXCEPTION 'operation %: fence, issue_count and poll_count never decrease', OLD.id
      USING ERRCODE = 'PF002', HINT = 'A fence token that went down would let a replaced owner write again.';
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
  'BEFORE UPDATE trigger on pgfence.operation: refuses any status move outside the operation machine (PF001) and any change to the request, a lowered fence, or a rewritten intent / external reference / cancel request (PF002), even from a hand-written UPDATE. Also BEFORE INSERT, filtered by a WHEN condition: a new row that is not a fresh request (queued, fence 0, no owner, lease, intent, reference, polled state, cancel request, result, error, start or finish) is refused (PF001).';

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

-- Timestamps inside JSON (history, event details) in UTC, whatever the session TimeZone.
CREATE OR REPLACE FUNCTION pgfence._operation_ts(p_at timestamptz)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
$$;
REVOKE ALL ON FUNCTION pgfence._operation_ts(timestamptz) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._operation_ts(timestamptz) IS
  'Private: an instant as ISO-8601 text in UTC (independent of the session TimeZone), for JSON written by the operation module.';

-- Event log: operations are few and slow, so one row trigger writes each change it sees.
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
        'lease_expires_at', pgfence._operation_ts(NEW.lease_expires_at),
        'previous_owner', CASE WHEN OLD.status = 'running' THEN OLD.locked_by END,
        'previous_lease_expired_at', CASE WHEN OLD.status = 'running' THEN pgfence._operation_ts(OLD.lease_expires_at) END,
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
  'AFTER INSERT/UPDATE row trigger on pgfence.operation: writes the event log in the same transaction: request, claim, takeover, issue, reissue, external_ref, poll (only when the polled state changed), cancel_request, requeue, cancel, finish (operation_release logs its own ''release''); with actor, fence and details (UTC timestamps).';

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
    RAISE EXCEPTION 'operation: id is required' USING ERRCODE = '22004';
  END IF;
  SELECT o.* INTO v_row FROM pgfence.operation o WHERE o.id = p_id FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'operation: no operation with id %', p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id; purged operations are gone.';
  END IF;
  RETURN v_row;
END
$$;
REVOKE ALL ON FUNCTION pgfence._operation_lock(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._operation_lock(bigint) IS
  'Private: lock one operation row (FOR UPDATE) and return it; 22004 for a NULL id, P0002 for an unknown one. Every owner write starts here, so fence, status and lease are checked under the lock.';

CREATE OR REPLACE FUNCTION pgfence._operation_check_lease(p_lease interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_lease IS NOT NULL AND (p_lease <= interval '0' OR p_lease > interval '1 day') THEN
    RAISE EXCEPTION 'operation: lease must be positive and at most 1 day, got %', p_lease
      USING ERRCODE = '22023', HINT = 'Pass e.g. interval ''2 minutes'' (longer than your poll interval and your external call timeout), or NULL for the current one.';
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
      USING ERRCODE = '22004';
  END IF;
  RETURN p_row.status = 'running' AND p_row.fence = p_fence
         AND (NOT p_check_lease OR p_row.lease_expires_at >= now());
END
$$;
REVOKE ALL ON FUNCTION pgfence._operation_owned(pgfence.operation, integer, boolean) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._operation_owned(pgfence.operation, integer, boolean) IS
  'Private: is the caller holding this fence still the owner (running, same fence, and with p_check_lease a lease that has not lapsed by the database clock)? 22004 for a NULL fence.';

-- ---------------------------------------------------------------------------------------------
-- Request (client)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_request(
  p_kind            text,
  p_target          text,
  p_params          jsonb DEFAULT '{}',
  p_idempotency_key text DEFAULT NULL,
  p_requested_by    text DEFAULT NULL
)
RETURNS TABLE (id bigint, status text, created boolean, result jsonb, error text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_by  text := coalesce(nullif(p_requested_by, ''), session_user::text);
  v_row pgfence.operation;
  v_try integer;
BEGIN
  IF p_kind IS NULL OR p_target IS NULL OR p_params IS NULL THEN
    RAISE EXCEPTION 'operation_request: kind, target and params are required'
      USING ERRCODE = '22004', HINT = 'Pass a kind (e.g. ''branch.reset''), a target (e.g. the branch name) and a JSON object of params.';
  END IF;
  IF p_kind !~ '^[a-z0-9][a-z0-9_.-]{0,62}$' THEN
    RAISE EXCEPTION 'operation_request: invalid kind "%"', p_kind
      USING ERRCODE = '22023', HINT = 'Kinds are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit; the executor maps each kind to a handler.';
  END IF;
  -- Bytes too: (kind, target) is a btree key (operation_one_in_flight, operation_target_idx),
  -- whose entries hold at most ~2700 bytes; 1024 characters of CJK text are 3072 bytes (54000).
  IF p_target = '' OR length(p_target) > 1024 OR octet_length(p_target) > 2048 THEN
    RAISE EXCEPTION 'operation_request: target must be 1-1024 characters and at most 2048 bytes'
      USING ERRCODE = '22023',
            DETAIL = format('Got %s characters, %s bytes in the database encoding.', length(p_target), octet_length(p_target)),
            HINT = 'The target names what the operation acts on (a branch, a resource id).';
  END IF;
  IF jsonb_typeof(p_params) <> 'object' THEN
    RAISE EXCEPTION 'operation_request: params must be a JSON object, got %', jsonb_typeof(p_params)
      USING ERRCODE = '22023', HINT = 'Wrap the value: jsonb_build_object(''value'', ...).';
  END IF;
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'operation_request: idempotency_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', HINT = 'Use a stable key for this one request, e.g. ''reset-dev-42-2024-05-01T10:00Z''.';
  END IF;
  IF length(v_by) > 200 THEN
    RAISE EXCEPTION 'operation_request: requested_by must be at most 200 characters' USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor(v_by);

  -- A conflict is either the idempotency key (a repeat: answer with that operation) or the
  -- one-in-flight index (another operation holds the target: PF201). ON CONFLICT DO NOTHING
  -- waits for a concurrent inserter of either, then the lookups below see its committed row.
  -- If that row is gone again by then (rolled back / finished), try once more.
  FOR v_try IN 1..5 LOOP
    INSERT INTO pgfence.operation AS o (kind, target, params, idempotency_key, requested_by)
    VALUES (p_kind, p_target, p_params, p_idempotency_key, v_by)
    ON CONFLICT DO NOTHING
    RETURNING o.* INTO v_row;
    IF v_row.id IS NOT NULL THEN
      PERFORM pg_notify('pgfence_operation', json_build_object('kind', p_kind, 'id', v_row.id)::text);
      RETURN QUERY SELECT v_row.id, v_row.status, true, v_row.result, v_row.error;
      PERFORM pgfence._set_actor(NULL);
      RETURN;
    END IF;

    IF p_idempotency_key IS NOT NULL THEN
      SELECT o.* INTO v_row FROM pgfence.operation o WHERE o.idempotency_key = p_idempotency_key;
      IF FOUND THEN
        IF v_row.kind <> p_kind OR v_row.target <> p_target OR v_row.params <> p_params THEN
          RAISE EXCEPTION 'operation_request: idempotency key "%" already names operation % (% %)', p_idempotency_key, v_row.id, v_row.kind, v_row.target
            USING ERRCODE = 'PF003',
                  DETAIL = format('This call asked for %s %s with params %s; operation %s has params %s.', p_kind, p_target, p_params, v_row.id, v_row.params),
                  HINT = 'An idempotency key identifies one request; use a new key for a different request.';
        END IF;
        RETURN QUERY SELECT v_row.id, v_row.status, false, v_row.result, v_row.error;
        PERFORM pgfence._set_actor(NULL);
        RETURN;
      END IF;
    END IF;

    SELECT o.* INTO v_row FROM pgfence.operation o
    WHERE o.kind = p_kind AND o.target = p_target AND o.status IN ('queued', 'running');
    IF FOUND THEN
      RAISE EXCEPTION 'operation_request: % % is busy: operation % is in flight', p_kind, p_target, v_row.id
        USING ERRCODE = 'PF201',
              DETAIL = format('Operation %s is %s for %s %s (idempotency key %s, requested by %s at %s).',
                              v_row.id, v_row.status, v_row.kind, v_row.target,
                              coalesce(v_row.idempotency_key, 'none'), v_row.requested_by,
                              pgfence._operation_ts(v_row.created_at)),
              HINT = format('Wait for operation %s to finish (pgfence.operation_get), cancel it (pgfence.operation_cancel), or repeat its own request (same idempotency key) to follow it.', v_row.id);
    END IF;
    IF current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
      EXIT;
    END IF;
  END LOOP;
  RAISE EXCEPTION 'operation_request: % % conflicts with an operation this snapshot cannot see', p_kind, p_target
    USING ERRCODE = '40001', HINT = 'Retry the transaction (this happens under REPEATABLE READ / SERIALIZABLE, or when the target is released and taken again repeatedly).';
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_request(text, text, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_request(text, text, jsonb, text, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_request(text, text, jsonb, text, text) IS
  'Request a long external operation of p_kind on p_target (e.g. ''branch.reset'', ''dev-42''); returns (id, status, created, result, error). A repeated idempotency key — also from a concurrent transaction — returns the existing operation with created = false, a finished one answering from its row, and starts nothing. At most one operation per (kind, target) is queued or running: a different request for a busy target raises PF201, whose DETAIL starts with "Operation <id>" (the one in flight). requested_by NULL = session_user. At commit, NOTIFY pgfence_operation carries {"kind","id"}. Errors: 22004 (kind/target/params NULL), 22023 (bad kind, target — 1-1024 characters, at most 2048 bytes —, params, key), PF003 (key already names a different request), PF201 (target busy), 40001 (conflict invisible to a REPEATABLE READ snapshot: retry).';

-- ---------------------------------------------------------------------------------------------
-- Claim (executor)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_claim(
  p_worker text,
  p_kinds  text[] DEFAULT NULL,
  p_lease  interval DEFAULT '2 minutes',
  p_batch  integer DEFAULT 1
)
RETURNS TABLE (
  id               bigint,
  kind             text,
  target           text,
  params           jsonb,
  idempotency_key  text,
  fence            integer,
  lease            interval,
  lease_expires_at timestamptz,
  issue_started    boolean,
  issue_count      integer,
  external_ref     text,
  external_state   jsonb,
  cancel_requested boolean,
  taken_over_from  text,
  created_at       timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  v_lease interval := coalesce(p_lease, interval '2 minutes');
  v_got   integer;
  v_ids   bigint[];
BEGIN
  IF p_worker IS NULL OR p_worker = '' OR length(p_worker) > 200 THEN
    RAISE EXCEPTION 'operation_claim: worker must be a non-empty name of at most 200 characters'
      USING ERRCODE = '22023', HINT = 'Use something an operator can trace, e.g. host:pid.';
  END IF;
  PERFORM pgfence._operation_check_lease(p_lease);
  IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'operation_claim: batch must be between 1 and 1000, got %', p_batch USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor(p_worker);

  -- First the orphans (running, lease lapsed: their external call may be in flight, resume
  -- them), then the queue in request order. SKIP LOCKED: concurrent claimers never collide.
  -- Plans: see the header.
  RETURN QUERY
  WITH cand AS (
    SELECT o.id, o.locked_by AS prev_owner FROM pgfence.operation o
    WHERE o.lease_expires_at < now()  -- running, lease lapsed: a lease is set only while running
      AND (p_kinds IS NULL OR o.kind = ANY (p_kinds))
    ORDER BY o.lease_expires_at, o.id
    LIMIT p_batch
    FOR UPDATE SKIP LOCKED
  ), upd AS (
    -- by primary key: an id array keeps even a generic plan on the index (a join with cand was
    -- planned as a walk of the whole primary key)
    UPDATE pgfence.operation o
    SET fence = o.fence + 1, locked_by = p_worker, claimed_at = now(), lease = v_lease,
        lease_expires_at = now() + v_lease
    WHERE o.id = ANY (ARRAY(SELECT c.id FROM cand c))
    RETURNING o.*, (SELECT c.prev_owner FROM cand c WHERE c.id = o.id) AS prev_owner
  )
  SELECT u.id, u.kind, u.target, u.params, coalesce(u.idempotency_key, 'pgfence-operation-' || u.id),
         u.fence, u.lease, u.lease_expires_at, u.issue_started_at IS NOT NULL, u.issue_count,
         u.external_ref, u.external_state, u.cancel_requested_at IS NOT NULL, u.prev_owner, u.created_at
  FROM upd u ORDER BY u.id;
  GET DIAGNOSTICS v_got = ROW_COUNT;
  IF v_got >= p_batch THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;

  -- The queue, oldest first, locked here and claimed by primary key below. All kinds:
  -- operation_queued_idx in id order. Some kinds: each kind's own queue
  -- (operation_kind_queued_idx, migration 0009), walked once per distinct kind up to the batch,
  -- then the oldest of those, so a backlog of a kind this executor does not serve is never read
  -- (the per-kind walks cannot use operation_queued_idx: its predicate, 0009). At most p_batch
  -- rows are locked per kind; those not claimed are released when this transaction ends (a
  -- moment later: executors claim in autocommit).
  IF p_kinds IS NULL THEN
    v_ids := ARRAY(
      SELECT o.id FROM pgfence.operation o
      -- no lease: true of every queued operation (CHECK operation_lease_iff_running); stating
      -- it lets this walk, and only this one, use operation_queued_idx (migration 0009)
      WHERE o.status = 'queued' AND o.lease_expires_at IS NULL
      ORDER BY o.id
      LIMIT p_batch - v_got
      FOR UPDATE SKIP LOCKED);
  ELSE
    v_ids := ARRAY(
      SELECT b.id
      FROM (SELECT DISTINCT u.k FROM unnest(p_kinds) AS u(k)) ks
      CROSS JOIN LATERAL (
        -- the rows and order of "kind = ks.k ORDER BY id", written so that only
        -- operation_kind_queued_idx gives the order: the planner folds a kind fixed by "=" out
        -- of the ORDER BY, and the primary key then gives id order as well; priced as
        -- sequential reads, it was chosen whenever the statistics said most operations were
        -- queued (analysed while busy), and every claim walked the history filtering on kind
        SELECT o.id FROM pgfence.operation o
        WHERE o.kind = ANY (ARRAY[ks.k]) AND o.status = 'queued'
        ORDER BY o.kind, o.id
        LIMIT p_batch - v_got
        FOR UPDATE SKIP LOCKED) b
      ORDER BY b.id
      LIMIT p_batch - v_got);
  END IF;
  IF cardinality(v_ids) = 0 THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;
  RETURN QUERY
  WITH upd AS (
    UPDATE pgfence.operation o
    SET status = 'running', fence = o.fence + 1, locked_by = p_worker, claimed_at = now(),
        lease = v_lease, lease_expires_at = now() + v_lease, started_at = coalesce(o.started_at, now())
    WHERE o.id = ANY (v_ids)  -- by primary key, as above
    RETURNING o.*
  )
  SELECT u.id, u.kind, u.target, u.params, coalesce(u.idempotency_key, 'pgfence-operation-' || u.id),
         u.fence, u.lease, u.lease_expires_at, u.issue_started_at IS NOT NULL, u.issue_count,
         u.external_ref, u.external_state, u.cancel_requested_at IS NOT NULL, NULL::text, u.created_at
  FROM upd u ORDER BY u.id;
  PERFORM pgfence._set_actor(NULL);
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_claim(text, text[], interval, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_claim(text, text[], interval, integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_claim(text, text[], interval, integer) IS
  'Claim up to p_batch operations of p_kinds (NULL = all): first running ones whose lease lapsed by the database clock (a takeover: taken_over_from names the old owner), then queued ones in request order; FOR UPDATE SKIP LOCKED, so concurrent claimers never share one. Bumps the fence and returns it: the token for begin_issue / record_external / poll / finish / release. issue_started and external_ref say whether the external call was already made: with a reference, only poll it; otherwise call operation_begin_issue, which decides. idempotency_key is the one to pass to the external API (pgfence-operation-<id> when the request had none). Errors: 22023 (empty worker, lease outside (0, 1 day], batch outside 1..1000).';

-- ---------------------------------------------------------------------------------------------
-- The issue protocol (owner), fenced
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_begin_issue(
  p_id         bigint,
  p_fence      integer,
  p_idempotent boolean,
  p_lease      interval DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  -- A transport that passes the key may re-issue, but not forever.
  c_max_issues constant integer := 10;
  v_row    pgfence.operation;
  v_reason text;
BEGIN
  IF p_idempotent IS NULL THEN
    RAISE EXCEPTION 'operation_begin_issue: idempotent is required'
      USING ERRCODE = '22004', HINT = 'Pass true only if your call hands the operation''s idempotency key to the external API, which then starts at most one operation per key.';
  END IF;
  PERFORM pgfence._operation_check_lease(p_lease);
  v_row := pgfence._operation_lock(p_id);
  IF NOT pgfence._operation_owned(v_row, p_fence, true) THEN
    RETURN NULL;  -- replaced, finished, or the lease lapsed: do not call out
  END IF;

  IF v_row.external_ref IS NOT NULL THEN
    UPDATE pgfence.operation o
    SET lease = coalesce(p_lease, o.lease), lease_expires_at = now() + coalesce(p_lease, o.lease)
    WHERE o.id = p_id;
    RETURN 'poll';
  END IF;

  IF v_row.issue_started_at IS NULL AND v_row.cancel_requested_at IS NOT NULL THEN
    -- A cancel request and no call ever started: cancel, do not call. (operation_cancel itself
    -- cancels such an operation at once; this covers a request recorded any other way.)
    UPDATE pgfence.operation o
    SET status = 'canceled', finished_at = now(), lease_expires_at = NULL,
        error = format('canceled at the request of %s before the external call was issued', o.cancel_requested_by)
    WHERE o.id = p_id;
    RETURN 'canceled';
  END IF;

  IF v_row.issue_started_at IS NULL THEN
    -- (A cancel before any call ends the operation at once, see operation_cancel.)
    UPDATE pgfence.operation o
    SET issue_started_at = now(), last_issue_at = now(), issued_by = o.locked_by, issue_count = 1,
        issue_idempotent = p_idempotent,
        lease = coalesce(p_lease, o.lease), lease_expires_at = now() + coalesce(p_lease, o.lease)
    WHERE o.id = p_id;
    RETURN 'issue';
  END IF;

  -- An intent without a reference: an earlier call may or may not have started the operation.
  -- The same rule with a cancel request pending: a re-issue with the key only finds the
  -- operation the first call may have started, and its reference is what lets the owner poll it
  -- and cancel it; without the key the outcome is unknown either way. The event log and the
  -- result record that a cancel was pending (tg_operation_event, below).
  IF p_idempotent AND v_row.issue_idempotent AND v_row.issue_count < c_max_issues THEN
    UPDATE pgfence.operation o
    SET issue_count = o.issue_count + 1, last_issue_at = now(),
        lease = coalesce(p_lease, o.lease), lease_expires_at = now() + coalesce(p_lease, o.lease)
    WHERE o.id = p_id;
    RETURN 'reissue';
  END IF;
  v_reason := CASE
    WHEN NOT v_row.issue_idempotent THEN 'the call that was made did not pass the idempotency key'
    WHEN NOT p_idempotent THEN 'this owner''s transport does not pass the idempotency key'
    ELSE format('it was issued %s times without a reference being recorded', v_row.issue_count) END;
  UPDATE pgfence.operation o
  SET status = 'failed', finished_at = now(), lease_expires_at = NULL,
      result = jsonb_strip_nulls(jsonb_build_object(
                 'reason', 'outcome_unknown', 'intent_at', pgfence._operation_ts(o.issue_started_at),
                 'issued_by', o.issued_by, 'issues', o.issue_count,
                 'cancel_pending', CASE WHEN o.cancel_requested_at IS NOT NULL THEN true END,
                 'cancel_requested_by', o.cancel_requested_by)),
      error = format('outcome unknown: %s started the external %s call for %s at %s, but no external reference was recorded; %s, so calling again could start a second operation.%s Check %s in the external system by hand.',
                     o.issued_by, o.kind, o.target, pgfence._operation_ts(o.last_issue_at), v_reason,
                     CASE WHEN o.cancel_requested_at IS NOT NULL
                          THEN format(' %s had asked to cancel it; cancel it there if it exists.', o.cancel_requested_by) ELSE '' END,
                     o.target)
  WHERE o.id = p_id;
  RETURN 'failed';
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_begin_issue(bigint, integer, boolean, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_begin_issue(bigint, integer, boolean, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_begin_issue(bigint, integer, boolean, interval) IS
  'Owner, before calling the external API: record the intent and decide whether to call. Returns ''issue'' (first call: go ahead), ''reissue'' (an earlier call left no reference; both it and yours pass the idempotency key, so calling again is safe — also when a cancel was requested meanwhile: the key finds the operation the first call may have started, the reissue event says cancel_pending, and the next poll answers ''cancel''), ''poll'' (a reference exists: do not call, poll it), ''canceled'' (a cancel was requested and no call was ever started: the operation is now canceled; do not call), ''failed'' (an earlier call left no reference and a repeat could start a second operation: the operation is now failed as "outcome unknown" for a person to check; its result says cancel_pending if a cancel had been requested), or NULL (you are not the owner any more, or your lease lapsed: do not call). p_idempotent: your call passes the idempotency key and the API starts at most one operation per key. Extends the lease (p_lease, NULL = the current lease length). Errors: 22004 (id/fence/idempotent NULL), 22023 (bad lease), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence.operation_record_external(
  p_id           bigint,
  p_fence        integer,
  p_external_ref text,
  p_detail       jsonb DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_row pgfence.operation;
BEGIN
  IF p_external_ref IS NULL THEN
    RAISE EXCEPTION 'operation_record_external: external_ref is required' USING ERRCODE = '22004';
  END IF;
  IF p_external_ref = '' OR length(p_external_ref) > 1024 THEN
    RAISE EXCEPTION 'operation_record_external: external_ref must be 1-1024 characters' USING ERRCODE = '22023';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  -- A lapsed lease is accepted while nobody took over: the call did happen, and its reference
  -- is what keeps a successor from calling again.
  IF NOT pgfence._operation_owned(v_row, p_fence, false) THEN
    RETURN false;
  END IF;
  IF v_row.issue_started_at IS NULL THEN
    RAISE EXCEPTION 'operation_record_external: operation % has no recorded intent', p_id
      USING ERRCODE = 'PF202',
            HINT = 'Call pgfence.operation_begin_issue before calling the external API, then record its reference.';
  END IF;
  IF v_row.external_ref IS NOT NULL THEN
    IF v_row.external_ref = p_external_ref THEN
      RETURN true;  -- a repeat of the same recording
    END IF;
    RAISE EXCEPTION 'operation_record_external: operation % already has external reference %', p_id, v_row.external_ref
      USING ERRCODE = 'PF002', DETAIL = format('This call tried to record %s.', p_external_ref),
            HINT = 'The external call was made once; poll the recorded reference.';
  END IF;
  UPDATE pgfence.operation o
  SET external_ref = p_external_ref, external_recorded_at = now(), external_detail = p_detail
  WHERE o.id = p_id;
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_record_external(bigint, integer, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_record_external(bigint, integer, text, jsonb) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_record_external(bigint, integer, text, jsonb) IS
  'Owner, right after the external API accepted the call: record its reference (and optionally its answer, p_detail). From now on every owner only polls. Returns true (recorded, or the same reference again) or false (not the owner any more: the fence is stale or the operation ended). A lapsed lease is accepted while nobody took over. Errors: 22004 (id/fence/ref NULL), 22023 (ref not 1-1024 chars), P0002 (unknown id), PF202 (no intent recorded: call operation_begin_issue first), PF002 (a different reference is already recorded).';

CREATE OR REPLACE FUNCTION pgfence.operation_poll(
  p_id             bigint,
  p_fence          integer,
  p_external_state jsonb,
  p_lease          interval DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  c_history constant integer := 50;
  v_row  pgfence.operation;
  v_hist jsonb;
  v_last jsonb;
BEGIN
  PERFORM pgfence._operation_check_lease(p_lease);
  IF p_external_state IS NOT NULL AND octet_length(p_external_state::text) > 65536 THEN
    RAISE EXCEPTION 'operation_poll: external_state is larger than 64 kB' USING ERRCODE = '22023',
      HINT = 'Store the external status and a few fields, not whole documents.';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  IF NOT pgfence._operation_owned(v_row, p_fence, true) THEN
    RETURN NULL;  -- replaced, finished, or the lease lapsed: stop; a new claim resumes polling
  END IF;
  IF v_row.external_ref IS NULL THEN
    RAISE EXCEPTION 'operation_poll: operation % has no external reference to poll', p_id
      USING ERRCODE = 'PF202',
            HINT = 'Issue first: operation_begin_issue, call the external API, operation_record_external.';
  END IF;

  v_hist := v_row.poll_history;
  IF p_external_state IS NOT NULL THEN
    v_last := v_hist -> -1;
    IF v_last IS NOT NULL AND v_last -> 'state' = p_external_state THEN
      v_hist := jsonb_set(v_hist, '{-1}', v_last || jsonb_build_object(
        'last_at', pgfence._operation_ts(now()), 'polls', (v_last ->> 'polls')::integer + 1));
    ELSE
      v_hist := v_hist || jsonb_build_array(jsonb_build_object(
        'state', p_external_state, 'first_at', pgfence._operation_ts(now()),
        'last_at', pgfence._operation_ts(now()), 'polls', 1, 'fence', p_fence));
      IF jsonb_array_length(v_hist) > c_history THEN
        v_hist := v_hist - 0;
      END IF;
    END IF;
  END IF;
  UPDATE pgfence.operation o
  SET external_state = coalesce(p_external_state, o.external_state),
      polled_at = CASE WHEN p_external_state IS NOT NULL THEN now() ELSE o.polled_at END,
      poll_count = o.poll_count + (p_external_state IS NOT NULL)::integer,
      poll_history = v_hist,
      lease = coalesce(p_lease, o.lease),
      lease_expires_at = now() + coalesce(p_lease, o.lease)
  WHERE o.id = p_id;
  RETURN CASE WHEN v_row.cancel_requested_at IS NOT NULL THEN 'cancel' ELSE 'continue' END;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_poll(bigint, integer, jsonb, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_poll(bigint, integer, jsonb, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_poll(bigint, integer, jsonb, interval) IS
  'Owner, after each poll of the external API: check and extend the lease (p_lease, NULL = the current lease length), store the polled external state on the row (history of the last 50 distinct states; the event log gets one row per change), and learn whether a cancel was requested. p_external_state NULL = a heartbeat only (the external API could not be reached). Returns ''continue'', ''cancel'' (a cancel was requested: cancel externally if you can, keep polling, and finish) or NULL (stop: the fence is stale, the operation ended, or your lease lapsed; a new claim resumes polling without calling again). Errors: 22004 (id/fence NULL), 22023 (bad lease, state over 64 kB), P0002 (unknown id), PF202 (no external reference recorded yet).';

CREATE OR REPLACE FUNCTION pgfence.operation_finish(
  p_id        bigint,
  p_fence     integer,
  p_succeeded boolean,
  p_detail    jsonb DEFAULT NULL,
  p_error     text DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_row    pgfence.operation;
  v_status text;
BEGIN
  IF p_succeeded IS NULL THEN
    RAISE EXCEPTION 'operation_finish: succeeded is required' USING ERRCODE = '22004';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  -- Like record_external, a lapsed lease is accepted while nobody took over: the outcome is real.
  IF NOT pgfence._operation_owned(v_row, p_fence, false) THEN
    RETURN NULL;
  END IF;
  IF p_succeeded AND v_row.external_ref IS NULL THEN
    RAISE EXCEPTION 'operation_finish: operation % cannot succeed without an external reference', p_id
      USING ERRCODE = 'PF202',
            HINT = 'Record the reference of the external call (operation_record_external) before reporting its success.';
  END IF;
  v_status := CASE WHEN p_succeeded THEN 'succeeded'
                   WHEN v_row.cancel_requested_at IS NOT NULL THEN 'canceled'
                   ELSE 'failed' END;
  UPDATE pgfence.operation o
  SET status = v_status, finished_at = now(), lease_expires_at = NULL, result = p_detail,
      error = left(CASE v_status
                     WHEN 'succeeded' THEN NULL
                     WHEN 'canceled' THEN format('canceled at the request of %s', o.cancel_requested_by) || coalesce(': ' || p_error, '')
                     ELSE coalesce(p_error, 'failed (no error given)') END, 8000)
  WHERE o.id = p_id;
  RETURN v_status;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_finish(bigint, integer, boolean, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_finish(bigint, integer, boolean, jsonb, text) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_finish(bigint, integer, boolean, jsonb, text) IS
  'Owner, when the external operation ended: running -> succeeded (p_succeeded), or canceled (not succeeded after a cancel request), or failed. p_detail is stored as the result, p_error as the error (after a cancel: "canceled at the request of <who>: <p_error>"). Returns the new status, or NULL when the fence is stale or the operation already ended (a lost race: nothing changed). A lapsed lease is accepted while nobody took over. Errors: 22004 (id/fence/succeeded NULL), P0002 (unknown id), PF202 (success reported without an external reference).';

CREATE OR REPLACE FUNCTION pgfence.operation_release(p_id bigint, p_fence integer)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_row pgfence.operation;
BEGIN
  v_row := pgfence._operation_lock(p_id);
  IF NOT pgfence._operation_owned(v_row, p_fence, false) THEN
    RETURN false;
  END IF;
  UPDATE pgfence.operation o SET lease_expires_at = now() - interval '1 millisecond' WHERE o.id = p_id;
  PERFORM pgfence._event('operation', p_id, 'release', 'running', 'running', p_fence,
    jsonb_build_object('lease_was_until', pgfence._operation_ts(v_row.lease_expires_at)), v_row.locked_by);
  PERFORM pg_notify('pgfence_operation', json_build_object('kind', v_row.kind, 'id', p_id)::text);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_release(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_release(bigint, integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_release(bigint, integer) IS
  'Owner, at a graceful shutdown: end your lease now so that another executor takes the operation over at once (it resumes from the recorded intent / reference, exactly as after a crash) instead of after the lease. Returns false when the fence is stale or the operation ended. Errors: 22004 (id/fence NULL), P0002 (unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Cancel (client / operator)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_cancel(p_id bigint, p_by text DEFAULT NULL)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_by  text := coalesce(nullif(p_by, ''), session_user::text);
  v_row pgfence.operation;
BEGIN
  IF length(v_by) > 200 THEN
    RAISE EXCEPTION 'operation_cancel: by must be at most 200 characters' USING ERRCODE = '22023';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  PERFORM pgfence._set_actor(v_by);
  IF v_row.status = 'queued' OR (v_row.status = 'running' AND v_row.issue_started_at IS NULL) THEN
    -- Nothing was started outside: cancel at once (an owner about to issue finds it canceled).
    UPDATE pgfence.operation o
    SET status = 'canceled', finished_at = now(), lease_expires_at = NULL,
        cancel_requested_at = now(), cancel_requested_by = v_by,
        error = format('canceled by %s before the external call was issued', v_by)
    WHERE o.id = p_id;
    PERFORM pgfence._set_actor(NULL);
    RETURN 'canceled';
  END IF;
  IF v_row.status = 'running' THEN
    IF v_row.cancel_requested_at IS NULL THEN
      UPDATE pgfence.operation o SET cancel_requested_at = now(), cancel_requested_by = v_by WHERE o.id = p_id;
    END IF;
    PERFORM pgfence._set_actor(NULL);
    RETURN 'cancel_requested';
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN NULL;  -- already finished
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_cancel(bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_cancel(bigint, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_cancel(bigint, text) IS
  'Cancel an operation. Queued, or running with no external call issued yet: canceled at once (returns ''canceled''). Running with the external call issued: a cancel request the owner honours on its next poll (returns ''cancel_requested''; repeating it is harmless); the operation ends as canceled unless the external side had already succeeded. Already finished: returns NULL and changes nothing. p_by NULL = session_user. Errors: 22004 (id NULL), 22023 (by too long), P0002 (unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Reaper
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_reap(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_count integer;
  c_running CONSTANT text := 'running';  -- a parameter: see the header, Plans
BEGIN
  IF p_max_rows IS NULL OR p_max_rows < 1 THEN
    RAISE EXCEPTION 'operation_reap: max_rows must be positive, got %', p_max_rows USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor('reaper');
  -- Lapsed leases the reaper can settle without an owner. With an external reference, or an
  -- intent whose call passed the idempotency key, the operation stays running for the next
  -- claim (it resumes polling / re-issues with the key).
  WITH stale AS (
    SELECT o.id FROM pgfence.operation o
    WHERE o.lease_expires_at < now()  -- running, lease lapsed: a lease is set only while running
      AND (o.issue_started_at IS NULL OR (o.external_ref IS NULL AND NOT o.issue_idempotent))
    ORDER BY o.lease_expires_at
    LIMIT p_max_rows
    FOR UPDATE SKIP LOCKED
  ), reaped AS (
    UPDATE pgfence.operation o
    SET status = CASE WHEN o.issue_started_at IS NULL THEN 'queued' ELSE 'failed' END,
        locked_by = CASE WHEN o.issue_started_at IS NULL THEN NULL ELSE o.locked_by END,
        lease_expires_at = NULL,
        finished_at = CASE WHEN o.issue_started_at IS NULL THEN NULL ELSE now() END,
        result = CASE WHEN o.issue_started_at IS NULL THEN o.result
                      ELSE jsonb_build_object('reason', 'outcome_unknown', 'intent_at', pgfence._operation_ts(o.issue_started_at),
                                              'issued_by', o.issued_by, 'issues', o.issue_count) END,
        error = CASE WHEN o.issue_started_at IS NULL
          THEN format('lease of %s lapsed at %s before the external call; requeued', o.locked_by, pgfence._operation_ts(o.lease_expires_at))
          ELSE format('outcome unknown: %s started the external %s call for %s at %s and its lease lapsed at %s before an external reference was recorded; the call did not pass the idempotency key, so calling again could start a second operation. Check %s in the external system by hand.',
                      o.issued_by, o.kind, o.target, pgfence._operation_ts(o.last_issue_at), pgfence._operation_ts(o.lease_expires_at), o.target) END
    WHERE o.id = ANY (ARRAY(SELECT s.id FROM stale s))  -- by primary key, as in operation_claim
      AND o.status = c_running AND o.lease_expires_at < now()
    RETURNING o.id, o.kind, o.status
  )
  SELECT count(*) INTO v_count FROM reaped;
  IF v_count > 0 THEN
    PERFORM pg_notify('pgfence_operation', json_build_object('kind', NULL, 'id', NULL, 'reaped', v_count)::text);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_reap(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_reap(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_reap(integer) IS
  'Reaper for operations whose lease lapsed by the database clock: one whose external call was never issued goes back to queued; one whose call was issued without the idempotency key and left no reference fails as "outcome unknown" (a repeat could start a second operation). Others (a reference, or an intent whose call passed the key) stay running for the next operation_claim, which resumes them. Skips rows locked by an owner''s write; takes at most max_rows. Returns how many it changed. Run by executors on a timer; safe for a DBA to call. Errors: 22023 (max_rows < 1).';

-- ---------------------------------------------------------------------------------------------
-- Reading
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.operation_get(p_id bigint)
RETURNS TABLE (
  id bigint, kind text, target text, params jsonb, idempotency_key text, requested_by text,
  status text, fence integer, locked_by text, claimed_at timestamptz, lease_expires_at timestamptz,
  issue_started_at timestamptz, issued_by text, issue_count integer, issue_idempotent boolean,
  external_ref text, external_recorded_at timestamptz, external_detail jsonb, external_state jsonb,
  polled_at timestamptz, poll_count integer, poll_history jsonb, cancel_requested_at timestamptz,
  cancel_requested_by text, result jsonb, error text, created_at timestamptz, updated_at timestamptz,
  started_at timestamptz, finished_at timestamptz
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'operation_get: id is required' USING ERRCODE = '22004';
  END IF;
  RETURN QUERY
  SELECT o.id, o.kind, o.target, o.params, o.idempotency_key, o.requested_by, o.status, o.fence,
         o.locked_by, o.claimed_at, o.lease_expires_at, o.issue_started_at, o.issued_by,
         o.issue_count, o.issue_idempotent, o.external_ref, o.external_recorded_at,
         o.external_detail, o.external_state, o.polled_at, o.poll_count, o.poll_history,
         o.cancel_requested_at, o.cancel_requested_by, o.result, o.error, o.created_at,
         o.updated_at, o.started_at, o.finished_at
  FROM pgfence.operation o WHERE o.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'operation_get: no operation with id %', p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id; purged operations are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_get(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_get(bigint) IS
  'One operation with everything known about it: the request, status, owner and lease, the intent and external reference, the last polled state and its history, a cancel request, result and error. Errors: 22004 (id NULL), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence.operation_list(
  p_kind   text DEFAULT NULL,
  p_target text DEFAULT NULL,
  p_status text DEFAULT NULL,
  p_limit  integer DEFAULT 100
)
RETURNS TABLE (
  id bigint, kind text, target text, idempotency_key text, status text, fence integer,
  locked_by text, lease_expires_at timestamptz, issue_count integer, external_ref text,
  external_state jsonb, cancel_requested boolean, error text, created_at timestamptz,
  finished_at timestamptz
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_status IS NOT NULL AND p_status NOT IN ('queued', 'running', 'succeeded', 'failed', 'canceled', 'in_flight') THEN
    RAISE EXCEPTION 'operation_list: unknown status "%"', p_status
      USING ERRCODE = '22023', HINT = 'One of queued, running, succeeded, failed, canceled, or in_flight (queued or running).';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'operation_list: limit must be between 1 and 10000' USING ERRCODE = '22023';
  END IF;
  RETURN QUERY
  SELECT o.id, o.kind, o.target, o.idempotency_key, o.status, o.fence, o.locked_by,
         o.lease_expires_at, o.issue_count, o.external_ref, o.external_state,
         o.cancel_requested_at IS NOT NULL, o.error, o.created_at, o.finished_at
  FROM pgfence.operation o
  WHERE (p_kind IS NULL OR o.kind = p_kind)
    AND (p_target IS NULL OR o.target = p_target)
    AND (p_status IS NULL OR o.status = p_status
         OR (p_status = 'in_flight' AND o.status IN ('queued', 'running')))
  ORDER BY o.id DESC
  LIMIT p_limit;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_list(text, text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_list(text, text, text, integer) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_list(text, text, text, integer) IS
  'The newest operations first (without params and history), optionally of one kind, target and/or status; status ''in_flight'' = queued or running. Errors: 22023 (unknown status, limit outside 1..10000).';

CREATE OR REPLACE VIEW pgfence.operation_in_flight AS
SELECT o.id, o.kind, o.target, o.status, o.locked_by AS owner, o.fence, o.lease_expires_at,
       o.status = 'running' AND o.lease_expires_at < now()  AS lease_lapsed,
       o.issue_started_at IS NOT NULL                        AS issue_started,
       o.external_ref,
       o.external_state,
       o.polled_at,
       o.cancel_requested_at IS NOT NULL                     AS cancel_requested,
       now() - o.created_at                                  AS age
FROM pgfence.operation o
WHERE o.status IN ('queued', 'running');
REVOKE ALL ON pgfence.operation_in_flight FROM PUBLIC;
GRANT SELECT ON pgfence.operation_in_flight TO pgfence_admin;
COMMENT ON VIEW pgfence.operation_in_flight IS
  'Operators: every queued or running operation (one per kind and target), who owns it and until when (lease_lapsed: a new claim will take it over), whether its external call was issued and its reference, the last polled state, a pending cancel request, and its age.';
