"""Plan benchmark: steps per second of ``CALL pgfence.plan_execute`` on 1,000-step plans.

Each step is its own committed transaction (lock the plan row, run the action in a
subtransaction, write the receipt, move the plan on, log the receipt event), so with fsync on
the number is bounded by commit latency. Two trivial SQL actions are measured:

- ``noop``: returns its args (the pure cost of pgfence's per-step bookkeeping);
- ``insert``: inserts one row into a table (a step with a real database effect).

``run(dsn)`` is what ``bench/run.py`` calls; it migrates the database (a no-op when up to
date), creates its fixtures (table ``public.bench_plan_rows``, two functions, two actions),
runs each variant ``repeats`` times and returns the numbers. Standalone:
``pgfence db run --durable -- python bench/plan.py`` (or with ``DATABASE_URL`` set).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg

from pgfence import plan
from pgfence.migrate import migrate

STEPS = 1000

_SETUP = """
CREATE TABLE IF NOT EXISTS public.bench_plan_rows (plan_id bigint, step int, PRIMARY KEY (plan_id, step));
CREATE OR REPLACE FUNCTION public.bench_plan_noop(p jsonb) RETURNS jsonb
  LANGUAGE sql AS $$ SELECT p $$;
CREATE OR REPLACE FUNCTION public.bench_plan_insert(p jsonb) RETURNS jsonb
  LANGUAGE sql SET search_path = public AS $$
  INSERT INTO bench_plan_rows VALUES ((p ->> 'plan')::bigint, (p ->> 'step')::int);
  SELECT '{}'::jsonb
$$;
"""


def _one_run(conn: psycopg.Connection[Any], action: str, tag: str) -> float:
    """Propose, approve and CALL plan_execute one 1,000-step plan; return its steps/s."""
    steps = [{"action": action, "args": {"plan": tag, "step": i}} for i in range(1, STEPS + 1)]
    pid = plan.propose(conn, steps, "bench")
    plan.approve(conn, pid, "bench-approver")
    started = time.perf_counter()
    result = plan.execute(conn, pid, "bench-runner")
    elapsed = time.perf_counter() - started
    if result.status != "executed" or len(result.receipts) != STEPS:
        raise RuntimeError(f"plan {pid} ended {result.status} with {len(result.receipts)} receipts")
    return STEPS / elapsed


def run(dsn: str, repeats: int = 3) -> dict[str, Any]:
    """Measure; returns ``{"steps": 1000, "<variant>_steps_per_s": median, ...}``."""
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(_SETUP)
        conn.execute("TRUNCATE public.bench_plan_rows")
        plan.register_action(conn, "bench.noop", "public.bench_plan_noop(jsonb)",
                             "benchmark: return the args")
        plan.register_action(conn, "bench.insert", "public.bench_plan_insert(jsonb)",
                             "benchmark: insert one row")
        fsync = conn.execute("SHOW fsync").fetchone()
        sync_commit = conn.execute("SHOW synchronous_commit").fetchone()
        out: dict[str, Any] = {
            "steps": STEPS, "repeats": repeats,
            "fsync": fsync[0] if fsync else None,
            "synchronous_commit": sync_commit[0] if sync_commit else None,
        }
        for variant in ("noop", "insert"):
            rates = [_one_run(conn, f"bench.{variant}", f"{i}") for i in range(repeats)]
            out[f"{variant}_steps_per_s"] = round(statistics.median(rates), 1)
            out[f"{variant}_runs"] = [round(r, 1) for r in rates]
    print(f"plan: CALL plan_execute, {STEPS}-step plan, median of {repeats}: "
          f"{out['noop_steps_per_s']} steps/s (noop action), "
          f"{out['insert_steps_per_s']} steps/s (one INSERT per step); "
          f"fsync={out['fsync']}, synchronous_commit={out['synchronous_commit']}")
    return out


def main() -> int:
    dsn = os.environ.get("DATABASE_URL")
    if not dsn:
        print("set DATABASE_URL, or: pgfence db run --durable -- python bench/plan.py",
              file=sys.stderr)
        return 2
    print(json.dumps(run(dsn), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
