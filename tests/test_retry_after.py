"""``Retry-After`` as an HTTP date is measured on the remote's clock or the database's, never the
executor's.

A real HTTP server on 127.0.0.1 answers 503 with ``Retry-After: <HTTP date>`` 30 s after the
``Date`` it sends. Its clock is set 2 hours ahead of (or behind) this host's: read against the
executor's clock the wait came out as 2 h (the channel's backoff cap) or 0 (an early retry);
against the response's ``Date`` it is 30 s. Without a ``Date`` header the date is turned into a
wait by the database (``now()``), like every lease and backoff.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import email.utils
import re
import time
from typing import Any

import psycopg
import pytest

from pgfence import outbox
from pgfence.executor import Executor, ExecutorConfig, OutboxModule
from pgfence.outbox import Claimed
from pgfence.transports import RetryableError, WebhookTransport, retry_after

TWO_HOURS = 7200.0


class RetryServer:
    """HTTP/1.1 server answering every POST ``503`` with ``Retry-After`` = its clock + 30 s.

    ``skew``: seconds its clock is off this host's; ``send_date``: whether it sends ``Date``.
    """

    def __init__(self, skew: float, send_date: bool) -> None:
        self.skew, self.send_date = skew, send_date
        self.server: asyncio.Server | None = None
        self.url = ""
        self.requests = 0

    async def __aenter__(self) -> RetryServer:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/hook"
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        await self.server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = re.search(rb"(?i)\r\ncontent-length: *(\d+)", head)
        await reader.readexactly(int(length.group(1)) if length else 0)
        self.requests += 1
        now = time.time() + self.skew
        lines = ["HTTP/1.1 503 Service Unavailable", "Content-Length: 0", "Connection: close",
                 "Retry-After: " + email.utils.formatdate(now + 30, usegmt=True)]
        if self.send_date:
            lines.append("Date: " + email.utils.formatdate(now, usegmt=True))
        writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
        await writer.drain()
        writer.close()


def message(url: str) -> Claimed:
    now = dt.datetime.now(dt.UTC)
    return Claimed(id=1, channel="hooks", recipient=url, payload={}, idempotency_key=None,
                   attempt=1, max_attempts=5, lease=dt.timedelta(seconds=30),
                   lease_expires_at=now, created_at=now)


async def refusal(skew: float, send_date: bool) -> RetryableError:
    async with RetryServer(skew, send_date) as server:
        transport = WebhookTransport()
        try:
            with pytest.raises(RetryableError) as err:
                await transport.deliver(message(server.url))
        finally:
            await transport.aclose()
    return err.value


@pytest.mark.parametrize("skew", [TWO_HOURS, -TWO_HOURS], ids=["remote-ahead", "remote-behind"])
def test_an_http_date_is_measured_against_the_response_date(skew: float) -> None:
    err = asyncio.run(refusal(skew, send_date=True))
    assert err.retry_after == dt.timedelta(seconds=30), "30 s on the remote's own clock"
    assert err.retry_at is None


def test_without_a_date_header_the_time_is_passed_on_for_the_database_clock() -> None:
    err = asyncio.run(refusal(0.0, send_date=False))
    assert err.retry_after is None
    assert err.retry_at is not None and err.retry_at.tzinfo is not None


def test_retry_after_header_forms() -> None:
    date = "Sun, 06 Nov 1994 08:49:37 GMT"
    assert retry_after("120", date) == (dt.timedelta(seconds=120), None)
    assert retry_after("Sun, 06 Nov 1994 08:51:37 GMT", date) == (dt.timedelta(seconds=120), None)
    assert retry_after("Sun, 06 Nov 1994 08:48:37 GMT", date) == (dt.timedelta(0), None), "past: now"
    assert retry_after("soon", date) == (None, None)
    assert retry_after(None, date) == (None, None)
    assert retry_after("Sun, 06 Nov 1994 08:51:37 GMT", "garbage")[0] is None


def _deferral(conn: psycopg.Connection[Any], mid: int) -> dt.timedelta | None:
    row = conn.execute("SELECT next_attempt_at - updated_at FROM pgfence.outbox WHERE id = %s"
                       " AND status = 'pending' AND attempts = 1", (mid,)).fetchone()
    return None if row is None else row[0]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("skew", "send_date"), [(TWO_HOURS, True), (-TWO_HOURS, True), (0.0, False)],
                         ids=["remote-ahead", "remote-behind", "no-date-header"])
def test_the_executor_schedules_the_retry_the_remote_asked_for(
        db: str, conn: psycopg.Connection[Any], skew: float, send_date: bool) -> None:
    outbox.configure_channel(conn, "hooks", backoff_base=dt.timedelta(milliseconds=100),
                             backoff_cap=dt.timedelta(hours=1))

    async def go() -> dt.timedelta:
        async with RetryServer(skew, send_date) as server:
            mid = outbox.enqueue(conn, "hooks", server.url, {"n": 1})
            executor = Executor(db, [OutboxModule({"hooks": WebhookTransport()})],
                                ExecutorConfig(poll_interval=0.2, reap_interval=1.0, grace=2.0))
            task = asyncio.create_task(executor.run())
            try:
                async with asyncio.timeout(20):
                    while (wait := _deferral(conn, mid)) is None:
                        await asyncio.sleep(0.05)
            finally:
                executor.stop()
                await asyncio.wait_for(task, 10)
            assert server.requests == 1
            return wait

    wait = asyncio.run(go())
    # 30 s: exactly, from the remote's Date; a little less from the database clock (the HTTP
    # date has whole seconds, and the query runs a moment after the remote answered).
    assert dt.timedelta(seconds=28) <= wait <= dt.timedelta(seconds=30), wait
