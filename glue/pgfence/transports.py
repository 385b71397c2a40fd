"""Transports: how the executor performs an outbox message's external side effect.

A transport receives a claimed message (:class:`pgfence.outbox.Claimed`) and either returns a
receipt (a small JSON-able dict stored on the message by ``outbox_mark_sent``) or raises:

- :class:`RetryableError` — try again later (backoff in SQL; ``retry_after`` may ask for longer);
- :class:`PermanentError` — never retry; the message becomes ``failed``.

Any other exception counts as retryable. Delivery is **at least once**: a worker that dies after
the remote side accepted the message, but before the database recorded it, leads to a second
delivery. Each transport says how the receiver can recognise the repeat:

- ``webhook``: HTTP POST of the payload as JSON, with ``Idempotency-Key`` = the message's
  idempotency key, or ``pgfence-outbox-<id>`` when it has none (stable across attempts);
  2xx = sent; 408, 425, 429, 5xx, timeouts and connection errors = retryable (``Retry-After``
  honoured: seconds, or an HTTP date measured against the response's ``Date``, else against
  the database clock — never the executor's); 3xx (redirects are not followed) and other
  4xx = permanent. Receipts and errors never contain the response body (clients can read
  them); ``webhook?allow=…`` limits the hosts a client-chosen recipient URL may name,
  ``webhook:<url>`` fixes the endpoint.
- ``smtp``: an e-mail whose ``Message-ID`` is derived from the idempotency key only
  (``<key@domain>``, e.g. ``<pgfence-outbox-42@domain>``), so a repeat is the same message to
  the receiving MTA;
  4xx SMTP replies and connection errors = retryable, 5xx = permanent.
- ``log``: writes the message to the log; ``noop``: does nothing (benchmarks).
- ``python:module:function``: any callable ``f(message) -> receipt | None``, sync (run in a
  thread) or async.

Routes map channels to transports; :func:`parse_route` reads the CLI / config spelling.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import email.utils
import importlib
import inspect
import json
import logging
import re
import socket
import threading
from collections.abc import Awaitable, Callable
from email.message import EmailMessage
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import parse_qs, urlparse

from .outbox import Claimed

if TYPE_CHECKING:
    import aiohttp

logger = logging.getLogger(__name__)

Receipt = dict[str, Any] | None


class RetryableError(Exception):
    """The delivery failed but may succeed later.

    ``retry_after``: the remote's requested wait. ``retry_at``: a time the remote named without
    saying what its own clock read (an HTTP-date ``Retry-After`` in a response without a
    ``Date`` header): the executor turns it into a wait on the database clock, never its own.
    """

    def __init__(self, message: str, *, retry_after: dt.timedelta | None = None,
                 retry_at: dt.datetime | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after
        self.retry_at = retry_at


class PermanentError(Exception):
    """The delivery can never succeed (bad address, rejected payload): do not retry."""


class Transport(Protocol):
    """What the executor needs from a transport."""

    name: str

    async def deliver(self, message: Claimed) -> Receipt:
        """Perform the side effect; return a receipt or raise Retryable/PermanentError."""
        ...

    async def aclose(self) -> None:
        """Release connections (called once at executor shutdown)."""
        ...


def idempotency_key(message: Claimed) -> str:
    """The key a receiver can deduplicate on: the message's own key, else ``pgfence-outbox-<id>``."""
    return message.idempotency_key or f"pgfence-outbox-{message.id}"


# -----------------------------------------------------------------------------------------------
class LogTransport:
    """Writes each message to the ``pgfence.transports`` log at INFO; always succeeds."""

    name = "log"

    async def deliver(self, message: Claimed) -> Receipt:
        # Named by its idempotency key: pgfence-outbox-<id>, or pgfence-plan-<id>-step-<n> for
        # an external plan step (the same transports perform both).
        logger.info("log transport: %s %s -> %s %s", idempotency_key(message), message.channel,
                    message.recipient, json.dumps(message.payload)[:500])
        return {"logged": True}

    async def aclose(self) -> None:
        return None


class NoopTransport:
    """Succeeds immediately without doing anything (benchmarks, tests)."""

    name = "noop"

    async def deliver(self, message: Claimed) -> Receipt:
        return None

    async def aclose(self) -> None:
        return None


