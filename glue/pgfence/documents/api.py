"""Typed wrappers around the document SQL functions (Module 4), sync and async.

Every function is one ``SELECT pgfence.document_*(%s::type, …)`` on a connection the caller
owns. Decisions — whether a save is a conflict, whether a retry is the same save, how a kind
merges — are made in SQL (``functions/4*_document_*.sql``); this file passes arguments and
translates SQLSTATEs into the exceptions of :mod:`pgfence.errors` plus the document ones below.

Content is any JSON value (``dict`` for ``record``), or already-serialised JSON wrapped in
:class:`JsonText`, which is what :class:`~pgfence.documents.DocumentSession` sends so that the
bytes it saves are exactly the bytes it kept in its draft. Versions are ``int``; times are aware
``datetime``.
"""

from __future__ import annotations

import datetime as dt
import logging
from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.rows import class_row, dict_row, tuple_row
from psycopg.types.json import Jsonb

# The errors of this module (functions/ERRORS.md, PF3xx), defined with every SQLSTATE in
# pgfence.errors and importable from here (and from pgfence.documents) as before.
from ..errors import ContentTooLarge as ContentTooLarge
from ..errors import MergeInvalid as MergeInvalid
from ..errors import UnknownKind as UnknownKind
from ..errors import VersionUnknown as VersionUnknown
from ..errors import translated

logger = logging.getLogger(__name__)

SQL_CREATE = "SELECT pgfence.document_create(%s::text, %s::jsonb, %s::text, %s::text)"
SQL_GET = "SELECT * FROM pgfence.document_get(%s::bigint)"
SQL_REVISION = "SELECT * FROM pgfence.document_revision(%s::bigint, %s::bigint)"
SQL_HISTORY = "SELECT * FROM pgfence.document_history(%s::bigint, %s::int, %s::bigint)"
SQL_SAVE = (
    "SELECT * FROM pgfence.document_save(%s::bigint, %s::bigint, %s::jsonb, %s::text, %s::text)"
)
SQL_DELETE = "SELECT * FROM pgfence.document_delete(%s::bigint, %s::bigint, %s::text)"
SQL_MERGE = "SELECT * FROM pgfence.document_merge(%s::text, %s::jsonb, %s::jsonb, %s::jsonb)"
SQL_REGISTER_KIND = (
    "SELECT * FROM pgfence.document_register_kind(%s::text, %s::text, %s::regprocedure,"
    " %s::text, %s::int, %s::text, %s::boolean)"
)
SQL_KINDS = "SELECT * FROM pgfence.document_kinds ORDER BY kind"


@dataclass(frozen=True)
class Document:
    """The current version of a document (``pgfence.document_get``).

    ``content`` is None and ``deleted`` True for a deleted document (its tombstone version).
    """

    id: int
    kind: str
    version: int
    content: Any
    deleted: bool
    created_by: str
    created_at: dt.datetime
    saved_by: str
    saved_at: dt.datetime


@dataclass(frozen=True)
class SaveResult:
    """The answer of ``document_save`` / ``document_delete``.

    ``outcome`` is ``saved`` (``version`` = the new version), ``deleted`` (``version`` = the
    tombstone) or ``conflict`` (``version``, ``content``, ``saved_by``, ``saved_at`` describe the
    stored version; ``deleted`` True if that is a tombstone). ``replayed`` is True when the
    answer came from the receipt of an earlier identical call (a retry whose answer was lost).
    """

    outcome: Literal["saved", "deleted", "conflict"]
    version: int
    content: Any
    saved_by: str
    saved_at: dt.datetime
    deleted: bool
    replayed: bool

    @property
    def ok(self) -> bool:
        """True for ``saved`` / ``deleted``, False for ``conflict``."""
        return self.outcome != "conflict"


@dataclass(frozen=True)
class Revision:
    """One version exactly as it was written (``op`` create, save or delete)."""

    document_id: int
    version: int
    op: str
    content: Any
    save_id: str | None
    saved_by: str
    saved_at: dt.datetime


@dataclass(frozen=True)
class MergeResult:
    """A kind's three-way merge (``pgfence.document_merge``).

    ``conflicts`` is a list of ``{"key", "base", "local", "stored"}`` (a side's field is absent
    when the key is absent on that side). For ``record``, ``content`` is the merge with the
    stored value kept at each conflicting key; for ``sheet`` it is None when both sides changed.
    """

    content: Any
    conflicts: list[dict[str, Any]]

    @property
    def clean(self) -> bool:
        """True when nothing needs a person: no conflicts."""
        return not self.conflicts


