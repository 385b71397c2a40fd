"""Metrics and health of an executor: counters kept in plain Python, served over HTTP.

The executor counts what it does in :class:`Stats` (dict increments and a bucket per
observation, on the event loop's thread: no lock, no database call per message). A scrape of
``/metrics`` (:class:`HttpServer`, on ``--metrics-port``) renders them in the Prometheus text
format with ``prometheus-client``, together with gauges of the executor's state (in flight, free
slots, listener connected, seconds since the last successful claim sweep) and the database-side
gauges of the view ``pgfence.audit_metrics`` (read once per scrape). ``/healthz`` answers from
the event loop (it is alive); ``/readyz`` checks the start-up check passed (schema version
known), the listener is connected, and the database answers within ``probe_timeout``.

Every metric is listed in docs/metrics.md.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import json
import logging
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from prometheus_client.core import Metric

    from .executor import Executor

# prometheus-client is imported by the functions that render a scrape, not here: the executor
# imports this module for its counters (Stats), and its start (the first claim) should not wait
# for an import that only a scrape needs.

logger = logging.getLogger(__name__)

#: Counters: name (without ``_total``) -> (help, label names).
COUNTERS: dict[str, tuple[str, tuple[str, ...]]] = {
    "pgfence_claimed": ("Units of work claimed (outbox messages, plan runs, operations).",
                        ("module", "queue")),
    "pgfence_delivered": ("Units finished successfully (outbox: sent; plan: steps ok; "
                          "operation: succeeded).", ("module", "queue")),
    "pgfence_failed": ("Failed attempts, by retry: retryable (retried later) or permanent.",
                       ("module", "queue", "retry")),
    "pgfence_dead": ("Outbox messages that used their last attempt (dead).", ("module", "queue")),
    "pgfence_reclaimed": ("Lapsed claims the reaper took back.", ("module",)),
    "pgfence_lost_races": ("Outcomes refused because the claim was taken over meanwhile "
                           "(fenced out: at least once).", ("module", "queue")),
}
#: Histograms: name -> (help, label names, bucket upper bounds in seconds).
_FAST = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
HISTOGRAMS: dict[str, tuple[str, tuple[str, ...], tuple[float, ...]]] = {
    "pgfence_delivery_duration_seconds": (
        "Time in the transport or handler, per unit.", ("module", "queue"),
        (*_FAST, 30.0, 60.0, 300.0)),
    "pgfence_claim_round_trip_seconds": (
        "One claim round (with the settlement of the deliveries before it): request to rows.",
        ("module",), _FAST),
    "pgfence_wakeup_latency_seconds": (
        "Outbox first attempts: from the message's creation (its due time unless deliver_at "
        "deferred it) to its handler's start, on the database clock.", ("module",),
        (*_FAST, 30.0, 60.0, 300.0, 3600.0)),
}


class _Histogram:
    """Counts per bucket (not cumulative), the sum and the count of observations."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: tuple[float, ...]) -> None:
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.total += value


class Stats:
    """The executor's counters and histograms, in plain Python (the event loop's thread only).

    ``inc("pgfence_claimed", ("outbox", "orders"), 10)``; ``observe(name, labels, seconds)``.
    Names and label orders are those of :data:`COUNTERS` and :data:`HISTOGRAMS`.
    """

    __slots__ = ("counters", "histograms")

    def __init__(self) -> None:
        self.counters: dict[tuple[str, tuple[str, ...]], int] = {}
        self.histograms: dict[tuple[str, tuple[str, ...]], _Histogram] = {}

    def inc(self, name: str, labels: tuple[str, ...], n: int = 1) -> None:
        """Add ``n`` to a counter."""
        key = (name, labels)
        self.counters[key] = self.counters.get(key, 0) + n

    def observe(self, name: str, labels: tuple[str, ...], seconds: float) -> None:
        """Record one observation of a histogram (seconds)."""
        key = (name, labels)
        hist = self.histograms.get(key)
        if hist is None:
            hist = self.histograms[key] = _Histogram(HISTOGRAMS[name][2])
        hist.observe(seconds)

    def value(self, name: str, labels: tuple[str, ...]) -> int:
        """A counter's value (0 if never incremented)."""
        return self.counters.get((name, labels), 0)


def _families(stats: Stats) -> Iterator[Metric]:
    from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

    for name, (doc, labels) in COUNTERS.items():
        fam = CounterMetricFamily(name, doc, labels=list(labels))
        for (n, values), count in sorted(stats.counters.items()):
            if n == name:
                fam.add_metric(list(values), count)
        yield fam
    for name, (doc, labels, bounds) in HISTOGRAMS.items():
        hfam = HistogramMetricFamily(name, doc, labels=list(labels))
        for (n, values), hist in sorted(stats.histograms.items(), key=lambda kv: kv[0]):
            if n != name:
                continue
            cumulative, running = [], 0
            for bound, count in zip((*(repr(b) for b in bounds), "+Inf"), hist.counts, strict=True):
                running += count
                cumulative.append((bound, running))
            hfam.add_metric(list(values), cumulative, hist.total)
        yield hfam


