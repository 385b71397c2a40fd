"""``pgfence op``: request, show, list, cancel and wait for long external operations; run the
local slow-operations simulator."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import click

from .. import operation as api
from ._common import (
    CliState,
    db_conn,
    emit,
    emit_one,
    import_demo,
    json_option,
    parse_json,
    pass_state,
)


@click.group("op")
def op() -> None:
    """Long external operations: one in flight per (kind, target), issued once, then polled.

    \b
    Example, with the simulator as the external API:
      pgfence op simulator --port 8765 &
      pgfence executor --op-kind branch.reset=simulator:http://127.0.0.1:8765 &
      pgfence op request branch.reset dev-42 '{"from": "main"}' --key reset-dev-42-1
      pgfence op wait 1
    """


@op.command()
@click.argument("kind")
@click.argument("target")
@click.argument("params", required=False, default="{}")
@click.option("--key", "idempotency_key",
              help="Idempotency key: a repeat returns the same operation (and is passed to the "
                   "external API by handlers that can).")
@click.option("--by", "requested_by", help="Who asks (default: the database user).")
@json_option
@pass_state
def request(state: CliState, kind: str, target: str, params: str, idempotency_key: str | None,
            requested_by: str | None, as_json: bool) -> None:
    """Request operation KIND on TARGET with a JSON object PARAMS; prints its id and status.

    A second request for a TARGET that has an operation in flight fails (exit 1) and names it.
    """
    body = parse_json(params, "PARAMS", dict, "must be a JSON object")
    with db_conn(state) as conn:
        got = api.request(conn, kind, target, body, idempotency_key=idempotency_key,
                          requested_by=requested_by)
    if as_json:
        emit_one(got.__dict__, True)
        return
    note = "requested" if got.created else "already requested (same key)"
    click.echo(f"operation {got.id} {got.status} ({note})")


@op.command()
@click.argument("operation_id", type=int)
@json_option
@pass_state
def show(state: CliState, operation_id: int, as_json: bool) -> None:
    """Everything about one operation: request, owner and lease, intent, external reference,
    polled state and its history, cancel request, result and error."""
    with db_conn(state) as conn:
        emit_one(api.get(conn, operation_id), as_json)


@op.command("list")
@click.option("--kind")
@click.option("--target")
@click.option("--status", type=click.Choice([*api.STATUSES, "in_flight"]))
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@json_option
@pass_state
def list_(state: CliState, kind: str | None, target: str | None, status: str | None,
          limit: int, as_json: bool) -> None:
    """Newest operations first."""
    with db_conn(state) as conn:
        rows = api.list_operations(conn, kind, target, status, limit)
    emit(rows, as_json, ["id", "kind", "target", "status", "fence", "locked_by", "issue_count",
                         "external_ref", "external_state", "cancel_requested", "error"])


@op.command()
@click.argument("operation_id", type=int)
@click.option("--by", help="Who cancels (default: the database user).")
@pass_state
def cancel(state: CliState, operation_id: int, by: str | None) -> None:
    """Cancel: at once if nothing was started outside, else ask the owner to cancel it."""
    with db_conn(state) as conn:
        outcome = api.cancel(conn, operation_id, by)
        status = api.get(conn, operation_id)["status"]
    if outcome == "canceled":
        click.echo(f"operation {operation_id} canceled")
    elif outcome == "cancel_requested":
        click.echo(f"operation {operation_id} cancel requested; its owner cancels it on its "
                   "next poll")
    else:
        click.echo(f"operation {operation_id} already ended: {status}", err=True)
        raise SystemExit(1)


@op.command()
@click.argument("operation_id", type=int)
@click.option("--timeout", type=click.FloatRange(0), default=300.0, show_default=True,
              help="Seconds to wait.")
@click.option("--interval", type=click.FloatRange(0.05), default=0.5, show_default=True)
@json_option
@pass_state
def wait(state: CliState, operation_id: int, timeout: float, interval: float,
         as_json: bool) -> None:
    """Wait until the operation ends; print it. Exit 0 if it succeeded, 1 otherwise
    (2 on timeout)."""
    deadline = time.monotonic() + timeout
    with db_conn(state) as conn:
        while True:
            row: dict[str, Any] = api.get(conn, operation_id)
            if row["status"] in api.TERMINAL or time.monotonic() >= deadline:
                break
            time.sleep(interval)
    emit_one(row, as_json)
    if row["status"] not in api.TERMINAL:
        raise SystemExit(2)
    if row["status"] != "succeeded":
        raise SystemExit(1)


@op.command()
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", type=int, default=8765, show_default=True, help="0 = a free port.")
@click.option("--mode", type=click.Choice(["idempotent", "plain"]), default="idempotent",
              show_default=True, help="idempotent: honour Idempotency-Key; plain: ignore it.")
@click.option("--queue-time", type=click.FloatRange(0), default=1.0, show_default=True)
@click.option("--run-time", type=click.FloatRange(0), default=3.0, show_default=True)
@click.option("--start-delay", type=click.FloatRange(0), default=0.0, show_default=True,
              help="Seconds between starting an operation and answering the request.")
@click.option("--result-delay", type=click.FloatRange(0), default=0.0, show_default=True)
def simulator(host: str, port: int, mode: str, queue_time: float, run_time: float,
              start_delay: float, result_delay: float) -> None:
    """Run the local slow-operations HTTP service (see pgfence_demo.simulator)."""
    sim_module = import_demo("simulator", "pgfence op simulator")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s simulator: %(message)s",
                        force=True)
    sim = sim_module.Simulator(mode=mode, queue_time=queue_time, run_time=run_time,
                               start_delay=start_delay, result_delay=result_delay)
    asyncio.run(sim_module.run(sim, host, port))
