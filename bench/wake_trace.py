"""Where an executor's wake-up goes: per-stage timestamps of the real Executor's wake-ups.

Usage: pgfence db run --durable -- python bench/wake_trace.py [SAMPLES [GAP_MS [RUNS]]]
(defaults 500 samples, 20 ms apart, 1 run; ``--json FILE`` also writes every sample).

One idle executor (``Executor`` + ``OutboxModule``, default settings, a Python handler) in a
forked process; the parent enqueues one message at a time (its own transaction, ``outbox_enqueue``)
and sleeps GAP_MS after each, as peers-bench's wake-up test does. The executor's process is
instrumented from outside (nothing in pgfence changes, nothing costs when this script is not
running): the event loop's selector, psycopg's ``notifies`` generator (async and sync
connections) and the executor's statement helpers (``_rows``, and ``_sync_rows`` where a
variant has it) are wrapped to stamp ``time.monotonic()`` (CLOCK_MONOTONIC, one clock for both
processes). Per wake-up the stages are:

    commit    the producer's enqueue (and its commit) returned
    select    the event loop's select() returned with the listener's socket readable (async
              listener only; with a thread listener: the notifies wait returned)
    ready     psycopg's notifies generator was resumed with the socket readable
    note      notifies() handed the Notify to the executor
    wake      the executor's wake-up claim began (``Executor._wake_claim``; absent in a loop)
    sent      the claim statement was about to be sent (``outbox_claim``)
    answer    its execute() returned (the answer read and parsed)
    rows      its rows were fetched
    handler   the handler started

and the deltas between them (``commit->select`` includes the server's commit and NOTIFY and the
kernel's wake-up of the executor's process; ``answer`` includes the claim's server time and its
durable commit). It prints p50 / p90 / p99 of the total and of every delta, and, for the slowest
1% and 5% of wake-ups, the mean of each delta against the median wake-up's, so a tail can be
placed. ``idle`` = the loop was idle (in select) when the producer's commit returned.

A diagnostic, not a target.
"""

from __future__ import annotations

import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
import executor as ex
import outbox as ob
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import migrate

CHANNEL = ob.CHANNEL
CTX = mp.get_context("fork")
STAGES = ("select_in", "select", "ready", "note", "wake", "sent", "answer", "rows", "handler")
DELTAS = (("commit", "select"), ("select", "ready"), ("ready", "note"), ("note", "wake"),
          ("wake", "sent"),
          ("sent", "answer"), ("answer", "rows"), ("rows", "handler"))


def _instrument(stamps: dict[str, float]) -> None:
    """Wrap the selector, psycopg's notifies generator and the executor's statement helpers so
    that they write into ``stamps`` (called in the executor's process, before it runs)."""
    import psycopg.connection as pc
    import psycopg.connection_async as pca
    import psycopg.generators as pg

    from pgfence import executor as ex

    state: dict[str, Any] = {"fd": -1, "sel_in": 0.0, "sel": 0.0}
    orig_notifies = pg.notifies

    def notifies(pgconn: Any) -> Any:
        state["fd"] = pgconn.socket
        gen = orig_notifies(pgconn)
        s = next(gen)
        while True:
            ready = yield s
            if ready:
                stamps["ready"] = time.monotonic()
                stamps["select"] = state["sel"] or stamps["ready"]
                stamps["select_in"] = state["sel_in"] or stamps["ready"]
                state["sel"] = state["sel_in"] = 0.0
            try:
                s = gen.send(ready)
            except StopIteration as stop:
                return stop.value

    pca.notifies = pc.notifies = notifies  # type: ignore[assignment]

    orig_anotifies = psycopg.AsyncConnection.notifies

    async def anotifies(self: Any, **kw: Any) -> Any:
        async for n in orig_anotifies(self, **kw):
            stamps["note"] = time.monotonic()
            yield n

    psycopg.AsyncConnection.notifies = anotifies  # type: ignore[method-assign]
    orig_snotifies = psycopg.Connection.notifies

    def snotifies(self: Any, **kw: Any) -> Any:
        for n in orig_snotifies(self, **kw):
            stamps["note"] = time.monotonic()
            yield n

    psycopg.Connection.notifies = snotifies  # type: ignore[method-assign]

    claim_sql = ex.sql.SQL_CLAIM
    orig_rows = ex._rows

    async def rows(cur: Any, query: Any, params: Any) -> Any:
        if query != claim_sql:
            return await orig_rows(cur, query, params)
        stamps["sent"] = time.monotonic()
        await cur.execute(query, params)
        stamps["answer"] = time.monotonic()
        res = cur.pgresult
        out = await cur.fetchall() if res is not None and res.nfields else []
        stamps["rows"] = time.monotonic()
        return out

    ex._rows = rows
    orig_wake = ex.Executor._wake_claim

    async def wake_claim(self: Any, *args: Any) -> None:
        stamps["wake"] = time.monotonic()
        await orig_wake(self, *args)

    ex.Executor._wake_claim = wake_claim  # type: ignore[method-assign]
    orig_sync = getattr(ex, "_sync_rows", None)
    if orig_sync is not None:
        def sync_rows(cur: Any, query: Any, params: Any) -> Any:
            if query != claim_sql:
                return orig_sync(cur, query, params)
            stamps["sent"] = time.monotonic()
            cur.execute(query, params)
            stamps["answer"] = time.monotonic()
            res = cur.pgresult
            out = cur.fetchall() if res is not None and res.nfields else []
            stamps["rows"] = time.monotonic()
            return out

        ex._sync_rows = sync_rows

    def hook_loop() -> None:
        sel = getattr(asyncio.get_running_loop(), "_selector", None)
        if sel is None:  # uvloop: no selector to wrap
            return
        orig_select = sel.select

        def select(timeout: float | None = None) -> Any:
            t_in = time.monotonic()
            events = orig_select(timeout)
            if events:
                fd = state["fd"]
                for key, _ in events:
                    if key.fd == fd:
                        state["sel_in"], state["sel"] = t_in, time.monotonic()
                        break
            return events

        sel.select = select

    stamps["_hook_loop"] = hook_loop  # type: ignore[assignment]


