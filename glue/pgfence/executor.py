"""The executor: a small asyncio process that performs external side effects.

It owns nothing by itself: every claim, fence check and outcome is a call to the SQL functions,
which decide. What it does:

- **Wake-up**: a dedicated autocommit connection LISTENs on each module's NOTIFY channel. NOTIFY
  is only a nudge: it is lost while the listener is disconnected, so the dispatcher also sweeps
  every ``poll_interval`` seconds, and sleeps no longer than the next due time reported by the
  database. A dropped listener (server restart, ``pg_terminate_backend``) reconnects with
  capped, jittered backoff, re-LISTENs, and triggers a sweep. The listener's connection can
  be another DSN (``listen_dsn``: a direct or session-mode one, when ``dsn`` goes through a
  transaction-mode pooler, where LISTEN does not work); at start a NOTIFY sent through the main
  connection must come back to it (a self-check that warns otherwise).
- **Liveness**: every connection has a connect timeout and TCP keepalives (:class:`Liveness`);
  every database call is bounded on the client (``query_timeout``, and never past the lease
  of the work it records): a call without an answer in time closes its connection and counts
  as a lost connection. The listener sends a heartbeat (``pg_listening_channels()``) after
  ``probe_interval`` seconds of silence and reconnects when it gets no answer within
  ``probe_timeout`` (a half-open connection: a dead NAT entry, a stuck proxy) or when its
  session no longer holds its LISTENs. The pool checks a connection that sat idle before
  handing it out, with the same bound.
- **Start**: the schema version must match (SchemaMismatch) and the login must be allowed to
  call what its modules call (MissingPrivilege, naming the GRANT).
- **Claim**: in rounds of up to ``batch``, never more than the free delivery slots
  (``concurrency``). Each round is its own short transaction, and its units are started before
  the next round is asked for: a round that fails (a connection lost mid-sweep, a pooler
  error, a restart) cannot strand what the earlier rounds of the sweep claimed. No transaction
  is open while a delivery runs.
- **Deliver**: each message runs in its own task with a timeout shorter than its lease.
  Outcomes go back through the fenced SQL functions; successful ones are grouped into one
  ``outbox_mark_sent_many`` per burst. A failure to record an outcome is logged and retried
  until the lease would lapse; after that the reaper takes the message back (at least once).
- **Reaper**: each module's reaper runs every ``reap_interval`` seconds.
- **Shutdown**: SIGTERM/SIGINT stop claiming; in-flight deliveries get ``grace`` seconds to
  finish and be recorded; whatever is left is abandoned to its lease. SIGKILL is survived by
  leases alone.

Modules plug in through :class:`Module`; the outbox is :class:`OutboxModule`.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import logging
import os
import random
import signal
import socket
import time
import uuid
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb
from psycopg_pool import AsyncConnectionPool

from . import outbox as sql
from .db import Liveness, aschema_version, check_version
from .errors import MissingPrivilege
from .outbox import Claimed
from .transports import PermanentError, RetryableError, Transport

SQL_UNTIL = "SELECT greatest(%s::timestamptz - now(), interval '0')"
# A function that does not exist is not a missing grant: its calls fail (and are logged) on
# their own, module by module.
SQL_MISSING_GRANTS = (
    "SELECT f FROM unnest(%s::text[]) AS f WHERE to_regprocedure(f) IS NOT NULL"
    " AND NOT has_function_privilege(to_regprocedure(f), 'EXECUTE')"
)
#: The channel of the start-up self-check NOTIFY (payload: a token of this executor).
SELF_CHECK_CHANNEL = "pgfence_self_check"

logger = logging.getLogger(__name__)

Job = Callable[[], Coroutine[Any, Any, None]]


class NoAnswer(psycopg.OperationalError):
    """A database call got no answer within its client-side bound; its connection was closed.

    An ``OperationalError``, so callers treat it as a lost connection (retried while the lease
    allows). What the server did with the statement is unknown, as for any lost answer.
    """


def _ident(name: str) -> str:
    """``name`` as an SQL identifier (quoted unless it is a plain lower-case one)."""
    if name.isidentifier() and name == name.lower() and name.isascii():
        return name
    return '"' + name.replace('"', '""') + '"'


def _sever(conn: psycopg.AsyncConnection[Any]) -> None:
    """Shut the connection's socket down both ways: a wait on it ends at once with a
    connection error. Nothing is sent to the server (a cancel request would wait on the same
    dead path); the connection is broken and a pool discards it."""
    with contextlib.suppress(OSError, ValueError, psycopg.Error):
        sock = socket.socket(fileno=os.dup(conn.pgconn.socket))
        try:
            sock.shutdown(socket.SHUT_RDWR)
        finally:
            sock.close()


@contextlib.asynccontextmanager
async def bounded(conn: psycopg.AsyncConnection[Any], seconds: float,
                  what: str) -> AsyncIterator[None]:
    """Bound the database calls made on ``conn`` inside the block to ``seconds`` in total.

    Past the bound the connection is severed (:func:`_sever`) and :class:`NoAnswer` raised,
    whatever TCP says: a peer that acknowledges packets but never answers is caught too.
    """
    fired = False

    def fire() -> None:
        nonlocal fired
        fired = True
        _sever(conn)

    handle = asyncio.get_running_loop().call_later(max(seconds, 0.01), fire)
    try:
        yield
    except psycopg.OperationalError as exc:
        if fired:
            raise NoAnswer(f"{what}: no answer from the server within {seconds:.1f}s "
                           "(connection closed)") from exc
        raise
    finally:
        handle.cancel()


def default_worker_id() -> str:
    """``host:pid:random`` — unique per process, readable in ``outbox_leases``."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass
