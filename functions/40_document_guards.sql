-- pgfence functions/40_document_guards.sql — documents (module 4): guards, revisions, checks.
--
-- Versioned documents: the server is authoritative, every write carries the version it was
-- based on, and a conflict is an answer, not an error. Files: 40 guards, the revision writer and
-- private checks, 41 kinds, 42 reads, 43 create / save / delete, 44 the three-way merge.
-- Here: tg_document_write (the one trigger on the write path: the next version, its revision and
-- event), tg_document_created (revision 1), tg_document_revision_guard (revisions never change),
-- tg_document_revision_insert (revisions are written only with their version); the last two also
-- hold what were the tables' CHECK constraints (migration 0031, raised by _check_violated);
-- the private argument checks shared by the writes (_document_kind, _document_check_*,
-- _document_version_unknown) and the tables' comments. No public functions.
-- Errors: functions/ERRORS.md (PF301-PF304 are this module's).

-- The tables (created by migration 0005; their comments live here, re-applied by every migrate).
COMMENT ON TABLE pgfence.document_kind IS
  'Document kinds: the JSON shape, the size limit and the three-way merge of each kind.
The JSON shape a kind''s content must have, its size limit, and its three-way merge (attributes: merge by top-level key; none: never merge, every difference is a conflict; function: an application function). Built in: record, sheet. Not an API: read pgfence.document_kinds, change with pgfence.document_register_kind().';
COMMENT ON TABLE pgfence.document IS
  'Versioned documents: one row per document, holding its current version (live or deleted).
Status machine live -> deleted (terminal tombstone). version grows by exactly one per write (create = 1, each save and the delete +1) and is never reused. Every version is also kept in pgfence.document_revision. Not an API: use the pgfence.document_* functions.';
COMMENT ON TABLE pgfence.document_revision IS
  'Every version of every document, as it was written: the history, and the receipts of saves.
Content NULL for the delete tombstone; written in the same transaction as the version. Immutable. Version v of a save was a compare-and-swap on version v-1. Not an API: use document_revision() and document_history().';

-- ---------------------------------------------------------------------------------------------
-- The document machine, held by tg_document_write for any write (psql included):
--   live --save (version+1)--> live;  live --delete (version+1)--> deleted;  deleted is final.
-- A document row is never DELETEd. Every version is kept in document_revision, written by the
-- same statement; a revision that carries a save_id is the receipt of that save.
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_document_write()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_op    text;
  v_log   boolean;
  v_check text;
BEGIN
  IF TG_OP = 'DELETE' THEN
    RAISE EXCEPTION 'document % cannot be removed: a deleted document keeps its tombstone so its id and versions are never reused', OLD.id
      USING ERRCODE = 'PF002', DETAIL = 'A client holding an old id or version must get a conflict, never meet another document.',
            HINT = 'Use pgfence.document_delete(id, expected_version, by).';
  END IF;
  IF TG_OP = 'INSERT' THEN
    IF NEW.version IS DISTINCT FROM 1 OR NEW.status IS DISTINCT FROM 'live' THEN
      RAISE EXCEPTION 'a new document starts live at version 1 (got % at version %)', NEW.status, NEW.version
        USING ERRCODE = 'PF001', DETAIL = 'Every document starts at version 1, kept as revision 1 with its create event.',
              HINT = 'Use pgfence.document_create().';
    END IF;
  ELSE
    IF NEW.id IS DISTINCT FROM OLD.id
       OR NEW.kind IS DISTINCT FROM OLD.kind
       OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
       OR NEW.created_by IS DISTINCT FROM OLD.created_by
       OR NEW.created_at IS DISTINCT FROM OLD.created_at THEN
      RAISE EXCEPTION 'document %: id, kind, idempotency_key, created_by and created_at never change', OLD.id
        USING ERRCODE = 'PF002', DETAIL = 'They are the document''s identity and the record of its creation.',
              HINT = 'Create a new document instead.';
    END IF;
    IF NOT (OLD.status = 'live' AND NEW.status IN ('live', 'deleted')) THEN
      RAISE EXCEPTION 'illegal document transition for document %: % -> %', OLD.id, OLD.status, NEW.status
        USING ERRCODE = 'PF001',
              DETAIL = 'Allowed: live -> live (save), live -> deleted (delete). A deleted document never changes again.',
              HINT = 'Use pgfence.document_save() and pgfence.document_delete().';
    END IF;
    IF NEW.version IS DISTINCT FROM OLD.version + 1 THEN
      RAISE EXCEPTION 'document %: every write makes exactly the next version (% -> % refused)', OLD.id, OLD.version, NEW.version
        USING ERRCODE = 'PF002', DETAIL = 'The version is the compare-and-swap token every save presents as its expected_version.',
              HINT = 'Versions only grow by one per write and are never reused; save with pgfence.document_save().';
    END IF;
  END IF;
  -- The table's CHECK constraints, checked here since migration 0031 (a declared CHECK costs
  -- every write statement, the save's fast path included, which makes them hold by construction):
  -- the same conditions (NULL passes, as in a CHECK), SQLSTATE 23514 and constraint names, after
  -- the machine's checks above, as PostgreSQL checked them after this trigger.
  v_check := CASE
    WHEN NOT (NEW.idempotency_key <> '' AND length(NEW.idempotency_key) <= 255) THEN 'document_idempotency_key_check'
    WHEN NOT (NEW.status IN ('live', 'deleted')) THEN 'document_status_check'
    WHEN NOT (NEW.version >= 1) THEN 'document_version_check'
    WHEN NOT (NEW.save_id <> '' AND length(NEW.save_id) <= 255) THEN 'document_save_id_check'
    WHEN NOT (NEW.created_by <> '' AND length(NEW.created_by) <= 200) THEN 'document_created_by_check'
    WHEN NOT (NEW.saved_by <> '' AND length(NEW.saved_by) <= 200) THEN 'document_saved_by_check'
    WHEN NOT ((NEW.status = 'live') = (NEW.content IS NOT NULL)) THEN 'document_content_iff_live'
  END;
  IF v_check IS NOT NULL THEN
    PERFORM pgfence._check_violated('document', v_check,
      format('Document %s, version %s, status %s.', NEW.id, NEW.version, NEW.status),
      'idempotency_key and save_id are 1-255 characters or NULL, created_by and saved_by 1-200 characters, content is present exactly while the document is live; use the pgfence.document_* functions.');
  END IF;
  IF TG_OP = 'INSERT' THEN
    NEW.created_at := now();
    NEW.saved_at := now();
    RETURN NEW;   -- revision 1 and its event: tg_document_created, once the row exists
  END IF;
  v_op := CASE WHEN NEW.status = 'deleted' THEN 'delete' ELSE 'save' END;
  NEW.saved_at := now();
  -- The revision (and the receipt of its save_id) and the event are written by the same
  -- statement as the version: if anything after this trigger refuses the row, the statement
  -- fails and takes them back with it.
  INSERT INTO pgfence.document_revision (document_id, version, op, content, save_id, saved_by, saved_at)
  VALUES (NEW.id, NEW.version, v_op, NEW.content, NEW.save_id, NEW.saved_by, NEW.saved_at);
  -- The save event only if the kind logs saves (document_kind.log_saves); a delete always, and
  -- without reading the kind (two IFs: an OR in one expression may evaluate both sides).
  IF v_op = 'save' THEN
    v_log := (SELECT k.log_saves FROM pgfence.document_kind k WHERE k.kind = NEW.kind);
  END IF;
  IF v_op = 'delete' OR v_log THEN
    INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
    VALUES ('document', NEW.id, v_op, OLD.status, NEW.status, NEW.saved_by, NEW.version,
            jsonb_strip_nulls(jsonb_build_object('kind', NEW.kind, 'based_on', OLD.version,
                                                 'save_id', NEW.save_id)));
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_document_write() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_document_write() IS
  'Trigger: every write to a document makes exactly the next version, kept as a revision.
BEFORE INSERT/UPDATE/DELETE trigger on pgfence.document, for any writer (psql included): a document starts live at version 1; every update makes exactly the next version (PF002 otherwise); only live -> live and live -> deleted are allowed (PF001); identity columns never change (PF002); rows are never deleted (PF002: the tombstone stays). Since migration 0031 it also checks what were the table''s CHECK constraints (23514 with the constraint''s name: document_idempotency_key_check, _status_check, _version_check, _save_id_check, _created_by_check, _saved_by_check, document_content_iff_live), after the machine''s own checks. Stamps created_at/saved_at from now(). For an update it also keeps the new version as an immutable pgfence.document_revision row (the receipt of its save_id) and logs save (if the kind''s log_saves is on) and delete to pgfence.event (actor = saved_by, fence = version), in the same statement. Not run for the one UPDATE that does all of this itself: document_save''s compare-and-swap, marked by a fresh write_nonce equal to the setting pgfence.document_writing (see the trigger document_write).';

-- Two triggers run it. document_write_new_or_gone, for every INSERT and DELETE. document_write,
-- for every UPDATE but one kind: document_save's fast path (43_document_write.sql) does the
-- trigger's work in its own statement (the checks in its WHERE and SET, the revision and the
-- event in the same statement) and marks its row with write_nonce, a value the row never had
-- (the base version as a uuid, since migration 0031; a gen_random_uuid() before) that it also puts in the transaction-local setting pgfence.document_writing for that one
-- statement. The trigger is skipped only for a row whose write_nonce changed to exactly that
-- value. No other function changes write_nonce (a catalog test in tests/pgtap/40_document.sql
-- checks it), and no client role may write the table, so a client that pre-sets the setting
-- before calling document_delete (or anything else) gains nothing: the row keeps its old nonce
-- and the trigger runs. Only a login that may UPDATE the table itself (its owner) could do both
-- on purpose; it can also disable triggers. The WHEN condition costs no function call.
-- (Before migration 0024 the column does not exist: one unconditional trigger, as before.)
DO $document_write$
BEGIN
  IF EXISTS (SELECT FROM pg_catalog.pg_attribute
             WHERE attrelid = 'pgfence.document'::regclass AND attname = 'write_nonce' AND NOT attisdropped) THEN
    CREATE OR REPLACE TRIGGER document_write
      BEFORE UPDATE ON pgfence.document
      FOR EACH ROW
      WHEN (NEW.write_nonce IS NOT DISTINCT FROM OLD.write_nonce
            OR NEW.write_nonce::text IS DISTINCT FROM pg_catalog.current_setting('pgfence.document_writing', true))
      EXECUTE FUNCTION pgfence.tg_document_write();
    CREATE OR REPLACE TRIGGER document_write_new_or_gone
      BEFORE INSERT OR DELETE ON pgfence.document
      FOR EACH ROW EXECUTE FUNCTION pgfence.tg_document_write();
  ELSE
    CREATE OR REPLACE TRIGGER document_write
      BEFORE INSERT OR UPDATE OR DELETE ON pgfence.document
      FOR EACH ROW EXECUTE FUNCTION pgfence.tg_document_write();
  END IF;
