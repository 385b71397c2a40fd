"""A/B of one claim round's cost, keyless and keyed: base functions (A) against this checkout's (B).

Usage: pgfence db run --durable -- python bench/keyed_rounds_ab.py BASE_FUNCTIONS_DIR [REPS]
One session runs rounds of outbox_settle_and_claim (settle the previous 50, claim 50) over
10,000 due keyless messages, or 10,000 messages over 1,000 ordering keys (10 a key, as the
drain); per rep and variant the median of 150 rounds (ms, database and wire time) and the
server process's CPU time per round (/proc, so a local server; robust to a loaded machine).
Reps interleave A keyless, A keyed, B keyless, B keyed (odd reps: B first, ABBA).
KEYED_AB_A_SQL=FILE: SQL run on A after the base functions (as bench/keyed_ab.py).
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


def _cpu_ms(pid: int) -> float:
    """CPU time (user + system) of a local server process so far, in ms (/proc, clock ticks)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000 / os.sysconf("SC_CLK_TCK")


def rounds(dsn: str, keys: int | None, n: int = 150) -> tuple[float, float]:
    outbox._reset(dsn)
    outbox._fill_outbox(dsn, 10_000, keys=keys)
    times: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE pgfence.outbox")
        pid = conn.execute("SELECT pg_backend_pid()").fetchone()[0]  # type: ignore[index]
        cpu0 = _cpu_ms(pid)
        ids: list[int] = []
        attempts: list[int] = []
        for _ in range(n):
            t0 = time.perf_counter()
            rows = conn.execute(
                "SELECT id, attempt FROM pgfence.outbox_settle_and_claim(%s, %s, NULL, 'bench-c', 50,"
                " ARRAY[%s])", (ids, attempts, outbox.CHANNEL)).fetchall()
            times.append((time.perf_counter() - t0) * 1000)
            ids = [r[0] for r in rows if r[0] is not None]
            attempts = [r[1] for r in rows if r[0] is not None]
        cpu = (_cpu_ms(pid) - cpu0) / n
    return statistics.median(times), cpu


def main() -> None:
    """Run the interleaved reps and print each and the medians."""
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    a, b = ab_databases(Path(sys.argv[1]), ("ra", "rb"))
    dsns = {"ra": a, "rb": b}
    res: dict[str, list[float]] = {k: [] for k in ("au", "ak", "bu", "bk", "auc", "akc", "buc", "bkc")}
    for i in range(reps):
        for v in (("a", "b") if i % 2 == 0 else ("b", "a")):  # ABBA: B after A has an order bias
            for kind, keys in (("u", None), ("k", 1000)):
                wall, cpu = rounds(dsns["r" + v], keys)
                res[v + kind].append(wall)
                res[v + kind + "c"].append(cpu)
        last = {k: v[-1] for k, v in res.items()}
        print(f"rep {i}: A keyless {last['au']:.2f} ms (cpu {last['auc']:.2f}) keyed {last['ak']:.2f}"
              f" (cpu {last['akc']:.2f}) | B keyless {last['bu']:.2f} (cpu {last['buc']:.2f}) keyed"
              f" {last['bk']:.2f} (cpu {last['bkc']:.2f}) | load {os.getloadavg()[0]:.1f}", flush=True)
    for v in ("a", "b"):
        for m, label in (("", "wall"), ("c", "server cpu")):
            un, ke = res[v + "u" + m], res[v + "k" + m]
            u, k = statistics.median(un), statistics.median(ke)
            print(f"{v.upper()} {label}: keyless round {u:.2f} ms ({min(un):.2f}-{max(un):.2f}),"
                  f" keyed {k:.2f} ms ({min(ke):.2f}-{max(ke):.2f}); keyless/keyed {u / k:.2f}")

if __name__ == "__main__":
    main()
