"""Edge cases of the outbox API found in review."""

from __future__ import annotations

import psycopg

from pgfence import outbox


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