END
$document_write$;

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
  'Trigger: keeps version 1 of a new document as revision 1 and logs its create event.
AFTER INSERT trigger on pgfence.document, in the creating transaction.';

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
    USING ERRCODE = 'PF002', DETAIL = 'A revision is a version as it was written, and the receipt of its save_id.',
          HINT = 'Revisions are the history and the save receipts; save a new version instead.';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_document_revision_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_document_revision_guard() IS
  'Trigger: document revisions never change and are never removed (PF002).
BEFORE UPDATE/DELETE trigger on pgfence.document_revision.';

CREATE OR REPLACE TRIGGER document_revision_guard
  BEFORE UPDATE OR DELETE ON pgfence.document_revision
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_document_revision_guard();

-- A revision is written only in the statement that writes its version: by the two triggers above
-- or by document_save's fast path (so its document exists: migration 0024 dropped the foreign key
-- that proved it on every save). A hand-written INSERT runs at trigger depth 0 without the
-- setting pgfence.document_writing and is refused. Clients have no INSERT on the table at all;
-- this stops the owner's mistakes. The same trigger checks the table's CHECK constraints
-- (migration 0031) for every revision written from inside a trigger (tg_document_write,
-- tg_document_created); the fast path's revision (depth 0, the setting holds the statement's
-- nonce) skips it: it is op save, version expected_version + 1 >= 2 and has content by
-- construction. The WHEN condition costs that path no function call.
CREATE OR REPLACE FUNCTION pgfence.tg_document_revision_insert()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_check text;
BEGIN
  -- depth 1: this trigger fired for a statement outside any trigger, and its WHEN let it through
  -- because the setting was empty (a hand-written INSERT)
  IF pg_trigger_depth() = 1 THEN
    RAISE EXCEPTION 'revision % of document % cannot be written by hand', NEW.version, NEW.document_id
      USING ERRCODE = 'PF002', DETAIL = 'A revision is written with its version, by the document triggers, in the same statement.',
            HINT = 'Use pgfence.document_save(), document_create() or document_delete().';
  END IF;
  -- The table's CHECK constraints (until migration 0031), with their names and SQLSTATE 23514;
  -- NULL passes, as in a CHECK.
  v_check := CASE
    WHEN NOT (NEW.version >= 1) THEN 'document_revision_version_check'
    WHEN NOT (NEW.op IN ('create', 'save', 'delete')) THEN 'document_revision_op_check'
    WHEN NOT ((NEW.op = 'delete') = (NEW.content IS NULL)) THEN 'document_revision_content_iff_not_delete'
    WHEN NOT ((NEW.op = 'create') = (NEW.version = 1)) THEN 'document_revision_create_is_1'
  END;
  IF v_check IS NOT NULL THEN
    PERFORM pgfence._check_violated('document_revision', v_check,
      format('Revision %s of document %s, op %s.', NEW.version, NEW.document_id, NEW.op),
      'A revision is version 1 exactly when it is the create, and has content unless it is the delete; use the pgfence.document_* functions.');
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_document_revision_insert() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_document_revision_insert() IS
  'Trigger: a revision is written only with its version, by the document triggers (PF002 otherwise).