def _variant_imports(variant: str) -> None:
    """In the executor's process: make ``variant``'s pgfence the one imported. ``exec`` (this
    interpreter's pgfence), ``exec=GLUE`` (the pgfence package under the directory GLUE, e.g.
    another checkout's ``glue``), ``cls=MODULE:ATTR`` (an Executor subclass, a prototype; MODULE
    on PYTHONPATH) or ``loop`` (a plain SQL loop, the peers-bench ``pgfence`` adapter's). Any
    but ``loop`` may end in ``+uvloop``: the same executor on uvloop's event loop (uvloop must be
    installed; the selector stage is then not stamped)."""
    if variant.startswith("exec="):
        for name in [m for m in sys.modules if m == "pgfence" or m.startswith("pgfence.")]:
            del sys.modules[name]
        sys.path.insert(0, variant[5:])
    elif variant.startswith("cls="):
        import importlib
        importlib.import_module(variant[4:].partition(":")[0])


def _sql_loop(dsn: str, stamps: dict[str, float], handler: Any, stop: Any) -> None:
    """The SQL loop of peers-bench's ``pgfence`` adapter: LISTEN; claim 50; run and mark each;
    wait for a NOTIFY only after an empty claim (all on one session, sync psycopg)."""
    from pgfence import outbox as sql
    with psycopg.connect(dsn, autocommit=True, application_name="bench-trace-loop") as conn:
        conn.execute(f"LISTEN {sql.NOTIFY_CHANNEL}")
        while not stop.is_set():
            stamps["sent"] = time.monotonic()
            cur = conn.execute(sql.SQL_CLAIM, ("bench-loop", 50, [CHANNEL], None))
            stamps["answer"] = time.monotonic()
            rows = cur.fetchall()
            stamps["rows"] = time.monotonic()
            if not rows:
                for _ in conn.notifies(timeout=0.2, stop_after=1):
                    pass
                continue
            for r in rows:
                handler(r[3])
                conn.execute(sql.SQL_MARK_SENT, (r[0], r[5], None))


