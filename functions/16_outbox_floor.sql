-- pgfence functions/16_outbox_floor.sql — outbox (module 1): the claim floor.
--
-- No public function. The claims (12_outbox_claim) walk the due indexes from a floor: a due
-- time no pending message is below, so the entries of messages claimed and sent since the last
-- VACUUM, which a snapshot held open keeps in the index, are stepped over in one index descent
-- instead of one by one (issue 14; docs/query-plans.md#the-claim-floor). Kept in sequences
-- (created below): not transactional, so every session reads the latest value whatever its
-- snapshot, and a setval is seen at once. Private: _outbox_floor() (read, and raise it when due), _outbox_floor_lower(at)
-- (the writers' side: triggers outbox_floor_insert / outbox_floor_update), _outbox_floor_check()
-- (the reaper's self-check), _outbox_floor_reset(), _outbox_us / _outbox_at (conversions).
--
-- Why no pending message is below the floor. The floor is raised in two steps, under an
-- advisory lock (the mutex), and only in READ COMMITTED (each statement then sees every commit
-- before it):
--  1. publish a guard G >= floor (the earliest pending message, capped at now() - 1 s) and arm;
--  2. at least 50 ms later, once no transaction that wrote a pending message since before G was
--     published is still open (the writers' lock below can be taken, for an instant), set
--     floor = least(G, the earliest pending message at or above the floor as a new statement
--     sees it); then publish the next guard (step 1).
-- Every write that makes a message pending (enqueue, retry, reap, requeue, any UPDATE moving a
-- due time back) calls _outbox_floor_lower(due) after the row is written, by trigger: it takes
-- the writers' lock, shared, until its transaction ends, then reads the guard, and if due < the
-- guard lowers the floor and the guard to due (under the mutex). A writer that read the guard
-- before G was published holds the writers' lock from then until it ends, so step 2 waits for
-- it and then sees its message (if it committed); a writer that read it later read G (or a
-- lower guard) and lowered them when its message is due before. Rows written with the triggers
-- bypassed (replication role replica, a restore of a dump whose sequences were read after its
-- snapshot) can be below the floor: the reaper's _outbox_floor_check lowers it to them, and
-- every migrate resets it. While writers keep the writers' lock held without a pause (or one
-- transaction that wrote a message stays open), step 2 waits: the claims walk from the last
-- floor, as they walked from the start before. A snapshot held open (the pressure case) holds
-- no lock and stops nothing.

-- The floor's state: created here rather than in a migration, as sequences hold no rows a
-- migration would have to carry forward (IF NOT EXISTS: every migrate re-applies this file and
-- then resets the floor, below). Values are microseconds since 2000-01-01 UTC (the server's own
-- epoch), the minimum meaning "no floor" (-infinity).
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_seq IS
  'The outbox claim floor: no pending message is due before it. Not an API.
Microseconds since 2000-01-01 UTC; the minimum = none. Kept by functions/16_outbox_floor.sql.';
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_guard_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_guard_seq IS
  'The highest value the outbox claim floor may be raised to next. Not an API.
A writer of a pending message due before it lowers it (and the floor).';
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_arm_seq AS bigint
  MINVALUE 0 START WITH 0 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_arm_seq IS
  'Whether the outbox claim floor''s guard is published, waiting to be raised to (1) or not (0).
Not an API.';
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_armed_at_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_armed_at_seq IS
  'When the outbox claim floor''s guard was last published. Not an API.
Microseconds since 2000-01-01 UTC: the floor moves at most every 50 ms.';

CREATE OR REPLACE FUNCTION pgfence._outbox_us(p_at timestamptz)
RETURNS bigint
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  SELECT CASE WHEN p_at = '-infinity' THEN -9223372036854775808
              WHEN p_at = 'infinity' THEN 9223372036854775807
              ELSE ((extract(epoch FROM p_at) - 946684800) * 1000000)::bigint END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_us(timestamptz) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_us(timestamptz) IS
  'Private: a time as microseconds since 2000-01-01 UTC (the claim floor''s unit).
-infinity = the minimum.
Exact: the inverse of pgfence._outbox_at. NULL for NULL.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_at(p_us bigint)
RETURNS timestamptz
LANGUAGE sql IMMUTABLE PARALLEL SAFE
AS $$
  -- days and microseconds apart: each factor is exact in double precision; timestamp without
  -- time zone, so that adding days ignores daylight saving
  SELECT CASE WHEN p_us = -9223372036854775808 THEN '-infinity'::timestamptz
              WHEN p_us = 9223372036854775807 THEN 'infinity'::timestamptz
              ELSE (timestamp '2000-01-01' + (p_us / 86400000000) * interval '1 day'
                    + (p_us % 86400000000) * interval '1 microsecond') AT TIME ZONE 'UTC' END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_at(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_at(bigint) IS
  'Private: microseconds since 2000-01-01 UTC as a time; the minimum = -infinity (no floor).
The inverse of pgfence._outbox_us. NULL for NULL.
Errors: none.';

-- The writers' side: lower the floor (and the guard) to p_at when a message is now pending and
-- due before the guard. The read of the guard is the only cost of an ordinary write.
CREATE OR REPLACE FUNCTION pgfence._outbox_floor_lower(p_at timestamptz)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_at bigint := pgfence._outbox_us(p_at);
  c_lock    CONSTANT bigint := 7094185336601403393;  -- the claim floor's mutex
  c_writers CONSTANT bigint := 7094185336601403394;  -- the writers' lock
BEGIN
  IF v_at IS NULL THEN
    RETURN;
  END IF;
  -- held (shared) until this transaction ends: the floor is not raised past what it reads next
  PERFORM pg_advisory_xact_lock_shared(c_writers);
  IF v_at >= (SELECT g.last_value FROM pgfence.outbox_floor_guard_seq g) THEN
    RETURN;
  END IF;
  -- a session lock released at once (setval is not transactional, so nothing waits for the
  -- commit); released on any error too
  PERFORM pg_advisory_lock(c_lock);
  BEGIN
    IF v_at < (SELECT f.last_value FROM pgfence.outbox_floor_seq f) THEN
      PERFORM setval('pgfence.outbox_floor_seq', v_at);
    END IF;
    IF v_at < (SELECT g.last_value FROM pgfence.outbox_floor_guard_seq g) THEN
      PERFORM setval('pgfence.outbox_floor_guard_seq', v_at);
    END IF;
  EXCEPTION WHEN OTHERS OR query_canceled THEN
    PERFORM pg_advisory_unlock(c_lock);
    RAISE;
  END;
  PERFORM pg_advisory_unlock(c_lock);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_lower(timestamptz) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_lower(timestamptz) IS
  'Private: a message is pending, due at p_at: lower the claim floor and its guard to p_at.
Only if they are above it.
Called after the row is written (triggers outbox_floor_insert, outbox_floor_update, and the
reaper''s check); why that suffices: functions/16_outbox_floor.sql. NULL does nothing.
Errors: none.';

-- Step 2 then step 1 of the header, under the mutex; returns the floor.
CREATE OR REPLACE FUNCTION pgfence._outbox_floor_move()
RETURNS bigint
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_floor bigint;
  v_guard bigint;
  v_armed boolean;
  v_min   timestamptz;
  c_writers CONSTANT bigint := 7094185336601403394;  -- the writers' lock
BEGIN
  SELECT f.last_value, g.last_value, a.last_value <> 0 INTO v_floor, v_guard, v_armed
  FROM pgfence.outbox_floor_seq f, pgfence.outbox_floor_guard_seq g, pgfence.outbox_floor_arm_seq a;
  IF v_armed THEN
    -- no writer that may have read an older guard is still open (the lock is only probed)
    IF NOT pg_try_advisory_lock(c_writers) THEN
      RETURN v_floor;
    END IF;
    PERFORM pg_advisory_unlock(c_writers);
  END IF;
  -- the earliest pending message at or above the floor (matches outbox_due_idx), read by a
  -- statement that starts after the probe
  SELECT o.next_attempt_at INTO v_min FROM pgfence.outbox o
  WHERE o.status = 'pending' AND o.attempts < o.max_attempts
    AND o.next_attempt_at >= pgfence._outbox_at(v_floor)
  ORDER BY o.next_attempt_at LIMIT 1;
  IF v_armed THEN
    v_floor := least(v_guard, coalesce(pgfence._outbox_us(v_min), v_guard));
    PERFORM setval('pgfence.outbox_floor_seq', v_floor);
  END IF;
  PERFORM setval('pgfence.outbox_floor_guard_seq',
                 greatest(v_floor, least(coalesce(pgfence._outbox_us(v_min), 9223372036854775807),
                                         pgfence._outbox_us(now() - interval '1 second'))));
  PERFORM setval('pgfence.outbox_floor_armed_at_seq', pgfence._outbox_us(now()));
  PERFORM setval('pgfence.outbox_floor_arm_seq', 1);
  RETURN v_floor;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_move() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_move() IS
  'Private: raise the claim floor to its guard when no writer that read an older guard is open.
Then publish the next guard.
Caller holds the floor''s mutex, in READ COMMITTED (pgfence._outbox_floor). Returns the floor
(microseconds since 2000-01-01 UTC). The algorithm: functions/16_outbox_floor.sql.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_floor()
RETURNS timestamptz
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_floor    bigint;
  v_arm      bigint;
  v_armed_at bigint;
  c_lock CONSTANT bigint := 7094185336601403393;  -- the claim floor's mutex
BEGIN
  SELECT f.last_value, a.last_value, t.last_value INTO v_floor, v_arm, v_armed_at
  FROM pgfence.outbox_floor_seq f, pgfence.outbox_floor_arm_seq a, pgfence.outbox_floor_armed_at_seq t;
  IF (v_arm = 0 OR pgfence._outbox_us(now()) - 50000 >= v_armed_at)
     AND current_setting('transaction_isolation') = 'read committed'
     AND pg_try_advisory_lock(c_lock) THEN
    BEGIN
      v_floor := pgfence._outbox_floor_move();
    EXCEPTION WHEN OTHERS OR query_canceled THEN
      PERFORM pg_advisory_unlock(c_lock);
      RAISE;
    END;
    PERFORM pg_advisory_unlock(c_lock);
  END IF;
  RETURN pgfence._outbox_at(v_floor);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor() IS
  'Private: the claim floor (no pending message is due before it), first raised when that is due.
Called by outbox_claim before its walk. Raises it at most every 50 ms, only in READ COMMITTED,
and skips that when another session holds the floor''s lock. -infinity = no floor.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_floor_check()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
BEGIN
  -- walks the index below the floor, dead entries included: once per reaper run, not per claim
  PERFORM pgfence._outbox_floor_lower((
    SELECT o.next_attempt_at FROM pgfence.outbox o
    WHERE o.status = 'pending' AND o.attempts < o.max_attempts
      AND o.next_attempt_at < pgfence._outbox_at((SELECT f.last_value FROM pgfence.outbox_floor_seq f))
    ORDER BY o.next_attempt_at LIMIT 1));
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_check() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_check() IS
  'Private: lower the claim floor to a pending message below it (written with triggers bypassed).
Called by outbox_reap. Walks outbox_due_idx below the floor.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_floor_reset()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  c_lock CONSTANT bigint := 7094185336601403393;  -- the claim floor's mutex
BEGIN
  PERFORM pg_advisory_lock(c_lock);
  BEGIN
    PERFORM setval('pgfence.outbox_floor_seq', -9223372036854775808);
    PERFORM setval('pgfence.outbox_floor_guard_seq', -9223372036854775808);
    PERFORM setval('pgfence.outbox_floor_arm_seq', 0);
  EXCEPTION WHEN OTHERS OR query_canceled THEN
    PERFORM pg_advisory_unlock(c_lock);
    RAISE;
  END;
  PERFORM pg_advisory_unlock(c_lock);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_reset() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_reset() IS
  'Private: forget the claim floor (claims walk from the start until it is raised again).
For after writing outbox rows with the triggers bypassed; every migrate calls it.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_floor_insert()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._outbox_floor_lower((SELECT min(n.next_attempt_at) FROM outbox_floor_new n));
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_floor_insert() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_floor_insert() IS
  'Trigger: new messages due before the claim floor''s guard lower the floor to them.
AFTER INSERT statement trigger on pgfence.outbox (one call per statement, however many rows: a
bulk enqueue pays one read of the guard). Why: functions/16_outbox_floor.sql.';

CREATE OR REPLACE TRIGGER outbox_floor_insert
  AFTER INSERT ON pgfence.outbox
  REFERENCING NEW TABLE AS outbox_floor_new
  FOR EACH STATEMENT EXECUTE FUNCTION pgfence.tg_outbox_floor_insert();

CREATE OR REPLACE FUNCTION pgfence.tg_outbox_floor_update()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._outbox_floor_lower(NEW.next_attempt_at);
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_outbox_floor_update() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_outbox_floor_update() IS
  'Trigger: a message pending again (retry, reap, requeue) or due earlier lowers the claim floor.
Only when it is due before the floor''s guard.
AFTER UPDATE row trigger on pgfence.outbox, filtered by its WHEN condition: a claim or a mark
never calls it. Why: functions/16_outbox_floor.sql.';

CREATE OR REPLACE TRIGGER outbox_floor_update
  AFTER UPDATE ON pgfence.outbox
  FOR EACH ROW
  WHEN (NEW.status = 'pending' AND (OLD.status <> 'pending' OR NEW.next_attempt_at < OLD.next_attempt_at))
  EXECUTE FUNCTION pgfence.tg_outbox_floor_update();

-- Every migrate starts from no floor: a restore or a bypassed write since is then harmless.
SELECT pgfence._outbox_floor_reset();
