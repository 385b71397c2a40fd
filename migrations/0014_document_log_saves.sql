-- pgfence 0014 — documents: the event of every save becomes a per-kind setting (log_saves).
-- depends: 0013_reaper_names
--
-- Every save wrote a revision (the receipt) and an event-log row; the event was a third of a
-- save's write cost (issue 14: 1,665 bytes of WAL per save against 171 for a bare UPDATE). Like
-- the outbox's per-channel event log (outbox_channel.log_events), a kind now says whether its
-- saves are logged: document_kind.log_saves, default true, so existing kinds keep their events;
-- document_register_kind(..., p_log_saves => false) turns them off. Creates, deletes,
-- conflicts and replays are always logged: audit_documents counts conflicts and replays either
-- way. document_register_kind gains the parameter and a column in its result, so its old
-- signature is dropped here (functions/41_document_kinds.sql creates the new one).

ALTER TABLE pgfence.document_kind ADD COLUMN log_saves boolean NOT NULL DEFAULT true;
COMMENT ON COLUMN pgfence.document_kind.log_saves IS
  'Whether a save of a document of this kind writes a save event to pgfence.event (creates, deletes, conflicts and replays always do).';
DROP FUNCTION IF EXISTS pgfence.document_register_kind(text, text, regprocedure, text, integer, text);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 14);
