"""``pgfence migrate``."""

from __future__ import annotations

import click

from ..db import resolve_dsn
from ..migrate import migrate
from ._common import CliState, pass_state


@click.command("migrate")
@click.option("--lock-timeout", type=click.FloatRange(1, 3600), default=120, show_default=True,
              help="Seconds to wait for another migrate holding the migration lock.")
@click.option("--break-lock", is_flag=True,
              help="Remove a migration lock left by a migrate that was killed, then migrate.")
@pass_state
def migrate_cmd(state: CliState, lock_timeout: float, break_lock: bool) -> None:
    """Install or upgrade schema pgfence: pending table migrations, then every function.

    Safe to run any number of times; a second run in a row changes nothing. Needs no superuser:
    the login must own the database (or have CREATE on it) and either have CREATEROLE or find
    pgfence's roles created and be a member of pgfence_definer; a missing privilege is reported
    with the statement that grants it.
    """
    dsn = state.liveness.dsn(resolve_dsn(state.dsn))
    result = migrate(dsn, lock_timeout=lock_timeout, break_lock=break_lock)
    if result.adopted:
        click.echo(f"recorded as installed by schema/pgfence.sql: {', '.join(result.adopted)}")
    if result.applied:
        click.echo(f"applied migrations: {', '.join(result.applied)}")
    else:
        click.echo("no pending migrations")
    click.echo(f"functions applied: {len(result.functions)} files; "
               f"schema version {result.schema_version}")
