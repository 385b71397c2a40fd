-- pgfence functions/33_operation_issue.sql — operations (module 3): the owner's issue protocol.
--
-- All under the fence token that operation_claim returned (a replaced owner gets NULL / false):
--   1. operation_begin_issue(id, fence, idempotent)  records the INTENT before calling out;
--   2. the owner calls the external API (passing the idempotency key if it can);
--   3. operation_record_external(id, fence, ref)     records the REFERENCE right after;
--   4. operation_poll(id, fence, state)              on an interval: extends the lease, keeps the
--                                                    polled state, reports a cancel request;
--   5. operation_finish(id, fence, succeeded, ...)   when the external side is done.
-- operation_release ends the lease at a graceful shutdown. A new owner that finds a reference
-- only polls; one that finds an intent without a reference re-issues only if both calls pass the
-- key, else the operation fails as "outcome unknown" (see operation_begin_issue).

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
      USING ERRCODE = '22004', DETAIL = 'Whether a lost call may be made again depends on whether your call and the first one pass the idempotency key.',
            HINT = 'Pass true only if your call hands the operation''s idempotency key to the external API, which then starts at most one operation per key.';
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
  -- result record that a cancel was pending (tg_operation_event).
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
                 'reason', 'outcome_unknown', 'intent_at', pgfence._ts(o.issue_started_at),
                 'issued_by', o.issued_by, 'issues', o.issue_count,
                 'cancel_pending', CASE WHEN o.cancel_requested_at IS NOT NULL THEN true END,
                 'cancel_requested_by', o.cancel_requested_by)),
      error = format('outcome unknown: %s started the external %s call for %s at %s, but no external reference was recorded; %s, so calling again could start a second operation.%s Check %s in the external system by hand.',
                     o.issued_by, o.kind, o.target, pgfence._ts(o.last_issue_at), v_reason,
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
  'Owner, before calling the external API: record the intent and learn whether to call at all.
Returns ''issue'' (first call: go ahead), ''reissue'' (an earlier call left no reference; both it and yours pass the idempotency key, so calling again is safe — also when a cancel was requested meanwhile: the key finds the operation the first call may have started, the reissue event says cancel_pending, and the next poll answers ''cancel''), ''poll'' (a reference exists: do not call, poll it), ''canceled'' (a cancel was requested and no call was ever started: the operation is now canceled; do not call), ''failed'' (an earlier call left no reference and a repeat could start a second operation: the operation is now failed as "outcome unknown" for a person to check; its result says cancel_pending if a cancel had been requested), or NULL (you are not the owner any more, or your lease lapsed: do not call). p_idempotent: your call passes the idempotency key and the API starts at most one operation per key. Extends the lease (p_lease, NULL = the current lease length). Errors: 22004 (id/fence/idempotent NULL), 22023 (bad lease), P0002 (unknown id).';

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
    RAISE EXCEPTION 'operation_record_external: external_ref is required'
      USING ERRCODE = '22004', DETAIL = 'The reference is what keeps every later owner from calling the external API again.',
            HINT = 'Pass the id the external API returned for the call you just made.';
  END IF;
  IF p_external_ref = '' OR length(p_external_ref) > 1024 THEN
    RAISE EXCEPTION 'operation_record_external: external_ref must be 1-1024 characters'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_external_ref)),
            HINT = 'Record the external system''s id of the operation; its whole answer goes in p_detail.';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  -- A lapsed lease is accepted while nobody took over: the call did happen, and its reference
  -- is what keeps a successor from calling again.
  IF NOT pgfence._operation_owned(v_row, p_fence, false) THEN
    RETURN false;
  END IF;
  IF v_row.issue_started_at IS NULL THEN
    RAISE EXCEPTION 'operation_record_external: operation % has no recorded intent', p_id
      USING ERRCODE = 'PF202', DETAIL = 'The intent, recorded before the call, is what tells a successor that a call may have been made.',
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
  'Owner, right after the external API accepted the call: record its reference; from now on, poll.
