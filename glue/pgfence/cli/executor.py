"""``pgfence executor``: run the executor process.

Its settings have one schema, :data:`SETTINGS`: each is a command-line option
(``--poll-interval``) and a key of the TOML file's ``[executor]`` table (``poll_interval``),
converted and checked by the same click type, so a bad value is the same one-line usage error
from either place. An option given on the command line wins over the file, the file over the
default.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource

from ..db import Liveness, resolve_dsn
from ..executor import Executor, ExecutorConfig, Module, OutboxModule
from ..logjson import JsonFormatter
from ..transports import Transport, parse_route
from ._common import CliState, pass_state


class _Name(click.ParamType[str]):
    """A non-empty name of at most 200 characters (a worker id)."""

    name = "name"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value)
        if not text.strip() or len(text) > 200:
            self.fail(f"{value!r} is not a name of 1-200 characters", param, ctx)
        return text


@dataclass(frozen=True)
class Setting:
    """One executor setting: option ``--<key with dashes>`` and TOML key ``[executor] <key>``."""

    key: str
    type: click.ParamType[Any]
    default: Any
    help: str
    aliases: tuple[str, ...] = ()
    flag: str | None = None  # booleans: "--x/--no-x"

    @property
    def option(self) -> str:
        return "--" + self.key.replace("_", "-")


_LEVELS = ["debug", "info", "warning", "error"]

#: Every executor setting, for the command line and the TOML file alike.
SETTINGS: tuple[Setting, ...] = (
    Setting("concurrency", click.IntRange(1, 10000), 16, "Deliveries (units of work) at once."),
    Setting("batch", click.IntRange(1, 10000), 50, "Units per claim round."),
    Setting("prefetch_wait", click.FloatRange(0, 60), 0.1,
            "While recent outbox deliveries were quick, claim up to two batches ahead of the free "
            "slots if the last one would wait at most N seconds for a slot (0 = never)."),
    Setting("poll_interval", click.FloatRange(0.05, 3600), 5.0,
            "Sweep every N seconds even without NOTIFY."),
    Setting("reap_interval", click.FloatRange(0.05, 3600), 10.0,
            "Run the reapers every N seconds.", aliases=("--reclaim-interval",)),
    Setting("lease", click.FloatRange(0.1, 86400), None,
            "Outbox claim lease in seconds (at most 1 day); default: each channel's lease."),
    Setting("grace", click.FloatRange(0, 86400), 30.0,
            "Seconds in-flight work may take after SIGTERM."),
    Setting("worker_id", _Name(), None, "Name to claim under [host:pid:random]."),
    Setting("plans", click.Choice(["start", "external", "off"]), "off",
            "Approved plans: start = take and run them (SQL steps with this executor's database "
            "role, external steps through the routes named after their actions); external = "
            "only perform external steps of runs released to executors; off: an executor runs "
            "plans only when asked to, since it runs their SQL steps with its own role."),
    Setting("plan_heartbeat", click.FloatRange(1, 86400), None,
            "Heartbeat interval in seconds for plan runs this executor takes [the plan's, 120]."),
    Setting("op_lease", click.FloatRange(0.5, 86400), 120.0, "Operation lease in seconds."),
    Setting("log_level", click.Choice(_LEVELS), "info",
            "info logs one line per delivery; warning only retries, failures and lapses."),
    Setting("log_format", click.Choice(["text", "json"]), "text",
            "json: one JSON object per line (time, level, event, module, id, channel/kind, "
            "attempt/fence, worker, outcome, duration_ms, error)."),
    Setting("metrics_port", click.IntRange(0, 65535), None,
            "Serve /metrics (Prometheus), /healthz and /readyz on this port (0 = a free one, "
            "logged at start) [off]."),
    Setting("metrics_host", click.STRING, "127.0.0.1",
            "The address of --metrics-port (0.0.0.0 for every interface, e.g. in a container)."),
    Setting("otel", click.BOOL, False,
            "OpenTelemetry spans per outbox delivery, plan step and operation issue/poll, "
            "children of the enqueuer's span (pip install 'pgfence[otel]'; an SDK and exporter "
            "from the application or opentelemetry-instrument; off when OTEL_SDK_DISABLED=true; "
            "docs/tracing.md).", flag="--otel/--no-otel"),
    Setting("listen_dsn", click.STRING, None,
            "DSN of the LISTEN connection, when --dsn goes through a transaction-mode pooler: "
            "a direct or session-mode connection [the --dsn]."),
    Setting("prepare", click.BOOL, True,
            "Server-side prepared statements (psycopg's, after 5 runs of a statement); "
            "--no-prepare behind a transaction-mode pooler (PgBouncer before 1.21).",
            flag="--prepare/--no-prepare"),
    Setting("query_timeout", click.FloatRange(0.5, 3600), 15.0,
            "Seconds one database call may go unanswered before its connection is closed "
            "and the call counts as a lost connection (never past the lease it records)."),
    Setting("probe_interval", click.FloatRange(0.2, 300), 5.0,
            "Seconds of listener silence before its heartbeat query."),
    Setting("probe_timeout", click.FloatRange(0.2, 300), 5.0,
            "Seconds a probe (listener heartbeat, idle-connection check, start-up NOTIFY "
            "self-check) may take before the connection counts as dead."),
    Setting("keepalive_idle", click.IntRange(1, 7200), 10,
            "TCP keepalive: seconds of silence before the first probe."),
    Setting("keepalive_interval", click.IntRange(1, 600), 5, "TCP keepalive: seconds between probes."),
    Setting("keepalive_count", click.IntRange(1, 100), 3,
            "TCP keepalive: unanswered probes before the connection is dropped."),
    Setting("tcp_user_timeout", click.FloatRange(0, 3600), 30.0,
            "Seconds sent data may stay unacknowledged before the connection is dropped "
            "(0 = the kernel's default)."),
)
_BY_KEY = {s.key: s for s in SETTINGS}


def _settings_options(f: Callable[..., Any]) -> Callable[..., Any]:
    for s in reversed(SETTINGS):
        names = [s.flag] if s.flag else [s.option, *s.aliases]
        f = click.option(*names, s.key, type=None if s.flag else s.type, default=s.default,
                         show_default=s.default is not None, help=s.help)(f)
    return f


def _load_config(path: Path | None) -> dict[str, Any]:
    if path is None:
        return {}
    import tomllib  # only with --config

    try:
        with open(path, "rb") as fh:
            return tomllib.load(fh)
    except tomllib.TOMLDecodeError as exc:
        raise click.BadParameter(f"{path} is not valid TOML: {exc}", param_hint="--config") from exc
    except OSError as exc:
        raise click.BadParameter(f"cannot read {path}: {exc.strerror}", param_hint="--config") from exc


def _table(conf: dict[str, Any], name: str, path: Path | None) -> dict[str, Any]:
    value = conf.get(name, {})
    if not isinstance(value, dict):
        raise click.BadParameter(f"[{name}] must be a table, got {type(value).__name__}",
                                 param_hint=f"{path}")
    return value


def _strings(table: dict[str, Any], name: str, path: Path | None) -> dict[str, str]:
    for key, value in table.items():
        if not isinstance(value, str):
            raise click.BadParameter(f"{key} must be a string, got {value!r}",
                                     param_hint=f"[{name}] in {path}")
    return dict(table)


def _from_file(ctx: click.Context, key: str, value: Any, path: Path | None) -> Any:
    """A TOML value through the option's own type, as if it had been typed after the option."""
    param = next(p for p in ctx.command.params if p.name == key)
    hint = f"'[executor] {key}' in {path}"
    if not isinstance(value, str | int | float | bool):  # a table, an array, a date
        raise click.BadParameter(f"expected a single value, got {value!r}", ctx, param_hint=hint)
    # As typed on the command line: true/false for booleans, numbers as written.
    text: Any = str(value).lower() if isinstance(value, bool) else str(value)
    try:
        return param.type.convert(text, param, ctx)
    except click.BadParameter as exc:
        exc.param_hint = hint
        raise


