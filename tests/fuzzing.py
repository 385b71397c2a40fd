"""The fuzzer of every public pgfence routine (``tests/test_fuzz.py`` runs it).

Nothing here names a pgfence function: the routines, their argument types and the SQLSTATEs
they document come from the catalog, so a function added (or a signature changed) is fuzzed
without anyone remembering to. What is pgfence-specific is the seed (``tests/fuzz_seed.sql``:
real rows in every state of every module, and sample arguments) and the invariants below (what
must hold of the tables after every call).

- :func:`routines` reads ``pg_proc``: every routine of schema pgfence whose name does not start
  with ``_`` and that is not a trigger function; its input arguments (name, type, default) and
  the codes its ``COMMENT`` lists after ``Errors:`` (:func:`documented_codes`, the convention of
  ``functions/ERRORS.md``).
- :class:`Pools` holds what the database holds after the seed, by type and by column name;
  :func:`hostile` the hostile values of each type: NULLs, limits +-1 in characters of 1-4 bytes,
  integer / double / interval extremes, +-infinity timestamps, wrong-shaped, huge and deep
  JSON, arrays with NULLs, other lower bounds and two dimensions.
- :class:`Fuzzer` draws one call at a time (:meth:`Fuzzer.draw_call`, with :class:`Draw`): a
  routine, then every argument by its type, often from *focus* rows of the routine's module
  (the first ``_``-separated word of its name names its table: outbox_* -> pgfence.outbox), so
  that ids, fences, versions, owners and keys match an item in some state and arrays hold
  several items' values in step; or a replay of an earlier successful call, as is or with one
  argument changed. A call is plausible, plausible but for one hostile argument, or anything
  goes. It runs the call in autocommit (sometimes inside an explicit transaction block) and
  checks after it (:meth:`Fuzzer.run`): success or a documented SQLSTATE; for a failure, that
  the tables' fingerprint did not change; for a success, that every invariant holds and that an
  interval or timestamp returned reads back; and that no setting (``pgfence.actor``,
  ``pgfence.purging``) leaked into the session. :class:`Snapshot` puts the seed back before
  every Hypothesis example.
"""

from __future__ import annotations

import json
import random
import re
import time
from collections import Counter, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from graphlib import TopologicalSorter
from pathlib import Path
from typing import Any

import psycopg
from hypothesis import strategies as st
from psycopg import sql
from psycopg.types.string import TextLoader

TESTS = Path(__file__).resolve().parent
ERRORS_MD = TESTS.parent / "functions" / "ERRORS.md"
SEED = TESTS / "fuzz_seed.sql"

# ---------------------------------------------------------------------------------------------
# The catalog
# ---------------------------------------------------------------------------------------------


def known_sqlstate(code: str) -> bool:
    """Is ``code`` a PostgreSQL SQLSTATE or one of pgfence's own (``PF`` + three digits)?"""
    if re.fullmatch(r"PF\d{3}", code):
        return True
    try:
        psycopg.errors.lookup(code)
    except KeyError:
        return False
    return True


def documented_codes(comment: str) -> set[str] | None:
    """The SQLSTATEs a COMMENT lists after its last ``Errors:`` (None: it has no such section).

    The convention (functions/ERRORS.md): each code is written as its five characters; the codes
    are the five-character tokens of the section that are SQLSTATEs (so "1..10000" is not one).
    """
    if "Errors:" not in comment:
        return None
    section = comment.rsplit("Errors:", 1)[1]
    return {t for t in re.findall(r"\b[0-9A-Z]{5}\b", section)
            if re.search(r"\d", t) and known_sqlstate(t)}


def errors_md_codes(text: str | None = None) -> set[str]:
    """The SQLSTATEs that the table of functions/ERRORS.md explains."""
    text = ERRORS_MD.read_text() if text is None else text
    return set(re.findall(r"^\| `([0-9A-Z]{5})` \|", text, re.MULTILINE))


@dataclass(frozen=True)
class Arg:
    name: str
    type: str          # format_type(): 'text', 'bigint[]', 'timestamp with time zone', ...
    has_default: bool


@dataclass(frozen=True)
class Routine:
    signature: str     # regprocedure text
    name: str
    kind: str          # 'f' function, 'p' procedure
    args: tuple[Arg, ...]
    comment: str
    codes: frozenset[str] | None

    @property
    def module(self) -> str:
        return self.name.split("_", 1)[0]

    def statement(self, n_args: int) -> sql.Composed:
        """``SELECT * FROM pgfence.f(%s::t1, ...)`` (``CALL`` for a procedure) with n_args args."""
        casts = sql.SQL(", ").join(
            sql.SQL("%s::{}").format(sql.SQL(a.type)) for a in self.args[:n_args])
        verb = "CALL {}.{}({})" if self.kind == "p" else "SELECT * FROM {}.{}({})"
        return sql.SQL(verb).format(sql.Identifier("pgfence"), sql.Identifier(self.name), casts)


ROUTINES_SQL = """
SELECT p.oid::regprocedure::text, p.proname, p.prokind::text,
       coalesce(obj_description(p.oid, 'pg_proc'), ''), p.pronargdefaults,
       ARRAY(SELECT format_type(t, NULL) FROM unnest(p.proargtypes::oid[]) WITH ORDINALITY AS u(t, i) ORDER BY u.i),
       ARRAY(SELECT coalesce(p.proargnames[u.i], '') FROM generate_subscripts(coalesce(p.proargmodes, array_fill('i'::"char", ARRAY[p.pronargs])), 1) AS u(i)
             WHERE coalesce(p.proargmodes[u.i], 'i') IN ('i', 'b', 'v') ORDER BY u.i)
FROM pg_catalog.pg_proc p
WHERE p.pronamespace = 'pgfence'::regnamespace AND p.proname !~ '^_' AND p.prorettype <> 'trigger'::regtype
ORDER BY p.proname, p.oid
"""


