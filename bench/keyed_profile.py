"""Where one claim round's time goes, keyless and keyed: per-function time and one round's plans.

Usage: pgfence db run --durable -- python bench/keyed_profile.py [stats | explain [ROUND]]
One session runs 150 rounds of outbox_settle_and_claim (settle the previous 50, claim 50) over
10,000 due keyless messages, then over 1,000 ordering keys (10 a key, as bench/keyed_ab.py's
drain), on a fresh database `keyed_profile`.

- ``stats`` (default): the median round (ms, database and wire time) and, from
  ``track_functions = all``, every pgfence function's calls, total and self time per round (ms).
- ``explain [ROUND]``: 30 rounds; round ROUND (default 22) is logged by ``auto_explain`` with
  ANALYZE, BUFFERS, nested statements and triggers (timing off), printed as NOTICEs.

A diagnostic, not a target: make bench's outbox module and bench/keyed_ab.py hold the numbers.
"""
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outbox
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import migrate

ROUND_SQL = ("SELECT id, attempt FROM pgfence.outbox_settle_and_claim"
             "(%s, %s, NULL, 'bench-profile', 50, ARRAY[%s])")
EXPLAIN_ON = [
    "LOAD 'auto_explain'",
    "SET auto_explain.log_analyze = on",
    "SET auto_explain.log_buffers = on",
    "SET auto_explain.log_nested_statements = on",
    "SET auto_explain.log_triggers = on",
    "SET auto_explain.log_timing = off",
    "SET auto_explain.log_level = notice",
    "SET client_min_messages = notice",
    "SET auto_explain.log_min_duration = 0",
]


def profile(dsn: str, keys: int | None, n: int = 150,
            explain_at: int | None = None) -> tuple[float, list[tuple[Any, ...]], list[str]]:
    """Run n rounds over 10,000 messages (keys: None = keyless, else that many ordering keys).

    Returns the median round (ms), the per-round function statistics (name, calls, total ms,
    self ms; from pg_stat_user_functions after a reset) and the NOTICEs (auto_explain's plans
    of round explain_at, if given).
    """
    outbox._reset(dsn)
    outbox._fill_outbox(dsn, 10_000, keys=keys)
    notes: list[str] = []
    times: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.add_notice_handler(lambda d: notes.append(d.message_primary or ""))
        conn.execute("VACUUM ANALYZE pgfence.outbox")
        conn.execute("SET track_functions = 'all'")
        conn.execute("SELECT pg_stat_reset()")
        ids: list[int] = []
        attempts: list[int] = []
        for i in range(n):
            if i == explain_at:
                for stmt in EXPLAIN_ON:
                    conn.execute(stmt)
            t0 = time.perf_counter()
            rows = conn.execute(ROUND_SQL, (ids, attempts, outbox.CHANNEL)).fetchall()
            times.append((time.perf_counter() - t0) * 1000)
            if i == explain_at:
                conn.execute("SET auto_explain.log_min_duration = -1")
            ids = [r[0] for r in rows if r[0] is not None]
            attempts = [r[1] for r in rows if r[0] is not None]
    time.sleep(1.5)  # the statistics collector's flush (PGSTAT_MIN_INTERVAL is 1 s)
    with psycopg.connect(dsn, autocommit=True) as conn:
        stats = conn.execute(
            "SELECT funcname, calls, round(total_time::numeric / %s, 3),"
            " round(self_time::numeric / %s, 3)"
            " FROM pg_stat_user_functions ORDER BY total_time DESC", (n, n)).fetchall()
    return statistics.median(times), stats, notes


def main(argv: list[str]) -> None:
    """Profile keyless then keyed rounds (argv: [stats | explain [ROUND]])."""
    mode = argv[0] if argv else "stats"
    if mode not in ("stats", "explain"):
        sys.exit("usage: keyed_profile.py [stats | explain [ROUND]]")
    admin = resolve_dsn()
    drop_database(admin, "keyed_profile")
    dsn = create_database(admin, "keyed_profile")
    migrate(dsn)
    for keys in (None, 1000):
        label = "keyless" if keys is None else f"{keys} keys"
        if mode == "stats":
            med, stats, _ = profile(dsn, keys)
            print(f"== {label}: median round {med:.2f} ms; per round: function, calls, total ms, self ms")
            for name, calls, total, self_ms in stats:
                print(f"   {name:<36} {calls:>7} {total:>8} {self_ms:>8}")
        else:
            at = int(argv[1]) if len(argv) > 1 else 22
            med, _, notes = profile(dsn, keys, n=30, explain_at=at)
            print(f"== {label}: round {at} (median round {med:.2f} ms)")
            for note in notes:
                print(note)
                print("--")
    drop_database(admin, "keyed_profile")


if __name__ == "__main__":
    main(sys.argv[1:])
