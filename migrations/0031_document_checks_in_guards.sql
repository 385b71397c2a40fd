-- pgfence 0031 — documents: the CHECK constraints of document and document_revision move into
-- their guard triggers, which the save's fast path skips.
-- depends: 0030_plan_step_checks
--
-- Issue 14: PostgreSQL 15 re-reads every CHECK constraint of a table once per write statement
-- (ExecRelCheck: stringToNode and ExecPrepareExpr of each constraint's expression, for every
-- execution of a cached plan), whether or not the statement can break it. document_save's fast
-- path (migration 0024) writes a document row and a revision in one statement and paid for
-- 11 such constraints on every save, about a quarter of its backend time. Every one of them holds
-- on that path by construction (docs/design.md, "The save path"), so they are checked where
-- that path does not go: tg_document_write (BEFORE INSERT and UPDATE on pgfence.document, for
-- every writer but the fast path) and tg_document_revision_insert (BEFORE INSERT on
-- pgfence.document_revision, for every writer but the fast path), each raising SQLSTATE 23514
-- with the constraint's old name, as PostgreSQL did (functions/40_document_guards.sql).
-- NOT NULL constraints stay (they are checked without re-reading an expression). The event
-- table's constraints stay: every module writes events.
ALTER TABLE pgfence.document
  DROP CONSTRAINT IF EXISTS document_idempotency_key_check,
  DROP CONSTRAINT IF EXISTS document_status_check,
  DROP CONSTRAINT IF EXISTS document_version_check,
  DROP CONSTRAINT IF EXISTS document_save_id_check,
  DROP CONSTRAINT IF EXISTS document_created_by_check,
  DROP CONSTRAINT IF EXISTS document_saved_by_check,
  DROP CONSTRAINT IF EXISTS document_content_iff_live;
ALTER TABLE pgfence.document_revision
  DROP CONSTRAINT IF EXISTS document_revision_version_check,
  DROP CONSTRAINT IF EXISTS document_revision_op_check,
  DROP CONSTRAINT IF EXISTS document_revision_content_iff_not_delete,
  DROP CONSTRAINT IF EXISTS document_revision_create_is_1;

-- Its raiser became the shared pgfence._check_violated (functions/00_core.sql).
DROP FUNCTION IF EXISTS pgfence._document_check_violated(text, text, text);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 31);
