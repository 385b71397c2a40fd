-- pgfence functions/16_outbox_keys.sql — outbox (module 1): ordering keys and per-key limits.
--
-- No public function: outbox_enqueue(..., ordering_key) and outbox_enqueue_many(...,
-- ordering_keys) give messages a key; outbox_configure_channel sets the key rules per channel
-- (key_max_in_flight, key_rate, key_burst, key_dead_policy, limit_key); audit_stuck lists
-- blocked keys. A channel with limit_key 'host' gives a message enqueued without a key the key
-- 'host:<its recipient URL's host>' (_outbox_host_key): the limits then apply per host, and such
-- a derived key is never blocked by a failed or dead message (it limits, it does not order).
-- The rule: of one (channel, ordering_key), only the oldest key_max_in_flight unfinished messages
-- (1 by default) are pending or processing, in enqueue (id) order; the others are 'waiting',
-- a status the claim walk never reads. So outbox_claim is not changed at all: a keyed message is
-- claimed like any other once it is its key's turn, and no busy key can starve another (at most
-- key_max_in_flight of a key are in the due index at once). A retry stays pending, so it holds
-- its key's turn; a failed or dead message holds it too ('block', the default) until an operator
-- requeues or cancels it, or releases it ('release').
-- The decision (_outbox_keys_decide, set-based: one call for all the keys a statement touched)
-- runs at the commit of an enqueue (deferred trigger), at the end of every UPDATE statement that
-- ends turns (settle, reap, cancel, requeue: one decision per statement, not per row) and when a
-- message holding its key's turn is deleted, each time under the row locks of the keys in
-- pgfence.outbox_key, taken in one global order (channel, key, collation "C") so that two
-- decisions over overlapping keys wait for each other instead of deadlocking: decisions on one
-- key are serialized and each sees the previous one. A key's rate (GCRA token bucket on now())
-- sets the due time of the messages it promotes. A statement that ends no keyed turn does not
-- call the decision's trigger (its WHEN reads a hint the row guard sets). After a hand-off that
-- trigger first forgets, without their locks, the keys that end (_outbox_keys_forget: their rows
-- deleted if no decision touched them since its snapshot;
-- docs/design.md#forgetting-a-key-without-its-lock).
-- In a claim round the settle of a keyed message can hand its key on to the same worker (_outbox_keys_hand_off,
-- called by outbox_settle_and_claim), skipping the promotion to pending and the claim; on a
-- channel with key_max_in_flight 1 it takes no key lock (docs/design.md#the-hand-off-without-the-key-lock).
-- outbox_cancel and outbox_requeue lock a keyed message's key before its row (the decisions'
-- order), so that they do not deadlock with a decision holding the key and wanting the row.
-- Errors: functions/ERRORS.md.

COMMENT ON TABLE pgfence.outbox_key IS
  'Ordering keys of the outbox with unfinished messages: the lock and the token bucket of each.
One row per (channel, ordering_key): its row lock orders the decisions of which of the key''s
messages may be claimed next; tat is the rate limit''s theoretical arrival time (GCRA, database
clock). Deleted when the key has nothing left to decide. Not an API.';

CREATE OR REPLACE FUNCTION pgfence._outbox_host_key(p_recipient text)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  -- scheme://[userinfo@]host[:port][/...]: the host, lower-cased ([v6] literals kept whole)
  SELECT left('host:' || lower(h), 255)
  FROM (SELECT substring(p_recipient FROM '^[A-Za-z][A-Za-z0-9+.-]*://(?:[^/?#@]*@)?(\[[^]/?#]*\]|[^/?#:\[\]]+)') AS h) x
  WHERE h IS NOT NULL AND h <> ''
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_host_key(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_host_key(text) IS
  'Private: the limit key of a recipient URL on a channel with limit_key host: host:<host>.
The host of scheme://[user@]host[:port]/..., lower-cased, at most 255 characters in all; NULL
when the recipient is not such a URL (the message then gets no key). Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_key_derived(p_limit_key text, p_key text)
RETURNS boolean
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT p_limit_key IS NOT DISTINCT FROM 'host' AND starts_with(p_key, 'host:')
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_key_derived(text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_key_derived(text, text) IS
  'Private: whether a key of a channel with this limit_key is a derived limit key (host:...).
A derived key limits (key_max_in_flight, key_rate) but is never held by a failed or dead
message, whatever the channel''s key_dead_policy. Errors: none.';

-- The keys' locks, in one global order: every decision and every hand-off takes them here.
CREATE OR REPLACE FUNCTION pgfence._outbox_keys_lock(p_channels text[], p_keys text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
AS $$
DECLARE
  v_tids tid[];
BEGIN
  -- One order (channel, then key, collation "C"): no deadlock between two decisions over
  -- overlapping keys. A concurrent decision waits here until it commits (READ COMMITTED: the
  -- caller's next statement then sees it); under REPEATABLE READ a decision committed after this
  -- snapshot makes this statement fail with 40001 instead of deciding on stale rows.
  -- Under REPEATABLE READ and SERIALIZABLE a key row that a decision committed after this
  -- snapshot deleted (the key ended) is no conflict, so the upsert creates a new row without an
  -- error, and the caller would decide on a snapshot that misses that decision (an enqueue that
  -- saw the key's last turn still held left its message waiting for good). The snapshot still
  -- sees the deleted row beside the row the upsert returned: then fail as a lost race (40001).
  WITH up AS (
    INSERT INTO pgfence.outbox_key AS k (channel, ordering_key)
    SELECT d.c, d.k
    FROM (SELECT DISTINCT u.c, u.k FROM unnest(p_channels, p_keys) AS u(c, k)
          WHERE u.c IS NOT NULL AND u.k IS NOT NULL) d
    ORDER BY d.c COLLATE "C", d.k COLLATE "C"
    ON CONFLICT (channel, ordering_key) DO UPDATE SET decisions = k.decisions + 1, updated_at = now()
    RETURNING k.ctid
  )
  SELECT array_agg(up.ctid) INTO v_tids FROM up;
  IF current_setting('transaction_isolation') = 'read committed' THEN
    RETURN;  -- each statement takes a new snapshot: the caller's next one sees that decision
  END IF;
  IF EXISTS (SELECT FROM pgfence.outbox_key k
             WHERE (k.channel, k.ordering_key) IN (SELECT u.c, u.k FROM unnest(p_channels, p_keys) AS u(c, k))
               AND k.ctid <> ALL (v_tids)) THEN
    RAISE EXCEPTION 'could not serialize access due to concurrent update'
      USING ERRCODE = '40001', DETAIL = 'A decision on an ordering key committed after this transaction''s snapshot ended the key.',
            HINT = 'Retry the transaction, or call pgfence in READ COMMITTED.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_keys_lock(text[], text[]) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_keys_lock(text[], text[]) IS
  'Private: locks the key rows of these (channel, key) pairs, creating missing ones, in one order.
Channel, then key, collation "C": the one order every key decision and hand-off takes them in, so
no two deadlock. Counts a decision on each row (outbox_key.decisions). Errors: 40001 under
REPEATABLE READ when another decision committed after the snapshot (one that deleted the key''s
row too).';

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

  -- The turns held (outbox_key_live_idx) and whether any message waits (outbox_key_waiting_idx):
  -- each status test is written as its index's predicate, so that the probe can use it.
  SELECT count(*) INTO v_live
  FROM pgfence.outbox o
  WHERE o.channel = p_channel AND o.ordering_key = p_key AND o.ordering_key IS NOT NULL
    AND o.status IN ('pending', 'processing', 'failed', 'dead')
    AND (o.status IN ('pending', 'processing')
         OR (v_set.key_dead_policy = 'block' AND NOT pgfence._outbox_key_derived(v_set.limit_key, p_key)));
  v_waiting := EXISTS (SELECT FROM pgfence.outbox o
                       WHERE o.channel = p_channel AND o.ordering_key = p_key AND o.status = 'waiting');

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
      AND o.status = 'waiting'  -- outbox_key_waiting_idx
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

CREATE OR REPLACE FUNCTION pgfence._outbox_keys_decide(p_channels text[], p_keys text[])
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_promoted integer;
  v_rated    text[];
  r          record;
  c_waiting  CONSTANT text := 'waiting';  -- docs/query-plans.md#constants-instead-of-literals
BEGIN
  PERFORM pgfence._outbox_keys_lock(p_channels, p_keys);

  -- Every key at once: how many of its messages hold a turn, whether any waits; the oldest
  -- waiting ones up to key_max_in_flight are promoted (keys with a rate: below, one by one, as
  -- the bucket orders their due times); keys with nothing left are forgotten (a bucket still
  -- refilling is kept, so a new message cannot jump the rate).
  WITH keys AS (
    SELECT DISTINCT u.c AS channel, u.k AS ordering_key FROM unnest(p_channels, p_keys) AS u(c, k)
    WHERE u.c IS NOT NULL AND u.k IS NOT NULL
  ), rules AS MATERIALIZED (  -- one settings lookup per channel, not per key
    SELECT ch.channel, s.key_max_in_flight, s.key_rate, s.key_dead_policy, s.limit_key
    FROM (SELECT DISTINCT keys.channel FROM keys) ch, LATERAL pgfence._outbox_settings(ch.channel) s
  ), st AS (
    -- per key: the turns held (outbox_key_live_idx) and whether any message waits
    -- (outbox_key_waiting_idx); each status test is its index's predicate, written out
    SELECT keys.channel, keys.ordering_key, rules.key_max_in_flight, rules.key_rate,
           (SELECT count(*) FROM pgfence.outbox o
            WHERE o.channel = keys.channel AND o.ordering_key = keys.ordering_key
              AND o.ordering_key IS NOT NULL AND o.status IN ('pending', 'processing', 'failed', 'dead')
              AND (o.status IN ('pending', 'processing')
                   OR (rules.key_dead_policy = 'block'
                       AND NOT pgfence._outbox_key_derived(rules.limit_key, keys.ordering_key)))) AS live,
           -- OFFSET 0: a probe per key; without it the planner may hash the EXISTS, a read of
           -- every waiting message of the table per decision (docs/query-plans.md#exists-probes)
           EXISTS (SELECT FROM pgfence.outbox o
                   WHERE o.channel = keys.channel AND o.ordering_key = keys.ordering_key
                     AND o.status = 'waiting' OFFSET 0) AS waiting
    FROM keys JOIN rules ON rules.channel = keys.channel
  ), promoted AS (
    UPDATE pgfence.outbox o SET status = 'pending', updated_at = now()
    FROM (SELECT w.id FROM st,
          LATERAL (SELECT o2.id FROM pgfence.outbox o2
                   WHERE o2.channel = st.channel AND o2.ordering_key = st.ordering_key
                     AND o2.status = 'waiting'  -- outbox_key_waiting_idx
                   ORDER BY o2.id
                   LIMIT greatest(st.key_max_in_flight - st.live, 0)) w
          WHERE st.waiting AND st.key_rate IS NULL) p
    WHERE o.id = p.id AND o.status = c_waiting
    RETURNING o.id
  ), forgotten AS (  -- runs although nothing reads it (a data-modifying WITH always does)
    DELETE FROM pgfence.outbox_key k USING st
    WHERE k.channel = st.channel AND k.ordering_key = st.ordering_key
      AND NOT st.waiting AND st.live = 0 AND (k.tat IS NULL OR k.tat <= now())
    RETURNING k.channel
  )
  SELECT (SELECT count(*) FROM promoted)::integer,
         (SELECT array_agg(st.channel || ' ' || st.ordering_key ORDER BY st.channel COLLATE "C", st.ordering_key COLLATE "C")
          FROM st WHERE st.waiting AND st.key_rate IS NOT NULL
            AND st.live < st.key_max_in_flight)
    INTO v_promoted, v_rated;

  FOR r IN SELECT split_part(e, ' ', 1) AS channel, substr(e, position(' ' IN e) + 1) AS ordering_key
           FROM unnest(v_rated) WITH ORDINALITY AS u(e, i) ORDER BY u.i
  LOOP
    v_promoted := v_promoted + pgfence._outbox_key_decide(r.channel, r.ordering_key);
  END LOOP;
  RETURN v_promoted;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_keys_decide(text[], text[]) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_keys_decide(text[], text[]) IS
  'Private: decide the next turns of many ordering keys at once (element i: channel i, key i).
Locks the keys'' rows in pgfence.outbox_key in one global order (channel, key; collation "C"),
then in one statement promotes, for every key, its oldest waiting messages (id order) up to
key_max_in_flight minus the messages holding a turn (pending, processing, and failed or dead
ones when the channel''s key_dead_policy is block) and forgets keys with nothing left; keys of
a channel with a key_rate are promoted one by one (_outbox_key_decide) in the same order.
NULL elements are skipped. Returns how many messages it promoted.
Errors: 40001 (REPEATABLE READ or SERIALIZABLE: a concurrent decision on a key; retry).';

-- The end of a key's turns without its lock (docs/design.md#forgetting-a-key-without-its-lock):
-- the statement trigger's keys that nothing waits on and nothing holds are forgotten in one
-- statement, each only if no decision touched its row since this statement's snapshot.
CREATE OR REPLACE FUNCTION pgfence._outbox_keys_forget(p_channels text[], p_keys text[],
                                                       OUT rest_channels text[], OUT rest_keys text[])
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
SET enable_hashjoin = off   -- the DELETE visits the key rows in the order of its sorted outer
SET enable_mergejoin = off  -- side (the global lock order), as a nested loop does
AS $$
BEGIN
  -- Per key, in this statement's snapshot: nothing waits (outbox_key_waiting_idx), nothing holds
  -- a turn as a decision counts them (outbox_key_live_idx; OFFSET 0: one probe per key,
  -- docs/query-plans.md#exists-probes), and then its row's decision count. The DELETE takes each
  -- such row's lock in the global order (channel, key, collation "C") and removes it only if its
  -- count is still the one read: a decision committed since (an enqueue's, a cancel's, a
  -- requeue's: each bumps the count under the lock) makes READ COMMITTED recheck the row's
  -- newest version and keep it (REPEATABLE READ: 40001), and a decision in progress makes it
  -- wait for that first. The keys not forgotten are returned for _outbox_keys_decide.
  WITH keys AS (
    SELECT DISTINCT u.c AS channel, u.k AS ordering_key FROM unnest(p_channels, p_keys) AS u(c, k)
    WHERE u.c IS NOT NULL AND u.k IS NOT NULL
  ), rules AS MATERIALIZED (  -- one settings lookup per channel, not per key
    SELECT ch.channel, s.key_dead_policy, s.limit_key
    FROM (SELECT DISTINCT keys.channel FROM keys) ch, LATERAL pgfence._outbox_settings(ch.channel) s
  ), st AS (
    SELECT keys.channel, keys.ordering_key, r.tid, r.decisions
    FROM keys JOIN rules ON rules.channel = keys.channel
    CROSS JOIN LATERAL (
      SELECT NOT EXISTS (SELECT FROM pgfence.outbox o
                         WHERE o.channel = keys.channel AND o.ordering_key = keys.ordering_key
                           AND o.status = 'waiting' OFFSET 0)
         AND NOT EXISTS (SELECT FROM pgfence.outbox o
                         WHERE o.channel = keys.channel AND o.ordering_key = keys.ordering_key
                           AND o.ordering_key IS NOT NULL
                           AND o.status IN ('pending', 'processing', 'failed', 'dead')
                           AND (o.status IN ('pending', 'processing')
                                OR (rules.key_dead_policy = 'block'
                                    AND NOT pgfence._outbox_key_derived(rules.limit_key, keys.ordering_key)))
                         OFFSET 0) AS ends) e
    LEFT JOIN LATERAL (SELECT k.ctid AS tid, k.decisions FROM pgfence.outbox_key k
                       WHERE e.ends AND k.channel = keys.channel AND k.ordering_key = keys.ordering_key
                         AND (k.tat IS NULL OR k.tat <= now())) r  -- a refilling bucket is kept
      ON true
  ), forgotten AS (  -- by the row version read above (its ctid): no second lookup of the key
    -- All or nothing: only when every key ends. A key left to the decision would be locked by
    -- it after these rows, out of the global order (held: a key forgotten here; wanted: a key
    -- that sorts before it), and deadlock with a decision that holds the one and wants the other
    -- (tests/isolation/specs/outbox-key-forget-order.spec).
    DELETE FROM pgfence.outbox_key k
    USING (SELECT st.tid, st.decisions FROM st
           WHERE st.tid IS NOT NULL AND NOT EXISTS (SELECT FROM st s0 WHERE s0.tid IS NULL)
           ORDER BY st.channel COLLATE "C", st.ordering_key COLLATE "C") e
    WHERE k.ctid = e.tid AND k.decisions = e.decisions AND (k.tat IS NULL OR k.tat <= now())
    RETURNING 1
  )
  -- None if every key was forgotten; else every key goes on to the decision: nothing was
  -- deleted (a key that does not end), or a row was kept (a decision since; it stays locked by
  -- the DELETE's recheck, and the deleted ones are this transaction's: the decision's locks wait
  -- for no one; deciding a forgotten key again only re-creates and deletes its row).
  SELECT array_agg(st.channel), array_agg(st.ordering_key) INTO rest_channels, rest_keys
  FROM st
  WHERE (SELECT count(*) FROM forgotten) < (SELECT count(*) FROM st s2);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_keys_forget(text[], text[]) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_keys_forget(text[], text[]) IS
  'Private: forget the keys that have nothing left to decide, without taking their locks first.
Element i: channel i, key i. In one statement: a key none of whose messages waits or holds a turn
(pending, processing, and failed or dead ones when the channel''s key_dead_policy is block) and
whose bucket is not refilling has its row in pgfence.outbox_key deleted, locked in the global
order (channel, key; collation "C"), if its decision count is still the one this statement''s
snapshot read: a decision on the key committed or in progress since then keeps the row (under
REPEATABLE READ: 40001). All or nothing: when a key does not end (or has no row, or a bucket
still refilling) no row is deleted, so that the decision takes every lock in the global order.
Returns NULL (rest_channels, rest_keys) when every key was forgotten, else all the keys, for
_outbox_keys_decide: what it would have decided for the forgotten ones is to delete their rows. Errors: 40001 (REPEATABLE READ or SERIALIZABLE: a concurrent decision on a key; retry).';

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_key_turn()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_todo text[] := nullif(current_setting('pgfence.outbox_keys_enqueued', true), '')::text[];
BEGIN
  IF v_todo IS NOT NULL THEN
    -- The first of this commit's firings: all the keys this transaction enqueued, decided at
    -- once in the global lock order (one firing per row would lock them in insert order). The
    -- firings of the other rows find nothing noted and do nothing: their keys were decided.
    PERFORM set_config('pgfence.outbox_keys_enqueued', '', true);
    v_todo := v_todo || (NEW.channel || ' ' || NEW.ordering_key);
    PERFORM pgfence._outbox_keys_decide(array_agg(split_part(e, ' ', 1)),
                                        array_agg(substr(e, position(' ' IN e) + 1)))
    FROM unnest(v_todo) AS e;
  END IF;
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_key_turn() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_key_turn() IS
  'Trigger: at an enqueue''s commit, decides the turns of every key the transaction enqueued.
Deferred AFTER INSERT constraint trigger on rows with an ordering_key. outbox_enqueue and
outbox_enqueue_many note their keys in the transaction-local setting pgfence.outbox_keys_enqueued
(_outbox_keys_note) before they insert; the first firing decides all the noted keys in one
_outbox_keys_decide (the global lock order) and clears the note, so the firings of the other
rows do nothing (no lookup per row). A keyed row inserted by hand, not through these functions,
waits for its key''s next decision. The setting is internal.';

CREATE OR REPLACE FUNCTION pgfence._outbox_keys_note(p_channel text, p_keys text[])
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_todo text := current_setting('pgfence.outbox_keys_enqueued', true);
  v_new  text;
BEGIN
  SELECT array_agg(DISTINCT p_channel || ' ' || k)::text INTO v_new
  FROM unnest(p_keys) AS k WHERE k IS NOT NULL;
  IF v_new IS NOT NULL THEN
    -- appended as text (no parse of what is noted already; the decision removes duplicates)
    PERFORM set_config('pgfence.outbox_keys_enqueued',
                       CASE WHEN coalesce(v_todo, '') = '' THEN v_new
                            ELSE left(v_todo, -1) || ',' || substr(v_new, 2) END, true);
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_keys_note(text, text[]) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_keys_note(text, text[]) IS
  'Private: note the ordering keys an enqueue is about to insert, for the decision at commit.
Appends (channel, key) to the transaction-local setting pgfence.outbox_keys_enqueued (a text[]
literal of ''channel key''; channel names have no space), read by tg_outbox_key_turn. NULL keys
are skipped. Errors: none.';

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_keys_turns_ended()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_channels text[];
  v_keys     text[];
  -- 'ending': a hand-off's statement, whose keys that reach here mostly end (nothing waits):
  -- worth trying to forget them before deciding (a wrong guess costs a probe per key, no more)
  v_forget   CONSTANT boolean := current_setting('pgfence.outbox_keys_turns_ended', true) = 'ending';
BEGIN
  -- The hint that brought us here (tg_outbox_guard, or the hand-off) is spent: cleared before
  -- the decision, whose own UPDATE (a promotion) must not fire this again.
  PERFORM set_config('pgfence.outbox_keys_turns_ended', '', true);
  -- One pass over the statement's keyed rows, per key: decided if a row of it ended its turn,
  -- unless the statement also claimed one of it (a hand-off, _outbox_keys_hand_off: it took the
  -- key's next turns itself).
  SELECT array_agg(d.channel), array_agg(d.ordering_key) INTO v_channels, v_keys
  FROM (SELECT n.channel, n.ordering_key FROM outbox_turns_ended n
        WHERE n.ordering_key IS NOT NULL
        GROUP BY n.channel, n.ordering_key
        HAVING bool_or(n.status IN ('sent', 'failed', 'dead', 'canceled', 'waiting'))
           AND NOT coalesce(bool_or(n.status = 'processing' AND n.claimed_at = now()), false)) d;
  IF v_keys IS NOT NULL THEN
    -- After a hand-off: if every key ends (nothing waits, nothing holds), the keys are forgotten
    -- without their locks (_outbox_keys_forget); else all are decided under them (one pass
    -- over the locks, in the global order).
    IF v_forget THEN
      SELECT f.rest_channels, f.rest_keys INTO v_channels, v_keys
      FROM pgfence._outbox_keys_forget(v_channels, v_keys) f;
    END IF;
    IF v_keys IS NOT NULL THEN
      PERFORM pgfence._outbox_keys_decide(v_channels, v_keys);
    END IF;
  END IF;
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_keys_turns_ended() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_keys_turns_ended() IS
  'Trigger: decides, once per UPDATE statement, the turns of the keys whose messages it ended.
AFTER UPDATE statement trigger on pgfence.outbox with the updated rows as a transition table,
called only when tg_outbox_guard has seen a keyed row end its turn in the statement (the hint
pgfence.outbox_keys_turns_ended, a transaction setting; a client who sets it only causes a
decision over the statement''s real rows, which is always safe):
the keys of rows left sent, failed, dead, canceled or waiting (requeued) go to one
_outbox_keys_decide (the global lock order), in the settling transaction, so that a claim in the
same call (outbox_settle_and_claim) sees each key''s next message. After a hand-off (the hint set
to ending by _outbox_keys_hand_off) the keys are first offered to _outbox_keys_forget, which
forgets them all when every one ends, and are decided only if it did not. A key of which the statement
also claimed a message (a row left processing, claimed at now()) is skipped: only a hand-off
(_outbox_keys_hand_off) does both, and it has taken the key''s next turns itself.';

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_key_deleted()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._outbox_keys_decide(ARRAY[OLD.channel], ARRAY[OLD.ordering_key]);
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_key_deleted() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_key_deleted() IS
  'Trigger: a deleted message that held its key''s turn hands the turn on.
AFTER DELETE row trigger on keyed rows that were pending, processing, failed or dead (an
operator deleting a blocker by hand): the key''s next waiting message is promoted at once.';

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
-- the key's next message; once per statement (a settle of 50 messages makes one decision).
DROP TRIGGER IF EXISTS outbox_key_turn_ended ON pgfence.outbox;
DROP TRIGGER IF EXISTS outbox_keys_turns_ended ON pgfence.outbox;
-- The WHEN reads the hint tg_outbox_guard sets for a row that ends a keyed turn: a statement
-- that ends none (every keyless claim and settle) does not call the function.
CREATE TRIGGER outbox_keys_turns_ended
  AFTER UPDATE ON pgfence.outbox
  REFERENCING NEW TABLE AS outbox_turns_ended
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.outbox_keys_turns_ended', true) IN ('on', 'ending'))
  EXECUTE FUNCTION pgfence.tg_outbox_keys_turns_ended();
CREATE OR REPLACE TRIGGER outbox_key_deleted
  AFTER DELETE ON pgfence.outbox
  FOR EACH ROW
  WHEN (OLD.ordering_key IS NOT NULL AND OLD.status IN ('pending', 'processing', 'failed', 'dead'))
  EXECUTE FUNCTION pgfence.tg_outbox_key_deleted();

-- ---------------------------------------------------------------------------------------------
-- The hand-off (outbox_settle_and_claim): a settled message's key goes on with the same worker
--
-- When a claim round settles a keyed message and has room to claim, the key's next message (if
-- due now) goes waiting -> processing straight to the same worker, fenced and leased like a claim,
-- in the same UPDATE that marks the settled one sent: instead of waiting -> pending (a decision)
-- and pending -> processing (a claim), one write of the row, one walk of the due index and one
-- decision fewer per keyed message. One leaves, one enters: the key's turns are counted as a
-- decision counts them, without the messages this round settles, so order (id order) and
-- key_max_in_flight hold exactly as at a decision. A key is handed off whole or not at all:
-- all the messages a decision would promote (key_max_in_flight minus the turns it holds, or all
-- that wait if fewer) must be due now and fit in the round's batch; then that UPDATE's decision
-- (tg_outbox_keys_turns_ended) is skipped for the key: it would promote nothing. The same UPDATE
-- settles the round's other keyed messages too (a next message not yet due, a key with a rate,
-- no room left): their keys are decided by its trigger, as without the hand-off. On one channel
-- with key_max_in_flight 1 and no rate (the defaults) the turns are not counted by a walk of the
-- key but by two probes (the lean form, below); other channels take the general form.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._outbox_keys_hand_off(
  p_settled  bigint[],
  p_channels text[],
  p_keys     text[],
  p_receipts jsonb[],
  p_worker   text,
  p_batch    integer,
  p_lease    interval
)
RETURNS TABLE (
  handed           boolean,
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
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  c_waiting  CONSTANT text := 'waiting';     -- docs/query-plans.md#constants-instead-of-literals
  c_processing CONSTANT text := 'processing';
  -- Due by the clock, as a claim decides (docs/design.md#claim-hint: due times are stamped at the
  -- clock, so a message enqueued since this transaction began is due after now()).
  v_due_by   CONSTANT timestamptz := clock_timestamp();
  v_lock_channels text[];
  v_lock_keys     text[];
  v_set      pgfence.outbox_channel;
  v_lease    interval;
  v_hold_dead boolean;
BEGIN
  -- The lean form: one channel (the common case) with key_max_in_flight 1 and no key_rate (the
  -- defaults). Per settled key two probes instead of a walk of all its unfinished messages: its
  -- oldest waiting message (outbox_key_waiting_idx, LIMIT 1), handed off if due now, unless a
  -- message other than the settled one holds or blocks a turn (outbox_key_live_idx; each index's
  -- predicate is written out as a literal so that the probe can use it). Then the key has room
  -- for exactly one, the settled one's: what a decision would promote. No key lock
  -- (docs/design.md#the-hand-off-without-the-key-lock).
  IF p_channels[1] = ALL (p_channels) THEN
    v_set := pgfence._outbox_settings(p_channels[1]);
    IF v_set.key_max_in_flight = 1 AND v_set.key_rate IS NULL THEN
      v_lease := coalesce(p_lease, v_set.lease);
      v_hold_dead := v_set.key_dead_policy = 'block';
      -- The keys this UPDATE settles and does not hand on mostly end (nothing waits): its
      -- statement trigger is asked to try forgetting them before deciding (a hint, and the
      -- forget checks what it deletes: docs/design.md#forgetting-a-key-without-its-lock).
      PERFORM set_config('pgfence.outbox_keys_turns_ended', 'ending', true);
      RETURN QUERY
      WITH settled AS (
        SELECT u.id, u.k AS ordering_key, u.receipt
        FROM unnest(p_settled, p_keys, p_receipts) AS u(id, k, receipt)
      ), nxt AS (  -- the handed messages: due first, at most p_batch
        SELECT w.id
        FROM settled s,
        LATERAL (SELECT o.id, o.next_attempt_at FROM pgfence.outbox o
                 WHERE o.channel = p_channels[1] AND o.ordering_key = s.ordering_key
                   AND o.status = 'waiting'  -- outbox_key_waiting_idx
                 ORDER BY o.id LIMIT 1) w
        WHERE w.next_attempt_at <= v_due_by
          -- OFFSET 0: a probe per settled key; without it the planner may make this an anti
          -- join over a scan of every turn holder of the channel, filtered for each key
          -- (docs/query-plans.md#exists-probes)
          AND NOT EXISTS (
            SELECT FROM pgfence.outbox o
            WHERE o.channel = p_channels[1] AND o.ordering_key = s.ordering_key
              AND o.ordering_key IS NOT NULL
              AND o.status IN ('pending', 'processing', 'failed', 'dead')  -- outbox_key_live_idx
              AND o.id <> s.id
              AND (o.status IN ('pending', 'processing')
                   OR (v_hold_dead AND NOT pgfence._outbox_key_derived(v_set.limit_key, s.ordering_key)))
            OFFSET 0)
        ORDER BY w.next_attempt_at, w.id
        LIMIT p_batch
      ), moves AS (  -- the handed messages, and every settled one (the others: the trigger decides)
        SELECT nxt.id, true AS handed, NULL::jsonb AS receipt FROM nxt
        UNION ALL
        SELECT settled.id, false, settled.receipt FROM settled
      ), moved AS (
        UPDATE pgfence.outbox o
        SET status = CASE WHEN m.handed THEN 'processing' ELSE 'sent' END,
            attempts = CASE WHEN m.handed THEN o.attempts + 1 ELSE o.attempts END,
            locked_by = CASE WHEN m.handed THEN p_worker END,
            lease_expires_at = CASE WHEN m.handed THEN now() + v_lease END,
            claimed_at = CASE WHEN m.handed THEN now() ELSE o.claimed_at END,
            finished_at = CASE WHEN m.handed THEN NULL ELSE now() END,
            receipt = CASE WHEN m.handed THEN o.receipt ELSE m.receipt END,
            last_error = CASE WHEN m.handed THEN o.last_error END,
            updated_at = now()
        FROM moves m
        WHERE o.id = m.id AND o.status = CASE WHEN m.handed THEN c_waiting ELSE c_processing END
        RETURNING m.handed, o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.attempts,
                  o.max_attempts, v_lease AS lease, o.lease_expires_at, o.created_at,
                  o.next_attempt_at AS due_at)
      SELECT m.handed, m.id, m.channel, m.recipient, m.payload, m.idempotency_key, m.attempts,
             m.max_attempts, m.lease, m.lease_expires_at, m.created_at
      FROM moved m WHERE m.handed ORDER BY m.due_at, m.id;
      RETURN;
    END IF;
  END IF;

  -- The keys of channels with key_max_in_flight above 1 are locked, as every decision locks
  -- them. A key of a channel with 1 is not: its settled message is its one turn, processing
  -- under this call's row lock since before this statement, so every decision on the key, in
  -- any snapshot, counts a turn held and promotes nothing, and the hand-off swaps that turn for
  -- the next in one UPDATE (docs/design.md#the-hand-off-without-the-key-lock).
  SELECT array_agg(ch.c) INTO v_lock_channels
  FROM (SELECT DISTINCT c FROM unnest(p_channels) AS c) ch, LATERAL pgfence._outbox_settings(ch.c) s
  WHERE s.key_max_in_flight > 1;
  IF v_lock_channels IS NOT NULL THEN
    SELECT array_agg(u.c), array_agg(u.k) INTO v_lock_channels, v_lock_keys
    FROM unnest(p_channels, p_keys) AS u(c, k) WHERE u.c = ANY (v_lock_channels);
    PERFORM pgfence._outbox_keys_lock(v_lock_channels, v_lock_keys);
  END IF;

  RETURN QUERY
  WITH settled AS (
    SELECT u.id, u.c AS channel, u.k AS ordering_key, u.receipt
    FROM unnest(p_settled, p_channels, p_keys, p_receipts) AS u(id, c, k, receipt)
  ), keys AS (
    SELECT DISTINCT settled.channel, settled.ordering_key FROM settled
  ), rules AS MATERIALIZED (  -- one settings lookup per channel, not per key
    SELECT ch.channel, s.key_max_in_flight, s.key_rate, s.key_dead_policy, s.limit_key,
           coalesce(p_lease, s.lease) AS lease
    FROM (SELECT DISTINCT keys.channel FROM keys) ch, LATERAL pgfence._outbox_settings(ch.channel) s
  ), st AS (  -- per key, the turns free once this round's settle is done (as a decision counts
               -- them: outbox_key_live_idx, its predicate written out)
    SELECT keys.channel, keys.ordering_key, rules.lease,
           greatest(rules.key_max_in_flight
                    - (SELECT count(*) FROM pgfence.outbox o
                       WHERE o.channel = keys.channel AND o.ordering_key = keys.ordering_key
                         AND o.ordering_key IS NOT NULL AND o.status IN ('pending', 'processing', 'failed', 'dead')
                         AND (o.status IN ('pending', 'processing')
                              OR (rules.key_dead_policy = 'block'
                                  AND NOT pgfence._outbox_key_derived(rules.limit_key, keys.ordering_key)))
                         AND o.id <> ALL (p_settled)), 0) AS room
    FROM keys JOIN rules ON rules.channel = keys.channel
    WHERE rules.key_rate IS NULL
  ), next AS (  -- what a decision would promote: the oldest waiting messages the room allows
    SELECT st.channel, st.ordering_key, st.lease, w.id, w.next_attempt_at
    FROM st,
    LATERAL (SELECT o.id, o.next_attempt_at FROM pgfence.outbox o
             WHERE o.channel = st.channel AND o.ordering_key = st.ordering_key
               AND o.status = 'waiting'  -- outbox_key_waiting_idx
             ORDER BY o.id LIMIT st.room) w
    WHERE st.room > 0
  ), ready AS (  -- keys whose next messages are all due now, earliest due first
    SELECT next.channel, next.ordering_key, count(*) AS n,
           sum(count(*)) OVER (ORDER BY min(next.next_attempt_at), min(next.id)) AS upto
    FROM next GROUP BY next.channel, next.ordering_key
    HAVING bool_and(next.next_attempt_at <= v_due_by)
  ), moves AS (  -- the handed keys, whole, within the batch: their next messages and their settled ones
    SELECT next.id, true AS handed, next.lease, NULL::jsonb AS receipt
    FROM next JOIN ready USING (channel, ordering_key) WHERE ready.upto <= p_batch
    UNION ALL  -- every settled message, handed key or not (the others: decided by the trigger)
    SELECT settled.id, false, NULL::interval, settled.receipt FROM settled
  ), moved AS (
    UPDATE pgfence.outbox o
    SET status = CASE WHEN m.handed THEN 'processing' ELSE 'sent' END,
        attempts = CASE WHEN m.handed THEN o.attempts + 1 ELSE o.attempts END,
        locked_by = CASE WHEN m.handed THEN p_worker END,
        lease_expires_at = CASE WHEN m.handed THEN now() + m.lease END,
        claimed_at = CASE WHEN m.handed THEN now() ELSE o.claimed_at END,
        finished_at = CASE WHEN m.handed THEN NULL ELSE now() END,
        receipt = CASE WHEN m.handed THEN o.receipt ELSE m.receipt END,
        last_error = CASE WHEN m.handed THEN o.last_error END,
        updated_at = now()
    FROM moves m
    WHERE o.id = m.id AND o.status = CASE WHEN m.handed THEN c_waiting ELSE c_processing END
    RETURNING m.handed, o.id, o.channel, o.recipient, o.payload, o.idempotency_key, o.attempts,
              o.max_attempts, o.lease_expires_at - now() AS lease, o.lease_expires_at,
              o.created_at, o.next_attempt_at AS due_at)
  SELECT m.handed, m.id, m.channel, m.recipient, m.payload, m.idempotency_key, m.attempts,
         m.max_attempts, m.lease, m.lease_expires_at, m.created_at
  FROM moved m WHERE m.handed ORDER BY m.due_at, m.id;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_keys_hand_off(bigint[], text[], text[], jsonb[], text, integer, interval) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_keys_hand_off(bigint[], text[], text[], jsonb[], text, integer, interval) IS
  'Private: settle a round''s keyed messages and claim their keys'' next ones for p_worker, at once.
Called by outbox_settle_and_claim before its settle, with the keyed messages it is settling
(element i: id, channel, ordering key, receipt), which it has locked in id order and found
processing under the attempt it was given; it settles every one of them. Locks their keys in the global order, except those of
channels with key_max_in_flight 1 (the settled message is the key''s one turn, row-locked by the
caller: docs/design.md#the-hand-off-without-the-key-lock). A key is handed off when every
message a decision would promote (its oldest waiting ones, id order, up to key_max_in_flight
minus the turns it holds besides the settled ones) is due now and they fit in p_batch (keys by
earliest due); never on a channel with a key_rate. One UPDATE then marks every given message
sent (as outbox_mark_sent_many) and moves the handed keys'' next ones waiting -> processing
(attempts + 1, owner p_worker, lease p_lease or the channel''s, as outbox_claim); its statement
trigger skips the decision of the handed keys and decides the others. With one channel of
key_max_in_flight 1 and no key_rate, a key''s turns are probed (its oldest waiting message on
outbox_key_waiting_idx, another holder on outbox_key_live_idx) instead of walked. Returns the
claimed ones (handed always true, the columns of outbox_claim), due order. The caller validates
worker and lease, and settles the keyless messages. Errors: 40001 (REPEATABLE READ or SERIALIZABLE: a
concurrent decision on a key; retry).';
