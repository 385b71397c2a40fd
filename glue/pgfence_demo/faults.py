"""A network link that fails on purpose, for the demo and the tests.

:class:`FaultyLink` is a TCP proxy in front of PostgreSQL. Clients connect to :attr:`dsn`; the
proxy forwards bytes to the real server (its Unix socket or TCP port) and can, on request:

- **drop a response**: the server has executed (and, in autocommit, committed) the statement,
  but the client's connection is cut before the answer reaches it — the client sees a
  connection error and cannot know whether its statement happened;
- **hold a response** until released, to deliver answers out of order;
- **go down**: cut every connection and refuse new ones until :meth:`up`;
- **freeze**: the path stops answering but still acknowledges TCP (a dead NAT entry, a stuck
  proxy): every open connection becomes a black hole for good (bytes from either side are read
  and dropped, nothing is closed), and new connections are accepted and black-holed too until
  :meth:`thaw`. Only a client-side bound notices this; TCP keepalives do not.

Nothing about the database is simulated: every statement runs on the real server.
A fault can be tied to the next connection whose client bytes contain ``match`` (e.g.
``b"document_save"``); the statement text is only on the wire until psycopg prepares it
(after ``prepare_threshold`` executions), so clients that rely on ``match`` should connect with
``prepare_threshold=None``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

from psycopg.conninfo import conninfo_to_dict, make_conninfo

logger = logging.getLogger(__name__)


@dataclass
class Held:
    """A response held back by :meth:`FaultyLink.hold_next_response`."""

    captured: asyncio.Event = field(default_factory=asyncio.Event)
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        """Let the held response (and everything after it) through."""
        self.released.set()


@dataclass
class _Fault:
    kind: str                     # "drop" or "hold"
    match: bytes | None
    held: Held | None = None
    fired: asyncio.Event = field(default_factory=asyncio.Event)
    then_down: bool = False


@dataclass(eq=False)
class _Pipe:
    client: asyncio.StreamWriter
    server: asyncio.StreamWriter
    fault: _Fault | None = None   # armed for this connection's next response
    dead: bool = False            # frozen: forwards nothing, ever again


class FaultyLink:
    """A TCP proxy to the server of ``upstream_dsn`` that can drop or hold responses.

    Use ``async with FaultyLink(dsn) as link:`` (or :meth:`start` / :meth:`close`) inside the
    event loop that serves it; connect clients to :attr:`dsn`.
    """

    def __init__(self, upstream_dsn: str) -> None:
        self.upstream = conninfo_to_dict(upstream_dsn)
        self._server: asyncio.Server | None = None
        self._pipes: set[_Pipe] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._faults: list[_Fault] = []
        self._down = False
        self._frozen = False
        self._holes: set[asyncio.StreamWriter] = set()
        self.port = 0
        #: Responses dropped so far.
        self.dropped = 0
        #: Connections accepted while frozen (black-holed).
        self.swallowed = 0

    @property
    def dsn(self) -> str:
        """Connection string that goes through the proxy (same user, database, options)."""
        params: dict[str, Any] = {k: v for k, v in self.upstream.items() if v is not None}
        params.update(host="127.0.0.1", port=str(self.port), sslmode="disable",
                      gssencmode="disable")
        params.pop("hostaddr", None)
        return make_conninfo(**params)

    async def start(self) -> FaultyLink:
        """Listen on 127.0.0.1 (a free port)."""
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        """Stop listening and cut every connection."""
        if self._server is not None:
            self._server.close()
        self._cut_all()
        for fault in self._faults:
            if fault.held is not None:
                fault.held.release()
        if self._handlers:
            await asyncio.wait(list(self._handlers), timeout=5)
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 5)

    async def __aenter__(self) -> FaultyLink:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------------------------------
    # faults
    # ----------------------------------------------------------------------------------------
    def drop_next_response(self, match: bytes | None = None, *,
                           then_down: bool = False) -> asyncio.Event:
        """Cut the connection instead of delivering the next response (of the next connection
        that sends ``match``, or of any connection); with ``then_down`` the link also goes
        :meth:`down` at that moment (the client "crashed" right after the server committed).
        Returns an event set when it happened."""
        fault = _Fault("drop", match, then_down=then_down)
        self._faults.append(fault)
        return fault.fired

    def hold_next_response(self, match: bytes | None = None) -> Held:
        """Hold back the next response (as for :meth:`drop_next_response`) until
        ``held.release()``; ``held.captured`` is set once the response is being held."""
        held = Held()
        self._faults.append(_Fault("hold", match, held))
        return held

    def down(self) -> None:
        """Cut every connection and refuse new ones."""
        self._down = True
        self._cut_all()

    def up(self) -> None:
        """Accept connections again."""
        self._down = False

    def freeze(self) -> None:
        """Stop answering while still acknowledging TCP: every open connection is a black hole
        from now on (for good, like a dead NAT entry), and new ones are black-holed until
        :meth:`thaw`."""
        self._frozen = True
        for pipe in self._pipes:
            pipe.dead = True

    def thaw(self) -> None:
        """New connections reach the server again; the frozen ones stay black holes."""
        self._frozen = False

    def _cut_all(self) -> None:
        for pipe in list(self._pipes):
            pipe.client.transport.abort()
            pipe.server.transport.abort()
        for hole in list(self._holes):
            hole.transport.abort()

    # ----------------------------------------------------------------------------------------
    # plumbing
    # ----------------------------------------------------------------------------------------
    async def _open_upstream(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        host = str(self.upstream.get("host") or "/var/run/postgresql")
        port = int(self.upstream.get("port") or 5432)
        if host.startswith("/"):
            return await asyncio.open_unix_connection(f"{host}/.s.PGSQL.{port}")
        return await asyncio.open_connection(host, port)

    async def _swallow(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        self.swallowed += 1
        self._holes.add(cwriter)
        try:
            with contextlib.suppress(OSError, ConnectionError):
                while await creader.read(65536):
                    pass
        finally:
            self._holes.discard(cwriter)
            cwriter.transport.abort()

    async def _serve(self, creader: asyncio.StreamReader, cwriter: asyncio.StreamWriter) -> None:
        if self._down:
            cwriter.transport.abort()
            return
        if self._frozen:
            await self._swallow(creader, cwriter)
            return
        try:
            sreader, swriter = await self._open_upstream()
        except OSError as exc:
            logger.warning("faulty link: upstream unreachable: %s", exc)
            cwriter.transport.abort()
            return
        pipe = _Pipe(cwriter, swriter)
        self._pipes.add(pipe)
        me = asyncio.current_task()
        if me is not None:
            self._handlers.add(me)
        tasks = [asyncio.create_task(self._pump(self._client_to_server(pipe, creader))),
                 asyncio.create_task(self._pump(self._server_to_client(pipe, sreader)))]
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        except asyncio.CancelledError:
            pass
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            pipe.client.transport.abort()
            pipe.server.transport.abort()
            self._pipes.discard(pipe)
            if me is not None:
                self._handlers.discard(me)

    @staticmethod
    async def _pump(coro: Any) -> None:
        with contextlib.suppress(OSError, ConnectionError):
            await coro

    async def _client_to_server(self, pipe: _Pipe, reader: asyncio.StreamReader) -> None:
        while data := await reader.read(65536):
            if pipe.dead:
                continue
            if pipe.fault is None:
                for fault in self._faults:
                    if fault.match is not None and fault.match in data:
                        self._faults.remove(fault)
                        pipe.fault = fault
                        break
            pipe.server.write(data)
            await pipe.server.drain()

    async def _server_to_client(self, pipe: _Pipe, reader: asyncio.StreamReader) -> None:
        while data := await reader.read(65536):
            if pipe.dead:
                continue
            fault = pipe.fault
            if fault is None:
                fault = next((f for f in self._faults if f.match is None), None)
                if fault is not None:
                    self._faults.remove(fault)
            if fault is not None:
                pipe.fault = None
                if fault.kind == "drop":
                    self.dropped += 1
                    if fault.then_down:
                        self.down()
                    fault.fired.set()
                    logger.info("faulty link: dropped a %d-byte response", len(data))
                    return
                assert fault.held is not None
                fault.held.captured.set()
                fault.fired.set()
                await fault.held.released.wait()
            pipe.client.write(data)
            await pipe.client.drain()
