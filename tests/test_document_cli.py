"""``pgfence doc``: the CLI against the real database."""

from __future__ import annotations

import json
import time
from pathlib import Path

import psycopg
from click.testing import CliRunner

from pgfence.cli import main
from pgfence.cli.document import EXIT_CONFLICT
from pgfence.documents import Draft, DraftStore, api


def cli(dsn: str, *args: str, input: str | None = None) -> tuple[int, str, str]:
    result = CliRunner().invoke(main, ["--dsn", dsn, *args], input=input)
    return result.exit_code, result.stdout, result.stderr


def test_create_get_save_conflict_history_delete(db: str, tmp_path: Path) -> None:
    code, out, _ = cli(db, "doc", "create", "--by", "ann", '{"title": "a"}')
    assert code == 0
    doc = out.strip()

    code, out, _ = cli(db, "doc", "get", doc, "--json")
    got = json.loads(out)
    assert (code, got["version"], got["content"]) == (0, 1, {"title": "a"})
    assert got["created_by"] == "ann"

    code, out, _ = cli(db, "doc", "save", doc, "-e", "1", "--by", "ann", "--save-id", "s-1",
                       '{"title": "b"}')
    assert code == 0 and "version 2" in out
    code, out, _ = cli(db, "doc", "save", doc, "-e", "1", "--by", "ann", "--save-id", "s-1",
                       '{"title": "b"}')
    assert code == 0 and "version 2" in out and "receipt" in out, "a retried save is answered saved"

    body = tmp_path / "c.json"
    body.write_text('{"title": "stale"}')
    code, out, err = cli(db, "doc", "save", doc, "-e", "1", "--by", "bob", f"@{body}")
    assert code == EXIT_CONFLICT
    assert "version 2" in err and json.loads(out) == {"title": "b"}

    code, out, _ = cli(db, "doc", "save", doc, "-e", "2", "--by", "bob", "-", input='{"t": 1}')
    assert code == 0 and "version 3" in out

    code, out, _ = cli(db, "doc", "history", doc, "--json")
    hist = json.loads(out)
    assert [(h["version"], h["op"], h["saved_by"]) for h in hist] == [
        (3, "save", "bob"), (2, "save", "ann"), (1, "create", "ann")]
    assert hist[1]["save_id"] == "s-1"

    code, out, _ = cli(db, "doc", "get", doc, "--version", "2", "--content-only")
    assert (code, json.loads(out)) == (0, {"title": "b"})

    code, _, _ = cli(db, "doc", "delete", doc, "-e", "2", "--by", "ann")
    assert code == EXIT_CONFLICT
    code, out, _ = cli(db, "doc", "delete", doc, "-e", "3", "--by", "ann")
    assert code == 0 and "version 4" in out


def test_errors_are_one_line_with_sqlstate(db: str) -> None:
    code, _, err = cli(db, "doc", "save", "999999", "-e", "1", "{}")
    assert code == 1 and "[P0002]" in err
    code, _, err = cli(db, "doc", "create", "--kind", "nope", "{}")
    assert code == 1 and "[PF302]" in err
    code, _, err = cli(db, "doc", "save", "1", "{}")
    assert code == 2 and "expected-version" in err, "no unconditional save from the CLI either"
    code, _, err = cli(db, "doc", "create", "{not json")
    assert code == 2 and "not JSON" in err


def test_kinds(db: str) -> None:
    code, out, _ = cli(db, "doc", "kinds", "--json")
    assert code == 0
    assert {k["kind"]: k["merge"] for k in json.loads(out)} == {"record": "attributes",
                                                                "sheet": "none"}


def test_a_kind_without_save_events_keeps_its_revisions_and_conflicts(db: str) -> None:
    # register_kind(log_saves=False): saves write no event; revisions and conflicts stay.
    with psycopg.connect(db, autocommit=True) as conn:
        assert api.register_kind(conn, "quiet", "attributes", log_saves=False)["log_saves"] is False
        assert {k["kind"]: k["log_saves"] for k in api.kinds(conn)} == {
            "quiet": False, "record": True, "sheet": True}
        doc = api.create(conn, "quiet", {"a": 1}, "ann")
        assert api.save(conn, doc, 1, {"a": 2}, "ann").outcome == "saved"
        assert api.save(conn, doc, 1, {"a": 3}, "bob").outcome == "conflict"
        assert sorted(r["version"] for r in api.history(conn, doc)) == [1, 2]
        events = [e for (e,) in conn.execute(
            "SELECT event FROM pgfence.event WHERE module = 'document' AND item_id = %s ORDER BY id",
            (doc,))]
        assert events == ["create", "conflict"]


def test_drafts_list_and_discard(tmp_path: Path) -> None:
    path = tmp_path / "drafts.sqlite3"
    with DraftStore(path) as store:
        for writer in ("tab-1", "tab-2"):
            store.put(Draft(scope="db", user="ann", document_id=7, writer_id=writer,
                            kind="record", base_version=3, content_json='{"a": 1}',
                            snapshot_id=f"{writer}:1", updated_at=time.time()))
    runner = CliRunner()
    result = runner.invoke(main, ["doc", "drafts", "--path", str(path), "--json", "--show"])
    assert result.exit_code == 0
    rows = json.loads(result.stdout)
    assert sorted(r["writer"] for r in rows) == ["tab-1", "tab-2"]
    assert rows[0]["content"] == {"a": 1} and rows[0]["base_version"] == 3
    result = runner.invoke(main, ["doc", "drafts", "--path", str(path), "--discard", "tab-1",
                                  "--document", "7", "--user", "ann"])
    assert result.exit_code == 0
    with DraftStore(path) as store:
        assert [d.writer_id for d in store.list()] == ["tab-2"]
    result = runner.invoke(main, ["doc", "drafts", "--path", str(tmp_path / "none.sqlite3")])
    assert result.exit_code == 0 and "no drafts" in result.stdout
