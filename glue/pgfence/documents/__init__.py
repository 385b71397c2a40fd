"""Versioned documents (Module 4): the SQL wrappers and the client session.

- :mod:`pgfence.documents.api` — one function per SQL function (``create``, ``get``,
  ``revision``, ``history``, ``save``, ``delete``, ``merge``, ``register_kind``), sync and async.
- :class:`DocumentSession` — the asyncio client session of one document: debounced, serialised
  saves by compare-and-swap, explicit conflicts with rebase, per-writer drafts in SQLite, a
  stale-read guard, a flush on close. :class:`SyncDocumentSession` wraps it for sync code.
- :class:`DraftStore` — the local draft file.

Example::

    async with await DocumentSession.open(doc_id, user="ann", dsn=dsn) as s:
        for draft in s.sibling_drafts:       # another tab's unsaved work: ask the user
            ...
        s.edit({**s.content, "title": "Q3 plan"})
        try:
            await s.flush()
        except ConflictPending:
            await s.rebase()                 # record: merge by attribute
            await s.flush()
"""

from __future__ import annotations

from .api import (
    ContentTooLarge,
    Document,
    JsonText,
    MergeInvalid,
    MergeResult,
    Revision,
    SaveResult,
    UnknownKind,
    VersionUnknown,
)
from .connections import ConnectionSource, DirectConnections
from .drafts import Draft, DraftChanged, DraftStore, default_draft_path
from .session import (
    Conflict,
    ConflictPending,
    DocumentDeleted,
    DocumentSession,
    MergeConflict,
    Rebase,
    Resolver,
    SaveRefused,
    SessionBusy,
    SessionClosed,
    SessionError,
    SessionState,
    StaleRead,
    StateChange,
    create_document,
    default_writer_id,
    is_transient,
)
from .sync import LoopThread, SyncDocumentSession

__all__ = [
    "Conflict", "ConflictPending", "ConnectionSource", "ContentTooLarge", "DirectConnections",
    "Document", "DocumentDeleted", "DocumentSession", "Draft", "DraftChanged", "DraftStore",
    "JsonText", "LoopThread", "MergeConflict", "MergeInvalid", "MergeResult", "Rebase",
    "Resolver", "Revision", "SaveRefused", "SaveResult", "SessionBusy", "SessionClosed",
    "SessionError", "SessionState", "StaleRead", "StateChange", "SyncDocumentSession",
    "UnknownKind", "VersionUnknown", "create_document", "default_draft_path",
    "default_writer_id", "is_transient",
]