# -----------------------------------------------------------------------------------------------
_RETRYABLE_HTTP = {408, 425, 429}
_SAFE_LOCAL = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


def _http_date(value: str | None) -> dt.datetime | None:
    if not value:
        return None
    try:
        when = email.utils.parsedate_to_datetime(value.strip())
    except (TypeError, ValueError, IndexError):
        return None
    return when if when.tzinfo is not None else when.replace(tzinfo=dt.UTC)


def retry_after(value: str | None, date: str | None) -> tuple[dt.timedelta | None, dt.datetime | None]:
    """Read a ``Retry-After`` header: ``(wait, None)``, ``(None, time)`` or ``(None, None)``.

    Delay-seconds are a wait. An HTTP date is measured against the response's own ``Date``
    header (both on the remote's clock, so neither this host's clock nor a skew between the
    two matters); without a usable ``Date`` it is returned as a time, for the caller to turn
    into a wait on the database clock (:meth:`pgfence.executor.Executor.retry_wait`).
    """
    if not value:
        return None, None
    value = value.strip()
    if value.isdigit():
        return dt.timedelta(seconds=int(value)), None
    when = _http_date(value)
    if when is None:
        return None, None
    sent = _http_date(date)
    if sent is None:
        return None, when
    return max(when - sent, dt.timedelta(0)), None


class WebhookTransport:
    """HTTP POST of the payload (JSON) to the recipient URL, or to a fixed ``url``.

    Args:
        url: if set, every message goes there and the recipient travels in the
            ``Pgfence-Recipient`` header; else the recipient must be an http(s) URL.
        timeout: seconds for the whole request (connect + response).
        headers: extra headers for every request.
    """

    name = "webhook"

    def __init__(self, url: str | None = None, *, timeout: float = 10.0,
                 headers: dict[str, str] | None = None,
                 allow_hosts: list[str] | None = None) -> None:
        import aiohttp  # imported when first used: it takes longer to import than to start an executor

        self.url = url
        self.timeout = aiohttp.ClientTimeout(total=timeout)
        self.headers = dict(headers or {})
        self.allow_hosts = [h.lower() for h in allow_hosts] if allow_hosts else None
        self._session: aiohttp.ClientSession | None = None

    def _allowed(self, host: str | None) -> bool:
        if self.allow_hosts is None:
            return True
        host = (host or "").lower()
        return any(host == pat or (pat.startswith("*.") and host.endswith(pat[1:]))
                   for pat in self.allow_hosts)

    def _client(self) -> aiohttp.ClientSession:
        import aiohttp

        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(timeout=self.timeout,
                                                  headers={"User-Agent": "pgfence-executor"})
        return self._session

    async def deliver(self, message: Claimed) -> Receipt:
        import aiohttp

        target = self.url or message.recipient
        parsed = urlparse(target)
        if parsed.scheme not in ("http", "https"):
            raise PermanentError(f"webhook recipient is not an http(s) URL: {target!r}")
        if not self._allowed(parsed.hostname):
            raise PermanentError(f"webhook host {parsed.hostname!r} is not in this route's allow list")
        headers = {
            **self.headers,
            "Content-Type": "application/json",
            "Idempotency-Key": idempotency_key(message),
            "Pgfence-Message-Id": str(message.id),
            "Pgfence-Attempt": str(message.attempt),
            "Pgfence-Channel": message.channel,
        }
        if self.url:
            headers["Pgfence-Recipient"] = message.recipient
        try:
            # Redirects are not followed: a 3xx is not an acceptance, and following one would
            # turn the POST into a GET of whatever the Location names.
            async with self._client().post(target, data=json.dumps(message.payload),
                                           headers=headers, allow_redirects=False) as resp:
                body = await resp.text()
                status = resp.status
                wait, retry_at = retry_after(resp.headers.get("Retry-After"),
                                             resp.headers.get("Date"))
                location = resp.headers.get("Location")
                request_id = resp.headers.get("X-Request-Id") or resp.headers.get("Request-Id")
        except (TimeoutError, aiohttp.ClientError, OSError) as exc:
            raise RetryableError(f"webhook {target}: {type(exc).__name__}: {exc}") from exc
        # The response body is logged for operators but never stored in the receipt or the
        # error: clients can read those (outbox_get), and a recipient URL chosen by a client
        # must not become a way to read internal services.
        if 200 <= status < 300:
            receipt: dict[str, Any] = {"http_status": status, "response_bytes": len(body)}
            if request_id:
                receipt["request_id"] = request_id[:200]
            return receipt
        logger.info("webhook %s answered HTTP %d: %.300r", target, status, body)
        detail = f"webhook {target}: HTTP {status}"
        if 300 <= status < 400:
            raise PermanentError(f"{detail}: redirect to {location!r} not followed")
        if status in _RETRYABLE_HTTP or status >= 500:
            raise RetryableError(detail, retry_after=wait, retry_at=retry_at)
        raise PermanentError(detail)

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()


