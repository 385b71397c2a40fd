"""Typed wrappers around the outbox SQL functions (Module 1).

Every function is one ``SELECT pgfence.outbox_*(%s::type, …)`` on a connection the caller
owns, so ``enqueue`` can run inside the caller's business transaction (the transactional
outbox). Decisions — who owns a message, what a failure means — are made in SQL; this file only
passes arguments and translates SQLSTATEs (:mod:`pgfence.errors`).

The SQL strings are module constants so the async executor sends the very same statements.
Times are ``datetime`` with a time zone; durations are ``timedelta`` (PostgreSQL ``interval``).
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row, dict_row, tuple_row
from psycopg.types.json import Jsonb

from ._calls import scalar
from .errors import translated
from .tracing import carried

logger = logging.getLogger(__name__)

SQL_ENQUEUE = (
    "SELECT pgfence.outbox_enqueue(%s::text, %s::text, %s::jsonb, %s::text, %s::timestamptz, %s::int,"
    " %s::text)"
)
#: Whether message %s was inserted by this transaction: its created_at is the transaction's
#: start (now()); a repeated idempotency key answers an older message.
SQL_INSERTED_HERE = "SELECT created_at = now() FROM pgfence.outbox_get(%s::bigint)"
SQL_ENQUEUE_MANY = (
    "SELECT id FROM pgfence.outbox_enqueue_many(%s::text, %s::text[], %s::jsonb[], %s::text[],"
    " %s::timestamptz, %s::int, %s::text[]) AS id"
)
SQL_CLAIM = "SELECT * FROM pgfence.outbox_claim(%s::text, %s::int, %s::text[], %s::interval)"
SQL_MARK_SENT = "SELECT pgfence.outbox_mark_sent(%s::bigint, %s::int, %s::jsonb)"
SQL_MARK_SENT_AND_CLAIM = (
    "SELECT * FROM pgfence.outbox_mark_sent_and_claim(%s::bigint, %s::int, %s::jsonb, %s::text,"
    " %s::int, %s::text[], %s::interval)"
)
SQL_MARK_SENT_MANY = (
    "SELECT id FROM pgfence.outbox_mark_sent_many(%s::bigint[], %s::int[], %s::jsonb[]) AS id"
)
SQL_MARK_FAILED = (
    "SELECT pgfence.outbox_mark_failed(%s::bigint, %s::int, %s::text, %s::boolean, %s::interval)"
)
SQL_RECLAIM = "SELECT pgfence.outbox_reap(%s::int)"
SQL_NEXT_DUE = "SELECT pgfence.outbox_next_due(%s::text[])"
SQL_REQUEUE = "SELECT pgfence.outbox_requeue(%s::bigint, %s::int)"
SQL_CANCEL = "SELECT pgfence.outbox_cancel(%s::bigint, %s::text, %s::text)"
SQL_GET = "SELECT * FROM pgfence.outbox_get(%s::bigint)"
SQL_LIST = "SELECT * FROM pgfence.outbox_list(%s::text, %s::text, %s::int)"
SQL_CONFIGURE = (
    "SELECT * FROM pgfence.outbox_configure_channel(%s::text, %s::int, %s::interval,"
    " %s::interval, %s::interval, %s::boolean, %s::int, %s::int, %s::float8, %s::int, %s::text,"
    " %s::text)"
)

#: LISTEN channel on which enqueue NOTIFYs ``{"channel": …, "id": …}`` at commit.
NOTIFY_CHANNEL = "pgfence_outbox"


@dataclass(frozen=True)
class Claimed:
    """One claimed message, as returned by ``pgfence.outbox_claim``.

    ``attempt`` is the fence token to pass back to :func:`mark_sent` / :func:`mark_failed`;
    ``lease`` is how long the claim is owned (``lease_expires_at`` is on the database clock).
    """

    id: int
    channel: str
    recipient: str
    payload: dict[str, Any]
    idempotency_key: str | None
    attempt: int
    max_attempts: int
    lease: dt.timedelta
    lease_expires_at: dt.datetime
    created_at: dt.datetime


AnyConn = psycopg.Connection[Any]


def enqueue(conn: AnyConn, channel: str, recipient: str, payload: dict[str, Any], *,
            idempotency_key: str | None = None, deliver_at: dt.datetime | None = None,
            max_attempts: int | None = None, ordering_key: str | None = None) -> int:
    """Enqueue one message on ``conn`` (inside its current transaction, if any); return its id.

    Args:
        channel: routing name, ``[a-z0-9][a-z0-9_.-]{0,62}``; the executor maps it to a transport.
        recipient: where the transport delivers (webhook URL, e-mail address, ...), ≤ 2048 chars.
        payload: a JSON object (dict).
        idempotency_key: a repeat returns the existing id; ≤ 255 chars.
        deliver_at: earliest delivery time (aware datetime); None = now (database clock).
        max_attempts: 1..1000; None = the channel's setting.
        ordering_key: messages of one channel and key are claimed in enqueue order, at most the
            channel's ``key_max_in_flight`` at once (1: one after the other); ≤ 255 chars.
            None on a channel with ``limit_key`` 'host': the key ``host:<recipient's host>``.

    Raises:
        InvalidArgument (22004/22023), IdempotencyKeyReused (PF003), PayloadTooLarge (PF004),
        SerializationFailure (40001).

    With the OpenTelemetry API installed (``pgfence[otel]``), the current span's trace context
    is stored with the message (:func:`pgfence.tracing.carried`, docs/tracing.md).
    """
    with carried(conn):
        return int(scalar(conn, SQL_ENQUEUE, (channel, recipient, Jsonb(payload),
                                               idempotency_key, deliver_at, max_attempts,
                                               ordering_key)))


def enqueue_reporting(conn: AnyConn, channel: str, recipient: str, payload: dict[str, Any], *,
                      idempotency_key: str | None = None, deliver_at: dt.datetime | None = None,
                      max_attempts: int | None = None,
                      ordering_key: str | None = None) -> tuple[int, bool]:
    """:func:`enqueue`, answering ``(id, deduplicated)``: True when the idempotency key already
    named message ``id`` (nothing was inserted). Same arguments and errors as :func:`enqueue`."""
    with translated(), conn.transaction():
        mid = enqueue(conn, channel, recipient, payload, idempotency_key=idempotency_key,
                      deliver_at=deliver_at, max_attempts=max_attempts, ordering_key=ordering_key)
        inserted = scalar(conn, SQL_INSERTED_HERE, (mid,))
    return mid, not inserted


def enqueue_many(conn: AnyConn, channel: str, recipients: Sequence[str],
                 payloads: Sequence[dict[str, Any]], *,
                 idempotency_keys: Sequence[str | None] | None = None,
                 deliver_at: dt.datetime | None = None,
                 max_attempts: int | None = None,
                 ordering_keys: Sequence[str | None] | None = None) -> list[int]:
    """Enqueue many messages on one channel in one statement; return ids in input order.

    Element *i* of ``recipients``/``payloads``/``idempotency_keys``/``ordering_keys`` is message
    *i*. Same rules and errors as :func:`enqueue`; an invalid element rejects the whole call.
    The current span's trace context is stored with every message, as by :func:`enqueue`.
    """
    with carried(conn), translated(), conn.cursor(row_factory=tuple_row) as cur:
        rows = cur.execute(
            SQL_ENQUEUE_MANY,
            (channel, list(recipients), [Jsonb(p) for p in payloads],
             list(idempotency_keys) if idempotency_keys is not None else None,
             deliver_at, max_attempts,
             list(ordering_keys) if ordering_keys is not None else None),
        ).fetchall()
    return [int(r[0]) for r in rows]


def claim(conn: AnyConn, worker: str, batch: int = 1, channels: Sequence[str] | None = None,
          lease: dt.timedelta | None = None) -> list[Claimed]:
    """Claim up to ``batch`` due messages for ``worker`` (see ``pgfence.outbox_claim``).

    ``channels``: None = every channel; an empty list claims nothing (as in SQL). ``lease``
    (at most 1 day) None = each channel's configured lease. Returns oldest-due first.

    Raises:
        InvalidArgument (22023): empty worker, batch outside 1..10000, lease not in (0, 1 day].
    """
    with translated(), conn.cursor(row_factory=class_row(Claimed)) as cur:
        cur.execute(SQL_CLAIM, (worker, batch, list(channels) if channels is not None else None, lease))
        return cur.fetchall()


def mark_sent(conn: AnyConn, message_id: int, attempt: int,
              receipt: dict[str, Any] | None = None) -> bool:
    """processing → sent under fence ``attempt``; False = stale claim (lost race, no change).

    Raises:
        NotFound (P0002): unknown id.
    """
    return bool(scalar(conn, SQL_MARK_SENT,
                        (message_id, attempt, Jsonb(receipt) if receipt is not None else None)))


def mark_sent_and_claim(conn: AnyConn, message_id: int, attempt: int, worker: str, *,
                        receipt: dict[str, Any] | None = None, batch: int = 1,
                        channels: Sequence[str] | None = None,
                        lease: dt.timedelta | None = None) -> tuple[bool, list[Claimed]]:
    """Mark ``message_id`` sent under fence ``attempt`` and claim the next messages, in one
    statement and one commit (see ``pgfence.outbox_mark_sent_and_claim``).

    For a worker that handles one message at a time: the loop is ``claim`` once, then
    ``mark_sent_and_claim`` after each delivery. ``worker``, ``batch`` (1..10000), ``channels``
    and ``lease`` (None = each channel's lease) are as in :func:`claim`.

    Returns ``(sent, claimed)``: ``sent`` is False for a stale claim (a lost race, nothing
    changed); ``claimed`` is oldest-due first and empty when nothing is due.

    Raises:
        InvalidArgument (22004, 22023; then nothing is marked either), NotFound (P0002: unknown
        id; then nothing is claimed).
    """
    with translated(), conn.cursor(row_factory=tuple_row) as cur:
        rows = cur.execute(SQL_MARK_SENT_AND_CLAIM, (
            message_id, attempt, Jsonb(receipt) if receipt is not None else None, worker, batch,
            list(channels) if channels is not None else None, lease)).fetchall()
    # The function returns one row even when nothing was claimed (id NULL), for ``sent``.
    return bool(rows[0][-1]), [Claimed(*r[:-1]) for r in rows if r[0] is not None]


def mark_failed(conn: AnyConn, message_id: int, attempt: int, error: str, *,
                retryable: bool = True, retry_after: dt.timedelta | None = None) -> str | None:
    """Report a failed delivery under fence ``attempt``.

    Returns the new status (``pending`` = will retry after backoff, ``dead``, ``failed``), or
    None for a stale claim (lost race, nothing changed).
    """
    status = scalar(conn, SQL_MARK_FAILED, (message_id, attempt, error, retryable, retry_after))
    return None if status is None else str(status)


def reap(conn: AnyConn, max_rows: int = 1000) -> int:
    """Run the outbox reaper (``outbox_reap``) once; return how many lapsed claims it took back.

    Args:
        conn: a connection (its transaction, if any, is the caller's).
        max_rows: at most this many lapsed leases per call (1..), the rest wait for the next one.

    Raises:
        InvalidArgument: ``max_rows`` < 1 (22023).
    """
    return int(scalar(conn, SQL_RECLAIM, (max_rows,)) or 0)


#: Deprecated: the former name of :func:`reap` (as ``outbox_reclaim_stale`` is of ``outbox_reap``).
reclaim_stale = reap


def requeue(conn: AnyConn, message_id: int, extra_attempts: int | None = None) -> bool:
    """Operator: retry a failed/dead message now (grants more attempts). False if not requeueable."""
    return bool(scalar(conn, SQL_REQUEUE, (message_id, extra_attempts)))


def cancel(conn: AnyConn, message_id: int, by: str, reason: str) -> bool:
    """Operator: cancel a message that is not being delivered (waiting, pending, failed, dead).

    ``by``: who cancels (1-200 chars), ``reason``: why (both go to the event log). Returns False
    when the message is processing or already finished (a claim that came first wins). Raises
    InvalidArgument (22004/22023), NotFound (P0002).
    """
    return bool(scalar(conn, SQL_CANCEL, (message_id, by, reason)))


def get(conn: AnyConn, message_id: int) -> dict[str, Any]:
    """One message with its delivery state. Raises NotFound (P0002) for an unknown id."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_GET, (message_id,))
        row = cur.fetchone()
    assert row is not None
    return row


def list_messages(conn: AnyConn, channel: str | None = None, status: str | None = None,
                  limit: int = 100) -> list[dict[str, Any]]:
    """Newest messages first, optionally filtered by channel and status (no payloads)."""
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_LIST, (channel, status, limit))
        return cur.fetchall()


def configure_channel(conn: AnyConn, channel: str, *, max_attempts: int | None = None,
                      backoff_base: dt.timedelta | None = None,
                      backoff_cap: dt.timedelta | None = None,
                      lease: dt.timedelta | None = None,
                      log_events: bool | None = None, max_payload_bytes: int | None = None,
                      key_max_in_flight: int | None = None, key_rate: float | None = None,
                      key_burst: int | None = None,
                      key_dead_policy: str | None = None,
                      limit_key: str | None = None) -> dict[str, Any]:
    """Set a channel's settings (None keeps the current value); returns the stored row.

    ``channel='*'`` changes the defaults for channels without their own row. ``log_events``
    writes every transition of the channel's messages to ``pgfence.event``.
    ``max_payload_bytes``: the largest payload (jsonb size) enqueue accepts. Ordering keys:
    ``key_max_in_flight`` messages of one key at once, ``key_rate`` claims per second per key
    (0 = no rate) in bursts of ``key_burst``, ``key_dead_policy`` 'block' or 'release'.
    ``limit_key`` 'host' ('none' clears it): messages enqueued without an ordering key get the
    key ``host:<recipient URL host>``, so the key limits apply per recipient host.
    Raises InvalidArgument (22023) for a bad name or setting.
    """
    with translated(), conn.cursor(row_factory=dict_row) as cur:
        cur.execute(SQL_CONFIGURE,
                    (channel, max_attempts, backoff_base, backoff_cap, lease, log_events,
                     max_payload_bytes, key_max_in_flight, key_rate, key_burst, key_dead_policy,
                     limit_key))
        row = cur.fetchone()
    assert row is not None
    return row
