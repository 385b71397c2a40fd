"""``pgfence status``: the health summary an operator looks at first."""

from __future__ import annotations

import json
from typing import Any

import click
from psycopg.rows import dict_row

from ._common import CliState, _jsonable, db_conn, emit, pass_state


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@pass_state
def status(state: CliState, as_json: bool) -> None:
    """Counts per channel and status, oldest due age, and who holds leases until when."""
    with db_conn(state) as conn, conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM pgfence.outbox_summary ORDER BY channel, status")
        summary: list[dict[str, Any]] = cur.fetchall()
        cur.execute("SELECT * FROM pgfence.outbox_leases ORDER BY worker, channel")
        leases: list[dict[str, Any]] = cur.fetchall()
    if as_json:
        click.echo(json.dumps({
            "outbox": [{k: _jsonable(v) for k, v in r.items()} for r in summary],
            "outbox_leases": [{k: _jsonable(v) for k, v in r.items()} for r in leases],
        }, indent=2))
        return
    click.echo("outbox")
    emit(summary, False, ["channel", "status", "messages", "oldest_due_age", "deferred",
                          "lapsed_leases", "max_attempts_used"], empty="  (no messages)")
    click.echo("\nleases held")
    emit(leases, False, ["worker", "channel", "held", "oldest_claim_at", "next_expiry", "lapsed"],
         empty="  (none)")
