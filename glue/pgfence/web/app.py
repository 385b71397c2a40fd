"""The documents HTTP API: an ASGI app (Starlette) over the document SQL functions.

Each endpoint is one or two calls of :mod:`pgfence.documents.api` on a pooled autocommit
connection; whether a save is a conflict, a replay or too large is decided in SQL
(``functions/4*_document_*.sql``). This file maps requests to calls and answers to HTTP:

=========================================  ===================================================
``POST /documents``                        create ``{"kind", "content"}`` (``Idempotency-Key``
                                           optional): 201 ``{id, kind, version}``
``GET /documents/{id}``                    200 ``{id, kind, version, content, ...}``, ``ETag``
                                           = the version; 304 on ``If-None-Match``; 410 deleted
``GET /documents/{id}/revisions/{v}``      one stored version (the confirmed base of a merge)
``PUT /documents/{id}``                    save ``{"content"}`` on ``If-Match: "<version>"`` or
                                           ``{"expectedVersion"}``, with ``Idempotency-Key``
                                           (the save id): 200 ``{version, replayed}`` | 409
                                           ``version_conflict`` with the stored copy | 428 no
                                           version | 404 | 410
``DELETE /documents/{id}``                 tombstone on ``If-Match``: 200 | 409 | 410 | 428
``POST /documents/{id}/merge``             the kind's three-way merge ``{"base", "local",
                                           "stored"}`` → ``{content, conflicts, clean}``
``GET /static/pgfence-documents.js``       the browser session module
=========================================  ===================================================

Errors are JSON ``{"error": <name>, "message", "sqlstate", "detail", "hint"}``; every
SQLSTATE → status mapping is :data:`HTTP_BY_SQLSTATE`. No response carries a stack trace
(unexpected exceptions are logged here and answered ``500 internal_error``). The user a
change is stored under comes from the ``authenticate`` hook (:mod:`pgfence.web.auth`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import inspect
import json
import logging
import math
import re
from collections.abc import AsyncIterator, Sequence
from decimal import Decimal
from pathlib import Path
from typing import Any, NoReturn

import psycopg
from psycopg_pool import AsyncConnectionPool
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles

from ..db import aschema_version, check_version
from ..documents import api
from ..documents.connections import ConnectionSource
from ..errors import SQLSTATES, PgfenceError
from .auth import READ, WRITE, Authenticate, Authorize, Forbidden, Principal, Unauthenticated

logger = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).resolve().parent / "static"
MAX_DOCUMENT_ID = 2**63 - 1

#: SQLSTATE → (HTTP status, error name), read from the one SQLSTATE table
#: (:data:`pgfence.errors.SQLSTATES`); anything else is 500 internal_error. 503 answers are
#: transient: retry the same request (a save with the same Idempotency-Key).
HTTP_BY_SQLSTATE: dict[str, tuple[int, str]] = {
    code: row.http for code, row in SQLSTATES.items() if row.http is not None}
_SQLSTATE_CLASS_08 = (503, "database_unavailable")  # connection exceptions


class HttpError(Exception):
    """An error answer: ``status``, ``error`` name, message and extra JSON fields."""

    def __init__(self, status: int, error: str, message: str, *,
                 headers: dict[str, str] | None = None, **extra: Any) -> None:
        super().__init__(message)
        self.status, self.error, self.message = status, error, message
        self.headers = headers or {}
        self.extra = extra


def _json(status: int, body: dict[str, Any], headers: dict[str, str] | None = None) -> Response:
    return JSONResponse(body, status_code=status,
                        headers={"Cache-Control": "no-store", **(headers or {})})


def _etag(version: int) -> str:
    return f'"{version}"'


def _iso(value: Any) -> Any:
    return value.isoformat() if hasattr(value, "isoformat") else value


def _db_error(exc: psycopg.Error | PgfenceError) -> HttpError:
    """The HTTP answer for a database error (via :data:`HTTP_BY_SQLSTATE`)."""
    state = getattr(exc, "sqlstate", None)
    if state is None and isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError):
        status, name = _SQLSTATE_CLASS_08
    elif state in HTTP_BY_SQLSTATE:
        status, name = HTTP_BY_SQLSTATE[state]
    elif state is not None and state.startswith("08"):
        status, name = _SQLSTATE_CLASS_08
    else:
        status, name = 500, "internal_error"
    if status == 503:
        logger.warning("documents API: database unavailable (%s): %s", state, exc)
        return HttpError(503, name, "the database is unavailable or asked for a retry",
                         headers={"Retry-After": "1"}, sqlstate=state,
                         hint="retry the same request (a save with the same Idempotency-Key)")
    if status == 500:
        logger.error("documents API: database error %s: %s", state, exc)
        return HttpError(500, name, "the server could not complete the request", sqlstate=state)
    if isinstance(exc, PgfenceError):
        detail, hint = exc.detail, exc.hint
    else:
        detail, hint = exc.diag.message_detail, exc.diag.message_hint
    return HttpError(status, name, str(exc), sqlstate=state, detail=detail, hint=hint)


async def _maybe_await(value: Any) -> Any:
    return await value if inspect.isawaitable(value) else value


_ETAG_VERSION = re.compile(r'(?:W/)?("?)([0-9]{1,19})\1')


def _version_or_none(value: object) -> int | None:
    """``value`` if it is an int version (1 .. 2**63-1), else None."""
    if isinstance(value, int) and not isinstance(value, bool) and 1 <= value <= MAX_DOCUMENT_ID:
        return value
    return None


def _parse_if_match(value: str) -> int:
    """``"3"`` (or weak ``W/"3"``, or bare ``3``) → 3: ASCII digits in bigint range only.
    ``*`` is refused (428): there is no unconditional save."""
    text = value.strip()
    if text == "*":
        raise HttpError(428, "precondition_required",
                        "If-Match: * would overwrite blindly; send the version you edited "
                        "(the ETag of your GET)")
    match = _ETAG_VERSION.fullmatch(text)
    version = _version_or_none(int(match.group(2))) if match else None
    if version is None:
        raise HttpError(400, "bad_request",
                        f"If-Match must be one ETag like \"3\" (a version 1..2^63-1), "
                        f"got {value[:80]!r}")
    return version


def _create_key(user: str, key: str | None) -> str | None:
    """The ``idempotency_key`` stored for a create: the caller's ``Idempotency-Key`` scoped to
    the authenticated user (a hash of both), so that two users sending the same key never get
    each other's document, nor learn that it exists. Raises HttpError 400 unless 1-255 chars."""
    if key is None:
        return None
    if not 1 <= len(key) <= 255:
        raise HttpError(400, "bad_request", "Idempotency-Key must be 1-255 characters")
    return "http:" + hashlib.sha256(f"{user}\0{key}".encode()).hexdigest()


