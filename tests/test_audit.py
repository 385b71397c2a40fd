"""Auditing from the glue: ``pgfence status`` / ``inspect`` / ``purge`` and :mod:`pgfence.audit`
against a real database, a monitoring login that may read but not purge, and an executor
SIGSTOPped past its lease seen through the audit views."""

from __future__ import annotations

import datetime as dt
import json
import signal
import uuid
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgfence import audit, operation, outbox, plan
from pgfence.cli import main
from pgfence.errors import InvalidArgument, NotFound
from pgfence_demo.receivers import WebhookReceiver
from support import Proc, scalar, wait_for


def run(dsn: str, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, ["--dsn", dsn, *args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def lapsed_then_sent(conn: psycopg.Connection, channel: str, key: str) -> int:
    """A message whose first claim (worker w-lost) lapsed and was reclaimed, then sent by w-ok."""
    mid = outbox.enqueue(conn, channel, "https://example.test/hook", {"n": 1}, idempotency_key=key)
    outbox.claim(conn, "w-lost", 1, [channel])
    conn.execute("UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 minute' WHERE id = %s", (mid,))
    assert outbox.reap(conn) == 1
    conn.execute("UPDATE pgfence.outbox SET next_attempt_at = now() WHERE id = %s", (mid,))
    (again,) = outbox.claim(conn, "w-ok", 1, [channel])
    assert outbox.mark_sent(conn, mid, again.attempt, {"http": 200})
    return mid


def stale_plan(conn: psycopg.Connection) -> int:
    conn.execute("CREATE FUNCTION public.t_audit_noop(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$")
    plan.register_action(conn, "t.noop", "public.t_audit_noop(jsonb)", "no-op")
    pid = plan.propose(conn, [{"action": "t.noop"}], "agent")
    plan.approve(conn, pid, "ops")
    assert plan.start(conn, pid, "w-plan") == 1
    conn.execute("UPDATE pgfence.plan SET heartbeat_expires_at = now() - interval '20 seconds' WHERE id = %s", (pid,))
    return pid


def test_status_shows_every_module(db: str, conn: psycopg.Connection) -> None:
    mid = lapsed_then_sent(conn, "hooks", "st-1")
    pid = stale_plan(conn)
    op = operation.request(conn, "branch.reset", "dev-1", {}, requested_by="alice")
    conn.execute("SELECT * FROM pgfence.operation_claim('w-op', ARRAY['branch.reset'])")
    doc = int(conn.execute("SELECT pgfence.document_create('record', '{}', 'alice')").fetchone()[0])
    conn.execute("SELECT * FROM pgfence.document_save(%s, 1, '{\"a\": 1}', 'alice')", (doc,))
    conn.execute("SELECT * FROM pgfence.document_save(%s, 1, '{\"a\": 2}', 'bob')", (doc,))

    out = json.loads(run(db, "status", "--json", code=1))  # 1: stuck and a possible duplicate
    assert set(out) == {"health", "warnings", "queues", "outbox", "stuck", "duplicates", "leases",
                        "documents", "executors", "unserved", "cleanup_blockers",
                        "cleanup_warn_after", "tables"}
    assert [w["kind"] for w in out["warnings"]] == ["stuck", "duplicates"]
    queues = {(q["module"], q["queue"]): q for q in out["queues"]}
    assert queues[("outbox", "hooks")]["done_5m"] == 1
    assert queues[("operation", "branch.reset")]["in_flight"] == 1
    assert queues[("plan", "*")]["lapsed"] == 1
    assert [(s["module"], s["item_id"], s["owner"]) for s in out["stuck"]] == [("plan", pid, "w-plan")]
    assert [(d["module"], d["item_id"], d["lost_by"]) for d in out["duplicates"]] == \
        [("outbox", mid, ["w-lost"])]
    leases = {(x["module"], x["owner"]): x["held"] for x in out["leases"]}
    assert leases == {("plan", "w-plan"): 1, ("operation", "w-op"): 1}
    assert [(d["document_id"], d["conflicts_1h"], d["last_conflict_by"]) for d in out["documents"]] == \
        [(doc, 1, "bob")]

    text = run(db, "status", code=1)
    for heading in ("queues", "outbox (per channel and status)", "stuck (lease or heartbeat lapsed)",
                    "may have been duplicated", "leases held", "documents with conflicts",
                    "tables (dead rows VACUUM has not removed yet)"):
        assert heading in text
    assert "w-plan" in text and "lease_lapsed" in text and "st-1" in text
    assert op.id > 0


def test_inspect_prints_owner_and_timeline(db: str, conn: psycopg.Connection) -> None:
    mid = lapsed_then_sent(conn, "hooks", "in-1")
    text = run(db, "inspect", "outbox", str(mid))
    assert "status: sent" in text and "last_owner" in text
    lines = [line.split()[2:4] for line in text.splitlines() if line.startswith("20")]
    assert [line[1] for line in lines] == ["enqueue", "lease_lapsed", "claim", "finish", "current"]
    data = json.loads(run(db, "inspect", "outbox", str(mid), "--json"))
    assert data["item"]["status"] == "sent"
    lapse = [e for e in data["timeline"] if e["event"] == "lease_lapsed"]
    assert [(e["fence"], e["detail"]["worker"]) for e in lapse] == [(1, "w-lost")]
    assert "[P0002]" in run(db, "inspect", "plan", "424242", code=1)
    assert "Invalid value" in run(db, "inspect", "queue", "1", code=2)


def test_python_api_errors_and_owner(db: str, conn: psycopg.Connection) -> None:
    op = operation.request(conn, "export", "t-1", {}, requested_by="alice")
    (claimed,) = conn.execute("SELECT fence FROM pgfence.operation_claim('w-9', ARRAY['export'], '1 minute')").fetchall()
    owner = audit.owner_of(conn, "operation", op.id)
    assert (owner["owned"], owner["owner"], owner["fence"], owner["lapsed"]) == (True, "w-9", claimed[0], False)
    assert dt.timedelta(seconds=50) < owner["remaining"] <= dt.timedelta(minutes=1)
    assert [r["item_id"] for r in audit.owned(conn)] == [op.id]
    with pytest.raises(InvalidArgument):
        audit.owner_of(conn, "queue", 1)
    with pytest.raises(NotFound):
        audit.timeline(conn, "document", 999)
    with pytest.raises(ValueError):
        audit.documents(conn, "loudest")


def test_purge_cli_keeps_pending_items(db: str, conn: psycopg.Connection) -> None:
    sent = lapsed_then_sent(conn, "hooks", "pu-1")
    pending = outbox.enqueue(conn, "hooks", "https://example.test/hook", {"n": 2})
    assert "purged 0 outbox item(s) (default age)" in run(db, "purge", "outbox")  # 7 days
    assert "purged 1 outbox item(s) older than 0.0s" in run(db, "purge", "outbox", "--older-than", "0s")
    ids = [r[0] for r in conn.execute("SELECT id FROM pgfence.outbox ORDER BY id").fetchall()]
    assert ids == [pending]
    assert scalar(db, "SELECT count(*) FROM pgfence.outbox_lapse WHERE message_id = %s", (sent,)) == 0
    assert "--older-than" in run(db, "purge", "outbox", "--older-than", "soon", code=2)
    assert audit.purge(conn, "document", dt.timedelta(0)) == 0


@pytest.fixture()
def monitor_dsn(db: str, admin_dsn: str) -> Iterator[str]:
    """A LOGIN role that is only a member of pg_monitor, connected to ``db``."""
    role = f"t_mon_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {role} LOGIN IN ROLE pg_monitor")
    params = conninfo_to_dict(db)
    params["user"] = role
    try:
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(f"REASSIGN OWNED BY {role} TO CURRENT_USER")
            conn.execute(f"DROP OWNED BY {role}")
        with psycopg.connect(admin_dsn, autocommit=True) as conn:
            conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (role,))
            conn.execute(f"DROP ROLE {role}")


