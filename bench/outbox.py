"""Outbox benchmark: pgfence's executor against a textbook SKIP LOCKED loop, in the same run.

Workloads (each on a freshly emptied table, 10,000 messages, a no-op handler):

- **drain**: N worker processes empty the queue (plus an unfenced two-transaction variant of
  the textbook loop — claim, then mark, like pgfence but without lease or fence — which isolates
  what the fence costs from what the second commit costs). Throughput = messages / (last finish − first
  claim), both read from the database clock, so process start-up is not counted.
  * pgfence: ``pgfence executor --route bench=noop`` with 1 or 4 processes, batch 1 or 50.
  * fenced loop: a synchronous single-message worker on the SQL contract, without the
    executor's machinery: ``outbox_claim(batch 1)`` once, then one ``outbox_mark_sent_and_claim``
    per message (the fenced mark of the message handled and the claim of the next: one
    statement, one commit, like the textbook loop). Also run as two calls per message
    (``outbox_claim`` → ``outbox_mark_sent``, two commits) to show what the second commit costs.
    The single-worker loops run three times, interleaved, and each keeps its best run.
  * textbook: ``BEGIN; SELECT … FOR UPDATE SKIP LOCKED LIMIT 1; <handler>; UPDATE … SET status =
    'sent'; COMMIT`` on a table of the same shape without triggers (the transaction stays open
    across the handler: the design pgfence avoids).
- **wake latency**: one idle worker; the benchmark commits one message at a time and the handler
  stamps its start time; latency = handler start − commit returned (same machine clock). Three
  runs of 500 samples, interleaved with the textbook loop's; each keeps its lowest-p99 run.
- **bulk enqueue**: 10,000 messages in one transaction with ``outbox_enqueue_many`` (best of 3; and, for
  reference, 10,000 ``outbox_enqueue`` calls pipelined, and a bare INSERT … SELECT unnest).
- **event log**: the 4 × batch-50 drain again with the channel's ``log_events`` on.
- **ordering keys**: the 4 × batch-50 drain again with every message keyed (1,000 keys of 10
  messages, one of a key in flight at a time), against the same drain unkeyed (target >= 0.8x),
  as 6 pairs run back to back in alternating order (unkeyed then keyed, keyed then unkeyed, ...;
  about 5 s a pair): the verdict is the median of the per-pair ratios (one drain of each varied
  by ±20% run to run, and the second drain of a pair gains about 0.04 on the ratio: 3 of each);
  the share of each key's next messages handed on by the settle of the one before, in its
  round (``_outbox_keys_hand_off``), rather than decided and claimed later; and the cost of
  one claim round (``outbox_settle_and_claim``: settle 50, claim 50) with 10,000 keys due
  against 10,000 keyless messages due.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

HERE = Path(__file__).resolve().parent
N = 10_000
CHANNEL = "bench"

TEXTBOOK_DDL = """
DROP TABLE IF EXISTS bench_textbook;
CREATE TABLE bench_textbook (
  id bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
  channel text NOT NULL, recipient text NOT NULL, payload jsonb NOT NULL,
  status text NOT NULL DEFAULT 'pending', attempts int NOT NULL DEFAULT 0,
  next_attempt_at timestamptz NOT NULL DEFAULT now(), claimed_at timestamptz,
  finished_at timestamptz, receipt jsonb, created_at timestamptz NOT NULL DEFAULT now());