Optionally with its answer, p_detail. From now on every owner only polls. Returns true (recorded, or the same reference again) or false (not the owner any more: the fence is stale or the operation ended). A lapsed lease is accepted while nobody took over. Errors: 22004 (id/fence/ref NULL), 22023 (ref not 1-1024 chars), P0002 (unknown id), PF202 (no intent recorded: call operation_begin_issue first), PF002 (a different reference is already recorded).';

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
    RAISE EXCEPTION 'operation_poll: external_state is larger than 64 kB'
      USING ERRCODE = '22023', DETAIL = format('Got %s bytes of JSON text.', octet_length(p_external_state::text)),
            HINT = 'Store the external status and a few fields, not whole documents.';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  IF NOT pgfence._operation_owned(v_row, p_fence, true) THEN
    RETURN NULL;  -- replaced, finished, or the lease lapsed: stop; a new claim resumes polling
  END IF;
  IF v_row.external_ref IS NULL THEN
    RAISE EXCEPTION 'operation_poll: operation % has no external reference to poll', p_id
      USING ERRCODE = 'PF202', DETAIL = 'Only an external call whose reference was recorded can be polled.',
            HINT = 'Issue first: operation_begin_issue, call the external API, operation_record_external.';
  END IF;

  v_hist := v_row.poll_history;
  IF p_external_state IS NOT NULL THEN
    v_last := v_hist -> -1;
    IF v_last IS NOT NULL AND v_last -> 'state' = p_external_state THEN
      v_hist := jsonb_set(v_hist, '{-1}', v_last || jsonb_build_object(
        'last_at', pgfence._ts(now()), 'polls', (v_last ->> 'polls')::integer + 1));
    ELSE
      v_hist := v_hist || jsonb_build_array(jsonb_build_object(
        'state', p_external_state, 'first_at', pgfence._ts(now()),
        'last_at', pgfence._ts(now()), 'polls', 1, 'fence', p_fence));
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
  'Owner, after each poll of the external API: extend the lease, keep the state, learn of a cancel.
Checks and extends the lease (p_lease, NULL = the current lease length), stores the polled external state on the row (history of the last 50 distinct states; the event log gets one row per change), and says whether a cancel was requested. p_external_state NULL = a heartbeat only (the external API could not be reached). Returns ''continue'', ''cancel'' (a cancel was requested: cancel externally if you can, keep polling, and finish) or NULL (stop: the fence is stale, the operation ended, or your lease lapsed; a new claim resumes polling without calling again). Errors: 22004 (id/fence NULL), 22023 (bad lease, state over 64 kB), P0002 (unknown id), PF202 (no external reference recorded yet).';

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
    RAISE EXCEPTION 'operation_finish: succeeded is required'
      USING ERRCODE = '22004', DETAIL = 'The outcome decides the final status: succeeded, or failed (canceled after a cancel request).',
            HINT = 'Pass true if the external operation succeeded, false otherwise (with p_error saying why).';
  END IF;
  v_row := pgfence._operation_lock(p_id);
  -- Like record_external, a lapsed lease is accepted while nobody took over: the outcome is real.
  IF NOT pgfence._operation_owned(v_row, p_fence, false) THEN
    RETURN NULL;
  END IF;
  IF p_succeeded AND v_row.external_ref IS NULL THEN
    RAISE EXCEPTION 'operation_finish: operation % cannot succeed without an external reference', p_id
      USING ERRCODE = 'PF202', DETAIL = 'A success without a reference would say an external call happened without saying which one.',
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
  'Owner, when the external operation ended: running -> succeeded, canceled or failed.
succeeded (p_succeeded), or canceled (not succeeded after a cancel request), or failed. p_detail is stored as the result, p_error as the error (after a cancel: "canceled at the request of <who>: <p_error>"). Returns the new status, or NULL when the fence is stale or the operation already ended (a lost race: nothing changed). A lapsed lease is accepted while nobody took over. Errors: 22004 (id/fence/succeeded NULL), P0002 (unknown id), PF202 (success reported without an external reference).';

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
    jsonb_build_object('lease_was_until', pgfence._ts(v_row.lease_expires_at)), v_row.locked_by);
  PERFORM pg_notify('pgfence_operation', json_build_object('kind', v_row.kind, 'id', p_id)::text);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_release(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_release(bigint, integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_release(bigint, integer) IS
  'Owner, at a graceful shutdown: end your lease now, so that another executor takes over at once.
It resumes from the recorded intent / reference, exactly as after a crash, instead of after the lease. Returns false when the fence is stale or the operation ended. Errors: 22004 (id/fence NULL), P0002 (unknown id).';
