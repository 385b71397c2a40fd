"""The approval check's row version (migration 0034) across 2^32 transactions.

A step records its function's pg_proc row version as (oid, xmin), and xmin is 32 bits. A
replacement of the function (CREATE OR REPLACE keeps the oid) whose transaction gets the recorded
xid again, one xid epoch later, must still be refused (PF108). Anyone who may replace the function
can aim at that xid: burn xids (each ``SELECT pg_current_xact_id()`` in autocommit takes one) and
replace it in the transaction that gets it; approved plans do not expire. The epoch is advanced
here with ``pg_resetwal`` on a cluster of this test's own, after freezing, as 2^32 transactions
would.
"""

from __future__ import annotations

from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgfence import plan
from pgfence.embedded import ClusterInfo, EmbeddedPostgres
from pgfence.migrate import migrate


def _pg(info: ClusterInfo, *argv: str) -> None:
    EmbeddedPostgres()._run([str(Path(info.bindir) / argv[0]), *argv[1:]], argv[0])


@pytest.mark.timeout(120)
def test_a_replacement_on_the_recorded_xmin_one_epoch_later_is_refused(own_cluster: ClusterInfo) -> None:
    dsn = own_cluster.url
    migrate(dsn)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION public.f(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT '{\"v\": 1}'::jsonb $$")
        assert plan.register_action(conn, "f", "public.f(jsonb)", "approved one") is True
        pid = plan.propose(conn, [{"action": "f"}], "agent")
        assert plan.approve(conn, pid, "alice") == "approved"
        row = conn.execute("SELECT function_xmin::text::bigint FROM pgfence.plan_step WHERE plan_id = %s",
                           (pid,)).fetchone()
        assert row is not None and row[0] is not None
        xmin = int(row[0])
        conn.execute("VACUUM (FREEZE)")
    template1 = make_conninfo(**{**conninfo_to_dict(dsn), "dbname": "template1"})
    with psycopg.connect(template1, autocommit=True) as conn:
        conn.execute("VACUUM (FREEZE)")
    datadir = own_cluster.datadir
    _pg(own_cluster, "pg_ctl", "-D", datadir, "-m", "fast", "-w", "stop")
    _pg(own_cluster, "pg_resetwal", "-e", "1", "-x", str(xmin - 3), datadir)  # the next epoch
    _pg(own_cluster, "pg_ctl", "-D", datadir, "-l", str(Path(own_cluster.root) / "server.log"), "-w", "start")
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(10):  # up to the xid just before the recorded one
            burnt = conn.execute("SELECT pg_current_xact_id()::text::bigint").fetchone()
            assert burnt is not None
            if (int(burnt[0]) + 1) % 2**32 == xmin:
                break
        conn.execute("CREATE OR REPLACE FUNCTION public.f(p jsonb) RETURNS jsonb LANGUAGE sql"
                     " AS $$ SELECT '{\"v\": \"replaced\"}'::jsonb $$")
        assert conn.execute("SELECT xmin::text::bigint FROM pg_proc WHERE oid = 'public.f(jsonb)'::regprocedure"
                            ).fetchone() == (xmin,), "the replacement's row has the recorded oid and xmin"
        token = plan.start(conn, pid, "runner")
        step = conn.execute("SELECT outcome, error ->> 'sqlstate', output FROM pgfence.plan_run_step(%s, 'runner', %s)",
                            (pid, token)).fetchone()
    assert step == ("error", "PF108", None)