def routines(conn: psycopg.Connection[Any]) -> list[Routine]:
    """Every public routine of schema pgfence, from the catalog."""
    out = []
    for signature, name, kind, comment, n_defaults, types, names in conn.execute(ROUTINES_SQL):
        n = len(types)
        args = tuple(Arg(names[i] if i < len(names) else "", types[i], i >= n - n_defaults)
                     for i in range(n))
        codes = documented_codes(comment)
        out.append(Routine(signature, name, kind, args, comment,
                           None if codes is None else frozenset(codes)))
    return out


# ---------------------------------------------------------------------------------------------
# Seeding and resetting
# ---------------------------------------------------------------------------------------------

def item_tables(conn: psycopg.Connection[Any]) -> list[str]:
    """The pgfence tables (and the seed's public.fuzz_* tables), for fingerprints and resets."""
    return [r[0] for r in conn.execute("""
        SELECT c.oid::regclass::text FROM pg_catalog.pg_class c
        WHERE c.relkind = 'r' AND ((c.relnamespace = 'pgfence'::regnamespace
               AND c.relname NOT LIKE '\\_yoyo%' AND c.relname NOT IN ('yoyo_lock', 'meta'))
           OR (c.relnamespace = 'public'::regnamespace AND c.relname LIKE 'fuzz\\_%'))
        ORDER BY 1""")]


def seed(conn: psycopg.Connection[Any]) -> None:
    """Load the seed into a freshly migrated database (autocommit connection, as the owner)."""
    conn.execute(SEED.read_text())


@dataclass
class Snapshot:
    """The seeded contents of every table (in schema fuzz_snapshot) and of their identity
    sequences. :meth:`restore` puts them back in a few milliseconds, where emptying and seeding
    again takes a few hundred: with triggers off (the guards would refuse rows in any state but
    the first), as replication does for a superuser, else by disabling the tables' own
    triggers (their owner may); in foreign-key order, for the constraints a non-superuser keeps."""

    tables: list[str]          # parents before children
    sequences: list[tuple[str, int, bool]]
    superuser: bool

    @classmethod
    def take(cls, conn: psycopg.Connection[Any], tables: list[str]) -> Snapshot:
        refs = conn.execute("""
            SELECT c.conrelid::regclass::text, c.confrelid::regclass::text FROM pg_catalog.pg_constraint c
            WHERE c.contype = 'f' AND c.conrelid <> c.confrelid""").fetchall()
        graph: dict[str, set[str]] = {t: set() for t in tables}
        for child, parent in refs:
            if child in graph and parent in graph:
                graph[child].add(parent)
        ordered = list(TopologicalSorter(graph).static_order())
        conn.execute("DROP SCHEMA IF EXISTS fuzz_snapshot CASCADE; CREATE SCHEMA fuzz_snapshot")
        sequences = []
        for i, table in enumerate(ordered):
            conn.execute(sql.SQL("CREATE TABLE fuzz_snapshot.{} AS SELECT * FROM {}").format(
                sql.Identifier(f"t{i}"), sql.SQL(table)))
            for (seq,) in conn.execute("""
                    SELECT pg_get_serial_sequence(%s, a.attname) FROM pg_catalog.pg_attribute a
                    WHERE a.attrelid = %s::regclass AND a.attidentity <> '' """, (table, table)).fetchall():
                row = conn.execute(sql.SQL("SELECT last_value, is_called FROM {}").format(sql.SQL(seq))).fetchone()
                assert row is not None
                sequences.append((seq, row[0], row[1]))
        superuser = conn.execute("SELECT rolsuper FROM pg_catalog.pg_roles WHERE rolname = current_user").fetchone()
        return cls(ordered, sequences, bool(superuser and superuser[0]))

    def restore(self, conn: psycopg.Connection[Any]) -> None:
        with conn.transaction():
            if self.superuser:
                conn.execute("SET LOCAL session_replication_role = replica")
            else:
                for table in self.tables:
                    conn.execute(sql.SQL("ALTER TABLE {} DISABLE TRIGGER USER").format(sql.SQL(table)))
            for table in reversed(self.tables):
                conn.execute(sql.SQL("DELETE FROM {}").format(sql.SQL(table)))
            for i, table in enumerate(self.tables):
                conn.execute(sql.SQL("INSERT INTO {} OVERRIDING SYSTEM VALUE SELECT * FROM fuzz_snapshot.{}").format(
                    sql.SQL(table), sql.Identifier(f"t{i}")))
            for seq, value, called in self.sequences:
                conn.execute("SELECT setval(%s, %s, %s)", (seq, value, called))
            if not self.superuser:
                for table in self.tables:
                    conn.execute(sql.SQL("ALTER TABLE {} ENABLE TRIGGER USER").format(sql.SQL(table)))


# ---------------------------------------------------------------------------------------------
# Fingerprint and invariants
# ---------------------------------------------------------------------------------------------

def after_call_sql(tables: list[str]) -> sql.Composed:
    """One query for after every call: the settings that must not leak out of a call, and the
    tables' fingerprint: per table its row count and the sum of its rows' xmin (every committed
    write gives the rows it writes a new xmin; a rolled-back one is invisible)."""
    parts = [sql.SQL("(SELECT count(*) || ':' || coalesce(sum(t.xmin::text::bigint), 0) FROM {} t)").format(
        sql.SQL(t)) for t in tables]
    return sql.SQL("SELECT current_setting('pgfence.actor', true), current_setting('pgfence.purging', true), "
                   "concat_ws('|', {})").format(sql.SQL(", ").join(parts))


