"""``pgfence plan``: propose, approve, reject, execute, show, list, compensate; the allow-list."""

from __future__ import annotations

import datetime as dt
import json
import os
import socket
from typing import Any

import click

from .. import plan as api
from ._common import (
    CliState,
    db_conn,
    emit,
    emit_one,
    fmt_value,
    json_option,
    parse_json,
    pass_state,
    read_arg_text,
)


def _steps_arg(value: str) -> list[dict[str, Any]]:
    """STEPS as JSON text, ``@file`` or ``-`` (stdin)."""
    text = read_arg_text(value, "STEPS")
    steps: list[Any] = parse_json(text, "STEPS", list, "a JSON array of steps")
    return steps


def _default_worker() -> str:
    return f"cli:{socket.gethostname()}:{os.getpid()}"


@click.group()
def plan() -> None:
    """Approved plans: someone proposes steps, a person approves, pgfence runs them in order.

    \b
    A step is {"action": NAME, "args": {...}, "note": "..."}; NAME must be on the allow-list
    (`pgfence plan actions`). Every step that committed has a receipt written in the same
    transaction as its effect, so after any crash `pgfence plan show ID` tells exactly which
    steps happened.
    """


@plan.command()
@click.option("--by", "proposed_by", required=True, help="Who proposes (person, script, agent).")
@click.option("--ttl", type=click.FloatRange(1), default=86400.0, show_default=True,
              help="Seconds the plan may wait for approval.")
@click.option("--key", "idempotency_key", help="Idempotency key: a repeat returns the same plan.")
@click.option("--compensates", type=int, help="Id of the executed or failed plan this one undoes.")
@click.argument("steps")
@pass_state
def propose(state: CliState, proposed_by: str, ttl: float, idempotency_key: str | None,
            compensates: int | None, steps: str) -> None:
    """Propose a plan of STEPS (a JSON array, @file or - for stdin); prints its id."""
    body = _steps_arg(steps)
    with db_conn(state) as conn:
        pid = api.propose(conn, body, proposed_by, ttl=dt.timedelta(seconds=ttl),
                          idempotency_key=idempotency_key, compensates=compensates)
    click.echo(pid)


@plan.command()
@click.argument("plan_id", type=int)
@click.option("--by", "by", required=True, help="Who proposes the compensation.")
@click.option("--ttl", type=click.FloatRange(1), default=86400.0, show_default=True,
              help="Seconds the plan may wait for approval.")
@click.option("--key", "idempotency_key", help="Idempotency key.")
@click.argument("steps")
@pass_state
def compensate(state: CliState, plan_id: int, by: str, ttl: float, idempotency_key: str | None,
               steps: str) -> None:
    """Propose a plan of STEPS that undoes PLAN_ID (executed or failed); prints its id."""
    body = _steps_arg(steps)
    with db_conn(state) as conn:
        pid = api.compensate(conn, plan_id, body, by, ttl=dt.timedelta(seconds=ttl),
                             idempotency_key=idempotency_key)
    click.echo(pid)


@plan.command()
@click.argument("plan_id", type=int)
@click.option("--by", required=True, help="Who approves (not the proposer).")
@pass_state
def approve(state: CliState, plan_id: int, by: str) -> None:
    """Approve a pending plan (exit 1 if it expired or was already decided)."""
    with db_conn(state) as conn:
        result = api.approve(conn, plan_id, by)
        status = api.get(conn, plan_id)["status"]
    if result == "approved":
        click.echo(f"plan#{plan_id} approved by {by}")
        return
    if result == "expired":
        click.echo(f"plan#{plan_id} had expired: it is now expired and can never run", err=True)
    else:
        click.echo(f"plan#{plan_id} is {status}: only a pending plan can be approved", err=True)
    raise SystemExit(1)


@plan.command()
@click.argument("plan_id", type=int)
@click.option("--by", required=True, help="Who rejects.")
@click.option("--reason", required=True, help="Why (kept with the plan and in the event log).")
@pass_state
def reject(state: CliState, plan_id: int, by: str, reason: str) -> None:
    """Reject a pending plan (exit 1 if it was no longer pending)."""
    with db_conn(state) as conn:
        ok = api.reject(conn, plan_id, by, reason)
        status = api.get(conn, plan_id)["status"]
    if ok:
        click.echo(f"plan#{plan_id} rejected by {by}")
        return
    click.echo(f"plan#{plan_id} is {status}: only a pending plan can be rejected", err=True)
    raise SystemExit(1)


@plan.command()
@click.argument("plan_id", type=int)
@click.option("--worker", default=None, help="Name to run under [cli:host:pid].")
@click.option("--heartbeat", type=click.FloatRange(1, 86400),
              help="Seconds of silence before the run counts as interrupted [120].")
@json_option
@pass_state
def execute(state: CliState, plan_id: int, worker: str | None, heartbeat: float | None,
            as_json: bool) -> None:
    """Run the plan's SQL steps now (CALL pgfence.plan_execute), one transaction per step.

    SQL actions run with the privileges of this connection's database role. The run stops at an
    error, at the end, or at an external step, which it hands to an executor. A finished plan
    runs nothing and prints its receipts. Exit status: 0 executed or handed over, 1 failed or
    not runnable.
    """
    with db_conn(state) as conn:
        result = api.execute(conn, plan_id, worker or _default_worker(),
                             dt.timedelta(seconds=heartbeat) if heartbeat else None)
        info = api.get(conn, plan_id)
        serving_plans = _serving_plans(conn)
    if as_json:
        click.echo(json.dumps({"status": result.status, "receipts": result.receipts}, indent=2))
    else:
        _print_receipts(result.receipts)
        click.echo(f"plan#{plan_id}: {_status_line(info)}")
    if result.status == "executing":
        if info["worker"] is None and not serving_plans:
            click.echo(f"plan#{plan_id} waits at step {info['next_step']}: no executor serving "
                       "plans is running; the run waits (it does not fail) until one starts "
                       "(pgfence executor --plans start|external)", err=True)
        else:
            click.echo(f"plan#{plan_id} waits at step {info['next_step']}: an executor takes it "
                       "from here (or another worker owns the run)", err=True)
    if result.status not in ("executed", "executing"):
        raise SystemExit(1)


