-- pgfence functions/89_audit_cleanup.sql — auditing from psql: what holds back cleanup.
--
-- Public: views audit_cleanup_blockers (open transactions and snapshots, replication slots,
--         prepared transactions that keep VACUUM from removing dead rows, oldest first, with a
--         warn flag past pgfence.cleanup_warn_after), audit_table_health (dead and live rows,
--         sizes and the last vacuum of pgfence's hot tables)
-- Applied before 90_audit_owned.sql and 91_audit_health.sql, whose audit_stuck and
-- audit_queue_health show the same holders. Read-only views for pgfence_admin and pg_monitor.
-- Every claim walks past the index entries of rows that VACUUM could not remove yet, so one
-- snapshot held open for an hour makes every queue slower (issue 14: bench/outbox_pressure.py
-- measures it). Time: now(), the database clock.
-- Visibility: pg_stat_activity shows the transaction start and query of another role's
-- sessions only to members of pg_read_all_stats (pg_monitor is one); the xmin of every session
-- is shown to all.

CREATE OR REPLACE FUNCTION pgfence._audit_cleanup_warn_after()
RETURNS interval
LANGUAGE sql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT coalesce(nullif(current_setting('pgfence.cleanup_warn_after', true), '')::interval,
                  interval '5 minutes')
$$;
REVOKE ALL ON FUNCTION pgfence._audit_cleanup_warn_after() FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._audit_cleanup_warn_after() TO pgfence_admin, pg_monitor, pgfence_executor;  -- audit_metrics
COMMENT ON FUNCTION pgfence._audit_cleanup_warn_after() IS
  'Private: how long a holder of cleanup may be open before the audit views warn (default 5 minutes).
The setting pgfence.cleanup_warn_after (an interval; e.g. ALTER DATABASE ... SET
pgfence.cleanup_warn_after = ''2 min''); empty or unset = 5 minutes.
Errors: 22007 (the setting is not an interval).';

CREATE OR REPLACE VIEW pgfence.audit_cleanup_blockers AS
WITH holders AS (
  SELECT 'transaction'::text                                      AS kind,
         a.pid,
         coalesce(nullif(a.application_name, ''), a.backend_type) AS holder,
         a.usename::text COLLATE "default"                        AS role,
         a.state,
         CASE WHEN a.backend_xid IS NULL THEN a.backend_xmin
              WHEN a.backend_xmin IS NULL THEN a.backend_xid
              WHEN age(a.backend_xid) >= age(a.backend_xmin) THEN a.backend_xid
              ELSE a.backend_xmin END                              AS xmin,
         a.xact_start                                             AS since,
         left(a.query, 200)                                       AS query
  FROM pg_catalog.pg_stat_activity a
  WHERE (a.backend_xmin IS NOT NULL OR a.backend_xid IS NOT NULL)
    AND a.pid <> pg_catalog.pg_backend_pid()
    -- since PostgreSQL 14 only this database's sessions (and walsenders' feedback) hold back
    -- the cleanup of its tables
    AND (a.datname = current_database() OR a.backend_type = 'walsender')
  UNION ALL
  SELECT 'replication slot', s.active_pid, s.slot_name::text COLLATE "default", NULL,
         CASE WHEN s.active THEN 'active' ELSE 'inactive' END
           || CASE WHEN s.xmin IS NULL THEN ' (catalog_xmin only: holds back the catalogs)' ELSE '' END,
         coalesce(s.xmin, s.catalog_xmin), NULL::timestamptz, NULL::text
  FROM pg_catalog.pg_replication_slots s
  WHERE (s.xmin IS NOT NULL OR s.catalog_xmin IS NOT NULL)
    AND (s.database IS NULL OR s.database = current_database())
  UNION ALL
  SELECT 'prepared transaction', NULL::integer, p.gid, p.owner::text COLLATE "default", 'prepared', p.transaction,
         p.prepared, NULL::text
  FROM pg_catalog.pg_prepared_xacts p
  WHERE p.database = current_database()
)
SELECT h.kind, h.pid, h.holder, h.role, h.state, h.xmin,
       age(h.xmin)     AS xid_age,
       now() - h.since AS age,
       h.since,
       CASE WHEN h.kind = 'replication slot' THEN h.state LIKE 'inactive%'
            ELSE coalesce(now() - h.since > pgfence._audit_cleanup_warn_after(), false) END AS warn,
       h.query
FROM holders h
ORDER BY age(h.xmin) DESC, h.pid;
REVOKE ALL ON pgfence.audit_cleanup_blockers FROM PUBLIC;
GRANT SELECT ON pgfence.audit_cleanup_blockers TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_cleanup_blockers IS
  'What holds back VACUUM in this database, oldest first: transactions, slots, prepared transactions.
