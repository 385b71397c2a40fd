"""Where a document session gets its database connections.

A session needs short autocommit connections, one at a time for saves and possibly one more for
a read that runs while a save is in flight. Anything with an async ``connection()`` context
manager yielding an autocommit :class:`psycopg.AsyncConnection` will do — a
:class:`psycopg_pool.AsyncConnectionPool` shared by many sessions (opened with
``kwargs={"autocommit": True}``), or :class:`DirectConnections` below, which a session builds
from a DSN.

:class:`DirectConnections` keeps up to ``max_idle`` idle connections and opens a new one when
none is idle. It does not retry: a failure to connect is raised at once, and the session retries
with its own backoff, so recovery after a network failure is as quick as the session's retry.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from typing import Any, Protocol

import psycopg
from psycopg.pq import TransactionStatus

logger = logging.getLogger(__name__)

AnyAsyncConn = psycopg.AsyncConnection[Any]


class ConnectionSource(Protocol):
    """What a session needs: ``async with source.connection() as conn`` (autocommit)."""

    def connection(self) -> AbstractAsyncContextManager[AnyAsyncConn]: ...


class DirectConnections:
    """Connections opened from a DSN on demand, up to ``max_idle`` kept for reuse.

    Args:
        dsn: libpq connection string or URI.
        connect_timeout: seconds to wait for a new connection.
        max_idle: idle connections kept open between calls.
        connect_kwargs: extra :meth:`psycopg.AsyncConnection.connect` arguments (e.g.
            ``prepare_threshold``).
    """

    def __init__(self, dsn: str, *, connect_timeout: float = 5.0, max_idle: int = 2,
                 connect_kwargs: dict[str, Any] | None = None) -> None:
        self.dsn = dsn
        self.connect_timeout = connect_timeout
        self.max_idle = max_idle
        self.connect_kwargs = dict(connect_kwargs or {})
        self._idle: list[AnyAsyncConn] = []
        self._closed = False

    async def _open(self) -> AnyAsyncConn:
        return await asyncio.wait_for(
            psycopg.AsyncConnection.connect(
                self.dsn, autocommit=True,
                connect_timeout=max(2, int(self.connect_timeout)), **self.connect_kwargs),
            timeout=self.connect_timeout)

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[AnyAsyncConn]:
        """Lend a connection; it goes back to the idle list if still healthy, else is closed."""
        if self._closed:
            raise RuntimeError("connection source is closed")
        conn = self._idle.pop() if self._idle else await self._open()
        try:
            yield conn
        finally:
            healthy = (not conn.closed and not conn.broken
                       and conn.info.transaction_status == TransactionStatus.IDLE)
            if healthy and not self._closed and len(self._idle) < self.max_idle:
                self._idle.append(conn)
            else:
                await conn.close()

    async def close(self) -> None:
        """Close every idle connection; connections on loan are closed when returned."""
        self._closed = True
        idle, self._idle = self._idle, []
        for conn in idle:
            await conn.close()
