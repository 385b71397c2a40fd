"""Edge cases of the outbox API found in review: an empty channel list, an unbounded lease."""

from __future__ import annotations

import datetime as dt

import psycopg
import pytest

from pgfence import outbox
from pgfence.errors import InvalidArgument


# ---------------------------------------------------------------------------------------------
# An empty channel list means no channel, as in SQL (not every channel)
# ---------------------------------------------------------------------------------------------
def test_an_empty_channel_list_claims_nothing(conn: psycopg.Connection) -> None:
    [other] = outbox.enqueue_many(conn, "edge-other", ["r"], [{}])
    [mine] = outbox.enqueue_many(conn, "edge-mine", ["r"], [{}])
    [held] = outbox.claim(conn, "w", channels=["edge-mine"])
    assert held.id == mine
    sql = conn.execute("SELECT count(*) FROM pgfence.outbox_claim('w', 10, '{}'::text[])").fetchone()
    assert sql == (0,), "SQL: an empty array of channels claims nothing"
    assert outbox.claim(conn, "w", batch=10, channels=[]) == []
    sent, claimed = outbox.mark_sent_and_claim(conn, held.id, held.attempt, "w", batch=10,
                                               channels=[])
    assert (sent, claimed) == (True, [])
    assert outbox.get(conn, other)["status"] == "pending", "another channel's message was not taken"


# ---------------------------------------------------------------------------------------------
# A lease is bounded like a channel's lease (1 day): 22023, never 22008, and nothing half-done
# ---------------------------------------------------------------------------------------------
def test_a_lease_longer_than_a_day_is_refused_and_the_settle_marks_nothing(
        conn: psycopg.Connection) -> None:
    ids = outbox.enqueue_many(conn, "edge-lease", ["r", "r"], [{}, {}])
    [held] = outbox.claim(conn, "w", channels=["edge-lease"])
    huge = dt.timedelta(days=365 * 300_000)  # now() + this overflows a timestamp
    for lease in (dt.timedelta(days=1, seconds=1), huge):
        with pytest.raises(InvalidArgument):
            outbox.claim(conn, "w", channels=["edge-lease"], lease=lease)
        with pytest.raises(InvalidArgument):
            outbox.mark_sent_and_claim(conn, held.id, held.attempt, "w", channels=["edge-lease"],
                                       lease=lease)
    assert outbox.get(conn, held.id)["status"] == "processing", "the failed settle marked nothing"
    assert outbox.get(conn, ids[1])["status"] == "pending"
    [nxt] = outbox.claim(conn, "w", channels=["edge-lease"], lease=dt.timedelta(days=1))
    assert nxt.id == ids[1] and nxt.lease <= dt.timedelta(days=1)
