-- pgfence functions/19_outbox_batch.sql — outbox (module 1): the executor's claim round.
--
-- Public: outbox_settle_and_claim(ids, attempts, receipts, worker, batch, channels, lease)
--           -> the claimed messages, then one row with the ids settled and the next due time
-- Called by executors (pgfence_executor) in place of outbox_mark_sent_many + outbox_claim (+
-- outbox_next_due): one round trip and one durable commit per batch instead of two or three.
-- It calls those functions (or their parts), so every mark is fenced and every claim locked
-- exactly as theirs; the claim is committed before the call returns, so before any of its
-- deliveries starts. The settle of a keyed message may hand its key's next message to the same
-- worker (the hand-off: 16_outbox_keys.sql), a claim that counts against the batch.
-- Errors: functions/ERRORS.md.

CREATE OR REPLACE FUNCTION pgfence.outbox_settle_and_claim(
  p_ids      bigint[],
  p_attempts integer[],
  p_receipts jsonb[],
  p_worker   text,
  p_batch    integer,
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
  sent             bigint[],
  next_due         interval
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan  -- its lock-and-lookup by id: docs/query-plans.md#pinned-settings
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  v_sent   bigint[] := '{}';
  v_handed   integer := 0;
  v_keyed    bigint[];
  v_channels text[];
  v_keys     text[];
  v_receipts jsonb[];
  c_processing CONSTANT text := 'processing';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  -- Checked before anything is written, so that a bad batch never leaves a half-done call.
  IF p_batch IS NULL OR p_batch NOT BETWEEN 0 AND 10000 THEN
    RAISE EXCEPTION 'outbox_settle_and_claim: batch must be between 0 and 10000, got %', p_batch
      USING ERRCODE = '22023',
            DETAIL = 'batch is how many messages to claim after settling; 0 settles only.',
            HINT = 'Claim at most as many messages as you can deliver within one lease.';
  END IF;
  -- The hand-off (16_outbox_keys.sql): the keyed messages of this round whose keys' next
  -- messages are due are settled together with the claim of those, for this worker; those rows
  -- count against the batch. Only with room to claim and well-formed arrays (outbox_mark_sent_many
  -- raises for the others), worker and lease checked first as outbox_claim checks them.
  IF p_batch > 0 AND cardinality(p_ids) > 0 AND cardinality(p_ids) = cardinality(p_attempts)
     AND (p_receipts IS NULL OR cardinality(p_receipts) = cardinality(p_ids)) THEN
    PERFORM pgfence._outbox_check_claimer(p_worker, p_lease);
    -- Lock every row to settle in id order, as outbox_mark_sent_many does (concurrent settles
    -- wait for each other instead of deadlocking), and in the same statement note the keyed
    -- ones this call may settle: fenced as the settle fences them (processing under the attempt
    -- given with the id's first element; LockRows returns the row's latest version). OFFSET 0
    -- keeps the outer tests above the lock (a qual pushed into the subquery would lock only
    -- the rows it passes): every row is locked, keyless ones too.
    SELECT array_agg(l.id), array_agg(l.channel), array_agg(l.ordering_key),
           array_agg(CASE WHEN p_receipts IS NOT NULL THEN p_receipts[array_position(p_ids, l.id)] END)
      INTO v_keyed, v_channels, v_keys, v_receipts
    FROM (SELECT o.id, o.channel, o.ordering_key, o.attempts, o.status FROM pgfence.outbox o
          WHERE o.id = ANY (p_ids) ORDER BY o.id OFFSET 0 FOR UPDATE) l
    WHERE l.ordering_key IS NOT NULL AND l.status = c_processing
      AND (p_channels IS NULL OR l.channel = ANY (p_channels))
      AND l.attempts = p_attempts[array_position(p_ids, l.id)];
    IF v_keyed IS NOT NULL THEN
      -- The handed-off messages go straight into this call's result (no loop over the rows).
      -- The hand-off settles every keyed message it is given (they are locked and fenced), the
      -- keys it hands off and the others alike: so what it settled is v_keyed, without a re-read.
      RETURN QUERY
      SELECT h.id, h.channel, h.recipient, h.payload, h.idempotency_key, h.attempt, h.max_attempts,
             h.lease, h.lease_expires_at, h.created_at, NULL::bigint[], NULL::interval
      FROM pgfence._outbox_keys_hand_off(v_keyed, v_channels, v_keys, v_receipts,
                                         p_worker, p_batch, p_lease) h;
      GET DIAGNOSTICS v_handed = ROW_COUNT;
      v_sent := v_keyed;
    END IF;
    -- The keyless ones, as outbox_mark_sent_many marks them (the rows are locked already). Its error
    -- (P0002) aborts the whole call, hand-off included.
    IF cardinality(v_sent) < cardinality(p_ids) THEN
      v_sent := v_sent || ARRAY(SELECT s FROM pgfence._outbox_mark_sent_rows(p_ids, p_attempts, p_receipts,
                                                                                cardinality(v_sent)) AS s);
    END IF;
  ELSIF p_ids IS NULL OR p_attempts IS NULL OR cardinality(p_ids) > 0 OR cardinality(p_attempts) > 0
     OR cardinality(p_receipts) > 0 THEN
    -- The settle only: its errors (22004, 22023, P0002) abort the call before anything is claimed.
    v_sent := ARRAY(SELECT s FROM pgfence.outbox_mark_sent_many(p_ids, p_attempts, p_receipts) AS s);
  END IF;
  IF p_batch > v_handed THEN
    RETURN QUERY
    SELECT c.id, c.channel, c.recipient, c.payload, c.idempotency_key, c.attempt, c.max_attempts,
           c.lease, c.lease_expires_at, c.created_at, NULL::bigint[], NULL::interval
    FROM pgfence.outbox_claim(p_worker, p_batch - v_handed, p_channels, p_lease) c;
  END IF;
  -- Last, one row with the settlement: a statement of its own, so it sees the claim above.
  RETURN QUERY
  SELECT NULL::bigint, NULL::text, NULL::text, NULL::jsonb, NULL::text, NULL::integer,
         NULL::integer, NULL::interval, NULL::timestamptz, NULL::timestamptz, v_sent,
         pgfence.outbox_next_due(p_channels);
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_settle_and_claim(bigint[], integer[], jsonb[], text, integer, text[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_settle_and_claim(bigint[], integer[], jsonb[], text, integer, text[], interval)
  TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_settle_and_claim(bigint[], integer[], jsonb[], text, integer, text[], interval) IS
  'Mark a batch of messages sent and claim the next batch in one statement and one durable commit.
The executor''s hot path: outbox_mark_sent_many(p_ids, p_attempts, p_receipts), then outbox_claim(p_worker, p_batch, p_channels, p_lease), in one transaction, so a batch costs one round trip and one commit instead of two. Every mark is fenced exactly as in outbox_mark_sent_many (element i of ids/attempts/receipts is one message and its fence), and the claim locks with SKIP LOCKED exactly as outbox_claim; the claim is committed when the call returns, before any of its messages can be delivered. Empty ids and attempts settle nothing; p_batch 0 claims nothing (then p_worker and p_lease are not read).
The hand-off: with p_batch 1 or more, a settled message with an ordering key whose key''s next messages are due now (and whose channel has no key_rate, and is in p_channels) is marked sent in the same UPDATE that claims those next messages for p_worker, waiting -> processing (attempt + 1, leased as by outbox_claim; a claim event when the channel logs events): they come first among the claimed rows and count against p_batch; order and key_max_in_flight hold as at any turn decision. The other keys'' next messages are promoted to pending as by outbox_mark_sent_many.
Returns the claimed messages (the columns of outbox_claim, oldest due first; sent and next_due NULL), then always one last row whose claim columns are NULL: sent = the ids this call moved to sent (the others were stale claims, lost races), next_due = outbox_next_due(p_channels) after this claim (0: more is due now; NULL: nothing pending).
Errors: 22004 (ids or attempts NULL), 22023 (batch outside 0..10000; ids, attempts and receipts of different lengths; with batch 1 or more: empty worker, lease not in (0, 1 day]), P0002 (an unknown id: nothing is marked or claimed).';
