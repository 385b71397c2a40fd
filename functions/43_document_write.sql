-- pgfence functions/43_document_write.sql — documents (module 4): create, save, delete.
--
-- Public: document_create (version 1; a repeated idempotency key answers with the same id),
-- document_save (one compare-and-swap on expected_version: 'saved' with expected + 1, or
-- 'conflict' with the stored version and content, nothing written) and document_delete (the
-- same, leaving a tombstone version: terminal; the id and its versions are never reused).
-- A save_id is the receipt of a save: a retry whose first answer was lost is answered 'saved'
-- with that version (replayed), never a false conflict. Conflicts are answers, not errors (a lost
-- race returns). Event log: create, save, delete from tg_document_write; conflict, replay from
-- here (a conflict changes no row). Under REPEATABLE READ a racing save fails with 40001.

CREATE OR REPLACE FUNCTION pgfence.document_create(
  p_kind            text,
  p_content         jsonb,
  p_created_by      text,
  p_idempotency_key text DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_kind  pgfence.document_kind := pgfence._document_kind(p_kind);
  v_id    bigint;
  v_first pgfence.document_revision;
BEGIN
  PERFORM pgfence._document_check_content(v_kind, p_content);
  PERFORM pgfence._document_check_actor(p_created_by, 'created_by');
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'document_create: idempotency_key must be 1-255 characters or NULL'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_idempotency_key)),
            HINT = 'Use one stable key per document to create (a retry sends the same one), or NULL.';
  END IF;

  INSERT INTO pgfence.document AS d (kind, idempotency_key, version, content, created_by, saved_by)
  VALUES (p_kind, p_idempotency_key, 1, p_content, p_created_by, p_created_by)
  ON CONFLICT (idempotency_key) DO NOTHING
  RETURNING d.id INTO v_id;
  IF v_id IS NOT NULL THEN
    RETURN v_id;
  END IF;

  -- The key exists (committed, or committed by the transaction we just waited for).
  SELECT d.id INTO v_id FROM pgfence.document d WHERE d.idempotency_key = p_idempotency_key;
  IF v_id IS NULL THEN
    RAISE EXCEPTION 'document_create: idempotency key "%" is held by a transaction this snapshot cannot see', p_idempotency_key
      USING ERRCODE = '40001', DETAIL = 'Under REPEATABLE READ or SERIALIZABLE a document created after the snapshot was taken is invisible here.',
            HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
  END IF;
  SELECT r.* INTO v_first FROM pgfence.document_revision r WHERE r.document_id = v_id AND r.version = 1;
  IF (SELECT d.kind FROM pgfence.document d WHERE d.id = v_id) <> p_kind OR v_first.content <> p_content THEN
    RAISE EXCEPTION 'document_create: idempotency key "%" already created document % with another kind or content', p_idempotency_key, v_id
      USING ERRCODE = 'PF003', DETAIL = format('Document %s was created with this key; this call sends another kind or other content.', v_id),
            HINT = 'A repeated create must send the same kind and content; use a new key for a new document.';
  END IF;
  RETURN v_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_create(text, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_create(text, jsonb, text, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_create(text, jsonb, text, text) IS
  'Create a document of a kind with its first content (version 1); returns its id.
A repeated idempotency_key with the same kind and content (a retry whose answer was lost) returns the same id and creates nothing. Errors: 22004 (missing kind, content or created_by), 22023 (content of the wrong JSON type, bad created_by or key), PF301 (content over the kind''s max_bytes), PF302 (unknown kind), PF003 (key already used for another kind or content), 40001 (key held by a transaction invisible to a REPEATABLE READ snapshot: retry).';
CREATE OR REPLACE FUNCTION pgfence._document_conflict(p_id bigint, p_op text, p_expected_version bigint,
                                                      p_save_id text, p_by text)
RETURNS TABLE (outcome text, version bigint, content jsonb, saved_by text, saved_at timestamptz,
               deleted boolean, replayed boolean)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_doc pgfence.document;
BEGIN
  SELECT d.* INTO v_doc FROM pgfence.document d WHERE d.id = p_id;
  PERFORM pgfence._event('document', p_id, 'conflict', v_doc.status, v_doc.status, v_doc.version,
                         jsonb_strip_nulls(jsonb_build_object('op', p_op, 'expected_version', p_expected_version,
                                                              'save_id', p_save_id)),
                         p_by);
  RETURN QUERY SELECT 'conflict'::text, v_doc.version, v_doc.content, v_doc.saved_by, v_doc.saved_at,
                      v_doc.status = 'deleted', false;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_conflict(bigint, text, bigint, text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_conflict(bigint, text, bigint, text, text) IS
  'Private: the conflict answer (the stored version and content) and its event-log row.
Stored version and content are read in one statement; a conflict changes no document row, so its event is written here.';

CREATE OR REPLACE FUNCTION pgfence._document_replay(p_rev pgfence.document_revision, p_expected_version bigint,
                                                    p_content jsonb, p_by text)
RETURNS TABLE (outcome text, version bigint, content jsonb, saved_by text, saved_at timestamptz,
               deleted boolean, replayed boolean)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  -- version - 1, not expected_version + 1: an expected_version of 2^63-1 must not overflow
  IF p_rev.op <> 'save' OR p_rev.version - 1 <> p_expected_version OR p_rev.content <> p_content THEN
    RAISE EXCEPTION 'document %: save_id "%" already saved version % (from version %) with other content', p_rev.document_id, p_rev.save_id, p_rev.version, p_rev.version - 1
      USING ERRCODE = 'PF003',
            DETAIL = format('This call is based on version %s.', p_expected_version),
            HINT = 'A save_id names one save (one snapshot on one base version); retry with the same arguments or use a new save_id for new content.';
  END IF;
  PERFORM pgfence._event('document', p_rev.document_id, 'replay', NULL, NULL, p_rev.version,
                         jsonb_build_object('op', 'save', 'save_id', p_rev.save_id, 'expected_version', p_expected_version),
                         p_by);
  RETURN QUERY SELECT 'saved'::text, p_rev.version, NULL::jsonb, p_rev.saved_by, p_rev.saved_at, false, true;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_replay(pgfence.document_revision, bigint, jsonb, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_replay(pgfence.document_revision, bigint, jsonb, text) IS
  'Private: answers a retried save from its receipt (the revision with the same save_id).
saved with that version when the retry sends the same base and content, PF003 otherwise. Logs a replay event.';

CREATE OR REPLACE FUNCTION pgfence.document_save(
  p_id               bigint,
  p_expected_version bigint,
  p_content          jsonb,
  p_saved_by         text,
  p_save_id          text DEFAULT NULL
)
RETURNS TABLE (outcome text, version bigint, content jsonb, saved_by text, saved_at timestamptz,
               deleted boolean, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_version  bigint;
  v_status   text;
  v_kind     text;
  v_type     text;
  v_max      integer;
  v_rev      pgfence.document_revision;
  v_saved_at timestamptz;
  v_nonce    uuid;
  v_set      text;
  v_stored   jsonb;
  v_stored_by text;
  v_stored_at timestamptz;
  v_receipt  boolean;
BEGIN
  -- The hot path calls no helper: the helpers run only to raise the precise error.
  IF p_id IS NULL OR p_expected_version IS NULL OR p_expected_version < 1
     OR p_saved_by IS NULL OR p_saved_by = '' OR length(p_saved_by) > 200 THEN
    PERFORM pgfence._document_check_write(p_id, p_expected_version);
    PERFORM pgfence._document_check_actor(p_saved_by, 'saved_by');
  END IF;
  IF p_save_id IS NOT NULL AND (p_save_id = '' OR length(p_save_id) > 255) THEN
    RAISE EXCEPTION 'document_save: save_id must be 1-255 characters or NULL'
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_save_id)),
            HINT = 'Use a fresh random id (e.g. a UUID) per snapshot, and the same one when retrying it.';
  END IF;

  -- The fast path: one statement writes the next version, its revision (the receipt of save_id)
  -- and, if the kind logs saves, its event. Its WHERE holds every check of the slow path below:
  -- the document is live at expected_version, the content fits its kind, and no receipt of
  -- save_id exists yet (a retry, or a save_id reused on another base: the slow path answers
  -- both). Its SET makes exactly the next version and leaves the identity columns alone, which is
  -- what tg_document_write checks; so the row is marked with a fresh write_nonce, equal to the
  -- setting pgfence.document_writing for this statement only, and the trigger skips it
  -- (40_document_guards.sql explains why no other caller can get that). Anything else, a lost
  -- race included, falls through to the slow path, which answers exactly as before. A concurrent
  -- save of the same version makes this UPDATE wait for its commit, after which the row no longer
  -- matches and nothing is written.
  -- The nonce is the base version as a uuid (0...0<hex>; not expected_version + 1, which could
  -- overflow): never a value this row had (each fast-path write has a higher base than the last,
  -- and the random uuids written before migration 0031 have a version nibble), and cheaper than
  -- gen_random_uuid() (about 8 us a save, measured). It must be fresh, not secret: no other
  -- writer changes write_nonce. set_config by assignment, a plain expression (PERFORM would run
  -- a query).
  v_nonce := pg_catalog.lpad(pg_catalog.to_hex(p_expected_version), 32, '0')::uuid;
  v_set := pg_catalog.set_config('pgfence.document_writing', v_nonce::text, true);
  WITH saved AS (
    UPDATE pgfence.document d
    SET version = d.version + 1, content = p_content, save_id = p_save_id, saved_by = p_saved_by,
        saved_at = now(), write_nonce = v_nonce
    FROM pgfence.document_kind k
    WHERE d.id = p_id AND d.version = p_expected_version AND d.status = 'live'
      AND k.kind = d.kind
      AND jsonb_typeof(p_content) <> 'null'
      AND (k.content_type = 'any' OR jsonb_typeof(p_content) = k.content_type)
      AND octet_length(p_content::text) <= k.max_bytes
      AND (p_save_id IS NULL
           OR NOT EXISTS (SELECT FROM pgfence.document_revision r
                          WHERE r.document_id = p_id AND r.save_id = p_save_id))
    RETURNING d.id, d.version, d.kind, d.saved_at, k.log_saves
  ), logged AS (
    INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
    SELECT 'document', s.id, 'save', 'live', 'live', p_saved_by, s.version,
           jsonb_strip_nulls(jsonb_build_object('kind', s.kind, 'based_on', p_expected_version,
                                                'save_id', p_save_id))
    FROM saved s WHERE s.log_saves
  )
  INSERT INTO pgfence.document_revision AS r (document_id, version, op, content, save_id, saved_by, saved_at)
  SELECT s.id, s.version, 'save', p_content, p_save_id, p_saved_by, s.saved_at FROM saved s
  RETURNING r.version, r.saved_at INTO v_version, v_saved_at;
  v_set := pg_catalog.set_config('pgfence.document_writing', '', true);
  IF v_version IS NOT NULL THEN
    -- the answer from variables, not a query: the hot path runs no statement after the UPDATE
    outcome := 'saved'; version := v_version; content := NULL; saved_by := p_saved_by;
    saved_at := v_saved_at; deleted := false; replayed := false;
    RETURN NEXT;
    RETURN;
  END IF;

  -- The slow path: the precise error, a replay, a conflict, or a second try after a race. One
  -- statement reads the document, its kind and whether save_id has a receipt; a conflict seen
  -- here is answered from what it read (the stored version and content, read together).
  SELECT d.version, d.status, d.kind, k.content_type, k.max_bytes, d.content, d.saved_by, d.saved_at,
         r.version IS NOT NULL
  INTO v_version, v_status, v_kind, v_type, v_max, v_stored, v_stored_by, v_stored_at, v_receipt
  FROM pgfence.document d JOIN pgfence.document_kind k ON k.kind = d.kind
  LEFT JOIN pgfence.document_revision r
    ON p_save_id IS NOT NULL AND r.document_id = d.id AND r.save_id = p_save_id
  WHERE d.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_save: no document with id %', p_id
      USING ERRCODE = 'P0002', DETAIL = 'No document was created with this id (a deleted document keeps its tombstone).',
            HINT = 'Check the id; create documents with document_create().';
  END IF;
  IF p_content IS NULL OR jsonb_typeof(p_content) = 'null'
     OR (v_type = 'object' AND jsonb_typeof(p_content) <> 'object')
     OR (v_type = 'array' AND jsonb_typeof(p_content) <> 'array')
     OR octet_length(p_content::text) > v_max THEN
    PERFORM pgfence._document_check_content(pgfence._document_kind(v_kind), p_content);
  END IF;

  -- A retry whose first answer was lost: the receipt answers it.
  IF v_receipt THEN
    SELECT r.* INTO v_rev FROM pgfence.document_revision r
    WHERE r.document_id = p_id AND r.save_id = p_save_id;
    IF FOUND THEN
      RETURN QUERY SELECT * FROM pgfence._document_replay(v_rev, p_expected_version, p_content, p_saved_by);
      RETURN;
    END IF;
  END IF;
  IF p_expected_version > v_version THEN
    PERFORM pgfence._document_version_unknown(p_id, p_expected_version, v_version);
  END IF;

  IF v_status <> 'live' OR v_version <> p_expected_version THEN
    -- A conflict: the answer is the stored version and content read above; a conflict changes
    -- no document row, so its event is written here (what _document_conflict writes).
    INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
    VALUES ('document', p_id, 'conflict', v_status, v_status, p_saved_by, v_version,
            jsonb_strip_nulls(jsonb_build_object('op', 'save', 'expected_version', p_expected_version,
                                                 'save_id', p_save_id)));
    outcome := 'conflict'; version := v_version; content := v_stored; saved_by := v_stored_by;
    saved_at := v_stored_at; deleted := v_status = 'deleted'; replayed := false;
    RETURN NEXT;
    RETURN;
  ELSE
    -- The compare-and-swap. A concurrent save of the same version makes us wait for its
    -- commit, after which the row no longer matches and we fall through to the conflict.
    UPDATE pgfence.document d
    SET version = d.version + 1, content = p_content, save_id = p_save_id, saved_by = p_saved_by
    WHERE d.id = p_id AND d.version = p_expected_version AND d.status = 'live'
    RETURNING d.version, d.saved_at INTO v_version, v_saved_at;
    IF FOUND THEN
      -- the answer from variables, not a query: the hot path runs no statement after the UPDATE
      outcome := 'saved'; version := v_version; content := NULL; saved_by := p_saved_by;
      saved_at := v_saved_at; deleted := false; replayed := false;
      RETURN NEXT;
      RETURN;
    END IF;
    -- Lost the race. If the winner was this very save (the same save_id, sent again while the
    -- first attempt was still running), its receipt is now visible: answer from it.
    IF p_save_id IS NOT NULL THEN
      SELECT r.* INTO v_rev FROM pgfence.document_revision r
      WHERE r.document_id = p_id AND r.save_id = p_save_id;
      IF FOUND THEN
        RETURN QUERY SELECT * FROM pgfence._document_replay(v_rev, p_expected_version, p_content, p_saved_by);
        RETURN;
      END IF;
    END IF;
  END IF;
  RETURN QUERY SELECT * FROM pgfence._document_conflict(p_id, 'save', p_expected_version, p_save_id, p_saved_by);
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_save(bigint, bigint, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_save(bigint, bigint, jsonb, text, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_save(bigint, bigint, jsonb, text, text) IS
  'Save a document as one compare-and-swap on expected_version: saved, or a conflict answer.
Returns one row: outcome saved with the new version (expected_version + 1), or outcome conflict with the stored version, its content and who saved it (deleted = true if the stored version is the delete tombstone); a conflict writes nothing but its event. Never last-write-wins: there is no unconditional save. save_id (a fresh id per snapshot, reused when retrying it) makes a retry whose first answer was lost return saved with the same version (replayed = true), never a false conflict. Errors: 22004 (missing id, expected_version, content or saved_by), 22023 (content of the wrong JSON type, bad saved_by or save_id), P0002 (unknown id), PF301 (content over the kind''s max_bytes), PF303 (expected_version newer than any version of the document), PF003 (save_id already used for other content or another base version).';

CREATE OR REPLACE FUNCTION pgfence.document_delete(p_id bigint, p_expected_version bigint, p_by text)
RETURNS TABLE (outcome text, version bigint, content jsonb, saved_by text, saved_at timestamptz,
               deleted boolean, replayed boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_doc pgfence.document;
BEGIN
  PERFORM pgfence._document_check_write(p_id, p_expected_version);
  PERFORM pgfence._document_check_actor(p_by, 'by');
  FOR attempt IN 1..2 LOOP
    SELECT d.* INTO v_doc FROM pgfence.document d WHERE d.id = p_id;
    IF NOT FOUND THEN
      RAISE EXCEPTION 'document_delete: no document with id %', p_id
        USING ERRCODE = 'P0002', DETAIL = 'No document was created with this id (a deleted document keeps its tombstone).',
              HINT = 'Check the id.';
    END IF;
    -- version - 1, not expected_version + 1: an expected_version of 2^63-1 must not overflow
    IF v_doc.status = 'deleted' AND v_doc.version - 1 = p_expected_version THEN
      -- Already deleted by a delete based on the same version (a retry whose answer was lost).
      PERFORM pgfence._event('document', p_id, 'replay', NULL, NULL, v_doc.version,
                             jsonb_build_object('op', 'delete', 'expected_version', p_expected_version), p_by);
      RETURN QUERY SELECT 'deleted'::text, v_doc.version, NULL::jsonb, v_doc.saved_by, v_doc.saved_at, true, true;
      RETURN;
    END IF;
    IF p_expected_version > v_doc.version THEN
      PERFORM pgfence._document_version_unknown(p_id, p_expected_version, v_doc.version);
    END IF;
    EXIT WHEN v_doc.status <> 'live' OR v_doc.version <> p_expected_version;
    UPDATE pgfence.document d
    SET version = d.version + 1, status = 'deleted', content = NULL, save_id = NULL, saved_by = p_by
    WHERE d.id = p_id AND d.version = p_expected_version AND d.status = 'live'
    RETURNING d.* INTO v_doc;
    IF FOUND THEN
      RETURN QUERY SELECT 'deleted'::text, v_doc.version, NULL::jsonb, v_doc.saved_by, v_doc.saved_at, true, false;
      RETURN;
    END IF;
    -- Lost a race: look again once (a concurrent identical delete is answered as a replay).
  END LOOP;
  RETURN QUERY SELECT * FROM pgfence._document_conflict(p_id, 'delete', p_expected_version, NULL, p_by);
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_delete(bigint, bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_delete(bigint, bigint, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_delete(bigint, bigint, text) IS
  'Delete a document as a compare-and-swap on expected_version, leaving a tombstone version.
Outcome deleted with the tombstone version (expected_version + 1; the row, its id and all revisions stay, and the document never changes again), or outcome conflict with the stored version and content. Repeating a delete that already happened on the same expected_version answers deleted (replayed = true). Errors: 22004 (missing id, expected_version or by), 22023 (bad by, version < 1), P0002 (unknown id), PF303 (expected_version newer than any version of the document).';
