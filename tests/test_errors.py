"""The one SQLSTATE table (pgfence.errors.SQLSTATES): complete, and known without import order.

- every code of functions/ERRORS.md is a row, every exception class of pgfence.errors is the
  class of a row (but the two the glue raises itself), and the module glue re-exports its
  classes where they always were;
- a process that imports nothing but ``pgfence.errors`` translates every code: a real server
  raises each one (``RAISE … USING ERRCODE``) and ``translate`` answers the row's class, with
  the server's DETAIL and HINT, or the psycopg error itself for the codes without a class;
- the HTTP face and the document session read their tables from it.
"""

from __future__ import annotations

import inspect
import json
import subprocess
import sys

import pgfence.audit
import pgfence.documents
import pgfence.documents.api
import pgfence.errors as errors
import pgfence.operation
import pgfence.plan
from fuzzing import errors_md_codes
from pgfence.documents.session import TRANSIENT_SQLSTATES
from pgfence.web import HTTP_BY_SQLSTATE

GLUE_ONLY = {errors.PgfenceError, errors.SchemaMismatch, errors.MissingPrivilege}


def test_every_documented_code_is_a_row_and_every_class_has_one() -> None:
    documented = errors_md_codes()
    assert documented, "functions/ERRORS.md has its table"
    assert documented <= set(errors.SQLSTATES), documented - set(errors.SQLSTATES)
    for code in documented:
        if code.startswith("PF"):
            assert errors.SQLSTATES[code].error is not None, f"{code} has an exception class"
    classes = {c for _, c in inspect.getmembers(errors, inspect.isclass)
               if issubclass(c, errors.PgfenceError)}
    mapped = {row.error for row in errors.SQLSTATES.values() if row.error is not None}
    assert classes - GLUE_ONLY == mapped
    for code, row in errors.SQLSTATES.items():
        assert row.code == code and len(code) == 5


def test_the_module_glue_re_exports_its_classes_where_they_were() -> None:
    where = {
        pgfence.plan: ["UnknownAction", "ActionConflict", "SelfApproval", "StepOutOfOrder",
                       "NotExternalStep", "NotCompensable", "StepNotBegun", "ActionChanged"],
        pgfence.operation: ["TargetBusy", "NotIssued"],
        pgfence.documents.api: ["ContentTooLarge", "UnknownKind", "VersionUnknown", "MergeInvalid"],
        pgfence.documents: ["ContentTooLarge", "UnknownKind", "VersionUnknown", "MergeInvalid"],
        pgfence.audit: ["PermissionDenied"],
    }
    for module, names in where.items():
        for name in names:
            assert getattr(module, name) is getattr(errors, name), f"{module.__name__}.{name}"


TRANSLATE_EVERY_CODE = """
import json, sys
import psycopg
from pgfence.errors import SQLSTATES, translate   # and nothing else of pgfence
out = {}
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    for code in SQLSTATES:
        try:
            conn.execute("DO $$ BEGIN RAISE EXCEPTION 'raised %', '" + code + "' USING ERRCODE = '"
                         + code + "', DETAIL = 'detail " + code + "', HINT = 'hint " + code
                         + "'; END $$")
        except psycopg.Error as exc:
            err = translate(exc)
            out[code] = [type(err).__module__ + "." + type(err).__name__, err is exc,
                         getattr(err, "sqlstate", None), getattr(err, "detail", None),
                         getattr(err, "hint", None), err.__cause__ is exc]
mods = sorted(m for m in sys.modules if m.startswith("pgfence"))
print(json.dumps({"codes": out, "modules": mods}))
"""


def test_a_process_that_imports_only_errors_translates_every_code(db: str) -> None:
    proc = subprocess.run([sys.executable, "-c", TRANSLATE_EVERY_CODE, db], capture_output=True,
                          text=True, timeout=60, check=False)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["modules"] == ["pgfence", "pgfence.errors"], "no other pgfence module was loaded"
    assert set(got["codes"]) == set(errors.SQLSTATES), "the server raised every code"
    for code, (cls, itself, state, detail, hint, chained) in got["codes"].items():
        row = errors.SQLSTATES[code]
        if row.error is None:
            assert itself and cls.startswith("psycopg.errors."), (code, cls)
        else:
            assert cls == f"pgfence.errors.{row.error.__name__}" and not itself, (code, cls)
            assert (state, detail, hint, chained) == (code, f"detail {code}", f"hint {code}", True)


def test_the_http_table_and_the_sessions_retries_come_from_the_one_table() -> None:
    assert {c: r.http for c, r in errors.SQLSTATES.items() if r.http} == HTTP_BY_SQLSTATE
    assert TRANSIENT_SQLSTATES is errors.TRANSIENT_SQLSTATES
    assert {c for c, r in errors.SQLSTATES.items() if r.transient} == TRANSIENT_SQLSTATES
    assert {"40001", "40P01", "55P03", "57014", "57P01", "57P02", "57P03",
            "53300"} == TRANSIENT_SQLSTATES
