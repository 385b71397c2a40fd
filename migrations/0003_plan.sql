-- pgfence 0003 — plan: approved plans of steps, their receipts, and the action allow-list.
-- depends: 0002_outbox
--
-- Functions, triggers, views and grants are in functions/20_plan.sql (re-applied on every
-- migrate). Status machine and rules: see the header of that file.

CREATE TABLE pgfence.plan_action (
  name          text PRIMARY KEY CHECK (name ~ '^[a-z0-9][a-z0-9_.-]{0,62}$'),
  kind          text NOT NULL CHECK (kind IN ('sql', 'external')),
  function      regprocedure,
  description   text NOT NULL CHECK (description <> '' AND length(description) <= 2000),
  registered_by text NOT NULL,
  registered_at timestamptz NOT NULL DEFAULT now(),
  retired_at    timestamptz,
  CONSTRAINT plan_action_function_iff_sql CHECK ((kind = 'sql') = (function IS NOT NULL))
);
COMMENT ON TABLE pgfence.plan_action IS
  'The allow-list of plan actions: a plan step can name nothing else. kind sql = a function f(args jsonb) RETURNS jsonb run by plan_run_step with the executing role''s privileges; kind external = a side effect the executor performs through the transport routed for the action name. Not an API: use pgfence.plan_register_action / plan_retire_action and the view pgfence.plan_actions.';
COMMENT ON COLUMN pgfence.plan_action.function IS
  'For kind sql: the function a step of this action calls, with the step''s args as its only argument. Never re-pointed while it exists (PF102): a different function is a new action name.';
COMMENT ON COLUMN pgfence.plan_action.retired_at IS
  'Set by plan_retire_action: new proposals may not use the action, and an approved plan reaching a step of it records an error receipt instead of running it.';

CREATE TABLE pgfence.plan (
  id                    bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  status                text NOT NULL DEFAULT 'pending'
                        CHECK (status IN ('pending', 'approved', 'rejected', 'expired',
                                          'executing', 'executed', 'failed')),
  step_count            integer NOT NULL,
  proposed_by           text NOT NULL,
  proposed_db_user      text NOT NULL DEFAULT session_user,
  proposed_at           timestamptz NOT NULL DEFAULT now(),
  expires_at            timestamptz NOT NULL,
  idempotency_key       text UNIQUE CHECK (idempotency_key <> '' AND length(idempotency_key) <= 255),
  compensates           bigint REFERENCES pgfence.plan (id),
  approved_by           text,
  approved_at           timestamptz,
  rejected_by           text,
  rejected_at           timestamptz,
  reject_reason         text,
  worker                text,
  started_at            timestamptz,
  heartbeat_interval    interval,
  heartbeat_at          timestamptz,
  heartbeat_expires_at  timestamptz,
  next_step             integer NOT NULL DEFAULT 1,
  external_started_at   timestamptz,
  step_begun            integer,
  step_begun_xact       xid8,
  failure               text CHECK (failure IN ('step_error', 'interrupted')),
  finished_at           timestamptz,
  updated_at            timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT plan_step_count CHECK (step_count BETWEEN 1 AND 10000),
  CONSTRAINT plan_next_step_range CHECK (next_step BETWEEN 1 AND step_count + 1),
  CONSTRAINT plan_expires_after_proposal CHECK (expires_at > proposed_at),
  CONSTRAINT plan_approved_iff CHECK (
    (status IN ('approved', 'executing', 'executed', 'failed')) = (approved_by IS NOT NULL AND approved_at IS NOT NULL)),
  CONSTRAINT plan_rejected_iff CHECK (
    (status = 'rejected') = (rejected_by IS NOT NULL AND rejected_at IS NOT NULL AND reject_reason IS NOT NULL)),
  CONSTRAINT plan_started_iff CHECK (
    (status IN ('executing', 'executed', 'failed')) = (started_at IS NOT NULL AND heartbeat_interval IS NOT NULL)),
  CONSTRAINT plan_heartbeat_while_executing CHECK (
    status <> 'executing' OR (heartbeat_at IS NOT NULL AND heartbeat_expires_at IS NOT NULL)),
  CONSTRAINT plan_external_in_flight CHECK (status IN ('executing', 'failed') OR external_started_at IS NULL),
  CONSTRAINT plan_failure_iff_failed CHECK ((status = 'failed') = (failure IS NOT NULL)),
  CONSTRAINT plan_finished_iff_terminal CHECK (
    (status IN ('rejected', 'expired', 'executed', 'failed')) = (finished_at IS NOT NULL)),
  CONSTRAINT plan_executed_all_steps CHECK (status <> 'executed' OR next_step = step_count + 1),
  CONSTRAINT plan_step_begun_whole CHECK ((step_begun IS NULL) = (step_begun_xact IS NULL))
);
COMMENT ON TABLE pgfence.plan IS
  'Approved plans: a frozen list of steps (rows of pgfence.plan_step) proposed by someone (a script, an AI agent), approved by a person, executed in order with a receipt per step. Status machine pending -> approved -> executing -> executed | failed, pending -> rejected | expired; enforced by tg_plan_guard. Not an API: use the pgfence.plan_* functions and views.';
COMMENT ON COLUMN pgfence.plan.step_count IS
  'How many steps the plan has (1..10000); the steps themselves are rows of pgfence.plan_step, numbered 1..step_count. Never changes (PF002).';