BEFORE INSERT trigger on pgfence.document_revision, WHEN (pg_trigger_depth() > 0 or pgfence.document_writing unset): a hand-written INSERT (psql, the owner included; client roles have no INSERT privilege at all) is refused. It stands in for the foreign key to pgfence.document (dropped by migration 0024): tg_document_write, tg_document_created and document_save''s compare-and-swap write a revision only for the row they are writing in the same statement, and a document row is never deleted. For a revision written from inside a trigger it checks what were the table''s CHECK constraints until migration 0031 (23514 with the constraint''s name: document_revision_version_check, _op_check, _content_iff_not_delete, _create_is_1); document_save''s compare-and-swap, which makes them hold by construction, skips it.';

CREATE OR REPLACE TRIGGER document_revision_insert_guard
  BEFORE INSERT ON pgfence.document_revision
  FOR EACH ROW
  WHEN (pg_catalog.pg_trigger_depth() > 0
        OR COALESCE(pg_catalog.current_setting('pgfence.document_writing', true), '') = '')
  EXECUTE FUNCTION pgfence.tg_document_revision_insert();

-- ---------------------------------------------------------------------------------------------
-- Private checks, shared by the writes (the hot path of document_save calls them only to
-- raise the precise error)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._document_kind(p_kind text)
RETURNS pgfence.document_kind
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_row pgfence.document_kind;
BEGIN
  IF p_kind IS NULL THEN
    RAISE EXCEPTION 'document: kind is required'
      USING ERRCODE = '22004', DETAIL = 'The kind decides the content''s JSON shape, its size limit and how conflicts merge.',
            HINT = 'Pass record, sheet or a registered kind.';
  END IF;
  SELECT k.* INTO v_row FROM pgfence.document_kind k WHERE k.kind = p_kind;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document: unknown kind "%"', p_kind
      USING ERRCODE = 'PF302', DETAIL = 'No kind of this name is registered; nothing was written.',
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
    RAISE EXCEPTION 'document: content is required'
      USING ERRCODE = '22004', DETAIL = 'A write sends the whole document, not a change.',
            HINT = 'Pass the whole document as JSON; to remove a document use document_delete().';
  END IF;
  IF (p_kind.content_type = 'object' AND jsonb_typeof(p_content) <> 'object')
     OR (p_kind.content_type = 'array' AND jsonb_typeof(p_content) <> 'array')
     OR jsonb_typeof(p_content) = 'null' THEN
    RAISE EXCEPTION 'document: a % document''s content must be a JSON %, got %', p_kind.kind,
      CASE p_kind.content_type WHEN 'any' THEN 'value other than null' ELSE p_kind.content_type END,
      jsonb_typeof(p_content)
      USING ERRCODE = '22023', DETAIL = format('Kind %s has content_type %s.', p_kind.kind, p_kind.content_type),
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
  'Private: checks content against its kind: present, of the kind''s JSON type, within its size limit.
