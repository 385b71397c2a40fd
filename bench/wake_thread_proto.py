"""A PROTOTYPE, for ``wake_trace.py --variants exec,cls=wake_thread_proto:ThreadExecutor`` only.

Idea (a) of issue 18: the listener owned by a thread with a sync psycopg connection, blocking in
``notifies()``, claiming right there and handing the claimed rows to the event loop with
``loop.call_soon_threadsafe``. Only the wake-up path is built (no reconnect, heartbeat, bounds
or shutdown drain): enough to measure whether the hop pays. Measured (issue-18q, 2026-12-04):
it saves ~0.08 ms between the socket's readiness and the claim's send, and the hand-off to the
loop (self-pipe wake-up, GIL hand-over) costs ~0.12 ms more between the rows and the handler:
no gain, so it was not built into the executor.
"""

import asyncio
import threading
import time
from typing import Any

import psycopg

from pgfence import executor as ex
from pgfence import outbox as sql
from pgfence.outbox import Claimed


def _sync_rows(cur: Any, query: Any, params: Any) -> Any:
    cur.execute(query, params)
    res = cur.pgresult
    return cur.fetchall() if res is not None and res.nfields else []


ex._sync_rows = _sync_rows  # type: ignore[attr-defined]  # wake_trace.py wraps it


class ThreadExecutor(ex.Executor):
    """The executor with the prototype thread listener (outbox only, first module)."""

    async def _listen(self) -> None:
        await self._started.wait()
        try:
            async with asyncio.timeout(1.0):
                await self._first_round.wait()
        except TimeoutError:
            pass
        loop = asyncio.get_running_loop()
        self._tstop = False
        t = threading.Thread(target=self._thread_listen, args=(loop,), daemon=True)
        t.start()
        try:
            await self._stopping.wait()
        finally:
            self._tstop = True
            await asyncio.to_thread(t.join, 5)

    def _thread_listen(self, loop: asyncio.AbstractEventLoop) -> None:
        conn = psycopg.Connection.connect(self.dsn, **self.connect_kwargs(self.dsn, "listener"))
        for ch in sorted(self._by_channel):
            conn.execute(f"LISTEN {ch}")
        self.listener_connected = True
        loop.call_soon_threadsafe(self._nudge_all)
        s = self._served[0]
        m: Any = s.module
        cur = conn.cursor()
        while not self._tstop:
            got = False
            for _ in conn.notifies(timeout=1.0, stop_after=1):
                got = True
            if not got:
                continue
            if s.sweeps or m.pending_outcomes() or s.reserved:  # racy: a prototype
                loop.call_soon_threadsafe(self._nudge_all)
                continue
            n = min(self.config.batch, self.config.concurrency - self._running - self._queued)
            asked = time.monotonic()
            rows = [Claimed(*r) for r in ex._sync_rows(  # type: ignore[attr-defined]
                cur, sql.SQL_CLAIM, (self.worker_id, n, m._channels, m.lease))]
            loop.call_soon_threadsafe(self._thread_claimed, s, rows, asked, n)
        conn.close()

    def _thread_claimed(self, s: Any, rows: list[Claimed], asked: float, n: int) -> None:
        m: Any = s.module
        self._enqueue(s, [m._job(r, asked) for r in rows])
        if len(rows) >= n:
            s.nudge()
            self._wake.set()
