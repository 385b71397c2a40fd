-- pgfence functions/42_document_read.sql — documents (module 4): reads.
--
-- Public: document_get (the current version: save against the version it returns),
-- document_revision (one version exactly as it was written, e.g. the base of a three-way merge)
-- and document_history (the revisions of a document, newest first, without content, paged with
-- before_version). A deleted document reads as its tombstone (deleted = true, content NULL):
-- documents are never removed, so an id that is not found was never created.
-- Reads change nothing and take no lock.
-- Errors: functions/ERRORS.md.

CREATE OR REPLACE FUNCTION pgfence.document_get(p_id bigint)
RETURNS TABLE (id bigint, kind text, version bigint, content jsonb, deleted boolean,
               created_by text, created_at timestamptz, saved_by text, saved_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'document_get: id is required'
      USING ERRCODE = '22004', DETAIL = 'document_get reads one document by its id.',
            HINT = 'Pass the id that pgfence.document_create returned.';
  END IF;
  RETURN QUERY
  SELECT d.id, d.kind, d.version, d.content, d.status = 'deleted', d.created_by, d.created_at,
         d.saved_by, d.saved_at
  FROM pgfence.document d WHERE d.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_get: no document with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No document was created with this id (a deleted document keeps its tombstone).',
            HINT = 'Check the id.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_get(bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_get(bigint) IS
  'The current version of a document: kind, version, content, who created and last saved it.
Content NULL and deleted = true for a deleted document''s tombstone; who created and who last saved it, when. Save against the returned version. Errors: 22004 (id NULL), P0002 (unknown id).';

CREATE OR REPLACE FUNCTION pgfence.document_revision(p_id bigint, p_version bigint)
RETURNS TABLE (document_id bigint, version bigint, op text, content jsonb, save_id text,
               saved_by text, saved_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_current bigint;
BEGIN
  IF p_id IS NULL OR p_version IS NULL THEN
    RAISE EXCEPTION 'document_revision: id and version are required'
      USING ERRCODE = '22004', DETAIL = 'A revision is named by its document and its version.',
            HINT = 'Pass the document id and a version from pgfence.document_history(id).';
  END IF;
  RETURN QUERY
  SELECT r.document_id, r.version, r.op, r.content, r.save_id, r.saved_by, r.saved_at
  FROM pgfence.document_revision r WHERE r.document_id = p_id AND r.version = p_version;
  IF NOT FOUND THEN
    SELECT d.version INTO v_current FROM pgfence.document d WHERE d.id = p_id;
    IF v_current IS NULL THEN
      RAISE EXCEPTION 'document_revision: no document with id %', p_id
        USING ERRCODE = 'P0002', DETAIL = 'No document was created with this id (a deleted document keeps its tombstone).',
              HINT = 'Check the id.';
    END IF;
    RAISE EXCEPTION 'document_revision: document % has no version %', p_id, p_version
      USING ERRCODE = 'P0002', DETAIL = format('Versions 1 to %s exist.', v_current),
            HINT = 'Pass a version from pgfence.document_history(id).';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_revision(bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_revision(bigint, bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_revision(bigint, bigint) IS
  'One saved version of a document exactly as it was written (op create, save or delete).
Content NULL for the delete tombstone; e.g. the confirmed base a client edited from, for a three-way merge. Errors: 22004 (NULL argument), P0002 (unknown id, or no such version).';

CREATE OR REPLACE FUNCTION pgfence.document_history(
  p_id             bigint,
  p_limit          integer DEFAULT 100,
  p_before_version bigint DEFAULT NULL
)
RETURNS TABLE (version bigint, op text, save_id text, saved_by text, saved_at timestamptz,
               stored_bytes integer)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'document_history: id is required'
      USING ERRCODE = '22004', DETAIL = 'document_history reads the revisions of one document.',
            HINT = 'Pass the id that pgfence.document_create returned.';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'document_history: limit must be between 1 and 10000'
      USING ERRCODE = '22023', DETAIL = format('Got %s.', coalesce(p_limit::text, 'NULL')),
            HINT = 'Pass 1 to 10000 (the default is 100); page back with p_before_version.';
  END IF;
  PERFORM 1 FROM pgfence.document d WHERE d.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_history: no document with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No document was created with this id (a deleted document keeps its tombstone).',
            HINT = 'Check the id.';
  END IF;
  RETURN QUERY
  SELECT r.version, r.op, r.save_id, r.saved_by, r.saved_at, pg_column_size(r.content)
  FROM pgfence.document_revision r
  WHERE r.document_id = p_id AND (p_before_version IS NULL OR r.version < p_before_version)
  ORDER BY r.version DESC
  LIMIT p_limit;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_history(bigint, integer, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_history(bigint, integer, bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_history(bigint, integer, bigint) IS
  'The revisions of a document, newest first, without content; page back with before_version.
Version, op, save_id, who saved it and when, stored size in bytes. Errors: 22004 (id NULL), 22023 (limit outside 1..10000), P0002 (unknown id).';