def _serve(dsn: str, variant: str, out: Any, count: Any, go: Any, stop: Any, n: int) -> None:
    """The executor's process: instrument, wait for ``go``, serve until ``stop``. A variant
    ending in ``+uvloop`` runs its event loop on uvloop instead of asyncio's own."""
    variant, uv = variant.removesuffix("+uvloop"), variant.endswith("+uvloop")
    if uv:
        import uvloop
    _variant_imports(variant)
    from pgfence.executor import Executor, ExecutorConfig, OutboxModule
    from pgfence.transports import CallableTransport

    stamps: dict[str, float] = {}
    _instrument(stamps)
    hook_loop = stamps.pop("_hook_loop")
    k = len(STAGES)

    def record(payload: Any) -> None:
        t = time.monotonic()
        seq = payload["seq"]
        if 0 <= seq < n:
            for i, name in enumerate(STAGES[:-1]):
                out[seq * k + i] = stamps.get(name, 0.0)
            out[seq * k + k - 1] = t
        stamps.clear()
        with count.get_lock():
            count.value += 1

    if variant == "loop":
        go.wait()
        _sql_loop(dsn, stamps, record, stop)
        return

    async def handler(message: Any) -> None:
        record(message.payload)

    cls: Any = Executor
    if variant.startswith("cls="):
        import importlib
        mod, _, attr = variant[4:].partition(":")
        cls = getattr(importlib.import_module(mod), attr)
    executor = cls(dsn, [OutboxModule({CHANNEL: CallableTransport(handler)})],
                   ExecutorConfig(worker_id="bench-trace"))

    async def main() -> None:
        hook_loop()  # type: ignore[operator]

        async def watch() -> None:
            while not stop.is_set():
                await asyncio.sleep(0.02)
            executor.stop()
        watcher = asyncio.create_task(watch())
        await executor.run()
        watcher.cancel()

    go.wait()
    prof = os.environ.get("WAKE_TRACE_PROFILE")  # a file: cProfile of the executor's process
    if prof:
        import cProfile
        with cProfile.Profile() as pr:
            (uvloop.run if uv else asyncio.run)(main())
        pr.dump_stats(f"{prof}.{variant.replace('/', '_')}")
    else:
        (uvloop.run if uv else asyncio.run)(main())


def _task_ns(pid: int) -> int:
    """CPU time (ns) of every thread of process ``pid`` so far (/proc schedstat; 0 if gone)."""
    total = 0
    try:
        for task in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{task}/schedstat") as f:
                total += int(f.read().split()[0])
    except OSError:
        pass
    return total


def _backends(conn: psycopg.Connection[Any]) -> dict[int, int]:
    """The traced process's server backends (by application_name) -> their CPU ns so far."""
    pids = [r[0] for r in conn.execute(
        "SELECT pid FROM pg_stat_activity WHERE application_name LIKE '%bench-trace%'")]
    return {pid: _task_ns(pid) for pid in pids}


def trace(dsn: str, samples: int, gap: float, variant: str = "exec") -> list[dict[str, float]]:
    """One run: ``samples`` wake-ups; each a dict of stage -> ms after the commit returned."""
    ob._reset(dsn)
    k = len(STAGES)
    n = samples + 1
    out = CTX.Array("d", n * k, lock=False)
    count = CTX.Value("l", 0)
    go, stop = CTX.Event(), CTX.Event()
    p = CTX.Process(target=_serve, args=(dsn, variant, out, count, go, stop, n))
    p.start()
    time.sleep(1.0)
    go.set()
    cpu0: tuple[dict[int, int], int] = ({}, 0)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            def warm() -> None:
                nonlocal cpu0
                cpu0 = _backends(conn), _task_ns(p.pid or 0)
            committed = ex.paced(conn, samples, gap, lambda: count.value, warm)
            time.sleep(0.1)  # the last outcome recorded
            server = sum(ns - cpu0[0].get(pid, 0) for pid, ns in _backends(conn).items())
            client = _task_ns(p.pid or 0) - cpu0[1]
    finally:
        stop.set()
        p.join(60)
        if p.is_alive():
            p.kill()
    rows = []
    for seq in range(samples):
        c = committed[seq]
        r = {"commit": 0.0}
        for i, name in enumerate(STAGES):
            v = out[seq * k + i]
            r[name] = (v - c) * 1000 if v else float("nan")
        r["idle"] = 1.0 if r["select_in"] <= 0 else 0.0
        r["server_cpu"] = server / samples / 1e6
        r["client_cpu"] = client / samples / 1e6
        rows.append(r)
    return rows


