-- pgfence functions/20_plan.sql — Module 2: approved plans.
--
-- A plan is a frozen JSON array of steps that someone (a script, an AI agent) proposes, a person
-- approves, and a worker executes in order, writing a receipt per step in the same transaction
-- as the step's effect. After any crash the receipts say exactly which steps committed.
--
--   pending --plan_approve--> approved --plan_start / plan_claim--> executing --> executed
--      |                                                              |
--      +--plan_reject--> rejected                                     +--> failed (step_error:
--      +--plan_approve after expires_at / reaper--> expired           |     an error receipt;
--                                                                     |     interrupted: the
--                                                                     |     heartbeat lapsed)
-- Enforced by tg_plan_guard (PF001/PF002), not only by these functions.
--
-- Steps name actions from the allow-list (plan_action): kind sql = a function f(jsonb) RETURNS
-- jsonb that plan_run_step runs inside a subtransaction, with the privileges of the role that
-- executes the plan (plan_run_step is NOT security definer; only its bookkeeping helpers
-- _plan_step_begin / _plan_step_finish are); kind external = an effect the executor performs
-- (through the outbox transports, idempotency key pgfence-plan-<id>-step-<n>) and reports with
-- plan_record_step. No retries: a failed step is a receipt, a new attempt is a new proposal,
-- and an undo is a compensating plan (plan_compensate) with its own approval and receipts.
--
-- Ownership of a run: plan_start / plan_claim make a worker the owner and return the run's
-- fence token (plan.run_token, bumped by every take: a start, a claim, a takeover of a released
-- run, a re-entry under the owner's own name, which also writes a 'reenter' event); every owner
-- write (run a step, record a step, heartbeat, release) locks the plan row and is refused unless
-- the plan is still executing by that worker, under that token, with a live heartbeat. So a
-- second process that takes the run under the same name fences the first one out, instead of
-- both acting as the owner. A lapsed heartbeat turns the
-- plan failed (interrupted) at the next lock-and-check, read (plan_get, plan_steps, plan_list)
-- or reaper run (plan_reap_stale), whichever comes first, so the answer depends only on the
-- database clock. An owner may release the run between steps (worker = NULL, e.g. to hand an
-- external step to an executor); another worker must take it over before the heartbeat lapses.
--
-- What was approved is what runs, and who approved it is another login:
--   * each sql step records, at proposal, the md5 of its function's definition
--     (pg_get_functiondef); a step whose function was replaced since does not run: its receipt
--     is an error PF108 and the plan fails (a dropped function: 42883; a retired action: PF101);
--   * plan_approve refuses (PF103) the approver name of the proposer, and the database login
--     (session_user) that proposed (plan.proposed_db_user), unless that login is a superuser;
--     every event records its login (event.db_user) next to the actor name it was given.
-- SQL receipts: _plan_step_begin stamps the step it hands out and the current transaction on the
-- plan row (step_begun, step_begun_xact); _plan_step_finish writes a receipt only for that step
-- in that transaction (PF107). Remaining trust: the action runs with the caller's privileges, so
-- a role granted both helpers (pgfence_executor, pgfence_admin) can still begin a step and write
-- its ok receipt in one transaction without running the action; grant pgfence_executor only to
-- executor logins trusted to run what plans say.
-- Rows: a hand-written INSERT must be a fresh proposal (PF001); plans, steps and receipts are
-- deleted only by the purge (PF002 otherwise, see tg_purge_only).
--
-- Actions run with search_path = pg_catalog, pgfence, pg_temp: write them with qualified names
-- or give them their own SET search_path.
-- Errors: functions/ERRORS.md (PF1xx are this module's).
--
-- Plans (tests/test_module_plans.py reads them through auto_explain): a statement that finds a
-- plan by id and also names its status compares the status with a PL/pgSQL constant
-- (c_executing, c_pending), in a function pinned to a generic plan (SET plan_cache_mode =
-- force_generic_plan, enable_seqscan / enable_bitmapscan off, as the outbox's hot functions).
-- With the literal the planner proves a partial index's predicate (plan_heartbeat_idx: status =
-- 'executing'; plan_pending_expiry_idx: 'pending'), and statistics taken while few plans were
-- in that status made every step a scan of every live heartbeat (_plan_step_begin) and every
-- approval a scan of all pending plans — in custom plans too, where a constant is folded back
-- into a literal, hence the pin. plan_claim walks one index per status that holds only its
-- candidates (migration 0008): one OR over both statuses, analysed while many plans were
-- approved or executing, was planned as a walk of the whole primary key, so that every claim
-- read the history.

-- ---------------------------------------------------------------------------------------------
-- Status machine guard
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.tg_plan_guard()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF TG_OP = 'INSERT' THEN
    -- Reached only through the WHEN condition of plan_insert_guard: the row is not a proposal.
    RAISE EXCEPTION 'plan: a new plan starts pending at step 1, proposed by this login (%), without approval, rejection, owner, heartbeat, failure or finish', session_user
      USING ERRCODE = 'PF001', HINT = 'Use pgfence.plan_propose(); a plan reaches any other state only through the plan_* functions.';
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
      USING ERRCODE = 'PF002', HINT = 'Propose a new plan instead.';
  END IF;
  IF (OLD.approved_by IS NOT NULL AND (NEW.approved_by, NEW.approved_at) IS DISTINCT FROM (OLD.approved_by, OLD.approved_at))
     OR (OLD.started_at IS NOT NULL AND NEW.started_at IS DISTINCT FROM OLD.started_at) THEN
    RAISE EXCEPTION 'plan %: who approved it and when it started never change', OLD.id
      USING ERRCODE = 'PF002', HINT = 'Propose a new plan instead.';
  END IF;
  IF NEW.next_step < OLD.next_step THEN
    RAISE EXCEPTION 'plan %: next_step never goes back (% -> %): committed steps stay committed', OLD.id, OLD.next_step, NEW.next_step
      USING ERRCODE = 'PF002', HINT = 'To undo steps, propose a compensating plan (pgfence.plan_compensate).';
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
      USING ERRCODE = 'PF001', HINT = 'Steps advance only through plan_run_step / plan_record_step.';
  END IF;
  IF NEW.status = 'failed' AND OLD.status <> 'failed' AND NEW.failure = 'step_error' AND NOT EXISTS (
       SELECT 1 FROM pgfence.plan_step s
       WHERE s.plan_id = OLD.id AND s.step_index = NEW.next_step AND s.outcome = 'error') THEN
    RAISE EXCEPTION 'plan %: failure step_error needs the error receipt of step %', OLD.id, NEW.next_step
      USING ERRCODE = 'PF001', HINT = 'Steps fail only through plan_run_step / plan_record_step.';
  END IF;
  NEW.updated_at := now();
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_plan_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_plan_guard() IS
  'BEFORE UPDATE trigger on pgfence.plan: refuses any transition outside the plan machine, a step advancing without its ok receipt, and a hand-over between two owners without a release (PF001); refuses changes to the frozen plan (step count, proposer name and login, expiry, key, compensated plan, approver, start), next_step or the run token going back (PF002) — even from a hand-written UPDATE. Also BEFORE INSERT, filtered by a WHEN condition: a new row that is not a fresh proposal (pending, step 1, proposed by session_user, no approval / rejection / owner / heartbeat / failure / finish) is refused (PF001).';

CREATE OR REPLACE TRIGGER plan_guard
  BEFORE UPDATE ON pgfence.plan
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_guard();
-- A hand-written INSERT must be a fresh proposal. The WHEN condition is evaluated without a
-- function call, so plan_propose's insert runs no PL/pgSQL here.
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
        OR NEW.failure IS NOT NULL OR NEW.finished_at IS NOT NULL)
  EXECUTE FUNCTION pgfence.tg_plan_guard();
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
  v_plan pgfence.plan;
BEGIN
  SELECT * INTO v_plan FROM pgfence.plan p WHERE p.id = NEW.plan_id;
  IF TG_OP = 'INSERT' THEN
    IF v_plan.status IS DISTINCT FROM 'pending' OR NEW.step_index > v_plan.step_count OR NEW.outcome IS NOT NULL THEN
      RAISE EXCEPTION 'plan %: step % can only be written with the proposal, without a receipt', NEW.plan_id, NEW.step_index
        USING ERRCODE = 'PF001', HINT = 'Steps are written by pgfence.plan_propose; receipts by plan_run_step / plan_record_step.';
    END IF;
    RETURN NEW;
  END IF;
  IF (NEW.plan_id, NEW.step_index, NEW.action, NEW.kind, NEW.function, NEW.args, NEW.note)
     IS DISTINCT FROM (OLD.plan_id, OLD.step_index, OLD.action, OLD.kind, OLD.function, OLD.args, OLD.note) THEN
    RAISE EXCEPTION 'plan %: step % is immutable once proposed', OLD.plan_id, OLD.step_index
      USING ERRCODE = 'PF002', HINT = 'Propose a new plan instead.';
  END IF;
  IF OLD.outcome IS NOT NULL THEN
    RAISE EXCEPTION 'receipt of plan % step % is immutable', OLD.plan_id, OLD.step_index
      USING ERRCODE = 'PF002', HINT = 'A receipt records what committed; to undo a step propose a compensating plan.';
  END IF;
  IF NEW.outcome IS NOT NULL AND (
       v_plan.status IS DISTINCT FROM 'executing'
       OR NEW.step_index <> v_plan.next_step
       OR NEW.worker IS DISTINCT FROM v_plan.worker) THEN
    RAISE EXCEPTION 'plan %: a receipt for step % by % does not fit the run (status %, next step %, owner %)',
      NEW.plan_id, NEW.step_index, NEW.worker, v_plan.status, v_plan.next_step, v_plan.worker
      USING ERRCODE = 'PF001', HINT = 'Receipts are written only by plan_run_step / plan_record_step, for the next step of an executing plan, by its owner.';
  END IF;
  RETURN NEW;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_plan_step_guard() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_plan_step_guard() IS
  'BEFORE INSERT / UPDATE trigger on pgfence.plan_step: steps are inserted only with their pending plan, without a receipt (PF001), and never change (PF002); a receipt is written once, only for the next step of an executing plan, by its owner (PF001), and never changes (PF002). Deletes: see plan_step_purge_only (tg_purge_only: only in a purge, with the plan).';

CREATE OR REPLACE TRIGGER plan_step_guard
  BEFORE INSERT OR UPDATE ON pgfence.plan_step
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_step_guard();
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
  'AFTER INSERT / UPDATE trigger on pgfence.plan: logs propose, approve, reject, expire, start, release, take, finish and fail to pgfence.event in the same transaction (start and take with the new run token in detail; reenter is written by plan_start itself); NOTIFY pgfence_plan {"id","status"[,"next"]} when a plan is proposed, approved, or released for another worker (delivered at commit).';

CREATE OR REPLACE TRIGGER plan_event_insert
  AFTER INSERT ON pgfence.plan
  FOR EACH ROW EXECUTE FUNCTION pgfence.tg_plan_event();
CREATE OR REPLACE TRIGGER plan_event_update
  AFTER UPDATE ON pgfence.plan
  FOR EACH ROW
  WHEN (OLD.status IS DISTINCT FROM NEW.status OR OLD.worker IS DISTINCT FROM NEW.worker)
  EXECUTE FUNCTION pgfence.tg_plan_event();

CREATE OR REPLACE FUNCTION pgfence.tg_plan_step_event()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  PERFORM pgfence._event('plan', NEW.plan_id, 'receipt', NULL, NULL, NEW.step_index,
    jsonb_strip_nulls(jsonb_build_object(
      'step', NEW.step_index, 'action', NEW.action, 'kind', NEW.kind, 'outcome', NEW.outcome,
      'error', NEW.error,
      'output', CASE WHEN pg_column_size(NEW.output) <= 2048 THEN NEW.output END)),
    coalesce(nullif(current_setting('pgfence.actor', true), ''), NEW.worker));
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_plan_step_event() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_plan_step_event() IS
  'AFTER UPDATE trigger on pgfence.plan_step: logs each receipt when it is written (step, action, outcome, error with SQLSTATE, small outputs) to pgfence.event in the step''s own transaction; fence = the step index.';

CREATE OR REPLACE TRIGGER plan_step_event
  AFTER UPDATE OF outcome ON pgfence.plan_step
  FOR EACH ROW WHEN (OLD.outcome IS NULL AND NEW.outcome IS NOT NULL)
  EXECUTE FUNCTION pgfence.tg_plan_step_event();

-- ---------------------------------------------------------------------------------------------
-- Private helpers
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._plan_check_name(p_value text, p_what text)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_value IS NULL THEN
    RAISE EXCEPTION 'plan: % is required', p_what
      USING ERRCODE = '22004', HINT = 'Name who does this: a person, a script or a worker (host:pid).';
  END IF;
  IF p_value = '' OR length(p_value) > 200 THEN
    RAISE EXCEPTION 'plan: % must be a non-empty name of at most 200 characters', p_what
      USING ERRCODE = '22023', HINT = 'Use something an operator can trace.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_name(text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_check_name(text, text) IS
  'Private: validates a proposer, approver or worker name; raises 22004 (NULL) or 22023 (empty, > 200 characters).';

CREATE OR REPLACE FUNCTION pgfence._plan_check_heartbeat(p_heartbeat interval)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_heartbeat IS NOT NULL AND (p_heartbeat < interval '1 second' OR p_heartbeat > interval '1 day') THEN
    RAISE EXCEPTION 'plan: heartbeat must be between 1 second and 1 day, got %', p_heartbeat
      USING ERRCODE = '22023', HINT = 'Pass NULL for the default (120 seconds), or the longest silence you accept before the run counts as interrupted.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_heartbeat(interval) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_check_heartbeat(interval) IS
  'Private: validates a heartbeat interval (1 second .. 1 day, NULL = default); raises 22023.';

CREATE OR REPLACE FUNCTION pgfence._plan_check_token(p_token bigint)
RETURNS void
LANGUAGE plpgsql IMMUTABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_token IS NULL THEN
    RAISE EXCEPTION 'plan: the run token is required'
      USING ERRCODE = '22004', DETAIL = 'Owner calls are fenced by the token of the take that made the caller the owner.',
            HINT = 'Pass the token that pgfence.plan_start returned (or the run_token column of pgfence.plan_claim).';
  END IF;
  IF p_token < 1 THEN
    RAISE EXCEPTION 'plan: run tokens start at 1, got %', p_token
      USING ERRCODE = '22023', DETAIL = 'Token 0 marks a run that nobody took under a token (approved, or executing since before migration 0010).',
            HINT = 'Take the run with pgfence.plan_start or plan_claim and pass the token it returns.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_check_token(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_check_token(bigint) IS
  'Private: raises 22004 when an owner call passes no run token, 22023 for a token below 1 (never issued).';

CREATE OR REPLACE FUNCTION pgfence._plan_require(p_id bigint)
RETURNS void
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'plan: plan id is required' USING ERRCODE = '22004';
  END IF;
  PERFORM 1 FROM pgfence.plan WHERE id = p_id;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'plan: no plan with id %', p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id (pgfence plan list).';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_require(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_require(bigint) IS
  'Private: raises 22004 for a NULL id and P0002 when no plan has this id (used on the lost-race path to tell a stale call from an unknown id).';

CREATE OR REPLACE FUNCTION pgfence._plan_step_key(p_id bigint, p_step integer)
RETURNS text
LANGUAGE sql IMMUTABLE PARALLEL SAFE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT 'pgfence-plan-' || p_id || '-step-' || p_step;
$$;
REVOKE ALL ON FUNCTION pgfence._plan_step_key(bigint, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_step_key(bigint, integer) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_step_key(bigint, integer) IS
  'Private: the idempotency key of a plan step, pgfence-plan-<plan id>-step-<step index>: the same for every delivery of that step, whichever worker performs it. Executable by the group roles because plan_run_step (not security definer) and the plan_receipts view call it as the reader.';

-- Heal plans that nobody can finish any more: executing with a lapsed heartbeat -> failed
-- (interrupted); pending past expires_at -> expired. Rows locked right now are skipped: a live
-- step transaction holds its plan's row, so that plan is not stale.
CREATE OR REPLACE FUNCTION pgfence._plan_heal(p_id bigint, p_max_rows integer)
RETURNS integer
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_count integer;
BEGIN
  WITH stale AS (
    SELECT p.id FROM pgfence.plan p
    WHERE (p_id IS NULL OR p.id = p_id)
      AND ((p.status = 'executing' AND p.heartbeat_expires_at < now())
           OR (p.status = 'pending' AND p.expires_at <= now()))
    ORDER BY p.id
    LIMIT p_max_rows
    FOR UPDATE SKIP LOCKED
  ), healed AS (
    UPDATE pgfence.plan p
    SET status = CASE WHEN p.status = 'pending' THEN 'expired' ELSE 'failed' END,
        failure = CASE WHEN p.status = 'executing' THEN 'interrupted' END,
        step_begun = NULL, step_begun_xact = NULL,
        finished_at = now()
    FROM stale
    WHERE p.id = stale.id
      AND ((p.status = 'executing' AND p.heartbeat_expires_at < now())
           OR (p.status = 'pending' AND p.expires_at <= now()))
    RETURNING p.id
  )
  SELECT count(*) INTO v_count FROM healed;
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_heal(bigint, integer) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_heal(bigint, integer) IS
  'Private: executing plans whose heartbeat lapsed become failed (interrupted), pending plans past expires_at become expired; one plan (p_id) or up to p_max_rows. Skips rows locked by a live transaction. Returns how many it changed.';

-- Lock one plan for an owner write, healing it first if its heartbeat lapsed.
CREATE OR REPLACE FUNCTION pgfence._plan_lock(p_id bigint)
RETURNS pgfence.plan
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'plan: plan id is required' USING ERRCODE = '22004';
  END IF;
  SELECT * INTO v FROM pgfence.plan p WHERE p.id = p_id FOR UPDATE;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'plan: no plan with id %', p_id
      USING ERRCODE = 'P0002', HINT = 'Check the id (pgfence plan list).';
  END IF;
  IF v.status = 'executing' AND v.heartbeat_expires_at < now() THEN
    UPDATE pgfence.plan p
    SET status = 'failed', failure = 'interrupted', finished_at = now(),
        step_begun = NULL, step_begun_xact = NULL
    WHERE p.id = p_id
    RETURNING * INTO v;
  END IF;
  RETURN v;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_lock(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_lock(bigint) IS
  'Private: SELECT ... FOR UPDATE of one plan (P0002 if unknown); if it is executing with a lapsed heartbeat it becomes failed (interrupted) first, so a stale owner finds it failed. Returns the locked row.';

-- Write a step's receipt and move the plan on, on a row the caller has locked and checked.
CREATE OR REPLACE FUNCTION pgfence._plan_commit_step(
  p_plan    pgfence.plan,
  p_ok      boolean,
  p_output  jsonb,
  p_error   jsonb
)
RETURNS text
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_status text;
BEGIN
  UPDATE pgfence.plan_step s
  SET outcome = CASE WHEN p_ok THEN 'ok' ELSE 'error' END,
      output = CASE WHEN p_ok THEN p_output END,
      error = CASE WHEN NOT p_ok THEN p_error END,
      worker = p_plan.worker,
      started_at = CASE WHEN s.kind = 'external' THEN coalesce(p_plan.external_started_at, now()) ELSE now() END,
      finished_at = clock_timestamp()
  WHERE s.plan_id = p_plan.id AND s.step_index = p_plan.next_step;
  -- The heartbeat is stamped with clock_timestamp(): a long step's transaction started (now())
  -- long ago, and the next deadline must count from the moment the step ended.
  UPDATE pgfence.plan p
  SET status = CASE WHEN NOT p_ok THEN 'failed'
                    WHEN p.next_step = p.step_count THEN 'executed'
                    ELSE 'executing' END,
      failure = CASE WHEN NOT p_ok THEN 'step_error' END,
      next_step = CASE WHEN p_ok THEN p.next_step + 1 ELSE p.next_step END,
      external_started_at = NULL,
      step_begun = NULL, step_begun_xact = NULL,
      heartbeat_at = clock_timestamp(),
      heartbeat_expires_at = clock_timestamp() + p.heartbeat_interval,
      finished_at = CASE WHEN NOT p_ok OR p.next_step = p.step_count THEN clock_timestamp() END
  WHERE p.id = p_plan.id
  RETURNING p.status INTO v_status;
  RETURN v_status;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_commit_step(pgfence.plan, boolean, jsonb, jsonb) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_commit_step(pgfence.plan, boolean, jsonb, jsonb) IS
  'Private: writes the receipt of the plan''s next step (ok with output, or error) and moves the plan on in the same transaction: next step with a fresh heartbeat, executed after the last ok step, failed (step_error) after an error. The caller holds the row lock and has checked the owner.';

-- Validate and normalise proposed steps: [{"action", "kind", "function", "args", "note"}].
CREATE OR REPLACE FUNCTION pgfence._plan_normalize_steps(p_steps jsonb)
RETURNS jsonb
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_n   integer;
  v_bad record;
  v_out jsonb;
BEGIN
  IF p_steps IS NULL THEN
    RAISE EXCEPTION 'plan: steps are required' USING ERRCODE = '22004',
      HINT = 'Pass a JSON array of {"action": name, "args": {...}} objects.';
  END IF;
  IF jsonb_typeof(p_steps) <> 'array' THEN
    RAISE EXCEPTION 'plan: steps must be a JSON array, got %', jsonb_typeof(p_steps)
      USING ERRCODE = '22023', HINT = 'Pass a JSON array of {"action": name, "args": {...}} objects.';
  END IF;
  v_n := jsonb_array_length(p_steps);
  IF v_n NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'plan: a plan has 1 to 10000 steps, got %', v_n
      USING ERRCODE = '22023', HINT = 'Split a longer plan into several plans.';
  END IF;
  SELECT s.i, s.problem INTO v_bad
  FROM (
    SELECT e.i, CASE
      WHEN jsonb_typeof(e.step) <> 'object' THEN 'is not a JSON object'
      WHEN EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(e.step) = 'object' THEN e.step END) k
                   WHERE k NOT IN ('action', 'args', 'note'))
        THEN 'has keys other than action, args, note'
      WHEN jsonb_typeof(e.step -> 'action') IS DISTINCT FROM 'string' THEN 'has no "action" string'
      WHEN e.step ? 'args' AND jsonb_typeof(e.step -> 'args') NOT IN ('object', 'null')
        THEN '"args" is not a JSON object'
      WHEN e.step ? 'note' AND (jsonb_typeof(e.step -> 'note') <> 'string' OR length(e.step ->> 'note') > 2000)
        THEN '"note" is not a string of at most 2000 characters'
      END AS problem
    FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  ) s
  WHERE s.problem IS NOT NULL
  ORDER BY s.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % %', v_bad.i, v_bad.problem
      USING ERRCODE = '22023', DETAIL = format('Step %s of %s; steps are numbered from 1.', v_bad.i, v_n),
            HINT = 'Each step is {"action": "<registered action>", "args": {...}, "note": "optional text"}.';
  END IF;
  SELECT e.i, e.step ->> 'action' AS action INTO v_bad
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  LEFT JOIN pgfence.plan_action a ON a.name = e.step ->> 'action' AND a.retired_at IS NULL
  WHERE a.name IS NULL
  ORDER BY e.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % names action "%", which is not on the allow-list', v_bad.i, v_bad.action
      USING ERRCODE = 'PF101',
            DETAIL = 'A plan can call only actions registered with pgfence.plan_register_action and not retired.',
            HINT = 'See the view pgfence.plan_actions for what is allowed; an administrator registers new actions.';
  END IF;
  SELECT e.i, e.step ->> 'action' AS action, a.function::text AS function INTO v_bad
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  JOIN pgfence.plan_action a ON a.name = e.step ->> 'action' AND a.kind = 'sql'
  WHERE NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc pr WHERE pr.oid = a.function)
  ORDER BY e.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % names action "%", whose function no longer exists', v_bad.i, v_bad.action
      USING ERRCODE = '42883',
            DETAIL = format('The action was registered with function %s, which was dropped since.', v_bad.function),
            HINT = 'An administrator re-creates the function and registers the action again (pgfence.plan_register_action), or retires it.';
  END IF;
  SELECT e.i, CASE
      WHEN jsonb_typeof(e.step -> 'args' -> 'recipient') IS DISTINCT FROM 'string'
           OR e.step -> 'args' ->> 'recipient' = '' OR length(e.step -> 'args' ->> 'recipient') > 2048
        THEN 'needs args.recipient, a string of 1-2048 characters'
      WHEN (e.step -> 'args') ? 'payload' AND jsonb_typeof(e.step -> 'args' -> 'payload') <> 'object'
        THEN 'args.payload must be a JSON object'
      WHEN EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(e.step -> 'args') = 'object' THEN e.step -> 'args' END) k
                   WHERE k NOT IN ('recipient', 'payload'))
        THEN 'args may hold only recipient and payload'
      END AS problem, e.step ->> 'action' AS action INTO v_bad
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  JOIN pgfence.plan_action a ON a.name = e.step ->> 'action' AND a.kind = 'external'
  WHERE jsonb_typeof(e.step -> 'args') IS DISTINCT FROM 'object'
     OR jsonb_typeof(e.step -> 'args' -> 'recipient') IS DISTINCT FROM 'string'
     OR e.step -> 'args' ->> 'recipient' = '' OR length(e.step -> 'args' ->> 'recipient') > 2048
     OR ((e.step -> 'args') ? 'payload' AND jsonb_typeof(e.step -> 'args' -> 'payload') <> 'object')
     OR EXISTS (SELECT 1 FROM jsonb_object_keys(CASE WHEN jsonb_typeof(e.step -> 'args') = 'object' THEN e.step -> 'args' END) k
                   WHERE k NOT IN ('recipient', 'payload'))
  ORDER BY e.i
  LIMIT 1;
  IF FOUND THEN
    RAISE EXCEPTION 'plan: step % (external action "%") %', v_bad.i, v_bad.action,
      coalesce(v_bad.problem, 'needs args {"recipient": ..., "payload": {...}}')
      USING ERRCODE = '22023',
            HINT = 'An external step''s args are {"recipient": "<url or address>", "payload": {...}}; the executor delivers payload to recipient.';
  END IF;
  SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
           'action', a.name,
           'kind', a.kind,
           'function', a.function::text,
           'note', e.step ->> 'note'))
         || jsonb_build_object('args', coalesce(nullif(e.step -> 'args', 'null'::jsonb), '{}'::jsonb))
         ORDER BY e.i)
  INTO v_out
  FROM jsonb_array_elements(p_steps) WITH ORDINALITY AS e(step, i)
  JOIN pgfence.plan_action a ON a.name = e.step ->> 'action';
  RETURN v_out;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_normalize_steps(jsonb) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_normalize_steps(jsonb) IS
  'Private: validates proposed steps up front (22004, 22023, PF101 for an action not on the allow-list, 42883 for a sql action whose function was dropped) and returns them normalised with each action''s kind and function frozen in.';

