"""A local HTTP service of slow operations, for the demo and the crash tests.

It stands in for a cloud API that resets database branches, provisions resources and the like:
starting an operation returns at once with an id; the operation is ``queued`` for a while, then
``running``, then ``done`` (or ``error``); a client polls it. Built on aiohttp's server.

Two modes, to show what an idempotency key buys:

- ``idempotent``: a start request with an ``Idempotency-Key`` header that was seen before
  returns the operation it started (HTTP 200, ``"deduplicated": true``) and starts nothing;
- ``plain``: the header is ignored; every start request starts a new operation.

It counts start requests and actual starts, in total and per target and per key, so a test can
assert "the external operation was started exactly once".

HTTP API (JSON bodies):

==========================================  ====================================================
``POST /operations``                        start: ``{"kind", "target", "params"}`` → 201
                                            ``{"id", "status", "deduplicated"}`` (200 if
                                            deduplicated). ``params.sim`` may override timings
                                            for this operation: ``queue_time``, ``run_time``,
                                            ``start_delay`` (seconds before the response, after
                                            the operation was created), ``result_delay``,
                                            ``outcome`` (``done``/``error``), ``reject`` (an
                                            HTTP status to answer instead of starting).
``GET /operations/{id}``                    ``{"id", "status", "progress", ...}``;
                                            status ``queued | running | done | error |
                                            canceled``
``POST /operations/{id}/cancel``            cancel a queued/running operation (409 if ended)
``GET /operations/{id}/result``             the result of a ``done`` operation (after
                                            ``result_delay``), 409 before
``GET /stats``                              counters (see :meth:`Simulator.stats`)
``GET /healthz``                            ``{"ok": true}``
==========================================  ====================================================

Run it: ``pgfence op simulator --port 8765`` or ``python -m pgfence_demo.simulator``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

logger = logging.getLogger(__name__)

MODES = ("idempotent", "plain")


@dataclass
class SimOperation:
    """One operation the simulator started (times are ``time.monotonic()`` seconds)."""

    id: str
    kind: str
    target: str
    params: dict[str, Any]
    idempotency_key: str | None
    created: float
    queue_time: float
    run_time: float
    result_delay: float
    outcome: str
    canceled_at: float | None = None
    polls: int = 0

    def status(self, now: float) -> str:
        """``queued``, ``running``, ``done``/``error`` (the outcome) or ``canceled``."""
        if self.canceled_at is not None:
            return "canceled"
        elapsed = now - self.created
        if elapsed < self.queue_time:
            return "queued"
        if elapsed < self.queue_time + self.run_time:
            return "running"
        return self.outcome

    def view(self, now: float) -> dict[str, Any]:
        """The JSON a poll returns."""
        status = self.status(now)
        progress = 0.0
        if status == "running" and self.run_time > 0:
            progress = min(1.0, (now - self.created - self.queue_time) / self.run_time)
        elif status in ("done", "error"):
            progress = 1.0
        body: dict[str, Any] = {"id": self.id, "kind": self.kind, "target": self.target,
                                "status": status, "progress": round(progress, 2)}
        if status == "error":
            body["error"] = f"simulated failure of {self.kind} on {self.target}"
        return body


@dataclass
class Simulator:
    """The service state and its aiohttp application.

    Args:
        mode: ``idempotent`` (honour ``Idempotency-Key``) or ``plain`` (ignore it).
        queue_time, run_time: seconds an operation stays queued, then running (defaults for
            operations that do not override them in ``params.sim``).
        start_delay: seconds between creating an operation and answering the start request.
        result_delay: seconds ``/result`` takes to answer.
    """

    mode: str = "idempotent"
    queue_time: float = 1.0
    run_time: float = 3.0
    start_delay: float = 0.0
    result_delay: float = 0.0
    operations: dict[str, SimOperation] = field(default_factory=dict)
    by_key: dict[str, str] = field(default_factory=dict)
    start_requests: Counter[str] = field(default_factory=Counter)
    starts: Counter[str] = field(default_factory=Counter)
    key_requests: Counter[str] = field(default_factory=Counter)
    key_starts: Counter[str] = field(default_factory=Counter)

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")

    # -- handlers ------------------------------------------------------------------------------
    async def start(self, request: web.Request) -> web.Response:
        """POST /operations."""
        try:
            body = await request.json()
        except ValueError:
            return web.json_response({"error": "body must be JSON"}, status=400)
        if not isinstance(body, dict) or not body.get("kind") or not body.get("target"):
            return web.json_response({"error": "need kind and target"}, status=400)
        raw_params = body.get("params")
        params: dict[str, Any] = raw_params if isinstance(raw_params, dict) else {}
        raw_sim = params.get("sim")
        sim: dict[str, Any] = raw_sim if isinstance(raw_sim, dict) else {}
        kind, target = str(body["kind"]), str(body["target"])
        key = request.headers.get("Idempotency-Key")
        self.start_requests[target] += 1
        if key:
            self.key_requests[key] += 1
        if sim.get("reject"):
            return web.json_response({"error": "rejected by the simulator"},
                                     status=int(sim["reject"]))
        if self.mode == "idempotent" and key and key in self.by_key:
            existing = self.operations[self.by_key[key]]
            logger.info("start %s %s: key %s seen before -> %s (not started again)", kind,
                        target, key, existing.id)
            return web.json_response({"id": existing.id,
                                      "status": existing.status(time.monotonic()),
                                      "deduplicated": True}, status=200)
        op = SimOperation(
            id=f"sim-{uuid.uuid4().hex[:12]}", kind=kind, target=target,
            params=params, idempotency_key=key,
            created=time.monotonic(),
            queue_time=float(sim.get("queue_time", self.queue_time)),
            run_time=float(sim.get("run_time", self.run_time)),
            result_delay=float(sim.get("result_delay", self.result_delay)),
            outcome="error" if sim.get("outcome") == "error" else "done",
        )
        self.operations[op.id] = op
        self.starts[target] += 1
        if key:
            self.key_starts[key] += 1
            if self.mode == "idempotent":
                self.by_key[key] = op.id
        logger.info("start %s %s -> %s (start #%d for this target)", kind, target, op.id,
                    self.starts[target])
        delay = float(sim.get("start_delay", self.start_delay))
        if delay > 0:
            await asyncio.sleep(delay)
        return web.json_response({"id": op.id, "status": op.status(time.monotonic()),
                                  "deduplicated": False}, status=201)

    def _find(self, request: web.Request) -> SimOperation:
        op = self.operations.get(request.match_info["op_id"])
        if op is None:
            raise web.HTTPNotFound(text='{"error": "no such operation"}',
                                   content_type="application/json")
        return op

    async def get(self, request: web.Request) -> web.Response:
        """GET /operations/{id}."""
        op = self._find(request)
        op.polls += 1
        return web.json_response(op.view(time.monotonic()))

    async def cancel(self, request: web.Request) -> web.Response:
        """POST /operations/{id}/cancel."""
        op = self._find(request)
        status = op.status(time.monotonic())
        if status in ("queued", "running"):
            op.canceled_at = time.monotonic()
            logger.info("cancel %s (%s %s)", op.id, op.kind, op.target)
            return web.json_response(op.view(time.monotonic()))
        if status == "canceled":
            return web.json_response(op.view(time.monotonic()))
        return web.json_response({"error": f"operation is {status}"}, status=409)

    async def result(self, request: web.Request) -> web.Response:
        """GET /operations/{id}/result."""
        op = self._find(request)
        status = op.status(time.monotonic())
        if status != "done":
            return web.json_response({"error": f"operation is {status}"}, status=409)
        if op.result_delay > 0:
            await asyncio.sleep(op.result_delay)
        return web.json_response({"id": op.id, "target": op.target,
                                  "result": {"kind": op.kind, "target": op.target,
                                             "params": {k: v for k, v in op.params.items()
                                                        if k != "sim"}}})

    def stats(self) -> dict[str, Any]:
        """Counters: ``start_requests`` and ``starts`` (operations actually created), in total,
        ``by_target`` and ``by_key``; plus each operation's status and poll count."""
        now = time.monotonic()
        targets = set(self.start_requests) | set(self.starts)
        keys = set(self.key_requests) | set(self.key_starts)
        return {
            "mode": self.mode,
            "start_requests": sum(self.start_requests.values()),
            "starts": sum(self.starts.values()),
            "by_target": {t: {"start_requests": self.start_requests[t], "starts": self.starts[t]}
                          for t in sorted(targets)},
            "by_key": {k: {"start_requests": self.key_requests[k], "starts": self.key_starts[k]}
                       for k in sorted(keys)},
            "operations": [{"id": o.id, "kind": o.kind, "target": o.target,
                            "idempotency_key": o.idempotency_key, "status": o.status(now),
                            "polls": o.polls} for o in self.operations.values()],
        }

    async def get_stats(self, request: web.Request) -> web.Response:
        """GET /stats."""
        return web.json_response(self.stats())

    async def healthz(self, request: web.Request) -> web.Response:
        """GET /healthz."""
        return web.json_response({"ok": True, "mode": self.mode})

    def app(self) -> web.Application:
        """The aiohttp application serving this simulator."""
        app = web.Application()
        app.add_routes([
            web.post("/operations", self.start),
            web.get("/operations/{op_id}", self.get),
            web.post("/operations/{op_id}/cancel", self.cancel),
            web.get("/operations/{op_id}/result", self.result),
            web.get("/stats", self.get_stats),
            web.get("/healthz", self.healthz),
        ])
        return app


