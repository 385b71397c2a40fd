"""Every public pgfence routine survives any input: a property-based fuzzer (``tests/fuzzing.py``)
and the check that every routine's COMMENT lists the SQLSTATEs it raises.

The fuzzer enumerates the routines from the catalog, so a new function is fuzzed without anyone
remembering to. Each Hypothesis example resets the database to the seed (``tests/fuzz_seed.sql``:
real rows in every state of every module), then makes a sequence of calls; after every call it
checks that the call succeeded or raised a SQLSTATE that the routine's COMMENT documents, that a
failed call changed no table (a fingerprint of every table), that after a success every table
invariant holds, and that no setting leaked into the session. The call counts are printed.

Settings (environment): ``PGFENCE_FUZZ_SECONDS`` the budget (60 in ``make test``; ``make fuzz``
runs 900 with ``PGFENCE_FUZZ_LONG=1``: random Hypothesis seeds, a finding shrunk),
``PGFENCE_FUZZ_CALLS`` calls per example (40), ``PGFENCE_FUZZ_CHUNK`` examples per Hypothesis
run (8), ``PGFENCE_FUZZ_COLLECT=1`` to record the first finding of each kind and go on (the test
still fails at the end, listing them all) instead of stopping at the first.
"""

from __future__ import annotations

import os
import random
import time

import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import seed as hypothesis_seed
from hypothesis import strategies as st
from psycopg import sql

from fuzzing import (
    Fuzzer,
    Snapshot,
    Stats,
    budget_clock,
    documented_codes,
    errors_md_codes,
    item_tables,
    routines,
    seed,
)

SECONDS = float(os.environ.get("PGFENCE_FUZZ_SECONDS", "60"))
CALLS = int(os.environ.get("PGFENCE_FUZZ_CALLS", "40"))
CHUNK = int(os.environ.get("PGFENCE_FUZZ_CHUNK", "8"))  # examples per Hypothesis run
LONG = os.environ.get("PGFENCE_FUZZ_LONG") == "1"   # make fuzz: random seeds, shrink a finding
# record the first finding of each kind and go on, instead of stopping at the first one
COLLECT = os.environ.get("PGFENCE_FUZZ_COLLECT") == "1"


def test_documented_codes_follow_the_errors_convention() -> None:
    assert documented_codes("Does things. Errors: 22004 (id NULL), 22023 (batch outside 1..10000), P0002.") == \
        {"22004", "22023", "P0002"}
    assert documented_codes("Errors: 22004/22023 (worker), PF104 (lease not in (0, 1 day]), 40001.") == \
        {"22004", "22023", "PF104", "40001"}
    assert documented_codes("Raises PF101 in a receipt. Errors: none.") == set()
    assert documented_codes("No section here: 22004") is None
    assert {"22004", "22023", "P0002", "PF001", "PF304", "42883", "2D000"} <= errors_md_codes()


def test_every_public_routine_lists_its_errors(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """Every public routine's COMMENT has an Errors: section, and every code in it is explained
    in functions/ERRORS.md."""
    rs = routines(conn)
    assert len(rs) > 50
    assert [r.signature for r in rs if r.codes is None] == []
    known = errors_md_codes()
    assert {r.signature: sorted(r.codes - known) for r in rs if r.codes and r.codes - known} == {}


def test_snapshot_puts_the_seed_back(conn: psycopg.Connection[tuple[object, ...]]) -> None:
    """The reset between examples restores every row, with replication's trigger switch (a
    superuser) and with each table's own triggers disabled (an owner that is not one)."""
    seed(conn)
    tables = item_tables(conn)
    content = sql.SQL("SELECT concat_ws('|', {})").format(sql.SQL(", ").join(
        sql.SQL("(SELECT count(*) || ':' || coalesce(sum(hashtext(t::text)::bigint), 0) FROM {} t)").format(sql.SQL(t))
        for t in tables))
    seeded = conn.execute(content).fetchone()
    next_id = conn.execute("SELECT max(id) + 1 FROM pgfence.outbox").fetchone()
    snapshot = Snapshot.take(conn, tables)
    for superuser in (True, False):
        conn.execute("SELECT pgfence.outbox_enqueue('fz-log', 'r', '{}')")
        conn.execute("SELECT pgfence.document_delete(1, 1, 'fz-user')")
        assert conn.execute(content).fetchone() != seeded
        snapshot.superuser = superuser
        snapshot.restore(conn)
        assert conn.execute(content).fetchone() == seeded
        assert conn.execute("SELECT pgfence.outbox_enqueue('fz-x', 'r', '{}')").fetchone() == next_id, \
            "the identity sequences are back too"
        snapshot.restore(conn)
    assert conn.execute("""SELECT count(*) FROM pg_catalog.pg_trigger t JOIN pg_catalog.pg_class c ON c.oid = t.tgrelid
                           WHERE c.relnamespace = 'pgfence'::regnamespace AND t.tgenabled <> 'O'""").fetchone() == (0,), \
        "every trigger is enabled again"


@pytest.mark.slow
@pytest.mark.timeout(int(SECONDS * 3) + 300)
def test_fuzz_every_public_routine(db: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Hypothesis runs of CHUNK examples each (seeds 0, 1, 2, ...; random ones with
    PGFENCE_FUZZ_LONG=1) until the budget is spent: a run is never cut short, since Hypothesis
    replays examples and refuses one that draws differently the second time."""
    stats = Stats()
    first_seed = random.randrange(2**32) if LONG else 0
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SET statement_timeout = '60s'")
        conn.execute("SET client_min_messages = warning")
        seed(conn)
        fuzzer = Fuzzer(conn, stats)
        over = budget_clock(SECONDS)

        def calls(data: st.DataObject) -> None:
            fuzzer.reset()
            stats.examples += 1
            for _ in range(CALLS):
                routine, args = fuzzer.draw_call(data)
                in_block = data.draw(st.integers(0, 24), label="in a transaction block") == 0
                fuzzer.run(routine, args, in_block, COLLECT)

        start = time.monotonic()
        try:
            run = 0
            while not over():
                settings(max_examples=CHUNK, deadline=None, database=None,
                         suppress_health_check=list(HealthCheck),
                         phases=[Phase.generate, Phase.shrink] if LONG else [Phase.generate])(
                    hypothesis_seed(first_seed + run)(given(st.data())(calls)))()
                run += 1
        finally:
            stats.seconds = time.monotonic() - start
            with capsys.disabled():
                print(f"\n(Hypothesis seeds {first_seed}..{first_seed + run}) " + stats.report())
    assert not stats.findings, stats.report()
    if SECONDS >= 30:
        assert set(stats.calls) == {r.name for r in fuzzer.routines}, "every public routine was called"
