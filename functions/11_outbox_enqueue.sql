-- pgfence functions/11_outbox_enqueue.sql — outbox (module 1): the write path.
--
-- Public: outbox_enqueue(channel, recipient, payload, idempotency_key, deliver_at, max_attempts,
--                        ordering_key)
--         outbox_enqueue_many(channel, recipients[], payloads[], idempotency_keys[], ...,
--                             ordering_keys[])
-- Called by clients (pgfence_client) inside their own business transaction, so a message
-- exists exactly when the business change commits. A repeated idempotency key answers the
-- existing id (PF003 when it names another channel or recipient). A payload is at most the
-- channel's max_payload_bytes (PF004). A message with an ordering key is inserted waiting; its
-- key's turn is decided at commit (16_outbox_keys.sql). At commit, NOTIFY
-- pgfence_outbox wakes the executors; it carries the channel and id only, never the payload.
-- Validation: _outbox_check_message (10_outbox_guards.sql). Errors: functions/ERRORS.md.
-- Plans: the SET clauses pin one generic plan with index access (docs/query-plans.md#outbox).

CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue(
  p_channel         text,
  p_recipient       text,
  p_payload         jsonb,
  p_idempotency_key text DEFAULT NULL,
  p_deliver_at      timestamptz DEFAULT NULL,
  p_max_attempts    integer DEFAULT NULL,
  p_ordering_key    text DEFAULT NULL
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
  v_key       text := p_ordering_key;
  v_at        timestamptz;  -- the due time: pgfence._outbox_pending_at
BEGIN
  PERFORM pgfence._outbox_check_message(p_channel, p_recipient, p_payload, p_idempotency_key, p_max_attempts);
  IF p_deliver_at IS NOT NULL AND NOT isfinite(p_deliver_at) THEN
    RAISE EXCEPTION 'outbox: deliver_at must be a finite time, got %', p_deliver_at
      USING ERRCODE = '22023', DETAIL = 'A message due at infinity would never be sent; nothing was enqueued.',
            HINT = 'Pass NULL to deliver now, or a real timestamp.';
  END IF;

  IF p_ordering_key IS NOT NULL AND (p_ordering_key = '' OR length(p_ordering_key) > 255) THEN
    RAISE EXCEPTION 'outbox: ordering_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', DETAIL = format('The key has %s characters; nothing was enqueued.', length(p_ordering_key)),
            HINT = 'Use the id of the aggregate whose events must stay in order, e.g. ''order-42''.';
  END IF;

  v_set := pgfence._outbox_settings(p_channel);
  IF pg_column_size(p_payload) > v_set.max_payload_bytes THEN
    PERFORM pgfence._outbox_payload_too_large(p_channel, 1, pg_column_size(p_payload), v_set.max_payload_bytes);
  END IF;
  IF v_key IS NULL AND v_set.limit_key = 'host' THEN
    v_key := pgfence._outbox_host_key(p_recipient);  -- limited per recipient host
  END IF;
  IF v_key IS NOT NULL THEN
    PERFORM pgfence._outbox_keys_note(p_channel, ARRAY[v_key]);  -- decided at commit
  END IF;
  v_at := pgfence._outbox_pending_at(p_deliver_at);  -- a past deliver_at is due now
  INSERT INTO pgfence.outbox AS o (channel, recipient, payload, idempotency_key, max_attempts,
                                   next_attempt_at, log_events, ordering_key, status)
  VALUES (p_channel, p_recipient, p_payload, p_idempotency_key,
          coalesce(p_max_attempts, v_set.max_attempts), v_at,
          v_set.log_events, v_key, CASE WHEN v_key IS NULL THEN 'pending' ELSE 'waiting' END)
  ON CONFLICT (idempotency_key) WHERE idempotency_key IS NOT NULL DO NOTHING
  RETURNING o.id INTO v_id;

  IF v_id IS NULL THEN
    -- The key exists (committed, or committed by the transaction we just waited for).
    SELECT o.id, o.channel, o.recipient INTO v_id, v_channel, v_recipient
    FROM pgfence.outbox o WHERE o.idempotency_key = p_idempotency_key;
    IF v_id IS NULL THEN
      RAISE EXCEPTION 'outbox: idempotency key "%" is held by a transaction this snapshot cannot see', p_idempotency_key
        USING ERRCODE = '40001',
              DETAIL = 'Another transaction stored this key after this snapshot was taken; nothing was enqueued.',
              HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
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
REVOKE ALL ON FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer, text)
  TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer, text) IS
  'Enqueue one message in the caller''s transaction; returns its id.