def _q(values: list[float], q: float) -> float:
    xs = sorted(v for v in values if v == v)
    if not xs:
        return float("nan")
    i = q * (len(xs) - 1)
    lo = int(i)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def report(rows: list[dict[str, float]]) -> dict[str, Any]:
    """Print and return the percentiles of the total and of each stage delta."""
    total = [r["handler"] for r in rows]
    res: dict[str, Any] = {"samples": len(rows)}
    print(f"{len(rows)} wake-ups; ms      p50     p90     p99    max")
    print(f"  total commit->handler {_q(total, .5):6.3f}  {_q(total, .9):6.3f}  "
          f"{_q(total, .99):6.3f} {max(total):6.2f}")
    res["total"] = {"p50": _q(total, .5), "p90": _q(total, .9), "p99": _q(total, .99)}
    deltas: dict[str, list[float]] = {}
    for a, b in DELTAS:
        name = f"{a}->{b}"
        deltas[name] = [r[b] - r[a] for r in rows]
        d = deltas[name]
        print(f"  {name:<21} {_q(d, .5):6.3f}  {_q(d, .9):6.3f}  {_q(d, .99):6.3f} "
              f"{max(x for x in d if x == x) if any(x == x for x in d) else float('nan'):6.2f}")
        res[name] = {"p50": _q(d, .5), "p90": _q(d, .9), "p99": _q(d, .99)}
    order = sorted(range(len(rows)), key=lambda i: total[i])
    mid = order[len(order) * 2 // 5: len(order) * 3 // 5]
    print("  mean of each delta:   median 20%  slowest 5%  slowest 1%")
    for name, d in deltas.items():
        def mean(idx: list[int], d: list[float] = d) -> float:
            xs = [d[i] for i in idx if d[i] == d[i]]
            return statistics.fmean(xs) if xs else float("nan")
        top5 = order[-max(1, len(order) // 20):]
        top1 = order[-max(1, len(order) // 100):]
        print(f"  {name:<21} {mean(mid):6.3f}      {mean(top5):6.3f}      {mean(top1):6.3f}")
        res[name]["mean_mid"], res[name]["mean_top5"], res[name]["mean_top1"] = \
            mean(mid), mean(top5), mean(top1)
    idle = statistics.fmean(r["idle"] for r in rows)
    res["server_cpu_ms"] = statistics.fmean(r["server_cpu"] for r in rows)
    res["client_cpu_ms"] = statistics.fmean(r["client_cpu"] for r in rows)
    print(f"  CPU per wake-up (every call of it, /proc schedstat): server backends "
          f"{res['server_cpu_ms']:.3f} ms, executor process {res['client_cpu_ms']:.3f} ms")
    print(f"  loop idle in select when the commit returned: {idle:.0%} of wake-ups; "
          f"load {os.getloadavg()[0]:.2f}")
    res["idle_share"] = idle
    return res


def main(argv: list[str]) -> None:
    """Run and print (argv: [SAMPLES [GAP_MS [RUNS]]] [--variants A,B,...] [--json FILE])."""
    opts: dict[str, str] = {}
    for flag in ("--json", "--variants"):
        if flag in argv:
            i = argv.index(flag)
            opts[flag] = argv[i + 1]
            argv = argv[:i] + argv[i + 2:]
    variants = opts.get("--variants", "exec").split(",")
    samples = int(argv[0]) if argv else 500
    gap = float(argv[1]) / 1000 if len(argv) > 1 else 0.02
    runs = int(argv[2]) if len(argv) > 2 else 1
    admin = resolve_dsn()
    drop_database(admin, "wake_trace")
    dsn = create_database(admin, "wake_trace")
    every: dict[str, list[dict[str, float]]] = {v: [] for v in variants}
    summary: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    try:
        migrate(dsn)
        for run in range(runs):
            # ABBA-like: odd runs in reverse order, so no variant always runs first
            for v in (variants if run % 2 == 0 else variants[::-1]):
                rows = trace(dsn, samples, gap, v)
                print(f"run {run + 1}/{runs} {v}")
                summary[v].append(report(rows))
                every[v].extend(rows)
    finally:
        drop_database(admin, "wake_trace")
    if runs > 1 or len(variants) > 1:
        for v in variants:
            print(f"== {v}: all runs; per-run total p50 "
                  + " ".join(f"{r['total']['p50']:.3f}" for r in summary[v]) + ", p99 "
                  + " ".join(f"{r['total']['p99']:.3f}" for r in summary[v]) + "; server CPU "
                  + " ".join(f"{r['server_cpu_ms']:.3f}" for r in summary[v]) + ", client CPU "
                  + " ".join(f"{r['client_cpu_ms']:.3f}" for r in summary[v]))
            report(every[v])
    if "--json" in opts:
        Path(opts["--json"]).write_text(json.dumps(every))


if __name__ == "__main__":
    main(sys.argv[1:])
