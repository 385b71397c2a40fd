"""16 writer processes x 200 saves on one record, each through its own DocumentSession.

Each writer increments its own attribute, saves, and on a conflict rebases (record merge by
attribute) and saves again, until 200 of its saves were acknowledged. Afterwards: every counter
is exactly 200 (zero lost updates), the history is versions 1..3201 without a gap, every version
was a CAS on its predecessor, and the versions acknowledged to the writers are exactly 2..3201,
each once.
"""

from __future__ import annotations

import asyncio
import multiprocessing as mp
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgfence.documents import ConflictPending, DocumentSession, api

WRITERS = 16
SAVES = 200


def _writer(dsn: str, doc: int, i: int, drafts: str, start: Any, out: Any) -> None:
    async def main() -> tuple[list[int], int]:
        acked: list[int] = []
        conflicts = 0
        async with await DocumentSession.open(doc, user=f"w{i}", dsn=dsn, drafts=drafts,
                                              debounce_ms=0, retry_base_ms=5,
                                              retry_cap_ms=100) as s:
            start.wait(60)
            key = f"w{i:02d}"
            while len(acked) < SAVES:
                content = s.content
                content[key] = content.get(key, 0) + 1
                s.edit(content)
                while True:
                    try:
                        acked.append(await s.flush(timeout=60))
                        break
                    except ConflictPending:
                        conflicts += 1
                        merged = await s.rebase()
                        assert merged.clean, merged.conflicts
        return acked, conflicts

    try:
        out.put((i, asyncio.run(main()), None))
    except BaseException as exc:  # report, never hang the parent
        out.put((i, None, repr(exc)))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_16_writers_200_saves_each_lose_nothing(db: str, tmp_path: Path) -> None:
    with psycopg.connect(db, autocommit=True) as c:
        doc = api.create(c, "record", {}, "setup")
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(db, doc, i, str(tmp_path / "drafts.sqlite3"),
                                               start, out), daemon=True)
             for i in range(WRITERS)]
    for p in procs:
        p.start()
    try:
        start.set()
        results = [out.get(timeout=540) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    errors = [(i, err) for i, _, err in results if err]
    assert not errors, errors

    acked = sorted(v for _, (versions, _), _ in results for v in versions)
    conflicts = sum(n for _, (_, n), _ in results)
    total = WRITERS * SAVES
    with psycopg.connect(db, autocommit=True) as c:
        final = api.get(c, doc)
        history = sorted(r["version"] for r in api.history(c, doc, 10000))
        bad_chain = c.execute(
            "SELECT count(*) FROM pgfence.event WHERE module = 'document' AND item_id = %s"
            " AND event = 'save' AND (detail ->> 'based_on')::bigint <> fence - 1",
            (doc,)).fetchone()
        logged_conflicts = c.execute(
            "SELECT count(*) FROM pgfence.event WHERE module = 'document' AND item_id = %s"
            " AND event = 'conflict'", (doc,)).fetchone()
    assert final.content == {f"w{i:02d}": SAVES for i in range(WRITERS)}, "no lost update"
    assert history == list(range(1, total + 2)), "gap-free history 1..3201"
    assert final.version == total + 1
    assert acked == list(range(2, total + 2)), "each version acknowledged to exactly one writer"
    assert bad_chain == (0,), "every version was a CAS on its predecessor"
    assert logged_conflicts == (conflicts,), "every conflict answer is in the event log"
    assert conflicts > 0, "16 writers on one document must have collided"
    print(f"\n16x200: {total} saves, {conflicts} conflicts "
          f"({conflicts / (total + conflicts):.0%} of CAS attempts)")
