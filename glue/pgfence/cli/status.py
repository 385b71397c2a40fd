"""``pgfence status``: the health summary an operator looks at first, for every module.

Each section is one audit view (see ``docs/psql.md`` for the same questions from psql): queue
health, the outbox per channel and status, what is stuck, which external effects may have been
duplicated, who holds leases, and documents with recent conflicts. Read-only: a login in the
``pg_monitor`` role may run it.
"""

from __future__ import annotations

import json
from typing import Any

import click
from psycopg.rows import dict_row

from .. import audit
from ._common import CliState, _jsonable, db_conn, emit, pass_state

_QUEUE_COLS = ["module", "queue", "ready", "deferred", "in_backoff", "in_flight", "lapsed",
               "oldest_ready_age", "done_5m", "failed_5m", "per_second_5m", "failed", "dead"]
_STUCK_COLS = ["module", "item_id", "queue", "status", "owner", "fence", "expired_at", "overdue",
               "next"]
_DUP_COLS = ["module", "item_id", "queue", "status", "reason", "fences", "lost_by",
             "idempotency_key", "since"]
_LEASE_COLS = ["module", "queue", "owner", "held", "oldest_claim_at", "next_expiry", "lapsed"]
_TABLE_COLS = ["table_name", "live_rows", "dead_rows", "dead_ratio", "table_bytes", "index_bytes",
               "last_vacuum"]
_DOC_COLS = ["document_id", "kind", "status", "version", "revisions", "conflicts_1h",
             "conflicts_24h", "last_conflict_at", "last_conflict_by"]


def _plain(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{k: _jsonable(v) for k, v in r.items()} for r in rows]


def cleanup_line(blockers: list[dict[str, Any]], warn_after: Any) -> str:
    """One line naming the oldest holder of cleanup (the first of ``audit.cleanup_blockers``):
    kind, pid, holder, how long open, xid age, and a WARNING past ``warn_after``."""
    if not blockers:
        return "cleanup: nothing holds back VACUUM"
    b = blockers[0]
    who = f"pid {b['pid']} ({b['holder']})" if b["pid"] is not None else str(b["holder"])
    age = f", open {str(b['age']).split('.')[0]}" if b["age"] is not None else ""
    state = f", {b['state']}" if b["state"] else ""
    line = f"cleanup: oldest holder {b['kind']} {who}{state}{age}, xmin age {b['xid_age']}"
    if len(blockers) > 1:
        line += f" ({len(blockers)} holders)"
    if b["warn"]:
        line += (f"\nWARNING: it holds back VACUUM past pgfence.cleanup_warn_after ({warn_after}):"
                 " dead rows pile up and claims slow down (see pgfence.audit_cleanup_blockers)")
    return line


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--limit", type=click.IntRange(1, 10000), default=20, show_default=True,
              help="Rows shown of the duplicated and documents sections.")
@pass_state
def status(state: CliState, as_json: bool, limit: int) -> None:
    """Health of every module: queues, stuck items, possible duplicates, leases, documents.

    \b
    queues      per outbox channel / operation kind / plans: ready, deferred, in backoff,
                in flight, lapsed, oldest ready age, finished in the last 5 minutes, failed, dead
    outbox      messages per channel and status
    stuck       owned items whose lease or heartbeat lapsed, how long overdue, what happens next
    duplicated  external effects that may have happened twice (check downstream)
    leases      who holds what, until when
    documents   documents with conflicts in the last hour / day
    cleanup     (first line) the oldest transaction, slot or prepared transaction holding back
                VACUUM, with pid and age; a WARNING past pgfence.cleanup_warn_after (5 min)
    tables      dead and live rows, sizes and last vacuum of the hot tables
    """
    with db_conn(state) as conn:
        queues = audit.queue_health(conn)
        with conn.cursor(row_factory=dict_row) as cur:
            cur.execute("SELECT * FROM pgfence.outbox_summary ORDER BY channel, status")
            summary: list[dict[str, Any]] = cur.fetchall()
        stuck = audit.stuck(conn)
        dups = audit.duplicates(conn, limit)
        leases = audit.leases(conn)
        docs = audit.documents(conn, "conflicts", limit)
        blockers = audit.cleanup_blockers(conn)
        warn_after = audit.cleanup_warn_after(conn)
        tables = audit.table_health(conn)
    if as_json:
        out: dict[str, Any] = {
            "queues": _plain(queues), "outbox": _plain(summary), "stuck": _plain(stuck),
            "duplicates": _plain(dups), "leases": _plain(leases), "documents": _plain(docs),
            "cleanup_blockers": _plain(blockers), "tables": _plain(tables),
        }
        click.echo(json.dumps(out, indent=2))
        return
    click.echo(cleanup_line(blockers, warn_after))
    click.echo("\nqueues")
    emit(queues, False, _QUEUE_COLS, empty="  (no items)")
    click.echo("\noutbox (per channel and status)")
    emit(summary, False, ["channel", "status", "messages", "oldest_due_age", "deferred",
                          "lapsed_leases", "max_attempts_used"], empty="  (no messages)")
    click.echo("\nstuck (lease or heartbeat lapsed)")
    emit(stuck, False, _STUCK_COLS, empty="  (nothing stuck)")
    click.echo(f"\nmay have been duplicated (newest {limit}; check downstream)")
    emit(dups, False, _DUP_COLS, empty="  (none)")
    click.echo("\nleases held")
    emit(leases, False, _LEASE_COLS, empty="  (none)")
    click.echo("\ndocuments with conflicts in the last 24 hours")
    emit(docs, False, _DOC_COLS, empty="  (none)")
    click.echo("\ntables (dead rows VACUUM has not removed yet)")
    emit(tables, False, _TABLE_COLS, empty="  (none)")
