"""Typed wrappers around the audit views and functions (``functions/90_audit.sql``).

The questions an operator asks during an incident, each answered by one view or function in
schema ``pgfence`` (``docs/psql.md`` shows them from psql):

- what is stuck, and since when: :func:`stuck` (view ``audit_stuck``);
- who owns what, until when: :func:`owned`, :func:`leases`, :func:`owner_of`;
- what did one item do: :func:`timeline` (``audit_timeline(module, id)``);
- which external effects may have been duplicated: :func:`duplicates`;
- queue health: :func:`queue_health`; documents: :func:`documents`;
- retention: :func:`purge` (``CALL pgfence.audit_purge``).

Everything but :func:`purge` only reads, and works for a login in the monitoring role
``pg_monitor``. Each call is one statement on a connection the caller owns; SQLSTATEs become
:mod:`pgfence.errors` exceptions. Rows are dicts keyed by the view's column names; times are
aware ``datetime`` on the database clock, durations ``timedelta``.
"""

from __future__ import annotations

import datetime as dt
import logging
from typing import Any

import psycopg

from ._calls import rows

# 42501 (functions/ERRORS.md), defined with every SQLSTATE in pgfence.errors and importable from
# here as before.
from .errors import PermissionDenied as PermissionDenied
from .errors import translated

logger = logging.getLogger(__name__)

#: The modules whose items audit_owner_of / audit_timeline / audit_purge accept.
MODULES: tuple[str, ...] = ("outbox", "plan", "operation", "document")

SQL_STUCK = "SELECT * FROM pgfence.audit_stuck ORDER BY overdue DESC, module, item_id"
SQL_OWNED = "SELECT * FROM pgfence.audit_owned ORDER BY expires_at, module, item_id LIMIT %s::int"
SQL_LEASES = (
    "SELECT module, queue, owner, count(*) AS held, min(claimed_at) AS oldest_claim_at,"
    " min(expires_at) AS next_expiry, count(*) FILTER (WHERE lapsed) AS lapsed"
    " FROM pgfence.audit_owned GROUP BY module, queue, owner ORDER BY module, queue, owner"
)
SQL_OWNER_OF = "SELECT * FROM pgfence.audit_owner_of(%s::text, %s::bigint)"
SQL_TIMELINE = "SELECT * FROM pgfence.audit_timeline(%s::text, %s::bigint)"
SQL_DUPLICATES = (
    "SELECT * FROM pgfence.audit_duplicates ORDER BY since DESC NULLS LAST, module, item_id"
    " LIMIT %s::int"
)
SQL_QUEUE_HEALTH = "SELECT * FROM pgfence.audit_queue_health ORDER BY module, queue"
SQL_DOCUMENTS = (
    "SELECT * FROM pgfence.audit_documents"
    " WHERE %s::text = 'revisions' OR conflicts_1h > 0 OR conflicts_24h > 0"
    " ORDER BY CASE WHEN %s::text = 'revisions' THEN revisions ELSE conflicts_1h END DESC,"
    " conflicts_24h DESC, revisions DESC, document_id LIMIT %s::int"
)
SQL_PURGE = "CALL pgfence.audit_purge(%s::text, %s::interval, %s::int, NULL)"
SQL_CLEANUP_BLOCKERS = "SELECT * FROM pgfence.audit_cleanup_blockers ORDER BY xid_age DESC, pid"
SQL_TABLE_HEALTH = "SELECT * FROM pgfence.audit_table_health ORDER BY dead_rows DESC, table_name"
SQL_WARN_AFTER = "SELECT pgfence._audit_cleanup_warn_after()"

AnyConn = psycopg.Connection[Any]


def stuck(conn: AnyConn) -> list[dict[str, Any]]:
    """Every owned item whose lease or heartbeat lapsed (view ``pgfence.audit_stuck``).

    Columns: module, item_id, queue, status, owner, fence, claimed_at, last_seen_at,
    expired_at, overdue (timedelta), next (what pgfence does about it next). Most overdue first.
    """
    return rows(conn, SQL_STUCK)


def owned(conn: AnyConn, limit: int = 1000) -> list[dict[str, Any]]:
    """Items owned right now (``pgfence.audit_owned``), the soonest to expire first.

    Columns: module, item_id, queue, status, owner, fence, claimed_at, last_seen_at,
    expires_at, remaining (timedelta, negative once lapsed), lapsed.
    """
    return rows(conn, SQL_OWNED, (limit,))


def leases(conn: AnyConn) -> list[dict[str, Any]]:
    """Owned items per module, queue and owner: held, oldest_claim_at, next_expiry, lapsed."""
    return rows(conn, SQL_LEASES)


