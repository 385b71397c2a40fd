"""Differential check of the claim: another commit's outbox_claim and outbox_next_due against this
checkout's, on random hint states (forged ones included).

Usage: pgfence db run -- python bench/claim_diff.py BASE_FUNCTIONS_DIR [TRIALS] [SEED]
One database migrated with this checkout; the base's two functions are installed next to them as
pgfence.outbox_claim_base and pgfence.outbox_next_due_base. Each trial picks a hint state (fields
near the messages' keys, xid bounds below, at or above the transaction's, flags, a time after the
clock, garbage), a batch, a scope (all channels, one, a set with repeats, {NULL}), a
pgfence.claim_full_walk_ms, whether the transaction already has its xid, and a row locked by
another session; then runs base and new, each in its own transaction that is rolled back, on the
same state, and compares what they return (ids, attempts, leases, channels) and the hint state
they leave (the transaction's xid and this call's clock replaced by tokens), and outbox_next_due
of the same state. Prints how many trials differ and the first ten. A tool for a change of the
claim's code that must not change its behaviour (issue 18), not a test: the pgTAP files and
isolation specs are the contract.
"""
import random
import re
import sys
from pathlib import Path
from typing import Any

import psycopg

sys.path.insert(0, str(Path(__file__).parent))
from keyed_ab import ab_databases

XID_TOKENS = ("X", "XLO", "XHI")


def _base_functions(base: Path) -> str:
    """The base's outbox_claim and outbox_next_due, renamed *_base."""
    src = (base / "12_outbox_claim.sql").read_text()
    out = []
    for name in ("outbox_claim", "outbox_next_due"):
        m = re.search(rf"CREATE OR REPLACE FUNCTION pgfence\.{name}\(.*?\n\$\$;\n", src, re.S)
        assert m, name
        out.append(m.group(0).replace(f"pgfence.{name}(", f"pgfence.{name}_base(", 1))
    return "\n".join(out)


def _us(conn: psycopg.Connection[Any]) -> int:
    return int(conn.execute("SELECT (extract(epoch FROM clock_timestamp()) * 1000000)::bigint")
               .fetchone()[0])  # type: ignore[index]


def _state(rnd: random.Random, keys: list[tuple[int, int]], now_us: int) -> list[Any]:
    k1, k2 = rnd.choice(keys), rnd.choice(keys)
    st: list[Any] = [rnd.choice([None, k1[0], k1[0] - 1, k1[0] + 1, 0]),
                     rnd.choice([None, k1[1], k1[1] - 1, k1[1] + 1]),
                     rnd.choice([None, k2[0], k2[0] + 1]), rnd.choice([None, k2[1], k2[1] - 1]),
                     rnd.choice([None, "XLO", "XHI", "X"]), rnd.choice([None, "X", "XLO", 7]),
                     rnd.choice([None, 0, 1, 2]), rnd.choice([None, now_us - 10**9, now_us, 0])]
    if rnd.random() < 0.05:
        st[rnd.choice([0, 2, 7])] = now_us + 10**12  # a time after the clock
    if rnd.random() < 0.05:
        st = rnd.choice([["garbage"], [*st, 1], [*st[:7], "1" * 19]])
    return st


Conn = psycopg.Connection[Any]
SCOPES: list[Any] = [None, ["a"], ["b"], ["a", "b"], ["b", "a", "b"], [None], ["a", None]]


