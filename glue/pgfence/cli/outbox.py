"""``pgfence outbox``: enqueue, list, show, requeue, cancel, configure."""

from __future__ import annotations

import datetime as dt

import click

from .. import outbox as api
from ._common import (
    CliState,
    db_conn,
    emit,
    emit_one,
    json_option,
    parse_json,
    pass_state,
    read_arg_text,
)


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
@click.option("--ordering-key", help="Messages with one key go out in enqueue order.")
@click.argument("payload")
@pass_state
def enqueue(state: CliState, channel: str, recipient: str, idempotency_key: str | None,
            delay: float | None, max_attempts: int | None, ordering_key: str | None,
            payload: str) -> None:
    """Enqueue one message with a JSON object PAYLOAD (text, @file or - for stdin); prints its id.

    A repeated --key prints "deduplicated: existing id N" instead (nothing is inserted).
    """
    body = parse_json(read_arg_text(payload, "PAYLOAD"), "PAYLOAD")
    with db_conn(state) as conn:
        deliver_at = None
        if delay:
            row = conn.execute("SELECT now() + make_interval(secs => %s)", (delay,)).fetchone()
            deliver_at = row[0] if row else None
        mid, deduplicated = api.enqueue_reporting(
            conn, channel, recipient, body, idempotency_key=idempotency_key,
            deliver_at=deliver_at, max_attempts=max_attempts, ordering_key=ordering_key)
    click.echo(f"deduplicated: existing id {mid}" if deduplicated else mid)


@outbox.command("list")
@click.option("--channel", help="Only this channel.")
@click.option("--status", type=click.Choice(["waiting", "pending", "processing", "sent", "failed",
                                             "dead", "canceled"]))
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
@click.argument("message_id", type=click.IntRange(1, 2**63 - 1))
@click.option("--by", required=True, help="Who cancels (recorded in the event log).")
@click.option("--reason", required=True, help="Why (recorded in the event log).")
@pass_state
def cancel(state: CliState, message_id: int, by: str, reason: str) -> None:
    """Cancel a message that is not being delivered (operator); exits 1 if it could not be."""
    with db_conn(state) as conn:
        ok = api.cancel(conn, message_id, by, reason)
        status = api.get(conn, message_id)["status"]
    if ok:
        click.echo(f"outbox#{message_id} canceled")
    else:
        click.echo(f"outbox#{message_id} is {status}: only waiting, pending, failed or dead "
                   "messages can be canceled", err=True)
        raise SystemExit(1)


@outbox.command()
@click.argument("channel")
@click.option("--max-attempts", type=click.IntRange(1, 1000))
@click.option("--backoff-base", type=click.FloatRange(0.001), help="Seconds.")
@click.option("--backoff-cap", type=click.FloatRange(0.001), help="Seconds.")
@click.option("--lease", type=click.FloatRange(0.001), help="Seconds.")
@click.option("--log-events/--no-log-events", default=None,
              help="Write every transition of this channel to the event log.")
@click.option("--max-payload-bytes", type=click.IntRange(1, 268435455),
              help="Largest payload enqueue accepts (jsonb bytes).")
@click.option("--key-max-in-flight", type=click.IntRange(1, 10000),
              help="Messages of one ordering key pending or processing at once.")
@click.option("--key-rate", type=click.FloatRange(0, 1000000),
              help="Claims per second per ordering key (0: no rate).")
@click.option("--key-burst", type=click.IntRange(1, 10000), help="Burst of the key rate.")
@click.option("--key-dead-policy", type=click.Choice(["block", "release"]),
              help="Whether a failed or dead message holds its ordering key.")
@click.option("--limit-key", type=click.Choice(["host", "none"]),
              help="host: limit messages without an ordering key per recipient URL host.")
@json_option
@pass_state
def configure(state: CliState, channel: str, max_attempts: int | None,
              backoff_base: float | None, backoff_cap: float | None, lease: float | None,
              log_events: bool | None, max_payload_bytes: int | None,
              key_max_in_flight: int | None, key_rate: float | None, key_burst: int | None,
              key_dead_policy: str | None, limit_key: str | None, as_json: bool) -> None:
    """Set CHANNEL's retry settings ('*' = defaults); unspecified ones are kept."""

    def secs(v: float | None) -> dt.timedelta | None:
        return None if v is None else dt.timedelta(seconds=v)

    with db_conn(state) as conn:
        row = api.configure_channel(conn, channel, max_attempts=max_attempts,
                                    backoff_base=secs(backoff_base),
                                    backoff_cap=secs(backoff_cap), lease=secs(lease),
                                    log_events=log_events, max_payload_bytes=max_payload_bytes,
                                    key_max_in_flight=key_max_in_flight, key_rate=key_rate,
                                    key_burst=key_burst, key_dead_policy=key_dead_policy,
                                    limit_key=limit_key)
    emit_one(row, as_json)