# Each query returns the rows that break the invariant, as (invariant, item) text.
INVARIANTS = r"""
SELECT 'outbox row invariants', o.id::text FROM pgfence.outbox o
WHERE NOT (o.status IN ('waiting', 'pending', 'processing', 'sent', 'failed', 'dead', 'canceled')
       AND o.max_attempts >= 1 AND o.attempts BETWEEN 0 AND o.max_attempts
       AND (o.status NOT IN ('pending', 'waiting') OR o.attempts < o.max_attempts)
       AND (o.status IN ('pending', 'waiting', 'canceled') OR o.attempts >= 1)
       AND (o.status <> 'waiting' OR o.ordering_key IS NOT NULL)
       AND (o.status = 'processing') = (o.locked_by IS NOT NULL AND o.lease_expires_at IS NOT NULL)
       AND (o.status IN ('sent', 'failed', 'dead', 'canceled')) = (o.finished_at IS NOT NULL)
       AND o.channel ~ '^[a-z0-9][a-z0-9_.-]{0,62}$' AND length(o.recipient) BETWEEN 1 AND 2048
       AND jsonb_typeof(o.payload) = 'object'
       AND (o.idempotency_key IS NULL OR length(o.idempotency_key) BETWEEN 1 AND 255))

UNION ALL
SELECT 'outbox lapse receipt without its attempt', l.message_id || '/' || l.attempt FROM pgfence.outbox_lapse l
WHERE NOT EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = l.message_id AND o.attempts >= l.attempt)
UNION ALL
SELECT 'event for an item that does not exist', e.module || ' ' || e.item_id || ' ' || e.event FROM pgfence.event e
WHERE NOT CASE e.module
  WHEN 'outbox' THEN EXISTS (SELECT 1 FROM pgfence.outbox o WHERE o.id = e.item_id)
  WHEN 'plan' THEN EXISTS (SELECT 1 FROM pgfence.plan p WHERE p.id = e.item_id)
  WHEN 'operation' THEN EXISTS (SELECT 1 FROM pgfence.operation o WHERE o.id = e.item_id)
  WHEN 'document' THEN EXISTS (SELECT 1 FROM pgfence.document d WHERE d.id = e.item_id) END
UNION ALL
SELECT 'more than one enqueue / create / propose / request event', e.module || ' ' || e.item_id FROM pgfence.event e
WHERE e.event IN ('enqueue', 'create', 'propose', 'request')
GROUP BY e.module, e.item_id HAVING count(*) > 1
UNION ALL
SELECT 'plan row invariants', p.id::text FROM pgfence.plan p
WHERE NOT (p.next_step BETWEEN 1 AND p.step_count + 1
       AND (p.status = 'executed') = (p.next_step = p.step_count + 1)
       AND (p.worker IS NULL OR p.status IN ('executing', 'executed', 'failed'))
       AND (p.status <> 'executing' OR (p.heartbeat_expires_at IS NOT NULL AND p.heartbeat_interval IS NOT NULL AND p.started_at IS NOT NULL))
       AND (p.status IN ('executed', 'failed', 'rejected', 'expired')) = (p.finished_at IS NOT NULL)
       AND (p.status NOT IN ('approved', 'executing', 'executed', 'failed') OR p.approved_by IS NOT NULL)
       AND (p.status = 'failed') = (p.failure IS NOT NULL)
       AND p.step_begun IS NULL AND p.step_begun_xact IS NULL)
UNION ALL
SELECT 'plan steps do not match the step count', p.id::text FROM pgfence.plan p
WHERE (SELECT count(*) FROM pgfence.plan_step s WHERE s.plan_id = p.id) <> p.step_count
   OR EXISTS (SELECT 1 FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.step_index NOT BETWEEN 1 AND p.step_count)
UNION ALL
SELECT 'plan receipts do not match its progress', p.id::text FROM pgfence.plan p
WHERE (SELECT count(*) FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.outcome = 'ok') <> p.next_step - 1
   OR EXISTS (SELECT 1 FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.step_index < p.next_step AND s.outcome IS DISTINCT FROM 'ok')
   OR EXISTS (SELECT 1 FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.step_index > p.next_step AND s.outcome IS NOT NULL)
   OR EXISTS (SELECT 1 FROM pgfence.plan_step s WHERE s.plan_id = p.id AND s.outcome = 'error'
              AND NOT (p.status = 'failed' AND p.failure = 'step_error' AND s.step_index = p.next_step))
   OR (p.failure = 'step_error' AND NOT EXISTS (SELECT 1 FROM pgfence.plan_step s
              WHERE s.plan_id = p.id AND s.step_index = p.next_step AND s.outcome = 'error'))
UNION ALL
SELECT 'an ok receipt of the fuzz action without its database effect', s.plan_id || '/' || s.step_index
FROM pgfence.plan_step s
WHERE s.outcome = 'ok' AND s.function = 'public.fuzz_action(jsonb)'
  AND NOT EXISTS (SELECT 1 FROM public.fuzz_effect e WHERE e.id::text = s.output ->> 'effect')
UNION ALL
SELECT 'a database effect of the fuzz action without exactly one ok receipt', e.id::text FROM public.fuzz_effect e
WHERE (SELECT count(*) FROM pgfence.plan_step s
       WHERE s.outcome = 'ok' AND s.function = 'public.fuzz_action(jsonb)' AND s.output ->> 'effect' = e.id::text) <> 1
UNION ALL
SELECT 'a sql action names no function (and the seed did not drop it)', a.name FROM pgfence.plan_action a
WHERE a.kind = 'sql' AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p WHERE p.oid = a.function)
  AND a.function::oid NOT IN (SELECT d.oid FROM public.fuzz_dropped d)
UNION ALL
SELECT 'a document kind''s merge function names no function', k.kind FROM pgfence.document_kind k
WHERE k.merge_function IS NOT NULL AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_proc p WHERE p.oid = k.merge_function)
UNION ALL
SELECT 'operation row invariants', o.id::text FROM pgfence.operation o
WHERE NOT ((o.status = 'running') = (o.lease_expires_at IS NOT NULL)
       AND (o.status IN ('succeeded', 'failed', 'canceled')) = (o.finished_at IS NOT NULL)
       AND (o.status NOT IN ('running', 'succeeded') OR o.fence >= 1)
       AND (o.external_ref IS NULL OR o.issue_started_at IS NOT NULL)
       AND (o.issue_count >= 1) = (o.issue_started_at IS NOT NULL)
       AND (o.status <> 'succeeded' OR o.external_ref IS NOT NULL)
       AND (o.cancel_requested_at IS NULL) = (o.cancel_requested_by IS NULL)
       AND length(o.target) BETWEEN 1 AND 1024 AND octet_length(o.target) <= 2048)
UNION ALL
SELECT 'document revisions do not match its version', d.id::text FROM pgfence.document d
WHERE (SELECT count(*) FROM pgfence.document_revision r WHERE r.document_id = d.id) <> d.version
   OR (SELECT max(r.version) FROM pgfence.document_revision r WHERE r.document_id = d.id) <> d.version
   OR (SELECT r.op FROM pgfence.document_revision r WHERE r.document_id = d.id AND r.version = 1) IS DISTINCT FROM 'create'
   OR (SELECT r.op = 'delete' FROM pgfence.document_revision r WHERE r.document_id = d.id AND r.version = d.version)
      IS DISTINCT FROM (d.status = 'deleted')
   OR (SELECT r.content FROM pgfence.document_revision r WHERE r.document_id = d.id AND r.version = d.version)
      IS DISTINCT FROM d.content
UNION ALL
SELECT 'document content over its kind''s limit or of the wrong shape', d.id::text
FROM pgfence.document d JOIN pgfence.document_revision r ON r.document_id = d.id AND r.version = d.version AND r.op <> 'delete'
WHERE r.content IS NULL OR jsonb_typeof(r.content) = 'null'
"""


