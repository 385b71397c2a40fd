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
