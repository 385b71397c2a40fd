"""Connections: which database to use, and the schema-version check.

The database is chosen in this order:

1. an explicit ``dsn`` argument (the CLI's ``--dsn``);
2. ``$DATABASE_URL``;
3. the dev cluster started by ``pgfence db start`` in this directory (``.pgfence/devdb.json``);

otherwise :func:`resolve_dsn` raises :class:`NoDatabase` with what to do.

Every connection pgfence opens carries client-side liveness settings (:class:`Liveness`): a
connect timeout, TCP keepalives and ``tcp_user_timeout``, unless the DSN sets them itself, so
that a server or path that stops answering is noticed instead of waited on forever.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import tuple_row

from . import SCHEMA_VERSION
from .errors import SchemaMismatch

logger = logging.getLogger(__name__)


class NoDatabase(RuntimeError):
    """No ``--dsn``, no ``DATABASE_URL`` and no running dev cluster."""


def resolve_dsn(dsn: str | None = None) -> str:
    """Return the connection string to use (see the module docstring for the order).

    Raises:
        NoDatabase: nothing to connect to; the message says how to get a database.
    """
    if dsn:
        return dsn
    if env := os.environ.get("DATABASE_URL"):
        return env
    from .embedded import load_dev_cluster  # the dev cluster's module: not needed to run

    if info := load_dev_cluster():
        return info.url
    raise NoDatabase(
        "No database: set DATABASE_URL (e.g. postgresql://user@host/db), pass --dsn, "
        "or start a throwaway local one with `pgfence db start`."
    )


@dataclass(frozen=True)
class Liveness:
    """Client-side liveness settings for one connection (libpq parameters); seconds.

    - ``connect_timeout``: the whole connection set-up (TCP, TLS, authentication) must finish
      within it (libpq rounds it to whole seconds, at least 2) — a server that accepts but
      never answers fails the connect instead of hanging it;
    - ``keepalives_idle`` / ``keepalives_interval`` / ``keepalives_count``: TCP keepalive
      probes after that much silence, every interval, that many unanswered before the kernel
      drops the connection (a dead host or a dropped NAT entry: noticed in ~25 s instead of the
      kernel's default 2 hours);
    - ``tcp_user_timeout``: data sent but not acknowledged for that long drops the connection
      (0 = the kernel's default).

    None of these help against a peer that still acknowledges TCP but never answers (a stuck
    proxy): the executor bounds every call itself for that (``query_timeout``, the listener's
    heartbeat). Over a Unix socket libpq ignores the TCP settings.
    """

    connect_timeout: float = 10.0
    keepalives_idle: int = 10
    keepalives_interval: int = 5
    keepalives_count: int = 3
    tcp_user_timeout: float = 30.0

    def params(self, dsn: str) -> dict[str, str]:
        """The libpq parameters to add to ``dsn``: these settings, minus those it sets itself."""
        mine = {
            "connect_timeout": str(max(1, round(self.connect_timeout))),
            "keepalives": "1",
            "keepalives_idle": str(self.keepalives_idle),
            "keepalives_interval": str(self.keepalives_interval),
            "keepalives_count": str(self.keepalives_count),
            "tcp_user_timeout": str(round(self.tcp_user_timeout * 1000)),
        }
        given = conninfo_to_dict(dsn)
        return {k: v for k, v in mine.items() if given.get(k) is None}

    def dsn(self, dsn: str) -> str:
        """``dsn`` with these settings added (the DSN's own values win)."""
        return make_conninfo(dsn, **self.params(dsn))


def with_dbname(dsn: str, dbname: str) -> str:
    """Return ``dsn`` pointing at database ``dbname`` instead (same host, port, user)."""
    params = conninfo_to_dict(dsn)
    params["dbname"] = dbname
    return make_conninfo("", **params)


def connect(dsn: str | None = None, *, autocommit: bool = True, check_schema: bool = True,
            liveness: Liveness | None = None, **kwargs: Any) -> psycopg.Connection[Any]:
    """Open a connection (autocommit by default: every pgfence call is its own transaction).

    Args:
        dsn: libpq connection string or URI; None = :func:`resolve_dsn`.
        autocommit: False to own the transaction (e.g. enqueue inside business work).
        check_schema: verify ``pgfence.schema_version()`` first (see :func:`check_schema`).
        liveness: connect timeout and TCP keepalives (:class:`Liveness`; None = its defaults);
            settings the DSN gives itself win.
        kwargs: passed to ``psycopg.connect`` (e.g. ``prepare_threshold=None`` behind a
            transaction-mode pooler).

    Raises:
        NoDatabase, SchemaMismatch, psycopg.OperationalError (also when the connect timeout
        expires: ``connection timeout expired``).
    """
    target = resolve_dsn(dsn)
    params: dict[str, Any] = dict((liveness or Liveness()).params(target))
    params.update(kwargs)
    conn = psycopg.connect(target, autocommit=autocommit, **params)
    if check_schema:
        try:
            verify_schema(conn)
        except BaseException:
            conn.close()
            raise
    return conn


SQL_HAS_SCHEMA_VERSION = "SELECT to_regprocedure('pgfence.schema_version()') IS NOT NULL"
SQL_SCHEMA_VERSION = "SELECT pgfence.schema_version()"


def schema_version(conn: psycopg.Connection[Any]) -> int | None:
    """Return ``pgfence.schema_version()``, or None when pgfence is not installed."""
    with conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SQL_HAS_SCHEMA_VERSION)
        row = cur.fetchone()
        if not row or not row[0]:
            return None
        cur.execute(SQL_SCHEMA_VERSION)
        got = cur.fetchone()
    return int(got[0]) if got else None


async def aschema_version(conn: psycopg.AsyncConnection[Any]) -> int | None:
    """Async :func:`schema_version`: ``pgfence.schema_version()``, or None when pgfence is not
    installed. Raises psycopg errors as they come (the caller maps them)."""
    cur = await conn.execute(SQL_HAS_SCHEMA_VERSION)
    row = await cur.fetchone()
    if not row or not row[0]:
        return None
    cur = await conn.execute(SQL_SCHEMA_VERSION)
    got = await cur.fetchone()
    return int(got[0]) if got else None


def verify_schema(conn: psycopg.Connection[Any], expected: int = SCHEMA_VERSION) -> int:
    """Raise unless the database's schema version is exactly ``expected``.

    Raises:
        SchemaMismatch: pgfence is missing or older (run ``pgfence migrate``), or newer than
            this glue (upgrade the pgfence package).
    """
    return check_version(schema_version(conn), expected)


def check_version(got: int | None, expected: int = SCHEMA_VERSION) -> int:
    """Compare a database's schema version with ``expected``; raise SchemaMismatch if different."""
    if got == expected:
        return got
    if got is None:
        msg = "pgfence is not installed in this database: run `pgfence migrate`"
    elif got < expected:
        msg = (f"database schema is version {got}, this pgfence needs {expected}: "
               "run `pgfence migrate`")
    else:
        msg = (f"database schema is version {got}, newer than this pgfence ({expected}): "
               "upgrade the pgfence package")
    raise SchemaMismatch(msg)


def create_database(admin_dsn: str, name: str, template: str | None = None) -> str:
    """CREATE DATABASE ``name`` (optionally from ``template``); return its DSN."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        stmt = sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name))
        if template:
            stmt = sql.SQL("{} TEMPLATE {}").format(stmt, sql.Identifier(template))
        conn.execute(stmt)
    return with_dbname(admin_dsn, name)


def drop_database(admin_dsn: str, name: str) -> None:
    """DROP DATABASE IF EXISTS ``name`` WITH (FORCE): disconnects its sessions first."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
        )
