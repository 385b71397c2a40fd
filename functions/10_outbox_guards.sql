-- pgfence functions/10_outbox.sql — Module 1: the transactional outbox.
--
-- A message is enqueued inside the caller's business transaction and delivered at least once
-- by an executor. Status machine (enforced by tg_outbox_guard, not only by these functions):
--
--   pending --claim--> processing --mark_sent--> sent                     (terminal)
--                                 --mark_failed(permanent)--> failed      (terminal until requeue)
--                                 --mark_failed / lease lapsed--> pending (retry, with backoff)
--                                                          or --> dead    (no attempts left)
--   failed | dead --outbox_requeue--> pending  (operator; grants more attempts)
--
-- Fence: `attempts` is bumped at every claim and returned as `attempt`; an owner's writes match
-- `attempts = attempt AND status = 'processing'`, so a worker whose lease was taken over (or
-- whose message was already finished) changes nothing: its call returns false / NULL.
-- Time: every lease and due time is computed from now(), the database clock.
-- Errors: functions/ERRORS.md.
--
-- Plans: the hot-path functions carry SET plan_cache_mode = force_generic_plan (plan once per
-- session instead of once per call: planning cost more than executing) together with
-- SET enable_seqscan = off and enable_bitmapscan = off. A generic plan is kept for the life of
-- the session; one made while the queue was empty would be a sequential scan, reused when the
-- queue is long — every claim would then read the whole table. Pinning index access keeps a
-- claim O(batch) whatever the statistics said when the plan was made (bench/outbox.py measured
-- an executor started on an empty queue at half the throughput before this).
-- A statement that finds its rows by primary key compares the status with a PL/pgSQL constant
-- (c_pending, c_processing), not a literal: in a generic plan that is a parameter, so the
-- planner cannot prove a partial index's predicate (WHERE status = 'pending' / 'processing')
-- and has no path but the primary key. With the literal, statistics taken while few messages
-- were processing made every mark a full scan of outbox_lease_idx (dead entries included) for
-- the life of the session, and every claim a full scan of outbox_channel_due_idx.

-- ---------------------------------------------------------------------------------------------
-- Status machine guard and event log
--
-- One PL/pgSQL row trigger checks the move and the row's invariants and, for messages whose
-- log_events flag is set, writes the event in the same statement. (Measured: a trigger WHEN
-- condition or CHECK constraints cost more here, because PostgreSQL re-parses them for every
-- statement, and the claim and the mark are one statement each on the hot path.)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_outbox_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    -- Reached only through the WHEN condition of outbox_insert_guard: not a fresh message.
    -- (The enqueue event is written by outbox_enqueue_event, AFTER the row exists.)
    RAISE EXCEPTION 'outbox: a new message starts pending, with 0 attempts, no owner and no lease'
      USING ERRCODE = 'PF001', HINT = 'Use pgfence.outbox_enqueue().';
  END IF;

  IF NEW.attempts < OLD.attempts THEN
    RAISE EXCEPTION 'outbox message %: attempts is a fence token and never decreases (% -> %)', OLD.id, OLD.attempts, NEW.attempts
      USING ERRCODE = 'PF002', HINT = 'To retry a failed or dead message use pgfence.outbox_requeue(id), which grants more attempts.';
  END IF;
  IF NOT (
       (   (OLD.status = 'pending'    AND NEW.status = 'processing' AND NEW.attempts = OLD.attempts + 1)
        OR (OLD.status = 'pending'    AND NEW.status = 'pending'    AND NEW.attempts = OLD.attempts)
        OR (OLD.status = 'processing' AND NEW.status IN ('processing', 'pending', 'sent', 'failed', 'dead')
                                      AND NEW.attempts = OLD.attempts)
        OR (OLD.status IN ('failed', 'dead') AND NEW.status = 'pending' AND NEW.attempts = OLD.attempts))
       AND NEW.attempts <= NEW.max_attempts
       AND (NEW.status <> 'pending' OR NEW.attempts < NEW.max_attempts)
       AND (NEW.status = 'processing') = (NEW.locked_by IS NOT NULL AND NEW.lease_expires_at IS NOT NULL)
       AND (NEW.status IN ('sent', 'failed', 'dead')) = (NEW.finished_at IS NOT NULL)) THEN
    RAISE EXCEPTION 'illegal outbox transition for message %: % -> % (attempts % -> %)',
      OLD.id, OLD.status, NEW.status, OLD.attempts, NEW.attempts
      USING ERRCODE = 'PF001',
            DETAIL = 'Allowed: pending->processing (attempts+1), pending->pending, processing->processing|pending|sent|failed|dead, failed|dead->pending (requeue); a sent message never changes again. Always: attempts <= max_attempts (< when pending: a pending message must have an attempt left), owner and lease iff processing, finished_at iff sent|failed|dead.',
            HINT = 'Use the pgfence.outbox_* functions; they make only legal moves.';
  END IF;
  IF NEW.log_events THEN
    PERFORM pgfence._event('outbox', NEW.id,
      CASE WHEN OLD.status = 'pending' AND NEW.status = 'processing' THEN 'claim'
           WHEN OLD.status = NEW.status THEN 'update'
           ELSE 'transition' END,
      OLD.status, NEW.status, NEW.attempts,
      jsonb_strip_nulls(jsonb_build_object(
        'channel', NEW.channel,
        'error', CASE WHEN NEW.last_error IS DISTINCT FROM OLD.last_error THEN NEW.last_error END,
        'receipt', CASE WHEN NEW.status = 'sent' THEN NEW.receipt END,
        'lease_expires_at', NEW.lease_expires_at,
        'next_attempt_at', CASE WHEN NEW.status = 'pending' THEN NEW.next_attempt_at END)),
      coalesce(nullif(current_setting('pgfence.actor', true), ''),
               CASE WHEN NEW.status = 'processing' THEN NEW.locked_by
                    WHEN OLD.status = 'processing' THEN OLD.locked_by END));
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_guard() IS
  'BEFORE UPDATE row trigger on pgfence.outbox (and BEFORE INSERT, filtered by a WHEN condition): refuses any move outside the status machine or breaking a row invariant (PF001) and any decrease of the fence token (PF002), even from a hand-written statement; for messages with log_events it writes the claim or transition event (actor, attempt, error, receipt) in the same statement (the enqueue event: tg_outbox_enqueued).';