CREATE INDEX ON bench_textbook (next_attempt_at, id) WHERE status = 'pending';
"""


def _reset(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        with conn.transaction():  # the owner's deliberate reset: the guard refuses it otherwise (PF005)
            conn.execute("SET LOCAL pgfence.purging = on")
            conn.execute("TRUNCATE pgfence.outbox, pgfence.event, pgfence.outbox_key")
        # channel settings outlive TRUNCATE: the event-log run must not leak into the next ones
        conn.execute("SELECT pgfence.outbox_configure_channel(%s, p_log_events => false)", (CHANNEL,))
        conn.execute(TEXTBOOK_DDL)
        conn.execute("VACUUM ANALYZE pgfence.outbox")


def _fill_outbox(dsn: str, n: int | None = None, keys: int | None = None) -> None:
    n = n or N
    ordering = [f"key-{i % keys}" for i in range(n)] if keys else None
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many(%s, %s, %s, NULL, NULL, NULL, %s)",
                     (CHANNEL, ["r"] * n, [Jsonb({"i": i}) for i in range(n)], ordering))


def _fill_textbook(dsn: str, n: int | None = None) -> None:
    n = n or N
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("INSERT INTO bench_textbook (channel, recipient, payload)"
                     " SELECT %s, 'r', jsonb_build_object('i', i) FROM generate_series(1, %s) i",
                     (CHANNEL, n))


def _wait_outbox_drained(dsn: str, n: int, timeout: float = 600) -> dict[str, float]:
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE status = 'sent'), count(*) FROM pgfence.outbox").fetchone()
            assert row is not None
            if row[0] >= n:
                break
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {row[0]} of {n} sent after {timeout}s")
            time.sleep(0.5)
        span = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(claimed_at)),"
                            " max(attempts) FROM pgfence.outbox").fetchone()
    assert span is not None
    return {"seconds": float(span[0]), "max_attempts": int(span[1])}


def _executors(dsn: str, count: int, batch: int, extra: list[str] | None = None,
               glue: str | None = None) -> list[subprocess.Popen[bytes]]:
    concurrency = max(16, 2 * batch)
    # glue: another checkout's glue/ directory, imported by the executors instead of this one's
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (glue, str(HERE)) if p))
    procs = [subprocess.Popen(
        [sys.executable, "-m", "pgfence", "--dsn", dsn, "executor", "--route", f"{CHANNEL}=noop",
         "--batch", str(batch), "--concurrency", str(concurrency), "--poll-interval", "1",
         "--log-level", "warning", "--worker-id", f"bench-{i}", *(extra or [])],
        env=env, stdout=subprocess.DEVNULL, stderr=None) for i in range(count)]
    # wait until every executor is listening (idle), so start-up is not measured
    deadline = time.monotonic() + 60
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute("SELECT count(*) FROM pg_stat_activity WHERE application_name"
                               " LIKE 'pgfence-listener:bench-%%'").fetchone()
            if row and row[0] >= count:
                break
            if time.monotonic() > deadline:
                raise TimeoutError("executors did not start")
            time.sleep(0.05)
    return procs


def _stop(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        p.terminate()
    for p in procs:
        p.wait(timeout=60)


def drain_executor(dsn: str, count: int, batch: int, log_events: bool = False,
                   keys: int | None = None, glue: str | None = None) -> dict[str, Any]:
    """Start ``count`` idle executors (running ``glue``, another checkout's glue/ directory, if
    given), then enqueue N messages (over ``keys`` ordering keys, if given) and time the drain."""
    _reset(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT pgfence.outbox_configure_channel(%s, p_log_events => %s)",
                     (CHANNEL, log_events))
    procs = _executors(dsn, count, batch, glue=glue)
    try:
        _fill_outbox(dsn, keys=keys)
        span = _wait_outbox_drained(dsn, N)
    finally:
        _stop(procs)
    out = {"executors": count, "batch": batch, "log_events": log_events, "keys": keys,
           "per_second": N / span["seconds"], "seconds": span["seconds"]}
    if keys:
        # Share of the keys' next messages handed on by the settle of the one before, in the
        # same round (claimed at its now()), rather than decided and claimed later.
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE claimed_at = prev), count(*) FROM (SELECT claimed_at,"
                " lag(finished_at) OVER (PARTITION BY ordering_key ORDER BY id) AS prev"
                " FROM pgfence.outbox) m WHERE prev IS NOT NULL").fetchone()
        assert row is not None
        out["handed_share"] = row[0] / max(row[1], 1)
    return out


def keyed_pairs(dsn: str, pairs: int = 6, keys: int = 1_000) -> dict[str, Any]:
    """The 4 x batch-50 drain unkeyed and over ``keys`` ordering keys, ``pairs`` times, each pair
    run back to back in alternating order (UK, KU, UK, ...: the second of a pair has an order
    bias, so an even number of pairs), so that a slow spell of the machine hits both sides of a
    pair; returns every pair (rates, ratio keyed/unkeyed, load), the median of the per-pair
    ratios and the pair at (or, for an even number, just below) it."""
    out: list[dict[str, Any]] = []
    for i in range(pairs):
        got = {k: drain_executor(dsn, 4, 50, keys=k) for k in ((None, keys) if i % 2 == 0 else (keys, None))}
        out.append({"order": "UK" if i % 2 == 0 else "KU", "unkeyed": got[None]["per_second"],
                    "keyed": got[keys]["per_second"], "handed_share": got[keys]["handed_share"],
                    "ratio": got[keys]["per_second"] / got[None]["per_second"],
                    "load": os.getloadavg()[0]})
    mid = sorted(out, key=lambda p: p["ratio"])[(len(out) - 1) // 2]
    return {"keys": keys, "pairs": out, "median_ratio": statistics.median(p["ratio"] for p in out),
            "median_pair": mid}


def claim_round_cost(dsn: str, keys: int | None, due: int = 10_000, rounds: int = 60,
                     batch: int = 50) -> dict[str, Any]:
    """Milliseconds per claim round (settle ``batch`` then claim ``batch``, one call) with
    ``due`` messages due: one per key of ``keys`` ordering keys (each with 2 more waiting behind
    it), or keyless when ``keys`` is None. Median of ``rounds`` rounds, database and wire time."""
    _reset(dsn)
    if keys:
        _fill_outbox(dsn, 3 * keys, keys=keys)
    else:
        _fill_outbox(dsn, due)
    times: list[float] = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("VACUUM ANALYZE pgfence.outbox")
        ids: list[int] = []
        attempts: list[int] = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            rows = conn.execute(
                "SELECT id, attempt FROM pgfence.outbox_settle_and_claim(%s, %s, NULL, 'bench-c', %s,"
                " ARRAY[%s])", (ids, attempts, batch, CHANNEL)).fetchall()
            times.append((time.perf_counter() - t0) * 1000)
            ids = [r[0] for r in rows if r[0] is not None]
            attempts = [r[1] for r in rows if r[0] is not None]
    return {"keys": keys, "due": due, "batch": batch, "ms_per_round": statistics.median(times)}


def _fenced_worker(dsn: str, worker: str, out: Any) -> None:
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute("SELECT id, attempt, payload FROM pgfence.outbox_claim(%s, 1, %s)",
                               (worker, [CHANNEL])).fetchone()
            if row is None:
                break
            conn.execute("SELECT pgfence.outbox_mark_sent(%s, %s)", (row[0], row[1]))
            done += 1
    out.put(done)


def _fenced_settle_worker(dsn: str, worker: str, out: Any) -> None:
    """The single-message loop as pgfence recommends it: one ``outbox_claim`` to start, then one
    ``outbox_mark_sent_and_claim`` per message (the fenced mark of the message just handled and
    the claim of the next, one statement and one commit)."""
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT id, attempt, payload FROM pgfence.outbox_claim(%s, 1, %s)",
                           (worker, [CHANNEL])).fetchone()
        while row is not None and row[0] is not None:
            # the handler would run here, with no transaction open
            row = conn.execute(
                "SELECT id, attempt, payload, previous_sent"
                " FROM pgfence.outbox_mark_sent_and_claim(%s, %s, NULL, %s, 1, %s)",
                (row[0], row[1], worker, [CHANNEL])).fetchone()
            assert row is not None and row[3], "a single owner never loses its own race"
            done += 1
    out.put(done)


def _textbook_worker(dsn: str, worker: str, out: Any) -> None:
    done = 0
    with psycopg.connect(dsn) as conn:
        while True:
            with conn.transaction():
                row = conn.execute(
                    "SELECT id, payload FROM bench_textbook WHERE status = 'pending'"
                    " AND next_attempt_at <= now() ORDER BY next_attempt_at, id LIMIT 1"
                    " FOR UPDATE SKIP LOCKED").fetchone()
                if row is None:
                    break
                # the handler would run here, inside the open transaction
                conn.execute("UPDATE bench_textbook SET status = 'sent', attempts = attempts + 1,"
                             " claimed_at = statement_timestamp(), finished_at = now()"
                             " WHERE id = %s", (row[0],))
            done += 1
    out.put(done)


_TEXTBOOK_NEXT = ("BEGIN; SELECT id, payload FROM bench_textbook WHERE status = 'pending'"
                  " AND next_attempt_at <= now() ORDER BY next_attempt_at, id LIMIT 1"
                  " FOR UPDATE SKIP LOCKED")


def _last_row(cur: psycopg.ClientCursor[Any]) -> Any:
    """The row of the last statement of a multi-statement string (None if it returned none)."""
    row = None
    while True:
        if cur.description is not None:
            row = cur.fetchone()
        if not cur.nextset():
            return row


def _textbook_one_trip_worker(dsn: str, worker: str, out: Any) -> None:
    """The textbook loop tuned to one round trip per message, as pgfence's loop is: the mark,
    the commit and the next claim go to the server as one string."""
    done = 0
    with psycopg.connect(dsn, autocommit=True, cursor_factory=psycopg.ClientCursor) as conn:
        cur = conn.cursor()
        cur.execute(_TEXTBOOK_NEXT)
        row = _last_row(cur)
        while row is not None:
            # the handler would run here, inside the open transaction
            cur.execute("UPDATE bench_textbook SET status = 'sent', attempts = attempts + 1,"
                        " claimed_at = statement_timestamp(), finished_at = now()"
                        " WHERE id = %s; COMMIT; " + _TEXTBOOK_NEXT, (row[0],))
            row = _last_row(cur)
            done += 1
        cur.execute("COMMIT")
    out.put(done)


def _textbook2_worker(dsn: str, worker: str, out: Any) -> None:
    """Claim, then mark, as two transactions like pgfence, but with no fence and no lease."""
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "UPDATE bench_textbook SET status = 'processing', claimed_at = now()"
                " WHERE id = (SELECT id FROM bench_textbook WHERE status = 'pending'"
                " AND next_attempt_at <= now() ORDER BY next_attempt_at, id LIMIT 1"
                " FOR UPDATE SKIP LOCKED) RETURNING id, payload").fetchone()
            if row is None:
                break
            conn.execute("UPDATE bench_textbook SET status = 'sent', finished_at = now()"
                         " WHERE id = %s", (row[0],))
            done += 1
    out.put(done)


def _textbook2_fenced_worker(dsn: str, worker: str, out: Any) -> None:
    """The two-transaction loop with pgfence's fence added as plain SQL: the claim bumps
    ``attempts`` and stamps a lease, the mark matches ``attempts`` and ``status``. Compared with
    the unfenced loop it shows what the fence itself costs, without pgfence's function layer."""
    done = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(
                "UPDATE bench_textbook SET status = 'processing', attempts = attempts + 1,"
                " claimed_at = now() WHERE id = (SELECT id FROM bench_textbook"
                " WHERE status = 'pending' AND next_attempt_at <= now()"
                " ORDER BY next_attempt_at, id LIMIT 1 FOR UPDATE SKIP LOCKED)"
                " RETURNING id, attempts, payload").fetchone()
            if row is None:
                break
            conn.execute("UPDATE bench_textbook SET status = 'sent', finished_at = now()"
                         " WHERE id = %s AND attempts = %s AND status = 'processing'",
                         (row[0], row[1]))
            done += 1
    out.put(done)