def invariant_violations(conn: psycopg.Connection[Any]) -> list[tuple[str, str]]:
    return [(r[0], r[1]) for r in conn.execute(INVARIANTS, prepare=True)]


# ---------------------------------------------------------------------------------------------
# Values
# ---------------------------------------------------------------------------------------------

BOUNDARY_LENGTHS = [0, 1, 2, 62, 63, 64, 199, 200, 201, 254, 255, 256, 999, 1000, 1001,
                    1023, 1024, 1025, 1999, 2000, 2001, 2047, 2048, 2049, 8000, 8001]
WIDE_CHARS = ["x", "é", "中", "😀"]   # 1, 2, 3 and 4 bytes in UTF-8
HOSTILE_TEXT = ["", " ", "*", "'", '"', "\\", "%s", "%", "x'; DROP TABLE pgfence.outbox; --", "NULL",
                "null", "a b", "A", "-", ".", "_", "a" * 63, "Ünïcødé", "\u202ehello", "\t\n", "😀",
                "0", "-1", "{}", "[]", "{a,b}", "on", "off", "true"]
WORDS = ["outbox", "plan", "operation", "document", "queue", "*", "pending", "processing", "sent",
         "failed", "dead", "approved", "rejected", "expired", "executing", "executed", "queued",
         "running", "succeeded", "canceled", "in_flight", "live", "deleted", "attributes", "none",
         "function", "object", "array", "any", "record", "sheet", "issue", "poll", "cancel"]
INT4_EDGES = [0, 1, -1, 2, 3, 5, 10, 100, 999, 1000, 1001, 9999, 10000, 10001, 100000, 100001,
              2**31 - 1, -(2**31)]
INT8_EDGES = [0, 1, -1, 2, 3, 10, 2**31 - 1, 2**31, 2**63 - 1, -(2**63), 2**62]
FLOAT_EDGES = ["0", "-0", "0.5", "0.999999", "0.9999999999999999", "1", "-1", "5e-324", "1e-300",
               "1e308", "NaN", "Infinity", "-Infinity", "0.25"]
INTERVAL_EDGES = ["0", "1 microsecond", "-1 microsecond", "1 second", "0.5 seconds", "5 minutes",
                  "1 hour", "1 day", "24 hours", "1 day 00:00:00.000001", "30 days", "31 days",
                  "366 days", "367 days", "1 mon", "1 year", "1000 years", "1001 years", "7000 years",
                  "300000 years", "178000000 years", "-178000000 years", "2147483647 days",
                  "-2147483648 days", "2562047788:00:54.775807", "-2562047788:00:54.775807",
                  "1 mon -29 days", "-1 mon 31 days", "71582788 mons -2147483640 days",
                  "178956970 years 7 mons 2147483647 days 2562047788:00:54.775807",
                  "-178956970 years -8 mons -2147483648 days -2562047788:00:54.775807", "-1 day", "-1 year"]
TIMESTAMP_EDGES = ["infinity", "-infinity", "epoch", "4713-01-01 00:00:00+00 BC",
                   "294276-12-31 23:59:59+00", "2000-02-29 12:00:00+14", "1999-12-31 23:59:59.999999-12"]
JSON_EDGES = ["{}", "[]", "null", "0", "-1", "1e308", "\"\"", "\"s\"", "true", "false", "{\"a\": 1}",
              "[null]", "[1, 2, 3]", "{\"\": null}", "{\"fail\": true}", "{\"malformed\": 1}",
              "{\"content\": {}, \"conflicts\": []}", "{\"recipient\": \"https://fz.example/x\", \"payload\": {}}",
              "{\"state\": \"done\"}"]