def owner_of(conn: AnyConn, module: str, item_id: int) -> dict[str, Any]:
    """Who owns one item, under which fence, until when (``pgfence.audit_owner_of``).

    Args:
        module: ``outbox``, ``plan``, ``operation`` or ``document``.
        item_id: the item's id.

    Returns:
        module, item_id, queue, status, owned, owner, fence, claimed_at, last_seen_at,
        expires_at, remaining, lapsed, last_owner.

    Raises:
        InvalidArgument (22004/22023): missing or unknown module. NotFound (P0002): no such item.
    """
    return rows(conn, SQL_OWNER_OF, (module, item_id))[0]


def timeline(conn: AnyConn, module: str, item_id: int) -> list[dict[str, Any]]:
    """What one item did, oldest first, ending with its current state (``audit_timeline``).

    Each row: at, source (event | receipt | lapse | row), event, from_status, to_status,
    actor (the name passed to pgfence), fence, detail (dict), db_user (the database login whose
    transaction wrote the event or receipt; None for rows rebuilt from the item). Raises
    InvalidArgument or NotFound like :func:`owner_of`.
    """
    return rows(conn, SQL_TIMELINE, (module, item_id))


def duplicates(conn: AnyConn, limit: int = 100) -> list[dict[str, Any]]:
    """External effects that may have been duplicated or happened unrecorded, newest first.

    Columns of ``pgfence.audit_duplicates``: module, item_id, queue, status, reason, fences,
    lost_by, since, idempotency_key, check_downstream.
    """
    return rows(conn, SQL_DUPLICATES, (limit,))


def queue_health(conn: AnyConn) -> list[dict[str, Any]]:
    """One row per outbox channel, operation kind, and all plans (``audit_queue_health``)."""
    return rows(conn, SQL_QUEUE_HEALTH)


def cleanup_blockers(conn: AnyConn) -> list[dict[str, Any]]:
    """What holds back VACUUM in this database, oldest first (``audit_cleanup_blockers``).

    Columns: kind ('transaction', 'replication slot', 'prepared transaction'), pid (int or
    None), holder, role, state, xmin, xid_age (int), age (timedelta or None), since, warn (open
    longer than ``pgfence.cleanup_warn_after``, default 5 minutes; a slot: inactive), query.
    Another role's age and query need ``pg_read_all_stats`` (``pg_monitor``).
    """
    return rows(conn, SQL_CLEANUP_BLOCKERS)


def cleanup_warn_after(conn: AnyConn) -> Any:
    """The threshold past which a holder of cleanup is warned about (a timedelta; the setting
    ``pgfence.cleanup_warn_after``, default 5 minutes). Raises psycopg.errors.InvalidDatetimeFormat
    (22007) when the setting is not an interval."""
    with conn.cursor() as cur:
        cur.execute(SQL_WARN_AFTER)
        row = cur.fetchone()
    return row[0] if row else None


def table_health(conn: AnyConn) -> list[dict[str, Any]]:
    """Dead and live rows, sizes (bytes) and last vacuum of pgfence's hot tables, most dead rows
    first (``audit_table_health``)."""
    return rows(conn, SQL_TABLE_HEALTH)


def documents(conn: AnyConn, order: str = "conflicts", limit: int = 20) -> list[dict[str, Any]]:
    """Documents by recent conflicts (``order='conflicts'``, only those with any in 24 h) or by
    number of revisions (``order='revisions'``), from ``pgfence.audit_documents``."""
    if order not in ("conflicts", "revisions"):
        raise ValueError("order must be 'conflicts' or 'revisions'")
    return rows(conn, SQL_DOCUMENTS, (order, order, limit))


def purge(conn: AnyConn, module: str, older_than: dt.timedelta | None = None,
          batch_size: int | None = None) -> int:
    """``CALL pgfence.audit_purge``: delete the module's terminal items older than ``older_than``.

    ``conn`` must be in autocommit mode: the procedure commits after every batch. None = the
    module's documented default (outbox 7 days / 1000, plan 90 days / 100, operation 90 days /
    1000, document events 90 days / 5000). Returns how many items (document: events) went.

    Raises:
        InvalidArgument (22004/22023), PermissionDenied (42501: not pgfence_admin),
        psycopg errors (2D000 inside a transaction block).
    """
    with translated(), conn.cursor() as cur:
        row = cur.execute(SQL_PURGE, (module, older_than, batch_size)).fetchone()
    purged = int(row[0]) if row and row[0] is not None else 0
    logger.info("purged %d %s item(s)", purged, module)
    return purged
