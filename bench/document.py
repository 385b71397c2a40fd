"""Document benchmark: pgfence's CAS save next to a bare ``UPDATE … WHERE version = $v``.

Workloads, each in the same run and on the same database:

- **uncontended**: one connection saves one document N times in a row, always on the right
  version (autocommit, one round trip per save).
  * ``document_save``: the CAS with its checks, a revision row (the receipt) and an event row;
    a ``save_id`` on every save, as the session sends it. Also on a kind registered with
    ``log_saves => false`` (migration 0014): no event row per save.
  * the hand-written equivalent with the same guarantees (target of issue 14: ``document_save``
    >= 0.9x of it): the CAS ``UPDATE ... WHERE version = $v`` plus an INSERT of the revision, in
    one transaction (one statement), below as "bare + history".
  * bare: ``UPDATE bench_doc SET version = version + 1, content = $c WHERE id = $id AND
    version = $v`` on a table of the same shape without triggers or history.
  * bare + history: the same UPDATE plus an INSERT of the new version into a history table in
    one statement — what a hand-written versioned table with revisions costs.
- **contended**: 16 processes on one document, each incrementing its own attribute until it has
  made ``PER_WRITER`` successful saves: read, modify, save; on a conflict, retry. With pgfence
  the conflict answer already carries the stored version and content, so a retry needs no extra
  read; the bare loop has to SELECT again. Reported: successful saves/s over the whole run and
  the conflict rate (conflicts / save attempts); the final counters are checked (no lost update).

The uncontended loops run ``ROUNDS`` times, interleaved, each keeping its best round (back-to-back
runs on a small VM differ by up to 15%).

``run(dsn)`` returns the numbers and the ratios pgfence / bare; ``python bench/document.py``
runs against ``$DATABASE_URL``.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import sys
import time
import uuid
from typing import Any

import psycopg
from psycopg.types.json import Jsonb

N = 3000
ROUNDS = 3
TARGET = 0.9
WRITERS = 16
PER_WRITER = 100

BARE_DDL = """
DROP TABLE IF EXISTS bench_doc, bench_doc_rev;
CREATE TABLE bench_doc (id bigint PRIMARY KEY, version bigint NOT NULL, content jsonb NOT NULL,
                        saved_by text NOT NULL, saved_at timestamptz NOT NULL DEFAULT now());
CREATE TABLE bench_doc_rev (id bigint NOT NULL, version bigint NOT NULL, content jsonb NOT NULL,
                            saved_by text NOT NULL, saved_at timestamptz NOT NULL,
                            PRIMARY KEY (id, version));