def _run_workers(target: Any, dsn: str, count: int) -> float:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=target, args=(dsn, f"loop-{i}", q)) for i in range(count)]
    t0 = time.perf_counter()
    for p in procs:
        p.start()
    total = sum(q.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    elapsed = time.perf_counter() - t0
    assert total == N, f"{total} != {N}"
    return elapsed


def drain_fenced_loop(dsn: str, count: int, settle: bool = True) -> dict[str, Any]:
    """N messages through single-message fenced loops in ``count`` processes:
    ``outbox_mark_sent_and_claim`` per message (``settle``), or claim(1) → mark_sent as two
    calls and two commits."""
    _reset(dsn)
    _fill_outbox(dsn)
    _run_workers(_fenced_settle_worker if settle else _fenced_worker, dsn, count)
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(claimed_at))"
                           " FROM pgfence.outbox").fetchone()
    assert row is not None
    return {"workers": count, "per_second": N / float(row[0]), "seconds": float(row[0])}


def drain_textbook(dsn: str, count: int, two_tx: bool = False, fenced: bool = False,
                   one_trip: bool = False) -> dict[str, Any]:
    """N messages through the textbook SKIP LOCKED loop in ``count`` processes: one transaction
    held across the handler (``one_trip``: its statements sent as one round trip per message),
    or (``two_tx``) claim and mark as two transactions, unfenced or (``fenced``) with the fence
    predicate added in plain SQL."""
    _reset(dsn)
    _fill_textbook(dsn)
    if two_tx:
        worker = _textbook2_fenced_worker if fenced else _textbook2_worker
    else:
        worker = _textbook_one_trip_worker if one_trip else _textbook_worker
    _run_workers(worker, dsn, count)
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT extract(epoch FROM max(finished_at) - min(claimed_at))"
                           " FROM bench_textbook").fetchone()
    assert row is not None
    return {"workers": count, "per_second": N / float(row[0]), "seconds": float(row[0])}