def database_families(rows: Sequence[Sequence[Any]]) -> Iterator[Metric]:
    """Gauges from rows of ``pgfence.audit_metrics`` (metric, module, queue, status, value);
    a NULL label is left out."""
    from prometheus_client.core import GaugeMetricFamily

    by_name: dict[str, list[Sequence[Any]]] = {}
    for row in rows:
        by_name.setdefault(str(row[0]), []).append(row)
    for name, samples in sorted(by_name.items()):
        used = [label for i, label in ((1, "module"), (2, "queue"), (3, "status"))
                if any(r[i] is not None for r in samples)]
        index = {"module": 1, "queue": 2, "status": 3}
        fam = GaugeMetricFamily(name, f"Database-side gauge {name} (pgfence.audit_metrics).",
                                labels=used)
        for r in samples:
            fam.add_metric([str(r[index[label]] or "") for label in used], float(r[4] or 0))
        yield fam


def _snapshot(ex: Executor, rows: Sequence[Sequence[Any]] | None) -> Iterator[Metric]:
    """One scrape: the executor's counters, its state gauges and the database rows."""
    from prometheus_client.core import GaugeMetricFamily

    yield from _families(ex.stats)
    state = ex.state()
    info = GaugeMetricFamily("pgfence_executor_info", "This executor (value 1).",
                             labels=["worker", "version"])
    info.add_metric([ex.worker_id, str(state["version"])], 1)
    yield info
    flight = GaugeMetricFamily("pgfence_in_flight", "Units running or queued for a slot.",
                               labels=["module"])
    for module, n in state["in_flight"].items():
        flight.add_metric([module], n)
    yield flight
    yield GaugeMetricFamily("pgfence_free_slots", "Delivery slots free now.",
                            value=state["free_slots"])
    yield GaugeMetricFamily("pgfence_listener_connected",
                            "1 while the LISTEN connection is up.",
                            value=1 if state["listener_connected"] else 0)
    since = state["seconds_since_last_sweep"]
    yield GaugeMetricFamily("pgfence_seconds_since_last_sweep",
                            "Seconds since the last claim sweep that succeeded (-1: none yet).",
                            value=-1 if since is None else since)
    yield GaugeMetricFamily("pgfence_database_gauges_up",
                            "1 if this scrape read pgfence.audit_metrics.",
                            value=0 if rows is None else 1)
    if rows:
        yield from database_families(rows)


SQL_METRICS = ("SELECT metric, module, queue, status, value FROM pgfence.audit_metrics"
               " ORDER BY 1, 2, 3, 4")


def render(executor: Executor, rows: Sequence[Sequence[Any]] | None) -> bytes:
    """The Prometheus text exposition of one scrape."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.registry import Collector

    class Snapshot(Collector):
        def collect(self) -> Iterator[Metric]:
            return _snapshot(executor, rows)

    registry = CollectorRegistry(auto_describe=False)
    registry.register(Snapshot())
    return generate_latest(registry)


class HttpServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on the executor's event loop.

    A minimal HTTP/1.1 server (GET only, one request per connection), so that answering proves
    the loop is alive, and nothing runs on another thread. Every request is bounded by
    ``timeout`` seconds (reading it, the database read of a scrape or readiness check).
    """

    def __init__(self, executor: Executor, host: str, port: int, timeout: float = 5.0) -> None:
        self.executor, self.host, self.port, self.timeout = executor, host, port, timeout
        self.server: asyncio.Server | None = None

    async def start(self) -> None:
        """Listen; ``port`` 0 picks a free one (read :attr:`port` after)."""
        self.server = await asyncio.start_server(self._handle, self.host, self.port)
        self.port = self.server.sockets[0].getsockname()[1]
        logger.info("metrics on http://%s:%d/metrics (health: /healthz, /readyz)", self.host,
                    self.port)

    async def aclose(self) -> None:
        """Stop listening."""
        if self.server is not None:
            self.server.close()
            with contextlib.suppress(Exception):
                await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(self.timeout):
                line = await reader.readline()
                while (header := await reader.readline()) not in (b"\r\n", b"\n", b""):
                    del header
                parts = line.decode("latin-1").split()
                method, path = (parts[0], parts[1].split("?")[0]) if len(parts) >= 2 else ("", "")
                status, ctype, body = await self._route(method, path)
            head = (f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\n"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, OSError):
            pass
        except asyncio.CancelledError:
            # The executor is shutting down (its pool closed under a scrape): the request ends
            # unanswered. Not re-raised: asyncio would log the handler task's cancellation.
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _route(self, method: str, path: str) -> tuple[str, str, bytes]:
        if method != "GET":
            return "405 Method Not Allowed", "text/plain", b"GET only\n"
        if path == "/healthz":
            return "200 OK", "text/plain", b"ok\n"
        # Database reads get half the request's bound, so that a database that does not
        # answer still gets its answer (503, database_gauges_up 0) within the bound.
        if path == "/readyz":
            checks = await self.executor.readiness(self.timeout / 2)
            ok = all(checks.values())
            body = json.dumps({"ready": ok, **checks}).encode() + b"\n"
            return ("200 OK" if ok else "503 Service Unavailable"), "application/json", body
        if path == "/metrics":
            rows: list[Any] | None
            try:
                rows = await self.executor.fetch(SQL_METRICS, (), timeout=self.timeout / 2)
            except Exception as exc:
                logger.debug("metrics: could not read pgfence.audit_metrics: %s", exc)
                rows = None
            return "200 OK", "text/plain; version=0.0.4; charset=utf-8", render(self.executor, rows)
        return "404 Not Found", "text/plain", b"/metrics, /healthz, /readyz\n"

