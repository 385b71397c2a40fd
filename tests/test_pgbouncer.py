"""pgfence behind a real PgBouncer in ``pool_mode = transaction`` (Debian's package).

Transaction pooling hands each transaction to any server session: psycopg's server-side
prepared statements (after 5 runs of a statement) then land in other clients' sessions, and a
LISTEN is registered on a session the listener does not keep. The documented way through:

- clients connect with ``prepare_threshold=None`` (the executor: ``--no-prepare``): the whole
  SQL API works through the pooler — an enqueue inside a business transaction, claims, marks,
  document saves, plans;
- the executor's listener gets a direct (or session-mode) connection, ``--listen-dsn``;
- without one, the executor's start-up self-check says that a NOTIFY did not come back, and
  delivery still happens through the sweep.
"""

from __future__ import annotations

import datetime as dt
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest

from bouncer import PgBouncer
from handlers import read_records
from pgfence import outbox, plan
from support import Proc, wait_for


@pytest.fixture()
def bouncer(admin_dsn: str) -> Iterator[PgBouncer]:
    pgb = PgBouncer(admin_dsn, pool_mode="transaction", pool_size=2).start()
    try:
        yield pgb
    finally:
        pgb.stop()


def _dbname(dsn: str) -> str:
    return str(psycopg.conninfo.conninfo_to_dict(dsn)["dbname"])


def _pooled(bouncer: PgBouncer, db: str, *, autocommit: bool = True) -> psycopg.Connection[Any]:
    return psycopg.connect(bouncer.dsn(_dbname(db)), autocommit=autocommit, prepare_threshold=None)


@pytest.mark.timeout(60)
def test_the_sql_api_works_through_transaction_pooling(db: str, conn: psycopg.Connection[Any],
                                                       bouncer: PgBouncer) -> None:
    conn.execute("CREATE TABLE public.orders (id int PRIMARY KEY, total numeric NOT NULL)")
    conn.execute("CREATE FUNCTION public.bump(p jsonb) RETURNS jsonb LANGUAGE sql AS"
                 " $$ UPDATE public.orders SET total = total + 1 WHERE id = (p ->> 'id')::int"
                 " RETURNING jsonb_build_object('id', id, 'total', total) $$")
    plan.register_action(conn, "orders.bump", "public.bump(jsonb)", "add 1 to an order's total")
    # three clients share two server sessions, and each runs every statement more than 5 times
    # (psycopg would prepare it by then), interleaved
    clients = [_pooled(bouncer, db, autocommit=False) for _ in range(3)]
    try:
        doc = {}
        for c in clients:
            c.autocommit = True
            doc[id(c)] = c.execute("SELECT pgfence.document_create('record', '{\"n\": 0}', 'ann')"
                                   ).fetchone()[0]  # type: ignore[index]
        for i in range(8):
            for n, c in enumerate(clients):
                order = 100 * n + i
                c.autocommit = False
                with c.transaction():  # the transactional outbox: both or neither
                    c.execute("INSERT INTO public.orders VALUES (%s, 10)", (order,))
                    outbox.enqueue(c, "orders", "https://shop.example/hook", {"order": order},
                                   idempotency_key=f"order-{order}")
                c.autocommit = True
                [claimed] = outbox.claim(c, f"w{n}", 1, ["orders"])
                assert outbox.mark_sent(c, claimed.id, claimed.attempt, {"http": 200})
                version = i + 1
                saved = c.execute("SELECT outcome, version FROM pgfence.document_save(%s, %s, %s, 'ann')",
                                  (doc[id(c)], version, json.dumps({"n": i + 1}))).fetchone()
                assert saved == ("saved", version + 1)
                pid = plan.propose(c, [{"action": "orders.bump", "args": {"id": order}}], "agent")
                assert plan.approve(c, pid, "ops") == "approved"
                assert plan.execute(c, pid, f"runner-{n}").status == "executed"
    finally:
        for c in clients:
            c.close()
    assert conn.execute("SELECT count(*), sum(total) FROM public.orders").fetchone() == (24, 24 * 11)
    assert conn.execute("SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'").fetchone() == (24,)
    assert conn.execute("SELECT count(*) FROM pgfence.plan WHERE status = 'executed'").fetchone() == (24,)
    assert conn.execute("SELECT array_agg(DISTINCT version) FROM pgfence.document").fetchone() == ([9],)


