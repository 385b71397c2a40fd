-- pgfence functions/12_outbox_claim.sql — outbox (module 1): claiming due messages.
--
-- Public: outbox_claim(worker, batch, channels, lease) -> the claimed messages, each with its
--           attempt (the fence token that outbox_mark_sent / outbox_mark_failed must present)
--         outbox_next_due(channels) -> how long until the next pending message is due
-- Called by executors (pgfence_executor). A claim locks due rows with FOR UPDATE SKIP LOCKED,
-- so concurrent claimers never get the same message, and leases them from now() (the
-- database clock). Errors: functions/ERRORS.md.
-- Plans: every walk here is chosen to match one index, and the status is compared with a
-- constant: docs/query-plans.md#outbox (tests/test_query_plans_outbox.py checks them).

CREATE OR REPLACE FUNCTION pgfence.outbox_claim(
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
  v_lease interval;
  c_pending CONSTANT text := 'pending';
BEGIN
  IF p_worker IS NULL OR p_worker = '' OR length(p_worker) > 200 THEN
    RAISE EXCEPTION 'outbox: worker must be a non-empty name of at most 200 characters'
      USING ERRCODE = '22023', DETAIL = 'The worker name is recorded as the owner of every message it claims.',
            HINT = 'Use something an operator can trace, e.g. host:pid.';
  END IF;
  -- bounded like a channel's lease (outbox_channel): now() + lease can never overflow (22008),
  -- and a crashed worker's claim is taken back within a day
  IF p_lease IS NOT NULL AND (p_lease <= interval '0' OR p_lease > interval '1 day') THEN
    RAISE EXCEPTION 'outbox: lease must be positive and at most 1 day, got %', p_lease
      USING ERRCODE = '22023', DETAIL = 'A lease longer than a day would keep a crashed worker''s messages for that long; nothing was claimed.',
            HINT = 'Pass NULL for the channel''s lease, or e.g. interval ''5 minutes''.';
  END IF;
  IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'outbox_claim: batch must be between 1 and 10000, got %', p_batch
      USING ERRCODE = '22023', DETAIL = 'Nothing was claimed.',
            HINT = 'Claim at most as many messages as you can deliver within one lease.';
  END IF;
  -- A channel array of any shape means its elements: '[0:0]={c}' or '{{c}}' is channel c (the
  -- one-channel path below reads p_channels[1], which is NULL for those).
  IF array_ndims(p_channels) > 1 OR array_lower(p_channels, 1) <> 1 THEN
    p_channels := ARRAY(SELECT u.ch FROM unnest(p_channels) AS u(ch));
  END IF;
  -- One statement: the ARRAY(...) sub-select locks the due rows, the UPDATE claims them by
  -- primary key. Each shape walks an index in due order and stops after p_batch rows: all
  -- channels -> outbox_due_idx; some channels -> outbox_channel_due_idx once per channel (at
  -- most p_batch locked per channel; the earliest p_batch are claimed, the others are released
  -- when this transaction ends a moment later). Plans: docs/query-plans.md#outbox.
  IF p_channels IS NULL THEN
    RETURN QUERY
    WITH claimed AS (
      UPDATE pgfence.outbox o
      SET status = 'processing', attempts = o.attempts + 1, locked_by = p_worker,
          claimed_at = now(), updated_at = now(),
          lease_expires_at = now() + coalesce(
            p_lease,
            (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = o.channel),
            (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = '*'))
      WHERE o.id = ANY (ARRAY(
              SELECT d.id FROM pgfence.outbox d
              -- attempts < max_attempts: true of every pending message; matches outbox_due_idx
              WHERE d.status = 'pending' AND d.attempts < d.max_attempts AND d.next_attempt_at <= now()
              ORDER BY d.next_attempt_at, d.id
              LIMIT p_batch
              FOR UPDATE SKIP LOCKED))
        AND o.status = c_pending  -- a constant: docs/query-plans.md#constants-instead-of-literals
      RETURNING o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.attempts,
                o.max_attempts, o.lease_expires_at - now() AS lease, o.lease_expires_at,
                o.created_at, o.next_attempt_at AS due_at)
    SELECT c.id, c.channel, c.recipient, c.payload, c.idempotency_key, c.attempts, c.max_attempts,
           c.lease, c.lease_expires_at, c.created_at
    FROM claimed c ORDER BY c.due_at, c.id;
  ELSIF cardinality(p_channels) = 1 THEN
    -- The common case (an executor routing one channel): one index walk, the lease looked up once.
    v_lease := coalesce(p_lease,
                        (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = p_channels[1]),
                        (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = '*'));
    RETURN QUERY
    WITH claimed AS (
      UPDATE pgfence.outbox o
      SET status = 'processing', attempts = o.attempts + 1, locked_by = p_worker,
          claimed_at = now(), updated_at = now(), lease_expires_at = now() + v_lease
      WHERE o.id = ANY (ARRAY(
              SELECT d.id FROM pgfence.outbox d
              WHERE d.channel = p_channels[1] AND d.status = 'pending' AND d.next_attempt_at <= now()
              ORDER BY d.next_attempt_at, d.id
              LIMIT p_batch
              FOR UPDATE SKIP LOCKED))
        AND o.status = c_pending  -- a constant: docs/query-plans.md#constants-instead-of-literals
      RETURNING o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.attempts,
                o.max_attempts, o.lease_expires_at - now() AS lease, o.lease_expires_at,
                o.created_at, o.next_attempt_at AS due_at)
    SELECT c.id, c.channel, c.recipient, c.payload, c.idempotency_key, c.attempts, c.max_attempts,
           c.lease, c.lease_expires_at, c.created_at
    FROM claimed c ORDER BY c.due_at, c.id;
  ELSE
    RETURN QUERY
    WITH claimed AS (
      UPDATE pgfence.outbox o
      SET status = 'processing', attempts = o.attempts + 1, locked_by = p_worker,
          claimed_at = now(), updated_at = now(),
          lease_expires_at = now() + coalesce(
            p_lease,
            (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = o.channel),
            (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = '*'))
      WHERE o.id = ANY (ARRAY(
              SELECT b.id
              FROM (SELECT DISTINCT u.ch FROM unnest(p_channels) AS u(ch)) chans
              CROSS JOIN LATERAL (
                SELECT d.id, d.next_attempt_at FROM pgfence.outbox d
                WHERE d.channel = chans.ch AND d.status = 'pending' AND d.next_attempt_at <= now()
                ORDER BY d.next_attempt_at, d.id
                LIMIT p_batch
                FOR UPDATE SKIP LOCKED) b
              ORDER BY b.next_attempt_at, b.id
              LIMIT p_batch))
        AND o.status = c_pending  -- a constant: docs/query-plans.md#constants-instead-of-literals
      RETURNING o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.attempts,
                o.max_attempts, o.lease_expires_at - now() AS lease, o.lease_expires_at,
                o.created_at, o.next_attempt_at AS due_at)
    SELECT c.id, c.channel, c.recipient, c.payload, c.idempotency_key, c.attempts, c.max_attempts,
           c.lease, c.lease_expires_at, c.created_at
    FROM claimed c ORDER BY c.due_at, c.id;
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_claim(text, integer, text[], interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_claim(text, integer, text[], interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_claim(text, integer, text[], interval) IS
  'Claim up to p_batch due messages, oldest due first; each comes with its attempt (fence token).
Locks with FOR UPDATE SKIP LOCKED, so concurrent claimers never get the same row. Each claim
bumps attempts and returns it as attempt: the fence token for outbox_mark_sent /
outbox_mark_failed. The lease runs from now() (database clock) for p_lease, or the channel''s
lease when NULL. p_channels NULL = all channels; an array of any shape (lower bound, dimensions)
means its elements. Order: due time, then id.
Errors: 22023 (empty worker, batch outside 1..10000, lease not in (0, 1 day]).';

CREATE OR REPLACE FUNCTION pgfence.outbox_next_due(p_channels text[] DEFAULT NULL)
RETURNS interval
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_due timestamptz;
BEGIN
  IF p_channels IS NULL THEN
    SELECT o.next_attempt_at INTO v_due FROM pgfence.outbox o
    WHERE o.status = 'pending' AND o.attempts < o.max_attempts  -- matches outbox_due_idx
    ORDER BY o.next_attempt_at LIMIT 1;
  ELSE
    SELECT min(n.at) INTO v_due
    FROM unnest(p_channels) AS c(ch)
    CROSS JOIN LATERAL (
      SELECT o.next_attempt_at AS at FROM pgfence.outbox o
      WHERE o.channel = c.ch AND o.status = 'pending' ORDER BY o.next_attempt_at LIMIT 1) n;
  END IF;
  RETURN CASE WHEN v_due IS NOT NULL THEN greatest(v_due - now(), interval '0') END;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_next_due(text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_next_due(text[]) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_next_due(text[]) IS
  'How long until the earliest pending message of these channels is due (database clock).
0 if one is due now, NULL if none is pending; p_channels NULL = all channels. Executors sleep
min(this, poll interval), so delayed and backed-off messages go out on time without a NOTIFY.
Errors: none.';