COMMENT ON COLUMN pgfence.plan.proposed_db_user IS
  'The database login (session_user) that proposed the plan. plan_approve refuses an approval from the same login (PF103), whatever approver name it passes, unless that login is a superuser. Never changes (PF002).';
COMMENT ON COLUMN pgfence.plan.step_begun IS
  'Set by _plan_step_begin when it hands a SQL step to plan_run_step, with step_begun_xact = that transaction; _plan_step_finish writes a receipt only for this step in this transaction (PF107) and clears both. A stamp left by a transaction that committed without a receipt is stale and ignored.';
COMMENT ON COLUMN pgfence.plan.worker IS
  'While executing: the worker that owns the run (runs steps, heartbeats, records external steps); NULL while the run is released and waits for another worker (an executor for an external step, or a SQL runner). Kept after the end: who ran the last step.';
COMMENT ON COLUMN pgfence.plan.heartbeat_expires_at IS
  'While executing: the run counts as interrupted after this time (database clock) unless the owner stamps a heartbeat or records a step first; a released run must be taken over by then.';
COMMENT ON COLUMN pgfence.plan.next_step IS
  'The next step to run (1-based); step_count + 1 once executed. For a failed plan: the step that failed or was interrupted.';
COMMENT ON COLUMN pgfence.plan.external_started_at IS
  'Set when the owner was handed the external step next_step to perform, cleared when it records it or releases the run. Kept when the run is interrupted: that step''s outcome is then unknown (it may have happened: external effects are at least once).';
COMMENT ON COLUMN pgfence.plan.failure IS
  'Why a failed plan failed: step_error (a step''s error receipt) or interrupted (the heartbeat lapsed: the owner died, stalled or never came back).';

CREATE INDEX plan_status_idx ON pgfence.plan (status, id);
CREATE INDEX plan_heartbeat_idx ON pgfence.plan (heartbeat_expires_at) WHERE status = 'executing';
CREATE INDEX plan_pending_expiry_idx ON pgfence.plan (expires_at) WHERE status = 'pending';
CREATE INDEX plan_compensates_idx ON pgfence.plan (compensates) WHERE compensates IS NOT NULL;

CREATE TABLE pgfence.plan_step (
  plan_id     bigint NOT NULL REFERENCES pgfence.plan (id) ON DELETE CASCADE,
  step_index  integer NOT NULL CHECK (step_index >= 1),
  -- the frozen step, written with the proposal
  action      text NOT NULL,
  kind        text NOT NULL CHECK (kind IN ('sql', 'external')),
  function    text,
  function_md5 text,
  args        jsonb NOT NULL CHECK (jsonb_typeof(args) = 'object'),
  note        text,
  -- its receipt, written once, in the same transaction as the step's effect
  outcome     text CHECK (outcome IN ('ok', 'error')),
  output      jsonb,
  error       jsonb,
  worker      text,
  started_at  timestamptz,
  finished_at timestamptz,
  PRIMARY KEY (plan_id, step_index),
  CONSTRAINT plan_step_function_iff_sql CHECK ((kind = 'sql') = (function IS NOT NULL)),
  CONSTRAINT plan_step_fingerprint_iff_sql CHECK ((kind = 'sql') = (function_md5 IS NOT NULL)),
  CONSTRAINT plan_step_receipt_whole CHECK (
    (outcome IS NULL) = (worker IS NULL AND started_at IS NULL AND finished_at IS NULL)),
  CONSTRAINT plan_step_no_result_without_receipt CHECK (
    outcome IS NOT NULL OR (output IS NULL AND error IS NULL)),
  CONSTRAINT plan_step_error_iff CHECK (
    outcome IS NULL
    OR (outcome = 'error') = (error IS NOT NULL AND jsonb_typeof(error) = 'object' AND error ? 'message')),
  CONSTRAINT plan_step_times CHECK (finished_at >= started_at)
);
COMMENT ON TABLE pgfence.plan_step IS
  'One row per plan step: the frozen step (action, kind, the function of a sql action, args, note), written with the proposal and never changed, and its receipt (outcome ok with output, or error; worker; times), written exactly once in the same transaction as the step''s database effect (sql) or as the executor''s report (external). A step without an outcome did not commit. Not an API: read pgfence.plan_receipts or pgfence.plan_steps(id).';
COMMENT ON COLUMN pgfence.plan_step.step_index IS
  'The step''s position in the plan, from 1: its identity, the same across workers and retries of a report (idempotency key pgfence-plan-<plan id>-step-<step_index>).';
COMMENT ON COLUMN pgfence.plan_step.function IS
  'For a sql step: the action''s function as registered when the plan was proposed (for audit; the step runs the action''s registered function).';
COMMENT ON COLUMN pgfence.plan_step.function_md5 IS
  'For a sql step: md5 of pg_get_functiondef() of the action''s function when the plan was proposed. A step whose function''s definition differs when it is about to run (CREATE OR REPLACE since) is not run: its receipt is an error PF108 and the plan fails. What was approved is what runs.';
COMMENT ON COLUMN pgfence.plan_step.error IS
  'For outcome error: {"sqlstate", "message", "detail", "hint", "context"} of the action''s exception (sql), or {"message"} reported by the executor (external).';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 3);
