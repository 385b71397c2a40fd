"""Edge cases of the outbox API found in review: an empty channel list, an unbounded lease, and
the executor's delivery timeout (``asyncio.timeout`` around ``transport.deliver``)."""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from pgfence import outbox
from pgfence.errors import InvalidArgument
from pgfence.executor import OutboxModule
from pgfence.transports import CallableTransport
from support import executor_until


# ---------------------------------------------------------------------------------------------
# An empty channel list means no channel, as in SQL (not every channel)
# ---------------------------------------------------------------------------------------------
def test_an_empty_channel_list_claims_nothing(conn: psycopg.Connection) -> None:
    [other] = outbox.enqueue_many(conn, "edge-other", ["r"], [{}])
    [mine] = outbox.enqueue_many(conn, "edge-mine", ["r"], [{}])
    [held] = outbox.claim(conn, "w", channels=["edge-mine"])
    assert held.id == mine
    sql = conn.execute("SELECT count(*) FROM pgfence.outbox_claim('w', 10, '{}'::text[])").fetchone()
    assert sql == (0,), "SQL: an empty array of channels claims nothing"
    assert outbox.claim(conn, "w", batch=10, channels=[]) == []
    sent, claimed = outbox.mark_sent_and_claim(conn, held.id, held.attempt, "w", batch=10,
                                               channels=[])
    assert (sent, claimed) == (True, [])
    assert outbox.get(conn, other)["status"] == "pending", "another channel's message was not taken"


# ---------------------------------------------------------------------------------------------
# A lease is bounded like a channel's lease (1 day): 22023, never 22008, and nothing half-done
# ---------------------------------------------------------------------------------------------
def test_a_lease_longer_than_a_day_is_refused_and_the_settle_marks_nothing(
        conn: psycopg.Connection) -> None:
    ids = outbox.enqueue_many(conn, "edge-lease", ["r", "r"], [{}, {}])
    [held] = outbox.claim(conn, "w", channels=["edge-lease"])
    huge = dt.timedelta(days=365 * 300_000)  # now() + this overflows a timestamp
    for lease in (dt.timedelta(days=1, seconds=1), huge):
        with pytest.raises(InvalidArgument):
            outbox.claim(conn, "w", channels=["edge-lease"], lease=lease)
        with pytest.raises(InvalidArgument):
            outbox.mark_sent_and_claim(conn, held.id, held.attempt, "w", channels=["edge-lease"],
                                       lease=lease)
    assert outbox.get(conn, held.id)["status"] == "processing", "the failed settle marked nothing"
    assert outbox.get(conn, ids[1])["status"] == "pending"
    [nxt] = outbox.claim(conn, "w", channels=["edge-lease"], lease=dt.timedelta(days=1))
    assert nxt.id == ids[1] and nxt.lease <= dt.timedelta(days=1)


# ---------------------------------------------------------------------------------------------
# The executor's delivery timeout
# ---------------------------------------------------------------------------------------------
async def _serve(db: str, func: Callable[..., Any], done: Callable[[], bool], *,
                 lease: float = 1.0, timeout: float = 20.0) -> None:
    module = OutboxModule({"edge-x": CallableTransport(func)}, lease=dt.timedelta(seconds=lease))
    # no reaper during the test: the short lease must not be taken back before the mark
    await executor_until(db, module, done, reap_interval=60, timeout=timeout)


def _row(db: str, message_id: int) -> dict[str, Any]:
    with psycopg.connect(db, autocommit=True) as c:
        return outbox.get(c, message_id)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("kind", ["async", "sync"])
def test_a_delivery_past_its_budget_is_a_retryable_timeout(db: str, conn: psycopg.Connection,
                                                           kind: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    [mid] = outbox.enqueue_many(conn, "edge-x", ["r"], [{}])
    cancelled: list[bool] = []
    thread_errors: list[BaseException | None] = []
    monkeypatch.setattr(threading, "excepthook", lambda a: thread_errors.append(a.exc_value))

    async def slow_async(message: outbox.Claimed) -> dict[str, Any]:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return {}

    def slow_sync(message: outbox.Claimed) -> dict[str, Any]:
        time.sleep(3)  # a daemon thread: outlives the timeout, its result is then ignored
        return {"late": True}

    asyncio.run(_serve(db, slow_async if kind == "async" else slow_sync,
                       lambda: _row(db, mid)["last_error"] is not None))
    row = _row(db, mid)
    assert row["status"] == "pending" and row["attempts"] == 1
    assert row["last_error"].startswith("delivery timed out after 0.5s"), row["last_error"]
    assert row["receipt"] is None
    if kind == "async":
        assert cancelled == [True], "the handler was cancelled at the budget"
    else:  # the handler thread outlives the executor's loop; it must end quietly
        for t in threading.enumerate():
            if t.name.startswith("pgfence-handler-"):
                t.join(10)
        assert thread_errors == []


@pytest.mark.timeout(60)
def test_a_timeout_raised_by_the_transport_is_reported_as_its_own_error(
        db: str, conn: psycopg.Connection) -> None:
    [mid] = outbox.enqueue_many(conn, "edge-x", ["r"], [{}])

    async def upstream_timeout(message: outbox.Claimed) -> dict[str, Any]:
        raise TimeoutError("upstream read timed out")

    asyncio.run(_serve(db, upstream_timeout, lambda: _row(db, mid)["last_error"] is not None,
                       lease=30.0))
    row = _row(db, mid)
    assert row["status"] == "pending"
    assert row["last_error"] == "TimeoutError: upstream read timed out", \
        "not 'delivery timed out after 28.0s': the budget did not run out"
