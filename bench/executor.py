"""Executor benchmark: pgfence's own executor, on its default settings, against the textbook loop.

What a user runs: ``Executor`` + ``OutboxModule`` in a process with a Python handler (a no-op that
records when it ran in shared memory) and ``ExecutorConfig()`` defaults (concurrency 16, batch
50), against the same table as ``outbox.py``. The workloads of issue 18 (and of the peers bench):

- **drain**: 10,000 due messages; the executor processes are started (imports done, connected to
  nothing), then released at once. Throughput = messages / (last handler start − release), so
  the executor's start-up counts; **first job** = first handler start − release (connect, the
  start-up check, the first claim and its commit). Configurations: 1 process, 4 processes (4
  competing executors), 1 process with ``concurrency=4``.
- **slow handler**: 1 process, ``concurrency=4``, 2,000 messages whose handler sleeps 5 ms: the
  slots must stay full (average deliveries in flight = handler time / drain time).
- **wake latency**: one idle executor; 500 messages enqueued one at a time, 20 ms apart; latency
  = handler start − the enqueue's commit returned (one machine clock, CLOCK_MONOTONIC).

Each runs three times, interleaved with the textbook loops of ``outbox.py`` (one and four worker
processes holding one transaction across the handler; its wake latency with LISTEN), and the
median run is kept (every run is in the JSON). Ratios are to the textbook loop with as many
workers (``concurrency=4`` in one process counts as four).
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
import os
import statistics
import time
from collections.abc import Callable
from multiprocessing.sharedctypes import Synchronized, SynchronizedArray
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

import outbox as ob

N = ob.N
CHANNEL = ob.CHANNEL
SLOW_N = 2000
SLOW_S = 0.005
LAT_N = 500
LAT_GAP = 0.02
CTX = mp.get_context("fork")


class _Probe:
    """Shared memory the handlers write to: when each message's handler started, how many ran,
    the most in flight at once and the total time spent in handlers."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.start: SynchronizedArray[float] = CTX.Array("d", n, lock=False)
        self.count: Synchronized[int] = CTX.Value("l", 0)
        self.most: Synchronized[int] = CTX.Value("l", 0, lock=False)
        self.busy: Synchronized[float] = CTX.Value("d", 0.0, lock=False)
        self.go = CTX.Event()
        self.stop = CTX.Event()


def _serve(dsn: str, probe: _Probe, concurrency: int | None, sleep: float, worker: str) -> None:
    """One executor process: import and build everything, wait for ``go``, run until ``stop``."""
    from pgfence.executor import Executor, ExecutorConfig, OutboxModule
    from pgfence.transports import CallableTransport

    in_flight = 0

    async def handler(message: Any) -> None:
        nonlocal in_flight
        t = time.monotonic()
        probe.start[message.payload["seq"]] = t
        with probe.count.get_lock():
            probe.count.value += 1
        if sleep:
            in_flight += 1
            probe.most.value = max(probe.most.value, in_flight)
            await asyncio.sleep(sleep)
            in_flight -= 1
            probe.busy.value += time.monotonic() - t

    config = ExecutorConfig(worker_id=worker)  # the defaults
    if concurrency is not None:
        config.concurrency = concurrency
    executor = Executor(dsn, [OutboxModule({CHANNEL: CallableTransport(handler)})], config)

    async def main() -> None:
        async def watch() -> None:
            while not probe.stop.is_set():
                await asyncio.sleep(0.02)
            executor.stop()
        watcher = asyncio.create_task(watch())
        await executor.run()
        watcher.cancel()

    probe.go.wait()
    asyncio.run(main())


def _fill(dsn: str, n: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many(%s, %s, %s)",
                     (CHANNEL, ["r"] * n, [Jsonb({"seq": i}) for i in range(n)]))
        conn.execute("VACUUM ANALYZE pgfence.outbox")


def _start(dsn: str, probe: _Probe, procs: int, concurrency: int | None,
           sleep: float = 0.0) -> list[Any]:
    ps = [CTX.Process(target=_serve, args=(dsn, probe, concurrency, sleep, f"bench-x{i}"))
          for i in range(procs)]
    for p in ps:
        p.start()
    time.sleep(1.0)  # imports done, blocked on go
    return ps


