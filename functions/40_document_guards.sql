-- pgfence functions/40_document.sql — Module 4: versioned documents.
--
-- The server is authoritative; every write carries the version it was based on:
--
--   document_create  --> version 1 (live)
--   document_save(id, expected_version, content, saved_by, save_id)
--                    --> 'saved' + version expected+1          (the one compare-and-swap)
--                    --> 'conflict' + stored version and content, nothing written
--   document_delete(id, expected_version, by)
--                    --> 'deleted' + tombstone version expected+1 (terminal; the id and its
--                        versions are never reused)   or 'conflict'
--
-- Status machine (enforced by tg_document_write for any write, psql included):
--   live --save (version+1)--> live;  live --delete (version+1)--> deleted;  deleted is final.
-- A document row is never DELETEd. Every version is kept in document_revision, written by
-- tg_document_write in the same statement; a revision that carries a save_id is the
-- receipt of that save: a retry with the same save_id (its first answer was lost) is answered
-- 'saved' with that version, never a false conflict.
--
-- Conflicts are answers, not errors (a lost race returns, it does not raise). Bad calls raise
-- documented SQLSTATEs (functions/ERRORS.md): 22004, 22023, P0002, PF003, PF301-PF304.
-- Event log: create, save, delete (from the trigger) and conflict, replay (from the
-- functions: a conflict changes no row, so the function writes its event).
--
-- Call these in autocommit / READ COMMITTED. Under REPEATABLE READ a save that races another
-- one fails with 40001 (retry it with the same save_id).

-- ---------------------------------------------------------------------------------------------
-- Guards and the revision writer
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_document_write()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_op text;
BEGIN
  IF TG_OP = 'DELETE' THEN
    RAISE EXCEPTION 'document % cannot be removed: a deleted document keeps its tombstone so its id and versions are never reused', OLD.id
      USING ERRCODE = 'PF002', HINT = 'Use pgfence.document_delete(id, expected_version, by).';
  END IF;
  IF TG_OP = 'INSERT' THEN
    IF NEW.version IS DISTINCT FROM 1 OR NEW.status IS DISTINCT FROM 'live' THEN
      RAISE EXCEPTION 'a new document starts live at version 1 (got % at version %)', NEW.status, NEW.version
        USING ERRCODE = 'PF001', HINT = 'Use pgfence.document_create().';
    END IF;
    NEW.created_at := now();
    NEW.saved_at := now();
    RETURN NEW;   -- revision 1 and its event: tg_document_created, once the row exists
  END IF;
  IF NEW.id IS DISTINCT FROM OLD.id
     OR NEW.kind IS DISTINCT FROM OLD.kind
     OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
     OR NEW.created_by IS DISTINCT FROM OLD.created_by
     OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
    RAISE EXCEPTION 'document %: id, kind, idempotency_key, created_by and created_at never change', OLD.id
      USING ERRCODE = 'PF002', HINT = 'Create a new document instead.';
  END IF;
  IF NOT (OLD.status = 'live' AND NEW.status IN ('live', 'deleted')) THEN
    RAISE EXCEPTION 'illegal document transition for document %: % -> %', OLD.id, OLD.status, NEW.status
      USING ERRCODE = 'PF001',
            DETAIL = 'Allowed: live -> live (save), live -> deleted (delete). A deleted document never changes again.',
            HINT = 'Use pgfence.document_save() and pgfence.document_delete().';
  END IF;
  IF NEW.version IS DISTINCT FROM OLD.version + 1 THEN
    RAISE EXCEPTION 'document %: every write makes exactly the next version (% -> % refused)', OLD.id, OLD.version, NEW.version
      USING ERRCODE = 'PF002',
            HINT = 'Versions only grow by one per write and are never reused; save with pgfence.document_save().';
  END IF;
  v_op := CASE WHEN NEW.status = 'deleted' THEN 'delete' ELSE 'save' END;
  NEW.saved_at := now();
  -- The revision (and the receipt of its save_id) and the event are written by the same
  -- statement as the version: if anything after this trigger refuses the row, the statement
  -- fails and takes them back with it.
  INSERT INTO pgfence.document_revision (document_id, version, op, content, save_id, saved_by, saved_at)
  VALUES (NEW.id, NEW.version, v_op, NEW.content, NEW.save_id, NEW.saved_by, NEW.saved_at);
  INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
  VALUES ('document', NEW.id, v_op, OLD.status, NEW.status, NEW.saved_by, NEW.version,
          jsonb_strip_nulls(jsonb_build_object('kind', NEW.kind, 'based_on', OLD.version,
                                               'save_id', NEW.save_id)));
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_document_write() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_document_write() IS
  'BEFORE INSERT/UPDATE/DELETE trigger on pgfence.document, for any writer (psql included): a document starts live at version 1; every update makes exactly the next version (PF002 otherwise); only live -> live and live -> deleted are allowed (PF001); identity columns never change (PF002); rows are never deleted (PF002: the tombstone stays). Stamps created_at/saved_at from now(). For an update it also keeps the new version as an immutable pgfence.document_revision row (the receipt of its save_id) and logs save/delete to pgfence.event (actor = saved_by, fence = version), in the same statement: one trigger on the hot path, not a guard plus an AFTER trigger.';

