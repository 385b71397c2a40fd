"""SQLSTATE → exception mapping, in one place.

pgfence's SQL functions raise documented SQLSTATEs (``functions/ERRORS.md``). The glue turns a
:class:`psycopg.Error` into one of the classes below with :func:`translate`; callers catch
those and never parse message text. A lost race is not an error: the SQL returns false/NULL.
"""

from __future__ import annotations

from typing import Any

import psycopg


class PgfenceError(Exception):
    """Base class. ``sqlstate`` is the server's code, ``detail``/``hint`` its DETAIL and HINT."""

    def __init__(self, message: str, *, sqlstate: str | None = None,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.detail = detail
        self.hint = hint


class InvalidArgument(PgfenceError):
    """22023 invalid_parameter_value or 22004 null_value_not_allowed: fix the call."""


class NotFound(PgfenceError):
    """P0002 no_data_found: no item with that id."""


class IllegalTransition(PgfenceError):
    """PF001: a status change the module's state machine does not allow."""


class Immutable(PgfenceError):
    """PF002: an attempt to change data that is frozen once written."""


class IdempotencyKeyReused(PgfenceError):
    """PF003: the idempotency key already names a different item."""


class SerializationFailure(PgfenceError):
    """40001: retry the whole transaction."""


class SchemaMismatch(PgfenceError):
    """The database's ``pgfence.schema_version()`` is not the one this glue was written for."""


class MissingPrivilege(PgfenceError):
    """42501, found before the first call: the login may not execute functions it will need
    (e.g. an executor without ``pgfence_executor``); ``hint`` is the GRANT to run."""


_BY_SQLSTATE: dict[str, type[PgfenceError]] = {
    "22023": InvalidArgument,
    "22004": InvalidArgument,
    "P0002": NotFound,
    "PF001": IllegalTransition,
    "PF002": Immutable,
    "PF003": IdempotencyKeyReused,
    "40001": SerializationFailure,
}


def register(sqlstate: str, cls: type[PgfenceError]) -> None:
    """Map one more SQLSTATE (used by the module glue for its own PF codes)."""
    _BY_SQLSTATE[sqlstate] = cls


def translate(exc: psycopg.Error) -> PgfenceError | psycopg.Error:
    """Return the pgfence exception for ``exc``'s SQLSTATE, or ``exc`` itself if unknown."""
    state = exc.sqlstate
    cls = _BY_SQLSTATE.get(state or "")
    if cls is None:
        return exc
    diag: Any = exc.diag
    err = cls(diag.message_primary or str(exc), sqlstate=state,
              detail=diag.message_detail, hint=diag.message_hint)
    err.__cause__ = exc
    return err
