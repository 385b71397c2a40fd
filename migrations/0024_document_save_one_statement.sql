-- pgfence 0024 — documents: a save writes its version, revision and event in one statement.
-- depends: 0021_metrics_indexes
--
-- Issue 14: a save cost about four times the backend time of a hand-written CAS UPDATE plus a
-- revision INSERT. Two costs go here:
-- * The foreign key document_revision -> document: an AFTER trigger per revision that looks the
--   document row up again and locks it FOR KEY SHARE (about an eighth of a save), to prove what the
--   revision's writer already holds: a revision is written only for the row being written in the
--   same statement (tg_document_write, tg_document_created, document_save's compare-and-swap), and
--   a document row is never deleted (tg_document_write refuses it; pgfence_definer has no DELETE).
--   A hand-written INSERT of a revision is refused by the trigger document_revision_insert_guard
--   instead (functions/40_document_guards.sql).
-- * The row trigger tg_document_write on the save path (a PL/pgSQL call, a kind lookup and two
--   more statements per save). document_save now writes the next version, its revision and its
--   event in one statement and stamps the row with write_nonce, a fresh random value that it also
--   puts in the transaction-local setting pgfence.document_writing for that statement only. The
--   UPDATE trigger is skipped only for a row whose write_nonce changed to exactly the setting's
--   value. No other writer changes write_nonce, and no client role may write the table, so a
--   client that pre-sets the setting gains nothing: the next writer's row keeps its old nonce
--   and the trigger runs (docs/design.md, "The save path").
ALTER TABLE pgfence.document_revision DROP CONSTRAINT IF EXISTS document_revision_document_id_fkey;
ALTER TABLE pgfence.document ADD COLUMN write_nonce uuid;
COMMENT ON COLUMN pgfence.document.write_nonce IS
  'Set by document_save only: a fresh random value per save, so that tg_document_write is skipped for that statement alone (see the trigger document_write). Not data.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 24);
