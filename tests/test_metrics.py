"""Metrics, health and structured logs of real executors against a real PostgreSQL: /metrics
scraped during a drain and its counters checked against the database; /healthz and /readyz
(the database going down behind a real TCP proxy); `pgfence metrics`; --log-format json; the
log lines that name what happened (a plan step, not an outbox message; a finished plan)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from prometheus_client.parser import text_string_to_metric_families

from pgfence import outbox, plan
from pgfence.cli import main
from pgfence.executor import Executor, ExecutorConfig, OutboxModule
from pgfence.transports import NoopTransport
from pgfence_demo.faults import FaultyLink
from pgfence_demo.receivers import free_port
from support import FAST, Proc, scalar, wait_for
from test_audit_docs import sql_blocks
from test_docs import psql

N = 20000


def get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of a scrape: (name, sorted labels) -> value."""
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def value(scrape: dict[tuple[str, tuple[tuple[str, str], ...]], float], name: str,
          **labels: str) -> float:
    return scrape.get((name, tuple(sorted(labels.items()))), 0.0)


def counts(dsn: str) -> dict[tuple[str, str], int]:
    with psycopg.connect(dsn, autocommit=True) as c:
        return {(str(ch), str(st)): int(n) for ch, st, n in c.execute(
            "SELECT channel, status, count(*) FROM pgfence.outbox GROUP BY 1, 2")}


@pytest.mark.timeout(180)
def test_metrics_scraped_during_a_drain_match_the_database(db: str, conn: psycopg.Connection,
                                                          tmp_path: Path) -> None:
    conn.execute("SELECT pgfence.outbox_enqueue_many('m', ARRAY(SELECT 'r' FROM generate_series(1, %s)),"
                 " ARRAY(SELECT '{}'::jsonb FROM generate_series(1, %s)))", (N, N))
    for n in range(3):
        outbox.enqueue(conn, "bad", "ftp://not-http", {"n": n})  # permanent: not an http(s) URL
    conn.execute("SELECT pgfence.outbox_configure_channel('dead', 1)")
    for n in range(2):  # retryable (refused), but one attempt only: dead
        outbox.enqueue(conn, "dead", f"http://127.0.0.1:{free_port()}/x", {"n": n})
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = Proc(db, ["--worker-id", "met-1", *FAST, "--route", "m=noop", "--route", "bad=webhook",
                     "--route", "dead=webhook", "--metrics-port", str(port), "--batch", "50"],
                tmp_path / "met.log")
    try:
        wait_for(lambda: "started" in proc.output(), 20, "the executor to start")
        assert f"metrics on {url}/metrics" in proc.output()
        mid_drain = 0
        while True:  # bounded by the test's timeout and the drain's end
            scrape = samples(get(f"{url}/metrics")[1])
            sent_after = counts(db).get(("m", "sent"), 0)
            delivered = value(scrape, "pgfence_delivered_total", module="outbox", queue="m")
            # A delivery is counted once its sent is committed: never ahead of the database.
            assert delivered <= sent_after
            assert value(scrape, "pgfence_claimed_total", module="outbox", queue="m") >= delivered
            # the database-side gauges are in a scrape only when its read of audit_metrics
            # finished within the probe timeout (pgfence_database_gauges_up: 0 on a loaded machine)
            if 0 < delivered < N and value(scrape, "pgfence_database_gauges_up") == 1:
                mid_drain += 1
                assert value(scrape, "pgfence_queue_depth", module="outbox", queue="m",
                             status="ready") + value(scrape, "pgfence_queue_depth", module="outbox",
                                                     queue="m", status="in_flight") > 0
            if delivered == N:
                break
        assert mid_drain > 0, "at least one scrape with the gauges during the drain"
        wait_for(lambda: counts(db).get(("dead", "dead"), 0) == 2
                 and counts(db).get(("bad", "failed"), 0) == 3, 30, "the failures")
        scrape = wait_for(lambda: (s := samples(get(f"{url}/metrics")[1])) and value(
            s, "pgfence_dead_total", module="outbox", queue="dead") == 2
            and value(s, "pgfence_database_gauges_up") == 1 and s, 20, "the counts and the gauges")
    finally:
        assert proc.terminate() == 0, proc.output()
    db_counts = counts(db)
    assert db_counts[("m", "sent")] == N
    assert value(scrape, "pgfence_delivered_total", module="outbox", queue="m") == N
    assert value(scrape, "pgfence_claimed_total", module="outbox", queue="m") == N
    assert value(scrape, "pgfence_failed_total", module="outbox", queue="bad",
                 retry="permanent") == db_counts[("bad", "failed")] == 3
    assert value(scrape, "pgfence_dead_total", module="outbox", queue="dead") == \
        db_counts[("dead", "dead")] == 2
    assert value(scrape, "pgfence_lost_races_total", module="outbox", queue="m") == 0
    assert value(scrape, "pgfence_delivery_duration_seconds_count", module="outbox", queue="m") == N
    assert value(scrape, "pgfence_wakeup_latency_seconds_count", module="outbox") == N + 5
    assert value(scrape, "pgfence_claim_round_trip_seconds_count", module="outbox") > 0
    assert value(scrape, "pgfence_listener_connected") == 1
    assert value(scrape, "pgfence_database_gauges_up") == 1
    assert 0 <= value(scrape, "pgfence_seconds_since_last_sweep") < 30
    assert value(scrape, "pgfence_queue_depth", module="outbox", queue="m", status="ready") == 0
    assert value(scrape, "pgfence_executors", status="alive") == 1
    assert value(scrape, "pgfence_executor_info", worker="met-1", version="0.1.0") == 1


