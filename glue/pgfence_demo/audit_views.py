"""Helpers for the demo scenes: show the audit views an operator would read after a crash.

Not a scene itself: the scenes call :func:`wait_stuck` between a SIGKILL and the start of the
executor that takes over (so the lapsed lease is visible), and :func:`show_duplicates` once the
work settled. Both only read (``pgfence.audit_stuck``, ``pgfence.audit_duplicates``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pgfence import audit

from . import DemoContext


def wait_stuck(ctx: DemoContext, module: str, item_id: int, timeout: float) -> dict[str, Any] | None:
    """Wait until ``pgfence.audit_stuck`` lists the item (its lease or heartbeat lapsed by the
    database clock), print the view, and return the item's row (None after ``timeout`` s)."""
    found: list[dict[str, Any]] = []

    def listed() -> bool:
        with ctx.connect() as conn:
            rows = audit.stuck(conn)
        found[:] = rows
        return any(r["module"] == module and r["item_id"] == item_id for r in rows)

    ctx.wait_until(listed, timeout, f"{module}#{item_id} to show in audit_stuck", interval=0.2)
    ctx.step("psql> SELECT module, item_id, owner, fence, overdue, next FROM pgfence.audit_stuck;")
    ctx.table([[r["module"], r["item_id"], r["owner"] or "", r["fence"] if r["fence"] is not None else "",
                f"{r['overdue'].total_seconds():.1f}s", r["next"]] for r in found],
              ["module", "item_id", "owner", "fence", "overdue", "next"])
    return next((r for r in found if r["module"] == module and r["item_id"] == item_id), None)


def show_duplicates(ctx: DemoContext, module: str, item_ids: Sequence[int]) -> list[dict[str, Any]]:
    """Print ``pgfence.audit_duplicates`` for these items of ``module``; return those rows."""
    with ctx.connect() as conn:
        rows = [r for r in audit.duplicates(conn, limit=10000)
                if r["module"] == module and r["item_id"] in set(item_ids)]
    ctx.step("psql> SELECT module, item_id, status, reason, fences, lost_by, idempotency_key "
             "FROM pgfence.audit_duplicates;")
    if rows:
        ctx.table([[r["module"], r["item_id"], r["status"], r["reason"], r["fences"], r["lost_by"],
                    r["idempotency_key"]] for r in rows],
                  ["module", "item_id", "status", "reason", "fences", "lost_by", "idempotency_key"])
        for r in rows:
            ctx.step(f"{r['module']}#{r['item_id']}: {r['check_downstream']}")
    else:
        ctx.step(f"(no {module} item of this scene is listed)")
    return rows
