"""A/B of a small claim's server CPU: base functions (A) against this checkout's (B), one cluster.

Usage: pgfence db run --durable -- python bench/claim_ab.py BASE_FUNCTIONS_DIR [REPS] [ROUNDS]
Each round is a wake-up as an executor makes it: an enqueuer session commits the round's
messages, the claimer session claims them (outbox_claim), a settler session marks them sent,
and the claimer asks outbox_next_due. The claim's server CPU is the claimer backend's run time
across that one call (/proc/<pid>/schedstat, ns; the backend is idle around it, so a loaded
machine disturbs it less than wall time). Modes: ch1 (one channel, batch 1, 1 message), all1
(all channels, batch 1), ch50 (one channel, batch 50, 50 messages), ch1e (as ch1, then an empty
claim after the settle: issue 18's "empty claim" effect). Per rep, variant and mode: the median
of ROUNDS (default 200) claims, in µs, CPU and wall. Reps alternate A,B / B,A (ABBA).
KEYED_AB_A_SQL=FILE: SQL run on A after the base functions (as bench/keyed_ab.py).
"""
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

sys.path.insert(0, str(Path(__file__).parent))
import outbox
from keyed_ab import ab_databases

MODES = ("ch1", "all1", "ch50", "ch1e")


def _run_ns(pid: int) -> int:
    """Run time of a local server process so far, in ns (/proc/<pid>/schedstat, first field)."""
    return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])


def rounds(dsn: str, mode: str, n: int) -> tuple[float, float]:
    """Median server CPU (µs) and wall time (µs) of ``n`` wake-up claims of ``mode``."""
    outbox._reset(dsn)
    batch = 50 if mode == "ch50" else 1
    chans: Any = None if mode == "all1" else [outbox.CHANNEL]
    cpu: list[float] = []
    wall: list[float] = []
    with (psycopg.connect(dsn, autocommit=True) as enq, psycopg.connect(dsn, autocommit=True) as cl,
          psycopg.connect(dsn, autocommit=True) as st):
        pid = cl.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        for i in range(n + 20):
            enq.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many(%s, %s, %s)",
                        (outbox.CHANNEL, ["r"] * batch, [Jsonb({"i": i})] * batch))
            c0 = _run_ns(pid)
            t0 = time.perf_counter()
            rows = cl.execute("SELECT id, attempt FROM pgfence.outbox_claim('bench-w', %s, %s)",
                              (batch, chans)).fetchall()
            t1 = time.perf_counter()
            c1 = _run_ns(pid)
            assert len(rows) == batch, (mode, len(rows))
            if i >= 20:  # warm-up: plans cached, hint settled
                cpu.append((c1 - c0) / 1000)
                wall.append((t1 - t0) * 1e6)
            st.execute("SELECT count(*) FROM pgfence.outbox_mark_sent_many(%s, %s)",
                       ([r[0] for r in rows], [r[1] for r in rows]))
            if mode == "ch1e":
                cl.execute("SELECT count(*) FROM pgfence.outbox_claim('bench-w', 1, %s)", (chans,))
            cl.execute("SELECT pgfence.outbox_next_due(%s)", (chans,))
    return statistics.median(cpu), statistics.median(wall)


def main() -> None:
    """Run the interleaved reps and print each and the medians."""
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 200
    modes = tuple(os.environ.get("CLAIM_AB_MODES", ",".join(MODES)).split(","))
    a, b = ab_databases(Path(sys.argv[1]), ("ca", "cb"))
    dsns = {"a": a, "b": b}
    res: dict[tuple[str, str, str], list[float]] = {}
    for i in range(reps):
        line = []
        for mode in modes:
            for v in (("a", "b") if i % 2 == 0 else ("b", "a")):
                c, w = rounds(dsns[v], mode, n)
                res.setdefault((v, mode, "cpu"), []).append(c)
                res.setdefault((v, mode, "wall"), []).append(w)
            line.append(f"{mode} A {res[('a', mode, 'cpu')][-1]:.0f} B {res[('b', mode, 'cpu')][-1]:.0f}")
        print(f"rep {i} cpu µs: " + " | ".join(line) + f" | load {os.getloadavg()[0]:.1f}", flush=True)
    for mode in modes:
        for m in ("cpu", "wall"):
            parts = []
            for v in ("a", "b"):
                xs = res[(v, mode, m)]
                parts.append(f"{v.upper()} {statistics.median(xs):.0f} ({min(xs):.0f}-{max(xs):.0f})")
            ratio = statistics.median(res[("b", mode, m)]) / statistics.median(res[("a", mode, m)])
            print(f"{mode} {m} µs per claim: " + ", ".join(parts) + f"; B/A {ratio:.2f}")


if __name__ == "__main__":
    main()
