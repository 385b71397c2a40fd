"""Handlers the benchmark's executor subprocesses load (``python:bench_handlers:<name>``)."""

from __future__ import annotations

import time

from pgfence.outbox import Claimed


async def stamp(message: Claimed) -> dict[str, float]:
    """Return the wall-clock time at which the handler started (seconds since the epoch)."""
    return {"t": time.time()}
