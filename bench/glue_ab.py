"""A/B of the executor's Python glue: another checkout's (A) against this one's (B), paired.

Usage (from a checkout): pgfence db run --durable -- python bench/glue_ab.py A_GLUE_DIR [PAIRS]
A_GLUE_DIR is the other checkout's ``glue`` directory (e.g. a worktree of the base commit); B is
this checkout's. Both run on one database with this checkout's schema: only the executor
processes differ (their PYTHONPATH). Each pair runs, in turn, A and B (B first in odd pairs: the
variant run second has an order bias), each the 4 x batch-50 drain of outbox.py unkeyed and over
1,000 ordering keys, and prints every drain (messages/s), each variant's median, the per-pair
keyed/unkeyed ratio and the paired B/A gains. Session 10 (issue 17): the executor that settles at
most a batch per claiming round gave keyed 1.15x, unkeyed 1.01x, keyed/unkeyed 0.74 -> 0.85.
"""
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
import outbox
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import migrate

HERE = Path(__file__).resolve().parent


def main() -> None:
    """Run the interleaved pairs and print each drain, the medians and the paired gains."""
    glue = {"A": str(Path(sys.argv[1]).resolve()), "B": str(HERE.parent / "glue")}
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 6
    admin = resolve_dsn()
    drop_database(admin, "glue_ab")
    dsn = create_database(admin, "glue_ab")
    migrate(dsn)
    res: dict[str, list[float]] = {k: [] for k in ("Au", "Ak", "Bu", "Bk")}
    for i in range(pairs):
        for v in (("A", "B") if i % 2 == 0 else ("B", "A")):
            for keys in ((None, 1_000) if i % 2 == 0 else (1_000, None)):
                rate = outbox.drain_executor(dsn, 4, 50, keys=keys, glue=glue[v])["per_second"]
                res[v + ("u" if keys is None else "k")].append(rate)
        print(i, {k: round(x[-1]) for k, x in res.items()}, f"load {os.getloadavg()[0]:.1f}",
              flush=True)
    drop_database(admin, "glue_ab")
    for k, x in res.items():
        print(f"{k}: median {statistics.median(x):,.0f} msg/s")
    for v in "AB":
        r = [k / u for k, u in zip(res[v + "k"], res[v + "u"], strict=True)]
        print(f"{v} keyed/unkeyed per pair {[round(x, 2) for x in r]}, median {statistics.median(r):.3f}")
    for kind in ("u", "k"):
        g = [b / a for a, b in zip(res["A" + kind], res["B" + kind], strict=True)]
        print(f"B/A {'unkeyed' if kind == 'u' else 'keyed'}: median of pairs {statistics.median(g):.3f}")


if __name__ == "__main__":
    main()
