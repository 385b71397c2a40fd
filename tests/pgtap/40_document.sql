-- pgTAP: Module 4 — documents. The compare-and-swap save and its outcomes, the lost-response
-- retry, versions after delete, revisions, the kinds' merges, the guards, and every documented
-- SQLSTATE. Cells that need two sessions at once are in 41_document_concurrency.sql.
BEGIN;
\ir helpers/setup.sql
SELECT plan(247);

-- =============================================================================================
-- Catalog: signatures, definer, volatility, privileges
-- =============================================================================================
CREATE TEMP TABLE fns (name text, args text[], definer boolean, vol text, client boolean, admin boolean);
INSERT INTO fns VALUES
  ('document_register_kind', ARRAY['text','text','regprocedure','text','integer','text','boolean'], true, 'volatile', false, true),
  ('document_create',        ARRAY['text','jsonb','text','text'],                       true, 'volatile', true,  true),
  ('document_get',           ARRAY['bigint'],                                           true, 'stable',   true,  true),
  ('document_revision',      ARRAY['bigint','bigint'],                                  true, 'stable',   true,  true),
  ('document_history',       ARRAY['bigint','integer','bigint'],                        true, 'stable',   true,  true),
  ('document_save',          ARRAY['bigint','bigint','jsonb','text','text'],            true, 'volatile', true,  true),
  ('document_delete',        ARRAY['bigint','bigint','text'],                           true, 'volatile', true,  true),
  ('document_merge',         ARRAY['text','jsonb','jsonb','jsonb'],                     false, 'stable',  true,  true);

SELECT has_function('pgfence', name, args, name || ' signature') FROM fns ORDER BY name;
SELECT CASE WHEN definer THEN is_definer('pgfence', name, args, name || ' is SECURITY DEFINER')
            ELSE isnt_definer('pgfence', name, args, name || ' is SECURITY INVOKER (an application merge function runs with the caller''s privileges)') END
FROM fns ORDER BY name;
SELECT volatility_is('pgfence', name, args, vol, name || ' is ' || vol) FROM fns ORDER BY name;
SELECT function_privs_are('pgfence', name, args, 'pgfence_client', CASE WHEN client THEN ARRAY['EXECUTE'] ELSE ARRAY[]::text[] END,
                          name || ': pgfence_client ' || CASE WHEN client THEN 'may' ELSE 'may not' END || ' execute')
FROM fns ORDER BY name;
SELECT function_privs_are('pgfence', name, args, 'pgfence_executor', ARRAY[]::text[], name || ': pgfence_executor may not execute')
FROM fns ORDER BY name;
SELECT function_privs_are('pgfence', name, args, 'pgfence_admin', ARRAY['EXECUTE'], name || ': pgfence_admin may execute')
FROM fns ORDER BY name;
SELECT ok(bool_and(p.proconfig @> ARRAY['search_path=pg_catalog, pgfence, pg_temp']), 'every document function pins search_path')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname LIKE '%document%';
SELECT has_view('pgfence', 'document_kinds', 'document_kinds view');
SELECT table_privs_are('pgfence', 'document_kinds', 'pgfence_client', ARRAY['SELECT'], 'client reads document_kinds');
SELECT table_privs_are('pgfence', 'document', 'pgfence_client', ARRAY[]::text[], 'client has no privilege on the document table');
SELECT table_privs_are('pgfence', 'document_revision', 'pgfence_admin', ARRAY[]::text[], 'admin has no privilege on the revision table');
SELECT has_trigger('pgfence', 'document', 'document_write', 'guard + revision trigger on document');
SELECT has_trigger('pgfence', 'document', 'document_created', 'revision-1 trigger on document');
SELECT is((SELECT count(*)::int FROM pg_trigger WHERE tgrelid = 'pgfence.document'::regclass AND NOT tgisinternal AND tgtype & 16 <> 0), 1,
  'one trigger fires on a save (the hot path)');
SELECT has_trigger('pgfence', 'document_revision', 'document_revision_guard', 'guard trigger on document_revision');
SELECT results_eq($$SELECT kind, merge, content_type, max_bytes, builtin FROM pgfence.document_kinds WHERE builtin ORDER BY kind$$,
  $$VALUES ('record'::text, 'attributes'::text, 'object'::text, 1048576, true), ('sheet', 'none', 'any', 1048576, true)$$,
  'built-in kinds: record merges by attribute, sheet never merges; 1 MiB limit');

-- Role behaviour, not just catalog flags.
SET LOCAL ROLE pgfence_client;
SELECT lives_ok($$SELECT pgfence.document_create('record', '{"role": 1}', 'tap-client')$$, 'as pgfence_client: create works (SECURITY DEFINER)');
SELECT throws_ok($$SELECT count(*) FROM pgfence.document$$, '42501', NULL, 'as pgfence_client: the document table is not readable');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-k', 'none')$$, '42501', NULL, 'as pgfence_client: registering a kind is refused');
RESET ROLE;
SET LOCAL ROLE pgfence_executor;
SELECT throws_ok($$SELECT * FROM pgfence.document_save(1, 1, '{}', 'x')$$, '42501', NULL, 'as pgfence_executor: saving is refused');
RESET ROLE;

-- =============================================================================================
-- Create and read
-- =============================================================================================
CREATE TEMP TABLE ids (name text PRIMARY KEY, id bigint);
INSERT INTO ids SELECT 'd', pgfence.document_create('record', '{"title": "draft", "owner": "ann"}', 'ann');
SELECT results_eq(
  $$SELECT kind, version, content, deleted, created_by, saved_by, created_at = now(), saved_at = now() FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))$$,
  $$VALUES ('record'::text, 1::bigint, '{"title": "draft", "owner": "ann"}'::jsonb, false, 'ann'::text, 'ann'::text, true, true)$$,
  'create: version 1, content, creator, stamped from the database clock');
SELECT results_eq(
  $$SELECT version, op, content, save_id FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'd'), 1)$$,
  $$VALUES (1::bigint, 'create'::text, '{"title": "draft", "owner": "ann"}'::jsonb, NULL::text)$$,
  'create writes revision 1');

INSERT INTO ids SELECT 'keyed', pgfence.document_create('sheet', '[[1, 2], [3, 4]]', 'ann', 'tap-create-1');
SELECT is(pgfence.document_create('sheet', '[[1, 2], [3, 4]]', 'ann', 'tap-create-1'), (SELECT id FROM ids WHERE name = 'keyed'),
  'a repeated create with the same key, kind and content returns the same id (lost answer retried)');
