"""DocumentSession: the client side of one document, which never loses an edit.

The session is client *state*; every decision about versions and conflicts is made by the SQL
functions (``document_save`` is the compare-and-swap, ``document_merge`` the kind's merge).
What the session adds:

**Save queue.** :meth:`DocumentSession.edit` replaces the local snapshot; saves are debounced
(``debounce_ms`` after the last edit, at most ``max_wait_ms`` after the first unsaved one) and
serialised: one save in flight at a time, always of the latest snapshot, always against the
last confirmed version. An edit made while a save is in flight stays pending; that save's
success never clears it (it only moves the confirmed version forward).

**Lost answers.** Each snapshot is sent with a fresh ``save_id``. When a save fails without an
answer (connection lost, timeout) its outcome is unknown, so the session retries *that same*
call — same save_id, base version and content — with capped exponential backoff before sending
anything newer; the server answers ``saved`` from its receipt if the first attempt had
committed. A refusal (content too large, ...) is not retried; the next edit tries again.

**Conflicts are explicit.** A ``conflict`` answer stops saving. The session holds the
confirmed base, the local copy and the stored copy (:class:`Conflict`).
:meth:`~DocumentSession.rebase` runs the kind's merge (SQL ``document_merge``) or the caller's
resolver, then saves the result against the stored version — a new compare-and-swap.
:meth:`~DocumentSession.discard_and_reload` fetches the stored version first and replaces the
local state only once that worked.

**Drafts.** Every edit is written to this writer's slot of the local draft store
(:mod:`pgfence.documents.drafts`) before anything is sent; the draft is deleted only when the
save of exactly that snapshot succeeded or the user discarded it. Drafts of other writers of the
same user and document are listed at open (:attr:`~DocumentSession.sibling_drafts`) for
:meth:`~DocumentSession.adopt` or :meth:`~DocumentSession.discard_draft`, never applied
silently. This writer's own leftover draft (same ``writer_id``, e.g. after a crash) is restored
as the pending local snapshot and goes through the CAS on its recorded base version.

**Stale reads.** Reads carry a sequence number and remember the edit generation at their start;
an answer older than an already applied read, or that started before a local edit, is dropped.

**Closing** (:meth:`~DocumentSession.close`, ``async with``) flushes; if the flush cannot
finish, the draft stays on disk and nothing is dropped.

**The state machine.** Where the session's saving stands is one :class:`Phase` (clean, dirty,
saving, retrying, refused, conflict); every move is a row of :data:`TRANSITIONS`,
``(phase, event) -> phase``, taken by ``_move(event)`` and nowhere else; the data a phase needs
(the unanswered attempt, the refusal's error, the conflict) is set beside the move. The
lifecycle (open, closing, closed) runs beside it. Local copies are numbered snapshots: the
session knows the number of the latest one and of the newest one the server confirmed
(``pending`` is "they differ", :meth:`~DocumentSession.flush` waits for its own number).

States (:class:`SessionState`, what a UI sees: :data:`STATE_OF`): ``clean``, ``dirty``,
``saving``, ``conflict``, ``error`` (retrying or refused), ``closed`` — observable through
``on_state`` or ``async for change in session.changes()``.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import random
import socket
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from enum import Enum, StrEnum
from types import MappingProxyType
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict

from ..db import aschema_version, check_version
from ..errors import TRANSIENT_SQLSTATES, NotFound, PgfenceError, SerializationFailure
from . import api
from .api import JsonText, MergeResult
from .connections import ConnectionSource, DirectConnections
from .drafts import Draft, DraftStore

logger = logging.getLogger(__name__)


class SessionState(StrEnum):
    """Where a session is. ``dirty``: unsaved edits, a save is due; ``saving``: a save is in
    flight (newer edits may be pending: see :attr:`StateChange.pending`); ``conflict``: the
    server holds another version, saving is stopped until rebase or discard; ``error``: the last
    save failed (``retry_in`` seconds until the automatic retry; None = refused, waiting for a
    new edit); ``closed``."""

    CLEAN = "clean"
    DIRTY = "dirty"
    SAVING = "saving"
    CONFLICT = "conflict"
    ERROR = "error"
    CLOSED = "closed"


@dataclass(frozen=True)
class Conflict:
    """A save answered ``conflict``: the three copies a resolution needs.

    ``base`` is the confirmed content at ``base_version`` that the local copy was edited from;
    ``local`` the snapshot that was refused; ``stored`` the server's content at
    ``stored_version`` (None with ``deleted`` True when the document was deleted), saved by
    ``stored_by``.
    """

    base_version: int
    base: Any
    local: Any
    stored_version: int
    stored: Any
    stored_by: str
    deleted: bool


@dataclass(frozen=True)
class StateChange:
    """One observable state of a session.

    ``version`` is the last confirmed version; ``pending`` is True while local edits are not
    confirmed; ``error`` the last save error (state ``error``), ``retry_in`` seconds until the
    automatic retry (None = not retried until the next edit); ``conflict`` in state
    ``conflict``.
    """

    state: SessionState
    version: int
    pending: bool
    error: BaseException | None = None
    retry_in: float | None = None
    conflict: Conflict | None = None


@dataclass(frozen=True)
class Rebase:
    """What a resolver passed to :meth:`DocumentSession.rebase` gets.

    ``merged`` is the kind's own merge of (``conflict.base``, ``local``, ``conflict.stored``);
    ``local`` is the session's current local copy (it may be newer than ``conflict.local``).
    The resolver returns the content to save against ``conflict.stored_version``.
    """

    conflict: Conflict
    local: Any
    merged: MergeResult


Resolver = Callable[[Rebase], Any]


class SessionError(PgfenceError):
    """Base class of the session's own errors."""


