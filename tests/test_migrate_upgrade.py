"""Upgrade path: a database at schema 6 holding messages in every state is migrated to the
current schema (0007 rebuilds ``outbox_due_idx`` with ``attempts < max_attempts``); nothing
pending is lost to the new predicate, and a second ``migrate`` is a no-op. The same for queued
operations at schema 8 (0009 adds the per-kind queue index and rebuilds
``operation_queued_idx`` with ``lease_expires_at IS NULL``)."""

from __future__ import annotations

import datetime as dt
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.types.json import Jsonb
from yoyo import get_backend, read_migrations

from pgfence import SCHEMA_VERSION, operation, outbox, plan
from pgfence.errors import InvalidArgument
from pgfence.migrate import migrate, preflight, yoyo_uri
from pgfence.paths import functions_dir, migrations_dir
from test_migrate import fingerprint


def after(last: str) -> list[str]:
    """Ids of the migrations after ``last``, in order: what an upgrade from there applies."""
    return sorted(p.stem for p in migrations_dir().glob("*.sql") if p.stem > last)

INDEXES = """
SELECT string_agg(indexdef, E'\\n' ORDER BY indexname) FROM pg_indexes WHERE schemaname = 'pgfence'
"""


#: Functions files whose DDL names what migration 0017 creates (outbox.ordering_key in trigger
#: conditions, table outbox_key): on an older schema they cannot be applied, so the outbox rows of
#: those schemas are written with plain SQL, as an older pgfence's functions left them.
NEEDS_0017 = ("10", "11", "12", "13", "14", "15", "16", "19", "99")


