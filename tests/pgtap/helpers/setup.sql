-- Shared fixture for every pgTAP file: quiet output, UTC, and helpers for a second session.
--
-- A file runs inside BEGIN ... ROLLBACK, so rows it writes are invisible to other sessions.
-- Concurrency tests therefore drive real extra sessions with dblink (connection string from
-- the database setting pgfence.test_peer_dsn, written by tests/run_pgtap.py) and commit their
-- fixtures there, on channels / keys unique to the test, deleting them at the end.
\set QUIET 1
SET client_min_messages = warning;
SET TIME ZONE 'UTC';
SET search_path = public, pgfence;

CREATE SCHEMA IF NOT EXISTS tap_helpers;

-- Open (or reopen) a named dblink session to this database as the test user.
CREATE OR REPLACE FUNCTION tap_helpers.peer(p_name text)
RETURNS text LANGUAGE plpgsql AS $$
BEGIN
  IF p_name = ANY (coalesce(dblink_get_connections(), '{}')) THEN
    PERFORM dblink_disconnect(p_name);
  END IF;
  PERFORM dblink_connect(p_name, current_setting('pgfence.test_peer_dsn'));
  PERFORM dblink_exec(p_name, 'SET client_min_messages = warning');
  RETURN p_name;
END $$;

-- Run one statement in a peer session and return its single scalar result as text.
CREATE OR REPLACE FUNCTION tap_helpers.peer_value(p_name text, p_sql text)
RETURNS text LANGUAGE plpgsql AS $$
DECLARE v text;
BEGIN
  SELECT x INTO v FROM dblink(p_name, p_sql) AS t(x text);
  RETURN v;
END $$;

-- Close every peer session.
CREATE OR REPLACE FUNCTION tap_helpers.close_peers()
RETURNS void LANGUAGE plpgsql AS $$
DECLARE n text;
BEGIN
  FOREACH n IN ARRAY coalesce(dblink_get_connections(), '{}') LOOP
    PERFORM dblink_disconnect(n);
  END LOOP;
END $$;