class SessionClosed(SessionError):
    """The session is closed (or closing): no more edits."""


class ConflictPending(SessionError):
    """A flush cannot finish: the session is in conflict (see ``.conflict``)."""

    def __init__(self, conflict: Conflict) -> None:
        super().__init__(f"document save conflicts with stored version {conflict.stored_version}"
                         f" (saved by {conflict.stored_by})")
        self.conflict = conflict


class SaveRefused(SessionError):
    """A flush cannot finish: the server refused the save (``__cause__`` says why); it is not
    retried until the next edit."""


class MergeConflict(SessionError):
    """:meth:`DocumentSession.rebase` without a resolver: the kind's merge left conflicts."""

    def __init__(self, merged: MergeResult) -> None:
        keys = ", ".join(str(c.get("key")) for c in merged.conflicts)
        super().__init__(f"the merge leaves {len(merged.conflicts)} conflict(s): {keys}")
        self.merged = merged


class DocumentDeleted(SessionError):
    """The document was deleted on the server; its content cannot be saved or merged into.
    The local copy (and its draft) are kept."""


class SessionBusy(SessionError):
    """The operation needs a session without unsaved edits or conflict."""


class StaleRead(SessionError):
    """A read was dropped because a newer read was applied or a local edit happened meanwhile."""


def is_transient(exc: BaseException) -> bool:
    """Whether a failed call may be retried as is: the connection or the server failed, or the
    server asked for a retry (serialization failure, deadlock, shutdown, too many clients)."""
    if isinstance(exc, psycopg.OperationalError | psycopg.InterfaceError | OSError
                  | TimeoutError | SerializationFailure):
        return True
    state = getattr(exc, "sqlstate", None)
    return state in TRANSIENT_SQLSTATES


