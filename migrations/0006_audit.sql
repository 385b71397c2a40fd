-- pgfence 0006 — audit: the outbox reaper's receipt of every lease it took back.
-- depends: 0005_document
--
-- The audit views and functions (functions/90_audit.sql) must say which outbox messages may
-- have been delivered twice: those claimed under an attempt whose lease lapsed and was taken
-- back by the reaper (the worker may still have delivered it). The message row alone cannot
-- tell: outbox_mark_sent clears last_error, and attempts also grow on ordinary retryable
-- failures. The event log can, but only for channels that log events. So the reaper writes one
-- row here per lease it takes back, in the same statement batch as the reclaim. This table is
-- written only by outbox_reclaim_stale, never on the claim / mark hot path; it has no foreign
-- key to pgfence.outbox (a foreign key would add work to every outbox update); the purge
-- deletes its rows together with the message.

CREATE TABLE pgfence.outbox_lapse (
  message_id       bigint NOT NULL,
  attempt          integer NOT NULL CHECK (attempt >= 1),
  worker           text NOT NULL,
  claimed_at       timestamptz,
  lease_expires_at timestamptz NOT NULL,
  reclaimed_at     timestamptz NOT NULL DEFAULT now(),
  outcome          text NOT NULL CHECK (outcome IN ('pending', 'dead')),
  PRIMARY KEY (message_id, attempt)
);
COMMENT ON TABLE pgfence.outbox_lapse IS
  'One row per outbox claim whose lease lapsed and was taken back by the reaper (outbox_reclaim_stale): the message, the attempt (fence token) that lost its lease, the worker that held it, when it was claimed, when the lease ran out and when it was reclaimed, and what the message became (pending for a retry, or dead). The worker may have delivered the message before it died or stalled, so each row is a possible duplicate delivery. Written in the reaper''s transaction, whatever the channel''s log_events setting. Not an API: read pgfence.audit_duplicates and pgfence.audit_timeline().';
COMMENT ON COLUMN pgfence.outbox_lapse.attempt IS
  'The attempt number (fence token) whose lease lapsed; the next claim of the message uses attempt + 1, so a late outbox_mark_sent under this attempt is refused.';
CREATE INDEX outbox_lapse_reclaimed_idx ON pgfence.outbox_lapse (reclaimed_at);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 6);