AnyConn = psycopg.Connection[Any]
AnyAsyncConn = psycopg.AsyncConnection[Any]


class JsonText(str):
    """A string that already is serialised JSON (sent as is, not encoded again)."""

    __slots__ = ()


def as_jsonb(content: Any) -> Any:
    """Parameter for ``%s::jsonb``: :class:`JsonText` as is, anything else as Jsonb."""
    return str(content) if isinstance(content, JsonText) else Jsonb(content)


def _one(row: Any, what: str) -> Any:
    if row is None:  # every function here returns a row or raises
        raise RuntimeError(f"{what} returned no row")
    return row


# --------------------------------------------------------------------------------------------
# sync
# --------------------------------------------------------------------------------------------
def create(conn: AnyConn, kind: str, content: Any, created_by: str, *,
           idempotency_key: str | None = None) -> int:
    """Create a document (version 1); return its id.

    Args:
        kind: ``record``, ``sheet`` or a registered kind.
        content: JSON value of the kind's shape (an object for ``record``), or JSON text.
        created_by: the user or process, 1-200 characters.
        idempotency_key: a repeat with the same kind and content returns the same id.

    Raises:
        InvalidArgument (22004/22023), ContentTooLarge (PF301), UnknownKind (PF302),
        IdempotencyKeyReused (PF003).
    """
    with translated(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SQL_CREATE, (kind, as_jsonb(content), created_by, idempotency_key))
        return int(_one(cur.fetchone(), "document_create")[0])


def get(conn: AnyConn, document_id: int) -> Document:
    """The current version. Raises NotFound (P0002) for an unknown id."""
    with translated(), conn.cursor(row_factory=class_row(Document)) as cur:
        cur.execute(SQL_GET, (document_id,))
        return _one(cur.fetchone(), "document_get")  # type: ignore[no-any-return]


def revision(conn: AnyConn, document_id: int, version: int) -> Revision:
    """One saved version. Raises NotFound (P0002) for an unknown id or version."""
    with translated(), conn.cursor(row_factory=class_row(Revision)) as cur:
        cur.execute(SQL_REVISION, (document_id, version))
        return _one(cur.fetchone(), "document_revision")  # type: ignore[no-any-return]


