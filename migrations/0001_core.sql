-- pgfence 0001 — core: the schema, the three group roles, the schema-version row.
--
-- Forward-only (yoyo-migrations). Tables live here; functions, views, triggers and grants live
-- in functions/*.sql and are re-applied by every `pgfence migrate`.
-- depends:

CREATE SCHEMA IF NOT EXISTS pgfence;
COMMENT ON SCHEMA pgfence IS
  'pgfence: durable step execution (outbox, approved plans, long operations) and versioned documents. Public surface = functions and views; tables are implementation and are not granted to anyone.';

-- Group roles (cluster-wide, NOLOGIN). Created if absent; a concurrent creator is not an error.
DO $roles$
DECLARE
  r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['pgfence_client', 'pgfence_executor', 'pgfence_admin'] LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles WHERE rolname = r) THEN
      BEGIN
        EXECUTE format('CREATE ROLE %I NOLOGIN', r);
      EXCEPTION WHEN duplicate_object OR unique_violation THEN
        NULL;
      END;
    END IF;
  END LOOP;
END
$roles$;

REVOKE ALL ON SCHEMA pgfence FROM PUBLIC;
GRANT USAGE ON SCHEMA pgfence TO pgfence_client, pgfence_executor, pgfence_admin;

CREATE TABLE pgfence.meta (
  singleton      boolean PRIMARY KEY DEFAULT true CHECK (singleton),
  schema_version integer NOT NULL CHECK (schema_version > 0),
  installed_at   timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE pgfence.meta IS
  'One row: the schema version that the migrations have brought this database to (read it with pgfence.schema_version()).';
INSERT INTO pgfence.meta (schema_version) VALUES (1);

-- The event log: one row per transition (and per receipt / conflict where a module says so),
-- written by the modules' triggers in the same transaction as the change it records, so a
-- rolled-back transition leaves no event. Append-only: triggers (functions/00_core.sql) refuse
-- UPDATE always and DELETE outside a purge (pgfence.audit_purge).
CREATE TABLE pgfence.event (
  id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  module      text NOT NULL CHECK (module IN ('outbox', 'plan', 'operation', 'document')),
  item_id     bigint NOT NULL,
  event       text NOT NULL CHECK (event ~ '^[a-z_]{1,40}$'),
  from_status text,
  to_status   text,
  actor       text,
  db_user     text NOT NULL DEFAULT session_user,
  fence       bigint,
  detail      jsonb,
  at          timestamptz NOT NULL DEFAULT clock_timestamp(),
  txid        xid8 NOT NULL DEFAULT pg_current_xact_id()
);
COMMENT ON TABLE pgfence.event IS
  'Append-only event log of every module: transitions with who made them and under which fence token, receipts, errors with SQLSTATE, document save outcomes. Written by the modules'' triggers and functions in the same transaction as the change. Not an API: read it through the audit views.';
COMMENT ON COLUMN pgfence.event.actor IS
  'Who made the change: the worker, approver or user passed to the pgfence function (via the transaction-local setting pgfence.actor), else the database session user.';
COMMENT ON COLUMN pgfence.event.db_user IS
  'The database login (session_user) whose transaction wrote the event, whatever name it passed as actor and whatever role it had SET: two actors with one db_user are one login. Filled by its default (the modules'' event writers never set it).';
COMMENT ON COLUMN pgfence.event.fence IS
  'The fence token in force after the change (outbox attempts, operation fence), when the module has one.';
CREATE INDEX event_item_idx ON pgfence.event (module, item_id, id);
CREATE INDEX event_at_idx ON pgfence.event (at);
