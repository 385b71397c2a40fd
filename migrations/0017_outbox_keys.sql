-- pgfence 0017 — outbox: ordering keys, per-key limits, cancel, payload bound (schema version 17).
-- depends: 0013_reaper_names
--
-- outbox.ordering_key: messages of one (channel, ordering_key) are delivered in enqueue order, at
-- most key_max_in_flight of them at once (1 by default: one after the other). A keyed message
-- waits in the new status 'waiting' until it is the key's next one; the promotion to 'pending' is
-- decided under a lock of the key's row in outbox_key (functions/16_outbox_keys.sql), so the
-- keyless claim walk (outbox_due_idx: status 'pending') is not changed at all.
-- outbox.status 'canceled': a terminal status set by outbox_cancel.
-- outbox_channel: max_payload_bytes (1 MiB by default), key_max_in_flight, key_rate (deliveries
-- per second per key, NULL = unlimited), key_burst, key_dead_policy (block | release).
-- The enqueue functions get a last parameter p_ordering_key: the old signatures are dropped here
-- (functions/ re-creates them with the new one; an old overload would make calls ambiguous).

ALTER TABLE pgfence.outbox DROP CONSTRAINT outbox_status_check;
ALTER TABLE pgfence.outbox ADD CONSTRAINT outbox_status_check
  CHECK (status IN ('waiting', 'pending', 'processing', 'sent', 'failed', 'dead', 'canceled'));
ALTER TABLE pgfence.outbox ADD COLUMN ordering_key text;
COMMENT ON COLUMN pgfence.outbox.ordering_key IS
  'Optional: messages of one channel and ordering key are claimed in enqueue order, at most the channel''s key_max_in_flight at once (one by default). NULL: no order.';
-- The key's messages that are not finished, in enqueue order: what the promotion reads.
CREATE INDEX outbox_key_idx ON pgfence.outbox (channel, ordering_key, id)
  WHERE ordering_key IS NOT NULL AND status <> 'sent' AND status <> 'canceled';

ALTER TABLE pgfence.outbox_channel
  ADD COLUMN max_payload_bytes integer NOT NULL DEFAULT 1048576
    CHECK (max_payload_bytes BETWEEN 1 AND 268435455),
  ADD COLUMN key_max_in_flight integer NOT NULL DEFAULT 1 CHECK (key_max_in_flight BETWEEN 1 AND 10000),
  ADD COLUMN key_rate double precision CHECK (key_rate > 0 AND key_rate <= 1000000),
  ADD COLUMN key_burst integer NOT NULL DEFAULT 1 CHECK (key_burst BETWEEN 1 AND 10000),
  ADD COLUMN key_dead_policy text NOT NULL DEFAULT 'block' CHECK (key_dead_policy IN ('block', 'release'));

-- One row per (channel, ordering key) with unfinished messages: the lock that orders the
-- promotion decisions of the key, and its token bucket (GCRA: the theoretical arrival time).
CREATE TABLE pgfence.outbox_key (
  channel      text NOT NULL,
  ordering_key text NOT NULL,
  tat          timestamptz,
  decisions    bigint NOT NULL DEFAULT 0,
  updated_at   timestamptz NOT NULL DEFAULT now(),
  PRIMARY KEY (channel, ordering_key)
);

DROP FUNCTION IF EXISTS pgfence.outbox_enqueue(text, text, jsonb, text, timestamptz, integer);
DROP FUNCTION IF EXISTS pgfence.outbox_enqueue_many(text, text[], jsonb[], text[], timestamptz, integer);
DROP FUNCTION IF EXISTS pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean);
DROP FUNCTION IF EXISTS pgfence.outbox_get(bigint);  -- returns ordering_key too

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 17);
