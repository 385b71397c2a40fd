"""OpenTelemetry (the ``otel`` extra): the trace context from enqueue to delivery, and the spans.

A real in-process executor against the real database, with the OpenTelemetry SDK's in-memory
span exporter as its tracer provider. A message enqueued inside a span is delivered in a span
of the same trace (its child); a failed delivery has status ERROR; a plan's run and steps and an
operation's issue and poll have their spans. With tracing off, the executor never reads a trace
context: the database's own count of calls (track_functions) of pgfence.trace_contexts stays 0.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import psycopg
import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pgfence import operation as op_api
from pgfence import outbox, plan
from pgfence.executor import Executor, ExecutorConfig, Module, OutboxModule
from pgfence.operation.module import OperationModule
from pgfence.outbox import Claimed
from pgfence.plan.module import PlanModule
from pgfence.transports import CallableTransport, PermanentError
from support import InstantOperation, Proc, wait_for
from test_audit_docs import psql, sql_blocks


def _provider() -> tuple[TracerProvider, InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider, exporter


def _one(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _run(db: str, modules: list[Module], done: str, *, otel: bool,
         provider: TracerProvider | None = None) -> Executor:
    """Run an executor until the SQL ``done`` answers true, then stop it (bounded: 60 s)."""
    executor = Executor(db, modules, ExecutorConfig(poll_interval=0.2, reap_interval=30, grace=5,
                                                     otel=otel, otel_provider=provider))

    def finished() -> bool:
        with psycopg.connect(db, autocommit=True) as c:
            return bool(_one(c, done))

    async def scenario() -> None:
        task = asyncio.create_task(executor.run())
        try:
            async with asyncio.timeout(60):
                while not await asyncio.to_thread(finished):
                    await asyncio.sleep(0.05)
        finally:
            executor.stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    return executor


def _named(spans: tuple[ReadableSpan, ...], name: str) -> list[ReadableSpan]:
    return [s for s in spans if s.name == name]


async def _deliver(message: Claimed) -> dict[str, Any]:
    if message.payload.get("fail"):
        raise PermanentError("410 gone")
    return {"ok": message.id}


def test_a_message_enqueued_in_a_span_is_delivered_in_its_trace(
        db: str, conn: psycopg.Connection[Any]) -> None:
    provider, exporter = _provider()
    app = provider.get_tracer("shop")
    with app.start_as_current_span("checkout") as checkout:
        traced = outbox.enqueue(conn, "hooks", "https://example.test/a", {"order": 1})
        failing = outbox.enqueue(conn, "hooks", "https://example.test/b", {"fail": True})
    with conn.transaction(), app.start_as_current_span("batch") as batch:
        many = outbox.enqueue_many(conn, "hooks", ["r1", "r2"], [{"n": 1}, {"n": 2}])
    plain = outbox.enqueue(conn, "hooks", "https://example.test/c", {"order": 3})
    ctx = checkout.get_span_context()
    want = f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{ctx.trace_flags:02x}"
    assert _one(conn, "SELECT traceparent FROM pgfence.outbox WHERE id = %s", (traced,)) == want
    assert _one(conn, "SELECT traceparent FROM pgfence.outbox WHERE id = %s", (plain,)) is None
    assert _one(conn, "SELECT current_setting('pgfence.traceparent', true)") in (None, ""), \
        "an autocommit enqueue leaves no setting behind"
    exporter.clear()  # only the executor's spans from here

    executor = _run(db, [OutboxModule({"hooks": CallableTransport(_deliver)})],
                    "SELECT count(*) = 0 FROM pgfence.outbox WHERE status IN ('pending', 'processing')",
                    otel=True, provider=provider)
    assert executor.tracing is not None and executor.tracing.fetches >= 1
    spans = exporter.get_finished_spans()
    by_id = {s.attributes["messaging.message.id"]: s for s in _named(spans, "process hooks")
             if s.attributes}
    assert sorted(by_id) == sorted(str(i) for i in (traced, failing, *many, plain))

    ok = by_id[str(traced)]
    assert ok.context.trace_id == ctx.trace_id, "the delivery is in the enqueuer's trace"
    assert ok.parent is not None and ok.parent.span_id == ctx.span_id
    assert ok.kind == SpanKind.CONSUMER
    assert ok.status.status_code != StatusCode.ERROR
    assert dict(ok.attributes or {}) == {
        "messaging.system": "pgfence", "messaging.operation.type": "process",
        "messaging.operation.name": "process", "messaging.message.id": str(traced),
        "messaging.destination.name": "hooks", "pgfence.module": "outbox", "pgfence.id": traced,
        "pgfence.channel": "hooks", "pgfence.attempt": 1,
        "pgfence.worker": executor.worker_id, "pgfence.outcome": "delivered"}

    bad = by_id[str(failing)]
    assert bad.context.trace_id == ctx.trace_id
    assert bad.status.status_code == StatusCode.ERROR
    assert bad.status.description == "410 gone"
    assert (bad.attributes or {})["error.type"] == "failed"
    assert (bad.attributes or {})["pgfence.outcome"] == "failed"

    bctx = batch.get_span_context()
    for mid in many:
        assert by_id[str(mid)].context.trace_id == bctx.trace_id
    root = by_id[str(plain)]
    assert root.parent is None, "no trace context stored: the delivery starts its own trace"
    assert root.context.trace_id not in (ctx.trace_id, bctx.trace_id)
    assert _one(conn, "SELECT status FROM pgfence.outbox WHERE id = %s", (failing,)) == "failed"


def test_a_plan_and_an_operation_have_spans_in_the_requesters_trace(
        db: str, conn: psycopg.Connection[Any]) -> None:
    conn.execute("CREATE FUNCTION public.trace_ok(p jsonb) RETURNS jsonb LANGUAGE sql"
                 " AS $$ SELECT jsonb_build_object('n', p -> 'n') $$")
    conn.execute("CREATE FUNCTION public.trace_boom(p jsonb) RETURNS jsonb LANGUAGE plpgsql"
                 " AS $$ BEGIN RAISE EXCEPTION 'boom' USING ERRCODE = 'P0001'; END $$")
    plan.register_action(conn, "trace.ok", "public.trace_ok(jsonb)", "a SQL step")
    plan.register_action(conn, "trace.boom", "public.trace_boom(jsonb)", "a failing SQL step")
    plan.register_action(conn, "trace.hook", None, "an external step")
    provider, exporter = _provider()
    app = provider.get_tracer("ops")
    with app.start_as_current_span("propose") as proposing:
        good = plan.propose(conn, [{"action": "trace.ok", "args": {"n": 1}},
                                   {"action": "trace.hook", "args": {"recipient": "r"}}], "agent")
        failing = plan.propose(conn, [{"action": "trace.boom", "args": {}}], "agent")
    with app.start_as_current_span("request") as requesting:
        op = op_api.request(conn, "trace.op", "target-1")
    for pid in (good, failing):
        assert plan.approve(conn, pid, "alice") == "approved"
    exporter.clear()

    hooked: list[int] = []

    async def hook(message: Claimed) -> dict[str, Any]:
        hooked.append(message.id)
        return {"hooked": True}

    modules: list[Module] = [
        PlanModule({"trace.hook": CallableTransport(hook)}, heartbeat=dt.timedelta(seconds=60)),
        OperationModule({"trace.op": InstantOperation()}, lease=dt.timedelta(seconds=60))]
    _run(db, modules, "SELECT (SELECT count(*) FROM pgfence.plan WHERE status IN ('executed', 'failed')) = 2"
                      " AND (SELECT status FROM pgfence.operation WHERE id = "
                      f"{op.id}) = 'succeeded'", otel=True, provider=provider)
    assert hooked == [good]
    spans = exporter.get_finished_spans()
    pctx, rctx = proposing.get_span_context(), requesting.get_span_context()

    runs = {(s.attributes or {})["pgfence.id"]: s for s in _named(spans, "plan run")}
    assert sorted(runs) == sorted([good, failing])
    for run in runs.values():
        assert run.context.trace_id == pctx.trace_id
        assert run.parent is not None and run.parent.span_id == pctx.span_id
    ok_step = _named(spans, "plan step trace.ok")
    hook_step = _named(spans, "plan step trace.hook")
    boom_step = _named(spans, "plan step trace.boom")
    assert len(ok_step) == len(hook_step) == len(boom_step) == 1
    for step, pid in ((ok_step[0], good), (hook_step[0], good), (boom_step[0], failing)):
        assert step.parent is not None and step.parent.span_id == runs[pid].context.span_id
        assert step.context.trace_id == pctx.trace_id
    assert dict(ok_step[0].attributes or {}) == {
        "pgfence.module": "plan", "pgfence.id": good, "pgfence.fence": 1, "pgfence.step": 1,
        "pgfence.kind": "trace.ok", "pgfence.worker": (ok_step[0].attributes or {})["pgfence.worker"],
        "pgfence.outcome": "ok"}
    assert (hook_step[0].attributes or {})["pgfence.step"] == 2
    assert hook_step[0].status.status_code != StatusCode.ERROR
    assert boom_step[0].status.status_code == StatusCode.ERROR
    assert "boom" in (boom_step[0].status.description or "")
    assert (boom_step[0].attributes or {})["error.type"] == "error"

    [opspan] = _named(spans, "operation trace.op")
    assert opspan.context.trace_id == rctx.trace_id
    assert opspan.parent is not None and opspan.parent.span_id == rctx.span_id
    assert (opspan.attributes or {})["pgfence.outcome"] == "succeeded"
    assert (opspan.attributes or {})["messaging.message.id"] == str(op.id)
    for child in ("operation issue", "operation poll"):
        found = _named(spans, child)
        assert found, f"no {child!r} span"
        for s in found:
            assert s.parent is not None and s.parent.span_id == opspan.context.span_id
            assert (s.attributes or {})["pgfence.id"] == op.id


def _calls(conn: psycopg.Connection[Any], function: str) -> int:
    """Calls of pgfence.<function> counted by the statistics system (track_functions)."""
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return int(_one(conn, "SELECT coalesce(sum(calls), 0) FROM pg_stat_user_functions"
                          " WHERE schemaname = 'pgfence' AND funcname = %s", (function,)))


@pytest.mark.timeout(120)
def test_with_tracing_off_the_executor_reads_no_trace_context(
        db: str, conn: psycopg.Connection[Any]) -> None:
    name = conn.info.dbname
    conn.execute(f'ALTER DATABASE "{name}" SET track_functions = \'all\'')
    provider, exporter = _provider()
    with provider.get_tracer("shop").start_as_current_span("checkout"):
        outbox.enqueue_many(conn, "hooks", ["r"] * 30, [{"i": i} for i in range(30)])
    exporter.clear()
    module = OutboxModule({"hooks": CallableTransport(_deliver)})
    off = _run(db, [module], "SELECT count(*) = 30 FROM pgfence.outbox WHERE status = 'sent'",
               otel=False)
    assert off.tracing is None
    # The executor's connections are closed: their counts are in the statistics.
    assert _calls(conn, "outbox_claim") + _calls(conn, "outbox_settle_and_claim") > 0, \
        "track_functions counts the executor's calls"
    assert _calls(conn, "trace_contexts") == 0
    assert exporter.get_finished_spans() == (), "no span without --otel"

    with provider.get_tracer("shop").start_as_current_span("again"):
        outbox.enqueue_many(conn, "hooks", ["r"] * 5, [{"i": i} for i in range(5)])
    on = _run(db, [OutboxModule({"hooks": CallableTransport(_deliver)})],
              "SELECT count(*) = 35 FROM pgfence.outbox WHERE status = 'sent'", otel=True,
              provider=provider)
    assert on.tracing is not None
    assert _calls(conn, "trace_contexts") == on.tracing.fetches >= 1, \
        "one call per claimed batch, only with tracing on"
    assert len(_named(exporter.get_finished_spans(), "process hooks")) == 5


def test_the_sql_block_of_docs_tracing_runs_and_stores_its_context(
        db: str, conn: psycopg.Connection[Any], tmp_path: Path) -> None:
    doc = Path(__file__).resolve().parents[1] / "docs" / "tracing.md"
    [block] = sql_blocks(doc.read_text(encoding="utf-8"))
    run = psql(db, block, tmp_path)
    assert run.returncode == 0, run.stderr
    assert conn.execute("SELECT traceparent, tracestate FROM pgfence.outbox WHERE channel = 'orders'").fetchall() == [
        ("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01", "congo=t61rcWkgMzE")]
    # The same block with a hand-built (uppercase) traceparent: refused (22023), nothing enqueued.
    bad = psql(db, block.replace("4bf92f3577b34da6", "4BF92F3577B34DA6"), tmp_path)
    assert bad.returncode != 0 and "is not a W3C traceparent" in bad.stderr, bad.stderr
    assert conn.execute("SELECT count(*) FROM pgfence.outbox WHERE channel = 'orders'").fetchone() == (1,)


def _spans(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.timeout(120)
@pytest.mark.parametrize("disabled", [False, True], ids=["otel", "OTEL_SDK_DISABLED"])
def test_a_real_executor_process_with_otel_exports_delivery_spans(
        db: str, conn: psycopg.Connection[Any], tmp_path: Path, disabled: bool) -> None:
    conn.execute(f'ALTER DATABASE "{conn.info.dbname}" SET track_functions = \'all\'')
    provider, _ = _provider()
    with provider.get_tracer("shop").start_as_current_span("checkout") as checkout:
        ok = outbox.enqueue(conn, "hooks", "r", {"n": 1})
        bad = outbox.enqueue(conn, "hooks", "r", {"fail": True})
    spans_file = tmp_path / "spans.jsonl"
    proc = Proc(db, ["--otel", "--route", "hooks=python:otel_spans:deliver", "--poll-interval", "0.2",
                     "--worker-id", "otel-1"], tmp_path / "executor.log",
                env={"PGFENCE_TEST_SPANS": str(spans_file),
                     **({"OTEL_SDK_DISABLED": "true"} if disabled else {})})
    try:
        wait_for(lambda: _one(conn, "SELECT count(*) FROM pgfence.outbox WHERE status IN ('sent', 'failed')") == 2,
                 30, "both messages to be delivered or failed")
    finally:
        assert proc.terminate() == 0, proc.output()
    spans = {s["attributes"]["pgfence.id"]: s for s in _spans(spans_file) if s["name"] == "process hooks"}
    if disabled:
        assert spans == {}
        assert _calls(conn, "trace_contexts") == 0
        assert "but OTEL_SDK_DISABLED=true: no spans" in proc.output()
        return
    ctx = checkout.get_span_context()
    assert sorted(spans) == sorted([ok, bad])
    assert spans[ok]["trace_id"] == f"{ctx.trace_id:032x}" and spans[ok]["parent"] == f"{ctx.span_id:016x}"
    assert spans[ok]["attributes"]["pgfence.worker"] == "otel-1"
    assert spans[ok]["attributes"]["pgfence.outcome"] == "delivered"
    assert spans[bad]["status"] == "ERROR" and spans[bad]["attributes"]["error.type"] == "failed"
    assert _calls(conn, "trace_contexts") >= 1


#: Python with the opentelemetry package made unimportable (as if the extra were not installed).
WITHOUT_OTEL = "import sys; sys.modules['opentelemetry'] = None\n"


def test_without_opentelemetry_installed_enqueue_works_and_otel_is_refused_clearly(
        db: str, conn: psycopg.Connection[Any]) -> None:
    script = WITHOUT_OTEL + (
        "import psycopg\n"
        "from pgfence import outbox, tracing\n"
        "assert not tracing.available()\n"
        f"with psycopg.connect({db!r}, autocommit=True) as c:\n"
        "    print(outbox.enqueue(c, 'hooks', 'r', {}))\n"
        "from pgfence.cli import main\n"
        f"main(['--dsn', {db!r}, 'executor', '--otel', '--route', 'hooks=noop'])\n")
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                         check=False)
    assert run.returncode == 2, run.stderr
    assert "OpenTelemetry is not installed: pip install 'pgfence[otel]'" in run.stderr
    assert "Traceback" not in run.stderr
    mid = int(run.stdout.split()[0])
    assert _one(conn, "SELECT traceparent IS NULL AND status = 'pending' FROM pgfence.outbox WHERE id = %s", (mid,))
