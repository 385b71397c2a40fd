"""``--log-format json``: one JSON object per log line, for log shippers.

Every line has ``time`` (UTC, ISO 8601, milliseconds), ``level``, ``logger``, ``event`` (a
dotted name such as ``outbox.sent``; ``log`` for lines without one), ``message`` (the text a
person reads), ``worker``; lines about one item add what applies of ``module``, ``id``,
``channel`` / ``kind``, ``attempt`` / ``fence``, ``step``, ``outcome``, ``duration_ms`` and
``error`` (passed with ``extra=`` by the executor and its modules; see :data:`FIELDS`).
"""

from __future__ import annotations

import datetime as dt
import json
import logging
from typing import Any

#: The structured fields a log call may pass with ``extra=`` (record attribute -> JSON key):
#: ``unit_module`` because ``module`` is taken by the LogRecord (the Python module's name).
FIELDS: dict[str, str] = {
    "unit_module": "module", "id": "id", "channel": "channel", "kind": "kind",
    "attempt": "attempt", "fence": "fence", "step": "step", "worker": "worker",
    "outcome": "outcome", "duration_ms": "duration_ms", "error": "error"}


class JsonFormatter(logging.Formatter):
    """Formats a record as one JSON object (see the module docstring).

    Args:
        worker: the ``worker`` of lines that do not name one (the executor's worker id).
    """

    def __init__(self, worker: str | None = None) -> None:
        super().__init__()
        self.worker = worker

    def format(self, record: logging.LogRecord) -> str:
        """The record as one line of JSON; an exception's traceback goes in ``error``."""
        at = dt.datetime.fromtimestamp(record.created, dt.UTC)
        out: dict[str, Any] = {
            "time": at.strftime("%Y-%m-%dT%H:%M:%S.") + f"{at.microsecond // 1000:03d}Z",
            "level": record.levelname.lower(), "logger": record.name,
            "event": getattr(record, "event", "log"), "message": record.getMessage(),
        }
        for attr, key in FIELDS.items():
            value = getattr(record, attr, None)
            if value is not None:
                out[key] = value
        if "worker" not in out and self.worker:
            out["worker"] = self.worker
        if record.exc_info:
            out["error"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)
