"""The executor module for long external operations.

:class:`OperationModule` plugs into :class:`pgfence.executor.Executor`. For each claimed
operation it runs one task that follows the SQL issue protocol and nothing else decides:

1. no reference yet → ``operation_begin_issue`` (the SQL answers ``issue``, ``reissue``,
   ``poll``, ``canceled``, ``failed`` or NULL); on ``issue``/``reissue`` call the handler's ``issue`` and
   record the reference with ``operation_record_external``;
2. a reference (recorded now, or found at claim by a new owner) → poll the external API every
   ``handler.poll_interval`` seconds and report each state with ``operation_poll``, which
   extends the lease and says whether a cancel was requested (then the handler's ``cancel``
   is called once);
3. a terminal external state → the handler's ``finish`` builds the result →
   ``operation_finish``.

Every write carries the claim's fence; any NULL/false answer means "you are not the owner any
more" and the task stops without touching the external API. A failed poll of the external API
still calls ``operation_poll`` with no state, as a heartbeat. At shutdown (SIGTERM) tasks stop
polling and ``operation_release`` their operations so another executor takes them over at once;
after SIGKILL the lease lapses and the next claim resumes them — polling, never issuing again.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import random
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

from psycopg.rows import class_row, dict_row
from psycopg.types.json import Jsonb

from ..executor import Job, Module
from ..transports import PermanentError
from . import (
    NOTIFY_CHANNEL,
    SQL_BEGIN_ISSUE,
    SQL_CLAIM,
    SQL_FINISH,
    SQL_GET,
    SQL_POLL,
    SQL_REAP,
    SQL_RECORD_EXTERNAL,
    SQL_RELEASE,
    ClaimedOperation,
)
from .handlers import ExternalState, Issued, OperationHandler

logger = logging.getLogger(__name__)


class OperationModule(Module):
    """Runs long external operations through one handler per kind.

    Args:
        handlers: kind → handler. Only these kinds are claimed.
        lease: how long a claim (and each poll) owns the operation; a crashed executor's
            operations are taken over this long after its last poll. Must exceed every
            handler's poll interval plus ``margin``.
        margin: seconds kept between an external call's timeout and the lease, so that its
            outcome can be recorded before another executor may take over.
    """

    name = "operation"
    notify_channels = (NOTIFY_CHANNEL,)
    functions = ("pgfence.operation_claim(text, text[], interval, integer)",
                 "pgfence.operation_begin_issue(bigint, integer, boolean, interval)",
                 "pgfence.operation_record_external(bigint, integer, text, jsonb)",
                 "pgfence.operation_poll(bigint, integer, jsonb, interval)",
                 "pgfence.operation_finish(bigint, integer, boolean, jsonb, text)",
                 "pgfence.operation_release(bigint, integer)",
                 "pgfence.operation_reap(integer)",
                 "pgfence.operation_get(bigint)")

    def __init__(self, handlers: Mapping[str, OperationHandler], *,
                 lease: dt.timedelta = dt.timedelta(minutes=2), margin: float = 1.0) -> None:
        if not handlers:
            raise ValueError("the operation module needs at least one handler")
        self.handlers = dict(handlers)
        self.kinds = sorted(self.handlers)
        self.lease = lease
        self.margin = margin
        lease_s = lease.total_seconds()
        for kind, handler in self.handlers.items():
            if handler.poll_interval + margin >= lease_s:
                raise ValueError(f"{kind}: poll interval {handler.poll_interval}s + margin "
                                 f"{margin}s must be shorter than the lease ({lease_s}s)")
        self.finished: dict[int, str] = {}  # observable for tests: id -> final status

    # -- Module interface ----------------------------------------------------------------------
    def serves(self) -> list[str]:
        return list(self.kinds)

    def _done(self, op: ClaimedOperation, status: str) -> None:
        """Note an operation's final status (:attr:`finished`, the metrics)."""
        self.finished[op.id] = status
        stats = self.executor.stats
        if status == "succeeded":
            stats.inc("pgfence_delivered", ("operation", op.kind))
        elif status == "failed":
            stats.inc("pgfence_failed", ("operation", op.kind, "permanent"))

    async def claim(self, slots: int) -> AsyncIterator[list[Job]]:
        batch = max(1, min(slots, self.executor.config.batch))
        while slots > 0 and not self._stopping():
            rows: list[ClaimedOperation] = await self.executor.fetch(
                SQL_CLAIM, (self.executor.worker_id, self.kinds, self.lease, min(batch, slots)),
                row_factory=class_row(ClaimedOperation))
            for op in rows:
                self.executor.stats.inc("pgfence_claimed", ("operation", op.kind))
            if self.executor.tracing is None:
                yield [self._job(op) for op in rows]  # started before the next round
            else:  # pgfence.tracing: a span per operation, with one per issue and poll
                yield await self.executor.tracing.operation_jobs(self, rows)
            slots -= len(rows)
            if len(rows) < batch:
                break

    async def reap(self) -> int:
        rows = await self.executor.fetch(SQL_REAP, (1000,))
        return int(rows[0][0]) if rows else 0

    async def aclose(self) -> None:
        for handler in {id(h): h for h in self.handlers.values()}.values():
            with contextlib.suppress(Exception):
                await handler.aclose()

    # -- one operation ---------------------------------------------------------------------------
    def _stopping(self) -> bool:
        return self.executor.stopping

    def _job(self, op: ClaimedOperation) -> Job:
        async def run() -> None:
            await self.run(op)
        return run

    async def _sql(self, query: str, params: tuple[Any, ...], deadline: float) -> Any:
        rows = await self.executor.fetch(query, params, retry_until=deadline)
        return rows[0][0] if rows else None

    async def _get(self, operation_id: int) -> dict[str, Any]:
        rows = await self.executor.fetch(SQL_GET, (operation_id,), row_factory=dict_row)
        return dict(rows[0]) if rows else {}

    def _deadline(self) -> float:
        """Local bound for database retries: until our lease would lapse."""
        return time.monotonic() + self.lease.total_seconds() - self.margin

    async def run(self, op: ClaimedOperation) -> None:
        """Drive one claimed operation to its end (or until ownership is lost / shutdown)."""
        handler = self.handlers.get(op.kind)
        if handler is None:  # not claimable: claim filters on our kinds
            return
        if op.taken_over_from:
            logger.warning("takeover op#%d %s %s from %s (fence %d): %s", op.id, op.kind,
                           op.target, op.taken_over_from, op.fence,
                           f"reference {op.external_ref}, only polling" if op.external_ref
                           else ("intent without reference" if op.issue_started
                                 else "not issued yet"))
        try:
            ref = op.external_ref
            if ref is None:
                ref = await self._issue(op, handler)
                if ref is None:
                    return
            await self._follow(op, handler, ref)
        except asyncio.CancelledError:
            logger.warning("op#%d abandoned at shutdown; its lease will lapse and another "
                           "executor resumes it", op.id)
            raise
        except Exception as exc:  # never take the executor down
            logger.error("op#%d: %s: %s; its lease will lapse and a new claim resumes it",
                         op.id, type(exc).__name__, exc)

    async def _issue(self, op: ClaimedOperation, handler: OperationHandler) -> str | None:
        """Record the intent, call out if the SQL says so, record the reference."""
        attempt = 0
        lease_s = self.lease.total_seconds()
        while True:
            decision = await self._sql(SQL_BEGIN_ISSUE,
                                       (op.id, op.fence, handler.idempotent, self.lease),
                                       self._deadline())
            if decision is None:
                logger.warning("stale    op#%d fence %d: not the owner any more; not calling "
                               "out", op.id, op.fence)
                return None
            if decision == "failed":
                row = await self._get(op.id)
                logger.error("failed   op#%d %s %s: %s", op.id, op.kind, op.target,
                             row.get("error"))
                self._done(op, "failed")
                return None
            if decision == "canceled":
                logger.info("canceled op#%d %s %s: a cancel was requested before any external "
                            "call; not calling out", op.id, op.kind, op.target)
                self._done(op, "canceled")
                return None
            if decision == "poll":
                ref = (await self._get(op.id)).get("external_ref")
                return str(ref) if ref else None
            if decision not in ("issue", "reissue"):
                logger.error("op#%d: unexpected answer %r from operation_begin_issue; not calling "
                             "out", op.id, decision)
                return None
            # issue / reissue
            started = time.monotonic()
            budget = max(lease_s - self.margin, 0.5)
            try:
                tracing = self.executor.tracing  # pgfence.tracing: a span per issue
                issued: Issued = await asyncio.wait_for(
                    handler.issue(op) if tracing is None
                    else tracing.step("issue", op, lambda: handler.issue(op)), budget)
            except PermanentError as exc:
                status = await self._sql(SQL_FINISH, (op.id, op.fence, False, None, str(exc)),
                                         started + lease_s)
                logger.error("%-8s op#%d %s %s: the API refused it: %s", status or "stale",
                             op.id, op.kind, op.target, exc)
                if status:
                    self._done(op, status)
                return None
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # outcome unknown: the SQL decides
                attempt += 1
                delay = min(lease_s / 4, 0.2 * 2 ** min(attempt, 6)) * (0.5 + random.random() / 2)
                logger.warning("issue of op#%d %s %s failed (%s: %s); the outcome is unknown, "
                               "asking again in %.1fs (%s)", op.id, op.kind, op.target,
                               type(exc).__name__, exc, delay,
                               "the key makes a repeat safe" if handler.idempotent
                               else "without a key this will fail it")
                await asyncio.sleep(delay)
                continue
            ok = await self._sql(SQL_RECORD_EXTERNAL,
                                 (op.id, op.fence, issued.ref,
                                  Jsonb(issued.detail) if issued.detail is not None else None),
                                 started + lease_s)
            if not ok:
                logger.error("stale    op#%d: issued as %s but the claim was taken over before "
                             "the reference was recorded; the new owner decides", op.id,
                             issued.ref)
                return None
            logger.info("%-8s op#%d %s %s -> %s (fence %d)", decision, op.id, op.kind,
                        op.target, issued.ref, op.fence)
            return issued.ref

    async def _follow(self, op: ClaimedOperation, handler: OperationHandler, ref: str) -> None:
        """Poll until the external side ends, then finish; stop on a lost fence or shutdown."""
        cancel_sent = False
        failures = 0
        while True:
            if self._stopping():
                released = await self._sql(SQL_RELEASE, (op.id, op.fence), self._deadline())
                logger.warning("shutdown: op#%d %s for another executor", op.id,
                               "released" if released else "already taken over")
                return
            state: ExternalState | None
            try:
                tracing = self.executor.tracing  # pgfence.tracing: a span per poll
                state = await asyncio.wait_for(
                    handler.poll(op, ref) if tracing is None
                    else tracing.step("poll", op, lambda: handler.poll(op, ref)),
                    max(self.lease.total_seconds() - handler.poll_interval - self.margin, 0.5))
                failures = 0
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # keep the lease, try again
                failures += 1
                state = None
                logger.warning("poll of op#%d (%s) failed %d time(s): %s: %s", op.id, ref,
                               failures, type(exc).__name__, exc)
            verdict = await self._sql(
                SQL_POLL, (op.id, op.fence, Jsonb(state.raw) if state else None, self.lease),
                self._deadline())
            if verdict is None:
                logger.warning("stale    op#%d fence %d: lease lost (lapsed or taken over); "
                               "stopping, the owner now polls %s", op.id, op.fence, ref)
                return
            if state is not None and state.terminal:
                try:
                    detail = await asyncio.wait_for(
                        handler.finish(op, ref, state),
                        max(self.lease.total_seconds() - self.margin, 0.5))
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # try again at the next poll
                    logger.warning("finish of op#%d (%s) failed: %s: %s; retrying", op.id, ref,
                                   type(exc).__name__, exc)
                else:
                    status = await self._sql(
                        SQL_FINISH, (op.id, op.fence, state.status == "succeeded",
                                     Jsonb(detail) if detail is not None else None, state.error),
                        self._deadline())
                    if status is None:
                        logger.warning("stale    op#%d: ended externally (%s) but the claim was "
                                       "taken over; the new owner records it", op.id,
                                       state.status)
                    else:
                        log = logger.info if status == "succeeded" else logger.warning
                        log("%-8s op#%d %s %s (%s, fence %d)", status, op.id, op.kind,
                            op.target, ref, op.fence, extra={
                                "event": "operation.finished", "unit_module": "operation",
                                "id": op.id, "kind": op.kind, "fence": op.fence,
                                "outcome": status})
                        self._done(op, status)
                    return
            if verdict == "cancel" and not cancel_sent:
                if handler.can_cancel:
                    try:
                        await handler.cancel(op, ref)
                        cancel_sent = True
                        logger.info("cancel   op#%d: asked the external API to cancel %s",
                                    op.id, ref)
                    except Exception as exc:  # ask again at the next poll
                        logger.warning("cancel of op#%d (%s) failed: %s", op.id, ref, exc)
                else:
                    cancel_sent = True
                    logger.warning("op#%d: cancel requested but the %s handler cannot cancel; "
                                   "following it to its end", op.id, op.kind)
            await self.executor.sleep_unless_stopping(handler.poll_interval)
