-- pgfence functions/41_document_kinds.sql — documents (module 4): kinds.
--
-- Public: the view document_kinds (every kind: content shape, size limit, merge) and
-- document_register_kind (administrators: add a kind or change one). A kind decides what its
-- documents may hold (content_type object, array or any; max_bytes of JSON text) and how
-- document_merge resolves a conflict: attributes (by top-level key, like record), none (never,
-- like sheet) or function (an application's merge_function, run with the caller's privileges).
-- record and sheet are built in: only their max_bytes, description and log_saves can change.
-- log_saves (migration 0014): whether a save writes a save event (default true); revisions,
-- creates, deletes, conflicts and replays are written either way.
-- Errors: functions/ERRORS.md.

CREATE OR REPLACE VIEW pgfence.document_kinds AS
SELECT k.kind, k.merge, k.merge_function, k.content_type, k.max_bytes, k.builtin, k.description,
       k.updated_at, k.log_saves
FROM pgfence.document_kind k;
REVOKE ALL ON pgfence.document_kinds FROM PUBLIC;
GRANT SELECT ON pgfence.document_kinds TO pgfence_client, pgfence_admin;
COMMENT ON VIEW pgfence.document_kinds IS
  'Document kinds: the content shape, size limit and merge of each kind (record, sheet, yours).
Content shape (object, array, any), size limit in bytes of JSON text, and merge (attributes: by top-level key; none: never merges; function: merge_function). record and sheet are built in; applications add kinds with document_register_kind().';
COMMENT ON COLUMN pgfence.document_kinds.kind IS 'The kind''s name, as documents name it (document_create).';
COMMENT ON COLUMN pgfence.document_kinds.merge IS 'How document_merge resolves a conflict: attributes (by top-level key), none (never merges), function.';
COMMENT ON COLUMN pgfence.document_kinds.merge_function IS 'For merge = function: f(base, local, stored jsonb) RETURNS jsonb {"content", "conflicts"}; NULL otherwise.';
COMMENT ON COLUMN pgfence.document_kinds.content_type IS 'The JSON type a document''s content must have: object, array, or any (anything but null).';
COMMENT ON COLUMN pgfence.document_kinds.max_bytes IS 'The largest content accepted by create and save, in bytes of its JSON text.';
COMMENT ON COLUMN pgfence.document_kinds.builtin IS 'Built in (record, sheet): only max_bytes, description and log_saves can change.';
COMMENT ON COLUMN pgfence.document_kinds.description IS 'What the kind is for, as whoever registered it wrote it.';
COMMENT ON COLUMN pgfence.document_kinds.updated_at IS 'When the kind was last registered or changed.';
COMMENT ON COLUMN pgfence.document_kinds.log_saves IS 'Whether each save writes a save event to the event log (creates, deletes, conflicts and replays always do; the revision is written either way).';

CREATE OR REPLACE FUNCTION pgfence.document_register_kind(
  p_kind           text,
  p_merge          text DEFAULT NULL,
  p_merge_function regprocedure DEFAULT NULL,
  p_content_type   text DEFAULT NULL,
  p_max_bytes      integer DEFAULT NULL,
  p_description    text DEFAULT NULL,
  p_log_saves      boolean DEFAULT NULL
)
RETURNS TABLE (kind text, merge text, merge_function regprocedure, content_type text,
               max_bytes integer, builtin boolean, description text, log_saves boolean)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
DECLARE
  v_cur pgfence.document_kind;
  v_fn  pg_catalog.pg_proc;