@contextlib.asynccontextmanager
async def serve(sim: Simulator, host: str = "127.0.0.1", port: int = 0) -> AsyncIterator[str]:
    """Serve ``sim`` until the block exits; yields its base URL (``port=0``: a free port)."""
    runner = web.AppRunner(sim.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, host, port)
    await site.start()
    addr = runner.addresses[0]
    try:
        yield f"http://{addr[0]}:{addr[1]}"
    finally:
        await runner.cleanup()


async def run(sim: Simulator, host: str = "127.0.0.1", port: int = 0) -> None:
    """Serve until SIGTERM/SIGINT; prints ``listening on <url>`` (flushed) once bound."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with serve(sim, host, port) as url:
        print(f"pgfence simulator ({sim.mode}) listening on {url}", flush=True)
        await stop.wait()


def build_parser() -> argparse.ArgumentParser:
    """Command-line options, shared with ``pgfence op simulator``."""
    p = argparse.ArgumentParser(prog="python -m pgfence_demo.simulator",
                                description="A local HTTP service of slow operations.")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765, help="0 = a free port (printed)")
    p.add_argument("--mode", choices=MODES, default="idempotent",
                   help="idempotent: honour Idempotency-Key; plain: ignore it")
    p.add_argument("--queue-time", type=float, default=1.0, help="seconds queued")
    p.add_argument("--run-time", type=float, default=3.0, help="seconds running")
    p.add_argument("--start-delay", type=float, default=0.0,
                   help="seconds before answering a start (after starting)")
    p.add_argument("--result-delay", type=float, default=0.0, help="seconds /result takes")
    return p


def main(argv: list[str] | None = None) -> None:
    """Entry point of ``python -m pgfence_demo.simulator``."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s simulator: %(message)s")
    sim = Simulator(mode=args.mode, queue_time=args.queue_time, run_time=args.run_time,
                    start_delay=args.start_delay, result_delay=args.result_delay)
    asyncio.run(run(sim, args.host, args.port))


if __name__ == "__main__":
    main()
