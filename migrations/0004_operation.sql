-- pgfence 0004 — operation: long external operations (reset a branch, provision, export),
-- at most one in flight per (kind, target), issued once and then only polled.
-- depends: 0002_outbox

CREATE TABLE pgfence.operation (
  id                   bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  kind                 text NOT NULL CHECK (kind ~ '^[a-z0-9][a-z0-9_.-]{0,62}$'),
  target               text NOT NULL CHECK (target <> '' AND length(target) <= 1024),
  params               jsonb NOT NULL CHECK (jsonb_typeof(params) = 'object'),
  idempotency_key      text UNIQUE CHECK (idempotency_key <> '' AND length(idempotency_key) <= 255),
  requested_by         text NOT NULL CHECK (requested_by <> ''),
  status               text NOT NULL DEFAULT 'queued'
                       CHECK (status IN ('queued', 'running', 'succeeded', 'failed', 'canceled')),
  fence                integer NOT NULL DEFAULT 0 CHECK (fence >= 0),
  locked_by            text,
  claimed_at           timestamptz,
  lease                interval CHECK (lease > interval '0'),
  lease_expires_at     timestamptz,
  issue_started_at     timestamptz,
  issued_by            text,
  issue_count          integer NOT NULL DEFAULT 0 CHECK (issue_count >= 0),
  last_issue_at        timestamptz,
  issue_idempotent     boolean,
  external_ref         text CHECK (external_ref <> '' AND length(external_ref) <= 1024),
  external_recorded_at timestamptz,
  external_detail      jsonb,
  external_state       jsonb,
  polled_at            timestamptz,
  poll_count           integer NOT NULL DEFAULT 0 CHECK (poll_count >= 0),
  poll_history         jsonb NOT NULL DEFAULT '[]'
                       CHECK (jsonb_typeof(poll_history) = 'array' AND jsonb_array_length(poll_history) <= 50),
  cancel_requested_at  timestamptz,
  cancel_requested_by  text,
  result               jsonb,
  error                text,
  created_at           timestamptz NOT NULL DEFAULT now(),
  updated_at           timestamptz NOT NULL DEFAULT now(),
  started_at           timestamptz,
  finished_at          timestamptz,
  CONSTRAINT operation_lease_iff_running
    CHECK ((status = 'running') = (lease_expires_at IS NOT NULL) AND (status <> 'running' OR locked_by IS NOT NULL)),
  CONSTRAINT operation_finished_iff_terminal
    CHECK ((status IN ('succeeded', 'failed', 'canceled')) = (finished_at IS NOT NULL)),
  CONSTRAINT operation_intent_complete
    CHECK ((issue_started_at IS NULL) = (issue_count = 0)
           AND (issue_started_at IS NULL) = (issued_by IS NULL)
           AND (issue_started_at IS NULL) = (issue_idempotent IS NULL)
           AND (issue_started_at IS NULL) = (last_issue_at IS NULL)),
  CONSTRAINT operation_intent_not_queued CHECK (issue_started_at IS NULL OR status <> 'queued'),
  CONSTRAINT operation_ref_after_intent CHECK (external_ref IS NULL OR issue_started_at IS NOT NULL),
  CONSTRAINT operation_ref_recorded CHECK ((external_ref IS NULL) = (external_recorded_at IS NULL)
                                          AND (external_ref IS NOT NULL OR external_detail IS NULL)),
  CONSTRAINT operation_succeeded_was_issued CHECK (status <> 'succeeded' OR external_ref IS NOT NULL),
  CONSTRAINT operation_cancel_by CHECK ((cancel_requested_at IS NULL) = (cancel_requested_by IS NULL))
);
COMMENT ON TABLE pgfence.operation IS
  'Long external operations (e.g. reset a database branch): one row per requested operation. Status machine queued -> running -> succeeded | failed | canceled (queued -> canceled; running -> queued only by the reaper, when no external call was started). At most one queued/running operation per (kind, target). fence is the owner''s token. The external call is recorded as an intent (issue_*) before it is made and by its reference (external_ref) right after; a new owner that finds a reference only polls it. Not an API: use the pgfence.operation_* functions.';
COMMENT ON COLUMN pgfence.operation.idempotency_key IS
  'The request''s identity: a repeated request with this key returns this operation. It is also the key a handler passes to the external API (pgfence-operation-<id> when NULL), so a re-issue after a crash is recognised by the remote side.';
COMMENT ON COLUMN pgfence.operation.fence IS
  'Fence token: bumped by every claim (including a takeover after a lapsed lease) and never decreases. Every owner write (begin_issue, record_external, poll, finish, release) must present it.';
COMMENT ON COLUMN pgfence.operation.lease_expires_at IS
  'While running: owned by locked_by until this time (database clock). Extended by every poll. After it, operation_claim may hand the operation to a new owner.';
COMMENT ON COLUMN pgfence.operation.issue_started_at IS
  'Intent: when an owner first declared it was about to call the external API (operation_begin_issue). Set before the call; never cleared. Intent without external_ref = the outcome of that call is unknown.';
COMMENT ON COLUMN pgfence.operation.issue_idempotent IS
  'Whether the first issuing owner''s transport passed the idempotency key to the external API. A re-issue is allowed only if this and the re-issuing transport both do.';
COMMENT ON COLUMN pgfence.operation.issue_count IS
  'How many times the external call was issued (1 = once; more only by re-issues with an idempotency key).';
COMMENT ON COLUMN pgfence.operation.external_ref IS
  'The external API''s reference for the started operation (its id), recorded right after the call. Frozen once set; from then on owners only poll it.';
COMMENT ON COLUMN pgfence.operation.external_detail IS
  'What the external API answered when the operation was started (recorded with external_ref).';
COMMENT ON COLUMN pgfence.operation.locked_by IS
  'The owner while running; after the end, the last owner (NULL while queued).';
COMMENT ON COLUMN pgfence.operation.external_state IS
  'The external status last reported by operation_poll (JSON as the handler saw it).';
COMMENT ON COLUMN pgfence.operation.poll_history IS
  'Bounded history of polled external states (the last 50 distinct ones, oldest first): {"state", "first_at", "last_at", "polls", "fence"}; consecutive identical states share one entry.';
COMMENT ON COLUMN pgfence.operation.cancel_requested_at IS
  'A cancel request for a running operation whose external call was started; the owner learns it from operation_poll and ends the operation as canceled.';
COMMENT ON COLUMN pgfence.operation.result IS
  'What the owner reported at the end (operation_finish detail), or the reason a pgfence function ended it ({"reason": "outcome_unknown", ...}).';

-- One operation in flight per (kind, target): the rule that makes a second reset of the same
-- branch wait for (or be refused by) the first one.
CREATE UNIQUE INDEX operation_one_in_flight ON pgfence.operation (kind, target)
  WHERE status IN ('queued', 'running');
COMMENT ON INDEX pgfence.operation_one_in_flight IS
  'At most one queued or running operation per (kind, target); operation_request turns a violation into PF201 naming the operation in flight.';
CREATE INDEX operation_queued_idx ON pgfence.operation (id) WHERE status = 'queued';
CREATE INDEX operation_lease_idx ON pgfence.operation (lease_expires_at) WHERE status = 'running';
CREATE INDEX operation_target_idx ON pgfence.operation (kind, target, id);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 4);
