"""Typed wrappers around the plan SQL functions (Module 2: approved plans).

A plan is a frozen list of steps that someone proposes (a script, an AI agent), a person
approves, and a worker executes in order, with a receipt per step written in the same
transaction as the step's effect. Everything that decides — who owns a run, whether a step may
run, what a failure means, when a run counts as interrupted — is in SQL
(``functions/2*_plan_*.sql``); each function here is one ``SELECT pgfence.plan_*(%s::type, …)``
on a connection the caller owns, with SQLSTATEs translated (:mod:`pgfence.errors`).

Steps are numbered from 1. A step is ``{"action": name, "args": {...}, "note": "..."}``; the
action must be on the allow-list (:func:`register_action`). SQL actions run inside
``plan_run_step`` with the privileges of the role of the connection that runs them; external
actions (``args = {"recipient": ..., "payload": {...}}``) are performed by the executor
(:mod:`pgfence.plan.module`) and reported with :func:`record_step`.

Durations are ``timedelta`` (PostgreSQL ``interval``); times are aware ``datetime`` from the
database clock.
"""

from __future__ import annotations

import datetime as dt
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg.rows import class_row, tuple_row
from psycopg.types.json import Jsonb

from .._calls import rows, scalar

# The errors of this module (functions/ERRORS.md, PF1xx), defined with every SQLSTATE in
# pgfence.errors and importable from here as before.
from ..errors import ActionChanged as ActionChanged
from ..errors import ActionConflict as ActionConflict
from ..errors import NotCompensable as NotCompensable
from ..errors import NotExternalStep as NotExternalStep
from ..errors import SelfApproval as SelfApproval
from ..errors import StepNotBegun as StepNotBegun
from ..errors import StepOutOfOrder as StepOutOfOrder
from ..errors import UnknownAction as UnknownAction
from ..errors import translated
from ..tracing import carried

logger = logging.getLogger(__name__)

SQL_REGISTER_ACTION = "SELECT pgfence.plan_register_action(%s::text, %s::regprocedure, %s::text)"
SQL_RETIRE_ACTION = "SELECT pgfence.plan_retire_action(%s::text)"
SQL_ACTIONS = "SELECT * FROM pgfence.plan_actions ORDER BY name"
SQL_PROPOSE = (
    "SELECT pgfence.plan_propose(%s::jsonb, %s::text, %s::interval, %s::text, %s::bigint)"
)
SQL_COMPENSATE = (
    "SELECT pgfence.plan_compensate(%s::bigint, %s::jsonb, %s::text, %s::interval, %s::text)"
)
SQL_APPROVE = "SELECT pgfence.plan_approve(%s::bigint, %s::text)"
SQL_REJECT = "SELECT pgfence.plan_reject(%s::bigint, %s::text, %s::text)"
SQL_START = "SELECT pgfence.plan_start(%s::bigint, %s::text, %s::interval)"
SQL_CLAIM = "SELECT * FROM pgfence.plan_claim(%s::text, %s::int, %s::boolean, %s::interval)"
SQL_RELEASE = "SELECT pgfence.plan_release(%s::bigint, %s::text, %s::bigint)"
SQL_HEARTBEAT = "SELECT pgfence.plan_heartbeat(%s::bigint, %s::text, %s::bigint)"
SQL_RUN_STEP = "SELECT * FROM pgfence.plan_run_step(%s::bigint, %s::text, %s::bigint, %s::boolean)"
SQL_RECORD_STEP = (
    "SELECT pgfence.plan_record_step(%s::bigint, %s::int, %s::text, %s::bigint, %s::boolean,"
    " %s::jsonb, %s::text)"
)
SQL_EXECUTE = "CALL pgfence.plan_execute(%s::bigint, %s::text, %s::interval)"
SQL_GET = "SELECT * FROM pgfence.plan_get(%s::bigint)"
SQL_STEPS = "SELECT * FROM pgfence.plan_steps(%s::bigint)"
SQL_LIST = "SELECT * FROM pgfence.plan_list(%s::text, %s::int)"
SQL_RECEIPTS = "SELECT * FROM pgfence.plan_receipts WHERE plan_id = %s::bigint ORDER BY step_index"
SQL_REAP = "SELECT pgfence.plan_reap(%s::int)"