# -- wake latency ---------------------------------------------------------------------------
def _pcts(samples_ms: list[float]) -> dict[str, float]:
    qs = statistics.quantiles(samples_ms, n=100, method="inclusive")
    return {"p50_ms": qs[49], "p95_ms": qs[94], "p99_ms": qs[98], "max_ms": max(samples_ms),
            "samples": len(samples_ms)}


def latency_executor(dsn: str, samples: int = 1000) -> dict[str, Any]:
    """Commit one message at a time to an idle executor whose handler stamps its start time."""
    _reset(dsn)
    env = dict(os.environ, PYTHONPATH=str(HERE))
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgfence", "--dsn", dsn, "executor", "--route",
         f"{CHANNEL}=python:bench_handlers:stamp", "--poll-interval", "5", "--log-level",
         "warning", "--worker-id", "bench-lat"], env=env)
    lat: list[float] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            while not conn.execute("SELECT 1 FROM pg_stat_activity WHERE application_name ="
                                   " 'pgfence-listener:bench-lat'").fetchone():
                if time.monotonic() > deadline:
                    raise TimeoutError("executor did not start")
                time.sleep(0.05)
            for i in range(samples + 20):
                with conn.transaction():
                    mid = conn.execute("SELECT pgfence.outbox_enqueue(%s, 'r', %s)",
                                       (CHANNEL, Jsonb({"i": i}))).fetchone()
                committed = time.time()
                assert mid is not None
                while True:
                    row = conn.execute("SELECT receipt->>'t' FROM pgfence.outbox WHERE id = %s"
                                       " AND status = 'sent'", (mid[0],)).fetchone()
                    if row:
                        break
                    time.sleep(0.002)
                if i >= 20:  # warm-up
                    lat.append((float(row[0]) - committed) * 1000)
                time.sleep(0.01)
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return _pcts(lat)


