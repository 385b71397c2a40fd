"""The executor's slots: fair between modules, full with slow handlers, never over ``concurrency``.

One executor serving the outbox, plans and operations offers a freed slot to the least served
module that has due work, so a backlog in one module (slow webhooks after an outage) never holds
an approved plan or a requested operation for longer than a slot takes to free. The case of issue
18: concurrency 4, batch 4, 80 due outbox messages whose delivery takes 0.5 s each (a 10 s
backlog), then 3 approved one-step plans and 1 requested operation: before, they waited for the
whole backlog; now each starts at one of the next freed slots (one every 0.125 s).
"""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import psycopg
import pytest

from pgfence import operation as op_api
from pgfence import outbox, plan
from pgfence.executor import Executor, ExecutorConfig, OutboxModule
from pgfence.operation.module import OperationModule
from pgfence.outbox import Claimed
from pgfence.plan.module import PlanModule
from pgfence.transports import CallableTransport
from support import InstantOperation, executor_until

#: The slowest wait (database clock, approval or request -> finished) allowed for the plans and
#: the operation. One slot turnover is 0.5 s (each slot frees every 0.5 s); the bound leaves room
#: for a loaded machine and is still a quarter of the 10 s backlog they used to wait behind.
BOUND_S = 2.5


class _InFlight:
    """A slow outbox handler that counts its deliveries in flight."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.now = 0
        self.most = 0
        self.done = 0

    async def deliver(self, message: Claimed) -> dict[str, Any]:
        self.now += 1
        self.most = max(self.most, self.now)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            self.now -= 1
        self.done += 1
        return {"ok": True}


def _one(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> Any:
    row = conn.execute(query, params).fetchone()
    assert row is not None
    return row[0]


def _sent(conn: psycopg.Connection[Any]) -> int:
    return int(_one(conn, "SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'"))


#: Four slots, batches of five, a quick sweep.
SMALL = ExecutorConfig(concurrency=4, batch=5, poll_interval=0.2, reap_interval=30, grace=5)


@pytest.mark.timeout(120)
def test_a_backlog_in_one_module_holds_no_other_module_back(db: str, conn: psycopg.Connection[Any]) -> None:
    outbox.configure_channel(conn, "slow", lease=dt.timedelta(seconds=60))
    outbox.enqueue_many(conn, "slow", ["r"] * 80, [{"i": i} for i in range(80)])
    conn.execute("CREATE TABLE public.fair_done (n int PRIMARY KEY)")
    conn.execute("CREATE FUNCTION public.fair_step(p jsonb) RETURNS jsonb LANGUAGE sql AS $$"
                 " INSERT INTO public.fair_done VALUES ((p ->> 'n')::int) RETURNING '{}'::jsonb $$")
    plan.register_action(conn, "fair.step", "public.fair_step(jsonb)", "one quick SQL step")
    proposed = [plan.propose(conn, [{"action": "fair.step", "args": {"n": n}}], "agent")
                for n in range(3)]
    handler = _InFlight(0.5)
    outbox_module = OutboxModule({"slow": CallableTransport(handler.deliver)})
    modules = [outbox_module, PlanModule(heartbeat=dt.timedelta(seconds=60)),
               OperationModule({"fair.op": InstantOperation()}, lease=dt.timedelta(seconds=60))]
    # A long sweep interval: the plans and the operation are found through their NOTIFYs.
    config = ExecutorConfig(concurrency=4, batch=4, poll_interval=30, reap_interval=30, grace=1)
    executor = Executor(db, modules, config)

    def submit() -> int:
        with psycopg.connect(db, autocommit=True) as c:
            for pid in proposed:
                assert plan.approve(c, pid, "ops") == "approved"
            return op_api.request(c, "fair.op", "target-1").id

    def finished() -> bool:
        with psycopg.connect(db, autocommit=True) as c:
            return bool(_one(c, "SELECT (SELECT count(*) FROM pgfence.plan WHERE status = 'executed') = 3"
                               " AND (SELECT count(*) FROM pgfence.operation WHERE status = 'succeeded') = 1"))

    async def scenario() -> tuple[int, int]:
        task = asyncio.create_task(executor.run())
        try:
            async with asyncio.timeout(60):
                while handler.now < 4:  # the backlog holds every slot
                    await asyncio.sleep(0.02)
                op_id = await asyncio.to_thread(submit)
                while not await asyncio.to_thread(finished):
                    await asyncio.sleep(0.05)
                return op_id, handler.done
        finally:
            executor.stop()
            await asyncio.wait_for(task, 30)

    op_id, sent_by_then = asyncio.run(scenario())
    waits = [float(_one(conn, "SELECT extract(epoch FROM finished_at - approved_at) FROM pgfence.plan"
                              " WHERE id = %s", (pid,))) for pid in proposed]
    waits.append(float(_one(conn, "SELECT extract(epoch FROM finished_at - created_at)"
                                  " FROM pgfence.operation WHERE id = %s", (op_id,))))
    assert max(waits) < BOUND_S, f"waited {waits} s behind the outbox backlog"
    assert sent_by_then < 40, "the backlog was still there: the others did not simply wait it out"
    assert handler.most == 4, "never more outbox deliveries at once than slots"
    assert _one(conn, "SELECT count(*) FROM public.fair_done") == 3


@pytest.mark.timeout(60)
def test_a_slow_handler_keeps_every_slot_busy_and_no_more(db: str, conn: psycopg.Connection[Any]) -> None:
    outbox.configure_channel(conn, "steady", lease=dt.timedelta(seconds=60))
    ids = outbox.enqueue_many(conn, "steady", ["r"] * 120, [{"i": i} for i in range(120)])
    handler = _InFlight(0.02)
    module = OutboxModule({"steady": CallableTransport(handler.deliver)})
    # batch 10 over 4 slots: while deliveries are quick, claims run ahead of the free slots
    executor = Executor(db, [module], ExecutorConfig(concurrency=4, batch=10, poll_interval=1,
                                                     reap_interval=30, grace=5))
    most_claimed = 0  # processing rows in the database
    most_held = 0  # the executor's own: units claimed and running or queued for a slot

    def claimed_now() -> int:
        with psycopg.connect(db, autocommit=True) as c:
            return int(_one(c, "SELECT count(*) FROM pgfence.outbox WHERE status = 'processing'"))

    async def scenario() -> None:
        nonlocal most_claimed, most_held
        task = asyncio.create_task(executor.run())
        try:
            async with asyncio.timeout(40):
                while handler.done < len(ids):
                    most_held = max(most_held, executor.state()["in_flight"].get("outbox", 0))
                    most_claimed = max(most_claimed, await asyncio.to_thread(claimed_now))
                    await asyncio.sleep(0.01)
        finally:
            executor.stop()
            await asyncio.wait_for(task, 30)

    asyncio.run(scenario())
    assert handler.most == 4, "every slot was used, never more"
    assert most_held <= 4 + 10, "claims run at most one batch ahead of the slots"
    # The database also counts as processing the messages delivered since the last claim round
    # began: the next round settles them. A round that waits (under load; before the pool is
    # open every call waits its turn on the start-up connection) leaves more of them, never
    # more than a round's worth.
    assert most_claimed <= 4 + 2 * 10, "claimed and not yet settled: at most one round more"
    assert _one(conn, "SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'") == len(ids)
    assert _one(conn, "SELECT max(attempts) FROM pgfence.outbox") == 1, "no lease lapsed"


def test_shares_must_name_the_modules(db: str) -> None:
    module = OutboxModule({"x": CallableTransport(lambda m: None)})
    with pytest.raises(ValueError, match="shares name no module: plans"):
        Executor(db, [module], ExecutorConfig(shares={"plans": 2}))
    with pytest.raises(ValueError, match="at least 1"):
        Executor(db, [module], ExecutorConfig(shares={"outbox": 0}))


@pytest.mark.timeout(60)
def test_without_settle_and_claim_the_outbox_uses_two_statements(
        db: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    # A database whose functions are older than the glue (migrate not run yet after an upgrade).
    conn.execute("DROP FUNCTION pgfence.outbox_settle_and_claim(bigint[], integer[], jsonb[], text,"
                 " integer, text[], interval)")
    ids = outbox.enqueue_many(conn, "old", ["r"] * 30, [{"i": i} for i in range(30)])
    handler = _InFlight(0.0)
    module = OutboxModule({"old": CallableTransport(handler.deliver)})
    asyncio.run(executor_until(db, module, lambda: _sent(conn) == len(ids), config=SMALL))
    assert "settling and claiming in two statements" in caplog.text
    assert handler.done == len(ids) and handler.most <= 4
    assert _one(conn, "SELECT max(attempts) FROM pgfence.outbox") == 1


@pytest.mark.timeout(60)
def test_a_message_purged_before_its_mark_costs_no_other_message(
        db: str, conn: psycopg.Connection[Any], caplog: pytest.LogCaptureFixture) -> None:
    # The settle of a batch fails whole (P0002) when one of its messages is gone: the others are
    # then marked one by one, and claiming goes on.
    outbox.configure_channel(conn, "gone", lease=dt.timedelta(seconds=60))
    ids = outbox.enqueue_many(conn, "gone", ["r"] * 20, [{"i": i} for i in range(20)])
    delivered: list[int] = []

    def deliver(message: Claimed) -> None:  # sync: runs in a thread, may block
        delivered.append(message.id)
        if message.id == ids[3]:
            with psycopg.connect(db, autocommit=True) as c, c.transaction():
                c.execute("SET LOCAL pgfence.purging = on")
                c.execute("DELETE FROM pgfence.outbox WHERE id = %s", (message.id,))

    module = OutboxModule({"gone": CallableTransport(deliver)})
    asyncio.run(executor_until(db, module, lambda: _sent(conn) == 19, config=SMALL))
    assert sorted(delivered) == ids, "each delivered once"
    assert _one(conn, "SELECT count(*) FROM pgfence.outbox") == 19
    assert _one(conn, "SELECT max(attempts) FROM pgfence.outbox") == 1
    assert "marking" in caplog.text and f"could not mark outbox#{ids[3]} sent" in caplog.text