def _executor(bouncer: PgBouncer, db: str, tmp_path: Path, *extra: str) -> Proc:
    return Proc(bouncer.dsn(_dbname(db)),
                ["--route", "orders=python:handlers:record", "--plans", "start", "--no-prepare",
                 "--probe-interval", "1", "--probe-timeout", "1", "--reap-interval", "1", *extra],
                tmp_path / "exec.log", env={"PGFENCE_TEST_RECORD": str(tmp_path / "record.txt")})


@pytest.mark.timeout(90)
def test_the_executor_works_through_transaction_pooling_with_a_direct_listener(
        db: str, conn: psycopg.Connection[Any], bouncer: PgBouncer, tmp_path: Path) -> None:
    conn.execute("CREATE FUNCTION public.noop(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$")
    plan.register_action(conn, "noop", "public.noop(jsonb)", "returns its args")
    outbox.configure_channel(conn, "orders", lease=dt.timedelta(seconds=60))
    # the sweep runs once a minute: deliveries within the test come from NOTIFY wake-ups
    proc = _executor(bouncer, db, tmp_path, "--poll-interval", "60", "--listen-dsn", db)
    try:
        wait_for(lambda: "start-up self-check: NOTIFY round trip" in proc.output(), 20,
                 "the start-up self-check to pass")
        with _pooled(bouncer, db) as client:
            ids: list[int] = []
            for burst in range(3):
                with client.transaction():
                    ids += outbox.enqueue_many(client, "orders", ["r"] * 10,
                                               [{"burst": burst, "i": i} for i in range(10)])
                pid = plan.propose(client, [{"action": "noop", "args": {"b": burst}}] * 7, "agent")
                assert plan.approve(client, pid, "ops") == "approved"
        wait_for(lambda: conn.execute("SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'"
                                      ).fetchone() == (30,), 20, "30 messages sent (NOTIFY)")
        wait_for(lambda: conn.execute("SELECT count(*) FROM pgfence.plan WHERE status = 'executed'"
                                      ).fetchone() == (3,), 20, "3 plans of 7 SQL steps executed")
    finally:
        assert proc.terminate() == 0, proc.output()
    log = proc.output()
    assert sorted(mid for _, mid, _ in read_records(str(tmp_path / "record.txt"))) == sorted(ids), \
        "each message delivered exactly once"
    assert conn.execute("SELECT max(attempts) FROM pgfence.outbox").fetchone() == (1,)
    assert conn.execute("SELECT count(*) FROM pgfence.outbox_lapse").fetchone() == (0,)
    for bad in ("does not exist", "already exists", "protocol", "did not reach", "Traceback"):
        assert bad not in log, log


@pytest.mark.timeout(60)
def test_listen_through_transaction_pooling_is_reported_and_the_sweep_still_delivers(
        db: str, conn: psycopg.Connection[Any], bouncer: PgBouncer, tmp_path: Path) -> None:
    proc = _executor(bouncer, db, tmp_path, "--poll-interval", "0.5")
    try:
        wait_for(lambda: "start-up self-check: a NOTIFY sent on the executor's connection did "
                         "not reach its listener" in proc.output(), 20, "the self-check's warning")
        with _pooled(bouncer, db) as client:
            mid = outbox.enqueue(client, "orders", "r", {"n": 1})
        wait_for(lambda: outbox.get(conn, mid)["status"] == "sent", 20, "the sweep to deliver")
    finally:
        assert proc.terminate() == 0, proc.output()
    assert "--listen-dsn" in proc.output()
