"""``pgfence inspect MODULE ID`` (who owns it, what it did) and ``pgfence purge MODULE``."""

from __future__ import annotations

import datetime as dt
import json
from typing import Any

import click

from .. import audit
from ._common import CliState, _jsonable, db_conn, emit, emit_one, fmt_value, pass_state


def _detail(value: Any, full: bool) -> str:
    if value is None:
        return ""
    text = json.dumps(value, separators=(",", ":"), sort_keys=True)
    return text if full or len(text) <= 100 else text[:97] + "..."


@click.command()
@click.argument("module", type=click.Choice(audit.MODULES))
@click.argument("item_id", type=int)
@click.option("--full", is_flag=True, help="Do not shorten the detail column.")
@click.option("--json", "as_json", is_flag=True, help="Print JSON: {\"item\": ..., \"timeline\": [...]}.")
@pass_state
def inspect(state: CliState, module: str, item_id: int, full: bool, as_json: bool) -> None:
    """Who owns one item until when, and its timeline: every transition with who made it and
    under which fence, receipts and errors (with SQLSTATE), ending with its current state.

    \b
    Same as, in psql:
      SELECT * FROM pgfence.audit_owner_of('plan', 42);
      SELECT * FROM pgfence.audit_timeline('plan', 42);
    """
    with db_conn(state) as conn:
        item = audit.owner_of(conn, module, item_id)
        events = audit.timeline(conn, module, item_id)
    if as_json:
        click.echo(json.dumps({"item": {k: _jsonable(v) for k, v in item.items()},
                               "timeline": [{k: _jsonable(v) for k, v in e.items()} for e in events]},
                              indent=2))
        return
    emit_one(item, False)
    click.echo("")
    rows = [{
        "at": e["at"], "source": e["source"], "event": e["event"],
        "transition": (f"{e['from_status'] or ''} -> {e['to_status']}"
                       if e["to_status"] is not None else ""),
        "actor": e["actor"], "fence": e["fence"], "detail": _detail(e["detail"], full),
    } for e in events]
    emit(rows, False, ["at", "source", "event", "transition", "actor", "fence", "detail"])


def _interval(value: str | None) -> dt.timedelta | None:
    if value is None:
        return None
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = value.strip().lower()
    try:
        if text and text[-1] in units:
            return dt.timedelta(seconds=float(text[:-1]) * units[text[-1]])
        return dt.timedelta(seconds=float(text))
    except ValueError as exc:
        raise click.BadParameter("a number of seconds, or with a unit: 30s, 15m, 12h, 7d",
                                 param_hint="--older-than") from exc


@click.command()
@click.argument("module", type=click.Choice(audit.MODULES))
@click.option("--older-than", "older_than", metavar="AGE",
              help="Keep items finished more recently than AGE (30s, 15m, 12h, 7d). "
                   "Default: 7d for the outbox, 90d otherwise.")
@click.option("--batch-size", type=click.IntRange(1, 100000),
              help="Items per transaction. Default: outbox 1000, plan 100, operation 1000, "
                   "document 5000.")
@pass_state
def purge(state: CliState, module: str, older_than: str | None, batch_size: int | None) -> None:
    """Delete MODULE's finished items (and their events) older than --older-than.

    Runs CALL pgfence.audit_purge(MODULE, ...): short batches, each committed, so it never holds
    long locks; items still pending, owned or running are never touched. For documents only old
    events are deleted (documents and revisions are kept). Needs pgfence_admin.
    """
    age = _interval(older_than)
    with db_conn(state) as conn:  # autocommit: the procedure commits after every batch
        n = audit.purge(conn, module, age, batch_size)
    what = "event(s)" if module == "document" else "item(s)"
    click.echo(f"purged {n} {module} {what}"
               + (f" older than {fmt_value(age)}" if age is not None else " (default age)"))

