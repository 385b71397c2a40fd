"""Wake-up latency of two executor variants, paired message by message on a busy machine.

Usage: pgfence db run --durable -- python bench/wake_ab.py A B [SAMPLES [GAP_MS [RUNS]]]
(A and B are bench/wake_trace.py variants: ``exec`` = this checkout, ``exec=GLUE`` = the pgfence
package under GLUE, e.g. another commit's ``glue`` from ``git archive``, ``loop`` = the plain
SQL loop; defaults 300 samples, 20 ms, 3 runs).

A and B each serve their own database of one cluster (NOTIFY is per database, so neither hears
the other's messages), instrumented as wake_trace does, both idle between messages. The
producer commits one message to A, GAP/2 later one to B, GAP/2 later the next to A, ...
(the order within a pair alternates), so every pair of wake-ups meets the same load, and a
burst of load on the shared machine hits both alike. Prints, per variant, p50 / p90 / p99 of
commit -> handler start and of its stages (as wake_trace), the CPU per wake-up of the
executor process and of its server sessions (/proc schedstat), and the paired differences
B - A: median, and in how many pairs B was quicker. Runs alternate which variant's process
was started first.

A diagnostic, not a target.
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).parent))
import outbox as ob
import wake_trace as wt
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import migrate


def _backend_ns(conn: psycopg.Connection[Any], db: str) -> int:
    pids = [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE '%%bench-trace%%'"
        " AND datname = %s", (db,))]
    return sum(wt._task_ns(pid) for pid in pids)


def _wait_all(shared: dict[str, Any], variants: list[str], n: int, what: str) -> None:
    """Wait up to 60 s until every variant's process counted ``n`` deliveries."""
    deadline = time.monotonic() + 60
    while any(shared[v][1].value < n for v in variants):
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.005)


def pair_run(dsns: dict[str, str], dbs: dict[str, str], variants: list[str], samples: int,
             gap: float) -> dict[str, list[dict[str, float]]]:
    """One run: ``samples`` wake-ups of each variant, interleaved; per variant its rows (as
    wake_trace.trace returns them)."""
    k = len(wt.STAGES)
    n = samples + 1
    procs: dict[str, Any] = {}
    shared: dict[str, Any] = {}
    go, stop = wt.CTX.Event(), wt.CTX.Event()
    for v in variants:
        ob._reset(dsns[v])
        out = wt.CTX.Array("d", n * k, lock=False)
        count = wt.CTX.Value("l", 0)
        shared[v] = (out, count)
        procs[v] = wt.CTX.Process(target=wt._serve,
                                  args=(dsns[v], v.split("#")[0], out, count, go, stop, n))
        procs[v].start()
    time.sleep(1.0)
    go.set()
    committed = {v: [0.0] * n for v in variants}
    cpu0: dict[str, tuple[int, int]] = {}
    cpu1: dict[str, tuple[int, int]] = {}
    sql = "SELECT pgfence.outbox_enqueue(%s, 'r', %s)"
    try:
        conns = {v: psycopg.connect(dsns[v], autocommit=True) for v in variants}
        admin = conns[variants[0]]
        try:
            for v in variants:  # warm-up message (seq = samples), then idle again
                conns[v].execute(sql, (ob.CHANNEL, Jsonb({"seq": samples})))
            _wait_all(shared, variants, 1, "an executor never took its warm-up message")
            time.sleep(0.5)
            for v in variants:
                cpu0[v] = (_backend_ns(admin, dbs[v]),
                           wt._task_ns(procs[v].pid or 0))
            for seq in range(samples):
                order = variants if seq % 2 == 0 else variants[::-1]
                for v in order:
                    conns[v].execute(sql, (ob.CHANNEL, Jsonb({"seq": seq})))
                    committed[v][seq] = time.monotonic()
                    time.sleep(gap / 2)
            _wait_all(shared, variants, n, "not every message was delivered")
            time.sleep(0.1)
            for v in variants:
                cpu1[v] = (_backend_ns(admin, dbs[v]),
                           wt._task_ns(procs[v].pid or 0))
        finally:
            for c in conns.values():
                c.close()
    finally:
        stop.set()
        for p in procs.values():
            p.join(60)
            if p.is_alive():
                p.kill()
    res: dict[str, list[dict[str, float]]] = {}
    for v in variants:
        out = shared[v][0]
        server = (cpu1[v][0] - cpu0[v][0]) / samples / 1e6
        client = (cpu1[v][1] - cpu0[v][1]) / samples / 1e6
        rows = []
        for seq in range(samples):
            c = committed[v][seq]
            r = {"commit": 0.0}
            for i, name in enumerate(wt.STAGES):
                val = out[seq * k + i]
                r[name] = (val - c) * 1000 if val else float("nan")
            r["idle"] = 1.0 if r["select_in"] <= 0 else 0.0
            r["server_cpu"], r["client_cpu"] = server, client
            rows.append(r)
        res[v] = rows
    return res


def main(argv: list[str]) -> None:
    """Run and print (argv: A B [SAMPLES [GAP_MS [RUNS]]])."""
    a, b = argv[0], argv[1]
    if a == b:  # the same variant twice (an A/A check): two databases all the same
        b = b + "#2"
    samples = int(argv[2]) if len(argv) > 2 else 300
    gap = float(argv[3]) / 1000 if len(argv) > 3 else 0.02
    runs = int(argv[4]) if len(argv) > 4 else 3
    admin = resolve_dsn()
    names = {a: "wake_ab_a", b: "wake_ab_b"}
    dsns: dict[str, str] = {}
    for v, db in names.items():
        drop_database(admin, db)
        dsns[v] = create_database(admin, db)
    every: dict[str, list[dict[str, float]]] = {a: [], b: []}
    diffs: list[float] = []
    per_run: list[str] = []
    try:
        for v in (a, b):
            migrate(dsns[v])
        for run in range(runs):
            order = [a, b] if run % 2 == 0 else [b, a]
            got = pair_run(dsns, names, order, samples, gap)
            da = [r["handler"] for r in got[a]]
            db_ = [r["handler"] for r in got[b]]
            d = [y - x for x, y in zip(da, db_, strict=True) if x == x and y == y]
            diffs.extend(d)
            per_run.append(f"run {run + 1}: p50 A {wt._q(da, .5):.3f} B {wt._q(db_, .5):.3f}, "
                           f"p99 A {wt._q(da, .99):.3f} B {wt._q(db_, .99):.3f}, "
                           f"CPU client A {got[a][0]['client_cpu']:.3f} B "
                           f"{got[b][0]['client_cpu']:.3f}, server A "
                           f"{got[a][0]['server_cpu']:.3f} B {got[b][0]['server_cpu']:.3f}")
            print(per_run[-1], flush=True)
            every[a].extend(got[a])
            every[b].extend(got[b])
    finally:
        for db in names.values():
            drop_database(admin, db)
    for v, label in ((a, "A"), (b, "B")):
        print(f"== {label} = {v}")
        wt.report(every[v])
    lower = sum(1 for x in diffs if x < 0)
    print(f"paired B - A (commit -> handler), {len(diffs)} pairs: median "
          f"{statistics.median(diffs):+.3f} ms, B quicker in {lower} of {len(diffs)}")


if __name__ == "__main__":
    main(sys.argv[1:])
