"""The catalog is the manual: these checks read it from a migrated database, one case per module.

- Every function, procedure, view and table of schema pgfence (private helpers and trigger
  functions too: ``\\df+ pgfence.*`` lists them all) has a COMMENT whose first line is a summary
  of at most 100 characters; the details follow on the next lines.
- Every column of every view has a COMMENT (``\\d+ pgfence.<view>`` explains each one).
- Every ``RAISE EXCEPTION`` in a PL/pgSQL body (``pg_proc.prosrc``) names its SQLSTATE and has a
  DETAIL and a HINT, as functions/ERRORS.md promises.

An object belongs to the module its name starts with (after a leading ``_`` or ``tg_``):
``outbox``, ``plan``, ``operation``, ``document`` or ``audit``; everything else (``event``,
``meta``, ``schema_version``, ``backoff``, ``tg_purge_only``, ...) is ``core``. The test ids name
the module, so ``pytest tests/test_catalog_docs.py -k outbox`` checks one module's files.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pytest

from pgfence.db import create_database, drop_database

MODULES = ("core", "outbox", "plan", "operation", "document", "audit")
SUMMARY_MAX = 100


def module_of(name: str) -> str:
    """The module an object belongs to, by its name (see the module docstring)."""
    first = re.sub(r"^(_|tg_)", "", name).split("_", 1)[0]
    return first if first in MODULES[1:] else "core"


@dataclass(frozen=True)
class Documented:
    """One object of the catalog and its comment (None when it has none)."""

    kind: str       # function, procedure, view, table, column
    name: str       # regprocedure, relation name, or view.column
    comment: str | None


@dataclass(frozen=True)
class Body:
    """The PL/pgSQL source of one routine."""

    name: str
    source: str


@dataclass
class Catalog:
    """What the checks read from one migrated database, for one module."""

    objects: list[Documented]
    columns: list[Documented]
    bodies: list[Body]


class ByModule(dict[str, Catalog]):
    """The catalog by module (with a short repr: pytest prints the fixture of a failed test)."""

    def __repr__(self) -> str:
        return f"<the catalog of {', '.join(self)}>"


OBJECTS_SQL = """
SELECT CASE p.prokind WHEN 'p' THEN 'procedure' ELSE 'function' END, p.proname::text,
       p.oid::regprocedure::text, obj_description(p.oid, 'pg_proc')
FROM pg_catalog.pg_proc p WHERE p.pronamespace = 'pgfence'::regnamespace
UNION ALL
SELECT CASE c.relkind WHEN 'v' THEN 'view' ELSE 'table' END, c.relname::text, c.relname::text,
       obj_description(c.oid, 'pg_class')
FROM pg_catalog.pg_class c
WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('r', 'v', 'm', 'p')
  AND c.relname !~ 'yoyo'
ORDER BY 3
"""
COLUMNS_SQL = """
SELECT c.relname::text, c.relname || '.' || a.attname, col_description(c.oid, a.attnum)
FROM pg_catalog.pg_class c JOIN pg_catalog.pg_attribute a ON a.attrelid = c.oid
WHERE c.relnamespace = 'pgfence'::regnamespace AND c.relkind IN ('v', 'm')
  AND a.attnum > 0 AND NOT a.attisdropped