Call it inside your own business transaction, so the message exists iff your change commits. A
repeated idempotency key (also from a concurrent transaction) returns the existing id and
inserts nothing; the first call''s payload wins. deliver_at delays the first attempt;
max_attempts NULL = the channel''s setting. ordering_key: messages of one channel and key are
claimed in enqueue order, at most the channel''s key_max_in_flight at once (1: one after the
other; a retry holds the key); such a message is waiting until its turn, decided at commit.
At commit a NOTIFY pgfence_outbox carries {"channel","id"} only, never the payload.
Errors: 22004 (missing argument), 22023 (bad channel/recipient/payload/key/max_attempts/deliver_at/
ordering_key), PF003 (key already used for another channel or recipient), PF004 (payload larger
than the channel''s max_payload_bytes), 40001 (key held by a transaction invisible to a
REPEATABLE READ snapshot: retry; or a concurrent decision on the ordering key).';

CREATE OR REPLACE FUNCTION pgfence.outbox_enqueue_many(
  p_channel          text,
  p_recipients       text[],
  p_payloads         jsonb[],
  p_idempotency_keys text[] DEFAULT NULL,
  p_deliver_at       timestamptz DEFAULT NULL,
  p_max_attempts     integer DEFAULT NULL,
  p_ordering_keys    text[] DEFAULT NULL
)
RETURNS SETOF bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET jit = off  -- docs/query-plans.md#outbox
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
  v_okeys    text[];   -- the ordering keys, with the derived host keys (limit_key host)
  v_at       timestamptz;  -- the due time: pgfence._outbox_pending_at
