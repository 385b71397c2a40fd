"""Plans run by real executor processes against a real PostgreSQL and a real webhook receiver:
SIGKILL mid-plan, SIGSTOP past the heartbeat, two executors racing, SIGTERM hand-over,
external-only executors, and an external step redelivered with the same idempotency key."""

from __future__ import annotations

import asyncio
import datetime as dt
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from pgfence import plan
from pgfence.executor import Executor, ExecutorConfig
from pgfence.plan.module import PlanModule
from pgfence.transports import WebhookTransport
from pgfence_demo.receivers import WebhookReceiver
from support import FAST, Proc, scalar, wait_for


@pytest.fixture()
def pconn(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    """The test database with a ledger table, a (slow) SQL action on it and an external action."""
    conn.execute("CREATE TABLE public.ledger (k text PRIMARY KEY, step int, backend int NOT NULL)")
    conn.execute("""
        CREATE FUNCTION public.put(p jsonb) RETURNS jsonb LANGUAGE plpgsql SET search_path = public AS $$
        BEGIN
          PERFORM pg_sleep(coalesce((p ->> 'sleep')::float8, 0));
          INSERT INTO ledger VALUES (p ->> 'k', (p ->> 'step')::int, pg_backend_pid());
          RETURN jsonb_build_object('k', p ->> 'k');
        END $$""")
    plan.register_action(conn, "put", "public.put(jsonb)", "insert a ledger row after an optional sleep")
    plan.register_action(conn, "hook", None, "POST the payload to a webhook")
    yield conn


def puts(n: int, prefix: str, sleep: float = 0.0) -> list[dict[str, object]]:
    return [{"action": "put", "args": {"k": f"{prefix}{i}", "step": i, "sleep": sleep}}
            for i in range(1, n + 1)]


def approved(conn: psycopg.Connection, steps: list[dict[str, object]]) -> int:
    pid = plan.propose(conn, steps, "agent")
    assert plan.approve(conn, pid, "alice") == "approved"
    return pid


def status(dsn: str, pid: int) -> str:
    return str(scalar(dsn, "SELECT status FROM pgfence.plan_get(%s)", (pid,)))


def receipt_steps(conn: psycopg.Connection, pid: int) -> list[int]:
    return [r["step_index"] for r in plan.receipts(conn, pid)]


def start_executor(db: str, tmp_path: Path, name: str, *args: str) -> Proc:
    mode = [] if "--plans" in args else ["--plans", "start"]
    proc = Proc(db, ["--worker-id", name, *FAST, *mode, *args], tmp_path / f"{name}.log")
    wait_for(lambda: "started" in proc.output(), 20, f"{name} to start")
    return proc


def backends_of(dsn: str, worker: str) -> int:
    return int(scalar(dsn, "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s "
                           "AND state = 'active'", (f"pgfence-executor:{worker}"[:63],)))


@pytest.mark.timeout(60)
def test_executor_runs_sql_and_external_steps(db: str, pconn: psycopg.Connection,
                                              webhook: WebhookReceiver, tmp_path: Path) -> None:
    proc = start_executor(db, tmp_path, "ex-1", "--route", "hook=webhook")
    try:
        pid = approved(pconn, [*puts(1, "a"),
                               {"action": "hook", "args": {"recipient": f"{webhook.url}/ok",
                                                           "payload": {"order": 7}}},
                               *puts(1, "b")])
        wait_for(lambda: status(db, pid) == "executed", 20, "the plan to be executed")
    finally:
        assert proc.terminate() == 0, proc.output()
    key = f"pgfence-plan-{pid}-step-2"
    assert webhook.count(key) == 1
    assert [h.body for h in webhook.hits if h.key == key] == [{"order": 7}]
    receipts = plan.receipts(pconn, pid)
    assert [(r["step_index"], r["kind"], r["outcome"], r["worker"]) for r in receipts] == [
        (1, "sql", "ok", "ex-1"), (2, "external", "ok", "ex-1"), (3, "sql", "ok", "ex-1")]
    assert receipts[1]["output"]["http_status"] == 200
    assert f"plan#{pid} step 2 hook delivered (key {key})" in proc.output()


@pytest.mark.timeout(90)
def test_sigkill_mid_plan_leaves_no_step_effected_without_receipt(
        db: str, pconn: psycopg.Connection, tmp_path: Path) -> None:
    proc = start_executor(db, tmp_path, "doomed")
    pid = approved(pconn, puts(60, "k", sleep=0.05))
    wait_for(lambda: len(receipt_steps(pconn, pid)) >= 5, 30, "a few steps to commit")
    proc.kill()
    # A step the backend was running when its client died may still commit (with its receipt):
    # wait until the dead executor's sessions are gone before comparing.
    wait_for(lambda: backends_of(db, "doomed") == 0, 20, "the dead executor's sessions to end")
    done = receipt_steps(pconn, pid)
    effects = [r[0] for r in pconn.execute("SELECT step FROM ledger WHERE k LIKE 'k%' ORDER BY step")]
    assert 5 <= len(done) < 60, "killed in the middle of the plan"
    assert effects == done == list(range(1, len(done) + 1)), \
        "every effect has its receipt and every receipt its effect, in order"

    info = plan.get(pconn, pid)
    assert (info["status"], info["worker"]) == ("executing", "doomed"), "until the heartbeat lapses"
    pconn.execute("UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '1 second' "
                  "WHERE id = %s", (pid,))
    info = plan.get(pconn, pid)
    assert (info["status"], info["failure"], info["next_step"]) == ("failed", "interrupted", len(done) + 1)

    # The dead executor's name coming back (a restarted process reusing it) is refused.
    token = int(pconn.execute("SELECT run_token FROM pgfence.plan WHERE id = %s", (pid,)).fetchone()[0])
    refused = plan.run_step(pconn, pid, "doomed", token)
    assert (refused.outcome, refused.status) == (None, "failed")
    assert plan.heartbeat(pconn, pid, "doomed", token) is False
    assert plan.start(pconn, pid, "doomed") is None
    # A new executor does not resume a failed plan: no retries, a new attempt is a new proposal.
    other = start_executor(db, tmp_path, "survivor")
    try:
        time.sleep(1.5)
    finally:
        assert other.terminate() == 0, other.output()
    assert receipt_steps(pconn, pid) == done
    assert [s["state"] for s in plan.steps(pconn, pid)][len(done):] == ["not_run"] * (60 - len(done))


@pytest.mark.timeout(60)
def test_stopped_worker_past_its_heartbeat_is_refused(db: str, pconn: psycopg.Connection,
                                                      webhook: WebhookReceiver, tmp_path: Path) -> None:
    proc = start_executor(db, tmp_path, "sleepy", "--route", "hook=webhook", "--plan-heartbeat", "1")
    try:
        pid = approved(pconn, [*puts(1, "s"),
                               {"action": "hook", "args": {"recipient": f"{webhook.url}/slow?s=2"}},
                               *puts(1, "t")])
        key = f"pgfence-plan-{pid}-step-2"
        wait_for(lambda: webhook.count(key) == 1, 20, "the external step to be in flight")
        proc.signal(signal.SIGSTOP)
        try:
            wait_for(lambda: scalar(db, "SELECT heartbeat_expires_at < now() FROM pgfence.plan "
                                        "WHERE id = %s", (pid,)), 10, "the heartbeat to lapse")
            assert plan.reap_stale(pconn) == 1
        finally:
            proc.signal(signal.SIGCONT)
        wait_for(lambda: "no longer ours" in proc.output() or "lost the run" in proc.output(), 20,
                 "the resumed executor to notice it lost the run")
    finally:
        assert proc.terminate() == 0, proc.output()
    info = plan.get(pconn, pid)
    assert (info["status"], info["failure"], info["next_step"]) == ("failed", "interrupted", 2)
    assert receipt_steps(pconn, pid) == [1], "the stale worker recorded nothing"
    assert [s["state"] for s in plan.steps(pconn, pid)] == ["ok", "unknown", "not_run"], \
        "the external step that was in flight is in doubt"
    assert webhook.count(key) == 1
    assert pconn.execute("SELECT count(*) FROM ledger WHERE k = 't1'").fetchone() == (0,)


@pytest.mark.timeout(90)
def test_two_executors_racing_each_plan_runs_once(db: str, pconn: psycopg.Connection,
                                                  tmp_path: Path) -> None:
    procs = [start_executor(db, tmp_path, f"racer-{i}") for i in (1, 2)]
    try:
        # Both are listening: every approval wakes both, and both try to take the plan.
        pids = [approved(pconn, puts(8, f"p{n}-", sleep=0.01)) for n in range(6)]
        wait_for(lambda: all(status(db, p) == "executed" for p in pids), 60, "all plans executed")
    finally:
        for p in procs:
            assert p.terminate() == 0, p.output()
    for n, pid in enumerate(pids):
        workers = {r["worker"] for r in plan.receipts(pconn, pid)}
        assert len(workers) == 1, f"plan {pid} was run by one executor, not {workers}"
        assert plan.get(pconn, pid)["worker"] in workers
        rows = pconn.execute("SELECT step FROM ledger WHERE k LIKE %s ORDER BY step", (f"p{n}-%",)).fetchall()
        assert [r[0] for r in rows] == list(range(1, 9)), "each step ran exactly once"
    starts = [e[0] for e in pconn.execute(
        "SELECT actor FROM pgfence.event WHERE module = 'plan' AND event = 'start' ORDER BY id")]
    assert len(starts) == 6, "one start per plan, however many tried"


@pytest.mark.timeout(90)
def test_sigterm_hands_the_run_over_between_steps(db: str, pconn: psycopg.Connection,
                                                  tmp_path: Path) -> None:
    first = start_executor(db, tmp_path, "leaving")
    pid = approved(pconn, puts(40, "h", sleep=0.05))
    wait_for(lambda: len(receipt_steps(pconn, pid)) >= 3, 30, "a few steps")
    assert first.terminate() == 0, first.output()
    assert f"plan#{pid} released (executor shutting down)" in first.output()
    info = plan.get(pconn, pid)
    assert (info["status"], info["worker"]) == ("executing", None), "released, not interrupted"
    second = start_executor(db, tmp_path, "arriving")
    try:
        wait_for(lambda: status(db, pid) == "executed", 30, "the second executor to finish it")
    finally:
        assert second.terminate() == 0, second.output()
    receipts = plan.receipts(pconn, pid)
    assert [r["step_index"] for r in receipts] == list(range(1, 41))
    workers = [r["worker"] for r in receipts]
    cut = workers.index("arriving")
    assert set(workers[:cut]) == {"leaving"} and set(workers[cut:]) == {"arriving"}
    assert [r[0] for r in pconn.execute("SELECT step FROM ledger ORDER BY step")] == list(range(1, 41))


@pytest.mark.timeout(60)
def test_external_only_executor_takes_released_external_steps(
        db: str, pconn: psycopg.Connection, webhook: WebhookReceiver, tmp_path: Path) -> None:
    pid = approved(pconn, [*puts(1, "x"),
                           {"action": "hook", "args": {"recipient": f"{webhook.url}/ok"}},
                           *puts(1, "y")])
    first = plan.execute(pconn, pid, "sql-runner")
    assert first.status == "executing" and [r["step_index"] for r in first.receipts] == [1]
    assert plan.get(pconn, pid)["worker"] is None, "released at the external step"
    proc = start_executor(db, tmp_path, "hooks-only", "--plans", "external", "--route", "hook=webhook")
    try:
        wait_for(lambda: receipt_steps(pconn, pid) == [1, 2] and plan.get(pconn, pid)["worker"] is None,
                 20, "the external step to be recorded and the run handed back")
        time.sleep(1.0)
        assert receipt_steps(pconn, pid) == [1, 2], "the external-only executor runs no SQL step"
    finally:
        assert proc.terminate() == 0, proc.output()
    assert pconn.execute("SELECT count(*) FROM ledger WHERE k = 'y1'").fetchone() == (0,)
    last = plan.execute(pconn, pid, "sql-runner")
    assert last.status == "executed"
    assert [(r["step_index"], r["worker"]) for r in last.receipts] == [
        (1, "sql-runner"), (2, "hooks-only"), (3, "sql-runner")]
    assert webhook.count(f"pgfence-plan-{pid}-step-2") == 1


@pytest.mark.timeout(60)
def test_external_step_redelivered_after_a_lapse_carries_the_same_key(
        db: str, pconn: psycopg.Connection, webhook: WebhookReceiver) -> None:
    """The first delivery outlives its timeout (the receiver got it, the answer is lost); the
    executor delivers again, with the same idempotency key, and records the step once."""
    pid = approved(pconn, [{"action": "hook", "args": {"recipient": f"{webhook.url}/slow-once?s=2",
                                                       "payload": {"n": 1}}}])

    async def main() -> None:
        module = PlanModule({"hook": WebhookTransport()}, delivery_timeout=0.5,
                            backoff_base=0.05, backoff_cap=0.2)
        executor = Executor(db, [module], ExecutorConfig(poll_interval=0.2, reap_interval=1.0,
                                                         worker_id="redeliverer"))
        task = asyncio.create_task(executor.run())
        try:
            deadline = time.monotonic() + 20
            while await asyncio.to_thread(status, db, pid) != "executed":
                assert time.monotonic() < deadline, "plan not executed in time"
                await asyncio.sleep(0.1)
        finally:
            executor.stop()
            await asyncio.wait_for(task, 15)

    asyncio.run(main())
    key = f"pgfence-plan-{pid}-step-1"
    hits = [h for h in webhook.hits if h.key == key]
    assert len(hits) == 2, "delivered again after the lapse (at least once)"
    assert [h.attempt for h in hits] == ["1", "2"]
    assert {h.message_id for h in hits} == {str(pid)}
    receipts = plan.receipts(pconn, pid)
    assert [(r["step_index"], r["outcome"], r["output"]["http_status"]) for r in receipts] == [(1, "ok", 200)]
    assert plan.get(pconn, pid)["heartbeat_interval"] == dt.timedelta(seconds=120)
