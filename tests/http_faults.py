"""An HTTP proxy that fails on purpose, in front of a real ``pgfence serve`` (browser tests).

:class:`HttpFaultProxy` listens on 127.0.0.1 and forwards each HTTP/1.1 request to the upstream
server on a fresh connection (one request per connection: both sides get ``Connection:
close``). On request it:

- **drops a response**: the request reaches the server and is executed (a save commits), then
  the client's connection is cut before any byte of the answer — the browser's ``fetch`` fails
  and cannot know whether its save happened;
- **holds a response** (already read from the server) until released, to deliver answers out
  of order;
- **stalls a request body**: forwards the head and half the body, then sends nothing more (a
  link that hangs mid-upload), and delivers whatever the server answers to that;
- **goes down**: accepts connections and cuts them at once, until :meth:`up`.

It runs its own asyncio loop on a thread, so synchronous (Selenium) tests can drive it.
Every request is logged in :attr:`log` as ``(method, path, idempotency key, outcome)``.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from dataclasses import dataclass, field


@dataclass
class _Fault:
    kind: str                 # "drop", "hold" or "stall"
    method: str
    path_contains: str
    fired: threading.Event = field(default_factory=threading.Event)
    release: asyncio.Event | None = None


class Held:
    """A held response: :attr:`captured` is set once it is held; :meth:`release` lets it go."""

    def __init__(self, proxy: HttpFaultProxy, fault: _Fault) -> None:
        self._proxy, self._fault = proxy, fault
        self.captured = fault.fired

    def release(self) -> None:
        self._proxy._loop.call_soon_threadsafe(self._release)

    def _release(self) -> None:
        if self._fault.release is None:
            self._fault.release = asyncio.Event()
        self._fault.release.set()


class HttpFaultProxy:
    """Proxy to ``http://127.0.0.1:upstream_port``; use as a context manager, browse :attr:`url`."""

    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="http-fault-proxy")
        self._server: asyncio.Server | None = None
        self._faults: list[_Fault] = []
        self._lock = threading.Lock()
        self._down = False
        self.port = 0
        self.log: list[tuple[str, str, str | None, str]] = []

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> HttpFaultProxy:
        self._thread.start()
        self._server = asyncio.run_coroutine_threadsafe(
            asyncio.start_server(self._serve, "127.0.0.1", 0), self._loop).result(10)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    def __exit__(self, *exc: object) -> None:
        with self._lock:
            for f in self._faults:
                if f.kind == "hold":
                    Held(self, f).release()
        if self._server is not None:
            self._loop.call_soon_threadsafe(self._server.close)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    # -- faults -----------------------------------------------------------------------------
    def drop_next(self, method: str, path_contains: str = "") -> threading.Event:
        """Cut the connection instead of delivering the next answer to ``method`` on a path
        containing ``path_contains`` (the server has handled the request). Returns an event set
        when it happened."""
        fault = _Fault("drop", method, path_contains)
        with self._lock:
            self._faults.append(fault)
        return fault.fired

    def hold_next(self, method: str, path_contains: str = "") -> Held:
        """Hold back the next answer to ``method`` on such a path until ``held.release()``."""
        fault = _Fault("hold", method, path_contains)
        with self._lock:
            self._faults.append(fault)
        return Held(self, fault)

    def stall_next(self, method: str, path_contains: str = "") -> threading.Event:
        """Send only half the body of the next ``method`` request on such a path, then stall
        (the server's answer, e.g. 408, is delivered). Returns an event set when it happened."""
        fault = _Fault("stall", method, path_contains)
        with self._lock:
            self._faults.append(fault)
        return fault.fired

    def down(self) -> None:
        """Cut every new connection at once (the server looks unreachable)."""
        self._down = True

    def up(self) -> None:
        self._down = False

    def requests(self, method: str, path_contains: str = "") -> list[tuple[str, str, str | None, str]]:
        """The logged requests of ``method`` on paths containing ``path_contains``."""
        return [r for r in list(self.log) if r[0] == method and path_contains in r[1]]

    # -- plumbing ---------------------------------------------------------------------------
    def _take(self, method: str, path: str) -> _Fault | None:
        with self._lock:
            for f in self._faults:
                if f.method == method and f.path_contains in path:
                    self._faults.remove(f)
                    return f
        return None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        delivered = False
        try:
            if self._down:
                self.log.append(("?", "?", None, "refused (down)"))
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError,
                    ConnectionError):
                return                          # a preconnect that sent nothing
            lines = head.decode("latin-1").split("\r\n")
            method, path, _ = lines[0].split(" ", 2)
            headers = [ln for ln in lines[1:] if ln]
            names = {ln.split(":", 1)[0].strip().lower(): ln.split(":", 1)[1].strip()
                     for ln in headers if ":" in ln}
            body = b""
            if int(names.get("content-length", "0") or 0):
                body = await asyncio.wait_for(reader.readexactly(int(names["content-length"])), 30)
            key = names.get("idempotency-key")
            kept = [ln for ln in headers if ln.split(":", 1)[0].strip().lower()
                    not in ("connection", "keep-alive")]
            request = "\r\n".join([lines[0], *kept, "Connection: close", "", ""]).encode("latin-1")
            fault = self._take(method, path)
            if fault is not None and fault.kind == "stall":
                body = body[:len(body) // 2]
                fault.fired.set()
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection("127.0.0.1", self.upstream_port), 10)
            try:
                up_writer.write(request + body)
                await asyncio.wait_for(up_writer.drain(), 30)
                response = await asyncio.wait_for(up_reader.read(), 30)
            finally:
                up_writer.close()
            if fault is not None and fault.kind == "drop":
                self.log.append((method, path, key, "dropped"))
                fault.fired.set()
                return                          # the finally below cuts the connection
            if fault is not None and fault.kind == "hold":
                if fault.release is None:
                    fault.release = asyncio.Event()
                fault.fired.set()
                self.log.append((method, path, key, "held"))
                await asyncio.wait_for(fault.release.wait(), 60)
            status = response.split(b"\r\n", 1)[0].decode("latin-1", "replace")
            self.log.append((method, path, key, status))
            writer.write(response)
            await asyncio.wait_for(writer.drain(), 30)
            delivered = True
        except (ConnectionError, TimeoutError, asyncio.IncompleteReadError):
            pass
        finally:
            with contextlib.suppress(Exception):
                if delivered:
                    writer.close()
                else:
                    writer.transport.abort()