CREATE OR REPLACE FUNCTION pgfence._plan_steps_json(p_id bigint)
RETURNS jsonb
LANGUAGE sql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
  SELECT jsonb_agg(jsonb_strip_nulls(jsonb_build_object(
           'action', s.action, 'kind', s.kind, 'function', s.function, 'note', s.note))
         || jsonb_build_object('args', s.args)
         ORDER BY s.step_index)
  FROM pgfence.plan_step s WHERE s.plan_id = p_id;
$$;
REVOKE ALL ON FUNCTION pgfence._plan_steps_json(bigint) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._plan_steps_json(bigint) IS
  'Private: a plan''s frozen steps as the JSON array plan_propose normalised them to (what plan_get returns, and what a repeated idempotency key is compared with).';

-- ---------------------------------------------------------------------------------------------
-- The allow-list
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_register_action(
  p_name        text,
  p_function    regprocedure,
  p_description text
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_kind     text := CASE WHEN p_function IS NULL THEN 'external' ELSE 'sql' END;
  v_proc     record;
  v_old      pgfence.plan_action;
BEGIN
  IF p_name IS NULL OR p_description IS NULL THEN
    RAISE EXCEPTION 'plan_register_action: name and description are required' USING ERRCODE = '22004',
      HINT = 'Describe what the action does: approvers read it.';
  END IF;
  IF p_name !~ '^[a-z0-9][a-z0-9_.-]{0,62}$' THEN
    RAISE EXCEPTION 'plan_register_action: invalid action name "%"', p_name
      USING ERRCODE = '22023', HINT = 'Action names are 1-63 characters of a-z, 0-9, _ . - starting with a letter or digit (an external action''s name is also the executor''s route).';
  END IF;
  IF p_description = '' OR length(p_description) > 2000 THEN
    RAISE EXCEPTION 'plan_register_action: description must be 1-2000 characters' USING ERRCODE = '22023';
  END IF;
  IF p_function IS NOT NULL THEN
    SELECT p.prokind, p.pronargs, p.proargtypes, p.prorettype, p.proretset, n.nspname INTO v_proc
    FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_namespace n ON n.oid = p.pronamespace
    WHERE p.oid = p_function;
    IF NOT FOUND THEN
      -- a regprocedure is only an OID: '999999'::regprocedure names nothing
      RAISE EXCEPTION 'plan_register_action: function % does not exist', p_function::oid
        USING ERRCODE = '42883', DETAIL = 'No function has this OID; a step of this action could never run.',
              HINT = 'Pass an existing function (args jsonb) RETURNS jsonb, e.g. ''myschema.my_action(jsonb)''::regprocedure.';
    END IF;
    IF v_proc.prokind <> 'f' OR v_proc.pronargs <> 1 OR v_proc.proargtypes[0] <> 'jsonb'::regtype
       OR v_proc.prorettype <> 'jsonb'::regtype OR v_proc.proretset THEN
      RAISE EXCEPTION 'plan_register_action: % is not a function (args jsonb) RETURNS jsonb', p_function
        USING ERRCODE = '22023', HINT = 'A SQL action takes the step''s args as one jsonb argument and returns a jsonb result (the receipt''s output).';
    END IF;
    IF v_proc.nspname = 'pgfence' THEN
      RAISE EXCEPTION 'plan_register_action: % is pgfence''s own function', p_function
        USING ERRCODE = '22023', HINT = 'Actions are your functions, in your schemas.';
    END IF;
  END IF;
  SELECT * INTO v_old FROM pgfence.plan_action a WHERE a.name = p_name FOR UPDATE;
  IF NOT FOUND THEN
    INSERT INTO pgfence.plan_action (name, kind, function, description, registered_by)
    VALUES (p_name, v_kind, p_function, p_description, session_user)
    ON CONFLICT (name) DO NOTHING;
    IF FOUND THEN
      RETURN true;
    END IF;
    SELECT * INTO v_old FROM pgfence.plan_action a WHERE a.name = p_name FOR UPDATE;
  END IF;
  -- An existing name keeps its kind and function, unless the function was dropped since.
  IF v_old.kind <> v_kind
     OR (v_old.function IS DISTINCT FROM p_function
         AND EXISTS (SELECT 1 FROM pg_catalog.pg_proc p WHERE p.oid = v_old.function)) THEN
    RAISE EXCEPTION 'plan_register_action: action "%" is already registered as % %', p_name, v_old.kind,
      coalesce(v_old.function::text, '')
      USING ERRCODE = 'PF102',
            DETAIL = 'Approved plans name this action; re-pointing it would run something nobody approved.',
            HINT = 'Register the new function under a new action name (and retire the old one with pgfence.plan_retire_action).';
  END IF;
  UPDATE pgfence.plan_action a
  SET description = p_description, function = p_function, retired_at = NULL
  WHERE a.name = p_name;
  RETURN false;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_register_action(text, regprocedure, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_register_action(text, regprocedure, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_register_action(text, regprocedure, text) IS
  'Administrators: put an action on the allow-list. p_function = a function (args jsonb) RETURNS jsonb makes a sql action, run by plan_run_step with the privileges of the executing role; p_function NULL makes an external action, performed by the executor through the transport routed for the action''s name (step args {"recipient", "payload"}). Returns true when the name is new, false when it existed (the description is updated and a retired action is back in use). Errors: 22004 (missing name/description), 22023 (bad name or description, wrong function signature, a pgfence function), PF102 (the name is already registered to another kind or to another function that still exists), 42883 (p_function names no function).';

CREATE OR REPLACE FUNCTION pgfence.plan_retire_action(p_name text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  UPDATE pgfence.plan_action a SET retired_at = now() WHERE a.name = p_name AND a.retired_at IS NULL;
  IF FOUND THEN
    RETURN true;
  END IF;
  PERFORM 1 FROM pgfence.plan_action a WHERE a.name = p_name;
  IF NOT FOUND THEN
    RAISE EXCEPTION 'plan_retire_action: no action named "%"', p_name
      USING ERRCODE = 'P0002', HINT = 'See the view pgfence.plan_actions.';
  END IF;
  RETURN false;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_retire_action(text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_retire_action(text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_retire_action(text) IS
  'Administrators: take an action off the allow-list. New proposals naming it are refused (PF101); an approved plan that reaches a step of it records an error receipt (PF101) instead of running it. Returns false if it was already retired. Errors: P0002 (unknown action).';

CREATE OR REPLACE VIEW pgfence.plan_actions AS
SELECT a.name, a.kind, a.function::text AS function, a.description, a.registered_by,
       a.registered_at, a.retired_at
FROM pgfence.plan_action a;
REVOKE ALL ON pgfence.plan_actions FROM PUBLIC;
GRANT SELECT ON pgfence.plan_actions TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON VIEW pgfence.plan_actions IS
  'The plan action allow-list: what a proposer may name in a step (retired_at NULL), its kind (sql function or external effect), the function a sql action calls, and the description approvers read.';

-- ---------------------------------------------------------------------------------------------
-- Propose, approve, reject
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_propose(
  p_steps           jsonb,
  p_proposed_by     text,
  p_ttl             interval DEFAULT interval '1 day',
  p_idempotency_key text DEFAULT NULL,
  p_compensates     bigint DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_steps      jsonb;
  v_id         bigint;
  v_old        record;
  v_comp_state text;
BEGIN
  PERFORM pgfence._plan_check_name(p_proposed_by, 'proposed_by');
  IF p_ttl IS NULL THEN
    RAISE EXCEPTION 'plan_propose: ttl is required' USING ERRCODE = '22004', HINT = 'Omit it for the default (1 day).';
  END IF;
  IF p_ttl <= interval '0' OR p_ttl > interval '366 days' THEN
    RAISE EXCEPTION 'plan_propose: ttl must be positive and at most 366 days, got %', p_ttl
      USING ERRCODE = '22023', HINT = 'ttl is how long the plan may wait for approval.';
  END IF;
  IF p_idempotency_key IS NOT NULL AND (p_idempotency_key = '' OR length(p_idempotency_key) > 255) THEN
    RAISE EXCEPTION 'plan_propose: idempotency_key must be 1-255 characters or NULL' USING ERRCODE = '22023';
  END IF;
  IF p_compensates IS NOT NULL THEN
    SELECT p.status INTO v_comp_state FROM pgfence.plan p WHERE p.id = p_compensates;
    IF NOT FOUND THEN
      RAISE EXCEPTION 'plan_propose: no plan % to compensate', p_compensates
        USING ERRCODE = 'P0002', HINT = 'Check the id of the plan to undo.';
    END IF;
    IF v_comp_state NOT IN ('executed', 'failed') THEN
      RAISE EXCEPTION 'plan_propose: plan % is %; only an executed or failed plan can be compensated', p_compensates, v_comp_state
        USING ERRCODE = 'PF106',
              DETAIL = 'A pending, approved, rejected or expired plan ran nothing; an executing one is still changing.',
              HINT = 'Reject a plan that should not run; wait for an executing one to end (or for its heartbeat to lapse).';
    END IF;
  END IF;
  v_steps := pgfence._plan_normalize_steps(p_steps);
  PERFORM pgfence._set_actor(p_proposed_by);

  INSERT INTO pgfence.plan AS p (step_count, proposed_by, expires_at, idempotency_key, compensates)
  VALUES (jsonb_array_length(v_steps), p_proposed_by, now() + p_ttl, p_idempotency_key, p_compensates)
  ON CONFLICT (idempotency_key) DO NOTHING
  RETURNING p.id INTO v_id;
  IF v_id IS NOT NULL THEN
    -- Each sql step keeps a fingerprint of its function's definition (once per action, not per
    -- step): a step whose function was replaced after the approval does not run (PF108).
    WITH fp AS MATERIALIZED (
      SELECT a.name, md5(pg_catalog.pg_get_functiondef(a.function)) AS function_md5
      FROM pgfence.plan_action a
      WHERE a.kind = 'sql' AND a.name IN (SELECT DISTINCT x ->> 'action' FROM jsonb_array_elements(v_steps) AS x)
    )
    INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function, function_md5, args, note)
    SELECT v_id, e.i, e.step ->> 'action', e.step ->> 'kind', e.step ->> 'function', fp.function_md5,
           e.step -> 'args', e.step ->> 'note'
    FROM jsonb_array_elements(v_steps) WITH ORDINALITY AS e(step, i)
    LEFT JOIN fp ON fp.name = e.step ->> 'action';
    PERFORM pgfence._set_actor(NULL);
    RETURN v_id;
  END IF;
  SELECT p.id, pgfence._plan_steps_json(p.id) AS steps, p.proposed_by, p.compensates INTO v_old
  FROM pgfence.plan p WHERE p.idempotency_key = p_idempotency_key;
  IF v_old.id IS NULL THEN
    RAISE EXCEPTION 'plan_propose: idempotency key "%" is held by a transaction this snapshot cannot see', p_idempotency_key
      USING ERRCODE = '40001', HINT = 'Retry the transaction (this happens only under REPEATABLE READ or SERIALIZABLE).';
  END IF;
  IF v_old.steps IS DISTINCT FROM v_steps OR v_old.proposed_by IS DISTINCT FROM p_proposed_by
     OR v_old.compensates IS DISTINCT FROM p_compensates THEN
    RAISE EXCEPTION 'plan_propose: idempotency key "%" already names plan %, with other steps or another proposer', p_idempotency_key, v_old.id
      USING ERRCODE = 'PF003', HINT = 'An idempotency key identifies one proposal; use a new key for a different plan.';
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_old.id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_propose(jsonb, text, interval, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_propose(jsonb, text, interval, text, bigint) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_propose(jsonb, text, interval, text, bigint) IS
  'Propose a plan: p_steps is a JSON array of {"action", "args", "note"} (1..10000 steps, numbered from 1), every action on the allow-list; all steps are validated up front and frozen (normalised with each action''s kind and function). It waits for approval until now() + ttl. A repeated idempotency key returns the existing plan and inserts nothing. compensates = the executed or failed plan this one undoes (plan_compensate). The proposing database login (session_user) is recorded with the plan: that login cannot approve it (plan_approve). Each sql step records the md5 of its function''s definition (pg_get_functiondef): if the function is replaced before the step runs, the step is not run (PF108). Returns the plan id; NOTIFY pgfence_plan at commit. Errors: 22004 (missing steps/proposer/ttl), 22023 (malformed steps, ttl outside (0, 366 days], bad key), PF101 (an action not on the allow-list), 42883 (a sql action whose function was dropped), P0002 (unknown plan to compensate), PF106 (that plan is not executed or failed), PF003 (key already names another plan), 40001 (key held by an invisible transaction: retry).';

CREATE OR REPLACE FUNCTION pgfence.plan_compensate(
  p_id              bigint,
  p_steps           jsonb,
  p_by              text,
  p_ttl             interval DEFAULT interval '1 day',
  p_idempotency_key text DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_id IS NULL THEN
    RAISE EXCEPTION 'plan_compensate: the id of the plan to undo is required' USING ERRCODE = '22004';
  END IF;
  RETURN pgfence.plan_propose(p_steps, p_by, p_ttl, p_idempotency_key, p_id);
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_compensate(bigint, jsonb, text, interval, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_compensate(bigint, jsonb, text, interval, text) TO pgfence_client, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_compensate(bigint, jsonb, text, interval, text) IS
  'Propose a compensating plan for plan p_id (executed, or failed after some steps committed): a new plan with its own steps, approval and receipts that references the one it undoes; no step of the original is rolled back. Same rules as plan_propose. Errors: those of plan_propose — 22004 (p_id, steps, proposer or ttl NULL), 22023 (malformed steps, ttl, key), PF101 (an action not on the allow-list), 42883 (a sql action whose function was dropped), P0002 (unknown plan p_id), PF106 (that plan is not executed or failed), PF003 (key already names another plan), 40001 (key held by an invisible transaction: retry).';

CREATE OR REPLACE FUNCTION pgfence.plan_approve(p_id bigint, p_by text)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  c_pending CONSTANT text := 'pending';  -- a parameter: see the header, Plans
  v_status   text;
  v_proposer text;
  v_login    text;
  -- Four eyes are two logins: the names passed in are whatever the caller says. A superuser
  -- login is exempt (it could change the tables or the function anyway).
  v_super    boolean := coalesce((SELECT r.rolsuper FROM pg_catalog.pg_roles r WHERE r.rolname = session_user), false);
BEGIN
  PERFORM pgfence._plan_check_name(p_by, 'approver');
  PERFORM pgfence._set_actor(p_by);
  UPDATE pgfence.plan p
  SET status = CASE WHEN p.expires_at <= now() THEN 'expired' ELSE 'approved' END,
      approved_by = CASE WHEN p.expires_at > now() THEN p_by END,
      approved_at = CASE WHEN p.expires_at > now() THEN now() END,
      finished_at = CASE WHEN p.expires_at <= now() THEN now() END
  WHERE p.id = p_id AND p.status = c_pending AND p.proposed_by <> p_by
    AND (v_super OR p.proposed_db_user <> session_user::text)
  RETURNING p.status INTO v_status;
  IF v_status IS NOT NULL THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN v_status;
  END IF;
  PERFORM pgfence._plan_require(p_id);
  SELECT p.status, p.proposed_by, p.proposed_db_user INTO v_status, v_proposer, v_login FROM pgfence.plan p WHERE p.id = p_id;
  IF v_status = 'pending' AND v_proposer = p_by THEN
    RAISE EXCEPTION 'plan_approve: % proposed plan % and cannot approve it too', p_by, p_id
      USING ERRCODE = 'PF103', HINT = 'Another person must approve it (four eyes).';
  END IF;
  IF v_status = 'pending' AND v_login = session_user::text AND NOT v_super THEN
    RAISE EXCEPTION 'plan_approve: database login % proposed plan % (as %) and cannot approve it too (as %)', v_login, p_id, v_proposer, p_by
      USING ERRCODE = 'PF103',
            DETAIL = 'Four eyes are two database logins: the approver''s name is whatever the caller passes.',
            HINT = 'Another person approves it from their own login (pgfence_admin).';
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_approve(bigint, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_approve(bigint, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_approve(bigint, text) IS
  'Approve a pending plan (one conditional UPDATE): returns ''approved'', or ''expired'' when called after its expires_at (the plan moves to expired and can never run), or NULL when the plan is no longer pending (already decided: a lost race, nothing changed). At commit NOTIFY pgfence_plan wakes executors. Four eyes: refused when the approver name is the proposer name, and when the approving database login (session_user) is the one that proposed (plan.proposed_db_user), whatever names are passed, unless that login is a superuser. Errors: 22004/22023 (approver name), P0002 (unknown plan), PF103 (the approver is the proposer, by name or by login).';

CREATE OR REPLACE FUNCTION pgfence.plan_reject(p_id bigint, p_by text, p_reason text)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
DECLARE
  c_pending CONSTANT text := 'pending';  -- a parameter: see the header, Plans
  v_status text;
BEGIN
  PERFORM pgfence._plan_check_name(p_by, 'rejecter');
  IF p_reason IS NULL THEN
    RAISE EXCEPTION 'plan_reject: a reason is required' USING ERRCODE = '22004', HINT = 'Say why, for the proposer and the audit log.';
  END IF;
  IF p_reason = '' OR length(p_reason) > 2000 THEN
    RAISE EXCEPTION 'plan_reject: reason must be 1-2000 characters' USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor(p_by);
  UPDATE pgfence.plan p
  SET status = CASE WHEN p.expires_at <= now() THEN 'expired' ELSE 'rejected' END,
      rejected_by = CASE WHEN p.expires_at > now() THEN p_by END,
      rejected_at = CASE WHEN p.expires_at > now() THEN now() END,
      reject_reason = CASE WHEN p.expires_at > now() THEN p_reason END,
      finished_at = now()
  WHERE p.id = p_id AND p.status = c_pending
  RETURNING p.status INTO v_status;
  IF v_status IS NULL THEN
    PERFORM pgfence._plan_require(p_id);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_status IS NOT DISTINCT FROM 'rejected';
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_reject(bigint, text, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_reject(bigint, text, text) TO pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_reject(bigint, text, text) IS
  'Reject a pending plan with a reason: returns true if this call rejected it; false if it was no longer pending (lost race) or had passed its expires_at (it becomes expired instead). Errors: 22004 (missing approver or reason), 22023 (bad name, reason longer than 2000), P0002 (unknown plan).';

-- ---------------------------------------------------------------------------------------------
-- Take a run: start, claim, release, heartbeat
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_start(
  p_id        bigint,
  p_worker    text,
  p_heartbeat interval DEFAULT NULL
)
RETURNS bigint
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v       pgfence.plan;
  v_token bigint;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_heartbeat(p_heartbeat);
  PERFORM pgfence._set_actor(p_worker);
  -- Lock first, to know what this take replaces: _plan_lock raises 22004 / P0002 and marks a
  -- lapsed run failed (interrupted), which is then refused like any terminal plan.
  v := pgfence._plan_lock(p_id);
  IF NOT (v.status = 'approved'
          OR (v.status = 'executing' AND (v.worker IS NULL OR v.worker = p_worker))) THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN NULL;
  END IF;
  UPDATE pgfence.plan p
  SET status = 'executing',
      worker = p_worker,
      run_token = p.run_token + 1,
      started_at = coalesce(p.started_at, now()),
      heartbeat_interval = coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds'),
      heartbeat_at = now(),
      heartbeat_expires_at = now() + coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds')
  WHERE p.id = p_id
  RETURNING p.run_token INTO v_token;
  IF v.status = 'executing' AND v.worker = p_worker THEN
    -- The owner's name takes its own live run again (a restarted worker resuming "its" plans,
    -- or a second process under the same name): the holder of the previous token is fenced out.
    PERFORM pgfence._event('plan', p_id, 'reenter', 'executing', 'executing', NULL,
      jsonb_strip_nulls(jsonb_build_object(
        'worker', p_worker, 'token', v_token, 'previous_token', v.run_token, 'step', v.next_step,
        'external_in_flight', CASE WHEN v.external_started_at IS NOT NULL THEN true END)),
      p_worker);
  END IF;
  PERFORM pgfence._set_actor(NULL);
  RETURN v_token;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_start(bigint, text, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_start(bigint, text, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_start(bigint, text, interval) IS
  'Take a run and return its new fence token (pass it to plan_run_step and the other owner calls).
Of concurrent callers exactly one wins: approved -> executing owned by p_worker, a takeover of an executing plan that its owner released (worker NULL), or a re-entry by the owner''s own name into its live run, which writes a reenter event and fences out whoever held the previous token (a second process under the same name, or the worker''s own earlier incarnation). Every take bumps plan.run_token. The heartbeat deadline is now() + p_heartbeat (NULL = the plan''s interval, 120 seconds at first). Returns NULL when refused (another owner, not approved, terminal, or heartbeat lapsed — which marks it failed/interrupted): a lost race, not an error. In psql: SELECT pgfence.plan_start(42, ''me'') -> 1, then SELECT * FROM pgfence.plan_run_step(42, ''me'', 1). Errors: 22004/22023 (worker name, heartbeat outside 1 s..1 day), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_claim(
  p_worker        text,
  p_batch         integer DEFAULT 1,
  p_external_only boolean DEFAULT false,
  p_heartbeat     interval DEFAULT NULL
)
RETURNS TABLE (id bigint, next_step integer, step_count integer, next_kind text, heartbeat_interval interval,
               run_token bigint)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  -- parameters in the UPDATE by id (see the header, Plans); the walks name their status with
  -- a literal, so that their own partial indexes apply
  c_approved  CONSTANT text := 'approved';
  c_executing CONSTANT text := 'executing';
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_heartbeat(p_heartbeat);
  IF p_batch IS NULL OR p_batch NOT BETWEEN 1 AND 1000 OR p_external_only IS NULL THEN
    RAISE EXCEPTION 'plan_claim: batch must be between 1 and 1000 and external_only true or false'
      USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor(p_worker);
  -- Two walks in id order, each stopping after p_batch rows that it locks: approved plans
  -- (plan_approved_idx) and runs released by their owner (plan_released_idx); both indexes
  -- hold only those (migration 0008). The oldest p_batch of both are taken by primary key (an
  -- id array keeps even a generic plan on the index); the others are unlocked when this
  -- transaction ends a moment later. The next step's kind is looked up by key, row by row (an
  -- EXISTS was planned as a hash of every external step of every plan).
  RETURN QUERY
  WITH taken AS (
    UPDATE pgfence.plan p
    SET status = 'executing',
        worker = p_worker,
        run_token = p.run_token + 1,
        started_at = coalesce(p.started_at, now()),
        heartbeat_interval = coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds'),
        heartbeat_at = now(),
        heartbeat_expires_at = now() + coalesce(p_heartbeat, p.heartbeat_interval, interval '120 seconds')
    WHERE p.id = ANY (ARRAY(
            SELECT r.id
            FROM unnest(
              ARRAY(SELECT a.id FROM pgfence.plan a
                    WHERE a.status = 'approved' AND NOT p_external_only
                    ORDER BY a.id
                    LIMIT p_batch
                    FOR UPDATE SKIP LOCKED)
              || ARRAY(SELECT e.id FROM pgfence.plan e
                       WHERE e.status = 'executing' AND e.worker IS NULL AND e.heartbeat_expires_at >= now()
                         AND (NOT p_external_only
                              OR (SELECT s.kind FROM pgfence.plan_step s
                                  WHERE s.plan_id = e.id AND s.step_index = e.next_step) = 'external')
                       ORDER BY e.id
                       LIMIT p_batch
                       FOR UPDATE SKIP LOCKED)) AS r(id)
            ORDER BY r.id
            LIMIT p_batch))
      AND (p.status = c_approved OR (p.status = c_executing AND p.worker IS NULL AND p.heartbeat_expires_at >= now()))
    RETURNING p.id, p.next_step, p.step_count,
              (SELECT s.kind FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.step_index = p.next_step) AS next_kind,
              p.heartbeat_interval, p.run_token
  )
  SELECT t.id, t.next_step, t.step_count, t.next_kind, t.heartbeat_interval, t.run_token FROM taken t ORDER BY t.id;
  PERFORM pgfence._set_actor(NULL);
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_claim(text, integer, boolean, interval) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_claim(text, integer, boolean, interval) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_claim(text, integer, boolean, interval) IS
  'Executors: take up to p_batch runs with FOR UPDATE SKIP LOCKED (oldest plan first), so concurrent executors never take the same one: approved plans, and executing plans released by their owner. p_external_only: take only released runs whose next step is external (an executor that performs external effects but runs no SQL actions). Each taken run is owned by p_worker with a heartbeat as in plan_start, under a new run token. Returns (id, next_step, step_count, next_kind, heartbeat_interval, run_token): pass run_token to plan_run_step and the other owner calls. Errors: 22004/22023 (worker, batch outside 1..1000, heartbeat).';

CREATE OR REPLACE FUNCTION pgfence.plan_release(p_id bigint, p_worker text, p_token bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  PERFORM pgfence._set_actor(p_worker);
  v := pgfence._plan_lock(p_id);
  IF v.status <> 'executing' OR v.worker IS DISTINCT FROM p_worker OR v.run_token <> p_token THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN false;
  END IF;
  UPDATE pgfence.plan p
  SET worker = NULL, external_started_at = NULL, step_begun = NULL, step_begun_xact = NULL,
      heartbeat_at = now(), heartbeat_expires_at = now() + p.heartbeat_interval
  WHERE p.id = p_id;
  PERFORM pgfence._set_actor(NULL);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_release(bigint, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_release(bigint, text, bigint) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_release(bigint, text, bigint) IS
  'The owner (p_worker with run token p_token) hands its run over between two steps.
E.g. a SQL runner reaching an external step, or an executor shutting down: the plan stays executing with worker NULL, and another worker must take it (plan_start / plan_claim, which issue the next token) within one heartbeat interval or it fails as interrupted. NOTIFY pgfence_plan {"id","status","next": kind of the next step} at commit. Call it only before starting or after recording a step. Returns false if p_worker does not own a live run under p_token (lost race, fenced out). Errors: 22004 (worker, token), 22023 (worker, a token below 1), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_heartbeat(p_id bigint, p_worker text, p_token bigint)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  v := pgfence._plan_lock(p_id);
  IF v.status <> 'executing' OR v.worker IS DISTINCT FROM p_worker OR v.run_token <> p_token THEN
    RETURN false;
  END IF;
  UPDATE pgfence.plan p
  SET heartbeat_at = now(), heartbeat_expires_at = now() + p.heartbeat_interval
  WHERE p.id = p_id;
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_heartbeat(bigint, text, bigint) IS
  'The owner of a run (p_worker with run token p_token) says it is alive; false = stop, the run is lost.
E.g. every third of the heartbeat interval while an external step runs: the deadline moves to now() + the plan''s heartbeat interval. Returns false if p_worker no longer owns a live run under p_token (taken again under a newer token, released, terminal); a lapsed heartbeat is not revived: the plan becomes failed (interrupted) and the worker must stop. Errors: 22004 (worker, token), 22023 (worker, a token below 1), P0002 (unknown plan).';

-- ---------------------------------------------------------------------------------------------
-- Run steps
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence._plan_step_begin(
  p_id     bigint,
  p_worker text,
  p_token  bigint,
  OUT step_index integer,
  OUT action     text,
  OUT kind       text,
  OUT fn_schema  text,
  OUT fn_name    text,
  OUT retired    boolean,
  OUT fn_md5     text,
  OUT fn_md5_now text,
  OUT args       jsonb,
  OUT status     text
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
SET plan_cache_mode = force_generic_plan
SET enable_seqscan = off
SET enable_bitmapscan = off
AS $$
#variable_conflict use_column
DECLARE
  v      pgfence.plan;
  v_step record;
  c_executing CONSTANT text := 'executing';  -- a parameter: see the header, Plans
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  PERFORM pgfence._set_actor(p_worker);
  -- The usual case, in one statement: lock the run if p_worker owns it under p_token with a
  -- live heartbeat,
  -- and stamp the step handed out. A SQL step: the step and this transaction (step_begun,
  -- step_begun_xact), the only receipt _plan_step_finish will write. An external step: in
  -- flight since (external_started_at), with a fresh heartbeat.
  UPDATE pgfence.plan p
  SET step_begun = CASE WHEN s.kind = 'sql' THEN p.next_step END,
      step_begun_xact = CASE WHEN s.kind = 'sql' THEN pg_catalog.pg_current_xact_id() END,
      external_started_at = CASE WHEN s.kind = 'external' THEN coalesce(p.external_started_at, now())
                                 ELSE p.external_started_at END,
      heartbeat_at = CASE WHEN s.kind = 'external' THEN now() ELSE p.heartbeat_at END,
      heartbeat_expires_at = CASE WHEN s.kind = 'external' THEN now() + p.heartbeat_interval
                                  ELSE p.heartbeat_expires_at END
  FROM pgfence.plan_step s
  WHERE p.id = p_id AND p.status = c_executing AND p.worker = p_worker AND p.run_token = p_token
    AND p.heartbeat_expires_at >= now()
    AND s.plan_id = p.id AND s.step_index = p.next_step
  RETURNING p.status, p.next_step, s.action, s.kind, s.args, s.function_md5 INTO v_step;
  IF NOT FOUND THEN
    -- Refused (step_index NULL): not executing, not by this worker under this token, or its
    -- heartbeat lapsed.
    -- _plan_lock raises 22004 / P0002 and marks a lapsed run failed (interrupted).
    v := pgfence._plan_lock(p_id);
    status := v.status;
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;
  status := v_step.status;
  step_index := v_step.next_step;
  action := v_step.action;
  kind := v_step.kind;
  args := v_step.args;
  IF v_step.kind = 'external' THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN;
  END IF;
  fn_md5 := v_step.function_md5;
  SELECT a.retired_at IS NOT NULL, n.nspname, pr.proname, md5(pg_catalog.pg_get_functiondef(pr.oid))
    INTO retired, fn_schema, fn_name, fn_md5_now
  FROM pgfence.plan_action a
  LEFT JOIN pg_catalog.pg_proc pr ON pr.oid = a.function
  LEFT JOIN pg_catalog.pg_namespace n ON n.oid = pr.pronamespace
  WHERE a.name = v_step.action;
  PERFORM pgfence._set_actor(NULL);
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_step_begin(bigint, text, bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_step_begin(bigint, text, bigint) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_step_begin(bigint, text, bigint) IS
  'Bookkeeping for plan_run_step (security definer, so that plan_run_step itself need not be): locks the plan row for the rest of the transaction, heals a lapsed heartbeat, and returns the next step (action, kind, the function to call, whether the action was retired, the md5 of the function''s definition at proposal and now, args) if p_worker owns the executing run under run token p_token; otherwise only the status (refused). For an external step it stamps external_started_at; for a SQL step it stamps the step and the current transaction on the plan row (step_begun, step_begun_xact), the only step _plan_step_finish will then receipt. Not for direct use. Trust: granted to pgfence_executor because plan_run_step runs with the caller''s privileges; see _plan_step_finish for what that role is trusted with.';

CREATE OR REPLACE FUNCTION pgfence._plan_step_finish(
  p_id     bigint,
  p_worker text,
  p_token  bigint,
  p_step   integer,
  p_ok     boolean,
  p_output jsonb,
  p_error  jsonb
)
RETURNS text
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v      pgfence.plan;
  v_step record;
  v_out  text;
BEGIN
  IF p_ok IS NULL OR p_step IS NULL OR (NOT p_ok AND p_error IS NULL) THEN
    RAISE EXCEPTION '_plan_step_finish: step, ok and (for an error) error are required' USING ERRCODE = '22004';
  END IF;
  PERFORM pgfence._set_actor(p_worker);
  -- Same transaction as _plan_step_begin: the row lock is ours already, nobody healed it since.
  SELECT * INTO v FROM pgfence.plan p WHERE p.id = p_id FOR UPDATE;
  IF v.status IS DISTINCT FROM 'executing' OR v.worker IS DISTINCT FROM p_worker
     OR v.run_token IS DISTINCT FROM p_token THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN NULL;
  END IF;
  IF v.step_begun IS DISTINCT FROM p_step OR v.step_begun_xact IS DISTINCT FROM pg_catalog.pg_current_xact_id() THEN
    RAISE EXCEPTION '_plan_step_finish: plan % step % was not begun in this transaction', p_id, p_step
      USING ERRCODE = 'PF107',
            DETAIL = format('Begun: step %s in transaction %s; this is transaction %s.',
                            coalesce(v.step_begun::text, 'none'), coalesce(v.step_begun_xact::text, 'none'), pg_catalog.pg_current_xact_id()),
            HINT = 'Run SQL steps with pgfence.plan_run_step or CALL pgfence.plan_execute: a receipt is written only in the transaction that ran the step.';
  END IF;
  IF v.next_step <> p_step THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN NULL;
  END IF;
  SELECT s.kind, s.action, s.function_md5, a.retired_at, a.function::text AS function,
         md5(pg_catalog.pg_get_functiondef(a.function)) AS md5_now
    INTO v_step
  FROM pgfence.plan_step s
  LEFT JOIN pgfence.plan_action a ON a.name = s.action
  WHERE s.plan_id = p_id AND s.step_index = p_step;
  IF v_step.kind IS DISTINCT FROM 'sql' THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN NULL;
  END IF;
  -- An ok receipt only for a step that plan_run_step would have run: checked again here (also
  -- closes the window between begin and the call, when a function is replaced meanwhile).
  IF p_ok AND v_step.retired_at IS NOT NULL THEN
    RAISE EXCEPTION '_plan_step_finish: action "%" is retired: step % cannot succeed', v_step.action, p_step
      USING ERRCODE = 'PF101', HINT = 'plan_run_step records an error receipt for it.';
  END IF;
  IF p_ok AND v_step.md5_now IS NULL THEN
    RAISE EXCEPTION '_plan_step_finish: the function of action "%" no longer exists: step % cannot succeed', v_step.action, p_step
      USING ERRCODE = '42883', HINT = 'plan_run_step records an error receipt for it.';
  END IF;
  IF p_ok AND v_step.md5_now IS DISTINCT FROM v_step.function_md5 THEN
    RAISE EXCEPTION '_plan_step_finish: the function of action "%" changed since plan % was proposed: step % cannot succeed', v_step.action, p_id, p_step
      USING ERRCODE = 'PF108',
            DETAIL = format('%s: definition md5 %s at proposal, %s now.', v_step.function, v_step.function_md5, v_step.md5_now),
            HINT = 'Nothing was committed for this step; run it again with plan_run_step, which records the error receipt.';
  END IF;
  v_out := pgfence._plan_commit_step(v, p_ok, p_output, p_error);
  PERFORM pgfence._set_actor(NULL);
  RETURN v_out;
END
$$;
REVOKE ALL ON FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence._plan_step_finish(bigint, text, bigint, integer, boolean, jsonb, jsonb) IS
  'Bookkeeping for plan_run_step (security definer): writes the receipt of SQL step p_step in the step''s own transaction and moves the plan on (next step, executed, or failed on an error). Only for the step that _plan_step_begin handed out in this same transaction (PF107 otherwise: no receipt for a step that was not run here). An ok receipt is refused for a step whose action was retired (PF101), whose function was dropped (42883) or whose function''s definition differs from the one fingerprinted at proposal (PF108): the whole transaction, with the step''s effects, rolls back. Returns the plan''s new status, or NULL if p_worker does not own the executing run under run token p_token or the step is not its next SQL step. Not for direct use. Trust level: the action runs inside plan_run_step with the caller''s privileges (it is not security definer, by design), so a role granted both helpers (pgfence_executor, pgfence_admin) can still, in one transaction, call _plan_step_begin and then this function without running the action in between, and write an ok receipt with an output of its choosing for an unchanged, unretired action. Grant pgfence_executor only to executor logins that you trust to run what plans say; what these checks guarantee is that no receipt is written outside the transaction that began the step, for another step, or for a changed action.';

CREATE OR REPLACE FUNCTION pgfence.plan_run_step(
  p_id            bigint,
  p_worker        text,
  p_token         bigint,
  p_external_only boolean DEFAULT false,
  OUT step_index      integer,
  OUT action          text,
  OUT outcome         text,
  OUT status          text,
  OUT output          jsonb,
  OUT error           jsonb,
  OUT args            jsonb,
  OUT idempotency_key text
)
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_variable
DECLARE
  v       record;
  v_state text;
  v_msg   text;
  v_det   text;
  v_hint  text;
  v_ctx   text;
BEGIN
  v := pgfence._plan_step_begin(p_id, p_worker, p_token);
  status := v.status;
  IF v.step_index IS NULL THEN
    RETURN;  -- refused: not executing, or not by this worker under this token (lost race / stale worker)
  END IF;
  step_index := v.step_index;
  action := v.action;
  idempotency_key := pgfence._plan_step_key(p_id, v.step_index);
  IF v.kind = 'external' THEN
    outcome := 'external';  -- the executor performs it and calls plan_record_step
    args := v.args;
    RETURN;
  END IF;
  IF p_external_only THEN
    -- A runner that performs only external effects hands a SQL step to a SQL runner.
    PERFORM pgfence.plan_release(p_id, p_worker, p_token);
    outcome := 'released';
    RETURN;
  END IF;
  -- The action runs here, in this function, with the privileges of the role calling it:
  -- plan_run_step is not security definer. A subtransaction: if the action raises, only its
  -- effects are rolled back, and the error receipt below commits with the step.
  BEGIN
    IF v.retired THEN
      RAISE EXCEPTION 'action "%" was retired after the plan was approved', v.action
        USING ERRCODE = 'PF101', HINT = 'Propose a new plan with an action on the allow-list.';
    END IF;
    IF v.fn_name IS NULL THEN
      RAISE EXCEPTION 'the function of action "%" no longer exists', v.action
        USING ERRCODE = '42883', HINT = 'An administrator re-registers the action once its function is back.';
    END IF;
    IF v.fn_md5_now IS DISTINCT FROM v.fn_md5 THEN
      RAISE EXCEPTION 'the function of action "%" changed since the plan was proposed', v.action
        USING ERRCODE = 'PF108',
              DETAIL = format('%I.%I: definition md5 %s at proposal, %s now.', v.fn_schema, v.fn_name, v.fn_md5, v.fn_md5_now),
              HINT = 'Nothing ran. Propose the plan again, so that an approver approves the new definition, or restore the approved definition before running other plans that use it.';
    END IF;
    EXECUTE format('SELECT %I.%I($1)', v.fn_schema, v.fn_name) INTO output USING v.args;
    outcome := 'ok';
  EXCEPTION WHEN OTHERS OR query_canceled OR assert_failure THEN
    GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_msg = MESSAGE_TEXT,
                            v_det = PG_EXCEPTION_DETAIL, v_hint = PG_EXCEPTION_HINT,
                            v_ctx = PG_EXCEPTION_CONTEXT;
    outcome := 'error';
    output := NULL;
    error := jsonb_strip_nulls(jsonb_build_object(
      'sqlstate', v_state, 'message', v_msg, 'detail', nullif(v_det, ''),
      'hint', nullif(v_hint, ''), 'context', nullif(left(v_ctx, 4000), '')));
  END;
  status := pgfence._plan_step_finish(p_id, p_worker, p_token, v.step_index, outcome = 'ok', output, error);
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_run_step(bigint, text, bigint, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_run_step(bigint, text, bigint, boolean) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_run_step(bigint, text, bigint, boolean) IS
  'Run the next step of a run p_worker owns under run token p_token (from plan_start / plan_claim).
In the caller''s transaction (one step per transaction): lock the plan row and refuse unless it is still executing by p_worker under p_token with a live heartbeat (a newer take, even under the same name, fences out the older token); run the SQL action with the privileges of the calling role (this function is NOT security definer) inside a subtransaction; write the receipt in the same transaction — ok with the action''s output, or error with SQLSTATE and message (the action''s effects rolled back, the plan failed, earlier steps stay committed). After the last ok step the plan is executed. A step whose action was retired (PF101), whose function was dropped (42883) or replaced since the proposal (PF108: the md5 of its definition differs) does not run: its receipt is that error. For an external step nothing runs: outcome ''external'' with its args and idempotency key, for the executor to perform and report with plan_record_step. p_external_only (an executor that runs no SQL actions): at a SQL step nothing runs and the run is released for a SQL runner (outcome ''released''). Returns (step_index, action, outcome ok|error|external|released, status, output, error, args, idempotency_key); outcome NULL = refused (lost race, stale worker or token, terminal plan): nothing ran. In psql: SELECT * FROM pgfence.plan_run_step(42, ''me'', 1). Errors: 22004 (worker, token), 22023 (worker, a token below 1), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_record_step(
  p_id         bigint,
  p_step_index integer,
  p_worker     text,
  p_token      bigint,
  p_ok         boolean,
  p_output     jsonb DEFAULT NULL,
  p_error      text DEFAULT NULL
)
RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v pgfence.plan;
BEGIN
  PERFORM pgfence._plan_check_name(p_worker, 'worker');
  PERFORM pgfence._plan_check_token(p_token);
  IF p_step_index IS NULL OR p_ok IS NULL THEN
    RAISE EXCEPTION 'plan_record_step: step_index and ok are required' USING ERRCODE = '22004';
  END IF;
  IF NOT p_ok AND (p_error IS NULL OR p_error = '') THEN
    RAISE EXCEPTION 'plan_record_step: a failed step needs its error text' USING ERRCODE = '22004',
      HINT = 'Pass what the transport reported.';
  END IF;
  PERFORM pgfence._set_actor(p_worker);
  v := pgfence._plan_lock(p_id);
  IF p_step_index < 1 OR p_step_index > v.step_count THEN
    RAISE EXCEPTION 'plan_record_step: plan % has steps 1..%, not %', p_id, v.step_count, p_step_index
      USING ERRCODE = '22023';
  END IF;
  IF v.status <> 'executing' OR v.worker IS DISTINCT FROM p_worker OR v.run_token <> p_token
     OR p_step_index < v.next_step THEN
    PERFORM pgfence._set_actor(NULL);
    RETURN false;  -- stale worker or token, terminal plan, or a step recorded already
  END IF;
  IF p_step_index > v.next_step THEN
    RAISE EXCEPTION 'plan_record_step: plan % is at step %, not %', p_id, v.next_step, p_step_index
      USING ERRCODE = 'PF104', HINT = 'Steps run in order; record the step plan_run_step handed you.';
  END IF;
  IF (SELECT s.kind FROM pgfence.plan_step s WHERE s.plan_id = p_id AND s.step_index = p_step_index) <> 'external' THEN
    RAISE EXCEPTION 'plan_record_step: step % of plan % is a SQL action', p_step_index, p_id
      USING ERRCODE = 'PF105', HINT = 'SQL steps are run, and receipted in their own transaction, by plan_run_step / CALL plan_execute.';
  END IF;
  PERFORM pgfence._plan_commit_step(v, p_ok, p_output,
    CASE WHEN NOT p_ok THEN jsonb_build_object('message', left(p_error, 8000)) END);
  PERFORM pgfence._set_actor(NULL);
  RETURN true;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text) IS
  'Executors: record the outcome of an external step, as owner p_worker under run token p_token.
The same lock-and-refuse rule as plan_run_step: the receipt (ok with output, or error with the transport''s message) is written only if p_worker still owns the executing run under p_token with a live heartbeat and p_step_index is its next step; an error fails the plan; the last ok step makes it executed. Returns false when refused (stale worker or token — a lapsed heartbeat has made the plan failed/interrupted, or the run was taken again —, terminal plan, or a step already recorded): nothing changed. In psql: SELECT pgfence.plan_record_step(42, 2, ''me'', 1, true, ''{"http_status": 200}''). Errors: 22004 (missing argument, token; error text for a failure), 22023 (step outside the plan, a token below 1), P0002 (unknown plan), PF104 (not the next step), PF105 (a SQL step: run by plan_run_step).';

CREATE OR REPLACE PROCEDURE pgfence.plan_execute(
  p_id        bigint,
  p_worker    text,
  p_heartbeat interval DEFAULT NULL,
  INOUT status   text DEFAULT NULL,
  INOUT receipts jsonb DEFAULT NULL
)
LANGUAGE plpgsql
-- No SET clause and not security definer: a procedure with either cannot COMMIT, and the
-- actions must run with the caller's privileges. Every name is schema-qualified.
AS $$
#variable_conflict use_variable
DECLARE
  v_token bigint;
  v_step  record;
BEGIN
  v_token := pgfence.plan_start(p_id, p_worker, p_heartbeat);
  COMMIT;
  IF v_token IS NOT NULL THEN
    LOOP
      SELECT * INTO v_step FROM pgfence.plan_run_step(p_id, p_worker, v_token);
      COMMIT;  -- each step (effect + receipt) is its own transaction
      EXIT WHEN v_step.outcome IS DISTINCT FROM 'ok' OR v_step.status <> 'executing';
    END LOOP;
    IF v_step.outcome = 'external' THEN
      -- A SQL session cannot perform an external effect: hand the run to an executor.
      PERFORM pgfence.plan_release(p_id, p_worker, v_token);
      COMMIT;
    END IF;
  END IF;
  SELECT g.status INTO status FROM pgfence.plan_get(p_id) g;
  SELECT coalesce(jsonb_agg(to_jsonb(r) - 'plan_id' ORDER BY r.step_index), '[]'::jsonb) INTO receipts
  FROM pgfence.plan_receipts r WHERE r.plan_id = p_id;
END
$$;
REVOKE ALL ON PROCEDURE pgfence.plan_execute(bigint, text, interval, text, jsonb) FROM PUBLIC;
GRANT EXECUTE ON PROCEDURE pgfence.plan_execute(bigint, text, interval, text, jsonb) TO pgfence_executor, pgfence_admin;
COMMENT ON PROCEDURE pgfence.plan_execute(bigint, text, interval, text, jsonb) IS
  'CALL pgfence.plan_execute(id, worker): take the run (plan_start, under a new run token) and run its SQL steps one by one, committing after each, so every committed step has its receipt and a crash loses at most the step in flight (rolled back whole). Stops at an error (plan failed), at the end (executed), when the run is lost (heartbeat lapsed, another owner), or at an external step, which it releases to an executor. A plan that is terminal, or owned by someone else, runs nothing. Returns (status, receipts): the plan''s status and every receipt so far. Must be called outside an explicit transaction block (autocommit), since it commits. Errors: those of plan_start — 22004 (id or worker NULL), 22023 (bad worker, heartbeat outside 1 s..1 day), P0002 (unknown plan) —, 2D000 (inside a transaction block).';

-- ---------------------------------------------------------------------------------------------
-- Read: plan_get (with lazy heal), plan_steps, plan_list, plan_receipts
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE VIEW pgfence.plan_receipts AS
SELECT s.plan_id, s.step_index, s.action, s.kind, s.outcome, s.output,
       s.error ->> 'sqlstate' AS sqlstate, s.error ->> 'message' AS message, s.error,
       s.worker, s.started_at, s.finished_at, s.finished_at - s.started_at AS duration,
       pgfence._plan_step_key(s.plan_id, s.step_index) AS idempotency_key
FROM pgfence.plan_step s
WHERE s.outcome IS NOT NULL;
REVOKE ALL ON pgfence.plan_receipts FROM PUBLIC;
GRANT SELECT ON pgfence.plan_receipts TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON VIEW pgfence.plan_receipts IS
  'Receipts of every plan step that committed an outcome: ok with the action''s output, or error with SQLSTATE and message; who ran it, when, how long, and the step''s idempotency key (pgfence-plan-<id>-step-<n>). A step without a receipt did not commit.';

CREATE OR REPLACE FUNCTION pgfence.plan_get(p_id bigint)
RETURNS TABLE (
  id bigint, status text, failure text, step_count integer, next_step integer,
  proposed_by text, proposed_at timestamptz, expires_at timestamptz, idempotency_key text,
  compensates bigint, compensated_by bigint[], approved_by text, approved_at timestamptz,
  rejected_by text, rejected_at timestamptz, reject_reason text, worker text,
  started_at timestamptz, heartbeat_interval interval, heartbeat_at timestamptz,
  heartbeat_expires_at timestamptz, external_started_at timestamptz, finished_at timestamptz,
  updated_at timestamptz, steps jsonb
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  PERFORM pgfence._plan_require(p_id);
  PERFORM pgfence._plan_heal(p_id, 1);   -- lazy heal: a lapsed run reads as failed (interrupted)
  RETURN QUERY
  SELECT p.id, p.status, p.failure, p.step_count, p.next_step, p.proposed_by, p.proposed_at,
         p.expires_at, p.idempotency_key, p.compensates,
         (SELECT array_agg(c.id ORDER BY c.id) FROM pgfence.plan c WHERE c.compensates = p.id),
         p.approved_by, p.approved_at, p.rejected_by, p.rejected_at, p.reject_reason, p.worker,
         p.started_at, p.heartbeat_interval, p.heartbeat_at, p.heartbeat_expires_at,
         p.external_started_at, p.finished_at, p.updated_at, pgfence._plan_steps_json(p.id)
  FROM pgfence.plan p WHERE p.id = p_id;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_get(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_get(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_get(bigint) IS
  'One plan: status (failure reason if failed), progress, who proposed / approved / rejected it and when, the owner and its heartbeat, the compensating plans, and the frozen steps. Heals lazily: a run whose heartbeat lapsed is marked failed (interrupted) and a pending plan past expires_at expired before it is read (unless a live step transaction holds the row). Errors: 22004 (id NULL), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_steps(p_id bigint)
RETURNS TABLE (
  step_index integer, action text, kind text, args jsonb, note text, state text,
  output jsonb, sqlstate text, message text, worker text, started_at timestamptz,
  finished_at timestamptz, duration interval, idempotency_key text
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  PERFORM pgfence._plan_require(p_id);
  PERFORM pgfence._plan_heal(p_id, 1);
  RETURN QUERY
  SELECT s.step_index, s.action, s.kind, s.args, s.note,
         CASE
           WHEN s.outcome IS NOT NULL THEN s.outcome
           WHEN s.step_index = p.next_step AND p.status = 'executing' AND p.external_started_at IS NOT NULL THEN 'running'
           WHEN s.step_index = p.next_step AND p.status = 'executing' THEN 'next'
           WHEN p.status IN ('pending', 'approved', 'executing') THEN 'waiting'
           WHEN s.step_index = p.next_step AND p.failure = 'interrupted' AND p.external_started_at IS NOT NULL
             THEN 'unknown'
           ELSE 'not_run' END,
         s.output, s.error ->> 'sqlstate', s.error ->> 'message', s.worker, s.started_at,
         s.finished_at, s.finished_at - s.started_at,
         pgfence._plan_step_key(p.id, s.step_index)
  FROM pgfence.plan p
  JOIN pgfence.plan_step s ON s.plan_id = p.id
  WHERE p.id = p_id
  ORDER BY s.step_index;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_steps(bigint) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_steps(bigint) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_steps(bigint) IS
  'Every step of a plan with its receipt: state ok | error (committed receipts), next (the step an executing run does next), running (an external step handed to its executor), waiting (not reached yet), unknown (an external step in flight when the run was interrupted: it may have happened), not_run (the plan ended before it). Heals lazily like plan_get. Errors: 22004 (id NULL), P0002 (unknown plan).';

CREATE OR REPLACE FUNCTION pgfence.plan_list(
  p_status text DEFAULT NULL,
  p_limit  integer DEFAULT 100
)
RETURNS TABLE (
  id bigint, status text, failure text, step_count integer, steps_done integer,
  proposed_by text, proposed_at timestamptz, expires_at timestamptz, approved_by text,
  worker text, heartbeat_expires_at timestamptz, compensates bigint, finished_at timestamptz
)
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
#variable_conflict use_column
BEGIN
  IF p_status IS NOT NULL AND p_status NOT IN ('pending', 'approved', 'rejected', 'expired', 'executing', 'executed', 'failed') THEN
    RAISE EXCEPTION 'plan_list: unknown status "%"', p_status
      USING ERRCODE = '22023', HINT = 'One of pending, approved, rejected, expired, executing, executed, failed.';
  END IF;
  IF p_limit IS NULL OR p_limit NOT BETWEEN 1 AND 10000 THEN
    RAISE EXCEPTION 'plan_list: limit must be between 1 and 10000' USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._plan_heal(NULL, 1000);
  RETURN QUERY
  SELECT p.id, p.status, p.failure, p.step_count,
         CASE WHEN p.status = 'executed' THEN p.step_count
              WHEN p.status IN ('executing', 'failed') THEN p.next_step - 1 ELSE 0 END,
         p.proposed_by, p.proposed_at, p.expires_at, p.approved_by, p.worker,
         CASE WHEN p.status = 'executing' THEN p.heartbeat_expires_at END,
         p.compensates, p.finished_at
  FROM pgfence.plan p
  WHERE p_status IS NULL OR p.status = p_status
  ORDER BY p.id DESC
  LIMIT p_limit;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_list(text, integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_list(text, integer) TO pgfence_client, pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_list(text, integer) IS
  'The newest plans (highest id first), optionally of one status, without their steps: progress (steps_done = ok receipts), proposer, approver, owner and heartbeat deadline. Heals lapsed runs and expired proposals first, like plan_get. Errors: 22023 (unknown status, limit outside 1..10000).';

-- ---------------------------------------------------------------------------------------------
-- Reaper
-- ---------------------------------------------------------------------------------------------
CREATE OR REPLACE FUNCTION pgfence.plan_reap_stale(p_max_rows integer DEFAULT 1000)
RETURNS integer
LANGUAGE plpgsql VOLATILE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
DECLARE
  v_count integer;
BEGIN
  IF p_max_rows IS NULL OR p_max_rows < 1 THEN
    RAISE EXCEPTION 'plan_reap_stale: max_rows must be positive, got %', p_max_rows
      USING ERRCODE = '22023';
  END IF;
  PERFORM pgfence._set_actor('reaper');
  v_count := pgfence._plan_heal(NULL, p_max_rows);
  PERFORM pgfence._set_actor(NULL);
  RETURN v_count;
END
$$;
REVOKE ALL ON FUNCTION pgfence.plan_reap_stale(integer) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.plan_reap_stale(integer) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.plan_reap_stale(integer) IS
  'Reaper: executing plans whose heartbeat lapsed (database clock) become failed with reason interrupted — their committed steps keep their receipts, nothing is retried, and the old owner is refused from then on — and pending plans past expires_at become expired. At most max_rows; skips rows a live transaction holds. Returns how many it changed. Run by executors on a timer; safe for a DBA to call. Errors: 22023 (max_rows < 1).';
