"""Operation handlers: how the executor talks to the external API of one operation kind.

A handler does three things for a claimed operation (:class:`pgfence.operation.ClaimedOperation`):

- :meth:`OperationHandler.issue` starts the external operation and returns its reference
  (:class:`Issued`). It is called only after ``operation_begin_issue`` said ``issue`` or
  ``reissue``; if the handler's API accepts an idempotency key it must pass
  ``op.idempotency_key`` and set :attr:`OperationHandler.idempotent` — that declaration is what
  allows a new owner to re-issue after a crash between the call and the recording of its
  reference. A handler that cannot pass a key declares ``idempotent = False``; such an
  operation then fails as "outcome unknown" instead of risking a second start.
- :meth:`OperationHandler.poll` asks the external API for the operation's state
  (:class:`ExternalState`), every :attr:`OperationHandler.poll_interval` seconds.
- :meth:`OperationHandler.finish` turns a terminal state into the result stored on the row (it
  may fetch more from the API); :meth:`OperationHandler.cancel` asks the API to cancel.

Errors: :class:`pgfence.transports.PermanentError` from ``issue`` means the API refused the
operation (nothing started): the operation fails. Any other exception from ``issue`` leaves the
outcome unknown: the executor asks ``operation_begin_issue`` again, which re-issues (key passed)
or fails the operation. Exceptions from ``poll`` are retried on the next poll (the lease is
kept alive with a heartbeat).

Built-in: :class:`SimulatorHandler` for :mod:`pgfence_demo.simulator`. Others are loaded
with :func:`parse_handler` from ``python:module:factory``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable
from urllib.parse import parse_qs, urlparse

import aiohttp

from ..transports import PermanentError, RetryableError, load_callable
from . import ClaimedOperation

logger = logging.getLogger(__name__)

#: Normalised external outcomes. ``pending`` = still queued or running on the external side.
EXTERNAL_STATUSES = ("pending", "succeeded", "failed", "canceled")


@dataclass(frozen=True)
class Issued:
    """The external API accepted the call: its reference (id) and what it answered."""

    ref: str
    detail: dict[str, Any] | None = None


@dataclass(frozen=True)
class ExternalState:
    """One polled state.

    ``status``: one of :data:`EXTERNAL_STATUSES`; ``raw``: the API's answer as JSON (stored on
    the operation row as ``external_state`` and in its poll history); ``error``: a message for a
    ``failed`` / ``canceled`` outcome.
    """

    status: str
    raw: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    def __post_init__(self) -> None:
        if self.status not in EXTERNAL_STATUSES:
            raise ValueError(f"external status must be one of {EXTERNAL_STATUSES}, "
                             f"got {self.status!r}")

    @property
    def terminal(self) -> bool:
        """The external operation ended (succeeded, failed or canceled)."""
        return self.status != "pending"


@runtime_checkable
class OperationHandler(Protocol):
    """What the executor needs for one operation kind (see the module docstring)."""

    #: True if :meth:`issue` passes ``op.idempotency_key`` to an API that starts at most one
    #: operation per key. Declares whether a re-issue after a crash is safe.
    idempotent: bool
    #: Seconds between two polls of one operation.
    poll_interval: float
    #: True if :meth:`cancel` can cancel the external operation.
    can_cancel: bool

    async def issue(self, op: ClaimedOperation) -> Issued:
        """Start the external operation; return its reference."""
        ...

    async def poll(self, op: ClaimedOperation, ref: str) -> ExternalState:
        """Return the external operation's current state."""
        ...

    async def cancel(self, op: ClaimedOperation, ref: str) -> None:
        """Ask the external API to cancel (only called when :attr:`can_cancel`)."""
        ...

    async def finish(self, op: ClaimedOperation, ref: str,
                     state: ExternalState) -> dict[str, Any] | None:
        """The result to store for a terminal ``state`` (e.g. fetched from the API)."""
        ...

    async def aclose(self) -> None:
        """Release connections at executor shutdown."""
        ...