def array_literal(elements: list[str | None], lower: int = 1, rows: int = 0) -> str:
    """A PostgreSQL array literal of text elements; lower bound ``lower``; ``rows`` > 0 shapes
    the elements as a two-dimensional array of that many rows (len must divide)."""
    def q(e: str | None) -> str:
        if e is None:
            return "NULL"
        return '"' + e.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if rows:
        width = len(elements) // rows
        body = "{" + ",".join("{" + ",".join(q(e) for e in elements[r * width:(r + 1) * width]) + "}"
                              for r in range(rows)) + "}"
        return body if lower == 1 else f"[{lower}:{lower + rows - 1}][1:{width}]={body}"
    body = "{" + ",".join(q(e) for e in elements) + "}"
    if lower != 1 and elements:
        return f"[{lower}:{lower + len(elements) - 1}]={body}"
    return body


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**53), 2**53) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=20),
    lambda kids: st.lists(kids, max_size=5) | st.dictionaries(
        st.sampled_from(["a", "b", "title", "action", "args", "note", "recipient", "payload", "content",
                         "conflicts", "state", "fail", "k", ""]), kids, max_size=5),
    max_leaves=20)
plain_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=40)


@dataclass
class Pools:
    """What the database holds after the seed, by type and by column name: every distinct value
    (up to 40 per column) of every column of the seeded tables. An argument p_<name> (or the
    singular of a plural, p_channels -> channel) is often drawn from the columns called <name>:
    p_channel from outbox.channel, p_worker from plan.worker, p_steps from the seed's samples."""

    known: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    named: dict[tuple[str, str], list[str]] = field(default_factory=lambda: defaultdict(list))  # (column, type)
    columns: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # table -> (column, type)

    TYPES = ("text", "jsonb", "integer", "bigint", "interval", "timestamp with time zone", "regprocedure",
             "boolean", "double precision")

    @classmethod
    def harvest(cls, conn: psycopg.Connection[Any], tables: list[str]) -> Pools:
        pools = cls()
        for table in tables:
            cols = conn.execute("""
                SELECT a.attname, format_type(a.atttypid, NULL) FROM pg_catalog.pg_attribute a
                WHERE a.attrelid = %s::regclass AND a.attnum > 0 AND NOT a.attisdropped ORDER BY a.attnum""",
                (table,)).fetchall()
            pools.columns[table] = [(c, t) for c, t in cols]
            for col, typ in cols:
                if typ not in cls.TYPES:
                    continue
                rows = conn.execute(sql.SQL("SELECT DISTINCT {}::text FROM {} WHERE {} IS NOT NULL LIMIT 40").format(
                    sql.Identifier(col), sql.SQL(table), sql.Identifier(col))).fetchall()
                values = [r[0] for r in rows if r[0] is not None and len(r[0]) < 5000]
                pools.known[typ].extend(values)
                pools.named[(col, typ)].extend(values)
        for pool in (pools.known, pools.named):
            for key in list(pool):
                pool[key] = sorted(set(pool[key]))   # type: ignore[index]
        return pools

    def by_name(self, arg: str, typ: str) -> list[str]:
        """The values of the columns an argument is named after (p_<column>, or p_<column>s)."""
        name = arg.removeprefix("p_")
        return self.named.get((name, typ)) or self.named.get((name.removesuffix("s"), typ)) or []


class Draw:
    """The choices of one call (or of one part of it: :meth:`part`).

    Hypothesis replays and shrinks sequences of choices, and refuses a test whose kinds of
    choices change with outside state (FlakyStrategyDefinition); what the database holds changes
    with it (due times, random jitter). So the structure of a call comes from one Hypothesis-drawn
    seed (``rng``, a Python Random), and Hypothesis draws only the rich values (``rich``: text,
    JSON, floats, times). A choice among database values (a focus row, a value of a column)
    consumes ``rng`` differently with what the database holds, so every argument, array element
    and the focus gets a Random of its own (:meth:`part`), and each decides first, from nothing
    but its seed, whether it draws a rich value at all.
    """

    def __init__(self, data: st.DataObject, seed: str, mode: str = "") -> None:
        self.data = data
        self.seed = seed
        self.rng = random.Random(seed)
        # A call is plausible (arguments from the focus rows and the named columns, few NULLs,
        # nothing hostile: deep states are reached), or plausible but for one hostile argument
        # (a hostile value where everything else is right reaches the check it should meet), or
        # anything goes.
        self.mode = mode or self.rng.choice(["plausible", "plausible", "one", "one", "any"])
        self.plausible = self.mode != "any"
        self.hostile = False

    @classmethod
    def call(cls, data: st.DataObject, call_no: int) -> Draw:
        # mixed with the call's number: Hypothesis draws 0 (its simplest value) often
        return cls(data, f"{data.draw(st.integers(0, 2**32 - 1), label='call')}:{call_no}")

    def part(self, tag: object, hostile: bool = False) -> Draw:
        """The choices of one part (an argument, an element), independent of the others'."""
        d = Draw(self.data, f"{self.seed}/{tag}", self.mode)
        d.hostile = hostile
        return d

    def rich(self, strategy: st.SearchStrategy[str]) -> str:
        return self.data.draw(strategy)

    def pick(self, values: list[str]) -> str | None:
        return self.rng.choice(values) if values else None

    def below(self, n: int) -> int:
        return self.rng.randrange(n)


