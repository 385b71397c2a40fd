-- pgfence functions/00_core.sql — shared helpers: schema version, backoff, the event log writer
-- and its guards, the purge-only delete guard shared by the modules' tables.
--
-- Every file in functions/ is re-runnable: CREATE OR REPLACE, followed by REVOKE ... FROM
-- PUBLIC, GRANT EXECUTE to the group role(s) that need it, and COMMENT ON. `pgfence migrate`
-- applies them in file-name order, in one transaction, after the table migrations.
-- Errors: see functions/ERRORS.md (our SQLSTATE class is PF).

CREATE OR REPLACE FUNCTION pgfence.schema_version()
RETURNS integer
LANGUAGE sql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT schema_version FROM pgfence.meta;
$$;
REVOKE ALL ON FUNCTION pgfence.schema_version() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.schema_version() TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.schema_version() IS
  'Schema version the migrations brought this database to. Client libraries compare it with the version they were written for and refuse to run against one they do not know. Errors: none.';

-- Capped exponential backoff with jitter:
-- delay = least(cap, base * 2^(attempt-1)) * (1 - jitter/2), jitter in [0,1) (random if NULL).
-- Computed in numeric seconds measured as PostgreSQL compares intervals (a month is 30 days,
-- so a year is 360 days: `interval '1 year' < interval '365 days'`), so the result is never
-- above the cap by PostgreSQL's own comparison, and no step can overflow or underflow: the
-- exponent is clamped at 80 (2^80 microseconds exceed the largest interval, so attempt =
-- 2^31-1 gives the cap), and a denormal jitter (5e-324) is exact in numeric. (Through
-- double-precision epoch seconds a year was 365.25 days, so a cap of 1 year was exceeded by
-- 1.5%, and a cap of 300000 years overflowed into a negative interval.)
-- The result is a plain time interval (hours, minutes, seconds) whenever it fits one (up to
-- about 285,000 years), so now() + backoff(...) does not depend on the session's TimeZone.
CREATE OR REPLACE FUNCTION pgfence.backoff(
  p_attempt integer,
  p_base    interval,
  p_cap     interval,
  p_jitter  double precision DEFAULT NULL
)
RETURNS interval
LANGUAGE plpgsql VOLATILE PARALLEL SAFE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_jitter double precision := coalesce(p_jitter, random());
  v_base_s numeric;
  v_cap_s  numeric;
  v_s      numeric;
  v_months numeric;
  v_days   numeric;
BEGIN
  IF p_attempt IS NULL OR p_base IS NULL OR p_cap IS NULL THEN
    RAISE EXCEPTION 'backoff: attempt, base and cap are required'
      USING ERRCODE = '22004', DETAIL = 'A NULL argument gives no delay.',
            HINT = 'Pass the attempt number and the channel''s backoff_base and backoff_cap.';
  END IF;
  IF p_base <= interval '0' OR p_cap < p_base THEN
    RAISE EXCEPTION 'backoff: need 0 < base <= cap (got base %, cap %)', p_base, p_cap
      USING ERRCODE = '22023', DETAIL = 'Intervals compare as PostgreSQL compares them (a month is 30 days).',
            HINT = 'Use a positive base and a cap at least as large.';
  END IF;
  IF v_jitter < 0 OR v_jitter >= 1 THEN   -- NaN sorts above every number: refused too
    RAISE EXCEPTION 'backoff: jitter must be in [0, 1) (got %)', v_jitter
      USING ERRCODE = '22023', DETAIL = 'The delay is scaled by (1 - jitter/2).',
            HINT = 'Pass NULL for a random jitter.';
  END IF;
  -- seconds as interval comparison counts them: epoch counts a year as 365.25 days
  v_base_s := extract(epoch FROM p_base) - 453600 * extract(year FROM p_base);
  v_cap_s  := extract(epoch FROM p_cap) - 453600 * extract(year FROM p_cap);
  v_s := least(v_cap_s, v_base_s * power(2::numeric, least(greatest(p_attempt, 1) - 1, 80)))
         * (1 - v_jitter::numeric / 2);
  IF v_s < 9e12 THEN
    RETURN least(make_interval(secs => v_s::double precision), p_cap);
  END IF;
  -- beyond what the time field of an interval holds: 30-day months, days and seconds
  v_months := floor(v_s / 2592000);
  IF v_months > 2147483647 THEN
    RETURN p_cap;
  END IF;
  v_days := floor((v_s - v_months * 2592000) / 86400);
  RETURN least(make_interval(months => v_months::integer, days => v_days::integer,
                             secs => (v_s - v_months * 2592000 - v_days * 86400)::double precision),
               p_cap);
END
$$;
REVOKE ALL ON FUNCTION pgfence.backoff(integer, interval, interval, double precision) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.backoff(integer, interval, interval, double precision)
  TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.backoff(integer, interval, interval, double precision) IS
  'Delay before retry number p_attempt: least(cap, base * 2^(attempt-1)) * (1 - jitter/2).
