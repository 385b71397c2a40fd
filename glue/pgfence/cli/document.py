"""``pgfence doc``: create, get, save, delete, history, kinds — and the local drafts.

CONTENT arguments are JSON text, ``@path`` (a JSON file) or ``-`` (JSON on stdin).
``doc save`` exits 0 when saved and 3 when the answer is a conflict (the stored version and
content are printed); a conflict is an answer, not an error.
"""

from __future__ import annotations

import getpass
import json
import sys
from pathlib import Path
from typing import Any

import click

from ..documents import DraftStore, api
from ..documents.drafts import default_draft_path
from ._common import CliState, db_conn, emit, emit_one, json_option, pass_state

#: Exit status of ``doc save`` / ``doc delete`` when the server answered ``conflict``.
EXIT_CONFLICT = 3


def _content(text: str) -> Any:
    try:
        if text == "-":
            return json.load(sys.stdin)
        if text.startswith("@"):
            return json.loads(Path(text[1:]).read_text(encoding="utf-8"))
        return json.loads(text)
    except (OSError, json.JSONDecodeError) as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint="CONTENT") from exc


by_option = click.option("--by", default=getpass.getuser, show_default="the OS user",
                         help="Who makes the change (stored with the version and in the log).")


@click.group("doc")
def doc() -> None:
    """Versioned documents: every save is a compare-and-swap on the version it was based on."""


@doc.command()
@click.option("--kind", default="record", show_default=True,
              help="record, sheet, or a registered kind (see `pgfence doc kinds`).")
@click.option("--key", "idempotency_key", help="Idempotency key: a repeat returns the same id.")
@by_option
@click.argument("content")
@pass_state
def create(state: CliState, kind: str, idempotency_key: str | None, by: str,
           content: str) -> None:
    """Create a document with CONTENT as version 1; prints its id."""
    body = _content(content)
    with db_conn(state) as conn:
        click.echo(api.create(conn, kind, body, by, idempotency_key=idempotency_key))


@doc.command()
@click.argument("document_id", type=int)
@click.option("--version", type=click.IntRange(1), help="An earlier version (a revision).")
@click.option("--content-only", is_flag=True, help="Print only the content, as JSON.")
@json_option
@pass_state
def get(state: CliState, document_id: int, version: int | None, content_only: bool,
        as_json: bool) -> None:
    """Show a document (its current version, or --version N)."""
    with db_conn(state) as conn:
        row: dict[str, Any] = dict(vars(api.revision(conn, document_id, version)
                                        if version else api.get(conn, document_id)))
    if content_only:
        click.echo(json.dumps(row["content"], indent=2, ensure_ascii=False))
        return
    emit_one(row, as_json)


def _report(res: api.SaveResult, document_id: int, as_json: bool) -> None:
    if as_json:
        emit_one(dict(vars(res)), True)
    elif res.ok:
        note = " (answered from the receipt of an earlier identical call)" if res.replayed else ""
        click.echo(f"{res.outcome}: document {document_id} is now version {res.version}{note}")
    else:
        what = "deleted" if res.deleted else f"saved by {res.saved_by}"
        click.echo(f"conflict: document {document_id} is at version {res.version} ({what}); "
                   "nothing was written", err=True)
        if res.content is not None:
            click.echo(json.dumps(res.content, indent=2, ensure_ascii=False))
    if not res.ok:
        sys.exit(EXIT_CONFLICT)


@doc.command()
@click.argument("document_id", type=int)
@click.option("-e", "--expected-version", type=click.IntRange(1), required=True,
              help="The version CONTENT is based on (there is no unconditional save).")
@click.option("--save-id", help="Id of this save; repeat it to retry safely after a lost answer.")
@by_option
@click.argument("content")
@json_option
@pass_state
def save(state: CliState, document_id: int, expected_version: int, save_id: str | None,
         by: str, content: str, as_json: bool) -> None:
    """Save CONTENT as the version after --expected-version (exit 3 on conflict)."""
    body = _content(content)
    with db_conn(state) as conn:
        res = api.save(conn, document_id, expected_version, body, by, save_id)
    _report(res, document_id, as_json)


@doc.command()
@click.argument("document_id", type=int)
@click.option("-e", "--expected-version", type=click.IntRange(1), required=True,
              help="The version you mean to delete.")
@by_option
@json_option
@pass_state
def delete(state: CliState, document_id: int, expected_version: int, by: str,
           as_json: bool) -> None:
    """Delete a document (it keeps a tombstone version; exit 3 on conflict)."""
    with db_conn(state) as conn:
        res = api.delete(conn, document_id, expected_version, by)
    _report(res, document_id, as_json)


@doc.command()
@click.argument("document_id", type=int)
@click.option("--limit", type=click.IntRange(1, 10000), default=50, show_default=True)
@click.option("--before", "before_version", type=click.IntRange(1),
              help="Only versions before this one (paging).")
@json_option
@pass_state
def history(state: CliState, document_id: int, limit: int, before_version: int | None,
            as_json: bool) -> None:
    """Every version of a document, newest first: who saved it, when, with which save id."""
    with db_conn(state) as conn:
        rows = api.history(conn, document_id, limit, before_version)
    emit(rows, as_json, ["version", "op", "saved_by", "saved_at", "save_id", "stored_bytes"])


@doc.command()
@json_option
@pass_state
def kinds(state: CliState, as_json: bool) -> None:
    """Registered document kinds: content shape, size limit, how they merge."""
    with db_conn(state) as conn:
        rows = api.kinds(conn)
    emit(rows, as_json, ["kind", "merge", "merge_function", "content_type", "max_bytes",
                         "builtin", "description"])


@doc.command()
@click.option("--path", type=click.Path(dir_okay=False, path_type=Path),
              help="The draft file (default: $PGFENCE_DRAFTS or the user data dir).")
@click.option("--user", help="Only this user's drafts.")
@click.option("--document", "document_id", type=int, help="Only drafts of this document.")
@click.option("--show", is_flag=True, help="Include each draft's content.")
@click.option("--discard", "discard_writer", metavar="WRITER_ID",
              help="Delete this writer's draft of --document (of --user).")
@json_option
def drafts(path: Path | None, user: str | None, document_id: int | None, show: bool,
           discard_writer: str | None, as_json: bool) -> None:
    """Unsaved drafts kept on this machine (one per user, document and writer)."""
    file = path or default_draft_path()
    if not file.exists():
        click.echo(f"no drafts ({file} does not exist)")
        return
    with DraftStore(file) as store:
        if discard_writer is not None:
            if document_id is None or user is None:
                raise click.UsageError("--discard needs --document and --user")
            mine = [d for d in store.list(None, user, document_id)
                    if d.writer_id == discard_writer]
            if not mine:
                click.echo(f"no draft of document {document_id} by {user}/{discard_writer}",
                           err=True)
                sys.exit(1)
            for d in mine:
                store.delete(d.scope, d.user, d.document_id, d.writer_id, d.snapshot_id)
            click.echo(f"discarded {len(mine)} draft(s)")
            return
        rows = [{"scope": d.scope, "user": d.user, "document": d.document_id,
                 "writer": d.writer_id, "kind": d.kind, "base_version": d.base_version,
                 "updated": d.updated, "sent_as": d.save_id,
                 **({"content": d.content} if show else {})} for d in
                store.list(None, user, document_id)]
    cols = ["scope", "user", "document", "writer", "kind", "base_version", "updated", "sent_as"]
    emit(rows, as_json, cols + (["content"] if show else []), empty="(no drafts)")
