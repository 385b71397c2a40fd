-- pgfence functions/44_document_merge.sql — documents (module 4): the three-way merge.
--
-- Public: document_merge(kind, base, local, stored), for a client rebasing its copy after a
-- conflict: base = the revision it edited from (document_revision), local = its copy, stored =
-- the conflict answer's content. It returns the merged content (to save against the stored
-- version) and the conflicts, and changes nothing. The kind decides how: attributes (by
-- top-level key), none (never merges; every difference is a conflict) or function (the kind's
-- merge_function). Not security definer: it reads the kind through the view document_kinds and
-- runs an application's merge function with the caller's privileges, never as pgfence's owner.
-- Errors: functions/ERRORS.md (PF302, PF304).

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
    RAISE EXCEPTION 'document_merge: kind is required'
      USING ERRCODE = '22004', DETAIL = 'The kind decides how the three versions merge.',
            HINT = 'Pass the document''s kind (document_get returns it).';
  END IF;
  IF p_base IS NULL OR p_local IS NULL OR p_stored IS NULL THEN
    RAISE EXCEPTION 'document_merge: base, local and stored are all required'
      USING ERRCODE = '22004', DETAIL = 'A three-way merge compares both edits with the version they started from.',
            HINT = 'base = the revision the local copy was edited from (document_revision), stored = the conflict answer''s content. A deleted document cannot be merged into.';
  END IF;
  -- Read through the view: this function runs with the caller's privileges (so that an
  -- application's merge function never runs as pgfence's owner).
  SELECT k.merge, k.merge_function INTO v_merge, v_function
  FROM pgfence.document_kinds k WHERE k.kind = p_kind;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'document_merge: unknown kind "%"', p_kind
      USING ERRCODE = 'PF302', DETAIL = 'No kind of this name is registered.',
            HINT = 'See the view pgfence.document_kinds.';
  END IF;

  IF v_merge = 'attributes' THEN
    IF jsonb_typeof(p_base) <> 'object' OR jsonb_typeof(p_local) <> 'object' OR jsonb_typeof(p_stored) <> 'object' THEN
      RAISE EXCEPTION 'document_merge: kind % merges objects keyed by attribute id; got %, %, %', p_kind,
        jsonb_typeof(p_base), jsonb_typeof(p_local), jsonb_typeof(p_stored)
        USING ERRCODE = '22023', DETAIL = 'The attributes merge compares top-level keys, so all three must be JSON objects.',
              HINT = 'Pass the three versions'' contents as stored: a record is a JSON object.';
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
      USING ERRCODE = 'PF304', DETAIL = 'document_merge answers with content and conflicts exactly as the kind''s merge function returns them.',
            HINT = 'Fix the kind''s merge function.';
  END IF;
  RETURN QUERY SELECT CASE WHEN jsonb_typeof(v_result -> 'content') = 'null' THEN NULL ELSE v_result -> 'content' END,
                      v_result -> 'conflicts';
END
$$;
REVOKE ALL ON FUNCTION pgfence.document_merge(text, jsonb, jsonb, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.document_merge(text, jsonb, jsonb, jsonb) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.document_merge(text, jsonb, jsonb, jsonb) IS
  'Three-way merge of a document kind''s content (base, local, stored), for a client after a conflict.
base = the revision the local copy was edited from, local = the client''s copy, stored = the conflict answer''s content. Returns content (the merge, to save against the stored version) and conflicts (a JSON array of {"key", "base", "local", "stored"}, a side''s field absent when the key is absent on that side; empty = clean). attributes (record): per top-level key, the side that changed it wins; keys changed differently on both sides are conflicts and content keeps the stored value for them. none (sheet): never merges: if only one side changed, content is that side; if both changed, content is NULL and every differing top-level key or array index (key NULL: the whole value) is a conflict. function: the kind''s merge_function, run with the caller''s privileges. Changes nothing. Errors: 22004 (NULL argument), 22023 (record inputs that are not objects), PF302 (unknown kind), PF304 (a merge function returned a malformed result), 42883 (the kind''s merge function was dropped); a kind''s merge function may raise its own.';
