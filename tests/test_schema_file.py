"""``schema/pgfence.sql`` cannot drift: it is what ``make schema`` generates now, a database
installed from it with ``psql -f`` (by a login that is not a superuser) has exactly the catalog of
one built by ``pgfence migrate``, and ``pgfence migrate`` takes such a database over: it records the
migrations the file held, applies nothing else, and later applies only newer migrations."""

from __future__ import annotations

import difflib
import shutil
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from catalog import catalog, diff
from pgfence.db import drop_database
from pgfence.migrate import migrate
from pgfence.paths import migrations_dir
from support import OWNER, install_as_owner, owned_database, psql_file, with_user

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = ROOT / "schema" / "pgfence.sql"
STALE = "schema/pgfence.sql is stale: run `make schema`"
MIGRATIONS = sorted(p.stem for p in migrations_dir().glob("*.sql"))

sys.path.insert(0, str(ROOT / "tools"))
import make_schema  # noqa: E402


@pytest.fixture()
def file_db(admin_dsn: str) -> Iterator[tuple[str, str]]:
    """(admin DSN, owner DSN) of a new database owned by a non-superuser login, without pgfence."""
    name = f"pgfence_f_{uuid.uuid4().hex[:12]}"
    dsn = owned_database(admin_dsn, name)
    if dsn is None:
        pytest.fail("these tests install as a non-superuser login, which needs a superuser DATABASE_URL")
    yield dsn, with_user(dsn, OWNER)
    drop_database(admin_dsn, name)


def install_file(dsn: str) -> None:
    proc = psql_file(dsn, SCHEMA)
    assert proc.returncode == 0, f"psql -f schema/pgfence.sql failed ({STALE}?):\n{proc.stderr[-3000:]}"


def test_the_file_is_what_make_schema_generates(admin_dsn: str) -> None:
    text = make_schema.generate(admin_dsn)
    if text != SCHEMA.read_text(encoding="utf-8"):
        changed = difflib.unified_diff(SCHEMA.read_text(encoding="utf-8").splitlines(), text.splitlines(),
                                       "schema/pgfence.sql", "generated", lineterm="", n=1)
        pytest.fail(STALE + "\n" + "\n".join(list(changed)[:60]))


def test_generation_is_deterministic(admin_dsn: str) -> None:
    assert make_schema.generate(admin_dsn) == make_schema.generate(admin_dsn)


def test_an_installed_file_has_the_catalog_of_a_migrated_database_and_migrate_takes_it_over(
        file_db: tuple[str, str], db: str) -> None:
    admin, owner = file_db
    install_file(owner)
    got, want = catalog(admin), catalog(db)
    assert got == want, f"{STALE}: the file installs another catalog than pgfence migrate\n{diff(got, want)}"

    result = migrate(owner)
    assert result.adopted == MIGRATIONS, "migrate records every migration the file held"
    assert result.applied == [], "and runs none of them again"
    got, want = catalog(admin, yoyo=True), catalog(db, yoyo=True)
    assert got == want, f"after migrate the database still differs from a migrated one\n{diff(got, want)}"
    again = migrate(owner)
    assert (again.adopted, again.applied) == ([], [])
    assert catalog(admin, yoyo=True) == want


def test_installing_over_an_installed_database_is_refused(db: str) -> None:
    before = catalog(db)
    proc = psql_file(db, SCHEMA)
    assert proc.returncode != 0
    assert "pgfence is already installed" in proc.stderr and "pgfence migrate" in proc.stderr
    assert catalog(db) == before, "one transaction: nothing was changed"


def test_a_file_install_is_upgraded_by_migrate_with_the_newer_migrations_only(
        file_db: tuple[str, str], admin_dsn: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package gains a migration after the file was generated: migrate applies just that one,
    and the result is the catalog of a database migrated from scratch by that package."""
    admin, owner = file_db
    install_file(owner)
    root = tmp_path / "sql"
    for folder in ("migrations", "functions", "schema"):
        shutil.copytree(ROOT / folder, root / folder)
    (root / "migrations" / "0099_test_upgrade.sql").write_text(
        "-- a migration newer than the schema file\n-- depends: 0012_install_record\n"
        "CREATE INDEX event_actor_idx ON pgfence.event (actor);\n"
        "COMMENT ON INDEX pgfence.event_actor_idx IS 'added after the file install';\n")
    monkeypatch.setenv("PGFENCE_SQL_ROOT", str(root))

    with psycopg.connect(admin, autocommit=True) as conn:  # the file's data survives the upgrade
        conn.execute("SELECT pgfence.outbox_enqueue('up-file', 'r', '{}', 'kept')")
    result = migrate(owner)
    assert result.adopted == MIGRATIONS
    assert result.applied == ["0099_test_upgrade"]

    name = f"pgfence_u_{uuid.uuid4().hex[:12]}"
    fresh = install_as_owner(admin_dsn, name)
    try:
        with psycopg.connect(fresh, autocommit=True) as conn:
            conn.execute("SELECT pgfence.outbox_enqueue('up-file', 'r', '{}', 'kept')")
        got, want = catalog(admin, yoyo=True), catalog(fresh, yoyo=True)
        assert got == want, diff(got, want)
    finally:
        drop_database(admin_dsn, name)
