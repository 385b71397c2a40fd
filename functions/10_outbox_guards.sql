-- pgfence functions/10_outbox_guards.sql — outbox (module 1): the table's guards and private helpers.
--
-- A message is enqueued inside the caller's business transaction and delivered at least once
-- by an executor. Status machine, enforced by tg_outbox_guard even against hand-written SQL:
--
--   pending --claim--> processing --mark_sent--> sent                     (terminal)
--                                 --mark_failed(permanent)--> failed      (terminal until requeue)
--                                 --mark_failed / lease lapsed--> pending (retry, with backoff)
--                                                          or --> dead    (no attempts left)
--   failed | dead --outbox_requeue--> pending  (operator; grants more attempts)
--   waiting --its key's turn--> pending  (a message with an ordering_key: 16_outbox_keys.sql)
--   waiting --its key's turn, handed off--> processing  (outbox_settle_and_claim: a claim)
--   waiting | pending | failed | dead --outbox_cancel--> canceled          (terminal)
--
-- Fence token: the attempt. `attempts` is bumped by every claim and returned as `attempt`; an
-- owner's writes match `attempts = attempt AND status = 'processing'`, so a worker whose lease
-- was taken over (or whose message already finished) changes nothing: it gets false / NULL.
-- Time: every lease and due time is computed from now(), the database clock.
-- Files: 10 guards, 11 enqueue, 12 claim, 13 settle (mark), 14 reaper, 15 operator functions
-- and views, 16 ordering keys and per-key limits. No public function here. Errors: functions/ERRORS.md. Plans: docs/query-plans.md.

COMMENT ON TABLE pgfence.outbox IS
  'Transactional outbox: one row per message. Not an API: use the pgfence.outbox_* functions.
Status machine pending -> processing -> sent | failed | dead; a retry is pending again with
attempts > 0; a message with an ordering_key waits (waiting) until its key''s turn; outbox_cancel
makes one canceled. attempts is the fence token (the claim''s attempt).';
COMMENT ON TABLE pgfence.outbox_channel IS
  'Retry settings per outbox channel; the row ''*'' holds the defaults for channels without one.
Change them with pgfence.outbox_configure_channel().';
COMMENT ON TABLE pgfence.outbox_lapse IS
  'The outbox reaper''s receipts: one row per claim whose lease lapsed and was taken back.
Each row: the message, the attempt (fence token) that lost its lease, the worker that held it,
when it was claimed, when the lease ran out and when it was reclaimed (pgfence.outbox_reap), and
what the message became (pending for a retry, or dead). The worker may have delivered the
message before it died or stalled, so each row is a possible duplicate delivery. Written in the
reaper''s transaction, whatever the channel''s log_events setting. Not an API: read
pgfence.audit_duplicates and pgfence.audit_timeline().';