def _textbook_latency_worker(dsn: str, stop_at: float) -> None:
    with psycopg.connect(dsn, autocommit=True) as listen, psycopg.connect(dsn) as conn:
        listen.execute("LISTEN bench_textbook")
        while time.time() < stop_at:
            while True:
                with conn.transaction():
                    row = conn.execute(
                        "SELECT id FROM bench_textbook WHERE status = 'pending' AND next_attempt_at"
                        " <= now() ORDER BY next_attempt_at, id LIMIT 1 FOR UPDATE SKIP LOCKED"
                    ).fetchone()
                    if row is None:
                        break
                    started = time.time()
                    conn.execute("UPDATE bench_textbook SET status = 'sent', finished_at = now(),"
                                 " receipt = jsonb_build_object('t', %s::float8) WHERE id = %s",
                                 (started, row[0]))
            for _ in listen.notifies(timeout=0.5, stop_after=1):
                pass


def latency_textbook(dsn: str, samples: int = 1000) -> dict[str, Any]:
    """The same measurement for a textbook loop woken by its own LISTEN."""
    _reset(dsn)
    ctx = mp.get_context("spawn")
    worker = ctx.Process(target=_textbook_latency_worker, args=(dsn, time.time() + 120))
    worker.start()
    lat: list[float] = []
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            deadline = time.monotonic() + 60
            while not conn.execute("SELECT 1 FROM pg_stat_activity WHERE query = 'LISTEN bench_textbook'"
                                   ).fetchone():
                if time.monotonic() > deadline:
                    raise TimeoutError("textbook worker did not start")
                time.sleep(0.05)
            for i in range(samples + 20):
                with conn.transaction():
                    mid = conn.execute("INSERT INTO bench_textbook (channel, recipient, payload)"
                                       " VALUES (%s, 'r', %s) RETURNING id",
                                       (CHANNEL, Jsonb({"i": i}))).fetchone()
                    conn.execute("NOTIFY bench_textbook")
                committed = time.time()
                assert mid is not None
                while True:
                    row = conn.execute("SELECT receipt->>'t' FROM bench_textbook WHERE id = %s"
                                       " AND status = 'sent'", (mid[0],)).fetchone()
                    if row:
                        break
                    time.sleep(0.002)
                if i >= 20:
                    lat.append((float(row[0]) - committed) * 1000)
                time.sleep(0.01)
    finally:
        worker.terminate()
        worker.join(timeout=30)
    return _pcts(lat)


