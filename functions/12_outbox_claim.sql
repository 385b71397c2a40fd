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
-- The claim hint: a claim (for all channels, or a set of them) walks from its session's hint, not
-- the front of the due index (dead entries stay there under a pinned snapshot), and from the
-- front once per pgfence.claim_full_walk_ms: docs/design.md#claim-hint. Private:
-- _outbox_claim_hint_name(channels), _outbox_claim_hint_state(setting name),
-- _outbox_check_claimer(worker, lease) (the claim's argument checks, shared with the hand-off).

CREATE OR REPLACE FUNCTION pgfence._outbox_claim_hint_name(p_channels text[])
RETURNS text
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
-- PL/pgSQL rather than SQL: an SQL function with SET is planned on every call.
BEGIN
  IF p_channels IS NULL THEN
    RETURN 'pgfence.claim_hint_all';
  ELSIF cardinality(p_channels) = 1 THEN
    RETURN 'pgfence.claim_hint_' || md5(p_channels[1]);
  END IF;
  -- a set of channels: the same set in any order, with repeats, is the same scope
  RETURN 'pgfence.claim_hint_' || md5(array_to_string(ARRAY(SELECT DISTINCT u.ch FROM unnest(p_channels) AS u(ch)
                                                            WHERE u.ch IS NOT NULL ORDER BY 1), ','));
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_claim_hint_name(text[]) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_claim_hint_name(text[]) IS
  'The session setting that holds the claim hint of a claim scope: all channels, or a channel set.
One channel, or a set of them in any order (channel names have no comma). NULL for a one-channel
array whose element is NULL. outbox_claim and outbox_next_due compute the first two cases inline
(the call of a function with SET costs more than its body). docs/design.md#claim-hint.';

CREATE OR REPLACE FUNCTION pgfence._outbox_claim_hint_state(p_name text)
RETURNS bigint[]
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
-- The hint's state as 8 numbers (NULL = none): hint due (µs since epoch), hint id, candidate
-- due, candidate id, candidate xid bound, candidate's transaction, passed (0/1), last full walk
-- (µs). Anything malformed, or a time after the clock (forged, or the clock stepped back),
-- reads as no state: a claim then walks from the front.
DECLARE
  v_raw text := current_setting(p_name, true);
  v_s   bigint[];
  v_now bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
BEGIN
  -- 8 optional fields of up to 18 digits: written as "digits, and no run of 19" (the same
  -- strings; the counted {1,18} inside {7} costs ~14 us a match, this ~3)
  IF v_raw IS NULL OR v_raw !~ '^(-?[0-9]+)?(,(-?[0-9]+)?){7}$' OR v_raw ~ '[0-9]{19}' THEN
    RETURN NULL;
  END IF;
  v_s := string_to_array(v_raw, ',', '')::bigint[];
  IF v_s[1] > v_now OR v_s[3] > v_now OR v_s[8] > v_now THEN
    RETURN NULL;
  END IF;
  RETURN v_s;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_claim_hint_state(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_claim_hint_state(text) IS
  'Reads a claim scope''s hint state from its session setting (NULL if absent or malformed).
Elements: hint due (µs since epoch), hint id, candidate due, candidate id, candidate xid bound,
candidate''s own xid, passed (1 once every writer older than the bound has ended), last full walk
(µs). outbox_claim and outbox_next_due read it the same way inline (the call of a function with
SET costs more than its body), so nothing calls this one: it is the reference of the check, for
an operator reading a session''s hint (pgTAP 12_outbox_claim_hint covers both). docs/design.md#claim-hint.';

CREATE OR REPLACE FUNCTION pgfence._outbox_check_claimer(p_worker text, p_lease interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
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
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_check_claimer(text, interval) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_check_claimer(text, interval) IS
  'Private: raises unless worker and lease are valid for a claim.
Called by outbox_claim (only to raise: its hot path tests the same condition inline) and by
outbox_settle_and_claim before a hand-off, which claims without calling outbox_claim.
Errors: 22023 (empty or over-long worker, lease not in (0, 1 day]).';

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
  -- Few statements on purpose: PL/pgSQL prepares every expression it evaluates again in each new
  -- transaction (~1 µs each), so each IF, assignment and DECLARE default costs every claim. Hence
  -- one IF for the argument checks, literals for constants, the walk's last key from the walk
  -- itself, and the hint's next state built in one ARRAY[...] per case.
  c_pending CONSTANT text := 'pending';  -- a parameter: docs/query-plans.md#constants-instead-of-literals
  -- due means next_attempt_at <= the clock as this call starts (a message made pending is
  -- stamped with the clock, pgfence._outbox_pending_at, so now() would miss it in the same
  -- transaction); taken before the walk's snapshot: docs/design.md#claim-hint
  v_now     timestamptz := clock_timestamp();
  v_now_us  bigint;
  v_name    text;
  v_raw     text;
  v_st      bigint[];     -- pgfence._outbox_claim_hint_state
  v_full    boolean;      -- this walk starts at the front
  v_passed  boolean;      -- the candidate's bound has passed (v_st[7] = 1, or passes now)
  v_from_at timestamptz;
  v_from_id bigint;
  v_own     bigint;       -- this transaction's xid before the walk (NULL: none yet)
  v_ids     bigint[];
  v_n       integer;
  v_l_us    bigint;       -- the last claimed key: due (µs), id (v_ids[v_n])
  v_lease   interval;
BEGIN
  IF p_worker IS NULL OR p_worker = '' OR length(p_worker) > 200
     OR (p_lease IS NOT NULL AND (p_lease <= interval '0' OR p_lease > interval '1 day'))
     OR p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 10000
     OR array_ndims(p_channels) > 1 OR array_lower(p_channels, 1) <> 1
     OR (cardinality(p_channels) = 1 AND p_channels[1] IS NULL) THEN
    IF p_worker IS NULL OR p_worker = '' OR length(p_worker) > 200
       OR (p_lease IS NOT NULL AND (p_lease <= interval '0' OR p_lease > interval '1 day')) THEN
      PERFORM pgfence._outbox_check_claimer(p_worker, p_lease);  -- raises the precise 22023
    END IF;
    IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 10000 THEN
      RAISE EXCEPTION 'outbox_claim: batch must be between 1 and 10000, got %', p_batch
        USING ERRCODE = '22023', DETAIL = 'Nothing was claimed.',
              HINT = 'Claim at most as many messages as you can deliver within one lease.';
    END IF;
    -- A channel array of any shape means its elements: '[0:0]={c}' or '{{c}}' is channel c (the
    -- one-channel path below reads p_channels[1], which is NULL for those).
    p_channels := ARRAY(SELECT u.ch FROM unnest(p_channels) AS u(ch));
    IF cardinality(p_channels) = 1 AND p_channels[1] IS NULL THEN
      RETURN;  -- '{NULL}': the channel NULL, which has no message (and no hint)
    END IF;
  END IF;

  -- The claim hint (docs/design.md#claim-hint): each scope (all channels, a channel set) walks
  -- its due index from the session's hint instead of the front, and from the front once the last full
  -- walk is older than pgfence.claim_full_walk_ms (default 1000, at most 60000; 0 = always).
  -- The name and the state are read here as _outbox_claim_hint_name / _state do (a call of
  -- either, a function with SET, costs more than its body: ~25 µs of a ~450 µs claim).
  v_name := CASE WHEN p_channels IS NULL THEN 'pgfence.claim_hint_all'
                 WHEN cardinality(p_channels) = 1 THEN 'pgfence.claim_hint_' || md5(p_channels[1])
                 ELSE pgfence._outbox_claim_hint_name(p_channels) END;
  v_now_us := (extract(epoch FROM v_now) * 1000000)::bigint;
  v_raw := current_setting(v_name, true);
  -- 8 optional fields of up to 18 digits, as _outbox_claim_hint_state checks it
  v_st := CASE WHEN v_raw ~ '^(-?[0-9]+)?(,(-?[0-9]+)?){7}$' AND v_raw !~ '[0-9]{19}'
               THEN string_to_array(v_raw, ',', '')::bigint[] END;
  -- none, malformed, or a time after the clock: no state (a walk from the front)
  IF v_st IS NULL OR v_st[1] > v_now_us OR v_st[3] > v_now_us OR v_st[8] > v_now_us THEN
    v_st := '{NULL,NULL,NULL,NULL,NULL,NULL,NULL,NULL}';
  END IF;
  v_full := v_st[1] IS NULL OR v_st[8] IS NULL
            OR v_now_us - v_st[8] >= 1000 * CASE WHEN current_setting('pgfence.claim_full_walk_ms', true) ~ '^[0-9]{1,5}$'
                                                 THEN least(current_setting('pgfence.claim_full_walk_ms', true)::bigint, 60000)
                                                 ELSE 1000 END;
  v_from_at := CASE WHEN v_full THEN '-infinity' ELSE 'epoch'::timestamptz + interval '1 microsecond' * v_st[1] END;
  v_from_id := CASE WHEN v_full THEN '-9223372036854775808'::bigint ELSE v_st[2] END;
  v_own := pg_current_xact_id_if_assigned()::text::bigint;
  -- A candidate taken in a transaction that already had its xid gets its bound from the xid
  -- of a later transaction of this session (assigned after the candidate's walk).
  IF v_st[4] IS NOT NULL AND v_st[5] IS NULL AND v_own IS DISTINCT FROM v_st[6] THEN
    v_st[5] := v_own;
  END IF;
  -- Passed: every transaction that had an xid when the candidate's walk took its snapshot
  -- has ended (all of them are below the bound), so all their writes are visible now. (NULL:
  -- not passed; the state's element 7 is written below, where the state is built.)
  v_passed := v_st[7] = 1 OR pg_snapshot_xmin(pg_current_snapshot())::text::bigint >= v_st[5];

  -- The walk locks the due rows (index order, p_batch, SKIP LOCKED); the UPDATE claims them by
  -- primary key. All channels -> outbox_due_idx; some channels -> outbox_channel_due_idx once
  -- per channel (at most p_batch locked per channel; the earliest p_batch are claimed, the
  -- others are released when this transaction ends a moment later). The walk also gives the
  -- count and the last key's due time (the latest due of the claimed). Plans:
  -- docs/query-plans.md#outbox.
  IF cardinality(p_channels) = 1 THEN
    SELECT array_agg(w.id ORDER BY w.due, w.id), count(*)::integer, (extract(epoch FROM max(w.due)) * 1000000)::bigint
    INTO v_ids, v_n, v_l_us
    FROM (SELECT d.id, d.next_attempt_at AS due FROM pgfence.outbox d
          WHERE d.channel = p_channels[1] AND d.status = 'pending' AND d.next_attempt_at <= v_now
            AND (d.next_attempt_at, d.id) >= (v_from_at, v_from_id)
          ORDER BY d.next_attempt_at, d.id
          LIMIT p_batch
          FOR UPDATE SKIP LOCKED) w;
  ELSIF p_channels IS NULL THEN
    SELECT array_agg(w.id ORDER BY w.due, w.id), count(*)::integer, (extract(epoch FROM max(w.due)) * 1000000)::bigint
    INTO v_ids, v_n, v_l_us
    FROM (SELECT d.id, d.next_attempt_at AS due FROM pgfence.outbox d
          -- attempts < max_attempts: true of every pending message; matches outbox_due_idx
          WHERE d.status = 'pending' AND d.attempts < d.max_attempts AND d.next_attempt_at <= v_now
            AND (d.next_attempt_at, d.id) >= (v_from_at, v_from_id)
          ORDER BY d.next_attempt_at, d.id
          LIMIT p_batch
          FOR UPDATE SKIP LOCKED) w;
  ELSE
    -- each channel's walk starts at the set's hint: the first p_batch of the union from there
    SELECT array_agg(w.id ORDER BY w.due, w.id), count(*)::integer, (extract(epoch FROM max(w.due)) * 1000000)::bigint
    INTO v_ids, v_n, v_l_us
    FROM (SELECT b.id, b.next_attempt_at AS due
          FROM (SELECT DISTINCT u.ch FROM unnest(p_channels) AS u(ch)) chans
          CROSS JOIN LATERAL (
            SELECT d.id, d.next_attempt_at FROM pgfence.outbox d
            WHERE d.channel = chans.ch AND d.status = 'pending' AND d.next_attempt_at <= v_now
              AND (d.next_attempt_at, d.id) >= (v_from_at, v_from_id)
            ORDER BY d.next_attempt_at, d.id
            LIMIT p_batch
            FOR UPDATE SKIP LOCKED) b
          ORDER BY b.next_attempt_at, b.id
          LIMIT p_batch) w;
  END IF;

  -- The hint's next state (v_st[8]: this walk's clock if it was a full walk). The last claimed
  -- key L is (v_l_us, v_ids[v_n]), NULL when nothing was claimed.
  IF v_passed THEN
    -- The candidate's bound has passed: no writer can make a message pending below it any
    -- more, and this walk saw every one that did. Everything this walk passed is done: the
    -- hint moves to the candidate (all due rows claimed) or to the last claimed key.
    IF v_n < p_batch OR (v_st[3], v_st[4]) <= (v_l_us, v_ids[v_n]) THEN
      v_st := ARRAY[v_st[3], v_st[4], NULL, NULL, NULL, NULL, NULL,
                    CASE WHEN v_full THEN v_now_us ELSE v_st[8] END];
    ELSE
      v_st := ARRAY[v_l_us, v_ids[v_n], v_st[3], v_st[4], v_st[5], v_st[6], 1,
                    CASE WHEN v_full THEN v_now_us ELSE v_st[8] END];
    END IF;
  ELSIF v_full THEN
    IF v_n = p_batch AND v_st[1] IS NOT NULL AND (v_l_us, v_ids[v_n]) < (v_st[1], v_st[2]) THEN
      -- A full walk that ended below the hint found messages the hint skipped (a locked row):
      -- walk from here next time.
      v_st := ARRAY[v_l_us, v_ids[v_n], v_st[3], v_st[4], v_st[5], v_st[6], v_st[7], v_now_us];
    ELSE
      v_st[8] := v_now_us;
    END IF;
  END IF;
  IF v_st[3] IS NULL AND v_n > 0 THEN
    -- The next candidate: this walk's last key, or the hint if that is above it, bounded by an
    -- xid assigned after this walk's snapshot: this transaction's, when the walk assigned it.
    v_st := ARRAY[v_st[1], v_st[2],
                  CASE WHEN (v_l_us, v_ids[v_n]) < (v_st[1], v_st[2]) THEN v_st[1] ELSE v_l_us END,
                  CASE WHEN (v_l_us, v_ids[v_n]) < (v_st[1], v_st[2]) THEN v_st[2] ELSE v_ids[v_n] END,
                  CASE WHEN v_own IS NULL THEN pg_current_xact_id_if_assigned()::text::bigint END,
                  pg_current_xact_id_if_assigned()::text::bigint, 0, v_st[8]];
  ELSIF v_st[5] IS NULL AND v_st[3] IS NOT NULL THEN
    -- A candidate still without a bound (taken by a transaction that had its xid before its
    -- walk): this later transaction's xid, when its walk assigned one, is a bound (assigned
    -- after the candidate's walk). Without this step such a candidate waits for a claim that
    -- has its xid before its walk (outbox_settle_and_claim's), and a session that only claims
    -- would never move its hint again.
    v_st[5] := CASE WHEN pg_current_xact_id_if_assigned()::text::bigint <> v_st[6]
                    THEN pg_current_xact_id_if_assigned()::text::bigint END;
  END IF;
  -- an assignment, not PERFORM: a simple expression, no SPI query
  v_raw := set_config(v_name, array_to_string(v_st, ',', ''), false);

  IF v_n = 0 THEN
    RETURN;
  ELSIF v_n = 1 THEN
    -- An executor's wake-up (one message, any channels): nothing to order, so no CTE and no
    -- sort (each executor node costs the claim its start-up); the lease looked up for its row.
    RETURN QUERY
    UPDATE pgfence.outbox o
    SET status = 'processing', attempts = o.attempts + 1, locked_by = p_worker,
        claimed_at = now(), updated_at = now(),
        lease_expires_at = now() + coalesce(
          p_lease,
          (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = o.channel),
          (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = '*'))
    WHERE o.id = ANY (v_ids)
      AND o.status = c_pending  -- a constant: docs/query-plans.md#constants-instead-of-literals
    RETURNING o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.attempts,
              o.max_attempts, o.lease_expires_at - now(), o.lease_expires_at, o.created_at;
  ELSIF cardinality(p_channels) = 1 THEN
    -- The common case (an executor routing one channel): the lease looked up once.
    v_lease := coalesce(p_lease,
                        (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = p_channels[1]),
                        (SELECT c.lease FROM pgfence.outbox_channel c WHERE c.channel = '*'));
    RETURN QUERY
    WITH claimed AS (
      UPDATE pgfence.outbox o
      SET status = 'processing', attempts = o.attempts + 1, locked_by = p_worker,
          claimed_at = now(), updated_at = now(), lease_expires_at = now() + v_lease
      WHERE o.id = ANY (v_ids)
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
      WHERE o.id = ANY (v_ids)
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
means its elements. Order: due time, then id. Due: next_attempt_at <= the database clock.
The walk starts at this session''s claim hint for these channels, and at the front
at least once per pgfence.claim_full_walk_ms (default 1000): docs/design.md#claim-hint.
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
  v_due     timestamptz;
  -- the claim hint's name and state read inline, as outbox_claim does (a call of
  -- _outbox_claim_hint_name / _state, functions with SET, costs more than its body)
  v_raw     text := current_setting(CASE WHEN p_channels IS NULL THEN 'pgfence.claim_hint_all'
                                         WHEN cardinality(p_channels) = 1 THEN 'pgfence.claim_hint_' || md5(p_channels[1])
                                         ELSE pgfence._outbox_claim_hint_name(p_channels) END, true);
  v_now_us  bigint := (extract(epoch FROM clock_timestamp()) * 1000000)::bigint;
  -- 8 optional fields of up to 18 digits, as _outbox_claim_hint_state checks it
  v_st      bigint[] := CASE WHEN v_raw ~ '^(-?[0-9]+)?(,(-?[0-9]+)?){7}$' AND v_raw !~ '[0-9]{19}'
                             THEN string_to_array(v_raw, ',', '')::bigint[] END;
  v_from_at timestamptz;
  v_from_id bigint;
BEGIN
  -- a time after the clock reads as no state
  IF v_st[1] > v_now_us OR v_st[3] > v_now_us OR v_st[8] > v_now_us THEN
    v_st := NULL;
  END IF;
  -- from the claim hint, as the claim walks (docs/design.md#claim-hint)
  v_from_at := coalesce('epoch'::timestamptz + interval '1 microsecond' * v_st[1], '-infinity');
  v_from_id := coalesce(v_st[2], '-9223372036854775808'::bigint);
  IF p_channels IS NULL THEN
    SELECT o.next_attempt_at INTO v_due FROM pgfence.outbox o
    WHERE o.status = 'pending' AND o.attempts < o.max_attempts  -- matches outbox_due_idx
      AND (o.next_attempt_at, o.id) >= (v_from_at, v_from_id)
    ORDER BY o.next_attempt_at, o.id LIMIT 1;
  ELSIF cardinality(p_channels) = 1 THEN
    SELECT o.next_attempt_at INTO v_due FROM pgfence.outbox o
    WHERE o.channel = p_channels[1] AND o.status = 'pending'
      AND (o.next_attempt_at, o.id) >= (v_from_at, v_from_id)
    ORDER BY o.next_attempt_at, o.id LIMIT 1;
  ELSE
    SELECT min(n.at) INTO v_due
    FROM unnest(p_channels) AS c(ch)
    CROSS JOIN LATERAL (
      SELECT o.next_attempt_at AS at FROM pgfence.outbox o
      WHERE o.channel = c.ch AND o.status = 'pending'
        AND (o.next_attempt_at, o.id) >= (v_from_at, v_from_id)
      ORDER BY o.next_attempt_at, o.id LIMIT 1) n;
  END IF;
  -- from the clock, as the claim decides what is due
  RETURN CASE WHEN v_due IS NOT NULL THEN greatest(v_due - clock_timestamp(), interval '0') END;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_next_due(text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_next_due(text[]) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_next_due(text[]) IS
  'How long until the earliest pending message of these channels is due (database clock).
0 if one is due now, NULL if none is pending; p_channels NULL = all channels. From the claim
hint of this session, like outbox_claim (docs/design.md#claim-hint). Executors sleep
min(this, poll interval), so delayed and backed-off messages go out on time without a NOTIFY.
Errors: none.';