CREATE OR REPLACE TRIGGER outbox_guard
  BEFORE UPDATE ON pgfence.outbox
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_outbox_guard();
-- On INSERT the WHEN condition filters in the executor (evaluated once per statement set-up,
-- then per row without a function call), so a bulk enqueue of 10,000 rows calls no PL/pgSQL
-- unless a row is malformed or its channel logs events.
CREATE OR REPLACE TRIGGER outbox_insert_guard
  BEFORE INSERT ON pgfence.outbox
  FOR EACH ROW
  WHEN (NEW.status <> 'pending' OR NEW.attempts <> 0 OR NEW.max_attempts < 1
        OR NEW.locked_by IS NOT NULL OR NEW.lease_expires_at IS NOT NULL
        OR NEW.finished_at IS NOT NULL)
  EXECUTE FUNCTION pgfence.tg_outbox_guard();

-- The enqueue event is written AFTER the insert: a BEFORE INSERT trigger also fires for a row
-- that ON CONFLICT (idempotency_key) DO NOTHING then skips (a retry, or a key repeated inside
-- one outbox_enqueue_many), which logged an enqueue for a message id that never existed.
CREATE OR REPLACE FUNCTION pgfence.tg_outbox_enqueued()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._event('outbox', NEW.id, 'enqueue', NULL, NEW.status, NEW.attempts,
    jsonb_build_object('channel', NEW.channel, 'recipient', NEW.recipient, 'due_at', NEW.next_attempt_at));
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_enqueued() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_enqueued() IS
  'AFTER INSERT row trigger on pgfence.outbox, for messages with log_events: writes the enqueue event.
Only for rows really inserted: a row skipped by ON CONFLICT DO NOTHING (a repeated idempotency key) gets none.';

-- WHEN in an AFTER trigger is evaluated as the row is inserted: a channel that does not log
-- events queues nothing.
CREATE OR REPLACE TRIGGER outbox_enqueue_event
  AFTER INSERT ON pgfence.outbox
  FOR EACH ROW
  WHEN (NEW.log_events)
  EXECUTE FUNCTION pgfence.tg_outbox_enqueued();

-- A stray DELETE would lose messages: only a purge deletes (see pgfence.tg_purge_only).
CREATE OR REPLACE TRIGGER outbox_purge_only
  BEFORE DELETE ON pgfence.outbox
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION pgfence.tg_purge_only();

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_frozen()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'outbox message % is immutable: channel, recipient, payload, idempotency_key and created_at are never updated', OLD.id
    USING ERRCODE = 'PF002', HINT = 'Enqueue a new message instead.';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_frozen() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_frozen() IS
  'BEFORE UPDATE OF channel, recipient, payload, idempotency_key, created_at trigger on pgfence.outbox: any statement that writes those columns is refused (PF002). A column trigger costs nothing for statements that do not name them.';

CREATE OR REPLACE TRIGGER outbox_frozen
  BEFORE UPDATE OF channel, recipient, payload, idempotency_key, created_at ON pgfence.outbox
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_outbox_frozen();

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._outbox_settings(p_channel text)
RETURNS pgfence.outbox_channel
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
-- PL/pgSQL rather than SQL: its plan is cached for the session; a non-inlined SQL function
-- would be parsed and planned again on every call (this runs on every enqueue and failure).
DECLARE
  v_row pgfence.outbox_channel;
