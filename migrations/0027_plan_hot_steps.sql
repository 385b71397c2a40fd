-- pgfence 0027 — plans: a step's commit in one statement, and its updates HOT.
-- depends: 0024_document_save_one_statement
--
-- Issue 14: every SQL step updates its plan_step row (the receipt) and its plan row (next step,
-- heartbeat). Neither update changes an indexed column any more (a step keeps the plan's
-- heartbeat_expires_at while it lies within the slack: functions/24_plan_steps.sql,
-- _plan_commit_step), so PostgreSQL can write the new row version on the same page without
-- new index entries (a HOT update) — if the page has room. plan_step rows are written with their
-- proposal, packed full at fillfactor 100, and each receipt then made the row move to another
-- page and inserted a new entry into plan_step_pkey. Leave room: a receipt adds its output,
-- worker and times to a row. Applies to pages written from now on (existing plans keep theirs).
--
-- The step's commit (_plan_commit_step) writes the receipt, moves the plan on and logs the
-- receipt event in one statement, and does what the row triggers plan_step_guard, plan_guard and
-- plan_step_event would. It marks both rows with receipt_nonce, a fresh random value that it also
-- puts in the transaction-local setting pgfence.plan_writing for that statement only; those
-- triggers skip exactly a row whose receipt_nonce changed to that value (functions/20, /24).
-- No other writer changes receipt_nonce and no client role may write these tables, so a client
-- that pre-sets the setting gains nothing.
ALTER TABLE pgfence.plan ADD COLUMN receipt_nonce uuid;
ALTER TABLE pgfence.plan_step ADD COLUMN receipt_nonce uuid;
COMMENT ON COLUMN pgfence.plan.receipt_nonce IS
  'Set by _plan_commit_step only: a fresh random value per step commit, so that tg_plan_guard is skipped for that statement alone (see the trigger plan_guard). Not data.';
COMMENT ON COLUMN pgfence.plan_step.receipt_nonce IS
  'Set by _plan_commit_step only: a fresh random value per receipt, so that tg_plan_step_guard and tg_plan_step_event are skipped for that statement alone (see the triggers plan_step_guard and plan_step_event). Not data.';
ALTER TABLE pgfence.plan_step SET (fillfactor = 70);
ALTER TABLE pgfence.plan SET (fillfactor = 90);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 27);
