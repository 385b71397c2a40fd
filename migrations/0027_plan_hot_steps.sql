-- pgfence 0027 — plans: room on the page for a step's updates, so that they stay HOT.
-- depends: 0024_document_save_one_statement
--
-- Issue 14: every SQL step updates its plan_step row (the receipt) and its plan row (next step,
-- heartbeat). Neither update changes an indexed column any more (a step keeps the plan's
-- heartbeat_expires_at while it lies within the slack: functions/24_plan_steps.sql,
-- _plan_commit_step), so PostgreSQL can write the new row version on the same page without
-- new index entries (a HOT update) — if the page has room. plan_step rows are written with their
-- proposal, packed full at fillfactor 100, and each receipt then made the row move to another
-- page and inserted a new entry into plan_step_pkey. Leave room: a receipt adds its output,
-- worker and times to a row. Applies to pages written from now on (existing plans keep theirs).
ALTER TABLE pgfence.plan_step SET (fillfactor = 70);
ALTER TABLE pgfence.plan SET (fillfactor = 90);

UPDATE pgfence.meta SET schema_version = greatest(schema_version, 27);
