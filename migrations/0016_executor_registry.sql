-- pgfence 0016 — schema version 16: the executor registry.
-- depends: 0013_reaper_names
--
-- Each executor registers at start (pgfence.executor_register), heartbeats on its reaper timer
-- (executor_heartbeat) and deregisters at shutdown (executor_deregister); one row per worker
-- name. pgfence.audit_executors lists them with liveness, audit_queue_health flags the queues
-- that have due work and no live executor serving them, and a plan run released to executors
-- waits (instead of failing as interrupted) while no live executor serves plans. Functions:
-- functions/50_executor.sql.

CREATE TABLE pgfence.executor (
  worker             text PRIMARY KEY CHECK (worker <> '' AND length(worker) <= 200),
  host               text NOT NULL,
  pid                integer NOT NULL,
  version            text NOT NULL,
  -- module -> the queues it serves: outbox channels, operation kinds, plans ("*" = every one;
  -- plans: "*" or "external" for an executor that runs external steps only)
  serves             jsonb NOT NULL CHECK (jsonb_typeof(serves) = 'object'),
  concurrency        integer NOT NULL CHECK (concurrency > 0),
  heartbeat_interval interval NOT NULL CHECK (heartbeat_interval > interval '0'),
  started_at         timestamptz NOT NULL DEFAULT now(),
  last_seen_at       timestamptz NOT NULL DEFAULT now(),
  expires_at         timestamptz NOT NULL,
  stopped_at         timestamptz
);
COMMENT ON TABLE pgfence.executor IS
  'The executor registry: one row per executor worker name.
Written by executor_register, executor_heartbeat and executor_deregister; read it through pgfence.audit_executors.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 16);