def history(conn: AnyConn, document_id: int, limit: int = 100,
            before_version: int | None = None) -> list[dict[str, Any]]:
    """Revisions newest first, without content (version, op, save_id, saved_by, saved_at,
    stored_bytes). Raises NotFound (P0002), InvalidArgument (limit outside 1..10000)."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_HISTORY, (document_id, limit, before_version))
        return cur.fetchall()


def save(conn: AnyConn, document_id: int, expected_version: int, content: Any, saved_by: str,
         save_id: str | None = None) -> SaveResult:
    """One compare-and-swap save: ``saved`` with the new version, or ``conflict`` with the stored
    version and content (nothing written).

    Args:
        expected_version: the version ``content`` is based on (required: no blind overwrite).
        save_id: a fresh id per snapshot, the same one when retrying it after a lost answer;
            the retry is then answered ``saved`` (``replayed``) instead of a false conflict.

    Raises:
        InvalidArgument (22004/22023), NotFound (P0002), ContentTooLarge (PF301),
        VersionUnknown (PF303), IdempotencyKeyReused (PF003: save_id reused for other content).
    """
    with translated(), conn.cursor(row_factory=class_row(SaveResult)) as cur:
        cur.execute(SQL_SAVE, (document_id, expected_version, as_jsonb(content), saved_by, save_id))
        return _one(cur.fetchone(), "document_save")  # type: ignore[no-any-return]


def delete(conn: AnyConn, document_id: int, expected_version: int, by: str) -> SaveResult:
    """Compare-and-swap delete: ``deleted`` with the tombstone version, or ``conflict``.

    Raises: InvalidArgument, NotFound (P0002), VersionUnknown (PF303).
    """
    with translated(), conn.cursor(row_factory=class_row(SaveResult)) as cur:
        cur.execute(SQL_DELETE, (document_id, expected_version, by))
        return _one(cur.fetchone(), "document_delete")  # type: ignore[no-any-return]


def merge(conn: AnyConn, kind: str, base: Any, local: Any, stored: Any) -> MergeResult:
    """The kind's three-way merge (changes nothing).

    Raises: InvalidArgument, UnknownKind (PF302), MergeInvalid (PF304),
    psycopg.errors.UndefinedFunction (42883: the kind's merge function was dropped).
    """
    with translated(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SQL_MERGE, (kind, as_jsonb(base), as_jsonb(local), as_jsonb(stored)))
        row = _one(cur.fetchone(), "document_merge")
    return MergeResult(content=row[0], conflicts=list(row[1]))


def register_kind(conn: AnyConn, kind: str, merge: str | None = None, *,
                  merge_function: str | None = None, content_type: str | None = None,
                  max_bytes: int | None = None, description: str | None = None,
                  log_saves: bool | None = None) -> dict[str, Any]:
    """Admin: register or change a kind (None keeps the current value); returns the stored kind.

    ``merge`` is ``attributes``, ``none`` or ``function`` (then ``merge_function`` is a
    signature such as ``'app.merge_todo(jsonb,jsonb,jsonb)'``). ``log_saves`` (default true for
    a new kind): whether each save writes a save event; revisions, creates, deletes, conflicts
    and replays are kept either way.

    Raises: InvalidArgument (22004/22023: bad name, merge, content type, max_bytes, signature,
    a description over 1000 characters), psycopg.errors.UndefinedFunction (42883: the merge
    function names no function).
    """
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_REGISTER_KIND,
                    (kind, merge, merge_function, content_type, max_bytes, description,
                     log_saves))
        return _one(cur.fetchone(), "document_register_kind")  # type: ignore[no-any-return]


def kinds(conn: AnyConn) -> list[dict[str, Any]]:
    """Every registered kind (``pgfence.document_kinds``)."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_KINDS)
        return cur.fetchall()


# --------------------------------------------------------------------------------------------
# async (the document session)
# --------------------------------------------------------------------------------------------
async def acreate(conn: AnyAsyncConn, kind: str, content: Any, created_by: str, *,
                  idempotency_key: str | None = None) -> int:
    """Async :func:`create`."""
    async with translated(), conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(SQL_CREATE, (kind, as_jsonb(content), created_by, idempotency_key))
        return int(_one(await cur.fetchone(), "document_create")[0])


async def aget(conn: AnyAsyncConn, document_id: int) -> Document:
    """Async :func:`get`."""
    async with translated(), conn.cursor(row_factory=class_row(Document)) as cur:
        await cur.execute(SQL_GET, (document_id,))
        return _one(await cur.fetchone(), "document_get")  # type: ignore[no-any-return]


async def arevision(conn: AnyAsyncConn, document_id: int, version: int) -> Revision:
    """Async :func:`revision`."""
    async with translated(), conn.cursor(row_factory=class_row(Revision)) as cur:
        await cur.execute(SQL_REVISION, (document_id, version))
        return _one(await cur.fetchone(), "document_revision")  # type: ignore[no-any-return]


async def asave(conn: AnyAsyncConn, document_id: int, expected_version: int, content: Any,
                saved_by: str, save_id: str | None = None) -> SaveResult:
    """Async :func:`save`."""
    async with translated(), conn.cursor(row_factory=class_row(SaveResult)) as cur:
        await cur.execute(SQL_SAVE, (document_id, expected_version, as_jsonb(content), saved_by,
                                     save_id))
        return _one(await cur.fetchone(), "document_save")  # type: ignore[no-any-return]


async def adelete(conn: AnyAsyncConn, document_id: int, expected_version: int,
                  by: str) -> SaveResult:
    """Async :func:`delete`."""
    async with translated(), conn.cursor(row_factory=class_row(SaveResult)) as cur:
        await cur.execute(SQL_DELETE, (document_id, expected_version, by))
        return _one(await cur.fetchone(), "document_delete")  # type: ignore[no-any-return]


async def amerge(conn: AnyAsyncConn, kind: str, base: Any, local: Any,
                 stored: Any) -> MergeResult:
    """Async :func:`merge`."""
    async with translated(), conn.cursor(row_factory=tuple_row) as cur:
        await cur.execute(SQL_MERGE, (kind, as_jsonb(base), as_jsonb(local), as_jsonb(stored)))
        row = _one(await cur.fetchone(), "document_merge")
    return MergeResult(content=row[0], conflicts=list(row[1]))

