-- pgfence functions/00_core.sql — core: the schema version and the retry backoff.
--
-- Public: schema_version(), backoff(attempt, base, cap, jitter).
-- Private helpers every module uses: _ts (an instant as UTC text for JSON), _is_name (the rule
-- for channel, action and kind names), _check_violated (23514 for a row check a guard holds).
-- Also here: the comments of the core tables (meta, installed_migration).
-- The event log writer and the delete guards shared by every module: 01_core_events.sql.
--
-- Every file in functions/ is re-runnable (CREATE OR REPLACE, then REVOKE ... FROM PUBLIC,
-- GRANT EXECUTE by full signature to the group roles, COMMENT ON). `pgfence migrate` applies
-- them in file-name order, in one transaction, after the table migrations (tools/make_schema.py
-- copies them into schema/pgfence.sql in the same order). Errors: functions/ERRORS.md.

COMMENT ON TABLE pgfence.meta IS
  'One row: the schema version the migrations have brought this database to.
Read it with pgfence.schema_version().';
-- installed_migration came with migration 0012; tests/test_migrate_upgrade.py applies these
-- files to the tables of older schemas.
DO $comment$
BEGIN
  IF to_regclass('pgfence.installed_migration') IS NOT NULL THEN
    COMMENT ON TABLE pgfence.installed_migration IS
      'The migrations that schema/pgfence.sql contained, for a database installed from that file.
Empty when installed by pgfence migrate; pgfence migrate records them as applied instead of
running them. Not an API.';
  END IF;
END
$comment$;

-- Private helpers retired by issue 13 (one copy of each helper: _ts replaced both).
DROP FUNCTION IF EXISTS pgfence._ts(timestamptz);
DROP FUNCTION IF EXISTS pgfence._ts(timestamptz);

CREATE OR REPLACE FUNCTION pgfence._ts(p_at timestamptz)
RETURNS text
-- PL/pgSQL, like _is_name: a SQL function with a SET clause is never inlined, and is then
-- planned again on every call (this one runs in the operation event trigger, per claim and poll).
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RETURN to_char(p_at AT TIME ZONE 'UTC', 'YYYY-MM-DD"T"HH24:MI:SS.US"Z"');
END
$$;
REVOKE ALL ON FUNCTION pgfence._ts(timestamptz) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._ts(timestamptz) IS
  'Private: an instant as ISO-8601 text in UTC, for the JSON that pgfence writes (events, audit).
Independent of the session TimeZone.
Errors: none.';

CREATE OR REPLACE FUNCTION pgfence._is_name(p_name text)
RETURNS boolean
LANGUAGE plpgsql IMMUTABLE PARALLEL SAFE  -- not sql: see _ts
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RETURN p_name ~ '^[a-z0-9][a-z0-9_.-]{0,62}$';
END
$$;
REVOKE ALL ON FUNCTION pgfence._is_name(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._is_name(text) IS
  'Private: is this a valid pgfence name (outbox channel, plan action, operation kind)?
1-63 characters of a-z, 0-9, _ . -, starting with a letter or digit. NULL for NULL.
Errors: none.';

-- A row check that a guard trigger holds instead of a declared CHECK (migrations 0030, 0031:
-- PostgreSQL prepares every CHECK once per writing statement, and the one-statement fast paths
-- that skip the guards make their checks hold by construction): raised as PostgreSQL would.
CREATE OR REPLACE FUNCTION pgfence._check_violated(p_table text, p_constraint text, p_detail text,
                                                   p_hint text)
RETURNS void
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'new row for relation "%" violates check constraint "%"', p_table, p_constraint
    USING ERRCODE = 'check_violation', CONSTRAINT = p_constraint, SCHEMA = 'pgfence', TABLE = p_table,
          DETAIL = p_detail, HINT = p_hint;
END
$$;
REVOKE ALL ON FUNCTION pgfence._check_violated(text, text, text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._check_violated(text, text, text, text) IS
  'Private: raises 23514 (check_violation) for a row of pgfence.p_table, naming the constraint.
With SCHEMA, TABLE and CONSTRAINT set as for a declared CHECK. Called by the guard triggers that hold
what were CHECK constraints (tg_plan_guard, tg_plan_step_guard, tg_document_write,
tg_document_revision_insert) and by _plan_step_finish.
Errors: always 23514.';

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
  'The schema version the migrations brought this database to.
Client libraries compare it with the version they were written for and refuse to run against a
version they do not know.
Errors: none.';

-- delay = least(cap, base * 2^(attempt-1)) * (1 - jitter/2), computed in numeric seconds
-- counted as PostgreSQL compares intervals (a month is 30 days, so a year is 360 days:
-- `interval '1 year' < interval '365 days'`). So the result is never above the cap by
-- PostgreSQL's own comparison and no step overflows: the exponent is clamped at 80 (2^80
-- microseconds exceed the largest interval), and a denormal jitter (5e-324) is exact in
-- numeric. (Through double-precision epoch seconds a year was 365.25 days: a cap of 1 year was
-- exceeded by 1.5%, and one of 300000 years overflowed into a negative interval.) The result is
-- a plain time interval whenever one holds it, so now() + backoff(...) ignores the TimeZone.
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
Concurrent retries spread over [delay/2, delay]; p_jitter NULL = random. Measured as PostgreSQL
compares intervals (a month = 30 days, a year = 360 days): never above the cap, never negative,
never an overflow, whatever the attempt. A plain time interval whenever one holds it (up to
~285,000 years), so now() + backoff(...) does not depend on the session''s TimeZone.
Errors: 22004 (NULL attempt, base or cap), 22023 (base <= 0, cap < base, jitter outside [0,1)).';
