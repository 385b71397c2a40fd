-- pgfence functions/13_outbox_settle.sql — outbox (module 1): reporting an outcome, fenced.
--
-- Public: outbox_mark_sent(id, attempt, receipt) -> boolean
--         outbox_mark_sent_many(ids[], attempts[], receipts[]) -> the ids moved to sent
--         outbox_mark_sent_and_claim(id, attempt, receipt, worker, batch, channels, lease)
--         outbox_mark_failed(id, attempt, error, retryable, retry_after) -> the new status
-- Private: _outbox_mark_sent_rows (the fenced UPDATE of the _many call, on rows already locked).
-- Called by executors (pgfence_executor). Every write matches the claim's attempt (the fence
-- token) and status processing: a stale claim changes nothing and answers false / NULL (a lost
-- race, not an error). Retries back off by the channel's settings (pgfence.backoff).
-- Errors: functions/ERRORS.md. Plans: docs/query-plans.md#outbox.

CREATE OR REPLACE FUNCTION pgfence.outbox_mark_sent(
  p_id      bigint,
  p_attempt integer,
  p_receipt jsonb DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  c_processing CONSTANT text := 'processing';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  IF p_attempt IS NULL THEN
    RAISE EXCEPTION 'outbox_mark_sent: attempt (the fence token from outbox_claim) is required'
      USING ERRCODE = '22004', DETAIL = 'Without the fence token the mark cannot tell the current owner from a stale one.',
            HINT = 'Pass the attempt that outbox_claim returned with the message.';
  END IF;
  UPDATE pgfence.outbox o
  SET status = 'sent', receipt = p_receipt, finished_at = now(), last_error = NULL,
      locked_by = NULL, lease_expires_at = NULL, updated_at = now()
  WHERE o.id = p_id AND o.attempts = p_attempt AND o.status = c_processing;
  IF FOUND THEN
    RETURN true;
  END IF;
  PERFORM pgfence._outbox_require(p_id);
  RETURN false;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_mark_sent(bigint, integer, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_mark_sent(bigint, integer, jsonb) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_mark_sent(bigint, integer, jsonb) IS
  'Record a delivery: processing -> sent, only under the claim''s attempt (the fence token).
Returns true if this call made the transition, false if the claim is stale (another attempt owns
the message, or it is already finished): a lost race, nothing changed. A lapsed lease that nobody
reclaimed yet is still accepted, since the delivery did happen.
Errors: 22004 (id or attempt NULL), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence._outbox_mark_sent_rows(
  p_ids      bigint[],
  p_attempts integer[],
  p_receipts jsonb[],
  p_done     integer DEFAULT 0
)
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_missing bigint;
  v_rows    bigint;
  c_processing CONSTANT text := 'processing';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  RETURN QUERY
  UPDATE pgfence.outbox o
  SET status = 'sent', receipt = u.receipt, finished_at = now(), last_error = NULL,
      locked_by = NULL, lease_expires_at = NULL, updated_at = now()
  FROM unnest(p_ids, p_attempts, coalesce(p_receipts, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])))
         AS u(id, attempt, receipt)
  WHERE o.id = u.id AND o.attempts = u.attempt AND o.status = c_processing
  RETURNING o.id;
  GET DIAGNOSTICS v_rows = ROW_COUNT;
  IF v_rows + p_done < cardinality(p_ids) THEN
    SELECT u.id INTO v_missing FROM unnest(p_ids) AS u(id)
    WHERE NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = u.id) LIMIT 1;
    IF v_missing IS NOT NULL THEN
      RAISE EXCEPTION 'outbox_mark_sent_many: no message with id %', v_missing
        USING ERRCODE = 'P0002', DETAIL = 'No message has this id: it never existed, or a purge deleted it.',
              HINT = 'Nothing was marked; check the ids.';
    END IF;
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_mark_sent_rows(bigint[], integer[], jsonb[], integer) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_mark_sent_rows(bigint[], integer[], jsonb[], integer) IS
  'Private: the fenced UPDATE of outbox_mark_sent_many, on rows the caller has locked in id order.
Element i of ids / attempts / receipts (NULL: none) is one (id, fence token, receipt); returns the
ids moved to sent. p_done: how many of the ids the caller has settled itself (a hand-off), so that
only a real shortfall looks for an unknown id. Called by outbox_mark_sent_many and
outbox_settle_and_claim after their lock pass. Errors: P0002 (an unknown id; nothing is marked:
the caller''s statement fails).';

