"""Claims benchmark: does a claim cost the same with many runs in flight and a long queue?

Workloads (issue 14), each printed as buffers per call (shared hits + reads, from ``EXPLAIN
(ANALYZE, BUFFERS)`` of the call: the statements nested in the function count too) and the
median time of a call:

- ``plan_claim`` with 200, 2,000 and 20,000 runs in flight (executing, owned, live heartbeat),
  a few approved plans and released runs waiting. One session keeps its plans across the sizes,
  as an executor's session does (its generic plan was made at 200); the table is analysed after
  each growth (VACUUM ANALYZE), as autovacuum would. Target: buffers per call at 20,000 within 1.5x of 200.
- ``operation_claim`` for one kind with 10,000 and 1,000,000 operations of it queued (filled with
  one ``INSERT ... SELECT generate_series``, triggers off for the fill), vacuumed and analysed. Measured with
  the function's ``jit = off`` (functions/98_hot_paths.sql) and, in the same run, with that
  setting reset for the function (what it was before issue 14: the server's ``jit = on`` and
  ``jit_above_cost``). Target: buffers within 1.5x from 10k to 1M, and no JIT (time at 1M within
  1.5x of 10k).

``run(dsn)`` returns the numbers and the ratios; ``python bench/claims.py`` runs against
``$DATABASE_URL``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from typing import Any

import psycopg

from pgfence.migrate import migrate

IN_FLIGHT = (200, 2000, 20000)
QUEUED = (10_000, 1_000_000)
CALLS = 30
TARGET = 1.5

_PLAN_SETUP = """
CREATE OR REPLACE FUNCTION public.bench_claims_noop(p jsonb) RETURNS jsonb
  LANGUAGE sql AS $$ SELECT p $$;
SELECT pgfence.plan_register_action('bench.claims', 'public.bench_claims_noop(jsonb)',
                                    'benchmark: return the args');
