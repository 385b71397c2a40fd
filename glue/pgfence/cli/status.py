"""``pgfence status``: the health summary an operator looks at first, for every module.

Each section is one audit view (see ``docs/psql.md`` for the same questions from psql): queue
health with the rates of the last 1, 5 and 15 minutes, the outbox per channel and status, what
is stuck, which external effects may have been duplicated, who holds leases, the executors
(registry), and documents with recent conflicts. Read-only: a login in the ``pg_monitor`` role
may run it.

The exit status is for alerting: 0 healthy, 1 warnings (something stuck, a possible duplicate
in the last 24 hours, a queue with ready work and no live executor serving it), 2 the database
could not be asked (no DSN, unreachable, schema version not this pgfence's). ``--watch``
refreshes a live view of a drain (depth, rate, ETA, in flight, stuck) until Ctrl-C or
``--count`` refreshes.
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

import click
import psycopg
from psycopg.rows import dict_row

from .. import audit
from ..db import NoDatabase, connect
from ..errors import SchemaMismatch
from ._common import CliState, _jsonable, db_conn, emit, pass_state

_QUEUE_COLS = ["module", "queue", "ready", "deferred", "in_backoff", "in_flight", "lapsed",
               "oldest_ready_age", "per_second_1m", "per_second_5m", "per_second_15m",
               "failed_5m", "failed", "dead", "executors", "unserved"]
_STUCK_COLS = ["module", "item_id", "queue", "status", "owner", "fence", "expired_at", "overdue",
               "next"]
_DUP_COLS = ["module", "item_id", "queue", "status", "reason", "fences", "lost_by",
             "idempotency_key", "since"]
_LEASE_COLS = ["module", "queue", "owner", "held", "oldest_claim_at", "next_expiry", "lapsed"]
_TABLE_COLS = ["table_name", "live_rows", "dead_rows", "dead_ratio", "table_bytes", "index_bytes",
               "last_vacuum"]
_DOC_COLS = ["document_id", "kind", "status", "version", "revisions", "conflicts_1h",
             "conflicts_24h", "last_conflict_at", "last_conflict_by"]
_EXECUTOR_COLS = ["worker", "status", "modules", "host", "pid", "concurrency", "version",
                  "started_at", "silent_for"]
_WATCH_COLS = ["module", "queue", "ready", "in_flight", "per_second", "eta", "lapsed",
               "executors"]

#: Exit statuses (documented in the command's help and README).
HEALTHY, WARNING, UNREACHABLE = 0, 1, 2

SQL_EXECUTORS = ("SELECT * FROM pgfence.audit_executors"
                 " ORDER BY alive DESC, status, last_seen_at DESC, worker")
#: Possible duplicates recent enough to warn about (older ones stay listed, without a warning).
SQL_RECENT_DUPLICATES = ("SELECT count(*) FROM pgfence.audit_duplicates"
                         " WHERE since >= now() - interval '24 hours'")


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


def _cleanup_blocker_warnings(blockers: list[dict[str, Any]],
                              warn_after: Any) -> list[dict[str, Any]]:
    """A warning (kind ``cleanup``) when the oldest holder of cleanup (the first row of
    ``pgfence.audit_cleanup_blockers``) is past ``pgfence.cleanup_warn_after``."""
    if not blockers or not blockers[0]["warn"]:
        return []
    b = blockers[0]
    who = f"pid {b['pid']}" if b["pid"] is not None else str(b["holder"])
    return [{"kind": "cleanup", "message": f"{b['kind']} {who} holds back VACUUM past "
             f"pgfence.cleanup_warn_after ({warn_after}), xmin age {b['xid_age']}: dead rows "
             "pile up and claims slow down (see cleanup)"}]


def collect(conn: psycopg.Connection[Any], limit: int) -> dict[str, Any]:
    """Every section of ``pgfence status`` (rows as dicts) and its ``warnings``: a list of
    ``{"kind", "message"}`` (kinds: stuck, duplicates, unserved, cleanup)."""
    queues = audit.queue_health(conn)
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute("SELECT * FROM pgfence.outbox_summary ORDER BY channel, status")
        summary: list[dict[str, Any]] = cur.fetchall()
        cur.execute(SQL_EXECUTORS)
        executors: list[dict[str, Any]] = cur.fetchall()
    stuck = audit.stuck(conn)
    dups = audit.duplicates(conn, limit)
    row = conn.execute(SQL_RECENT_DUPLICATES).fetchone()
    recent_dups = int(row[0]) if row else 0
    leases = audit.leases(conn)
    docs = audit.documents(conn, "conflicts", limit)
    blockers = audit.cleanup_blockers(conn)
    warn_after = audit.cleanup_warn_after(conn)
    tables = audit.table_health(conn)
    unserved = [q for q in queues if q.get("unserved")]
    warnings: list[dict[str, Any]] = []
    # audit_stuck's module "database" rows (what holds back VACUUM) warn as kind cleanup below
    owned = [s for s in stuck if s["module"] != "database"]
    if owned:
        warnings.append({"kind": "stuck", "message": f"{len(owned)} item(s) owned past their "
                         "lease or heartbeat (see stuck)"})
    if recent_dups:
        warnings.append({"kind": "duplicates", "message": f"{recent_dups} external effect(s) in "
                         "the last 24 hours may have happened twice (see duplicated)"})
    for q in unserved:
        warnings.append({"kind": "unserved", "message": f"{q['module']} {q['queue']}: "
                         f"{q['ready']} ready and no live executor serves it"})
    warnings.extend(_cleanup_blocker_warnings(blockers, warn_after))
    return {"health": "warning" if warnings else "ok", "warnings": warnings,
            "queues": queues, "outbox": summary, "stuck": stuck, "duplicates": dups,
            "leases": leases, "documents": docs, "executors": executors,
            "cleanup_blockers": blockers, "cleanup_warn_after": warn_after, "tables": tables,
            "unserved": [{"module": q["module"], "queue": q["queue"], "ready": q["ready"]}
                         for q in unserved]}


def _unreachable(exc: Exception) -> None:
    """Say why the database could not be read (as every command does) and exit 2."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    if isinstance(exc, psycopg.OperationalError):
        click.echo(f"pgfence: cannot reach the database: {text}", err=True)
    else:
        click.echo(f"pgfence: {text}", err=True)
    raise SystemExit(UNREACHABLE)