CREATE OR REPLACE FUNCTION pgfence.outbox_mark_sent_many(
  p_ids      bigint[],
  p_attempts integer[],
  p_receipts jsonb[] DEFAULT NULL
)
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off  -- row estimates of array joins are inflated; JIT compilation would cost ~0.2 s
AS $$
BEGIN
  IF p_ids IS NULL OR p_attempts IS NULL THEN
    RAISE EXCEPTION 'outbox_mark_sent_many: ids and attempts are required'
      USING ERRCODE = '22004', DETAIL = 'Every mark is fenced on its attempt; nothing was marked.',
            HINT = 'Pass the ids and attempts that outbox_claim returned, element for element.';
  END IF;
  IF cardinality(p_ids) <> cardinality(p_attempts)
     OR (p_receipts IS NOT NULL AND cardinality(p_receipts) <> cardinality(p_ids)) THEN
    RAISE EXCEPTION 'outbox_mark_sent_many: ids, attempts and receipts must have the same length'
      USING ERRCODE = '22023',
            DETAIL = format('Elements: %s ids, %s attempts, %s receipts; nothing was marked.',
                            cardinality(p_ids), cardinality(p_attempts), coalesce(cardinality(p_receipts)::text, 'no')),
            HINT = 'Pass one element per message in each array (receipts NULL for none).';
  END IF;
  -- Lock the rows in id order first: the UPDATE below locks them in the order its join
  -- produces, the input order, so two calls over the same (id, attempt) pairs in different
  -- orders deadlocked (40P01); in id order one of them waits for the other, then finds its
  -- claims stale (a lost race). No SKIP LOCKED: a concurrent mark is waited for, not skipped.
  PERFORM 1 FROM pgfence.outbox o WHERE o.id = ANY (p_ids) ORDER BY o.id FOR UPDATE;
  RETURN QUERY SELECT s FROM pgfence._outbox_mark_sent_rows(p_ids, p_attempts, p_receipts) AS s;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) IS
  'outbox_mark_sent for many messages in one statement; returns the ids this call moved to sent.
Element i of ids / attempts / receipts is one (id, fence token, receipt), and every row is fenced
exactly as in outbox_mark_sent; the ids not returned were stale claims (lost races). Rows are
locked in id order, so concurrent calls over the same pairs in any order wait for each other
instead of deadlocking.
Errors: 22004 (ids or attempts NULL), 22023 (arrays of different lengths), P0002 (an unknown id;
then nothing is marked).';

