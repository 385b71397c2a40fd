-- pgfence 0010 — plan runs get a fence token.
-- depends: 0009_operation_kind_queue
--
-- Ownership of a plan run was the worker name alone: a second process that called
-- plan_start(id, 'pod-9') under the name of a live owner got true, and plan_run_step handed it
-- the step in flight again. Now every take of a run (plan_start, plan_claim, a takeover of a
-- released run, and a re-entry by the current owner's name) bumps plan.run_token and returns
-- it, and every owner write (plan_run_step, plan_record_step, plan_heartbeat, plan_release)
-- must present the current token: a process holding an older one is refused like a stale
-- worker, whatever its name. A re-entry writes a 'reenter' event naming the previous token.
--
-- The owner functions change signature (a token parameter; plan_start returns the token,
-- plan_claim returns it as a column), so their old versions are dropped here and
-- functions/20_plan.sql creates the new ones. Executors of an older pgfence calling the old
-- signatures get 42883 until they are restarted on this version (README, Upgrading): an old
-- executor's runs are left to their heartbeat and fail as interrupted, as after a crash.
--
-- Adding a column with a constant default rewrites nothing; existing runs start at token 0,
-- which is never issued (owner calls refuse tokens below 1 with 22023), so a run executing
-- during the upgrade is taken again by its owner's next plan_start (a reenter event, token 1),
-- or fails as interrupted when its heartbeat lapses.

ALTER TABLE pgfence.plan ADD COLUMN run_token bigint NOT NULL DEFAULT 0
  CONSTRAINT plan_run_token_nonnegative CHECK (run_token >= 0);
COMMENT ON COLUMN pgfence.plan.run_token IS
  'The fence token of the run: 0 until the first take, then bumped by every plan_start, plan_claim, takeover of a released run and re-entry under the owner''s name. The owner functions (plan_run_step, plan_record_step, plan_heartbeat, plan_release) act only with the current token; it never goes down (PF002).';

DROP FUNCTION IF EXISTS pgfence.plan_start(bigint, text, interval);
DROP FUNCTION IF EXISTS pgfence.plan_claim(text, integer, boolean, interval);
DROP FUNCTION IF EXISTS pgfence.plan_release(bigint, text);
DROP FUNCTION IF EXISTS pgfence.plan_heartbeat(bigint, text);
DROP FUNCTION IF EXISTS pgfence.plan_run_step(bigint, text, boolean);
DROP FUNCTION IF EXISTS pgfence.plan_record_step(bigint, integer, text, boolean, jsonb, text);
DROP FUNCTION IF EXISTS pgfence._plan_step_begin(bigint, text);
DROP FUNCTION IF EXISTS pgfence._plan_step_finish(bigint, text, integer, boolean, jsonb, jsonb);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 10);
