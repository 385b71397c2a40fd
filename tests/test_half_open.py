"""Half-open connections: the path to the server freezes (it still acknowledges TCP but never
answers, like a dead NAT entry or a stuck proxy), through a real TCP proxy between a real
executor process and PostgreSQL.

TCP keepalives cannot see this (the proxy's kernel acknowledges every probe); the executor's own
bounds do: the listener's heartbeat gets no answer within ``--probe-timeout`` and the listener
reconnects (a log line says so), a delivery's outcome recorded over a frozen pooled connection
gets no answer within ``--query-timeout`` and is retried on a new connection, and once the path
answers again a message enqueued meanwhile is delivered — all well within the lease and long
before the poll interval (60 s here), which would otherwise be the only way it got out.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from handlers import read_records
from pgfence import outbox
from pgfence_demo.faults import FaultyLink
from support import Proc, scalar, wait_for

# Short test settings: probes every 1 s, 1 s to answer; calls 2 s; connects 2 s (libpq's least,
# set through $PGFENCE_CONNECT_TIMEOUT, the global --connect-timeout).
SHORT = ["--poll-interval", "60", "--reap-interval", "60", "--probe-interval", "1",
         "--probe-timeout", "1", "--query-timeout", "2", "--grace", "5"]


class LinkThread:
    """A :class:`FaultyLink` served by an event loop of its own, in a daemon thread."""

    def __init__(self, upstream: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True,
                                       name="faulty-link")
        self.thread.start()
        self.link = FaultyLink(upstream)
        self._call(self.link.start())

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    def _do(self, fn: Any) -> None:
        async def run() -> None:
            fn()
        self._call(run())

    @property
    def dsn(self) -> str:
        return self.link.dsn

    def freeze(self) -> None:
        self._do(self.link.freeze)

    def thaw(self) -> None:
        self._do(self.link.thaw)

    def close(self) -> None:
        self._call(self.link.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture()
def link(db: str) -> Iterator[LinkThread]:
    lt = LinkThread(db)
    try:
        yield lt
    finally:
        lt.close()


def status(db: str, mid: int) -> tuple[str, int]:
    with psycopg.connect(db, autocommit=True) as conn:
        row = conn.execute("SELECT status, attempts FROM pgfence.outbox WHERE id = %s", (mid,)).fetchone()
    assert row is not None
    return str(row[0]), int(row[1])


@pytest.mark.timeout(90)
def test_a_frozen_path_is_detected_logged_and_survived(db: str, conn: psycopg.Connection[Any],
                                                       link: LinkThread, tmp_path: Path) -> None:
    outbox.configure_channel(conn, "hooks", lease=dt.timedelta(seconds=60))
    record = tmp_path / "deliveries.txt"
    proc = Proc(link.dsn, ["--route", "hooks=python:handlers:slow_record", *SHORT],
                tmp_path / "exec.log",
                env={"PGFENCE_TEST_RECORD": str(record), "PGFENCE_CONNECT_TIMEOUT": "2"})
    try:
        wait_for(lambda: "self-check: NOTIFY round trip" in proc.output(), 20, "the executor to start")
        slow = outbox.enqueue(conn, "hooks", "r", {"sleep": 2})
        wait_for(lambda: read_records(str(record)), 10, "the slow delivery to start (NOTIFY)")

        # Freeze while the delivery runs: its outcome must go out over a frozen connection.
        link.freeze()
        late = outbox.enqueue(conn, "hooks", "r", {"sleep": 0})  # its NOTIFY goes nowhere
        # within the bound: probe interval + probe timeout (2 s here), plus slack
        wait_for(lambda: "listener heartbeat: no answer" in proc.output(), 10,
                 "the listener to notice the frozen path (probe interval + probe timeout)")
        wait_for(lambda: "database call: no answer" in proc.output(), 10,
                 "the outcome's call over the frozen pool connection to time out")
        assert status(db, slow) == ("processing", 1), "nothing recorded while frozen"
        assert status(db, late) == ("pending", 0), "nothing claimed while frozen"
        time.sleep(1)  # a reconnect attempt meets the frozen path too (connect timeout)

        link.thaw()
        wait_for(lambda: status(db, slow)[0] == "sent" and status(db, late)[0] == "sent", 20,
                 "both messages sent once the path answers again")
        wait_for(lambda: "listener reconnected" in proc.output(), 10,
                 "the listener to be back (its reconnect sweeps, so the next NOTIFY counts)")
        woken = outbox.enqueue(conn, "hooks", "r", {"sleep": 0})
        wait_for(lambda: status(db, woken)[0] == "sent", 10, "a NOTIFY to wake the executor again")
    finally:
        assert proc.terminate() == 0, proc.output()
    log = proc.output()
    assert "listener connection lost (NoAnswer: listener heartbeat" in log, log
    assert status(db, slow) == ("sent", 1), "recorded by its first attempt: no lapse, no redelivery"
    assert status(db, late) == ("sent", 1)
    assert sorted(mid for _, mid, _ in read_records(str(record))) == [slow, late, woken], \
        "each delivered once"
    assert link.link.swallowed >= 1, "a connection attempt met the frozen path"
    assert scalar(db, "SELECT count(*) FROM pgfence.outbox_lapse") == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("command", [["status"], ["migrate"]])
def test_a_cli_command_against_a_server_that_never_answers_gives_up(
        link: LinkThread, command: list[str]) -> None:
    import subprocess
    import sys

    link.freeze()  # accepts the TCP connection, then never answers
    proc = subprocess.run([sys.executable, "-m", "pgfence", "--connect-timeout", "2", "--dsn",
                           link.dsn, *command], capture_output=True, text=True, timeout=30,
                          check=False)  # before: it waited forever (TimeoutExpired here)
    # status: 2 = the database could not be read (for alerting); other commands: 1
    assert proc.returncode == (2 if command == ["status"] else 1), proc.stderr
    assert "pgfence: cannot reach the database: connection timeout expired" in proc.stderr
    assert "Traceback" not in proc.stderr
