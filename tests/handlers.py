"""Python transports used by the executor subprocesses in tests (``python:handlers:<name>``).

They append one line per delivery to the file named by ``$PGFENCE_TEST_RECORD`` (O_APPEND, so
several processes can share it): ``<pid> <message id> <attempt>``.
"""

from __future__ import annotations

import os
import time

from pgfence.outbox import Claimed


def _record(message: Claimed) -> None:
    path = os.environ["PGFENCE_TEST_RECORD"]
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"{os.getpid()} {message.id} {message.attempt}\n".encode())
    finally:
        os.close(fd)


async def record(message: Claimed) -> dict[str, object]:
    """Record the delivery and succeed."""
    _record(message)
    return {"pid": os.getpid(), "handler_started": time.time()}


def read_records(path: str) -> list[tuple[int, int, int]]:
    """Parse the record file: (pid, message id, attempt) per delivery."""
    if not os.path.exists(path):
        return []
    with open(path) as fh:
        return [tuple(int(x) for x in line.split()) for line in fh if line.strip()]  # type: ignore[misc]


def hang(message: Claimed) -> dict[str, object]:
    """A sync handler that never returns (a stuck network call without a timeout)."""
    _record(message)
    time.sleep(3600)
    return {}


async def odd_receipt(message: Claimed) -> dict[str, object]:
    """Delivers fine but returns a receipt that is not JSON for message payloads marked odd."""
    _record(message)
    if message.payload.get("odd"):
        return {"x": {1, 2}}  # a set: not JSON
    return {"ok": True}


async def slow_record(message: Claimed) -> dict[str, object]:
    """Record the delivery as it starts, then take ``payload["sleep"]`` seconds (default 0)."""
    import asyncio

    _record(message)
    await asyncio.sleep(float(message.payload.get("sleep", 0)))
    return {"pid": os.getpid()}


async def key_record(message: Claimed) -> dict[str, object]:
    """Record ``S <channel> <key> <seq>`` as the delivery starts and ``E ...`` as it ends, in
    one O_APPEND file shared by every executor process, so the file's line order is the order
    in which deliveries really started and ended (``payload["key"]``, ``payload["seq"]``)."""
    import asyncio

    path = os.environ["PGFENCE_TEST_RECORD"]
    tag = f"{message.channel} {message.payload['key']} {message.payload['seq']}"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, f"S {tag}\n".encode())
        await asyncio.sleep(0.002)
        os.write(fd, f"E {tag}\n".encode())
    finally:
        os.close(fd)
    return {"pid": os.getpid()}
