"""Generate ``schema/pgfence.sql``, the one-file install, from ``migrations/`` and ``functions/``.

Usage (``make schema`` runs it on a throwaway cluster)::

    pgfence db run -- python tools/make_schema.py [--check] [--output PATH]

It creates a scratch database on ``$DATABASE_URL``'s server, applies the migrations one at a
time (as ``pgfence migrate`` applies them to a new database: all migrations, then the functions),
and renders what they built — the tables with their columns, constraints, indexes, comments,
grants and seed rows, as they are after the last migration (an index rebuilt by a later
migration appears once, in its final form) — grouped by the migration that created each table.
Then come ``functions/*.sql`` verbatim (functions, views, triggers, grants, comments, with their
comments), and the list of migrations the file holds, for ``pgfence migrate`` to record later.
``schema/preflight.sql`` (the roles and the installing login's privileges) comes first.

The output depends only on the SQL sources and the server's major version: no names of the
generating cluster, no timestamps. ``--check`` writes nothing and exits 1 if the file differs.
``tests/test_schema_file.py`` proves that a database installed from the file has the catalog of
one built by ``pgfence migrate``.
"""

from __future__ import annotations

import argparse
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psycopg
from yoyo import get_backend, read_migrations

from pgfence import SCHEMA_VERSION
from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import yoyo_uri
from pgfence.paths import functions_dir, migrations_dir, preflight_file, schema_file

NUMERIC_TYPES = {"smallint", "integer", "bigint", "numeric", "real", "double precision", "boolean"}
YOYO = "%yoyo%"


@dataclass
class Table:
    """One table as rendered, and the migrations that made it so."""

    name: str
    sql: str
    created_by: str
    changed_by: list[str] = field(default_factory=list)


