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
  connection must come back to it (a self-check that warns otherwise). A NOTIFY for an idle
  module is claimed right away on the listener's own connection (not with ``listen_dsn``): the
  server session that passed the NOTIFY on is awake, a pooled one would have to be woken.
- **Liveness**: every connection has a connect timeout and TCP keepalives (:class:`Liveness`);
  every database call is bounded on the client (``query_timeout``, and never past the lease
  of the work it records): a call without an answer in time closes its connection and counts
  as a lost connection. The listener sends a heartbeat (``pg_listening_channels()``) after
  ``probe_interval`` seconds of silence and reconnects when it gets no answer within
  ``probe_timeout`` (a half-open connection: a dead NAT entry, a stuck proxy) or when its
  session no longer holds its LISTENs. The pool checks a connection that sat idle before
  handing it out, with the same bound.
- **Start**: the schema version must match (SchemaMismatch) and the login must be allowed to
  call what its modules call (MissingPrivilege, naming the GRANT). The check's connection
  then makes the first claim at once; what the first claim does not need follows its first
  round, so that it does not compete with it for the CPU: the connection pool (psycopg_pool,
  imported only then: ~10 ms), the listener's connection, the registry row, the NOTIFY
  self-check. Until the pool is open, the check's connection serves every call, one at a time.
- **Claim**: in rounds of up to ``batch``. Each round is its own short transaction, and its
  units are handed to the delivery slots before the next round is asked for: a round that
  fails (a connection lost mid-sweep, a pooler error, a restart) cannot strand what the
  earlier rounds of the sweep claimed. No transaction is open while a delivery runs. A module
  is asked again when something may be due for it: a NOTIFY on its channel, its next due
  time, a full round last time, the sweep.
- **Slots and fairness**: ``concurrency`` delivery slots, served by long-lived slot workers
  (no task per unit). Free slots are offered to the modules in the order of their use of
  their share (``shares``, equal by default): the least served module with due work first,
  capped at its fair share while another module waits, so a backlog in one module (slow
  webhooks after an outage) never keeps a plan or an operation waiting longer than the next
  freed slot. A module whose units are quick (the outbox, while its recent deliveries took
  little time: ``prefetch_wait``) may claim ahead of the free slots (a batch per claim round
  in flight), so a small ``concurrency`` still claims full batches, and while it has a
  backlog it keeps two claim rounds in flight side by side, so that their commits overlap.
- **Deliver**: each message runs in a slot with a timeout that ends before its lease (counted
  from the claim). Successful outcomes are settled in batches: the next claim round settles
  the deliveries finished since the last one (at most a batch of them when it also claims; a
  round that only settles takes them all) and claims the next batch in one statement and one
  durable commit (``outbox_settle_and_claim``), so a keyed message's settle hands its key's
  next message to this executor in that round. A failure to record an outcome is logged
  and retried until the lease would lapse; after that the reaper takes the message back (at
  least once).
- **Reaper**: each module's reaper runs every ``reap_interval`` seconds.
- **Shutdown**: SIGTERM/SIGINT stop claiming; in-flight (and already claimed) deliveries get
  ``grace`` seconds to finish and be recorded; whatever is left is abandoned to its lease.
  SIGKILL is survived by leases alone.

Modules plug in through :class:`Module`; the outbox is :class:`OutboxModule`.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import datetime as dt
import json
import logging
import os
import random
import signal
import socket
import time
import weakref
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.types.json import Jsonb

from . import outbox as sql
from .db import Liveness, aschema_version, check_version
from .errors import MissingPrivilege
from .metrics import HttpServer, Stats
from .outbox import Claimed
from .transports import PermanentError, RetryableError, Transport

if TYPE_CHECKING:
    from psycopg_pool import AsyncConnectionPool

    from .tracing import Tracing

SQL_UNTIL = "SELECT greatest(%s::timestamptz - now(), interval '0')"
# At start: the modules' functions that do not exist (a module may fall back to older ones), those
# the login may not execute (a function that does not exist is not a missing grant: its calls
# fail, and are logged, on their own), the login, and the schema version (one round trip; a
# database without pgfence.schema_version() fails it: then aschema_version says None).
SQL_START_CHECK = (
    "WITH f(sig) AS (SELECT unnest(%s::text[]))"
    " SELECT ARRAY(SELECT sig FROM f WHERE to_regprocedure(sig) IS NULL),"
    " ARRAY(SELECT sig FROM f WHERE to_regprocedure(sig) IS NOT NULL"
    " AND NOT has_function_privilege(to_regprocedure(sig), 'EXECUTE')), current_user::text,"
    " pgfence.schema_version()"
)
#: The outbox's claim round: settle the deliveries finished since the last one, claim the next.
SETTLE_AND_CLAIM = ("pgfence.outbox_settle_and_claim(bigint[], integer[], jsonb[], text, integer,"
                    " text[], interval)")
SQL_SETTLE_AND_CLAIM = (
    "SELECT * FROM pgfence.outbox_settle_and_claim(%s::bigint[], %s::int[], %s::jsonb[], %s::text,"
    " %s::int, %s::text[], %s::interval)"
)
#: The channel of the start-up self-check NOTIFY (payload: a token of this executor).
SELF_CHECK_CHANNEL = "pgfence_self_check"
#: The executor registry (functions/50_executor.sql): at start, on the reaper timer, at stop.
SQL_REGISTER = ("SELECT pgfence.executor_register(%s::text, %s::text, %s::int, %s::text,"
                " %s::jsonb, %s::int, %s::interval)")
SQL_HEARTBEAT = "SELECT pgfence.executor_heartbeat(%s::text)"
SQL_DEREGISTER = "SELECT pgfence.executor_deregister(%s::text)"

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


class bounded:  # used like a function: ``async with bounded(conn, seconds, what):``
    """Bound the database calls made on ``conn`` inside the block to ``seconds`` in total.

    Past the bound the connection is severed (:func:`_sever`) and :class:`NoAnswer` raised,
    whatever TCP says: a peer that acknowledges packets but never answers is caught too. (A
    class rather than a generator-based context manager: it is on every database call.)
    """

    __slots__ = ("conn", "fired", "handle", "seconds", "what")

    def __init__(self, conn: psycopg.AsyncConnection[Any], seconds: float, what: str) -> None:
        self.conn, self.seconds, self.what = conn, seconds, what
        self.fired = False
        self.handle: asyncio.TimerHandle | None = None

    def _fire(self) -> None:
        self.fired = True
        _sever(self.conn)

    async def __aenter__(self) -> None:
        self.handle = asyncio.get_running_loop().call_later(max(self.seconds, 0.01), self._fire)

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: object) -> None:
        if self.handle is not None:
            self.handle.cancel()
        if self.fired and isinstance(exc, psycopg.OperationalError):
            raise NoAnswer(f"{self.what}: no answer from the server within {self.seconds:.1f}s "
                           "(connection closed)") from exc


def default_worker_id() -> str:
    """``host:pid:random`` — unique per process, readable in ``outbox_leases``."""
    return f"{socket.gethostname()}:{os.getpid()}:{os.urandom(3).hex()}"