def test_pgfence_metrics_prints_the_database_gauges(db: str, conn: psycopg.Connection) -> None:
    outbox.enqueue(conn, "pm", "r", {})
    result = CliRunner().invoke(main, ["--dsn", db, "metrics"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    scrape = samples(result.output)
    assert value(scrape, "pgfence_queue_depth", module="outbox", queue="pm", status="ready") == 1
    assert value(scrape, "pgfence_queue_unserved", module="outbox", queue="pm") == 1
    assert value(scrape, "pgfence_stuck_items", module="plan") == 0
    result = CliRunner().invoke(main, ["--dsn", db, "metrics", "--json"], catch_exceptions=False)
    rows = json.loads(result.output)
    assert {"metric": "pgfence_queue_depth", "module": "outbox", "queue": "pm",
            "status": "ready", "value": 1.0} in rows


@pytest.mark.timeout(60)
def test_healthz_and_readyz_follow_the_database(db: str) -> None:
    async def scenario() -> None:
        async with FaultyLink(db) as link:
            ex = Executor(link.dsn, [OutboxModule({"h": NoopTransport()})], ExecutorConfig(
                poll_interval=0.2, reap_interval=0.3, grace=2, metrics_port=0,
                probe_interval=0.5, probe_timeout=1.0, query_timeout=2.0))
            task = asyncio.create_task(ex.run())
            try:
                async with asyncio.timeout(20):
                    while ex.metrics_url is None or not ex.listener_connected:
                        await asyncio.sleep(0.05)
                base = ex.metrics_url.removesuffix("/metrics")
                code, body = await asyncio.to_thread(get, f"{base}/healthz")
                assert (code, body) == (200, "ok\n")
                code, body = await asyncio.to_thread(get, f"{base}/readyz")
                assert code == 200 and json.loads(body) == {
                    "ready": True, "started": True, "listener": True, "database": True}
                link.down()
                async with asyncio.timeout(20):
                    while True:
                        code, body = await asyncio.to_thread(get, f"{base}/readyz")
                        if code == 503:
                            break
                        await asyncio.sleep(0.1)
                state = json.loads(body)
                assert state["ready"] is False and state["database"] is False
                assert (await asyncio.to_thread(get, f"{base}/healthz"))[0] == 200
                code, text = await asyncio.to_thread(get, f"{base}/metrics")
                assert code == 200 and "pgfence_database_gauges_up 0.0" in text
                link.up()
                async with asyncio.timeout(30):
                    while (await asyncio.to_thread(get, f"{base}/readyz"))[0] != 200:
                        await asyncio.sleep(0.1)
            finally:
                ex.stop()
                await asyncio.wait_for(task, 20)

    asyncio.run(scenario())


@pytest.mark.timeout(90)
def test_json_logs_and_a_plan_step_named_as_such(db: str, conn: psycopg.Connection,
                                                 tmp_path: Path) -> None:
    mid = outbox.enqueue(conn, "j", "r", {"n": 1})
    plan.register_action(conn, "note", None, "log it")
    pid = plan.propose(conn, [{"action": "note", "args": {"recipient": "ops"}}], "agent")
    assert plan.approve(conn, pid, "alice") == "approved"
    proc = Proc(db, ["--worker-id", "json-1", *FAST, "--route", "j=log", "--route", "note=log",
                     "--plans", "start", "--log-format", "json"], tmp_path / "json.log")
    try:
        wait_for(lambda: plan.get(conn, pid)["status"] == "executed"
                 and outbox.get(conn, mid)["status"] == "sent", 30, "the message and the plan")
        wait_for(lambda: '"outbox.sent"' in proc.output() and f"plan#{pid} executed"
                 in proc.output(), 10, "their log lines")
    finally:
        assert proc.terminate() == 0, proc.output()
    lines = [json.loads(line) for line in proc.output().splitlines() if line.startswith("{")]
    assert lines and len(lines) == len([x for x in proc.output().splitlines() if x.strip()]), \
        "every line is one JSON object"
    assert all({"time", "level", "event", "message", "logger", "worker"} <= set(x) for x in lines)
    (sent,) = [x for x in lines if x["event"] == "outbox.sent"]
    assert {k: sent[k] for k in ("module", "id", "channel", "attempt", "worker", "outcome")} == {
        "module": "outbox", "id": mid, "channel": "j", "attempt": 1, "worker": "json-1",
        "outcome": "sent"}
    assert sent["duration_ms"] >= 0
    (step,) = [x for x in lines if x["event"] == "plan.external_step"]
    assert (step["id"], step["step"], step["kind"], step["outcome"]) == (pid, 1, "note", "ok")
    messages = [x["message"] for x in lines]
    assert any(m.startswith(f"log transport: pgfence-plan-{pid}-step-1 note -> ops") for m in messages)
    assert any(m.startswith(f"log transport: pgfence-outbox-{mid} j -> r") for m in messages)
    assert not any("no longer ours" in m for m in messages), messages
    assert scalar(db, "SELECT count(*) FROM pgfence.audit_executors WHERE worker = 'json-1'") == 1


def test_every_sql_block_of_docs_metrics_runs(db: str, conn: psycopg.Connection,
                                              tmp_path: Path) -> None:
    outbox.enqueue(conn, "docs", "r", {})
    doc = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"
    blocks = sql_blocks(doc.read_text(encoding="utf-8"))
    assert len(blocks) == 2
    outputs = []
    for block in blocks:
        run = psql(db, block, tmp_path)
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout)
    assert "pgfence_queue_depth" in outputs[0]
    assert "docs" in outputs[1]  # the unserved channel


def _scans(node: dict, out: list[tuple[str, str, int]]) -> None:
    if node.get("Relation Name") in ("outbox", "plan", "operation") and node["Actual Loops"] > 0:
        out.append((node["Relation Name"], node["Node Type"], int(node["Actual Rows"]) * int(node["Actual Loops"])))
    for child in node.get("Plans", []):
        _scans(child, out)


@pytest.mark.timeout(180)
def test_audit_metrics_reads_live_and_failed_rows_not_the_history(conn: psycopg.Connection) -> None:
    """A scrape reads the live and failed rows through partial indexes, never the sent history:
    with 30,000 sent messages kept (no purge) and a handful live, no scan of the outbox, plan or
    operation table that runs returns more rows than are live or failed, no outbox scan that runs
    is sequential, and the depths are right."""
    # The history: sent messages (written directly, as a purge-less month would leave them).
    conn.execute("SET session_replication_role = replica")
    conn.execute("""INSERT INTO pgfence.outbox (channel, recipient, payload, status, attempts, max_attempts,
                                                finished_at)
                    SELECT 'hist', 'r', '{}', 'sent', 1, 5, now() FROM generate_series(1, 30000)""")
    conn.execute("RESET session_replication_role")
    conn.execute("SELECT pgfence.outbox_enqueue_many('hist', ARRAY['a', 'b', 'c'], ARRAY['{}', '{}', '{}']::jsonb[])")
    conn.execute("SELECT pgfence.outbox_enqueue('later', 'r', '{}', NULL, now() + interval '1 hour')")
    claimed = conn.execute("SELECT id, attempt FROM pgfence.outbox_claim('w', 1, ARRAY['hist'])").fetchone()
    assert claimed is not None
    assert conn.execute("SELECT pgfence.outbox_mark_failed(%s, %s, 'bad request', false)", claimed).fetchone()
    conn.execute("SELECT pgfence.outbox_claim('w', 1, ARRAY['hist'])")
    conn.execute("ANALYZE pgfence.outbox")
    depth = {(q, s): v for q, s, v in conn.execute(
        "SELECT queue, status, value FROM pgfence.audit_metrics WHERE metric = 'pgfence_queue_depth'"
        " AND module = 'outbox'")}
    assert depth[("hist", "ready")] == 1 and depth[("hist", "in_flight")] == 1
    assert depth[("hist", "failed")] == 1 and depth[("hist", "dead")] == 0
    assert depth[("later", "deferred")] == 1 and depth[("later", "ready")] == 0
    plan_json = conn.execute("EXPLAIN (ANALYZE, FORMAT JSON) SELECT * FROM pgfence.audit_metrics").fetchone()
    assert plan_json is not None
    scans: list[tuple[str, str, int]] = []
    _scans(plan_json[0][0]["Plan"], scans)
    assert any(rel == "outbox" for rel, _, _ in scans), scans
    assert [s for s in scans if s[0] == "outbox" and s[1] == "Seq Scan"] == [], scans
    assert all(rows <= 10 for _, _, rows in scans), scans