class ExecutorConfig:
    """Executor settings. Durations are seconds (float).

    Liveness (see the module docstring and README, Running in production): ``query_timeout``
    bounds every database call on the client (never past the lease or heartbeat of the work
    it records); the listener sends its heartbeat after ``probe_interval`` seconds of silence
    and gives up on its connection when a probe (the heartbeat, the LISTENs, the start-up
    self-check) gets no answer within ``probe_timeout``, so a dead or half-open listener is
    replaced within ``probe_interval + probe_timeout`` (10 s by default); an idle pooled
    connection older than ``pool_check_idle`` is probed before use; ``liveness`` holds the
    connect timeout and TCP keepalives of every connection.

    Poolers: ``listen_dsn`` gives the listener its own DSN (direct or session mode, when the
    main one goes through a transaction-mode pooler); ``prepare_threshold`` is psycopg's
    (None = never prepare server-side, as a transaction-mode pooler before PgBouncer 1.21
    requires).
    """

    concurrency: int = 16
    batch: int = 10
    poll_interval: float = 5.0
    reap_interval: float = 10.0
    grace: float = 30.0
    reconnect_max: float = 10.0
    pool_size: int = 4
    worker_id: str = field(default_factory=default_worker_id)
    query_timeout: float = 15.0
    probe_interval: float = 5.0
    probe_timeout: float = 5.0
    pool_check_idle: float = 5.0
    liveness: Liveness = field(default_factory=Liveness)
    listen_dsn: str | None = None
    prepare_threshold: int | None = 5


class Module(ABC):
    """One durable module as the executor sees it: what wakes it, how it claims, its reaper."""

    name: str = "module"
    notify_channels: tuple[str, ...] = ()
    #: The functions this module calls, by signature: the login must be allowed to execute them
    #: (checked at start; pgfence_executor grants them all).
    functions: tuple[str, ...] = ()

    def bind(self, executor: Executor) -> None:
        """Called once before the executor starts; keep a reference for the pool and config."""
        self.executor = executor

    @abstractmethod
    def claim(self, slots: int) -> AsyncIterator[list[Job]]:
        """Claim up to ``slots`` units of work in rounds; yield each round's jobs (one per unit).

        Implement it as an async generator that yields right after each claiming statement: the
        executor starts a round's jobs before it asks for the next round, so an exception raised
        by a later round (it ends the sweep and is logged) cannot leave the units that earlier
        rounds claimed unstarted until their leases lapse.
        """

    async def next_due(self) -> float | None:
        """Seconds until this module has due work (None = nothing scheduled)."""
        return None

    async def reap(self) -> int:
        """Run the module's reaper once; return how many items it took back."""
        return 0

    async def aclose(self) -> None:
        """Release resources at shutdown."""
        return None