@dataclass
class ExecutorConfig:
    """Executor settings. Durations are seconds (float).

    Slots: ``concurrency`` units of work (deliveries, plan runs, operations) at once; each
    claim round asks for at most ``batch``. ``shares`` weighs the modules (by
    :attr:`Module.name`, default 1 each) when they compete for slots: with several modules
    having due work, each holds about ``concurrency * share / total`` slots, and a freed slot
    goes to the least served one. ``prefetch_wait``: a module whose units are quick (the
    outbox) may claim a batch more than the free slots per claim round in flight (two) while
    the last of them would wait at most this long for a slot, judged from its recent delivery
    times (0 = never claim ahead of the free slots).

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

    Observability: ``metrics_port`` serves ``/metrics``, ``/healthz`` and ``/readyz`` on
    ``metrics_host`` (None = no HTTP server; 0 = a free port, see
    :attr:`Executor.metrics_url`). The counters are kept either way (:attr:`Executor.stats`).
    ``otel``: OpenTelemetry spans per delivery, plan step and operation issue/poll
    (:mod:`pgfence.tracing`, the ``otel`` extra; off when ``OTEL_SDK_DISABLED=true``), on
    ``otel_provider`` (a TracerProvider; None = the global one).
    """

    concurrency: int = 16
    # One durable commit per up to 50 units: what is claimed beyond the free slots is bounded by
    # prefetch_wait (quick units only), so a larger round does not hold slow units ahead.
    batch: int = 50
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
    shares: Mapping[str, int] = field(default_factory=dict)
    prefetch_wait: float = 0.1
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    otel: bool = False
    otel_provider: Any = None


class Module(ABC):
    """One durable module as the executor sees it: what wakes it, how it claims, its reaper."""

    name: str = "module"
    notify_channels: tuple[str, ...] = ()
    #: The functions this module calls, by signature: the login must be allowed to execute them
    #: (checked at start; pgfence_executor grants them all).
    functions: tuple[str, ...] = ()
    #: True if its units are independent and usually quick (outbox deliveries): the executor may
    #: then claim some ahead of the free slots while recent units took little time.
    prefetch: bool = False

    def bind(self, executor: Executor) -> None:
        """Called once, after the start-up check, before the first claim; keep a reference for
        the pool and config (``executor.missing_functions`` names the functions of
        :attr:`functions` that the database lacks)."""
        self.executor = executor

    @abstractmethod
    def claim(self, slots: int) -> AsyncIterator[list[Job]]:
        """Claim up to ``slots`` units of work in rounds; yield each round's jobs (one per unit).

        Implement it as an async generator that yields right after each claiming statement: the
        executor hands a round's jobs to its slots before it asks for the next round, so an
        exception raised by a later round (it ends the sweep and is logged) cannot leave the
        units that earlier rounds claimed unstarted until their leases lapse. ``slots`` is 0
        only when :meth:`pending_outcomes` is not 0: record those outcomes, claim nothing.
        """

    def pending_outcomes(self) -> int:
        """How many finished units wait for their outcome to be recorded by the next
        :meth:`claim` round (the executor calls it soon, with ``slots`` 0 if none are free)."""
        return 0

    async def next_due(self) -> float | None:
        """Seconds until this module has due work (None = nothing scheduled or unknown)."""
        return None

    async def reap(self) -> int:
        """Run the module's reaper once; return how many items it took back."""
        return 0

    async def aclose(self) -> None:
        """Release resources at shutdown."""
        return None

    def serves(self) -> list[str]:
        """The queues this module serves, for the executor registry: outbox channels,
        operation kinds, ``["*"]`` for every one (``["external"]``: external plan steps only)."""
        return ["*"]


class _Served:
    """What the executor tracks of one module: its queued and running units, whether it may
    have due work (``dirty``), when it has more due, and how long its recent units took."""

    __slots__ = ("dirty", "due_at", "failures", "full", "generation", "index", "module", "queue",
                 "reserved", "retry_at", "running", "share", "sweeps", "took")

    def __init__(self, module: Module, index: int, share: int) -> None:
        self.module = module
        self.index = index
        self.share = share
        self.queue: collections.deque[tuple[Job, float]] = collections.deque()
        self.running = 0
        self.dirty = True
        self.generation = 0  # bumped by every nudge (NOTIFY, sweep): a claim racing it stays dirty
        self.due_at: float | None = None  # time.monotonic() of its next due work, if known
        self.took: float | None = None  # recent unit durations (exponential average), seconds
        self.sweeps: set[asyncio.Task[None]] = set()  # its claim sweeps in flight
        self.reserved = 0  # slots its sweeps may still fill
        self.full = False  # its last claim round got all it asked for (a backlog)
        self.failures = 0  # claim sweeps failed in a row
        self.retry_at = 0.0  # time.monotonic() before which a failed module is not asked again

    @property
    def busy(self) -> int:
        return self.running + len(self.queue) + self.reserved

    def nudge(self) -> None:
        self.dirty = True
        self.generation += 1


