"""``pgfence outbox``: enqueue, list, show, requeue, configure."""

from __future__ import annotations

import datetime as dt

import click

from .. import outbox as api
from ._common import CliState, db_conn, emit, emit_one, json_option, parse_json, pass_state


@click.group()
def outbox() -> None:
    """The transactional outbox: messages delivered at least once by the executor."""


@outbox.command()
@click.option("--channel", required=True, help="Channel name (routes to a transport).")
@click.option("--recipient", required=True, help="Where to deliver: URL, e-mail address, ...")
@click.option("--key", "idempotency_key", help="Idempotency key: a repeat returns the same id.")
@click.option("--delay", type=click.FloatRange(0, 10 * 366 * 86400),
              help="Deliver no earlier than N seconds from now (at most 10 years).")
@click.option("--max-attempts", type=click.IntRange(1, 1000), help="Default: the channel's.")
@click.argument("payload")
@pass_state
def enqueue(state: CliState, channel: str, recipient: str, idempotency_key: str | None,
            delay: float | None, max_attempts: int | None, payload: str) -> None:
    """Enqueue one message with a JSON object PAYLOAD; prints its id."""
    body = parse_json(payload, "PAYLOAD")
    with db_conn(state) as conn:
        deliver_at = None
        if delay:
            row = conn.execute("SELECT now() + make_interval(secs => %s)", (delay,)).fetchone()
            deliver_at = row[0] if row else None
        mid = api.enqueue(conn, channel, recipient, body, idempotency_key=idempotency_key,
                          deliver_at=deliver_at, max_attempts=max_attempts)
    click.echo(mid)


@outbox.command("list")
@click.option("--channel", help="Only this channel.")
@click.option("--status", type=click.Choice(["pending", "processing", "sent", "failed", "dead"]))
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@json_option
@pass_state
def list_(state: CliState, channel: str | None, status: str | None, limit: int,
          as_json: bool) -> None:
    """Newest messages first, with status, attempts, owner and last error."""
    with db_conn(state) as conn:
        rows = api.list_messages(conn, channel, status, limit)
    emit(rows, as_json, ["id", "channel", "recipient", "status", "attempts", "max_attempts",
                         "next_attempt_at", "locked_by", "last_error"])


@outbox.command()
@click.argument("message_id", type=click.IntRange(1, 2**63 - 1))
@json_option
@pass_state
def show(state: CliState, message_id: int, as_json: bool) -> None:
    """Everything about one message: payload, status, attempts, lease, error, receipt."""
    with db_conn(state) as conn:
        emit_one(api.get(conn, message_id), as_json)


@outbox.command()
@click.argument("message_id", type=click.IntRange(1, 2**63 - 1))
@click.option("--extra-attempts", type=click.IntRange(1, 1000),
              help="Attempts to grant (default: the channel's max_attempts).")
@pass_state
def requeue(state: CliState, message_id: int, extra_attempts: int | None) -> None:
    """Retry a failed or dead message now (operator)."""
    with db_conn(state) as conn:
        ok = api.requeue(conn, message_id, extra_attempts)
        status = api.get(conn, message_id)["status"]
    if ok:
        click.echo(f"outbox#{message_id} requeued (now {status})")
    else:
        click.echo(f"outbox#{message_id} is {status}: only failed, dead or pending messages "
                   "can be requeued", err=True)
        raise SystemExit(1)


@outbox.command()
@click.argument("channel")
@click.option("--max-attempts", type=click.IntRange(1, 1000))
@click.option("--backoff-base", type=click.FloatRange(0.001), help="Seconds.")
@click.option("--backoff-cap", type=click.FloatRange(0.001), help="Seconds.")
@click.option("--lease", type=click.FloatRange(0.001), help="Seconds.")
@click.option("--log-events/--no-log-events", default=None,
              help="Write every transition of this channel to the event log.")
@json_option
@pass_state
def configure(state: CliState, channel: str, max_attempts: int | None,
              backoff_base: float | None, backoff_cap: float | None, lease: float | None,
              log_events: bool | None, as_json: bool) -> None:
    """Set CHANNEL's retry settings ('*' = defaults); unspecified ones are kept."""

    def secs(v: float | None) -> dt.timedelta | None:
        return None if v is None else dt.timedelta(seconds=v)

    with db_conn(state) as conn:
        row = api.configure_channel(conn, channel, max_attempts=max_attempts,
                                    backoff_base=secs(backoff_base),
                                    backoff_cap=secs(backoff_cap), lease=secs(lease),
                                    log_events=log_events)
    emit_one(row, as_json)