def resolve_settings(ctx: click.Context, given: dict[str, Any],
                     section: dict[str, Any], path: Path | None) -> dict[str, Any]:
    """Each setting's value: the command line's, else the file's (checked by the same type),
    else the default. Raises click.BadParameter for an unknown key or a bad value."""
    if unknown := sorted(set(section) - set(_BY_KEY)):
        raise click.BadParameter(f"unknown setting(s) {', '.join(unknown)}",
                                 param_hint=f"[executor] in {path}")
    out: dict[str, Any] = {}
    for key in _BY_KEY:
        source = ctx.get_parameter_source(key)
        if source in (ParameterSource.COMMANDLINE, ParameterSource.ENVIRONMENT) \
                or key not in section:
            out[key] = given[key]
        else:
            out[key] = _from_file(ctx, key, section[key], path)
    return out


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


def _shares(table: dict[str, Any], path: Path | None, given: tuple[str, ...]) -> dict[str, int]:
    """The module shares: the ``[shares]`` table, then ``--share MODULE=N`` (which wins)."""
    out: dict[str, int] = {}
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 1000:
            raise click.BadParameter(f"{key} must be a whole number from 1 to 1000, got {value!r}",
                                     param_hint=f"[shares] in {path}")
        out[key] = value
    for name, spec in _pairs(given, "MODULE=N", "--share").items():
        if not spec.isdigit() or not 1 <= int(spec) <= 1000:
            raise click.BadParameter(f"{name}: expected a whole number from 1 to 1000, got {spec!r}",
                                     param_hint="--share")
        out[name] = int(spec)
    return out


