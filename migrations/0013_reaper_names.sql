-- pgfence 0013 — schema version 13: the functions of this release use the new names.
-- depends: 0010_plan_run_token 0012_install_record
--
-- No table changes. The re-cut of issue 13 renamed two reapers (outbox_reap, plan_reap; the
-- former names outbox_reclaim_stale and plan_reap_stale stay as deprecated wrappers) and merged
-- private helpers (pgfence._ts, pgfence._is_name). Functions are re-applied by every migrate, so
-- a database only has the new names after a migrate; this version bump makes the glue's version
-- check refuse a database that was not migrated, instead of failing later with 42883.

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 13);