BEGIN
  IF p_channel IS NULL OR p_recipients IS NULL OR p_payloads IS NULL THEN
    RAISE EXCEPTION 'outbox_enqueue_many: channel, recipients and payloads are required'
      USING ERRCODE = '22004', DETAIL = 'A NULL array names no messages; nothing was enqueued.',
            HINT = 'Pass the channel and one array element per message (an empty array enqueues nothing).';
  END IF;
  IF cardinality(p_payloads) <> v_n
     OR (p_idempotency_keys IS NOT NULL AND cardinality(p_idempotency_keys) <> v_n)
     OR (p_ordering_keys IS NOT NULL AND cardinality(p_ordering_keys) <> v_n) THEN
    RAISE EXCEPTION 'outbox_enqueue_many: recipients, payloads, idempotency_keys and ordering_keys must have the same length'
      USING ERRCODE = '22023',
            DETAIL = format('Elements: %s recipients, %s payloads, %s idempotency_keys, %s ordering_keys; nothing was enqueued.',
                            v_n, cardinality(p_payloads), coalesce(cardinality(p_idempotency_keys)::text, 'no'),
                            coalesce(cardinality(p_ordering_keys)::text, 'no')),
            HINT = 'Pass one element per message in each array (or NULL for no keys).';
  END IF;
  IF v_n = 0 THEN
    RETURN;
  END IF;
  PERFORM pgfence._outbox_check_message(p_channel, 'x', '{}'::jsonb, NULL, p_max_attempts);
  IF p_deliver_at IS NOT NULL AND NOT isfinite(p_deliver_at) THEN
    RAISE EXCEPTION 'outbox_enqueue_many: deliver_at must be a finite time, got %', p_deliver_at
      USING ERRCODE = '22023', DETAIL = 'Messages due at infinity would never be sent; nothing was enqueued.',
            HINT = 'Pass NULL to deliver now, or a real timestamp.';
  END IF;
  SELECT i, r, p, k INTO v_bad
  FROM unnest(p_recipients, p_payloads, coalesce(p_idempotency_keys, array_fill(NULL::text, ARRAY[v_n])),
              coalesce(p_ordering_keys, array_fill(NULL::text, ARRAY[v_n])))
         WITH ORDINALITY AS u(r, p, k, ok, i)
  WHERE r IS NULL OR r = '' OR length(r) > 2048
     OR p IS NULL OR jsonb_typeof(p) <> 'object'
     OR k = '' OR length(k) > 255 OR ok = '' OR length(ok) > 255
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'outbox_enqueue_many: message % is invalid (recipient 1-2048 chars, payload a JSON object, keys 1-255 chars or NULL)', v_bad.i
      USING ERRCODE = '22023', DETAIL = 'Elements are numbered from 1, in unnest order; nothing was enqueued.',
            HINT = 'Fix that element; nothing was enqueued.';
  END IF;
  v_set := pgfence._outbox_settings(p_channel);
  v_max := coalesce(p_max_attempts, v_set.max_attempts);
  SELECT u.i::integer AS i, pg_column_size(u.p) AS size INTO v_bad
  FROM unnest(p_payloads) WITH ORDINALITY AS u(p, i)
  WHERE pg_column_size(u.p) > v_set.max_payload_bytes
  LIMIT 1;
  IF FOUND THEN
    PERFORM pgfence._outbox_payload_too_large(p_channel, v_bad.i, v_bad.size, v_set.max_payload_bytes);
  END IF;
  IF v_set.limit_key = 'host' THEN
    -- limited per recipient host: a message without an ordering key gets its host's key
    v_okeys := ARRAY(SELECT coalesce(u.ok, pgfence._outbox_host_key(u.r))
                     FROM unnest(coalesce(p_ordering_keys, array_fill(NULL::text, ARRAY[v_n])), p_recipients)
                            WITH ORDINALITY AS u(ok, r, i)
                     ORDER BY u.i);
  ELSE
    v_okeys := p_ordering_keys;
  END IF;
  IF v_okeys IS NOT NULL THEN
    PERFORM pgfence._outbox_keys_note(p_channel, v_okeys);  -- decided at commit
  END IF;
  v_at := pgfence._outbox_pending_at(p_deliver_at);  -- a past deliver_at is due now
  IF p_idempotency_keys IS NULL THEN
    -- No keys: a plain INSERT (no conflict handling, no key to check); identity values follow
    -- the input order.
    RETURN QUERY
    WITH ins AS (
      INSERT INTO pgfence.outbox AS o (channel, recipient, payload, max_attempts, next_attempt_at, log_events,
                                       ordering_key, status)
      SELECT p_channel, u.r, u.p, v_max, v_at, v_set.log_events,
             u.ok, CASE WHEN u.ok IS NULL THEN 'pending' ELSE 'waiting' END
      FROM unnest(p_recipients, p_payloads, coalesce(v_okeys, array_fill(NULL::text, ARRAY[v_n])))
             WITH ORDINALITY AS u(r, p, ok, i)
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
        USING ERRCODE = 'PF003', DETAIL = format('Message %s is the first to use it.', v_bad.i),
              HINT = 'Idempotency keys identify one message; nothing was enqueued.';
    END IF;
    SELECT u.i, o.id, o.channel, o.recipient, u.r AS asked INTO v_bad
    FROM unnest(p_recipients, p_idempotency_keys) WITH ORDINALITY AS u(r, k, i)
    JOIN pgfence.outbox o ON o.idempotency_key = u.k
    WHERE o.channel <> p_channel OR o.recipient <> u.r
    LIMIT 1;
    IF FOUND THEN
      RAISE EXCEPTION 'outbox_enqueue_many: the idempotency key of message % already names message % for %/%', v_bad.i, v_bad.id, v_bad.channel, v_bad.recipient
        USING ERRCODE = 'PF003', DETAIL = format('This call asked for channel %s, recipient %s.', p_channel, v_bad.asked),
              HINT = 'Idempotency keys identify one message; nothing was enqueued.';
    END IF;
    v_ids := ARRAY(SELECT nextval(v_seq) FROM generate_series(1, v_n));
    INSERT INTO pgfence.outbox AS o (id, channel, recipient, payload, idempotency_key, max_attempts,
                                     next_attempt_at, log_events, ordering_key, status)
    OVERRIDING SYSTEM VALUE
    SELECT v_ids[u.i], p_channel, u.r, u.p, u.k, v_max, v_at, v_set.log_events,
           u.ok, CASE WHEN u.ok IS NULL THEN 'pending' ELSE 'waiting' END
    FROM unnest(p_recipients, p_payloads, p_idempotency_keys,
                coalesce(v_okeys, array_fill(NULL::text, ARRAY[v_n]))) WITH ORDINALITY AS u(r, p, k, ok, i)
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
REVOKE ALL ON FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer, text[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer, text[])
  TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer, text[]) IS
  'Enqueue many messages on one channel in one statement; returns their ids in input order.
Element i of recipients, payloads and idempotency_keys is message i (a repeated key yields the
existing id). Keys are taken in one canonical order, so concurrent calls with the same keys in
any order wait for each other instead of deadlocking. One NOTIFY per call. Same validation as
outbox_enqueue; an invalid element rejects the whole call (22023), so nothing is half-enqueued.
Element i of ordering_keys (NULL: none) is message i''s ordering key, as in outbox_enqueue.
Arrays of any shape are read element by element (unnest order).
Errors: 22004 (channel, recipients or payloads NULL), 22023 (bad channel, element, max_attempts
or deliver_at; arrays of different lengths), PF003 (a key already used for another channel or
recipient, or for two recipients in this call), PF004 (a payload larger than the channel''s
max_payload_bytes), 40001 (a key held by a transaction invisible to a REPEATABLE READ snapshot:
retry; or a concurrent decision on an ordering key).';

