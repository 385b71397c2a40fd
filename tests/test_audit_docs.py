"""``docs/psql.md`` cannot rot: every ```sql block in it runs, in order, through ``psql`` with
``ON_ERROR_STOP``, against a migrated database holding what the demo leaves behind (the same ids:
outbox message 8 killed mid-delivery, plan 1 interrupted during its external step 3, plan 3
failed on a CHECK violation, operation 1 taken over after its executor died, documents with
conflicts). Some blocks must also show what the guide says they show.

To check the guide against the real demo database instead: run ``pgfence demo --keep``, then
``PGFENCE_DOCS_DSN=<the DATABASE_URL it printed> pytest tests/test_audit_docs.py`` (the blocks
change that database: they make items stuck, requeue, compensate and purge, as the guide tells
an operator to).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

DOC = Path(__file__).resolve().parents[1] / "docs" / "psql.md"

# The demo's data, by SQL: the same ids and states the guide's queries and samples refer to.
SEED = r"""
CREATE TABLE public.demo_inventory (sku text PRIMARY KEY, qty integer NOT NULL CHECK (qty >= 0));
CREATE FUNCTION public.demo_adjust_stock(p jsonb) RETURNS jsonb LANGUAGE plpgsql SET search_path = public AS $$
DECLARE v_qty integer;
BEGIN
  INSERT INTO demo_inventory AS i (sku, qty) VALUES (p ->> 'sku', (p ->> 'delta')::int)
  ON CONFLICT (sku) DO UPDATE SET qty = i.qty + (p ->> 'delta')::int
  RETURNING qty INTO v_qty;
  RETURN jsonb_build_object('sku', p ->> 'sku', 'qty', v_qty);
END $$;
INSERT INTO public.demo_inventory VALUES ('widget-demo', 5), ('gadget-demo', 5), ('gizmo-demo', 5);
SELECT pgfence.plan_register_action('demo.adjust_stock', 'public.demo_adjust_stock(jsonb)', 'add delta to a SKU''s stock');
SELECT pgfence.plan_register_action('demo.notify', NULL, 'POST an event to the shop''s webhook');
SELECT pgfence.outbox_configure_channel(c, 5, '200 milliseconds', '2 seconds', '10 seconds', true)
FROM unnest(ARRAY['hooks', 'mail', 'slow-hooks']) AS c;

-- outbox 1..8: sent, sent after a 503, failed (410), sent x4, and 8: its first worker died
CREATE FUNCTION pg_temp.deliver(p_channel text, p_key text, p_fail text DEFAULT NULL, p_retryable boolean DEFAULT true)
RETURNS bigint LANGUAGE plpgsql AS $$
DECLARE v_id bigint; v_attempt integer;
BEGIN
  v_id := pgfence.outbox_enqueue(p_channel, 'http://127.0.0.1:9/' || p_key, jsonb_build_object('key', p_key), p_key);
  SELECT c.attempt INTO v_attempt FROM pgfence.outbox_claim('executor-1', 1, ARRAY[p_channel]) c;
  IF p_fail IS NULL THEN
    PERFORM pgfence.outbox_mark_sent(v_id, v_attempt, '{"http_status": 200}');
  ELSE
    PERFORM pgfence.outbox_mark_failed(v_id, v_attempt, p_fail, p_retryable);
  END IF;
  RETURN v_id;
END $$;
SELECT pg_temp.deliver('hooks', 'order-1001');
SELECT pg_temp.deliver('hooks', 'order-1002', 'HTTP 503');
UPDATE pgfence.outbox SET next_attempt_at = now() WHERE id = 2;
SELECT pgfence.outbox_mark_sent(2, c.attempt) FROM pgfence.outbox_claim('executor-1', 1, ARRAY['hooks']) c;
SELECT pg_temp.deliver('hooks', 'order-1003', 'HTTP 410 Gone', false);
SELECT pg_temp.deliver('hooks', 'reminder-1001');
SELECT pg_temp.deliver('mail', 'mail-1001');
SELECT pg_temp.deliver('hooks', 'order-1005');
SELECT pg_temp.deliver('hooks', 'order-1006');
SELECT pgfence.outbox_enqueue('slow-hooks', 'http://127.0.0.1:9/slow', '{"event": "slow"}', 'order-1004');
SELECT pgfence.outbox_claim('executor-1', 1, ARRAY['slow-hooks']);
UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second' WHERE id = 8;
SELECT pgfence.outbox_reap();
UPDATE pgfence.outbox SET next_attempt_at = now() WHERE id = 8;
SELECT pgfence.outbox_mark_sent(8, c.attempt, '{"http_status": 200}') FROM pgfence.outbox_claim('executor-2', 1, ARRAY['slow-hooks']) c;