-- ---------------------------------------------------------------------------------------------
-- Settle one message and claim the next, in one statement (single-message workers)
--
-- A worker that handles one message at a time would otherwise pay two commits per message: the
-- mark of the one it finished and the claim of the next. Both are needed separately only at the
-- very start and end of a run; in between, this does both in one transaction. Every row is still
-- fenced exactly as by outbox_mark_sent and claimed exactly as by outbox_claim (it calls them).
-- bench/outbox.py measures the single-message loop with and without it.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.outbox_mark_sent_and_claim(
  p_id       bigint,
  p_attempt  integer,
  p_receipt  jsonb,
  p_worker   text,
  p_batch    integer DEFAULT 1,
  p_channels text[] DEFAULT NULL,
  p_lease    interval DEFAULT NULL
)
RETURNS TABLE (
  id               bigint,
  channel          text,
  recipient        text,
  payload          jsonb,
  idempotency_key  text,
  attempt          integer,
  max_attempts     integer,
  lease            interval,
  lease_expires_at timestamptz,
  created_at       timestamptz,
  previous_sent    boolean
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_sent boolean;
BEGIN
  -- The mark first: its errors (22004, P0002) abort the call before anything is claimed.
  v_sent := pgfence.outbox_mark_sent(p_id, p_attempt, p_receipt);
  RETURN QUERY
  SELECT c.id, c.channel, c.recipient, c.payload, c.idempotency_key, c.attempt, c.max_attempts,
         c.lease, c.lease_expires_at, c.created_at, v_sent
  FROM pgfence.outbox_claim(p_worker, p_batch, p_channels, p_lease) c;
  IF NOT FOUND THEN
    -- Nothing due: one row that carries only the mark's outcome, so it is never lost.
    RETURN QUERY SELECT NULL::bigint, NULL::text, NULL::text, NULL::jsonb, NULL::text, NULL::integer,
                        NULL::integer, NULL::interval, NULL::timestamptz, NULL::timestamptz, v_sent;
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_mark_sent_and_claim(bigint, integer, jsonb, text, integer, text[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_mark_sent_and_claim(bigint, integer, jsonb, text, integer, text[], interval)
  TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_mark_sent_and_claim(bigint, integer, jsonb, text, integer, text[], interval) IS
  'outbox_mark_sent of one message, then outbox_claim of the next, in one round trip and commit.
For a worker that handles one message at a time: outbox_mark_sent(p_id, p_attempt, p_receipt)
and then outbox_claim(p_worker, p_batch, p_channels, p_lease) in one transaction, so a message
costs one commit instead of two. The mark is fenced and the claim locks with SKIP LOCKED exactly
as in those functions. Returns the claimed messages (the columns of outbox_claim) with
previous_sent = the mark''s outcome (true: this call moved p_id to sent; false: a stale claim, a
lost race, nothing changed). When nothing is due it returns one row whose id and other claim
columns are NULL, carrying only previous_sent.
Errors: those of outbox_mark_sent (22004, P0002: then nothing is claimed) and of outbox_claim
(22023: then nothing is marked either; the whole call rolls back).';

CREATE OR REPLACE FUNCTION pgfence.outbox_mark_failed(
  p_id          bigint,
  p_attempt     integer,
  p_error       text,
  p_retryable   boolean DEFAULT true,
  p_retry_after interval DEFAULT NULL
)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_status text;
  c_processing CONSTANT text := 'processing';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  IF p_attempt IS NULL OR p_error IS NULL OR p_retryable IS NULL THEN
    RAISE EXCEPTION 'outbox_mark_failed: attempt, error and retryable are required'
      USING ERRCODE = '22004', DETAIL = 'The mark is fenced on the attempt and records the error; nothing was changed.',
            HINT = 'Pass the attempt from outbox_claim, the error text, and whether a retry may succeed.';
  END IF;
  IF p_retry_after IS NOT NULL AND p_retry_after < interval '0' THEN
    RAISE EXCEPTION 'outbox_mark_failed: retry_after must not be negative, got %', p_retry_after
      USING ERRCODE = '22023', DETAIL = 'retry_after is the earliest time from now for the next attempt; nothing was changed.',
            HINT = 'Pass NULL for the channel''s backoff, or the delay the receiver asked for (e.g. HTTP Retry-After).';
  END IF;
  UPDATE pgfence.outbox o
  SET status = CASE WHEN NOT p_retryable THEN 'failed'
                    WHEN o.attempts >= o.max_attempts THEN 'dead'
                    ELSE 'pending' END,
      next_attempt_at = CASE
        WHEN p_retryable AND o.attempts < o.max_attempts THEN
          now() + (SELECT least(greatest(pgfence.backoff(o.attempts, s.backoff_base, s.backoff_cap),
                                         coalesce(p_retry_after, interval '0')),
                                s.backoff_cap)
                   FROM pgfence._outbox_settings(o.channel) s)
        ELSE o.next_attempt_at END,
      finished_at = CASE WHEN NOT p_retryable OR o.attempts >= o.max_attempts THEN now() END,
      last_error = left(p_error, 8000),
      locked_by = NULL, lease_expires_at = NULL, updated_at = now()
  WHERE o.id = p_id AND o.attempts = p_attempt AND o.status = c_processing
  RETURNING o.status INTO v_status;
  IF v_status IS NULL THEN
    PERFORM pgfence._outbox_require(p_id);
  END IF;
  RETURN v_status;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_mark_failed(bigint, integer, text, boolean, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_mark_failed(bigint, integer, text, boolean, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_mark_failed(bigint, integer, text, boolean, interval) IS
  'Record a failed delivery under the claim''s attempt; returns the new status (NULL: stale claim).
Retryable: back to pending, due after the channel''s capped, jittered exponential backoff (or
retry_after, e.g. an HTTP Retry-After, if longer; never beyond the cap), or dead when no attempts
remain. Not retryable: failed. NULL when the claim is stale (a lost race: nothing changed).
Errors: 22004 (id, attempt, error or retryable NULL), 22023 (negative retry_after), P0002
(unknown id).';

