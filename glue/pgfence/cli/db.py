"""``pgfence db``: a throwaway local PostgreSQL for development, the demo and the tests."""

from __future__ import annotations

import os
import subprocess
import sys

import click

from ..embedded import (
    EmbeddedPostgres,
    forget_dev_cluster,
    load_dev_cluster,
    save_dev_cluster,
    stop_cluster,
    throwaway_cluster,
)


@click.group()
def db() -> None:
    """Start, stop or use a throwaway local PostgreSQL (initdb in a temp folder, Unix socket)."""


@db.command()
def start() -> None:
    """Start a dev cluster that later commands use when DATABASE_URL is unset.

    Prints its DATABASE_URL. As root, the server runs as the `postgres` user.
    """
    if info := load_dev_cluster():
        click.echo(info.url)
        click.echo("(already running; `pgfence db stop` to remove it)", err=True)
        return
    info = EmbeddedPostgres().start()
    save_dev_cluster(info)
    click.echo(info.url)


@db.command()
def stop() -> None:
    """Stop the dev cluster and delete its folder."""
    info = load_dev_cluster()
    if info is None:
        click.echo("no dev cluster is running", err=True)
        forget_dev_cluster()
        return
    stop_cluster(info)
    forget_dev_cluster()
    click.echo(f"stopped and removed {info.root}")


@db.command()
def url() -> None:
    """Print the dev cluster's DATABASE_URL (exit 1 if none is running)."""
    info = load_dev_cluster()
    if info is None:
        click.echo("no dev cluster is running: `pgfence db start`", err=True)
        sys.exit(1)
    click.echo(info.url)


@db.command(context_settings={"ignore_unknown_options": True})
@click.option("--durable", is_flag=True, help="Keep fsync on (for benchmarks).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def run(durable: bool, command: tuple[str, ...]) -> None:
    """Run COMMAND with DATABASE_URL set, then stop everything.

    With DATABASE_URL already set, COMMAND runs against it; otherwise a throwaway cluster is
    started first and removed afterwards. Exits with COMMAND's status.

    \b
    Example: pgfence db run -- pytest -x
    """
    if os.environ.get("DATABASE_URL"):
        sys.exit(subprocess.run(list(command), check=False).returncode)
    with throwaway_cluster(durable=durable) as info:
        env = dict(os.environ, DATABASE_URL=info.url)
        code = subprocess.run(list(command), env=env, check=False).returncode
    sys.exit(code)