# -- bulk enqueue -----------------------------------------------------------------------------
def bulk_enqueue(dsn: str) -> dict[str, Any]:
    """10,000 messages in one transaction, three ways, each on a new connection (so the first
    call's planning is counted); three interleaved runs each, the best kept."""
    payloads = [Jsonb({"order": i, "note": "x" * 50}) for i in range(N)]

    def timed(statement: Any) -> dict[str, Any]:
        _reset(dsn)
        with psycopg.connect(dsn) as conn:
            t0 = time.perf_counter()
            with conn.transaction():
                statement(conn)
            return {"per_second": N / (time.perf_counter() - t0)}

    def many(conn: psycopg.Connection[Any]) -> None:
        conn.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many(%s, %s, %s)",
                     (CHANNEL, ["r"] * N, payloads))

    def pipelined(conn: psycopg.Connection[Any]) -> None:
        with conn.cursor() as cur:
            cur.executemany("SELECT pgfence.outbox_enqueue(%s, 'r', %s)",
                            [(CHANNEL, p) for p in payloads])

    def bare(conn: psycopg.Connection[Any]) -> None:
        conn.execute("INSERT INTO bench_textbook (channel, recipient, payload)"
                     " SELECT %s, 'r', p FROM unnest(%s::jsonb[]) p", (CHANNEL, payloads))

    best = _best_of(3, {"enqueue_many": lambda: timed(many),
                        "enqueue_pipelined": lambda: timed(pipelined),
                        "bare_insert": lambda: timed(bare)})
    out: dict[str, Any] = {}
    for name, r in best.items():
        out[f"{name}_per_second"] = r["per_second"]
        out[f"{name}_runs_per_second"] = r["runs_per_second"]
    return out


