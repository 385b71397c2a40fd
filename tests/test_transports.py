"""Transports against real local servers: status mapping, idempotency headers, stable Message-ID."""

from __future__ import annotations

import asyncio
import datetime as dt

import pytest

from pgfence.outbox import Claimed
from pgfence.transports import (
    CallableTransport,
    PermanentError,
    RetryableError,
    SmtpTransport,
    WebhookTransport,
    parse_route,
)
from pgfence_demo.receivers import SmtpSink, WebhookReceiver, free_port


def message(mid: int, recipient: str, payload: dict[str, object] | None = None,
            key: str | None = None, attempt: int = 1) -> Claimed:
    now = dt.datetime.now(dt.UTC)
    return Claimed(id=mid, channel="hooks", recipient=recipient, payload=payload or {"n": mid},
                   idempotency_key=key, attempt=attempt, max_attempts=5,
                   lease=dt.timedelta(seconds=30), lease_expires_at=now, created_at=now)


def deliver(transport: object, msg: Claimed) -> object:
    async def go() -> object:
        try:
            return await transport.deliver(msg)  # type: ignore[attr-defined]
        finally:
            await transport.aclose()  # type: ignore[attr-defined]
    return asyncio.run(go())


def test_webhook_2xx_is_sent_with_idempotency_key(webhook: WebhookReceiver) -> None:
    receipt = deliver(WebhookTransport(), message(7, f"{webhook.url}/ok", {"a": 1}, key="k-7"))
    assert receipt == {"http_status": 200, "response_bytes": len('{"received": "k-7", "seen": 1}')}
    hit = webhook.hits[0]
    assert (hit.key, hit.message_id, hit.attempt, hit.body) == ("k-7", "7", "1", {"a": 1})


def test_webhook_key_defaults_to_the_message_id_and_is_stable(webhook: WebhookReceiver) -> None:
    for attempt in (1, 2):
        deliver(WebhookTransport(), message(8, f"{webhook.url}/ok", attempt=attempt))
    assert [h.key for h in webhook.hits] == ["pgfence-outbox-8", "pgfence-outbox-8"]


@pytest.mark.parametrize("path", ["/status/503", "/status/429", "/status/408", "/status/500"])
def test_webhook_retryable_statuses(webhook: WebhookReceiver, path: str) -> None:
    with pytest.raises(RetryableError):
        deliver(WebhookTransport(), message(1, webhook.url + path))


@pytest.mark.parametrize("path", ["/gone", "/status/400", "/status/404", "/status/422"])
def test_webhook_permanent_statuses(webhook: WebhookReceiver, path: str) -> None:
    with pytest.raises(PermanentError):
        deliver(WebhookTransport(), message(1, webhook.url + path))


def test_webhook_connection_refused_is_retryable() -> None:
    with pytest.raises(RetryableError, match="Connect"):
        deliver(WebhookTransport(), message(1, f"http://127.0.0.1:{free_port()}/x"))


def test_webhook_timeout_is_retryable(webhook: WebhookReceiver) -> None:
    with pytest.raises(RetryableError, match="Timeout"):
        deliver(WebhookTransport(timeout=0.3), message(1, f"{webhook.url}/slow?s=2"))


def test_webhook_rejects_a_non_http_recipient() -> None:
    with pytest.raises(PermanentError, match="not an http"):
        deliver(WebhookTransport(), message(1, "mailto:ada@example.com"))


def test_smtp_message_id_is_stable_across_attempts() -> None:
    sink = SmtpSink()
    try:
        transport = SmtpTransport("127.0.0.1", sink.port, "me@pgfence.local", domain="pgfence.local")
        for attempt in (1, 2):
            receipt = deliver(transport, message(11, "ada@example.com",
                                                 {"subject": "Hi", "text": "Hello"}, attempt=attempt))
            assert isinstance(receipt, dict)
            assert receipt["message_id"] == "<pgfence-outbox-11@pgfence.local>"
        assert sink.count("<pgfence-outbox-11@pgfence.local>") == 2
        assert sink.messages[0]["to"] == "ada@example.com"
    finally:
        sink.close()


