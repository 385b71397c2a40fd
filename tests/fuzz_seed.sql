-- Seed for the fuzzer (tests/test_fuzz.py): real rows in every state of every module, so that the
-- state-dependent branches of every public function run. Made through the public functions;
-- leases, heartbeats and expiries lapse because rows are back-dated (never by faking the clock).
-- Run as the tables' owner in autocommit, one statement at a time (fuzzing.seed()), on an empty
-- pgfence schema; names start with fz so that the fuzzer's vocabulary can find them.

-- An application's side: a SQL action with one database effect per ok run (public.fuzz_effect:
-- the fuzzer checks one effect per ok receipt), actions that get retired, dropped and replaced,
-- and a merge function.
CREATE TABLE IF NOT EXISTS public.fuzz_effect (id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY, args jsonb NOT NULL);
CREATE OR REPLACE FUNCTION public.fuzz_action(p jsonb) RETURNS jsonb LANGUAGE plpgsql AS $$
DECLARE v bigint;
BEGIN
  IF p ->> 'fail' = 'true' THEN
    RAISE EXCEPTION 'fuzz action asked to fail' USING ERRCODE = 'P0001', HINT = 'args.fail';
  END IF;
  INSERT INTO public.fuzz_effect (args) VALUES (p) RETURNING id INTO v;
  RETURN jsonb_build_object('effect', v);
END $$;
-- A purge deletes receipts with their plans: their effects go with them (so that every effect
-- row has exactly one ok receipt, the invariant the fuzzer checks).
CREATE OR REPLACE FUNCTION public.fuzz_receipt_purged() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  DELETE FROM public.fuzz_effect e WHERE OLD.outcome = 'ok' AND e.id::text = OLD.output ->> 'effect';
  RETURN NULL;
END $$;
CREATE OR REPLACE TRIGGER fuzz_receipt_purged AFTER DELETE ON pgfence.plan_step
  FOR EACH ROW EXECUTE FUNCTION public.fuzz_receipt_purged();