def _best_of(runs: int, loops: dict[str, Callable[[], dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Run every loop ``runs`` times, interleaved (so a slow spell of the machine hits them
    all alike), and keep each loop's fastest run, with all rates under ``runs_per_second``."""
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
    for _ in range(runs):
        for name, loop in loops.items():
            seen[name].append(loop())
    out = {}
    for name, results in seen.items():
        best = dict(max(results, key=lambda r: r["per_second"]))
        best["runs_per_second"] = [round(r["per_second"]) for r in results]
        out[name] = best
    return out


def run(dsn: str) -> dict[str, Any]:
    """Run every outbox workload; print a table; return the numbers and ratios."""
    res: dict[str, Any] = {"messages": N}
    print(f"outbox: {N} messages per drain, no-op handler", flush=True)
    # The single-worker loops decide a 0.95x target, and back-to-back runs on a small VM differ
    # by up to 15%: each runs three times, interleaved, and keeps its best run.
    single = _best_of(3, {
        "textbook": lambda: drain_textbook(dsn, 1),
        "textbook_one_trip": lambda: drain_textbook(dsn, 1, one_trip=True),
        "textbook_two_tx": lambda: drain_textbook(dsn, 1, two_tx=True),
        "textbook_two_tx_fenced": lambda: drain_textbook(dsn, 1, two_tx=True, fenced=True),
        "fenced_loop": lambda: drain_fenced_loop(dsn, 1),
        "fenced_loop_two_calls": lambda: drain_fenced_loop(dsn, 1, settle=False),
    })
    res["textbook"] = {"1": single["textbook"], "4": drain_textbook(dsn, 4)}
    res["textbook_two_tx"] = {"1": single["textbook_two_tx"],
                              "4": drain_textbook(dsn, 4, two_tx=True)}
    res["textbook_two_tx_fenced"] = {"1": single["textbook_two_tx_fenced"]}
    res["textbook_one_trip"] = {"1": single["textbook_one_trip"]}
    res["fenced_loop"] = {"1": single["fenced_loop"], "4": drain_fenced_loop(dsn, 4)}
    res["fenced_loop_two_calls"] = {"1": single["fenced_loop_two_calls"]}
    res["executor"] = {f"{c}x{b}": drain_executor(dsn, c, b) for c in (1, 4) for b in (1, 50)}
    res["executor_event_log"] = drain_executor(dsn, 4, 50, log_events=True)
    res["executor_keyed_pairs"] = keyed_pairs(dsn)
    res["executor_keyed"] = {"executors": 4, "batch": 50, "keys": 1_000,
                             "per_second": res["executor_keyed_pairs"]["median_pair"]["keyed"]}
    res["claim_round"] = {"keyless": claim_round_cost(dsn, None), "keys_10000": claim_round_cost(dsn, 10_000)}
    # Wake latency, like the single-worker loops: three runs of 500 samples each, interleaved,
    # each side keeping its run with the lowest p99 (every run is printed and kept in the JSON).
    # Most of pgfence's latency is the claim's durable commit, and an fsync on an idle VM ranges
    # from 0.1 to over 1 ms depending on what else the host does.
    lat_runs: dict[str, list[dict[str, Any]]] = {"latency_executor": [], "latency_textbook": []}
    for _ in range(3):
        lat_runs["latency_executor"].append(latency_executor(dsn, 500))
        lat_runs["latency_textbook"].append(latency_textbook(dsn, 500))
    for name, runs in lat_runs.items():
        res[name] = dict(min(runs, key=lambda r: r["p99_ms"]))
        res[name]["runs_p50_p99_ms"] = [[round(r["p50_ms"], 2), round(r["p99_ms"], 2)] for r in runs]
    res["bulk"] = bulk_enqueue(dsn)
    tb1 = res["textbook"]["1"]["per_second"]
    tb4 = res["textbook"]["4"]["per_second"]
    res["ratios"] = {
        "fenced_loop_1_vs_textbook_1": res["fenced_loop"]["1"]["per_second"] / tb1,
        "fenced_loop_1_vs_textbook_one_trip_1": res["fenced_loop"]["1"]["per_second"]
                                                / res["textbook_one_trip"]["1"]["per_second"],
        "plain_sql_fence_vs_unfenced_two_tx_1": res["textbook_two_tx_fenced"]["1"]["per_second"]
                                               / res["textbook_two_tx"]["1"]["per_second"],
        "fenced_two_calls_1_vs_textbook_1": res["fenced_loop_two_calls"]["1"]["per_second"] / tb1,
        "fenced_two_calls_1_vs_unfenced_two_tx_1":
            res["fenced_loop_two_calls"]["1"]["per_second"]
            / res["textbook_two_tx"]["1"]["per_second"],
        "fenced_loop_4_vs_textbook_4": res["fenced_loop"]["4"]["per_second"] / tb4,
        "executor_1x1_vs_textbook_1": res["executor"]["1x1"]["per_second"] / tb1,
        "executor_4x50_vs_textbook_4": res["executor"]["4x50"]["per_second"] / tb4,
        "event_log_on_vs_off_4x50": res["executor_event_log"]["per_second"]
                                    / res["executor"]["4x50"]["per_second"],
        "enqueue_many_vs_bare_insert": res["bulk"]["enqueue_many_per_second"]
                                       / res["bulk"]["bare_insert_per_second"],
        "keyed_vs_unkeyed_4x50": res["executor_keyed_pairs"]["median_ratio"],
        "claim_round_10000_keys_vs_keyless": res["claim_round"]["keys_10000"]["ms_per_round"]
                                             / res["claim_round"]["keyless"]["ms_per_round"],
    }
    res["targets"] = {
        "fence costs nothing: fenced single-message loop (mark_sent_and_claim) >= 0.95x"
        " textbook 1": res["ratios"]["fenced_loop_1_vs_textbook_1"] >= 0.95,
        "4 executors x batch 50 >= 3x textbook 4": res["ratios"]["executor_4x50_vs_textbook_4"] >= 3,
        "bulk enqueue >= 50,000/s": res["bulk"]["enqueue_many_per_second"] >= 50_000,
        "wake latency p99 <= 2 ms": res["latency_executor"]["p99_ms"] <= 2.0,
        "keyed drain (1,000 keys) >= 0.8x unkeyed, 4 x 50": res["ratios"]["keyed_vs_unkeyed_4x50"] >= 0.8,
    }
    rows = [
        ("textbook SKIP LOCKED, 1 worker", tb1, 1.0),
        ("textbook SKIP LOCKED, 4 workers", tb4, 1.0),
        ("  same, claim+mark as 2 tx, no fence, 1 w", res["textbook_two_tx"]["1"]["per_second"],
         res["textbook_two_tx"]["1"]["per_second"] / tb1),
        ("  same, claim+mark as 2 tx, no fence, 4 w", res["textbook_two_tx"]["4"]["per_second"],
         res["textbook_two_tx"]["4"]["per_second"] / tb4),
        ("  same, 1 round trip per message, 1 w", res["textbook_one_trip"]["1"]["per_second"],
         res["textbook_one_trip"]["1"]["per_second"] / tb1),
        ("  2 tx + fence predicate in plain SQL, 1 w", res["textbook_two_tx_fenced"]["1"]["per_second"],
         res["textbook_two_tx_fenced"]["1"]["per_second"] / tb1),
        ("fenced loop, mark_sent_and_claim, 1 w", res["fenced_loop"]["1"]["per_second"],
         res["ratios"]["fenced_loop_1_vs_textbook_1"]),
        ("fenced loop, mark_sent_and_claim, 4 w", res["fenced_loop"]["4"]["per_second"],
         res["ratios"]["fenced_loop_4_vs_textbook_4"]),
        ("  claim(1) then mark_sent: 2 calls, 1 w", res["fenced_loop_two_calls"]["1"]["per_second"],
         res["ratios"]["fenced_two_calls_1_vs_textbook_1"]),
    ]
    for d in res["executor"].values():
        base = tb1 if d["executors"] == 1 else tb4
        rows.append((f"pgfence executor {d['executors']} proc x batch {d['batch']}",
                     d["per_second"], d["per_second"] / base))
    d = res["executor_event_log"]
    rows.append(("  same 4 x 50 with event log on", d["per_second"], d["per_second"] / tb4))
    d = res["executor_keyed"]
    rows.append(("  same 4 x 50, 1,000 ordering keys (median)", d["per_second"], d["per_second"] / tb4))
    print(f"{'drain (messages/s)':44} {'rate':>10} {'x textbook':>11}")
    for name, rate, ratio in rows:
        print(f"{name:44} {rate:10,.0f} {ratio:10.2f}x")
    le, lt = res["latency_executor"], res["latency_textbook"]
    print(f"wake latency commit->handler  executor p50 {le['p50_ms']:.2f} p95 {le['p95_ms']:.2f}"
          f" p99 {le['p99_ms']:.2f} ms | textbook+LISTEN p50 {lt['p50_ms']:.2f}"
          f" p95 {lt['p95_ms']:.2f} p99 {lt['p99_ms']:.2f} ms")
    b = res["bulk"]
    print(f"bulk enqueue 10,000 in one tx: enqueue_many {b['enqueue_many_per_second']:,.0f}/s,"
          f" pipelined enqueue {b['enqueue_pipelined_per_second']:,.0f}/s,"
          f" bare INSERT {b['bare_insert_per_second']:,.0f}/s")
    one_trip = res["ratios"]["fenced_loop_1_vs_textbook_one_trip_1"]
    print("fenced loop vs textbook tuned to 1 round trip per message (not a target: it also"
          f" counts pgfence's extra work per message): {one_trip:.2f}x")
    print("single-worker runs (msg/s, best kept): " + "; ".join(
        f"{name} {single[name]['runs_per_second']}" for name in single))
    print(f"bulk enqueue_many runs (msg/s, best kept): {b['enqueue_many_runs_per_second']}")
    print(f"wake latency runs [p50, p99] ms (lowest p99 kept): executor {le['runs_p50_p99_ms']};"
          f" textbook {lt['runs_p50_p99_ms']}")
    kp = res["executor_keyed_pairs"]
    print("keyed vs unkeyed drain, 4 x 50, interleaved pairs (msg/s): " + "; ".join(
        f"{p['order']} unkeyed {p['unkeyed']:,.0f} keyed {p['keyed']:,.0f} = {p['ratio']:.2f}x"
        f" (load {p['load']:.1f}, {p['handed_share']:.0%} handed on)" for p in kp["pairs"])
        + f"; median of the ratios {kp['median_ratio']:.2f}x")
    cr = res["claim_round"]
    print(f"claim round (settle 50 + claim 50): {cr['keyless']['ms_per_round']:.2f} ms with 10,000"
          f" keyless due, {cr['keys_10000']['ms_per_round']:.2f} ms with 10,000 keys due"
          f" ({res['ratios']['claim_round_10000_keys_vs_keyless']:.2f}x)")
    for target, ok in res["targets"].items():
        print(f"  target {'MET ' if ok else 'MISSED'}  {target}")
    return res
