"""No hot function JIT-compiles: the catalog says ``jit=off`` for each (functions/98_hot_paths.sql).

A claim's cost estimate crosses ``jit_above_cost`` once a table holds about a million rows, and
then every call compiles its statement again (operation_claim at 1M queued: 7.4 ms a call instead
of 0.65 ms). The hot functions are every claim, settle, save and step function and the reapers:
the list below, and any function pinned to generic plans (``plan_cache_mode=force_generic_plan``
in ``pg_proc.proconfig``: pinned because it runs per item), so a new pinned function without the
setting fails here too.
"""

from __future__ import annotations

from typing import Any

import psycopg

HOT = {
    "outbox": ["outbox_enqueue", "outbox_enqueue_many", "outbox_claim", "outbox_next_due",
               "outbox_mark_sent", "outbox_mark_sent_many", "outbox_mark_sent_and_claim",
               "outbox_mark_failed", "outbox_settle_and_claim", "outbox_reap"],
    "plan": ["plan_claim", "plan_start", "plan_release", "plan_heartbeat", "plan_approve",
             "plan_reject", "_plan_step_begin", "_plan_step_finish", "plan_record_step",
             "plan_reap"],
    "operation": ["operation_request", "operation_claim", "operation_begin_issue",
                  "operation_record_external", "operation_poll", "operation_finish",
                  "operation_release", "operation_reap"],
    "document": ["document_create", "document_save", "document_delete"],
}

SQL_FUNCTIONS = """
SELECT p.proname, p.oid::regprocedure::text, coalesce(p.proconfig, '{}')
FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.prokind = 'f'
"""


def _catalog(conn: psycopg.Connection[Any]) -> dict[str, list[tuple[str, list[str]]]]:
    out: dict[str, list[tuple[str, list[str]]]] = {}
    for name, signature, config in conn.execute(SQL_FUNCTIONS):
        out.setdefault(name, []).append((signature, list(config)))
    return out


def test_every_listed_hot_function_has_jit_off(conn: psycopg.Connection[Any]) -> None:
    catalog = _catalog(conn)
    missing = [name for names in HOT.values() for name in names if name not in catalog]
    assert missing == [], f"listed as hot but not in the catalog (renamed?): {missing}"
    without = [signature for names in HOT.values() for name in names
               for signature, config in catalog[name] if "jit=off" not in config]
    assert without == [], f"hot functions that may JIT-compile: {without}"


def test_every_pinned_function_has_jit_off(conn: psycopg.Connection[Any]) -> None:
    pinned = [(signature, config) for overloads in _catalog(conn).values()
              for signature, config in overloads
              if "plan_cache_mode=force_generic_plan" in config]
    assert len(pinned) >= 10, pinned
    without = [signature for signature, config in pinned if "jit=off" not in config]
    assert without == [], f"pinned to generic plans (a per-item function) without jit=off: {without}"


def test_jit_is_off_inside_a_hot_call_and_back_after(conn: psycopg.Connection[Any]) -> None:
    # A SET clause holds for the call (and what it runs: its triggers, nested calls), never after.
    conn.execute("SET jit = on")
    conn.execute("CREATE FUNCTION public.seen_jit(jsonb) RETURNS jsonb LANGUAGE sql"
                 " AS $$ SELECT jsonb_build_object('jit', current_setting('jit')) $$")
    conn.execute("SELECT pgfence.plan_register_action('seen', 'public.seen_jit(jsonb)', 'x')")
    row = conn.execute("SELECT pgfence.plan_propose('[{\"action\": \"seen\"}]', 'alice')").fetchone()
    assert row is not None
    plan_id = row[0]
    conn.execute("SELECT pgfence.plan_approve(%s, 'bob')", (plan_id,))
    claimed = conn.execute("SELECT id, run_token FROM pgfence.plan_claim('w1')").fetchall()
    assert [c[0] for c in claimed] == [plan_id]
    # the action runs inside plan_run_step, which keeps the caller's settings
    out = conn.execute("SELECT output FROM pgfence.plan_run_step(%s, 'w1', %s)",
                       (plan_id, claimed[0][1])).fetchone()
    assert out is not None and out[0] == {"jit": "on"}
    setting = conn.execute("SHOW jit").fetchone()
    assert setting is not None and setting[0] == "on"