Concurrent retries spread over [delay/2, delay]. Measured as PostgreSQL compares intervals (a month = 30 days, a year = 360 days): never above the cap, never negative, never an overflow, whatever the attempt. A plain time interval whenever one holds it (up to ~285,000 years). p_jitter NULL = random.
Errors: 22004 (NULL attempt, base or cap), 22023 (base <= 0, cap < base, jitter outside [0,1)).';

-- The event log writer, shared by every module's triggers.
CREATE OR REPLACE FUNCTION pgfence._event(
  p_module      text,
  p_item_id     bigint,
  p_event       text,
  p_from_status text DEFAULT NULL,
  p_to_status   text DEFAULT NULL,
  p_fence       bigint DEFAULT NULL,
  p_detail      jsonb DEFAULT NULL,
  p_actor       text DEFAULT NULL
)
RETURNS void
LANGUAGE sql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
  VALUES (p_module, p_item_id, p_event, p_from_status, p_to_status,
          coalesce(p_actor, nullif(current_setting('pgfence.actor', true), ''), session_user::text),
          p_fence, p_detail);
$$;
REVOKE ALL ON FUNCTION pgfence._event(text, bigint, text, text, text, bigint, jsonb, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._event(text, bigint, text, text, text, bigint, jsonb, text) IS
  'Private: append one row to pgfence.event in the current transaction. The actor is p_actor, else the transaction-local setting pgfence.actor (set by functions that take a worker / by argument, see _set_actor), else session_user.';

-- The actor ends with the call that named it: such a function calls _set_actor(NULL) before
-- each RETURN (an error rolls the setting back with the call's work). Not a function-level
-- SET pgfence.actor = '' clause: on PostgreSQL 15 a SET clause naming a custom setting makes
-- CREATE FUNCTION need GRANT SET ON PARAMETER, which a non-superuser owner does not have.
CREATE OR REPLACE FUNCTION pgfence._set_actor(p_actor text)
RETURNS void
LANGUAGE sql VOLATILE
-- No SET clause on purpose: a function-level SET would undo this set_config at exit.
AS $$
  SELECT pg_catalog.set_config('pgfence.actor', coalesce(p_actor, ''), true);
$$;
REVOKE ALL ON FUNCTION pgfence._set_actor(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._set_actor(text) IS
  'Private: name the actor (worker, approver, user) that the event log records for the changes that follow; NULL clears it. A calling function clears it (_set_actor(NULL)) before each RETURN, so that the name ends with the call instead of leaking into the rest of the caller''s transaction.';

-- ---------------------------------------------------------------------------------------------
-- Deletes only in a purge; the event log is append-only
--
-- Items (plans, their steps, operations, events) disappear only through CALL
-- pgfence.audit_purge, whose batch function runs with the setting pgfence.purging = on. Any
-- other DELETE is refused (PF002) by a statement-level trigger whose WHEN condition is false
-- while purging, so a purge pays nothing per row. This is a safety catch against a stray
-- DELETE in psql, not a permission: no pgfence role can write the tables at all, and their
-- owner can disable triggers. A DBA who must delete by hand does it in a transaction with
-- SET LOCAL pgfence.purging = on. (TRUNCATE is not guarded: it needs the owner, and is what
-- the benchmarks use to reset.)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_purge_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF current_setting('pgfence.purging', true) IS DISTINCT FROM 'on' THEN
    RAISE EXCEPTION 'pgfence.%: rows are deleted only by a purge', TG_TABLE_NAME
      USING ERRCODE = 'PF002',
            DETAIL = 'Items, their receipts and their events are the audit trail; pgfence.audit_purge deletes finished ones after their retention period.',
            HINT = 'CALL pgfence.audit_purge(module, older_than). To delete by hand on purpose, do it in a transaction with SET LOCAL pgfence.purging = on.';
  END IF;
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_purge_only() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_purge_only() IS
  'BEFORE DELETE statement trigger (shared by pgfence.event, outbox, plan, plan_step and operation; filtered by WHEN pgfence.purging is not on): refuses the DELETE (PF002) unless the transaction-local setting pgfence.purging is on, as pgfence._audit_purge_batch sets it.';

-- Inserts are not guarded: an event has no initial state to check, and db_user and txid come
-- from their column defaults. (A WHEN-filtered row trigger checking them was measured at +3 us
-- per event, +20% on an event insert, which the outbox pays on its hot path when a channel logs
-- events; only the tables' owner can insert, and the owner can disable any trigger anyway.)
CREATE OR REPLACE FUNCTION pgfence.tg_event_append_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'pgfence.event is append-only: an event is never changed'
    USING ERRCODE = 'PF002', HINT = 'Events record what happened; the purge deletes old ones (pgfence.audit_purge).';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_event_append_only() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_event_append_only() IS
  'BEFORE UPDATE statement trigger on pgfence.event: refuses any UPDATE (PF002), the log is append-only. Costs nothing on the normal path (events are never updated).';

CREATE OR REPLACE TRIGGER event_no_update
  BEFORE UPDATE ON pgfence.event
  FOR EACH STATEMENT EXECUTE FUNCTION pgfence.tg_event_append_only();
CREATE OR REPLACE TRIGGER event_purge_only
  BEFORE DELETE ON pgfence.event
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION pgfence.tg_purge_only();