# -----------------------------------------------------------------------------------------------
class SmtpTransport:
    """Sends ``payload = {"subject": str, "text": str}`` as an e-mail to the recipient address.

    Args:
        host, port: the SMTP server.
        sender: the From address.
        domain: right-hand side of the stable Message-ID (default: this host's FQDN).
        tls: ``none``, ``starttls`` or ``ssl``.
        timeout: seconds per SMTP operation.
    """

    name = "smtp"

    def __init__(self, host: str, port: int, sender: str, *, domain: str | None = None,
                 tls: str = "none", timeout: float = 30.0, username: str | None = None,
                 password: str | None = None) -> None:
        if tls not in ("none", "starttls", "ssl"):
            raise ValueError("tls must be none, starttls or ssl")
        self.host, self.port, self.sender = host, port, sender
        self.domain = domain or socket.getfqdn() or "localhost"
        self.tls, self.timeout = tls, timeout
        self.username, self.password = username, password

    def message_id(self, message: Claimed) -> str:
        """Stable across attempts: derived from the idempotency key (see :func:`idempotency_key`),
        so every attempt of one message — or of one plan step — carries the same Message-ID."""
        key = idempotency_key(message)
        import hashlib  # here: not needed to start an executor

        local = key if _SAFE_LOCAL.fullmatch(key) else "k-" + hashlib.sha256(key.encode()).hexdigest()[:40]
        return f"<{local}@{self.domain}>"

    async def deliver(self, message: Claimed) -> Receipt:
        import aiosmtplib  # imported when first used, like aiohttp

        subject = message.payload.get("subject")
        text = message.payload.get("text", message.payload.get("body"))
        if not isinstance(subject, str) or not isinstance(text, str):
            raise PermanentError('smtp payload must be {"subject": str, "text": str}')
        mail = EmailMessage()
        mail["From"] = self.sender
        mail["To"] = message.recipient
        mail["Subject"] = subject
        mail["Message-ID"] = self.message_id(message)
        mail["Date"] = email.utils.formatdate(localtime=False)
        mail["Pgfence-Attempt"] = str(message.attempt)
        mail.set_content(text)
        try:
            errors, reply = await aiosmtplib.send(
                mail, hostname=self.host, port=self.port, timeout=self.timeout,
                use_tls=self.tls == "ssl", start_tls=self.tls == "starttls",
                username=self.username, password=self.password,
            )
        except aiosmtplib.SMTPResponseException as exc:
            detail = f"smtp {self.host}:{self.port}: {exc.code} {exc.message}"
            if 400 <= exc.code < 500:
                raise RetryableError(detail) from exc
            raise PermanentError(detail) from exc
        except (TimeoutError, aiosmtplib.SMTPException, OSError) as exc:
            raise RetryableError(f"smtp {self.host}:{self.port}: {type(exc).__name__}: {exc}") from exc
        if errors:
            raise PermanentError(f"smtp refused recipients: {errors}")
        return {"message_id": mail["Message-ID"], "smtp_reply": reply[:200]}

    async def aclose(self) -> None:
        return None


