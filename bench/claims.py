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

- ``operation_claim`` under a pinned snapshot: one executor session claims (batch 1, one kind)
  and finishes PINNED_OPS operations one at a time, clean and with one ``REPEATABLE READ``
  snapshot held open on another connection for the whole run (the entries of claimed operations
  then stay at the front of the kind's queue index), and pinned with 1-second leases (the dead
  entries of finished leases then lie below ``now()`` in ``operation_lease_idx``, which the
  lapsed-lease walk reads from its front). p50/p99 of the claim call (client side) and the
  backend's CPU per claim (``/proc/<pid>/schedstat``), and the buffers of every 10th claim (median
  and last: under a pinned snapshot a walk from the front reads more the longer the run), side by
  side. Targets: pinned p50, and the last claim's buffers, within 1.5x of clean
  (docs/design.md#operation-claim-hint). The buffers are what a loaded machine does not disturb.

``run(dsn)`` returns the numbers and the ratios; ``python bench/claims.py`` runs against
``$DATABASE_URL``.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

from pgfence.migrate import migrate

PINNED_OPS = int(os.environ.get("PGFENCE_BENCH_PINNED_OPS", "5000"))
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


def _run_ns(pid: int) -> int:
    """Run time of a local server process so far, in ns (/proc/<pid>/schedstat, first field)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def _reset_operations(conn: psycopg.Connection[Any], n: int) -> None:
    """An empty operation table (the owner's purge switch), then n fresh requests of one kind."""
    with conn.transaction():
        conn.execute("SET LOCAL pgfence.purging = on")
        conn.execute("DELETE FROM pgfence.operation")
        conn.execute("DELETE FROM pgfence.event")
    conn.execute("VACUUM ANALYZE pgfence.operation, pgfence.event")
    conn.execute(f"""DO $$ BEGIN FOR i IN 1..{n} LOOP
                       PERFORM pgfence.operation_request('bench.pin', 'target-' || i);
                     END LOOP; END $$""")
    conn.execute("ANALYZE pgfence.operation")


def operation_pinned_run(dsn: str, pinned: bool, lease: str = "2 minutes",
                         n: int = PINNED_OPS) -> dict[str, Any]:
    """Claim (batch 1, kind bench.pin) and finish n operations in one session; with ``pinned``,
    a REPEATABLE READ snapshot taken before the first claim is held open on another connection
    until the last. Returns p50/p99 of the claim (ms, client side) and the claimer backend's
    median CPU per claim (µs)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        _reset_operations(conn, n)
    holder = psycopg.connect(dsn)
    lat: list[float] = []
    cpu: list[float] = []
    bufs: list[int] = []
    try:
        if pinned:
            holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
            holder.execute("SELECT count(*) FROM pgfence.operation").fetchone()  # takes the snapshot
        with psycopg.connect(dsn, autocommit=True) as ex:
            pid = ex.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            claim = ("SELECT id, fence FROM pgfence.operation_claim('bench-w', ARRAY['bench.pin'],"
                     " %s::interval, 1)")
            i = 0
            while True:
                i += 1
                if i % 10 == 0:  # every 10th claim under EXPLAIN: its buffers (not timed)
                    plan = ex.execute("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) " + claim, (lease,)).fetchone()
                    assert plan is not None
                    top = plan[0][0]["Plan"]
                    if top["Actual Rows"] == 0:
                        break
                    bufs.append(int(top.get("Shared Hit Blocks", 0)) + int(top.get("Shared Read Blocks", 0)))
                    rows = ex.execute("SELECT id, fence FROM pgfence.operation WHERE locked_by = 'bench-w'"
                                      " AND status = 'running'").fetchall()
                else:
                    c0 = _run_ns(pid)
                    t0 = time.perf_counter()
                    rows = ex.execute(claim, (lease,)).fetchall()
                    t1 = time.perf_counter()
                    c1 = _run_ns(pid)
                    if not rows:
                        break
                    lat.append((t1 - t0) * 1000)
                    cpu.append((c1 - c0) / 1000)
                ex.execute("SELECT pgfence.operation_finish(%s, %s, false)", rows[0])
    finally:
        holder.rollback()
        holder.close()
    assert len(lat) + len(bufs) == n, (len(lat), len(bufs), n)
    q = statistics.quantiles(lat, n=100)
    return {"pinned": pinned, "lease": lease, "claims": n, "p50_ms": round(statistics.median(lat), 3),
            "p99_ms": round(q[98], 3), "cpu_us": round(statistics.median(cpu), 1),
            "buffers": statistics.median(bufs), "buffers_last": bufs[-1]}


PINNED_CASES = (("clean", False, "2 minutes"), ("pinned", True, "2 minutes"),
                ("pinned, 1 s leases", True, "1 second"))


def operation_pinned(dsn: str) -> dict[str, Any]:
    """The three cases of ``operation_pinned_run`` in one run, with the pinned/clean ratios."""
    out: dict[str, Any] = {name: operation_pinned_run(dsn, pinned, lease)
                           for name, pinned, lease in PINNED_CASES}
    for name, _, _ in PINNED_CASES[1:]:
        out[name]["p50_ratio"] = round(out[name]["p50_ms"] / out["clean"]["p50_ms"], 2)
        out[name]["p99_ratio"] = round(out[name]["p99_ms"] / out["clean"]["p99_ms"], 2)
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
    res["operation_pinned"] = operation_pinned(dsn)
    _print_pinned(res["operation_pinned"])
    return res


def _print_pinned(op: dict[str, Any]) -> None:
    print(f"  operation_claim + finish, {PINNED_OPS} operations, one session:")
    for name, _, _ in PINNED_CASES:
        r = op[name]
        ratio = f"  ({r['p50_ratio']}x / {r['p99_ratio']}x clean)" if "p50_ratio" in r else ""
        print(f"    {name:19} p50 {r['p50_ms']:.3f} ms, p99 {r['p99_ms']:.3f} ms,"
              f" {r['cpu_us']:.0f} µs backend CPU, {r['buffers']:.0f} buffers"
              f" (last {r['buffers_last']}){ratio}")
    print(f"  target: pinned claim p50 <= {TARGET}x clean: {op['pinned']['p50_ratio']}x"
          f" {_verdict(op['pinned']['p50_ratio'] <= TARGET)}")
    bufs = op["pinned"]["buffers_last"] / op["clean"]["buffers_last"]
    print(f"  target: pinned claim buffers (last claim) <= {TARGET}x clean: {bufs:.2f}x"
          f" {_verdict(bufs <= TARGET)}")


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