A row is a holder of an xmin: VACUUM keeps every row version deleted after it, so dead rows and
index entries pile up in the outbox, plans and operations, and claims walk past them. warn: open
longer than pgfence.cleanup_warn_after (default 5 minutes; a slot: inactive). The reading
session itself is not listed. Another role''s transaction start and query are shown only to
pg_read_all_stats (pg_monitor). End a holder with COMMIT / ROLLBACK, pg_terminate_backend(pid),
COMMIT PREPARED / ROLLBACK PREPARED, or pg_drop_replication_slot.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.kind IS
  'transaction (a session with an open snapshot or transaction id), replication slot, or prepared transaction.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.pid IS
  'The backend''s process id (a slot: its active walsender''s; a prepared transaction: NULL).';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.holder IS
  'application_name (else the backend type), the slot''s name, or the prepared transaction''s gid.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.role IS
  'The session''s or prepared transaction''s role (a slot: NULL).';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.state IS
  'pg_stat_activity.state (e.g. idle in transaction), active / inactive for a slot, prepared.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.xmin IS
  'The oldest transaction id it holds: the older of backend_xid and backend_xmin; a slot''s xmin (else catalog_xmin); the prepared transaction''s id.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.xid_age IS
  'age(xmin): how many transactions ago it began (what VACUUM cannot clean beyond).';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.age IS
  'How long it has been open (now() - since); NULL for a slot, or without the privilege to see it.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.since IS
  'When its transaction began (pg_stat_activity.xact_start) or was prepared; NULL for a slot.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.warn IS
  'Open longer than pgfence.cleanup_warn_after (default 5 minutes), or an inactive slot.';
COMMENT ON COLUMN pgfence.audit_cleanup_blockers.query IS
  'The session''s current or last statement (first 200 characters; pg_read_all_stats for another role''s).';

CREATE OR REPLACE VIEW pgfence.audit_table_health AS
SELECT s.relname::text                                                           AS table_name,
       s.n_live_tup                                                              AS live_rows,
       s.n_dead_tup                                                              AS dead_rows,
       round(s.n_dead_tup::numeric / nullif(s.n_live_tup + s.n_dead_tup, 0), 3)  AS dead_ratio,
       pg_catalog.pg_relation_size(s.relid)                                      AS table_bytes,
       pg_catalog.pg_indexes_size(s.relid)                                       AS index_bytes,
       greatest(s.last_autovacuum, s.last_vacuum)                                AS last_vacuum,
       s.autovacuum_count + s.vacuum_count                                       AS vacuums,
       greatest(s.last_autoanalyze, s.last_analyze)                              AS last_analyze
FROM pg_catalog.pg_stat_user_tables s
WHERE s.schemaname = 'pgfence'
  AND s.relname IN ('outbox', 'outbox_lapse', 'event', 'plan', 'plan_step', 'operation',
                    'document', 'document_revision')
ORDER BY s.n_dead_tup DESC, s.relname;
REVOKE ALL ON pgfence.audit_table_health FROM PUBLIC;
GRANT SELECT ON pgfence.audit_table_health TO pgfence_admin, pg_monitor;
COMMENT ON VIEW pgfence.audit_table_health IS
  'Dead and live rows, sizes and the last vacuum of pgfence''s hot tables, most dead rows first.
From pg_stat_user_tables (estimates, updated by the statistics system). Dead rows that stay high
after a vacuum: something in audit_cleanup_blockers holds them.';
COMMENT ON COLUMN pgfence.audit_table_health.table_name IS 'The table in schema pgfence.';
COMMENT ON COLUMN pgfence.audit_table_health.live_rows IS 'n_live_tup: live rows (estimate).';
COMMENT ON COLUMN pgfence.audit_table_health.dead_rows IS 'n_dead_tup: dead row versions not yet removed (estimate).';
COMMENT ON COLUMN pgfence.audit_table_health.dead_ratio IS 'dead_rows / (live_rows + dead_rows); NULL when both are 0.';
COMMENT ON COLUMN pgfence.audit_table_health.table_bytes IS 'pg_relation_size: the table''s main fork, in bytes.';
COMMENT ON COLUMN pgfence.audit_table_health.index_bytes IS 'pg_indexes_size: all its indexes, in bytes.';
COMMENT ON COLUMN pgfence.audit_table_health.last_vacuum IS 'The last vacuum, by autovacuum or by hand.';
COMMENT ON COLUMN pgfence.audit_table_health.vacuums IS 'How many vacuums (auto and manual) since the statistics were reset.';
COMMENT ON COLUMN pgfence.audit_table_health.last_analyze IS 'The last analyze, by autovacuum or by hand.';