def test_smtp_bad_payload_is_permanent() -> None:
    with pytest.raises(PermanentError, match="subject"):
        deliver(SmtpTransport("127.0.0.1", 1, "me@x"), message(1, "a@b", {"text": "no subject"}))


def test_smtp_unreachable_server_is_retryable() -> None:
    with pytest.raises(RetryableError):
        deliver(SmtpTransport("127.0.0.1", free_port(), "me@x", timeout=2),
                message(1, "a@b", {"subject": "s", "text": "t"}))


def test_python_callable_sync_and_async() -> None:
    def sync_handler(m: Claimed) -> dict[str, object]:
        return {"sync": m.id}

    async def async_handler(m: Claimed) -> dict[str, object]:
        return {"async": m.id}

    assert deliver(CallableTransport(sync_handler), message(5, "x")) == {"sync": 5}
    assert deliver(CallableTransport(async_handler), message(6, "x")) == {"async": 6}


@pytest.mark.parametrize("spec,name", [("log", "log"), ("noop", "noop"), ("webhook", "webhook"),
                                       ("smtp://h:25?from=a@b", "smtp"),
                                       ("python:json:dumps", "python")])
def test_parse_route(spec: str, name: str) -> None:
    assert parse_route(spec).name == name


@pytest.mark.parametrize("spec", ["carrier-pigeon", "smtp://h:25", "python:nope.nothing:f"])
def test_parse_route_errors(spec: str) -> None:
    with pytest.raises(ValueError):
        parse_route(spec)


def test_smtp_message_id_comes_from_the_idempotency_key() -> None:
    transport = SmtpTransport("127.0.0.1", 1, "me@x", domain="d.example")
    assert transport.message_id(message(5, "a@b", key="pgfence-plan-5-step-2")) == \
        "<pgfence-plan-5-step-2@d.example>"
    odd = transport.message_id(message(5, "a@b", key="order 5/<x>"))
    assert odd.startswith("<k-") and odd.endswith("@d.example>") and " " not in odd
    assert odd == transport.message_id(message(6, "a@b", key="order 5/<x>")), "same key, same id"


def test_webhook_does_not_follow_redirects(webhook: WebhookReceiver) -> None:
    with pytest.raises(PermanentError, match="302"):
        deliver(WebhookTransport(), message(1, f"{webhook.url}/status/302"))
    assert [h.path for h in webhook.hits] == ["/status/302"], "no second request was made"


def test_webhook_bodies_stay_out_of_receipts_and_errors(webhook: WebhookReceiver) -> None:
    receipt = deliver(WebhookTransport(), message(1, f"{webhook.url}/ok", key="secret-body"))
    assert receipt == {"http_status": 200, "response_bytes": len('{"received": "secret-body", "seen": 1}')}
    with pytest.raises(RetryableError) as err:
        deliver(WebhookTransport(), message(2, f"{webhook.url}/status/503", key="k-503"))
    assert "k-503" not in str(err.value) and "HTTP 503" in str(err.value)


def test_webhook_allow_list(webhook: WebhookReceiver) -> None:
    assert deliver(parse_route("webhook?allow=127.0.0.1"), message(1, f"{webhook.url}/ok"))
    with pytest.raises(PermanentError, match="allow list"):
        deliver(parse_route("webhook?allow=hooks.example.com,*.partner.example"),
                message(2, f"{webhook.url}/ok"))
    assert len(webhook.hits) == 1, "the refused host was never contacted"
    assert WebhookTransport(allow_hosts=["*.partner.example"])._allowed("a.partner.example")


def test_webhook_fixed_url_sends_the_recipient_header(webhook: WebhookReceiver) -> None:
    async def go() -> None:
        transport = parse_route(f"webhook:{webhook.url}/ok")
        try:
            await transport.deliver(message(3, "tenant-42"))
        finally:
            await transport.aclose()
    asyncio.run(go())
    assert (webhook.hits[-1].path, webhook.hits[-1].recipient) == ("/ok", "tenant-42")
