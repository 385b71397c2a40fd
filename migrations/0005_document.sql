-- pgfence 0005 — documents: versioned JSON documents saved by compare-and-swap, every version
-- kept as a revision, and a registry of document kinds (how a kind's content is checked and
-- merged). Functions, triggers and views: functions/40_document.sql.
-- depends: 0002_outbox

-- Kinds: 'record' and 'sheet' are built in; applications register their own with
-- pgfence.document_register_kind().
CREATE TABLE pgfence.document_kind (
  kind           text PRIMARY KEY CHECK (kind ~ '^[a-z][a-z0-9_.-]{0,62}$'),
  merge          text NOT NULL CHECK (merge IN ('attributes', 'none', 'function')),
  merge_function regprocedure,
  content_type   text NOT NULL CHECK (content_type IN ('object', 'array', 'any')),
  max_bytes      integer NOT NULL CHECK (max_bytes BETWEEN 1 AND 104857600),
  builtin        boolean NOT NULL DEFAULT false,
  description    text CHECK (length(description) <= 1000),
  updated_at     timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT document_kind_function_iff_merge_function
    CHECK ((merge = 'function') = (merge_function IS NOT NULL))
);
COMMENT ON TABLE pgfence.document_kind IS
  'Document kinds: the JSON shape a kind''s content must have, its size limit, and its three-way merge (attributes: merge by top-level key; none: never merge, every difference is a conflict; function: an application function). Built in: record, sheet. Not an API: read pgfence.document_kinds, change with pgfence.document_register_kind().';
COMMENT ON COLUMN pgfence.document_kind.max_bytes IS
  'Largest content accepted by create and save, in bytes of its JSON text (octet_length(content::text)).';
COMMENT ON COLUMN pgfence.document_kind.merge_function IS
  'For merge = function: f(base jsonb, local jsonb, stored jsonb) RETURNS jsonb, returning {"content": merged, "conflicts": [...]}. It runs with the privileges of the role calling document_merge.';
INSERT INTO pgfence.document_kind (kind, merge, content_type, max_bytes, builtin, description) VALUES
  ('record', 'attributes', 'object', 1048576, true,
   'An object keyed by attribute id; a three-way merge takes each attribute from the side that changed it, and reports attributes changed differently on both sides as conflicts.'),
  ('sheet', 'none', 'any', 1048576, true,
   'Content that is never merged: when both sides changed it, every difference between them is a conflict for a person to resolve.');

-- Documents. The row holds the current version; a deleted document keeps its row as a
-- tombstone (status deleted, content NULL) so its id and versions are never reused.
CREATE TABLE pgfence.document (
  id              bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  kind            text NOT NULL REFERENCES pgfence.document_kind (kind),
  idempotency_key text UNIQUE CHECK (idempotency_key <> '' AND length(idempotency_key) <= 255),
  status          text NOT NULL DEFAULT 'live' CHECK (status IN ('live', 'deleted')),
  version         bigint NOT NULL CHECK (version >= 1),
  content         jsonb,
  save_id         text CHECK (save_id <> '' AND length(save_id) <= 255),
  created_by      text NOT NULL CHECK (created_by <> '' AND length(created_by) <= 200),
  created_at      timestamptz NOT NULL DEFAULT now(),
  saved_by        text NOT NULL CHECK (saved_by <> '' AND length(saved_by) <= 200),
  saved_at        timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT document_content_iff_live CHECK ((status = 'live') = (content IS NOT NULL))
);
COMMENT ON TABLE pgfence.document IS
  'Versioned documents, one row per document holding its current version. Status machine live -> deleted (terminal tombstone). version grows by exactly one per write (create = 1, each save and the delete +1) and is never reused. Every version is also kept in pgfence.document_revision. Not an API: use the pgfence.document_* functions.';
COMMENT ON COLUMN pgfence.document.version IS
  'Current version: the compare-and-swap token a save must present as expected_version. Grows by one per save and once more at delete.';
COMMENT ON COLUMN pgfence.document.save_id IS
  'The save_id the writer of the current version passed (copied into its revision, where it serves as the save''s receipt).';

-- Revisions: one immutable row per version, written by a trigger on pgfence.document in the
-- same transaction as the version itself. A revision with a save_id is that save's receipt:
-- a retry with the same save_id finds it and is answered "saved" again.
CREATE TABLE pgfence.document_revision (
  document_id bigint NOT NULL REFERENCES pgfence.document (id),
  version     bigint NOT NULL CHECK (version >= 1),
  op          text NOT NULL CHECK (op IN ('create', 'save', 'delete')),
  content     jsonb,
  save_id     text,
  saved_by    text NOT NULL,
  saved_at    timestamptz NOT NULL,
  PRIMARY KEY (document_id, version),
  CONSTRAINT document_revision_content_iff_not_delete CHECK ((op = 'delete') = (content IS NULL)),
  CONSTRAINT document_revision_create_is_1 CHECK ((op = 'create') = (version = 1))
);
COMMENT ON TABLE pgfence.document_revision IS
  'Every version of every document (content NULL for the delete tombstone), written in the same transaction as the version. Immutable. Version v of a save was a compare-and-swap on version v-1. Not an API: use document_revision() and document_history().';
COMMENT ON COLUMN pgfence.document_revision.save_id IS
  'The writer''s save_id: the receipt that makes a retried save (same save_id, lost response) answer saved with this version instead of a false conflict. Unique per document.';
CREATE UNIQUE INDEX document_revision_save_id_key
  ON pgfence.document_revision (document_id, save_id) WHERE save_id IS NOT NULL;

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 5);