class Executor:
    """Runs modules until :meth:`stop` (or SIGTERM/SIGINT with :meth:`run_forever`).

    Args:
        dsn: the database (libpq URI / key=value).
        modules: the modules to serve (e.g. ``[OutboxModule(routes)]``).
        config: :class:`ExecutorConfig`.
    """

    def __init__(self, dsn: str, modules: Sequence[Module],
                 config: ExecutorConfig | None = None) -> None:
        self.dsn = dsn
        self.modules = list(modules)
        self.config = config or ExecutorConfig()
        self.pool: AsyncConnectionPool | None = None
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._inflight: set[asyncio.Task[None]] = set()
        self._saturated = False
        self._returned: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        self._check_token = uuid.uuid4().hex
        self._check_heard = asyncio.Event()
        self.listener_connects = 0  # observable for tests: how many times LISTEN was (re)issued
        #: The start-up self-check: True = a NOTIFY sent on the main connection reached the
        #: listener, False = it did not within probe_timeout, None = not run (yet).
        self.self_check: bool | None = None

    # -- lifecycle --------------------------------------------------------------------------
    def stop(self) -> None:
        """Stop claiming; :meth:`run` returns once in-flight work finished or ``grace`` passed."""
        self._stopping.set()
        self._wake.set()

    @property
    def stopping(self) -> bool:
        """True once :meth:`stop` was called (SIGTERM/SIGINT): modules stop starting new work."""
        return self._stopping.is_set()

    async def sleep_unless_stopping(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; return early (True) as soon as the executor is stopping."""
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)
        return self._stopping.is_set()

    @property
    def worker_id(self) -> str:
        """The name this executor claims under (visible in ``pgfence.outbox_leases``)."""
        return self.config.worker_id

    @property
    def listen_dsn(self) -> str:
        """The DSN of the LISTEN connection: ``config.listen_dsn``, else the main one."""
        return self.config.listen_dsn or self.dsn

    def connect_kwargs(self, dsn: str, role: str) -> dict[str, Any]:
        """Keyword arguments for a connection to ``dsn``: autocommit, the prepare threshold,
        an ``application_name`` naming ``role`` and this worker, and the liveness settings the
        DSN does not set itself."""
        kwargs: dict[str, Any] = dict(self.config.liveness.params(dsn))
        kwargs.update(autocommit=True, prepare_threshold=self.config.prepare_threshold,
                      application_name=f"pgfence-{role}:{self.worker_id}"[:63])
        return kwargs

    async def run(self) -> None:
        """Serve until :meth:`stop`.

        Raises (before anything is claimed): SchemaMismatch (the schema version differs),
        MissingPrivilege (the login may not call what a module calls; the message names the
        GRANT), psycopg.OperationalError (the database is unreachable at start).
        """
        await self._preflight()
        self.pool = AsyncConnectionPool(
            self.dsn, min_size=1, max_size=self.config.pool_size, open=False,
            kwargs=self.connect_kwargs(self.dsn, "executor"), name="pgfence-executor",
            timeout=self.config.query_timeout, check=self._check_idle, reset=self._on_return,
        )
        await self.pool.open(wait=True, timeout=30)
        for module in self.modules:
            module.bind(self)
        logger.info("executor %s started: modules=%s concurrency=%d batch=%d poll=%.1fs",
                    self.worker_id, ",".join(m.name for m in self.modules),
                    self.config.concurrency, self.config.batch, self.config.poll_interval)
        listener = asyncio.create_task(self._listen(), name="pgfence-listener")
        reaper = asyncio.create_task(self._reap_loop(), name="pgfence-reaper")
        try:
            await self._dispatch()
            await self._drain()
        finally:
            for task in (listener, reaper):
                task.cancel()
            await asyncio.gather(listener, reaper, return_exceptions=True)
            for module in self.modules:
                with contextlib.suppress(Exception):
                    await module.aclose()
            await self.pool.close()
            logger.info("executor %s stopped", self.worker_id)

    def run_forever(self) -> None:
        """Run in a fresh event loop; SIGTERM and SIGINT trigger a graceful :meth:`stop`."""

        async def main() -> None:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
            await self.run()

        asyncio.run(main())

    def _on_signal(self, sig: int) -> None:
        logger.warning("executor %s: %s received, no new claims; %d in flight get %.0fs",
                       self.worker_id, signal.Signals(sig).name, len(self._inflight),
                       self.config.grace)
        self.stop()

    async def _preflight(self) -> None:
        """The schema version and the login's grants, on one short connection."""
        async with await psycopg.AsyncConnection.connect(
                self.dsn, **self.connect_kwargs(self.dsn, "executor")) as conn, \
                bounded(conn, self.config.query_timeout, "start-up check"):
            check_version(await aschema_version(conn))
            wanted = sorted({f for m in self.modules for f in m.functions})
            cur = await conn.execute(SQL_MISSING_GRANTS, (wanted,))
            missing = [str(r[0]) for r in await cur.fetchall()]
            cur = await conn.execute("SELECT current_user")
            login = (await cur.fetchone() or ("?",))[0]
        if missing:
            raise MissingPrivilege(
                f"database login {login} may not execute {', '.join(missing)}: the executor "
                "cannot claim or record anything",
                sqlstate="42501",
                detail=f"Modules {', '.join(m.name for m in self.modules)} call these functions; "
                       "the group role pgfence_executor may call them all.",
                hint=f"GRANT pgfence_executor TO {_ident(login)};")

    # -- the pool -----------------------------------------------------------------------------
    async def _on_return(self, conn: psycopg.AsyncConnection[Any]) -> None:
        self._returned[conn] = time.monotonic()

    async def _check_idle(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The pool's check before handing out a connection that sat idle: one round trip
        within ``probe_timeout`` (a broken or half-open one fails and is replaced)."""
        idle = time.monotonic() - self._returned.get(conn, 0.0)
        if idle < self.config.pool_check_idle:
            return
        async with bounded(conn, self.config.probe_timeout, "pool check of an idle connection"):
            await conn.execute("SELECT 1")

    # -- wake-up ----------------------------------------------------------------------------
    async def _listen(self) -> None:
        channels = sorted({c for m in self.modules for c in m.notify_channels})
        if not channels:
            return
        cfg = self.config
        failures = 0
        checking: asyncio.Task[None] | None = None
        while not self._stopping.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                        self.listen_dsn, **self.connect_kwargs(self.listen_dsn, "listener")) as conn:
                    async with bounded(conn, cfg.probe_timeout, "listener LISTEN"):
                        for ch in [*channels, SELF_CHECK_CHANNEL]:
                            await conn.execute(f"LISTEN {ch}")
                    self.listener_connects += 1
                    if failures:
                        logger.warning("listener reconnected after %d failed attempt(s); sweeping",
                                       failures)
                    failures = 0
                    self._wake.set()  # NOTIFYs sent while we were away are lost: sweep now
                    if checking is None:
                        checking = asyncio.create_task(self._self_check(),
                                                       name="pgfence-self-check")
                    await self._hear(conn, channels)
            except asyncio.CancelledError:
                if checking is not None:
                    checking.cancel()
                raise
            except Exception as exc:
                failures += 1
                delay = min(self.config.reconnect_max, 0.1 * 2 ** min(failures - 1, 10))
                delay *= 0.5 + random.random() / 2
                logger.warning("listener connection lost (%s: %s); reconnecting in %.2fs",
                               type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc) else "",
                               delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)

    async def _hear(self, conn: psycopg.AsyncConnection[Any], channels: list[str]) -> None:
        """Wake the dispatcher on every NOTIFY; after ``probe_interval`` seconds of silence
        ask the session which channels it listens on, within ``probe_timeout``. Returns only by
        raising (a lost or half-open connection: NoAnswer)."""
        cfg = self.config
        warned = False
        while not self._stopping.is_set():
            async for note in conn.notifies(timeout=cfg.probe_interval):
                if note.channel != SELF_CHECK_CHANNEL:
                    self._wake.set()
                elif note.payload == self._check_token:
                    self._check_heard.set()
            async with bounded(conn, cfg.probe_timeout, "listener heartbeat"):
                cur = await conn.execute("SELECT pg_catalog.pg_listening_channels()")
                held = {str(r[0]) for r in await cur.fetchall()}
                missing = sorted(set(channels) - held)
                if missing:
                    # A transaction-mode pooler runs each statement on any server session: the
                    # LISTEN is not this session's. Say so once per connection, listen again.
                    log = logger.debug if warned else logger.warning
                    log("listener: its session does not hold LISTEN %s (a transaction-mode "
                        "pooler in between? give the listener a direct or session-mode "
                        "connection: --listen-dsn); listening again", ", ".join(missing))
                    warned = True
                    for ch in missing:
                        await conn.execute(f"LISTEN {ch}")
                    self._wake.set()

    async def _self_check(self) -> None:
        """Once, at start: a NOTIFY sent on a pooled connection must reach the listener."""
        started = time.monotonic()
        try:
            await self.fetch("SELECT pg_catalog.pg_notify(%s, %s)",
                             (SELF_CHECK_CHANNEL, self._check_token))
            async with asyncio.timeout(self.config.probe_timeout):
                await self._check_heard.wait()
        except TimeoutError:
            self.self_check = False
            logger.warning(
                "start-up self-check: a NOTIFY sent on the executor's connection did not reach "
                "its listener within %.1fs: wake-ups fall back to the %.1fs sweep. Behind a "
                "transaction-mode pooler (PgBouncer pool_mode=transaction) LISTEN does not "
                "work: give the listener a direct or session-mode connection (--listen-dsn)",
                self.config.probe_timeout, self.config.poll_interval)
        except psycopg.Error as exc:
            logger.warning("start-up self-check could not send its NOTIFY (%s)", exc)
        else:
            self.self_check = True
            logger.info("start-up self-check: NOTIFY round trip in %.0f ms",
                        (time.monotonic() - started) * 1000)

    # -- dispatch ---------------------------------------------------------------------------
    async def _dispatch(self) -> None:
        cfg = self.config
        failures = 0
        while not self._stopping.is_set():
            self._wake.clear()
            timeout = cfg.poll_interval
            free = cfg.concurrency - len(self._inflight)
            failed = False
            # Each module on its own: one module's failure (a database error, a poisoned row)
            # must not stop the others from claiming.
            for module in self.modules:
                if free <= 0:
                    break
                started = 0
                try:
                    async for jobs in module.claim(free):
                        # Started before the next round is asked for: whatever that round
                        # raises, these units are running (not left to their leases).
                        for job in jobs:
                            self._spawn(job)
                        started += len(jobs)
                        free -= len(jobs)
                        if jobs:
                            await asyncio.sleep(0)  # let them start before the next query
                except Exception as exc:
                    failed = True
                    logger.warning("%s claim failed (%s: %s)%s", module.name, type(exc).__name__,
                                   str(exc).strip().splitlines()[0] if str(exc) else "",
                                   f"; the {started} unit(s) claimed before it were started"
                                   if started else "")
            self._saturated = free <= 0
            if not self._saturated:
                for module in self.modules:
                    try:
                        due = await module.next_due()
                    except Exception:
                        failed = True
                        continue
                    if due is not None:
                        timeout = min(timeout, max(due, 0.001))
            if failed:
                failures += 1
                timeout = min(timeout, cfg.reconnect_max, 0.1 * 2 ** min(failures - 1, 10))
                logger.warning("retrying in %.2fs", timeout)
            else:
                failures = 0
            if self._saturated:
                # a finishing job sets _wake; the timeout is only a safety net
                timeout = cfg.poll_interval
            # asyncio.timeout, not wait_for: no extra task between a NOTIFY and the next claim
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _spawn(self, job: Job) -> None:
        task = asyncio.create_task(job())
        self._inflight.add(task)
        task.add_done_callback(self._done)

    def _done(self, task: asyncio.Task[None]) -> None:
        self._inflight.discard(task)
        if not task.cancelled() and task.exception() is not None:
            logger.error("job crashed: %r", task.exception())
        if self._saturated:
            self._saturated = False
            self._wake.set()

    async def _drain(self) -> None:
        if not self._inflight:
            return
        _, pending = await asyncio.wait(set(self._inflight), timeout=self.config.grace)
        if pending:
            logger.warning("grace period over: abandoning %d in-flight job(s) to their leases",
                           len(pending))
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)

    async def _reap_loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.reap_interval)
            if self._stopping.is_set():
                return
            for module in self.modules:
                try:
                    n = await module.reap()
                except Exception as exc:
                    logger.warning("%s reaper failed: %s", module.name, exc)
                    continue
                if n:
                    logger.warning("%s reaper took back %d lapsed claim(s)", module.name, n)
                    self._wake.set()

    # -- database helpers for modules ----------------------------------------------------
    async def retry_wait(self, exc: RetryableError) -> dt.timedelta | None:
        """The wait a transport's retryable failure asks for, or None.

        ``retry_after`` as is; a ``retry_at`` (a time the remote named without its own clock
        reading) measured against the database clock, ``now()``, like every lease and backoff;
        None if that query fails (the backoff alone then decides).
        """
        if exc.retry_after is not None or exc.retry_at is None:
            return exc.retry_after
        try:
            rows = await self.fetch(SQL_UNTIL, (exc.retry_at,))
        except psycopg.Error as err:
            logger.warning("could not read the database clock for Retry-After (%s)", err)
            return None
        wait: dt.timedelta | None = rows[0][0] if rows else None
        return wait

    async def fetch(self, query: str, params: Sequence[Any], *, retry_until: float | None = None,
                    row_factory: Any = None, timeout: float | None = None) -> list[Any]:
        """Run one statement on a pooled autocommit connection and return all rows.

        Each attempt is bounded on the client by ``timeout`` seconds (None = ``query_timeout``),
        and never past ``retry_until``; an attempt without an answer in time closes its
        connection and raises :class:`NoAnswer` (an OperationalError). With ``retry_until`` (a
        ``time.monotonic()`` deadline, e.g. the lease of the work being recorded), connection
        errors are retried with capped backoff until then; SQL errors (a SQLSTATE from
        pgfence) are not retried.
        """
        assert self.pool is not None
        attempt = 0
        while True:
            bound = self.config.query_timeout if timeout is None else timeout
            if retry_until is not None:
                bound = min(bound, max(retry_until - time.monotonic(), 0.1))
            try:
                async with self.pool.connection(timeout=bound) as conn, \
                        bounded(conn, bound, "database call"):
                    cur = conn.cursor(row_factory=row_factory) if row_factory else conn.cursor()
                    async with cur:
                        await cur.execute(query, params)
                        return await cur.fetchall() if cur.description else []
            except psycopg.OperationalError as exc:
                attempt += 1
                delay = min(self.config.reconnect_max, 0.05 * 2 ** min(attempt, 10))
                if retry_until is None or time.monotonic() + delay > retry_until:
                    raise
                logger.warning("database unavailable (%s); retry %d in %.2fs", exc, attempt, delay)
                await asyncio.sleep(delay)


# ===============================================================================================
# Outbox
# ===============================================================================================
@dataclass
class _SentItem:
    message: Claimed
    receipt: dict[str, Any] | None
    deadline: float
    done: asyncio.Future[bool]


def _storable(receipt: Any, message: Claimed) -> dict[str, Any] | None:
    """The receipt as it will be stored: a JSON object, or a note saying why it could not be.

    A transport that returns something unserialisable did deliver the message: that must still
    be recorded as sent (not retried), so the receipt is replaced, never the outcome.
    """
    if receipt is None:
        return None
    stored: dict[str, Any] = receipt if isinstance(receipt, dict) else {"value": receipt}
    try:
        json.dumps(stored)
    except (TypeError, ValueError) as exc:
        logger.warning("outbox#%d: the transport's receipt is not JSON (%s); storing its repr",
                       message.id, exc)
        return {"unserialisable_receipt": repr(stored)[:500]}
    return stored


class OutboxModule(Module):
    """Delivers outbox messages through the transport routed for each channel.

    Args:
        routes: channel → transport. The key ``"*"`` is the fallback for other channels.
        channels: claim only these channels; None = the routed channels, or all channels when
            there is a ``"*"`` route.
        lease: override every channel's lease (timedelta); None = per-channel setting.
        margin: seconds kept between a delivery's timeout and its lease, so the outcome can be
            recorded before the reaper may take the message back.
    """

    name = "outbox"
    notify_channels = (sql.NOTIFY_CHANNEL,)
    functions = ("pgfence.outbox_claim(text, integer, text[], interval)",
                 "pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[])",
                 "pgfence.outbox_mark_sent(bigint, integer, jsonb)",
                 "pgfence.outbox_mark_failed(bigint, integer, text, boolean, interval)",
                 "pgfence.outbox_reap(integer)",
                 "pgfence.outbox_next_due(text[])")

    def __init__(self, routes: Mapping[str, Transport], *, channels: Sequence[str] | None = None,
                 lease: dt.timedelta | None = None, margin: float = 2.0) -> None:
        if not routes:
            raise ValueError("the outbox module needs at least one route")
        self.routes = dict(routes)
        if channels is not None:
            self.channels: list[str] | None = list(channels)
        elif "*" in self.routes:
            self.channels = None
        else:
            self.channels = sorted(self.routes)
        self.lease = lease
        self.margin = margin
        self._sent: asyncio.Queue[_SentItem] = asyncio.Queue()
        self._completer: asyncio.Task[None] | None = None
        self.delivered = 0

    def bind(self, executor: Executor) -> None:
        super().bind(executor)
        self._completer = asyncio.create_task(self._complete_loop(), name="pgfence-outbox-marks")

    async def aclose(self) -> None:
        if self._completer is not None:
            self._completer.cancel()
            await asyncio.gather(self._completer, return_exceptions=True)
        for transport in {id(t): t for t in self.routes.values()}.values():
            with contextlib.suppress(Exception):
                await transport.aclose()

    def _transport(self, channel: str) -> Transport | None:
        return self.routes.get(channel) or self.routes.get("*")

    async def claim(self, slots: int) -> AsyncIterator[list[Job]]:
        batch = min(slots, self.executor.config.batch)
        while slots > 0:
            rows: list[Claimed] = await self.executor.fetch(
                sql.SQL_CLAIM, (self.executor.worker_id, min(batch, slots), self.channels,
                                self.lease), row_factory=class_row(Claimed))
            yield [self._job(message) for message in rows]
            slots -= len(rows)
            if len(rows) < batch:
                break

    async def next_due(self) -> float | None:
        rows = await self.executor.fetch(sql.SQL_NEXT_DUE, (self.channels,))
        due = rows[0][0] if rows else None
        return None if due is None else due.total_seconds()

    async def reap(self) -> int:
        rows = await self.executor.fetch(sql.SQL_RECLAIM, (1000,))
        return int(rows[0][0]) if rows else 0

    def _job(self, message: Claimed) -> Job:
        async def run() -> None:
            await self.deliver(message)
        return run

    async def deliver(self, message: Claimed) -> None:
        """Deliver one claimed message and record the outcome under its fence."""
        started = time.monotonic()
        # The lease is measured on the database clock; this local deadline only bounds our own
        # wait so that the outcome reaches the database before the lease can lapse.
        lease_s = message.lease.total_seconds()
        deadline = started + lease_s
        # Leave `margin` seconds to record the outcome; with a very short lease, half of it.
        budget = lease_s - self.margin if lease_s > 2 * self.margin else lease_s / 2
        transport = self._transport(message.channel)
        error: str | None = None
        retryable = True
        retry_after: dt.timedelta | None = None
        receipt: dict[str, Any] | None = None
        # asyncio.timeout, not wait_for: no extra task before the handler starts
        deadline_cm = asyncio.timeout(budget)
        try:
            if transport is None:
                raise PermanentError(f"no route for channel {message.channel!r}")
            async with deadline_cm:
                raw = await transport.deliver(message)
            receipt = _storable(raw, message)
        except RetryableError as exc:
            error, retry_after = str(exc), await self.executor.retry_wait(exc)
        except PermanentError as exc:
            error, retryable = str(exc), False
        except TimeoutError as exc:
            if deadline_cm.expired():
                error = f"delivery timed out after {budget:.1f}s (lease {message.lease})"
            else:  # the transport's own timeout (a socket, an upstream): its message, retryable
                error = f"{type(exc).__name__}: {exc}"
        except asyncio.CancelledError:
            logger.warning("outbox#%d attempt %d abandoned at shutdown; its lease will lapse",
                           message.id, message.attempt)
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
        elapsed_ms = (time.monotonic() - started) * 1000
        try:
            if error is None:
                fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
                await self._sent.put(_SentItem(message, receipt, deadline, fut))
                marked = await fut
                self.delivered += 1
                if marked:
                    logger.info("sent     outbox#%d %s -> %s attempt %d (%.0f ms)", message.id,
                                message.channel, message.recipient, message.attempt, elapsed_ms)
                else:
                    logger.warning("stale    outbox#%d attempt %d delivered but its claim was "
                                   "taken over; the new owner delivers again (at least once)",
                                   message.id, message.attempt)
            else:
                rows = await self.executor.fetch(
                    sql.SQL_MARK_FAILED,
                    (message.id, message.attempt, error[:8000], retryable, retry_after),
                    retry_until=deadline)
                status = rows[0][0] if rows else None
                if status is None:
                    logger.warning("stale    outbox#%d attempt %d failed (%s) but its claim "
                                   "was taken over", message.id, message.attempt, error)
                else:
                    log = logger.info if status == "pending" else logger.warning
                    log("%-8s outbox#%d %s -> %s attempt %d/%d: %s", status, message.id,
                        message.channel, message.recipient, message.attempt,
                        message.max_attempts, error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("could not record the outcome of outbox#%d attempt %d (%s); the reaper "
                         "will take it back when the lease lapses", message.id, message.attempt,
                         exc)

    async def _complete_loop(self) -> None:
        """Group successful deliveries into one fenced ``outbox_mark_sent_many`` per burst."""
        while True:
            items = [await self._sent.get()]
            while not self._sent.empty() and len(items) < 1000:
                items.append(self._sent.get_nowait())
            try:
                marked = await self._mark_sent(items)
            except Exception as exc:
                for item in items:
                    if not item.done.done():
                        item.done.set_exception(exc)
                continue
            for item in items:
                if not item.done.done():
                    item.done.set_result(item.message.id in marked)

    async def _mark_sent(self, items: list[_SentItem]) -> set[int]:
        deadline = min(i.deadline for i in items)
        params = ([i.message.id for i in items], [i.message.attempt for i in items],
                  [Jsonb(i.receipt) if i.receipt is not None else None for i in items])
        try:
            rows = await self.executor.fetch(sql.SQL_MARK_SENT_MANY, params, retry_until=deadline)
            return {int(r[0]) for r in rows}
        except psycopg.OperationalError:
            raise  # the database is gone past the deadline: every item's lease will lapse
        except Exception as exc:
            # E.g. a message purged meanwhile (P0002): record the others one by one, so that a
            # single bad item does not send every message of the batch out again.
            logger.warning("batch mark failed (%s); marking %d message(s) one by one",
                           exc, len(items))
            marked: set[int] = set()
            for item in items:
                try:
                    rows = await self.executor.fetch(
                        sql.SQL_MARK_SENT, (item.message.id, item.message.attempt,
                                            Jsonb(item.receipt) if item.receipt else None),
                        retry_until=item.deadline)
                except psycopg.OperationalError:
                    raise
                except Exception as one:
                    logger.error("could not mark outbox#%d sent: %s", item.message.id, one)
                    continue
                if rows and rows[0][0]:
                    marked.add(item.message.id)
            return marked
