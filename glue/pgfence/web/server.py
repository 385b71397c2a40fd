"""``pgfence serve``: the documents API, the browser module and the demo page, on uvicorn.

:func:`serve_app` builds the standalone app (the :func:`~pgfence.web.documents_app` routes, an
index page, the read-only console at ``/console/`` (:mod:`pgfence.web.console`), and with
``demo=True`` the demo page at ``/demo/``). :class:`ServerThread` runs an
ASGI app on uvicorn in a background thread on a socket it binds first, so the real port is
known before the first request (the demo scene, the tests and the bench use it).
"""

from __future__ import annotations

import html
import logging
import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import FileResponse, HTMLResponse, RedirectResponse, Response
from starlette.routing import BaseRoute, Route

from .app import STATIC_DIR, documents_app
from .auth import Authenticate, Authorize
from .console import console_routes

logger = logging.getLogger(__name__)

#: The header the demo page names its user in (``pgfence serve --demo`` trusts it).
DEMO_USER_HEADER = "X-Pgfence-User"


def serve_app(*, dsn: str, authenticate: Authenticate, authorize: Authorize | None = None,
              demo: bool = False, cors_origins: Sequence[str] = (),
              max_body_bytes: int = 2 * 1024 * 1024, db_timeout: float = 10.0,
              pool_size: int = 10, body_timeout: float = 30.0) -> Starlette:
    """The app of ``pgfence serve``: ``/documents…``, ``/static/…``, an index at ``/`` and,
    with ``demo``, the demo page at ``/demo/`` (arguments as for
    :func:`~pgfence.web.documents_app`)."""

    async def index(request: Request) -> Response:
        links = ['<li><a href="console/">console/</a> — the read-only console: queues and'
                 ' their rates, stuck items, possible duplicates, executors, timelines</li>',
                 '<li><a href="static/pgfence-documents.js">static/pgfence-documents.js</a>'
                 ' — the browser session module (an ES module)</li>']
        if demo:
            links.insert(0, '<li><a href="demo/">demo/</a> — a record editor and a sheet grid'
                            ' on the module</li>')
        return HTMLResponse(
            "<!doctype html><meta charset=utf-8><title>pgfence serve</title>"
            "<body><h1>pgfence serve</h1><p>Versioned documents over HTTP: "
            "<code>POST /documents</code>, <code>GET|PUT|DELETE /documents/{id}</code>, "
            "<code>GET /documents/{id}/revisions/{version}</code>, "
            "<code>POST /documents/{id}/merge</code>.</p><ul>" + "".join(links) + "</ul>"
            f"<p>{html.escape('Every save needs If-Match (or expectedVersion) and Idempotency-Key.')}"
            "</p></body>")

    async def demo_page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "demo.html", headers={"Cache-Control": "no-cache"})

    async def to_demo(request: Request) -> Response:
        return RedirectResponse(str(request.url.replace(path=request.url.path + "/")), 308)

    routes: list[BaseRoute] = [Route("/", index, methods=["GET"]), *console_routes()]
    if demo:
        routes += [Route("/demo/", demo_page, methods=["GET"]),
                   Route("/demo", to_demo, methods=["GET"])]
    return documents_app(dsn=dsn, authenticate=authenticate, authorize=authorize,
                         cors_origins=cors_origins, max_body_bytes=max_body_bytes,
                         db_timeout=db_timeout, pool_size=pool_size, body_timeout=body_timeout,
                         routes=routes)


def bind(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host:port`` (port 0 = a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # proto IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY only on sockets that say they are
    # TCP, and without it a response written as headers + body waits ~40 ms for a delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.set_inheritable(True)
    return sock


def uvicorn_server(app: Any, *, log_level: str = "warning", access_log: bool = False
                   ) -> uvicorn.Server:
    """A uvicorn server for ``app`` (lifespan on, no signal handling outside the main thread)."""
    config = uvicorn.Config(app, log_level=log_level, access_log=access_log, lifespan="on",
                            timeout_graceful_shutdown=5)
    return uvicorn.Server(config)


class ServerThread:
    """``app`` on uvicorn in a daemon thread, listening on ``host`` (a free port by default).

    Use ``with ServerThread(app) as srv:`` and ``srv.url``; :meth:`stop` shuts it down (open
    connections are closed after at most 5 s).
    """

    def __init__(self, app: Any, host: str = "127.0.0.1", port: int = 0) -> None:
        self.sock = bind(host, port)
        self.host, self.port = host, self.sock.getsockname()[1]
        self.server = uvicorn_server(app)
        self._thread = threading.Thread(target=self._run, name="pgfence-serve", daemon=True)
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        """``http://host:port`` (no trailing slash)."""
        return f"http://{self.host}:{self.port}"

    def _run(self) -> None:
        try:
            self.server.run(sockets=[self.sock])
        except BaseException as exc:  # reported by start()
            self._error = exc

    def start(self, timeout: float = 10.0) -> ServerThread:
        """Start and wait until uvicorn accepts connections.

        Raises:
            RuntimeError: it did not start within ``timeout`` seconds (or failed).
        """
        self._thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if self._error is not None or not self._thread.is_alive():
                raise RuntimeError(f"the HTTP server failed to start: {self._error!r}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the HTTP server did not start within {timeout:g}s")
            time.sleep(0.01)
        return self

    def stop(self, timeout: float = 10.0) -> None:
        """Ask uvicorn to exit and join the thread."""
        self.server.should_exit = True
        self._thread.join(timeout)
        self.sock.close()

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
