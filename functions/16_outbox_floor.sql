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
-- The floor is a pair (due time, id), the claims' order: a bulk enqueue gives thousands of
-- messages one due time, and only the id tells the sent ones from the pending. "Before" and
-- "the earliest" below are in that order.
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
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_id_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_id_seq IS
  'The outbox claim floor''s message id: no pending message is before (floor, this id). Not an API.
Due order is (next_attempt_at, id): a bulk enqueue gives every message one due time.';
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_guard_id_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_guard_id_seq IS
  'The message id of the outbox claim floor''s guard (with outbox_floor_guard_seq). Not an API.';
CREATE SEQUENCE IF NOT EXISTS pgfence.outbox_floor_version_seq AS bigint
  MINVALUE 0 START WITH 0 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_version_seq IS
  'Bumped before and after every write of the outbox claim floor (odd while writing). Not an API.
Readers retry when it changed under them, so a floor is never read half-written.';
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

-- The floor is a pair (due time, id) in two sequences, written under the mutex between two
-- bumps of the version sequence (a seqlock) and read by _outbox_floor_read, which retries when
-- the version moved: a claim never starts from a floor half old, half new.
CREATE OR REPLACE FUNCTION pgfence._outbox_floor_read(OUT p_at bigint, OUT p_id bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_before bigint;
BEGIN
  FOR i IN 1..3 LOOP
    v_before := (SELECT v.last_value FROM pgfence.outbox_floor_version_seq v);
    p_at := (SELECT f.last_value FROM pgfence.outbox_floor_seq f);
    p_id := (SELECT f.last_value FROM pgfence.outbox_floor_id_seq f);
    IF v_before % 2 = 0 AND v_before = (SELECT v.last_value FROM pgfence.outbox_floor_version_seq v) THEN
      RETURN;
    END IF;
  END LOOP;
  -- written under us three times: no floor for this call (always true, never wrong)
  p_at := -9223372036854775808;
  p_id := -9223372036854775808;
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_read() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_read() IS
  'Private: the claim floor (microseconds since 2000-01-01 UTC, message id), never half-written.
Retries while a writer is at work; after three tries returns no floor (the minimum pair).
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_floor_write(p_at bigint, p_id bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_version bigint := (SELECT v.last_value FROM pgfence.outbox_floor_version_seq v);
BEGIN
  -- even, so that an interrupted write (odd) heals on the next one
  v_version := v_version + 1 + v_version % 2;
  PERFORM setval('pgfence.outbox_floor_version_seq', v_version);
  PERFORM setval('pgfence.outbox_floor_seq', p_at);
  PERFORM setval('pgfence.outbox_floor_id_seq', p_id);
  PERFORM setval('pgfence.outbox_floor_version_seq', v_version + 1);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_write(bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_write(bigint, bigint) IS
  'Private: set the claim floor to (p_at microseconds since 2000-01-01 UTC, message id p_id).
The caller holds the floor''s mutex. Bumps the version before and after (_outbox_floor_read).
Errors: none.';

-- The writers' side: lower the floor (and the guard) to (p_at, p_id) when a message is now
-- pending and due before the guard. The read of the guard is the only cost of an ordinary write.
CREATE OR REPLACE FUNCTION pgfence._outbox_floor_lower(p_at timestamptz, p_id bigint)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_at  bigint := pgfence._outbox_us(p_at);
  v_gat bigint;
  v_gid bigint;
  v_fat bigint;
  v_fid bigint;
  c_lock    CONSTANT bigint := 7094185336601403393;  -- the claim floor's mutex
  c_writers CONSTANT bigint := 7094185336601403394;  -- the writers' lock
BEGIN
  IF v_at IS NULL OR p_id IS NULL THEN
    RETURN;
  END IF;
  -- held (shared) until this transaction ends: the floor is not raised past what it reads next
  PERFORM pg_advisory_xact_lock_shared(c_writers);
  -- the due time alone decides (one sequence: never half-written); a tie is settled below
  IF v_at > (SELECT g.last_value FROM pgfence.outbox_floor_guard_seq g) THEN
    RETURN;
  END IF;
  -- a session lock released at once (setval is not transactional, so nothing waits for the
  -- commit); released on any error too
  PERFORM pg_advisory_lock(c_lock);
  BEGIN
    SELECT g.last_value, gi.last_value INTO v_gat, v_gid
    FROM pgfence.outbox_floor_guard_seq g, pgfence.outbox_floor_guard_id_seq gi;
    IF (v_at, p_id) < (v_gat, v_gid) THEN
      PERFORM setval('pgfence.outbox_floor_guard_seq', v_at);
      PERFORM setval('pgfence.outbox_floor_guard_id_seq', p_id);
    END IF;
    SELECT r.p_at, r.p_id INTO v_fat, v_fid FROM pgfence._outbox_floor_read() r;
    IF (v_at, p_id) < (v_fat, v_fid) THEN
      PERFORM pgfence._outbox_floor_write(v_at, p_id);
    END IF;
  EXCEPTION WHEN OTHERS OR query_canceled THEN
    PERFORM pg_advisory_unlock(c_lock);
    RAISE;
  END;
  PERFORM pg_advisory_unlock(c_lock);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_lower(timestamptz, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_lower(timestamptz, bigint) IS
  'Private: message p_id is pending, due at p_at: lower the claim floor and its guard to it.
Only if they are above (in due order: due time, then id). Called after the row is written
(triggers outbox_floor_insert, outbox_floor_update, and the reaper''s check); why that suffices:
functions/16_outbox_floor.sql. NULL does nothing.
Errors: none.';

-- Step 2 then step 1 of the header, under the mutex; returns the floor.
CREATE OR REPLACE FUNCTION pgfence._outbox_floor_move()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_fat   bigint;
  v_fid   bigint;
  v_gat   bigint;
  v_gid   bigint;
  v_armed boolean;
  v_mat   bigint;
  v_mid   bigint;
  v_cap   bigint := pgfence._outbox_us(now() - interval '1 second');
  c_writers CONSTANT bigint := 7094185336601403394;  -- the writers' lock
BEGIN
  -- only mutex holders write these: read directly
  SELECT f.last_value, fi.last_value, g.last_value, gi.last_value, a.last_value <> 0
  INTO v_fat, v_fid, v_gat, v_gid, v_armed
  FROM pgfence.outbox_floor_seq f, pgfence.outbox_floor_id_seq fi, pgfence.outbox_floor_guard_seq g,
       pgfence.outbox_floor_guard_id_seq gi, pgfence.outbox_floor_arm_seq a;
  IF v_armed THEN
    -- no writer that may have read an older guard is still open (the lock is only probed)
    IF NOT pg_try_advisory_lock(c_writers) THEN
      RETURN;
    END IF;
    PERFORM pg_advisory_unlock(c_writers);
  END IF;
  -- the earliest pending message at or after the floor (matches outbox_due_idx), read by a
  -- statement that starts after the probe
  SELECT pgfence._outbox_us(o.next_attempt_at), o.id INTO v_mat, v_mid FROM pgfence.outbox o
  WHERE o.status = 'pending' AND o.attempts < o.max_attempts
    AND (o.next_attempt_at, o.id) >= (pgfence._outbox_at(v_fat), v_fid)
  ORDER BY o.next_attempt_at, o.id LIMIT 1;
  IF v_armed THEN
    IF v_mat IS NOT NULL AND (v_mat, v_mid) < (v_gat, v_gid) THEN
      v_gat := v_mat;
      v_gid := v_mid;
    END IF;
    IF (v_gat, v_gid) > (v_fat, v_fid) THEN
      PERFORM pgfence._outbox_floor_write(v_gat, v_gid);
      v_fat := v_gat;
      v_fid := v_gid;
    END IF;
  END IF;
  -- the next guard: the earliest pending message, capped at now() - 1 s, not below the floor
  IF v_mat IS NULL OR (v_cap, -9223372036854775808) < (v_mat, v_mid) THEN
    v_mat := v_cap;
    v_mid := -9223372036854775808;
  END IF;
  IF (v_mat, v_mid) < (v_fat, v_fid) THEN
    v_mat := v_fat;
    v_mid := v_fid;
  END IF;
  PERFORM setval('pgfence.outbox_floor_guard_id_seq', v_mid);
  PERFORM setval('pgfence.outbox_floor_guard_seq', v_mat);
  PERFORM setval('pgfence.outbox_floor_armed_at_seq', pgfence._outbox_us(now()));
  PERFORM setval('pgfence.outbox_floor_arm_seq', 1);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_move() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_move() IS
  'Private: raise the claim floor to its guard when no writer that read an older guard is open.
Then publish the next guard. The caller holds the floor''s mutex, in READ COMMITTED
(pgfence._outbox_floor). The algorithm: functions/16_outbox_floor.sql.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_floor(OUT p_at timestamptz, OUT p_id bigint)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_at       bigint;
  v_arm      bigint;
  v_armed_at bigint;
  c_lock CONSTANT bigint := 7094185336601403393;  -- the claim floor's mutex
BEGIN
  SELECT a.last_value, t.last_value INTO v_arm, v_armed_at
  FROM pgfence.outbox_floor_arm_seq a, pgfence.outbox_floor_armed_at_seq t;
  IF (v_arm = 0 OR pgfence._outbox_us(now()) - 50000 >= v_armed_at)
     AND current_setting('transaction_isolation') = 'read committed'
     AND pg_try_advisory_lock(c_lock) THEN
    BEGIN
      PERFORM pgfence._outbox_floor_move();
    EXCEPTION WHEN OTHERS OR query_canceled THEN
      PERFORM pg_advisory_unlock(c_lock);
      RAISE;
    END;
    PERFORM pg_advisory_unlock(c_lock);
  END IF;
  SELECT r.p_at, r.p_id INTO v_at, p_id FROM pgfence._outbox_floor_read() r;
  p_at := pgfence._outbox_at(v_at);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor() IS
  'Private: the claim floor (due time, id): no pending message is before it; first raised if due.
Called by outbox_claim before its walks. Raises it at most every 50 ms, only in READ COMMITTED,
and not while another session holds the floor''s mutex. (-infinity, minimum) = no floor.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._outbox_floor_check()
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  v_fat bigint;
  v_fid bigint;
  v_at  timestamptz;
  v_id  bigint;
BEGIN
  SELECT r.p_at, r.p_id INTO v_fat, v_fid FROM pgfence._outbox_floor_read() r;
  -- walks the index before the floor, dead entries included: once per reaper run, not per claim
  SELECT o.next_attempt_at, o.id INTO v_at, v_id FROM pgfence.outbox o
  WHERE o.status = 'pending' AND o.attempts < o.max_attempts
    AND (o.next_attempt_at, o.id) < (pgfence._outbox_at(v_fat), v_fid)
  ORDER BY o.next_attempt_at, o.id LIMIT 1;
  PERFORM pgfence._outbox_floor_lower(v_at, v_id);
END
$$;
REVOKE ALL ON FUNCTION pgfence._outbox_floor_check() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._outbox_floor_check() IS
  'Private: lower the claim floor to a pending message before it (written with triggers bypassed).
Called by outbox_reap. Walks outbox_due_idx before the floor.
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
    PERFORM pgfence._outbox_floor_write(-9223372036854775808, -9223372036854775808);
    PERFORM setval('pgfence.outbox_floor_guard_seq', -9223372036854775808);
    PERFORM setval('pgfence.outbox_floor_guard_id_seq', -9223372036854775808);
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
  PERFORM pgfence._outbox_floor_lower(n.next_attempt_at, n.id)
  FROM (SELECT m.next_attempt_at, m.id FROM outbox_floor_new m ORDER BY m.next_attempt_at, m.id LIMIT 1) n;
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
  PERFORM pgfence._outbox_floor_lower(NEW.next_attempt_at, NEW.id);
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
