-- pgfence functions/05_trace_context.sql — the W3C trace context carried from enqueue to delivery.
--
-- Public: trace_contexts(module, ids[])  (an executor with tracing on: one call per claimed batch)
-- Internal: _traceparent(), _tracestate() (the defaults of the traceparent / tracestate columns
--           of outbox, plan and operation), _trace_check(value, setting); trigger
--           tg_trace_frozen (the columns are never updated: PF002).
-- A caller whose trace should reach the executor sets, in the transaction that enqueues
-- (proposes, requests): SET LOCAL pgfence.traceparent = '00-<trace id>-<parent id>-<flags>'
-- (and optionally pgfence.tracestate); every outbox message, plan and operation it then inserts
-- carries it. No function signature changes. Unset or '' = no trace context (NULL). A malformed
-- value raises 22023 at the insert: nothing is written (the Python helpers only set valid ones).
-- The defaults are inlinable SQL: an insert without the setting pays a current_setting() call.
-- Docs: docs/tracing.md. Errors: functions/ERRORS.md.

CREATE OR REPLACE FUNCTION pgfence._trace_check(p_value text, p_setting text)
RETURNS text
LANGUAGE plpgsql STABLE
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_setting = 'pgfence.traceparent' THEN
    -- W3C Trace Context level 1: version-traceid-parentid-flags, lowercase hex, version ff and
    -- all-zero ids invalid. Exactly 55 characters (the fields of version 00).
    IF p_value ~ '^[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}$'
       AND left(p_value, 2) <> 'ff'
       AND substr(p_value, 4, 32) <> repeat('0', 32)
       AND substr(p_value, 37, 16) <> repeat('0', 16) THEN
      RETURN p_value;
    END IF;
    RAISE EXCEPTION 'pgfence.traceparent is not a W3C traceparent: "%"', left(p_value, 100)
      USING ERRCODE = '22023',
            DETAIL = 'A traceparent is version-traceid-parentid-flags in lowercase hex (2-32-16-2 digits, ids not all zero, version not ff); nothing was written.',
            HINT = 'Set it from your tracer''s current span (e.g. 00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01), or RESET pgfence.traceparent.';
  END IF;
  -- tracestate: at most 512 characters of printable ASCII (the W3C list of key=value members).
  IF length(p_value) <= 512 AND p_value ~ '^[\x20-\x7e]*$' THEN
    RETURN p_value;
  END IF;
  RAISE EXCEPTION 'pgfence.tracestate is not a W3C tracestate (% characters)', length(p_value)
    USING ERRCODE = '22023',
          DETAIL = 'A tracestate is at most 512 characters of printable ASCII (key=value members, comma-separated); nothing was written.',
          HINT = 'Set it from your tracer''s current span context, or RESET pgfence.tracestate.';
END
$$;
REVOKE ALL ON FUNCTION pgfence._trace_check(text, text) FROM PUBLIC;
COMMENT ON FUNCTION pgfence._trace_check(text, text) IS
  'Internal: p_value if it is a valid W3C value of the setting p_setting, else raises 22023.
p_setting is pgfence.traceparent (version-traceid-parentid-flags, lowercase hex, 55 characters,
ids not all zero, version not ff) or pgfence.tracestate (at most 512 printable ASCII characters).
Errors: 22023 (malformed traceparent or tracestate).';

-- Inlinable (SQL, no SET clause, no SECURITY DEFINER): a column default without the setting
-- costs one current_setting() per row; the check runs only when the setting is there.
CREATE OR REPLACE FUNCTION pgfence._traceparent()
RETURNS text
LANGUAGE sql STABLE
AS $$
  SELECT CASE WHEN coalesce(current_setting('pgfence.traceparent', true), '') <> ''
              THEN pgfence._trace_check(current_setting('pgfence.traceparent', true), 'pgfence.traceparent') END
$$;
REVOKE ALL ON FUNCTION pgfence._traceparent() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._traceparent() IS
  'Internal: the transaction''s setting pgfence.traceparent, validated; NULL when unset or empty.
The default of the traceparent columns of outbox, plan and operation.
Errors: 22023 (malformed traceparent).';

CREATE OR REPLACE FUNCTION pgfence._tracestate()
RETURNS text
LANGUAGE sql STABLE
AS $$
  SELECT CASE WHEN coalesce(current_setting('pgfence.traceparent', true), '') <> ''
               AND coalesce(current_setting('pgfence.tracestate', true), '') <> ''
              THEN pgfence._trace_check(current_setting('pgfence.tracestate', true), 'pgfence.tracestate') END
$$;
REVOKE ALL ON FUNCTION pgfence._tracestate() FROM PUBLIC;
COMMENT ON FUNCTION pgfence._tracestate() IS
  'Internal: the transaction''s setting pgfence.tracestate, validated; NULL when unset or empty.
Kept only together with a traceparent (a tracestate alone means nothing). The default of the
tracestate columns of outbox, plan and operation.
Errors: 22023 (malformed tracestate).';

