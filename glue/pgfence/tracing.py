"""OpenTelemetry spans of the executor, and the W3C trace context carried from enqueue to delivery.

An optional extra: ``pip install pgfence[otel]`` (the API only; the application brings its SDK
and exporter). Nothing here is imported unless tracing is asked for: the executor with
``ExecutorConfig(otel=True)`` (``pgfence executor --otel``) builds one :class:`Tracing`; off,
its hot path is a single ``is None`` check per claimed batch. See docs/tracing.md.

Spans (names and attributes follow the OpenTelemetry semantic conventions for messaging where
they fit; ``pgfence.*`` attributes otherwise):

* ``process <channel>`` (CONSUMER): one outbox delivery attempt; child of the enqueuer's span
  when the message carries a trace context.
* ``plan run`` (CONSUMER) with a ``plan step <action>`` child per step run; child of the
  proposer's span.
* ``operation <kind>`` (CONSUMER) with ``operation issue`` / ``operation poll`` children;
  child of the requester's span.

A failed unit has status ERROR (its error as the description) and ``error.type`` = its
pgfence outcome (retry, failed, dead, lost_race, unrecorded, error).

The trace context: a caller sets the transaction settings ``pgfence.traceparent`` (and
``pgfence.tracestate``); the column defaults of outbox, plan and operation store them
(functions/05_trace_context.sql). :func:`carried` does that for the Python helpers
(``outbox.enqueue``, ``plan.propose``, ``operation.request``) from the current span, when the
OpenTelemetry API is installed. The executor reads them per claimed batch with
``pgfence.trace_contexts(module, ids)`` — only when tracing is on.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Iterator, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.pq import TransactionStatus

if TYPE_CHECKING:
    from .executor import Executor, Job, OutboxModule
    from .operation import ClaimedOperation
    from .operation.module import OperationModule
    from .outbox import Claimed
    from .plan import ClaimedPlan, StepResult
    from .plan.module import PlanModule

logger = logging.getLogger(__name__)

SQL_TRACE_CONTEXTS = ("SELECT id, traceparent, tracestate"
                      " FROM pgfence.trace_contexts(%s::text, %s::bigint[])")
#: SET LOCAL of both settings (set_config(..., true): until the end of the transaction).
SQL_SET_CONTEXT = ("SELECT set_config('pgfence.traceparent', %s, true),"
                   " set_config('pgfence.tracestate', %s, true)")
SYSTEM = "pgfence"

_api: Any = None  # the opentelemetry package once imported; False when it is not installed


def _otel() -> Any:
    """The ``opentelemetry`` package (trace and propagator imported), or None without it."""
    global _api
    if _api is None:
        try:
            import opentelemetry.trace
            import opentelemetry.trace.propagation.tracecontext
            _api = opentelemetry
        except ImportError:
            _api = False
    return _api or None


def available() -> bool:
    """Whether the OpenTelemetry API is installed (``pip install pgfence[otel]``)."""
    return _otel() is not None


def disabled_by_env() -> bool:
    """OpenTelemetry's own switch: ``OTEL_SDK_DISABLED=true`` turns the executor's spans off."""
    return os.environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"


# -- enqueue side ---------------------------------------------------------------------------------
def current_context() -> tuple[str, str] | None:
    """``(traceparent, tracestate)`` of the current OpenTelemetry span (tracestate may be ''),
    or None: the API is not installed, or no valid span is current."""
    otel = _otel()
    if otel is None or not otel.trace.get_current_span().get_span_context().is_valid:
        return None
    carrier: dict[str, str] = {}
    otel.trace.propagation.tracecontext.TraceContextTextMapPropagator().inject(carrier)
    tp = carrier.get("traceparent")
    return (tp, carrier.get("tracestate", "")) if tp else None


@contextlib.contextmanager
def carried(conn: psycopg.Connection[Any]) -> Iterator[None]:
    """Around an insert by a Python helper: the current span's trace context in the settings
    ``pgfence.traceparent`` / ``pgfence.tracestate`` of the transaction, so that the column
    defaults store it. Without the OpenTelemetry API or a current span: nothing at all.

    An autocommit connection gets a transaction around the block (the settings are local to
    it); in the caller's transaction the settings are cleared again after the block (a SET LOCAL
    of the caller's own is then cleared too). Raises: what the statements raise.
    """
    ctx = current_context()
    if ctx is None:
        yield
        return
    if conn.autocommit and conn.info.transaction_status == TransactionStatus.IDLE:
        with conn.transaction():
            conn.execute(SQL_SET_CONTEXT, ctx)
            yield
        return
    conn.execute(SQL_SET_CONTEXT, ctx)
    try:
        yield
    finally:
        if conn.info.transaction_status == TransactionStatus.INTRANS:  # not after an error
            conn.execute(SQL_SET_CONTEXT, ("", ""))


# -- executor side --------------------------------------------------------------------------------
class Tracing:
    """The executor's spans (one per :class:`~pgfence.executor.Executor` with ``otel=True``).

    Args:
        executor: the executor (its ``fetch``, ``worker_id``).
        provider: an OpenTelemetry ``TracerProvider``; None = the global one (set by the
            application or by ``opentelemetry-instrument``).

    Raises:
        RuntimeError: the OpenTelemetry API is not installed.
    """

    def __init__(self, executor: Executor, provider: Any = None) -> None:
        otel = _otel()
        if otel is None:
            raise RuntimeError("OpenTelemetry is not installed: pip install 'pgfence[otel]'")
        from opentelemetry.trace import SpanKind, Status, StatusCode
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        from . import __version__
        self.executor = executor
        self.tracer = otel.trace.get_tracer("pgfence", __version__, tracer_provider=provider)
        self._propagator = TraceContextTextMapPropagator()
        self._consumer = SpanKind.CONSUMER
        self._status, self._error = Status, StatusCode.ERROR
        self._fetch = True  # False after the database refused trace_contexts (an old schema)
        #: How many times trace contexts were read (one call per claimed batch).
        self.fetches = 0

    # -- trace contexts ---------------------------------------------------------------------------
    async def contexts(self, module: str, ids: Sequence[int]) -> dict[int, Any]:
        """id -> the OpenTelemetry Context of the item's stored traceparent (items without one
        are left out). One database call; a failure is logged and answers {} (spans then start
        their own traces)."""
        if not self._fetch or not ids:
            return {}
        try:
            rows = await self.executor.fetch(SQL_TRACE_CONTEXTS, (module, list(ids)))
        except psycopg.errors.UndefinedFunction:
            self._fetch = False
            logger.warning("the database has no pgfence.trace_contexts (run `pgfence migrate`): "
                           "spans start their own traces")
            return {}
        except Exception as exc:
            logger.warning("could not read the trace contexts of %d %s item(s): %s", len(ids),
                           module, exc)
            return {}
        self.fetches += 1
        out: dict[int, Any] = {}
        for item_id, traceparent, tracestate in rows:
            carrier = {"traceparent": traceparent}
            if tracestate:
                carrier["tracestate"] = tracestate
            out[int(item_id)] = self._propagator.extract(carrier)
        return out

    def _fail(self, span: Any, outcome: str, error: str | None) -> None:
        span.set_attribute("error.type", outcome)
        span.set_status(self._status(self._error, error or outcome))

    def _base(self, module: str, item_id: int) -> dict[str, Any]:
        return {"messaging.system": SYSTEM, "messaging.operation.type": "process",
                "messaging.operation.name": "process", "messaging.message.id": str(item_id),
                "pgfence.module": module, "pgfence.id": item_id,
                "pgfence.worker": self.executor.worker_id}

    # -- outbox -----------------------------------------------------------------------------------
    async def outbox_jobs(self, module: OutboxModule, rows: Sequence[Claimed],
                          claimed_at: float) -> list[Job]:
        """The delivery jobs of a claimed batch, each in a ``process <channel>`` span."""
        parents = await self.contexts("outbox", [m.id for m in rows])

        def job(message: Claimed) -> Job:
            def run() -> Coroutine[Any, Any, None]:
                return self._deliver(module, message, claimed_at, parents.get(message.id))
            return run
        return [job(m) for m in rows]

    async def _deliver(self, module: OutboxModule, message: Claimed, claimed_at: float,
                       parent: Any) -> None:
        attrs = self._base("outbox", message.id)
        attrs.update({"messaging.destination.name": message.channel,
                      "pgfence.channel": message.channel, "pgfence.attempt": message.attempt})
        with self.tracer.start_as_current_span(f"process {message.channel}", context=parent,
                                               kind=self._consumer, attributes=attrs) as span:
            outcome, error = await module.deliver(message, claimed_at)
            span.set_attribute("pgfence.outcome", outcome)
            if error is not None:
                self._fail(span, outcome, error)

    # -- plans ------------------------------------------------------------------------------------
    async def plan_jobs(self, module: PlanModule, rows: Sequence[ClaimedPlan]) -> list[Job]:
        """The run jobs of a claimed batch of plans, each in a ``plan run`` span."""
        parents = await self.contexts("plan", [r.id for r in rows])

        def job(run: ClaimedPlan) -> Job:
            async def go() -> None:
                attrs = self._base("plan", run.id)
                attrs.update({"pgfence.fence": run.run_token, "pgfence.step": run.next_step,
                              "pgfence.step_count": run.step_count})
                with self.tracer.start_as_current_span("plan run", context=parents.get(run.id),
                                                       kind=self._consumer, attributes=attrs):
                    await module.run_plan(run)
            return go
        return [job(r) for r in rows]

    def plan_step(self, plan_id: int, token: int, step: StepResult, started: float,
                  ok: bool, error: str | None) -> None:
        """Record one step run as a ``plan step <action>`` span (child of the current ``plan
        run`` span): from ``started`` (``time.monotonic()``) to now."""
        now_ns = time.time_ns()
        start_ns = now_ns - int(max(time.monotonic() - started, 0.0) * 1e9)
        outcome = "ok" if ok else "error"
        attrs = {"pgfence.module": "plan", "pgfence.id": plan_id, "pgfence.fence": token,
                 "pgfence.step": step.step_index or 0, "pgfence.kind": step.action or "",
                 "pgfence.worker": self.executor.worker_id, "pgfence.outcome": outcome}
        span = self.tracer.start_span(f"plan step {step.action}", attributes=attrs,
                                      start_time=start_ns)
        if not ok:
            self._fail(span, outcome, error)
        span.end(end_time=now_ns)

    # -- operations -------------------------------------------------------------------------------
    async def operation_jobs(self, module: OperationModule,
                             rows: Sequence[ClaimedOperation]) -> list[Job]:
        """The jobs of a claimed batch of operations, each in an ``operation <kind>`` span."""
        parents = await self.contexts("operation", [op.id for op in rows])

        def job(op: ClaimedOperation) -> Job:
            async def go() -> None:
                attrs = self._base("operation", op.id)
                attrs.update({"messaging.destination.name": op.kind, "pgfence.kind": op.kind,
                              "pgfence.fence": op.fence})
                with self.tracer.start_as_current_span(f"operation {op.kind}",
                                                       context=parents.get(op.id),
                                                       kind=self._consumer,
                                                       attributes=attrs) as span:
                    await module.run(op)
                    status = module.finished.get(op.id)
                    span.set_attribute("pgfence.outcome", status or "unfinished")
                    if status == "failed":
                        self._fail(span, "failed", "the operation failed")
            return go
        return [job(op) for op in rows]

    def step(self, what: str, op: ClaimedOperation,
             call: Callable[[], Awaitable[Any]]) -> Coroutine[Any, Any, Any]:
        """``call()`` awaited in an ``operation <what>`` span (issue, poll), child of the
        current one; an exception it raises is recorded (status ERROR) and re-raised."""
        async def go() -> Any:
            attrs = {"pgfence.module": "operation", "pgfence.id": op.id, "pgfence.kind": op.kind,
                     "pgfence.fence": op.fence, "pgfence.worker": self.executor.worker_id}
            with self.tracer.start_as_current_span(f"operation {what}", attributes=attrs):
                return await call()
        return go()
