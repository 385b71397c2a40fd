-- pgfence 0034 — plans: no receipt event per step; the approval check knows its function's row.
-- depends: 0033_operation_requeued_index
--
-- Issue 14 (the owner's decision, session 8): a SQL step cost about three times the CPU of a
-- hand-written runner. These costs go, no guarantee does:
-- * The per-step 'receipt' row in pgfence.event repeated the receipt itself: plan_step's outcome,
--   output, error, worker and times are written once (tg_plan_step_guard) and audit_timeline
--   already read receipts from plan_step. The only thing the event added was the login whose
--   transaction wrote the receipt (event.db_user): it is now the step's own column db_user,
--   written with the receipt (by _plan_commit_step, or by tg_plan_step_guard for any other
--   writer) and write-once like the rest of it. The trigger plan_step_event and its function go.
--   Receipts written before this migration keep their events, and audit_timeline still takes
--   their login from there. The plan's transition events (propose ... finish, fail) stay.
-- * The approval check (approved is what runs, PF108) hashed pg_get_functiondef() of the step's
--   function twice per step. A step now also records, at proposal, the identity of the
--   function's pg_proc row version: its oid and xmin. CREATE OR REPLACE FUNCTION, ALTER FUNCTION
--   and DROP/CREATE all make a new row version, with a new xmin (or a new oid), and xmin is kept
--   raw through freezing (PostgreSQL >= 9.4 marks a frozen tuple with infomask bits). So while
--   the registered function's row is that very version the definition is the one hashed at
--   proposal and the step skips the md5; when it differs the md5 decides as before (PF108 if
--   the text differs; identical text runs). A row written by the proposing transaction itself
--   is not recorded (it could still change under the same xmin before that transaction ends):
--   those steps always hash.
--   The md5 is taken from the catalog cache and the xmin from the proposal's snapshot; a
--   replacement that commits between becoming visible to snapshots and sending its cache
--   invalidations could pair the old definition's md5 with the new row's xmin. So the skip also
--   needs the plan's version_checked, which plan_approve (a later transaction) sets only after
--   finding every recorded row still current with the recorded md5
--   (docs/design.md, "The approval check").
ALTER TABLE pgfence.plan
  ADD COLUMN IF NOT EXISTS version_checked boolean NOT NULL DEFAULT false;
COMMENT ON COLUMN pgfence.plan.version_checked IS
  'Written only by plan_approve (tg_plan_guard refuses any other change, PF002): true when the approval, in another transaction than the proposal and under READ COMMITTED, found for every sql step with a recorded function row version (plan_step.function_oid, function_xmin) that row still current and md5(pg_get_functiondef) equal to the recorded function_md5. Only then may the steps'' checks skip the md5 by row version; false: every step computes it.';
ALTER TABLE pgfence.plan_step
  ADD COLUMN IF NOT EXISTS function_oid oid,
  ADD COLUMN IF NOT EXISTS function_xmin xid8,
  ADD COLUMN IF NOT EXISTS db_user text;
COMMENT ON COLUMN pgfence.plan_step.function_oid IS
  'For a sql step: the oid of the action''s function when the plan was proposed (with function_xmin, the identity of the pg_proc row version whose definition function_md5 hashes). NULL for steps proposed before migration 0034 and when the proposing transaction had itself written that row.';
COMMENT ON COLUMN pgfence.plan_step.function_xmin IS
  'For a sql step: the xmin of the action''s function''s pg_proc row when the plan was proposed, as a full (64-bit) transaction id (_plan_row_xid). While the plan is version_checked (plan_approve found this row current with this md5), the registered function''s row has this oid and xmin (its 32 bits), under READ COMMITTED, and the checking snapshot''s xmax is at most 2^32 after it, its definition is the one fingerprinted in function_md5 and the step skips the md5 (any CREATE OR REPLACE or ALTER writes a new row version with a new xmin; freezing keeps xmin; a new row with the same 32-bit xmin needs 2^32 transactions). NULL: the md5 is always computed.';
COMMENT ON COLUMN pgfence.plan_step.db_user IS
  'Part of the receipt: the database login (session_user) whose transaction wrote it, whatever worker name it passed. NULL for receipts written before migration 0034 (their login is in their receipt event).';

-- The step's commit marks its rows with its run token and step as a uuid instead of a random one
-- (new for both rows all the same; see _plan_commit_step).
COMMENT ON COLUMN pgfence.plan.receipt_nonce IS
  'Set by _plan_commit_step only: a value new for the row per step commit (the run token and the step as a uuid; random before migration 0034), so that tg_plan_guard is skipped for that statement alone (see the trigger plan_guard). Not data.';
COMMENT ON COLUMN pgfence.plan_step.receipt_nonce IS
  'Set by _plan_commit_step only, with the receipt: the run token and the step as a uuid (random before migration 0034), so that tg_plan_step_guard is skipped for that statement alone (see the trigger plan_step_guard). Not data.';

DROP TRIGGER IF EXISTS plan_step_event ON pgfence.plan_step;
DROP FUNCTION IF EXISTS pgfence.tg_plan_step_event();

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 34);