SELECT is((SELECT count(*)::int FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'keyed'))), 1, '... and creates nothing');
SELECT throws_ok($$SELECT pgfence.document_create('sheet', '[[9]]', 'ann', 'tap-create-1')$$, 'PF003', NULL, 'same create key, other content: PF003');
SELECT throws_ok($$SELECT pgfence.document_create('record', '{}', 'ann', 'tap-create-1')$$, 'PF003', NULL, 'same create key, other kind: PF003');
SELECT throws_ok($$SELECT pgfence.document_create('nosuchkind', '{}', 'ann')$$, 'PF302', NULL, 'create: unknown kind is PF302');
SELECT throws_ok($$SELECT pgfence.document_create(NULL, '{}', 'ann')$$, '22004', NULL, 'create: NULL kind is 22004');
SELECT throws_ok($$SELECT pgfence.document_create('record', NULL, 'ann')$$, '22004', NULL, 'create: NULL content is 22004');
SELECT throws_ok($$SELECT pgfence.document_create('record', '{}', NULL)$$, '22004', NULL, 'create: NULL created_by is 22004');
SELECT throws_ok($$SELECT pgfence.document_create('record', '{}', '')$$, '22023', NULL, 'create: empty created_by is 22023');
SELECT throws_ok($$SELECT pgfence.document_create('record', '[1, 2]', 'ann')$$, '22023', NULL, 'create: a record that is not an object is 22023');
SELECT throws_ok($$SELECT pgfence.document_create('sheet', 'null', 'ann')$$, '22023', NULL, 'create: JSON null content is 22023');
SELECT throws_ok($$SELECT pgfence.document_create('record', '{}', 'ann', '')$$, '22023', NULL, 'create: empty idempotency key is 22023');
SELECT throws_ok($$SELECT pgfence.document_create('record', jsonb_build_object('blob', repeat('x', 1048576)), 'ann')$$, 'PF301', NULL,
  'create: content over the kind''s 1 MiB limit is PF301');
SELECT lives_ok($$SELECT pgfence.document_create('record', jsonb_build_object('blob', repeat('x', 1048576 - 20)), 'ann')$$,
  'create: content just under the limit is accepted');

SELECT throws_ok($$SELECT * FROM pgfence.document_get(-1)$$, 'P0002', NULL, 'get: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.document_get(NULL)$$, '22004', NULL, 'get: NULL id is 22004');

-- =============================================================================================
-- document_save: the one compare-and-swap
-- =============================================================================================
SELECT results_eq(
  $$SELECT outcome, version, content, saved_by, deleted, replayed FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 1, '{"title": "v2", "owner": "ann"}', 'ann', 'tap-save-a')$$,
  $$VALUES ('saved'::text, 2::bigint, NULL::jsonb, 'ann'::text, false, false)$$,
  'save on the current version: saved, version + 1');
SELECT results_eq($$SELECT version, content FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))$$,
  $$VALUES (2::bigint, '{"title": "v2", "owner": "ann"}'::jsonb)$$, '... the document holds the saved content');

SELECT results_eq(
  $$SELECT outcome, version, content, saved_by, deleted, replayed FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 1, '{"title": "bob was here", "owner": "ann"}', 'bob', 'tap-save-b')$$,
  $$VALUES ('conflict'::text, 2::bigint, '{"title": "v2", "owner": "ann"}'::jsonb, 'ann'::text, false, false)$$,
  'save on a stale version: conflict, with the stored version, content and who saved it, in the same answer');
SELECT results_eq($$SELECT version, content FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))$$,
  $$VALUES (2::bigint, '{"title": "v2", "owner": "ann"}'::jsonb)$$, '... the conflict changed nothing (never last-write-wins)');
SELECT is((SELECT count(*)::int FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'))), 2, '... and wrote no revision');
SELECT results_eq(
  $$SELECT event, from_status, to_status, actor, fence, detail FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'd') AND event = 'conflict'$$,
  $$VALUES ('conflict'::text, 'live'::text, 'live'::text, 'bob'::text, 2::bigint, '{"op": "save", "save_id": "tap-save-b", "expected_version": 1}'::jsonb)$$,
  '... but the conflict is in the event log (who, on which version, against which stored version)');

-- lost response: the same save_id again
SELECT results_eq(
  $$SELECT outcome, version, replayed FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 1, '{"title": "v2", "owner": "ann"}', 'ann', 'tap-save-a')$$,
  $$VALUES ('saved'::text, 2::bigint, true)$$,
  'a retry with the same save_id (first answer lost) is answered saved with the same version, not a conflict');
SELECT is((SELECT count(*)::int FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'))), 2, '... and saves nothing twice');
SELECT is((SELECT count(*)::int FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'd') AND event = 'replay'), 1,
  '... the replay is logged');
SELECT results_eq(
  $$SELECT outcome, version FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 2, '{"title": "v3", "owner": "cy"}', 'cy', 'tap-save-c')$$,
  $$VALUES ('saved'::text, 3::bigint)$$, 'another writer saves version 3 on top');
SELECT results_eq(
  $$SELECT outcome, version, replayed FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 1, '{"title": "v2", "owner": "ann"}', 'ann', 'tap-save-a')$$,
  $$VALUES ('saved'::text, 2::bigint, true)$$,
  'a late retry of save tap-save-a still answers saved version 2 (never a false conflict)');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 1, '{"title": "other"}', 'ann', 'tap-save-a')$$,
  'PF003', NULL, 'the same save_id with other content: PF003');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 3, '{"title": "v2", "owner": "ann"}', 'ann', 'tap-save-a')$$,
  'PF003', NULL, 'the same save_id on another base version: PF003');
SELECT results_eq(
  $$SELECT outcome, version FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 3, '{"title": "v4", "owner": "cy"}', 'cy')$$,
  $$VALUES ('saved'::text, 4::bigint)$$, 'a save without save_id is a plain CAS');

-- malformed calls
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), NULL, '{}', 'ann')$$, '22004', NULL,
  'save without an expected version is refused (22004: no unconditional overwrite)');
SELECT is((SELECT version FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))), 4::bigint, '... and wrote nothing');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 0, '{}', 'ann')$$, '22023', NULL, 'save: expected_version 0 is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 99, '{}', 'ann')$$, 'PF303', NULL,
  'save: an expected_version the document never had is PF303');
