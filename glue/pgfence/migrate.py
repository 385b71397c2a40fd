"""Apply pgfence to a database: forward-only table migrations, then every functions/ file.

``pgfence migrate`` does, under yoyo's migration lock:

1. create schema ``pgfence`` if absent (yoyo keeps its bookkeeping tables there, out of the
   application's ``public`` schema);
2. apply pending yoyo migrations from ``migrations/`` (tables, constraints, roles);
3. re-apply every ``functions/*.sql`` in file-name order, in one transaction guarded by an
   advisory lock. yoyo only runs its post-apply hooks when a migration is pending, so this step
   is done here, every time: a changed function ships without a table migration.

Running it twice is a no-op the second time: no migration is pending and the function
definitions written are identical (the tests compare catalog fingerprints).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict
from yoyo import get_backend, read_migrations

from .db import resolve_dsn, schema_version
from .paths import functions_dir, migrations_dir

logger = logging.getLogger(__name__)

#: Advisory lock key held while functions/ are applied ("pgfence" in ASCII, truncated).
FUNCTIONS_LOCK_KEY = 0x7067666E6365


@dataclass
class MigrateResult:
    """What one ``migrate`` call did."""

    applied: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    schema_version: int | None = None


def yoyo_uri(dsn: str) -> str:
    """Translate any libpq DSN/URI into the URI yoyo expects (psycopg 3 driver).

    Every libpq parameter is passed as a query argument, which yoyo hands to
    ``psycopg.connect``; ``schema=pgfence`` puts yoyo's own tables in the pgfence schema.
    """
    params: dict[str, Any] = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["schema"] = "pgfence"
    return "postgresql+psycopg:///?" + urlencode(params)


def apply_functions(conn: psycopg.Connection[Any]) -> list[str]:
    """Apply every ``functions/*.sql`` in one transaction on ``conn``; return the file names."""
    files = sorted(functions_dir().glob("*.sql"))
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (FUNCTIONS_LOCK_KEY,))
        for path in files:
            logger.debug("applying %s", path.name)
            try:
                conn.execute(path.read_text(encoding="utf-8").encode())
            except psycopg.Error as exc:
                raise RuntimeError(f"applying {path.name} failed: {exc}") from exc
    return [p.name for p in files]


def migrate(dsn: str | None = None, *, lock_timeout: float = 120,
            break_lock: bool = False) -> MigrateResult:
    """Bring the database to this package's schema; safe to run any number of times.

    Args:
        dsn: connection string; None = :func:`pgfence.db.resolve_dsn`.
        lock_timeout: seconds to wait for a concurrent migrate's lock (yoyo's lock row).
        break_lock: first delete a lock row left by a killed migrate.

    Returns:
        MigrateResult: ids of migrations applied now (empty when up to date), the functions
        files applied, and the resulting ``pgfence.schema_version()``.

    Raises:
        RuntimeError: a functions file failed (its name and the server error are in the message;
            the functions transaction is rolled back as a whole).
        psycopg.Error, yoyo.exceptions.LockTimeout: connection problems or a stuck lock.
    """
    dsn = resolve_dsn(dsn)
    result = MigrateResult()
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA IF NOT EXISTS pgfence")
        backend = get_backend(yoyo_uri(dsn), migration_table="_yoyo_migration")
        try:
            migrations = read_migrations(str(migrations_dir()))
            if break_lock:
                backend.break_lock()
            with backend.lock(timeout=lock_timeout):
                pending = backend.to_apply(migrations)
                result.applied = [m.id for m in pending]
                if pending:
                    backend.apply_migrations(pending)
                result.functions = apply_functions(conn)
        finally:
            backend.connection.close()
        result.schema_version = schema_version(conn)
    for mid in result.applied:
        logger.info("applied migration %s", mid)
    return result