BEGIN
  IF p_kind IS NULL THEN
    RAISE EXCEPTION 'document_register_kind: kind is required'
      USING ERRCODE = '22004', DETAIL = 'Documents name their kind by this name.',
            HINT = 'Pass a name, e.g. ''invoice''; the view pgfence.document_kinds lists the registered ones.';
  END IF;
  IF p_kind !~ '^[a-z][a-z0-9_.-]{0,62}$' THEN
    RAISE EXCEPTION 'document_register_kind: invalid kind name "%"', p_kind
      USING ERRCODE = '22023', DETAIL = 'Documents name their kind by this name; nothing was registered.',
            HINT = 'Kind names are 1-63 characters of a-z, 0-9, _ . - starting with a letter.';
  END IF;
  IF p_merge IS NOT NULL AND p_merge NOT IN ('attributes', 'none', 'function') THEN
    RAISE EXCEPTION 'document_register_kind: merge must be attributes, none or function, got "%"', p_merge
      USING ERRCODE = '22023', DETAIL = 'attributes merges by top-level key, none never merges, function calls merge_function.',
            HINT = 'Pass attributes, none or function (NULL keeps the current merge).';
  END IF;
  IF p_content_type IS NOT NULL AND p_content_type NOT IN ('object', 'array', 'any') THEN
    RAISE EXCEPTION 'document_register_kind: content_type must be object, array or any, got "%"', p_content_type
      USING ERRCODE = '22023', DETAIL = 'content_type is the JSON type every document of the kind has: object, array, or any value but null.',
            HINT = 'Pass object, array or any (NULL keeps the current one; a new kind defaults to object).';
  END IF;
  IF p_max_bytes IS NOT NULL AND p_max_bytes NOT BETWEEN 1 AND 104857600 THEN
    RAISE EXCEPTION 'document_register_kind: max_bytes must be between 1 and 104857600 (100 MiB), got %', p_max_bytes
      USING ERRCODE = '22023', DETAIL = 'max_bytes limits a document''s content, in bytes of its JSON text.',
            HINT = 'Pass 1 to 104857600 (NULL keeps the current limit; a new kind defaults to 1 MiB).';
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
    RAISE EXCEPTION 'document_register_kind: "%" is built in; only max_bytes, description and log_saves can change', p_kind
      USING ERRCODE = '22023', DETAIL = format('%s is built in with merge %s and content_type %s.', p_kind, v_cur.merge, v_cur.content_type),
            HINT = 'Register a kind of your own with the merge you need.';
  END IF;
  IF NOT FOUND AND p_merge IS NULL THEN
    RAISE EXCEPTION 'document_register_kind: a new kind needs a merge (attributes, none or function)'
      USING ERRCODE = '22004', DETAIL = format('No kind %s is registered yet, so there is no merge to keep.', p_kind),
            HINT = 'Pass p_merge => ''attributes'', ''none'' or ''function'' (with p_merge_function).';
  END IF;
  IF coalesce(p_merge, v_cur.merge) = 'function' THEN
    IF coalesce(p_merge_function, v_cur.merge_function) IS NULL THEN
      RAISE EXCEPTION 'document_register_kind: merge = function needs merge_function'
        USING ERRCODE = '22004', DETAIL = 'merge = function calls merge_function for every three-way merge of the kind.',
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
        USING ERRCODE = '22023', DETAIL = 'document_merge calls it with the base, local and stored content.',
              HINT = 'Signature: f(base jsonb, local jsonb, stored jsonb) RETURNS jsonb, returning {"content": ..., "conflicts": [...]}.';
    END IF;
    IF v_fn.provolatile = 'v' THEN
      RAISE EXCEPTION 'document_register_kind: % must be IMMUTABLE or STABLE (a merge reads its arguments and changes nothing)', p_merge_function
        USING ERRCODE = '22023', DETAIL = format('%s is VOLATILE.', coalesce(p_merge_function, v_cur.merge_function)),
              HINT = 'Declare it IMMUTABLE or STABLE (ALTER FUNCTION ... STABLE) and register the kind again.';
    END IF;
  ELSIF p_merge_function IS NOT NULL THEN
    RAISE EXCEPTION 'document_register_kind: merge_function is only used with merge = function'
      USING ERRCODE = '22023', DETAIL = format('The kind''s merge is %s.', coalesce(p_merge, v_cur.merge)),
            HINT = 'Pass p_merge => ''function'' with it, or leave merge_function NULL.';
  END IF;

  INSERT INTO pgfence.document_kind AS k (kind, merge, merge_function, content_type, max_bytes, description,
                                          log_saves)
  VALUES (p_kind,
          coalesce(p_merge, v_cur.merge),
          CASE WHEN coalesce(p_merge, v_cur.merge) = 'function'
               THEN coalesce(p_merge_function, v_cur.merge_function) END,
          coalesce(p_content_type, v_cur.content_type, 'object'),
          coalesce(p_max_bytes, v_cur.max_bytes, 1048576),
          coalesce(p_description, v_cur.description),
          coalesce(p_log_saves, v_cur.log_saves, true))
  ON CONFLICT ON CONSTRAINT document_kind_pkey DO UPDATE
    SET merge = EXCLUDED.merge, merge_function = EXCLUDED.merge_function,
        content_type = EXCLUDED.content_type, max_bytes = EXCLUDED.max_bytes,
        description = EXCLUDED.description, log_saves = EXCLUDED.log_saves, updated_at = now();
  RETURN QUERY
  SELECT k.kind, k.merge, k.merge_function, k.content_type, k.max_bytes, k.builtin, k.description,
         k.log_saves
  FROM pgfence.document_kind k WHERE k.kind = p_kind;
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_register_kind(text, text, regprocedure, text, integer, text, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_register_kind(text, text, regprocedure, text, integer, text, boolean) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.document_register_kind(text, text, regprocedure, text, integer, text, boolean) IS
  'Admin: register a document kind or change one (NULL keeps the current value).
A new kind defaults to content_type object and max_bytes 1 MiB. merge: attributes (three-way merge by top-level key, like record), none (never merges, like sheet) or function (merge_function f(base, local, stored jsonb) RETURNS jsonb {"content", "conflicts"}, IMMUTABLE or STABLE; it runs with the privileges of whoever calls document_merge, so grant them EXECUTE on it). log_saves: whether each save writes a save event (default true; creates, deletes, conflicts and replays are always logged, and the revision is written either way). Built-in kinds (record, sheet) only take a new max_bytes, description or log_saves. Returns the stored kind. Errors: 22004 (missing kind, merge or merge_function), 22023 (bad name, merge, content_type, max_bytes, description over 1000 characters or function signature; changing a built-in''s merge), 42883 (merge_function names no function: an OID of nothing, or the kind''s function was dropped).';
