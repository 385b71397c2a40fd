"""A/B of operation_claim under a pinned snapshot: base functions (A) against this checkout's (B).

Usage: pgfence db run --durable -- python bench/operation_pinned_ab.py BASE_FUNCTIONS_DIR [REPS] [OPS]
(e.g. ``git archive b0cd27a functions | tar -x -C /tmp/base``). Both databases are migrated with
this checkout, then A gets the base functions (bench/keyed_ab.py's ab_databases; A keeps this
checkout's indexes, e.g. operation_requeued_idx, which the run leaves empty). Per rep and variant,
the three cases of bench/claims.py's ``operation_pinned_run`` (clean, pinned, pinned with 1-second
leases: OPS claims + finishes each, default 5000); reps in ABBA order. Prints each rep and the
medians of p50, p99, backend CPU per claim and buffers (median and last) of every 10th claim.
"""
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from claims import PINNED_CASES, operation_pinned_run
from keyed_ab import ab_databases


def main() -> None:
    """Run the interleaved reps and print each and the medians."""
    reps = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    ops = int(sys.argv[3]) if len(sys.argv) > 3 else 5000
    a, b = ab_databases(Path(sys.argv[1]), ("opa", "opb"))
    dsns = {"a": a, "b": b}
    res: dict[tuple[str, str, str], list[float]] = {}
    for i in range(reps):
        for name, pinned, lease in PINNED_CASES:
            line = []
            for v in (("a", "b") if i % 2 == 0 else ("b", "a")):  # ABBA
                r = operation_pinned_run(dsns[v], pinned, lease, ops)
                for m in ("p50_ms", "p99_ms", "cpu_us", "buffers", "buffers_last"):
                    res.setdefault((v, name, m), []).append(r[m])
                line.append(f"{v.upper()} p50 {r['p50_ms']:.3f} p99 {r['p99_ms']:.3f} cpu {r['cpu_us']:.0f}"
                            f" buf {r['buffers']:.0f}/{r['buffers_last']}")
            print(f"rep {i} {name:19} " + " | ".join(sorted(line)) + f" | load {os.getloadavg()[0]:.2f}",
                  flush=True)
    for name, _, _ in PINNED_CASES:
        parts = []
        for m in ("p50_ms", "p99_ms", "cpu_us", "buffers", "buffers_last"):
            xa, xb = res[("a", name, m)], res[("b", name, m)]
            parts.append(f"{m} A {statistics.median(xa):.3f} ({min(xa):.3f}-{max(xa):.3f})"
                         f" B {statistics.median(xb):.3f} ({min(xb):.3f}-{max(xb):.3f})"
                         f" B/A {statistics.median(xb) / statistics.median(xa):.2f}")
        print(f"{name}: " + "; ".join(parts))


if __name__ == "__main__":
    main()
