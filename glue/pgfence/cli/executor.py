"""``pgfence executor``: run the executor process."""

from __future__ import annotations

import datetime as dt
import logging
import tomllib
from pathlib import Path
from typing import Any

import click

from ..db import resolve_dsn
from ..executor import Executor, ExecutorConfig, Module, OutboxModule
from ..plan.module import PlanModule
from ..transports import Transport, parse_route
from ._common import CliState, pass_state


def _load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    with open(path, "rb") as fh:
        return tomllib.load(fh)


def _operation_module(specs: dict[str, str], lease_s: float) -> Module:
    from ..operation.handlers import OperationHandler, parse_handler
    from ..operation.module import OperationModule

    handlers: dict[str, OperationHandler] = {}
    for kind, spec in specs.items():
        try:
            handlers[kind] = parse_handler(spec)
        except ValueError as exc:
            raise click.BadParameter(f"{kind}: {exc}", param_hint="--op-kind") from exc
    try:
        return OperationModule(handlers, lease=dt.timedelta(seconds=float(lease_s)))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--op-lease") from exc


@click.command("executor")
@click.option("--route", "routes", multiple=True, metavar="CHANNEL=TRANSPORT",
              help="Deliver CHANNEL with TRANSPORT (repeatable; CHANNEL '*' = every other "
                   "channel). TRANSPORT: log | noop | webhook | webhook:<url> | "
                   "smtp://host:port?from=addr | python:module:function.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML file with [executor] settings and a [routes] table (CLI options win).")
@click.option("--concurrency", type=click.IntRange(1, 10000), help="Deliveries at once [16].")
@click.option("--batch", type=click.IntRange(1, 10000), help="Messages per claim [10].")
@click.option("--poll-interval", type=click.FloatRange(0.01), help="Sweep every N seconds even "
              "without NOTIFY [5].")
@click.option("--reap-interval", "--reclaim-interval", "reap_interval", type=click.FloatRange(0.01),
              help="Run the reapers every N seconds [10].")
@click.option("--lease", type=click.FloatRange(0.1, 86400), help="Claim lease in seconds (at "
              "most 1 day); default: each channel's configured lease.")
@click.option("--grace", type=click.FloatRange(0), help="Seconds in-flight work may take after "
              "SIGTERM [30].")
@click.option("--worker-id", help="Name to claim under [host:pid:random].")
@click.option("--plans", type=click.Choice(["start", "external", "off"]), default=None,
              help="Approved plans: start = take and run them (SQL steps with this executor's "
                   "database role, external steps through the routes named after their "
                   "actions); external = only perform external steps of runs released to "
                   "executors; off [off: an executor runs plans only when asked to, since it "
                   "runs their SQL steps with its own database role].")
@click.option("--plan-heartbeat", type=click.FloatRange(1, 86400),
              help="Heartbeat interval in seconds for plan runs this executor takes "
                   "[the plan's, 120].")
@click.option("--op-kind", "op_kinds", multiple=True, metavar="KIND=HANDLER",
              help="Run operations of KIND with HANDLER (repeatable): "
                   "simulator:<url>[?idempotent=1|0&poll=<s>] | python:module:factory.")
@click.option("--op-lease", type=click.FloatRange(0.5), help="Operation lease in seconds [120].")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]),
              default="info", show_default=True,
              help="info logs one line per delivery; warning only retries, failures and lapses.")