CREATE OR REPLACE TRIGGER document_write
  BEFORE INSERT OR UPDATE OR DELETE ON pgfence.document
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_document_write();

-- Revision 1 is written AFTER the insert: a BEFORE INSERT trigger also fires for a row that
-- ON CONFLICT (idempotency_key) DO NOTHING then skips, and the revision's foreign key needs
-- the document row.
CREATE OR REPLACE FUNCTION pgfence.tg_document_created()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  INSERT INTO pgfence.document_revision (document_id, version, op, content, save_id, saved_by, saved_at)
  VALUES (NEW.id, NEW.version, 'create', NEW.content, NEW.save_id, NEW.saved_by, NEW.saved_at);
  INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
  VALUES ('document', NEW.id, 'create', NULL, NEW.status, NEW.saved_by, NEW.version,
          jsonb_build_object('kind', NEW.kind));
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_document_created() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_document_created() IS
  'AFTER INSERT trigger on pgfence.document: keeps version 1 as revision 1 and logs the create event, in the creating transaction.';

CREATE OR REPLACE TRIGGER document_created
  AFTER INSERT ON pgfence.document
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_document_created();

CREATE OR REPLACE FUNCTION pgfence.tg_document_revision_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'revision % of document % is immutable', OLD.version, OLD.document_id
    USING ERRCODE = 'PF002', HINT = 'Revisions are the history and the save receipts; save a new version instead.';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_document_revision_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_document_revision_guard() IS
  'BEFORE UPDATE/DELETE trigger on pgfence.document_revision: revisions never change and are never removed (PF002).';

CREATE OR REPLACE TRIGGER document_revision_guard
  BEFORE UPDATE OR DELETE ON pgfence.document_revision
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_document_revision_guard();

-- ---------------------------------------------------------------------------------------------
-- Kinds
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.document_kinds AS
SELECT k.kind, k.merge, k.merge_function, k.content_type, k.max_bytes, k.builtin, k.description,
       k.updated_at
FROM pgfence.document_kind k;
REVOKE ALL ON pgfence.document_kinds FROM PUBLIC;
GRANT SELECT ON pgfence.document_kinds TO pgfence_client, pgfence_admin;
COMMENT ON VIEW pgfence.document_kinds IS
  'Document kinds: content shape (object, array, any), size limit in bytes of JSON text, and merge (attributes: by top-level key; none: never merges; function: merge_function). record and sheet are built in; applications add kinds with document_register_kind().';

