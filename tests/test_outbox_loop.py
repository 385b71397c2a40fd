"""The single-message worker loop through the Python API: ``claim`` once, then
``mark_sent_and_claim`` after each delivery (one statement and one commit per message)."""

from __future__ import annotations

import threading
from collections import Counter

import psycopg
import pytest

from pgfence import outbox
from pgfence.errors import InvalidArgument, NotFound


def test_mark_sent_and_claim_returns_the_mark_outcome_and_the_next_messages(
        conn: psycopg.Connection) -> None:
    ids = outbox.enqueue_many(conn, "loop", ["a", "b", "c"], [{"i": 0}, {"i": 1}, {"i": 2}])
    [first] = outbox.claim(conn, "w1", channels=["loop"])
    assert first.id == ids[0]

    sent, claimed = outbox.mark_sent_and_claim(conn, first.id, first.attempt, "w1",
                                               receipt={"http": 200}, batch=5, channels=["loop"])
    assert sent is True
    assert [m.id for m in claimed] == ids[1:], "the rest, oldest due first"
    assert all(m.attempt == 1 and m.payload["i"] in (1, 2) for m in claimed)
    assert outbox.get(conn, first.id)["receipt"] == {"http": 200}

    # the same fence again: a lost race (already sent), not an error; nothing is due
    sent, claimed = outbox.mark_sent_and_claim(conn, first.id, first.attempt, "w1",
                                               channels=["loop"])
    assert (sent, claimed) == (False, [])

    with pytest.raises(NotFound):
        outbox.mark_sent_and_claim(conn, -1, 1, "w1", channels=["loop"])
    with pytest.raises(InvalidArgument):
        outbox.mark_sent_and_claim(conn, ids[1], 1, "w1", batch=0, channels=["loop"])
    assert outbox.get(conn, ids[1])["status"] == "processing", "the failed call marked nothing"


@pytest.mark.timeout(120)
def test_four_single_message_loops_share_the_queue_without_overlap(db: str,
                                                                   conn: psycopg.Connection) -> None:
    n = 800
    outbox.configure_channel(conn, "loop4", log_events=True)
    ids = outbox.enqueue_many(conn, "loop4", ["r"] * n, [{"i": i} for i in range(n)])
    seen: Counter[int] = Counter()
    stale: list[int] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker(name: str) -> None:
        try:
            with psycopg.connect(db, autocommit=True) as c:
                batch = outbox.claim(c, name, channels=["loop4"])
                for _ in range(n + 1):  # bounded: never more iterations than messages
                    if not batch:
                        return
                    [m] = batch
                    with lock:
                        seen[m.id] += 1
                    sent, batch = outbox.mark_sent_and_claim(c, m.id, m.attempt, name,
                                                             receipt={"by": name},
                                                             channels=["loop4"])
                    if not sent:
                        with lock:
                            stale.append(m.id)
        except BaseException as exc:  # reported below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(f"w{i}",)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert not any(t.is_alive() for t in threads), "a worker loop did not finish"
    assert errors == []
    assert set(seen) == set(ids) and all(c == 1 for c in seen.values()), \
        "every message claimed exactly once: no two loops ever held the same message"
    assert stale == []
    rows = conn.execute("SELECT status, count(*) FROM pgfence.outbox WHERE channel = 'loop4'"
                        " GROUP BY status").fetchall()
    assert rows == [("sent", n)]
    sent_events = conn.execute(
        "SELECT count(DISTINCT item_id), count(*) FROM pgfence.event WHERE module = 'outbox'"
        " AND to_status = 'sent' AND event = 'transition'").fetchone()
    assert sent_events == (n, n), "exactly one sent transition per message"
    by = Counter(r[0] for r in conn.execute(
        "SELECT receipt->>'by' FROM pgfence.outbox WHERE channel = 'loop4'").fetchall())
    assert len(by) > 1, "the work was shared between loops"
