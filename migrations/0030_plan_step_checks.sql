-- pgfence 0030 — plans: a step writes with fewer statements and without the multi-column CHECKs.
-- depends: 0027_plan_hot_steps
--
-- Issue 14: a SQL step cost about four times the CPU of a hand-written equivalent. Two costs go:
-- * PostgreSQL 15 reads and prepares every CHECK constraint of a table once per writing
--   statement (ExecRelCheck: stringToNode and ExecPrepareExpr of each), and the step's commit
--   writes plan and plan_step: about an eighth of a step's CPU went to the 26 CHECKs of these two
--   tables. The multi-column ones below move into the guard triggers tg_plan_guard and
--   tg_plan_step_guard (functions/20_plan_guards.sql), which check the same expressions in the
--   same order and fail with the same SQLSTATE (23514) and constraint name. Every writer runs
--   those triggers but the step's commit (_plan_commit_step), whose one statement holds these
--   checks by construction (functions/24_plan_steps.sql). A new plan that skips plan_guard is a
--   fresh proposal (plan_insert_guard's WHEN), which holds every one of them; every new step runs
--   plan_step_new_guard. The simple checks stay declared: the status, failure, kind and outcome
--   sets, the step count, the expiry, the key, the run token, the step index and the step times.
-- * _plan_commit_step now takes the plan by id, worker and token and checks them in its
--   statement, so _plan_step_finish needs no statement of its own: its signature changes.
-- docs/design.md, "Row checks in the guards".
ALTER TABLE pgfence.plan
  DROP CONSTRAINT IF EXISTS plan_next_step_range,
  DROP CONSTRAINT IF EXISTS plan_approved_iff,
  DROP CONSTRAINT IF EXISTS plan_rejected_iff,
  DROP CONSTRAINT IF EXISTS plan_started_iff,
  DROP CONSTRAINT IF EXISTS plan_heartbeat_while_executing,
  DROP CONSTRAINT IF EXISTS plan_external_in_flight,
  DROP CONSTRAINT IF EXISTS plan_failure_iff_failed,
  DROP CONSTRAINT IF EXISTS plan_finished_iff_terminal,
  DROP CONSTRAINT IF EXISTS plan_executed_all_steps,
  DROP CONSTRAINT IF EXISTS plan_step_begun_whole;
ALTER TABLE pgfence.plan_step
  DROP CONSTRAINT IF EXISTS plan_step_args_check,
  DROP CONSTRAINT IF EXISTS plan_step_function_iff_sql,
  DROP CONSTRAINT IF EXISTS plan_step_fingerprint_iff_sql,
  DROP CONSTRAINT IF EXISTS plan_step_receipt_whole,
  DROP CONSTRAINT IF EXISTS plan_step_no_result_without_receipt,
  DROP CONSTRAINT IF EXISTS plan_step_error_iff;
DROP FUNCTION IF EXISTS pgfence._plan_commit_step(pgfence.plan, boolean, jsonb, jsonb);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 30);
