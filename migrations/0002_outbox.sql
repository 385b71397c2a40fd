-- pgfence 0002 — outbox: messages to deliver at least once, and per-channel retry settings.
-- depends: 0001_core

CREATE TABLE pgfence.outbox_channel (
  channel      text PRIMARY KEY
               CHECK (channel = '*' OR channel ~ '^[a-z0-9][a-z0-9_.-]{0,62}$'),
  max_attempts integer  NOT NULL CHECK (max_attempts BETWEEN 1 AND 1000),
  backoff_base interval NOT NULL CHECK (backoff_base > interval '0'),
  backoff_cap  interval NOT NULL,
  lease        interval NOT NULL CHECK (lease > interval '0' AND lease <= interval '1 day'),
  log_events   boolean NOT NULL DEFAULT false,
  updated_at   timestamptz NOT NULL DEFAULT now(),
  CONSTRAINT outbox_channel_cap_ge_base CHECK (backoff_cap >= backoff_base),
  -- bounded so that now() + lease / backoff can never overflow a timestamp
  CONSTRAINT outbox_channel_cap_bounded CHECK (backoff_cap <= interval '30 days')
);
COMMENT ON COLUMN pgfence.outbox_channel.log_events IS
  'Write every transition of this channel''s messages to pgfence.event (off by default: outbox volume is high; the message row keeps attempts, owner, times and last error either way).';
COMMENT ON TABLE pgfence.outbox_channel IS
  'Retry settings per outbox channel; the row ''*'' holds the defaults for channels without a row. Change with pgfence.outbox_configure_channel().';
INSERT INTO pgfence.outbox_channel (channel, max_attempts, backoff_base, backoff_cap, lease, log_events)
VALUES ('*', 10, interval '1 second', interval '1 hour', interval '5 minutes', false);

CREATE TABLE pgfence.outbox (
  id               bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  -- channel, recipient, payload and key are validated by the enqueue functions (22023) and
  -- frozen by trigger outbox_frozen. The invariants between columns (lease iff processing,
  -- finished iff terminal, attempts <= max_attempts, the fence never decreasing) are checked by
  -- trigger outbox_guard together with the transition table: PostgreSQL re-evaluates every
  -- CHECK constraint on every UPDATE, and a claim or a mark is one UPDATE on the hot path.
  channel          text NOT NULL,
  recipient        text NOT NULL,
  payload          jsonb NOT NULL,
  idempotency_key  text,
  status           text NOT NULL DEFAULT 'pending'
                   CHECK (status IN ('pending', 'processing', 'sent', 'failed', 'dead')),
  attempts         integer NOT NULL DEFAULT 0,
  max_attempts     integer NOT NULL,
  next_attempt_at  timestamptz NOT NULL DEFAULT now(),
  locked_by        text,
  claimed_at       timestamptz,
  lease_expires_at timestamptz,
  last_error       text,
  receipt          jsonb,
  log_events       boolean NOT NULL DEFAULT false,
  created_at       timestamptz NOT NULL DEFAULT now(),
  updated_at       timestamptz NOT NULL DEFAULT now(),
  finished_at      timestamptz
);
COMMENT ON TABLE pgfence.outbox IS
  'Transactional outbox: one row per message. Status machine pending -> processing -> sent | failed | dead; a retry is pending again with attempts > 0. attempts is the fence token. Not an API: use the pgfence.outbox_* functions.';
COMMENT ON COLUMN pgfence.outbox.attempts IS
  'Claims made so far; bumped at claim, so it is also the fence token the claimer must present to mark the message. Never decreases.';
COMMENT ON COLUMN pgfence.outbox.next_attempt_at IS
  'When the message is due (database clock). Set by enqueue (deliver_at), by backoff after a retryable failure or a lapsed lease, and by requeue.';
COMMENT ON COLUMN pgfence.outbox.lease_expires_at IS
  'While processing: the claim is owned by locked_by until this time (database clock); after it, outbox_reclaim_stale may take it back.';
COMMENT ON COLUMN pgfence.outbox.log_events IS
  'Copied from the channel''s setting at enqueue (and refreshed by outbox_configure_channel and outbox_requeue): this message''s transitions go to pgfence.event.';
COMMENT ON COLUMN pgfence.outbox.receipt IS
  'What the transport reported on success (for a webhook: HTTP status and response id), written by outbox_mark_sent.';

-- Partial: most messages have no key, and every claim and mark writes a new row version (the
-- status is indexed), so a full index would take an entry for NULL on every one of them.
CREATE UNIQUE INDEX outbox_idempotency_key_idx ON pgfence.outbox (idempotency_key)
  WHERE idempotency_key IS NOT NULL;
CREATE INDEX outbox_due_idx ON pgfence.outbox (next_attempt_at, id) WHERE status = 'pending';
-- Claims restricted to some channels walk this one per channel, in due order.
CREATE INDEX outbox_channel_due_idx ON pgfence.outbox (channel, next_attempt_at, id) WHERE status = 'pending';
CREATE INDEX outbox_lease_idx ON pgfence.outbox (lease_expires_at) WHERE status = 'processing';

UPDATE pgfence.meta SET schema_version = 2;