def hostile(d: Draw, typ: str, big: bool) -> str:
    """A value of type ``typ`` from the hostile ones (edges, random; ``big``: huge / deep JSON,
    long multi-byte text)."""
    r = d.rng
    if typ == "text":
        if big or r.random() < 0.3:
            return r.choice(WIDE_CHARS) * r.choice(BOUNDARY_LENGTHS)
        return r.choice(HOSTILE_TEXT + WORDS) if r.random() < 0.5 else d.rich(plain_text)
    if typ in ("integer", "bigint"):
        top = 2**31 - 1 if typ == "integer" else 2**63 - 1
        roll = r.random()
        if roll < 0.4:   # the extremes, where arithmetic on the value overflows
            return str(r.choice([top, -top - 1, top - 1, 0, -1]))
        return str(r.choice(INT4_EDGES if typ == "integer" else INT8_EDGES) if roll < 0.7 else r.randint(-3, 30))
    if typ == "double precision":
        return r.choice(FLOAT_EDGES) if r.random() < 0.6 else d.rich(st.floats(0, 1, exclude_max=True).map(repr))
    if typ == "boolean":
        return r.choice(["true", "false"])
    if typ == "interval":
        return r.choice(INTERVAL_EDGES) if r.random() < 0.7 else f"{r.randint(-10**6, 10**9)} milliseconds"
    if typ == "timestamp with time zone":
        if r.random() < 0.6:
            return r.choice([*TIMESTAMP_EDGES, "now"])
        return d.rich(st.datetimes(datetime(1900, 1, 1), datetime(2200, 1, 1), timezones=st.just(UTC))
                      .map(lambda t: t.isoformat()))
    if typ == "jsonb":
        if not big:
            return r.choice(JSON_EDGES) if r.random() < 0.4 else d.rich(json_values.map(json.dumps))
        # huge or deep: over the 64 kB / 1 MiB limits, or nested far
        size = r.choice([65537, 1048577, 2 * 1048576])
        return r.choice([lambda: json.dumps({"blob": "x" * size}), lambda: json.dumps(["x"] * (size // 4)),
                         lambda: "[" * 500 + "]" * 500, lambda: json.dumps({f"k{i}": i for i in range(5000)})])()
    if typ == "regprocedure":
        return "-"
    raise AssertionError(f"the fuzzer has no values for type {typ}: add them to tests/fuzzing.py")


def scalar(d: Draw, typ: str, pools: Pools, focus: list[str], named: list[str],
           prefer: str | None = None) -> str | None:
    """One value of type ``typ`` as a literal (None = SQL NULL): the focus row's column named like
    the argument (``prefer``), the focus row's other values of that type (``focus``), the columns
    the argument is named after (``named``), anything the database holds, or hostile (only that
    when ``d.hostile``). Numbers from the database are often moved by one."""
    roll = d.below(100)
    if d.hostile:
        return None if roll < 5 else hostile(d, typ, big=roll >= 92)
    if not d.plausible and roll >= 75:
        return hostile(d, typ, big=roll >= 97)
    known = pools.known.get(typ, [])
    if roll < (2 if d.plausible else 6):
        return None
    if roll < 45 and prefer is not None:
        value = prefer
    elif roll < 62:
        value = d.pick(focus) or d.pick(named) or d.pick(known)
    else:
        value = d.pick(named) or d.pick(known) if d.plausible or roll < 68 else d.pick(known)
    if typ in ("integer", "bigint"):
        return str(int(value or 0) + d.rng.choice([0, 0, 0, -1, 1]))
    return value


def array(d: Draw, typ: str, pools: Pools, aligned: list[list[str]], named: list[str]) -> str | None:
    """An array literal of element type ``typ``: in step with the call's focus rows (``aligned``:
    that type's values of each row), or drawn element by element; with NULL elements, another
    lower bound, or two dimensions (hostile, or anything goes)."""
    shape = d.below(100)
    if d.hostile:
        shape = 55 + shape * 45 // 100 if shape >= 5 else 0   # NULL, or elements drawn one by one
    elif d.plausible:
        shape = 6 + shape * 49 // 100 if shape >= 2 else 0   # NULL 2%, in step with the focus rows
    if shape < 6:
        return None
    null_at = d.below(10) == 0 and not d.plausible
    form = d.below(4) if d.hostile else d.below(20) if not d.plausible else 19
    lower = d.rng.choice([0, 2, -5, 100])
    elements: list[str | None]
    if shape < 55:
        elements = [d.part(("aligned", j)).pick(vals) for j, vals in enumerate(aligned)]
    elif shape < 97:
        count = d.rng.choice([0, 1, 1, 2, 3, 5])
        elements = [scalar(d.part(j, d.hostile), typ, pools, [], named) for j in range(count)]
    else:
        elements = [d.part("long").pick(pools.known.get(typ, [])) or "1"] * d.rng.choice([1000, 10001])
    if null_at and elements:
        elements[len(elements) // 2] = None
    if form == 0:
        return array_literal(elements, lower=lower)
    if form == 1 and elements:
        return array_literal(elements, rows=1)
    if form == 2 and elements and len(elements) % 2 == 0:
        return array_literal(elements, rows=2, lower=lower if lower in (0, 2) else 1)
    return array_literal(elements)


# ---------------------------------------------------------------------------------------------
# The fuzzer
# ---------------------------------------------------------------------------------------------

@dataclass
class Stats:
    calls: Counter[str] = field(default_factory=Counter)
    ok: Counter[str] = field(default_factory=Counter)
    errors: dict[str, Counter[str]] = field(default_factory=lambda: defaultdict(Counter))
    examples: int = 0
    seconds: float = 0.0
    findings: dict[str, str] = field(default_factory=dict)   # kind of finding -> first message

    def report(self) -> str:
        total = sum(self.calls.values())
        ok = sum(self.ok.values())
        lines = [f"fuzz: {total} calls of {len(self.calls)} routines in {self.examples} examples, "
                 f"{self.seconds:.0f} s: {ok} succeeded, {total - ok} raised a documented SQLSTATE"]
        for name in sorted(self.calls):
            errs = ", ".join(f"{c} x{n}" for c, n in self.errors[name].most_common())
            lines.append(f"  {name}: {self.calls[name]} calls, {self.ok[name]} ok" + (f"; {errs}" if errs else ""))
        if self.findings:
            lines.append(f"{len(self.findings)} kinds of findings:")
            lines.extend(f"  {message}" for message in self.findings.values())
        return "\n".join(lines)


class Finding(AssertionError):
    """A call broke the contract; ``kind`` says how (an undocumented SQLSTATE, an invariant, ...)."""

    def __init__(self, message: str, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Fuzzer:
    """Draws and runs calls against one seeded database (see the module docstring)."""

    def __init__(self, conn: psycopg.Connection[Any], stats: Stats) -> None:
        self.conn = conn
        # results stay text: Python has no timedelta of 90 million years nor an infinite datetime
        for name in ("interval", "timestamptz", "timestamp", "date", "numeric", "float8"):
            conn.adapters.register_loader(name, TextLoader)
        self.stats = stats
        self.routines = routines(conn)
        self.by_signature = {r.signature: r for r in self.routines}
        self.tables = item_tables(conn)
        self.after_sql = after_call_sql(self.tables)
        self.pools = Pools.harvest(conn, self.tables)
        self.replays: dict[str, list[tuple[str | None, ...]]] = defaultdict(list)
        self.item_tables = {t.split(".")[1]: t for t in self.tables
                            if t.startswith("pgfence.") and ("id", "bigint") in self.pools.columns.get(t, [])}
        broken = invariant_violations(conn)
        if broken:
            raise AssertionError(f"the seed breaks invariants: {broken}")
        self.snapshot = Snapshot.take(conn, self.tables)
        self.row_cache: dict[str, list[dict[str, Any]]] = {}
        self.current: str | None = None   # the tables' fingerprint now, when known
        self.call_no = 0

    def reset(self) -> None:
        """Back to the seeded state (:class:`Snapshot`), before every example."""
        self.snapshot.restore(self.conn)
        self.replays.clear()
        self.row_cache.clear()
        self.current = None
        self.call_no = 0

    def after_call(self) -> tuple[str | None, str | None, str]:
        """(pgfence.actor, pgfence.purging, the tables' fingerprint) as they are now."""
        row = self.conn.execute(self.after_sql, prepare=True).fetchone()
        assert row is not None
        return row[0], row[1], str(row[2])

    def _rows(self, table: str) -> list[dict[str, Any]]:
        """The rows of ``table`` (cached until the next successful call: a failed one changes nothing)."""
        if table not in self.row_cache:
            self.row_cache[table] = [r[0] for r in self.conn.execute(
                sql.SQL("SELECT to_jsonb(t) FROM {} t ORDER BY t.id").format(sql.SQL(table)))]
        return self.row_cache[table]

    def _values_of(self, table: str, row: dict[str, Any], typ: str) -> list[str]:
        """The values in ``row`` (of ``table``) of the columns of type ``typ``, as literals."""
        out = []
        for col, ctyp in self.pools.columns[table]:
            v = row.get(col)
            if v is None:
                continue
            if ctyp == typ or (typ == "integer" and ctyp == "bigint" and isinstance(v, int) and abs(v) < 2**31) \
                    or (typ == "bigint" and ctyp == "integer"):
                out.append(json.dumps(v) if ctyp == "jsonb" else str(v))
        return out

    def _named_in(self, table: str, row: dict[str, Any], arg: Arg) -> str | None:
        """The value in ``row`` of its column named like the argument (p_channel -> channel,
        p_token -> run_token), if that column has the argument's type."""
        name = arg.name.removeprefix("p_")
        for col, ctyp in self.pools.columns[table]:
            named = col in (name, name.removesuffix("s")) or col.endswith("_" + name)
            if named and ctyp == arg.type and row.get(col) is not None:
                v = row[col]
                return json.dumps(v) if ctyp == "jsonb" else str(v)
        return None

    def draw_call(self, data: st.DataObject) -> tuple[Routine, tuple[str | None, ...]]:
        """A routine and its arguments (literals; None = NULL): fresh, or a replay of an earlier
        successful call of it, as is or with one argument replaced by a fresh one. Arguments are
        drawn by type, often from 1-4 *focus* rows of the routine's module (the table named by
        the first word of its name; a routine of no module gets a table drawn): the first
        required bigint argument is the first focus row's id, another argument the focus row's
        column named like it (p_channel -> channel) or one of its values of the argument's type
        (+-1 for numbers), arrays the values of all focus rows in step."""
        d = Draw.call(data, self.call_no)
        self.call_no += 1
        routine = self.routines[d.below(len(self.routines))]
        replay = d.below(10)
        table = self.item_tables.get(routine.module) or d.rng.choice(sorted(self.item_tables.values()))
        k = d.rng.randint(1, 4)
        n = len(routine.args)
        if d.below(5) == 0:
            n = d.rng.randint(sum(1 for a in routine.args if not a.has_default), n)
        odd_one = d.below(max(n, 1))
        as_id = d.below(10) < 6
        # what the database holds: choices that depend on it, on Randoms of their own
        rows = self._rows(table)
        pf = d.part("focus")
        focus = [pf.rng.choice(rows) if rows else {} for _ in range(k)]
        # the focus row's id goes to the first required bigint argument (else the first bigint)
        first_bigint = next((j for j, a in enumerate(routine.args) if a.type == "bigint" and not a.has_default),
                            next((j for j, a in enumerate(routine.args) if a.type == "bigint"), None))
        args: list[str | None] = []
        for i in range(n):
            arg = routine.args[i]
            base = arg.type.removesuffix("[]")
            named = self.pools.by_name(arg.name, base)
            da = d.part(i, hostile=d.mode == "one" and i == odd_one)
            default_null = arg.has_default and da.below(10) < 2   # the default's NULL means something
            if arg.type.startswith("pgfence.") or (default_null and not da.hostile):
                args.append(None)
            elif i == first_bigint and as_id and not da.hostile and "id" in focus[0]:
                args.append(str(focus[0]["id"]))
            elif arg.type.endswith("[]"):
                args.append(array(da, base, self.pools, [self._values_of(table, r, base) for r in focus], named))
            else:
                args.append(scalar(da, arg.type, self.pools, self._values_of(table, focus[0], arg.type), named,
                                   self._named_in(table, focus[0], arg)))
        done = self.replays.get(routine.signature)
        if replay < 2 and done:
            pr = d.part("replay")
            old = list(pr.rng.choice(done))
            if replay == 1 and old:
                j = pr.below(len(old))
                old[j] = args[j] if j < len(args) else old[j]
            return routine, tuple(old)
        return routine, tuple(args)

    def _execute(self, stmt: sql.Composed, args: tuple[str | None, ...]) -> list[tuple[str, str]]:
        """Run the call; return its interval and timestamp results (type, text) to read back."""
        cur = self.conn.execute(stmt, args)
        if cur.description is None:
            return []
        rows = cur.fetchall()
        cols = [(i, READ_BACK[c.type_code]) for i, c in enumerate(cur.description) if c.type_code in READ_BACK]
        return [(typ, row[i]) for row in rows[:20] for i, typ in cols if row[i] is not None]

    def run(self, routine: Routine, args: tuple[str | None, ...], in_block: bool, collect: bool = False) -> None:
        """Run one call and check the contract after it: raises :class:`Finding`, or with
        ``collect`` records the first finding of each kind in the stats and goes back to the
        seeded state (the next calls would only see the same broken state again)."""
        try:
            self._run(routine, args, in_block)
        except Finding as finding:
            if not collect:
                raise
            self.stats.findings.setdefault(f"{routine.name}: {finding.kind}", str(finding))
            self.reset()

    def _run(self, routine: Routine, args: tuple[str | None, ...], in_block: bool) -> None:
        before = self.current or self.after_call()[2]
        self.current = None
        self.stats.calls[routine.name] += 1
        stmt = routine.statement(len(args))
        error: psycopg.Error | None = None
        results: list[tuple[str, str]] = []
        try:
            if in_block:
                with self.conn.transaction():
                    results = self._execute(stmt, args)
            else:
                results = self._execute(stmt, args)
        except psycopg.Error as e:
            error = e
        call = f"{routine.signature} with {shorten(args)}" + (" in a transaction block" if in_block else "")
        if self.conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
            raise Finding(f"{call}: the session was left in transaction status {self.conn.info.transaction_status.name}",
                          "transaction left open")
        actor, purging, after = self.after_call()
        if (actor or "") != "" or (purging or "") == "on":
            raise Finding(f"{call}: a setting leaked into the session: pgfence.actor={actor!r}, pgfence.purging={purging!r}",
                          "setting leaked")
        if error is not None:
            code = error.sqlstate or "(client)"
            if error.sqlstate is None or "portal parameter" in (error.diag.context or ""):
                raise AssertionError(f"the fuzzer drew a literal its type does not accept: {call}: {error}")
            self.stats.errors[routine.name][code] += 1
            if routine.codes is None or code not in routine.codes:
                raise Finding(f"{call}: raised {code} ({error.diag.message_primary}), which its COMMENT does not "
                              f"list (Errors: {sorted(routine.codes or [])}); context: {error.diag.context}",
                              f"undocumented {code}")
            if after != before:
                raise Finding(f"{call}: failed with {code} but changed the tables "
                              f"({diff_fingerprints(self.tables, before, after)})", "a failed call changed tables")
            self.current = after
            return
        self.stats.ok[routine.name] += 1
        self.row_cache.clear()
        self.current = after
        for typ, text in results:
            # a result must be a value of its type: an overflowed interval prints as a negative
            # one that PostgreSQL cannot read back
            try:
                self.conn.execute(sql.SQL("SELECT %s::{}").format(sql.SQL(typ)), (text,))
            except psycopg.Error as e:
                raise Finding(f"{call}: returned the {typ} {text!r}, which PostgreSQL cannot read back ({e.sqlstate})",
                              "returned a value that does not read back") from None
        broken = invariant_violations(self.conn)
        if broken:
            raise Finding(f"{call}: succeeded and broke invariants: {broken[:5]}",
                          "broke " + ", ".join(sorted({b[0] for b in broken})))
        done = self.replays[routine.signature]
        if args not in done and len(done) < 20:
            done.append(args)


# Result types whose text form is read back after a call (OID -> type).
READ_BACK = {1186: "interval", 1184: "timestamp with time zone"}


def shorten(args: tuple[str | None, ...]) -> str:
    return "(" + ", ".join("NULL" if a is None else repr(a if len(a) <= 80 else a[:60] + f"...<{len(a)} chars>")
                           for a in args) + ")"


def diff_fingerprints(tables: list[str], before: str, after: str) -> str:
    return ", ".join(t for t, b, a in zip(tables, before.split("|"), after.split("|"), strict=True) if a != b)


def budget_clock(seconds: float) -> Callable[[], bool]:
    """A function that says whether ``seconds`` have passed since this call."""
    deadline = time.monotonic() + seconds
    return lambda: time.monotonic() > deadline
