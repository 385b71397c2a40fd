"""``pgfence demo``: run the demo scenes (package ``pgfence_demo`` of the source checkout)."""

from __future__ import annotations

import os
import sys

import click

from ..db import create_database, drop_database
from ..embedded import EmbeddedPostgres, save_dev_cluster
from ._common import CliState, import_demo, pass_state


@click.command()
@click.option("--scene", "scenes", multiple=True, help="Run only this scene (repeatable).")
@click.option("--keep", is_flag=True, help="Leave the throwaway cluster running afterwards as "
              "the dev cluster, so `pgfence status` etc. can explore what the demo left.")
@pass_state
def demo(state: CliState, scenes: tuple[str, ...], keep: bool) -> None:
    """Run the demo: real executors, receivers and crashes, with checks; exit 1 if any fails.

    Uses --dsn / DATABASE_URL when given (the demo's rows stay there, tagged with a run id);
    otherwise starts a throwaway PostgreSQL and removes it at the end (unless --keep).
    """
    run_demo = import_demo("", "pgfence demo").run_demo
    dsn = state.dsn or os.environ.get("DATABASE_URL")
    if dsn:
        sys.exit(run_demo(dsn, scenes or None))
    pg = EmbeddedPostgres()
    info = pg.start()
    code = 1
    try:
        click.echo(f"throwaway PostgreSQL started in {info.root}")
        drop_database(info.url, "pgfence_demo")
        demo_dsn = create_database(info.url, "pgfence_demo")
        code = run_demo(demo_dsn, scenes or None)
    finally:
        if keep:
            save_dev_cluster(info)
            click.echo(f"cluster kept: DATABASE_URL='{demo_dsn}'  (pgfence db stop removes it)")
        else:
            pg.stop()
            click.echo("throwaway PostgreSQL stopped and removed")
    sys.exit(code)
