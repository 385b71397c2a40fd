"""Operation module glue: SQL wrappers, the simulator, the executor module (in process), CLI.

Everything runs against a real PostgreSQL (fixture ``db``) and a real HTTP simulator served
in the test's event loop. Crash tests with real processes are in test_operation_crash.py.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import psycopg
import pytest
from click.testing import CliRunner

from pgfence import operation as op_api
from pgfence.cli import main as cli_main
from pgfence.errors import IdempotencyKeyReused, Immutable, InvalidArgument, NotFound
from pgfence.operation import NotIssued, TargetBusy
from pgfence.operation.handlers import ExternalState, SimulatorHandler, parse_handler
from pgfence.operation.module import OperationModule
from pgfence_demo.simulator import Simulator, serve
from support import executor_until

KIND = "test.reset"


# ---------------------------------------------------------------------------------------------
# SQL wrappers
# ---------------------------------------------------------------------------------------------
def test_request_repeat_and_busy_target(conn: psycopg.Connection[Any]) -> None:
    first = op_api.request(conn, KIND, "dev-1", {"from": "main"}, idempotency_key="k1",
                           requested_by="alice")
    assert (first.status, first.created) == ("queued", True)
    again = op_api.request(conn, KIND, "dev-1", {"from": "main"}, idempotency_key="k1")
    assert (again.id, again.created) == (first.id, False)
    with pytest.raises(TargetBusy) as busy:
        op_api.request(conn, KIND, "dev-1", {"from": "main"}, idempotency_key="k2")
    assert busy.value.sqlstate == "PF201"
    assert busy.value.in_flight_id == first.id
    assert busy.value.hint and str(first.id) in busy.value.hint
    with pytest.raises(IdempotencyKeyReused):
        op_api.request(conn, KIND, "dev-1", {"from": "other"}, idempotency_key="k1")
    with pytest.raises(InvalidArgument):
        op_api.request(conn, "Not A Kind", "dev-1")
    assert op_api.request(conn, "test.other", "dev-1").created  # another kind, same target


def test_request_inside_a_rolled_back_transaction_leaves_nothing(db: str) -> None:
    with psycopg.connect(db) as conn:  # not autocommit: the caller owns the transaction
        op_api.request(conn, KIND, "dev-rb", idempotency_key="k-rb")
        conn.rollback()
        assert op_api.list_operations(conn, target="dev-rb") == []


def test_issue_protocol_round_trip(conn: psycopg.Connection[Any]) -> None:
    req = op_api.request(conn, KIND, "dev-2", idempotency_key="k-rt")
    [claimed] = op_api.claim(conn, "w1", [KIND], dt.timedelta(seconds=30))
    assert (claimed.id, claimed.fence, claimed.issue_started) == (req.id, 1, False)
    assert claimed.idempotency_key == "k-rt"
    with pytest.raises(NotIssued):
        op_api.record_external(conn, req.id, 1, "ext-1")
    assert op_api.begin_issue(conn, req.id, 1, idempotent=True) == "issue"
    assert op_api.record_external(conn, req.id, 1, "ext-1", {"accepted": True})
    with pytest.raises(Immutable):
        op_api.record_external(conn, req.id, 1, "ext-2")
    assert op_api.poll(conn, req.id, 1, {"status": "running"}) == "continue"
    assert op_api.poll(conn, req.id, 2, {"status": "running"}) is None  # wrong fence
    assert op_api.cancel(conn, req.id, "bob") == "cancel_requested"
    assert op_api.poll(conn, req.id, 1, {"status": "canceled"}) == "cancel"
    assert op_api.finish(conn, req.id, 1, False, {"external": "canceled"}) == "canceled"
    row = op_api.get(conn, req.id)
    assert (row["status"], row["issue_count"], row["external_ref"]) == ("canceled", 1, "ext-1")
    assert [h["state"]["status"] for h in row["poll_history"]] == ["running", "canceled"]
    assert op_api.cancel(conn, req.id) is None
    with pytest.raises(NotFound):
        op_api.get(conn, 10**12)


def test_reap_and_release(conn: psycopg.Connection[Any]) -> None:
    plain = op_api.request(conn, KIND, "dev-reap")
    [c] = op_api.claim(conn, "w-dead", [KIND])
    assert op_api.begin_issue(conn, plain.id, c.fence, idempotent=False) == "issue"
    assert op_api.release(conn, plain.id, c.fence)
    assert op_api.reap(conn) == 1  # intent without reference, no key: outcome unknown
    row = op_api.get(conn, plain.id)
    assert row["status"] == "failed" and row["result"]["reason"] == "outcome_unknown"
    assert row["error"].startswith("outcome unknown: w-dead started the external")


# ---------------------------------------------------------------------------------------------
# Handlers and the simulator
# ---------------------------------------------------------------------------------------------
def test_parse_handler() -> None:
    h = parse_handler("simulator:http://127.0.0.1:9/?idempotent=0&poll=0.25&timeout=3")
    assert isinstance(h, SimulatorHandler)
    assert (h.base_url, h.idempotent, h.poll_interval) == ("http://127.0.0.1:9", False, 0.25)
    assert parse_handler("simulator:http://127.0.0.1:9").idempotent is True
    for bad in ("nope", "simulator:ftp://x", "simulator:http://x?idempotent=maybe",
                "python:json:dumps"):
        with pytest.raises(ValueError):
            parse_handler(bad)
    with pytest.raises(ValueError):
        ExternalState("done")


def _run(coro_fn: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(coro_fn(), 60))


def test_simulator_modes_and_counters() -> None:
    async def main() -> None:
        for mode, expected_ids in (("idempotent", 1), ("plain", 2)):
            sim = Simulator(mode=mode, queue_time=0.0, run_time=0.2)
            async with serve(sim) as url, aiohttp.ClientSession() as http:
                ids = set()
                for _ in range(2):
                    async with http.post(f"{url}/operations", headers={"Idempotency-Key": "K"},
                                         json={"kind": "k", "target": "t"}) as resp:
                        ids.add((await resp.json())["id"])
                assert len(ids) == expected_ids
                stats = sim.stats()
                assert stats["start_requests"] == 2
                assert stats["starts"] == expected_ids
                assert stats["by_key"]["K"] == {"start_requests": 2, "starts": expected_ids}
                ref = ids.pop()
                await asyncio.sleep(0.3)
                async with http.get(f"{url}/operations/{ref}") as resp:
                    assert (await resp.json())["status"] == "done"
                async with http.post(f"{url}/operations/{ref}/cancel") as resp:
                    assert resp.status == 409
                async with http.post(f"{url}/operations",
                                     json={"kind": "k", "target": "t",
                                           "params": {"sim": {"reject": 422}}}) as resp:
                    assert resp.status == 422
                assert sim.stats()["starts"] == expected_ids  # a rejected start starts nothing
    _run(main)


# ---------------------------------------------------------------------------------------------
# The executor module, in process
# ---------------------------------------------------------------------------------------------
async def _executor_until(db: str, handler: SimulatorHandler, done: Callable[[], bool], *,
                          lease: float = 3.0, timeout: float = 30.0) -> OperationModule:
    module = OperationModule({KIND: handler}, lease=dt.timedelta(seconds=lease), margin=0.5)
    await executor_until(db, module, done, timeout=timeout)
    return module


def _status(db: str, operation_id: int) -> dict[str, Any]:
    with psycopg.connect(db, autocommit=True) as c:
        return op_api.get(c, operation_id)


@pytest.mark.timeout(60)
def test_executor_runs_an_operation_to_success(db: str) -> None:
    async def main() -> None:
        sim = Simulator(mode="idempotent", queue_time=0.2, run_time=0.5)
        async with serve(sim) as url:
            with psycopg.connect(db, autocommit=True) as c:
                req = op_api.request(c, KIND, "dev-ok", {"from": "main"}, idempotency_key="ok")
            module = await _executor_until(
                db, SimulatorHandler(url, idempotent=True, poll_interval=0.1),
                lambda: _status(db, req.id)["status"] in op_api.TERMINAL)
        row = _status(db, req.id)
        assert row["status"] == "succeeded", row
        assert module.finished == {req.id: "succeeded"}
        assert row["result"]["result"]["params"] == {"from": "main"}
        assert row["external_state"]["status"] == "done"
        assert [h["state"]["status"] for h in row["poll_history"]][-1] == "done"
        assert sim.stats()["by_target"]["dev-ok"] == {"start_requests": 1, "starts": 1}
        assert sim.stats()["by_key"]["ok"]["starts"] == 1  # the request's key was passed on
    _run(main)


@pytest.mark.timeout(60)
def test_cancel_is_honoured_on_the_next_poll(db: str) -> None:
    async def main() -> None:
        sim = Simulator(mode="idempotent", queue_time=0.0, run_time=60.0)
        async with serve(sim) as url:
            with psycopg.connect(db, autocommit=True) as c:
                req = op_api.request(c, KIND, "dev-cancel")

            def cancel_when_polled() -> bool:
                row = _status(db, req.id)
                if row["poll_count"] >= 1 and row["cancel_requested_at"] is None:
                    with psycopg.connect(db, autocommit=True) as c:
                        assert op_api.cancel(c, req.id, "carol") == "cancel_requested"
                return row["status"] in op_api.TERMINAL

            await _executor_until(db, SimulatorHandler(url, poll_interval=0.1),
                                  cancel_when_polled)
        row = _status(db, req.id)
        assert row["status"] == "canceled", row
        assert row["error"] == "canceled at the request of carol: canceled by the external service"
        assert [o["status"] for o in sim.stats()["operations"]] == ["canceled"]
    _run(main)


@pytest.mark.timeout(60)
def test_a_cancel_recorded_before_any_call_is_never_issued(db: str) -> None:
    """A cancel request on an operation whose external call was never started (written here by
    hand: operation_cancel itself cancels such an operation at once): operation_begin_issue
    answers ``canceled`` and the executor does not call the API."""
    async def main() -> None:
        sim = Simulator(mode="idempotent", queue_time=0.0, run_time=0.2)
        async with serve(sim) as url:
            with psycopg.connect(db, autocommit=True) as c:
                req = op_api.request(c, KIND, "dev-cancel-early")
                c.execute("UPDATE pgfence.operation SET cancel_requested_at = now(),"
                          " cancel_requested_by = 'carol' WHERE id = %s", (req.id,))
            module = await _executor_until(
                db, SimulatorHandler(url, idempotent=True, poll_interval=0.1),
                lambda: _status(db, req.id)["status"] in op_api.TERMINAL)
        row = _status(db, req.id)
        assert row["status"] == "canceled", row
        assert row["issue_count"] == 0 and row["issue_started_at"] is None
        assert row["error"] == "canceled at the request of carol before the external call was issued"
        assert module.finished == {req.id: "canceled"}
        assert sim.stats()["starts"] == 0
    _run(main)


@pytest.mark.timeout(60)
def test_refused_start_fails_the_operation(db: str) -> None:
    async def main() -> None:
        sim = Simulator(mode="idempotent")
        async with serve(sim) as url:
            with psycopg.connect(db, autocommit=True) as c:
                req = op_api.request(c, KIND, "dev-refused", {"sim": {"reject": 400}})
            await _executor_until(db, SimulatorHandler(url, poll_interval=0.1),
                                  lambda: _status(db, req.id)["status"] in op_api.TERMINAL)
        row = _status(db, req.id)
        assert row["status"] == "failed"
        assert "refused: HTTP 400" in row["error"]
        assert sim.stats()["starts"] == 0
    _run(main)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("idempotent", [True, False])
def test_an_issue_call_with_unknown_outcome(db: str, idempotent: bool) -> None:
    """The start call times out after the remote started the operation: with a key, the SQL
    allows a re-issue that the remote deduplicates; without one, the operation fails as
    "outcome unknown". Either way the remote started it once."""
    async def main() -> None:
        sim = Simulator(mode="idempotent" if idempotent else "plain", queue_time=0.0,
                        run_time=0.3)
        async with serve(sim) as url:
            with psycopg.connect(db, autocommit=True) as c:
                # the first answer comes after the handler's 1 s timeout (lease 1.5 - margin)
                req = op_api.request(c, KIND, "dev-slow", {"sim": {"start_delay": 2.5}})
            await _executor_until(
                db, SimulatorHandler(url, idempotent=idempotent, poll_interval=0.1),
                lambda: _status(db, req.id)["status"] in op_api.TERMINAL, lease=1.5)
        row = _status(db, req.id)
        stats = sim.stats()["by_target"]["dev-slow"]
        if idempotent:
            assert row["status"] == "succeeded", row
            assert row["issue_count"] == 2
            assert stats == {"start_requests": 2, "starts": 1}
        else:
            assert row["status"] == "failed", row
            assert row["result"]["reason"] == "outcome_unknown"
            assert "did not pass the idempotency key" in row["error"]
            assert stats == {"start_requests": 1, "starts": 1}
    _run(main)


@pytest.mark.timeout(60)
def test_graceful_stop_releases_and_a_successor_only_polls(db: str) -> None:
    async def main() -> None:
        sim = Simulator(mode="plain", queue_time=0.0, run_time=2.0)
        async with serve(sim) as url:
            with psycopg.connect(db, autocommit=True) as c:
                req = op_api.request(c, KIND, "dev-handoff")
            # lease 30 s: without the release a successor would wait half a minute
            await _executor_until(db, SimulatorHandler(url, idempotent=False, poll_interval=0.1),
                                  lambda: _status(db, req.id)["poll_count"] >= 2, lease=30.0)
            row = _status(db, req.id)
            assert row["status"] == "running" and row["lease_expires_at"] is not None
            await _executor_until(db, SimulatorHandler(url, idempotent=False, poll_interval=0.1),
                                  lambda: _status(db, req.id)["status"] in op_api.TERMINAL,
                                  lease=30.0, timeout=15.0)
        row = _status(db, req.id)
        assert (row["status"], row["fence"], row["issue_count"]) == ("succeeded", 2, 1)
        assert sim.stats()["by_target"]["dev-handoff"] == {"start_requests": 1, "starts": 1}
    _run(main)


# ---------------------------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------------------------
def test_cli_request_show_list_cancel_wait(db: str) -> None:
    runner = CliRunner()

    def cli(*args: str) -> Any:
        return runner.invoke(cli_main, ["--dsn", db, "op", *args], catch_exceptions=False)

    res = cli("request", KIND, "dev-cli", '{"from": "main"}', "--key", "cli-1", "--json")
    assert res.exit_code == 0, res.output
    op_id = json.loads(res.output)["id"]
    res = cli("request", KIND, "dev-cli", "{}", "--key", "cli-2")
    assert res.exit_code == 1
    assert f"Operation {op_id} is queued" in res.output
    assert "[PF201]" in res.output
    res = cli("request", KIND, "dev-cli", '{"from": "main"}', "--key", "cli-1")
    assert res.exit_code == 0 and "already requested" in res.output
    res = cli("show", str(op_id), "--json")
    assert json.loads(res.output)["idempotency_key"] == "cli-1"
    res = cli("list", "--status", "in_flight", "--json")
    assert [r["id"] for r in json.loads(res.output)] == [op_id]
    res = cli("wait", str(op_id), "--timeout", "0.2", "--interval", "0.05")
    assert res.exit_code == 2  # still queued
    res = cli("cancel", str(op_id), "--by", "carol")
    assert res.exit_code == 0 and "canceled" in res.output
    res = cli("cancel", str(op_id))
    assert res.exit_code == 1
    res = cli("wait", str(op_id), "--json")
    assert res.exit_code == 1 and json.loads(res.output)["status"] == "canceled"
    res = cli("request", KIND, "dev-cli", "[1]")
    assert res.exit_code == 2
