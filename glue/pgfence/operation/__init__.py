"""Typed wrappers around the operation SQL functions (Module 3: long external operations).

An operation is something slow done by another system — reset a database branch, provision a
resource, run an export. The SQL functions guarantee that at most one operation per
``(kind, target)`` is in flight, that the external call is issued once (intent recorded before
the call, reference right after) and that a replaced owner only polls. This file passes
arguments and translates SQLSTATEs; every decision is made in SQL.

Each function is one ``SELECT pgfence.operation_*(%s::type, …)`` on a connection the caller
owns. The SQL strings are module constants so that the async executor
(:mod:`pgfence.operation.module`) sends the very same statements. Durations are ``timedelta``
(PostgreSQL ``interval``); times are aware ``datetime`` on the database clock.

Submodules: :mod:`.handlers` (what an executor calls per operation kind),
:mod:`.module` (the executor module). The local slow-operations HTTP service that the demo and
the tests call is ``pgfence_demo.simulator`` (source checkout only).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row
from psycopg.types.json import Jsonb

from .._calls import scalar

# The errors of this module (functions/ERRORS.md, PF2xx), defined with every SQLSTATE in
# pgfence.errors and importable from here as before.
from ..errors import NotIssued as NotIssued
from ..errors import TargetBusy as TargetBusy
from ..errors import translated
from ..tracing import carried

logger = logging.getLogger(__name__)

SQL_REQUEST = (
    "SELECT * FROM pgfence.operation_request(%s::text, %s::text, %s::jsonb, %s::text, %s::text)"
)
SQL_CLAIM = "SELECT * FROM pgfence.operation_claim(%s::text, %s::text[], %s::interval, %s::int)"
SQL_BEGIN_ISSUE = (
    "SELECT pgfence.operation_begin_issue(%s::bigint, %s::int, %s::boolean, %s::interval)"
)
SQL_RECORD_EXTERNAL = (
    "SELECT pgfence.operation_record_external(%s::bigint, %s::int, %s::text, %s::jsonb)"
)
SQL_POLL = "SELECT pgfence.operation_poll(%s::bigint, %s::int, %s::jsonb, %s::interval)"
SQL_FINISH = (
    "SELECT pgfence.operation_finish(%s::bigint, %s::int, %s::boolean, %s::jsonb, %s::text)"
)
SQL_RELEASE = "SELECT pgfence.operation_release(%s::bigint, %s::int)"
SQL_CANCEL = "SELECT pgfence.operation_cancel(%s::bigint, %s::text)"
SQL_REAP = "SELECT pgfence.operation_reap(%s::int)"
SQL_GET = "SELECT * FROM pgfence.operation_get(%s::bigint)"
SQL_LIST = "SELECT * FROM pgfence.operation_list(%s::text, %s::text, %s::text, %s::int)"

#: LISTEN channel: ``operation_request`` (and release / reap) NOTIFY ``{"kind", "id"}`` at commit.
NOTIFY_CHANNEL = "pgfence_operation"

#: Statuses of the machine ``queued -> running -> succeeded | failed | canceled``.
STATUSES = ("queued", "running", "succeeded", "failed", "canceled")
TERMINAL = frozenset({"succeeded", "failed", "canceled"})


@dataclass(frozen=True)
class Requested:
    """What ``operation_request`` answered: the operation, and whether this call created it.

    For a repeat of a finished request, ``status`` is terminal and ``result``/``error`` come
    from its row: nothing was started again.
    """

    id: int
    status: str
    created: bool
    result: dict[str, Any] | None
    error: str | None


@dataclass(frozen=True)
class ClaimedOperation:
    """One claimed operation, as returned by ``pgfence.operation_claim``.

    ``fence`` is the token for every owner write. ``issue_started``/``external_ref`` say whether
    an earlier owner already made the external call: with a reference, only poll it.
    ``idempotency_key`` is the key to pass to the external API (``pgfence-operation-<id>`` when
    the request had none). ``lease`` is how long the claim is owned (database clock).
    """

    id: int
    kind: str
    target: str
    params: dict[str, Any]
    idempotency_key: str
    fence: int
    lease: dt.timedelta
    lease_expires_at: dt.datetime
    issue_started: bool
    issue_count: int
    external_ref: str | None
    external_state: Any
    cancel_requested: bool
    taken_over_from: str | None
    created_at: dt.datetime


AnyConn = psycopg.Connection[Any]


def _json(value: Any) -> Jsonb | None:
    return None if value is None else Jsonb(value)


def request(conn: AnyConn, kind: str, target: str, params: dict[str, Any] | None = None, *,
            idempotency_key: str | None = None, requested_by: str | None = None) -> Requested:
    """Request an operation (inside the caller's transaction, if ``conn`` has one open).

    Args:
        kind: ``[a-z0-9][a-z0-9_.-]{0,62}``, e.g. ``branch.reset``; the executor maps kinds to
            handlers.
        target: what it acts on (a branch name, a resource id), 1–1024 chars, at most 2048 bytes.
        params: a JSON object for the handler (None = ``{}``).
        idempotency_key: 1–255 chars; a repeat (also a concurrent one) returns the same
            operation. Also passed to the external API by handlers that can.
        requested_by: recorded on the row and in the event log (None = the database user).

    Raises:
        TargetBusy (PF201): another operation is in flight for ``(kind, target)``;
            ``exc.in_flight_id`` names it.
        IdempotencyKeyReused (PF003): the key already names a different request.
        InvalidArgument (22004/22023), SerializationFailure (40001).

    With the OpenTelemetry API installed (``pgfence[otel]``), the current span's trace context
    is stored with the operation: the executor's spans of it are its children.
    """
    with carried(conn), translated(), conn.cursor(row_factory=class_row(Requested)) as cur:
        cur.execute(SQL_REQUEST, (kind, target, Jsonb(params or {}), idempotency_key,
                                  requested_by))
        row = cur.fetchone()
    assert row is not None
    return row


def claim(conn: AnyConn, worker: str, kinds: Sequence[str] | None = None,
          lease: dt.timedelta | None = None, batch: int = 1) -> list[ClaimedOperation]:
    """Claim up to ``batch`` operations of ``kinds`` (None = all) for ``worker``.

    Lapsed running operations (takeovers) come first, then queued ones. ``lease`` None = the
    SQL default (2 minutes). Raises InvalidArgument (22023).
    """
    with translated(), conn.cursor(row_factory=class_row(ClaimedOperation)) as cur:
        cur.execute(SQL_CLAIM, (worker, list(kinds) if kinds else None, lease, batch))
        return cur.fetchall()


def begin_issue(conn: AnyConn, operation_id: int, fence: int, idempotent: bool,
                lease: dt.timedelta | None = None) -> str | None:
    """Record the intent to call the external API; the SQL decides whether to call.

    Returns ``issue`` / ``reissue`` (call now), ``poll`` (a reference exists: poll it),
    ``canceled`` (a cancel was requested before any call: the operation is now canceled, do not
    call), ``failed`` (outcome unknown: the operation is now failed), or None (not the owner any
    more, or the lease lapsed: do not call). ``idempotent``: your call passes the idempotency key.
    """
    value = scalar(conn, SQL_BEGIN_ISSUE, (operation_id, fence, idempotent, lease))
    return None if value is None else str(value)


def record_external(conn: AnyConn, operation_id: int, fence: int, external_ref: str,
                    detail: dict[str, Any] | None = None) -> bool:
    """Record the external reference right after the call. False = not the owner any more.

    Raises:
        NotIssued (PF202): no intent recorded. Immutable (PF002): another reference recorded.
    """
    return bool(scalar(conn, SQL_RECORD_EXTERNAL,
                        (operation_id, fence, external_ref, _json(detail))))


def poll(conn: AnyConn, operation_id: int, fence: int, external_state: Any,
         lease: dt.timedelta | None = None) -> str | None:
    """Store a polled external state and extend the lease.

    Returns ``continue``, ``cancel`` (a cancel was requested) or None (stop: stale fence,
    finished, or lease lapsed). ``external_state`` None = heartbeat only.
    Raises NotIssued (PF202) when no reference was recorded.
    """
    value = scalar(conn, SQL_POLL, (operation_id, fence, _json(external_state), lease))
    return None if value is None else str(value)


def finish(conn: AnyConn, operation_id: int, fence: int, succeeded: bool,
           detail: dict[str, Any] | None = None, error: str | None = None) -> str | None:
    """End the operation: returns ``succeeded``, ``failed``, ``canceled`` or None (stale)."""
    value = scalar(conn, SQL_FINISH, (operation_id, fence, succeeded, _json(detail), error))
    return None if value is None else str(value)


def release(conn: AnyConn, operation_id: int, fence: int) -> bool:
    """End your lease now so another executor takes over at once. False = not the owner."""
    return bool(scalar(conn, SQL_RELEASE, (operation_id, fence)))


def cancel(conn: AnyConn, operation_id: int, by: str | None = None) -> str | None:
    """Cancel: ``canceled`` (at once), ``cancel_requested`` (the owner will), None (finished).

    Raises NotFound (P0002).
    """
    value = scalar(conn, SQL_CANCEL, (operation_id, by))
    return None if value is None else str(value)


def reap(conn: AnyConn, max_rows: int = 1000) -> int:
    """Run the operation reaper once; returns how many operations it requeued or failed."""
    return int(scalar(conn, SQL_REAP, (max_rows,)) or 0)


def get(conn: AnyConn, operation_id: int) -> dict[str, Any]:
    """Everything about one operation. Raises NotFound (P0002)."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_GET, (operation_id,))
        row = cur.fetchone()
    assert row is not None
    return row


def list_operations(conn: AnyConn, kind: str | None = None, target: str | None = None,
                    status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Newest first; ``status`` may also be ``in_flight`` (queued or running)."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_LIST, (kind, target, status, limit))
        return cur.fetchall()