def _pairs(items: tuple[str, ...], what: str, option: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or not name or not spec:
            raise click.BadParameter(f"expected {what}, got {item!r}", param_hint=option)
        out[name] = spec
    return out


@click.command("executor")
@click.option("--route", "routes", multiple=True, metavar="CHANNEL=TRANSPORT",
              help="Deliver CHANNEL with TRANSPORT (repeatable; CHANNEL '*' = every other "
                   "channel). TRANSPORT: log | noop | webhook | webhook:<url> | "
                   "smtp://host:port?from=addr | python:module:function.")
@click.option("--op-kind", "op_kinds", multiple=True, metavar="KIND=HANDLER",
              help="Run operations of KIND with HANDLER (repeatable): "
                   "simulator:<url>[?idempotent=1|0&poll=<s>] | python:module:factory.")
@click.option("--share", "shares", multiple=True, metavar="MODULE=N",
              help="Weigh MODULE (outbox, plan, operation) N when modules compete for slots "
                   "(repeatable; default 1 each): each holds about concurrency*N/total slots, "
                   "and a freed slot goes to the least served module with due work.")
@click.option("--config", "config_path", type=click.Path(exists=True, dir_okay=False, path_type=Path),
              help="TOML file: an [executor] table with any of the settings below (underscores "
                   "for dashes), [routes], [operations] and [shares] tables. Command-line "
                   "options win.")
@_settings_options
@pass_state
@click.pass_context
def executor_cmd(ctx: click.Context, state: CliState, /, routes: tuple[str, ...],
                 op_kinds: tuple[str, ...], shares: tuple[str, ...], config_path: Path | None,
                 **given: Any) -> None:
    """Deliver outbox messages, run approved plans and long operations: LISTEN, sweep, claim, act, record.

    \b
    Examples:
      pgfence executor --route orders=webhook --route mail='smtp://127.0.0.1:25?from=me@x.org'
      pgfence executor --config executor.toml
      pgfence executor --op-kind branch.reset=simulator:http://127.0.0.1:8765
      pgfence --dsn postgresql://app@pgbouncer:6432/shop executor --no-prepare \\
          --listen-dsn postgresql://app@db:5432/shop --route orders=webhook

    \b
    executor.toml:
      [executor]
      concurrency = 32
      batch = 20
      log_level = "warning"
      [routes]
      orders = "webhook"
      audit = "log"
      [shares]
      plan = 2

    SIGTERM stops claiming and lets in-flight deliveries finish within --grace seconds. At start
    the executor checks the schema version and that its login may call what it will call
    (otherwise it stops, naming the GRANT), and that a NOTIFY comes back to its listener
    (otherwise it warns: wake-ups then wait for the sweep).
    """
    conf = _load_config(config_path)
    if extra := set(conf) - {"executor", "routes", "operations", "shares"}:
        raise click.BadParameter(f"unknown table(s) {', '.join(sorted(extra))}; expected "
                                 "[executor], [routes], [operations], [shares]",
                                 param_hint="--config")
    v = resolve_settings(ctx, given, _table(conf, "executor", config_path), config_path)
    route_specs = _strings(_table(conf, "routes", config_path), "routes", config_path)
    route_specs.update(_pairs(routes, "CHANNEL=TRANSPORT", "--route"))
    op_specs = _strings(_table(conf, "operations", config_path), "operations", config_path)
    op_specs.update(_pairs(op_kinds, "KIND=HANDLER", "--op-kind"))
    share_of = _shares(_table(conf, "shares", config_path), config_path, shares)
    if not route_specs and not op_specs and v["plans"] == "off":
        raise click.UsageError("give at least one --route CHANNEL=TRANSPORT or --op-kind "
                               "KIND=HANDLER (or a [routes] / [operations] table), or --plans")
    transports: dict[str, Transport] = {}
    for channel, spec in route_specs.items():
        try:
            transports[channel] = parse_route(spec)
        except ValueError as exc:
            raise click.BadParameter(f"{channel}: {exc}", param_hint="--route") from exc

    config = ExecutorConfig(
        concurrency=v["concurrency"], batch=v["batch"], poll_interval=v["poll_interval"],
        reap_interval=v["reap_interval"], grace=v["grace"], query_timeout=v["query_timeout"],
        prefetch_wait=v["prefetch_wait"], shares=share_of,
        probe_interval=v["probe_interval"], probe_timeout=v["probe_timeout"],
        listen_dsn=v["listen_dsn"], prepare_threshold=5 if v["prepare"] else None,
        metrics_port=v["metrics_port"], metrics_host=v["metrics_host"], otel=v["otel"],
        liveness=Liveness(connect_timeout=state.connect_timeout,
                          keepalives_idle=v["keepalive_idle"],
                          keepalives_interval=v["keepalive_interval"],
                          keepalives_count=v["keepalive_count"],
                          tcp_user_timeout=v["tcp_user_timeout"]),
    )
    if v["worker_id"]:
        config.worker_id = v["worker_id"]
    modules: list[Module] = []
    if transports:
        lease = v["lease"]
        modules.append(OutboxModule(
            transports, lease=dt.timedelta(seconds=lease) if lease else None))
    if v["plans"] != "off":
        from ..plan.module import PlanModule

        hb = v["plan_heartbeat"]
        modules.append(PlanModule(transports, external_only=v["plans"] == "external",
                                  heartbeat=dt.timedelta(seconds=hb) if hb else None))
    if op_specs:
        modules.append(_operation_module(op_specs, v["op_lease"]))
    names = {m.name for m in modules}
    if unknown := sorted(set(share_of) - names):
        raise click.BadParameter(f"no module {', '.join(unknown)} runs here (modules: "
                                 f"{', '.join(sorted(names))})", param_hint="--share")
    try:
        executor = Executor(resolve_dsn(state.dsn), modules, config)
    except RuntimeError as exc:  # --otel without OpenTelemetry installed
        raise click.UsageError(str(exc)) from exc
    logging.getLogger("pgfence").setLevel(v["log_level"].upper())
    if v["log_format"] == "json":
        formatter = JsonFormatter(worker=config.worker_id)
        for handler in logging.getLogger().handlers:
            handler.setFormatter(formatter)
    executor.run_forever()