def _serving_plans(conn: Any) -> int:
    """How many live executors serve plans (``pgfence.executor_serving``, the registry)."""
    row = conn.execute("SELECT pgfence.executor_serving('plan', '*')").fetchone()
    return int(row[0]) if row else 0


def _status_line(info: dict[str, Any]) -> str:
    text = str(info["status"])
    if info.get("failure"):
        text += f" ({info['failure']} at step {info['next_step']})"
    return text


def _print_receipts(receipts: list[dict[str, Any]]) -> None:
    emit([{**r, "error": r.get("message")} for r in receipts], False,
         ["step_index", "action", "outcome", "output", "sqlstate", "error", "worker"],
         empty="(no receipts)")


@plan.command()
@click.argument("plan_id", type=int)
@json_option
@pass_state
def show(state: CliState, plan_id: int, as_json: bool) -> None:
    """A plan: who proposed and approved it, timing, and every step with its receipt."""
    with db_conn(state) as conn:
        info = api.get(conn, plan_id)
        steps = api.steps(conn, plan_id)
        released = info["status"] == "executing" and info["worker"] is None
        serving = _serving_plans(conn) if released else 0
    if as_json:
        from ._common import _jsonable

        out = {k: _jsonable(v) for k, v in info.items() if k != "steps"}
        out["steps"] = [{k: _jsonable(v) for k, v in s.items()} for s in steps]
        click.echo(json.dumps(out, indent=2))
        return
    header: dict[str, Any] = {
        "plan": f"#{info['id']}",
        "status": _status_line(info),
        "proposed": f"by {info['proposed_by']} at {fmt_value(info['proposed_at'])}",
        "expires": fmt_value(info["expires_at"]),
    }
    if info["approved_by"]:
        header["approved"] = f"by {info['approved_by']} at {fmt_value(info['approved_at'])}"
    if info["rejected_by"]:
        header["rejected"] = (f"by {info['rejected_by']} at {fmt_value(info['rejected_at'])}: "
                              f"{info['reject_reason']}")
    if info["started_at"]:
        header["started"] = fmt_value(info["started_at"])
        header["owner"] = info["worker"] or (
            "(released: waiting for an executor with --plans)" if serving else
            "(released: waiting for an executor with --plans (none is running); it waits, "
            "it does not fail)")
        if info["status"] == "executing":
            header["heartbeat until"] = fmt_value(info["heartbeat_expires_at"])
    if info["finished_at"]:
        header["finished"] = fmt_value(info["finished_at"])
        if info["started_at"]:
            header["took"] = fmt_value(info["finished_at"] - info["started_at"])
    if info["compensates"]:
        header["compensates"] = f"plan#{info['compensates']}"
    if info["compensated_by"]:
        header["compensated by"] = ", ".join(f"plan#{c}" for c in info["compensated_by"])
    if info["idempotency_key"]:
        header["key"] = info["idempotency_key"]
    emit_one(header, False)
    click.echo("")
    emit([{**s, "result": s["output"] if s["state"] == "ok" else
           (f"{s['sqlstate']}: {s['message']}" if s["sqlstate"] else s["message"])}
          for s in steps], False,
         ["step_index", "action", "kind", "args", "state", "result", "worker", "duration"])


@plan.command("list")
@click.option("--status", type=click.Choice(["pending", "approved", "rejected", "expired",
                                             "executing", "executed", "failed"]))
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@json_option
@pass_state
def list_(state: CliState, status: str | None, limit: int, as_json: bool) -> None:
    """Newest plans first, with progress, proposer, approver and owner."""
    with db_conn(state) as conn:
        rows = api.list_plans(conn, status, limit)
    emit(rows, as_json, ["id", "status", "failure", "steps_done", "step_count", "proposed_by",
                         "approved_by", "worker", "compensates", "proposed_at", "finished_at"])


@plan.command()
@json_option
@pass_state
def actions(state: CliState, as_json: bool) -> None:
    """The allow-list: the actions a plan may name."""
    with db_conn(state) as conn:
        rows = api.actions(conn)
    emit(rows, as_json, ["name", "kind", "function", "description", "retired_at"])


@plan.command("register-action")
@click.argument("name")
@click.option("--function", "function", help="SQL action: 'schema.fn(jsonb)', a function "
              "(args jsonb) RETURNS jsonb.")
@click.option("--external", is_flag=True, help="External action, performed by the executor "
              "through the route named NAME.")
@click.option("--description", required=True, help="What it does (approvers read this).")
@pass_state
def register_action(state: CliState, name: str, function: str | None, external: bool,
                    description: str) -> None:
    """Put action NAME on the allow-list (administrators)."""
    if bool(function) == external:
        raise click.UsageError("give exactly one of --function or --external")
    with db_conn(state) as conn:
        new = api.register_action(conn, name, function, description)
    click.echo(f"action {name} {'registered' if new else 'updated'}")


@plan.command("retire-action")
@click.argument("name")
@pass_state
def retire_action(state: CliState, name: str) -> None:
    """Take action NAME off the allow-list (approved plans reaching it record an error)."""
    with db_conn(state) as conn:
        done = api.retire_action(conn, name)
    click.echo(f"action {name} {'retired' if done else 'was already retired'}")
