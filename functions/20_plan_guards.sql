-- pgfence functions/20_plan_guards.sql — plans (module 2): the state machine's guards and events.
--
-- A plan is a frozen JSON array of steps that someone (a script, an AI agent) proposes, a person
-- approves and a worker executes in order, writing a receipt per step in the same transaction as
-- the step's effect: after any crash the receipts say exactly which steps committed. Files: 20
-- guards and events, 21 private helpers, 22 allow-list and proposals, 23 taking a run, 24
-- running steps (the receipt handshake), 25 reads and the reaper.
-- Here: tg_plan_guard and tg_plan_step_guard (PF001/PF002, for hand-written SQL too), the
-- purge-only deletes, tg_plan_event (event log of the plan's transitions, NOTIFY pgfence_plan;
-- a receipt is its step's row and logs no event since migration 0034) and the tables' comments. No public functions. Errors: functions/ERRORS.md (PF1xx are this module's).

-- The tables (created by migrations 0003 and 0010; their comments live here, re-applied by every
-- migrate).
COMMENT ON TABLE pgfence.plan IS
  'Approved plans: one row per proposal, with its status, approval, owner, run token and progress.
A frozen list of steps (rows of pgfence.plan_step) proposed by someone (a script, an AI agent), approved by a person, executed in order with a receipt per step. Status machine pending -> approved -> executing -> executed | failed, pending -> rejected | expired; enforced by tg_plan_guard. Not an API: use the pgfence.plan_* functions and views.';
COMMENT ON TABLE pgfence.plan_step IS
  'Plan steps: each frozen step of a plan and, once it ran, its receipt (written exactly once).
One row per plan step: the frozen step (action, kind, the function of a sql action, args, note), written with the proposal and never changed, and its receipt (outcome ok with output, or error; worker; times; the login db_user), written exactly once in the same transaction as the step''s database effect (sql) or as the executor''s report (external). A step without an outcome did not commit. Receipts log no event of their own (since migration 0034): audit_timeline reads them from here. Not an API: read pgfence.plan_receipts or pgfence.plan_steps(id).';
-- Since _plan_step_begin stamps a SQL step by locking its plan_step row (functions/24), nothing
-- sets these two columns any more; the comments from migration 0003 are replaced here.
COMMENT ON COLUMN pgfence.plan.step_begun IS
  'Unused (always NULL): a SQL step''s begin stamp is _plan_step_begin''s lock on the step''s row.
Older versions stamped the step here; _plan_commit_step, a release and the reaper still clear it.';
COMMENT ON COLUMN pgfence.plan.step_begun_xact IS
  'Unused (always NULL), with step_begun: the transaction of an older version''s begin stamp.';
COMMENT ON TABLE pgfence.plan_action IS
  'The allow-list of plan actions: a plan step can name nothing else.
kind sql = a function f(args jsonb) RETURNS jsonb run by plan_run_step with the executing role''s privileges; kind external = a side effect the executor performs through the transport routed for the action name. Not an API: use pgfence.plan_register_action / plan_retire_action and the view pgfence.plan_actions.';

-- ---------------------------------------------------------------------------------------------
-- The row checks that the guard triggers hold (migration 0030). They were CHECK constraints;
-- PostgreSQL 15 reads and prepares every CHECK of a table once per writing statement (about an
-- eighth of a step's CPU for these), and the one writer that writes a plan step's receipt
-- (_plan_commit_step, functions/24) holds them by construction in its statement and skips the
-- guard triggers. Every other writer, hand-written SQL included, runs the guards, which check
-- the same expressions as the constraints did, in the constraints' order (by name), and fail with
-- the same SQLSTATE (23514, check_violation) and constraint name. The simple ones stay declared
-- (status, failure, kind and outcome sets, step count, expiry, key, run token, step index, times).
-- docs/design.md, "Row checks in the guards".
-- ---------------------------------------------------------------------------------------------

-- ---------------------------------------------------------------------------------------------
-- The plan machine, held by tg_plan_guard against any UPDATE (psql included):
--
--   pending --plan_approve--> approved --plan_start / plan_claim--> executing --> executed
--      |                                                              |
--      +--plan_reject--> rejected                                     +--> failed (step_error:
--      +--plan_approve after expires_at / reaper--> expired           |     an error receipt;
--                                                                     |     interrupted: the
--                                                                     |     heartbeat lapsed)
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_plan_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_check text;
BEGIN
  IF TG_OP = 'INSERT' THEN
    -- Reached only through the WHEN condition of plan_insert_guard: the row is not a proposal.
    RAISE EXCEPTION 'plan: a new plan starts pending at step 1, proposed by this login (%), without approval, rejection, owner, heartbeat, failure or finish', session_user
      USING ERRCODE = 'PF001',
            DETAIL = format('The new row has status %s, next step %s, proposed_db_user %s.', NEW.status, NEW.next_step, NEW.proposed_db_user),
            HINT = 'Use pgfence.plan_propose(); a plan reaches any other state only through the plan_* functions.';
  END IF;
  IF NEW.id IS DISTINCT FROM OLD.id
     OR NEW.step_count IS DISTINCT FROM OLD.step_count
     OR NEW.proposed_by IS DISTINCT FROM OLD.proposed_by
     OR NEW.proposed_db_user IS DISTINCT FROM OLD.proposed_db_user
     OR NEW.proposed_at IS DISTINCT FROM OLD.proposed_at
     OR NEW.expires_at IS DISTINCT FROM OLD.expires_at
     OR NEW.idempotency_key IS DISTINCT FROM OLD.idempotency_key
     OR NEW.compensates IS DISTINCT FROM OLD.compensates THEN
    RAISE EXCEPTION 'plan % is immutable: its step count, proposer (name and login), expiry, idempotency key and the plan it compensates never change', OLD.id
      USING ERRCODE = 'PF002', DETAIL = 'These fields are what the approver saw; changing them would run something nobody approved.',
            HINT = 'Propose a new plan instead.';
  END IF;
  IF (OLD.approved_by IS NOT NULL AND (NEW.approved_by, NEW.approved_at) IS DISTINCT FROM (OLD.approved_by, OLD.approved_at))
     OR (OLD.started_at IS NOT NULL AND NEW.started_at IS DISTINCT FROM OLD.started_at) THEN
    RAISE EXCEPTION 'plan %: who approved it and when it started never change', OLD.id
      USING ERRCODE = 'PF002',
            DETAIL = format('Approved by %s at %s, started at %s.', OLD.approved_by, OLD.approved_at, OLD.started_at),
            HINT = 'Propose a new plan instead.';
  END IF;
  -- version_checked (migration 0034) lets the steps skip the md5 of the approval check: only
  -- plan_approve sets it, in its approving statement, after its cross-check (functions/22).
  IF NEW.version_checked IS DISTINCT FROM OLD.version_checked
     AND NOT (NEW.version_checked AND OLD.status = 'pending' AND NEW.status = 'approved'
              AND pg_catalog.current_setting('pgfence.plan_version_checking', true) = OLD.id::text) THEN
    RAISE EXCEPTION 'plan %: version_checked is written only by plan_approve', OLD.id
      USING ERRCODE = 'PF002',
            DETAIL = 'It says that the approval found each step''s recorded function row current with its recorded md5; the steps skip the md5 on it.',
            HINT = 'Approve the plan with pgfence.plan_approve.';
  END IF;
  IF NEW.next_step < OLD.next_step THEN
    RAISE EXCEPTION 'plan %: next_step never goes back (% -> %): committed steps stay committed', OLD.id, OLD.next_step, NEW.next_step
      USING ERRCODE = 'PF002', DETAIL = 'Every step before next_step committed with its ok receipt.',
            HINT = 'To undo steps, propose a compensating plan (pgfence.plan_compensate).';
  END IF;
  IF NEW.run_token < OLD.run_token THEN
    RAISE EXCEPTION 'plan %: the run token never goes back (% -> %)', OLD.id, OLD.run_token, NEW.run_token
      USING ERRCODE = 'PF002', DETAIL = 'An older token would let a fenced-out owner act on the run again.',
            HINT = 'Take the run with pgfence.plan_start or plan_claim: they issue the next token.';
  END IF;
  IF NOT (
       (OLD.status = 'pending'   AND NEW.status IN ('approved', 'rejected', 'expired')
                                 AND NEW.next_step = OLD.next_step AND NEW.worker IS NULL)
    OR (OLD.status = 'approved'  AND NEW.status = 'executing' AND NEW.next_step = OLD.next_step
                                 AND NEW.worker IS NOT NULL)
    OR (OLD.status = 'executing' AND NEW.status IN ('executing', 'executed', 'failed')
                                 AND NEW.next_step IN (OLD.next_step, OLD.next_step + 1)
                                 -- an owner hands over only through a release (worker NULL)
                                 AND (NEW.worker IS NOT DISTINCT FROM OLD.worker
                                      OR NEW.worker IS NULL OR OLD.worker IS NULL))
  ) THEN
    RAISE EXCEPTION 'illegal plan transition for plan %: % -> % (step % -> %, worker % -> %)',
      OLD.id, OLD.status, NEW.status, OLD.next_step, NEW.next_step, OLD.worker, NEW.worker
      USING ERRCODE = 'PF001',
            DETAIL = 'Allowed: pending->approved|rejected|expired, approved->executing, executing->executing|executed|failed (one step at a time; the owner changes only through a release). A rejected, expired, executed or failed plan never changes again.',
            HINT = 'Use the pgfence.plan_* functions; they make only legal moves.';
  END IF;
  -- Progress and failure must match the receipts: a step advances only over its ok receipt,
  -- and step_error names the step whose error receipt stopped the plan.
  IF NEW.next_step > OLD.next_step AND NOT EXISTS (
       SELECT 1 FROM pgfence.plan_step s
       WHERE s.plan_id = OLD.id AND s.step_index = OLD.next_step AND s.outcome = 'ok') THEN
    RAISE EXCEPTION 'plan %: step % has no ok receipt, the plan cannot move past it', OLD.id, OLD.next_step
      USING ERRCODE = 'PF001', DETAIL = 'next_step advances only over the ok receipt of the step it leaves.',
            HINT = 'Steps advance only through plan_run_step / plan_record_step.';
  END IF;
  IF NEW.status = 'failed' AND OLD.status <> 'failed' AND NEW.failure = 'step_error' AND NOT EXISTS (
       SELECT 1 FROM pgfence.plan_step s
       WHERE s.plan_id = OLD.id AND s.step_index = NEW.next_step AND s.outcome = 'error') THEN
    RAISE EXCEPTION 'plan %: failure step_error needs the error receipt of step %', OLD.id, NEW.next_step
      USING ERRCODE = 'PF001', DETAIL = 'failure = step_error names the step whose error receipt stopped the plan.',
            HINT = 'Steps fail only through plan_run_step / plan_record_step.';
  END IF;
  NEW.updated_at := now();
  -- The row checks (formerly CHECK constraints, migration 0030), in their name order. An INSERT
  -- that skips this trigger is a fresh proposal (plan_insert_guard's WHEN), which holds them all.
  v_check := CASE
    WHEN ((NEW.status IN ('approved', 'executing', 'executed', 'failed'))
          = (NEW.approved_by IS NOT NULL AND NEW.approved_at IS NOT NULL)) IS FALSE THEN 'plan_approved_iff'
    WHEN (NEW.status <> 'executed' OR NEW.next_step = NEW.step_count + 1) IS FALSE THEN 'plan_executed_all_steps'
    WHEN (NEW.status IN ('executing', 'failed') OR NEW.external_started_at IS NULL) IS FALSE THEN 'plan_external_in_flight'
    WHEN ((NEW.status = 'failed') = (NEW.failure IS NOT NULL)) IS FALSE THEN 'plan_failure_iff_failed'
    WHEN ((NEW.status IN ('rejected', 'expired', 'executed', 'failed'))
          = (NEW.finished_at IS NOT NULL)) IS FALSE THEN 'plan_finished_iff_terminal'
    WHEN (NEW.status <> 'executing'
          OR (NEW.heartbeat_at IS NOT NULL AND NEW.heartbeat_expires_at IS NOT NULL)) IS FALSE THEN 'plan_heartbeat_while_executing'
    WHEN (NEW.next_step BETWEEN 1 AND NEW.step_count + 1) IS FALSE THEN 'plan_next_step_range'
    WHEN ((NEW.status = 'rejected')
          = (NEW.rejected_by IS NOT NULL AND NEW.rejected_at IS NOT NULL AND NEW.reject_reason IS NOT NULL)) IS FALSE THEN 'plan_rejected_iff'
    WHEN ((NEW.status IN ('executing', 'executed', 'failed'))
          = (NEW.started_at IS NOT NULL AND NEW.heartbeat_interval IS NOT NULL)) IS FALSE THEN 'plan_started_iff'
    WHEN ((NEW.step_begun IS NULL) = (NEW.step_begun_xact IS NULL)) IS FALSE THEN 'plan_step_begun_whole'
  END;
  IF v_check IS NOT NULL THEN
    PERFORM pgfence._check_violated('plan', v_check, format('Failing row contains %s.', NEW),
      'A row check of pgfence.plan, held by this trigger since migration 0030: write plans only through the pgfence.plan_* functions.');
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_plan_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_plan_guard() IS
  'Trigger: holds the plan state machine and the frozen fields of pgfence.plan, for any writer.
BEFORE UPDATE trigger on pgfence.plan: refuses any transition outside the plan machine, a step advancing without its ok receipt, and a hand-over between two owners without a release (PF001); refuses changes to the frozen plan (step count, proposer name and login, expiry, key, compensated plan, approver, start), next_step or the run token going back, and any change of version_checked except plan_approve''s (PF002) — even from a hand-written UPDATE; then holds the row checks that were CHECK constraints before migration 0030 (plan_approved_iff ... plan_step_begun_whole: 23514 with the constraint''s name). Also BEFORE INSERT, filtered by a WHEN condition: a new row that is not a fresh proposal (pending, step 1, proposed by session_user, no approval / rejection / owner / heartbeat / failure / finish, not version_checked) is refused (PF001).';

-- plan_guard runs for every UPDATE but one kind: a step's commit (_plan_commit_step,
-- 24_plan_steps.sql) does the guard's work in its own statement and marks the row with
-- receipt_nonce, a fresh value (its run token and step as a uuid: never the row's value) that it also puts in the transaction-local setting
-- pgfence.plan_writing for that one statement. The guard is skipped only for a row whose
-- receipt_nonce changed to exactly that value. No other function changes receipt_nonce (a
-- catalog test in tests/pgtap/20_plan.sql checks it), and no client role may write the table,
-- so a client that pre-sets the setting before calling any plan function gains nothing: the row
-- keeps its old nonce and the guard runs. Only a login that may UPDATE the table itself (its
-- owner) could do both on purpose; it can also disable triggers. The WHEN costs no function call.
-- (Before migration 0027 the column does not exist: the triggers without the WHEN, as before.)
DO $plan_guard$
BEGIN
  IF EXISTS (SELECT FROM pg_catalog.pg_attribute
             WHERE attrelid = 'pgfence.plan'::regclass AND attname = 'receipt_nonce' AND NOT attisdropped) THEN
    CREATE OR REPLACE TRIGGER plan_guard
      BEFORE UPDATE ON pgfence.plan
      FOR EACH ROW
      WHEN (NEW.receipt_nonce IS NOT DISTINCT FROM OLD.receipt_nonce
            OR NEW.receipt_nonce::text IS DISTINCT FROM pg_catalog.current_setting('pgfence.plan_writing', true))
      EXECUTE FUNCTION pgfence.tg_plan_guard();
  ELSE
    CREATE OR REPLACE TRIGGER plan_guard
      BEFORE UPDATE ON pgfence.plan
      FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_guard();
  END IF;
END
$plan_guard$;
-- A hand-written INSERT must be a fresh proposal. The WHEN condition is evaluated without a
-- function call, so plan_propose's insert runs no PL/pgSQL here. (Before migration 0034 there is
-- no version_checked: the condition without it.)
DO $plan_insert_guard$
BEGIN
  EXECUTE format($t$
    CREATE OR REPLACE TRIGGER plan_insert_guard
      BEFORE INSERT ON pgfence.plan
      FOR EACH ROW
      WHEN (NEW.status <> 'pending' OR NEW.next_step <> 1
            OR NEW.proposed_db_user IS DISTINCT FROM session_user::text
            OR NEW.approved_by IS NOT NULL OR NEW.approved_at IS NOT NULL
            OR NEW.rejected_by IS NOT NULL OR NEW.rejected_at IS NOT NULL OR NEW.reject_reason IS NOT NULL
            OR NEW.worker IS NOT NULL OR NEW.started_at IS NOT NULL OR NEW.heartbeat_interval IS NOT NULL
            OR NEW.heartbeat_at IS NOT NULL OR NEW.heartbeat_expires_at IS NOT NULL
            OR NEW.external_started_at IS NOT NULL OR NEW.step_begun IS NOT NULL OR NEW.step_begun_xact IS NOT NULL
            OR NEW.failure IS NOT NULL OR NEW.finished_at IS NOT NULL%s)
      EXECUTE FUNCTION pgfence.tg_plan_guard()$t$,
    CASE WHEN EXISTS (SELECT FROM pg_catalog.pg_attribute
                      WHERE attrelid = 'pgfence.plan'::regclass AND attname = 'version_checked' AND NOT attisdropped)
         THEN ' OR NEW.version_checked' ELSE '' END);
END
$plan_insert_guard$;
-- Plans, steps and receipts are deleted only by a purge (tg_purge_only, functions/00_core.sql).
CREATE OR REPLACE TRIGGER plan_purge_only
  BEFORE DELETE ON pgfence.plan
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION pgfence.tg_purge_only();

CREATE OR REPLACE FUNCTION pgfence.tg_plan_step_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_plan  pgfence.plan;
  v_check text;
BEGIN
  SELECT * INTO v_plan FROM pgfence.plan p WHERE p.id = NEW.plan_id;
  IF TG_OP = 'INSERT' THEN
    IF v_plan.status IS DISTINCT FROM 'pending' OR NEW.step_index > v_plan.step_count OR NEW.outcome IS NOT NULL THEN
      RAISE EXCEPTION 'plan %: step % can only be written with the proposal, without a receipt', NEW.plan_id, NEW.step_index
        USING ERRCODE = 'PF001',
              DETAIL = format('Plan %s is %s with %s steps; the new step has outcome %s.',
                              NEW.plan_id, coalesce(v_plan.status, 'not found'), v_plan.step_count, coalesce(NEW.outcome, 'none')),
              HINT = 'Steps are written by pgfence.plan_propose; receipts by plan_run_step / plan_record_step.';
    END IF;
    NEW.db_user := NULL;  -- part of the receipt, which a new step does not have
  ELSE
    IF (NEW.plan_id, NEW.step_index, NEW.action, NEW.kind, NEW.function, NEW.args, NEW.note,
        NEW.function_oid, NEW.function_xmin)
       IS DISTINCT FROM (OLD.plan_id, OLD.step_index, OLD.action, OLD.kind, OLD.function, OLD.args, OLD.note,
                         OLD.function_oid, OLD.function_xmin) THEN
      RAISE EXCEPTION 'plan %: step % is immutable once proposed', OLD.plan_id, OLD.step_index
        USING ERRCODE = 'PF002', DETAIL = 'A step''s action, kind, function, args and note are what the approver saw.',
              HINT = 'Propose a new plan instead.';
    END IF;
    IF OLD.outcome IS NOT NULL THEN
      RAISE EXCEPTION 'receipt of plan % step % is immutable', OLD.plan_id, OLD.step_index
        USING ERRCODE = 'PF002', DETAIL = format('The step''s receipt says %s (finished at %s).', OLD.outcome, OLD.finished_at),
              HINT = 'A receipt records what committed; to undo a step propose a compensating plan.';
    END IF;
    IF NEW.outcome IS NOT NULL AND (
         v_plan.status IS DISTINCT FROM 'executing'
         OR NEW.step_index <> v_plan.next_step
         OR NEW.worker IS DISTINCT FROM v_plan.worker) THEN
      RAISE EXCEPTION 'plan %: a receipt for step % by % does not fit the run (status %, next step %, owner %)',
        NEW.plan_id, NEW.step_index, NEW.worker, v_plan.status, v_plan.next_step, v_plan.worker
        USING ERRCODE = 'PF001', DETAIL = 'A receipt is the outcome of the next step of an executing plan, written by its owner.',
              HINT = 'Receipts are written only by plan_run_step / plan_record_step, for the next step of an executing plan, by its owner.';
    END IF;
    -- The receipt's login, as event.db_user was filled: by the database, never by the writer.
    NEW.db_user := CASE WHEN NEW.outcome IS NOT NULL THEN session_user::text END;
  END IF;
  -- The row checks (formerly CHECK constraints, migration 0030), in their name order, for every
  -- INSERT and every UPDATE but a step's commit (which holds them by construction).
  v_check := CASE
    WHEN (pg_catalog.jsonb_typeof(NEW.args) = 'object') IS FALSE THEN 'plan_step_args_check'
    WHEN (NEW.outcome IS NULL
          OR (NEW.outcome = 'error') = (NEW.error IS NOT NULL AND pg_catalog.jsonb_typeof(NEW.error) = 'object'
                                        AND NEW.error ? 'message')) IS FALSE THEN 'plan_step_error_iff'
    WHEN ((NEW.kind = 'sql') = (NEW.function_md5 IS NOT NULL)) IS FALSE THEN 'plan_step_fingerprint_iff_sql'
    WHEN ((NEW.kind = 'sql') = (NEW.function IS NOT NULL)) IS FALSE THEN 'plan_step_function_iff_sql'
    WHEN (NEW.outcome IS NOT NULL OR (NEW.output IS NULL AND NEW.error IS NULL)) IS FALSE THEN 'plan_step_no_result_without_receipt'
    WHEN ((NEW.outcome IS NULL)
          = (NEW.worker IS NULL AND NEW.started_at IS NULL AND NEW.finished_at IS NULL)) IS FALSE THEN 'plan_step_receipt_whole'
  END;
  IF v_check IS NOT NULL THEN
    PERFORM pgfence._check_violated('plan_step', v_check, format('Failing row contains %s.', NEW),
      'A row check of pgfence.plan_step, held by this trigger since migration 0030: write plans only through the pgfence.plan_* functions.');
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_plan_step_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_plan_step_guard() IS
  'Trigger: plan steps are written with their proposal, receipts once, by the run''s owner.
BEFORE INSERT / UPDATE trigger on pgfence.plan_step: steps are inserted only with their pending plan, without a receipt (PF001), and never change (PF002); a receipt is written once, only for the next step of an executing plan, by its owner (PF001), and never changes (PF002); stamps the receipt''s login (db_user = session_user, NULL without a receipt); then holds the row checks that were CHECK constraints before migration 0030 (plan_step_args_check ... plan_step_receipt_whole: 23514 with the constraint''s name). Deletes: see plan_step_purge_only (tg_purge_only: only in a purge, with the plan).';

-- plan_step_guard (UPDATE) is skipped for the receipt of a step's commit alone, as plan_guard is
-- (see there); plan_step_new_guard checks every INSERT.
DO $plan_step_guard$
BEGIN
  IF EXISTS (SELECT FROM pg_catalog.pg_attribute
             WHERE attrelid = 'pgfence.plan_step'::regclass AND attname = 'receipt_nonce' AND NOT attisdropped) THEN
    CREATE OR REPLACE TRIGGER plan_step_guard
      BEFORE UPDATE ON pgfence.plan_step
      FOR EACH ROW
      WHEN (NEW.receipt_nonce IS NOT DISTINCT FROM OLD.receipt_nonce
            OR NEW.receipt_nonce::text IS DISTINCT FROM pg_catalog.current_setting('pgfence.plan_writing', true))
      EXECUTE FUNCTION pgfence.tg_plan_step_guard();
    CREATE OR REPLACE TRIGGER plan_step_new_guard
      BEFORE INSERT ON pgfence.plan_step
      FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_step_guard();
  ELSE
    CREATE OR REPLACE TRIGGER plan_step_guard
      BEFORE INSERT OR UPDATE ON pgfence.plan_step
      FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_step_guard();
  END IF;
END
$plan_step_guard$;
-- A statement trigger, so that the purge's cascade from plan to its (up to 10000) steps pays
-- nothing per row: its WHEN condition is false while pgfence.purging is on.
CREATE OR REPLACE TRIGGER plan_step_purge_only
  BEFORE DELETE ON pgfence.plan_step
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION pgfence.tg_purge_only();

-- ---------------------------------------------------------------------------------------------
-- Event log and NOTIFY
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_plan_event()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_event     text;
  v_detail    jsonb;
  v_next_kind text;
BEGIN
  IF TG_OP = 'INSERT' THEN
    PERFORM pgfence._event('plan', NEW.id, 'propose', NULL, NEW.status, NULL,
      jsonb_strip_nulls(jsonb_build_object('steps', NEW.step_count, 'expires_at', NEW.expires_at,
                                           'compensates', NEW.compensates,
                                           'idempotency_key', NEW.idempotency_key)),
      nullif(current_setting('pgfence.actor', true), ''));
    PERFORM pg_notify('pgfence_plan', json_build_object('id', NEW.id, 'status', NEW.status)::text);
    RETURN NULL;
  END IF;
  v_event := CASE
    WHEN OLD.status = 'pending'   AND NEW.status = 'approved'  THEN 'approve'
    WHEN OLD.status = 'pending'   AND NEW.status = 'rejected'  THEN 'reject'
    WHEN OLD.status = 'pending'   AND NEW.status = 'expired'   THEN 'expire'
    WHEN OLD.status = 'approved'  AND NEW.status = 'executing' THEN 'start'
    WHEN NEW.status = 'executed'                               THEN 'finish'
    WHEN NEW.status = 'failed'                                 THEN 'fail'
    WHEN NEW.worker IS NULL                                    THEN 'release'
    ELSE 'take' END;
  IF v_event = 'release' THEN
    SELECT s.kind INTO v_next_kind FROM pgfence.plan_step s WHERE s.plan_id = NEW.id AND s.step_index = NEW.next_step;
  END IF;
  v_detail := jsonb_strip_nulls(CASE v_event
    WHEN 'approve' THEN jsonb_build_object('by', NEW.approved_by)
    WHEN 'reject'  THEN jsonb_build_object('by', NEW.rejected_by, 'reason', NEW.reject_reason)
    WHEN 'expire'  THEN jsonb_build_object('expires_at', NEW.expires_at)
    WHEN 'start'   THEN jsonb_build_object('worker', NEW.worker, 'heartbeat', NEW.heartbeat_interval,
                                           'token', NEW.run_token)
    WHEN 'finish'  THEN jsonb_build_object('steps', NEW.step_count, 'worker', NEW.worker)
    WHEN 'fail'    THEN jsonb_build_object(
                          'reason', NEW.failure, 'step', NEW.next_step, 'worker', OLD.worker,
                          'external_in_doubt', CASE WHEN NEW.external_started_at IS NOT NULL THEN true END,
                          'heartbeat_expired_at', CASE WHEN NEW.failure = 'interrupted' THEN OLD.heartbeat_expires_at END)
    WHEN 'release' THEN jsonb_build_object('from', OLD.worker, 'step', NEW.next_step,
                                           'kind', v_next_kind,
                                           'take_by', NEW.heartbeat_expires_at)
    ELSE jsonb_build_object('worker', NEW.worker, 'step', NEW.next_step, 'token', NEW.run_token) END);
  PERFORM pgfence._event('plan', NEW.id, v_event, OLD.status, NEW.status, NULL, v_detail,
    coalesce(nullif(current_setting('pgfence.actor', true), ''), NEW.worker, OLD.worker));
  IF NEW.status = 'approved' OR v_event = 'release' THEN
    PERFORM pg_notify('pgfence_plan', json_build_object(
      'id', NEW.id, 'status', NEW.status,
      'next', v_next_kind)::text);
  END IF;
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_plan_event() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_plan_event() IS
  'Trigger: logs every plan transition to pgfence.event and wakes executors (NOTIFY pgfence_plan).
AFTER INSERT / UPDATE trigger on pgfence.plan: logs propose, approve, reject, expire, start, release, take, finish and fail to pgfence.event in the same transaction (start and take with the new run token in detail; reenter is written by plan_start itself); NOTIFY pgfence_plan {"id","status"[,"next"]} when a plan is proposed, approved, or released for another worker (delivered at commit).';

CREATE OR REPLACE TRIGGER plan_event_insert
  AFTER INSERT ON pgfence.plan
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_event();
CREATE OR REPLACE TRIGGER plan_event_update
  AFTER UPDATE ON pgfence.plan
  FOR EACH ROW
  WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.worker IS DISTINCT FROM NEW.worker)
  EXECUTE FUNCTION pgfence.tg_plan_event();

-- A receipt logs no event of its own (migration 0034): the receipt is the step's row, written
-- once, with its worker, times and login (db_user); audit_timeline reads it from there.
