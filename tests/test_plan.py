"""Plan module glue: the Python API (one SQL call each, SQLSTATEs translated) and the CLI."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql
from psycopg.conninfo import make_conninfo

from pgfence import plan
from pgfence.cli import main
from pgfence.errors import IdempotencyKeyReused, InvalidArgument, NotFound


def setup_actions(conn: psycopg.Connection) -> None:
    """A small table, SQL actions on it, and an external action."""
    conn.execute("CREATE TABLE public.ledger (k text PRIMARY KEY, v int NOT NULL CHECK (v >= 0))")
    conn.execute("""
        CREATE FUNCTION public.put(p jsonb) RETURNS jsonb LANGUAGE sql SET search_path = public AS $$
          INSERT INTO ledger VALUES (p ->> 'k', (p ->> 'v')::int) RETURNING jsonb_build_object('k', k)
        $$""")
    conn.execute("""
        CREATE FUNCTION public.take(p jsonb) RETURNS jsonb LANGUAGE sql SET search_path = public AS $$
          UPDATE ledger SET v = v - (p ->> 'v')::int WHERE k = p ->> 'k' RETURNING jsonb_build_object('v', v)
        $$""")
    assert plan.register_action(conn, "put", "public.put(jsonb)", "insert a ledger row") is True
    assert plan.register_action(conn, "take", "public.take(jsonb)", "decrement a ledger row") is True
    assert plan.register_action(conn, "hook", None, "POST to a webhook") is True


@pytest.fixture()
def pconn(conn: psycopg.Connection) -> Iterator[psycopg.Connection]:
    setup_actions(conn)
    yield conn


def put(k: str, v: int) -> dict[str, object]:
    return {"action": "put", "args": {"k": k, "v": v}}


def test_propose_approve_execute_receipts(pconn: psycopg.Connection) -> None:
    pid = plan.propose(pconn, [put("a", 5), put("b", 7), {"action": "take", "args": {"k": "a", "v": 2}}],
                       "agent-7", idempotency_key="ledger-1")
    assert plan.propose(pconn, [put("a", 5), put("b", 7), {"action": "take", "args": {"k": "a", "v": 2}}],
                        "agent-7", idempotency_key="ledger-1") == pid
    assert plan.get(pconn, pid)["status"] == "pending"
    assert plan.approve(pconn, pid, "alice") == "approved"
    assert plan.approve(pconn, pid, "bob") is None, "second approval is a lost race"

    result = plan.execute(pconn, pid, "runner-1")
    assert result.status == "executed"
    assert [(r["step_index"], r["outcome"], r["output"]) for r in result.receipts] == [
        (1, "ok", {"k": "a"}), (2, "ok", {"k": "b"}), (3, "ok", {"v": 3})]
    assert pconn.execute("SELECT k, v FROM ledger ORDER BY k").fetchall() == [("a", 3), ("b", 7)]
    info = plan.get(pconn, pid)
    assert (info["status"], info["approved_by"], info["worker"], info["next_step"]) == \
        ("executed", "alice", "runner-1", 4)
    assert [s["state"] for s in plan.steps(pconn, pid)] == ["ok", "ok", "ok"]

    again = plan.execute(pconn, pid, "runner-2")
    assert again.status == "executed" and again.receipts == result.receipts, \
        "a terminal plan answers from its receipts"
    assert pconn.execute("SELECT v FROM ledger WHERE k = 'a'").fetchone() == (3,), "and ran nothing"


def test_failing_step_is_an_error_receipt_and_earlier_steps_stay(pconn: psycopg.Connection) -> None:
    pid = plan.propose(pconn, [put("x", 1), put("y", 1), {"action": "take", "args": {"k": "x", "v": 5}},
                               put("z", 1)], "agent")
    plan.approve(pconn, pid, "alice")
    result = plan.execute(pconn, pid, "runner")
    assert result.status == "failed"
    last = result.receipts[-1]
    assert (last["step_index"], last["outcome"], last["sqlstate"]) == (3, "error", "23514")
    assert pconn.execute("SELECT k, v FROM ledger ORDER BY k").fetchall() == [("x", 1), ("y", 1)]
    assert [s["state"] for s in plan.steps(pconn, pid)] == ["ok", "ok", "error", "not_run"]
    assert plan.get(pconn, pid)["failure"] == "step_error"


def test_run_step_record_step_and_errors(pconn: psycopg.Connection) -> None:
    pid = plan.propose(pconn, [put("s1", 1), {"action": "hook", "args": {"recipient": "http://127.0.0.1:9/h",
                                                                         "payload": {"n": 1}}}], "agent")
    plan.approve(pconn, pid, "alice")
    assert plan.claim(pconn, "w1", 5) == [plan.ClaimedPlan(pid, 1, 2, "sql", plan.DEFAULT_HEARTBEAT, 1)]
    assert plan.start(pconn, pid, "w2") is None
    with pytest.raises(plan.NotExternalStep):
        plan.record_step(pconn, pid, 1, "w1", 1, True)
    first = plan.run_step(pconn, pid, "w1", 1)
    assert (first.step_index, first.outcome, first.status) == (1, "ok", "executing")
    ext = plan.run_step(pconn, pid, "w1", 1)
    assert (ext.outcome, ext.args, ext.idempotency_key) == \
        ("external", {"recipient": "http://127.0.0.1:9/h", "payload": {"n": 1}}, f"pgfence-plan-{pid}-step-2")
    assert plan.heartbeat(pconn, pid, "w1", 1) is True
    assert plan.heartbeat(pconn, pid, "w2", 1) is False
    assert plan.heartbeat(pconn, pid, "w1", 2) is False, "a token this run never issued"
    assert plan.record_step(pconn, pid, 1, "w1", 1, True) is False, "step 1 is receipted already"
    with pytest.raises(InvalidArgument):
        plan.record_step(pconn, pid, 3, "w1", 1, True)
    assert plan.record_step(pconn, pid, 2, "w2", 1, True) is False, "not the owner"
    assert plan.record_step(pconn, pid, 2, "w1", 1, True, output={"http_status": 200}) is True
    assert plan.get(pconn, pid)["status"] == "executed"
    assert [r["output"] for r in plan.receipts(pconn, pid)] == [{"k": "s1"}, {"http_status": 200}]
    refused = plan.run_step(pconn, pid, "w1", 1)
    assert (refused.outcome, refused.status) == (None, "executed")


def test_errors_are_translated(pconn: psycopg.Connection) -> None:
    with pytest.raises(plan.UnknownAction) as unknown:
        plan.propose(pconn, [{"action": "drop-database"}], "agent")
    assert unknown.value.sqlstate == "PF101" and unknown.value.hint
    with pytest.raises(InvalidArgument):
        plan.propose(pconn, [], "agent")
    with pytest.raises(plan.ActionConflict):
        plan.register_action(pconn, "put", "public.take(jsonb)", "re-pointed")
    pid = plan.propose(pconn, [put("e", 1)], "agent", idempotency_key="k-e")
    with pytest.raises(IdempotencyKeyReused):
        plan.propose(pconn, [put("e", 2)], "agent", idempotency_key="k-e")
    with pytest.raises(plan.SelfApproval):
        plan.approve(pconn, pid, "agent")
    with pytest.raises(plan.NotCompensable):
        plan.compensate(pconn, pid, [put("undo", 0)], "agent")
    with pytest.raises(NotFound):
        plan.get(pconn, 999999)
    ext = plan.propose(pconn, [{"action": "hook", "args": {"recipient": "http://x/1"}},
                               {"action": "hook", "args": {"recipient": "http://x/2"}}], "agent")
    plan.approve(pconn, ext, "alice")
    token = plan.start(pconn, ext, "w")
    assert token == 1
    with pytest.raises(plan.StepOutOfOrder):
        plan.record_step(pconn, ext, 2, "w", token, True)
    with pytest.raises(InvalidArgument) as no_token:
        plan.run_step(pconn, ext, "w", None)  # type: ignore[arg-type]
    assert no_token.value.sqlstate == "22004" and "plan_start" in (no_token.value.hint or "")
    assert plan.retire_action(pconn, "take") is True
    with pytest.raises(plan.UnknownAction):
        plan.propose(pconn, [{"action": "take", "args": {}}], "agent")
    with pytest.raises(psycopg.errors.UndefinedFunction):
        plan.register_action(pconn, "ghost", "public.nope(jsonb)", "no such function")


@pytest.fixture()
def two_logins(db: str, admin_dsn: str) -> Iterator[list[tuple[str, str]]]:
    """(name, DSN) of two new non-superuser logins that may propose and approve (dropped after)."""
    suffix = uuid.uuid4().hex[:8]
    names = [f"pf_mallory_{suffix}", f"pf_trent_{suffix}"]
    with psycopg.connect(admin_dsn, autocommit=True) as admin:
        for name in names:
            admin.execute(sql.SQL("CREATE ROLE {} LOGIN IN ROLE pgfence_client, pgfence_admin")
                          .format(sql.Identifier(name)))
    try:
        yield [(name, make_conninfo(db, user=name)) for name in names]
    finally:
        with psycopg.connect(admin_dsn, autocommit=True) as admin:
            for name in names:
                admin.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(name)))


def test_four_eyes_are_two_database_logins(pconn: psycopg.Connection,
                                           two_logins: list[tuple[str, str]]) -> None:
    (mallory_login, mallory_dsn), (trent_login, trent_dsn) = two_logins
    with psycopg.connect(mallory_dsn, autocommit=True) as mallory:
        pid = plan.propose(mallory, [put("m", 1)], "mallory")
        with pytest.raises(plan.SelfApproval) as refused:
            plan.approve(mallory, pid, "definitely-not-mallory")
        assert refused.value.sqlstate == "PF103" and "login" in str(refused.value)
    assert plan.get(pconn, pid)["status"] == "pending"
    with psycopg.connect(trent_dsn, autocommit=True) as trent:
        assert plan.approve(trent, pid, "trent") == "approved"
    logins = pconn.execute("SELECT event, actor, db_user FROM pgfence.event WHERE module = 'plan'"
                           " AND item_id = %s ORDER BY id", (pid,)).fetchall()
    assert logins == [("propose", "mallory", mallory_login), ("approve", "trent", trent_login)]


def test_a_replaced_action_function_fails_its_step(pconn: psycopg.Connection) -> None:
    pid = plan.propose(pconn, [put("r1", 1), put("r2", 1)], "agent")
    plan.approve(pconn, pid, "alice")
    pconn.execute("""
        CREATE OR REPLACE FUNCTION public.put(p jsonb) RETURNS jsonb LANGUAGE sql SET search_path = public AS $$
          INSERT INTO ledger VALUES (p ->> 'k', 1000) RETURNING jsonb_build_object('k', k, 'evil', true)
        $$""")
    result = plan.execute(pconn, pid, "runner")
    assert result.status == "failed"
    assert [(r["step_index"], r["outcome"], r["sqlstate"]) for r in result.receipts] == [(1, "error", "PF108")]
    assert pconn.execute("SELECT count(*) FROM ledger").fetchone() == (0,), "nothing ran"


EVIL_PUT = """
    CREATE OR REPLACE FUNCTION public.put(p jsonb) RETURNS jsonb LANGUAGE sql SET search_path = public AS $$
      INSERT INTO ledger VALUES (p ->> 'k', 1000) RETURNING jsonb_build_object('k', k, 'evil', true)
    $$"""


@pytest.mark.parametrize("isolation", ["REPEATABLE READ", "SERIALIZABLE"])
def test_a_function_replaced_after_a_steps_snapshot_fails_it(db: str, pconn: psycopg.Connection,
                                                              isolation: str) -> None:
    """A step's transaction under REPEATABLE READ / SERIALIZABLE reads pg_proc with its snapshot,
    taken before a peer replaced the function; the action runs the replacement (the catalog
    caches see the latest definition). The approval check must not take the stale row version
    for the approved one: PF108, nothing of the replacement commits."""
    pid = plan.propose(pconn, [put("s1", 1)], "agent")
    assert plan.approve(pconn, pid, "alice") == "approved"
    token = plan.start(pconn, pid, "runner")
    with psycopg.connect(db) as step:  # one transaction: the step's
        step.execute(f"SET TRANSACTION ISOLATION LEVEL {isolation}")
        step.execute("SELECT 1")  # the transaction's snapshot
        pconn.execute(EVIL_PUT)  # a peer replaces the function, committed
        row = step.execute("SELECT outcome, error ->> 'sqlstate', output FROM pgfence.plan_run_step(%s, 'runner', %s)",
                           (pid, token)).fetchone()
        step.commit()
    assert row == ("error", "PF108", None)
    assert pconn.execute("SELECT count(*) FROM ledger").fetchone() == (0,), "the replacement did not commit"


def test_a_replaced_function_is_refused_at_the_finish_of_a_repeatable_read_step(
        db: str, pconn: psycopg.Connection) -> None:
    """The finish's check (an ok receipt) under REPEATABLE READ, the helpers called by hand: the
    stale row version in the snapshot does not vouch for a function replaced meanwhile."""
    pid = plan.propose(pconn, [put("s1", 1)], "agent")
    assert plan.approve(pconn, pid, "alice") == "approved"
    token = plan.start(pconn, pid, "runner")
    with psycopg.connect(db) as step:
        step.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        step.execute("SELECT 1")
        pconn.execute(EVIL_PUT)
        step.execute("SELECT * FROM pgfence._plan_step_begin(%s, 'runner', %s)", (pid, token))
        with pytest.raises(psycopg.Error) as refused:
            step.execute("SELECT pgfence._plan_step_finish(%s, 'runner', %s, 1, true, '{\"k\": \"s1\"}', NULL)",
                         (pid, token))
        assert refused.value.sqlstate == "PF108"
    assert pconn.execute("SELECT outcome FROM pgfence.plan_step WHERE plan_id = %s", (pid,)).fetchone() == (None,)


FROZEN = ("SELECT p.xmin::text, age(p.xmin) > age(c.relfrozenxid) FROM pg_proc p, pg_class c"
          " WHERE p.oid = 'public.put(jsonb)'::regprocedure AND c.oid = 'pg_catalog.pg_proc'::regclass")


def test_a_frozen_function_row_is_still_the_approved_version(pconn: psycopg.Connection) -> None:
    """VACUUM FREEZE keeps pg_proc's raw xmin (PostgreSQL >= 9.4), so a step whose function's row
    was frozen after the proposal still matches the row version recorded then (migration 0034)."""
    pid = plan.propose(pconn, [put("f1", 1), put("f2", 1)], "agent")
    assert plan.approve(pconn, pid, "alice") == "approved"
    [(xmin, frozen)] = pconn.execute(FROZEN).fetchall()
    assert not frozen
    assert pconn.execute("SELECT DISTINCT function_oid = 'public.put(jsonb)'::regprocedure, function_xmin::text"
                         " FROM pgfence.plan_step WHERE plan_id = %s", (pid,)).fetchall() == [(True, xmin)]
    pconn.execute("VACUUM (FREEZE) pg_catalog.pg_proc")
    assert pconn.execute(FROZEN).fetchall() == [(xmin, True)], "frozen (older than relfrozenxid), xmin kept"
    # Spoil the recorded md5 (past the guard): only the row version can tell that the function
    # is the approved one, at the step's begin and at its finish (top-level: the one-statement path).
    with pconn.transaction():
        pconn.execute("SET LOCAL session_replication_role = replica")
        pconn.execute("UPDATE pgfence.plan_step SET function_md5 = md5('spoilt') WHERE plan_id = %s", (pid,))
    result = plan.execute(pconn, pid, "runner")
    assert [(r["step_index"], r["outcome"]) for r in result.receipts] == [(1, "ok"), (2, "ok")]
    assert result.status == "executed"


def test_execute_needs_autocommit(db: str, pconn: psycopg.Connection) -> None:
    pid = plan.propose(pconn, [put("t", 1)], "agent")
    plan.approve(pconn, pid, "alice")
    with psycopg.connect(db) as tx_conn, pytest.raises(ValueError, match="autocommit"):
        plan.execute(tx_conn, pid, "runner")
    assert plan.get(pconn, pid)["status"] == "approved", "nothing happened"


def test_compensation_and_rejection(pconn: psycopg.Connection) -> None:
    pid = plan.propose(pconn, [put("c", 10)], "agent")
    plan.approve(pconn, pid, "alice")
    assert plan.execute(pconn, pid, "r").status == "executed"
    undo = plan.compensate(pconn, pid, [{"action": "take", "args": {"k": "c", "v": 10}}], "agent")
    assert plan.get(pconn, undo)["compensates"] == pid
    assert plan.get(pconn, pid)["compensated_by"] == [undo]
    assert plan.reject(pconn, undo, "bob", "not now") is True
    assert plan.reject(pconn, undo, "bob", "again") is False
    assert plan.execute(pconn, undo, "r").status == "rejected"
    assert pconn.execute("SELECT v FROM ledger WHERE k = 'c'").fetchone() == (10,)
    assert [p["id"] for p in plan.list_plans(pconn, "rejected")] == [undo]


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def cli(db: str, *args: str, input: str | None = None) -> tuple[int, str]:
    res = CliRunner().invoke(main, ["--dsn", db, "plan", *args], input=input, catch_exceptions=False)
    return res.exit_code, res.output


def test_cli_propose_approve_execute_show_list(db: str, pconn: psycopg.Connection, tmp_path) -> None:
    steps = tmp_path / "steps.json"
    steps.write_text(json.dumps([put("cli1", 1), put("cli2", 2)]))
    code, out = cli(db, "propose", "--by", "agent", f"@{steps}")
    assert code == 0, out
    pid = int(out.strip())
    code, out = cli(db, "approve", str(pid), "--by", "agent")
    assert code == 1 and "PF103" in out and "four eyes" in out, out
    code, out = cli(db, "approve", str(pid), "--by", "alice")
    assert (code, out.strip()) == (0, f"plan#{pid} approved by alice")
    code, out = cli(db, "execute", str(pid), "--worker", "cli-runner")
    assert code == 0, out
    assert f"plan#{pid}: executed" in out and "cli-runner" in out
    code, out = cli(db, "show", str(pid))
    assert code == 0, out
    assert "approved: by alice" in out and "proposed: by agent" in out and "took:" in out
    assert out.count(" ok ") >= 2
    code, out = cli(db, "show", str(pid), "--json")
    shown = json.loads(out)
    assert shown["status"] == "executed"
    assert [(s["step_index"], s["state"]) for s in shown["steps"]] == [(1, "ok"), (2, "ok")]
    code, out = cli(db, "list", "--json")
    assert [(p["id"], p["status"], p["steps_done"]) for p in json.loads(out)] == [(pid, "executed", 2)]


def test_cli_failed_plan_exits_1_and_compensation(db: str, pconn: psycopg.Connection) -> None:
    code, out = cli(db, "propose", "--by", "agent", "-",
                    input=json.dumps([put("f1", 1), {"action": "take", "args": {"k": "f1", "v": 9}}]))
    pid = int(out.strip())
    cli(db, "approve", str(pid), "--by", "alice")
    code, out = cli(db, "execute", str(pid))
    assert code == 1 and "failed (step_error at step 2)" in out and "23514" in out, out
    code, out = cli(db, "compensate", str(pid), "--by", "agent",
                    json.dumps([{"action": "take", "args": {"k": "f1", "v": 1}}]))
    assert code == 0, out
    undo = int(out.strip())
    code, out = cli(db, "show", str(pid))
    assert f"compensated by: plan#{undo}" in out
    code, out = cli(db, "reject", str(undo), "--by", "bob", "--reason", "keep it")
    assert code == 0 and "rejected by bob" in out
    code, out = cli(db, "propose", "--by", "agent", '[{"action": "nope"}]')
    assert code == 1 and "PF101" in out
    code, out = cli(db, "propose", "--by", "agent", "not json")
    assert code == 2 and "not JSON" in out


def test_cli_actions(db: str, conn: psycopg.Connection) -> None:
    conn.execute("CREATE FUNCTION public.echo(p jsonb) RETURNS jsonb LANGUAGE sql AS $$ SELECT p $$")
    assert cli(db, "register-action", "echo", "--function", "public.echo(jsonb)",
               "--description", "echo the args") == (0, "action echo registered\n")
    assert cli(db, "register-action", "notify", "--external", "--description", "a webhook")[0] == 0
    code, out = cli(db, "register-action", "bad", "--description", "x")
    assert code == 2 and "exactly one of" in out
    code, out = cli(db, "actions", "--json")
    assert [(a["name"], a["kind"]) for a in json.loads(out)] == [("echo", "sql"), ("notify", "external")]
    assert cli(db, "retire-action", "echo") == (0, "action echo retired\n")
