-- pgTAP: who owns pgfence's functions — role pgfence_definer, its privileges, and what a SECURITY
-- DEFINER function therefore cannot do (functions/99_owner.sql, schema/preflight.sql).
-- Runs as the installing login, which is not a superuser (tests/run_pgtap.py).
BEGIN;
\ir helpers/setup.sql
SELECT plan(30);

-- the role
SELECT has_role('pgfence_definer', 'role pgfence_definer exists');
SELECT is((SELECT format('super=%s login=%s createrole=%s createdb=%s replication=%s bypassrls=%s',
                         rolsuper, rolcanlogin, rolcreaterole, rolcreatedb, rolreplication, rolbypassrls)
           FROM pg_roles WHERE rolname = 'pgfence_definer'),
          'super=f login=f createrole=f createdb=f replication=f bypassrls=f',
          'pgfence_definer is a plain NOLOGIN role: no superuser, no CREATEROLE, no BYPASSRLS');
SELECT is((SELECT count(*)::int FROM pg_auth_members WHERE member = 'pgfence_definer'::regrole), 0,
          'pgfence_definer is a member of no role (it has only what is granted to it)');
SELECT ok(pg_has_role(current_user, 'pgfence_definer', 'MEMBER'), 'the installing login is a member of pgfence_definer (it replaces the functions)');

-- what it owns
SELECT is((SELECT array_agg(p.oid::regprocedure::text ORDER BY 1) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proowner <> 'pgfence_definer'::regrole),
          NULL, 'every pgfence function and procedure belongs to pgfence_definer');
SELECT is((SELECT array_agg(p.oid::regprocedure::text ORDER BY 1) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace AND p.prosecdef AND p.proowner <> 'pgfence_definer'::regrole),
          NULL, 'so every SECURITY DEFINER function runs as pgfence_definer, whoever installed pgfence');
SELECT is((SELECT array_agg(c.relname::text ORDER BY 1) FROM pg_class c
           WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind = 'v' AND c.relowner <> 'pgfence_definer'::regrole),
          NULL, 'every pgfence view belongs to pgfence_definer');
SELECT is((SELECT array_agg(c.relname::text ORDER BY 1) FROM pg_class c
           WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('r', 'p', 'S', 'i')
             AND c.relowner = 'pgfence_definer'::regrole),
          NULL, 'pgfence_definer owns no table, sequence or index');
SELECT isnt((SELECT nspowner FROM pg_namespace WHERE nspname = 'pgfence'), 'pgfence_definer'::regrole::oid,
            'nor the schema');
SELECT ok(NOT has_schema_privilege('pgfence_definer', 'pgfence', 'CREATE'), 'it may not create objects in schema pgfence');

-- exactly the table privileges of functions/99_owner.sql (a new table must be added there)
SELECT is(
  (SELECT array_agg(format('%s: %s', c.relname,
            coalesce((SELECT string_agg(p, ',' ORDER BY p) FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE', 'TRUNCATE', 'REFERENCES', 'TRIGGER']) AS p
                      WHERE has_table_privilege('pgfence_definer', c.oid, p)), '-')) ORDER BY c.relname)
   FROM pg_class c WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind = 'r' AND c.relname NOT LIKE '%yoyo%'),
  ARRAY['document: INSERT,SELECT,UPDATE', 'document_kind: INSERT,SELECT,UPDATE', 'document_revision: INSERT,SELECT',
        'event: DELETE,INSERT,SELECT', 'executor: DELETE,INSERT,SELECT,UPDATE', 'installed_migration: -', 'meta: SELECT',
        'operation: DELETE,INSERT,SELECT,UPDATE', 'outbox: DELETE,INSERT,SELECT,UPDATE',
        'outbox_channel: INSERT,SELECT,UPDATE', 'outbox_key: DELETE,INSERT,SELECT,UPDATE', 'outbox_lapse: DELETE,INSERT,SELECT',
        'plan: DELETE,INSERT,SELECT,UPDATE', 'plan_action: INSERT,SELECT,UPDATE', 'plan_step: INSERT,SELECT,UPDATE'],
  'pgfence_definer holds exactly the listed table privileges: no TRUNCATE, no UPDATE of events or revisions, meta read-only');
SELECT is((SELECT array_agg(c.relname::text ORDER BY 1) FROM pg_class c
           WHERE c.relnamespace = 'pgfence'::regnamespace AND CASE WHEN c.relkind = 'S' THEN has_sequence_privilege('pgfence_definer', c.oid, 'USAGE') END),
          ARRAY['outbox_id_seq'], 'and USAGE on the one sequence a function draws from by hand (outbox_enqueue_many)');
SELECT is((SELECT array_agg(c.relname::text ORDER BY 1) FROM pg_class c
           WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relname LIKE '%yoyo%'
             AND (has_table_privilege('pgfence_definer', c.oid, 'SELECT') OR has_table_privilege('pgfence_definer', c.oid, 'INSERT'))),
          NULL, 'and nothing on the migration bookkeeping');