def _exact_float(text: str) -> float:
    """``parse_float`` for request bodies: a JSON number that a double holds exactly (as
    jsonb will then store it); anything a double would change (1e400, 1e-400, more than 17
    significant digits) is refused rather than silently stored rounded."""
    value = float(text)
    if not math.isfinite(value) or Decimal(repr(value)) != Decimal(text):
        raise ValueError(f"the number {text[:40]} cannot be kept exactly; send it as a string")
    return value


class _DocumentsAPI:
    """The request handlers and their shared state (connection source, hooks, limits)."""

    def __init__(self, *, dsn: str | None, source: ConnectionSource | None,
                 authenticate: Authenticate, authorize: Authorize | None, max_body_bytes: int,
                 db_timeout: float, pool_size: int, body_timeout: float) -> None:
        self._dsn = dsn
        self._source = source
        self._own_pool: AsyncConnectionPool[Any] | None = None
        self._pool_lock = asyncio.Lock()
        self._schema_checked = source is not None
        self.authenticate = authenticate
        self.authorize = authorize
        self.max_body_bytes = max_body_bytes
        self.db_timeout = db_timeout
        self.pool_size = pool_size
        self.body_timeout = body_timeout

    # -- plumbing --------------------------------------------------------------------------
    async def _connections(self) -> ConnectionSource:
        if self._source is not None:
            return self._source
        async with self._pool_lock:
            if self._own_pool is None:
                pool: AsyncConnectionPool[Any] = AsyncConnectionPool(
                    str(self._dsn), min_size=1, max_size=self.pool_size, open=False,
                    timeout=self.db_timeout,
                    kwargs={"autocommit": True, "connect_timeout": max(2, int(self.db_timeout))})
                await pool.open(wait=False)
                self._own_pool = pool
            pool = self._own_pool
            if not self._schema_checked:
                async with pool.connection() as conn:
                    check_version(await aschema_version(conn))
                self._schema_checked = True
        return pool

    @contextlib.asynccontextmanager
    async def _conn(self) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        try:
            async with asyncio.timeout(self.db_timeout):
                source = await self._connections()
                async with source.connection() as conn:
                    yield conn
        except (psycopg.Error, PgfenceError) as exc:
            raise _db_error(exc) from exc
        except TimeoutError as exc:
            raise HttpError(503, "database_timeout",
                            f"the database did not answer within {self.db_timeout:g}s",
                            headers={"Retry-After": "1"},
                            hint="retry the same request (a save with the same Idempotency-Key)"
                            ) from exc

    async def close(self) -> None:
        """Close the pool this app opened (not a source passed in)."""
        if self._own_pool is not None:
            await self._own_pool.close()
            self._own_pool = None

    async def _principal(self, request: Request, scope: str, action: str,
                         document_id: int | None) -> Principal:
        try:
            got = await _maybe_await(self.authenticate(request))
            if got is None:
                raise Unauthenticated("credentials required")
            principal = Principal(name=got) if isinstance(got, str) else got
            if not isinstance(principal, Principal) or not 1 <= len(principal.name) <= 200:
                raise Unauthenticated("the authenticate hook returned no valid user")
            if scope not in principal.scopes:
                raise Forbidden(f"{principal.name} may not {scope}")
            if self.authorize is not None and not await _maybe_await(
                    self.authorize(principal, action, document_id)):
                raise Forbidden(f"{principal.name} may not {action} document {document_id}")
        except Unauthenticated as exc:
            raise HttpError(401, "unauthenticated", str(exc),
                            headers={"WWW-Authenticate": 'Bearer realm="pgfence"'}) from exc
        except Forbidden as exc:
            raise HttpError(403, "forbidden", str(exc)) from exc
        return principal

    async def _json_body(self, request: Request) -> dict[str, Any]:
        ctype = request.headers.get("content-type", "")
        if ctype.split(";", 1)[0].strip().lower() != "application/json":
            raise HttpError(415, "unsupported_media_type",
                            f"send Content-Type: application/json (got {ctype or 'none'!r})")
        length = request.headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > self.max_body_bytes):
            raise HttpError(413, "body_too_large",
                            f"the request body is over {self.max_body_bytes} bytes")
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        raise HttpError(413, "body_too_large",
                                        f"the request body is over {self.max_body_bytes} bytes")
                    chunks.append(chunk)
        except TimeoutError as exc:
            raise HttpError(408, "body_timeout",
                            f"the request body did not arrive within {self.body_timeout:g}s",
                            headers={"Connection": "close"},
                            hint="send the same request again (a save with the same "
                                 "Idempotency-Key)") from exc
        try:
            body = json.loads(b"".join(chunks), parse_constant=_no_constant,
                              parse_float=_exact_float)
        except (ValueError, UnicodeDecodeError) as exc:
            raise HttpError(400, "bad_request", f"the body is not valid JSON: {exc}") from exc
        except RecursionError as exc:
            raise HttpError(400, "bad_request", "the body is nested too deeply") from exc
        if not isinstance(body, dict):
            raise HttpError(400, "bad_request", "the body must be a JSON object")
        return body

    @staticmethod
    def _doc_id(request: Request) -> int:
        doc_id: int = request.path_params["id"]
        if doc_id > MAX_DOCUMENT_ID:
            raise HttpError(404, "not_found", f"no document with id {doc_id}")
        return doc_id

    @staticmethod
    def _require(body: dict[str, Any], *keys: str) -> None:
        missing = [k for k in keys if k not in body]
        if missing:
            raise HttpError(400, "bad_request", f"the body needs {', '.join(missing)}")

    @staticmethod
    def _expected_version(request: Request, body: dict[str, Any] | None) -> int:
        header = request.headers.get("if-match")
        from_header = _parse_if_match(header) if header is not None else None
        from_body = None
        if body is not None and ("expectedVersion" in body or "expected_version" in body):
            from_body = _version_or_none(body.get("expectedVersion",
                                                  body.get("expected_version")))
            if from_body is None:
                raise HttpError(400, "bad_request",
                                "expectedVersion must be an integer 1..2^63-1")
        if from_header is not None and from_body is not None and from_header != from_body:
            raise HttpError(400, "bad_request",
                            f"If-Match ({from_header}) and expectedVersion ({from_body}) differ")
        version = from_header if from_header is not None else from_body
        if version is None:
            raise HttpError(428, "precondition_required",
                            "send the version this change is based on: If-Match with the ETag "
                            "of your GET, or expectedVersion in the body")
        return version

    @staticmethod
    def _conflict(res: api.SaveResult) -> NoReturn:
        if res.deleted:
            raise HttpError(410, "deleted", f"the document was deleted (version {res.version})",
                            headers={"ETag": _etag(res.version)}, version=res.version,
                            saved_by=res.saved_by, saved_at=_iso(res.saved_at))
        raise HttpError(409, "version_conflict",
                        f"the document is at version {res.version} (saved by {res.saved_by}); "
                        "merge your change into that content and save against it",
                        headers={"ETag": _etag(res.version)}, version=res.version,
                        content=res.content, saved_by=res.saved_by,
                        saved_at=_iso(res.saved_at), deleted=False)

    # -- endpoints -------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        """``POST /documents``."""
        who = await self._principal(request, WRITE, "create", None)
        body = await self._json_body(request)
        self._require(body, "kind", "content")
        if not isinstance(body["kind"], str):
            raise HttpError(400, "bad_request", "kind must be a string")
        key = _create_key(who.name, request.headers.get("idempotency-key"))
        async with self._conn() as conn:
            doc_id = await api.acreate(conn, body["kind"], body["content"], who.name,
                                       idempotency_key=key)
        location = str(request.url.replace(query="")).rstrip("/") + f"/{doc_id}"
        return _json(201, {"id": doc_id, "kind": body["kind"], "version": 1},
                     {"ETag": _etag(1), "Location": location})

    async def get(self, request: Request) -> Response:
        """``GET /documents/{id}``."""
        doc_id = self._doc_id(request)
        await self._principal(request, READ, "read", doc_id)
        async with self._conn() as conn:
            doc = await api.aget(conn, doc_id)
        if doc.deleted:
            raise HttpError(410, "deleted", f"document {doc_id} was deleted (version "
                            f"{doc.version})", headers={"ETag": _etag(doc.version)},
                            version=doc.version, saved_by=doc.saved_by,
                            saved_at=_iso(doc.saved_at))
        etag = _etag(doc.version)
        inm = request.headers.get("if-none-match")
        if inm is not None and (inm.strip() == "*" or etag in [
                t.strip().removeprefix("W/") for t in inm.split(",")]):
            return Response(status_code=304, headers={"ETag": etag, "Cache-Control": "no-cache"})
        return _json(200, {"id": doc.id, "kind": doc.kind, "version": doc.version,
                           "content": doc.content, "created_by": doc.created_by,
                           "created_at": _iso(doc.created_at), "saved_by": doc.saved_by,
                           "saved_at": _iso(doc.saved_at)},
                     {"ETag": etag, "Cache-Control": "no-cache"})

    async def revision(self, request: Request) -> Response:
        """``GET /documents/{id}/revisions/{version}``."""
        doc_id = self._doc_id(request)
        version: int = request.path_params["version"]
        await self._principal(request, READ, "read", doc_id)
        if version > MAX_DOCUMENT_ID:
            raise HttpError(404, "not_found", f"document {doc_id} has no version {version}")
        async with self._conn() as conn:
            rev = await api.arevision(conn, doc_id, version)
        return _json(200, {"document_id": rev.document_id, "version": rev.version,
                           "op": rev.op, "content": rev.content, "saved_by": rev.saved_by,
                           "saved_at": _iso(rev.saved_at)}, {"ETag": _etag(rev.version)})

    async def save(self, request: Request) -> Response:
        """``PUT /documents/{id}``."""
        doc_id = self._doc_id(request)
        who = await self._principal(request, WRITE, "save", doc_id)
        body = await self._json_body(request)
        self._require(body, "content")
        expected = self._expected_version(request, body)
        save_id = request.headers.get("idempotency-key")
        if not save_id:
            raise HttpError(400, "idempotency_key_required",
                            "send Idempotency-Key: a fresh id per snapshot, the same one when "
                            "retrying it (a retry whose first answer was lost is answered "
                            "saved, not a conflict)")
        async with self._conn() as conn:
            res = await api.asave(conn, doc_id, expected, body["content"], who.name, save_id)
        if not res.ok:
            self._conflict(res)
        return _json(200, {"version": res.version, "saved_by": res.saved_by,
                           "saved_at": _iso(res.saved_at), "replayed": res.replayed},
                     {"ETag": _etag(res.version)})

    async def delete(self, request: Request) -> Response:
        """``DELETE /documents/{id}``."""
        doc_id = self._doc_id(request)
        who = await self._principal(request, WRITE, "delete", doc_id)
        expected = self._expected_version(request, None)
        async with self._conn() as conn:
            res = await api.adelete(conn, doc_id, expected, who.name)
        if not res.ok:
            self._conflict(res)
        return _json(200, {"version": res.version, "deleted": True, "saved_by": res.saved_by,
                           "saved_at": _iso(res.saved_at), "replayed": res.replayed},
                     {"ETag": _etag(res.version)})

    async def merge(self, request: Request) -> Response:
        """``POST /documents/{id}/merge``: the kind's merge; changes nothing."""
        doc_id = self._doc_id(request)
        await self._principal(request, READ, "merge", doc_id)
        body = await self._json_body(request)
        self._require(body, "base", "local", "stored")
        async with self._conn() as conn:
            doc = await api.aget(conn, doc_id)
            if doc.deleted:
                raise HttpError(410, "deleted", f"document {doc_id} was deleted; nothing to "
                                "merge into", version=doc.version)
            merged = await api.amerge(conn, doc.kind, body["base"], body["local"],
                                      body["stored"])
        return _json(200, {"kind": doc.kind, "content": merged.content,
                           "conflicts": merged.conflicts, "clean": merged.clean})