BEGIN
  SELECT c.* INTO v_row FROM pgfence.outbox_channel c WHERE c.channel = p_channel;
  IF NOT FOUND THEN
    SELECT c.* INTO v_row FROM pgfence.outbox_channel c WHERE c.channel = '*';
  END IF;
  RETURN v_row;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_settings(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_settings(text) IS
  'Private: the retry settings that apply to a channel (its own row, else the ''*'' defaults).';

CREATE OR REPLACE FUNCTION pgfence._outbox_check_message(
  p_channel text, p_recipient text, p_payload jsonb, p_idempotency_key text, p_max_attempts integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_channel IS NULL OR p_recipient IS NULL OR p_payload IS NULL THEN
    RAISE EXCEPTION 'outbox: channel, recipient and payload are required'
      USING ERRCODE = '22004', HINT = 'Pass a channel name, a recipient and a JSON object payload.';
  END IF;
  IF p_channel !~ '^[a-z0-9][a-z0-9_.-]{0,62}$' THEN
    RAISE EXCEPTION 'outbox: invalid channel name "%"', p_channel
      USING ERRCODE = '22023', HINT = 'Channel names are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit.';
  END IF;
  IF p_recipient = '' OR length(p_recipient) > 2048 THEN
    RAISE EXCEPTION 'outbox: recipient must be 1-2048 characters'
      USING ERRCODE = '22023', HINT = 'Pass the address the transport delivers to (a URL, an e-mail address, ...).';
  END IF;
  IF jsonb_typeof(p_payload) <> 'object' THEN
    RAISE EXCEPTION 'outbox: payload must be a JSON object, got %', jsonb_typeof(p_payload)
      USING ERRCODE = '22023', HINT = 'Wrap the value: jsonb_build_object(''data'', value).';
  END IF;
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'outbox: idempotency_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', HINT = 'Use a stable business key such as ''order-42-confirmation''.';
  END IF;
  IF p_max_attempts IS NOT NULL AND p_max_attempts NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'outbox: max_attempts must be between 1 and 1000, got %', p_max_attempts
      USING ERRCODE = '22023', HINT = 'Pass NULL to use the channel''s setting.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_check_message(text, text, jsonb, text, integer) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_check_message(text, text, jsonb, text, integer) IS
  'Private: validates one message''s arguments; raises 22004/22023 with a hint.';

CREATE OR REPLACE FUNCTION pgfence._outbox_require(p_id bigint)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'outbox: message id is required' USING ERRCODE = '22004';
  END IF;
  PERFORM 1 FROM pgfence.outbox WHERE id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'outbox: no message with id %', p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id; purged messages are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_require(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_require(bigint) IS
  'Private: raises P0002 when no message has this id (used on the lost-race path to tell a stale call from an unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Enqueue
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue(
  p_channel         text,
  p_recipient       text,
  p_payload         jsonb,
  p_idempotency_key text DEFAULT NULL,
  p_deliver_at      timestamptz DEFAULT NULL,
  p_max_attempts    integer DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_id        bigint;
  v_channel   text;
  v_recipient text;
  v_set       pgfence.outbox_channel;
BEGIN
  PERFORM pgfence._outbox_check_message(p_channel, p_recipient, p_payload, p_idempotency_key, p_max_attempts);
  IF p_deliver_at IS NOT NULL AND NOT isfinite(p_deliver_at) THEN
    RAISE EXCEPTION 'outbox: deliver_at must be a finite time, got %', p_deliver_at
      USING ERRCODE = '22023', HINT = 'Pass NULL to deliver now, or a real timestamp.';
  END IF;

  v_set := pgfence._outbox_settings(p_channel);
  INSERT INTO pgfence.outbox AS o (channel, recipient, payload, idempotency_key, max_attempts,
                                   next_attempt_at, log_events)
  VALUES (p_channel, p_recipient, p_payload, p_idempotency_key,
          coalesce(p_max_attempts, v_set.max_attempts), coalesce(p_deliver_at, now()),
          v_set.log_events)
  ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
  RETURNING o.id INTO v_id;

  IF v_id IS NULL THEN
    -- The key exists (committed, or committed by the transaction we just waited for).
    SELECT o.id, o.channel, o.recipient INTO v_id, v_channel, v_recipient
    FROM pgfence.outbox o WHERE o.idempotency_key = p_idempotency_key;
    IF v_id IS NULL THEN
      RAISE EXCEPTION 'outbox: idempotency key "%" is held by a transaction this snapshot cannot see', p_idempotency_key
        USING ERRCODE = '40001', HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
    END IF;
    IF v_channel <> p_channel OR v_recipient <> p_recipient THEN
      RAISE EXCEPTION 'outbox: idempotency key "%" already names message % for %/%', p_idempotency_key, v_id, v_channel, v_recipient
        USING ERRCODE = 'PF003',
              DETAIL = format('This call asked for channel %s, recipient %s.', p_channel, p_recipient),
              HINT = 'Idempotency keys identify one message; use a different key for a different destination.';
    END IF;
    RETURN v_id;
  END IF;

  IF p_deliver_at IS NULL OR p_deliver_at <= now() THEN
    PERFORM pg_notify('pgfence_outbox', json_build_object('channel', p_channel, 'id', v_id)::text);
  END IF;
  RETURN v_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer)
  TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer) IS
  'Enqueue one message; call it inside your own business transaction so the message exists iff your change commits. Returns the message id. A repeated idempotency key (also from a concurrent transaction) returns the existing id and inserts nothing; the first call''s payload wins. deliver_at delays the first attempt; max_attempts NULL = the channel''s setting. At commit a NOTIFY pgfence_outbox carries {"channel","id"} only, never the payload. Errors: 22004 (missing argument), 22023 (bad channel/recipient/payload/key/max_attempts), PF003 (key already used for another channel or recipient), 40001 (key held by a transaction invisible to a REPEATABLE READ snapshot: retry).';

CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue_many(
  p_channel          text,
  p_recipients       text[],
  p_payloads         jsonb[],
  p_idempotency_keys text[] DEFAULT NULL,
  p_deliver_at       timestamptz DEFAULT NULL,
  p_max_attempts     integer DEFAULT NULL
)
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off  -- row estimates of array joins are inflated; JIT compilation would cost ~0.2 s
AS $$
DECLARE
  v_n        integer := coalesce(cardinality(p_recipients), 0);
  v_max      integer;
  v_bad      record;
  v_seq      regclass;
  v_set      pgfence.outbox_channel;
  v_ids      bigint[];
  v_unseen   bigint;
  v_clash    bigint;
BEGIN
  IF p_channel IS NULL OR p_recipients IS NULL OR p_payloads IS NULL THEN
    RAISE EXCEPTION 'outbox_enqueue_many: channel, recipients and payloads are required'
      USING ERRCODE = '22004';
  END IF;
  IF cardinality(p_payloads) <> v_n
     OR (p_idempotency_keys IS NOT NULL AND cardinality(p_idempotency_keys) <> v_n) THEN
    RAISE EXCEPTION 'outbox_enqueue_many: recipients, payloads and idempotency_keys must have the same length'
      USING ERRCODE = '22023', HINT = 'Pass one element per message in each array (or NULL for no keys).';
  END IF;
  IF v_n = 0 THEN
    RETURN;
  END IF;
  PERFORM pgfence._outbox_check_message(p_channel, 'x', '{}'::jsonb, NULL, p_max_attempts);
  IF p_deliver_at IS NOT NULL AND NOT isfinite(p_deliver_at) THEN
    RAISE EXCEPTION 'outbox_enqueue_many: deliver_at must be a finite time, got %', p_deliver_at
      USING ERRCODE = '22023', HINT = 'Pass NULL to deliver now, or a real timestamp.';
  END IF;
  SELECT i, r, p, k INTO v_bad
  FROM unnest(p_recipients, p_payloads, coalesce(p_idempotency_keys, array_fill(NULL::text, ARRAY[v_n])))
         WITH ORDINALITY AS u(r, p, k, i)
  WHERE r IS NULL OR r = '' OR length(r) > 2048
     OR p IS NULL OR jsonb_typeof(p) <> 'object'
     OR k = '' OR length(k) > 255
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'outbox_enqueue_many: message % is invalid (recipient 1-2048 chars, payload a JSON object, key 1-255 chars or NULL)', v_bad.i
      USING ERRCODE = '22023', HINT = 'Fix that element; nothing was enqueued.';
  END IF;
  v_set := pgfence._outbox_settings(p_channel);
  v_max := coalesce(p_max_attempts, v_set.max_attempts);
  IF p_idempotency_keys IS NULL THEN
    -- No keys: a plain INSERT (no conflict handling, no key to check); identity values follow
    -- the input order.
    RETURN QUERY
    WITH ins AS (
      INSERT INTO pgfence.outbox AS o (channel, recipient, payload, max_attempts, next_attempt_at, log_events)
      SELECT p_channel, u.r, u.p, v_max, coalesce(p_deliver_at, now()), v_set.log_events
      FROM unnest(p_recipients, p_payloads) WITH ORDINALITY AS u(r, p, i)
      ORDER BY u.i
      RETURNING o.id)
    SELECT ins.id FROM ins ORDER BY ins.id;
  ELSE
    -- With keys: a key must name one message (PF003), then ON CONFLICT on the key; a key
    -- repeated inside this call or already stored yields that message's id. Rows are inserted
    -- in key order (ids are drawn in input order first): each insert waits for a concurrent
    -- transaction holding its key, so two calls with the same keys in different orders took
    -- them in different orders and deadlocked (40P01); in one canonical order one of them
    -- simply waits for the other.
    v_seq := pg_get_serial_sequence('pgfence.outbox', 'id')::regclass;
    SELECT min(u.i) AS i, u.k INTO v_bad
    FROM unnest(p_recipients, p_idempotency_keys) WITH ORDINALITY AS u(r, k, i)
    WHERE u.k IS NOT NULL
    GROUP BY u.k HAVING count(DISTINCT u.r) > 1
    LIMIT 1;
    IF FOUND THEN
      RAISE EXCEPTION 'outbox_enqueue_many: idempotency key "%" is used for different recipients within this call', v_bad.k
        USING ERRCODE = 'PF003', HINT = 'Idempotency keys identify one message; nothing was enqueued.';
    END IF;
    SELECT u.i, o.id, o.channel, o.recipient INTO v_bad
    FROM unnest(p_recipients, p_idempotency_keys) WITH ORDINALITY AS u(r, k, i)
    JOIN pgfence.outbox o ON o.idempotency_key = u.k
    WHERE o.channel <> p_channel OR o.recipient <> u.r
    LIMIT 1;
    IF FOUND THEN
      RAISE EXCEPTION 'outbox_enqueue_many: the idempotency key of message % already names message % for %/%', v_bad.i, v_bad.id, v_bad.channel, v_bad.recipient
        USING ERRCODE = 'PF003', HINT = 'Idempotency keys identify one message; nothing was enqueued.';
    END IF;
    v_ids := ARRAY(SELECT nextval(v_seq) FROM generate_series(1, v_n));
    INSERT INTO pgfence.outbox AS o (id, channel, recipient, payload, idempotency_key, max_attempts,
                                     next_attempt_at, log_events)
    OVERRIDING SYSTEM VALUE
    SELECT v_ids[u.i], p_channel, u.r, u.p, u.k, v_max, coalesce(p_deliver_at, now()), v_set.log_events
    FROM unnest(p_recipients, p_payloads, p_idempotency_keys) WITH ORDINALITY AS u(r, p, k, i)
    ORDER BY u.k COLLATE "C", u.i
    ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING;
    -- The ids, in a statement of its own: its snapshot (READ COMMITTED) sees a key that a
    -- concurrent transaction committed while the insert waited for it, which the insert's own
    -- snapshot did not (its lookup answered NULL for such a key). A key repeated inside this
    -- call finds the row inserted for its first use.
    SELECT array_agg(coalesce(o.id, CASE WHEN u.k IS NULL THEN u.new_id END) ORDER BY u.i),
           min(u.i) FILTER (WHERE u.k IS NOT NULL AND o.id IS NULL),
           min(u.i) FILTER (WHERE o.channel <> p_channel OR o.recipient <> u.r)
      INTO v_ids, v_unseen, v_clash
    FROM unnest(p_recipients, p_idempotency_keys, v_ids) WITH ORDINALITY AS u(r, k, new_id, i)
    LEFT JOIN pgfence.outbox o ON o.idempotency_key = u.k;
    IF v_clash IS NOT NULL THEN
      RAISE EXCEPTION 'outbox_enqueue_many: the idempotency key of message % was just used by a concurrent transaction for another channel or recipient', v_clash
        USING ERRCODE = 'PF003', DETAIL = 'That transaction committed while this call waited for the key.',
              HINT = 'Idempotency keys identify one message; nothing was enqueued.';
    END IF;
    IF v_unseen IS NOT NULL THEN
      RAISE EXCEPTION 'outbox_enqueue_many: the idempotency key of message % is held by a transaction this snapshot cannot see', v_unseen
        USING ERRCODE = '40001', DETAIL = 'Nothing was enqueued.',
              HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
    END IF;
    RETURN QUERY SELECT u.id FROM unnest(v_ids) WITH ORDINALITY AS u(id, i) ORDER BY u.i;
  END IF;

  IF p_deliver_at IS NULL OR p_deliver_at <= now() THEN
    PERFORM pg_notify('pgfence_outbox', json_build_object('channel', p_channel, 'id', NULL, 'count', v_n)::text);
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer)
  TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer) IS
  'Bulk enqueue on one channel in one statement: element i of recipients, payloads and idempotency_keys is message i. Returns the ids in input order (a repeated key yields the existing id). Keys are taken in one canonical order, so concurrent calls with the same keys in any order wait for each other instead of deadlocking. One NOTIFY per call. Same validation as outbox_enqueue; an invalid element rejects the whole call (22023) so nothing is half-enqueued. Arrays of any shape are read element by element (unnest order). Errors: 22004 (channel, recipients or payloads NULL), 22023 (bad channel, element, max_attempts or deliver_at; arrays of different lengths), PF003 (a key already used for another channel or recipient, or for two recipients in this call), 40001 (a key held by a transaction invisible to a REPEATABLE READ snapshot: retry).';

