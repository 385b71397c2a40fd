"""``pgfence migrate``."""

from __future__ import annotations

import click

from ..migrate import migrate
from ._common import CliState, pass_state


@click.command("migrate")
@pass_state
def migrate_cmd(state: CliState) -> None:
    """Install or upgrade schema pgfence: pending table migrations, then every function.

    Safe to run any number of times; a second run in a row changes nothing.
    """
    result = migrate(state.dsn)
    if result.applied:
        click.echo(f"applied migrations: {', '.join(result.applied)}")
    else:
        click.echo("no pending migrations")
    click.echo(f"functions applied: {len(result.functions)} files; "
               f"schema version {result.schema_version}")
