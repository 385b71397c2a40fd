"""The ``pgfence`` command line.

Every command talks to the database chosen by ``--dsn``, else ``$DATABASE_URL``, else the dev
cluster of ``pgfence db start`` (see :mod:`pgfence.db`). Read commands take ``--json``.
Each module adds its group here: ``outbox``, ``plan``, ``op``, ``doc``.
"""

from __future__ import annotations

import logging
import sys

import click
import psycopg
from yoyo.exceptions import LockTimeout

from .. import SCHEMA_VERSION, __version__
from ..db import NoDatabase
from ..embedded import PostgresNotFound
from ..errors import PgfenceError
from ..migrate import FunctionsError, InstallPrivilegeError
from ..paths import SqlNotFound
from ._common import CliState, DemoNotInstalled

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
    """Turns the errors a user can act on into one clear line and exit code 1 (2 for usage)."""

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except (NoDatabase, PostgresNotFound, SqlNotFound, InstallPrivilegeError, FunctionsError,
                DemoNotInstalled) as exc:
            click.echo(f"pgfence: {exc}", err=True)
            sys.exit(1)
        except PgfenceError as exc:
            _fail(str(exc), exc.sqlstate, exc.detail, exc.hint)
        except psycopg.OperationalError as exc:
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            click.echo(f"pgfence: cannot reach the database: {first}", err=True)
            sys.exit(1)
        except psycopg.Error as exc:
            _fail(exc.diag.message_primary or str(exc).strip(), exc.sqlstate,
                  exc.diag.message_detail, exc.diag.message_hint)
        except LockTimeout as exc:
            click.echo(f"pgfence: {exc}\n  hint: if no `pgfence migrate` is running, remove the "
                       "stale lock with `pgfence migrate --break-lock`", err=True)
            sys.exit(1)
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


def _register() -> None:
    from .db import db
    from .demo import demo
    from .document import doc
    from .executor import executor_cmd
    from .inspect import inspect, purge
    from .metrics import metrics_cmd
    from .migrate import migrate_cmd
    from .operation import op
    from .outbox import outbox
    from .plan import plan
    from .serve import serve_cmd, token_cmd
    from .status import status

    for cmd in (db, demo, migrate_cmd, executor_cmd, outbox, plan, op, doc, status, metrics_cmd,
                inspect, purge, serve_cmd, token_cmd):
        main.add_command(cmd)


_register()