class SimulatorHandler:
    """Drives :mod:`pgfence_demo.simulator` (or any API with the same shape).

    ``POST {base}/operations`` with ``{"kind", "target", "params"}`` (and the
    ``Idempotency-Key`` header when ``idempotent``), ``GET {base}/operations/{ref}`` to poll,
    ``POST …/cancel``, and ``GET …/result`` when done.

    Args:
        base_url: e.g. ``http://127.0.0.1:8765``.
        idempotent: send ``Idempotency-Key: <op.idempotency_key>``; only true if the service
            honours it (simulator mode ``idempotent``).
        poll_interval: seconds between polls.
        timeout: seconds per HTTP request.
    """

    can_cancel = True

    def __init__(self, base_url: str, *, idempotent: bool = True, poll_interval: float = 1.0,
                 timeout: float = 10.0) -> None:
        if urlparse(base_url).scheme not in ("http", "https"):
            raise ValueError(f"simulator URL must be http(s), got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.idempotent = idempotent
        self.poll_interval = poll_interval
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self._session: aiohttp.ClientSession | None = None

    def __repr__(self) -> str:
        return (f"SimulatorHandler({self.base_url!r}, idempotent={self.idempotent}, "
                f"poll_interval={self.poll_interval})")

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout,
                                                  headers={"User-Agent": "pgfence-executor"})
        return self._session

    async def _call(self, method: str, path: str, body: Any = None,
                    headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
        url = f"{self.base_url}{path}"
        try:
            async with self._client().request(method, url, json=body, headers=headers) as resp:
                text = await resp.text()
                status = resp.status
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise RetryableError(f"{method} {url}: {type(exc).__name__}: {exc}") from exc
        try:
            data = json.loads(text) if text else {}
        except ValueError:
            data = {"body": text[:500]}
        if status >= 500 or status in (408, 425, 429):
            raise RetryableError(f"{method} {url}: HTTP {status} {text[:200]!r}")
        return status, data if isinstance(data, dict) else {"body": data}

    async def issue(self, op: ClaimedOperation) -> Issued:
        headers = {"Idempotency-Key": op.idempotency_key} if self.idempotent else {}
        status, data = await self._call(
            "POST", "/operations",
            {"kind": op.kind, "target": op.target, "params": op.params}, headers)
        if status >= 400 or not data.get("id"):
            raise PermanentError(f"start of {op.kind} {op.target} refused: HTTP {status} {data}")
        return Issued(str(data["id"]), data)

    async def poll(self, op: ClaimedOperation, ref: str) -> ExternalState:
        status, data = await self._call("GET", f"/operations/{ref}")
        if status == 404:
            return ExternalState("failed", data, f"external operation {ref} is unknown to "
                                                 f"{self.base_url}")
        if status >= 400:
            raise RetryableError(f"poll of {ref}: HTTP {status} {data}")
        mapped = {"queued": "pending", "running": "pending", "done": "succeeded",
                  "error": "failed", "canceled": "canceled"}.get(str(data.get("status")))
        if mapped is None:
            raise RetryableError(f"poll of {ref}: unknown status {data.get('status')!r}")
        return ExternalState(mapped, data, data.get("error") if mapped == "failed" else
                             ("canceled by the external service" if mapped == "canceled" else None))

    async def cancel(self, op: ClaimedOperation, ref: str) -> None:
        status, data = await self._call("POST", f"/operations/{ref}/cancel")
        if status >= 400 and status != 409:
            raise RetryableError(f"cancel of {ref}: HTTP {status} {data}")

    async def finish(self, op: ClaimedOperation, ref: str,
                     state: ExternalState) -> dict[str, Any] | None:
        if state.status != "succeeded":
            return {"external": state.raw}
        status, data = await self._call("GET", f"/operations/{ref}/result")
        if status >= 400:
            raise RetryableError(f"result of {ref}: HTTP {status} {data}")
        return {"external_ref": ref, **data}

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


def parse_handler(spec: str) -> OperationHandler:
    """Build a handler from its CLI spelling.

    - ``simulator:<url>[?idempotent=1|0][&poll=<seconds>][&timeout=<seconds>]`` —
      :class:`SimulatorHandler` (idempotent by default);
    - ``python:module:factory`` — ``factory()`` returns an :class:`OperationHandler`.

    Raises:
        ValueError: unknown or malformed spec, or a factory that returns no handler.
    """
    if spec.startswith("simulator:"):
        url = urlparse(spec.removeprefix("simulator:"))
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        idem = q.get("idempotent", "1").lower()
        if idem not in ("1", "0", "true", "false", "yes", "no"):
            raise ValueError(f"idempotent must be 1 or 0, got {idem!r}")
        return SimulatorHandler(url._replace(query="").geturl(),
                                idempotent=idem in ("1", "true", "yes"),
                                poll_interval=float(q.get("poll", 1.0)),
                                timeout=float(q.get("timeout", 10.0)))
    if spec.startswith("python:"):
        factory = load_callable(spec.removeprefix("python:"))
        try:
            handler = factory()  # type: ignore[call-arg]
        except TypeError as exc:
            raise ValueError(f"{spec}: the factory must take no arguments ({exc})") from exc
        if not isinstance(handler, OperationHandler):
            raise ValueError(f"{spec}: the factory did not return an operation handler "
                             "(needs idempotent, poll_interval, can_cancel, issue, poll, cancel, "
                             "finish, aclose)")
        return handler
    raise ValueError(f"unknown operation handler {spec!r}: use simulator:<url>[?idempotent=0|1]"
                     " or python:module:factory")