def _migrate_to(dsn: str, last: str) -> None:
    """Apply the migrations up to and including ``last`` (as an older pgfence would have), and
    today's functions on those tables, as far as these tests need them: the audit views read
    columns of later migrations (plan.run_token, 0010), and so does the view document_kinds
    (document_kind.log_saves, 0014), so they wait for ``migrate()``; so do the outbox files and
    the owner file before 0017 (:data:`NEEDS_0017`)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        preflight(conn)  # the roles today's functions/ need
        conn.execute("CREATE SCHEMA IF NOT EXISTS pgfence")
        backend = get_backend(yoyo_uri(dsn), migration_table="_yoyo_migration")
        try:
            every = read_migrations(str(migrations_dir()))
            wanted = every.filter(lambda m: m.id <= last)
            with backend.lock():
                backend.apply_migrations(backend.to_apply(wanted))
        finally:
            backend.connection.close()
        with conn.transaction():
            for path in sorted(functions_dir().glob("*.sql")):
                # the audit files (90_audit_*.sql, and 98_hot_paths.sql), the kinds' view
                if "90" <= path.name[:2] <= "98" or path.name == "41_document_kinds.sql":
                    continue
                if last < "0017" and path.name[:2] in NEEDS_0017:
                    continue
                conn.execute(path.read_text(encoding="utf-8").encode())


def _old_message(conn: psycopg.Connection[Any], channel: str, **state: Any) -> int:
    """Insert one outbox message as an older pgfence left it (no triggers before migrate());
    ``state`` sets columns beyond channel, recipient, payload and max_attempts (default 10)."""
    cols = {"channel": channel, "recipient": "r", "payload": Jsonb({}), "max_attempts": 10, **state}
    query = sql.SQL("INSERT INTO pgfence.outbox ({}) VALUES ({}) RETURNING id").format(
        sql.SQL(", ").join(map(sql.Identifier, cols)), sql.SQL(", ").join(sql.Placeholder() * len(cols)))
    row = conn.execute(query, list(cols.values())).fetchone()
    assert row is not None
    return int(row[0])


def test_schema_6_with_messages_upgrades_and_every_pending_message_stays_claimable(
        empty_db: str, db: str) -> None:
    _migrate_to(empty_db, "0006_audit")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT pgfence.schema_version()").fetchone() == (6,)
        due = [_old_message(conn, "up-a") for _ in range(3)]
        due += [_old_message(conn, "up-b", max_attempts=2) for _ in range(2)]
        _old_message(conn, "up-a", next_attempt_at=dt.datetime.now(dt.UTC) + dt.timedelta(hours=1))
        # one in flight, one sent, one dead (retried once, then no attempts left)
        held, done, dead = due[3], due[0], due[4]
        conn.execute("UPDATE pgfence.outbox SET status = 'processing', attempts = 1, locked_by = 'old-w',"
                     " claimed_at = now(), lease_expires_at = now() + interval '5 minutes' WHERE id = %s",
                     (held,))
        conn.execute("UPDATE pgfence.outbox SET status = 'sent', attempts = 1, finished_at = now()"
                     " WHERE id = %s", (done,))
        conn.execute("UPDATE pgfence.outbox SET status = 'dead', attempts = 2, finished_at = now(),"
                     " last_error = 'HTTP 503' WHERE id = %s", (dead,))

    result = migrate(empty_db)
    assert result.applied == after("0006_audit")
    assert result.schema_version == SCHEMA_VERSION

    with psycopg.connect(empty_db, autocommit=True) as conn:
        pending = {r[0] for r in conn.execute(
            "SELECT id FROM pgfence.outbox WHERE status = 'pending' AND next_attempt_at <= now()")}
        assert pending == set(due) - {held, done, dead}
        assert conn.execute("SELECT pgfence.outbox_next_due()").fetchone() == (dt.timedelta(0),)
        claimed = outbox.claim(conn, "new-w", batch=100)  # all channels: outbox_due_idx
        assert {m.id for m in claimed} == pending, "the all-channels claim sees every due message"
        states = dict(conn.execute("SELECT status, count(*) FROM pgfence.outbox GROUP BY status"))
        assert states == {"processing": len(pending) + 1, "sent": 1, "dead": 1, "pending": 1}

    before = fingerprint(empty_db)
    again = migrate(empty_db)
    assert again.applied == []
    assert fingerprint(empty_db) == before
    # an upgraded database has the same indexes (definitions, predicates) as a fresh one
    with psycopg.connect(empty_db) as up, psycopg.connect(db) as fresh:
        assert up.execute(INDEXES).fetchone() == fresh.execute(INDEXES).fetchone()


def test_upgrade_stops_on_a_pending_message_with_no_attempt_left(empty_db: str) -> None:
    """Such a row (written with the triggers bypassed) would be invisible to the all-channels
    claim under 0007's index predicate: the upgrade refuses, names it, and succeeds once it is
    repaired as the hint says."""
    _migrate_to(empty_db, "0006_audit")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        bad = _old_message(conn, "up-c", attempts=10)
    with pytest.raises(psycopg.Error) as failed:
        migrate(empty_db)
    assert failed.value.sqlstate == "PF001" and str(bad) in str(failed.value)
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT pgfence.schema_version()").fetchone() == (6,)
        # what outbox_requeue(id, 1) of that schema's functions did: one more attempt
        conn.execute("UPDATE pgfence.outbox SET max_attempts = attempts + 1 WHERE id = %s", (bad,))
    assert migrate(empty_db).applied == after("0006_audit")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert [m.id for m in outbox.claim(conn, "w", batch=10)] == [bad]


def test_schema_8_with_operations_upgrades_and_every_queued_operation_stays_claimable(
        empty_db: str) -> None:
    _migrate_to(empty_db, "0008_claim_walk_indexes")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        queued = {kind: [operation.request(conn, kind, f"t{i}").id for i in range(3)]
                  for kind in ("up.a", "up.b")}
        # one requeued by the reaper (queued again, fence 1), one running
        [requeued] = operation.claim(conn, "old-w", ["up.a"])
        conn.execute("UPDATE pgfence.operation SET lease_expires_at = now() - interval '1 second'"
                     " WHERE id = %s", (requeued.id,))
        assert operation.reap(conn) == 1
        [running] = operation.claim(conn, "old-w", ["up.b"])
        assert running.id == queued["up.b"][0]

    assert migrate(empty_db).applied == after("0008_claim_walk_indexes")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT pgfence.schema_version()").fetchone() == (SCHEMA_VERSION,)
        one_kind = operation.claim(conn, "new-w", ["up.a"], batch=10)  # operation_kind_queued_idx
        assert [(o.id, o.fence) for o in one_kind] == [(queued["up.a"][0], 2), (queued["up.a"][1], 1),
                                                       (queued["up.a"][2], 1)]
        every = operation.claim(conn, "new-w", None, batch=10)  # operation_queued_idx
        assert [o.id for o in every] == queued["up.b"][1:], "the all-kinds claim sees every queued one"
    assert migrate(empty_db).applied == []


def test_schema_9_with_a_run_in_flight_upgrades_to_fenced_runs(empty_db: str) -> None:
    """0010 gives every plan run token 0, which no caller holds: the run in flight during the
    upgrade is taken again (a new token, a reenter event for its own owner's name), and the old
    unfenced owner functions are gone."""
    _migrate_to(empty_db, "0009_operation_kind_queue")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        conn.execute("CREATE FUNCTION public.up_noop(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$")
        plan.register_action(conn, "up.noop", "public.up_noop(jsonb)", "no-op")
        # proposed, approved and started as an old pgfence left it (today's guard needs the token
        # column, today's plan_propose the step's function row columns of 0034)
        with conn.transaction():
            conn.execute("SET LOCAL session_replication_role = replica")
            row = conn.execute(
                "INSERT INTO pgfence.plan (step_count, proposed_by, expires_at, status, approved_by,"
                " approved_at, worker, started_at, heartbeat_interval, heartbeat_at, heartbeat_expires_at)"
                " VALUES (1, 'agent', now() + interval '1 day', 'executing', 'ops', now(), 'old-w', now(),"
                " '120 seconds', now(), now() + interval '120 seconds') RETURNING id").fetchone()
            assert row is not None
            pid = int(row[0])
            conn.execute("INSERT INTO pgfence.plan_step (plan_id, step_index, action, kind, function,"
                         " function_md5, args) VALUES (%s, 1, 'up.noop', 'sql', 'public.up_noop(jsonb)',"
                         " md5(pg_get_functiondef('public.up_noop(jsonb)'::regprocedure)), '{}')", (pid,))

    assert migrate(empty_db).applied == after("0009_operation_kind_queue")
    with psycopg.connect(empty_db, autocommit=True) as conn:
        assert conn.execute("SELECT run_token FROM pgfence.plan WHERE id = %s", (pid,)).fetchone() == (0,)
        assert conn.execute("SELECT to_regprocedure('pgfence.plan_run_step(bigint,text,boolean)')"
                            ).fetchone() == (None,), "the unfenced signature was dropped"
        with pytest.raises(InvalidArgument):
            plan.run_step(conn, pid, "old-w", 0)  # token 0 is never issued: nobody holds it
        assert plan.start(conn, pid, "old-w") == 1
        [(detail,)] = conn.execute("SELECT detail FROM pgfence.event WHERE module = 'plan'"
                                         " AND item_id = %s AND event = 'reenter'", (pid,)).fetchall()
        assert detail["previous_token"] == 0 and detail["token"] == 1
        assert plan.run_step(conn, pid, "old-w", 1).status == "executed"