#: LISTEN channel: NOTIFY ``{"id", "status"[, "next"]}`` when a plan is proposed, approved, or
#: released by its owner for another worker (``next`` = kind of the step that waits).
NOTIFY_CHANNEL = "pgfence_plan"

#: Heartbeat interval a run gets unless ``start``/``claim`` say otherwise (``plan_start``).
DEFAULT_HEARTBEAT = dt.timedelta(seconds=120)


# -- result shapes --------------------------------------------------------------------------------
@dataclass(frozen=True)
class StepResult:
    """What ``pgfence.plan_run_step`` reports for one call.

    ``outcome``: ``ok`` (the SQL step committed with its receipt), ``error`` (its effects were
    rolled back, an error receipt committed, the plan failed), ``external`` (nothing ran: the
    caller must perform the external step — ``args``, ``idempotency_key`` — and report it with
    :func:`record_step`), ``released`` (an external-only runner reached a SQL step and handed
    the run over), or None: refused — the caller does not own a live run (lost race, heartbeat
    lapsed, terminal plan) and nothing ran. ``status`` is the plan's status afterwards.
    """

    step_index: int | None
    action: str | None
    outcome: str | None
    status: str
    output: Any
    error: dict[str, Any] | None
    args: dict[str, Any] | None
    idempotency_key: str | None


@dataclass(frozen=True)
class ClaimedPlan:
    """One run taken by :func:`claim`: the plan, where it stands, its heartbeat interval, and
    ``run_token``, the fence token every owner call of this run must pass."""

    id: int
    next_step: int
    step_count: int
    next_kind: str
    heartbeat_interval: dt.timedelta
    run_token: int


@dataclass(frozen=True)
class ExecuteResult:
    """What ``CALL pgfence.plan_execute`` returns: the plan's status and every receipt so far."""

    status: str
    receipts: list[dict[str, Any]]


AnyConn = psycopg.Connection[Any]


# -- allow-list -----------------------------------------------------------------------------------
def register_action(conn: AnyConn, name: str, function: str | None, description: str) -> bool:
    """Put an action on the allow-list (administrators, role ``pgfence_admin``).

    Args:
        name: action name, ``[a-z0-9][a-z0-9_.-]{0,62}``; for an external action it is also the
            executor's route (channel) for the transport.
        function: ``'schema.fn(jsonb)'`` — a function ``(args jsonb) RETURNS jsonb`` — for a SQL
            action; None for an external action.
        description: what the action does (approvers read it), 1-2000 characters.

    Returns:
        True if the name is new; False if it existed (description updated, un-retired).

    Raises:
        InvalidArgument (22004/22023: bad name, description or signature), ActionConflict
        (PF102), psycopg.errors.UndefinedFunction (42883: no such function).
    """
    return bool(scalar(conn, SQL_REGISTER_ACTION, (name, function, description)))


def retire_action(conn: AnyConn, name: str) -> bool:
    """Take an action off the allow-list; False if already retired. Raises NotFound (P0002)."""
    return bool(scalar(conn, SQL_RETIRE_ACTION, (name,)))


def actions(conn: AnyConn) -> list[dict[str, Any]]:
    """The allow-list (view ``pgfence.plan_actions``): name, kind, function, description, ..."""
    return rows(conn, SQL_ACTIONS, ())


