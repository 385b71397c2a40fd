"""Apply pgfence to a database: forward-only table migrations, then every functions/ file.

``pgfence migrate`` does:

1. run ``schema/preflight.sql``: the roles pgfence needs (created if the login may), and the
   installing login's privileges; a missing one raises :class:`InstallPrivilegeError`, whose
   one-line message names the GRANT or command to run (see README "Installing without a
   superuser");
2. create schema ``pgfence`` if absent (yoyo keeps its bookkeeping tables there, out of the
   application's ``public`` schema);
3. under yoyo's migration lock: record as applied the migrations that ``schema/pgfence.sql``
   installed (a database installed from that file lists them in
   ``pgfence.installed_migration``), then apply pending yoyo migrations from ``migrations/``
   (tables, constraints);
4. re-apply every ``functions/*.sql`` in file-name order, in one transaction guarded by an
   advisory lock. yoyo only runs its post-apply hooks when a migration is pending, so this step
   is done here, every time: a changed function ships without a table migration. The last file
   (``99_owner.sql``) hands every function and view to role ``pgfence_definer``.

Running it twice is a no-op the second time: no migration is pending and the function
definitions written are identical (the tests compare catalog fingerprints). A database whose
schema is newer than this package is refused before anything is applied.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

import psycopg
from psycopg.conninfo import conninfo_to_dict
from yoyo import get_backend, read_migrations

from . import SCHEMA_VERSION
from .db import check_version, resolve_dsn, schema_version
from .paths import functions_dir, migrations_dir, preflight_file

logger = logging.getLogger(__name__)

#: Advisory lock key held while functions/ are applied ("pgfence" in ASCII, truncated).
FUNCTIONS_LOCK_KEY = 0x7067666E6365


class InstallPrivilegeError(RuntimeError):
    """The login running migrate lacks a privilege; the message names the statement to run."""


class FunctionsError(RuntimeError):
    """A ``functions/`` file failed to apply (the whole functions transaction was rolled back)."""


@dataclass
class MigrateResult:
    """What one ``migrate`` call did."""

    applied: list[str] = field(default_factory=list)
    functions: list[str] = field(default_factory=list)
    schema_version: int | None = None
    adopted: list[str] = field(default_factory=list)


def yoyo_uri(dsn: str) -> str:
    """Translate any libpq DSN/URI into the URI yoyo expects (psycopg 3 driver).

    Every libpq parameter is passed as a query argument, which yoyo hands to
    ``psycopg.connect``; ``schema=pgfence`` puts yoyo's own tables in the pgfence schema.
    """
    params: dict[str, Any] = {k: v for k, v in conninfo_to_dict(dsn).items() if v is not None}
    params["schema"] = "pgfence"
    return "postgresql+psycopg:///?" + urlencode(params)


def apply_functions(conn: psycopg.Connection[Any]) -> list[str]:
    """Apply every ``functions/*.sql`` in one transaction on ``conn``; return the file names.

    Raises:
        FunctionsError: a file failed; nothing of any file was applied.
    """
    files = sorted(functions_dir().glob("*.sql"))
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (FUNCTIONS_LOCK_KEY,))
        for path in files:
            logger.debug("applying %s", path.name)
            try:
                conn.execute(path.read_text(encoding="utf-8").encode())
            except psycopg.Error as exc:
                first = exc.diag.message_primary or str(exc).strip().splitlines()[0]
                code = f" [{exc.sqlstate}]" if exc.sqlstate else ""
                raise FunctionsError(f"applying {path.name} failed: {first}{code}") from exc
    return [p.name for p in files]


def preflight(conn: psycopg.Connection[Any]) -> None:
    """Run ``schema/preflight.sql`` on ``conn`` (autocommit): create missing roles, check privileges.

    Raises:
        InstallPrivilegeError: a privilege is missing (nothing was changed); the message is one
            line naming the GRANT / CREATE ROLE statement that fixes it.
    """
    try:
        conn.execute(preflight_file().read_text(encoding="utf-8").encode())
    except psycopg.errors.InsufficientPrivilege as exc:
        raise InstallPrivilegeError(exc.diag.message_primary or str(exc).strip()) from exc


def recorded_version(conn: psycopg.Connection[Any]) -> int | None:
    """The schema version in ``pgfence.meta`` (read from the table: the function may be a hot-fix)."""
    row = conn.execute("SELECT to_regclass('pgfence.meta') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return None
    got = conn.execute("SELECT schema_version FROM pgfence.meta").fetchone()
    return int(got[0]) if got else None


def installed_from_file(conn: psycopg.Connection[Any]) -> set[str]:
    """Ids of the migrations ``schema/pgfence.sql`` installed here (empty for a migrated database)."""
    row = conn.execute("SELECT to_regclass('pgfence.installed_migration') IS NOT NULL").fetchone()
    if not row or not row[0]:
        return set()
    return {r[0] for r in conn.execute("SELECT migration_id FROM pgfence.installed_migration")}


def migrate(dsn: str | None = None, *, lock_timeout: float = 120,
            break_lock: bool = False) -> MigrateResult:
    """Bring the database to this package's schema; safe to run any number of times.

    Args:
        dsn: connection string; None = :func:`pgfence.db.resolve_dsn`.
        lock_timeout: seconds to wait for a concurrent migrate's lock (yoyo's lock row).
        break_lock: first delete a lock row left by a killed migrate.

    Returns:
        MigrateResult: ids of migrations applied now (empty when up to date), of those recorded
        as installed by ``schema/pgfence.sql`` (``adopted``), the functions files applied, and
        the resulting ``pgfence.schema_version()``.

    Raises:
        InstallPrivilegeError: the login lacks a privilege (see :func:`preflight`).
        SchemaMismatch: the database's schema is newer than this package (upgrade pgfence).
        FunctionsError: a functions file failed (its name, the server's message and SQLSTATE are
            in the message; the functions transaction is rolled back as a whole).
        pgfence.paths.SqlNotFound: this install has no SQL files.
        psycopg.Error, yoyo.exceptions.LockTimeout: connection problems or a stuck lock.
    """
    dsn = resolve_dsn(dsn)
    result = MigrateResult()
    migrations = read_migrations(str(migrations_dir()))
    with psycopg.connect(dsn, autocommit=True) as conn:
        preflight(conn)
        if (found := recorded_version(conn)) is not None and found > SCHEMA_VERSION:
            check_version(found)  # raises: a newer schema is never downgraded
        conn.execute("CREATE SCHEMA IF NOT EXISTS pgfence")
        backend = get_backend(yoyo_uri(dsn), migration_table="_yoyo_migration")
        try:
            if break_lock:
                backend.break_lock()
            with backend.lock(timeout=lock_timeout):
                if installed := installed_from_file(conn):
                    adopt = migrations.filter(lambda m: m.id in installed and not backend.is_applied(m))
                    result.adopted = [m.id for m in adopt]
                    if adopt:
                        backend.mark_migrations(adopt)
                pending = backend.to_apply(migrations)
                result.applied = [m.id for m in pending]
                if pending:
                    backend.apply_migrations(pending)
                result.functions = apply_functions(conn)
        finally:
            backend.connection.close()
        result.schema_version = schema_version(conn)
    for mid in result.adopted:
        logger.info("recorded migration %s (installed by schema/pgfence.sql)", mid)
    for mid in result.applied:
        logger.info("applied migration %s", mid)
    return result