class Executor:
    """Runs modules until :meth:`stop` (or SIGTERM/SIGINT with :meth:`run_forever`).

    Args:
        dsn: the database (libpq URI / key=value).
        modules: the modules to serve (e.g. ``[OutboxModule(routes)]``).
        config: :class:`ExecutorConfig`.

    Raises:
        ValueError: two modules share a name, or ``config.shares`` names no module or gives a
            share below 1.
        RuntimeError: ``config.otel`` without the OpenTelemetry API installed.
    """

    def __init__(self, dsn: str, modules: Sequence[Module],
                 config: ExecutorConfig | None = None) -> None:
        self.dsn = dsn
        self.modules = list(modules)
        self.config = config or ExecutorConfig()
        names = [m.name for m in self.modules]
        if len(set(names)) != len(names):
            raise ValueError(f"module names must be unique, got {names}")
        if unknown := sorted(set(self.config.shares) - set(names)):
            raise ValueError(f"shares name no module: {', '.join(unknown)} (modules: "
                             f"{', '.join(names)})")
        if bad := sorted(k for k, v in self.config.shares.items() if int(v) < 1):
            raise ValueError(f"a share must be at least 1: {', '.join(bad)}")
        self._served = [_Served(m, i, int(self.config.shares.get(m.name, 1)))
                        for i, m in enumerate(self.modules)]
        self._by_channel: dict[str, list[_Served]] = {}
        for s in self._served:
            for ch in s.module.notify_channels:
                self._by_channel.setdefault(ch, []).append(s)
        self.pool: AsyncConnectionPool | None = None  # opened after the first claim round
        self._start_conn: psycopg.AsyncConnection[Any] | None = None  # the check's, until then
        self._start_lock = asyncio.Lock()
        self._wake = asyncio.Event()
        self._stopping = asyncio.Event()
        self._started = asyncio.Event()  # the start-up check passed
        self._first_round = asyncio.Event()  # the first claim sweep ended (registration follows)
        self._announced = asyncio.Event()  # registered (or failed to) and logged "started"
        self._registering = False  # the registration was sent (stop deregisters then)
        self._slots: set[asyncio.Task[None]] = set()
        self._idle: collections.deque[asyncio.Future[None]] = collections.deque()
        self._running = 0
        self._queued = 0
        self._reserved = 0
        self._sweep_at = 0.0
        self._returned: weakref.WeakKeyDictionary[Any, float] = weakref.WeakKeyDictionary()
        # (listener task, its connection) while that task makes a wake-up claim on it
        self._via: tuple[asyncio.Task[Any], psycopg.AsyncConnection[Any],
                         psycopg.AsyncCursor[Any]] | None = None
        self._check_token = os.urandom(16).hex()
        self._check_heard = asyncio.Event()
        self.listener_connects = 0  # observable for tests: how many times LISTEN was (re)issued
        #: The start-up self-check: True = a NOTIFY sent on the main connection reached the
        #: listener, False = it did not within probe_timeout, None = not run (yet).
        self.self_check: bool | None = None
        #: Signatures of the modules' :attr:`Module.functions` that the database does not have
        #: (read at start; a module may fall back to older functions).
        self.missing_functions: frozenset[str] = frozenset()
        #: True once this executor registered in ``pgfence.executor`` (audit_executors).
        self.registered = False
        #: What it did: counters and histograms served by /metrics (:mod:`pgfence.metrics`).
        self.stats = Stats()
        #: True while the LISTEN connection is up (or there is nothing to listen to).
        self.listener_connected = False
        self.last_sweep: float | None = None  # time.monotonic() of the last successful sweep
        self._http: HttpServer | None = None
        #: OpenTelemetry spans (pgfence.tracing), None when off: the modules check it once per
        #: claimed batch and otherwise run exactly as without tracing.
        self.tracing: Tracing | None = None
        if self.config.otel:
            from . import tracing
            if tracing.disabled_by_env():
                logger.warning("tracing asked for, but OTEL_SDK_DISABLED=true: no spans")
            else:
                self.tracing = tracing.Tracing(self, self.config.otel_provider)

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
        if self.config.metrics_port is not None:
            self._http = HttpServer(self, self.config.metrics_host, self.config.metrics_port,
                                    timeout=self.config.probe_timeout)
            await self._http.start()
        listener = asyncio.create_task(self._listen(), name="pgfence-listener")
        reaper: asyncio.Task[None] | None = None
        after: asyncio.Task[None] | None = None
        pooling: asyncio.Task[None] | None = None
        try:
            await self._preflight()
            pooling = asyncio.create_task(self._open_pool(), name="pgfence-pool-open")
            for module in self.modules:
                module.bind(self)
            self._started.set()
            after = asyncio.create_task(self._after_start(), name="pgfence-register")
            reaper = asyncio.create_task(self._reap_loop(), name="pgfence-reaper")
            await self._dispatch()
            await self._drain()
        finally:
            if after is not None and self._registering and not after.done():
                # The registration is under way: let it end (bounded), so that it is not left
                # half done and the deregistration below finds its row.
                with contextlib.suppress(Exception):
                    await asyncio.wait({after}, timeout=self.config.probe_timeout)
            tasks = [t for t in (listener, pooling, reaper, after, *self._slots,
                                 *(t for s in self._served for t in s.sweeps)) if t is not None]
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            for module in self.modules:
                with contextlib.suppress(Exception):
                    await module.aclose()
            await self._deregister()
            if self._http is not None:
                await self._http.aclose()
            if self.pool is not None:
                await self.pool.close()
            if self._start_conn is not None:
                await self._start_conn.close()
            logger.info("executor %s stopped", self.worker_id,
                        extra={"event": "executor.stopped", "worker": self.worker_id})

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
                       self.worker_id, signal.Signals(sig).name, self._running,
                       self.config.grace)
        self.stop()

    async def _open_pool(self) -> None:
        """Once the first claim round is back (or a second after the check): import
        psycopg_pool, open the pool and, once it has its first connection, switch every call
        to it and close the check's connection."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._first_round.wait()
        from psycopg_pool import AsyncConnectionPool

        pool: AsyncConnectionPool = AsyncConnectionPool(
            self.dsn, min_size=1, max_size=self.config.pool_size, open=False,
            kwargs=self.connect_kwargs(self.dsn, "executor"), name="pgfence-executor",
            timeout=self.config.query_timeout, check=self._check_idle,
        )
        try:
            await pool.open(wait=False)
            with contextlib.suppress(Exception):
                await pool.wait(timeout=self.config.query_timeout)  # its first connection
        except BaseException:  # stopped meanwhile
            await pool.close()
            raise
        self.pool = pool
        async with self._start_lock:  # after the call in flight on it, if any
            conn, self._start_conn = self._start_conn, None
            if conn is not None:
                await conn.close()

    @contextlib.asynccontextmanager
    async def _start_connection(self, timeout: float) -> AsyncIterator[psycopg.AsyncConnection[Any]]:
        """The check's connection, for one call at a time, until the pool is open (then the
        pool's). Raises psycopg.OperationalError if it was lost before: the caller's retry
        finds the pool, opened at most a second after the check."""
        async with asyncio.timeout(timeout):
            await self._start_lock.acquire()
        locked = True
        try:
            conn = self._start_conn
            if conn is None or conn.closed or conn.broken:
                if self.pool is None:
                    raise psycopg.OperationalError("the start-up connection was lost; the pool "
                                                   "is being opened")
                self._start_lock.release()  # handed over to the pool meanwhile
                locked = False
                async with self.pool.connection(timeout=timeout) as pooled:
                    yield pooled
                return
            yield conn
        finally:
            if locked:
                self._start_lock.release()

    def _connection(self, timeout: float) -> contextlib.AbstractAsyncContextManager[Any]:
        """A connection for one call: the pool's, or before it is open the check's."""
        if self.pool is not None:
            return self.pool.connection(timeout=timeout)
        return self._start_connection(timeout)

    async def _preflight(self) -> None:
        """The schema version and the login's grants, on a connection that then serves every
        call (the first claim at once) until the pool is open (:meth:`_open_pool`)."""
        conn = await psycopg.AsyncConnection.connect(
            self.dsn, **self.connect_kwargs(self.dsn, "executor"))
        try:
            async with bounded(conn, self.config.query_timeout, "start-up check"):
                wanted = sorted({f for m in self.modules for f in m.functions})
                try:
                    cur = await conn.execute(SQL_START_CHECK, (wanted,))
                except (psycopg.errors.UndefinedFunction, psycopg.errors.InvalidSchemaName):
                    check_version(await aschema_version(conn))  # no schema_version(): says so
                    raise
                row = await cur.fetchone()
                check_version(int(row[3]) if row and row[3] is not None else None)
                missing: list[str] = list(row[1] or ()) if row else []
        except BaseException:
            await conn.close()
            raise
        self._start_conn = conn
        absent: list[str] = list(row[0] or ()) if row else []
        login: str = str(row[2]) if row else "?"
        self.missing_functions = frozenset(absent)
        if missing:
            raise MissingPrivilege(
                f"database login {login} may not execute {', '.join(missing)}: the executor "
                "cannot claim or record anything",
                sqlstate="42501",
                detail=f"Modules {', '.join(m.name for m in self.modules)} call these functions; "
                       "the group role pgfence_executor may call them all.",
                hint=f"GRANT pgfence_executor TO {_ident(login)};")

    # -- observability ------------------------------------------------------------------------
    @property
    def metrics_url(self) -> str | None:
        """``http://host:port/metrics`` once the HTTP server listens (None without one)."""
        if self._http is None or self._http.server is None:
            return None
        return f"http://{self._http.host}:{self._http.port}/metrics"

    def state(self) -> dict[str, Any]:
        """The state gauges of /metrics: version, in_flight (module -> units running or
        queued), free_slots, listener_connected, seconds_since_last_sweep (None: none yet)."""
        from . import __version__

        return {"version": __version__,
                "in_flight": {s.module.name: s.running + len(s.queue) for s in self._served},
                "free_slots": max(self.config.concurrency - self._running, 0),
                "listener_connected": self.listener_connected,
                "seconds_since_last_sweep": None if self.last_sweep is None
                else round(time.monotonic() - self.last_sweep, 3)}

    async def readiness(self, timeout: float) -> dict[str, bool]:
        """The checks of /readyz: started (the start-up check passed: schema version known,
        grants), listener (connected), database (a ``SELECT 1`` answered within ``timeout``
        seconds)."""
        database = False
        if self._started.is_set():
            try:
                database = bool(await self.fetch("SELECT 1", (), timeout=timeout))
            except Exception:
                database = False
        return {"started": self._started.is_set(), "listener": self.listener_connected,
                "database": database}

    # -- the registry -------------------------------------------------------------------------
    def registration(self) -> dict[str, Any]:
        """What this executor registers (``pgfence.executor_register``): worker, host, pid,
        version, serves (module -> queues), concurrency, heartbeat interval (timedelta)."""
        from . import __version__

        host, pid = socket.gethostname(), os.getpid()
        return {"worker": self.worker_id, "host": host, "pid": pid, "version": __version__,
                "serves": {m.name: m.serves() for m in self.modules},
                "concurrency": self.config.concurrency,
                "heartbeat": dt.timedelta(seconds=self.config.reap_interval)}

    async def _after_start(self) -> None:
        """The start-up work the first claim does not wait for: once the first claim sweep is
        back (or after a second), register in the executor registry and log "started" (the
        self-check NOTIFY follows). A registration that fails is logged; the heartbeat on the
        reaper timer registers again."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._first_round.wait()
        try:
            self._registering = True
            async with self._connection(self.config.query_timeout) as conn, \
                    bounded(conn, self.config.query_timeout, "executor registration"):
                await self._register(conn)
        except Exception as exc:
            logger.warning("could not register in the executor registry (%s); running anyway",
                           str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__)
        logger.info("executor %s started: modules=%s concurrency=%d batch=%d poll=%.1fs",
                    self.worker_id, ",".join(m.name for m in self.modules),
                    self.config.concurrency, self.config.batch, self.config.poll_interval,
                    extra={"event": "executor.started", "worker": self.worker_id})
        self._announced.set()

    async def _register(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """Register in the executor registry at start. A failure is logged, not fatal: the
        registry informs operators, it decides nothing about claims."""
        r = self.registration()
        try:
            cur = await conn.execute(SQL_REGISTER, (r["worker"], r["host"], r["pid"], r["version"],
                                                    Jsonb(r["serves"]), r["concurrency"],
                                                    r["heartbeat"]))
            row = await cur.fetchone()
        except psycopg.OperationalError:
            raise
        except psycopg.Error as exc:
            logger.warning("could not register in the executor registry (%s); running anyway",
                           str(exc).strip().splitlines()[0] if str(exc) else type(exc).__name__)
            return
        self.registered = True
        revived = int(row[0]) if row and row[0] else 0
        if revived:
            logger.info("%d plan run(s) that waited for an executor serving plans are due again",
                        revived)
            self._nudge_all()

    async def _heartbeat(self) -> None:
        """The registry heartbeat, on the reaper timer; re-register if the row is gone."""
        try:
            rows = await self.fetch(SQL_HEARTBEAT, (self.worker_id,))
            if rows and rows[0][0]:
                return
            async with self._connection(self.config.query_timeout) as conn, \
                    bounded(conn, self.config.query_timeout, "executor registration"):
                await self._register(conn)
        except Exception as exc:
            logger.warning("executor registry heartbeat failed: %s", exc)

    async def _deregister(self) -> None:
        if not (self.registered or self._registering):
            return
        with contextlib.suppress(Exception):
            await self.fetch(SQL_DEREGISTER, (self.worker_id,), timeout=self.config.probe_timeout)

    # -- the pool -----------------------------------------------------------------------------
    async def _check_idle(self, conn: psycopg.AsyncConnection[Any]) -> None:
        """The pool's check before handing out a connection that sat idle: one round trip
        within ``probe_timeout`` (a broken or half-open one fails and is replaced). A new
        connection (never returned yet) was just made: no check."""
        returned = self._returned.get(conn)
        if returned is None or time.monotonic() - returned < self.config.pool_check_idle:
            return
        async with bounded(conn, self.config.probe_timeout, "pool check of an idle connection"):
            await conn.execute("SELECT 1")

    # -- wake-up ----------------------------------------------------------------------------
    def _nudge_all(self) -> None:
        for s in self._served:
            s.nudge()
        self._wake.set()

    async def _listen(self) -> None:
        channels = sorted(self._by_channel)
        if not channels:
            self.listener_connected = True  # nothing to listen to: nothing missing
            return
        cfg = self.config
        failures = 0
        checking: asyncio.Task[None] | None = None
        # Connected once the first claim sweep is back (or a second after the start-up check):
        # until then its connection would only compete with the first claim for the CPU, and
        # nothing is missed meanwhile (once listening, it sweeps every module).
        await self._started.wait()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(1.0):
                await self._first_round.wait()
        while not self._stopping.is_set():
            try:
                async with await psycopg.AsyncConnection.connect(
                        self.listen_dsn, **self.connect_kwargs(self.listen_dsn, "listener")) as conn:
                    async with bounded(conn, cfg.probe_timeout, "listener LISTEN"):
                        for ch in [*channels, SELF_CHECK_CHANNEL]:
                            await conn.execute(f"LISTEN {ch}")
                    self.listener_connects += 1
                    self.listener_connected = True
                    if failures:
                        logger.warning("listener reconnected after %d failed attempt(s); sweeping",
                                       failures)
                    failures = 0
                    self._nudge_all()  # NOTIFYs sent while we were away are lost: sweep now
                    # The wake-up claims' cursor, kept for this connection: a new cursor per
                    # call would build its adapters again.
                    cursor = conn.cursor()
                    await self._sweep_here(conn, cursor, channels)
                    # The self-check after that sweep: behind a transaction-mode pooler a
                    # statement of this connection in flight could pass its NOTIFY on by chance.
                    if checking is None:
                        checking = asyncio.create_task(self._self_check(),
                                                       name="pgfence-self-check")
                    await self._hear(conn, cursor, channels)
            except asyncio.CancelledError:
                if checking is not None:
                    checking.cancel()
                raise
            except Exception as exc:
                self.listener_connected = False
                failures += 1
                delay = min(self.config.reconnect_max, 0.1 * 2 ** min(failures - 1, 10))
                delay *= 0.5 + random.random() / 2
                logger.warning("listener connection lost (%s: %s); reconnecting in %.2fs",
                               type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc) else "",
                               delay)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), delay)

    async def _sweep_here(self, conn: psycopg.AsyncConnection[Any],
                          cursor: psycopg.AsyncCursor[Any], channels: list[str]) -> None:
        """The sweep after (re)connecting, for each channel's first module if it is idle, on the
        listener's session (the others' go to the pool, nudged by the caller): it finds what was
        due while nobody listened, and it makes this new server session compile the claim
        function and plan its walk before the first wake-up needs them. A new session's first
        claim takes ~6.5 ms against ~0.6 warm (a wake-up after it ~2 ms, the found path planned
        then); without this the first wake-up after every (re)connect paid that."""
        for ch in channels:
            first = self._by_channel[ch]
            if not self._stopping.is_set() and self._inline_ok(first):  # (started: _listen)
                await self._wake_claim(conn, cursor, first)

    async def _hear(self, conn: psycopg.AsyncConnection[Any], cursor: psycopg.AsyncCursor[Any],
                    channels: list[str]) -> None:
        """Wake the dispatcher on every NOTIFY; after ``probe_interval`` seconds of silence
        ask the session which channels it listens on, within ``probe_timeout``. Returns only by
        raising (a lost or half-open connection: NoAnswer).

        A NOTIFY for an idle module is claimed on this connection itself, at once (see
        :meth:`_wake_claim`); NOTIFYs arriving meanwhile are kept by psycopg for the next turn.
        """
        cfg = self.config
        warned = False
        by_channel = self._by_channel
        probe_at = time.monotonic() + cfg.probe_interval
        while not self._stopping.is_set():
            wake: list[_Served] | None = None
            # One batch of NOTIFYs at a time (stop_after: what one read brought, all of it), so
            # that a wake-up claim can use the connection right after it.
            async with contextlib.aclosing(conn.notifies(
                    timeout=max(probe_at - time.monotonic(), 0.0), stop_after=1)) as notes:
                async for note in notes:
                    probe_at = time.monotonic() + cfg.probe_interval
                    served = by_channel.get(note.channel)
                    if served is not None:
                        for s in served:
                            s.nudge()
                        if self._started.is_set() and not self._stopping.is_set():
                            if wake is None and self._inline_ok(served):
                                wake = served  # claimed below, once notifies() let go of conn
                            elif wake is None:
                                self._launch()  # the claim goes out now, not after a loop turn
                        if wake is None:
                            # (a wake-up claim wakes the dispatcher when its sweep ends: not
                            # while its answer is awaited, when the loop should be free for it)
                            self._wake.set()
                    elif note.channel == SELF_CHECK_CHANNEL and note.payload == self._check_token:
                        self._check_heard.set()
            if wake is not None:
                await self._wake_claim(conn, cursor, wake)
                continue
            if time.monotonic() < probe_at:
                continue
            probe_at = time.monotonic() + cfg.probe_interval
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
                    self._nudge_all()

    def _inline_ok(self, served: list[_Served]) -> bool:
        """True if a NOTIFY for ``served`` may be claimed on the listener's own connection: it
        is the main DSN's (no ``listen_dsn``), and the first of them is idle (no claim sweep in
        flight, no outcome waiting to be recorded, not backing off)."""
        if self.config.listen_dsn is not None:
            return False
        s = served[0]
        return not s.sweeps and not s.module.pending_outcomes() and s.retry_at <= time.monotonic()

    async def _wake_claim(self, conn: psycopg.AsyncConnection[Any],
                          cursor: psycopg.AsyncCursor[Any], served: list[_Served]) -> None:
        """A wake-up claim of ``served[0]`` on the listener's connection, in the listener's
        task: the session that just passed the NOTIFY on is awake, while a pooled one must be
        woken first (on a busy 2-core machine, most of a wake-up's time). Otherwise the same
        sweep as :meth:`_launch` starts (the same room, fairness and bounds); the other modules
        of the channel get their sweeps as usual. The dispatcher is woken when the sweep ends
        (:meth:`_sweep`), not before: while the answer is awaited nothing is due for it, and the
        loop is free when the answer comes. ``cursor``: one of ``conn``'s, for every such claim."""
        s = served[0]
        room = self._launch(inline=s)
        if room is None:
            self._wake.set()
            return
        task = asyncio.current_task()
        assert task is not None
        s.sweeps.add(task)
        self._via = (task, conn, cursor)
        try:
            await self._sweep(s, room)
        finally:
            self._via = None

    async def _self_check(self) -> None:
        """Once, at start: a NOTIFY sent on a pooled connection must reach the listener."""
        await self._announced.wait()  # after the first claim round and the registration
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
        """Start claim sweeps whenever a module may have due work and a slot is free (or
        outcomes wait to be recorded); in between, sleep until a NOTIFY, a freed slot, a
        finished sweep, the next due time or the sweep timer."""
        cfg = self.config
        self._sweep_at = time.monotonic() + cfg.poll_interval
        while not self._stopping.is_set():
            self._wake.clear()
            now = time.monotonic()
            if now >= self._sweep_at:
                self._sweep_at = now + cfg.poll_interval
                for s in self._served:
                    s.nudge()
            for s in self._served:
                if s.due_at is not None and s.due_at <= now:
                    s.due_at = None
                    s.nudge()
            self._launch()
            timeout = max(self._sweep_at - now, 0.0)
            for s in self._served:
                if s.due_at is not None:
                    timeout = min(timeout, s.due_at - now)
                if s.retry_at > now and (s.dirty or s.module.pending_outcomes()):
                    timeout = min(timeout, s.retry_at - now)
            if timeout <= 0:
                continue
            # asyncio.timeout, not wait_for: no extra task between a NOTIFY and the next claim
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()

    def _room(self, s: _Served) -> int:
        """How many units ``s`` may claim now: the free slots, plus, for a module whose units
        are quick, units ahead of them that would wait at most ``prefetch_wait`` for a slot
        (judged from its recent units): a batch per claim round in flight if all of those fit,
        else as many as fit, up to one batch."""
        cfg = self.config
        limit = cfg.concurrency
        # The last unit claimed ahead waits about ahead / concurrency unit times for a slot:
        # a round per sweep in flight ahead while all of them fit within prefetch_wait, else as
        # many as fit, up to one round.
        if s.module.prefetch and s.took is not None and cfg.prefetch_wait > 0:
            fits = int(cfg.concurrency * (cfg.prefetch_wait / max(s.took, 1e-6) - 1))
            rounds = self._depth(s) * cfg.batch
            limit += rounds if fits >= rounds else max(0, min(fits, cfg.batch))
        return limit - self._running - self._queued - self._reserved

    def _launch(self, inline: _Served | None = None) -> int | None:
        """Start a claim sweep for each module that may have due work. A sweep claims in
        rounds of ``batch``, the next round asked for while the units of the last one run; one
        sweep per module at a time, except for a module whose units are quick (the outbox):
        while it has a backlog it has two rounds in flight side by side, so that their commits
        overlap, and with them this process's work.

        Modules are served least-served first (their busy slots over their share); while
        another module with possibly due work comes after it, a module gets no more than its
        fair share of the slots, so a backlog in one never holds the others off for longer than
        the next freed slot. Slots a module leaves unused go to the next one; a module capped
        by its share stays due and gets the rest once the others are served.

        ``inline``: that module's sweep is not started but its room reserved and returned, for
        the caller to run (:meth:`_wake_claim`); None if it gets no sweep now.
        """
        cfg = self.config
        stopping = self._stopping.is_set()
        now = time.monotonic()
        # A second sweep beside one in flight only while the module has a backlog (its last
        # round came back full); outcomes otherwise wait for the sweep in flight to end.
        wanted = [s for s in self._served if s.retry_at <= now and (
            not s.sweeps or (len(s.sweeps) < self._depth(s) and s.full and s.dirty
                             and not stopping))
            and (s.module.pending_outcomes() or (s.dirty and not stopping))]
        if not wanted:
            return None
        wanted.sort(key=lambda s: (s.busy / s.share, s.index))
        active = sum(s.share for s in self._served if s.dirty or s.busy)
        inline_room: int | None = None
        for pos, s in enumerate(wanted):
            room = 0
            if s.dirty and not stopping:
                room = self._room(s)
                if any(o.dirty for o in wanted[pos + 1:]):
                    fair = max(1, cfg.concurrency * s.share // max(active, 1))
                    room = min(room, fair - s.busy)
            room = max(room, 0)
            depth = self._depth(s)
            if depth > 1:
                room = min(room, cfg.batch)  # one round each, side by side
            if room == 0 and not s.module.pending_outcomes():
                continue
            s.reserved += room
            self._reserved += room
            if s is inline:
                inline_room = room
                continue
            task = asyncio.create_task(self._sweep(s, room), name=f"pgfence-{s.module.name}-claim")
            s.sweeps.add(task)
            # The second round side by side (with a backlog): it overlaps the two commits, and
            # this process's work with them.
            if depth > len(s.sweeps) and s.full and s.dirty and not stopping:
                more = min(self._room(s), cfg.batch)
                if more > 0 and not any(o.dirty for o in wanted[pos + 1:]):
                    s.reserved += more
                    self._reserved += more
                    task = asyncio.create_task(self._sweep(s, more),
                                               name=f"pgfence-{s.module.name}-claim")
                    s.sweeps.add(task)
        return inline_room

    def _depth(self, s: _Served) -> int:
        """Claim sweeps ``s`` may have in flight: two (of one round each) for a module whose
        units are quick."""
        return 2 if s.module.prefetch else 1

    async def _sweep(self, s: _Served, slots: int) -> None:
        """One claim sweep of ``s`` for up to ``slots`` units (0: only record its outcomes);
        ``slots`` were reserved for it by :meth:`_launch`."""
        cfg = self.config
        generation = s.generation
        claimed = 0
        held = slots
        wake = self._via is not None and self._via[0] is asyncio.current_task()
        try:
            for again in (False, True):
                if again and not (wake and claimed < slots and s.module.pending_outcomes()
                                  and not self._stopping.is_set()):
                    break
                # again: the wake-up's units already finished (quick handlers): record them and
                # claim again on the same session, one round (settle and claim in one statement:
                # its answer also says when more is due), as a plain SQL loop does: two
                # statements per wake-up on one session instead of three on two (claim and next
                # due here, the settle on a pooled connection), and the next wake-up finds the
                # module idle.
                async for jobs in s.module.claim(held):
                    # Handed to the slots before the next round is asked for: whatever that
                    # round raises, these units run (not left to their leases).
                    done = min(len(jobs), held)
                    held -= done
                    s.reserved -= done
                    self._reserved -= done
                    self._enqueue(s, jobs)
                    claimed += len(jobs)
                    if wake:
                        # A wake-up claim: its units start now, before the rest of the round
                        # (its counters, the next due time) runs on the listener's task.
                        await asyncio.sleep(0)
        except Exception as exc:
            s.failures += 1
            delay = min(cfg.reconnect_max, 0.1 * 2 ** min(s.failures - 1, 10))
            s.retry_at = time.monotonic() + delay
            logger.warning("%s claim failed (%s: %s)%s; retrying in %.2fs", s.module.name,
                           type(exc).__name__, str(exc).strip().splitlines()[0] if str(exc) else "",
                           f"; the {claimed} unit(s) claimed before it were started"
                           if claimed else "", delay)
        else:
            s.failures = 0
            self.last_sweep = time.monotonic()
            s.full = claimed >= slots > 0
            if s.full:
                # A backlog: more may be due, and a sweep in flight beside this one that comes
                # back short may have read a snapshot older than this sweep's commits (a keyed
                # settle's promotions send no NOTIFY): the nudge keeps that one from clearing
                # ``dirty`` on what it could not see.
                s.nudge()
            elif slots == 0:
                # Outcomes only: the settle may have made messages due (a key's next turn).
                with contextlib.suppress(Exception):
                    due = await s.module.next_due()
                    if due is not None and due <= 0:
                        s.nudge()
            elif claimed < slots and s.generation == generation:
                # Drained (nothing more due now): asked again on a NOTIFY, its due time or the
                # sweep. A module that answers "due now" although it got fewer units than it
                # asked for (another executor holds them) looks again a moment later.
                s.dirty = False
                with contextlib.suppress(Exception):
                    await asyncio.sleep(0)  # the units just queued start first
                    due = await s.module.next_due()
                    s.due_at = None if due is None else time.monotonic() + max(due, 0.002)
        finally:
            s.reserved -= held
            self._reserved -= held
            self._first_round.set()
            task = asyncio.current_task()
            if task is not None:
                s.sweeps.discard(task)
            self._wake.set()

    # -- slots ------------------------------------------------------------------------------
    def _enqueue(self, s: _Served, jobs: list[Job]) -> None:
        """Queue a round's units for the slots; wake idle slot workers or start new ones."""
        if not jobs:
            return
        now = time.monotonic()
        s.queue.extend((job, now) for job in jobs)
        self._queued += len(jobs)
        for _ in range(len(jobs)):
            while self._idle:
                waiter = self._idle.popleft()
                if not waiter.done():
                    waiter.set_result(None)
                    break
            else:
                if len(self._slots) < self.config.concurrency:
                    task = asyncio.create_task(self._slot(), name="pgfence-slot")
                    self._slots.add(task)
                    task.add_done_callback(self._slots.discard)

    def _next_unit(self) -> tuple[_Served, Job] | None:
        """The next queued unit, of the module that runs the fewest units for its share."""
        best: _Served | None = None
        for s in self._served:
            if s.queue and (best is None or s.running * best.share < best.running * s.share):
                best = s
        if best is None:
            return None
        job, _ = best.queue.popleft()
        self._queued -= 1
        return best, job

    async def _slot(self) -> None:
        """A slot worker: runs queued units one after the other; idles when there are none."""
        loop = asyncio.get_running_loop()
        while True:
            unit = self._next_unit()
            if unit is None:
                waiter: asyncio.Future[None] = loop.create_future()
                self._idle.append(waiter)
                await waiter
                continue
            s, job = unit
            s.running += 1
            self._running += 1
            started = time.monotonic()
            try:
                await job()
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise
                logger.error("%s job ended by cancellation", s.module.name)
            except Exception as exc:
                logger.error("job crashed: %r", exc)
            finally:
                took = time.monotonic() - started
                s.took = took if s.took is None else s.took + (took - s.took) * 0.2
                s.running -= 1
                self._running -= 1
                self._wake.set()

    async def _drain(self) -> None:
        """After stop: in-flight and claimed units get ``grace`` seconds, their outcomes are
        recorded as they finish; whatever is left then is abandoned to its lease."""
        deadline = time.monotonic() + self.config.grace
        while True:
            self._wake.clear()
            self._launch()  # stopping: sweeps that only record outcomes
            now = time.monotonic()
            pending = any(s.module.pending_outcomes() for s in self._served)
            if not (self._running or self._queued or pending
                    or any(s.sweeps for s in self._served)):
                return
            timeout = deadline - now
            if timeout <= 0:
                break
            for s in self._served:
                if s.retry_at > now and s.module.pending_outcomes():
                    timeout = min(timeout, s.retry_at - now)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._wake.wait()
        if self._running or self._queued:
            logger.warning("grace period over: abandoning %d in-flight job(s) to their leases",
                           self._running + self._queued)

    async def _reap_loop(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self.config.reap_interval)
            if self._stopping.is_set():
                return
            await self._heartbeat()
            for s in self._served:
                try:
                    n = await s.module.reap()
                except Exception as exc:
                    logger.warning("%s reaper failed: %s", s.module.name, exc)
                    continue
                if n:
                    self.stats.inc("pgfence_reclaimed", (s.module.name,), n)
                    logger.warning("%s reaper took back %d lapsed claim(s)", s.module.name, n)
                    s.nudge()
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
        if self._via is not None and self._via[0] is asyncio.current_task():
            # A wake-up claim on the listener's connection, with its cursor: one attempt.
            _, conn, via = self._via
            bound = self.config.query_timeout if timeout is None else timeout
            async with bounded(conn, bound, "wake-up claim"):
                if row_factory is None:
                    return await _rows(via, query, params)
                async with conn.cursor(row_factory=row_factory) as cur:
                    return await _rows(cur, query, params)
        attempt = 0
        while True:
            bound = self.config.query_timeout if timeout is None else timeout
            if retry_until is not None:
                bound = min(bound, max(retry_until - time.monotonic(), 0.1))
            try:
                async with self._connection(bound) as conn:
                    try:
                        async with bounded(conn, bound, "database call"):
                            cur = conn.cursor(row_factory=row_factory) if row_factory \
                                else conn.cursor()
                            async with cur:
                                return await _rows(cur, query, params)
                    finally:
                        # When it went back to the pool (an idle one is checked before reuse).
                        # Not the pool's reset callback: that returns every connection through
                        # a task of the pool's, a hop on every call.
                        self._returned[conn] = time.monotonic()
            except psycopg.OperationalError as exc:
                attempt += 1
                delay = min(self.config.reconnect_max, 0.05 * 2 ** min(attempt, 10))
                if retry_until is None or time.monotonic() + delay > retry_until:
                    raise
                logger.warning("database unavailable (%s); retry %d in %.2fs", exc, attempt, delay)
                await asyncio.sleep(delay)


async def _rows(cur: psycopg.AsyncCursor[Any], query: Any, params: Any) -> list[Any]:
    """Execute ``query`` on ``cur``; its rows, or [] for a statement that returns none."""
    await cur.execute(query, params)
    res = cur.pgresult  # not cur.description: it builds columns
    return await cur.fetchall() if res is not None and res.nfields else []


# ===============================================================================================
# Outbox
# ===============================================================================================
@dataclass(slots=True)
class _SentItem:
    """A delivered message whose ``sent`` is still to be recorded (by the next claim round)."""

    message: Claimed
    receipt: dict[str, Any] | None
    deadline: float  # time.monotonic() when its lease lapses
    took_ms: float = 0.0  # the delivery's duration


#: ``OutboxModule._next_due`` when the last round did not say (ask outbox_next_due).
_UNKNOWN = -1.0


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

    Each claim round records the deliveries finished since the previous one and claims the
    next batch in one statement and one durable commit (``outbox_settle_and_claim``; on a
    database that lacks it, ``outbox_mark_sent_many`` then ``outbox_claim``). A round with
    nothing to settle (a wake-up, the first claim) is ``outbox_claim`` alone, the quickest
    answer; when it comes back short, ``outbox_next_due`` is asked after its messages were
    handed to the slots, not before. A wake-up round whose deliveries finished within a loop
    turn settles them at once and claims again on the listener's session (one
    ``outbox_settle_and_claim``: the next due time comes with it; see :meth:`Executor._sweep`).

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
                 SETTLE_AND_CLAIM,
                 "pgfence.outbox_mark_sent_many(bigint[], integer[], jsonb[])",
                 "pgfence.outbox_mark_sent(bigint, integer, jsonb)",
                 "pgfence.outbox_mark_failed(bigint, integer, text, boolean, interval)",
                 "pgfence.outbox_reap(integer)",
                 "pgfence.outbox_next_due(text[])")
    prefetch = True

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
        # The channels as an array literal, made once (cheaper than adapting the list per call).
        self._channels = None if self.channels is None else "{" + ",".join(
            '"' + c.replace("\\", "\\\\").replace('"', '\\"') + '"' for c in self.channels) + "}"
        self._sent: list[_SentItem] = []
        self._next_due: float | None = None  # seconds, as of the last round (or _UNKNOWN)
        self._combined = True
        self.delivered = 0

    def bind(self, executor: Executor) -> None:
        super().bind(executor)
        self._combined = SETTLE_AND_CLAIM not in executor.missing_functions
        if not self._combined:
            logger.warning("the database has no %s (run `pgfence migrate`): settling and "
                           "claiming in two statements", SETTLE_AND_CLAIM)

    async def aclose(self) -> None:
        for item in self._sent:
            self._unrecorded(item, "the executor stopped first")
        self._sent = []
        for transport in {id(t): t for t in self.routes.values()}.values():
            with contextlib.suppress(Exception):
                await transport.aclose()

    def _transport(self, channel: str) -> Transport | None:
        return self.routes.get(channel) or self.routes.get("*")

    def serves(self) -> list[str]:
        return ["*"] if self.channels is None else list(self.channels)

    def pending_outcomes(self) -> int:
        return len(self._sent)

    async def claim(self, slots: int) -> AsyncIterator[list[Job]]:
        batch = self.executor.config.batch
        while True:
            n = min(batch, slots)
            # At most a batch of outcomes per claiming round (the rest ride on the next round):
            # a keyed message's settle hands its key on in the same round only while the
            # round claims as many as it settles (_outbox_keys_hand_off).
            cap = len(self._sent) if n <= 0 else max(n, batch)
            sent, self._sent = self._sent[:cap], self._sent[cap:]
            if n <= 0 and not sent:
                return
            # The lease runs from the claim: counted from before the request, to be safe.
            asked = time.monotonic()
            rows = await self._settle_and_claim(sent, max(n, 0))
            back = time.monotonic()
            # The jobs go to the slots first, the counters follow (off a wake-up's path).
            if self.executor.tracing is None:
                yield [self._job(message, asked) for message in rows]
            else:  # pgfence.tracing: a span per delivery (one more call per batch)
                yield await self.executor.tracing.outbox_jobs(self, rows, asked)
            stats = self.executor.stats
            stats.observe("pgfence_claim_round_trip_seconds", ("outbox",), back - asked)
            if rows:
                counts = collections.Counter([m.channel for m in rows])
                for channel, k in counts.items():
                    stats.inc("pgfence_claimed", ("outbox", channel), k)
            slots -= len(rows)
            if len(rows) < n or slots <= 0:
                return

    async def next_due(self) -> float | None:
        if self._next_due == _UNKNOWN:
            rows = await self.executor.fetch(sql.SQL_NEXT_DUE, (self._channels,))
            due: dt.timedelta | None = rows[0][0] if rows else None
            self._next_due = None if due is None else due.total_seconds()
        return self._next_due

    async def reap(self) -> int:
        rows = await self.executor.fetch(sql.SQL_RECLAIM, (1000,))
        return int(rows[0][0]) if rows else 0

    # -- one round: settle, then claim ----------------------------------------------------------
    async def _settle_and_claim(self, sent: list[_SentItem], n: int) -> list[Claimed]:
        """Record ``sent`` and claim up to ``n`` messages (0: settle only); log each outcome.

        Raises what the round raised. Outcomes a lost connection left unrecorded go back to
        the next round (until their leases would lapse): the dispatcher retries with backoff
        and is never held up here, so a stop or a NOTIFY is still heard.
        """
        try:
            if not sent:
                # A wake-up: nothing to settle. outbox_claim alone answers ~0.5 ms sooner than
                # the combined call (no settlement, no next-due probe before the answer); the
                # next due time, if the round comes back short, is asked for after its
                # messages were handed to the slots (next_due).
                return await self._claim_alone(n)
            if not self._combined:
                if sent:
                    self._log_sent(sent, await self._mark_sent(sent))
                    sent = []
                return await self._claim_alone(n)
            # The arrays as literals: joining numbers is cheaper than adapting list elements.
            ids = "{" + ",".join([str(i.message.id) for i in sent]) + "}"
            attempts = "{" + ",".join([str(i.message.attempt) for i in sent]) + "}"
            receipts = ([Jsonb(i.receipt) if i.receipt is not None else None for i in sent]
                        if any(i.receipt is not None for i in sent) else None)
            try:
                rows = await self.executor.fetch(
                    SQL_SETTLE_AND_CLAIM, (ids, attempts, receipts, self.executor.worker_id,
                                           n, self._channels, self.lease))
            except psycopg.OperationalError:
                raise
            except psycopg.Error:
                if not sent:
                    raise  # the claim itself failed (nothing to settle): as a plain claim would
                # E.g. a message purged meanwhile (P0002), or the claim failed: nothing of the
                # call was committed. Record the marks on their own, then claim on its own.
                self._log_sent(sent, await self._mark_sent(sent))
                sent = []
                return await self._claim_alone(n)
        except psycopg.OperationalError:
            # No answer: whether it committed is unknown. The marks are fenced, so recording
            # them again is safe; what a claim took (if anything) is left to its leases.
            self._requeue(sent)
            raise
        last = rows[-1]
        due: dt.timedelta | None = last[11]
        self._next_due = None if due is None else due.total_seconds()
        if sent:
            self._log_sent(sent, set(last[10] or ()))
        return [Claimed(*r[:10]) for r in rows[:-1]]

    async def _claim_alone(self, n: int) -> list[Claimed]:
        """``outbox_claim`` alone (a database without ``outbox_settle_and_claim``, or after it
        failed on a mark). When it comes back short, the next due time is asked for
        later (:meth:`next_due`), after its messages were handed to the slots."""
        if n <= 0:
            return []
        # Tuples made into Claimed here: cheaper than a row factory that reads the columns' names.
        rows = [Claimed(*r) for r in await self.executor.fetch(
            sql.SQL_CLAIM, (self.executor.worker_id, n, self._channels, self.lease))]
        self._next_due = 0.0 if len(rows) == n else _UNKNOWN
        return rows

    def _requeue(self, items: list[_SentItem]) -> None:
        """Give unrecorded outcomes to the next round, those whose lease has not lapsed."""
        now = time.monotonic()
        keep = [i for i in items if i.deadline > now]
        for item in items:
            if item.deadline <= now:
                self._unrecorded(item, "its lease lapsed first")
        self._sent[:0] = keep

    @staticmethod
    def _unrecorded(item: _SentItem, why: str) -> None:
        logger.error("could not record the outcome of outbox#%d attempt %d (%s); the reaper "
                     "will take it back when the lease lapses", item.message.id,
                     item.message.attempt, why)

    def _log_sent(self, sent: list[_SentItem], marked: set[int]) -> None:
        info = logger.isEnabledFor(logging.INFO)
        stats = self.executor.stats
        for item in sent:
            m = item.message
            stats.inc("pgfence_delivered" if m.id in marked else "pgfence_lost_races",
                      ("outbox", m.channel))
            if m.id not in marked:
                logger.warning("stale    outbox#%d attempt %d delivered but its claim was "
                               "taken over; the new owner delivers again (at least once)",
                               m.id, m.attempt, extra={
                                   "event": "outbox.stale", "unit_module": "outbox", "id": m.id,
                                   "channel": m.channel, "attempt": m.attempt,
                                   "outcome": "lost_race"})
            elif info:
                logger.info("sent     outbox#%d %s -> %s attempt %d", m.id, m.channel,
                            m.recipient, m.attempt, extra={
                                "event": "outbox.sent", "unit_module": "outbox", "id": m.id,
                                "channel": m.channel, "attempt": m.attempt, "outcome": "sent",
                                "duration_ms": item.took_ms})

    async def _mark_sent(self, items: list[_SentItem]) -> set[int]:
        """``outbox_mark_sent_many`` for ``items``; one by one if the batch is refused.

        Raises psycopg.OperationalError (a lost connection: nothing is known)."""
        params = ([i.message.id for i in items], [i.message.attempt for i in items],
                  [Jsonb(i.receipt) if i.receipt is not None else None for i in items])
        try:
            rows = await self.executor.fetch(sql.SQL_MARK_SENT_MANY, params)
            return {int(r[0]) for r in rows}
        except psycopg.OperationalError:
            raise
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
                                            Jsonb(item.receipt) if item.receipt else None))
                except psycopg.OperationalError:
                    raise
                except Exception as one:
                    logger.error("could not mark outbox#%d sent: %s", item.message.id, one)
                    continue
                if rows and rows[0][0]:
                    marked.add(item.message.id)
            return marked

    # -- one delivery -------------------------------------------------------------------------
    def _job(self, message: Claimed, claimed_at: float) -> Job:
        def run() -> Coroutine[Any, Any, Any]:
            return self.deliver(message, claimed_at)
        return run

    async def deliver(self, message: Claimed,
                      claimed_at: float | None = None) -> tuple[str, str | None]:
        """Deliver one claimed message and record the outcome under its fence.

        ``claimed_at``: ``time.monotonic()`` when its claim was asked for (None = now); its
        lease, measured on the database clock, runs from then. A success is recorded by the
        next claim round (with the other deliveries finished meanwhile); a failure at once.
        Returns ``(outcome, error)``: ``("delivered", None)``, or an outcome of ``retry``,
        ``failed``, ``dead``, ``lost_race``, ``unrecorded`` with the delivery's error.
        """
        started = time.monotonic()
        stats = self.executor.stats
        # This local deadline only bounds our own wait, so that the outcome reaches the
        # database before the lease can lapse.
        deadline = (started if claimed_at is None else claimed_at) + message.lease.total_seconds()
        left = deadline - started
        # Leave `margin` seconds to record the outcome; with a very short lease, half of it.
        budget = left - self.margin if left > 2 * self.margin else max(left / 2, 0.001)
        transport = self._transport(message.channel)
        error: str | None = None
        raw: Any = None
        retryable = True
        retry_after: dt.timedelta | None = None
        # asyncio.timeout, not wait_for: no extra task before the handler starts
        deadline_cm = asyncio.timeout(budget)
        try:
            if transport is None:
                raise PermanentError(f"no route for channel {message.channel!r}")
            async with deadline_cm:
                raw = await transport.deliver(message)
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
        took = time.monotonic() - started
        if message.attempt == 1 and claimed_at is not None:
            # Due (created) to claimed on the database clock, then claimed to started here
            # (observed once the handler returned: not on the way to it).
            stats.observe("pgfence_wakeup_latency_seconds", ("outbox",),
                          (message.lease_expires_at - message.lease - message.created_at)
                          .total_seconds() + (started - claimed_at))
        stats.observe("pgfence_delivery_duration_seconds", ("outbox", message.channel), took)
        if error is None:
            self.delivered += 1
            self._sent.append(_SentItem(message, _storable(raw, message), deadline,
                                        round(took * 1000, 1)))
            return "delivered", None
        try:
            rows = await self.executor.fetch(
                sql.SQL_MARK_FAILED,
                (message.id, message.attempt, error[:8000], retryable, retry_after),
                retry_until=deadline)
            status = rows[0][0] if rows else None
            labels = ("outbox", message.channel)
            if status is None:
                stats.inc("pgfence_lost_races", labels)
            elif status == "dead":
                stats.inc("pgfence_dead", labels)
            else:
                stats.inc("pgfence_failed", (*labels, "retryable" if status == "pending"
                                             else "permanent"))
            fields = {"unit_module": "outbox", "id": message.id, "channel": message.channel,
                      "attempt": message.attempt, "duration_ms": round(took * 1000, 1),
                      "error": error}
            if status is None:
                logger.warning("stale    outbox#%d attempt %d failed (%s) but its claim "
                               "was taken over", message.id, message.attempt, error,
                               extra={**fields, "event": "outbox.stale", "outcome": "lost_race"})
            else:
                log = logger.info if status == "pending" else logger.warning
                # pending = it will be retried after its backoff; failed / dead = it will not
                log("%-8s outbox#%d %s -> %s attempt %d/%d: %s", status, message.id,
                    message.channel, message.recipient, message.attempt,
                    message.max_attempts, error,
                    extra={**fields, "event": "outbox." + ("retry" if status == "pending"
                                                           else status), "outcome": status})
            return ("lost_race" if status is None else "retry" if status == "pending"
                    else str(status)), error
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("could not record the outcome of outbox#%d attempt %d (%s); the reaper "
                         "will take it back when the lease lapses", message.id, message.attempt,
                         exc)
        return "unrecorded", error