Raises 22004 (NULL), 22023 (wrong JSON type) or PF301 (over max_bytes).';

CREATE OR REPLACE FUNCTION pgfence._document_check_actor(p_by text, p_what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_by IS NULL THEN
    RAISE EXCEPTION 'document: % is required', p_what
      USING ERRCODE = '22004', DETAIL = 'Every version records who wrote it.',
            HINT = 'Name the user or process making the change; it is stored with the version and in the event log.';
  END IF;
  IF p_by = '' OR length(p_by) > 200 THEN
    RAISE EXCEPTION 'document: % must be 1-200 characters', p_what
      USING ERRCODE = '22023', DETAIL = format('Got %s characters.', length(p_by)),
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
    RAISE EXCEPTION 'document: id is required'
      USING ERRCODE = '22004', DETAIL = 'Every write names the document it changes.',
            HINT = 'Pass the id that pgfence.document_create returned.';
  END IF;
  IF p_expected_version IS NULL THEN
    RAISE EXCEPTION 'document %: expected_version is required: there is no unconditional overwrite', p_id
      USING ERRCODE = '22004', DETAIL = 'A write that does not say which version it is based on could overwrite a newer one.',
            HINT = 'Pass the version your content is based on (from document_get or the last save); a mismatch is answered as a conflict, never overwritten.';
  END IF;
  IF p_expected_version < 1 THEN
    RAISE EXCEPTION 'document %: expected_version must be >= 1, got %', p_id, p_expected_version
      USING ERRCODE = '22023', DETAIL = 'expected_version is the version your content is based on.',
            HINT = 'Versions start at 1.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_check_write(bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_check_write(bigint, bigint) IS
  'Private: a write names a document and the version it is based on; raises 22004 or 22023.
22004 for a NULL id or expected_version (there is no unconditional overwrite), 22023 for a version < 1.';

CREATE OR REPLACE FUNCTION pgfence._document_version_unknown(p_id bigint, p_expected_version bigint, p_current bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'document %: expected_version % was never issued (the current version is %)', p_id, p_expected_version, p_current
    USING ERRCODE = 'PF303', DETAIL = format('Versions 1 to %s exist.', p_current),
          HINT = 'The version must come from this document (document_get, a save answer or a conflict answer); check that the client did not mix up documents.';
END
$$;
REVOKE ALL ON FUNCTION pgfence._document_version_unknown(bigint, bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._document_version_unknown(bigint, bigint, bigint) IS
  'Private: raises PF303 for an expected_version higher than any version the document had.';