def _finish(probe: _Probe, ps: list[Any]) -> None:
    probe.stop.set()
    for p in ps:
        p.join(60)
        if p.is_alive():
            p.kill()


def drain(dsn: str, procs: int, concurrency: int | None, n: int | None = None,
          sleep: float = 0.0) -> dict[str, Any]:
    """``n`` (default N) due messages through ``procs`` executor processes released at once."""
    n = n or N
    ob._reset(dsn)
    _fill(dsn, n)
    probe = _Probe(n)
    ps = _start(dsn, probe, procs, concurrency, sleep)
    t0 = time.monotonic()
    probe.go.set()
    deadline = t0 + 600
    try:
        while probe.count.value < n:
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {probe.count.value} of {n} delivered")
            time.sleep(0.005)
    finally:
        _finish(probe, ps)
    starts = list(probe.start)
    first, last = min(starts), max(starts)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FILTER (WHERE status = 'sent'), max(attempts)"
                           " FROM pgfence.outbox").fetchone()
    assert row is not None and row[0] == n and row[1] == 1, f"not every message sent once: {row}"
    out = {"procs": procs, "concurrency": concurrency or 16, "messages": n,
           "per_second": n / (last - t0), "steady_per_second": (n - 1) / (last - first),
           "first_job_ms": (first - t0) * 1000}
    if sleep:
        out.update(handler_s=sleep, most_in_flight=probe.most.value,
                   avg_in_flight=probe.busy.value / (last + sleep - first))
    return out


def paced(conn: psycopg.Connection[Any], samples: int, gap: float,
          delivered: Callable[[], int], warm: Callable[[], None] | None = None) -> list[float]:
    """Commit ``samples`` + 1 messages one at a time on ``conn`` (autocommit) to an idle
    executor: first a warm-up message (seq ``samples``; waits up to 60 s until ``delivered()``
    counts it, calls ``warm`` if given, then 0.5 s for the executor to idle again), then seq 0 ..
    samples - 1, ``gap`` seconds apart; then waits up to 60 s for all to be delivered. Returns
    each seq's commit time (``time.monotonic()``, s). Raises TimeoutError when one is missing."""
    committed = [0.0] * (samples + 1)
    for seq in [samples, *range(samples)]:  # the first one warms the executor up
        conn.execute("SELECT pgfence.outbox_enqueue(%s, 'r', %s)", (CHANNEL, Jsonb({"seq": seq})))
        committed[seq] = time.monotonic()
        if seq == samples:
            deadline = time.monotonic() + 60
            while delivered() < 1:
                if time.monotonic() > deadline:
                    raise TimeoutError("the executor never took the warm-up message")
                time.sleep(0.005)
            time.sleep(0.5)  # idle again
            if warm is not None:
                warm()
        else:
            time.sleep(gap)
    deadline = time.monotonic() + 60
    while delivered() < samples + 1:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only {delivered()} of {samples + 1} delivered")
        time.sleep(0.005)
    return committed


def latency(dsn: str, samples: int = LAT_N, gap: float = LAT_GAP) -> dict[str, Any]:
    """Commit one message at a time to an idle executor; latency = handler start − commit."""
    ob._reset(dsn)
    probe = _Probe(samples + 1)
    ps = _start(dsn, probe, 1, None)
    probe.go.set()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            committed = paced(conn, samples, gap, lambda: probe.count.value)
    finally:
        _finish(probe, ps)
    lat = [(probe.start[i] - committed[i]) * 1000 for i in range(samples)]
    out = ob._pcts(lat)
    out["first_job_ms"] = (probe.start[samples] - committed[samples]) * 1000
    return out


