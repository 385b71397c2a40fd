"""SQLSTATE → exception mapping, in one place: every code, every exception class.

pgfence's SQL functions raise documented SQLSTATEs (``functions/ERRORS.md``). The glue turns a
:class:`psycopg.Error` into one of the classes below with :func:`translate`; callers catch
those and never parse message text. A lost race is not an error: the SQL returns false/NULL.

:data:`SQLSTATES` is the one table: each code with its name, the exception :func:`translate`
raises for it, and the documents API's HTTP answer (:data:`pgfence.web.HTTP_BY_SQLSTATE` is
read from it, and so is :data:`TRANSIENT_SQLSTATES`, what a client retries as is). It is
complete at import of this module: no module has to be imported first for its codes to be
known. The module glue re-exports its classes where they always were (``pgfence.plan``,
``pgfence.operation``, ``pgfence.documents``, ``pgfence.audit``).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType, TracebackType
from typing import Any

import psycopg


class PgfenceError(Exception):
    """Base class. ``sqlstate`` is the server's code, ``detail``/``hint`` its DETAIL and HINT."""

    def __init__(self, message: str, *, sqlstate: str | None = None,
                 detail: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate
        self.detail = detail
        self.hint = hint


# -- every module (functions/ERRORS.md) -----------------------------------------------------------
class InvalidArgument(PgfenceError):
    """22023 invalid_parameter_value or 22004 null_value_not_allowed: fix the call."""


class NotFound(PgfenceError):
    """P0002 no_data_found: no item with that id."""


class IllegalTransition(PgfenceError):
    """PF001: a status change the module's state machine does not allow."""


class Immutable(PgfenceError):
    """PF002: an attempt to change data that is frozen once written."""


class IdempotencyKeyReused(PgfenceError):
    """PF003: the idempotency key already names a different item."""


class PayloadTooLarge(PgfenceError):
    """PF004: an outbox payload is over its channel's ``max_payload_bytes``."""


class TruncateRefused(PgfenceError):
    """PF005: TRUNCATE of a table whose rows only a purge deletes."""


class SerializationFailure(PgfenceError):
    """40001: retry the whole transaction."""


class PermissionDenied(PgfenceError):
    """42501 insufficient_privilege: the role may not do this (e.g. ``pg_monitor`` purging).
    Also exported as ``pgfence.audit.PermissionDenied``."""


# -- raised by the glue itself, no SQLSTATE of their own -------------------------------------------
class SchemaMismatch(PgfenceError):
    """The database's ``pgfence.schema_version()`` is not the one this glue was written for."""


class MissingPrivilege(PgfenceError):
    """42501, found before the first call: the login may not execute functions it will need
    (e.g. an executor without ``pgfence_executor``); ``hint`` is the GRANT to run."""


# -- plan (PF1xx; exported by pgfence.plan) --------------------------------------------------------
class UnknownAction(PgfenceError):
    """PF101: a step names an action that is not on the allow-list (or was retired)."""


class ActionConflict(PgfenceError):
    """PF102: the action name is registered to another kind or another function."""


class SelfApproval(PgfenceError):
    """PF103: the approver is the proposer (by name, or by database login unless that login is a
    superuser); someone else must approve, from their own login."""


class StepOutOfOrder(PgfenceError):
    """PF104: ``record_step`` for a step after the plan's next step."""


class NotExternalStep(PgfenceError):
    """PF105: ``record_step`` for a SQL step (those are run by ``plan_run_step``)."""


class NotCompensable(PgfenceError):
    """PF106: only an executed or failed plan can be compensated."""


class StepNotBegun(PgfenceError):
    """PF107: a receipt for a SQL step that was not begun in the same transaction (only
    ``plan_run_step`` writes SQL receipts)."""


class ActionChanged(PgfenceError):
    """PF108: the function of a step's action was replaced since the plan was proposed. Usually
    seen as the SQLSTATE of an ``error`` receipt (the step did not run); raised only for an ok
    receipt written past ``plan_run_step``."""


# -- operation (PF2xx; exported by pgfence.operation) ----------------------------------------------
class TargetBusy(PgfenceError):
    """PF201: another operation is queued or running for this ``(kind, target)``.

    ``in_flight_id`` is that operation's id (read from the documented DETAIL, which starts with
    ``Operation <id>``).
    """

    @property
    def in_flight_id(self) -> int | None:
        """Id of the operation in flight, or None if the DETAIL is missing."""
        match = re.match(r"Operation (\d+) ", self.detail or "")
        return int(match.group(1)) if match else None


class NotIssued(PgfenceError):
    """PF202: an owner skipped a step of the issue protocol (intent -> reference -> poll)."""


# -- document (PF3xx; exported by pgfence.documents) -----------------------------------------------
class ContentTooLarge(PgfenceError):
    """PF301: the content's JSON text is larger than its kind's ``max_bytes``."""


class UnknownKind(PgfenceError):
    """PF302: the kind is not registered (see ``pgfence.document_kinds``)."""


class VersionUnknown(PgfenceError):
    """PF303: ``expected_version`` is newer than any version the document ever had."""


class MergeInvalid(PgfenceError):
    """PF304: an application kind's merge function returned a malformed result."""


# -- the table -------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SqlState:
    """One row of :data:`SQLSTATES`.

    ``name`` is the condition name (PostgreSQL's, or ours from ``functions/ERRORS.md``);
    ``error`` the class :func:`translate` raises, None = the :class:`psycopg.Error` itself is
    raised (its own subclass, e.g. ``psycopg.errors.UndefinedFunction``); ``http`` the documents
    API's answer ``(status, error name)``, None = ``500 internal_error``.
    """

    code: str
    name: str
    error: type[PgfenceError] | None
    http: tuple[int, str] | None = None

    @property
    def transient(self) -> bool:
        """Whether a call that failed with this code may be sent again as is (the server asked
        for a retry or is unavailable); the documents API answers these 503."""
        return self.http is not None and self.http[0] == 503


_UNAVAILABLE = (503, "database_unavailable")
_RETRY = (503, "retry")
_INVALID = (422, "invalid_argument")

#: Every SQLSTATE pgfence knows: the codes of ``functions/ERRORS.md`` first (in its order), then
#: PostgreSQL's own codes that any statement may raise and that a client handles by kind.
SQLSTATES: Mapping[str, SqlState] = MappingProxyType({row.code: row for row in (
    # functions/ERRORS.md
    SqlState("22004", "null_value_not_allowed", InvalidArgument, _INVALID),
    SqlState("22023", "invalid_parameter_value", InvalidArgument, _INVALID),
    SqlState("P0002", "no_data_found", NotFound, (404, "not_found")),
    SqlState("40001", "serialization_failure", SerializationFailure, _RETRY),
    SqlState("23514", "check_violation", None),            # a hand-written write breaks a row check
    SqlState("PF001", "illegal_transition", IllegalTransition, (409, "illegal_transition")),
    SqlState("PF002", "immutable", Immutable, (409, "immutable")),
    SqlState("PF003", "idempotency_key_reused", IdempotencyKeyReused,
             (422, "idempotency_key_reused")),     # same key, other content or base version
    SqlState("PF004", "payload_too_large", PayloadTooLarge),
    SqlState("PF005", "truncate_refused", TruncateRefused),
    SqlState("PF101", "unknown_action", UnknownAction),
    SqlState("PF102", "action_conflict", ActionConflict),
    SqlState("PF103", "self_approval", SelfApproval),
    SqlState("PF104", "step_out_of_order", StepOutOfOrder),
    SqlState("PF105", "not_external_step", NotExternalStep),
    SqlState("PF106", "not_compensable", NotCompensable),
    SqlState("PF107", "step_not_begun", StepNotBegun),
    SqlState("PF108", "action_changed", ActionChanged),
    SqlState("2D000", "invalid_transaction_termination", None),   # CALL inside a transaction
    SqlState("PF201", "operation_target_busy", TargetBusy),
    SqlState("PF202", "operation_not_issued", NotIssued),
    SqlState("PF301", "document_content_too_large", ContentTooLarge, (413, "content_too_large")),
    SqlState("PF302", "document_kind_unknown", UnknownKind, (422, "unknown_kind")),
    SqlState("PF303", "document_version_unknown", VersionUnknown, (422, "version_unknown")),
    SqlState("PF304", "document_merge_invalid", MergeInvalid, (500, "merge_invalid")),
    SqlState("42883", "undefined_function", None),         # a function dropped since registered
    SqlState("42501", "insufficient_privilege", PermissionDenied,
             (500, "insufficient_privilege")),     # for the API: its own login lacks a grant
    # PostgreSQL's own, about the input: jsonb refuses a lone surrogate or \u0000, a number
    # out of a column's range
    SqlState("22P02", "invalid_text_representation", None, _INVALID),
    SqlState("22P05", "untranslatable_character", None, _INVALID),
    SqlState("22003", "numeric_value_out_of_range", None, _INVALID),
    # PostgreSQL's own, about the moment: send the same call again
    SqlState("40P01", "deadlock_detected", None, _RETRY),
    SqlState("55P03", "lock_not_available", None, _RETRY),
    SqlState("57014", "query_canceled", None, _RETRY),           # statement timeout / cancel
    SqlState("57P01", "admin_shutdown", None, _UNAVAILABLE),
    SqlState("57P02", "crash_shutdown", None, _UNAVAILABLE),
    SqlState("57P03", "cannot_connect_now", None, _UNAVAILABLE),
    SqlState("53300", "too_many_connections", None, _UNAVAILABLE),
)})

#: SQLSTATEs a call may be retried on as is (the documents API answers each of them 503).
TRANSIENT_SQLSTATES: frozenset[str] = frozenset(c for c, row in SQLSTATES.items() if row.transient)

_BY_SQLSTATE: dict[str, type[PgfenceError]] = {
    code: row.error for code, row in SQLSTATES.items() if row.error is not None}


def register(sqlstate: str, cls: type[PgfenceError]) -> None:
    """Map one more SQLSTATE (an application's own code) to ``cls`` for :func:`translate`.

    Every pgfence code is in :data:`SQLSTATES` already; registering one of them replaces its
    class for this process.
    """
    _BY_SQLSTATE[sqlstate] = cls


def translate(exc: psycopg.Error) -> PgfenceError | psycopg.Error:
    """Return the pgfence exception for ``exc``'s SQLSTATE, or ``exc`` itself if unknown."""
    state = exc.sqlstate
    cls = _BY_SQLSTATE.get(state or "")
    if cls is None:
        return exc
    diag: Any = exc.diag
    err = cls(diag.message_primary or str(exc), sqlstate=state,
              detail=diag.message_detail, hint=diag.message_hint)
    err.__cause__ = exc
    return err


class _Translated:
    """The context manager of :func:`translated`, for ``with`` and ``async with`` alike."""

    __slots__ = ()

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if isinstance(exc, psycopg.Error):
            raise translate(exc) from exc

    async def __aenter__(self) -> None:
        return None

    async def __aexit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        self.__exit__(kind, exc, tb)


def translated() -> _Translated:
    """A context manager (``with`` or ``async with``) that raises :func:`translate` of any
    :class:`psycopg.Error` raised inside it, chained to the original; nothing else changes."""
    return _Translated()
