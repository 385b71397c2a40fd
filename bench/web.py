"""HTTP benchmark: a save through ``pgfence serve`` (PUT with If-Match and Idempotency-Key) next
to calling ``document_save`` directly, in the same run and on the same database.

- **direct**: one psycopg connection calls ``pgfence.document_save`` N times in a row (with a
  save id, like the session), one round trip per save.
- **HTTP**: ``pgfence serve`` runs as its own process (uvicorn, the dev trusted-header auth on
  127.0.0.1); one keep-alive HTTP/1.1 connection PUTs N saves in a row; the server parses the
  body, authenticates, takes a pooled connection and calls the same function.
- Both again with ``CONCURRENCY`` clients at once, each on its own document and connection.

Reported: saves/s, p50 and p99 latency per save (ms), and the ratios HTTP / direct.
``run(dsn)`` returns the numbers; ``python bench/web.py`` runs against ``$DATABASE_URL``.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

N = 2000
CONCURRENCY = 8
PER_CLIENT = 500
SQL_SAVE = ("SELECT outcome, version FROM pgfence.document_save(%s::bigint, %s::bigint,"
            " %s::jsonb, %s::text, %s::text)")


def _content(i: int) -> dict[str, Any]:
    return {"title": "Quarterly plan", "owner": "ann", "status": "draft", "n": i, "notes": "x" * 200}


def _new_doc(dsn: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pgfence.document_create('record', %s, 'bench')",
                           (Jsonb(_content(0)),)).fetchone()
    assert row is not None
    return int(row[0])


def _direct(dsn: str, doc: int, n: int) -> list[float]:
    lat = []
    with psycopg.connect(dsn, autocommit=True) as conn:
        for i in range(1, n + 1):
            t0 = time.perf_counter()
            row = conn.execute(SQL_SAVE, (doc, i, Jsonb(_content(i)), "bench",
                                          uuid.uuid4().hex)).fetchone()
            lat.append(time.perf_counter() - t0)
            assert row is not None and row[0] == "saved"
    return lat


def _http(port: int, doc: int, n: int) -> list[float]:
    lat = []
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    conn.connect()
    # http.client writes the headers and the body separately: without TCP_NODELAY (which
    # browsers set) Nagle's algorithm meets the server's delayed ACK and adds ~40 ms a request.
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        for i in range(1, n + 1):
            body = json.dumps({"content": _content(i)}).encode()
            t0 = time.perf_counter()
            conn.request("PUT", f"/documents/{doc}", body=body, headers={
                "Content-Type": "application/json", "If-Match": f'"{i}"',
                "Idempotency-Key": uuid.uuid4().hex, "X-Bench-User": "bench"})
            res = conn.getresponse()
            raw = res.read()
            lat.append(time.perf_counter() - t0)
            assert res.status == 200, raw
    finally:
        conn.close()
    return lat


def _stats(lat: list[float], seconds: float) -> dict[str, float]:
    q = statistics.quantiles(lat, n=100, method="inclusive")
    return {"saves": len(lat), "saves_per_second": len(lat) / seconds,
            "p50_ms": q[49] * 1000, "p99_ms": q[98] * 1000}


def _parallel(fn: Any, args: list[tuple[Any, ...]]) -> dict[str, float]:
    results: list[list[float]] = [[] for _ in args]
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            results[i] = fn(*args[i])
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(args))]
    t0 = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join(600)
    elapsed = time.perf_counter() - t0
    if errors:
        raise RuntimeError(f"{len(errors)} client(s) failed: {errors[0]!r}") from errors[0]
    return _stats([x for r in results for x in r], elapsed)


def _timed(fn: Any, *args: Any) -> dict[str, float]:
    t0 = time.perf_counter()
    lat = fn(*args)
    return _stats(lat, time.perf_counter() - t0)


class _Serve:
    """``pgfence serve`` as a subprocess on a free port."""

    def __init__(self, dsn: str) -> None:
        self.log = tempfile.NamedTemporaryFile(  # noqa: SIM115 - closed in close()
            "w+", prefix="pgfence-bench-serve-", suffix=".log")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgfence", "--dsn", dsn, "serve", "--port", "0",
             "--dev-trusted-header", "X-Bench-User"],
            stdout=self.log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        deadline = time.monotonic() + 30
        while True:
            self.log.seek(0)
            m = re.search(r"http://127\.0\.0\.1:(\d+)/documents", self.log.read())
            if m:
                self.port = int(m.group(1))
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError("pgfence serve did not start")
            time.sleep(0.05)

    def close(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def run(dsn: str) -> dict[str, Any]:
    """Both workloads, direct and over HTTP; print a table; return the numbers and ratios."""
    print(f"web: {N} saves in a row, then {CONCURRENCY} clients x {PER_CLIENT} saves on their"
          " own documents; document_save direct vs PUT through pgfence serve", flush=True)
    serve = _Serve(dsn)
    try:
        _http(serve.port, _new_doc(dsn), 50)            # warm the pool and the server
        _direct(dsn, _new_doc(dsn), 50)
        res: dict[str, Any] = {
            "sequential": {"direct": _timed(_direct, dsn, _new_doc(dsn), N),
                           "http": _timed(_http, serve.port, _new_doc(dsn), N)},
            "concurrent": {
                "direct": _parallel(_direct, [(dsn, _new_doc(dsn), PER_CLIENT)
                                              for _ in range(CONCURRENCY)]),
                "http": _parallel(_http, [(serve.port, _new_doc(dsn), PER_CLIENT)
                                          for _ in range(CONCURRENCY)])},
        }
    finally:
        serve.close()
    res["ratios"] = {}
    print(f"{'':34} {'saves/s':>9} {'p50 ms':>8} {'p99 ms':>8}")
    for load in ("sequential", "concurrent"):
        d, h = res[load]["direct"], res[load]["http"]
        res["ratios"][f"{load}_http_vs_direct_throughput"] = h["saves_per_second"] / d["saves_per_second"]
        res["ratios"][f"{load}_http_vs_direct_p50"] = h["p50_ms"] / d["p50_ms"]
        res["ratios"][f"{load}_http_vs_direct_p99"] = h["p99_ms"] / d["p99_ms"]
        label = "1 client" if load == "sequential" else f"{CONCURRENCY} clients"
        for name, row in (("document_save direct", d), ("PUT via pgfence serve", h)):
            print(f"{name + ', ' + label:34} {row['saves_per_second']:9,.0f} {row['p50_ms']:8.2f}"
                  f" {row['p99_ms']:8.2f}")
        r = res["ratios"]
        print(f"{'  HTTP / direct':34} {r[f'{load}_http_vs_direct_throughput']:8.2f}x"
              f" {r[f'{load}_http_vs_direct_p50']:7.2f}x {r[f'{load}_http_vs_direct_p99']:7.2f}x")
    return res


if __name__ == "__main__":
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("set DATABASE_URL to a migrated pgfence database")
    run(url)