def _one(c: Conn, locker: Conn, suffix: str, trial: dict[str, Any]) -> Any:
    """One call of the base (suffix "_base") or new functions in a transaction rolled back:
    (claimed rows, the hint state left, normalised; next_due in s or None)."""
    one = c.execute
    if trial["lock"] is not None:
        locker.execute("BEGIN")
        locker.execute("SELECT 1 FROM pgfence.outbox WHERE id = %s FOR UPDATE", (trial["lock"],))
    one("BEGIN")
    if trial["pre_xid"]:
        ref = one("SELECT pg_current_xact_id()::text::bigint").fetchone()[0]  # type: ignore[index]
    else:  # the xid this transaction will get
        ref = one("SELECT pg_snapshot_xmax(pg_current_snapshot())::text::bigint").fetchone()[0]  # type: ignore[index]
    sub = {"X": ref, "XLO": ref - 1000, "XHI": ref + 1000}
    raw = ",".join("" if v is None else str(sub[v]) if v in XID_TOKENS else str(v) for v in trial["state"])
    chans = trial["chans"]
    name = one("SELECT pgfence._outbox_claim_hint_name(%s)", (chans,)).fetchone()[0]  # type: ignore[index]
    if name is not None:
        one("SELECT set_config(%s, %s, false)", (name, raw))
    if trial["walk"] is not None:
        one("SELECT set_config('pgfence.claim_full_walk_ms', %s, false)", (trial["walk"],))
    due = one(f"SELECT pgfence.outbox_next_due{suffix}(%s)", (chans,)).fetchone()[0]  # type: ignore[index]
    t0 = _us(c)
    rows = one(f"SELECT id, attempt, lease, channel FROM pgfence.outbox_claim{suffix}('w', %s, %s)",
               (trial["batch"], chans)).fetchall()
    t1 = _us(c)
    mine = one("SELECT pg_current_xact_id_if_assigned()::text::bigint").fetchone()[0]  # type: ignore[index]
    after = one("SELECT current_setting(%s, true)", (name,)).fetchone()[0] if name else None  # type: ignore[index]
    one("ROLLBACK")
    if trial["lock"] is not None:
        locker.execute("ROLLBACK")
    tokens = {ref - 1000: "XLO", ref + 1000: "XHI", ref: "X"}
    norm = []
    for f in (after or "").split(","):
        if f and mine is not None and int(f) == mine:
            f = "MINE"
        elif f and t0 <= int(f) <= t1:
            f = "NOW"
        elif f and int(f) in tokens:
            f = tokens[int(f)]
        norm.append(f)
    return rows, norm, None if due is None else due.total_seconds()


def main() -> None:
    """Run the trials and print the differences."""
    trials = int(sys.argv[2]) if len(sys.argv) > 2 else 2000
    rnd = random.Random(int(sys.argv[3]) if len(sys.argv) > 3 else 1)
    _, dsn = ab_databases(Path("/nonexistent"), ("cd_unused", "claim_diff"))
    with psycopg.connect(dsn, autocommit=True) as c, psycopg.connect(dsn, autocommit=True) as locker:
        c.execute(_base_functions(Path(sys.argv[1])).encode())
        c.execute("SELECT pgfence.outbox_configure_channel('a', p_lease => '7 minutes')")
        for ch in ("a", "b"):
            c.execute("SELECT count(*) FROM pgfence.outbox_enqueue_many(%s, array_fill('r'::text, ARRAY[6]),"
                      " array_fill('{}'::jsonb, ARRAY[6]))", (ch,))
        c.execute("SELECT pgfence.outbox_enqueue('b', 'r', '{}', p_deliver_at => now() + interval '1 hour')")
        keys = [(int(r[0]), int(r[1])) for r in c.execute(
            "SELECT (extract(epoch FROM next_attempt_at) * 1000000)::bigint, id"
            " FROM pgfence.outbox ORDER BY 1, 2")]
        now_us = _us(c)
        differ = 0
        for _ in range(trials):
            trial = {"state": _state(rnd, keys, now_us), "batch": rnd.choice([1, 1, 2, 3, 20]),
                     "chans": rnd.choice(SCOPES),
                     "walk": rnd.choice([None, "0", "1000", "60000", "x"]), "pre_xid": rnd.random() < 0.4,
                     "lock": rnd.choice([None, None, rnd.choice(keys)[1]])}
            (rows_a, st_a, due_a), (rows_b, st_b, due_b) = (_one(c, locker, s, trial) for s in ("_base", ""))
            # next_due is a time from the clock: the same if both NULL, or within 50 ms
            same_due = due_a == due_b or (None not in (due_a, due_b) and abs(due_a - due_b) < 0.05)
            if (rows_a, st_a) != (rows_b, st_b) or not same_due:
                differ += 1
                if differ <= 10:
                    print("DIFF", trial, (rows_a, st_a, due_a), (rows_b, st_b, due_b), flush=True)
        print(f"{trials} trials, {differ} differ")


if __name__ == "__main__":
    main()
