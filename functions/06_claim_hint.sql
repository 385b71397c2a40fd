-- pgfence functions/06_claim_hint.sql — every module: the claim hint's state machine, shared.
--
-- Public: none. Private: _claim_hint_open(setting name, now µs) -> the state before a walk,
--                        _claim_hint_close(setting name, state, claimed, batch, last key) -> stores it.
-- A claim walks its queue index from its session's hint (a key below which nothing of its scope
-- is claimable, and none will be) instead of the front, where the dead entries of claimed rows
-- stay while a snapshot older than them is open: docs/design.md#claim-hint. The state is the
-- outbox's (functions/12_outbox_claim.sql, which inlines the same steps for its cost): 8 numbers,
-- a key being two of them, (due µs, id) for the outbox and (0, id) for the operations' id order.
-- Used by operation_claim (functions/32_operation_claim.sql). Both helpers are called between the
-- caller's checks and its walk / right after its walk, in the caller's transaction.
-- No SET clause on either, on purpose: the call of a PL/pgSQL function with SET costs more than
-- these bodies (~12 µs, functions/12_outbox_claim.sql); both are private (no EXECUTE for
-- PUBLIC), called only from SECURITY DEFINER functions that pin search_path, and name only
-- pg_catalog objects, qualified.

CREATE OR REPLACE FUNCTION pgfence._claim_hint_open(p_name text, p_now_us bigint)
RETURNS bigint[]
LANGUAGE plpgsql VOLATILE
AS $$
-- Returns 10 numbers: the 8 of the state (docs/design.md#claim-hint; NULL elements = none) —
-- hint key (2), candidate key (2), candidate xid bound, candidate's transaction, passed (0/1),
-- last full walk (µs) — then [9] 1 if this walk starts at the front (else 0) and [10] 1 if the
-- transaction had its xid before the walk (else 0). Call it right before the walk: [5], [7]
-- and [10] are read from the transaction and snapshot as they are then.
DECLARE
  v_raw   text := pg_catalog.current_setting(p_name, true);
  v_st    bigint[];
  v_bound bigint;
  v_own   bigint := pg_catalog.pg_current_xact_id_if_assigned()::text::bigint;
BEGIN
  -- 8 optional fields of up to 18 digits, written as "digits, and no run of 19" (the same
  -- strings as the counted {1,18} inside {7}, at ~3 us a match instead of ~14: b0cd27a)
  IF v_raw IS NOT NULL AND v_raw OPERATOR(pg_catalog.~) '^(-?[0-9]+)?(,(-?[0-9]+)?){7}$'
     AND v_raw OPERATOR(pg_catalog.!~) '[0-9]{19}' THEN
    v_st := pg_catalog.string_to_array(v_raw, ',', '')::bigint[];
  END IF;
  -- none, malformed, or a time after the clock (forged, or the clock stepped back): no state
  IF v_st IS NULL OR v_st[1] > p_now_us OR v_st[3] > p_now_us OR v_st[8] > p_now_us THEN
    v_st := pg_catalog.array_fill(NULL::bigint, ARRAY[8]);
  END IF;
  -- from the front once per pgfence.claim_full_walk_ms (default 1000, at most 60000; 0 = always)
  v_raw := pg_catalog.current_setting('pgfence.claim_full_walk_ms', true);
  v_bound := CASE WHEN v_raw OPERATOR(pg_catalog.~) '^[0-9]{1,5}$' THEN least(v_raw::bigint, 60000) ELSE 1000 END * 1000;
  -- A candidate taken in a transaction that already had its xid gets its bound from the xid of
  -- a later transaction of this session (assigned after the candidate's walk).
  IF v_st[4] IS NOT NULL AND v_st[5] IS NULL AND v_own IS DISTINCT FROM v_st[6] THEN
    v_st[5] := v_own;
  END IF;
  -- Passed: every transaction that had an xid when the candidate's walk took its snapshot has
  -- ended (all of them are below the bound), so all their writes are visible to this walk.
  IF v_st[5] IS NOT NULL AND v_st[7] IS DISTINCT FROM 1
     AND pg_catalog.pg_snapshot_xmin(pg_catalog.pg_current_snapshot())::text::bigint >= v_st[5] THEN
    v_st[7] := 1;
  END IF;
  v_st[9] := CASE WHEN v_st[1] IS NULL OR v_st[8] IS NULL OR p_now_us - v_st[8] >= v_bound THEN 1 ELSE 0 END;
  v_st[10] := CASE WHEN v_own IS NULL THEN 0 ELSE 1 END;
  RETURN v_st;
END
$$;
REVOKE ALL ON FUNCTION pgfence._claim_hint_open(text, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._claim_hint_open(text, bigint) IS
  'Private: a claim scope''s hint state before its walk, from its session setting p_name.
10 numbers: hint key (2), candidate key (2), candidate xid bound, candidate''s transaction,
passed (1 once every writer older than the bound ended), last full walk (µs); then 1 if this
walk starts at the front, 1 if the transaction had its xid. Malformed or future state reads
as none. p_now_us: the claim''s clock (µs since epoch). docs/design.md#claim-hint.';

CREATE OR REPLACE FUNCTION pgfence._claim_hint_close(
  p_name text, p_st bigint[], p_n integer, p_batch integer, p_l1 bigint, p_l2 bigint, p_now_us bigint)
RETURNS text
LANGUAGE plpgsql VOLATILE
AS $$
-- p_st: what _claim_hint_open returned before the walk; p_n rows claimed of p_batch; (p_l1,
-- p_l2) the last claimed key (NULL when none). Moves the hint as the outbox claim does
-- (docs/design.md#claim-hint, steps 1-3) and stores the 8 numbers in the session setting
-- (set_config(..., false): it rolls back with the claim's transaction); returns what it stored
-- (the caller assigns it: a simple expression, where PERFORM would run an SPI query).
DECLARE
  v_st   bigint[] := p_st[1:8];
  v_full boolean := p_st[9] = 1;
  v_l1   bigint := p_l1;
  v_l2   bigint := p_l2;
BEGIN
  IF v_full THEN
    v_st[8] := p_now_us;
  END IF;
  IF v_st[7] = 1 THEN
    -- The candidate's bound has passed: no writer can make a row claimable below it any more,
    -- and this walk saw every one that did. Everything this walk passed is done: the hint moves
    -- to the candidate (all claimable rows claimed) or to the last claimed key.
    IF p_n < p_batch OR (v_st[3], v_st[4]) <= (v_l1, v_l2) THEN
      v_st[1] := v_st[3]; v_st[2] := v_st[4];
      v_st[3] := NULL; v_st[4] := NULL; v_st[5] := NULL; v_st[6] := NULL; v_st[7] := NULL;
    ELSE
      v_st[1] := v_l1; v_st[2] := v_l2;
    END IF;
  ELSIF v_full AND p_n = p_batch AND v_st[1] IS NOT NULL AND (v_l1, v_l2) < (v_st[1], v_st[2]) THEN
    -- A full walk that ended below the hint found rows the hint skipped (a locked row): walk
    -- from here next time.
    v_st[1] := v_l1; v_st[2] := v_l2;
  END IF;
  IF v_st[3] IS NULL AND p_n > 0 THEN
    -- The next candidate: this walk's last key (not below the hint), bounded by an xid assigned
    -- after this walk's snapshot: this transaction's, when the walk assigned it.
    IF v_st[1] IS NOT NULL AND (v_l1, v_l2) < (v_st[1], v_st[2]) THEN
      v_l1 := v_st[1]; v_l2 := v_st[2];
    END IF;
    v_st[3] := v_l1; v_st[4] := v_l2;
    v_st[6] := pg_catalog.pg_current_xact_id_if_assigned()::text::bigint;
    v_st[5] := CASE WHEN p_st[10] = 1 THEN NULL ELSE v_st[6] END;
    v_st[7] := 0;
  END IF;
  RETURN pg_catalog.set_config(p_name, pg_catalog.array_to_string(v_st, ',', ''), false);
END
$$;
REVOKE ALL ON FUNCTION pgfence._claim_hint_close(text, bigint[], integer, integer, bigint, bigint, bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._claim_hint_close(text, bigint[], integer, integer, bigint, bigint, bigint) IS
  'Private: moves a claim scope''s hint after its walk and stores it in session setting p_name.
p_st from _claim_hint_open before the walk; p_n rows claimed of p_batch; (p_l1, p_l2) the last
claimed key. Candidate, bound, promotion and the full walk''s correction as in
docs/design.md#claim-hint (the outbox claim inlines the same steps). Returns the stored state.';
