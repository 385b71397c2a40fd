"""The query plans the outbox functions really run, read with auto_explain (nested statements).

The hot functions keep one generic plan per session (plan_cache_mode = force_generic_plan), so a
plan chosen under unlucky statistics is kept for the life of an executor (why, and how to read a
failure here: docs/query-plans.md). These tests call the real functions under the two statistics
states that once produced bad plans — a table analysed while empty, and one analysed with two
channels and nothing processing — and check every scan of ``pgfence.outbox`` inside them:
lookups by id use the primary key, one-channel walks ``outbox_channel_due_idx`` (never the
all-channels index, which would read other channels' backlogs), all-channels walks
``outbox_due_idx``, the reaper ``outbox_lease_idx``; nothing is a sequential scan.
"""

from __future__ import annotations

import json
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg.types.json import Jsonb

from support import PlanScans

PK, CHANNEL_DUE, DUE, LEASE = ("outbox_pkey", "outbox_channel_due_idx", "outbox_due_idx",
                               "outbox_lease_idx")


def _fill(conn: psycopg.Connection[Any], analyze: bool) -> None:
    conn.execute("SELECT pgfence.outbox_configure_channel('busy', p_lease => '1 hour')")
    conn.execute("VACUUM ANALYZE pgfence.outbox")  # statistics of an empty table
    conn.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many('busy', array_fill('r'::text,"
                 " ARRAY[3000]), array_fill('{}'::jsonb, ARRAY[3000]))")
    conn.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many('mine', array_fill('r'::text,"
                 " ARRAY[1000]), array_fill('{}'::jsonb, ARRAY[1000]))")
    if analyze:
        conn.execute("ANALYZE pgfence.outbox")  # two channels, nothing processing


@pytest.mark.parametrize("analyze", [False, True], ids=["stats-of-empty-table", "analyzed"])
def test_every_outbox_statement_uses_its_index(conn: psycopg.Connection[Any], analyze: bool) -> None:
    _fill(conn, analyze)
    plans = PlanScans(conn, {"outbox"})

    rows, scans = plans.scans("SELECT id, attempt FROM pgfence.outbox_claim('w', 1, '{mine}')")
    assert scans == {CHANNEL_DUE, PK}, "one-channel claim: walk the channel's due index, update by id"
    (mid, attempt), = rows
    _, scans = plans.scans("SELECT pgfence.outbox_mark_sent(%s, %s)", (mid, attempt))
    assert scans == {PK}

    rows, scans = plans.scans("SELECT id, attempt FROM pgfence.outbox_claim('w', 2, '{mine,none}')")
    assert scans == {CHANNEL_DUE, PK}, "several channels: one walk per channel"
    (m1, a1), (m2, a2) = rows
    _, scans = plans.scans("SELECT * FROM pgfence.outbox_mark_sent_many(%s, %s)", ([m1], [a1]))
    assert scans == {PK}
    _, scans = plans.scans("SELECT pgfence.outbox_mark_failed(%s, %s, 'x')", (m2, a2))
    assert scans == {PK}

    rows, scans = plans.scans("SELECT id, attempt FROM pgfence.outbox_mark_sent_and_claim("
                              "%s, %s, NULL, 'w', 1, '{mine}')", (m1, a1))
    assert scans == {CHANNEL_DUE, PK}

    rows, scans = plans.scans("SELECT id, attempt FROM pgfence.outbox_claim('w', 1)")
    assert scans == {DUE, PK}, "all channels: the all-channels due index"

    _, scans = plans.scans("SELECT pgfence.outbox_next_due('{mine}')")
    assert scans == {CHANNEL_DUE}
    _, scans = plans.scans("SELECT pgfence.outbox_next_due()")
    assert scans == {DUE}

    conn.execute("UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 second'"
                 " WHERE status = 'processing'")
    _, scans = plans.scans("SELECT pgfence.outbox_reap()")
    assert scans == {LEASE, PK}, "the reaper walks lapsed leases, then updates by id"


WAITING, LIVE = "outbox_key_waiting_idx", "outbox_key_live_idx"


@pytest.mark.parametrize("analyze", [False, True], ids=["stats-of-empty-table", "analyzed"])
@pytest.mark.parametrize("limit", [1, 2], ids=["lean-hand-off", "hand-off-with-key-lock"])
def test_every_keyed_statement_uses_its_index(conn: psycopg.Connection[Any], analyze: bool,
                                              limit: int) -> None:
    """Key decisions and hand-offs read a key through its waiting and live indexes, never the table,
    and each read is a probe of its key (the index condition names the key), never a scan of all
    the channel's keys.

    The lean hand-off (key_max_in_flight 1) probes outbox_key_waiting_idx for the key's next
    message and outbox_key_live_idx for another turn holder; the hand-off of a channel with a
    higher limit and every key decision read the same two (migration 0032).
    """
    conn.execute("SELECT pgfence.outbox_configure_channel('keyed', p_key_max_in_flight => %s)", (limit,))
    conn.execute("VACUUM ANALYZE pgfence.outbox")  # statistics of an empty table
    conn.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many('busy', array_fill('r'::text,"
                 " ARRAY[2000]), array_fill('{}'::jsonb, ARRAY[2000]))")
    if analyze:
        conn.execute("ANALYZE pgfence.outbox")
    # every read of a key index is a probe of one key: a scan with only the channel as its
    # condition (e.g. materialized once, then filtered per settled key) reads every key of it
    plans = PlanScans(conn, {"outbox"}, probes={WAITING: "ordering_key", LIVE: "ordering_key"})
    keys = [f"k{i % 20}" for i in range(200)]
    _, scans = plans.scans("SELECT count(*) FROM pgfence.outbox_enqueue_many('keyed', %s, %s,"
                           " NULL, NULL, NULL, %s)", (["r"] * 200, [Jsonb({})] * 200, keys))
    assert scans <= {WAITING, LIVE, PK}, "the enqueue's decision at commit"
    assert {WAITING, LIVE} <= scans
    rows, scans = plans.scans("SELECT id, attempt FROM pgfence.outbox_claim('w', 50, '{keyed}')")
    assert scans == {CHANNEL_DUE, PK}
    assert len(rows) == 20 * limit
    for _ in range(3):
        ids, attempts = [r[0] for r in rows], [r[1] for r in rows]
        rows, scans = plans.scans("SELECT id, attempt FROM pgfence.outbox_settle_and_claim(%s, %s, NULL,"
                                  " 'w', 50, '{keyed}')", (ids, attempts))
        assert scans <= {WAITING, LIVE, PK, CHANNEL_DUE}, "settle, hand-off, claim, next due"
        assert {WAITING, LIVE, PK} <= scans
        rows = [r for r in rows if r[0] is not None]
        assert len(rows) == 20 * limit, "every key handed on"
    # the last messages of the keys: nothing to hand on, so the decision forgets the keys
    conn.execute("UPDATE pgfence.outbox SET status = 'canceled', finished_at = now()"
                 " WHERE channel = 'keyed' AND status = 'waiting'")
    ids, attempts = [r[0] for r in rows], [r[1] for r in rows]
    _, scans = plans.scans("SELECT * FROM pgfence.outbox_settle_and_claim(%s, %s, NULL, 'w', 50,"
                           " '{keyed}')", (ids, attempts))
    assert scans <= {WAITING, LIVE, PK, CHANNEL_DUE}
    assert conn.execute("SELECT count(*) FROM pgfence.outbox_key WHERE channel = 'keyed'").fetchone() == (0,)
    if limit > 1:
        return  # the general hand-off: its trigger decides the keys under their locks
    # after the lean hand-off, _outbox_keys_forget deleted the key rows without a decision: in
    # the global lock order, a nested loop over the keys sorted COLLATE "C", each row by the
    # ctid it read
    deletes = [n for n in _plan_nodes(plans.notices)
               if n.get("Operation") == "Delete" and n.get("Relation Name") == "outbox_key"]
    assert len(deletes) == 1, "the keys are forgotten by one DELETE, no decision"
    join, = deletes[0]["Plans"]
    assert join["Node Type"] == "Nested Loop"
    outer, inner = join["Plans"]
    sorts = [n for n in _plan_nodes([json.dumps({"Plan": outer})], prefixed=False) if n["Node Type"] == "Sort"]
    assert sorts and all('COLLATE "C"' in key for key in sorts[0]["Sort Key"]), sorts
    assert inner["Node Type"] == "Tid Scan"


def _plan_nodes(notices: list[str], prefixed: bool = True) -> list[dict[str, Any]]:
    """Every plan node of the auto_explain NOTICEs (JSON), depth first."""
    out: list[dict[str, Any]] = []

    def walk(node: dict[str, Any]) -> None:
        out.append(node)
        for child in node.get("Plans", []):
            walk(child)
    for message in notices:
        if not prefixed:
            walk(json.loads(message)["Plan"])
        elif "plan:" in message:
            walk(json.loads(message.split("plan:", 1)[1])["Plan"])
    return out


def test_wake_up_claim_is_two_statements(conn: psycopg.Connection[Any]) -> None:
    """A claim that gets one message (an executor's wake-up) runs the walk and one UPDATE ...
    RETURNING, nothing else: no CTE, no sort, and the lease is read inside the UPDATE (its row's
    channel, then '*'), not by a statement of its own; each statement and executor node costs the
    claim its start-up (docs/query-plans.md#outbox)."""
    _fill(conn, analyze=True)
    conn.execute("SELECT pgfence.outbox_configure_channel('one', p_lease => '7 minutes')")
    default, = conn.execute("SELECT lease FROM pgfence.outbox_channel WHERE channel = '*'").fetchone()  # type: ignore[misc]
    plans = PlanScans(conn, {"outbox", "outbox_channel"})

    def nodes(node: dict[str, Any]) -> list[str]:
        return [node["Node Type"]] + [n for child in node.get("Plans", []) for n in nodes(child)]

    for channel, chans, lease in (("one", "{one}", timedelta(minutes=7)), ("two", "{one,two}", default),
                                  ("two", None, default)):
        conn.execute("SELECT pgfence.outbox_enqueue(%s, 'r', '{}')", (channel,))
        if chans is None:  # all channels: the others' backlogs out of the way
            conn.execute("UPDATE pgfence.outbox SET next_attempt_at = now() + interval '1 hour'"
                         " WHERE channel IN ('busy', 'mine')")
        rows, scans = plans.scans("SELECT channel, lease FROM pgfence.outbox_claim('w', 4, %s)", (chans,))
        assert rows == [(channel, lease)], chans
        assert scans == {CHANNEL_DUE if chans else DUE, PK, "outbox_channel_pkey"}, chans
        statements = [json.loads(m.split("plan:", 1)[1])["Plan"] for m in plans.notices if "plan:" in m]
        # the walk, the UPDATE, and the call itself (for a channel set, also the sub-select in
        # _outbox_claim_hint_name that sorts the set)
        kinds = sorted(s["Node Type"] for s in statements)
        assert kinds == sorted(["Aggregate", "ModifyTable", "Function Scan"] + ["Result"] * (chans == "{one,two}")), chans
        update, = [s for s in statements if s["Node Type"] == "ModifyTable"]
        # the UPDATE by primary key, and the lease's two look-ups by outbox_channel_pkey
        assert sorted(nodes(update)) == ["Index Scan"] * 3 + ["ModifyTable"], nodes(update)
