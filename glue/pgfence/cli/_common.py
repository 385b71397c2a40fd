"""Helpers shared by the CLI commands: the connection, and table / JSON output."""

from __future__ import annotations

import datetime as dt
import decimal
import importlib
import json
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import click
import psycopg

from ..db import Liveness, connect
from ..errors import translate


@dataclass
class CliState:
    """Per-invocation state: the ``--dsn`` given on the command line (or None) and the
    ``--connect-timeout`` (seconds) for every connection the command opens."""

    dsn: str | None
    connect_timeout: float = 10.0

    @property
    def liveness(self) -> Liveness:
        """Connect timeout and TCP keepalives for this command's connections."""
        return Liveness(connect_timeout=self.connect_timeout)


pass_state = click.make_pass_decorator(CliState)

#: The demo scenes and the stand-ins they run (receivers, the operation simulator, the fault
#: proxy): a package of the source checkout, not of the pgfence wheel.
DEMO_PACKAGE = "pgfence_demo"


class DemoNotInstalled(RuntimeError):
    """A command that needs :data:`DEMO_PACKAGE` runs where only the pgfence wheel is installed."""


def import_demo(module: str, command: str) -> ModuleType:
    """Import ``pgfence_demo.<module>`` for ``command`` (e.g. ``"pgfence demo"``).

    Raises:
        DemoNotInstalled: the package is absent; the message (one line) says what to install.
    """
    name = f"{DEMO_PACKAGE}.{module}" if module else DEMO_PACKAGE
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name not in (DEMO_PACKAGE, name):
            raise
        raise DemoNotInstalled(
            f"{command} needs the package {DEMO_PACKAGE}, which the pgfence wheel does not "
            "include: install pgfence from its source checkout (`make demo` there, or "
            "`pip install -e <checkout>`)") from None


@contextmanager
def db_conn(state: CliState) -> Iterator[psycopg.Connection[Any]]:
    """Autocommit connection (schema version checked); SQLSTATE errors become pgfence ones."""
    with connect(state.dsn, liveness=state.liveness) as conn:
        try:
            yield conn
        except psycopg.Error as exc:
            raise translate(exc) from exc


def read_arg_text(value: str, param_hint: str) -> str:
    """An argument's text: ``-`` reads stdin, ``@path`` the file at path, anything else is itself.

    Raises:
        click.BadParameter: the file cannot be read (the message names the OS error).
    """
    if value == "-":
        return sys.stdin.read()
    if value.startswith("@"):
        try:
            with open(value[1:], encoding="utf-8") as fh:
                return fh.read()
        except (OSError, UnicodeDecodeError) as exc:
            raise click.BadParameter(str(exc), param_hint=param_hint) from exc
    return value


def parse_json(text: str, param_hint: str, want: type | None = None, want_text: str = "") -> Any:
    """The JSON of a command-line argument (``param_hint`` names it in the error).

    Raises:
        click.BadParameter: ``text`` is not JSON, or not an instance of ``want`` (the message
            is then ``want_text``, e.g. "must be a JSON object").
    """
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=param_hint) from exc
    if want is not None and not isinstance(value, want):
        raise click.BadParameter(want_text, param_hint=param_hint)
    return value


def _jsonable(value: Any) -> Any:
    if isinstance(value, dt.datetime | dt.date):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return float(value)
    return value


def fmt_value(value: Any) -> str:
    """Human text for one cell: intervals as seconds, timestamps to the millisecond in UTC."""
    if value is None:
        return ""
    if isinstance(value, dt.timedelta):
        return f"{value.total_seconds():.1f}s"
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + "Z"
    if isinstance(value, dict | list):
        text = json.dumps(value, separators=(",", ":"))
        return text if len(text) <= 60 else text[:57] + "..."
    return str(value)


def emit(rows: Sequence[dict[str, Any]], as_json: bool, columns: Sequence[str] | None = None,
         empty: str = "(none)") -> None:
    """Print ``rows`` as a table (or JSON array with ``as_json``), in ``columns`` order."""
    cols = list(columns) if columns else (list(rows[0].keys()) if rows else [])
    if as_json:
        click.echo(json.dumps([{c: _jsonable(r.get(c)) for c in cols} for r in rows], indent=2))
        return
    if not rows:
        click.echo(empty)
        return
    from tabulate import tabulate  # only for a table (~10 ms of import)

    click.echo(tabulate([[fmt_value(r.get(c)) for c in cols] for r in rows], headers=cols))


def emit_one(row: dict[str, Any], as_json: bool) -> None:
    """Print one record as ``key: value`` lines (or a JSON object)."""
    if as_json:
        click.echo(json.dumps({k: _jsonable(v) for k, v in row.items()}, indent=2))
        return
    width = max(len(k) for k in row)
    for key, value in row.items():
        text = json.dumps(value) if isinstance(value, dict | list) else fmt_value(value)
        click.echo(f"{key.rjust(width)}: {text}")


json_option = click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