-- ---------------------------------------------------------------------------------------------
-- Claim (executor)
-- ---------------------------------------------------------------------------------------------
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
      USING ERRCODE = '22023', HINT = 'Use something an operator can trace, e.g. host:pid.';
  END IF;
  -- bounded like a channel's lease (outbox_channel): now() + lease can never overflow (22008),
  -- and a crashed worker's claim is taken back within a day
  IF p_lease IS NOT NULL AND (p_lease <= interval '0' OR p_lease > interval '1 day') THEN
    RAISE EXCEPTION 'outbox: lease must be positive and at most 1 day, got %', p_lease
      USING ERRCODE = '22023', HINT = 'Pass NULL for the channel''s lease, or e.g. interval ''5 minutes''.';
  END IF;
  IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'outbox_claim: batch must be between 1 and 10000, got %', p_batch
      USING ERRCODE = '22023', HINT = 'Claim at most as many messages as you can deliver within one lease.';
  END IF;
  -- A channel array of any shape means its elements: '[0:0]={c}' or '{{c}}' is channel c (the
  -- one-channel path below reads p_channels[1], which is NULL for those).
  IF array_ndims(p_channels) > 1 OR array_lower(p_channels, 1) <> 1 THEN
    p_channels := ARRAY(SELECT u.ch FROM unnest(p_channels) AS u(ch));
  END IF;
  -- One statement: the ARRAY(...) sub-select locks the due rows, the UPDATE claims them by
  -- primary key (an id array keeps even a generic plan on the index). Each shape walks an index
  -- in due order and stops after p_batch rows: all channels -> outbox_due_idx; some channels ->
  -- outbox_channel_due_idx once per channel (at most p_batch locked per channel; the earliest
  -- p_batch are claimed, the others are released when this transaction ends a moment later).
  -- The per-channel walks cannot use outbox_due_idx (its predicate, see migration 0007), so a
  -- backlog on another channel is never read.
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
              -- attempts < max_attempts holds for every pending message; stating it lets this
              -- walk use outbox_due_idx, whose predicate includes it (migration 0007)
              WHERE d.status = 'pending' AND d.attempts < d.max_attempts AND d.next_attempt_at <= now()
              ORDER BY d.next_attempt_at, d.id
              LIMIT p_batch
              FOR UPDATE SKIP LOCKED))
        AND o.status = c_pending  -- a parameter: see the header, Plans
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
        AND o.status = c_pending  -- a parameter: see the header, Plans
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
        AND o.status = c_pending  -- a parameter: see the header, Plans
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
  'Claim up to p_batch due messages (oldest due time first, then id) with FOR UPDATE SKIP LOCKED, so concurrent claimers never get the same row. Each claim bumps attempts and returns it as attempt: the fence token for outbox_mark_sent / outbox_mark_failed. The lease runs from now() (database clock) for p_lease, or the channel''s lease when NULL. p_channels NULL = all channels; an array of any shape (lower bound, dimensions) means its elements. Errors: 22023 (empty worker, batch outside 1..10000, lease not in (0, 1 day]).';

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
    WHERE o.status = 'pending' AND o.attempts < o.max_attempts  -- outbox_due_idx (migration 0007)
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
  'How long until the earliest pending message is due, by the database clock (0 if one is due now, NULL if none is pending). Executors sleep min(this, poll interval) so delayed and backed-off messages go out on time without a NOTIFY. Errors: none.';

