-- pgfence functions/34_operation_read.sql — operations (module 3): reads.
--
-- Public: operation_get (one operation with everything known about it), operation_list (the
-- newest operations, by kind, target and status) and the view operation_in_flight (operators:
-- every queued or running operation, its owner, lease and external reference).
-- Reads change nothing: an operation whose lease lapsed stays running until the next claim or
-- reaper run settles it (operation_in_flight says lease_lapsed). Timestamps are timestamptz
-- columns; JSON history (poll_history) holds UTC text (pgfence._ts).
-- Errors: functions/ERRORS.md.

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
    RAISE EXCEPTION 'operation_get: id is required'
      USING ERRCODE = '22004', DETAIL = 'operation_get reads one operation by its id.',
            HINT = 'Pass the id that pgfence.operation_request returned, or find it with pgfence.operation_list.';
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
      USING ERRCODE = 'P0002', DETAIL = 'No operation has this id: it was never requested, or it was purged.',
            HINT = 'Check the id; purged operations are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_get(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_get(bigint) IS
  'One operation with everything known about it: request, status, owner, intent, reference, polls.
The request, status, owner and lease, the intent and external reference, the last polled state and its history, a cancel request, result and error. Errors: 22004 (id NULL), P0002 (unknown id).';

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
      USING ERRCODE = '22023', DETAIL = 'p_status keeps the operations of one status (in_flight: queued or running); NULL lists them all.',
            HINT = 'One of queued, running, succeeded, failed, canceled, or in_flight (queued or running).';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'operation_list: limit must be between 1 and 10000'
      USING ERRCODE = '22023', DETAIL = format('Got %s.', coalesce(p_limit::text, 'NULL')),
            HINT = 'Pass 1 to 10000 (the default is 100), or narrow the list by kind, target or status.';
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
  'The newest operations first (without params and history), by kind, target and/or status.
Each filter is optional; status ''in_flight'' = queued or running. Errors: 22023 (unknown status, limit outside 1..10000).';

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
  'Operators: every queued or running operation (one per kind and target), its owner and lease.
Who owns it and until when (lease_lapsed: a new claim will take it over), whether its external call was issued and its reference, the last polled state, a pending cancel request, and its age.';
COMMENT ON COLUMN pgfence.operation_in_flight.id IS 'The operation.';
COMMENT ON COLUMN pgfence.operation_in_flight.kind IS 'What kind of work (the executor''s handler for it), e.g. branch.reset.';
COMMENT ON COLUMN pgfence.operation_in_flight.target IS 'What it acts on; at most one operation per (kind, target) is in flight.';
COMMENT ON COLUMN pgfence.operation_in_flight.status IS 'queued (waiting for an executor) or running (claimed by owner).';
COMMENT ON COLUMN pgfence.operation_in_flight.owner IS 'The worker that claimed it last (locked_by); NULL while queued.';
COMMENT ON COLUMN pgfence.operation_in_flight.fence IS 'The owner''s fence token, bumped by every claim: a replaced owner''s writes change nothing.';
COMMENT ON COLUMN pgfence.operation_in_flight.lease_expires_at IS 'Until when the owner holds it without a poll (database clock); NULL while queued.';
COMMENT ON COLUMN pgfence.operation_in_flight.lease_lapsed IS 'Running with a lapsed lease: the next claim takes it over (or the reaper settles it).';
COMMENT ON COLUMN pgfence.operation_in_flight.issue_started IS 'An intent was recorded: the external call may have been made.';
COMMENT ON COLUMN pgfence.operation_in_flight.external_ref IS 'The external system''s reference of the call, once recorded: from then on owners only poll.';
COMMENT ON COLUMN pgfence.operation_in_flight.external_state IS 'The last state an owner polled from the external system.';
COMMENT ON COLUMN pgfence.operation_in_flight.polled_at IS 'When that state was polled.';
COMMENT ON COLUMN pgfence.operation_in_flight.cancel_requested IS 'A cancel was requested; the owner honours it at its next poll.';
COMMENT ON COLUMN pgfence.operation_in_flight.age IS 'How long ago the operation was requested (now() - created_at).';