"""
SQL_SAVE = ("SELECT outcome, version, content FROM pgfence.document_save(%s::bigint, %s::bigint,"
            " %s::jsonb, %s::text, %s::text)")
SQL_GET = "SELECT version, content FROM pgfence.document_get(%s::bigint)"
SQL_BARE = ("UPDATE bench_doc SET version = version + 1, content = %s::jsonb, saved_by = %s,"
            " saved_at = now() WHERE id = %s AND version = %s")
SQL_BARE_HISTORY = (
    "WITH u AS (UPDATE bench_doc SET version = version + 1, content = %s::jsonb, saved_by = %s,"
    " saved_at = now() WHERE id = %s AND version = %s RETURNING id, version, content, saved_by,"
    " saved_at) INSERT INTO bench_doc_rev SELECT * FROM u")
SQL_BARE_GET = "SELECT version, content FROM bench_doc WHERE id = %s"


def _content(i: int) -> dict[str, Any]:
    return {"title": "Quarterly plan", "owner": "ann", "status": "draft", "n": i,
            "notes": "x" * 200}


def _new_doc(conn: psycopg.Connection[Any], kind: str = "record") -> int:
    row = conn.execute("SELECT pgfence.document_create(%s, %s, 'bench')",
                       (kind, Jsonb(_content(0)))).fetchone()
    assert row is not None
    return int(row[0])


def _new_bare(conn: psycopg.Connection[Any], doc_id: int) -> None:
    conn.execute("INSERT INTO bench_doc (id, version, content, saved_by) VALUES (%s, 1, %s, 'b')",
                 (doc_id, Jsonb(_content(0))))


# -- uncontended ------------------------------------------------------------------------------
def uncontended(dsn: str, n: int = N) -> dict[str, float]:
    """Saves per second for one writer that is never in conflict (best of ROUNDS, interleaved)."""
    best: dict[str, float] = {}
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("SELECT * FROM pgfence.document_register_kind('bench.quiet', 'attributes',"
                      " p_log_saves => false)")
        for _ in range(ROUNDS):
            for key, kind in (("document_save_per_second", "record"),
                              ("document_save_log_saves_off_per_second", "bench.quiet")):
                doc = _new_doc(conn, kind)
                t0 = time.perf_counter()
                for i in range(1, n + 1):
                    row = conn.execute(SQL_SAVE, (doc, i, Jsonb(_content(i)), "bench",
                                                  uuid.uuid4().hex)).fetchone()
                    assert row is not None and row[0] == "saved"
                best[key] = max(best.get(key, 0.0), n / (time.perf_counter() - t0))
            for key, sql in (("bare_update_per_second", SQL_BARE),
                             ("bare_update_with_history_per_second", SQL_BARE_HISTORY)):
                conn.execute(BARE_DDL)
                _new_bare(conn, 1)
                t0 = time.perf_counter()
                for i in range(1, n + 1):
                    cur = conn.execute(sql, (Jsonb(_content(i)), "bench", 1, i))
                    assert cur.rowcount == 1
                best[key] = max(best.get(key, 0.0), n / (time.perf_counter() - t0))
    return best


# -- contended --------------------------------------------------------------------------------
def _pgfence_writer(dsn: str, doc: int, i: int, start: Any, out: Any) -> None:
    key = f"w{i:02d}"
    saves = conflicts = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(SQL_GET, (doc,)).fetchone()
        assert row is not None
        version, content = row
        start.wait(60)
        while saves < PER_WRITER:
            content[key] = content.get(key, 0) + 1
            row = conn.execute(SQL_SAVE, (doc, version, Jsonb(content), key,
                                          uuid.uuid4().hex)).fetchone()
            assert row is not None
            if row[0] == "saved":
                saves += 1
                version = row[1]
            else:                      # the conflict answer carries the stored copy: no re-read
                conflicts += 1
                version, content = row[1], row[2]
    out.put((saves, conflicts))


def _bare_writer(dsn: str, doc: int, i: int, start: Any, out: Any) -> None:
    key = f"w{i:02d}"
    saves = conflicts = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        start.wait(60)
        while saves < PER_WRITER:
            row = conn.execute(SQL_BARE_GET, (doc,)).fetchone()
            assert row is not None
            version, content = row
            content[key] = content.get(key, 0) + 1
            if conn.execute(SQL_BARE, (Jsonb(content), key, doc, version)).rowcount == 1:
                saves += 1
            else:
                conflicts += 1
    out.put((saves, conflicts))


def _guarded(target: Any, dsn: str, doc: int, i: int, start: Any, out: Any) -> None:
    try:
        target(dsn, doc, i, start, out)
    except BaseException as exc:  # report instead of leaving the parent waiting
        out.put(exc)


def _contend(dsn: str, target: Any, doc: int) -> dict[str, float]:
    ctx = mp.get_context("spawn")
    start, out = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_guarded, args=(target, dsn, doc, i, start, out), daemon=True)
             for i in range(WRITERS)]
    for p in procs:
        p.start()
    time.sleep(1.0)                    # let every process connect and wait on the start event
    t0 = time.perf_counter()
    start.set()
    try:
        results = [out.get(timeout=600) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    elapsed = time.perf_counter() - t0
    failed = [r for r in results if isinstance(r, BaseException)]
    if failed:
        raise RuntimeError(f"{len(failed)} writer(s) failed: {failed[0]!r}") from failed[0]
    saves = sum(r[0] for r in results)
    conflicts = sum(r[1] for r in results)
    return {"writers": WRITERS, "saves": saves, "conflicts": conflicts, "seconds": elapsed,
            "saves_per_second": saves / elapsed,
            "attempts_per_second": (saves + conflicts) / elapsed,
            "conflict_rate": conflicts / (saves + conflicts)}


def contended(dsn: str) -> dict[str, dict[str, float]]:
    """16 processes incrementing their own attribute of one document, pgfence and bare."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        doc = _new_doc(conn)
        conn.execute(BARE_DDL)
        _new_bare(conn, doc)
    res = {"document_save": _contend(dsn, _pgfence_writer, doc),
           "bare_update": _contend(dsn, _bare_writer, doc)}
    expected = {f"w{i:02d}": PER_WRITER for i in range(WRITERS)}
    with psycopg.connect(dsn, autocommit=True) as conn:
        for sql in (SQL_GET, SQL_BARE_GET):
            row = conn.execute(sql, (doc,)).fetchone()
            assert row is not None
            got = {k: v for k, v in row[1].items() if k.startswith("w")}
            assert got == expected, f"lost update: {got}"
    return res


