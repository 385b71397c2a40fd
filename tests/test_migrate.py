"""Migrations: idempotent, yoyo bookkeeping inside schema pgfence, schema-version guard."""

from __future__ import annotations

import psycopg
import pytest

from pgfence import SCHEMA_VERSION
from pgfence.db import connect
from pgfence.errors import SchemaMismatch
from pgfence.migrate import migrate

CATALOG_FINGERPRINT = """
SELECT md5(string_agg(def, E'\\n' ORDER BY def)) FROM (
  SELECT 'fn ' || p.oid::regprocedure::text || ' ' || pg_get_functiondef(p.oid)
         || coalesce(obj_description(p.oid, 'pg_proc'), '') || coalesce(array_to_string(p.proacl, ','), '') AS def
  FROM pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace AND p.prokind IN ('f', 'p')
  UNION ALL
  SELECT 'rel ' || c.relname || ' ' || c.relkind::text || coalesce(pg_get_viewdef(c.oid), '')
         || coalesce(array_to_string(c.relacl, ','), '')
  FROM pg_class c WHERE c.relnamespace = 'pgfence'::regnamespace
  UNION ALL
  SELECT 'col ' || attrelid::regclass::text || '.' || attname || ' ' || format_type(atttypid, atttypmod)
  FROM pg_attribute WHERE attrelid IN (SELECT oid FROM pg_class WHERE relnamespace = 'pgfence'::regnamespace)
    AND attnum > 0 AND NOT attisdropped
  UNION ALL
  SELECT 'con ' || conname || ' ' || pg_get_constraintdef(oid)
  FROM pg_constraint WHERE connamespace = 'pgfence'::regnamespace
  UNION ALL
  SELECT 'trg ' || pg_get_triggerdef(t.oid) FROM pg_trigger t
  JOIN pg_class c ON c.oid = t.tgrelid WHERE c.relnamespace = 'pgfence'::regnamespace AND NOT t.tgisinternal
) s
"""


def fingerprint(dsn: str) -> str:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(CATALOG_FINGERPRINT).fetchone()
    assert row is not None
    return str(row[0])


def test_migrate_twice_is_a_no_op(empty_db: str) -> None:
    first = migrate(empty_db)
    assert first.applied, "the first run applies every migration"
    assert first.schema_version == SCHEMA_VERSION
    before = fingerprint(empty_db)
    second = migrate(empty_db)
    assert second.applied == [], "nothing pending the second time"
    assert second.schema_version == SCHEMA_VERSION
    assert fingerprint(empty_db) == before, "the catalog is identical after the second run"


def test_yoyo_tables_live_in_schema_pgfence(empty_db: str) -> None:
    migrate(empty_db)
    with psycopg.connect(empty_db) as conn:
        public = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'public'").fetchone()
        yoyo = conn.execute("SELECT count(*) FROM pg_tables WHERE schemaname = 'pgfence'"
                            " AND tablename LIKE '%%yoyo%%'").fetchone()
    assert public == (0,), "nothing is created in the application's public schema"
    assert yoyo and yoyo[0] >= 2


def test_functions_are_reapplied_on_every_migrate(empty_db: str) -> None:
    migrate(empty_db)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        # a DBA "hot-fixes" a function by hand; migrate restores the shipped definition
        conn.execute("CREATE OR REPLACE FUNCTION pgfence.schema_version() RETURNS integer"
                     " LANGUAGE sql AS 'SELECT 999'")
        assert conn.execute("SELECT pgfence.schema_version()").fetchone() == (999,)
    result = migrate(empty_db)
    assert result.applied == []
    with psycopg.connect(empty_db) as conn:
        assert conn.execute("SELECT pgfence.schema_version()").fetchone() == (SCHEMA_VERSION,)


def test_glue_refuses_a_database_without_pgfence(empty_db: str) -> None:
    with pytest.raises(SchemaMismatch, match="run `pgfence migrate`"):
        connect(empty_db)


def test_glue_refuses_a_newer_schema(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("UPDATE pgfence.meta SET schema_version = schema_version + 1")
    with pytest.raises(SchemaMismatch, match="newer than this pgfence"):
        connect(db)


def test_glue_refuses_an_older_schema(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("UPDATE pgfence.meta SET schema_version = 1")
    with pytest.raises(SchemaMismatch, match="run `pgfence migrate`"):
        connect(db)