SELECT throws_ok($$SELECT * FROM pgfence.document_save(-1, 1, '{}', 'ann')$$, 'P0002', NULL, 'save: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.document_save(NULL, 1, '{}', 'ann')$$, '22004', NULL, 'save: NULL id is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, NULL, 'ann')$$, '22004', NULL, 'save: NULL content is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, '{}', NULL)$$, '22004', NULL, 'save: NULL saved_by is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, '{}', repeat('u', 201))$$, '22023', NULL, 'save: saved_by over 200 characters is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, '{}', 'ann', '')$$, '22023', NULL, 'save: empty save_id is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, '"text"', 'ann')$$, '22023', NULL, 'save: a record that is not an object is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, jsonb_build_object('blob', repeat('x', 1048576)), 'ann')$$, 'PF301', NULL,
  'save: content over the size limit is PF301');
SELECT throws_ok($$SELECT * FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 1, jsonb_build_object('blob', repeat('x', 1048576)), 'ann')$$, 'PF301', NULL,
  'save: an oversized save is refused even on a stale version (checked before the CAS)');
SELECT is((SELECT version FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))), 4::bigint, 'no malformed call wrote a version');

-- a rolled-back save leaves no revision and no event
SELECT throws_ok($q$DO $do$ BEGIN
    PERFORM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, '{"title": "rolled back"}', 'ann', 'tap-rb');
    RAISE EXCEPTION 'caller aborts' USING ERRCODE = 'P0001';
  END $do$$q$, 'P0001', NULL, 'a caller''s transaction saves, then aborts');
SELECT results_eq(
  $$SELECT (SELECT version FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))),
           (SELECT count(*) FROM pgfence.event WHERE module = 'document' AND detail ->> 'save_id' = 'tap-rb')$$,
  $$VALUES (4::bigint, 0::bigint)$$, '... its version, revision and event are gone with it');

-- events: one per version, with the writer as actor and the version as fence
SELECT results_eq(
  $$SELECT event, from_status, to_status, actor, fence, (detail ->> 'based_on')::bigint FROM pgfence.event
    WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'd') AND event IN ('create', 'save') ORDER BY id$$,
  $$VALUES ('create'::text, NULL::text, 'live'::text, 'ann'::text, 1::bigint, NULL::bigint),
           ('save', 'live', 'live', 'ann', 2, 1), ('save', 'live', 'live', 'cy', 3, 2), ('save', 'live', 'live', 'cy', 4, 3)$$,
  'every version is logged: writer as actor, version as fence, based_on = the version it replaced');

-- =============================================================================================
-- Revisions and history
-- =============================================================================================
SELECT results_eq(
  $$SELECT version, op, content, save_id, saved_by FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'd'), 2)$$,
  $$VALUES (2::bigint, 'save'::text, '{"title": "v2", "owner": "ann"}'::jsonb, 'tap-save-a'::text, 'ann'::text)$$,
  'document_revision returns a version exactly as saved, with its save_id (the receipt)');
SELECT results_eq(
  $$SELECT version, op, save_id, saved_by FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'))$$,
  $$VALUES (4::bigint, 'save'::text, NULL::text, 'cy'::text), (3, 'save', 'tap-save-c', 'cy'), (2, 'save', 'tap-save-a', 'ann'), (1, 'create', NULL, 'ann')$$,
  'history: every version, newest first');
SELECT results_eq(
  $$SELECT version FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'), 2, 4)$$,
  $$VALUES (3::bigint), (2::bigint)$$, 'history pages back with before_version and limit');
SELECT throws_ok($$SELECT * FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'd'), 99)$$, 'P0002', NULL, 'revision: a version that does not exist is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.document_revision(-1, 1)$$, 'P0002', NULL, 'revision: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'd'), NULL)$$, '22004', NULL, 'revision: NULL version is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_history(-1)$$, 'P0002', NULL, 'history: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.document_history(NULL)$$, '22004', NULL, 'history: NULL id is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'), 0)$$, '22023', NULL, 'history: limit 0 is 22023');

-- =============================================================================================
-- Delete: a tombstone; versions keep growing and are never reused
-- =============================================================================================
SELECT results_eq(
  $$SELECT outcome, version, content, deleted FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'd'), 3, 'ann')$$,
  $$VALUES ('conflict'::text, 4::bigint, '{"title": "v4", "owner": "cy"}'::jsonb, false)$$,
  'delete on a stale version: conflict with the stored content');
SELECT results_eq(
  $$SELECT outcome, version, content, deleted, replayed FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'd'), 4, 'ann')$$,
  $$VALUES ('deleted'::text, 5::bigint, NULL::jsonb, true, false)$$,
  'delete on the current version: deleted, the tombstone is version 5');
SELECT results_eq(
  $$SELECT version, content, deleted, saved_by FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'd'))$$,
  $$VALUES (5::bigint, NULL::jsonb, true, 'ann'::text)$$, 'get shows the tombstone: version 5, no content, deleted');
SELECT results_eq(
  $$SELECT op, content FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'd'), 5)$$,
  $$VALUES ('delete'::text, NULL::jsonb)$$, 'the tombstone is a revision too');
SELECT is((SELECT content FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'd'), 4)), '{"title": "v4", "owner": "cy"}'::jsonb,
  'earlier revisions survive the delete');
SELECT results_eq(
  $$SELECT outcome, version, replayed FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'd'), 4, 'ann')$$,
  $$VALUES ('deleted'::text, 5::bigint, true)$$, 'repeating the delete (lost answer) is answered deleted, nothing changes');
SELECT results_eq(
  $$SELECT outcome, version, content, deleted FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 4, '{"title": "late"}', 'bob')$$,
  $$VALUES ('conflict'::text, 5::bigint, NULL::jsonb, true)$$,
  'a save based on a pre-delete version: conflict, deleted = true');
SELECT results_eq(
  $$SELECT outcome, version, deleted FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'd'), 5, '{"title": "resurrect"}', 'bob')$$,
  $$VALUES ('conflict'::text, 5::bigint, true)$$,
  'a save on the tombstone version is a conflict too: a deleted document never changes again');
SELECT results_eq(
  $$SELECT outcome, version FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'd'), 5, 'bob')$$,
  $$VALUES ('conflict'::text, 5::bigint)$$, 'deleting the tombstone again: conflict');