-- no custom setting in a SET clause: installing needs no GRANT SET ON PARAMETER
SELECT is((SELECT array_agg(p.oid::regprocedure::text ORDER BY 1) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace AND EXISTS (SELECT 1 FROM unnest(p.proconfig) c WHERE c LIKE 'pgfence.%')),
          NULL, 'no pgfence function sets pgfence.actor or pgfence.purging in a SET clause');
SELECT pgfence.plan_register_action('tap.owner_ext', NULL, 'an external action for 99_owner');
SELECT ok(pgfence.plan_propose('[{"action": "tap.owner_ext", "args": {"recipient": "http://127.0.0.1:9/x", "payload": {}}}]', 'tap-owner-agent') > 0, 'a proposal names its actor ...');
SELECT is(coalesce(current_setting('pgfence.actor', true), ''), '', '... and the name does not outlive the call');
SELECT is((SELECT actor FROM pgfence.event WHERE module = 'plan' AND event = 'propose' ORDER BY id DESC LIMIT 1),
          'tap-owner-agent', 'the event of that call carries it');
SELECT is(pgfence.outbox_reap(), 0, 'an early return (nothing to reap) ...');
SELECT is(coalesce(current_setting('pgfence.actor', true), ''), '', '... clears the actor too');

-- the definer functions run as pgfence_definer, whoever calls them
CREATE TABLE tap_helpers.seen (who text);
GRANT INSERT ON tap_helpers.seen TO pgfence_definer;
GRANT USAGE, CREATE ON SCHEMA tap_helpers TO pgfence_definer;
CREATE FUNCTION tap_helpers.tg_seen() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO tap_helpers.seen VALUES (current_user);
  RETURN NULL;
END $$;
CREATE TRIGGER tap_seen AFTER INSERT ON pgfence.outbox FOR EACH ROW EXECUTE FUNCTION tap_helpers.tg_seen();
SET LOCAL ROLE pgfence_client;
SELECT pgfence.outbox_enqueue('tap-owner', 'r', '{}');
RESET ROLE;
SELECT pgfence.outbox_enqueue('tap-owner', 'r', '{}');
SELECT is((SELECT array_agg(DISTINCT who) FROM tap_helpers.seen), ARRAY['pgfence_definer'::text],
          'outbox_enqueue writes as pgfence_definer, called by a client or by the installing login');
DROP TRIGGER tap_seen ON pgfence.outbox;

-- what a function owned by pgfence_definer cannot do: a SECURITY DEFINER probe owned by it runs
-- each statement with exactly the privileges every pgfence definer function has
CREATE TABLE tap_helpers.secret (x int);
INSERT INTO tap_helpers.secret VALUES (1);
CREATE FUNCTION tap_helpers.as_definer(p_sql text) RETURNS void LANGUAGE plpgsql SECURITY DEFINER
SET search_path = pg_catalog, pg_temp AS $$
BEGIN
  EXECUTE p_sql;
END $$;
ALTER FUNCTION tap_helpers.as_definer(text) OWNER TO pgfence_definer;
SELECT lives_ok($$SELECT tap_helpers.as_definer('SELECT count(*) FROM pgfence.outbox')$$, 'the probe may read what the functions read');
SELECT throws_ok($$SELECT tap_helpers.as_definer('TRUNCATE pgfence.outbox')$$, '42501', NULL, 'it may not TRUNCATE a table');
SELECT throws_ok($$SELECT tap_helpers.as_definer('ALTER TABLE pgfence.outbox DISABLE TRIGGER outbox_guard')$$, '42501', NULL, 'nor disable a guard trigger (only the tables'' owner may)');
SELECT throws_ok($$SELECT tap_helpers.as_definer('DROP TABLE pgfence.plan_step')$$, '42501', NULL, 'nor drop a table');
SELECT throws_ok($$SELECT tap_helpers.as_definer('UPDATE pgfence.event SET actor = ''forged''')$$, '42501', NULL, 'nor change an event (no UPDATE on the log, beneath its trigger)');
SELECT throws_ok($$SELECT tap_helpers.as_definer('UPDATE pgfence.meta SET schema_version = 1')$$, '42501', NULL, 'nor write the schema version');
SELECT throws_ok($$SELECT tap_helpers.as_definer('CREATE TABLE pgfence.intruder (x int)')$$, '42501', NULL, 'nor create anything in schema pgfence');
SELECT throws_ok($$SELECT tap_helpers.as_definer('SELECT * FROM tap_helpers.secret')$$, '42501', NULL, 'nor read an application''s table');
SELECT throws_ok($$SELECT tap_helpers.as_definer('SET session_replication_role = replica')$$, '42501', NULL, 'nor switch the triggers off for its session');
SELECT throws_ok($$SELECT tap_helpers.as_definer('CREATE ROLE tap_intruder')$$, '42501', NULL, 'nor create a role');

SELECT * FROM finish();
ROLLBACK;
