"""A/B of the keyed drain: base functions (A) against this checkout's (B), interleaved.

Usage (from a worktree): pgfence db run --durable -- python bench/keyed_ab.py BASE_FUNCTIONS_DIR [PAIRS]
Both databases get this checkout's migrations; A then gets BASE_FUNCTIONS_DIR/*.sql applied on
top (CREATE OR REPLACE: A's functions and triggers are the base's). Each pair runs, in turn, A
unkeyed, A keyed, B unkeyed, B keyed (4 executors x batch 50, 10,000 messages, 1,000 keys), then
claim_round_cost keyless and with 1,000 keys on A and B (one settle-50 + claim-50 round, ms).
"""
import os
import statistics
import sys
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outbox  # noqa: E402
from pgfence.db import create_database, drop_database, resolve_dsn  # noqa: E402
from pgfence.migrate import migrate  # noqa: E402

base = Path(sys.argv[1])
pairs = int(sys.argv[2]) if len(sys.argv) > 2 else 4
admin = resolve_dsn()
dsns = {}
for name in ("ka", "kb"):
    drop_database(admin, name)
    dsns[name] = create_database(admin, name)
    migrate(dsns[name])
with psycopg.connect(dsns["ka"]) as conn:
    for f in sorted(base.glob("*.sql")):
        conn.execute(f.read_text().encode())
res: dict[str, list[float]] = {k: [] for k in ("au", "ak", "bu", "bk", "ac", "bc", "ar", "br")}
for i in range(pairs):
    for v in ("a", "b"):
        dsn = dsns["k" + v]
        res[v + "u"].append(outbox.drain_executor(dsn, 4, 50)["per_second"])
        res[v + "k"].append(outbox.drain_executor(dsn, 4, 50, keys=1000)["per_second"])
        res[v + "c"].append(outbox.claim_round_cost(dsn, None, rounds=100)["ms_per_round"])
        res[v + "r"].append(outbox.claim_round_cost(dsn, 1000, rounds=40)["ms_per_round"])
    load = os.getloadavg()[0]
    print(f"pair {i}: A unkeyed {res['au'][-1]:.0f} keyed {res['ak'][-1]:.0f} ({res['ak'][-1]/res['au'][-1]:.2f}x)"
          f" | B unkeyed {res['bu'][-1]:.0f} keyed {res['bk'][-1]:.0f} ({res['bk'][-1]/res['bu'][-1]:.2f}x)"
          f" | round keyless A {res['ac'][-1]:.2f} B {res['bc'][-1]:.2f} ms, 1,000 keys A {res['ar'][-1]:.2f} B {res['br'][-1]:.2f} ms"
          f" | load {load:.1f}", flush=True)
med = {k: statistics.median(v) for k, v in res.items()}
for v in ("a", "b"):
    ratios = [k / u for k, u in zip(res[v + "k"], res[v + "u"])]
    print(f"{v.upper()}: median unkeyed {med[v+'u']:.0f}/s keyed {med[v+'k']:.0f}/s ratio of medians"
          f" {med[v+'k']/med[v+'u']:.2f}x, per-pair ratios {min(ratios):.2f}-{max(ratios):.2f};"
          f" keyless round {med[v+'c']:.2f} ms ({min(res[v+'c']):.2f}-{max(res[v+'c']):.2f}),"
          f" keyed round {med[v+'r']:.2f} ms ({min(res[v+'r']):.2f}-{max(res[v+'r']):.2f})")