def _rows(conn: psycopg.Connection[Any], query: str, params: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    return conn.execute(query, params).fetchall()


def _lit(conn: psycopg.Connection[Any], text: str) -> str:
    row = conn.execute("SELECT quote_literal(%s::text)", (text,)).fetchone()
    assert row is not None
    return str(row[0])


def _grants(conn: psycopg.Connection[Any], acl_sql: str, owner_sql: str, target: str,
            oid: int) -> list[str]:
    """GRANT statements for the ACL entries of one object other than its owner's own."""
    out = []
    for grantee, privs in _rows(conn, f"""
        SELECT CASE WHEN a.grantee = 0 THEN 'PUBLIC' ELSE quote_ident(pg_get_userbyid(a.grantee)) END,
               string_agg(a.privilege_type, ', ' ORDER BY a.privilege_type)
        FROM ({acl_sql}) x, aclexplode(x.acl) WITH ORDINALITY a
        WHERE a.grantee <> ({owner_sql})
        GROUP BY a.grantee ORDER BY min(a.ordinality)""", (oid, oid)):
        out.append(f"GRANT {privs} ON {target} TO {grantee};")
    return out


def render_table(conn: psycopg.Connection[Any], oid: int, earlier: set[int]) -> tuple[str, list[str]]:
    """``CREATE TABLE`` with columns and constraints, then comments, indexes and grants.

    Returns the text and the foreign keys that must wait for a table created later.
    """
    [(name, options)] = _rows(conn, "SELECT oid::regclass::text, reloptions FROM pg_class WHERE oid = %s",
                              (oid,))
    cols = _rows(conn, """
        SELECT quote_ident(a.attname), format_type(a.atttypid, a.atttypmod), a.attnotnull,
               pg_get_expr(d.adbin, d.adrelid), a.attidentity, a.attgenerated,
               CASE WHEN a.attcollation <> t.typcollation THEN quote_ident(co.collname) END,
               col_description(a.attrelid, a.attnum)
        FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        LEFT JOIN pg_collation co ON co.oid = a.attcollation
        WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""", (oid,))
    width = max(len(c[0]) for c in cols)
    lines = []
    for col, typ, notnull, default, identity, generated, collation, _ in cols:
        line = f"  {col.ljust(width)} {typ}"
        if collation:
            line += f" COLLATE {collation}"
        if identity:
            check_identity_defaults(conn, oid, col)
            line += " GENERATED {} AS IDENTITY".format("ALWAYS" if identity == "a" else "BY DEFAULT")
        elif generated:
            line += f" GENERATED ALWAYS AS ({default}) STORED"
        if notnull:
            line += " NOT NULL"
        if default is not None and not generated:
            line += f" DEFAULT {default}"
        lines.append(line)
    later: list[str] = []
    for conname, condef, ref in _rows(conn, """
        SELECT quote_ident(c.conname), pg_get_constraintdef(c.oid), c.confrelid
        FROM pg_constraint c WHERE c.conrelid = %s
        ORDER BY array_position(ARRAY['p', 'u', 'f', 'c', 'x'], c.contype::text), c.conname""", (oid,)):
        if ref and ref != oid and ref not in earlier:
            later.append(f"ALTER TABLE {name} ADD CONSTRAINT {conname} {condef};")
        else:
            lines.append(f"  CONSTRAINT {conname} {condef}")
    with_options = f" WITH ({', '.join(options)})" if options else ""
    out = [f"CREATE TABLE {name} (", ",\n".join(lines), f"){with_options};"]
    if (comment := _rows(conn, "SELECT obj_description(%s, 'pg_class')", (oid,))[0][0]) is not None:
        out.append(f"COMMENT ON TABLE {name} IS\n  {_lit(conn, comment)};")
    for col, *_, comment in cols:
        if comment is not None:
            out.append(f"COMMENT ON COLUMN {name}.{col} IS\n  {_lit(conn, comment)};")
    for conname, comment in _rows(conn, """
        SELECT quote_ident(c.conname), obj_description(c.oid, 'pg_constraint') FROM pg_constraint c
        WHERE c.conrelid = %s AND obj_description(c.oid, 'pg_constraint') IS NOT NULL ORDER BY 1""", (oid,)):
        out.append(f"COMMENT ON CONSTRAINT {conname} ON {name} IS\n  {_lit(conn, comment)};")
    for index, indexdef, comment in _rows(conn, """
        SELECT i.indexrelid::regclass::text, pg_get_indexdef(i.indexrelid),
               obj_description(i.indexrelid, 'pg_class')
        FROM pg_index i JOIN pg_class c ON c.oid = i.indexrelid
        WHERE i.indrelid = %s AND NOT EXISTS (
          SELECT 1 FROM pg_constraint k WHERE k.conindid = i.indexrelid AND k.conrelid = i.indrelid)
        ORDER BY c.relname""", (oid,)):
        out.append(indexdef + ";")
        if comment is not None:
            out.append(f"COMMENT ON INDEX {index} IS\n  {_lit(conn, comment)};")
    out += _grants(conn, "SELECT relacl AS acl FROM pg_class WHERE oid = %s",
                   "SELECT relowner FROM pg_class WHERE oid = %s", name, oid)
    return "\n".join(out), later


def check_identity_defaults(conn: psycopg.Connection[Any], table: int, column: str) -> None:
    """Refuse an identity sequence with non-default options (this renderer does not write them)."""
    [(ok,)] = _rows(conn, """
        SELECT s.seqstart = 1 AND s.seqincrement = 1 AND s.seqmin = 1 AND s.seqcache = 1 AND NOT s.seqcycle
               AND s.seqmax = CASE format_type(s.seqtypid, NULL) WHEN 'bigint' THEN 9223372036854775807
                                  WHEN 'integer' THEN 2147483647 ELSE 32767 END
        FROM pg_sequence s WHERE s.seqrelid = pg_get_serial_sequence(%s::regclass::text, %s)::regclass""",
                    (table, column.strip('"')))
    if not ok:
        raise SystemExit(f"make_schema: identity column {column} has sequence options that this "
                         "generator does not write: extend check_identity_defaults and render_table")


def tables(conn: psycopg.Connection[Any]) -> list[tuple[int, str]]:
    """(oid, name) of pgfence's own tables, in creation order (yoyo's bookkeeping left out)."""
    return [(int(o), str(n)) for o, n in _rows(conn, """
        SELECT c.oid, c.oid::regclass::text FROM pg_class c
        WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('r', 'p') AND c.relname NOT LIKE %s
        ORDER BY c.oid""", (YOYO,))]


def seed_rows(conn: psycopg.Connection[Any], oid: int, name: str) -> str | None:
    """``INSERT`` of the rows the migrations wrote, without columns filled by a time default."""
    cols = _rows(conn, """
        SELECT quote_ident(a.attname), format_type(a.atttypid, NULL) FROM pg_attribute a
        LEFT JOIN pg_attrdef d ON d.adrelid = a.attrelid AND d.adnum = a.attnum
        WHERE a.attrelid = %s AND a.attnum > 0 AND NOT a.attisdropped
          AND a.attidentity = '' AND a.attgenerated = ''
          AND NOT (d.adbin IS NOT NULL AND format_type(a.atttypid, NULL) LIKE 'timestamp%%')
        ORDER BY a.attnum""", (oid,))
    exprs = ", ".join(f"{c}::text" for c, _ in cols)
    rows = _rows(conn, f"SELECT {exprs} FROM {name} ORDER BY 1")
    if not rows:
        return None
    values = []
    for row in rows:
        items = []
        for (_, typ), value in zip(cols, row, strict=True):
            items.append("NULL" if value is None else value if typ in NUMERIC_TYPES else _lit(conn, value))
        values.append("  (" + ", ".join(items) + ")")
    return f"INSERT INTO {name} ({', '.join(c for c, _ in cols)}) VALUES\n" + ",\n".join(values) + ";"


def snapshot(conn: psycopg.Connection[Any]) -> dict[str, str]:
    """Every table's rendering (used to tell which migration changed which table)."""
    done: set[int] = set()
    out = {}
    for oid, name in tables(conn):
        text, later = render_table(conn, oid, done)
        out[name] = text + "\n".join(later)
        done.add(oid)
    return out


def migration_summary(mid: str) -> list[str]:
    """The opening comment of a migration (up to its ``depends:`` line or a blank comment line)."""
    out = []
    for line in (migrations_dir() / f"{mid}.sql").read_text(encoding="utf-8").splitlines():
        if not line.startswith("-- ") or line.startswith(("-- depends:", "-- transactional:")):
            break
        out.append(line)
    return out


def build(conn: psycopg.Connection[Any], dsn: str) -> tuple[list[Table], list[str]]:
    """Apply the migrations one by one on ``conn``'s (empty) database; return tables and ids."""
    conn.execute("CREATE SCHEMA IF NOT EXISTS pgfence")
    every = read_migrations(str(migrations_dir()))
    backend = get_backend(yoyo_uri(dsn), migration_table="_yoyo_migration")
    found: dict[str, Table] = {}
    applied: list[str] = []
    try:
        with backend.lock():
            for migration in backend.to_apply(every):
                backend.apply_migrations(backend.to_apply(every.filter(lambda m, i=migration.id: m.id == i)))
                applied.append(migration.id)
                for name, text in snapshot(conn).items():
                    if name not in found:
                        found[name] = Table(name, text, migration.id)
                    elif found[name].sql != text:
                        found[name].sql = text
                        found[name].changed_by.append(migration.id)
    finally:
        backend.connection.close()
    return list(found.values()), applied


def header(applied: list[str]) -> str:
    """The file's opening comment (how to install, what it holds) and its BEGIN."""
    return f"""\
-- pgfence schema/pgfence.sql — the whole of schema pgfence in one file, schema version {SCHEMA_VERSION}.
--
-- GENERATED by `make schema` (tools/make_schema.py) from migrations/ and functions/: do not edit;
-- change those and run `make schema` (tests/test_schema_file.py fails while this file is stale).
--
-- For clients without Python, and for a DBA who wants every table in one place. Install into a
-- database that has no pgfence yet, as the login that will own it (see README, "Installing"):
--
--     psql -v ON_ERROR_STOP=1 -d DATABASE -f schema/pgfence.sql
--
-- One transaction: it installs everything or nothing. Upgrade later with `pgfence migrate`: the
-- file records the migrations it holds (pgfence.installed_migration), and migrate applies only
-- newer ones. The installing login needs what `pgfence migrate` needs (schema/preflight.sql
-- below says what, and stops with the GRANT to run when something is missing).
--
-- Contents: 1. the roles and the installer's privileges (schema/preflight.sql); 2. the tables,
-- grouped by the migration that created them, as the migrations leave them (indexes in their
-- final form); 3. functions/*.sql verbatim: functions, views, triggers, grants, comments,
-- one file per module; 4. the record of the migrations held: {applied[0]} .. {applied[-1]}.

BEGIN;
"""


def generate(admin_dsn: str) -> str:
    """Build a scratch database on ``admin_dsn``'s server and return the text of the file."""
    name = f"pgfence_schema_{uuid.uuid4().hex[:12]}"
    dsn = create_database(admin_dsn, name)
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            found, applied = build(conn, dsn)
            return render(conn, found, applied)
    finally:
        drop_database(admin_dsn, name)


def section(title: str) -> str:
    """A comment banner between the file's parts."""
    bar = "-" * 95
    return f"\n-- {bar}\n-- {title}\n-- {bar}\n"


def render(conn: psycopg.Connection[Any], found: list[Table], applied: list[str]) -> str:
    """The whole file from the migrated scratch database on ``conn`` (see the module docstring)."""
    parts = [header(applied), section("1. Roles and the installing login's privileges: schema/preflight.sql"),
             preflight_file().read_text(encoding="utf-8").rstrip() + "\n",
             section("2. Schema pgfence and its tables"), GUARD]
    [(schema_comment,)] = _rows(conn, "SELECT obj_description('pgfence'::regnamespace, 'pg_namespace')")
    parts.append("CREATE SCHEMA IF NOT EXISTS pgfence;")
    if schema_comment is not None:
        parts.append(f"COMMENT ON SCHEMA pgfence IS\n  {_lit(conn, schema_comment)};")
    parts.append("REVOKE ALL ON SCHEMA pgfence FROM PUBLIC;")
    oid = int(_rows(conn, "SELECT 'pgfence'::regnamespace::oid")[0][0])
    parts += _grants(conn, "SELECT nspacl AS acl FROM pg_namespace WHERE oid = %s",
                     "SELECT nspowner FROM pg_namespace WHERE oid = %s", "SCHEMA pgfence", oid)
    oids = {name: o for o, name in tables(conn)}
    done: set[int] = set()
    later: list[str] = []
    current = None
    for table in sorted(found, key=lambda t: oids[t.name]):
        if table.created_by != current:
            current = table.created_by
            parts.append("\n".join([f"\n-- ==== migrations/{current}.sql", *migration_summary(current)]))
        text, waiting = render_table(conn, oids[table.name], done)
        done.add(oids[table.name])
        later += waiting
        note = f"-- {table.name}"
        if table.changed_by:
            note += f" (changed later by {', '.join(table.changed_by)})"
        parts.append(f"\n{note}\n{text}")
        if rows := seed_rows(conn, oids[table.name], table.name):
            parts.append(rows)
    if later:
        parts.append("\n-- foreign keys to tables created after their own\n" + "\n".join(later))
    parts.append(section("3. Functions, views, triggers, grants: functions/*.sql"))
    for path in sorted(functions_dir().glob("*.sql")):
        parts.append(f"\n-- ==== functions/{path.name}\n" + path.read_text(encoding="utf-8").rstrip() + "\n")
    parts.append(section("4. The migrations this file holds (pgfence migrate records them as applied)"))
    parts.append("INSERT INTO pgfence.installed_migration (migration_id) VALUES\n"
                 + ",\n".join(f"  ('{mid}')" for mid in applied) + ";\n")
    parts.append("COMMIT;\n")
    return "\n".join(parts)


GUARD = """\
DO $guard$
BEGIN
  IF to_regclass('pgfence.meta') IS NOT NULL THEN
    RAISE EXCEPTION 'pgfence is already installed in database % (schema version %)',
      current_database(), (SELECT m.schema_version FROM pgfence.meta m)
      USING ERRCODE = '42P07',
            HINT = 'Upgrade it with pgfence migrate; this file installs into a database without pgfence.';
  END IF;
END
$guard$;
"""


def main(argv: list[str] | None = None) -> int:
    """Write (or with ``--check`` compare) the file; returns the exit status."""
    parser = argparse.ArgumentParser(description="Generate schema/pgfence.sql (run under `pgfence db run`).")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if the file is stale")
    parser.add_argument("--output", type=Path, default=None, help="default: schema/pgfence.sql")
    args = parser.parse_args(argv)
    out: Path = args.output or schema_file()
    text = generate(resolve_dsn(os.environ.get("DATABASE_URL")))
    if args.check:
        if not out.is_file() or out.read_text(encoding="utf-8") != text:
            print(f"{out} is stale: run `make schema`", file=sys.stderr)
            return 1
        return 0
    out.write_text(text, encoding="utf-8")
    print(f"wrote {out} ({len(text.splitlines())} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