-- ---------------------------------------------------------------------------------------------
-- Report an outcome (executor), fenced on attempt
-- ---------------------------------------------------------------------------------------------
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
  c_processing CONSTANT text := 'processing';  -- a parameter: see the header, Plans
BEGIN
  IF p_attempt IS NULL THEN
    RAISE EXCEPTION 'outbox_mark_sent: attempt (the fence token from outbox_claim) is required'
      USING ERRCODE = '22004';
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
  'Record a successful delivery: processing -> sent, only if the message is still processing under this attempt (the fence). Returns true if this call made the transition, false if the claim is stale (another attempt owns it, or it is already finished): a lost race, nothing changed. A lapsed lease that nobody reclaimed yet is still accepted, since the delivery did happen. Errors: 22004 (attempt NULL), P0002 (unknown id).';

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
DECLARE
  v_missing bigint;
  v_rows    bigint;
  c_processing CONSTANT text := 'processing';  -- a parameter: see the header, Plans
BEGIN
  IF p_ids IS NULL OR p_attempts IS NULL THEN
    RAISE EXCEPTION 'outbox_mark_sent_many: ids and attempts are required' USING ERRCODE = '22004';
  END IF;
  IF cardinality(p_ids) <> cardinality(p_attempts)
     OR (p_receipts IS NOT NULL AND cardinality(p_receipts) <> cardinality(p_ids)) THEN
    RAISE EXCEPTION 'outbox_mark_sent_many: ids, attempts and receipts must have the same length'
      USING ERRCODE = '22023';
  END IF;
  -- Lock the rows in id order first: the UPDATE below locks them in the order its join
  -- produces, the input order, so two calls over the same (id, attempt) pairs in different
  -- orders deadlocked (40P01); in id order one of them waits for the other, then finds its
  -- claims stale (a lost race). No SKIP LOCKED: a concurrent mark is waited for, not skipped.
  PERFORM 1 FROM pgfence.outbox o WHERE o.id = ANY (p_ids) ORDER BY o.id FOR UPDATE;
  RETURN QUERY
  UPDATE pgfence.outbox o
  SET status = 'sent', receipt = u.receipt, finished_at = now(), last_error = NULL,
      locked_by = NULL, lease_expires_at = NULL, updated_at = now()
  FROM unnest(p_ids, p_attempts, coalesce(p_receipts, array_fill(NULL::jsonb, ARRAY[cardinality(p_ids)])))
         AS u(id, attempt, receipt)
  WHERE o.id = u.id AND o.attempts = u.attempt AND o.status = c_processing
  RETURNING o.id;
  GET DIAGNOSTICS v_rows = ROW_COUNT;
  IF v_rows < cardinality(p_ids) THEN
    SELECT u.id INTO v_missing FROM unnest(p_ids) AS u(id)
    WHERE NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = u.id) LIMIT 1;
    IF v_missing IS NOT NULL THEN
      RAISE EXCEPTION 'outbox_mark_sent_many: no message with id %', v_missing
        USING ERRCODE = 'P0002', HINT = 'Nothing was marked; check the ids.';
    END IF;
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) IS
  'outbox_mark_sent for many messages in one statement: element i of ids/attempts/receipts is one (id, fence, receipt). Every row is fenced exactly as in outbox_mark_sent. Returns the ids that this call moved to sent; the others were stale claims (lost races). Rows are locked in id order, so concurrent calls over the same pairs in any order wait for each other instead of deadlocking. Errors: 22004 (ids or attempts NULL), 22023 (arrays of different lengths), P0002 (an unknown id; then nothing is marked).';

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
  'For a worker that handles one message at a time: outbox_mark_sent(p_id, p_attempt, p_receipt) and then outbox_claim(p_worker, p_batch, p_channels, p_lease) in one transaction, so a message costs one round trip and one commit instead of two. The mark is fenced and the claim locks with SKIP LOCKED exactly as in those functions. Returns the claimed messages (same columns as outbox_claim) with previous_sent = the mark''s outcome (true: this call moved p_id to sent; false: a stale claim, a lost race, nothing changed). When nothing is due it returns one row whose id and other claim columns are NULL, carrying only previous_sent. Errors: those of outbox_mark_sent (22004, P0002: then nothing is claimed) and of outbox_claim (22023: then nothing is marked either; the whole call rolls back).';

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
  c_processing CONSTANT text := 'processing';  -- a parameter: see the header, Plans