@click.command()
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of tables.")
@click.option("--limit", type=click.IntRange(1, 10000), default=20, show_default=True,
              help="Rows shown of the duplicated and documents sections.")
@click.option("--watch", is_flag=True,
              help="Refresh a live view (depth, rate, ETA, in flight, stuck) until Ctrl-C.")
@click.option("--interval", type=click.FloatRange(0.2, 3600), default=2.0, show_default=True,
              help="Seconds between --watch refreshes.")
@click.option("--count", type=click.IntRange(0, 1_000_000), default=0, show_default=True,
              help="Stop --watch after N refreshes (0 = until Ctrl-C).")
@pass_state
def status(state: CliState, as_json: bool, limit: int, watch: bool, interval: float,
           count: int) -> None:
    """Health of every module: queues, stuck items, possible duplicates, leases, executors.

    \b
    queues      per outbox channel / operation kind / plans: ready, deferred, in backoff,
                in flight, lapsed, oldest ready age, finished per second over the last 1, 5
                and 15 minutes, failed, dead, live executors serving it, unserved
    outbox      messages per channel and status
    stuck       owned items whose lease or heartbeat lapsed, how long overdue, what happens next
    duplicated  external effects that may have happened twice (check downstream)
    leases      who holds what, until when
    executors   the registry: alive, lapsed (silent past three heartbeats) or stopped
    documents   documents with conflicts in the last hour / day
    cleanup     (after health) the oldest transaction, slot or prepared transaction holding back
                VACUUM, with pid and age; a WARNING past pgfence.cleanup_warn_after (5 min)
    tables      dead and live rows, sizes and last vacuum of the hot tables

    \b
    Exit status: 0 healthy; 1 warnings: something stuck, a possible duplicate in the last
    24 hours, a queue with ready work that no live executor serves; 2 the database could not
    be read (no DSN, unreachable, wrong schema version); a transaction, slot or prepared
    transaction holding back VACUUM past pgfence.cleanup_warn_after also warns (1).
    --watch: that of the last refresh.
    """
    if watch:
        _watch(state, as_json, interval, count)
        return
    try:
        with db_conn(state) as conn:
            out = collect(conn, limit)
    except (NoDatabase, SchemaMismatch, psycopg.OperationalError) as exc:
        _unreachable(exc)
        return
    if as_json:
        click.echo(json.dumps(out, indent=2, default=_jsonable))
    else:
        _print(out, limit)
    if out["warnings"]:
        raise SystemExit(WARNING)


