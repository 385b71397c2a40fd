"""Paired A/B of one claim round's server CPU: base functions (A) against this checkout's (B).

Usage: pgfence db run --durable -- python bench/keyed_pairs_ab.py BASE_FUNCTIONS_DIR [FILLS] [KEYS]
Like bench/keyed_rounds_ab.py (one session per variant runs outbox_settle_and_claim rounds:
settle the previous 50, claim 50, over 10,000 due messages, keyless or over KEYS ordering keys,
default 1,000; KEYS 0: keyless), but A and B alternate round by round (ABBA within each fill),
so that a change in the machine's load hits both alike, and each round's CPU is the server
process's run time across the call from /proc/<pid>/schedstat (ns; a local server). Per fill
(a fresh 10,000 messages per variant) 149 measured rounds each; prints each fill's medians,
then the medians over all rounds and the median and mean of the paired differences B - A
(the mean includes the rounds that end keys). KEYED_AB_A_SQL=FILE: SQL run on A after the base
functions (as bench/keyed_ab.py).
"""
import os
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outbox
from keyed_ab import ab_databases

ROUND_SQL = ("SELECT id, attempt FROM pgfence.outbox_settle_and_claim(%s, %s, NULL, 'bench-c', 50,"
             " ARRAY[%s])")


def _cpu_ns(pid: int) -> int:
    """Run time of a local server process so far, in ns (/proc/<pid>/schedstat)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def main() -> None:
    """Run the fills, alternating A and B round by round, and print the medians."""
    fills = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    keys = int(sys.argv[3]) if len(sys.argv) > 3 else 1000
    a, b = ab_databases(Path(sys.argv[1]), ("pa", "pb"))
    dsns = {"a": a, "b": b}
    cpu: dict[str, list[float]] = {"a": [], "b": []}
    wall: dict[str, list[float]] = {"a": [], "b": []}
    diffs: list[float] = []
    for f in range(fills):
        conns: dict[str, tuple[psycopg.Connection[tuple[object, ...]], int]] = {}
        state: dict[str, tuple[list[int], list[int]]] = {}
        for v, dsn in dsns.items():
            outbox._reset(dsn)
            outbox._fill_outbox(dsn, 10_000, keys=keys or None)
            conn = psycopg.connect(dsn, autocommit=True)
            conn.execute("VACUUM ANALYZE pgfence.outbox")
            pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
            conns[v] = (conn, int(str(pid)))
            state[v] = ([], [])
        for i in range(150):
            per: dict[str, float] = {}
            for v in (("a", "b") if (i + f) % 2 == 0 else ("b", "a")):
                conn, pid = conns[v]
                c0, t0 = _cpu_ns(pid), time.perf_counter()
                rows = conn.execute(ROUND_SQL, (*state[v], outbox.CHANNEL)).fetchall()
                ms, used = (time.perf_counter() - t0) * 1000, (_cpu_ns(pid) - c0) / 1e6
                done = [r for r in rows if r[0] is not None]
                state[v] = ([int(str(r[0])) for r in done], [int(str(r[1])) for r in done])
                if i > 0:  # the first round settles nothing
                    cpu[v].append(used)
                    wall[v].append(ms)
                    per[v] = used
            if i > 0:
                diffs.append(per["b"] - per["a"])
        for conn, _ in conns.values():
            conn.close()
        print(f"fill {f}: server cpu per round A {statistics.median(cpu['a'][-149:]):.3f} ms,"
              f" B {statistics.median(cpu['b'][-149:]):.3f} ms | load {os.getloadavg()[0]:.1f}", flush=True)
    for v in "ab":
        print(f"{v.upper()} ({keys or 'no'} keys): server cpu per round median"
              f" {statistics.median(cpu[v]):.3f} ms (mean {statistics.fmean(cpu[v]):.3f}),"
              f" wall median {statistics.median(wall[v]):.3f} ms")
    print(f"paired B - A server cpu: median {statistics.median(diffs):+.3f} ms,"
          f" mean {statistics.fmean(diffs):+.3f} ms over {len(diffs)} rounds")


if __name__ == "__main__":
    main()