# -- propose / decide -----------------------------------------------------------------------------
def propose(conn: AnyConn, steps: Sequence[dict[str, Any]], proposed_by: str, *,
            ttl: dt.timedelta = dt.timedelta(days=1), idempotency_key: str | None = None,
            compensates: int | None = None) -> int:
    """Propose a plan; return its id (a repeated ``idempotency_key`` returns the existing one).

    Args:
        steps: ``[{"action": ..., "args": {...}, "note": "..."}, ...]``, 1-10000 steps.
        proposed_by: who proposes (a person, a script, an agent), ≤ 200 characters.
        ttl: how long it may wait for approval (> 0, ≤ 366 days).
        idempotency_key: ≤ 255 characters.
        compensates: id of the executed/failed plan this one undoes (see :func:`compensate`).

    The connection's login (``session_user``) is recorded as the proposing login: it cannot
    approve the plan (:func:`approve`). Each SQL step records the md5 of its function's
    definition: if the function is replaced before the step runs, the step's receipt is an error
    ``PF108`` instead.

    Raises:
        InvalidArgument (22004/22023), UnknownAction (PF101), NotFound (P0002),
        NotCompensable (PF106), IdempotencyKeyReused (PF003), SerializationFailure (40001),
        psycopg.errors.UndefinedFunction (42883: a SQL action whose function was dropped).

    With the OpenTelemetry API installed (``pgfence[otel]``), the current span's trace context
    is stored with the plan: the executor's run and step spans are its children.
    """
    with carried(conn):
        return int(scalar(conn, SQL_PROPOSE, (Jsonb(list(steps)), proposed_by, ttl,
                                               idempotency_key, compensates)))


def compensate(conn: AnyConn, plan_id: int, steps: Sequence[dict[str, Any]], by: str, *,
               ttl: dt.timedelta = dt.timedelta(days=1),
               idempotency_key: str | None = None) -> int:
    """Propose a compensating plan for ``plan_id`` (executed or failed); it needs its own approval.

    Returns the new plan's id. Raises as :func:`propose`; carries the trace context likewise.
    """
    with carried(conn):
        return int(scalar(conn, SQL_COMPENSATE, (plan_id, Jsonb(list(steps)), by, ttl,
                                                  idempotency_key)))


def approve(conn: AnyConn, plan_id: int, by: str) -> str | None:
    """Approve a pending plan: ``'approved'``, ``'expired'`` (past its expiry: it can never run),
    or None (no longer pending: a lost race, nothing changed).

    Four eyes: ``by`` must differ from the proposer's name, and the connection's login from the
    proposing login (unless it is a superuser).

    Raises:
        SelfApproval (PF103), NotFound (P0002), InvalidArgument.
    """
    status = scalar(conn, SQL_APPROVE, (plan_id, by))
    return None if status is None else str(status)


def reject(conn: AnyConn, plan_id: int, by: str, reason: str) -> bool:
    """Reject a pending plan; False if it was no longer pending or had expired (then expired).

    Raises NotFound (P0002), InvalidArgument (missing/too long reason).
    """
    return bool(scalar(conn, SQL_REJECT, (plan_id, by, reason)))


# -- runs -----------------------------------------------------------------------------------------
def start(conn: AnyConn, plan_id: int, worker: str,
          heartbeat: dt.timedelta | None = None) -> int | None:
    """Take the run of an approved (or released) plan; return its new run token, or None.

    The token (an int that grows with every take) fences the run: pass it to :func:`run_step`,
    :func:`record_step`, :func:`heartbeat` and :func:`release`. Taking a live run again under
    the owner's own name is allowed (a restarted worker resuming its plans): it issues a new
    token, fences out whoever holds the old one and writes a ``reenter`` event.

    ``heartbeat`` (1 s .. 1 day): the longest silence before the run counts as interrupted;
    None = the plan's interval (120 s at first). None is a lost race, not an error.

    Raises:
        InvalidArgument (22004/22023: worker, heartbeat), NotFound (P0002).
    """
    token = scalar(conn, SQL_START, (plan_id, worker, heartbeat))
    return None if token is None else int(token)


def claim(conn: AnyConn, worker: str, batch: int = 1, *, external_only: bool = False,
          heartbeat: dt.timedelta | None = None) -> list[ClaimedPlan]:
    """Take up to ``batch`` runs (approved or released plans) with SKIP LOCKED, oldest first.

    ``external_only``: only released runs whose next step is external. Each
    :class:`ClaimedPlan` carries the run token for the owner calls.
    """
    with translated(), conn.cursor(row_factory=class_row(ClaimedPlan)) as cur:
        cur.execute(SQL_CLAIM, (worker, batch, external_only, heartbeat))
        return cur.fetchall()