@pass_state
def executor_cmd(state: CliState, routes: tuple[str, ...], config_path: Path | None,
                 concurrency: int | None, batch: int | None, poll_interval: float | None,
                 reap_interval: float | None, lease: float | None, grace: float | None,
                 worker_id: str | None, plans: str | None, plan_heartbeat: float | None,
                 op_kinds: tuple[str, ...], op_lease: float | None, log_level: str) -> None:
    """Deliver outbox messages, run approved plans and long operations: LISTEN, sweep, claim, act, record.

    \b
    Examples:
      pgfence executor --route orders=webhook --route mail='smtp://127.0.0.1:25?from=me@x.org'
      pgfence executor --config executor.toml
      pgfence executor --op-kind branch.reset=simulator:http://127.0.0.1:8765

    \b
    executor.toml:
      [executor]
      concurrency = 32
      batch = 20
      [routes]
      orders = "webhook"
      audit = "log"

    SIGTERM stops claiming and lets in-flight deliveries finish within --grace seconds.
    """
    conf = _load_config(config_path)
    if extra := set(conf) - {"executor", "routes", "operations"}:
        raise click.BadParameter(f"unknown table(s) {', '.join(sorted(extra))}; expected "
                                 "[executor], [routes], [operations]", param_hint="--config")
    section = conf.get("executor", {})
    route_specs: dict[str, str] = dict(conf.get("routes", {}))
    for item in routes:
        channel, sep, spec = item.partition("=")
        if not sep or not channel or not spec:
            raise click.BadParameter(f"expected CHANNEL=TRANSPORT, got {item!r}", param_hint="--route")
        route_specs[channel] = spec
    plans_mode = plans or section.get("plans", "off")
    if plans_mode not in ("start", "external", "off"):
        raise click.BadParameter(f"plans must be start, external or off, got {plans_mode!r}",
                                 param_hint="[executor] plans")
    unknown = set(section) - {"concurrency", "batch", "poll_interval", "reap_interval", "grace",
                              "worker_id", "lease", "plans", "plan_heartbeat", "op_lease"}
    if unknown:
        raise click.BadParameter(f"unknown setting(s) {', '.join(sorted(unknown))}",
                                 param_hint="[executor]")
    op_specs: dict[str, str] = dict(conf.get("operations", {}))
    for item in op_kinds:
        kind, sep, spec = item.partition("=")
        if not sep or not kind or not spec:
            raise click.BadParameter(f"expected KIND=HANDLER, got {item!r}",
                                     param_hint="--op-kind")
        op_specs[kind] = spec
    if not route_specs and not op_specs and plans_mode == "off":
        raise click.UsageError("give at least one --route CHANNEL=TRANSPORT or --op-kind "
                               "KIND=HANDLER (or a [routes] / [operations] table), or --plans")
    transports: dict[str, Transport] = {}
    for channel, spec in route_specs.items():
        try:
            transports[channel] = parse_route(spec)
        except ValueError as exc:
            raise click.BadParameter(f"{channel}: {exc}", param_hint="--route") from exc

    def pick(cli_value: Any, key: str, default: Any) -> Any:
        return cli_value if cli_value is not None else section.get(key, default)

    config = ExecutorConfig(
        concurrency=int(pick(concurrency, "concurrency", 16)),
        batch=int(pick(batch, "batch", 10)),
        poll_interval=float(pick(poll_interval, "poll_interval", 5.0)),
        reap_interval=float(pick(reap_interval, "reap_interval", 10.0)),
        grace=float(pick(grace, "grace", 30.0)),
    )
    if wid := pick(worker_id, "worker_id", None):
        config.worker_id = str(wid)
    lease_s = pick(lease, "lease", None)
    modules: list[Module] = []
    if transports:
        modules.append(OutboxModule(
            transports, lease=dt.timedelta(seconds=float(lease_s)) if lease_s else None))
    if plans_mode != "off":
        hb = pick(plan_heartbeat, "plan_heartbeat", None)
        modules.append(PlanModule(transports, external_only=plans_mode == "external",
                                  heartbeat=dt.timedelta(seconds=float(hb)) if hb else None))
    if op_specs:
        modules.append(_operation_module(op_specs, pick(op_lease, "op_lease", 120.0)))
    executor = Executor(resolve_dsn(state.dsn), modules, config)
    logging.getLogger("pgfence").setLevel(log_level.upper())
    executor.run_forever()