def _print(out: dict[str, Any], limit: int) -> None:
    click.echo(f"health: {out['health']}")
    click.echo(cleanup_line(out["cleanup_blockers"], out["cleanup_warn_after"]))
    for w in out["warnings"]:
        click.echo(f"  warning ({w['kind']}): {w['message']}")
    click.echo("\nqueues")
    emit(out["queues"], False, _QUEUE_COLS, empty="  (no items)")
    click.echo("\noutbox (per channel and status)")
    emit(out["outbox"], False, ["channel", "status", "messages", "oldest_due_age", "deferred",
                                "lapsed_leases", "max_attempts_used"], empty="  (no messages)")
    click.echo("\nstuck (lease or heartbeat lapsed)")
    emit(out["stuck"], False, _STUCK_COLS, empty="  (nothing stuck)")
    click.echo(f"\nmay have been duplicated (newest {limit}; check downstream)")
    emit(out["duplicates"], False, _DUP_COLS, empty="  (none)")
    click.echo("\nleases held")
    emit(out["leases"], False, _LEASE_COLS, empty="  (none)")
    click.echo("\nexecutors")
    emit(out["executors"], False, _EXECUTOR_COLS, empty="  (none registered)")
    click.echo("\ndocuments with conflicts in the last 24 hours")
    emit(out["documents"], False, _DOC_COLS, empty="  (none)")
    click.echo("\ntables (dead rows VACUUM has not removed yet)")
    emit(out["tables"], False, _TABLE_COLS, empty="  (none)")


def _frame(queues: list[dict[str, Any]], before: dict[tuple[str, str], int] | None,
           elapsed: float) -> list[dict[str, Any]]:
    """The rows of one --watch frame: the rate from two readings of ``finished`` (items per
    second since the last frame; the 1-minute rate on the first), the ETA of what is ready
    and in flight at that rate (seconds; None while nothing finishes)."""
    rows = []
    for q in queues:
        key = (q["module"], q["queue"])
        finished = int(q.get("finished") or 0)
        if before is not None and key in before and elapsed > 0:
            rate = max(finished - before[key], 0) / elapsed
        else:
            rate = float(q.get("per_second_1m") or 0)
        left = int(q.get("ready") or 0) + int(q.get("in_flight") or 0)
        rows.append({"module": q["module"], "queue": q["queue"], "ready": q["ready"],
                     "in_flight": q["in_flight"], "per_second": round(rate, 1),
                     "eta": round(left / rate, 1) if rate > 0 and left else (0.0 if not left else None),
                     "lapsed": q["lapsed"], "executors": q.get("executors"),
                     "finished": finished})
    return rows


def _watch(state: CliState, as_json: bool, interval: float, count: int) -> None:
    """Refresh until Ctrl-C or ``count`` frames; exit with the last frame's health."""
    code = HEALTHY
    tty = sys.stdout.isatty() and not as_json
    try:
        conn = connect(state.dsn, liveness=state.liveness)
    except (NoDatabase, SchemaMismatch, psycopg.OperationalError) as exc:
        _unreachable(exc)
        return
    before: dict[tuple[str, str], int] | None = None
    taken = time.monotonic()
    frames = 0
    try:
        with conn:
            while True:
                try:
                    queues = audit.queue_health(conn)
                    stuck = len(audit.stuck(conn))
                except psycopg.OperationalError as exc:
                    _unreachable(exc)
                now = time.monotonic()
                rows = _frame(queues, before, now - taken)
                before = {(r["module"], r["queue"]): r["finished"] for r in rows}
                taken = now
                unserved = [q for q in queues if q.get("unserved")]
                code = WARNING if stuck or unserved else HEALTHY
                frames += 1
                if as_json:
                    click.echo(json.dumps({"at": time.time(), "stuck": stuck,
                                           "unserved": len(unserved), "queues": _plain(rows)},
                                          default=_jsonable))
                else:
                    if tty:
                        click.echo("\x1b[H\x1b[2J", nl=False)
                    click.echo(f"{time.strftime('%H:%M:%S')}  stuck {stuck}  unserved "
                               f"{len(unserved)}  (every {interval:g}s, Ctrl-C to stop)")
                    emit(rows, False, _WATCH_COLS, empty="  (no items)")
                    click.echo("")
                if count and frames >= count:
                    break
                time.sleep(interval)
    except KeyboardInterrupt:
        click.echo("")
    raise SystemExit(code)