SELECT is((SELECT max(version) FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'))), 5::bigint,
  'the version stays at the tombstone: nothing after the delete made a version');
SELECT results_eq(
  $$SELECT array_agg(version ORDER BY version) FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'd'))$$,
  $$VALUES (ARRAY[1, 2, 3, 4, 5]::bigint[])$$, 'revision history is gap-free from 1 to the tombstone');
SELECT ok((SELECT max(id) FROM ids) < pgfence.document_create('record', '{}', 'ann'), 'a new document gets a new id (ids are never reused)');
SELECT results_eq(
  $$SELECT event, from_status, to_status, fence FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'd') AND event = 'delete'$$,
  $$VALUES ('delete'::text, 'live'::text, 'deleted'::text, 5::bigint)$$, 'the delete is logged');
SELECT throws_ok($$SELECT * FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'keyed'), NULL, 'ann')$$, '22004', NULL, 'delete without an expected version is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'keyed'), 7, 'ann')$$, 'PF303', NULL, 'delete: a version the document never had is PF303');
SELECT throws_ok($$SELECT * FROM pgfence.document_delete(-1, 1, 'ann')$$, 'P0002', NULL, 'delete: unknown id is P0002');
SELECT throws_ok($$SELECT * FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'keyed'), 1, '')$$, '22023', NULL, 'delete: empty by is 22023');

-- =============================================================================================
-- Guards: even a hand-written UPDATE / DELETE cannot break the version chain
-- =============================================================================================
INSERT INTO ids SELECT 'g', pgfence.document_create('record', '{"a": 1}', 'ann');
SELECT throws_ok($$UPDATE pgfence.document SET version = version + 2, content = '{"a": 2}' WHERE id = (SELECT id FROM ids WHERE name = 'g')$$, 'PF002', NULL,
  'hand UPDATE skipping a version: PF002');
SELECT throws_ok($$UPDATE pgfence.document SET content = '{"a": 2}' WHERE id = (SELECT id FROM ids WHERE name = 'g')$$, 'PF002', NULL,
  'hand UPDATE of content without a new version: PF002');
SELECT throws_ok($$UPDATE pgfence.document SET kind = 'sheet', version = version + 1 WHERE id = (SELECT id FROM ids WHERE name = 'g')$$, 'PF002', NULL,
  'changing a document''s kind: PF002');
SELECT throws_ok($$UPDATE pgfence.document SET status = 'live', version = version + 1, content = '{}' WHERE id = (SELECT id FROM ids WHERE name = 'd')$$, 'PF001', NULL,
  'hand UPDATE deleted -> live (resurrection): PF001');
SELECT throws_ok($$UPDATE pgfence.document SET status = 'bogus', version = version + 1 WHERE id = (SELECT id FROM ids WHERE name = 'g')$$, 'PF001', NULL,
  'an unknown status: PF001');
SELECT throws_ok($$DELETE FROM pgfence.document WHERE id = (SELECT id FROM ids WHERE name = 'd')$$, 'PF002', NULL,
  'hand DELETE of a document (its tombstone): PF002');
SELECT throws_ok($$INSERT INTO pgfence.document (kind, version, content, created_by, saved_by) VALUES ('record', 7, '{}', 'x', 'x')$$, 'PF001', NULL,
  'a document inserted at version 7: PF001');
SELECT throws_ok($$UPDATE pgfence.document_revision SET content = '{"forged": true}' WHERE document_id = (SELECT id FROM ids WHERE name = 'g')$$, 'PF002', NULL,
  'editing a revision: PF002');
SELECT throws_ok($$DELETE FROM pgfence.document_revision WHERE document_id = (SELECT id FROM ids WHERE name = 'g')$$, 'PF002', NULL,
  'deleting a revision: PF002');
UPDATE pgfence.document SET version = version + 1, content = '{"a": "by hand"}', saved_by = 'dba' WHERE id = (SELECT id FROM ids WHERE name = 'g');
SELECT results_eq(
  $$SELECT version, op, content, saved_by FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'g'), 2)$$,
  $$VALUES (2::bigint, 'save'::text, '{"a": "by hand"}'::jsonb, 'dba'::text)$$,
  'a legal hand UPDATE (next version) is still kept as a revision and logged');

-- =============================================================================================
-- Merge: record (by attribute)
-- =============================================================================================
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": 1, "b": 1, "c": 1}', '{"a": 2, "b": 1, "c": 1}', '{"a": 1, "b": 2, "c": 1}')$$,
  $$VALUES ('{"a": 2, "b": 2, "c": 1}'::jsonb, '[]'::jsonb)$$,
  'record: attributes changed on different sides both survive, no conflict');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": 1}', '{"a": 5}', '{"a": 5}')$$,
  $$VALUES ('{"a": 5}'::jsonb, '[]'::jsonb)$$, 'record: the same change on both sides is no conflict');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": 1, "b": 1}', '{"a": 2, "b": 1}', '{"a": 3, "b": 9}')$$,
  $$VALUES ('{"a": 3, "b": 9}'::jsonb, '[{"key": "a", "base": 1, "local": 2, "stored": 3}]'::jsonb)$$,
  'record: an attribute changed differently on both sides is a conflict (base, local, stored); content keeps stored there, merges the rest');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": 1, "b": 1}', '{"b": 1}', '{"a": 1, "b": 2}')$$,
  $$VALUES ('{"b": 2}'::jsonb, '[]'::jsonb)$$, 'record: an attribute removed locally and untouched on the server is removed');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": 1}', '{}', '{"a": 2}')$$,
  $$VALUES ('{"a": 2}'::jsonb, '[{"key": "a", "base": 1, "stored": 2}]'::jsonb)$$,
  'record: removed locally but changed on the server is a conflict (no local field = absent locally)');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{}', '{"n": "x"}', '{"n": "y", "m": true}')$$,
  $$VALUES ('{"n": "y", "m": true}'::jsonb, '[{"key": "n", "local": "x", "stored": "y"}]'::jsonb)$$,
  'record: the same attribute added on both sides with different values is a conflict without a base');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": 1}', '{"a": null}', '{"a": 1, "z": {"deep": [1]}}')$$,
  $$VALUES ('{"a": null, "z": {"deep": [1]}}'::jsonb, '[]'::jsonb)$$,
  'record: JSON null is a value, not an absence; nested values merge as whole attributes');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('record', '{"a": {"x": 1}}', '{"a": {"x": 1, "y": 2}}', '{"a": {"x": 3}}')$$,
  $$VALUES ('{"a": {"x": 3}}'::jsonb, '[{"key": "a", "base": {"x": 1}, "local": {"x": 1, "y": 2}, "stored": {"x": 3}}]'::jsonb)$$,
  'record: an attribute is the unit of merge (a nested object changed on both sides is one conflict)');
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('record', '{}', '[1]', '{}')$$, '22023', NULL, 'record merge of a non-object: 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('record', NULL, '{}', '{}')$$, '22004', NULL, 'merge without a base: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('record', '{}', '{}', NULL)$$, '22004', NULL, 'merge into a deleted (NULL) stored copy: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_merge(NULL, '{}', '{}', '{}')$$, '22004', NULL, 'merge without a kind: 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('nosuchkind', '{}', '{}', '{}')$$, 'PF302', NULL, 'merge of an unknown kind: PF302');

