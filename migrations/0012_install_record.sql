-- pgfence 0012 — a database installed from schema/pgfence.sql records which migrations it holds.
-- depends: 0009_operation_kind_queue
--
-- schema/pgfence.sql installs everything in one file, for clients without Python; yoyo's own
-- bookkeeping (pgfence._yoyo_migration) is created by the first `pgfence migrate`. So that the
-- migrate after a file install applies only what the file did not contain, the file writes the
-- ids of the migrations it holds here, and migrate records those as applied (yoyo's "mark")
-- before looking for pending ones. A database installed by `pgfence migrate` has this table
-- too, empty: both ways give the same catalog (tests/test_schema_file.py).
--
-- The same release hands every function and view to role pgfence_definer (functions/99_owner.sql,
-- re-applied by every migrate; the role is created by schema/preflight.sql).

CREATE TABLE pgfence.installed_migration (
  migration_id text PRIMARY KEY CHECK (migration_id ~ '^[0-9]{4}_[a-z0-9_]+$'),
  installed_at timestamptz NOT NULL DEFAULT now()
);
COMMENT ON TABLE pgfence.installed_migration IS
  'The migrations that schema/pgfence.sql contained, for a database installed from that file (empty when installed by pgfence migrate): pgfence migrate records them as applied instead of running them. Not an API.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 12);