def test_a_monitoring_login_reads_but_cannot_purge_or_write(db: str, conn: psycopg.Connection,
                                                            monitor_dsn: str) -> None:
    mid = lapsed_then_sent(conn, "hooks", "mon-1")
    out = json.loads(run(monitor_dsn, "status", "--json", code=1))  # 1: a possible duplicate
    assert [d["item_id"] for d in out["duplicates"]] == [mid]
    assert "lease_lapsed" in run(monitor_dsn, "inspect", "outbox", str(mid))
    err = run(monitor_dsn, "purge", "outbox", "--older-than", "0s", code=1)
    assert "[42501]" in err
    err = run(monitor_dsn, "outbox", "requeue", str(mid), code=1)
    assert "[42501]" in err
    assert scalar(db, "SELECT count(*) FROM pgfence.outbox") == 1


@pytest.mark.timeout(90)
def test_sigstop_past_the_lease_is_stuck_then_a_possible_duplicate(db: str, conn: psycopg.Connection,
                                                                   tmp_path: Path) -> None:
    hook = WebhookReceiver()
    outbox.configure_channel(conn, "hooks", lease=dt.timedelta(seconds=2),
                             backoff_base=dt.timedelta(milliseconds=100),
                             backoff_cap=dt.timedelta(seconds=1), log_events=True)
    fast = ["--route", "hooks=webhook", "--poll-interval", "0.5", "--reap-interval", "0.3", "--grace", "10"]
    mid = outbox.enqueue(conn, "hooks", f"{hook.url}/slow-once?s=1", {"n": 1}, idempotency_key="freeze")
    paused = Proc(db, ["--worker-id", "frozen", *fast], tmp_path / "frozen.log")
    try:
        wait_for(lambda: hook.count("freeze") == 1, 20, "the first delivery to reach the receiver")
        paused.signal(signal.SIGSTOP)
        stuck = wait_for(lambda: [r for r in audit.stuck(conn) if r["item_id"] == mid], 20,
                         "audit_stuck to list the frozen worker's message")
        assert (stuck[0]["owner"], stuck[0]["fence"], stuck[0]["status"]) == ("frozen", 1, "processing")
        assert stuck[0]["overdue"] >= dt.timedelta(0)
        other = Proc(db, ["--worker-id", "other", *fast], tmp_path / "other.log")
        try:
            wait_for(lambda: outbox.get(conn, mid)["status"] == "sent", 20, "the other worker to deliver")
        finally:
            assert other.terminate() == 0
        assert not [r for r in audit.stuck(conn) if r["item_id"] == mid]
        dups = [d for d in audit.duplicates(conn) if d["module"] == "outbox"]
        assert [(d["item_id"], d["fences"], d["lost_by"], d["idempotency_key"]) for d in dups] == \
            [(mid, [1], ["frozen"], "freeze")]
        assert hook.count("freeze") == 2, "the receiver did get it twice, as audit_duplicates warned"
        events = [(e["event"], e["to_status"], e["actor"]) for e in audit.timeline(conn, "outbox", mid)
                  if e["source"] == "event"]
        assert events == [("enqueue", "pending", events[0][2]), ("claim", "processing", "frozen"),
                          ("transition", "pending", "reaper"), ("claim", "processing", "other"),
                          ("transition", "sent", "other")]
    finally:
        paused.signal(signal.SIGCONT)
        paused.terminate()
        hook.close()
