"""The executor's plan module: takes approved (or released) plans and runs them step by step.

It plugs into :class:`pgfence.executor.Executor` like the outbox module. Every decision is a
call to the plan SQL functions:

- **Wake-up**: LISTEN ``pgfence_plan`` (``plan_approve`` and ``plan_release`` NOTIFY at commit),
  plus the executor's timer sweep.
- **Take**: ``plan_claim`` (FOR UPDATE SKIP LOCKED), so of several executors exactly one runs a
  given plan. Each take comes with the run's fence token, passed to every owner call: a run
  taken again elsewhere (even under this executor's worker name) refuses this one from then on.
  In ``external_only`` mode it takes only runs that their owner released at an external step
  (e.g. ``CALL plan_execute`` from SQL), and hands SQL steps back.
- **SQL steps**: ``plan_run_step`` on a pooled autocommit connection: one transaction per step,
  the action running with the executor's database role, its receipt committed with its effect.
  A connection lost mid-call is safe to retry: the step either committed with its receipt or
  rolled back whole.
- **External steps**: performed through the outbox transports (a :class:`~pgfence.outbox.Claimed`
  is built for them: channel = the action name, recipient and payload from the step's args,
  idempotency key ``pgfence-plan-<id>-step-<n>`` on every delivery), at least once: retryable
  failures are retried with capped, jittered backoff (``pgfence.backoff``) up to
  ``max_deliveries``. While a step runs, the module stamps ``plan_heartbeat`` every third of the
  heartbeat interval; if the database refuses a heartbeat the run is lost and the module stops
  without recording. The outcome is recorded with ``plan_record_step``.
- **Reaper**: ``plan_reap`` on the executor's timer.
- **Shutdown**: SIGTERM makes a running plan stop after its current step and release the run,
  so another executor continues it instead of it being interrupted.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator, Mapping
from typing import Any

import psycopg
from psycopg.rows import class_row
from psycopg.types.json import Jsonb

from .. import plan as sql
from ..executor import Job, Module
from ..outbox import Claimed
from ..transports import PermanentError, RetryableError, Transport

logger = logging.getLogger(__name__)

SQL_BACKOFF = "SELECT pgfence.backoff(%s::int, %s::interval, %s::interval)"


class RunLost(Exception):
    """The database refused the run's heartbeat: another worker or the reaper owns the plan now."""


