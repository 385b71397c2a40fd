-- pgfence 0015 — outbox: the claim floor, a lower bound on every pending message's due time.
-- depends: 0013_reaper_names
--
-- Every claim moves a message out of the partial due indexes (status = 'pending'), and the old
-- version's entry stays at the front of the index until VACUUM removes it; while any snapshot
-- older than those versions is open (a report, pg_dump, a forgotten BEGIN), nothing can, and a
-- claim that walks the index from its front steps over every message sent since (issue 14).
-- The claims start their walk at a floor instead: a due time no pending message is below
-- (functions/16_outbox_floor.sql keeps it, and says why it holds). Sequences, not a table,
-- because they are not transactional: every session reads their latest value, whatever its
-- snapshot, and a setval is seen at once. Values are microseconds since 2000-01-01 UTC (the
-- server's own epoch), the minimum meaning "no floor" (-infinity).

CREATE SEQUENCE pgfence.outbox_floor_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_seq IS
  'The outbox claim floor (microseconds since 2000-01-01 UTC; the minimum = none): no pending message is due before it. Kept by functions/16_outbox_floor.sql; not an API.';
CREATE SEQUENCE pgfence.outbox_floor_guard_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_guard_seq IS
  'The highest value the outbox claim floor may be raised to next: a writer of a pending message due before it lowers it (and the floor). Not an API.';
CREATE SEQUENCE pgfence.outbox_floor_arm_seq AS bigint
  MINVALUE 0 START WITH 0 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_arm_seq IS
  'Whether a guard of the outbox claim floor is published and waits to be raised to (1) or not (0). Not an API.';
CREATE SEQUENCE pgfence.outbox_floor_armed_at_seq AS bigint
  MINVALUE -9223372036854775808 START WITH -9223372036854775808 NO CYCLE;
COMMENT ON SEQUENCE pgfence.outbox_floor_armed_at_seq IS
  'When the outbox claim floor''s guard was last published (microseconds since 2000-01-01 UTC): the floor moves at most every 50 ms. Not an API.';

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 15);