BEGIN
  IF p_attempt IS NULL OR p_error IS NULL OR p_retryable IS NULL THEN
    RAISE EXCEPTION 'outbox_mark_failed: attempt, error and retryable are required' USING ERRCODE = '22004';
  END IF;
  IF p_retry_after IS NOT NULL AND p_retry_after < interval '0' THEN
    RAISE EXCEPTION 'outbox_mark_failed: retry_after must not be negative, got %', p_retry_after
      USING ERRCODE = '22023';
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
  'Record a failed delivery under the claim''s attempt (the fence). Retryable: back to pending, due after the channel''s capped, jittered exponential backoff (or retry_after, e.g. an HTTP Retry-After, if longer; never beyond the cap), or dead when no attempts remain. Not retryable: failed. Returns the new status, or NULL when the claim is stale (lost race: nothing changed). Errors: 22004 (missing argument), 22023 (negative retry_after), P0002 (unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Reaper
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.outbox_reclaim_stale(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_ids   bigint[];
  v_count integer;
  c_processing CONSTANT text := 'processing';  -- a parameter: see the header, Plans
BEGIN
  IF p_max_rows IS NULL OR p_max_rows < 1 THEN
    RAISE EXCEPTION 'outbox_reclaim_stale: max_rows must be positive, got %', p_max_rows
      USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor('reaper');
  -- SKIP LOCKED: a row being marked right now is left alone. FOR UPDATE re-reads a row that was
  -- committed after our snapshot and drops it unless it is still processing and lapsed; the
  -- UPDATE below checks both again under the lock.
  SELECT array_agg(s.id) INTO v_ids
  FROM (
    SELECT o.id FROM pgfence.outbox o
    WHERE o.status = 'processing' AND o.lease_expires_at < now()
    ORDER BY o.lease_expires_at
    LIMIT p_max_rows
    FOR UPDATE SKIP LOCKED
  ) s;
  IF v_ids IS NULL THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN 0;
  END IF;
  -- The lapse receipt (pgfence.outbox_lapse, migration 0006): the rows are locked by us, so
  -- this sees exactly the rows the UPDATE below takes back.
  INSERT INTO pgfence.outbox_lapse (message_id, attempt, worker, claimed_at, lease_expires_at, outcome)
  SELECT o.id, o.attempts, o.locked_by, o.claimed_at, o.lease_expires_at,
         CASE WHEN o.attempts >= o.max_attempts THEN 'dead' ELSE 'pending' END
  FROM pgfence.outbox o
  WHERE o.id = ANY (v_ids) AND o.status = c_processing AND o.lease_expires_at < now()
  ON CONFLICT (message_id, attempt) DO NOTHING;
  UPDATE pgfence.outbox o
  SET status = CASE WHEN o.attempts >= o.max_attempts THEN 'dead' ELSE 'pending' END,
      next_attempt_at = CASE WHEN o.attempts >= o.max_attempts THEN o.next_attempt_at
        ELSE now() + (SELECT pgfence.backoff(o.attempts, st.backoff_base, st.backoff_cap)
                      FROM pgfence._outbox_settings(o.channel) st) END,
      finished_at = CASE WHEN o.attempts >= o.max_attempts THEN now() END,
      last_error = format('lease expired: worker %s did not finish attempt %s by %s',
                          o.locked_by, o.attempts, o.lease_expires_at),
      locked_by = NULL, lease_expires_at = NULL, updated_at = now()
  WHERE o.id = ANY (v_ids) AND o.status = c_processing AND o.lease_expires_at < now();
  GET DIAGNOSTICS v_count = ROW_COUNT;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_reclaim_stale(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_reclaim_stale(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_reclaim_stale(integer) IS
  'Reaper: messages whose lease lapsed by the database clock go back to pending after a backoff (counted as a failed attempt), or to dead when no attempts remain; each one leaves a lapse receipt in pgfence.outbox_lapse (a possible duplicate delivery, listed by pgfence.audit_duplicates). Takes at most max_rows; skips rows locked by a concurrent mark and never touches a row finished between its read and its write. Returns how many it reclaimed. Run by executors on a timer; safe for a DBA to call. Errors: 22023 (max_rows < 1).';

-- ---------------------------------------------------------------------------------------------
-- Operator functions
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.outbox_requeue(p_id bigint, p_extra_attempts integer DEFAULT NULL)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_extra_attempts IS NOT NULL AND p_extra_attempts NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'outbox_requeue: extra_attempts must be between 1 and 1000, got %', p_extra_attempts
      USING ERRCODE = '22023';
  END IF;
  UPDATE pgfence.outbox o
  SET status = 'pending',
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
  'Operator: retry a failed or dead message now, granting extra_attempts more attempts (default: the channel''s max_attempts); a pending message is made due now (and gets extra_attempts more, if given). attempts keeps counting, so fence tokens are never reused. Returns false for a message that is processing or sent (a sent message never changes again). Errors: 22004 (id NULL), 22023 (extra_attempts outside 1..1000), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence.outbox_configure_channel(
  p_channel      text,
  p_max_attempts integer DEFAULT NULL,
  p_backoff_base interval DEFAULT NULL,
  p_backoff_cap  interval DEFAULT NULL,
  p_lease        interval DEFAULT NULL,
  p_log_events   boolean DEFAULT NULL
)
RETURNS pgfence.outbox_channel
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_cur pgfence.outbox_channel;
  v_row pgfence.outbox_channel;
BEGIN
  IF p_channel IS NULL OR (p_channel <> '*' AND p_channel !~ '^[a-z0-9][a-z0-9_.-]{0,62}$') THEN
    RAISE EXCEPTION 'outbox_configure_channel: invalid channel name "%"', p_channel
      USING ERRCODE = '22023', HINT = 'Use a channel name, or ''*'' for the defaults.';
  END IF;
  v_cur := pgfence._outbox_settings(p_channel);
  BEGIN
    INSERT INTO pgfence.outbox_channel AS c (channel, max_attempts, backoff_base, backoff_cap, lease, log_events)
    VALUES (p_channel,
            coalesce(p_max_attempts, v_cur.max_attempts),
            coalesce(p_backoff_base, v_cur.backoff_base),
            coalesce(p_backoff_cap, v_cur.backoff_cap),
            coalesce(p_lease, v_cur.lease),
            coalesce(p_log_events, v_cur.log_events))
    ON CONFLICT (channel) DO UPDATE
      SET max_attempts = EXCLUDED.max_attempts, backoff_base = EXCLUDED.backoff_base,
          backoff_cap = EXCLUDED.backoff_cap, lease = EXCLUDED.lease,
          log_events = EXCLUDED.log_events, updated_at = now()
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
      USING ERRCODE = '22023',
            HINT = 'Need 1 <= max_attempts <= 1000, 0 < backoff_base <= backoff_cap <= 30 days, 0 < lease <= 1 day.';
  END;
  RETURN v_row;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean) IS
  'Operator: set a channel''s retry settings and whether its transitions go to the event log (NULL keeps the current value, inherited from ''*'' for a new channel). Applies to claims and failures from now on; max_attempts applies to messages enqueued from now on. Returns the stored row. Errors: 22023 (bad name or settings).';

CREATE OR REPLACE FUNCTION pgfence.outbox_get(p_id bigint)
RETURNS TABLE (
  id bigint, channel text, recipient text, payload jsonb, idempotency_key text, status text,
  attempts integer, max_attempts integer, next_attempt_at timestamptz, locked_by text,
  claimed_at timestamptz, lease_expires_at timestamptz, last_error text, receipt jsonb,
  created_at timestamptz, updated_at timestamptz, finished_at timestamptz
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
         o.last_error, o.receipt, o.created_at, o.updated_at, o.finished_at
  FROM pgfence.outbox o WHERE o.id = p_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.outbox_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_get(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_get(bigint) IS
  'One message with its delivery state (status, attempts, owner and lease, last error, receipt). Errors: 22004 (id NULL), P0002 (unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Views for operators (psql)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.outbox_summary AS
SELECT o.channel,
       o.status,
       count(*)                                                         AS messages,
       min(o.created_at)                                                AS oldest_created_at,
       CASE WHEN o.status = 'pending' THEN
         now() - min(o.next_attempt_at) FILTER (WHERE o.next_attempt_at <= now())
       END                                                              AS oldest_due_age,
       count(*) FILTER (WHERE o.status = 'pending' AND o.next_attempt_at > now()) AS deferred,
       count(*) FILTER (WHERE o.status = 'processing' AND o.lease_expires_at < now()) AS lapsed_leases,
       max(o.attempts)                                                  AS max_attempts_used
FROM pgfence.outbox o
GROUP BY o.channel, o.status;
REVOKE ALL ON pgfence.outbox_summary FROM PUBLIC;
GRANT SELECT ON pgfence.outbox_summary TO pgfence_admin;
COMMENT ON VIEW pgfence.outbox_summary IS
  'Operators: one row per channel and status: message count, oldest created, oldest_due_age (pending: how long the most overdue due message has waited), deferred (pending, not yet due: backoff or deliver_at), lapsed_leases (processing past its lease: the reaper will take them), highest attempts used.';

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
  'Operators: who holds outbox leases right now, per worker and channel, with the earliest expiry and how many already lapsed (database clock).';

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
  IF p_status IS NOT NULL AND p_status NOT IN ('pending', 'processing', 'sent', 'failed', 'dead') THEN
    RAISE EXCEPTION 'outbox_list: unknown status "%"', p_status
      USING ERRCODE = '22023', HINT = 'One of pending, processing, sent, failed, dead.';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'outbox_list: limit must be between 1 and 10000' USING ERRCODE = '22023';
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
  'Operators: the newest messages (highest id first), optionally of one channel and/or status, without payloads. Errors: 22023 (unknown status, limit outside 1..10000).';