# -----------------------------------------------------------------------------------------------
class CallableTransport:
    """Wraps ``func(message) -> receipt | None`` (sync: run in a worker thread; or async)."""

    name = "python"

    def __init__(self, func: Callable[[Claimed], Receipt | Awaitable[Receipt]],
                 label: str | None = None) -> None:
        self.func = func
        self.label = label or getattr(func, "__qualname__", repr(func))
        self._is_async = inspect.iscoroutinefunction(func)

    async def deliver(self, message: Claimed) -> Receipt:
        if self._is_async:
            result = self.func(message)
            assert inspect.isawaitable(result)
            return await result
        # A daemon thread per call, not the loop's default executor: a sync handler that never
        # returns must not keep the process alive after SIGTERM and the grace period (the
        # default executor is joined at interpreter exit).
        loop = asyncio.get_running_loop()
        fut: asyncio.Future[Receipt] = loop.create_future()

        def work() -> None:
            out: Any = None
            err: BaseException | None = None
            try:
                out = self.func(message)
            except BaseException as exc:  # handed to the awaiting task, not lost in the thread
                err = exc
            # A closed loop: the handler outlived the executor (timed out, then shutdown); no
            # task awaits the outcome any more, and the thread must not die with a traceback.
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(_settle, fut, out, err)

        threading.Thread(target=work, name=f"pgfence-handler-{message.id}", daemon=True).start()
        out = await fut
        assert not inspect.isawaitable(out)
        return out

    async def aclose(self) -> None:
        return None


def _settle(fut: asyncio.Future[Receipt], value: Receipt, exc: BaseException | None) -> None:
    if fut.done():  # the awaiting task was cancelled (timeout, shutdown)
        return
    if exc is not None:
        fut.set_exception(exc)
    else:
        fut.set_result(value)


def load_callable(path: str) -> Callable[[Claimed], Any]:
    """Import ``package.module:function``; raises ValueError with a clear message if missing."""
    module_name, _, attr = path.partition(":")
    if not module_name or not attr:
        raise ValueError(f"expected module:function, got {path!r}")
    try:
        obj: Any = importlib.import_module(module_name)
        for part in attr.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as exc:
        raise ValueError(f"cannot load handler {path!r}: {exc}") from exc
    if not callable(obj):
        raise ValueError(f"handler {path!r} is not callable")
    return obj  # type: ignore[no-any-return]


def parse_route(spec: str) -> Transport:
    """Build a transport from its route spelling.

    ``log`` · ``noop`` · ``webhook`` (recipient is the URL) · ``webhook?allow=h1,*.example.com``
    (recipient is the URL, its host must be listed) · ``webhook:<url>`` (fixed URL) ·
    ``smtp://host:port?from=addr[&domain=d][&tls=none|starttls|ssl][&timeout=s]`` ·
    ``python:module:function``.

    Raises:
        ValueError: unknown or malformed spec.
    """
    if spec == "log":
        return LogTransport()
    if spec == "noop":
        return NoopTransport()
    if spec == "webhook":
        return WebhookTransport()
    if spec.startswith("webhook?"):
        q = {k: v[-1] for k, v in parse_qs(spec.removeprefix("webhook?")).items()}
        if "allow" not in q:
            raise ValueError("webhook?allow=host1,*.example.com is the only webhook option")
        return WebhookTransport(allow_hosts=[h.strip() for h in q["allow"].split(",") if h.strip()])
    if spec.startswith("webhook:"):
        return WebhookTransport(spec.removeprefix("webhook:"))
    if spec.startswith("smtp://"):
        url = urlparse(spec)
        q = {k: v[-1] for k, v in parse_qs(url.query).items()}
        if not url.hostname or "from" not in q:
            raise ValueError("smtp route needs smtp://host:port?from=sender@example.com")
        return SmtpTransport(url.hostname, url.port or 25, q["from"], domain=q.get("domain"),
                             tls=q.get("tls", "none"), timeout=float(q.get("timeout", 30)),
                             username=url.username, password=url.password)
    if spec.startswith("python:"):
        path = spec.removeprefix("python:")
        return CallableTransport(load_callable(path), label=path)
    raise ValueError(
        f"unknown transport {spec!r}: use log, noop, webhook, webhook?allow=<hosts>, webhook:<url>, "
        "smtp://host:port?from=addr or python:module:function"
    )