-- plan 1: executor-1 died during external step 3; plan 2 compensates it; plan 3 fails at step 3
SELECT pgfence.plan_propose('[
  {"action": "demo.adjust_stock", "args": {"sku": "widget-demo", "delta": 50}},
  {"action": "demo.adjust_stock", "args": {"sku": "gadget-demo", "delta": 20}},
  {"action": "demo.notify", "args": {"recipient": "http://127.0.0.1:9/slow", "payload": {"event": "restocked"}}},
  {"action": "demo.adjust_stock", "args": {"sku": "gizmo-demo", "delta": 10}}]', 'agent', p_idempotency_key => 'restock-demo');
SELECT pgfence.plan_approve(1, 'dana (ops)');
SELECT pgfence.plan_start(1, 'executor-1', interval '2 seconds');
SELECT outcome FROM pgfence.plan_run_step(1, 'executor-1', 1);
SELECT outcome FROM pgfence.plan_run_step(1, 'executor-1', 1);
SELECT outcome FROM pgfence.plan_run_step(1, 'executor-1', 1);
UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' WHERE id = 1;
SELECT pgfence.plan_reap();
SELECT pgfence.plan_compensate(1, '[
  {"action": "demo.adjust_stock", "args": {"sku": "widget-demo", "delta": -50}},
  {"action": "demo.adjust_stock", "args": {"sku": "gadget-demo", "delta": -20}},
  {"action": "demo.notify", "args": {"recipient": "http://127.0.0.1:9/ok", "payload": {"event": "restock-cancelled"}}}]', 'agent');
SELECT pgfence.plan_approve(2, 'dana (ops)');
SELECT pgfence.plan_start(2, 'executor-2');
SELECT outcome FROM pgfence.plan_run_step(2, 'executor-2', 1);
SELECT outcome FROM pgfence.plan_run_step(2, 'executor-2', 1);
SELECT outcome FROM pgfence.plan_run_step(2, 'executor-2', 1);
SELECT pgfence.plan_record_step(2, 3, 'executor-2', 1, true, '{"http_status": 200}');
SELECT pgfence.plan_propose('[
  {"action": "demo.adjust_stock", "args": {"sku": "widget-demo", "delta": 1}},
  {"action": "demo.adjust_stock", "args": {"sku": "gadget-demo", "delta": 1}},
  {"action": "demo.adjust_stock", "args": {"sku": "gizmo-demo", "delta": -1000}},
  {"action": "demo.adjust_stock", "args": {"sku": "widget-demo", "delta": 1}}]', 'agent');
SELECT pgfence.plan_approve(3, 'dana (ops)');
CALL pgfence.plan_execute(3, 'sql-runner');

-- operation 1: issued once by executor-1, which died; executor-2 took over and only polled
SELECT id FROM pgfence.operation_request('branch.reset', 'dev-demo', '{"from": "main"}', 'reset-dev-demo-1', 'alice');
SELECT fence FROM pgfence.operation_claim('executor-1', ARRAY['branch.reset'], interval '4 seconds');
SELECT pgfence.operation_begin_issue(1, 1, true);
SELECT pgfence.operation_record_external(1, 1, 'sim-demo');
SELECT pgfence.operation_poll(1, 1, '{"status": "queued"}');
UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second' WHERE id = 1;
SELECT fence FROM pgfence.operation_claim('executor-2', ARRAY['branch.reset'], interval '4 seconds');
SELECT pgfence.operation_poll(1, 2, '{"status": "done"}');
SELECT pgfence.operation_finish(1, 2, true, '{"ok": true}');

