"""A transport for executor subprocesses under ``--otel`` (``python:otel_spans:deliver``).

Importing it installs the OpenTelemetry SDK as the process's global tracer provider, exporting
each finished span as one JSON line to the file named by ``$PGFENCE_TEST_SPANS`` (what the
application or ``opentelemetry-instrument`` would set up with a real exporter).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult

from pgfence.outbox import Claimed
from pgfence.transports import PermanentError


class JsonLinesExporter(SpanExporter):
    """Appends name, ids, parent, status and attributes of each span to a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self.path, "a", encoding="utf-8") as fh:
            for s in spans:
                fh.write(json.dumps({
                    "name": s.name, "trace_id": f"{s.context.trace_id:032x}",
                    "span_id": f"{s.context.span_id:016x}",
                    "parent": f"{s.parent.span_id:016x}" if s.parent else None,
                    "status": s.status.status_code.name, "attributes": dict(s.attributes or {}),
                }) + "\n")
        return SpanExportResult.SUCCESS


_provider = TracerProvider()
_provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(os.environ["PGFENCE_TEST_SPANS"])))
trace.set_tracer_provider(_provider)


async def deliver(message: Claimed) -> dict[str, Any]:
    """Delivered, unless the payload says ``{"fail": true}`` (a permanent failure)."""
    if message.payload.get("fail"):
        raise PermanentError("410 gone")
    return {"ok": message.id}