def _no_constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HttpError)
    body: dict[str, Any] = {"error": exc.error, "message": exc.message,
                            "sqlstate": exc.extra.pop("sqlstate", None)}
    body.update({k: v for k, v in exc.extra.items() if v is not None or k == "content"})
    return _json(exc.status, body, exc.headers)


async def _starlette_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    names = {404: "not_found", 405: "method_not_allowed"}
    return _json(exc.status_code, {"error": names.get(exc.status_code, "http_error"),
                                   "message": exc.detail, "sqlstate": None},
                 dict(exc.headers or {}))


async def _unexpected(request: Request, exc: Exception) -> Response:
    logger.error("documents API: unexpected error on %s %s", request.method, request.url.path,
                 exc_info=exc)
    return _json(500, {"error": "internal_error", "message": "the server could not complete "
                       "the request", "sqlstate": None})


EXCEPTION_HANDLERS: dict[Any, Any] = {HttpError: _http_error, HTTPException: _starlette_error,
                                      Exception: _unexpected}


def cors_middleware(origins: Sequence[str]) -> list[Middleware]:
    """CORS for ``origins`` (none = no CORS headers at all: same-origin only)."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins),
                       allow_methods=["GET", "POST", "PUT", "DELETE"],
                       allow_headers=["Authorization", "Content-Type", "If-Match",
                                      "If-None-Match", "Idempotency-Key"],
                       expose_headers=["ETag", "Location", "Retry-After"], max_age=600)]


def documents_app(*, dsn: str | None = None, source: ConnectionSource | None = None,
                  authenticate: Authenticate, authorize: Authorize | None = None,
                  cors_origins: Sequence[str] = (), max_body_bytes: int = 2 * 1024 * 1024,
                  db_timeout: float = 10.0, pool_size: int = 10,
                  body_timeout: float = 30.0, routes: Sequence[BaseRoute] = ()) -> Starlette:
    """The documents API as an ASGI app, to run or mount (``Mount("/api", documents_app(…))``
    serves ``/api/documents/…``; the browser module is at ``/api/static/pgfence-documents.js``).

    Args:
        dsn: the database; the app opens an autocommit connection pool on the first request
            (and checks the schema version) and closes it at shutdown. Or ``source``: your own
            ``AsyncConnectionPool(…, kwargs={"autocommit": True})`` (opened by you).
        authenticate: ``authenticate(request) -> Principal | str | None`` (may be async): who
            is calling; None = 401; raise :class:`~pgfence.web.auth.Forbidden` for 403. Its
            name is stored as ``saved_by``; nothing in the body can change it.
        authorize: optional ``authorize(principal, action, document_id) -> bool`` (may be
            async), False = 403.
        cors_origins: origins allowed cross-origin (default none: no CORS headers).
        max_body_bytes: larger request bodies are answered 413 before they are read in full.
        db_timeout: seconds a request may wait for a connection and its statements (then 503).
        pool_size: most pooled connections.
        body_timeout: seconds a request body may take to arrive (then 408): a client that
            stalls mid-body does not hold its connection forever.
        routes: more routes, matched before the documents ones (``pgfence serve`` adds its
            index and demo pages).

    Raises:
        ValueError: neither or both of ``dsn`` and ``source``.
    """
    if (dsn is None) == (source is None):
        raise ValueError("pass exactly one of dsn= or source=")
    handlers = _DocumentsAPI(dsn=dsn, source=source, authenticate=authenticate,
                             authorize=authorize, max_body_bytes=max_body_bytes,
                             db_timeout=db_timeout, pool_size=pool_size,
                             body_timeout=body_timeout)

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await handlers.close()

    app = Starlette(routes=[*routes, *document_routes(handlers)],
                    middleware=cors_middleware(cors_origins),
                    exception_handlers=EXCEPTION_HANDLERS, lifespan=lifespan)
    app.state.pgfence_documents = handlers
    return app


def document_routes(h: _DocumentsAPI) -> list[Route | Mount]:
    """The routes of :func:`documents_app`."""
    return [
        Route("/documents", h.create, methods=["POST"]),
        Route("/documents/{id:int}", h.get, methods=["GET"]),
        Route("/documents/{id:int}", h.save, methods=["PUT"]),
        Route("/documents/{id:int}", h.delete, methods=["DELETE"]),
        Route("/documents/{id:int}/revisions/{version:int}", h.revision, methods=["GET"]),
        Route("/documents/{id:int}/merge", h.merge, methods=["POST"]),
        Mount("/static", app=StaticFiles(directory=STATIC_DIR), name="static"),
    ]


async def close_documents_app(app: Starlette) -> None:
    """Close the pool of a :func:`documents_app` that you mounted (sub-apps' lifespans do not
    run under Starlette's ``Mount``); safe to call twice."""
    handlers: _DocumentsAPI = app.state.pgfence_documents
    await handlers.close()