ORDER BY c.relname, a.attnum
"""
BODIES_SQL = """
SELECT p.proname::text, p.oid::regprocedure::text, p.prosrc
FROM pg_catalog.pg_proc p JOIN pg_catalog.pg_language l ON l.oid = p.prolang
WHERE p.pronamespace = 'pgfence'::regnamespace AND l.lanname = 'plpgsql'
ORDER BY 2
"""


@pytest.fixture(scope="module")
def catalog(admin_dsn: str, template_db: str) -> Iterator[ByModule]:
    """The objects, view columns and PL/pgSQL bodies of a migrated database, by module."""
    name = f"pgfence_cat_{uuid.uuid4().hex[:12]}"
    dsn = create_database(admin_dsn, name, template=template_db)
    try:
        by_module = ByModule({m: Catalog([], [], []) for m in MODULES})
        with psycopg.connect(dsn) as conn:
            for kind, short, full, comment in conn.execute(OBJECTS_SQL):
                by_module[module_of(short)].objects.append(Documented(kind, full, comment))
            for view, column, comment in conn.execute(COLUMNS_SQL):
                by_module[module_of(view)].columns.append(Documented("column", column, comment))
            for short, full, source in conn.execute(BODIES_SQL):
                by_module[module_of(short)].bodies.append(Body(full, source))
        yield by_module
    finally:
        drop_database(admin_dsn, name)


# ---------------------------------------------------------------------------------------------
# Reading RAISE statements out of PL/pgSQL source
# ---------------------------------------------------------------------------------------------
_DOLLAR = re.compile(r"\$([A-Za-z_][A-Za-z_0-9]*)?\$")
_LEVELS = {"exception", "warning", "notice", "info", "log", "debug"}


def blank_strings_and_comments(source: str) -> str:
    """``source`` with the inside of every literal and comment replaced by spaces (same length).

    Handles ``'...'`` (with ``''``), ``E'...'`` (with backslash escapes), ``"identifiers"``,
    ``$tag$...$tag$``, ``-- line`` and ``/* block */`` comments. What is left is the code: a
    keyword found in it is a keyword, not a word of a message or a comment.
    """
    out = list(source)
    i, n = 0, len(source)

    def blank(a: int, b: int) -> None:
        for k in range(a, b):
            if out[k] != "\n":
                out[k] = " "

    while i < n:
        ch = source[i]
        if source.startswith("--", i):
            j = source.find("\n", i)
            j = n if j < 0 else j
            blank(i, j)
            i = j
        elif source.startswith("/*", i):
            j = source.find("*/", i + 2)
            j = n if j < 0 else j + 2
            blank(i, j)
            i = j
        elif ch in "'\"":
            escapes = ch == "'" and i > 0 and source[i - 1] in "eE" and not source[i - 2:i - 1].isalnum()
            j = i + 1
            while j < n:
                if escapes and source[j] == "\\":
                    j += 2
                    continue
                if source[j] == ch:
                    if j + 1 < n and source[j + 1] == ch:
                        j += 2
                        continue
                    break
                j += 1
            blank(i + 1, j)
            i = j + 1
        elif ch == "$" and (m := _DOLLAR.match(source, i)) and not source[i - 1:i].isalnum():
            end = source.find(m.group(0), m.end())
            end = n if end < 0 else end
            blank(m.end(), end)
            i = end + len(m.group(0))
        else:
            i += 1
    return "".join(out)


def raise_statements(source: str) -> list[str]:
    """The ``RAISE`` statements of a PL/pgSQL body that raise an error, as written (with
    literals blanked): level EXCEPTION, or no level (EXCEPTION is the default); ``RAISE;``, which
    re-raises the error being handled, and RAISE WARNING / NOTICE / ... are left out."""
    code = blank_strings_and_comments(source)
    found = []
    for m in re.finditer(r"\bRAISE\b", code, flags=re.IGNORECASE):
        end = code.find(";", m.end())
        stmt = code[m.start():len(code) if end < 0 else end]
        words = stmt.split()
        level = words[1].lower() if len(words) > 1 else ""
        if len(words) == 1 or (level in _LEVELS and level != "exception"):
            continue
        found.append(stmt)
    return found


def missing_options(stmt: str) -> list[str]:
    """Which of ERRCODE, DETAIL, HINT a RAISE statement lacks (a condition name or SQLSTATE
    after the level gives the code: ``RAISE EXCEPTION unique_violation USING ...``)."""
    words = stmt.split()
    rest = words[2:] if len(words) > 1 and words[1].lower() == "exception" else words[1:]
    named = bool(rest) and rest[0].lower() != "using" and re.fullmatch(r"[A-Za-z_]\w*", rest[0]) is not None
    using = re.split(r"\bUSING\b", stmt, maxsplit=1, flags=re.IGNORECASE)
    options = using[1] if len(using) == 2 else ""
    missing = []
    for option in ("ERRCODE", "DETAIL", "HINT"):
        if option == "ERRCODE" and named:
            continue
        if not re.search(rf"\b{option}\s*=", options, flags=re.IGNORECASE):
            missing.append(option)
    return missing


def test_the_raise_reader_reads_plpgsql() -> None:
    body = """
    BEGIN
      -- RAISE EXCEPTION 'in a comment' is not a statement
      RAISE NOTICE 'not an error';
      RAISE EXCEPTION 'a; b %', $x$ HINT = 'no' ; $x$ USING ERRCODE = '22023', HINT = 'h';
      RAISE 'default level' USING ERRCODE = 'PF001', DETAIL = 'd', HINT = E'it''s \\' ; fine';
      RAISE EXCEPTION unique_violation USING DETAIL = 'd', HINT = 'h';
      /* RAISE EXCEPTION 'in a block comment'; */
      RAISE EXCEPTION 'no using' ;
    EXCEPTION WHEN others THEN
      RAISE;
    END"""
    stmts = raise_statements(body)
    assert [missing_options(s) for s in stmts] == [["DETAIL"], [], [], ["ERRCODE", "DETAIL", "HINT"]]
    assert blank_strings_and_comments("x := 'it''s'; -- c") == "x := '     ';     "


# ---------------------------------------------------------------------------------------------
# The checks, per module
# ---------------------------------------------------------------------------------------------
def _summary_problem(comment: str | None) -> str | None:
    if comment is None or not comment.strip():
        return "no COMMENT"
    first = comment.split("\n", 1)[0]
    if not first.strip():
        return "the first line is empty"
    if len(first) > SUMMARY_MAX:
        return f"first line has {len(first)} characters (at most {SUMMARY_MAX}): {first[:60]}..."
    return None


@pytest.mark.parametrize("module", MODULES)
def test_every_object_has_a_summary_first_comment(catalog: ByModule, module: str) -> None:
    """Functions, procedures, views and tables: a COMMENT whose first line is a short summary."""
    objects = catalog[module].objects
    assert objects, f"module {module} has no objects: is module_of() still right?"
    problems = {f"{o.kind} {o.name}": p for o in objects if (p := _summary_problem(o.comment))}
    assert problems == {}


@pytest.mark.parametrize("module", MODULES)
def test_every_view_column_has_a_comment(catalog: ByModule, module: str) -> None:
    """\\d+ pgfence.<view> explains every column."""
    missing = [c.name for c in catalog[module].columns if not (c.comment or "").strip()]
    assert missing == []


@pytest.mark.parametrize("module", MODULES)
def test_every_raise_has_errcode_detail_and_hint(catalog: ByModule, module: str) -> None:
    """functions/ERRORS.md: every RAISE names its SQLSTATE and has a DETAIL and a HINT."""
    problems = []
    for body in catalog[module].bodies:
        for stmt in raise_statements(body.source):
            if missing := missing_options(stmt):
                first = " ".join(stmt.split())[:70]
                problems.append(f"{body.name}: no {'/'.join(missing)} in {first}")
    assert problems == []
