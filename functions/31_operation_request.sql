-- pgfence functions/31_operation_request.sql — operations (module 3): what clients call.
--
-- Public: operation_request (ask for an operation of a kind on a target; a repeated
-- idempotency key answers with the same operation; PF201 while the target is busy) and
-- operation_cancel (cancel at once if no external call was made, else a request the owner
-- honours at its next poll). At most one operation per (kind, target) is queued or running
-- (the unique index operation_one_in_flight, migration 0004). Every write logs its event
-- (tg_operation_event) and NOTIFY pgfence_operation {"kind","id"} wakes executors at commit.
-- Call these in autocommit / READ COMMITTED: under REPEATABLE READ a conflict with an
-- invisible transaction raises 40001. Errors: functions/ERRORS.md (PF201, PF003).

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
  v_xid xid8;
BEGIN
  IF p_kind IS NULL OR p_target IS NULL OR p_params IS NULL THEN
    RAISE EXCEPTION 'operation_request: kind, target and params are required'
      USING ERRCODE = '22004', DETAIL = 'An operation is work of a kind on a target, with its parameters.',
            HINT = 'Pass a kind (e.g. ''branch.reset''), a target (e.g. the branch name) and a JSON object of params.';
  END IF;
  IF NOT pgfence._is_name(p_kind) THEN
    RAISE EXCEPTION 'operation_request: invalid kind "%"', p_kind
      USING ERRCODE = '22023', DETAIL = 'The kind names the handler an executor routes the operation to; nothing was requested.',
            HINT = 'Kinds are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit; the executor maps each kind to a handler.';
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
      USING ERRCODE = '22023', DETAIL = 'The params are handed to the kind''s handler as one JSON object.',
            HINT = 'Wrap the value: jsonb_build_object(''value'', ...).';
  END IF;
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'operation_request: idempotency_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_idempotency_key)),
            HINT = 'Use a stable key for this one request, e.g. ''reset-dev-42-2024-05-01T10:00Z''.';
  END IF;
  IF length(v_by) > 200 THEN
    RAISE EXCEPTION 'operation_request: requested_by must be at most 200 characters'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(v_by)),
            HINT = 'Name who asks (a user, a service); NULL records the database login.';
  END IF;
  PERFORM pgfence._set_actor(v_by);

  -- A conflict is either the idempotency key (a repeat: answer with that operation) or the
  -- one-in-flight index (another operation holds the target: PF201). ON CONFLICT DO NOTHING
  -- waits for a concurrent inserter of either, then the lookups below see its committed row.
  -- If that row is gone again by then (rolled back / finished), try once more.
  -- The xid before the id (the identity's nextval runs before the row's insert would assign it):
  -- a request whose xid is newer than a claim hint's candidate bound then gets an id above the
  -- candidate, the sequence having CACHE 1 (docs/design.md#operation-claim-hint, "writers stamp
  -- above: the id after the xid").
  v_xid := pg_current_xact_id();
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
                              pgfence._ts(v_row.created_at)),
              HINT = format('Wait for operation %s to finish (pgfence.operation_get), cancel it (pgfence.operation_cancel), or repeat its own request (same idempotency key) to follow it.', v_row.id);
    END IF;
    IF current_setting('transaction_isolation') IN ('repeatable read', 'serializable') THEN
      EXIT;
    END IF;
  END LOOP;
  RAISE EXCEPTION 'operation_request: % % conflicts with an operation this snapshot cannot see', p_kind, p_target
    USING ERRCODE = '40001', DETAIL = 'The operation holding the key or the target was committed, or ended, by a transaction this snapshot cannot see.',
          HINT = 'Retry the transaction (this happens under REPEATABLE READ / SERIALIZABLE, or when the target is released and taken again repeatedly).';
END
$$;
REVOKE ALL ON FUNCTION pgfence.operation_request(text, text, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.operation_request(text, text, jsonb, text, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.operation_request(text, text, jsonb, text, text) IS
  'Request a long external operation of p_kind on p_target; returns (id, status, created, ...).
E.g. (''branch.reset'', ''dev-42''); returns (id, status, created, result, error). A repeated idempotency key — also from a concurrent transaction — returns the existing operation with created = false, a finished one answering from its row, and starts nothing. At most one operation per (kind, target) is queued or running: a different request for a busy target raises PF201, whose DETAIL starts with "Operation <id>" (the one in flight). requested_by NULL = session_user. At commit, NOTIFY pgfence_operation carries {"kind","id"}. Errors: 22004 (kind/target/params NULL), 22023 (bad kind, target — 1-1024 characters, at most 2048 bytes —, params, key), PF003 (key already names a different request), PF201 (target busy), 40001 (conflict invisible to a REPEATABLE READ snapshot: retry).';

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
    RAISE EXCEPTION 'operation_cancel: by must be at most 200 characters'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(v_by)),
            HINT = 'Name who cancels (a user, a service); NULL records the database login.';
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
  'Cancel an operation: at once if no external call was made, else by a request to its owner.
Queued, or running with no external call issued yet: canceled at once (returns ''canceled''). Running with the external call issued: a cancel request the owner honours on its next poll (returns ''cancel_requested''; repeating it is harmless); the operation ends as canceled unless the external side had already succeeded. Already finished: returns NULL and changes nothing. p_by NULL = session_user. Errors: 22004 (id NULL), 22023 (by too long), P0002 (unknown id).';
