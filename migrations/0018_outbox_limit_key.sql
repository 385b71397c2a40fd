-- pgfence 0018 — outbox: a default limit key per channel (schema version 18).
-- depends: 0017_outbox_keys
--
-- outbox_channel.limit_key: NULL (the default) limits only messages enqueued with an explicit
-- ordering key; 'host' also gives every message enqueued without one the key 'host:<host of
-- its recipient URL>' (functions/16_outbox_keys.sql), so key_max_in_flight and the key's token
-- bucket (key_rate, key_burst) apply per recipient host. Such a derived key limits, it does not
-- block: a failed or dead message never holds it (as key_dead_policy release). A recipient
-- without a host gets no key. outbox_configure_channel gets a last parameter p_limit_key: the
-- old signature is dropped here (functions/ re-creates it with the new one).

ALTER TABLE pgfence.outbox_channel
  ADD COLUMN limit_key text CHECK (limit_key IN ('host'));
COMMENT ON COLUMN pgfence.outbox_channel.limit_key IS
  'NULL: only explicit ordering keys are limited. host: a message enqueued without an ordering key gets the key host:<its recipient URL''s host>, limited by key_max_in_flight and key_rate per host, never blocked by a failed or dead message.';

DROP FUNCTION IF EXISTS pgfence.outbox_configure_channel(text, integer, interval, interval, interval, boolean, integer, integer, double precision, integer, text);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 18);
