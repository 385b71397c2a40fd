"""Ordering keys and per-key limits with real executor processes (functions/16_outbox_keys.sql).

Four executors deliver two channels at once through a Python transport that appends a start and
an end line per delivery to one shared O_APPEND file (tests/handlers.py ``key_record``), so the
file is the receiver's log in real order. Channel ``ordered`` (key_max_in_flight 1): each key's
messages start in enqueue order, and never while another of the key is in flight. Channel
``limited`` (key_max_in_flight 3): never more than 3 of one key in flight. Scaled (1,200 and 600
messages) to run in seconds; the claim walk per key is the same at any size.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgfence import outbox
from support import FAST, Proc, scalar, wait_for

ORDERED, LIMITED = "ordered", "limited"
ORDERED_KEYS, ORDERED_PER_KEY = 100, 12
LIMITED_KEYS, LIMITED_PER_KEY, LIMIT = 20, 30, 3


def _enqueue(conn: psycopg.Connection[Any], channel: str, keys: int, per_key: int) -> None:
    # interleaved (key 0 seq 0, key 1 seq 0, ...), in batches of commits, as producers would
    for seq in range(per_key):
        names = [f"k{k}" for k in range(keys)]
        outbox.enqueue_many(conn, channel, ["r"] * keys,
                            [{"key": n, "seq": seq} for n in names], ordering_keys=names)


@pytest.mark.timeout(120)
def test_four_executors_keep_each_keys_order_and_limit(db: str, conn: psycopg.Connection[Any],
                                                      tmp_path: Path) -> None:
    outbox.configure_channel(conn, LIMITED, key_max_in_flight=LIMIT)
    total = ORDERED_KEYS * ORDERED_PER_KEY + LIMITED_KEYS * LIMITED_PER_KEY
    record = tmp_path / "receiver.log"
    env = {"PGFENCE_TEST_RECORD": str(record)}
    procs = [Proc(db, ["--route", f"{ORDERED}=python:handlers:key_record",
                       "--route", f"{LIMITED}=python:handlers:key_record",
                       "--worker-id", f"kx{i}", "--concurrency", "16", *FAST],
                  tmp_path / f"exec{i}.log", env) for i in range(4)]
    try:
        # All four listen before the first message: an executor still starting when the others
        # have drained the lot would deliver none (seen once in four runs), and the test is about
        # executors running side by side.
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity"
                                    " WHERE application_name LIKE 'pgfence-listener:kx%%'") == 4,
                 60, "four executors listening")
        _enqueue(conn, ORDERED, ORDERED_KEYS, ORDERED_PER_KEY)
        _enqueue(conn, LIMITED, LIMITED_KEYS, LIMITED_PER_KEY)
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'") == total,
                 90, f"all {total} messages sent")
    finally:
        for p in procs:
            assert p.terminate() == 0, p.output()
    workers = scalar(db, "SELECT count(DISTINCT receipt->>'pid') FROM pgfence.outbox")
    assert workers == 4, "every executor delivered some"

    in_flight: dict[tuple[str, str], int] = defaultdict(int)
    peak: dict[str, int] = defaultdict(int)
    started: dict[tuple[str, str], list[int]] = defaultdict(list)
    for line in record.read_text().splitlines():
        edge, channel, key, seq = line.split()
        if edge == "S":
            in_flight[channel, key] += 1
            peak[channel] = max(peak[channel], in_flight[channel, key])
            started[channel, key].append(int(seq))
        else:
            in_flight[channel, key] -= 1
    assert sum(len(v) for v in started.values()) == total, "each message delivered once"
    assert peak[ORDERED] == 1, "never two of one ordered key at once"
    assert 1 <= peak[LIMITED] <= LIMIT, f"never more than {LIMIT} of one limited key at once"
    for (channel, key), seqs in started.items():
        if channel == ORDERED:
            assert seqs == sorted(seqs), f"{key}: delivered in enqueue order"
    assert scalar(db, "SELECT count(*) FROM pgfence.outbox_key") == 0, "every key forgotten at the end"


STALL_KEYS, STALL_PER_KEY, STALL_DRAINS, STALL_POLL = 1000, 10, 4, 30.0


@pytest.mark.timeout(240)
def test_a_keyed_drain_never_waits_for_the_poll(db: str, conn: psycopg.Connection[Any],
                                                tmp_path: Path) -> None:
    """Four idle executors (batch 50, two claim sweeps in flight each) drain keyed backlogs
    without a NOTIFY for a key's next turn: a settle's promotions send none, so a sweep that
    came back short on a snapshot older than a neighbour sweep's commit must not clear the
    module's due flag. Before the fix about 4 bench drains in 10 stalled until the sweep timer
    (a 1.6 s gap with --poll-interval 3), and this test failed 3 runs of 3; with a 30 s poll a
    stall fails the bound."""
    channel = "stall"
    procs = [Proc(db, ["--route", f"{channel}=noop", "--worker-id", f"st{i}", "--batch", "50",
                       "--concurrency", "100", "--poll-interval", str(STALL_POLL),
                       "--reap-interval", "60"],
                  tmp_path / f"stall{i}.log") for i in range(4)]
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity"
                                    " WHERE application_name LIKE 'pgfence-listener:st%%'") == 4,
                 60, "four executors listening")
        total = 0
        for drain in range(STALL_DRAINS):
            n = STALL_KEYS * STALL_PER_KEY  # one call, the keys interleaved (k0, k1, ..., k0, ...)
            outbox.enqueue_many(conn, channel, ["r"] * n, [{"i": i} for i in range(n)],
                                ordering_keys=[f"d{drain}k{i % STALL_KEYS}" for i in range(n)])
            total += n
            # A drain takes about 0.5-2 s here; a stall lasts until the 30 s sweep timer.
            wait_for(lambda want=total: scalar(db, "SELECT count(*) FROM pgfence.outbox"
                                                   " WHERE status = 'sent'") == want,
                     STALL_POLL / 2, f"drain {drain + 1}: all {total} messages sent before the poll")
    finally:
        for p in procs:
            assert p.terminate() == 0, p.output()
    # Each key's next message went to the executor that settled the one before, in that same
    # round (_outbox_keys_hand_off: claimed at the settle's now()), not through a decision and a
    # claim: a claiming round settles no more outcomes than a batch, so the keys it settles fit
    # in what it claims. Before that cap about 20% of them went the long way here (two sweeps'
    # outcomes settled by one round that could claim one batch); with it, all of them.
    handed, follow_ons = scalar(db, """
        SELECT array[count(*) FILTER (WHERE claimed_at = prev_finished), count(*)]
        FROM (SELECT claimed_at, lag(finished_at) OVER (PARTITION BY ordering_key ORDER BY id)
                AS prev_finished FROM pgfence.outbox WHERE channel = 'stall') m
        WHERE prev_finished IS NOT NULL""")
    assert follow_ons == total - STALL_DRAINS * STALL_KEYS
    assert handed >= 0.95 * follow_ons, f"only {handed} of {follow_ons} keys handed on in the round"