"""
_MOVES = {
    "executing": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w1', '1 day');",
    "approved": "PERFORM pgfence.plan_approve(v, 'bob');",
    "released": "PERFORM pgfence.plan_approve(v, 'bob'); PERFORM pgfence.plan_start(v, 'w1', '1 day');"
                " PERFORM pgfence.plan_release(v, 'w1', 1);",
}


def _plans(conn: psycopg.Connection[Any], n: int, state: str) -> None:
    steps = '[{"action": "bench.claims"}, {"action": "bench.claims"}]'
    conn.execute(f"""DO $$ DECLARE v bigint; BEGIN FOR i IN 1..{n} LOOP
                       v := pgfence.plan_propose('{steps}', 'alice'); {_MOVES[state]}
                     END LOOP; END $$""")


def _buffers(conn: psycopg.Connection[Any], sql: str) -> int:
    row = conn.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + sql).fetchone()
    assert row is not None
    top = row[0][0]["Plan"]
    return int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0))


def _ms(conn: psycopg.Connection[Any], sql: str) -> float:
    t0 = time.perf_counter()
    conn.execute(sql).fetchall()
    return (time.perf_counter() - t0) * 1000


def plan_claim(dsn: str) -> dict[str, Any]:
    """Buffers and median ms per plan_claim(batch 1) at each count of runs in flight."""
    out: dict[str, Any] = {}
    with psycopg.connect(dsn, autocommit=True) as conn, \
            psycopg.connect(dsn, autocommit=True) as executor:
        conn.execute(_PLAN_SETUP)
        have = 0
        for n in IN_FLIGHT:
            _plans(conn, n - have, "executing")
            have = n
            # the fill leaves every run's approved row version dead in plan_approved_idx:
            # vacuumed, as autovacuum would, so that what is measured is the runs in flight
            conn.execute("VACUUM ANALYZE pgfence.plan, pgfence.plan_step")
            _plans(conn, CALLS, "approved")
            _plans(conn, 2 * CALLS, "released")
            sql = "SELECT * FROM pgfence.plan_claim('w2', 1)"
            buffers = [_buffers(executor, sql) for _ in range(CALLS)]
            times = [_ms(executor, sql) for _ in range(CALLS)]
            out[str(n)] = {"buffers": statistics.median(buffers),
                           "p50_ms": round(statistics.median(times), 3)}
    first, last = out[str(IN_FLIGHT[0])], out[str(IN_FLIGHT[-1])]
    out["buffers_ratio"] = round(last["buffers"] / first["buffers"], 2)
    return out


def _fill_operations(conn: psycopg.Connection[Any], kind: str, n: int, first: int) -> None:
    # A bench fixture, not an API: triggers off (session_replication_role) for a fill of fresh
    # requests, which is what operation_request would insert, a million times faster.
    conn.execute("SET session_replication_role = replica")
    conn.execute(
        "INSERT INTO pgfence.operation (kind, target, params, requested_by)"
        " SELECT %s, 'target-' || i, '{}', 'bench' FROM generate_series(%s::bigint, %s::bigint) i",
        (kind, first, first + n - 1))
    conn.execute("RESET session_replication_role")
    conn.execute("VACUUM ANALYZE pgfence.operation")


def operation_claim(dsn: str) -> dict[str, Any]:
    """Buffers and median ms per operation_claim(one kind) at 10k and 1M queued, jit off / reset."""
    out: dict[str, Any] = {}
    sig = "pgfence.operation_claim(text, text[], interval, integer)"
    with psycopg.connect(dsn, autocommit=True) as conn:
        have = 0
        for n in QUEUED:
            _fill_operations(conn, "bench.op", n - have, have + 1)
            have = n
            res: dict[str, Any] = {}
            for variant in ("jit_off", "jit_reset"):
                if variant == "jit_reset":
                    conn.execute(f"ALTER FUNCTION {sig} RESET jit")
                try:
                    # a new session per variant: its plans are made under these statistics
                    with psycopg.connect(dsn, autocommit=True) as executor:
                        executor.execute("SET jit = on")
                        sql = "SELECT * FROM pgfence.operation_claim('w1', ARRAY['bench.op'])"
                        buffers = [_buffers(executor, sql) for _ in range(CALLS)]
                        times = [_ms(executor, sql) for _ in range(CALLS)]
                finally:
                    conn.execute(f"ALTER FUNCTION {sig} SET jit = off")
                res[variant] = {"buffers": statistics.median(buffers),
                                "p50_ms": round(statistics.median(times), 3)}
            out[str(n)] = res
    first, last = out[str(QUEUED[0])]["jit_off"], out[str(QUEUED[-1])]["jit_off"]
    out["buffers_ratio"] = round(last["buffers"] / first["buffers"], 2)
    out["p50_ratio"] = round(last["p50_ms"] / first["p50_ms"], 2)
    return out


def _verdict(ok: bool) -> str:
    return "MET" if ok else "MISSED"


def run(dsn: str) -> dict[str, Any]:
    """Both workloads; prints a table and the targets; returns the numbers."""
    migrate(dsn)
    print("claims: buffers per call and median ms, as runs in flight and the queue grow", flush=True)
    res: dict[str, Any] = {"plan_claim": plan_claim(dsn)}
    pc = res["plan_claim"]
    for n in IN_FLIGHT:
        print(f"  plan_claim, {n:>6} runs in flight: {pc[str(n)]['buffers']:>6} buffers,"
              f" {pc[str(n)]['p50_ms']} ms")
    print(f"  target: buffers at {IN_FLIGHT[-1]} <= {TARGET}x at {IN_FLIGHT[0]}:"
          f" {pc['buffers_ratio']}x {_verdict(pc['buffers_ratio'] <= TARGET)}", flush=True)
    res["operation_claim"] = operation_claim(dsn)
    oc = res["operation_claim"]
    for n in QUEUED:
        on, reset = oc[str(n)]["jit_off"], oc[str(n)]["jit_reset"]
        print(f"  operation_claim, {n:>8} queued: {on['buffers']:>6} buffers, {on['p50_ms']} ms"
              f" (jit = off); {reset['buffers']} buffers, {reset['p50_ms']} ms (jit reset, as before)")
    print(f"  target: buffers at {QUEUED[-1]} <= {TARGET}x at {QUEUED[0]}: {oc['buffers_ratio']}x"
          f" {_verdict(oc['buffers_ratio'] <= TARGET)}; time {oc['p50_ratio']}x"
          f" {_verdict(oc['p50_ratio'] <= TARGET)}")
    return res


def main() -> int:
    dsn = os.environ.get("DATABASE_URL")
    if not dsn:
        print("set DATABASE_URL, or: pgfence db run --durable -- python bench/claims.py",
              file=sys.stderr)
        return 2
    print(json.dumps(run(dsn), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
