-- pgfence functions/99_owner.sql — who owns pgfence's functions and views, and what that owner may
-- do. Applied last by every `pgfence migrate` (and at the end of schema/pgfence.sql).
--
-- Every function, procedure and view of schema pgfence belongs to pgfence_definer, a NOLOGIN role
-- (created by schema/preflight.sql) that owns no table. A SECURITY DEFINER function runs with
-- that role's privileges, whoever installed pgfence (a superuser too): exactly the table
-- privileges granted below. It cannot drop, alter or truncate a table, disable a trigger (the
-- guards), change an event (no UPDATE on pgfence.event) or a revision, write pgfence.meta,
-- create anything, or read any other schema. The tables stay with the installing login, which
-- is a member of pgfence_definer (so that it can replace the functions on the next migrate);
-- pgfence_definer is a member of nothing.
--
-- A new table gets no privilege until it is listed here (tests/pgtap/99_owner.sql lists them);
-- pgfence.installed_migration gets none (only migrate reads it).

GRANT USAGE ON SCHEMA pgfence TO pgfence_definer;

REVOKE ALL ON pgfence.meta, pgfence.event, pgfence.outbox_channel, pgfence.outbox,
  pgfence.outbox_lapse, pgfence.outbox_key, pgfence.plan_action, pgfence.plan, pgfence.plan_step, pgfence.operation,
  pgfence.document_kind, pgfence.document, pgfence.document_revision
  FROM pgfence_definer;
GRANT SELECT                         ON pgfence.meta              TO pgfence_definer;
GRANT SELECT, INSERT, DELETE         ON pgfence.event             TO pgfence_definer;  -- append-only; the purge deletes
GRANT SELECT, INSERT, UPDATE         ON pgfence.outbox_channel    TO pgfence_definer;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.outbox            TO pgfence_definer;
GRANT SELECT, INSERT, DELETE         ON pgfence.outbox_lapse      TO pgfence_definer;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.outbox_key        TO pgfence_definer;  -- derived state: deleted when idle
GRANT SELECT, INSERT, UPDATE         ON pgfence.plan_action       TO pgfence_definer;
GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.plan              TO pgfence_definer;
GRANT SELECT, INSERT, UPDATE         ON pgfence.plan_step         TO pgfence_definer;  -- purged with its plan (ON DELETE CASCADE)
GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.operation         TO pgfence_definer;
GRANT SELECT, INSERT, UPDATE         ON pgfence.document_kind     TO pgfence_definer;
GRANT SELECT, INSERT, UPDATE         ON pgfence.document          TO pgfence_definer;  -- a delete is a tombstone version
GRANT SELECT, INSERT                 ON pgfence.document_revision TO pgfence_definer;  -- immutable
-- The executor registry (migration 0016); guarded, so that these files also apply to a schema
-- of an earlier migration (tests/test_migrate_upgrade.py applies them to one).
DO $registry$
BEGIN
  IF to_regclass('pgfence.executor') IS NOT NULL THEN
    REVOKE ALL ON pgfence.executor FROM pgfence_definer;
    GRANT SELECT, INSERT, UPDATE, DELETE ON pgfence.executor TO pgfence_definer;
  END IF;
END
$registry$;
-- outbox_enqueue_many takes its ids from the identity sequence up front (nextval), to insert in
-- input order; every other insert takes them from the identity default, which needs no grant.
REVOKE ALL ON SEQUENCE pgfence.outbox_id_seq FROM pgfence_definer;
GRANT USAGE ON SEQUENCE pgfence.outbox_id_seq TO pgfence_definer;

-- Hand every function, procedure and view not yet owned by pgfence_definer to it (new ones, and
-- all of them on the upgrade that introduced the role). A non-superuser may give an object to a
-- role only when that role may create in the schema: it may, for the length of this block.
DO $owner$
DECLARE
  v_stmt  text;
  v_grant boolean := false;
BEGIN
  FOR v_stmt IN
    SELECT format('ALTER %s %s OWNER TO pgfence_definer',
                  CASE p.prokind WHEN 'p' THEN 'PROCEDURE' ELSE 'FUNCTION' END, p.oid::regprocedure)
    FROM pg_catalog.pg_proc p
    WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proowner <> 'pgfence_definer'::regrole
    UNION ALL
    SELECT format('ALTER VIEW %s OWNER TO pgfence_definer', c.oid::regclass)
    FROM pg_catalog.pg_class c
    WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind = 'v' AND c.relowner <> 'pgfence_definer'::regrole
    ORDER BY 1
  LOOP
    IF NOT v_grant AND NOT pg_catalog.has_schema_privilege('pgfence_definer', 'pgfence', 'CREATE') THEN
      GRANT CREATE ON SCHEMA pgfence TO pgfence_definer;
      v_grant := true;
    END IF;
    EXECUTE v_stmt;
  END LOOP;
  IF v_grant THEN
    REVOKE CREATE ON SCHEMA pgfence FROM pgfence_definer;
  END IF;
END
$owner$;
