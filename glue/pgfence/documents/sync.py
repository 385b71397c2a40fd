"""A thin synchronous wrapper around :class:`~pgfence.documents.DocumentSession`.

The asyncio session runs in an event loop on a background thread (:class:`LoopThread`, which
several sync sessions may share); every method below submits the matching coroutine to that
loop and waits for its result. ``on_state`` callbacks run on the loop's thread.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from .api import MergeResult
from .drafts import Draft
from .session import Conflict, DocumentSession, Resolver, SessionState, StateChange

T = TypeVar("T")


class LoopThread:
    """An asyncio event loop running forever on a daemon thread."""

    def __init__(self, name: str = "pgfence-documents") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and return its result (its exception is raised here)."""
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    def call(self, fn: Callable[[], T]) -> T:
        """Run a plain function on the loop's thread and return its result."""
        async def _call() -> T:
            return fn()
        return self.run(_call())

    def stop(self) -> None:
        """Stop the loop and join the thread."""
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self._thread.is_alive():
            self.loop.close()

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SyncDocumentSession:
    """Blocking facade of :class:`DocumentSession` (same arguments, same semantics).

    ``SyncDocumentSession.open(doc_id, user=..., dsn=...)`` starts a private
    :class:`LoopThread` unless ``loop_thread=`` is given (shared threads are not stopped by
    :meth:`close`).
    """

    def __init__(self, session: DocumentSession, loop_thread: LoopThread,
                 owns_loop: bool) -> None:
        self.session = session
        self._lt = loop_thread
        self._owns_loop = owns_loop

    @classmethod
    def open(cls, document_id: int, *, loop_thread: LoopThread | None = None,
             **kwargs: Any) -> SyncDocumentSession:
        """Open a session (see :meth:`DocumentSession.open` for the arguments)."""
        owns = loop_thread is None
        lt = loop_thread or LoopThread()
        try:
            session = lt.run(DocumentSession.open(document_id, **kwargs))
        except BaseException:
            if owns:
                lt.stop()
            raise
        return cls(session, lt, owns)

    # reading
    @property
    def state(self) -> SessionState:
        """See :attr:`DocumentSession.state`."""
        return self.session.state

    @property
    def version(self) -> int:
        """See :attr:`DocumentSession.version`."""
        return self.session.version

    @property
    def content(self) -> Any:
        """See :attr:`DocumentSession.content`."""
        return self._lt.call(lambda: self.session.content)

    @property
    def pending(self) -> bool:
        """See :attr:`DocumentSession.pending`."""
        return self.session.pending

    @property
    def conflict(self) -> Conflict | None:
        """See :attr:`DocumentSession.conflict`."""
        return self.session.conflict

    @property
    def sibling_drafts(self) -> list[Draft]:
        """See :attr:`DocumentSession.sibling_drafts`."""
        return list(self.session.sibling_drafts)

    @property
    def writer_id(self) -> str:
        """See :attr:`DocumentSession.writer_id`."""
        return self.session.writer_id

    def snapshot(self) -> StateChange:
        """See :meth:`DocumentSession.snapshot`."""
        return self._lt.call(self.session.snapshot)

    # acting
    def edit(self, content: Any) -> None:
        """See :meth:`DocumentSession.edit` (the draft is written before this returns)."""
        self._lt.call(lambda: self.session.edit(content))

    def flush(self, timeout: float | None = None) -> int:
        """See :meth:`DocumentSession.flush`."""
        return self._lt.run(self.session.flush(timeout))

    def rebase(self, resolve: Resolver | None = None) -> MergeResult:
        """See :meth:`DocumentSession.rebase` (``resolve`` runs on the loop thread)."""
        return self._lt.run(self.session.rebase(resolve))

    def discard_and_reload(self) -> bool:
        """See :meth:`DocumentSession.discard_and_reload`."""
        return self._lt.run(self.session.discard_and_reload())

    def refresh(self) -> bool:
        """See :meth:`DocumentSession.refresh`."""
        return self._lt.run(self.session.refresh())

    def adopt(self, draft: Draft) -> None:
        """See :meth:`DocumentSession.adopt`."""
        self._lt.run(self.session.adopt(draft))

    def discard_draft(self, draft: Draft) -> bool:
        """See :meth:`DocumentSession.discard_draft`."""
        return self._lt.call(lambda: self.session.discard_draft(draft))

    def close(self, timeout: float = 10.0) -> bool:
        """See :meth:`DocumentSession.close`; also stops a private loop thread."""
        try:
            return self._lt.run(self.session.close(timeout))
        finally:
            if self._owns_loop:
                self._lt.stop()

    def __enter__(self) -> SyncDocumentSession:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