-- =============================================================================================
-- Merge: sheet (never merges)
-- =============================================================================================
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('sheet', '{"A1": 1, "B1": 2}', '{"A1": 5, "B1": 2}', '{"A1": 1, "B1": 2}')$$,
  $$VALUES ('{"A1": 5, "B1": 2}'::jsonb, '[]'::jsonb)$$, 'sheet: only the local side changed: local, no conflict');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('sheet', '{"A1": 1}', '{"A1": 1}', '{"A1": 9}')$$,
  $$VALUES ('{"A1": 9}'::jsonb, '[]'::jsonb)$$, 'sheet: only the stored side changed: stored, no conflict');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('sheet', '{"A1": 1, "B1": 2}', '{"A1": 5, "B1": 2}', '{"A1": 1, "B1": 7}')$$,
  $$VALUES (NULL::jsonb, '[{"key": "A1", "base": 1, "local": 5, "stored": 1}, {"key": "B1", "base": 2, "local": 2, "stored": 7}]'::jsonb)$$,
  'sheet: both changed different cells: no merge, content NULL, every difference is a conflict');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('sheet', '[[1, 2]]', '[[1, 3]]', '[[1, 2], [4, 5]]')$$,
  $$VALUES (NULL::jsonb, '[{"key": 0, "base": [1, 2], "local": [1, 3], "stored": [1, 2]}, {"key": 1, "stored": [4, 5]}]'::jsonb)$$,
  'sheet as an array of rows: each differing row index is a conflict');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('sheet', '"a"', '"b"', '{"x": 1}')$$,
  $$VALUES (NULL::jsonb, '[{"key": null, "base": "a", "local": "b", "stored": {"x": 1}}]'::jsonb)$$,
  'sheet with different shapes: one conflict for the whole value');
SELECT results_eq(
  $$SELECT content, conflicts FROM pgfence.document_merge('sheet', '{"A1": 1}', '{"A1": 2}', '{"A1": 2}')$$,
  $$VALUES ('{"A1": 2}'::jsonb, '[]'::jsonb)$$, 'sheet: identical edits on both sides: no conflict');

-- =============================================================================================
-- Application kinds
-- =============================================================================================
CREATE FUNCTION pg_temp.tap_union_merge(b jsonb, l jsonb, s jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE
  AS $f$ SELECT jsonb_build_object('content', s || l, 'conflicts', '[]'::jsonb) $f$;
CREATE FUNCTION pg_temp.tap_bad_merge(b jsonb, l jsonb, s jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE
  AS $f$ SELECT jsonb_build_object('merged', l) $f$;
CREATE FUNCTION pg_temp.tap_wrong_args(b jsonb, l jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $f$ SELECT l $f$;
CREATE FUNCTION pg_temp.tap_volatile(b jsonb, l jsonb, s jsonb) RETURNS jsonb LANGUAGE sql VOLATILE
  AS $f$ SELECT jsonb_build_object('content', l, 'conflicts', '[]'::jsonb) $f$;
-- An invoker function that reads a pgfence table: proves the merge runs with the caller's rights.
CREATE FUNCTION public.tap_peeking_merge(b jsonb, l jsonb, s jsonb) RETURNS jsonb LANGUAGE sql STABLE
  AS $f$ SELECT jsonb_build_object('content', to_jsonb((SELECT count(*) FROM pgfence.document)), 'conflicts', '[]'::jsonb) $f$;
GRANT EXECUTE ON FUNCTION public.tap_peeking_merge(jsonb, jsonb, jsonb) TO pgfence_client;

SELECT results_eq(
  $$SELECT kind, merge, content_type, max_bytes, builtin FROM pgfence.document_register_kind('tap-todo', 'attributes', NULL, NULL, 200, 'todo list')$$,
  $$VALUES ('tap-todo'::text, 'attributes'::text, 'object'::text, 200, false)$$, 'register an application kind (object content, 200-byte limit)');
SELECT ok(pgfence.document_create('tap-todo', '{"t1": "milk"}', 'ann') > 0, 'create a document of the new kind');
SELECT throws_ok($$SELECT pgfence.document_create('tap-todo', jsonb_build_object('t1', repeat('m', 300)), 'ann')$$, 'PF301', NULL,
  'the kind''s own size limit applies (PF301)');
SELECT results_eq($$SELECT max_bytes, description FROM pgfence.document_register_kind('tap-todo', p_max_bytes => 1000)$$,
  $$VALUES (1000, 'todo list'::text)$$, 're-registering changes only what is passed');
SELECT results_eq($$SELECT merge, max_bytes FROM pgfence.document_register_kind('record', p_max_bytes => 2097152)$$,
  $$VALUES ('attributes'::text, 2097152)$$, 'a built-in kind''s limit can be raised');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('record', 'none')$$, '22023', NULL, 'a built-in kind''s merge cannot change (22023)');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('Bad Kind', 'none')$$, '22023', NULL, 'register: invalid kind name is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new')$$, '22004', NULL, 'register: a new kind without a merge is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind(NULL, 'none')$$, '22004', NULL, 'register: NULL kind is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'magic')$$, '22023', NULL, 'register: unknown merge is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'none', NULL, 'string')$$, '22023', NULL, 'register: unknown content_type is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'none', NULL, NULL, 0)$$, '22023', NULL, 'register: max_bytes 0 is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'function')$$, '22004', NULL, 'register: merge = function without a function is 22004');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'function', 'pg_temp.tap_wrong_args(jsonb,jsonb)')$$, '22023', NULL,
  'register: a merge function with the wrong signature is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'function', 'pg_temp.tap_volatile(jsonb,jsonb,jsonb)')$$, '22023', NULL,
  'register: a VOLATILE merge function is 22023');
