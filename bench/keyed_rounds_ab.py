"""A/B of one claim round's cost, keyless and keyed: base functions (A) against this checkout's (B).

Usage: pgfence db run --durable -- python bench/keyed_rounds_ab.py BASE_FUNCTIONS_DIR [REPS]
One session runs rounds of outbox_settle_and_claim (settle the previous 50, claim 50) over
10,000 due keyless messages, or 10,000 messages over 1,000 ordering keys (10 a key, as the
drain); per rep and variant the median of 150 rounds (ms, database and wire time) and the
server process's CPU time per round (/proc, so a local server; robust to a loaded machine). Reps interleave A keyless, A keyed, B keyless, B keyed.
"""
import os
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outbox  # noqa: E402
from pgfence.db import create_database, drop_database, resolve_dsn  # noqa: E402
from pgfence.migrate import migrate  # noqa: E402


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
    base = Path(sys.argv[1])
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 5
    admin = resolve_dsn()
    dsns = {}
    for name in ("ra", "rb"):
        drop_database(admin, name)
        dsns[name] = create_database(admin, name)
        migrate(dsns[name])
    with psycopg.connect(dsns["ra"]) as conn:
        for f in sorted(base.glob("*.sql")):
            conn.execute(f.read_text().encode())
    res: dict[str, list[float]] = {k: [] for k in ("au", "ak", "bu", "bk", "auc", "akc", "buc", "bkc")}
    for i in range(reps):
        for v in ("a", "b"):
            for kind, keys in (("u", None), ("k", 1000)):
                wall, cpu = rounds(dsns["r" + v], keys)
                res[v + kind].append(wall)
                res[v + kind + "c"].append(cpu)
        print(f"rep {i}: A keyless {res['au'][-1]:.2f} ms (cpu {res['auc'][-1]:.2f}) keyed {res['ak'][-1]:.2f} (cpu {res['akc'][-1]:.2f})"
              f" | B keyless {res['bu'][-1]:.2f} (cpu {res['buc'][-1]:.2f}) keyed {res['bk'][-1]:.2f} (cpu {res['bkc'][-1]:.2f})"
              f" | load {os.getloadavg()[0]:.1f}", flush=True)
    for v in ("a", "b"):
        for m, label in (("", "wall"), ("c", "server cpu")):
            u, k = statistics.median(res[v + "u" + m]), statistics.median(res[v + "k" + m])
            print(f"{v.upper()} {label}: keyless round {u:.2f} ms ({min(res[v+'u'+m]):.2f}-{max(res[v+'u'+m]):.2f}),"
                  f" keyed {k:.2f} ms ({min(res[v+'k'+m]):.2f}-{max(res[v+'k'+m]):.2f}); keyless/keyed {u/k:.2f}")


if __name__ == "__main__":
    main()
