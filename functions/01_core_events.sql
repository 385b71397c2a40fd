-- pgfence functions/01_core_events.sql — core: the event log and the delete guard of every module.
--
-- No public function: the modules' triggers and functions write pgfence.event through
-- _event(), naming the actor with _set_actor(); the audit views (90_audit_*.sql) read it.
-- Guards: tg_event_append_only (an event is never updated) and tg_purge_only, the BEFORE DELETE
-- statement trigger shared by event, outbox, plan, plan_step and operation: rows go only in a
-- purge (CALL pgfence.audit_purge, which sets pgfence.purging = on for its batch). A safety
-- catch against a stray DELETE in psql, not a permission: no pgfence role can write the tables,
-- and their owner can disable triggers. tg_no_truncate is the same catch for TRUNCATE (which
-- only the tables' owner may run): refused unless pgfence.purging is on in the transaction.

COMMENT ON TABLE pgfence.event IS
  'Append-only event log of every module, written in the same transaction as each change.
Transitions with who made them and under which fence token, receipts, errors with SQLSTATE,
document save outcomes, written by the modules'' triggers and functions. Not an API: read it
through the audit views.';

CREATE OR REPLACE FUNCTION pgfence._event(
  p_module      text,
  p_item_id     bigint,
  p_event       text,
  p_from_status text DEFAULT NULL,
  p_to_status   text DEFAULT NULL,
  p_fence       bigint DEFAULT NULL,
  p_detail      jsonb DEFAULT NULL,
  p_actor       text DEFAULT NULL
)
RETURNS void
-- PL/pgSQL, not SQL: a SQL function with a SET clause is never inlined, and a SQL function that
-- is not inlined is parsed and planned again on every call (about a third of a plan step's
-- time went here); a PL/pgSQL function keeps its statement's plan for the session.
LANGUAGE plpgsql VOLATILE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  INSERT INTO pgfence.event (module, item_id, event, from_status, to_status, actor, fence, detail)
  VALUES (p_module, p_item_id, p_event, p_from_status, p_to_status,
          coalesce(p_actor, nullif(current_setting('pgfence.actor', true), ''), session_user::text),
          p_fence, p_detail);
END
$$;
REVOKE ALL ON FUNCTION pgfence._event(text, bigint, text, text, text, bigint, jsonb, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._event(text, bigint, text, text, text, bigint, jsonb, text) IS
  'Private: append one row to pgfence.event in the current transaction.
The actor is p_actor, else the transaction-local setting pgfence.actor (set by the functions
that take a worker or a name, see _set_actor), else session_user. db_user and txid come from the
columns'' defaults.';

-- The actor ends with the call that named it: such a function calls _set_actor(NULL) before
-- each RETURN (an error rolls the setting back with the call's work). Not a function-level
-- SET pgfence.actor = '' clause: on PostgreSQL 15 a SET clause naming a custom setting makes
-- CREATE FUNCTION need GRANT SET ON PARAMETER, which a non-superuser owner does not have.
CREATE OR REPLACE FUNCTION pgfence._set_actor(p_actor text)
RETURNS void
-- PL/pgSQL, not SQL: this SQL function was not inlined (a PERFORM of it planned it again on
-- every call, ~20 us, four times per plan step). No SET clause on purpose: a function-level SET
-- would undo this set_config at exit; every name is qualified instead.
LANGUAGE plpgsql VOLATILE
AS $$
BEGIN
  PERFORM pg_catalog.set_config('pgfence.actor', coalesce(p_actor, ''), true);
END
$$;
REVOKE ALL ON FUNCTION pgfence._set_actor(text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._set_actor(text) IS
  'Private: name the actor (worker, approver, user) the event log records next; NULL clears it.
A calling function clears it (_set_actor(NULL)) before each RETURN, so that the name ends with the
call instead of leaking into the rest of the caller''s transaction.';

CREATE OR REPLACE FUNCTION pgfence.tg_purge_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF current_setting('pgfence.purging', true) IS DISTINCT FROM 'on' THEN
    RAISE EXCEPTION 'pgfence.%: rows are deleted only by a purge', TG_TABLE_NAME
      USING ERRCODE = 'PF002',
            DETAIL = 'Items, their receipts and their events are the audit trail; pgfence.audit_purge deletes finished ones after their retention period.',
            HINT = 'CALL pgfence.audit_purge(module, older_than). To delete by hand on purpose, do it in a transaction with SET LOCAL pgfence.purging = on.';
  END IF;
  RETURN NULL;
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_purge_only() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_purge_only() IS
  'Trigger: refuses a DELETE (PF002) unless the setting pgfence.purging is on, as purges set it.
BEFORE DELETE statement trigger shared by pgfence.event, outbox, plan, plan_step and operation,
filtered by WHEN pgfence.purging is not on, so a purge pays nothing per row.
pgfence._audit_purge_batch sets the transaction-local setting for the length of one batch.';

-- Inserts are not guarded: an event has no initial state to check, db_user and txid come from
-- their column defaults, and only the tables' owner can insert (what a guard would cost:
-- docs/query-plans.md#core).
CREATE OR REPLACE FUNCTION pgfence.tg_event_append_only()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'pgfence.event is append-only: an event is never changed'
    USING ERRCODE = 'PF002',
          DETAIL = 'The event log records what happened, in the transaction that did it.',
          HINT = 'Events record what happened; the purge deletes old ones (pgfence.audit_purge).';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_event_append_only() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_event_append_only() IS
  'Trigger: refuses any UPDATE of pgfence.event (PF002); the log is append-only.
BEFORE UPDATE statement trigger on pgfence.event. Costs nothing on the normal path (events are
never updated).';

CREATE OR REPLACE TRIGGER event_no_update
  BEFORE UPDATE ON pgfence.event
  FOR EACH STATEMENT EXECUTE FUNCTION pgfence.tg_event_append_only();
CREATE OR REPLACE TRIGGER event_purge_only
  BEFORE DELETE ON pgfence.event
  FOR EACH STATEMENT
  WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
  EXECUTE FUNCTION pgfence.tg_purge_only();

-- TRUNCATE skips the row triggers, so tg_purge_only never sees it: a statement trigger of its
-- own refuses it on the tables whose rows only a purge may delete. Only the tables' owner (the
-- installing login) may TRUNCATE at all; a reset on purpose (tests, benchmarks) sets
-- pgfence.purging = on for its transaction first, exactly as a hand-made DELETE must.
CREATE OR REPLACE FUNCTION pgfence.tg_no_truncate()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION 'pgfence.%: TRUNCATE is refused; rows are deleted only by a purge', TG_TABLE_NAME
    USING ERRCODE = 'PF005',
          DETAIL = 'TRUNCATE would remove items, receipts or events that are the audit trail, without the purge''s retention rules.',
          HINT = 'CALL pgfence.audit_purge(module, older_than). The tables'' owner may reset them on purpose in a transaction with SET LOCAL pgfence.purging = on.';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_no_truncate() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_no_truncate() IS
  'Trigger: refuses TRUNCATE (PF005) of a table whose rows only a purge deletes.
BEFORE TRUNCATE statement trigger on pgfence.event, outbox, outbox_lapse, plan, plan_step and
operation, filtered by WHEN pgfence.purging is not on: the owner''s deliberate reset sets it for
its transaction (SET LOCAL pgfence.purging = on), as a hand-made DELETE must.';

DO $guards$
DECLARE
  v_table text;
BEGIN
  FOREACH v_table IN ARRAY ARRAY['event', 'outbox', 'outbox_lapse', 'plan', 'plan_step', 'operation'] LOOP
    EXECUTE format($t$CREATE OR REPLACE TRIGGER %I
      BEFORE TRUNCATE ON pgfence.%I
      FOR EACH STATEMENT
      WHEN (current_setting('pgfence.purging', true) IS DISTINCT FROM 'on')
      EXECUTE FUNCTION pgfence.tg_no_truncate()$t$, v_table || '_no_truncate', v_table);
  END LOOP;
END
$guards$;
