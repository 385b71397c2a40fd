"""``pgfence metrics``: the database-side gauges (view ``pgfence.audit_metrics``).

In the Prometheus text format (for a textfile collector, a cron job, a quick look), or as JSON
rows. The executor serves the same gauges, with its own counters, on ``--metrics-port``.
"""

from __future__ import annotations

import json
from collections.abc import Iterator

import click
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import Metric
from prometheus_client.registry import Collector

from ..metrics import SQL_METRICS, database_families
from ._common import CliState, _jsonable, db_conn, pass_state


class _Rows(Collector):
    def __init__(self, rows: list[tuple[object, ...]]) -> None:
        self.rows = rows

    def collect(self) -> Iterator[Metric]:
        yield from database_families(self.rows)


@click.command("metrics")
@click.option("--json", "as_json", is_flag=True, help="Print the rows as JSON.")
@pass_state
def metrics_cmd(state: CliState, as_json: bool) -> None:
    """The database-side gauges in the Prometheus text format: depth, oldest ready age, stuck.

    \b
    One sample per row of the view pgfence.audit_metrics (docs/metrics.md lists them): queue
    depth by status, oldest ready age, unserved queues, stuck items, possible duplicates of
    the last 24 hours, executors by status. A monitoring login (pg_monitor) may run it.
    """
    with db_conn(state) as conn:
        rows = conn.execute(SQL_METRICS).fetchall()
    if as_json:
        click.echo(json.dumps([dict(zip(("metric", "module", "queue", "status", "value"),
                                        (_jsonable(v) for v in r), strict=True)) for r in rows],
                              indent=2))
        return
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Rows(rows))
    click.echo(generate_latest(registry).decode(), nl=False)