-- The trace context is part of what was committed with the item: never updated (PF002). The
-- triggers are named <table>_frozen_trace: they fire before <table>_guard (alphabetical order).
CREATE OR REPLACE FUNCTION pgfence.tg_trace_frozen()
RETURNS trigger
LANGUAGE plpgsql
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  RAISE EXCEPTION '% %: its trace context (traceparent, tracestate) is never updated', TG_TABLE_NAME, OLD.id
    USING ERRCODE = 'PF002',
          DETAIL = 'The trace context is the one of the transaction that created the row.',
          HINT = 'Set pgfence.traceparent in the transaction that enqueues (proposes, requests) instead.';
END
$$;
REVOKE ALL ON FUNCTION pgfence.tg_trace_frozen() FROM PUBLIC;
COMMENT ON FUNCTION pgfence.tg_trace_frozen() IS
  'Trigger: refuses any write of the traceparent or tracestate of a message, plan or operation (PF002).
BEFORE UPDATE OF traceparent, tracestate on pgfence.outbox, pgfence.plan and pgfence.operation:
a column trigger, nothing for statements that do not name them.';

-- The column defaults and the frozen-trace triggers, per table (the columns come from migration
-- 0019; guarded, so that these files also apply to a schema of an earlier migration). SET
-- DEFAULT rewrites nothing: it applies to rows inserted from now on.
DO $trace$
DECLARE
  v_table text;
BEGIN
  FOREACH v_table IN ARRAY ARRAY['outbox', 'plan', 'operation'] LOOP
    IF EXISTS (SELECT FROM pg_attribute
               WHERE attrelid = format('pgfence.%I', v_table)::regclass AND attname = 'traceparent'
                 AND NOT attisdropped) THEN
      EXECUTE format('ALTER TABLE pgfence.%I ALTER COLUMN traceparent SET DEFAULT pgfence._traceparent(),'
                     ' ALTER COLUMN tracestate SET DEFAULT pgfence._tracestate()', v_table);
      EXECUTE format('CREATE OR REPLACE TRIGGER %I BEFORE UPDATE OF traceparent, tracestate ON pgfence.%I'
                     ' FOR EACH ROW EXECUTE FUNCTION pgfence.tg_trace_frozen()', v_table || '_frozen_trace', v_table);
    END IF;
  END LOOP;
END
$trace$;

CREATE OR REPLACE FUNCTION pgfence.trace_contexts(p_module text, p_ids bigint[])
RETURNS TABLE (id bigint, traceparent text, tracestate text)
LANGUAGE plpgsql STABLE SECURITY DEFINER
SET search_path = pg_catalog, pgfence, pg_temp
AS $$
BEGIN
  IF p_module IS NULL OR p_ids IS NULL THEN
    RAISE EXCEPTION 'trace_contexts: module and ids are required'
      USING ERRCODE = '22004', DETAIL = format('module %s, ids %s', coalesce(p_module, 'NULL'),
                                              CASE WHEN p_ids IS NULL THEN 'NULL' ELSE 'given' END),
            HINT = 'Pass the module (outbox, plan or operation) and an array of the ids just claimed.';
  END IF;
  IF cardinality(p_ids) > 10000 THEN
    RAISE EXCEPTION 'trace_contexts: at most 10000 ids per call, got %', cardinality(p_ids)
      USING ERRCODE = '22023', DETAIL = 'A claimed batch is at most 10000 items.',
            HINT = 'Ask for one claimed batch at a time.';
  END IF;
  IF p_module = 'outbox' THEN
    RETURN QUERY SELECT o.id, o.traceparent, o.tracestate FROM pgfence.outbox o
                 WHERE o.id = ANY (p_ids) AND o.traceparent IS NOT NULL;
  ELSIF p_module = 'plan' THEN
    RETURN QUERY SELECT p.id, p.traceparent, p.tracestate FROM pgfence.plan p
                 WHERE p.id = ANY (p_ids) AND p.traceparent IS NOT NULL;
  ELSIF p_module = 'operation' THEN
    RETURN QUERY SELECT o.id, o.traceparent, o.tracestate FROM pgfence.operation o
                 WHERE o.id = ANY (p_ids) AND o.traceparent IS NOT NULL;
  ELSE
    RAISE EXCEPTION 'trace_contexts: unknown module "%"', p_module
      USING ERRCODE = '22023', DETAIL = 'The modules with a trace context are outbox, plan and operation.',
            HINT = 'Pass outbox, plan or operation.';
  END IF;
END
$$;
REVOKE ALL ON FUNCTION pgfence.trace_contexts(text, bigint[]) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION pgfence.trace_contexts(text, bigint[]) TO pgfence_executor, pgfence_admin;
COMMENT ON FUNCTION pgfence.trace_contexts(text, bigint[]) IS
  'The W3C trace contexts (traceparent, tracestate) of these outbox messages, plans or operations.
What an executor with tracing on reads once per claimed batch, to make each delivery span a
child of the enqueuer''s span; items without a trace context (and unknown ids) are left out.
p_module: outbox, plan or operation; p_ids: at most 10000.
Errors: 22004 (module or ids NULL), 22023 (unknown module, more than 10000 ids).';