def _median(runs: list[dict[str, Any]], key: str) -> dict[str, Any]:
    ordered = sorted(runs, key=lambda r: r[key])
    kept = dict(ordered[len(ordered) // 2])
    kept["runs"] = [round(r[key], 2) for r in runs]
    return kept


def run(dsn: str) -> dict[str, Any]:
    """Run every executor workload three times, interleaved with the textbook loops; print the
    medians, the ratios and the targets of issue 18."""
    print(f"executor (defaults: concurrency 16, batch 50): {N} messages per drain, Python handler",
          flush=True)
    loops: dict[str, Any] = {
        "textbook_1": lambda: ob.drain_textbook(dsn, 1),
        "textbook_4": lambda: ob.drain_textbook(dsn, 4),
        "executor_1x1": lambda: drain(dsn, 1, None),
        "executor_4x1": lambda: drain(dsn, 4, None),
        "executor_1x4": lambda: drain(dsn, 1, 4),
        "executor_1x4_slow": lambda: drain(dsn, 1, 4, SLOW_N, SLOW_S),
        "latency_executor": lambda: latency(dsn),
        "latency_textbook": lambda: ob.latency_textbook(dsn, LAT_N),
    }
    seen: dict[str, list[dict[str, Any]]] = {name: [] for name in loops}
    for _ in range(3):
        for name, loop in loops.items():
            seen[name].append(loop())
    res: dict[str, Any] = {}
    for name, runs in seen.items():
        res[name] = _median(runs, "p99_ms" if name.startswith("latency") else "per_second")
    tb1, tb4 = res["textbook_1"]["per_second"], res["textbook_4"]["per_second"]
    x11, x41, x14 = (res[f"executor_{c}"] for c in ("1x1", "4x1", "1x4"))
    slow, le, lt = res["executor_1x4_slow"], res["latency_executor"], res["latency_textbook"]
    res["ratios"] = {
        "executor_1x1_vs_textbook_1": x11["per_second"] / tb1,
        "executor_4x1_vs_textbook_4": x41["per_second"] / tb4,
        "executor_1x4_vs_textbook_4": x14["per_second"] / tb4,
        "executor_1x4_vs_executor_1x1": x14["per_second"] / x11["per_second"],
    }
    res["targets"] = {
        "concurrency 4 in one process >= 0.9x the default single process":
            res["ratios"]["executor_1x4_vs_executor_1x1"] >= 0.9,
        "a 5 ms handler keeps >= 0.9 x concurrency deliveries in flight on average":
            slow["avg_in_flight"] >= 0.9 * 4,
        "wake latency p99 <= 2.0 ms": le["p99_ms"] <= 2.0,
        "wake latency p50 within 0.3 ms of the textbook loop's": le["p50_ms"] - lt["p50_ms"] <= 0.3,
        "first job <= 20 ms after the start with work waiting":
            statistics.median([x11["first_job_ms"], x41["first_job_ms"], x14["first_job_ms"]]) <= 20,
    }
    print(f"{'drain (messages/s)':44} {'rate':>10} {'steady':>10} {'first job':>10} {'x textbook':>11}")
    for label, r, base in (("textbook SKIP LOCKED, 1 worker", res["textbook_1"], tb1),
                           ("textbook SKIP LOCKED, 4 workers", res["textbook_4"], tb4),
                           ("executor, 1 process (defaults)", x11, tb1),
                           ("executor, 4 processes (defaults)", x41, tb4),
                           ("executor, 1 process, concurrency 4", x14, tb4)):
        steady = r.get("steady_per_second", r["per_second"])
        first = f"{r['first_job_ms']:.1f} ms" if "first_job_ms" in r else "-"
        print(f"{label:44} {r['per_second']:10,.0f} {steady:10,.0f} {first:>10} "
              f"{r['per_second'] / base:10.2f}x")
    print(f"executor, 1 process, concurrency 4, {SLOW_S * 1000:.0f} ms handler: "
          f"{slow['per_second']:,.0f}/s, {slow['avg_in_flight']:.2f} in flight on average "
          f"(at most {slow['most_in_flight']})")
    print(f"wake latency commit->handler  executor p50 {le['p50_ms']:.2f} p95 {le['p95_ms']:.2f}"
          f" p99 {le['p99_ms']:.2f} ms (warm-up {le['first_job_ms']:.1f} ms) | textbook+LISTEN"
          f" p50 {lt['p50_ms']:.2f} p95 {lt['p95_ms']:.2f} p99 {lt['p99_ms']:.2f} ms")
    print("runs (median kept): " + "; ".join(f"{name} {res[name]['runs']}" for name in loops))
    for target, ok in res["targets"].items():
        print(f"  target {'MET ' if ok else 'MISSED'}  {target}")
    return res


if __name__ == "__main__":  # python bench/executor.py, against $DATABASE_URL (migrated)
    run(os.environ["DATABASE_URL"])
