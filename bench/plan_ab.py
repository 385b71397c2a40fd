"""A/B of a SQL plan step: base functions (A) against this checkout's (B), one cluster.

Usage: pgfence db run --durable -- python bench/plan_ab.py BASE_FUNCTIONS_DIR [REPS]
Both databases are migrated with this checkout; A then gets the base functions (e.g. main's:
``git -C /work/main archive main functions | tar -x -C /tmp/base``). Per rep, in each database
and for each action (noop, insert): ``CALL plan_execute`` of a 1,000-step plan and the
hand-written runner of ``bench/plan.py`` over 1,000 steps, each measured in steps/s (wall) and
in backend CPU per step (/proc/<pid>/schedstat, ns; for pgfence the CALL only, without the
proposal). A and B alternate within each rep (ABBA
across reps). The summary gives, per action, the medians, the ratio pgfence / hand-written
(steps/s, each rep's own pair), and the paired per-rep difference B - A of the CPU per step
(median, range, reps B lower), with the load average.
"""
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import plan as planbench
from keyed_ab import ab_databases
from pgfence import plan

ACTIONS = ("noop", "insert")


def _run_ns(pid: int) -> int:
    """Run time of a local server process so far, in ns (/proc/<pid>/schedstat, first field)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def _setup(dsn: str) -> None:
    """bench/plan.py's fixtures: tables, action functions, the hand-written runner, actions."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(planbench._SETUP)
        plan.register_action(conn, "bench.noop", "public.bench_plan_noop(jsonb)",
                             "benchmark: return the args")
        plan.register_action(conn, "bench.insert", "public.bench_plan_insert(jsonb)",
                             "benchmark: insert one row")


def _measure(conn: psycopg.Connection[Any], pid: int, action: str,
             tag: int) -> tuple[float, float, float, float]:
    """(pgfence steps/s, pgfence CPU µs/step, hand steps/s, hand CPU µs/step) of one pair.

    The pgfence side counts ``CALL plan_execute`` only (not the proposal and approval)."""
    steps = planbench.STEPS
    plan_id = plan.propose(conn, [{"action": f"bench.{action}", "args": {"plan": str(tag), "step": i}}
                                  for i in range(1, steps + 1)], "bench")
    plan.approve(conn, plan_id, "bench-approver")
    c0 = _run_ns(pid)
    t0 = time.perf_counter()
    result = plan.execute(conn, plan_id, "bench-runner")
    rate = steps / (time.perf_counter() - t0)
    c1 = _run_ns(pid)
    if result.status != "executed":
        raise RuntimeError(f"plan {plan_id} ended {result.status}")
    hand = planbench._one_hand_run(conn, f"public.bench_plan_{action}", tag + 500000)
    c2 = _run_ns(pid)
    return rate, (c1 - c0) / steps / 1000, hand, (c2 - c1) / steps / 1000


def main() -> None:
    """Run the interleaved reps and print each and the summary."""
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 8
    a, b = ab_databases(Path(sys.argv[1]), ("plan_a", "plan_b"))
    dsns = {"A": a, "B": b}
    conns = {}
    for v, dsn in dsns.items():
        _setup(dsn)
        c = psycopg.connect(dsn, autocommit=True)
        conns[v] = (c, c.info.backend_pid)
    res: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {
        (v, act): [] for v in dsns for act in ACTIONS}
    loads = []
    for i in range(reps + 1):  # rep 0 is a warm-up
        for v in (("A", "B") if i % 2 == 0 else ("B", "A")):
            conn, pid = conns[v]
            for act in ACTIONS:
                m = _measure(conn, pid, act, 10000 + i * 10 + ACTIONS.index(act))
                if i > 0:
                    res[(v, act)].append(m)
        load = os.getloadavg()[0]
        if i > 0:
            loads.append(load)
            print(f"rep {i}: " + " | ".join(
                f"{act} A {res[('A', act)][-1][0]:.0f}/s {res[('A', act)][-1][1]:.0f} µs"
                f" ({res[('A', act)][-1][0] / res[('A', act)][-1][2]:.2f}x)"
                f" B {res[('B', act)][-1][0]:.0f}/s {res[('B', act)][-1][1]:.0f} µs"
                f" ({res[('B', act)][-1][0] / res[('B', act)][-1][2]:.2f}x)"
                f" hand {res[('B', act)][-1][3]:.0f} µs" for act in ACTIONS)
                  + f" | load {load:.1f}", flush=True)
    print(f"{reps} reps, load {min(loads):.1f}-{max(loads):.1f}")
    for act in ACTIONS:
        for v in dsns:
            r = res[(v, act)]
            ratios = [x[0] / x[2] for x in r]
            print(f"{act} {v}: {statistics.median(x[0] for x in r):.0f} steps/s,"
                  f" CPU {statistics.median(x[1] for x in r):.0f} µs/step;"
                  f" hand-written {statistics.median(x[2] for x in r):.0f} steps/s,"
                  f" CPU {statistics.median(x[3] for x in r):.0f} µs/step;"
                  f" ratio median {statistics.median(ratios):.2f}x"
                  f" (range {min(ratios):.2f}-{max(ratios):.2f})")
        d = [bb[1] - aa[1] for aa, bb in zip(res[("A", act)], res[("B", act)], strict=True)]
        print(f"{act} CPU B - A: median {statistics.median(d):+.0f} µs/step"
              f" (range {min(d):+.0f}..{max(d):+.0f}), B lower in {sum(x < 0 for x in d)} of {len(d)}")
    for c, _ in conns.values():
        c.close()


if __name__ == "__main__":
    main()
