"""What the typed wrappers share: one statement on the caller's connection, errors translated.

Each wrapper module (:mod:`pgfence.outbox`, :mod:`pgfence.plan`, :mod:`pgfence.operation`,
:mod:`pgfence.audit`) sends ``SELECT pgfence.fn(%s::type, …)`` through these, on a connection
the caller owns (so in the caller's transaction, if any); a :class:`psycopg.Error` leaves them
as the exception of :mod:`pgfence.errors` for its SQLSTATE (:func:`pgfence.errors.translate`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg.rows import dict_row, tuple_row

from .errors import translated

AnyConn = psycopg.Connection[Any]


def scalar(conn: AnyConn, query: str, params: Sequence[Any] = ()) -> Any:
    """First column of the first row (None without a row), whatever row factory ``conn`` has.

    Raises: the :mod:`pgfence.errors` exception of the statement's SQLSTATE, or its
    :class:`psycopg.Error` when the code has no class.
    """
    with translated(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(query, params)
        row = cur.fetchone()
    return None if row is None else row[0]


def rows(conn: AnyConn, query: str, params: Sequence[Any] = ()) -> list[dict[str, Any]]:
    """Every row as a dict keyed by column name. Raises as :func:`scalar`."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(query, params)
        return cur.fetchall()