CREATE OR REPLACE FUNCTION pgfence._document_kind(p_kind text)
RETURNS pgfence.document_kind
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_row pgfence.document_kind;
BEGIN
  IF p_kind IS NULL THEN
    RAISE EXCEPTION 'document: kind is required' USING ERRCODE = '22004', HINT = 'Pass record, sheet or a registered kind.';
  END IF;
  SELECT k.* INTO v_row FROM pgfence.document_kind k WHERE k.kind = p_kind;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document: unknown kind "%"', p_kind
      USING ERRCODE = 'PF302',
            HINT = 'Use record, sheet, or a kind registered with pgfence.document_register_kind() (see the view pgfence.document_kinds).';
  END IF;
  RETURN v_row;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_kind(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_kind(text) IS
  'Private: the registry row of a kind; raises 22004 (NULL) or PF302 (unknown kind).';

CREATE OR REPLACE FUNCTION pgfence._document_check_content(p_kind pgfence.document_kind, p_content jsonb)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_bytes integer;
BEGIN
  IF p_content IS NULL THEN
    RAISE EXCEPTION 'document: content is required' USING ERRCODE = '22004',
      HINT = 'Pass the whole document as JSON; to remove a document use document_delete().';
  END IF;
  IF (p_kind.content_type = 'object' AND jsonb_typeof(p_content) <> 'object')
     OR (p_kind.content_type = 'array' AND jsonb_typeof(p_content) <> 'array')
     OR jsonb_typeof(p_content) = 'null' THEN
    RAISE EXCEPTION 'document: a % document''s content must be a JSON %, got %', p_kind.kind,
      CASE p_kind.content_type WHEN 'any' THEN 'value other than null' ELSE p_kind.content_type END,
      jsonb_typeof(p_content)
      USING ERRCODE = '22023',
            HINT = CASE p_kind.content_type WHEN 'object' THEN 'A record is an object keyed by attribute id, e.g. {"title": "..."}.'
                   ELSE 'Send the whole document content.' END;
  END IF;
  v_bytes := octet_length(p_content::text);
  IF v_bytes > p_kind.max_bytes THEN
    RAISE EXCEPTION 'document: content is too large for kind % (% bytes, limit %)', p_kind.kind, v_bytes, p_kind.max_bytes
      USING ERRCODE = 'PF301',
            DETAIL = format('Size is measured as the bytes of the JSON text: %s > %s.', v_bytes, p_kind.max_bytes),
            HINT = 'Split the document, or have an admin raise the kind''s max_bytes with pgfence.document_register_kind().';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_check_content(pgfence.document_kind, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_check_content(pgfence.document_kind, jsonb) IS
  'Private: content must be non-NULL (22004), of the kind''s JSON type (22023) and within its size limit (PF301).';

CREATE OR REPLACE FUNCTION pgfence._document_check_actor(p_by text, p_what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_by IS NULL THEN
    RAISE EXCEPTION 'document: % is required', p_what USING ERRCODE = '22004',
      HINT = 'Name the user or process making the change; it is stored with the version and in the event log.';
  END IF;
  IF p_by = '' OR length(p_by) > 200 THEN
    RAISE EXCEPTION 'document: % must be 1-200 characters', p_what USING ERRCODE = '22023',
      HINT = 'Name the user or process making the change.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_check_actor(text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_check_actor(text, text) IS
  'Private: validates a saved_by / created_by / by argument; raises 22004 or 22023.';

CREATE OR REPLACE FUNCTION pgfence._document_check_write(p_id bigint, p_expected_version bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'document: id is required' USING ERRCODE = '22004';
  END IF;
  IF p_expected_version IS NULL THEN
    RAISE EXCEPTION 'document %: expected_version is required: there is no unconditional overwrite', p_id
      USING ERRCODE = '22004',
            HINT = 'Pass the version your content is based on (from document_get or the last save); a mismatch is answered as a conflict, never overwritten.';
  END IF;
  IF p_expected_version < 1 THEN
    RAISE EXCEPTION 'document %: expected_version must be >= 1, got %', p_id, p_expected_version
      USING ERRCODE = '22023', HINT = 'Versions start at 1.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_check_write(bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_check_write(bigint, bigint) IS
  'Private: a write names a document and the version it is based on; raises 22004 (NULL, including a missing expected_version: no unconditional overwrite) or 22023 (version < 1).';

CREATE OR REPLACE FUNCTION pgfence._document_version_unknown(p_id bigint, p_expected_version bigint, p_current bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'document %: expected_version % was never issued (the current version is %)', p_id, p_expected_version, p_current
    USING ERRCODE = 'PF303',
          HINT = 'The version must come from this document (document_get, a save answer or a conflict answer); check that the client did not mix up documents.';
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_version_unknown(bigint, bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_version_unknown(bigint, bigint, bigint) IS
  'Private: raises PF303 for an expected_version higher than any version the document had.';

CREATE OR REPLACE FUNCTION pgfence.document_register_kind(
  p_kind           text,
  p_merge          text DEFAULT NULL,
  p_merge_function regprocedure DEFAULT NULL,
  p_content_type   text DEFAULT NULL,
  p_max_bytes      integer DEFAULT NULL,
  p_description    text DEFAULT NULL
)
RETURNS TABLE (kind text, merge text, merge_function regprocedure, content_type text,
               max_bytes integer, builtin boolean, description text)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_cur pgfence.document_kind;
  v_fn  pg_catalog.pg_proc;
BEGIN
  IF p_kind IS NULL THEN
    RAISE EXCEPTION 'document_register_kind: kind is required' USING ERRCODE = '22004';
  END IF;
  IF p_kind !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
    RAISE EXCEPTION 'document_register_kind: invalid kind name "%"', p_kind
      USING ERRCODE = '22023', HINT = 'Kind names are 1-63 characters of a-z, 0-9, _ . - starting with a letter.';
  END IF;
  IF p_merge IS NOT NULL AND p_merge NOT IN ('attributes', 'none', 'function') THEN
    RAISE EXCEPTION 'document_register_kind: merge must be attributes, none or function, got "%"', p_merge
      USING ERRCODE = '22023';
  END IF;
  IF p_content_type IS NOT NULL AND p_content_type NOT IN ('object', 'array', 'any') THEN
    RAISE EXCEPTION 'document_register_kind: content_type must be object, array or any, got "%"', p_content_type
      USING ERRCODE = '22023';
  END IF;
  IF p_max_bytes IS NOT NULL AND p_max_bytes NOT BETWEEN 1 AND 104857600 THEN
    RAISE EXCEPTION 'document_register_kind: max_bytes must be between 1 and 104857600 (100 MiB), got %', p_max_bytes
      USING ERRCODE = '22023';
  END IF;
  IF length(p_description) > 1000 THEN
    RAISE EXCEPTION 'document_register_kind: description must be at most 1000 characters, got %', length(p_description)
      USING ERRCODE = '22023', DETAIL = 'The kind registry holds descriptions of up to 1000 characters.',
            HINT = 'Shorten the description; nothing was registered.';
  END IF;
  SELECT k.* INTO v_cur FROM pgfence.document_kind k WHERE k.kind = p_kind FOR UPDATE;
  IF FOUND AND v_cur.builtin
     AND (coalesce(p_merge, v_cur.merge) <> v_cur.merge
          OR p_merge_function IS NOT NULL
          OR coalesce(p_content_type, v_cur.content_type) <> v_cur.content_type) THEN
    RAISE EXCEPTION 'document_register_kind: "%" is built in; only max_bytes and description can change', p_kind
      USING ERRCODE = '22023', HINT = 'Register a kind of your own with the merge you need.';
  END IF;
  IF NOT FOUND AND p_merge IS NULL THEN
    RAISE EXCEPTION 'document_register_kind: a new kind needs a merge (attributes, none or function)'
      USING ERRCODE = '22004';
  END IF;
  IF coalesce(p_merge, v_cur.merge) = 'function' THEN
    IF coalesce(p_merge_function, v_cur.merge_function) IS NULL THEN
      RAISE EXCEPTION 'document_register_kind: merge = function needs merge_function' USING ERRCODE = '22004',
        HINT = 'Pass a function f(base jsonb, local jsonb, stored jsonb) RETURNS jsonb.';
    END IF;
    SELECT p.* INTO v_fn FROM pg_catalog.pg_proc p WHERE p.oid = coalesce(p_merge_function, v_cur.merge_function);
    IF NOT FOUND THEN
      -- a regprocedure is only an OID: '999999'::regprocedure, or a function dropped since
      RAISE EXCEPTION 'document_register_kind: merge_function % does not exist', coalesce(p_merge_function, v_cur.merge_function)::oid
        USING ERRCODE = '42883',
              DETAIL = CASE WHEN p_merge_function IS NULL THEN 'The kind''s merge function was dropped after it was registered.'
                            ELSE 'No function has this OID.' END,
              HINT = 'Pass an existing function f(base jsonb, local jsonb, stored jsonb) RETURNS jsonb.';
    END IF;
    IF v_fn.pronargs <> 3 OR v_fn.proargtypes[0] <> 'jsonb'::regtype OR v_fn.proargtypes[1] <> 'jsonb'::regtype
       OR v_fn.proargtypes[2] <> 'jsonb'::regtype
       OR v_fn.prorettype <> 'jsonb'::regtype OR v_fn.proretset OR v_fn.prokind <> 'f' THEN
      RAISE EXCEPTION 'document_register_kind: % must take (jsonb, jsonb, jsonb) and return one jsonb', p_merge_function
        USING ERRCODE = '22023', HINT = 'Signature: f(base jsonb, local jsonb, stored jsonb) RETURNS jsonb, returning {"content": ..., "conflicts": [...]}.';
    END IF;
    IF v_fn.provolatile = 'v' THEN
      RAISE EXCEPTION 'document_register_kind: % must be IMMUTABLE or STABLE (a merge reads its arguments and changes nothing)', p_merge_function
        USING ERRCODE = '22023';
    END IF;
  ELSIF p_merge_function IS NOT NULL THEN
    RAISE EXCEPTION 'document_register_kind: merge_function is only used with merge = function' USING ERRCODE = '22023';
  END IF;

  INSERT INTO pgfence.document_kind AS k (kind, merge, merge_function, content_type, max_bytes, description)
  VALUES (p_kind,
          coalesce(p_merge, v_cur.merge),
          CASE WHEN coalesce(p_merge, v_cur.merge) = 'function'
               THEN coalesce(p_merge_function, v_cur.merge_function) END,
          coalesce(p_content_type, v_cur.content_type, 'object'),
          coalesce(p_max_bytes, v_cur.max_bytes, 1048576),
          coalesce(p_description, v_cur.description))
  ON CONFLICT ON CONSTRAINT document_kind_pkey DO UPDATE
    SET merge = EXCLUDED.merge, merge_function = EXCLUDED.merge_function,
        content_type = EXCLUDED.content_type, max_bytes = EXCLUDED.max_bytes,
        description = EXCLUDED.description, updated_at = now();
  RETURN QUERY
  SELECT k.kind, k.merge, k.merge_function, k.content_type, k.max_bytes, k.builtin, k.description
  FROM pgfence.document_kind k WHERE k.kind = p_kind;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_register_kind(text, text, regprocedure, text, integer, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_register_kind(text, text, regprocedure, text, integer, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.document_register_kind(text, text, regprocedure, text, integer, text) IS
  'Admin: register a document kind or change one (NULL keeps the current value; a new kind defaults to content_type object and max_bytes 1 MiB). merge: attributes (three-way merge by top-level key, like record), none (never merges, like sheet) or function (merge_function f(base, local, stored jsonb) RETURNS jsonb {"content", "conflicts"}, IMMUTABLE or STABLE; it runs with the privileges of whoever calls document_merge, so grant them EXECUTE on it). Built-in kinds (record, sheet) only take a new max_bytes or description. Returns the stored kind. Errors: 22004 (missing kind, merge or merge_function), 22023 (bad name, merge, content_type, max_bytes, description over 1000 characters or function signature; changing a built-in''s merge), 42883 (merge_function names no function: an OID of nothing, or the kind''s function was dropped).';

-- ---------------------------------------------------------------------------------------------
-- Create, read
-- ---------------------------------------------------------------------------------------------
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
    RAISE EXCEPTION 'document_create: idempotency_key must be 1-255 characters or NULL' USING ERRCODE = '22023';
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
      USING ERRCODE = '40001', HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
  END IF;
  SELECT r.* INTO v_first FROM pgfence.document_revision r WHERE r.document_id = v_id AND r.version = 1;
  IF (SELECT d.kind FROM pgfence.document d WHERE d.id = v_id) <> p_kind OR v_first.content <> p_content THEN
    RAISE EXCEPTION 'document_create: idempotency key "%" already created document % with another kind or content', p_idempotency_key, v_id
      USING ERRCODE = 'PF003',
            HINT = 'A repeated create must send the same kind and content; use a new key for a new document.';
  END IF;
  RETURN v_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_create(text, jsonb, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_create(text, jsonb, text, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_create(text, jsonb, text, text) IS
  'Create a document of a kind with its first content (version 1); returns its id. A repeated idempotency_key with the same kind and content (a retry whose answer was lost) returns the same id and creates nothing. Errors: 22004 (missing kind, content or created_by), 22023 (content of the wrong JSON type, bad created_by or key), PF301 (content over the kind''s max_bytes), PF302 (unknown kind), PF003 (key already used for another kind or content), 40001 (key held by a transaction invisible to a REPEATABLE READ snapshot: retry).';

CREATE OR REPLACE FUNCTION pgfence.document_get(p_id bigint)
RETURNS TABLE (id bigint, kind text, version bigint, content jsonb, deleted boolean,
               created_by text, created_at timestamptz, saved_by text, saved_at timestamptz)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'document_get: id is required' USING ERRCODE = '22004';
  END IF;
  RETURN QUERY
  SELECT d.id, d.kind, d.version, d.content, d.status = 'deleted', d.created_by, d.created_at,
         d.saved_by, d.saved_at
  FROM pgfence.document d WHERE d.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_get: no document with id %', p_id USING ERRCODE = 'P0002',
      HINT = 'Check the id.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_get(bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_get(bigint) IS
  'The current version of a document: kind, version, content (NULL and deleted = true for a deleted document''s tombstone), who created and who last saved it, when. Save against the returned version. Errors: 22004 (id NULL), P0002 (unknown id).';

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
    RAISE EXCEPTION 'document_revision: id and version are required' USING ERRCODE = '22004';
  END IF;
  RETURN QUERY
  SELECT r.document_id, r.version, r.op, r.content, r.save_id, r.saved_by, r.saved_at
  FROM pgfence.document_revision r WHERE r.document_id = p_id AND r.version = p_version;
  IF NOT FOUND THEN
    SELECT d.version INTO v_current FROM pgfence.document d WHERE d.id = p_id;
    IF v_current IS NULL THEN
      RAISE EXCEPTION 'document_revision: no document with id %', p_id USING ERRCODE = 'P0002';
    END IF;
    RAISE EXCEPTION 'document_revision: document % has no version %', p_id, p_version
      USING ERRCODE = 'P0002', DETAIL = format('Versions 1 to %s exist.', v_current);
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_revision(bigint, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_revision(bigint, bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_revision(bigint, bigint) IS
  'One saved version of a document exactly as it was written (op create, save or delete; content NULL for the delete tombstone), e.g. the confirmed base a client edited from, for a three-way merge. Errors: 22004 (NULL argument), P0002 (unknown id, or no such version).';

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
    RAISE EXCEPTION 'document_history: id is required' USING ERRCODE = '22004';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'document_history: limit must be between 1 and 10000' USING ERRCODE = '22023';
  END IF;
  PERFORM 1 FROM pgfence.document d WHERE d.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_history: no document with id %', p_id USING ERRCODE = 'P0002';
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
  'The revisions of a document, newest first, without content: version, op, save_id, who saved it and when, stored size in bytes. Page back with before_version. Errors: 22004 (id NULL), 22023 (limit outside 1..10000), P0002 (unknown id).';

-- ---------------------------------------------------------------------------------------------
-- Save and delete: one compare-and-swap each
-- ---------------------------------------------------------------------------------------------
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
  'Private: the conflict answer (stored version and content, read in one statement) and its event-log row; a conflict changes no document row, so its event is written here.';

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
  'Private: answers a retried save from its receipt (the revision with the same save_id): saved with that version when the retry sends the same base and content, PF003 otherwise. Logs a replay event.';

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
BEGIN
  -- The hot path calls no helper: the helpers run only to raise the precise error.
  IF p_id IS NULL OR p_expected_version IS NULL OR p_expected_version < 1
     OR p_saved_by IS NULL OR p_saved_by = '' OR length(p_saved_by) > 200 THEN
    PERFORM pgfence._document_check_write(p_id, p_expected_version);
    PERFORM pgfence._document_check_actor(p_saved_by, 'saved_by');
  END IF;
  IF p_save_id IS NOT NULL AND (p_save_id = '' OR length(p_save_id) > 255) THEN
    RAISE EXCEPTION 'document_save: save_id must be 1-255 characters or NULL' USING ERRCODE = '22023',
      HINT = 'Use a fresh random id (e.g. a UUID) per snapshot, and the same one when retrying it.';
  END IF;
  SELECT d.version, d.status, d.kind, k.content_type, k.max_bytes
  INTO v_version, v_status, v_kind, v_type, v_max
  FROM pgfence.document d JOIN pgfence.document_kind k ON k.kind = d.kind
  WHERE d.id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_save: no document with id %', p_id USING ERRCODE = 'P0002',
      HINT = 'Check the id; create documents with document_create().';
  END IF;
  IF p_content IS NULL OR jsonb_typeof(p_content) = 'null'
     OR (v_type = 'object' AND jsonb_typeof(p_content) <> 'object')
     OR (v_type = 'array' AND jsonb_typeof(p_content) <> 'array')
     OR octet_length(p_content::text) > v_max THEN
    PERFORM pgfence._document_check_content(pgfence._document_kind(v_kind), p_content);
  END IF;

  -- A retry whose first answer was lost: the receipt answers it.
  IF p_save_id IS NOT NULL THEN
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

  IF v_status = 'live' AND v_version = p_expected_version THEN
    -- The compare-and-swap. A concurrent save of the same version makes us wait for its
    -- commit, after which the row no longer matches and we fall through to the conflict.
    UPDATE pgfence.document d
    SET version = d.version + 1, content = p_content, save_id = p_save_id, saved_by = p_saved_by
    WHERE d.id = p_id AND d.version = p_expected_version AND d.status = 'live'
    RETURNING d.version, d.saved_at INTO v_version, v_saved_at;
    IF FOUND THEN
      RETURN QUERY SELECT 'saved'::text, v_version, NULL::jsonb, p_saved_by, v_saved_at, false, false;
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
  'Save a document as one compare-and-swap on expected_version. Returns one row: outcome saved with the new version (expected_version + 1), or outcome conflict with the stored version, its content and who saved it (deleted = true if the stored version is the delete tombstone); a conflict writes nothing but its event. Never last-write-wins: there is no unconditional save. save_id (a fresh id per snapshot, reused when retrying it) makes a retry whose first answer was lost return saved with the same version (replayed = true), never a false conflict. Errors: 22004 (missing id, expected_version, content or saved_by), 22023 (content of the wrong JSON type, bad saved_by or save_id), P0002 (unknown id), PF301 (content over the kind''s max_bytes), PF303 (expected_version newer than any version of the document), PF003 (save_id already used for other content or another base version).';

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
      RAISE EXCEPTION 'document_delete: no document with id %', p_id USING ERRCODE = 'P0002';
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
  'Delete a document as a compare-and-swap on expected_version: outcome deleted with the tombstone version (expected_version + 1; the row, its id and all revisions stay, and the document never changes again), or outcome conflict with the stored version and content. Repeating a delete that already happened on the same expected_version answers deleted (replayed = true). Errors: 22004 (missing id, expected_version or by), 22023 (bad by, version < 1), P0002 (unknown id), PF303 (expected_version newer than any version of the document).';

-- ---------------------------------------------------------------------------------------------
-- Merge: the kind's three-way merge, for a client rebasing after a conflict
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.document_merge(p_kind text, p_base jsonb, p_local jsonb, p_stored jsonb)
RETURNS TABLE (content jsonb, conflicts jsonb)
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_merge    text;
  v_function regprocedure;
  v_call     text;
  v_result   jsonb;
BEGIN
  IF p_kind IS NULL THEN
    RAISE EXCEPTION 'document_merge: kind is required' USING ERRCODE = '22004';
  END IF;
  IF p_base IS NULL OR p_local IS NULL OR p_stored IS NULL THEN
    RAISE EXCEPTION 'document_merge: base, local and stored are all required' USING ERRCODE = '22004',
      HINT = 'base = the revision the local copy was edited from (document_revision), stored = the conflict answer''s content. A deleted document cannot be merged into.';
  END IF;
  -- Read through the view: this function runs with the caller's privileges (so that an
  -- application's merge function never runs as pgfence's owner).
  SELECT k.merge, k.merge_function INTO v_merge, v_function
  FROM pgfence.document_kinds k WHERE k.kind = p_kind;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_merge: unknown kind "%"', p_kind USING ERRCODE = 'PF302',
      HINT = 'See the view pgfence.document_kinds.';
  END IF;

  IF v_merge = 'attributes' THEN
    IF jsonb_typeof(p_base) <> 'object' OR jsonb_typeof(p_local) <> 'object' OR jsonb_typeof(p_stored) <> 'object' THEN
      RAISE EXCEPTION 'document_merge: kind % merges objects keyed by attribute id; got %, %, %', p_kind,
        jsonb_typeof(p_base), jsonb_typeof(p_local), jsonb_typeof(p_stored)
        USING ERRCODE = '22023';
    END IF;
    -- Per attribute (SQL NULL = absent on that side): the side that changed it wins; both
    -- changed it the same way: that value; both changed it differently: a conflict, and the
    -- merged content keeps the stored value until the caller resolves it.
    RETURN QUERY
    WITH keys AS (
      SELECT k FROM jsonb_object_keys(p_base) k
      UNION SELECT k FROM jsonb_object_keys(p_local) k
      UNION SELECT k FROM jsonb_object_keys(p_stored) k
    ), sides AS (
      SELECT k, p_base -> k AS b, p_local -> k AS l, p_stored -> k AS s FROM keys
    ), decided AS (
      SELECT k, b, l, s,
             CASE WHEN l IS NOT DISTINCT FROM s THEN l
                  WHEN l IS NOT DISTINCT FROM b THEN s
                  WHEN s IS NOT DISTINCT FROM b THEN l
                  ELSE s END AS v,
             l IS DISTINCT FROM s AND l IS DISTINCT FROM b AND s IS DISTINCT FROM b AS clash
      FROM sides
    )
    SELECT coalesce(jsonb_object_agg(k, v) FILTER (WHERE v IS NOT NULL), '{}'::jsonb),
           coalesce(jsonb_agg(jsonb_build_object('key', k)
                              || CASE WHEN b IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('base', b) END
                              || CASE WHEN l IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('local', l) END
                              || CASE WHEN s IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('stored', s) END
                              ORDER BY k) FILTER (WHERE clash), '[]'::jsonb)
    FROM decided;
    RETURN;
  END IF;

  IF v_merge = 'none' THEN
    -- Only one side changed (or both made the same change): nothing to merge.
    IF p_local = p_stored OR p_local = p_base THEN
      RETURN QUERY SELECT p_stored, '[]'::jsonb;
      RETURN;
    END IF;
    IF p_stored = p_base THEN
      RETURN QUERY SELECT p_local, '[]'::jsonb;
      RETURN;
    END IF;
    -- Both changed: never merged. Every difference between local and stored is a conflict.
    IF jsonb_typeof(p_local) = 'object' AND jsonb_typeof(p_stored) = 'object' THEN
      RETURN QUERY
      WITH keys AS (
        SELECT k FROM jsonb_object_keys(p_local) k UNION SELECT k FROM jsonb_object_keys(p_stored) k
      )
      SELECT NULL::jsonb,
             jsonb_agg(jsonb_build_object('key', k)
                       || CASE WHEN p_base -> k IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('base', p_base -> k) END
                       || CASE WHEN p_local -> k IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('local', p_local -> k) END
                       || CASE WHEN p_stored -> k IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('stored', p_stored -> k) END
                       ORDER BY k)
      FROM keys WHERE (p_local -> k) IS DISTINCT FROM (p_stored -> k);
    ELSIF jsonb_typeof(p_local) = 'array' AND jsonb_typeof(p_stored) = 'array' THEN
      RETURN QUERY
      SELECT NULL::jsonb,
             jsonb_agg(jsonb_build_object('key', i)
                       || CASE WHEN jsonb_typeof(p_base) <> 'array' OR p_base -> i IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('base', p_base -> i) END
                       || CASE WHEN p_local -> i IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('local', p_local -> i) END
                       || CASE WHEN p_stored -> i IS NULL THEN '{}'::jsonb ELSE jsonb_build_object('stored', p_stored -> i) END
                       ORDER BY i)
      FROM generate_series(0, greatest(jsonb_array_length(p_local), jsonb_array_length(p_stored)) - 1) AS i
      WHERE (p_local -> i) IS DISTINCT FROM (p_stored -> i);
    ELSE
      RETURN QUERY SELECT NULL::jsonb,
        jsonb_build_array(jsonb_build_object('key', NULL, 'base', p_base, 'local', p_local, 'stored', p_stored));
    END IF;
    RETURN;
  END IF;

  -- merge = function: the application's merge, with the caller's privileges.
  SELECT format('SELECT %I.%I($1, $2, $3)', n.nspname, p.proname) INTO v_call
  FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
  WHERE p.oid = v_function;
  IF v_call IS NULL THEN
    RAISE EXCEPTION 'document_merge: the merge function of kind % no longer exists', p_kind
      USING ERRCODE = '42883', DETAIL = format('The kind was registered with function OID %s, which names no function now.', v_function::oid),
            HINT = 'An admin re-registers the kind with an existing merge function (document_register_kind).';
  END IF;
  EXECUTE v_call INTO v_result USING p_base, p_local, p_stored;
  IF v_result IS NULL OR jsonb_typeof(v_result) <> 'object' OR NOT v_result ? 'content'
     OR jsonb_typeof(v_result -> 'conflicts') IS DISTINCT FROM 'array' THEN
    RAISE EXCEPTION 'document_merge: the merge function % of kind % returned %, not {"content": ..., "conflicts": [...]}', v_function, p_kind, left(coalesce(v_result::text, 'NULL'), 200)
      USING ERRCODE = 'PF304', HINT = 'Fix the kind''s merge function.';
  END IF;
  RETURN QUERY SELECT CASE WHEN jsonb_typeof(v_result -> 'content') = 'null' THEN NULL ELSE v_result -> 'content' END,
                      v_result -> 'conflicts';
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_merge(text, jsonb, jsonb, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_merge(text, jsonb, jsonb, jsonb) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_merge(text, jsonb, jsonb, jsonb) IS
  'Three-way merge of a kind: base = the revision the local copy was edited from, local = the client''s copy, stored = the conflict answer''s content. Returns content (the merge, to save against the stored version) and conflicts (a JSON array of {"key", "base", "local", "stored"}, a side''s field absent when the key is absent on that side; empty = clean). attributes (record): per top-level key, the side that changed it wins; keys changed differently on both sides are conflicts and content keeps the stored value for them. none (sheet): never merges: if only one side changed, content is that side; if both changed, content is NULL and every differing top-level key or array index (key NULL: the whole value) is a conflict. function: the kind''s merge_function, run with the caller''s privileges. Changes nothing. Errors: 22004 (NULL argument), 22023 (record inputs that are not objects), PF302 (unknown kind), PF304 (a merge function returned a malformed result), 42883 (the kind''s merge function was dropped); a kind''s merge function may raise its own.';
