-- pgfence functions/15_outbox_operator.sql — outbox (module 1): operator functions and views.
--
-- Public: outbox_requeue(id, extra_attempts) -> boolean       retry a failed or dead message
--         outbox_cancel(id, by, reason) -> boolean              a message that must not go out
--         outbox_configure_channel(channel, max_attempts, backoff_base, backoff_cap, lease,
--                                  log_events, max_payload_bytes, key_max_in_flight, key_rate,
--                                  key_burst, key_dead_policy, limit_key) -> the stored settings
--         outbox_get(id), outbox_list(channel, status, limit)  read messages
--         views outbox_summary (per channel and status), outbox_leases (who holds what)
-- For pgfence_admin (outbox_get also for clients and executors; the views also for pg_monitor,
-- granted in 90_audit_owned.sql). Nothing here takes part in a delivery: a requeue and a cancel
-- are the writes; a requeue keeps counting attempts, so fence tokens are never reused, and a
-- cancel never touches a message being delivered.
-- Errors: functions/ERRORS.md.

CREATE OR REPLACE FUNCTION pgfence.outbox_requeue(p_id bigint, p_extra_attempts integer DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_channel text;
  v_key     text;
BEGIN
  IF p_extra_attempts IS NOT NULL AND p_extra_attempts NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'outbox_requeue: extra_attempts must be between 1 and 1000, got %', p_extra_attempts
      USING ERRCODE = '22023', DETAIL = 'A message has at most 1000 attempts per requeue; nothing was changed.',
            HINT = 'Pass NULL for the channel''s max_attempts.';
  END IF;
  -- A keyed failed or dead message goes waiting, which its decision then decides: the key's
  -- lock first, then the row, in the order of every decision (as outbox_cancel).
  SELECT o.channel, o.ordering_key INTO v_channel, v_key FROM pgfence.outbox o
  WHERE o.id = p_id AND o.ordering_key IS NOT NULL AND o.status IN ('failed', 'dead');
  IF v_key IS NOT NULL THEN
    PERFORM pgfence._outbox_keys_lock(ARRAY[v_channel], ARRAY[v_key]);
  END IF;
  UPDATE pgfence.outbox o
  -- a keyed message queues again behind its key's turn (16_outbox_keys.sql decides it)
  SET status = CASE WHEN o.ordering_key IS NULL OR o.status = 'pending' THEN 'pending' ELSE 'waiting' END,
      next_attempt_at = now(),
      finished_at = NULL,
      updated_at = now(),
      log_events = (pgfence._outbox_settings(o.channel)).log_events,
      max_attempts = CASE WHEN o.status = 'pending' THEN o.max_attempts + coalesce(p_extra_attempts, 0)
                          ELSE o.attempts + coalesce(p_extra_attempts, (pgfence._outbox_settings(o.channel)).max_attempts) END
  WHERE o.id = p_id AND o.status IN ('failed', 'dead', 'pending');
  IF FOUND THEN
    RETURN true;
  END IF;
  PERFORM pgfence._outbox_require(p_id);
  RETURN false;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_requeue(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_requeue(bigint, integer) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_requeue(bigint, integer) IS
  'Operator: retry a failed or dead message now, with more attempts; false if it is not retryable.
Grants extra_attempts more attempts (default: the channel''s max_attempts); a pending message is
made due now (and gets extra_attempts more, if given). attempts keeps counting, so fence tokens
are never reused. A failed or dead message with an ordering_key waits for its key''s turn again
(first in its key: it is the oldest); its key is locked before its row, as by outbox_cancel.
Returns false for a message that is waiting, processing, sent or canceled.
Errors: 40001 (REPEATABLE READ or SERIALIZABLE: a concurrent decision on the key; retry), 22004 (id NULL), 22023 (extra_attempts outside 1..1000), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence.outbox_cancel(p_id bigint, p_by text, p_reason text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_from    text;
  v_channel text;
  v_key     text;
  v_row     pgfence.outbox;
BEGIN
  IF p_by IS NULL OR p_by = '' OR length(p_by) > 200 OR p_reason IS NULL OR p_reason = '' THEN
    RAISE EXCEPTION 'outbox_cancel: who cancels (1-200 characters) and why are required'
      USING ERRCODE = '22023', DETAIL = 'A cancel is an operator''s decision: the event log records who and why; nothing was changed.',
            HINT = 'Pass your name and a reason, e.g. outbox_cancel(42, ''alice'', ''customer withdrew the order'').';
  END IF;
  PERFORM pgfence._set_actor(p_by);
  -- The status is re-checked under the row lock: a concurrent claim that took the message first
  -- makes this match nothing (a lost race: false), and one that comes after skips it.
  SELECT o.status, o.channel, o.ordering_key INTO v_from, v_channel, v_key FROM pgfence.outbox o WHERE o.id = p_id;
  IF v_key IS NOT NULL AND v_from IN ('waiting', 'pending', 'failed', 'dead') THEN
    -- The key's lock before the row's, the order of every decision: this cancel's decision
    -- (tg_outbox_keys_turns_ended) wants the key, and a decision or hand-off holding the key may
    -- want this row (to promote or hand it off): row first, then key, deadlocked with them.
    PERFORM pgfence._outbox_keys_lock(ARRAY[v_channel], ARRAY[v_key]);
  END IF;
  UPDATE pgfence.outbox o
  SET status = 'canceled', finished_at = now(), updated_at = now(),
      last_error = left(format('canceled by %s: %s', p_by, p_reason), 8000)
  WHERE o.id = p_id AND o.status IN ('waiting', 'pending', 'failed', 'dead')
  RETURNING o.* INTO v_row;
  IF v_row.id IS NULL THEN
    PERFORM pgfence._set_actor(NULL);
    PERFORM pgfence._outbox_require(p_id);
    RETURN false;
  END IF;
  IF NOT v_row.log_events THEN
    -- Always in the event log, whatever the channel's log_events (which wrote it otherwise).
    PERFORM pgfence._event('outbox', v_row.id, 'transition', v_from, 'canceled', v_row.attempts,
      jsonb_build_object('channel', v_row.channel, 'error', v_row.last_error), p_by);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_cancel(bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_cancel(bigint, text, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_cancel(bigint, text, text) IS
  'Operator: cancel a message that is not being delivered; false if it is processing or finished.
waiting, pending, failed or dead -> canceled, a terminal status (finished_at set; last_error says
who and why), with its transition event in pgfence.event whatever the channel''s log_events.
Fenced against a concurrent claim: the status is checked under the row lock, so a message a
claimer took first is left alone (false: a lost race) and a claimer that comes second skips it.
Canceling the message that holds an ordering key gives the key''s turn to its next message. A
keyed message''s key is locked (pgfence.outbox_key) before its row, the order every key decision
takes them in, so a cancel racing a settle of the key waits for it instead of deadlocking.
Errors: 40001 (REPEATABLE READ or SERIALIZABLE: a concurrent decision on the key; retry), 22004 (id NULL), 22023 (by empty or over 200 characters, reason empty), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence.outbox_configure_channel(
  p_channel      text,
  p_max_attempts integer DEFAULT NULL,
  p_backoff_base interval DEFAULT NULL,
  p_backoff_cap  interval DEFAULT NULL,
  p_lease        interval DEFAULT NULL,
  p_log_events   boolean DEFAULT NULL,
  p_max_payload_bytes integer DEFAULT NULL,
  p_key_max_in_flight integer DEFAULT NULL,
  p_key_rate     double precision DEFAULT NULL,
  p_key_burst    integer DEFAULT NULL,
  p_key_dead_policy text DEFAULT NULL,
  p_limit_key    text DEFAULT NULL
)
RETURNS pgfence.outbox_channel
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_cur pgfence.outbox_channel;
  v_row pgfence.outbox_channel;
BEGIN
  IF p_channel IS NULL OR (p_channel <> '*' AND NOT pgfence._is_name(p_channel)) THEN
    RAISE EXCEPTION 'outbox_configure_channel: invalid channel name "%"', p_channel
      USING ERRCODE = '22023', DETAIL = 'Channel names are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit.',
            HINT = 'Use a channel name, or ''*'' for the defaults.';
  END IF;
  v_cur := pgfence._outbox_settings(p_channel);
  BEGIN
    INSERT INTO pgfence.outbox_channel AS c (channel, max_attempts, backoff_base, backoff_cap, lease, log_events,
                                             max_payload_bytes, key_max_in_flight, key_rate, key_burst,
                                             key_dead_policy, limit_key)
    VALUES (p_channel,
            coalesce(p_max_attempts, v_cur.max_attempts),
            coalesce(p_backoff_base, v_cur.backoff_base),
            coalesce(p_backoff_cap, v_cur.backoff_cap),
            coalesce(p_lease, v_cur.lease),
            coalesce(p_log_events, v_cur.log_events),
            coalesce(p_max_payload_bytes, v_cur.max_payload_bytes),
            coalesce(p_key_max_in_flight, v_cur.key_max_in_flight),
            CASE WHEN p_key_rate = 0 THEN NULL ELSE coalesce(p_key_rate, v_cur.key_rate) END,
            coalesce(p_key_burst, v_cur.key_burst),
            coalesce(p_key_dead_policy, v_cur.key_dead_policy),
            CASE WHEN p_limit_key = 'none' THEN NULL ELSE coalesce(p_limit_key, v_cur.limit_key) END)
    ON CONFLICT (channel) DO UPDATE
      SET max_attempts = EXCLUDED.max_attempts, backoff_base = EXCLUDED.backoff_base,
          backoff_cap = EXCLUDED.backoff_cap, lease = EXCLUDED.lease,
          log_events = EXCLUDED.log_events, max_payload_bytes = EXCLUDED.max_payload_bytes,
          key_max_in_flight = EXCLUDED.key_max_in_flight, key_rate = EXCLUDED.key_rate,
          key_burst = EXCLUDED.key_burst, key_dead_policy = EXCLUDED.key_dead_policy,
          limit_key = EXCLUDED.limit_key,
          updated_at = now()
    RETURNING c.* INTO v_row;
    IF p_log_events IS NOT NULL THEN
      -- messages still in flight follow the new setting; finished ones keep their history
      UPDATE pgfence.outbox o SET log_events = p_log_events, updated_at = now()
      WHERE (p_channel = '*' OR o.channel = p_channel)
        AND o.status IN ('pending', 'processing') AND o.log_events <> p_log_events
        AND (p_channel <> '*' OR NOT EXISTS (SELECT 1 FROM pgfence.outbox_channel c WHERE c.channel = o.channel));
    END IF;
  EXCEPTION WHEN check_violation THEN
    RAISE EXCEPTION 'outbox_configure_channel: invalid settings for "%"', p_channel
      USING ERRCODE = '22023', DETAIL = 'Nothing was changed.',
            HINT = 'Need 1 <= max_attempts <= 1000, 0 < backoff_base <= backoff_cap <= 30 days, 0 < lease <= 1 day, 1 <= max_payload_bytes <= 268435455, 1 <= key_max_in_flight <= 10000, key_rate 0 (no rate) or 0.000001 to 1000000, 1 <= key_burst <= 10000, key_dead_policy block or release, limit_key host or none.';
  END;
  IF p_key_max_in_flight IS NOT NULL OR p_key_dead_policy IS NOT NULL OR p_key_rate IS NOT NULL
     OR p_key_burst IS NOT NULL THEN
    -- Keys waiting under the old rules may take their turn under the new ones now.
    PERFORM pgfence._outbox_keys_decide(array_agg(k.channel), array_agg(k.ordering_key))
    FROM pgfence.outbox_key k
    WHERE k.channel = p_channel
       OR (p_channel = '*' AND NOT EXISTS (SELECT 1 FROM pgfence.outbox_channel c WHERE c.channel = k.channel));
  END IF;
  RETURN v_row;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean, integer, integer, double precision, integer, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean, integer, integer, double precision, integer, text, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean, integer, integer, double precision, integer, text, text) IS
  'Operator: set a channel''s retry, size, event logging and ordering-key rules; returns the row.
NULL keeps the current value (inherited from ''*'' for a new channel; ''*'' itself holds the
defaults). Applies to claims and failures from now on; max_attempts and max_payload_bytes (the
jsonb size of a payload, 1 MiB by default) to messages enqueued from now on; log_events also to
messages still pending or processing. Ordering keys: key_max_in_flight (how many messages of one
key may be pending or processing at once, 1 by default: strictly one after the other),
key_rate (claims per second per key, a token bucket on the database clock; 0 = no rate) with
key_burst, key_dead_policy (block: a failed or dead message holds its key until an operator
requeues or cancels it; release: the key moves on). A change of these decides every waiting key
of the channel again at once. limit_key (host; none to clear; NULL by default): a message
enqueued from now on without an ordering key gets the key host:<its recipient URL''s host>, so
the key limits apply per host; such a key is never held by a failed or dead message.
Errors: 22023 (bad name or settings: 1 <= max_attempts <= 1000, 0 < backoff_base <= backoff_cap
<= 30 days, 0 < lease <= 1 day, 1 <= max_payload_bytes <= 268435455, 1 <= key_max_in_flight <=
10000, key_rate 0 (no rate) or 0.000001 to 1000000, 1 <= key_burst <= 10000, key_dead_policy block or release,
limit_key host or none).';

CREATE OR REPLACE FUNCTION pgfence.outbox_get(p_id bigint)
RETURNS TABLE (
  id bigint, channel text, recipient text, payload jsonb, idempotency_key text, status text,
  attempts integer, max_attempts integer, next_attempt_at timestamptz, locked_by text,
  claimed_at timestamptz, lease_expires_at timestamptz, last_error text, receipt jsonb,
  created_at timestamptz, updated_at timestamptz, finished_at timestamptz, ordering_key text
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  PERFORM pgfence._outbox_require(p_id);
  RETURN QUERY
  SELECT o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.status, o.attempts,
         o.max_attempts, o.next_attempt_at, o.locked_by, o.claimed_at, o.lease_expires_at,
         o.last_error, o.receipt, o.created_at, o.updated_at, o.finished_at, o.ordering_key
  FROM pgfence.outbox o WHERE o.id = p_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_get(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_get(bigint) IS
  'One message with its delivery state (status, attempts, owner and lease, last error, receipt).
ordering_key: its ordering key (NULL: none).
Errors: 22004 (id NULL), P0002 (unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Views for operators (psql: \d+ pgfence.outbox_summary explains every column)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.outbox_summary AS
SELECT o.channel,
       o.status,
       count(*)                                                         AS messages,
       min(o.created_at)                                                AS oldest_created_at,
       CASE WHEN o.status = 'pending' THEN
         clock_timestamp() - min(o.next_attempt_at) FILTER (WHERE o.next_attempt_at <= clock_timestamp())
       END                                                              AS oldest_due_age,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > clock_timestamp()) AS deferred,
       count(*) FILTER (WHERE o.status = 'processing' AND o.lease_expires_at < now()) AS lapsed_leases,
       max(o.attempts)                                                  AS max_attempts_used
FROM pgfence.outbox o
GROUP BY o.channel, o.status;
REVOKE ALL ON pgfence.outbox_summary FROM PUBLIC;
GRANT SELECT ON pgfence.outbox_summary TO pgfence_admin;
COMMENT ON VIEW pgfence.outbox_summary IS
  'Operators: message counts per outbox channel and status, with the oldest and the overdue.
One row per channel and status (\d+ explains each column). Counts every row: after a long run
without purge it scans the whole outbox.';

COMMENT ON COLUMN pgfence.outbox_summary.channel IS 'The outbox channel.';
COMMENT ON COLUMN pgfence.outbox_summary.status IS 'waiting, pending, processing, sent, failed, dead or canceled.';
COMMENT ON COLUMN pgfence.outbox_summary.messages IS 'How many messages of the channel are in this status.';
COMMENT ON COLUMN pgfence.outbox_summary.oldest_created_at IS 'When the oldest of them was enqueued.';
COMMENT ON COLUMN pgfence.outbox_summary.oldest_due_age IS
  'Pending only: how long the most overdue due message has waited since its due time (NULL: none due).';
COMMENT ON COLUMN pgfence.outbox_summary.deferred IS
  'Pending messages not due yet: waiting out a retry backoff or their deliver_at.';
COMMENT ON COLUMN pgfence.outbox_summary.lapsed_leases IS
  'Processing messages past their lease (database clock): the reaper (outbox_reap) will take them back.';
COMMENT ON COLUMN pgfence.outbox_summary.max_attempts_used IS 'The highest attempts count among them.';

CREATE OR REPLACE VIEW pgfence.outbox_leases AS
SELECT o.locked_by                          AS worker,
       o.channel,
       count(*)                             AS held,
       min(o.claimed_at)                    AS oldest_claim_at,
       min(o.lease_expires_at)              AS next_expiry,
       count(*) FILTER (WHERE o.lease_expires_at < now()) AS lapsed
FROM pgfence.outbox o
WHERE o.status = 'processing'
GROUP BY o.locked_by, o.channel;
REVOKE ALL ON pgfence.outbox_leases FROM PUBLIC;
GRANT SELECT ON pgfence.outbox_leases TO pgfence_admin;
COMMENT ON VIEW pgfence.outbox_leases IS
  'Operators: who holds outbox leases right now, per worker and channel (database clock).
Only messages being delivered (processing), with the earliest expiry and how many already lapsed.';

COMMENT ON COLUMN pgfence.outbox_leases.worker IS 'The worker holding the leases (the name it claimed with).';
COMMENT ON COLUMN pgfence.outbox_leases.channel IS 'The outbox channel.';
COMMENT ON COLUMN pgfence.outbox_leases.held IS 'How many messages of the channel it is delivering (processing).';
COMMENT ON COLUMN pgfence.outbox_leases.oldest_claim_at IS 'When it claimed the oldest of them.';
COMMENT ON COLUMN pgfence.outbox_leases.next_expiry IS 'The earliest lease deadline among them (database clock).';
COMMENT ON COLUMN pgfence.outbox_leases.lapsed IS
  'How many of its leases already lapsed: the worker may be dead or stalled; the reaper takes them back.';

CREATE OR REPLACE FUNCTION pgfence.outbox_list(
  p_channel text DEFAULT NULL,
  p_status  text DEFAULT NULL,
  p_limit   integer DEFAULT 100
)
RETURNS TABLE (
  id bigint, channel text, recipient text, idempotency_key text, status text, attempts integer,
  max_attempts integer, next_attempt_at timestamptz, locked_by text, lease_expires_at timestamptz,
  last_error text, created_at timestamptz, finished_at timestamptz
)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_status IS NOT NULL AND p_status NOT IN ('waiting', 'pending', 'processing', 'sent', 'failed', 'dead', 'canceled') THEN
    RAISE EXCEPTION 'outbox_list: unknown status "%"', p_status
      USING ERRCODE = '22023', DETAIL = 'The outbox status machine has seven statuses.',
            HINT = 'One of waiting, pending, processing, sent, failed, dead, canceled.';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'outbox_list: limit must be between 1 and 10000, got %', p_limit
      USING ERRCODE = '22023', DETAIL = 'The list is meant for a screen, newest first.',
            HINT = 'Narrow it by channel and status, or read pgfence.outbox_summary for counts.';
  END IF;
  RETURN QUERY
  SELECT o.id, o.channel, o.recipient, o.idempotency_key, o.status, o.attempts, o.max_attempts,
         o.next_attempt_at, o.locked_by, o.lease_expires_at, o.last_error, o.created_at, o.finished_at
  FROM pgfence.outbox o
  WHERE (p_channel IS NULL OR o.channel = p_channel)
    AND (p_status IS NULL OR o.status = p_status)
  ORDER BY o.id DESC
  LIMIT p_limit;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_list(text, text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_list(text, text, integer) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_list(text, text, integer) IS
  'Operators: the newest messages (highest id first), of one channel and/or status, no payloads.
Errors: 22023 (unknown status, limit outside 1..10000).';
