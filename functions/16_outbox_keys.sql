-- pgfence functions/16_outbox_keys.sql — outbox (module 1): ordering keys and per-key limits.
--
-- No public function: outbox_enqueue(..., ordering_key) and outbox_enqueue_many(...,
-- ordering_keys) give messages a key; outbox_configure_channel sets the key rules per channel
-- (key_max_in_flight, key_rate, key_burst, key_dead_policy); audit_stuck lists blocked keys.
-- The rule: of one (channel, ordering_key), only the oldest key_max_in_flight unfinished messages
-- (1 by default) are pending or processing, in enqueue (id) order; the others are 'waiting',
-- a status the claim walk never reads. So outbox_claim is not changed at all: a keyed message is
-- claimed like any other once it is its key's turn, keyless messages pay only the WHEN condition
-- of two triggers, and no busy key can starve another (at most key_max_in_flight of a key are in
-- the due index at once). A retry stays pending, so it holds its key's turn; a failed or dead
-- message holds it too ('block', the default) until an operator requeues or cancels it, or
-- releases it ('release').
-- The decision (_outbox_key_decide) runs at the commit of an enqueue (deferred trigger) and in
-- the transaction of every change that ends a turn (settle, reap, cancel, requeue), each time
-- under the row lock of the key in pgfence.outbox_key: decisions on one key are serialized and
-- each sees the previous one. A key's rate (GCRA token bucket on now()) sets the due time of
-- the messages it promotes. Errors: functions/ERRORS.md.

COMMENT ON TABLE pgfence.outbox_key IS
  'Ordering keys of the outbox with unfinished messages: the lock and the token bucket of each.
One row per (channel, ordering_key): its row lock orders the decisions of which of the key''s
messages may be claimed next; tat is the rate limit''s theoretical arrival time (GCRA, database
clock). Deleted when the key has nothing left to decide. Not an API.';

CREATE OR REPLACE FUNCTION pgfence._outbox_key_decide(p_channel text, p_key text)
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_set      pgfence.outbox_channel;
  v_tat      timestamptz;
  v_live     integer;
  v_waiting  boolean;
  v_at       timestamptz;
  v_step     interval;
  v_promoted integer := 0;
  r          record;
  c_waiting  CONSTANT text := 'waiting';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  v_set := pgfence._outbox_settings(p_channel);
  -- The key's lock: a concurrent decision waits here until it commits (READ COMMITTED: the
  -- statements below then see it). Under REPEATABLE READ a decision committed after this
  -- snapshot makes this statement fail with 40001 instead of deciding on stale rows.
  INSERT INTO pgfence.outbox_key AS k (channel, ordering_key)
  VALUES (p_channel, p_key)
  ON CONFLICT (channel, ordering_key) DO UPDATE SET decisions = k.decisions + 1, updated_at = now()
  RETURNING k.tat INTO v_tat;

  SELECT count(*) FILTER (WHERE o.status IN ('pending', 'processing')
                             OR (o.status IN ('failed', 'dead') AND v_set.key_dead_policy = 'block')),
         bool_or(o.status = c_waiting)
    INTO v_live, v_waiting
  FROM pgfence.outbox o
  WHERE o.channel = p_channel AND o.ordering_key = p_key
    AND o.status <> 'sent' AND o.status <> 'canceled';  -- matches outbox_key_idx

  IF NOT coalesce(v_waiting, false) THEN
    IF v_live = 0 AND (v_tat IS NULL OR v_tat <= now()) THEN
      -- Nothing left to order (a bucket still refilling is kept, so a new message cannot
      -- jump the rate).
      DELETE FROM pgfence.outbox_key k WHERE k.channel = p_channel AND k.ordering_key = p_key;
    END IF;
    RETURN 0;
  END IF;

  IF v_set.key_rate IS NOT NULL THEN
    v_step := make_interval(secs => 1.0 / v_set.key_rate);
  END IF;
  FOR r IN
    SELECT o.id, o.next_attempt_at FROM pgfence.outbox o
    WHERE o.channel = p_channel AND o.ordering_key = p_key
      AND o.status <> 'sent' AND o.status <> 'canceled' AND o.status = c_waiting
    ORDER BY o.id
    LIMIT greatest(v_set.key_max_in_flight - v_live, 0)
  LOOP
    v_at := r.next_attempt_at;
    IF v_step IS NOT NULL THEN
      -- GCRA: the message may go at the earliest when the bucket holds a token again.
      v_at := greatest(v_at, now(), v_tat - v_step * (v_set.key_burst - 1));
      v_tat := greatest(coalesce(v_tat, v_at), v_at) + v_step;
    END IF;
    UPDATE pgfence.outbox o SET status = 'pending', next_attempt_at = v_at, updated_at = now()
    WHERE o.id = r.id AND o.status = c_waiting;
    v_promoted := v_promoted + 1;
  END LOOP;
  IF v_step IS NOT NULL AND v_promoted > 0 THEN
    UPDATE pgfence.outbox_key k SET tat = v_tat
    WHERE k.channel = p_channel AND k.ordering_key = p_key;
  END IF;
  RETURN v_promoted;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_key_decide(text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_key_decide(text, text) IS
  'Private: promote a key''s next waiting messages to pending, if its turn and its limits allow.
Under the row lock of the key in pgfence.outbox_key: counts the key''s pending and processing
messages (and failed or dead ones when the channel''s key_dead_policy is block) and promotes the
oldest waiting ones (id order) up to key_max_in_flight, each due no earlier than the key''s rate
allows (GCRA on now(): key_rate per second, bursts of key_burst). Returns how many it promoted.
Errors: 40001 (REPEATABLE READ or SERIALIZABLE: a concurrent decision on the key; retry).';

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_key_turn()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._outbox_key_decide(NEW.channel, NEW.ordering_key);
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_key_turn() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_key_turn() IS
  'Trigger: decides the next turn of a keyed message''s ordering key (_outbox_key_decide).
Deferred AFTER INSERT constraint trigger (at the enqueue''s commit, when the message becomes
visible) and AFTER UPDATE OF status trigger (when a keyed message ends its turn: sent, failed,
dead, canceled, or requeued to waiting), both only for rows with an ordering_key.';

-- At the enqueue's commit: the decision must see the messages committed before it, and the key's
-- lock is then held only for the commit, not for the rest of the business transaction.
DROP TRIGGER IF EXISTS outbox_key_enqueued ON pgfence.outbox;
CREATE CONSTRAINT TRIGGER outbox_key_enqueued
  AFTER INSERT ON pgfence.outbox
  DEFERRABLE INITIALLY DEFERRED
  FOR EACH ROW
  WHEN (NEW.ordering_key IS NOT NULL)
  EXECUTE FUNCTION pgfence.tg_outbox_key_turn();
-- In the settling transaction, so that a claim in the same call (outbox_settle_and_claim) sees
-- the key's next message.
CREATE OR REPLACE TRIGGER outbox_key_turn_ended
  AFTER UPDATE OF status ON pgfence.outbox
  FOR EACH ROW
  WHEN (NEW.ordering_key IS NOT NULL AND OLD.status IS DISTINCT FROM NEW.status
        AND NEW.status IN ('sent', 'failed', 'dead', 'canceled', 'waiting'))
  EXECUTE FUNCTION pgfence.tg_outbox_key_turn();
