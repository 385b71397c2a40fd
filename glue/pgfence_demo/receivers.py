"""Local receivers for the demo and the tests: an HTTP webhook endpoint and an SMTP sink.

Both run on 127.0.0.1 on a free port, in a background thread with its own event loop, and record
every delivery they see, so at-least-once delivery is visible: a message delivered twice is
counted twice (the receiver can still deduplicate on ``Idempotency-Key`` / ``Message-ID``).

Webhook paths:

- ``/ok`` → 200;
- ``/flaky?fail=N`` → 503 for the first N requests of each idempotency key (default 2), then 200;
- ``/gone`` → 410 (a permanent failure);
- ``/slow?s=SECONDS`` → waits, then 200 (the request is counted when it *arrives*);
- ``/slow-once?s=SECONDS`` → like ``/slow`` for the first request of a key, then immediate;
- ``/status/CODE`` → that status.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Hit:
    """One HTTP request as the webhook receiver saw it."""

    path: str
    key: str
    message_id: str
    attempt: str
    body: Any
    at: float = field(default_factory=time.time)
    status: int | None = None
    recipient: str = ""


class _LoopThread:
    """An asyncio loop in a daemon thread, for servers the synchronous demo drives."""

    def __init__(self, name: str) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def call(self, coro: Any, timeout: float = 10.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


class WebhookReceiver:
    """HTTP endpoint recording every request; use :attr:`url` + a path as the recipient."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.hits: list[Hit] = []
        self._lock = threading.Lock()
        self._attempts: Counter[str] = Counter()
        self._thread = _LoopThread("pgfence-webhook")
        self._runner: web.AppRunner | None = None
        self._thread.call(self._start())

    async def _start(self) -> None:
        app = web.Application()
        app.router.add_post("/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        await web.TCPSite(self._runner, "127.0.0.1", self.port).start()

    async def _handle(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            body = await request.text()
        key = request.headers.get("Idempotency-Key", "")
        hit = Hit(request.path, key, request.headers.get("Pgfence-Message-Id", ""),
                  request.headers.get("Pgfence-Attempt", ""), body,
                  recipient=request.headers.get("Pgfence-Recipient", ""))
        with self._lock:
            self.hits.append(hit)
            self._attempts[key] += 1
            seen = self._attempts[key]
        status = 200
        if request.path == "/flaky":
            status = 503 if seen <= int(request.query.get("fail", "2")) else 200
        elif request.path == "/gone":
            status = 410
        elif request.path == "/slow" or (request.path == "/slow-once" and seen == 1):
            await asyncio.sleep(float(request.query.get("s", "3")))
        elif request.path.startswith("/status/"):
            status = int(request.path.rsplit("/", 1)[1])
        hit.status = status
        return web.json_response({"received": key, "seen": seen}, status=status)

    def count(self, key: str) -> int:
        """How many requests carried this Idempotency-Key."""
        with self._lock:
            return sum(1 for h in self.hits if h.key == key)

    def close(self) -> None:
        """Stop the server and its thread."""
        if self._runner is not None:
            with contextlib.suppress(Exception):
                self._thread.call(self._runner.cleanup())
        self._thread.stop()


class SmtpSink:
    """An SMTP server (aiosmtpd) that keeps every message it accepts."""

    def __init__(self) -> None:
        from aiosmtpd.controller import Controller

        self.port = free_port()
        self.messages: list[dict[str, str]] = []
        self._lock = threading.Lock()
        sink = self

        class Handler:
            async def handle_DATA(self, server: Any, session: Any, envelope: Any) -> str:
                from email import message_from_bytes

                msg = message_from_bytes(envelope.content)
                with sink._lock:
                    sink.messages.append({
                        "message_id": str(msg.get("Message-ID", "")),
                        "to": ",".join(envelope.rcpt_tos),
                        "subject": str(msg.get("Subject", "")),
                    })
                return "250 Message accepted for delivery"

        self._controller = Controller(Handler(), hostname="127.0.0.1", port=self.port)
        self._controller.start()

    @property
    def url(self) -> str:
        """Route spelling for the executor's smtp transport."""
        return f"smtp://127.0.0.1:{self.port}?from=demo@pgfence.local&domain=pgfence.local"

    def count(self, message_id: str) -> int:
        """How many copies of this Message-ID arrived."""
        with self._lock:
            return sum(1 for m in self.messages if m["message_id"] == message_id)

    def close(self) -> None:
        """Stop the SMTP server."""
        with contextlib.suppress(Exception):
            self._controller.stop()