def release(conn: AnyConn, plan_id: int, worker: str, token: int) -> bool:
    """Hand the run over between two steps (another worker must take it within a heartbeat).

    False = ``worker`` does not own a live run under ``token`` (nothing changed).
    """
    return bool(scalar(conn, SQL_RELEASE, (plan_id, worker, token)))


def heartbeat(conn: AnyConn, plan_id: int, worker: str, token: int) -> bool:
    """Extend the run's deadline; False = ``worker`` lost the run (or a newer take holds it
    under a newer token) and must stop."""
    return bool(scalar(conn, SQL_HEARTBEAT, (plan_id, worker, token)))


def run_step(conn: AnyConn, plan_id: int, worker: str, token: int, *,
             external_only: bool = False) -> StepResult:
    """Run the next step of a run ``worker`` owns under ``token``, in ``conn``'s transaction.

    See :class:`StepResult`; outcome None = refused (lost race, stale worker or token). On an
    autocommit connection the step, its effect and its receipt are one transaction. The SQL
    action runs with the privileges of ``conn``'s role.

    Raises:
        InvalidArgument (22004/22023: worker, token), NotFound (P0002).
    """
    with translated(), conn.cursor(row_factory=class_row(StepResult)) as cur:
        cur.execute(SQL_RUN_STEP, (plan_id, worker, token, external_only))
        row = cur.fetchone()
    assert row is not None
    return row


def record_step(conn: AnyConn, plan_id: int, step_index: int, worker: str, token: int,
                ok: bool, *, output: Any = None, error: str | None = None) -> bool:
    """Record an external step's outcome as owner ``worker`` under ``token``; False = refused
    (stale worker or token, step already recorded).

    Raises:
        StepOutOfOrder (PF104), NotExternalStep (PF105), InvalidArgument, NotFound.
    """
    return bool(scalar(conn, SQL_RECORD_STEP,
                        (plan_id, step_index, worker, token, ok,
                         Jsonb(output) if output is not None else None, error)))


def execute(conn: AnyConn, plan_id: int, worker: str,
            heartbeat: dt.timedelta | None = None) -> ExecuteResult:
    """``CALL pgfence.plan_execute``: run the plan's SQL steps, one committed transaction each.

    Stops at an error, at the end, when the run is lost, or at an external step (released to an
    executor). A terminal plan runs nothing and answers from its receipts. ``conn`` must be in
    autocommit mode (the procedure commits).

    Raises:
        ValueError: ``conn`` is not in autocommit mode.
    """
    if not conn.autocommit:
        raise ValueError("plan execute commits after every step: use an autocommit connection")
    with translated(), conn.cursor(row_factory=tuple_row) as cur:
        cur.execute(SQL_EXECUTE, (plan_id, worker, heartbeat))
        row = cur.fetchone()
    assert row is not None
    return ExecuteResult(status=str(row[0]), receipts=list(row[1] or []))


# -- read -----------------------------------------------------------------------------------------
def get(conn: AnyConn, plan_id: int) -> dict[str, Any]:
    """One plan (``pgfence.plan_get``; heals a lapsed run first). Raises NotFound (P0002)."""
    found = rows(conn, SQL_GET, (plan_id,))
    assert found
    return found[0]


def steps(conn: AnyConn, plan_id: int) -> list[dict[str, Any]]:
    """Every step with its receipt and state (ok, error, next, running, waiting, unknown, not_run)."""
    return rows(conn, SQL_STEPS, (plan_id,))


def receipts(conn: AnyConn, plan_id: int) -> list[dict[str, Any]]:
    """The committed receipts of one plan, by step."""
    return rows(conn, SQL_RECEIPTS, (plan_id,))


def list_plans(conn: AnyConn, status: str | None = None, limit: int = 100) -> list[dict[str, Any]]:
    """Newest plans first, optionally of one status (no steps)."""
    return rows(conn, SQL_LIST, (status, limit))


def reap_stale(conn: AnyConn, max_rows: int = 1000) -> int:
    """Run the plan reaper once: lapsed runs -> failed (interrupted), old proposals -> expired."""
    return int(scalar(conn, SQL_REAP, (max_rows,)) or 0)
