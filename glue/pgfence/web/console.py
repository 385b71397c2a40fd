"""The read-only web console of ``pgfence serve``: the views a DBA reads in psql, in a browser.

``GET /console/`` is a static page (``static/console.html`` and ``console.js``, no data in it);
its script reads JSON from two endpoints, behind the same ``authenticate`` hook as the documents
API (the ``read`` scope):

- ``GET /console/api/overview``: ``audit_queue_health`` (queues, with the 1/5/15-minute rates),
  ``audit_queue_rates`` (finished per minute over the last hour: the charts), ``audit_stuck``,
  the newest 100 rows of ``audit_duplicates``, ``audit_executors``;
- ``GET /console/api/timeline/{module}/{id}``: ``audit_owner_of`` and ``audit_timeline`` of one
  item.

Nothing here writes. The server's database login must read the audit views (``pg_monitor`` or
``pgfence_admin``); another login's requests are answered 403 (SQLSTATE 42501).
"""

from __future__ import annotations

import datetime as dt
import decimal
from typing import TYPE_CHECKING, Any

from psycopg.rows import dict_row
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse, RedirectResponse, Response
from starlette.routing import Route

from ..audit import MODULES
from .auth import READ

if TYPE_CHECKING:
    from .app import _DocumentsAPI

SQL_OVERVIEW = {
    "queues": "SELECT * FROM pgfence.audit_queue_health ORDER BY module, queue",
    "rates": "SELECT * FROM pgfence.audit_queue_rates ORDER BY module, queue, minute",
    "stuck": "SELECT * FROM pgfence.audit_stuck ORDER BY overdue DESC, module, item_id",
    "duplicates": ("SELECT * FROM pgfence.audit_duplicates ORDER BY since DESC NULLS LAST,"
                   " module, item_id LIMIT 100"),
    "executors": ("SELECT * FROM pgfence.audit_executors"
                  " ORDER BY alive DESC, status, last_seen_at DESC, worker"),
}
SQL_OWNER = "SELECT * FROM pgfence.audit_owner_of(%s::text, %s::bigint)"
SQL_TIMELINE = "SELECT * FROM pgfence.audit_timeline(%s::text, %s::bigint)"


def _plain(value: Any) -> Any:
    """A value as JSON: times as ISO 8601, intervals as seconds, numerics as floats."""
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    return value


def _answer(body: dict[str, Any]) -> Response:
    return JSONResponse(_plain(body), headers={"Cache-Control": "no-store"})


def _handlers(request: Request) -> _DocumentsAPI:
    api: _DocumentsAPI = request.app.state.pgfence_documents
    return api


async def overview(request: Request) -> Response:
    """``GET /console/api/overview``: every section of the console in one answer."""
    api = _handlers(request)
    await api._principal(request, READ, "console", None)
    out: dict[str, Any] = {}
    async with api._conn() as conn, conn.cursor(row_factory=dict_row) as cur:
        for key, query in SQL_OVERVIEW.items():
            await cur.execute(query)
            out[key] = await cur.fetchall()
        await cur.execute("SELECT now() AS now")
        row = await cur.fetchone()
    out["now"] = row["now"] if row else None
    return _answer(out)


async def timeline(request: Request) -> Response:
    """``GET /console/api/timeline/{module}/{id}``: one item's owner and timeline."""
    from .app import HttpError

    api = _handlers(request)
    await api._principal(request, READ, "console", None)
    module: str = request.path_params["module"]
    item: int = request.path_params["id"]
    if module not in MODULES:
        raise HttpError(404, "not_found", f"no module {module!r} (one of {', '.join(MODULES)})")
    async with api._conn() as conn, conn.cursor(row_factory=dict_row) as cur:
        await cur.execute(SQL_OWNER, (module, item))
        owner = await cur.fetchone()
        await cur.execute(SQL_TIMELINE, (module, item))
        events = await cur.fetchall()
    return _answer({"module": module, "id": item, "owner": owner, "events": events})


def console_routes() -> list[Route]:
    """The console's routes, for :func:`pgfence.web.server.serve_app`."""
    from .app import STATIC_DIR

    async def page(request: Request) -> Response:
        return FileResponse(STATIC_DIR / "console.html", headers={"Cache-Control": "no-cache"})

    async def to_page(request: Request) -> Response:
        return RedirectResponse(str(request.url.replace(path=request.url.path + "/")), 308)

    return [Route("/console/", page, methods=["GET"]),
            Route("/console", to_page, methods=["GET"]),
            Route("/console/api/overview", overview, methods=["GET"]),
            Route("/console/api/timeline/{module}/{id:int}", timeline, methods=["GET"])]
