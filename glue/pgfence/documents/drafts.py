"""Per-writer drafts: unsaved document snapshots kept in a local SQLite file.

A *writer* is one editing session (a tab, a process, an automated writer). Each writer owns one
slot per (scope, user, document): ``put`` overwrites only that slot, so one writer never erases
another's work. A draft records the version it was based on, so adopting it later goes through
the server's compare-and-swap like any save (a stale draft becomes a conflict, never an
overwrite).

:class:`~pgfence.documents.DocumentSession` writes the slot on every edit *before* anything is
sent, and deletes it only when the save of exactly that snapshot (``snapshot_id``) succeeded or
the user discarded it. Sibling slots (same user and document, other writer) are offered when a
session opens, never applied silently.

The file defaults to ``drafts.sqlite3`` under the user's data directory
(:func:`default_draft_path`; ``$PGFENCE_DRAFTS`` overrides it). SQLite in WAL mode with
``synchronous=NORMAL``: a committed draft survives the writer process crashing (the case this
store is for); pass ``synchronous="FULL"`` to also survive a power loss, at an fsync per edit.
Several processes may share the file.
"""

from __future__ import annotations

import datetime as dt
import json
import logging
import os
import sqlite3
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS draft (
  scope        TEXT NOT NULL,
  user_id      TEXT NOT NULL,
  document_id  INTEGER NOT NULL,
  writer_id    TEXT NOT NULL,
  kind         TEXT NOT NULL,
  base_version INTEGER NOT NULL,
  content      TEXT NOT NULL,
  snapshot_id  TEXT NOT NULL,
  updated_at   REAL NOT NULL,
  save_id      TEXT,
  PRIMARY KEY (scope, user_id, document_id, writer_id)
)
"""
_COLUMNS = ("scope, user_id, document_id, writer_id, kind, base_version, content, snapshot_id,"
            " updated_at, save_id")
_UPSERT = f"INSERT OR REPLACE INTO draft ({_COLUMNS}) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)"


def default_draft_path() -> Path:
    """``$PGFENCE_DRAFTS``, else ``<user data dir>/pgfence/drafts.sqlite3``.

    The user data dir is ``$XDG_DATA_HOME`` or ``~/.local/share`` on Linux and other Unixes,
    ``~/Library/Application Support`` on macOS, ``%LOCALAPPDATA%`` on Windows.
    """
    if env := os.environ.get("PGFENCE_DRAFTS"):
        return Path(env)
    home = Path.home()
    if sys.platform == "win32":
        base = Path(os.environ.get("LOCALAPPDATA") or home / "AppData" / "Local")
    elif sys.platform == "darwin":
        base = home / "Library" / "Application Support"
    else:
        base = Path(os.environ.get("XDG_DATA_HOME") or home / ".local" / "share")
    return base / "pgfence" / "drafts.sqlite3"


@dataclass(frozen=True)
class Draft:
    """One writer's unsaved snapshot of one document.

    ``content_json`` is the snapshot exactly as the writer serialised it; ``base_version`` is
    the server version it was edited from; ``snapshot_id`` names this snapshot (a save of it
    deletes the draft only if the slot still holds it); ``updated_at`` is Unix time.
    ``save_id`` is set once a save of this snapshot was sent: whoever resumes the draft retries
    with it, so a save that did commit is answered ``saved`` (not a conflict with itself).
    """

    scope: str
    user: str
    document_id: int
    writer_id: str
    kind: str
    base_version: int
    content_json: str
    snapshot_id: str
    updated_at: float
    save_id: str | None = None

    @property
    def content(self) -> Any:
        """The snapshot, parsed (a new object on each access)."""
        return json.loads(self.content_json)

    @property
    def updated(self) -> dt.datetime:
        """``updated_at`` as an aware UTC datetime."""
        return dt.datetime.fromtimestamp(self.updated_at, tz=dt.UTC)


# How long a draft call waits for another process holding the file (seconds).
_BUSY_TIMEOUT = 10.0


class DraftChanged(RuntimeError):
    """The slot no longer holds the snapshot the caller saw (its writer edited it meanwhile)."""


class DraftStore:
    """The SQLite draft file. Thread-safe; each method is one short transaction.

    Args:
        path: the SQLite file; None = :func:`default_draft_path`. Parent folders are created.
        synchronous: SQLite ``synchronous`` pragma (``NORMAL`` or ``FULL``).

    Raises:
        sqlite3.Error: the file cannot be opened or written (disk full, permissions).
    """

    def __init__(self, path: str | os.PathLike[str] | None = None, *,
                 synchronous: str = "NORMAL") -> None:
        if synchronous.upper() not in ("NORMAL", "FULL", "EXTRA"):
            raise ValueError("synchronous must be NORMAL, FULL or EXTRA")
        self.path = Path(path) if path is not None else default_draft_path()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, timeout=_BUSY_TIMEOUT, isolation_level=None,
                                   check_same_thread=False)
        try:
            self._set_up(synchronous.upper())
        except BaseException:
            self._db.close()
            raise

    def _set_up(self, synchronous: str) -> None:
        """WAL mode, the schema, the save_id column. Several processes may open one new file at
        the same moment: switching it to WAL answers "database is locked" at once to all but
        one of them (SQLite does not wait on its busy timeout for that switch), and two may both
        add the column of an old file. Both are retried or tolerated, within the busy timeout."""
        deadline = time.monotonic() + _BUSY_TIMEOUT
        delay = 0.005
        while True:
            try:
                mode = self._db.execute("PRAGMA journal_mode").fetchone()
                if not mode or str(mode[0]).lower() != "wal":
                    self._db.execute("PRAGMA journal_mode=WAL")
                break
            except sqlite3.OperationalError as exc:
                if "locked" not in str(exc) or time.monotonic() + delay > deadline:
                    raise
                time.sleep(delay)
                delay = min(2 * delay, 0.1)
        self._db.execute(f"PRAGMA synchronous={synchronous}")
        self._db.execute(_SCHEMA)
        columns = {row[1] for row in self._db.execute("PRAGMA table_info(draft)")}
        if "save_id" not in columns:  # a file written before drafts recorded the save in flight
            try:
                self._db.execute("ALTER TABLE draft ADD COLUMN save_id TEXT")
            except sqlite3.OperationalError as exc:
                if "duplicate column" not in str(exc):  # another process added it meanwhile
                    raise

    def close(self) -> None:
        """Close the file."""
        with self._lock:
            self._db.close()

    def __enter__(self) -> DraftStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def _row(row: tuple[Any, ...]) -> Draft:
        return Draft(scope=row[0], user=row[1], document_id=int(row[2]), writer_id=row[3],
                     kind=row[4], base_version=int(row[5]), content_json=row[6],
                     snapshot_id=row[7], updated_at=float(row[8]), save_id=row[9])

    def put(self, draft: Draft) -> None:
        """Write ``draft`` into its writer's slot (replacing what that slot held)."""
        with self._lock:
            self._db.execute(
                _UPSERT,
                (draft.scope, draft.user, draft.document_id, draft.writer_id, draft.kind,
                 draft.base_version, draft.content_json, draft.snapshot_id, draft.updated_at,
                 draft.save_id))

    def get(self, scope: str, user: str, document_id: int, writer_id: str) -> Draft | None:
        """The draft in one slot, or None."""
        with self._lock:
            row = self._db.execute(
                f"SELECT {_COLUMNS} FROM draft WHERE scope = ? AND user_id = ? AND document_id = ?"
                " AND writer_id = ?", (scope, user, document_id, writer_id)).fetchone()
        return None if row is None else self._row(row)

    def list(self, scope: str | None = None, user: str | None = None,
             document_id: int | None = None) -> list[Draft]:
        """Drafts matching the given filters (None = any), newest first."""
        where, args = [], []
        for column, value in (("scope", scope), ("user_id", user), ("document_id", document_id)):
            if value is not None:
                where.append(f"{column} = ?")
                args.append(value)
        sql = f"SELECT {_COLUMNS} FROM draft"
        if where:
            sql += " WHERE " + " AND ".join(where)
        with self._lock:
            rows = self._db.execute(sql + " ORDER BY updated_at DESC", args).fetchall()
        return [self._row(r) for r in rows]

    def delete(self, scope: str, user: str, document_id: int, writer_id: str,
               snapshot_id: str | None = None) -> bool:
        """Empty a slot; with ``snapshot_id``, only if the slot still holds that snapshot.

        Returns whether a draft was deleted.
        """
        sql = ("DELETE FROM draft WHERE scope = ? AND user_id = ? AND document_id = ?"
               " AND writer_id = ?")
        args: list[Any] = [scope, user, document_id, writer_id]
        if snapshot_id is not None:
            sql += " AND snapshot_id = ?"
            args.append(snapshot_id)
        with self._lock:
            return self._db.execute(sql, args).rowcount > 0

    def mark_sending(self, scope: str, user: str, document_id: int, writer_id: str,
                     snapshot_id: str, save_id: str) -> bool:
        """Record that a save of the slot's snapshot ``snapshot_id`` is being sent as ``save_id``
        (before it is sent). Returns False if the slot holds another snapshot."""
        with self._lock:
            return self._db.execute(
                "UPDATE draft SET save_id = ? WHERE scope = ? AND user_id = ? AND document_id = ?"
                " AND writer_id = ? AND snapshot_id = ?",
                (save_id, scope, user, document_id, writer_id, snapshot_id)).rowcount > 0

    def rebase(self, scope: str, user: str, document_id: int, writer_id: str,
               base_version: int, except_snapshot: str) -> bool:
        """Move a slot's base version forward (an earlier snapshot of the same writer was saved
        as ``base_version``; the newer snapshot in the slot is now based on it). Leaves the slot
        alone if it holds ``except_snapshot`` (the one just saved) or a newer base."""
        with self._lock:
            return self._db.execute(
                "UPDATE draft SET base_version = ? WHERE scope = ? AND user_id = ?"
                " AND document_id = ? AND writer_id = ? AND snapshot_id <> ? AND base_version < ?",
                (base_version, scope, user, document_id, writer_id, except_snapshot,
                 base_version)).rowcount > 0

    def transfer(self, draft: Draft, writer_id: str, snapshot_id: str) -> Draft:
        """Adopt a sibling's draft: in one transaction, write its content and base into
        ``writer_id``'s slot (as ``snapshot_id``) and empty the sibling's slot.

        Raises:
            DraftChanged: the sibling's slot no longer holds ``draft.snapshot_id``.
        """
        mine = Draft(scope=draft.scope, user=draft.user, document_id=draft.document_id,
                     writer_id=writer_id, kind=draft.kind, base_version=draft.base_version,
                     content_json=draft.content_json, snapshot_id=snapshot_id,
                     updated_at=time.time(), save_id=draft.save_id)
        with self._lock:
            self._db.execute("BEGIN IMMEDIATE")
            try:
                gone = self._db.execute(
                    "DELETE FROM draft WHERE scope = ? AND user_id = ? AND document_id = ?"
                    " AND writer_id = ? AND snapshot_id = ?",
                    (draft.scope, draft.user, draft.document_id, draft.writer_id,
                     draft.snapshot_id)).rowcount
                if not gone:
                    raise DraftChanged(
                        f"writer {draft.writer_id}'s draft of document {draft.document_id} "
                        "changed or was removed; list the drafts again")
                self._db.execute(
                    _UPSERT,
                    (mine.scope, mine.user, mine.document_id, mine.writer_id, mine.kind,
                     mine.base_version, mine.content_json, mine.snapshot_id, mine.updated_at,
                     mine.save_id))
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")
        return mine