def default_writer_id() -> str:
    """``host:pid:random`` — a new writer per session unless the caller names one."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


def _dumps(content: Any) -> str:
    return json.dumps(content, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


# --------------------------------------------------------------------------------------------
# the save machine
# --------------------------------------------------------------------------------------------
class Phase(Enum):
    """Where the save machine of a session is; :data:`TRANSITIONS` is every move between them.

    What a UI sees is :class:`SessionState` (:data:`STATE_OF`): both ``RETRYING`` and
    ``REFUSED`` show as ``error``, and a closed session shows ``closed`` whatever its phase.
    """

    #: The local copy is the confirmed version; nothing to save.
    CLEAN = "clean"
    #: Unsaved edits: a save is due after the debounce (at once when urgent or closing).
    DIRTY = "dirty"
    #: One save in flight; edits made meanwhile stay pending (its success never clears them).
    SAVING = "saving"
    #: The last save got no answer (its outcome is unknown): that same call is sent again,
    #: after a backoff, before anything newer.
    RETRYING = "retrying"
    #: The server refused the latest snapshot (e.g. too large): no save until the next edit.
    REFUSED = "refused"
    #: The server holds another version: no save until :meth:`~DocumentSession.rebase` or
    #: :meth:`~DocumentSession.discard_and_reload`.
    CONFLICT = "conflict"


class Event(Enum):
    """What moves the save machine (:data:`TRANSITIONS`)."""

    #: :meth:`~DocumentSession.edit`: a new local snapshot.
    EDIT = "edit"
    #: A snapshot made elsewhere becomes the local one, on its own base: this writer's leftover
    #: draft at open, or an adopted sibling draft.
    TAKE = "take"
    #: The save loop sends the local snapshot (or sends the unanswered call again).
    SEND = "send"
    #: Answered ``saved``, and that snapshot is still the latest.
    SAVED = "saved"
    #: Answered ``saved``; newer edits were made meanwhile and are pending.
    SAVED_OLDER = "saved_older"
    #: Answered ``conflict``: the stored version is not the one the snapshot was based on.
    CONFLICT = "conflict"
    #: Failed without an answer (connection lost, timeout, the server asked for a retry).
    NO_ANSWER = "no_answer"
    #: Refused by the server (not transient), and that snapshot is still the latest.
    REFUSED = "refused"
    #: Refused, but newer edits were made meanwhile: those are saved next.
    REFUSED_OLDER = "refused_older"
    #: :meth:`~DocumentSession.rebase`: the resolution becomes the local snapshot, based on the
    #: stored version.
    REBASED = "rebased"
    #: :meth:`~DocumentSession.discard_and_reload` or :meth:`~DocumentSession.refresh`: the
    #: stored version replaces the local state.
    RELOADED = "reloaded"


_P, _E = Phase, Event

#: Every move of the save machine: ``(phase, event) -> next phase``. A pair that is not here
#: cannot happen (the session raises RuntimeError: a bug). Which event a call fires is decided
#: where the call is handled; the data each phase holds (the attempt, the conflict, the error)
#: is set beside the move.
TRANSITIONS: Mapping[tuple[Phase, Event], Phase] = MappingProxyType({
    # edits: a new snapshot is pending; a save in flight, an unknown outcome or a conflict
    # are settled first; a refusal waited for exactly this
    (_P.CLEAN, _E.EDIT): _P.DIRTY,
    (_P.DIRTY, _E.EDIT): _P.DIRTY,
    (_P.SAVING, _E.EDIT): _P.SAVING,
    (_P.RETRYING, _E.EDIT): _P.RETRYING,
    (_P.REFUSED, _E.EDIT): _P.DIRTY,
    (_P.CONFLICT, _E.EDIT): _P.CONFLICT,
    (_P.CLEAN, _E.TAKE): _P.DIRTY,         # only onto a clean session (adopt refuses otherwise)
    # one save at a time, always of the latest snapshot, or the unanswered one again
    (_P.DIRTY, _E.SEND): _P.SAVING,
    (_P.RETRYING, _E.SEND): _P.SAVING,
    # the answers
    (_P.SAVING, _E.SAVED): _P.CLEAN,
    (_P.SAVING, _E.SAVED_OLDER): _P.DIRTY,
    (_P.SAVING, _E.CONFLICT): _P.CONFLICT,
    (_P.SAVING, _E.NO_ANSWER): _P.RETRYING,
    (_P.SAVING, _E.REFUSED): _P.REFUSED,
    (_P.SAVING, _E.REFUSED_OLDER): _P.DIRTY,
    # the user's way out of a conflict; the stored version replaces anything but a save in flight
    (_P.CONFLICT, _E.REBASED): _P.DIRTY,
    (_P.CLEAN, _E.RELOADED): _P.CLEAN,
    (_P.DIRTY, _E.RELOADED): _P.CLEAN,
    (_P.RETRYING, _E.RELOADED): _P.CLEAN,
    (_P.REFUSED, _E.RELOADED): _P.CLEAN,
    (_P.CONFLICT, _E.RELOADED): _P.CLEAN,
})

#: What a UI sees of each phase while the session is open.
STATE_OF: Mapping[Phase, SessionState] = MappingProxyType({
    Phase.CLEAN: SessionState.CLEAN, Phase.DIRTY: SessionState.DIRTY,
    Phase.SAVING: SessionState.SAVING, Phase.RETRYING: SessionState.ERROR,
    Phase.REFUSED: SessionState.ERROR, Phase.CONFLICT: SessionState.CONFLICT,
})


class _Life(Enum):
    """The session's lifecycle, beside the save machine: ``open -> closing -> closed``. Closing
    refuses edits and saves without debounce; closed stops the save loop (the phase stays what
    it was, so a closed session still knows its conflict or refusal)."""

    OPEN = "open"
    CLOSING = "closing"
    CLOSED = "closed"


@dataclass(frozen=True)
class _Snapshot:
    """One local copy: its number in this session (0 = as loaded, then one more per new local
    copy), its id in the draft store ("" = the stored version, no draft), its JSON text and
    that text parsed."""

    number: int
    id: str
    json: str
    content: Any


@dataclass(frozen=True)
class _Attempt:
    """One save call: its ``save_id``, the version it is based on, the snapshot it sends. Kept
    while its outcome is unknown, so that the retry is the very same call."""

    save_id: str
    expected: int
    snapshot: _Snapshot


class DocumentSession:
    """One writer's session on one document. Create it with :meth:`open`.

    All methods must be called from the event loop the session was opened in (use
    :class:`~pgfence.documents.SyncDocumentSession` from threads / sync code).
    """

    def __init__(self, *, source: ConnectionSource, owns_source: bool, document_id: int,
                 kind: str, user: str, writer_id: str, drafts: DraftStore, owns_drafts: bool,
                 scope: str, debounce_ms: float, max_wait_ms: float, retry_base_ms: float,
                 retry_cap_ms: float, on_state: Callable[[StateChange], None] | None) -> None:
        self._source = source
        self._owns_source = owns_source
        self.document_id = document_id
        self.kind = kind
        self.user = user
        self.writer_id = writer_id
        self._drafts = drafts
        self._owns_drafts = owns_drafts
        self.scope = scope
        self.debounce = debounce_ms / 1000.0
        self.max_wait = max_wait_ms / 1000.0
        self.retry_base = retry_base_ms / 1000.0
        self.retry_cap = retry_cap_ms / 1000.0
        self._on_state = on_state
        self._session_id = uuid.uuid4().hex[:12]
        self._loop = asyncio.get_running_loop()

        # the machine (TRANSITIONS) and the lifecycle beside it
        self._phase = Phase.CLEAN
        self._life = _Life.OPEN
        # confirmed server state this writer builds on: the version, its content, and the
        # number of the newest local snapshot the server confirmed
        self._base_version = 0
        self._base: Any = None
        self._confirmed = 0
        # the local copy
        self._local = _Snapshot(number=0, id="", json="null", content=None)
        # when to save: the last edit, the first unsaved one, and "now" (flush, a taken draft)
        self._last_edit_at = 0.0
        self._dirty_since: float | None = None
        self._urgent = False
        # the data of the phases: the call whose outcome is unknown (RETRYING, or a taken draft
        # that was being sent), its backoff, the last error (RETRYING, REFUSED), the conflict
        self._attempt: _Attempt | None = None
        self._failures = 0
        self._retry_at: float | None = None
        self._last_error: BaseException | None = None
        self._conflict: Conflict | None = None
        # the save loop
        self._io = asyncio.Lock()
        self._wake = asyncio.Event()
        self._progress = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        # reads
        self._read_seq = 0
        self._applied_read_seq = 0
        #: Read answers dropped by the stale-read guard (older than an applied read, or started
        #: before a local edit).
        self.stale_reads_dropped = 0
        # observers
        self._state = SessionState.CLEAN
        self._last_change: StateChange | None = None
        self._subscribers: list[asyncio.Queue[StateChange | None]] = []
        #: Drafts of other writers of this user and document, found at open (adopt or discard).
        self.sibling_drafts: list[Draft] = []
        #: This writer's own leftover draft restored at open (None if there was none).
        self.restored_draft: Draft | None = None

    # ----------------------------------------------------------------------------------------
    # opening
    # ----------------------------------------------------------------------------------------
    @classmethod
    async def open(cls, document_id: int, *, user: str, dsn: str | None = None,
                   source: ConnectionSource | None = None, writer_id: str | None = None,
                   drafts: DraftStore | str | os.PathLike[str] | None = None,
                   scope: str | None = None, debounce_ms: float = 300.0,
                   max_wait_ms: float = 5000.0, retry_base_ms: float = 200.0,
                   retry_cap_ms: float = 10000.0, restore_own_draft: bool = True,
                   on_state: Callable[[StateChange], None] | None = None,
                   connect_timeout: float = 5.0,
                   connect_kwargs: dict[str, Any] | None = None) -> DocumentSession:
        """Load a document and start its session.

        Args:
            document_id: the document (``pgfence.document_get``).
            user: who edits; stored as ``saved_by`` and part of the draft key.
            dsn: database to connect to (the session opens and closes its own connections);
                or ``source``: a shared connection source such as an
                ``AsyncConnectionPool(…, kwargs={"autocommit": True})``, left open at close.
            writer_id: this writer's draft slot; default a new one per session
                (:func:`default_writer_id`). Reuse one (e.g. per device) to get your own
                leftover draft back after a crash.
            drafts: a :class:`DraftStore`, or a path for one; None = the default file.
            scope: namespace of the draft keys; default the database name of ``dsn``/``source``.
            debounce_ms: save this long after the last edit ...
            max_wait_ms: ... but no later than this after the first unsaved edit.
            retry_base_ms, retry_cap_ms: backoff of retries after a failed save (doubling,
                jittered, capped).
            restore_own_draft: restore this writer's leftover draft as the pending snapshot.
            on_state: called with every :class:`StateChange` (in the event loop; keep it short).
            connect_timeout: seconds, for connections the session opens itself.
            connect_kwargs: extra psycopg connect arguments for those connections.

        Raises:
            NotFound (P0002): no such document. DocumentDeleted: it was deleted.
            SchemaMismatch: the database's pgfence schema is not this package's.
            psycopg.OperationalError / TimeoutError: the database cannot be reached.
        """
        if (dsn is None) == (source is None):
            raise ValueError("pass exactly one of dsn= or source=")
        owns_source = source is None
        src: ConnectionSource = source if source is not None else DirectConnections(
            str(dsn), connect_timeout=connect_timeout, connect_kwargs=connect_kwargs)
        if scope is None:
            conninfo = dsn if dsn is not None else str(getattr(source, "conninfo", "") or "")
            scope = str(conninfo_to_dict(conninfo).get("dbname") or "") if conninfo else ""
        owns_drafts = not isinstance(drafts, DraftStore)
        store = drafts if isinstance(drafts, DraftStore) else DraftStore(drafts)
        try:
            async with src.connection() as conn:
                check_version(await aschema_version(conn))
                doc = await api.aget(conn, document_id)
            if doc.deleted:
                raise DocumentDeleted(f"document {document_id} was deleted (version {doc.version})")
            self = cls(source=src, owns_source=owns_source, document_id=document_id,
                       kind=doc.kind, user=user, writer_id=writer_id or default_writer_id(),
                       drafts=store, owns_drafts=owns_drafts, scope=scope,
                       debounce_ms=debounce_ms, max_wait_ms=max_wait_ms,
                       retry_base_ms=retry_base_ms, retry_cap_ms=retry_cap_ms, on_state=on_state)
            self._read_seq = self._applied_read_seq = 1
            self._base_version = doc.version
            self._base = doc.content
            self._local = _Snapshot(number=0, id="", json=_dumps(doc.content), content=doc.content)
            found = store.list(scope, user, document_id)
            own = next((d for d in found if d.writer_id == self.writer_id), None)
            self.sibling_drafts = [d for d in found if d.writer_id != self.writer_id]
            if own is not None and restore_own_draft:
                await self._restore(own)
            elif own is not None:
                self.sibling_drafts.insert(0, own)
        except BaseException:
            if owns_source and isinstance(src, DirectConnections):
                await src.close()
            if owns_drafts:
                store.close()
            raise
        self._publish()
        self._task = asyncio.create_task(self._run(), name=f"pgfence-doc-{document_id}")
        if self.sibling_drafts:
            logger.info("document %s: %d unsaved draft(s) of other writers of %s to adopt or "
                        "discard", document_id, len(self.sibling_drafts), user)
        return self

    async def _restore(self, own: Draft) -> None:
        """Make this writer's leftover draft the pending local snapshot, on its own base."""
        base = await self._fetch_base(own.base_version)
        self.restored_draft = own
        self._base_version = own.base_version
        self._base = base
        self._local = self._next_snapshot(own.content_json, own.snapshot_id)
        self._resume_attempt(own)
        self._mark_dirty(Event.TAKE, urgent=True)

    def _resume_attempt(self, draft: Draft) -> None:
        """A draft whose save was sent (outcome unknown) is retried with that save_id first."""
        if draft.save_id is not None:
            self._attempt = _Attempt(save_id=draft.save_id, expected=draft.base_version,
                                     snapshot=self._local)

    def _next_snapshot(self, text: str, snapshot_id: str) -> _Snapshot:
        """The next local snapshot: ``text`` (JSON) under the draft id ``snapshot_id``."""
        return _Snapshot(number=self._local.number + 1, id=snapshot_id, json=text,
                         content=json.loads(text))

    def _next_snapshot_id(self) -> str:
        return f"{self._session_id}:{self._local.number + 1}"

    async def _fetch_base(self, version: int) -> Any:
        if version == self._base_version:
            return self._base
        async with self._source.connection() as conn:
            rev = await api.arevision(conn, self.document_id, version)
        return rev.content

    # ----------------------------------------------------------------------------------------
    # what a UI reads
    # ----------------------------------------------------------------------------------------
    @property
    def state(self) -> SessionState:
        """The current :class:`SessionState`."""
        return self._state

    @property
    def version(self) -> int:
        """The last version this session knows to be saved (what the next save is based on)."""
        return self._base_version

    @property
    def content(self) -> Any:
        """The local copy (latest edit); a fresh object, safe to mutate."""
        return json.loads(self._local.json)

    @property
    def confirmed(self) -> Any:
        """The content of :attr:`version` as this session knows it."""
        return self._base

    @property
    def pending(self) -> bool:
        """True while some local edit is not confirmed by the server."""
        return self._local.number != self._confirmed

    @property
    def conflict(self) -> Conflict | None:
        """The conflict waiting for rebase or discard, if any."""
        return self._conflict

    @property
    def last_error(self) -> BaseException | None:
        """The last save error (cleared by a successful save)."""
        return self._last_error

    def snapshot(self) -> StateChange:
        """The current :class:`StateChange`."""
        retry_in = None
        if self._state is SessionState.ERROR and self._retry_at is not None:
            retry_in = max(0.0, self._retry_at - self._loop.time())
        return StateChange(state=self._state, version=self._base_version, pending=self.pending,
                           error=self._last_error if self._state is SessionState.ERROR else None,
                           retry_in=retry_in, conflict=self._conflict)

    async def changes(self) -> AsyncIterator[StateChange]:
        """Every state change from now on (the current one first); ends when the session closes."""
        queue: asyncio.Queue[StateChange | None] = asyncio.Queue()
        queue.put_nowait(self.snapshot())
        if self._life is _Life.CLOSED:
            queue.put_nowait(None)
        self._subscribers.append(queue)
        try:
            while (change := await queue.get()) is not None:
                yield change
        finally:
            self._subscribers.remove(queue)

    # ----------------------------------------------------------------------------------------
    # editing
    # ----------------------------------------------------------------------------------------
    def edit(self, content: Any) -> None:
        """Replace the local copy with ``content`` (the whole document).

        The snapshot is serialised and written to this writer's draft slot before this returns
        (and so before anything is sent); the save follows after the debounce.

        Raises:
            SessionClosed: after :meth:`close` started.
            TypeError / ValueError: ``content`` is not JSON-serialisable.
            sqlite3.Error: the draft could not be written; the edit is not taken.
        """
        if self._life is not _Life.OPEN:
            raise SessionClosed(f"document {self.document_id}: session is closed")
        text = _dumps(content)
        if text == self._local.json:
            return
        snapshot_id = self._next_snapshot_id()
        self._drafts.put(Draft(scope=self.scope, user=self.user, document_id=self.document_id,
                               writer_id=self.writer_id, kind=self.kind,
                               base_version=self._base_version, content_json=text,
                               snapshot_id=snapshot_id, updated_at=time.time()))
        self._local = self._next_snapshot(text, snapshot_id)
        self._mark_dirty(Event.EDIT, urgent=False)

    def _mark_dirty(self, event: Event, *, urgent: bool) -> None:
        """A new local snapshot (``event``): time it, move, wake the save loop. ``urgent``:
        save it without the debounce (an edit after that is debounced again)."""
        now = self._loop.time()
        self._last_edit_at = now
        if self._dirty_since is None:
            self._dirty_since = now
        self._urgent = urgent
        self._move(event)
        self._wake.set()

    async def flush(self, timeout: float | None = None) -> int:
        """Save now (skipping the debounce) and wait until every edit made before this call is
        confirmed; return the confirmed version.

        Transient failures are retried (with backoff) until ``timeout`` seconds.

        Raises:
            ConflictPending: the save was answered conflict (rebase or discard first).
            SaveRefused: the server refused the snapshot (e.g. content too large).
            TimeoutError: not confirmed within ``timeout``.
            SessionClosed: the session closed meanwhile.
        """
        target = self._local.number
        self._urgent = True
        self._retry_at = None              # a flush is a request to try now
        self._wake.set()
        async with asyncio.timeout(timeout):
            while True:
                if self._confirmed >= target:
                    return self._base_version
                if self._conflict is not None:        # Phase.CONFLICT
                    raise ConflictPending(self._conflict)
                if self._phase is Phase.REFUSED:
                    raise SaveRefused(f"document {self.document_id}: the server refused the "
                                      f"save: {self._last_error}") from self._last_error
                if self._life is _Life.CLOSED:
                    raise SessionClosed(f"document {self.document_id}: session closed")
                await self._wait_progress()

    async def _wait_progress(self) -> None:
        event = self._progress
        await event.wait()

    # ----------------------------------------------------------------------------------------
    # the save loop
    # ----------------------------------------------------------------------------------------
    def _next_delay(self) -> float | None:
        """Seconds until the next save attempt; None = nothing to do until woken."""
        if self._life is _Life.CLOSED or self._phase not in (Phase.DIRTY, Phase.RETRYING):
            return None
        now = self._loop.time()
        if self._attempt is not None:          # an outcome is unknown: retry that exact call
            return 0.0 if self._retry_at is None else max(0.0, self._retry_at - now)
        if self._urgent or self._life is _Life.CLOSING:
            return 0.0
        due = self._last_edit_at + self.debounce
        if self._dirty_since is not None:
            due = min(due, self._dirty_since + self.max_wait)
        return max(0.0, due - now)

    async def _run(self) -> None:
        while self._life is not _Life.CLOSED:
            delay = self._next_delay()
            if delay is None or delay > 0:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), delay)
                self._wake.clear()
                continue
            try:
                await self._save_once()
            except asyncio.CancelledError:
                raise
            except Exception:  # a bug, not a save failure: keep the loop (and the draft) alive
                logger.exception("document %s: unexpected error in the save loop",
                                 self.document_id)
                await asyncio.sleep(self.retry_base)

    async def _save_once(self) -> None:
        async with self._io:
            if self._life is _Life.CLOSED or self._phase not in (Phase.DIRTY, Phase.RETRYING):
                return
            if self._attempt is None:
                self._attempt = _Attempt(save_id=uuid.uuid4().hex, expected=self._base_version,
                                         snapshot=self._local)
                # Before sending: whoever resumes this draft retries with the same save_id.
                self._drafts.mark_sending(self.scope, self.user, self.document_id,
                                          self.writer_id, self._local.id, self._attempt.save_id)
            att = self._attempt
            self._move(Event.SEND)
            try:
                async with self._source.connection() as conn:
                    res = await api.asave(conn, self.document_id, att.expected,
                                          JsonText(att.snapshot.json), self.user, att.save_id)
            except asyncio.CancelledError:
                # close() stopped the loop during the call: its outcome is unknown (the draft
                # keeps its save_id for the next session); the session is closed already.
                self._enter(Event.NO_ANSWER)
                raise
            except Exception as exc:
                self._last_error = exc
                if is_transient(exc):
                    # The outcome is unknown: keep the attempt and send it again, unchanged.
                    self._failures += 1
                    delay = min(self.retry_cap, self.retry_base * 2 ** (self._failures - 1))
                    self._retry_at = self._loop.time() + delay * (1 - random.random() / 2)
                    logger.info("document %s: save failed (%s); retrying in %.2fs",
                                self.document_id, exc, delay)
                    self._move(Event.NO_ANSWER)
                else:
                    # Refused by the server: nothing was written. Wait for a new edit.
                    self._attempt = None
                    self._retry_at = None
                    logger.warning("document %s: save refused: %s", self.document_id, exc)
                    self._move(Event.REFUSED if self._is_latest(att) else Event.REFUSED_OLDER)
                return
            self._attempt = None
            self._failures = 0
            self._retry_at = None
            self._last_error = None
            if res.outcome == "saved":
                latest = self._is_latest(att)
                try:
                    self._on_saved(att, res)
                finally:
                    self._move(Event.SAVED if latest else Event.SAVED_OLDER)
            else:
                self._conflict = Conflict(base_version=att.expected, base=self._base,
                                          local=att.snapshot.content, stored_version=res.version,
                                          stored=res.content, stored_by=res.saved_by,
                                          deleted=res.deleted)
                logger.info("document %s: conflict: based on %d, stored is %d by %s",
                            self.document_id, att.expected, res.version, res.saved_by)
                self._move(Event.CONFLICT)

    def _is_latest(self, att: _Attempt) -> bool:
        """Whether ``att`` sent the current local snapshot (no edit since)."""
        return att.snapshot.number == self._local.number

    def _on_saved(self, att: _Attempt, res: api.SaveResult) -> None:
        self._base_version = res.version
        self._base = att.snapshot.content
        self._confirmed = att.snapshot.number
        if self._is_latest(att):
            self._dirty_since = None
            self._drafts.delete(self.scope, self.user, self.document_id, self.writer_id,
                                snapshot_id=att.snapshot.id)
        else:
            # Newer edits are pending: their draft is now based on the version just saved.
            self._dirty_since = self._last_edit_at
            self._drafts.rebase(self.scope, self.user, self.document_id, self.writer_id,
                                res.version, except_snapshot=att.snapshot.id)

    # ----------------------------------------------------------------------------------------
    # conflict resolution
    # ----------------------------------------------------------------------------------------
    async def rebase(self, resolve: Resolver | None = None, *, max_rounds: int = 5) -> MergeResult:
        """Resolve the conflict and save the result against the stored version.

        Without ``resolve``: the kind's merge (SQL ``document_merge``) of base, local and stored;
        if it leaves conflicts, :class:`MergeConflict` is raised and nothing changes. With
        ``resolve``: it is called with a :class:`Rebase` (including the kind's merge) and
        returns the content to save (it may be a coroutine function). The result becomes the
        local copy, based on the stored version; it is saved at once (await :meth:`flush` for
        the outcome — another writer may have saved meanwhile: then it is a new conflict).

        Raises:
            SessionBusy: no conflict to resolve. DocumentDeleted: the stored version is a
            delete. MergeConflict: see above. StaleRead: local edits kept arriving during
            ``max_rounds`` merges.
        """
        async with self._io:
            conflict = self._conflict
            if conflict is None:
                raise SessionBusy(f"document {self.document_id}: no conflict to rebase")
            if conflict.deleted:
                raise DocumentDeleted(
                    f"document {self.document_id} was deleted (version {conflict.stored_version})"
                    "; its local copy is kept in the session and the draft")
            for _ in range(max_rounds):
                number, local = self._local.number, json.loads(self._local.json)
                async with self._source.connection() as conn:
                    merged = await api.amerge(conn, self.kind, conflict.base, local,
                                              conflict.stored)
                if resolve is None:
                    if merged.conflicts:
                        raise MergeConflict(merged)
                    content = merged.content
                else:
                    content = resolve(Rebase(conflict=conflict, local=local, merged=merged))
                    if inspect.isawaitable(content):
                        content = await content
                if number == self._local.number:
                    break
            else:
                raise StaleRead(f"document {self.document_id}: local edits kept arriving while "
                                "rebasing; rebase again")
            text = _dumps(content)
            snapshot_id = self._next_snapshot_id()
            self._drafts.put(Draft(scope=self.scope, user=self.user,
                                   document_id=self.document_id, writer_id=self.writer_id,
                                   kind=self.kind, base_version=conflict.stored_version,
                                   content_json=text, snapshot_id=snapshot_id,
                                   updated_at=time.time()))
            self._local = self._next_snapshot(text, snapshot_id)
            self._base_version = conflict.stored_version
            self._base = conflict.stored
            self._conflict = None
            self._mark_dirty(Event.REBASED, urgent=True)
            return merged

    async def discard_and_reload(self) -> bool:
        """Throw away the local copy (and this writer's draft) for the stored version.

        The stored version is fetched first; local state is replaced only if the fetch worked
        and no edit was made while it ran. Returns True if it was applied, False if an edit
        made meanwhile won (that edit is kept).

        Raises:
            DocumentDeleted: the document was deleted (local copy and draft kept).
            psycopg / pgfence errors of the fetch (nothing changed).
        """
        async with self._io:               # no save is in flight while we reload
            seq, number = self._begin_read()
            async with self._source.connection() as conn:
                doc = await api.aget(conn, self.document_id)
            if not self._accept_read(seq, number):
                return False
            if doc.deleted:
                raise DocumentDeleted(f"document {self.document_id} was deleted "
                                      f"(version {doc.version}); the local copy is kept")
            self._drafts.delete(self.scope, self.user, self.document_id, self.writer_id)
            self._apply_document(doc)
            return True

    async def refresh(self) -> bool:
        """Fetch the stored version and take it if this session has nothing unsaved.

        Returns True if the local copy was replaced by a newer stored version. The answer is
        dropped (False) if a newer read was applied first, a local edit happened while it ran,
        or the session is not clean.
        """
        seq, number = self._begin_read()
        async with self._source.connection() as conn:
            doc = await api.aget(conn, self.document_id)
        if not self._accept_read(seq, number):
            return False
        if self._phase is not Phase.CLEAN or doc.deleted or doc.version <= self._base_version:
            return False
        self._apply_document(doc)
        return True

    def _begin_read(self) -> tuple[int, int]:
        """A read starts: its sequence number, and the number of the local snapshot."""
        self._read_seq += 1
        return self._read_seq, self._local.number

    def _accept_read(self, seq: int, number: int) -> bool:
        """The stale-read guard: drop an answer older than an applied one, or that started
        before a local edit."""
        if seq <= self._applied_read_seq or number != self._local.number:
            logger.debug("document %s: dropped stale read #%d", self.document_id, seq)
            self.stale_reads_dropped += 1
            return False
        self._applied_read_seq = seq
        return True

    def _apply_document(self, doc: api.Document) -> None:
        self._base_version = doc.version
        self._base = doc.content
        self._local = self._next_snapshot(_dumps(doc.content), "")
        self._confirmed = self._local.number
        self._attempt = None
        self._conflict = None
        self._dirty_since = None
        self._urgent = False
        self._retry_at = None
        self._failures = 0
        self._last_error = None
        self._move(Event.RELOADED)

    # ----------------------------------------------------------------------------------------
    # other writers' drafts
    # ----------------------------------------------------------------------------------------
    async def adopt(self, draft: Draft) -> None:
        """Take over a sibling's draft: its content becomes the local copy, based on the
        version the draft was edited from, and is saved through the CAS (a stale draft becomes a
        conflict to rebase, never an overwrite). The draft moves into this writer's slot in one
        SQLite transaction.

        Raises:
            SessionBusy: this session has unsaved edits or a conflict.
            ValueError: not a sibling draft of this session.
            DraftChanged: the sibling edited or removed its draft meanwhile.
        """
        if draft not in self.sibling_drafts:
            raise ValueError("not one of this session's sibling drafts")
        async with self._io:
            self._check_adoptable()
            base = await self._fetch_base(draft.base_version)
            self._check_adoptable()            # an edit may have come during the fetch
            snapshot_id = self._next_snapshot_id()
            mine = self._drafts.transfer(draft, self.writer_id, snapshot_id)
            self.sibling_drafts.remove(draft)
            self._local = self._next_snapshot(mine.content_json, snapshot_id)
            self._base_version = draft.base_version
            self._base = base
            self._resume_attempt(mine)
            self._mark_dirty(Event.TAKE, urgent=True)

    def _check_adoptable(self) -> None:
        if self._phase is not Phase.CLEAN:
            raise SessionBusy(f"document {self.document_id}: save or discard this "
                              "session's own edits before adopting a draft")

    def discard_draft(self, draft: Draft) -> bool:
        """Delete a sibling's draft (the user chose to drop it). Returns False if the sibling
        changed it meanwhile (then nothing is deleted: list the drafts again)."""
        if draft not in self.sibling_drafts:
            raise ValueError("not one of this session's sibling drafts")
        self.sibling_drafts.remove(draft)
        return self._drafts.delete(draft.scope, draft.user, draft.document_id, draft.writer_id,
                                   snapshot_id=draft.snapshot_id)

    # ----------------------------------------------------------------------------------------
    # closing
    # ----------------------------------------------------------------------------------------
    async def close(self, timeout: float = 10.0) -> bool:
        """Flush, then close. Never drops pending work: if the flush does not finish within
        ``timeout`` seconds (conflict, refusal, network down), the unsaved snapshot stays in
        this writer's draft slot for the next session. Returns True if everything was saved."""
        if self._life is _Life.CLOSED:
            return not self.pending
        self._life = _Life.CLOSING
        flushed = False
        try:
            await self.flush(timeout=timeout)
            flushed = True
        except (SessionError, TimeoutError) as exc:
            logger.warning("document %s: closing with unsaved edits (%s); draft kept in %s",
                           self.document_id, exc, self._drafts.path)
        finally:
            self._life = _Life.CLOSED
            self._wake.set()
            if self._task is not None:
                self._task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._task
            if self._owns_source and isinstance(self._source, DirectConnections):
                await self._source.close()
            if self._owns_drafts:
                self._drafts.close()
            self._publish()
            for queue in self._subscribers:
                queue.put_nowait(None)
        return flushed

    async def __aenter__(self) -> DocumentSession:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ----------------------------------------------------------------------------------------
    # state
    # ----------------------------------------------------------------------------------------
    def _enter(self, event: Event) -> None:
        """Take ``event``'s move in :data:`TRANSITIONS` (without publishing it)."""
        try:
            self._phase = TRANSITIONS[self._phase, event]
        except KeyError:
            raise RuntimeError(f"document {self.document_id}: no move from {self._phase.value} "
                               f"on {event.value}") from None

    def _move(self, event: Event) -> None:
        """Take ``event``'s move and publish the state."""
        self._enter(event)
        self._publish()

    def _publish(self) -> None:
        """Wake the waiters of :meth:`flush`; tell observers if the state changed."""
        self._state = (SessionState.CLOSED if self._life is _Life.CLOSED
                       else STATE_OF[self._phase])
        change = self.snapshot()
        progress, self._progress = self._progress, asyncio.Event()
        progress.set()
        if change == self._last_change or (
                self._last_change is not None
                and replace(change, retry_in=None) == replace(self._last_change, retry_in=None)):
            return
        self._last_change = change
        for queue in self._subscribers:
            queue.put_nowait(change)
        if self._on_state is not None:
            try:
                self._on_state(change)
            except Exception:
                logger.exception("document %s: on_state callback failed", self.document_id)


async def create_document(kind: str, content: Any, *, user: str, dsn: str | None = None,
                          source: ConnectionSource | None = None,
                          idempotency_key: str | None = None) -> int:
    """Create a document (``pgfence.document_create``) and return its id; open it with
    :meth:`DocumentSession.open`."""
    if (dsn is None) == (source is None):
        raise ValueError("pass exactly one of dsn= or source=")
    if source is None:
        direct = DirectConnections(str(dsn))
        try:
            async with direct.connection() as conn:
                return await api.acreate(conn, kind, content, user,
                                         idempotency_key=idempotency_key)
        finally:
            await direct.close()
    async with source.connection() as conn:
        return await api.acreate(conn, kind, content, user, idempotency_key=idempotency_key)


__all__ = [
    "Conflict", "ConflictPending", "DocumentDeleted", "DocumentSession", "MergeConflict",
    "NotFound", "Rebase", "Resolver", "SaveRefused", "SessionBusy", "SessionClosed",
    "SessionError", "SessionState", "StaleRead", "StateChange", "create_document",
    "default_writer_id", "is_transient",
]
