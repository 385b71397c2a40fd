"""The ``pgfence`` command line.

Every command talks to the database chosen by ``--dsn``, else ``$DATABASE_URL``, else the dev
cluster of ``pgfence db start`` (see :mod:`pgfence.db`). Read commands take ``--json``.
Each module adds its group to :data:`COMMANDS`: ``outbox``, ``plan``, ``op``, ``doc``.
"""

from __future__ import annotations

import importlib
import logging
import sys

import click
import psycopg

from .. import SCHEMA_VERSION, __version__
from ..db import NoDatabase
from ..errors import PgfenceError
from ..paths import SqlNotFound
from ._common import CliState, DemoNotInstalled

#: Each command's module and attribute, imported only when the command runs (or --help lists
#: it): `pgfence executor` does not wait for yoyo, tabulate, prometheus-client, the web stack.
COMMANDS: dict[str, tuple[str, str]] = {
    "db": ("db", "db"), "demo": ("demo", "demo"), "migrate": ("migrate", "migrate_cmd"),
    "executor": ("executor", "executor_cmd"), "outbox": ("outbox", "outbox"),
    "plan": ("plan", "plan"), "op": ("operation", "op"), "doc": ("document", "doc"),
    "status": ("status", "status"), "metrics": ("metrics", "metrics_cmd"),
    "inspect": ("inspect", "inspect"), "purge": ("inspect", "purge"),
    "serve": ("serve", "serve_cmd"), "token": ("serve", "token_cmd"),
}
#: Errors a user can act on, printed as one line, from modules the commands import lazily: a
#: class of a module that was never imported cannot have been raised (:func:`_plain_errors`).
_LAZY_ERRORS = (("pgfence.embedded", "PostgresNotFound"), ("pgfence.migrate", "FunctionsError"),
                ("pgfence.migrate", "InstallPrivilegeError"))


def _plain_errors() -> tuple[type[BaseException], ...]:
    """The one-line errors: NoDatabase, SqlNotFound, DemoNotInstalled and those of
    :data:`_LAZY_ERRORS` whose module is loaded."""
    found: list[type[BaseException]] = [NoDatabase, SqlNotFound, DemoNotInstalled]
    for module, name in _LAZY_ERRORS:
        if (loaded := sys.modules.get(module)) is not None:
            found.append(getattr(loaded, name))
    return tuple(found)


def _lock_timeout() -> type[BaseException] | None:
    """yoyo's LockTimeout if yoyo is loaded (only `pgfence migrate` and `db` load it)."""
    loaded = sys.modules.get("yoyo.exceptions")
    return None if loaded is None else loaded.LockTimeout

_ROLE_HINT = ("this database login lacks the pgfence role for that command (pgfence_client, "
              "pgfence_executor or pgfence_admin)")


def _fail(message: str, sqlstate: str | None, detail: str | None, hint: str | None) -> None:
    msg = f"pgfence: {message}"
    if sqlstate:
        msg += f" [{sqlstate}]"
    if detail:
        msg += f"\n  detail: {detail}"
    if sqlstate == "42501" and not hint:
        hint = _ROLE_HINT
    if hint:
        msg += f"\n  hint: {hint}"
    click.echo(msg, err=True)
    sys.exit(1)


class _Group(click.Group):
    """Turns the errors a user can act on into one clear line and exit code 1 (2 for usage).

    Its commands are imported when used (:data:`COMMANDS`; click's lazy-loading pattern).
    """

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*self.commands, *COMMANDS})

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name not in self.commands and cmd_name in COMMANDS:
            module, attr = COMMANDS[cmd_name]
            cmd = getattr(importlib.import_module(f"{__name__}.{module}"), attr)
            assert isinstance(cmd, click.Command) and cmd.name == cmd_name, cmd_name
            self.add_command(cmd)
        return self.commands.get(cmd_name)

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except PgfenceError as exc:
            _fail(str(exc), exc.sqlstate, exc.detail, exc.hint)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            click.echo(f"pgfence: cannot reach the database: {first}", err=True)
            sys.exit(1)
        except psycopg.Error as exc:
            _fail(exc.diag.message_primary or str(exc).strip(), exc.sqlstate,
                  exc.diag.message_detail, exc.diag.message_hint)
        except Exception as exc:
            if isinstance(exc, _plain_errors()):
                click.echo(f"pgfence: {exc}", err=True)
                sys.exit(1)
            if (lock_timeout := _lock_timeout()) is not None and isinstance(exc, lock_timeout):
                click.echo(f"pgfence: {exc}\n  hint: if no `pgfence migrate` is running, remove "
                           "the stale lock with `pgfence migrate --break-lock`", err=True)
                sys.exit(1)
            raise
        return None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="pgfence",
                      message=f"%(prog)s %(version)s (schema version {SCHEMA_VERSION})")
@click.option("--dsn", envvar="PGFENCE_DSN", metavar="DSN",
              help="Database to use (libpq URI or key=value). Default: $DATABASE_URL, "
                   "else the dev cluster from `pgfence db start`.")
@click.option("--connect-timeout", envvar="PGFENCE_CONNECT_TIMEOUT", type=click.FloatRange(2, 3600),
              default=10, show_default=True, metavar="SECONDS",
              help="Give up on a database that does not complete the connection within this "
                   "time (every command; unless the DSN sets connect_timeout).")
@click.option("-v", "--verbose", count=True, help="More logging (-v info, -vv debug).")
@click.pass_context
def main(ctx: click.Context, dsn: str | None, connect_timeout: float, verbose: int) -> None:
    """pgfence — durable step execution and versioned documents in PostgreSQL.

    \b
    Quick start (a throwaway local PostgreSQL):
      pgfence db start            # prints the DATABASE_URL it started
      pgfence migrate             # install / upgrade schema pgfence
      pgfence outbox enqueue --channel hooks --recipient http://127.0.0.1:8080/hook '{"hi": 1}'
      pgfence executor --route hooks=webhook
      pgfence status
      pgfence db stop
    """
    level = logging.WARNING - 10 * verbose
    logging.basicConfig(level=max(level, logging.DEBUG),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    ctx.obj = CliState(dsn=dsn, connect_timeout=connect_timeout)
