"""A claim round that fails in the middle of a sweep strands nothing the sweep already claimed.

The executor claims in rounds of ``batch`` until its free slots are filled (the outbox: rounds of
one batch, two side by side). A trigger in the test
database makes every second claiming transaction fail with a real server error (as a connection
lost mid-sweep, a pooler error or a restart would): the units claimed by the round before it
are committed as owned, and must be started at once — not wait out their leases (here far longer
than the test may take) and lose an attempt. Outbox, plans and operations alike.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
from collections import Counter
from typing import Any

import psycopg
import pytest

from pgfence import operation as op_api
from pgfence import outbox, plan
from pgfence.executor import ExecutorConfig, Module, OutboxModule
from pgfence.operation.module import OperationModule
from pgfence.outbox import Claimed
from pgfence.plan.module import PlanModule
from pgfence.transports import CallableTransport
from support import InstantOperation, executor_until

# Fails the second, fourth, ... transaction that moves a row of `table` from `from_status` to
# `to_status` (a claim), on its first such row; the others pass. A sequence counts them (it is
# not rolled back with the failed transaction). The claim functions are security definer: the
# trigger runs as their owner, pgfence_definer, which needs the sequence.
FAIL_EVERY_SECOND_CLAIM = """
CREATE SEQUENCE public.claim_tx_{table};
GRANT USAGE ON SEQUENCE public.claim_tx_{table} TO pgfence_definer;
CREATE FUNCTION public.fail_every_second_claim_{table}() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
  IF current_setting('test.claim_tx', true) IS DISTINCT FROM pg_current_xact_id()::text THEN
    PERFORM set_config('test.claim_tx', pg_current_xact_id()::text, true);
    IF nextval('public.claim_tx_{table}') % 2 = 0 THEN
      RAISE EXCEPTION 'injected failure of claim transaction %', currval('public.claim_tx_{table}');
    END IF;
  END IF;
  RETURN NEW;
END $$;
CREATE TRIGGER aa_fail_every_second_claim BEFORE UPDATE ON pgfence.{table} FOR EACH ROW
  WHEN (OLD.status = '{from_status}' AND NEW.status = '{to_status}')
  EXECUTE FUNCTION public.fail_every_second_claim_{table}();
"""

# Short settings: a failed sweep is retried within 0.3 s; the leases (60 s) outlast the test.
CONFIG = dict(concurrency=40, batch=5, poll_interval=0.3, reap_interval=0.5, reconnect_max=0.3,
              grace=5.0)


def inject(conn: psycopg.Connection[Any], table: str, from_status: str, to_status: str) -> None:
    conn.execute(FAIL_EVERY_SECOND_CLAIM.format(table=table, from_status=from_status,
                                                to_status=to_status))


def injected(conn: psycopg.Connection[Any], table: str) -> int:
    """How many claim transactions the trigger saw (every second one failed)."""
    row = conn.execute(f"SELECT last_value FROM public.claim_tx_{table}").fetchone()
    return int(row[0]) if row else 0


async def serve_until(db: str, module: Module, done: Any, timeout: float) -> None:
    """An in-process executor with the short settings above, until ``done()``."""
    await executor_until(db, module, done, timeout=timeout, config=ExecutorConfig(**CONFIG))  # type: ignore[arg-type]


@pytest.mark.timeout(60)
def test_outbox_failed_round_starts_what_earlier_rounds_claimed(
        db: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    outbox.configure_channel(conn, "rounds", lease=dt.timedelta(seconds=60))
    ids = outbox.enqueue_many(conn, "rounds", ["r"] * 30, [{"i": i} for i in range(30)])
    inject(conn, "outbox", "pending", "processing")
    delivered: Counter[int] = Counter()

    async def deliver(message: Claimed) -> dict[str, Any]:
        delivered[message.id] += 1
        return {"ok": True}

    def all_sent() -> bool:
        return bool(conn.execute("SELECT count(*) = 30 FROM pgfence.outbox WHERE status = 'sent'"
                                 ).fetchone()[0])  # type: ignore[index]

    caplog.set_level(logging.WARNING, logger="pgfence")
    module = OutboxModule({"rounds": CallableTransport(deliver)})
    # Far less than the 60 s lease: a message stranded by a failed round would not make it.
    asyncio.run(serve_until(db, module, all_sent, timeout=30))
    assert sorted(delivered) == ids and set(delivered.values()) == {1}, "each delivered once"
    attempts = Counter(r[0] for r in conn.execute("SELECT attempts FROM pgfence.outbox"))
    assert attempts == {1: 30}, "no message lost an attempt to a lapsed lease"
    assert conn.execute("SELECT count(*) FROM pgfence.outbox_lapse").fetchone() == (0,)
    assert injected(conn, "outbox") >= 6, "claims kept failing every second transaction"
    assert "outbox claim failed" in caplog.text and "injected failure" in caplog.text
    # The outbox claims in rounds of one batch, two side by side (its units are quick): a failed
    # round ends only itself, while the units of the other run (delivered once, above).


@pytest.mark.timeout(60)
def test_plan_failed_round_starts_what_earlier_rounds_claimed(
        db: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    conn.execute("CREATE TABLE public.rounds_done (plan_id bigint PRIMARY KEY)")
    conn.execute("CREATE FUNCTION public.rounds_mark(p jsonb) RETURNS jsonb LANGUAGE sql AS $$"
                 " INSERT INTO public.rounds_done VALUES ((p ->> 'n')::bigint) RETURNING '{}'::jsonb $$")
    plan.register_action(conn, "rounds.mark", "public.rounds_mark(jsonb)", "mark one plan done")
    pids = []
    for n in range(12):
        pid = plan.propose(conn, [{"action": "rounds.mark", "args": {"n": n}}], "agent")
        assert plan.approve(conn, pid, "ops") == "approved"
        pids.append(pid)
    inject(conn, "plan", "approved", "executing")

    def all_executed() -> bool:
        return bool(conn.execute("SELECT count(*) = 12 FROM pgfence.plan WHERE status = 'executed'"
                                 ).fetchone()[0])  # type: ignore[index]

    caplog.set_level(logging.WARNING, logger="pgfence")
    module = PlanModule(heartbeat=dt.timedelta(seconds=60))
    asyncio.run(serve_until(db, module, all_executed, timeout=30))
    assert conn.execute("SELECT count(*) FROM public.rounds_done").fetchone() == (12,)
    assert injected(conn, "plan") >= 4 and "plan claim failed" in caplog.text
    assert "claimed before it were started" in caplog.text, caplog.text


@pytest.mark.timeout(60)
def test_operation_failed_round_starts_what_earlier_rounds_claimed(
        db: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    for n in range(12):
        op_api.request(conn, "rounds.op", f"target-{n}")
    inject(conn, "operation", "queued", "running")

    def all_succeeded() -> bool:
        return bool(conn.execute("SELECT count(*) = 12 FROM pgfence.operation WHERE status = 'succeeded'"
                                 ).fetchone()[0])  # type: ignore[index]

    caplog.set_level(logging.WARNING, logger="pgfence")
    module = OperationModule({"rounds.op": InstantOperation()}, lease=dt.timedelta(seconds=60))
    asyncio.run(serve_until(db, module, all_succeeded, timeout=30))
    fences = Counter(r[0] for r in conn.execute("SELECT fence FROM pgfence.operation"))
    assert fences == {1: 12}, "every operation finished under its first claim (no takeover)"
    assert injected(conn, "operation") >= 4 and "operation claim failed" in caplog.text
