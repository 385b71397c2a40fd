-- pgfence functions/98_hot_paths.sql — every module: no JIT compilation on a hot path.
--
-- Public: none (settings of functions defined in the files before this one).
-- The functions an executor or a client calls per item — every claim, settle, save and step
-- function, and the reapers — run with jit = off. JIT pays off for queries that read millions
-- of rows; these read a batch by index, but the planner's cost of a claim crosses
-- jit_above_cost once a table holds about a million rows (operation_claim at 1M queued: 7.4 ms
-- a call instead of 0.65 ms, all of it compiling), and then every call compiles again.
-- Set here, in one list, after the CREATEs (CREATE OR REPLACE resets a function's settings; this
-- file is re-applied by every migrate after them). A SET applies for the call and the statements
-- nested in it (its triggers, the functions it calls); plan_run_step is left alone on purpose:
-- the approved action runs inside it, with the caller's settings. tests/test_hot_paths.py fails
-- for a pinned function (plan_cache_mode = force_generic_plan) or a listed one without it.
-- docs/query-plans.md#pinned-settings.

-- outbox
ALTER FUNCTION pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer, text) SET jit = off;
ALTER FUNCTION pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer, text[]) SET jit = off;
ALTER FUNCTION pgfence.outbox_claim(text, integer, text[], interval) SET jit = off;
ALTER FUNCTION pgfence.outbox_next_due(text[]) SET jit = off;
ALTER FUNCTION pgfence.outbox_mark_sent(bigint, integer, jsonb) SET jit = off;
ALTER FUNCTION pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[]) SET jit = off;
ALTER FUNCTION pgfence.outbox_mark_sent_and_claim(bigint, integer, jsonb, text, integer, text[], interval) SET jit = off;
ALTER FUNCTION pgfence.outbox_mark_failed(bigint, integer, text, boolean, interval) SET jit = off;
ALTER FUNCTION pgfence.outbox_settle_and_claim(bigint[], integer[], jsonb[], text, integer, text[], interval) SET jit = off;
ALTER FUNCTION pgfence.outbox_reap(integer) SET jit = off;
ALTER FUNCTION pgfence._outbox_key_decide(text, text) SET jit = off;  -- keys with a rate (16_outbox_keys.sql)
ALTER FUNCTION pgfence._outbox_keys_lock(text[], text[]) SET jit = off;  -- every key decision and hand-off (16_outbox_keys.sql)
ALTER FUNCTION pgfence._outbox_keys_decide(text[], text[]) SET jit = off;  -- every keyed enqueue and settle (16_outbox_keys.sql)
ALTER FUNCTION pgfence._outbox_keys_forget(text[], text[]) SET jit = off;  -- every settle that ends keyed turns (16_outbox_keys.sql)
ALTER FUNCTION pgfence._outbox_keys_hand_off(bigint[], text[], text[], jsonb[], text, integer, interval) SET jit = off;  -- outbox_settle_and_claim (16_outbox_keys.sql)
ALTER FUNCTION pgfence._outbox_mark_sent_rows(bigint[], integer[], jsonb[], integer) SET jit = off;  -- every settle of many (13_outbox_settle.sql)

-- plans
ALTER FUNCTION pgfence.plan_claim(text, integer, boolean, interval) SET jit = off;
ALTER FUNCTION pgfence.plan_start(bigint, text, interval) SET jit = off;
ALTER FUNCTION pgfence.plan_release(bigint, text, bigint) SET jit = off;
ALTER FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) SET jit = off;
ALTER FUNCTION pgfence.plan_approve(bigint, text) SET jit = off;
ALTER FUNCTION pgfence.plan_reject(bigint, text, text) SET jit = off;
ALTER FUNCTION pgfence._plan_step_begin(bigint, text, bigint) SET jit = off;
ALTER FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) SET jit = off;
ALTER FUNCTION pgfence._plan_commit_step(bigint, integer, text, bigint, boolean, jsonb, jsonb, boolean) SET jit = off;  -- every step's commit (24_plan_steps.sql)
ALTER FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) SET jit = off;
ALTER FUNCTION pgfence.plan_reap(integer) SET jit = off;

-- operations
ALTER FUNCTION pgfence.operation_request(text, text, jsonb, text, text) SET jit = off;
ALTER FUNCTION pgfence.operation_claim(text, text[], interval, integer) SET jit = off;
ALTER FUNCTION pgfence.operation_begin_issue(bigint, integer, boolean, interval) SET jit = off;
ALTER FUNCTION pgfence.operation_record_external(bigint, integer, text, jsonb) SET jit = off;
ALTER FUNCTION pgfence.operation_poll(bigint, integer, jsonb, interval) SET jit = off;
ALTER FUNCTION pgfence.operation_finish(bigint, integer, boolean, jsonb, text) SET jit = off;
ALTER FUNCTION pgfence.operation_release(bigint, integer) SET jit = off;
ALTER FUNCTION pgfence.operation_reap(integer) SET jit = off;

-- documents
ALTER FUNCTION pgfence.document_create(text, jsonb, text, text) SET jit = off;
ALTER FUNCTION pgfence.document_save(bigint, bigint, jsonb, text, text) SET jit = off;
ALTER FUNCTION pgfence.document_delete(bigint, bigint, text) SET jit = off;
