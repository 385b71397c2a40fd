-- pgfence 0019 — schema version 19: the W3C trace context of an outbox message, plan, operation.
-- depends: 0017_outbox_keys
--
-- outbox.traceparent / tracestate (and the same columns of plan and operation): the trace
-- context of the transaction that created the row, when its caller set the transaction setting
-- pgfence.traceparent (and optionally pgfence.tracestate); NULL otherwise. The column defaults
-- that read and validate the settings, and pgfence.trace_contexts (what an executor with
-- tracing on reads per claimed batch), are in functions/05_trace_context.sql: the defaults are
-- set there, after their functions exist. Nullable columns without a default here: adding them
-- rewrites no table.

ALTER TABLE pgfence.outbox ADD COLUMN traceparent text, ADD COLUMN tracestate text;
ALTER TABLE pgfence.plan ADD COLUMN traceparent text, ADD COLUMN tracestate text;
ALTER TABLE pgfence.operation ADD COLUMN traceparent text, ADD COLUMN tracestate text;

COMMENT ON COLUMN pgfence.outbox.traceparent IS
  'W3C traceparent of the enqueuing transaction (its setting pgfence.traceparent), NULL if none: the executor''s delivery span is its child.';
COMMENT ON COLUMN pgfence.outbox.tracestate IS
  'W3C tracestate of the enqueuing transaction (setting pgfence.tracestate), kept only with a traceparent; NULL if none.';
COMMENT ON COLUMN pgfence.plan.traceparent IS
  'W3C traceparent of the proposing transaction (its setting pgfence.traceparent), NULL if none: the executor''s run and step spans are its children.';
COMMENT ON COLUMN pgfence.plan.tracestate IS
  'W3C tracestate of the proposing transaction (setting pgfence.tracestate), kept only with a traceparent; NULL if none.';
COMMENT ON COLUMN pgfence.operation.traceparent IS
  'W3C traceparent of the requesting transaction (its setting pgfence.traceparent), NULL if none: the executor''s issue and poll spans are its children.';
COMMENT ON COLUMN pgfence.operation.tracestate IS
  'W3C tracestate of the requesting transaction (setting pgfence.tracestate), kept only with a traceparent; NULL if none.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 19);