-- the trigger runs as whoever deletes the receipt: audit_purge (SECURITY DEFINER) deletes as
-- pgfence_definer
GRANT SELECT, DELETE ON public.fuzz_effect TO pgfence_definer;
CREATE OR REPLACE FUNCTION public.fuzz_retired(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
CREATE OR REPLACE FUNCTION public.fuzz_changing(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
CREATE OR REPLACE FUNCTION public.fuzz_gone(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$;
CREATE OR REPLACE FUNCTION public.fuzz_wrong(p text) RETURNS jsonb LANGUAGE sql AS $$ SELECT to_jsonb(p) $$;
CREATE OR REPLACE FUNCTION public.fuzz_merge(b jsonb, l jsonb, s jsonb) RETURNS jsonb LANGUAGE sql IMMUTABLE AS $$
  SELECT CASE WHEN l ? 'malformed' THEN '[]'::jsonb
              ELSE jsonb_build_object('content', l, 'conflicts', '[]'::jsonb) END
$$;

-- ------------------------------------------------------------------------------------------
-- outbox: pending (due, deferred, backed off), processing (live, lapsed), sent, failed, dead
-- ------------------------------------------------------------------------------------------
SELECT pgfence.outbox_configure_channel('fz-log', 3, '1 second', '1 minute', '1 hour', true);
SELECT pgfence.outbox_configure_channel('fz-dead', 1, '1 second', '1 minute', '1 hour', true);
SELECT pgfence.outbox_enqueue('fz-log', 'https://fz.example/due', '{"n": 1}', 'fz-key-1');
SELECT pgfence.outbox_enqueue('fz-quiet', 'mailto:fz@example.org', '{"n": 2}', NULL, now() + interval '1 day');
SELECT pgfence.outbox_enqueue_many('fz-log', ARRAY['https://fz.example/a', 'https://fz.example/b'],
                                   ARRAY['{"n": 3}', '{"n": 4}']::jsonb[], ARRAY['fz-key-2', NULL]);
SELECT pgfence.outbox_enqueue('fz-live', 'https://fz.example/live', '{"n": 5}', 'fz-key-live');
SELECT pgfence.outbox_claim('fz-w1', 1, ARRAY['fz-live'], interval '1 day');
SELECT pgfence.outbox_enqueue('fz-lapsed', 'https://fz.example/lapsed', '{"n": 6}');
SELECT pgfence.outbox_claim('fz-w2', 1, ARRAY['fz-lapsed']);
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second' WHERE channel = 'fz-lapsed';
SELECT pgfence.outbox_enqueue('fz-sent', 'https://fz.example/sent', '{"n": 7}', 'fz-key-sent');
SELECT pgfence.outbox_mark_sent(c.id, c.attempt, '{"http_status": 200}') FROM pgfence.outbox_claim('fz-w1', 1, ARRAY['fz-sent']) c;
SELECT pgfence.outbox_enqueue('fz-failed', 'https://fz.example/failed', '{"n": 8}');
SELECT pgfence.outbox_mark_failed(c.id, c.attempt, 'HTTP 410', false) FROM pgfence.outbox_claim('fz-w1', 1, ARRAY['fz-failed']) c;
SELECT pgfence.outbox_enqueue('fz-dead', 'https://fz.example/dead', '{"n": 9}');
SELECT pgfence.outbox_mark_failed(c.id, c.attempt, 'HTTP 503', true) FROM pgfence.outbox_claim('fz-w1', 1, ARRAY['fz-dead']) c;
SELECT pgfence.outbox_enqueue('fz-retry', 'https://fz.example/retry', '{"n": 10}');
SELECT pgfence.outbox_mark_failed(c.id, c.attempt, 'HTTP 503', true, interval '1 hour') FROM pgfence.outbox_claim('fz-w1', 1, ARRAY['fz-retry']) c;
SELECT pgfence.outbox_enqueue('fz-reaped', 'https://fz.example/reaped', '{"n": 11}');
SELECT pgfence.outbox_claim('fz-w3', 1, ARRAY['fz-reaped']);
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second' WHERE channel = 'fz-reaped';
SELECT pgfence.outbox_reap();
-- ordering keys: a key in flight with one waiting behind it, a key blocked by a dead message
SELECT pgfence.outbox_enqueue('fz-keyed', 'https://fz.example/k', '{"n": 12}', NULL, NULL, NULL, 'fz-order-1');
SELECT pgfence.outbox_enqueue('fz-keyed', 'https://fz.example/k', '{"n": 13}', NULL, NULL, NULL, 'fz-order-1');
SELECT pgfence.outbox_claim('fz-w4', 1, ARRAY['fz-keyed']);
SELECT pgfence.outbox_enqueue('fz-dead', 'https://fz.example/kd', '{"n": 14}', NULL, NULL, NULL, 'fz-order-2');
SELECT pgfence.outbox_enqueue('fz-dead', 'https://fz.example/kd', '{"n": 15}', NULL, NULL, NULL, 'fz-order-2');
SELECT pgfence.outbox_mark_failed(c.id, c.attempt, 'HTTP 503', true) FROM pgfence.outbox_claim('fz-w4', 1, ARRAY['fz-dead']) c;

-- ------------------------------------------------------------------------------------------
-- plan: every status, SQL and external steps, a receipt of each outcome, a compensation, and
-- approved plans whose action was retired, replaced or dropped since
-- ------------------------------------------------------------------------------------------
SELECT pgfence.plan_register_action('fz.act', 'public.fuzz_action(jsonb)', 'fuzz: one effect row per ok run');
SELECT pgfence.plan_register_action('fz.hook', NULL, 'fuzz: an external webhook');
SELECT pgfence.plan_register_action('fz.retired', 'public.fuzz_retired(jsonb)', 'fuzz: retired after approval');
SELECT pgfence.plan_register_action('fz.changing', 'public.fuzz_changing(jsonb)', 'fuzz: replaced after approval');
SELECT pgfence.plan_register_action('fz.gone', 'public.fuzz_gone(jsonb)', 'fuzz: dropped after approval');
-- 1 pending, 2 pending past its expiry, 3 approved, 4 rejected
SELECT pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 1}}, {"action": "fz.hook", "args": {"recipient": "https://fz.example/hook", "payload": {"k": 1}}}]', 'fz-agent', p_idempotency_key => 'fz-plan-key');
SELECT pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 2}}]', 'fz-agent', interval '1 microsecond');
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 3}}, {"action": "fz.act", "args": {"k": 4}}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_reject(pgfence.plan_propose('[{"action": "fz.act"}]', 'fz-agent'), 'fz-ops', 'not now');
-- 5 executing by fz-w1 after one ok step; 6 released between steps; 7 its heartbeat lapsed
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 5}}, {"action": "fz.act", "args": {"k": 6}}, {"action": "fz.act", "args": {"k": 7}}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_start(5, 'fz-w1', interval '1 day');
SELECT outcome FROM pgfence.plan_run_step(5, 'fz-w1', 1);
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 8}}, {"action": "fz.hook", "args": {"recipient": "https://fz.example/hook"}}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_start(6, 'fz-w2', interval '1 day');
SELECT outcome FROM pgfence.plan_run_step(6, 'fz-w2', 1);
SELECT pgfence.plan_release(6, 'fz-w2', 1);
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.hook", "args": {"recipient": "https://fz.example/slow"}}, {"action": "fz.act"}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_start(7, 'fz-w3');
SELECT outcome FROM pgfence.plan_run_step(7, 'fz-w3', 1);
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = 7;
-- 8 executed, 9 failed on an error receipt, 10 compensates 8 (pending)
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 9}}, {"action": "fz.hook", "args": {"recipient": "https://fz.example/done"}}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_start(8, 'fz-w1');
SELECT outcome FROM pgfence.plan_run_step(8, 'fz-w1', 1);
SELECT outcome FROM pgfence.plan_run_step(8, 'fz-w1', 1);
SELECT pgfence.plan_record_step(8, 2, 'fz-w1', 1, true, '{"http_status": 200}');
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.act", "args": {"k": 10}}, {"action": "fz.act", "args": {"fail": true}}, {"action": "fz.act"}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_start(9, 'fz-w1');
SELECT outcome FROM pgfence.plan_run_step(9, 'fz-w1', 1);
SELECT outcome FROM pgfence.plan_run_step(9, 'fz-w1', 1);
SELECT pgfence.plan_compensate(8, '[{"action": "fz.act", "args": {"undo": 9}}]', 'fz-agent');
-- 11 executing at its external step (owned by fz-w2, handed out)
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.hook", "args": {"recipient": "https://fz.example/ext", "payload": {"k": 11}}}, {"action": "fz.act", "args": {"k": 11}}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_start(11, 'fz-w2', interval '1 day');
SELECT outcome FROM pgfence.plan_run_step(11, 'fz-w2', 1);
-- 12, 13, 14: approved, then the action was retired / replaced / dropped
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.retired"}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.changing", "args": {"v": 1}}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_approve(pgfence.plan_propose('[{"action": "fz.gone"}]', 'fz-agent'), 'fz-ops');
SELECT pgfence.plan_retire_action('fz.retired');
CREATE OR REPLACE FUNCTION public.fuzz_changing(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p || '{"changed": true}' $$;
CREATE TABLE IF NOT EXISTS public.fuzz_dropped AS SELECT 'public.fuzz_gone(jsonb)'::regprocedure::oid AS oid;
DROP FUNCTION public.fuzz_gone(jsonb);

-- ------------------------------------------------------------------------------------------
-- operation: queued, running (no intent, intent with and without the key, a reference, lapsed,
-- a cancel request), succeeded, failed, canceled
-- ------------------------------------------------------------------------------------------
SELECT pgfence.operation_request('fz.queued', 'fz-target-1', '{"n": 1}', 'fz-op-key', 'fz-user');
SELECT pgfence.operation_request('fz.claimed', 'fz-target-2');
SELECT pgfence.operation_claim('fz-w1', ARRAY['fz.claimed'], interval '1 day');
SELECT pgfence.operation_request('fz.issued', 'fz-target-3');
SELECT pgfence.operation_begin_issue(c.id, c.fence, true) FROM pgfence.operation_claim('fz-w1', ARRAY['fz.issued'], interval '1 day') c;
SELECT pgfence.operation_request('fz.unsafe', 'fz-target-4');
SELECT pgfence.operation_begin_issue(c.id, c.fence, false) FROM pgfence.operation_claim('fz-w2', ARRAY['fz.unsafe'], interval '1 day') c;
SELECT pgfence.operation_request('fz.polled', 'fz-target-5');
SELECT pgfence.operation_begin_issue(c.id, c.fence, true), pgfence.operation_record_external(c.id, c.fence, 'fz-ref-5'),
       pgfence.operation_poll(c.id, c.fence, '{"state": "running"}')
FROM pgfence.operation_claim('fz-w1', ARRAY['fz.polled'], interval '1 day') c;
SELECT pgfence.operation_request('fz.lapsed', 'fz-target-6');
SELECT pgfence.operation_begin_issue(c.id, c.fence, true), pgfence.operation_record_external(c.id, c.fence, 'fz-ref-6')
FROM pgfence.operation_claim('fz-w3', ARRAY['fz.lapsed']) c;
UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE kind = 'fz.lapsed';
SELECT pgfence.operation_request('fz.cancel', 'fz-target-7');
SELECT pgfence.operation_begin_issue(c.id, c.fence, true), pgfence.operation_record_external(c.id, c.fence, 'fz-ref-7')
FROM pgfence.operation_claim('fz-w1', ARRAY['fz.cancel'], interval '1 day') c;
SELECT pgfence.operation_cancel((SELECT id FROM pgfence.operation WHERE kind = 'fz.cancel'), 'fz-user');
SELECT pgfence.operation_request('fz.done', 'fz-target-8');
SELECT pgfence.operation_begin_issue(c.id, c.fence, true), pgfence.operation_record_external(c.id, c.fence, 'fz-ref-8'),
       pgfence.operation_finish(c.id, c.fence, true, '{"ok": true}')
FROM pgfence.operation_claim('fz-w1', ARRAY['fz.done']) c;
SELECT pgfence.operation_request('fz.done', 'fz-target-9');
SELECT pgfence.operation_finish(c.id, c.fence, false, NULL, 'it broke') FROM pgfence.operation_claim('fz-w1', ARRAY['fz.done']) c;
SELECT pgfence.operation_request('fz.done', 'fz-target-10');
SELECT pgfence.operation_cancel((SELECT id FROM pgfence.operation WHERE target = 'fz-target-10'));

-- ------------------------------------------------------------------------------------------
-- document: live (saved several times, with save receipts), a sheet, deleted, an application
-- kind merged by a function, a small kind
-- ------------------------------------------------------------------------------------------
SELECT pgfence.document_register_kind('fz-fn', 'function', 'public.fuzz_merge(jsonb,jsonb,jsonb)', 'any', 4096, 'fuzz: merged by a function');
SELECT pgfence.document_register_kind('fz-small', 'attributes', NULL, 'object', 64, 'fuzz: 64 bytes at most');
SELECT pgfence.document_create('record', '{"title": "one"}', 'fz-user', 'fz-doc-key');
SELECT pgfence.document_create('record', '{"title": "two", "body": "x"}', 'fz-user');
SELECT outcome FROM pgfence.document_save(2, 1, '{"title": "two", "body": "y"}', 'fz-ann', 'fz-save-1');
SELECT outcome FROM pgfence.document_save(2, 2, '{"title": "two", "body": "z"}', 'fz-bob', 'fz-save-2');
SELECT outcome FROM pgfence.document_save(2, 2, '{"title": "stale"}', 'fz-ann', 'fz-save-3');
SELECT pgfence.document_create('sheet', '[[1, 2], [3, 4]]', 'fz-user');
SELECT pgfence.document_create('record', '{"title": "gone"}', 'fz-user');
SELECT outcome FROM pgfence.document_delete(4, 1, 'fz-user');
SELECT pgfence.document_create('fz-fn', '"text"', 'fz-user');
SELECT pgfence.document_create('fz-small', '{"a": 1}', 'fz-user');

-- ------------------------------------------------------------------------------------------
-- Samples: arguments worth trying that no table holds, in columns named after the arguments
-- they are for (the fuzzer draws p_<name> from columns called <name>)
-- ------------------------------------------------------------------------------------------
CREATE TABLE IF NOT EXISTS public.fuzz_sample (steps jsonb, function regprocedure, merge_function regprocedure,
                                               content jsonb, base jsonb, local jsonb, stored jsonb);
INSERT INTO public.fuzz_sample (steps) VALUES
  ('[{"action": "fz.act", "args": {"k": 100}}]'),
  ('[{"action": "fz.act", "args": {"k": 101}, "note": "two steps"}, {"action": "fz.act", "args": {"k": 102}}]'),
  ('[{"action": "fz.hook", "args": {"recipient": "https://fz.example/s", "payload": {"k": 103}}}, {"action": "fz.act"}]'),
  ('[{"action": "fz.act", "args": {"fail": true}}]'),
  ('[{"action": "fz.retired"}]'),
  ('[{"action": "fz.gone"}]'),
  ('[{"action": "fz.changing", "args": {"v": 2}}]'),
  ('[{"action": "fz.hook", "args": {"recipient": ""}}]'),
  ('[{"action": "fz.act", "args": [1]}]'),
  ('[{"action": "fz.act", "extra": 1}]'),
  ('[]');
INSERT INTO public.fuzz_sample (function) VALUES
  ('public.fuzz_action(jsonb)'), ('public.fuzz_changing(jsonb)'), ('public.fuzz_wrong(text)'),
  ('public.fuzz_merge(jsonb,jsonb,jsonb)'), ('pgfence.backoff(integer,interval,interval,double precision)'),
  ('pg_catalog.jsonb_typeof(jsonb)'), ('999999');
INSERT INTO public.fuzz_sample (merge_function) VALUES
  ('public.fuzz_merge(jsonb,jsonb,jsonb)'), ('public.fuzz_action(jsonb)'), ('pg_catalog.jsonb_concat(jsonb,jsonb)'), ('999999');
INSERT INTO public.fuzz_sample (content, base, local, stored) VALUES
  ('{"title": "new"}', '{"title": "two", "body": "x"}', '{"title": "mine", "body": "x"}', '{"title": "two", "body": "z"}'),
  ('[[1, 2], [3, 5]]', '[[1, 2], [3, 4]]', '[[1, 2], [3, 5]]', '[[0, 2], [3, 4]]'),
  ('{"malformed": true}', '"text"', '{"malformed": true}', '"text"'),
  ('"scalar"', '{"a": 1}', '{"a": 2}', '{"a": 3}');
