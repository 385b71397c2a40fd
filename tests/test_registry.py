"""The executor registry with real executor processes: a running executor is listed alive with
what it serves, a stopped one as stopped, a killed one lapses; a queue nobody serves is flagged;
a plan handed to executors while none serves plans waits, and runs once one starts."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
from psycopg.rows import dict_row

from pgfence import outbox, plan
from pgfence_demo.receivers import WebhookReceiver
from support import FAST, Proc, scalar, wait_for


def executors(dsn: str) -> dict[str, dict[str, object]]:
    with psycopg.connect(dsn, autocommit=True) as c, c.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM pgfence.audit_executors")
        return {str(r["worker"]): r for r in cur.fetchall()}


@pytest.mark.timeout(60)
def test_a_running_executor_is_listed_alive_and_stopped_after_sigterm(db: str, tmp_path: Path) -> None:
    proc = Proc(db, ["--worker-id", "reg-1", *FAST, "--route", "orders=log", "--route", "audit=noop",
                     "--plans", "external", "--concurrency", "3"], tmp_path / "reg-1.log")
    try:
        wait_for(lambda: "started" in proc.output(), 20, "the executor to start")
        row = executors(db)["reg-1"]
        assert (row["status"], row["alive"], row["pid"], row["concurrency"]) == ("alive", True, proc.pid, 3)
        assert row["serves"] == {"outbox": ["audit", "orders"], "plan": ["external"]}
        assert row["modules"] == ["outbox", "plan"]
        seen = row["last_seen_at"]
        wait_for(lambda: executors(db)["reg-1"]["last_seen_at"] != seen, 10,
                 "a heartbeat on the reaper timer")
    finally:
        assert proc.terminate() == 0, proc.output()
    row = executors(db)["reg-1"]
    assert (row["status"], row["alive"]) == ("stopped", False)


@pytest.mark.timeout(60)
def test_a_killed_executor_lapses_and_its_channel_is_unserved(db: str, conn: psycopg.Connection,
                                                             tmp_path: Path) -> None:
    proc = Proc(db, ["--worker-id", "reg-k", *FAST, "--route", "kchan=noop"], tmp_path / "k.log")
    wait_for(lambda: "started" in proc.output(), 20, "the executor to start")
    proc.kill()
    outbox.enqueue(conn, "kchan", "r", {"n": 1})
    # Alive for three heartbeat intervals (0.3 s) after its last heartbeat, then lapsed.
    wait_for(lambda: executors(db)["reg-k"]["status"] == "lapsed", 10, "the killed executor to lapse")
    row = conn.execute("SELECT executors, unserved FROM pgfence.audit_queue_health "
                       "WHERE module = 'outbox' AND queue = 'kchan'").fetchone()
    assert row == (0, True)


@pytest.mark.timeout(90)
def test_a_plan_handed_to_executors_waits_while_none_serves_plans(
        db: str, conn: psycopg.Connection, webhook: WebhookReceiver, tmp_path: Path) -> None:
    plan.register_action(conn, "hook", None, "POST to a webhook")
    pid = plan.propose(conn, [{"action": "hook", "args": {"recipient": f"{webhook.url}/w"}}], "agent")
    assert plan.approve(conn, pid, "alice") == "approved"
    run = subprocess.run([sys.executable, "-m", "pgfence", "--dsn", db, "plan", "execute", str(pid)],
                         capture_output=True, text=True, timeout=60, check=False)
    assert run.returncode == 0, run.stderr
    assert "no executor serving plans is running" in run.stderr
    # Past its heartbeat with nobody to take it: the reaper leaves it waiting, plan show says so.
    conn.execute("UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' "
                 "WHERE id = %s", (pid,))
    assert scalar(db, "SELECT pgfence.plan_reap()") == 0
    assert plan.get(conn, pid)["status"] == "executing"
    show = subprocess.run([sys.executable, "-m", "pgfence", "--dsn", db, "plan", "show", str(pid)],
                          capture_output=True, text=True, timeout=60, check=False)
    assert "waiting for an executor with --plans (none is running)" in show.stdout, show.stdout
    health = subprocess.run([sys.executable, "-m", "pgfence", "--dsn", db, "status", "--json"],
                            capture_output=True, text=True, timeout=60, check=False)
    assert health.returncode == 1, health.stdout + health.stderr
    assert {"module": "plan", "queue": "*"}.items() <= json.loads(health.stdout)["unserved"][0].items()
    # An executor that serves plans starts: it revives the run and performs the step.
    proc = Proc(db, ["--worker-id", "reg-p", *FAST, "--plans", "external", "--route", "hook=webhook"],
                tmp_path / "p.log")
    try:
        wait_for(lambda: plan.get(conn, pid)["status"] == "executed", 30, "the plan to run")
    finally:
        assert proc.terminate() == 0, proc.output()
    assert webhook.count(f"pgfence-plan-{pid}-step-1") == 1
