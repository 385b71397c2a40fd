"""Shared by the document tests (session, web): set-up and read-back straight through the SQL
wrappers, each on its own autocommit connection."""

from __future__ import annotations

from typing import Any

import psycopg

from pgfence.documents import api


def create(dsn: str, content: Any, kind: str = "record") -> int:
    """A new document of ``kind`` (created by ``setup``); its id."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return api.create(c, kind, content, "setup")


def stored(dsn: str, doc: int) -> api.Document:
    """The stored (current) version."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return api.get(c, doc)


def versions(dsn: str, doc: int) -> list[int]:
    """Every version the document has, in order."""
    with psycopg.connect(dsn, autocommit=True) as c:
        return sorted(r["version"] for r in api.history(c, doc, 10000))


def save_as(dsn: str, doc: int, content: Any, user: str = "other") -> api.SaveResult:
    """Another writer saves on top of whatever is stored (read, then CAS)."""
    with psycopg.connect(dsn, autocommit=True) as c:
        cur = api.get(c, doc)
        return api.save(c, doc, cur.version, content, user)


def events_of(dsn: str, doc: int, event: str) -> int:
    """How many events of this kind the document's log holds."""
    with psycopg.connect(dsn, autocommit=True) as c:
        row = c.execute("SELECT count(*) FROM pgfence.event WHERE module = 'document'"
                        " AND item_id = %s AND event = %s", (doc, event)).fetchone()
    return int(row[0]) if row else 0