SELECT throws_ok($$SELECT * FROM pgfence.document_register_kind('tap-new', 'none', 'pg_temp.tap_union_merge(jsonb,jsonb,jsonb)')$$, '22023', NULL,
  'register: a merge function without merge = function is 22023');

SELECT lives_ok($$SELECT * FROM pgfence.document_register_kind('tap-union', 'function', 'pg_temp.tap_union_merge(jsonb,jsonb,jsonb)')$$, 'register a kind with its own merge function');
SELECT results_eq($$SELECT content, conflicts FROM pgfence.document_merge('tap-union', '{}', '{"a": 1}', '{"b": 2}')$$,
  $$VALUES ('{"a": 1, "b": 2}'::jsonb, '[]'::jsonb)$$, 'document_merge calls the kind''s function');
SELECT lives_ok($$SELECT * FROM pgfence.document_register_kind('tap-bad', 'function', 'pg_temp.tap_bad_merge(jsonb,jsonb,jsonb)')$$, 'register a kind whose merge returns junk');
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('tap-bad', '{}', '{}', '{}')$$, 'PF304', NULL, 'a malformed merge result is PF304');
SELECT lives_ok($$SELECT * FROM pgfence.document_register_kind('tap-peek', 'function', 'public.tap_peeking_merge(jsonb,jsonb,jsonb)')$$, 'register a merge that reads a pgfence table');
SET LOCAL ROLE pgfence_client;
SELECT throws_ok($$SELECT * FROM pgfence.document_merge('tap-peek', '{}', '{}', '{}')$$, '42501', NULL,
  'as pgfence_client the application''s merge runs with the client''s rights, not pgfence''s owner''s (42501)');
RESET ROLE;

-- =============================================================================================
-- log_saves (migration 0014): a kind says whether its saves write a save event; the revisions,
-- creates, deletes, conflicts and replays are kept either way (audit_documents counts them)
-- =============================================================================================
SELECT results_eq($$SELECT kind, log_saves FROM pgfence.document_kinds WHERE builtin ORDER BY kind$$,
  $$VALUES ('record'::text, true), ('sheet'::text, true)$$, 'log_saves: the built-in kinds log their saves by default');
SELECT results_eq($$SELECT log_saves FROM pgfence.document_register_kind('tap-quiet', 'attributes', p_log_saves => false)$$,
  $$VALUES (false)$$, 'log_saves: a kind registered with p_log_saves => false');
SELECT results_eq($$SELECT log_saves FROM pgfence.document_register_kind('tap-quiet', p_description => 'still quiet')$$,
  $$VALUES (false)$$, 'log_saves: NULL keeps the kind''s setting');
SELECT results_eq($$SELECT log_saves FROM pgfence.document_register_kind('tap-loud', 'none')$$,
  $$VALUES (true)$$, 'log_saves: a new kind logs its saves unless told otherwise');
INSERT INTO ids SELECT 'quiet', pgfence.document_create('tap-quiet', '{"a": 1}', 'ann');
SELECT results_eq($$SELECT outcome, version FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'quiet'), 1, '{"a": 2}', 'ann', 'tap-q-1')$$,
  $$VALUES ('saved'::text, 2::bigint)$$, 'log_saves off: the save is made');
SELECT results_eq($$SELECT outcome, version FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'quiet'), 1, '{"a": 3}', 'bob')$$,
  $$VALUES ('conflict'::text, 2::bigint)$$, 'log_saves off: a stale save is still a conflict');
SELECT results_eq($$SELECT outcome, version, replayed FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'quiet'), 1, '{"a": 2}', 'ann', 'tap-q-1')$$,
  $$VALUES ('saved'::text, 2::bigint, true)$$, 'log_saves off: a retried save is still answered from its receipt');
SELECT results_eq($$SELECT version, op, save_id FROM pgfence.document_history((SELECT id FROM ids WHERE name = 'quiet')) ORDER BY version$$,
  $$VALUES (1::bigint, 'create'::text, NULL::text), (2::bigint, 'save'::text, 'tap-q-1'::text)$$,
  'log_saves off: every version is still kept as a revision (the receipt of its save_id)');
SELECT results_eq($$SELECT event FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'quiet') ORDER BY id$$,
  $$VALUES ('create'::text), ('conflict'::text), ('replay'::text)$$,
  'log_saves off: no save event; create, conflict and replay are logged');
SELECT results_eq($$SELECT revisions, conflicts_1h, conflicts_24h, replays_24h, last_conflict_by FROM pgfence.audit_documents WHERE document_id = (SELECT id FROM ids WHERE name = 'quiet')$$,
  $$VALUES (2::bigint, 1::bigint, 1::bigint, 1::bigint, 'bob'::text)$$,
  'log_saves off: audit_documents still counts the revisions, conflicts and replays');
SELECT lives_ok($$SELECT * FROM pgfence.document_register_kind('tap-quiet', p_log_saves => true)$$, 'log_saves turned back on');
SELECT results_eq($$SELECT outcome FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'quiet'), 2, '{"a": 4}', 'ann')$$,
  $$VALUES ('saved'::text)$$, 'log_saves on again: a save');
SELECT results_eq($$SELECT event, fence FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'quiet') AND event = 'save'$$,
  $$VALUES ('save'::text, 3::bigint)$$, 'log_saves on again: the next save is logged, at once (no session cache)');
SELECT lives_ok($$SELECT * FROM pgfence.document_register_kind('tap-quiet', p_log_saves => false)$$, 'log_saves off again');
SELECT results_eq($$SELECT outcome, version FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'quiet'), 3, 'ann')$$,
  $$VALUES ('deleted'::text, 4::bigint)$$, 'log_saves off: a delete');
SELECT results_eq($$SELECT count(*) FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'quiet') AND event = 'delete'$$,
  $$VALUES (1::bigint)$$, 'log_saves off: a delete is always logged');
SELECT results_eq($$SELECT log_saves FROM pgfence.document_register_kind('record', p_log_saves => false)$$,
  $$VALUES (false)$$, 'log_saves: a built-in kind''s setting can change');
SELECT results_eq($$SELECT log_saves FROM pgfence.document_register_kind('record', p_log_saves => true)$$,
  $$VALUES (true)$$, 'log_saves: and back');

