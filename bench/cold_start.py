"""The database's share of an executor's first job: a new session's first calls, cold and warm.

Usage: pgfence db run --durable -- python bench/cold_start.py [SESSIONS]
For each of SESSIONS (default 15) new sessions, on a fresh database `cold_start`, with one message
enqueued (and due) just before: the connection (psycopg, as the executor opens it), the executor's start-up
check (pgfence.executor.SQL_START_CHECK with the outbox module's functions), the first
outbox_claim (it claims the waiting message), then a second and a third claim (nothing due: a
warm backend). Prints the median and max of each step in ms (client wall time).

A new backend compiles every PL/pgSQL function and plans its statements on first use, so the
first claim costs several warm claims: that is most of the time between an executor's start and
its first job that is not the Python import (peers-bench's "first job" column, issue 18).
A diagnostic, not a target.
"""
import statistics
import sys
import time
from pathlib import Path

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import outbox
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.executor import SQL_START_CHECK, OutboxModule
from pgfence.migrate import migrate

CLAIM_SQL = "SELECT * FROM pgfence.outbox_claim(%s, %s, ARRAY[%s])"


def _session(dsn: str, functions: list[str]) -> dict[str, float]:
    """One new session's steps (see the module docstring): step name -> ms."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    conn = psycopg.connect(dsn, autocommit=True)
    out["connect"] = (time.perf_counter() - t0) * 1000
    try:
        t0 = time.perf_counter()
        conn.execute(SQL_START_CHECK, (functions,)).fetchall()
        out["start check"] = (time.perf_counter() - t0) * 1000
        for i, name in enumerate(("claim 1 (cold)", "claim 2", "claim 3")):
            t0 = time.perf_counter()
            got = conn.execute(CLAIM_SQL, ("bench-cold", 10, outbox.CHANNEL)).fetchall()
            out[name] = (time.perf_counter() - t0) * 1000
            if len(got) != (1 if i == 0 else 0):
                sys.exit(f"cold_start: {name} got {len(got)} messages")
    finally:
        conn.close()
    return out


def measure(dsn: str, sessions: int) -> dict[str, list[float]]:
    """Time each step of `sessions` new sessions; step name -> ms per session."""
    functions = sorted(OutboxModule.functions)
    steps: dict[str, list[float]] = {}
    for i in range(sessions):
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute("SELECT pgfence.outbox_enqueue(%s, %s, '{}'::jsonb)",
                          (outbox.CHANNEL, f"cold-{i}"))
        for name, ms in _session(dsn, functions).items():
            steps.setdefault(name, []).append(ms)
    return steps


def main(argv: list[str]) -> None:
    """Measure and print (argv: [SESSIONS])."""
    sessions = int(argv[0]) if argv else 15
    admin = resolve_dsn()
    drop_database(admin, "cold_start")
    dsn = create_database(admin, "cold_start")
    try:
        migrate(dsn)
        steps = measure(dsn, sessions)
    finally:
        drop_database(admin, "cold_start")
    print(f"{sessions} new sessions, ms (median / max):")
    for name, values in steps.items():
        print(f"  {name:<16} {statistics.median(values):6.2f} / {max(values):6.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
