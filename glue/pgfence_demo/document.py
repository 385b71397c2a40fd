"""Demo scene: versioned documents — two writers on one record (conflict, rebase by attribute),
a sheet conflict that stays a conflict, a save whose answer the network drops, and a writer
killed with unsaved edits whose draft is offered to the next session."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import click

from pgfence.documents import (
    ConflictPending,
    DocumentSession,
    MergeConflict,
    SessionState,
    StateChange,
    api,
)

from . import DemoContext
from .faults import FaultyLink

TITLE = "Documents: compare-and-swap saves, explicit conflicts, lost answers, drafts after a crash"


def _fmt(content: Any) -> str:
    return json.dumps(content, ensure_ascii=False, sort_keys=True)


async def _open(ctx: DemoContext, doc: int, user: str, drafts: Path, dsn: str | None = None,
                states: list[StateChange] | None = None) -> DocumentSession:
    return await DocumentSession.open(
        doc, user=user, dsn=dsn or ctx.dsn, drafts=drafts, debounce_ms=50, retry_base_ms=200,
        on_state=states.append if states is not None else None,
        connect_kwargs={"prepare_threshold": None})


async def _record_conflict(ctx: DemoContext, drafts: Path) -> int:
    with ctx.connect() as conn:
        doc = api.create(conn, "record", {"title": "Q3 plan", "owner": "ann", "budget": 100,
                                          "notes": ""}, "setup")
    ctx.step(f"record document #{doc} created at version 1; ann and bob both open it")
    ann = await _open(ctx, doc, "ann", drafts)
    bob = await _open(ctx, doc, "bob", drafts)

    ann.edit({**ann.content, "title": "Q3 plan (final)"})
    ctx.check(await ann.flush(10) == 2, "ann renames it: saved as version 2")

    ctx.step("bob, still on version 1, raises the budget")
    bob.edit({**bob.content, "budget": 150})
    try:
        await bob.flush(10)
        ctx.check(False, "bob's save is answered conflict")
    except ConflictPending as exc:
        c = exc.conflict
        ctx.check(bob.state is SessionState.CONFLICT and c.stored_version == 2,
                  f"bob's save based on version {c.base_version} is answered conflict: "
                  f"version {c.stored_version} by {c.stored_by}; nothing was overwritten")
        ctx.table([("base (v1)", _fmt(c.base)), ("bob's copy", _fmt(c.local)),
                   (f"stored (v{c.stored_version})", _fmt(c.stored))], ["copy", "content"])
    merged = await bob.rebase()
    ctx.check(merged.clean, "rebase: the record merge takes each attribute from the side that "
                            "changed it (title from ann, budget from bob), no conflict left")
    ctx.check(await bob.flush(10) == 3, "bob's merge is saved as version 3, a new CAS on v2")
    with ctx.connect() as conn:
        final = api.get(conn, doc).content
    ctx.check(final["title"] == "Q3 plan (final)" and final["budget"] == 150,
              f"both edits are in version 3: {_fmt(final)}")

    ctx.step("both change the owner: the same attribute, two different values")
    await ann.refresh()                    # ann was clean on version 2: she takes version 3
    ann.edit({**ann.content, "owner": "ann & team"})
    await ann.flush(10)
    bob.edit({**bob.content, "owner": "bob"})
    with contextlib.suppress(ConflictPending):
        await bob.flush(10)
    try:
        await bob.rebase()
        ctx.check(False, "the merge reports the owner as a conflict")
    except MergeConflict as exc:
        ctx.check([c["key"] for c in exc.merged.conflicts] == ["owner"],
                  f"the merge stops on one conflict: {_fmt(exc.merged.conflicts)}")
    await bob.rebase(lambda r: {**r.merged.content, "owner": "bob (with ann's team)"})
    version = await bob.flush(10)
    ctx.check(version == 5, f"bob resolves it himself and saves version {version}")
    await ann.close()
    await bob.close()
    return doc


async def _sheet_conflict(ctx: DemoContext, drafts: Path) -> None:
    with ctx.connect() as conn:
        doc = api.create(conn, "sheet", {"A1": 1, "B1": 2}, "setup")
    ctx.step(f"sheet document #{doc}: ann sets A1, bob (on the old version) sets B1")
    ann = await _open(ctx, doc, "ann", drafts)
    bob = await _open(ctx, doc, "bob", drafts)
    ann.edit({"A1": 10, "B1": 2})
    await ann.flush(10)
    bob.edit({"A1": 1, "B1": 20})
    with contextlib.suppress(ConflictPending):
        await bob.flush(10)
    try:
        await bob.rebase()
        ctx.check(False, "a sheet does not merge")
    except MergeConflict as exc:
        ctx.check(exc.merged.content is None and bob.state is SessionState.CONFLICT,
                  f"a sheet never merges: every difference is a conflict "
                  f"({', '.join(str(c['key']) for c in exc.merged.conflicts)}); bob stays in "
                  "conflict until a person decides")
    with ctx.connect() as conn:
        stored = api.get(conn, doc)
    ctx.check(stored.version == 2 and stored.content == {"A1": 10, "B1": 2},
              f"the server still holds ann's version 2: {_fmt(stored.content)}")
    ctx.step("bob decides to drop his copy: discard_and_reload fetches first, then replaces")
    ctx.check(await bob.discard_and_reload() and bob.state is SessionState.CLEAN
              and bob.content == {"A1": 10, "B1": 2}, "bob is clean on version 2")
    await ann.close()
    await bob.close()


async def _dropped_answer(ctx: DemoContext, drafts: Path, doc: int) -> None:
    states: list[StateChange] = []
    async with FaultyLink(ctx.dsn) as link:
        ctx.step(f"bob edits document #{doc} over a link that will drop the answer of his save")
        bob = await _open(ctx, doc, "bob", drafts, dsn=link.dsn, states=states)
        before = bob.version
        link.drop_next_response(b"document_save")
        bob.edit({**bob.content, "notes": "approved in the Monday meeting"})
        version = await bob.flush(15)
        await bob.close()
    seen = [s.state.value for s in states]
    ctx.step(f"bob's session went through: {' -> '.join(seen)}")
    ctx.check(link.dropped == 1 and SessionState.ERROR.value in seen,
              "the server committed the save but the answer was lost: the session saw a "
              "connection error (outcome unknown)")
    ctx.check(version == before + 1,
              f"it retried the same save (same save_id) and was answered saved, version "
              f"{version}")
    with ctx.connect() as conn:
        history = api.history(conn, doc)
        replays = conn.execute("SELECT count(*) FROM pgfence.event WHERE module = 'document'"
                               " AND item_id = %s AND event = 'replay'", (doc,)).fetchone()
    ctx.check(history[0]["version"] == version and history[1]["version"] == before
              and replays == (1,),
              "one version was made, not two, and no false conflict: the retry was answered "
              "from the save's receipt (a replay event)")


def _crash_writer(ctx: DemoContext, doc: int, drafts: Path, content: Any) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgfence_demo.document", "crash-writer", "--dsn", ctx.dsn,
         "--doc", str(doc), "--drafts", str(drafts), "--user", "carol",
         "--content", json.dumps(content)],
        stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ready = proc.stdout.readline().strip()
        ctx.step(f"carol's laptop (pid {proc.pid}): {ready}")
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        ctx.step(f"SIGKILL pid {proc.pid} before its save was due")
    finally:
        if proc.poll() is None:
            proc.kill()


async def _crash_and_draft(ctx: DemoContext, drafts: Path, doc: int) -> None:
    with ctx.connect() as conn:
        start = api.get(conn, doc)
    _crash_writer(ctx, doc, drafts, {**start.content, "notes": "carol: add the hiring plan"})
    with ctx.connect() as conn:
        cur = api.get(conn, doc)
        api.save(conn, doc, cur.version, {**cur.content, "budget": 175}, "ann")
    ctx.step("meanwhile ann raised the budget to 175")

    carol = await _open(ctx, doc, "carol", drafts)
    offered = carol.sibling_drafts
    ctx.check(len(offered) == 1, f"carol opens the document again: {len(offered)} unsaved "
                                 "draft of hers is offered")
    if not offered:
        await carol.close()
        return
    draft = offered[0]
    ctx.table([(draft.writer_id, draft.base_version, _fmt(draft.content))],
              ["writer", "based on version", "content"])
    ctx.check(carol.content == cur.content | {"budget": 175} and not carol.pending,
              "it is not applied silently: carol's session shows the stored version")
    ctx.step("carol adopts it: it is saved through the CAS on the version it was based on")
    await carol.adopt(draft)
    try:
        await carol.flush(10)
    except ConflictPending as exc:
        ctx.check(True, f"based on version {exc.conflict.base_version}, the document is at "
                        f"{exc.conflict.stored_version}: a conflict, not an overwrite")
        await carol.rebase()
        await carol.flush(10)
    await carol.close()
    with ctx.connect() as conn:
        final = api.get(conn, doc)
    ctx.check(final.content["notes"] == "carol: add the hiring plan"
              and final.content["budget"] == 175,
              f"carol's note and ann's budget are both in version {final.version}")
    from pgfence.documents import DraftStore
    with DraftStore(drafts) as store:
        left = store.list(user="carol", document_id=doc)
    ctx.check(not left, "the draft was deleted once its content was saved")


async def _scene(ctx: DemoContext, drafts: Path) -> None:
    doc = await _record_conflict(ctx, drafts)
    await _sheet_conflict(ctx, drafts)
    await _dropped_answer(ctx, drafts, doc)
    await _crash_and_draft(ctx, drafts, doc)
    with ctx.connect() as conn:
        trail = conn.execute(
            "SELECT e.event, e.actor, e.fence, coalesce(e.detail ->> 'based_on',"
            " e.detail ->> 'expected_version'), left(coalesce(e.detail ->> 'save_id', ''), 12)"
            " FROM pgfence.event e WHERE e.module = 'document' AND e.item_id = %s ORDER BY e.id",
            (doc,)).fetchall()
    ctx.step(f"the event log of record #{doc} (conflicts and replays are logged too)")
    ctx.table(trail, ["event", "actor", "version", "based on / expected", "save_id"])


def run(ctx: DemoContext) -> None:
    drafts_dir = Path(tempfile.mkdtemp(prefix="pgfence-demo-drafts-"))
    try:
        asyncio.run(_scene(ctx, drafts_dir / "drafts.sqlite3"))
    finally:
        shutil.rmtree(drafts_dir, ignore_errors=True)


def _crash_writer_main(argv: list[str]) -> None:
    """``python -m pgfence_demo.document crash-writer …``: edit, say so, wait to be killed."""
    p = argparse.ArgumentParser()
    p.add_argument("cmd", choices=["crash-writer"])
    p.add_argument("--dsn", required=True)
    p.add_argument("--doc", type=int, required=True)
    p.add_argument("--drafts", required=True)
    p.add_argument("--user", required=True)
    p.add_argument("--content", required=True)
    args = p.parse_args(argv)

    async def main() -> None:
        s = await DocumentSession.open(args.doc, user=args.user, dsn=args.dsn,
                                       drafts=args.drafts, debounce_ms=60_000)
        s.edit(json.loads(args.content))
        click.echo(f"edited document {args.doc} (draft written, save due in 60 s)")
        sys.stdout.flush()
        await asyncio.sleep(120)

    asyncio.run(main())


if __name__ == "__main__":
    _crash_writer_main(sys.argv[1:])