-- =============================================================================================
-- The save's one-statement fast path (migration 0024): who may skip tg_document_write
-- =============================================================================================
SELECT is((SELECT array_agg(p.proname::text ORDER BY p.proname) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace AND p.prosrc ~ '(write_nonce|document_writing)'),
          ARRAY['document_save'],
  'only document_save changes write_nonce or sets pgfence.document_writing (the trigger bypass)');
SELECT is((SELECT array_agg(p.proname::text ORDER BY p.proname) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace
             AND p.prosrc ~* '(insert\s+into|update|delete\s+from)\s+pgfence\.document\M'),
          ARRAY['document_create', 'document_delete', 'document_save'],
  'the functions that write pgfence.document are create, save and delete');
SELECT is((SELECT array_agg(p.proname::text ORDER BY p.proname) FROM pg_proc p
           WHERE p.pronamespace = 'pgfence'::regnamespace
             AND p.prosrc ~* 'insert\s+into\s+pgfence\.document_revision\M'),
          ARRAY['document_save', 'tg_document_created', 'tg_document_write'],
  'revisions are inserted only by the two document triggers and the save''s compare-and-swap');
SELECT is((SELECT array_agg(r.rolname::text ORDER BY r.rolname) FROM pg_roles r
           WHERE NOT r.rolsuper AND r.rolname NOT IN ('pgfence_definer', 'pg_write_all_data')
             AND r.oid NOT IN (SELECT c.relowner FROM pg_class c
                               WHERE c.oid IN ('pgfence.document'::regclass, 'pgfence.document_revision'::regclass))
             AND (has_table_privilege(r.oid, 'pgfence.document', 'INSERT, UPDATE, DELETE, TRUNCATE')
                  OR has_table_privilege(r.oid, 'pgfence.document_revision', 'INSERT, UPDATE, DELETE, TRUNCATE'))),
          NULL,
  'no role but the tables'' owner and pgfence_definer (and the superuser-granted pg_write_all_data) may write documents or revisions');
SELECT is((SELECT count(*)::int FROM pg_trigger WHERE tgrelid = 'pgfence.document'::regclass AND tgname = 'document_write'
           AND tgtype & 16 <> 0 AND pg_get_triggerdef(oid) ~ 'NOT \(new\.write_nonce IS DISTINCT FROM old\.write_nonce\)'), 1,
  'document_write is skipped only for a row whose write_nonce changed (to the setting''s value)');
INSERT INTO ids SELECT 'nonce', pgfence.document_create('record', '{"a": 1}', 'ann');
SELECT results_eq($$SELECT outcome, version FROM pgfence.document_save((SELECT id FROM ids WHERE name = 'nonce'), 1, '{"a": 2}', 'ann', 'tap-nonce-1')$$,
  $$VALUES ('saved'::text, 2::bigint)$$, 'fast path: a save');
SELECT is(current_setting('pgfence.document_writing', true), '', 'fast path: the setting is cleared after the save (the nonce does not leak)');
SELECT results_eq($$SELECT version, op, content, save_id, saved_by FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'nonce'), 2)$$,
  $$VALUES (2::bigint, 'save'::text, '{"a": 2}'::jsonb, 'tap-nonce-1'::text, 'ann'::text)$$,
  'fast path: the revision is written in the same statement');
SELECT is((SELECT write_nonce FROM pgfence.document WHERE id = (SELECT id FROM ids WHERE name = 'nonce')),
          '00000000-0000-0000-0000-000000000001'::uuid,
  'fast path: the nonce is the save''s base version as a uuid (a value the row never had: bases only grow)');
SELECT results_eq($$SELECT event, from_status, to_status, actor, fence, detail FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'nonce') AND event = 'save'$$,
  $$VALUES ('save'::text, 'live'::text, 'live'::text, 'ann'::text, 2::bigint, '{"kind": "record", "based_on": 1, "save_id": "tap-nonce-1"}'::jsonb)$$,
  'fast path: the save event is what tg_document_write logs');
-- A caller that knows the row's nonce and pre-sets the setting to it gains nothing: the delete does
-- not change write_nonce, so the trigger runs (revision and event), and a hand UPDATE is guarded.
SELECT set_config('pgfence.document_writing', (SELECT write_nonce::text FROM pgfence.document WHERE id = (SELECT id FROM ids WHERE name = 'nonce')), true);
SELECT throws_ok($$UPDATE pgfence.document SET version = version + 2 WHERE id = (SELECT id FROM ids WHERE name = 'nonce')$$, 'PF002', NULL,
  'a pre-set setting equal to the row''s nonce: a hand UPDATE is still guarded');
SELECT throws_ok($$UPDATE pgfence.document SET version = version + 2, write_nonce = gen_random_uuid() WHERE id = (SELECT id FROM ids WHERE name = 'nonce')$$, 'PF002', NULL,
  'a new nonce that is not the setting''s value: the hand UPDATE is still guarded');
SELECT results_eq($$SELECT outcome, version FROM pgfence.document_delete((SELECT id FROM ids WHERE name = 'nonce'), 2, 'mallory')$$,
  $$VALUES ('deleted'::text, 3::bigint)$$, 'a pre-set setting: document_delete works');
SELECT results_eq($$SELECT op, saved_by FROM pgfence.document_revision((SELECT id FROM ids WHERE name = 'nonce'), 3)$$,
  $$VALUES ('delete'::text, 'mallory'::text)$$, 'a pre-set setting: the delete still has its revision');
SELECT results_eq($$SELECT count(*) FROM pgfence.event WHERE module = 'document' AND item_id = (SELECT id FROM ids WHERE name = 'nonce') AND event = 'delete'$$,
  $$VALUES (1::bigint)$$, 'a pre-set setting: the delete is still logged');
SELECT set_config('pgfence.document_writing', '', true);
SELECT throws_ok($$INSERT INTO pgfence.document_revision (document_id, version, op, content, saved_by, saved_at) VALUES ((SELECT id FROM ids WHERE name = 'g'), 99, 'save', '{}', 'x', now())$$,
  'PF002', NULL, 'a hand INSERT of a revision: PF002 (it stands in for the foreign key)');
SELECT throws_ok($$INSERT INTO pgfence.document_revision (document_id, version, op, content, saved_by, saved_at) VALUES (-5, 2, 'save', '{}', 'x', now())$$,
  'PF002', NULL, 'a hand INSERT of a revision of no document: PF002');