-- ---------------------------------------------------------------------------------------------
-- Status machine guard and event log
--
-- One PL/pgSQL row trigger checks the move and the row's invariants and, for messages whose
-- log_events flag is set, writes the event in the same statement (cheaper than a trigger WHEN
-- condition or CHECK constraints here: docs/query-plans.md#outbox).
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
    RAISE EXCEPTION 'outbox: a new message starts pending (waiting, with an ordering key), with 0 attempts, no owner and no lease'
      USING ERRCODE = 'PF001',
            DETAIL = format('This row: status %s, attempts %s, max_attempts %s, locked_by %s, lease_expires_at %s, finished_at %s.',
                            coalesce(NEW.status, 'NULL'), coalesce(NEW.attempts::text, 'NULL'),
                            coalesce(NEW.max_attempts::text, 'NULL'), coalesce(NEW.locked_by, 'NULL'),
                            coalesce(NEW.lease_expires_at::text, 'NULL'), coalesce(NEW.finished_at::text, 'NULL')),
            HINT = 'Use pgfence.outbox_enqueue().';
  END IF;

  -- The claim hint (12_outbox_claim.sql): a message made pending, or due earlier, is stamped
  -- no earlier than the clock after this transaction has its xid, so it lands above any hint a
  -- claim may have promoted since (docs/design.md#claim-hint). The same for every writer, even
  -- a hand-written UPDATE.
  IF NEW.status = 'pending' AND (OLD.status <> 'pending' OR NEW.next_attempt_at < OLD.next_attempt_at) THEN
    NEW.next_attempt_at := pgfence._outbox_pending_at(NEW.next_attempt_at);
  END IF;
  IF NEW.attempts < OLD.attempts THEN
    RAISE EXCEPTION 'outbox message %: attempts is a fence token and never decreases (% -> %)', OLD.id, OLD.attempts, NEW.attempts
      USING ERRCODE = 'PF002',
            DETAIL = 'A lower attempt would let a worker whose lease was taken over write again under its old token.',
            HINT = 'To retry a failed or dead message use pgfence.outbox_requeue(id), which grants more attempts.';
  END IF;
  IF NOT (
       (   (OLD.status = 'pending'    AND NEW.status = 'processing' AND NEW.attempts = OLD.attempts + 1)
        OR (OLD.status = 'pending'    AND NEW.status = 'pending'    AND NEW.attempts = OLD.attempts)
        OR (OLD.status = 'processing' AND NEW.status IN ('processing', 'pending', 'sent', 'failed', 'dead')
                                      AND NEW.attempts = OLD.attempts)
        OR (OLD.status IN ('failed', 'dead') AND NEW.status IN ('pending', 'waiting') AND NEW.attempts = OLD.attempts)
        -- ordering keys (16_outbox_keys.sql): a waiting message is promoted to pending
        OR (OLD.status = 'waiting'    AND NEW.status IN ('waiting', 'pending') AND NEW.attempts = OLD.attempts)
        -- the hand-off (outbox_settle_and_claim): a key's next message claimed as its turn comes
        OR (OLD.status = 'waiting'    AND NEW.status = 'processing' AND NEW.attempts = OLD.attempts + 1)
        -- outbox_cancel: a message that is not being delivered and not sent
        OR (OLD.status IN ('waiting', 'pending', 'failed', 'dead') AND NEW.status = 'canceled'
                                      AND NEW.attempts = OLD.attempts))
       AND NEW.attempts <= NEW.max_attempts
       AND (NEW.status NOT IN ('pending', 'waiting') OR NEW.attempts < NEW.max_attempts)
       AND (NEW.status <> 'waiting' OR NEW.ordering_key IS NOT NULL)
       AND (NEW.status = 'processing') = (NEW.locked_by IS NOT NULL AND NEW.lease_expires_at IS NOT NULL)
       AND (NEW.status IN ('sent', 'failed', 'dead', 'canceled')) = (NEW.finished_at IS NOT NULL)) THEN
    RAISE EXCEPTION 'illegal outbox transition for message %: % -> % (attempts % -> %)',
      OLD.id, OLD.status, NEW.status, OLD.attempts, NEW.attempts
      USING ERRCODE = 'PF001',
            DETAIL = 'Allowed: pending->processing (attempts+1), pending->pending, processing->processing|pending|sent|failed|dead, failed|dead->pending|waiting (requeue), waiting->waiting|pending (a keyed message''s turn), waiting->processing (attempts+1: a hand-off), waiting|pending|failed|dead->canceled (outbox_cancel); a sent or canceled message never changes again. Always: attempts <= max_attempts (< when pending or waiting: it must have an attempt left), waiting only with an ordering_key, owner and lease iff processing, finished_at iff sent|failed|dead|canceled.',
            HINT = 'Use the pgfence.outbox_* functions; they make only legal moves.';
  END IF;
  IF NEW.log_events THEN
    PERFORM pgfence._event('outbox', NEW.id,
      CASE WHEN OLD.status IN ('pending', 'waiting') AND NEW.status = 'processing' THEN 'claim'
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
  -- A keyed message's turn ends (16_outbox_keys.sql): the statement's key decision
  -- (outbox_keys_turns_ended) has work. Only a hint, read by that trigger's WHEN so that a
  -- statement ending no keyed turn pays nothing for it: set, it makes the trigger look at the
  -- statement's rows, which decide; a client who sets it can only cause such a look. ('ending',
  -- set by the hand-off before its UPDATE, is kept: it also asks the trigger to try forgetting
  -- the keys first.)
  IF NEW.ordering_key IS NOT NULL AND NEW.status IN ('sent', 'failed', 'dead', 'canceled', 'waiting')
     AND coalesce(current_setting('pgfence.outbox_keys_turns_ended', true), '') NOT IN ('on', 'ending') THEN
    PERFORM set_config('pgfence.outbox_keys_turns_ended', 'on', true);
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_guard() IS
  'Trigger: holds the outbox status machine and row invariants, and writes the message''s events.
BEFORE UPDATE row trigger on pgfence.outbox (and BEFORE INSERT, filtered by a WHEN condition):
refuses any move outside the status machine or breaking a row invariant (PF001) and any decrease
of the fence token (PF002), even from a hand-written statement. For messages with log_events it
writes the claim or transition event (actor, attempt, error, receipt) in the same statement (the
enqueue event: tg_outbox_enqueued).';

CREATE OR REPLACE TRIGGER outbox_guard
  BEFORE UPDATE ON pgfence.outbox
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_outbox_guard();
-- On INSERT the WHEN condition filters without calling PL/pgSQL: a bulk enqueue calls the
-- trigger only for a malformed row (docs/query-plans.md#outbox).
CREATE OR REPLACE TRIGGER outbox_insert_guard
  BEFORE INSERT ON pgfence.outbox
  FOR EACH ROW
  WHEN (NEW.status <> CASE WHEN NEW.ordering_key IS NULL THEN 'pending' ELSE 'waiting' END
        OR NEW.attempts <> 0 OR NEW.max_attempts < 1
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
  'Trigger: writes the enqueue event of a message whose channel logs events.
AFTER INSERT row trigger on pgfence.outbox (WHEN log_events). Only for rows really inserted: a
row skipped by ON CONFLICT DO NOTHING (a repeated idempotency key) gets none.';

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
  RAISE EXCEPTION 'outbox message % is immutable: channel, recipient, payload, idempotency_key, ordering_key and created_at are never updated', OLD.id
    USING ERRCODE = 'PF002',
          DETAIL = 'A message''s content is what was committed with the business change; only its delivery state changes.',
          HINT = 'Enqueue a new message instead.';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_frozen() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_frozen() IS
  'Trigger: refuses any write of a message''s content (PF002).
BEFORE UPDATE OF channel, recipient, payload, idempotency_key, ordering_key, created_at on
pgfence.outbox: a
statement that writes those columns is refused. A column trigger costs nothing for statements
that do not name them.';

CREATE OR REPLACE TRIGGER outbox_frozen
  BEFORE UPDATE OF channel, recipient, payload, idempotency_key, ordering_key, created_at ON pgfence.outbox
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_outbox_frozen();

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._outbox_pending_at(p_at timestamptz)
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pg_current_xact_id();  -- the xid first: the stamp below is taken after it exists
  RETURN greatest(coalesce(p_at, now()), clock_timestamp());
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_pending_at(timestamptz) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_pending_at(timestamptz) IS
  'The due time of a message made pending now: greatest(p_at or now(), the clock after the xid).
Assigns this transaction its xid first, then reads clock_timestamp(): a message a transaction
makes pending is never due below a claim hint promoted while that transaction was in flight
(docs/design.md#claim-hint). Used by the enqueue functions and tg_outbox_guard.';

CREATE OR REPLACE FUNCTION pgfence._outbox_settings(p_channel text)
RETURNS pgfence.outbox_channel
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
-- PL/pgSQL rather than SQL: docs/query-plans.md#outbox.
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
  'Private: the retry settings that apply to a channel (its own row, else the ''*'' defaults).
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_check_message(
  p_channel text, p_recipient text, p_payload jsonb, p_idempotency_key text, p_max_attempts integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_channel IS NULL OR p_recipient IS NULL OR p_payload IS NULL THEN
    RAISE EXCEPTION 'outbox: channel, recipient and payload are required'
      USING ERRCODE = '22004', DETAIL = 'A message needs all three; nothing was enqueued.',
            HINT = 'Pass a channel name, a recipient and a JSON object payload.';
  END IF;
  IF NOT pgfence._is_name(p_channel) THEN
    RAISE EXCEPTION 'outbox: invalid channel name "%"', p_channel
      USING ERRCODE = '22023', DETAIL = 'The channel name routes the message to a transport; nothing was enqueued.',
            HINT = 'Channel names are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit.';
  END IF;
  IF p_recipient = '' OR length(p_recipient) > 2048 THEN
    RAISE EXCEPTION 'outbox: recipient must be 1-2048 characters'
      USING ERRCODE = '22023', DETAIL = format('The recipient has %s characters; nothing was enqueued.', length(p_recipient)),
            HINT = 'Pass the address the transport delivers to (a URL, an e-mail address, ...).';
  END IF;
  IF jsonb_typeof(p_payload) <> 'object' THEN
    RAISE EXCEPTION 'outbox: payload must be a JSON object, got %', jsonb_typeof(p_payload)
      USING ERRCODE = '22023', DETAIL = 'Transports send the payload as a JSON object; nothing was enqueued.',
            HINT = 'Wrap the value: jsonb_build_object(''data'', value).';
  END IF;
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'outbox: idempotency_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', DETAIL = format('The key has %s characters; nothing was enqueued.', length(p_idempotency_key)),
            HINT = 'Use a stable business key such as ''order-42-confirmation''.';
  END IF;
  IF p_max_attempts IS NOT NULL AND p_max_attempts NOT BETWEEN 1 AND 1000 THEN
    RAISE EXCEPTION 'outbox: max_attempts must be between 1 and 1000, got %', p_max_attempts
      USING ERRCODE = '22023', DETAIL = 'A message is tried at least once and at most 1000 times; nothing was enqueued.',
            HINT = 'Pass NULL to use the channel''s setting.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_check_message(text, text, jsonb, text, integer) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_check_message(text, text, jsonb, text, integer) IS
  'Private: validates one message''s arguments (channel, recipient, payload, key, max_attempts).
Errors: 22004 (channel, recipient or payload NULL), 22023 (bad channel name, recipient, payload,
key or max_attempts).';

CREATE OR REPLACE FUNCTION pgfence._outbox_require(p_id bigint)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'outbox: message id is required'
      USING ERRCODE = '22004', DETAIL = 'A NULL id names no message.',
            HINT = 'Pass the id that outbox_enqueue or outbox_claim returned.';
  END IF;
  PERFORM 1 FROM pgfence.outbox WHERE id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'outbox: no message with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No message has this id: it never existed, or a purge deleted it.',
            HINT = 'Check the id; purged messages are gone.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_require(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_require(bigint) IS
  'Private: raises unless a message has this id; tells a stale call from an unknown id.
Used on the lost-race path of the fenced functions, after their UPDATE matched no row.
Errors: 22004 (id NULL), P0002 (unknown id).';


CREATE OR REPLACE FUNCTION pgfence._outbox_payload_too_large(
  p_channel text, p_message integer, p_bytes integer, p_max integer)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'outbox: the payload of message % is % bytes, over channel %''s max_payload_bytes %', p_message, p_bytes, p_channel, p_max
    USING ERRCODE = 'PF004',
          DETAIL = 'The size is that of the stored jsonb value (pg_column_size); nothing was enqueued.',
          HINT = 'Send a reference to the data instead of the data, or have an admin raise the bound: outbox_configure_channel(channel, p_max_payload_bytes => n).';
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_payload_too_large(text, integer, integer, integer) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_payload_too_large(text, integer, integer, integer) IS
  'Private: raises PF004 for a payload over its channel''s max_payload_bytes (message n of a call).
Errors: PF004 (always).';