-- documents 1 (record: saves and conflicts) and 2 (sheet)
SELECT pgfence.document_create('record', '{"title": "v1"}', 'setup');
SELECT outcome FROM pgfence.document_save(1, 1, '{"title": "ann"}', 'ann', 'save-ann-1');
SELECT outcome FROM pgfence.document_save(1, 1, '{"title": "bob"}', 'bob', 'save-bob-1');
SELECT outcome FROM pgfence.document_save(1, 2, '{"title": "bob"}', 'bob', 'save-bob-2');
SELECT outcome FROM pgfence.document_save(1, 2, '{"title": "bob"}', 'bob', 'save-bob-2');
SELECT pgfence.document_create('sheet', '[["a"]]', 'ann');
SELECT outcome FROM pgfence.document_save(2, 1, '[["b"]]', 'bob');
"""

# (a piece of a block, a piece its output must contain): the guide's claims about its queries.
EXPECT = [
    ("FROM pgfence.audit_stuck\nORDER BY overdue DESC", "executor-9"),
    ("SELECT pgfence.outbox_reap(), pgfence.plan_reap()", "1 |"),
    ("audit_owner_of('plan', 4)", "executor-9"),
    ("FROM pgfence.audit_timeline('outbox', 8);", "executor-2"),
    ("FROM pgfence.audit_timeline('plan', 3);", "23514"),
    ("FROM pgfence.audit_timeline('plan', 1);", "pgfence-plan-1-step-3"),
    ("FROM pgfence.audit_timeline('operation', 1);", "takeover"),
    ("FROM pgfence.audit_duplicates\nORDER BY since DESC;", "external_step_in_doubt"),
    ("FROM pgfence.audit_duplicates\nORDER BY since DESC;", "order-1004"),
    ("outbox_list('hooks', 'failed')", "410"),
    ("SELECT pgfence.outbox_requeue(3);", " t"),
    ("ORDER BY conflicts_1h DESC, conflicts_24h DESC", "bob"),
    ("FROM pgfence.audit_timeline('document', 1);", "conflict"),
]


def sql_blocks(markdown: str) -> list[str]:
    """The ```sql blocks of a markdown text, in order, dedented (blocks inside list items)."""
    blocks = re.findall(r"^( *)```sql\n(.*?)^\1```", markdown, flags=re.S | re.M)
    return [textwrap.dedent(body) for _, body in blocks]


def psql(dsn: str, sql: str, tmp: Path) -> subprocess.CompletedProcess[str]:
    exe = shutil.which("psql")
    assert exe, "psql (postgresql-client) is needed to check docs/psql.md"
    path = tmp / "block.sql"
    path.write_text(sql)
    return subprocess.run([exe, "-X", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(path)],
                          capture_output=True, text=True, timeout=60, check=False)


def test_the_guide_has_a_query_for_every_question() -> None:
    blocks = sql_blocks(DOC.read_text())
    assert len(blocks) >= 20
    text = "\n".join(blocks)
    for thing in ("pgfence.audit_stuck", "pgfence.audit_owner_of(", "pgfence.audit_owned",
                  "pgfence.audit_timeline(", "pgfence.audit_duplicates", "pgfence.audit_queue_health",
                  "pgfence.audit_documents", "CALL pgfence.audit_purge("):
        assert thing in text, thing
    for piece, _ in EXPECT:
        assert any(piece in b for b in blocks), f"no block contains {piece!r}"


@pytest.mark.timeout(120)
def test_every_sql_block_in_the_guide_runs(db: str, tmp_path: Path) -> None:
    dsn = os.environ.get("PGFENCE_DOCS_DSN") or db
    if dsn == db:
        seeded = psql(db, SEED, tmp_path)  # one statement per transaction, as a DBA's psql does
        assert seeded.returncode == 0, seeded.stderr
    outputs: list[tuple[str, str]] = []
    for block in sql_blocks(DOC.read_text()):
        proc = psql(dsn, block, tmp_path)
        assert proc.returncode == 0, f"this block of docs/psql.md failed:\n{block}\n{proc.stderr}"
        outputs.append((block, proc.stdout))
    for piece, shown in EXPECT:
        out = "".join(o for b, o in outputs if piece in b)
        assert shown in out, f"the block with {piece!r} does not show {shown!r}:\n{out}"
