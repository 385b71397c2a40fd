"""The draft file shared by several processes: opened while another process writes it.

16 writer processes of tests/test_document_concurrency.py open one new drafts.sqlite3 together,
and one of them failed now and then with "database is locked" before it saved anything:
switching a file to WAL mode answers that at once while another connection holds a write lock
(SQLite does not wait its busy timeout for that switch). Here the lock is held on purpose by a
real second process, so the case happens every time, and then by 16 openers released together.
"""

from __future__ import annotations

import multiprocessing as mp
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pytest

from pgfence.documents.drafts import Draft, DraftStore

OPENERS = 16

HOLDER = textwrap.dedent("""
    import sqlite3, sys, time
    db = sqlite3.connect(sys.argv[1], isolation_level=None)
    db.execute("BEGIN IMMEDIATE")  # a write lock on the file, in its first (rollback) journal mode
    db.execute("CREATE TABLE held (x)")
    print("held", flush=True)
    time.sleep(float(sys.argv[2]))
    db.execute("COMMIT")
""")


def _draft(i: int) -> Draft:
    return Draft(scope="s", user=f"u{i}", document_id=1, writer_id=f"w{i}", kind="record",
                 base_version=1, content_json="{}", snapshot_id=f"x{i}", updated_at=time.time(),
                 save_id=None)


@pytest.mark.timeout(60)
def test_a_draft_file_opens_while_another_process_holds_its_write_lock(tmp_path: Path) -> None:
    path = tmp_path / "drafts.sqlite3"
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(path), "0.5"],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        started = time.monotonic()
        with DraftStore(path) as store:  # waits for the lock instead of failing at once
            store.put(_draft(0))
            assert [d.writer_id for d in store.list(scope="s")] == ["w0"]
        assert time.monotonic() - started >= 0.3, "it waited for the holder's commit"
    finally:
        assert holder.wait(timeout=30) == 0


def _open_and_write(path: str, i: int, start: Any, out: Any) -> None:
    try:
        start.wait(60)
        with DraftStore(path) as store:
            store.put(_draft(i))
        out.put((i, None))
    except BaseException as exc:  # report, never hang the parent
        out.put((i, repr(exc)))


@pytest.mark.timeout(120)
def test_many_processes_open_one_new_draft_file_at_once(tmp_path: Path) -> None:
    path = tmp_path / "drafts.sqlite3"
    ctx = mp.get_context("spawn")
    start = ctx.Event()
    out: Any = ctx.Queue()
    procs = [ctx.Process(target=_open_and_write, args=(str(path), i, start, out), daemon=True)
             for i in range(OPENERS)]
    for p in procs:
        p.start()
    try:
        start.set()
        results = [out.get(timeout=90) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert [err for _, err in results if err] == []
    with DraftStore(path) as store:
        assert len(store.list(scope="s")) == OPENERS, "every writer's slot is kept"