class PlanModule(Module):
    """Runs plans for the executor.

    Args:
        routes: external action name → transport (``"*"`` = every other action). An external
            step without a route gets an ``error`` receipt (no route), as in the outbox.
        external_only: take only released runs whose next step is external, and hand SQL
            steps back (an executor whose role may not run the SQL actions).
        heartbeat: the heartbeat interval for runs this executor takes (None = the plan's, 120 s
            at first).
        delivery_timeout: seconds one delivery attempt of an external step may take.
        max_deliveries: delivery attempts per external step before it is recorded as an error.
        backoff_base, backoff_cap: spacing of retried deliveries (seconds).
    """

    name = "plan"
    notify_channels = (sql.NOTIFY_CHANNEL,)
    functions = ("pgfence.plan_claim(text, integer, boolean, interval)",
                 "pgfence.plan_run_step(bigint, text, bigint, boolean)",
                 "pgfence.plan_record_step(bigint, integer, text, bigint, boolean, jsonb, text)",
                 "pgfence.plan_heartbeat(bigint, text, bigint)",
                 "pgfence.plan_release(bigint, text, bigint)",
                 "pgfence.plan_reap(integer)",
                 "pgfence.backoff(integer, interval, interval, double precision)")

    def __init__(self, routes: Mapping[str, Transport] | None = None, *,
                 external_only: bool = False, heartbeat: dt.timedelta | None = None,
                 delivery_timeout: float = 30.0, max_deliveries: int = 5,
                 backoff_base: float = 0.5, backoff_cap: float = 30.0) -> None:
        if max_deliveries < 1:
            raise ValueError("max_deliveries must be at least 1")
        self.routes = dict(routes or {})
        self.external_only = external_only
        self.heartbeat = heartbeat
        self.delivery_timeout = delivery_timeout
        self.max_deliveries = max_deliveries
        self.backoff_base = dt.timedelta(seconds=backoff_base)
        self.backoff_cap = dt.timedelta(seconds=max(backoff_cap, backoff_base))
        self.steps_run = 0  # observable: SQL steps this module ran (ok or error)

    async def aclose(self) -> None:
        for transport in {id(t): t for t in self.routes.values()}.values():
            with contextlib.suppress(Exception):
                await transport.aclose()

    def serves(self) -> list[str]:
        return ["external"] if self.external_only else ["*"]

    @property
    def _worker(self) -> str:
        return self.executor.worker_id

    def _stopping(self) -> bool:
        # Executor.stop() (SIGTERM): finish the current step, then hand the run over.
        return self.executor.stopping

    # -- Module interface ---------------------------------------------------------------------
    async def claim(self, slots: int) -> AsyncIterator[list[Job]]:
        batch = min(slots, self.executor.config.batch)
        while slots > 0:
            rows: list[sql.ClaimedPlan] = await self.executor.fetch(
                sql.SQL_CLAIM, (self._worker, min(batch, slots), self.external_only,
                                self.heartbeat),
                row_factory=class_row(sql.ClaimedPlan))
            if rows:
                self.executor.stats.inc("pgfence_claimed", ("plan", "*"), len(rows))
            if self.executor.tracing is None:
                yield [self._job(row) for row in rows]  # started before the next round
            else:  # pgfence.tracing: a span per run, with one per step
                yield await self.executor.tracing.plan_jobs(self, rows)
            slots -= len(rows)
            if len(rows) < batch:
                break

    async def reap(self) -> int:
        rows = await self.executor.fetch(sql.SQL_REAP, (1000,))
        return int(rows[0][0]) if rows else 0

    def _job(self, run: sql.ClaimedPlan) -> Job:
        async def job() -> None:
            await self.run_plan(run)
        return job

    # -- one run ------------------------------------------------------------------------------
    async def run_plan(self, run: sql.ClaimedPlan) -> None:
        """Run the plan's steps in order while this executor owns the run."""
        plan_id, interval, token = run.id, run.heartbeat_interval, run.run_token
        logger.info("plan#%d taken by %s at step %d/%d (heartbeat %.0fs, token %d)", plan_id,
                    self._worker, run.next_step, run.step_count, interval.total_seconds(), token)
        try:
            while True:
                if self._stopping():
                    await self._release(plan_id, token, "executor shutting down")
                    return
                started = time.monotonic()
                step: sql.StepResult = (await self.executor.fetch(
                    sql.SQL_RUN_STEP, (plan_id, self._worker, token, self.external_only),
                    row_factory=class_row(sql.StepResult),
                    # a SQL step may run long: bounded by the run's heartbeat, not query_timeout
                    timeout=interval.total_seconds(),
                    retry_until=time.monotonic() + interval.total_seconds()))[0]
                ms = (time.monotonic() - started) * 1000
                if step.outcome is None:
                    if step.status in ("executed", "failed"):
                        # The last step recorded ended the plan: nothing more to run.
                        logger.info("plan#%d %s", plan_id, step.status)
                    else:
                        self.executor.stats.inc("pgfence_lost_races", ("plan", "*"))
                        logger.warning("plan#%d: run no longer ours (status %s, another worker "
                                       "or the reaper took it); stopping", plan_id, step.status)
                    return
                if step.outcome == "released":
                    logger.info("plan#%d step %d (%s) is a SQL step: released to a SQL runner",
                                plan_id, step.step_index, step.action)
                    return
                if step.outcome == "external":
                    if not await self._external(plan_id, token, step, interval):
                        return
                else:
                    if self.executor.tracing is not None:  # pgfence.tracing: the step's span
                        self.executor.tracing.plan_step(plan_id, token, step, started,
                                                        step.outcome == "ok",
                                                        (step.error or {}).get("message"))
                    self.steps_run += 1
                    self.executor.stats.observe("pgfence_delivery_duration_seconds",
                                                ("plan", "*"), ms / 1000)
                    self.executor.stats.inc("pgfence_delivered" if step.outcome == "ok"
                                            else "pgfence_failed",
                                            ("plan", "*") if step.outcome == "ok"
                                            else ("plan", "*", "permanent"))
                    fields = {"unit_module": "plan", "id": plan_id, "step": step.step_index,
                              "kind": step.action, "fence": token, "duration_ms": round(ms, 1)}
                    if step.outcome == "ok":
                        logger.info("plan#%d step %d/%d %s ok (%.0f ms)", plan_id, step.step_index,
                                    run.step_count, step.action, ms,
                                    extra={**fields, "event": "plan.step", "outcome": "ok"})
                    else:
                        err = step.error or {}
                        logger.warning("plan#%d step %d/%d %s error %s: %s; plan failed", plan_id,
                                       step.step_index, run.step_count, step.action,
                                       err.get("sqlstate"), err.get("message"),
                                       extra={**fields, "event": "plan.step", "outcome": "error",
                                              "error": err.get("message")})
                if step.status != "executing":
                    logger.info("plan#%d %s", plan_id, step.status)
                    return
                # A recorded external step may have ended the plan; plan_run_step says so next.
        except asyncio.CancelledError:
            logger.warning("plan#%d abandoned at shutdown; the run fails as interrupted when its "
                           "heartbeat lapses unless someone takes it over", plan_id)
            raise
        except RunLost as exc:
            self.executor.stats.inc("pgfence_lost_races", ("plan", "*"))
            logger.warning("plan#%d: %s", plan_id, exc)
        except Exception as exc:
            logger.error("plan#%d: stopping after %s: %s; the run is left to its heartbeat",
                         plan_id, type(exc).__name__, exc)

    async def _release(self, plan_id: int, token: int, why: str) -> None:
        rows = await self.executor.fetch(sql.SQL_RELEASE, (plan_id, self._worker, token))
        if rows and rows[0][0]:
            logger.warning("plan#%d released (%s): another worker may continue it", plan_id, why)

    # -- external steps -----------------------------------------------------------------------
    async def _external(self, plan_id: int, token: int, step: sql.StepResult,
                        interval: dt.timedelta) -> bool:
        """Perform one external step and record it; False if the run was lost meanwhile."""
        assert step.step_index is not None and step.action is not None and step.args is not None
        began = time.monotonic()
        lost = asyncio.Event()
        beat = asyncio.create_task(self._heartbeat_loop(plan_id, token, interval, lost),
                                   name=f"pgfence-plan-{plan_id}-heartbeat")
        try:
            ok, output, error = await self._deliver(plan_id, step, interval, lost)
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)
        if lost.is_set():
            raise RunLost(f"lost the run during external step {step.step_index} ({step.action}); "
                          "its outcome is unknown to pgfence (at least once)")
        rows = await self.executor.fetch(
            sql.SQL_RECORD_STEP,
            (plan_id, step.step_index, self._worker, token, ok,
             Jsonb(output) if output is not None else None, error),
            retry_until=time.monotonic() + interval.total_seconds())
        if not (rows and rows[0][0]):
            raise RunLost(f"external step {step.step_index} ({step.action}) done, but the "
                          "database refused the report: the run is no longer ours")
        self.executor.stats.inc("pgfence_delivered" if ok else "pgfence_failed",
                                ("plan", "*") if ok else ("plan", "*", "permanent"))
        if self.executor.tracing is not None:  # pgfence.tracing: the step's span
            self.executor.tracing.plan_step(plan_id, token, step, began, ok, error)
        fields = {"event": "plan.external_step", "unit_module": "plan", "id": plan_id,
                  "step": step.step_index, "kind": step.action, "fence": token}
        if ok:
            logger.info("plan#%d step %d %s delivered (key %s)", plan_id, step.step_index,
                        step.action, step.idempotency_key, extra={**fields, "outcome": "ok"})
        else:
            logger.warning("plan#%d step %d %s failed: %s; plan failed", plan_id, step.step_index,
                           step.action, error, extra={**fields, "outcome": "error",
                                                      "error": error})
        return True

    async def _deliver(self, plan_id: int, step: sql.StepResult, interval: dt.timedelta,
                       lost: asyncio.Event) -> tuple[bool, Any, str | None]:
        """Deliver through the routed transport, retrying retryable failures; (ok, output, error)."""
        assert step.action is not None and step.args is not None and step.step_index is not None
        transport = self.routes.get(step.action) or self.routes.get("*")
        if transport is None:
            return False, None, f"no route for external action {step.action!r}"
        error = "not attempted"
        for attempt in range(1, self.max_deliveries + 1):
            now = dt.datetime.now(dt.UTC)
            message = Claimed(
                id=plan_id, channel=step.action, recipient=str(step.args["recipient"]),
                payload=dict(step.args.get("payload") or {}),
                idempotency_key=step.idempotency_key, attempt=attempt,
                max_attempts=self.max_deliveries, lease=interval,
                lease_expires_at=now + interval, created_at=now)
            retry_after: dt.timedelta | None = None
            try:
                receipt = await self._until_lost(
                    asyncio.wait_for(transport.deliver(message), self.delivery_timeout), lost)
                return True, receipt, None
            except RunLost:
                return False, None, "run lost"
            except RetryableError as exc:
                error, retry_after = str(exc), await self.executor.retry_wait(exc)
            except PermanentError as exc:
                return False, None, str(exc)
            except TimeoutError:
                error = f"delivery timed out after {self.delivery_timeout:.1f}s"
            except Exception as exc:  # unknown errors are retryable, as in the outbox
                error = f"{type(exc).__name__}: {exc}"
            if attempt == self.max_deliveries:
                break
            rows = await self.executor.fetch(SQL_BACKOFF, (attempt, self.backoff_base,
                                                           self.backoff_cap))
            wait: dt.timedelta = rows[0][0]
            if retry_after is not None:
                wait = min(max(wait, retry_after), self.backoff_cap)
            logger.info("plan#%d step %d %s delivery %d/%d failed (%s); retry in %.2fs with the "
                        "same idempotency key", plan_id, step.step_index, step.action, attempt,
                        self.max_deliveries, error, wait.total_seconds())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(lost.wait(), wait.total_seconds())
            if lost.is_set():
                return False, None, "run lost"
        return False, None, f"{error} (after {self.max_deliveries} deliveries)"

    @staticmethod
    async def _until_lost(coro: Any, lost: asyncio.Event) -> Any:
        """Await ``coro`` unless ``lost`` is set first (then cancel it and raise RunLost)."""
        work = asyncio.ensure_future(coro)
        watch = asyncio.ensure_future(lost.wait())
        try:
            await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watch.cancel()
        if not work.done():
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            raise RunLost("run lost")
        return work.result()

    async def _heartbeat_loop(self, plan_id: int, token: int, interval: dt.timedelta,
                              lost: asyncio.Event) -> None:
        """Stamp the run's heartbeat every third of its interval until cancelled."""
        period = max(interval.total_seconds() / 3, 0.2)
        deadline = time.monotonic() + interval.total_seconds()
        while True:
            await asyncio.sleep(period)
            try:
                rows = await self.executor.fetch(sql.SQL_HEARTBEAT, (plan_id, self._worker, token),
                                                 retry_until=deadline)
            except psycopg.OperationalError as exc:
                logger.warning("plan#%d: heartbeat impossible until the deadline (%s)", plan_id, exc)
                lost.set()
                return
            if not (rows and rows[0][0]):
                logger.warning("plan#%d: heartbeat refused: the run is no longer ours", plan_id)
                lost.set()
                return
            deadline = time.monotonic() + interval.total_seconds()