def run(dsn: str) -> dict[str, Any]:
    """Run both workloads; print a table; return the numbers and the pgfence/bare ratios."""
    print(f"document: {N} uncontended saves; {WRITERS} writers x {PER_WRITER} saves on one"
          " document", flush=True)
    res: dict[str, Any] = {"uncontended": uncontended(dsn), "contended": contended(dsn)}
    u, c = res["uncontended"], res["contended"]
    res["ratios"] = {
        "uncontended_save_vs_bare_update":
            u["document_save_per_second"] / u["bare_update_per_second"],
        "uncontended_save_vs_bare_update_with_history":
            u["document_save_per_second"] / u["bare_update_with_history_per_second"],
        "uncontended_save_log_saves_off_vs_bare_update_with_history":
            u["document_save_log_saves_off_per_second"] / u["bare_update_with_history_per_second"],
        "contended_saves_vs_bare_update":
            c["document_save"]["saves_per_second"] / c["bare_update"]["saves_per_second"],
    }
    r = res["ratios"]
    print(f"{'uncontended (saves/s)':46} {'rate':>10} {'x bare':>8}")
    print(f"{'bare UPDATE ... WHERE version = $v':46} {u['bare_update_per_second']:10,.0f}"
          f" {1.0:7.2f}x")
    print(f"{'bare UPDATE + history INSERT':46} {u['bare_update_with_history_per_second']:10,.0f}"
          f" {u['bare_update_with_history_per_second'] / u['bare_update_per_second']:7.2f}x")
    print(f"{'document_save (CAS, receipt, revision, event)':46}"
          f" {u['document_save_per_second']:10,.0f} {r['uncontended_save_vs_bare_update']:7.2f}x")
    print(f"{'document_save, kind with log_saves off':46}"
          f" {u['document_save_log_saves_off_per_second']:10,.0f}"
          f" {u['document_save_log_saves_off_per_second'] / u['bare_update_per_second']:7.2f}x")
    for label, key in (("event on", "uncontended_save_vs_bare_update_with_history"),
                       ("log_saves off", "uncontended_save_log_saves_off_vs_bare_update_with_history")):
        print(f"  target: document_save ({label}) >= {TARGET}x bare UPDATE + history INSERT:"
              f" {r[key]:.2f}x {'MET' if r[key] >= TARGET else 'MISSED'}")
    print(f"{'contended, 16 writers (successful saves/s)':46} {'rate':>10} {'x bare':>8}"
          f" {'conflicts':>10}")
    b, d = c["bare_update"], c["document_save"]
    print(f"{'bare read + UPDATE ... WHERE version = $v':46} {b['saves_per_second']:10,.0f}"
          f" {1.0:7.2f}x {b['conflict_rate']:9.0%}")
    print(f"{'document_save (conflict answer has the copy)':46} {d['saves_per_second']:10,.0f}"
          f" {r['contended_saves_vs_bare_update']:7.2f}x {d['conflict_rate']:9.0%}")
    return res


if __name__ == "__main__":
    url = os.environ.get("DATABASE_URL")
    if not url:
        sys.exit("set DATABASE_URL to a migrated pgfence database")
    run(url)
