"""A/B of the keyed drain: base functions (A) against this checkout's (B), interleaved.

Usage (from a worktree): pgfence db run --durable -- python bench/keyed_ab.py BASE_FUNCTIONS_DIR [PAIRS]
Both databases get this checkout's migrations; A then gets BASE_FUNCTIONS_DIR/*.sql applied on
top (CREATE OR REPLACE: A's functions and triggers are the base's). Each pair runs, in turn, A
unkeyed, A keyed, B unkeyed, B keyed (4 executors x batch 50, 10,000 messages, 1,000 keys), then
claim_round_cost keyless and with 1,000 keys on A and B (one settle-50 + claim-50 round, ms).
Odd pairs run B first (ABBA order: the variant run second has an order bias).
KEYED_AB_A_SQL=FILE: SQL run on A after the base functions (schema the base had, e.g. indexes).
KEYED_AB_STATS=unkeyed: before each drain, the outbox's column statistics are made those of an
unkeyed backlog (10,000 keyless messages analysed, then removed; an empty table's ANALYZE keeps
them), the state `make bench`'s keyed drain meets after its keyless drains; otherwise they are
whatever autovacuum last saw, which differs from pair to pair (the hot functions keep generic
plans, chosen under these statistics: docs/query-plans.md).
"""
import os
import statistics
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outbox
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import migrate


def ab_databases(base: Path, names: tuple[str, str]) -> tuple[str, str]:
    """Create databases ``names`` (A, B), migrate both with this checkout, then apply the base
    functions (``base``/*.sql) on A; return their DSNs."""
    admin = resolve_dsn()
    dsns = []
    for name in names:
        drop_database(admin, name)
        dsns.append(create_database(admin, name))
        migrate(dsns[-1])
    with psycopg.connect(dsns[0]) as conn:
        for f in sorted(base.glob("*.sql")):
            conn.execute(f.read_text().encode())
        if setup := os.environ.get("KEYED_AB_A_SQL"):  # e.g. the base's indexes back on A
            conn.execute(Path(setup).read_text().encode())
    return dsns[0], dsns[1]


def unkeyed_stats(dsn: str) -> None:
    """Make the outbox's column statistics those of an unkeyed backlog (KEYED_AB_STATS=unkeyed)."""
    outbox._reset(dsn)
    outbox._fill_outbox(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("ANALYZE pgfence.outbox")


def main() -> None:
    """Run the interleaved pairs and print each and the medians."""
    pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    a, b = ab_databases(Path(sys.argv[1]), ("ka", "kb"))
    dsns = {"ka": a, "kb": b}
    res: dict[str, list[float]] = {k: [] for k in ("au", "ak", "bu", "bk", "ac", "bc", "ar", "br")}
    for i in range(pairs):
        for v in (("a", "b") if i % 2 == 0 else ("b", "a")):  # ABBA: B after A has an order bias
            dsn = dsns["k" + v]
            if os.environ.get("KEYED_AB_STATS") == "unkeyed":
                unkeyed_stats(dsn)
            res[v + "u"].append(outbox.drain_executor(dsn, 4, 50)["per_second"])
            if os.environ.get("KEYED_AB_STATS") == "unkeyed":
                unkeyed_stats(dsn)
            res[v + "k"].append(outbox.drain_executor(dsn, 4, 50, keys=1000)["per_second"])
            res[v + "c"].append(outbox.claim_round_cost(dsn, None, rounds=100)["ms_per_round"])
            res[v + "r"].append(outbox.claim_round_cost(dsn, 1000, rounds=40)["ms_per_round"])
        last = {k: v[-1] for k, v in res.items()}
        print(f"pair {i}: A unkeyed {last['au']:.0f} keyed {last['ak']:.0f} ({last['ak'] / last['au']:.2f}x)"
              f" | B unkeyed {last['bu']:.0f} keyed {last['bk']:.0f} ({last['bk'] / last['bu']:.2f}x)"
              f" | round keyless A {last['ac']:.2f} B {last['bc']:.2f} ms,"
              f" 1,000 keys A {last['ar']:.2f} B {last['br']:.2f} ms | load {os.getloadavg()[0]:.1f}",
              flush=True)
    for v in ("a", "b"):
        u, k, c, r = (res[v + x] for x in "ukcr")
        ratios = [ki / ui for ki, ui in zip(k, u, strict=True)]
        print(f"{v.upper()}: median unkeyed {statistics.median(u):.0f}/s keyed {statistics.median(k):.0f}/s,"
              f" ratio of medians {statistics.median(k) / statistics.median(u):.2f}x,"
              f" per-pair ratios {min(ratios):.2f}-{max(ratios):.2f}, median {statistics.median(ratios):.2f};"
              f" keyless round {statistics.median(c):.2f} ms ({min(c):.2f}-{max(c):.2f}),"
              f" keyed round {statistics.median(r):.2f} ms ({min(r):.2f}-{max(r):.2f})")

if __name__ == "__main__":
    main()