-- =============================================================================================
-- The tables' CHECK constraints live in the guard triggers (migration 0031): a hand-written
-- write that breaks one fails as before, 23514 with the constraint's name
-- =============================================================================================
CREATE FUNCTION pg_temp.violation(p_sql text) RETURNS text LANGUAGE plpgsql AS $$
DECLARE
  v_state text;
  v_name  text;
BEGIN
  EXECUTE p_sql;
  RETURN 'no error';
EXCEPTION WHEN OTHERS THEN
  GET STACKED DIAGNOSTICS v_state = RETURNED_SQLSTATE, v_name = CONSTRAINT_NAME;
  RETURN v_state || ' ' || coalesce(nullif(v_name, ''), '-');
END
$$;
SELECT is((SELECT count(*)::int FROM pg_constraint
           WHERE contype = 'c' AND conrelid IN ('pgfence.document'::regclass, 'pgfence.document_revision'::regclass)), 0,
  'document and document_revision declare no CHECK constraint (each would be re-read by every save)');
INSERT INTO ids SELECT 'chk', pgfence.document_create('record', '{"a": 1}', 'ann');
CREATE TEMP TABLE hand_writes (constraint_name text, sql text);
INSERT INTO hand_writes VALUES
  ('document_idempotency_key_check', $$INSERT INTO pgfence.document (kind, idempotency_key, version, content, created_by, saved_by) VALUES ('record', '', 1, '{}', 'x', 'x')$$),
  ('document_idempotency_key_check', $$INSERT INTO pgfence.document (kind, idempotency_key, version, content, created_by, saved_by) VALUES ('record', repeat('k', 256), 1, '{}', 'x', 'x')$$),
  ('document_created_by_check', $$INSERT INTO pgfence.document (kind, version, content, created_by, saved_by) VALUES ('record', 1, '{}', '', 'x')$$),
  ('document_saved_by_check', $$INSERT INTO pgfence.document (kind, version, content, created_by, saved_by) VALUES ('record', 1, '{}', 'x', repeat('s', 201))$$),
  ('document_save_id_check', $$INSERT INTO pgfence.document (kind, version, content, created_by, saved_by, save_id) VALUES ('record', 1, '{}', 'x', 'x', '')$$),
  ('document_content_iff_live', $$INSERT INTO pgfence.document (kind, version, content, created_by, saved_by) VALUES ('record', 1, NULL, 'x', 'x')$$),
  ('document_save_id_check', $$UPDATE pgfence.document SET version = version + 1, save_id = '' WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$),
  ('document_save_id_check', $$UPDATE pgfence.document SET version = version + 1, save_id = repeat('i', 256) WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$),
  ('document_saved_by_check', $$UPDATE pgfence.document SET version = version + 1, saved_by = '' WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$),
  ('document_saved_by_check', $$UPDATE pgfence.document SET version = version + 1, saved_by = repeat('s', 201) WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$),
  ('document_content_iff_live', $$UPDATE pgfence.document SET version = version + 1, content = NULL WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$),
  ('document_content_iff_live', $$UPDATE pgfence.document SET version = version + 1, status = 'deleted' WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$);
SELECT is(pg_temp.violation(sql), '23514 ' || constraint_name,
          'a hand-written write breaking ' || constraint_name || ': 23514 with its name (' || left(sql, 6) || ')')
FROM hand_writes ORDER BY constraint_name, sql;
-- document_status_check and document_version_check were never reached by a hand-written write:
-- the machine's own checks refuse those rows first, as they did when the constraints were declared
SELECT is(pg_temp.violation($$INSERT INTO pgfence.document (kind, status, version, content, created_by, saved_by) VALUES ('record', 'bogus', 1, '{}', 'x', 'x')$$),
          'PF001 -', 'an unknown status on insert: PF001 before document_status_check');
SELECT is(pg_temp.violation($$UPDATE pgfence.document SET version = 0 WHERE id = (SELECT id FROM ids WHERE name = 'chk')$$),
          'PF002 -', 'version 0 on update: PF002 before document_version_check');
SELECT is(pg_temp.violation($$INSERT INTO pgfence.document (kind, idempotency_key, version, content, created_by, saved_by) VALUES ('record', NULL, 1, '{}', 'x', 'x')$$),
          'no error', 'NULL passes as in a CHECK: a hand INSERT without an idempotency key and save_id is accepted');
SELECT results_eq($$SELECT version, content FROM pgfence.document_get((SELECT id FROM ids WHERE name = 'chk'))$$,
  $$VALUES (1::bigint, '{"a": 1}'::jsonb)$$, 'the refused hand-written writes changed nothing');
-- Revisions written from inside a trigger (depth > 0) are checked; from the top level they are
-- refused before any check (PF002, above).
CREATE TEMP TABLE forge (version bigint, op text, content jsonb);
CREATE FUNCTION pg_temp.tg_forge() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  INSERT INTO pgfence.document_revision (document_id, version, op, content, saved_by, saved_at)
  VALUES ((SELECT id FROM ids WHERE name = 'chk'), NEW.version, NEW.op, NEW.content, 'x', now());
  RETURN NEW;
END
$$;
CREATE TRIGGER forge BEFORE INSERT ON forge FOR EACH ROW EXECUTE FUNCTION pg_temp.tg_forge();
CREATE TEMP TABLE rev_writes (constraint_name text, sql text);
INSERT INTO rev_writes VALUES
  ('document_revision_version_check', $$INSERT INTO forge VALUES (0, 'save', '{}')$$),
  ('document_revision_op_check', $$INSERT INTO forge VALUES (50, 'bogus', '{}')$$),
  ('document_revision_content_iff_not_delete', $$INSERT INTO forge VALUES (50, 'save', NULL)$$),
  ('document_revision_content_iff_not_delete', $$INSERT INTO forge VALUES (50, 'delete', '{}')$$),
  ('document_revision_create_is_1', $$INSERT INTO forge VALUES (50, 'create', '{}')$$),
  ('document_revision_create_is_1', $$INSERT INTO forge VALUES (1, 'save', '{}')$$);
SELECT is(pg_temp.violation(sql), '23514 ' || constraint_name,
          'a revision written from a trigger breaking ' || constraint_name || ': 23514 with its name')
FROM rev_writes ORDER BY constraint_name, sql;
SELECT is(pg_temp.violation($$INSERT INTO forge VALUES (50, 'save', '{}')$$), 'no error',
  'a well-formed revision written from a trigger passes the guard (as before)');

SELECT * FROM finish();
ROLLBACK;
