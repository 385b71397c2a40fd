"""Demo scene: the transactional outbox, delivered at least once, surviving a SIGKILL."""

from __future__ import annotations

import datetime as dt
import json
import urllib.request
from dataclasses import dataclass
from typing import Any

import click

from pgfence import outbox

from . import DemoContext, ExecutorProcess, audit_views

TITLE = "Outbox: notifications delivered at least once, with bounded, spaced retries"


@dataclass
class Planned:
    label: str
    channel: str
    recipient: str
    key: str | None
    expect_status: str
    expect_min_hits: int
    expect_max_hits: int
    id: int = 0


def _state(ctx: DemoContext, ids: list[int]) -> dict[int, dict[str, Any]]:
    with ctx.connect() as conn:
        return {i: outbox.get(conn, i) for i in ids}


def run(ctx: DemoContext) -> None:
    r = ctx.run_id
    hook = ctx.webhook.url
    with ctx.connect() as conn:
        ctx.step("channel settings: short leases and backoff so the demo runs in seconds")
        for channel, lease in (("hooks", 10), ("mail", 10), ("slow-hooks", 5)):
            outbox.configure_channel(conn, channel, max_attempts=5,
                                     backoff_base=dt.timedelta(milliseconds=200),
                                     backoff_cap=dt.timedelta(seconds=2),
                                     lease=dt.timedelta(seconds=lease), log_events=True)
        conn.execute("CREATE TABLE IF NOT EXISTS demo_orders (id text PRIMARY KEY, "
                     "customer text NOT NULL, total numeric NOT NULL)")

    plan = [
        Planned("order confirmed (webhook)", "hooks", f"{hook}/ok", f"order-1001-{r}", "sent", 1, 1),
        Planned("receiver fails twice (503)", "hooks", f"{hook}/flaky?fail=2", f"order-1002-{r}",
                "sent", 3, 3),
        Planned("receiver answers 410 Gone", "hooks", f"{hook}/gone", f"order-1003-{r}",
                "failed", 1, 1),
        Planned("delayed 2 s (deliver_at)", "hooks", f"{hook}/ok", f"reminder-1001-{r}", "sent", 1, 1),
        Planned("e-mail receipt (SMTP)", "mail", "customer@example.com", f"mail-1001-{r}", "sent", 1, 1),
        Planned("slow receiver; executor killed", "slow-hooks", f"{hook}/slow?s=1.5",
                f"order-1004-{r}", "sent", 2, 2),
    ]

    ctx.step("business transaction: insert an order AND enqueue its notifications, one COMMIT")
    first_wave, slow = plan[:5], plan[5]
    with ctx.connect() as conn, conn.transaction():
        conn.execute("INSERT INTO demo_orders VALUES (%s, 'ada', 42.00)", (f"1001-{r}",))
        for p in first_wave:
            payload: dict[str, Any] = {"event": p.label, "order": p.key}
            if p.channel == "mail":
                payload = {"subject": "Your order 1001", "text": "Thanks for your order."}
            deliver_at = None
            if p.key and p.key.startswith("reminder"):
                row = conn.execute("SELECT now() + interval '2 seconds'").fetchone()
                deliver_at = row[0] if row else None
            p.id = outbox.enqueue(conn, p.channel, p.recipient, payload, idempotency_key=p.key,
                                  deliver_at=deliver_at)

    ctx.step("a rolled-back business transaction leaves no message behind")
    with ctx.connect() as conn:
        before = conn.execute("SELECT count(*) FROM pgfence.outbox_list(NULL, NULL, 10000)").fetchone()
        try:
            with conn.transaction():
                outbox.enqueue(conn, "hooks", f"{hook}/ok", {"event": "never"},
                               idempotency_key=f"rolled-back-{r}")
                raise RuntimeError("payment declined")
        except RuntimeError:
            pass
        after = conn.execute("SELECT count(*) FROM pgfence.outbox_list(NULL, NULL, 10000)").fetchone()
    ctx.check(before == after, "rollback: the message vanished with the business change")

    ctx.step("the same idempotency key enqueued again (a client retry) returns the same id")
    with ctx.connect() as conn:
        dup = outbox.enqueue(conn, "hooks", f"{hook}/ok", {"event": "retry"},
                             idempotency_key=plan[0].key)
    ctx.check(dup == plan[0].id, f"duplicate key -> outbox#{dup}, the same message, no new row")

    exec_args = ["--route", "hooks=webhook", "--route", "slow-hooks=webhook",
                 "--route", f"mail={ctx.smtp.url}", "--poll-interval", "0.5",
                 "--reap-interval", "0.5", "--grace", "5"]
    first = ctx.start_executor("executor-1", *exec_args)
    quick = [p.id for p in first_wave if not (p.key or "").startswith("reminder")]
    ctx.wait_until(lambda: all(m["status"] in ("sent", "failed", "dead")
                               for m in _state(ctx, quick).values()), 20,
                   "the first wave to settle")
    ctx.step("a slow receiver next: enqueue one more message, then kill the executor mid-delivery")
    with ctx.connect() as conn:
        slow.id = outbox.enqueue(conn, slow.channel, slow.recipient, {"event": slow.label},
                                 idempotency_key=slow.key)
    ctx.wait_until(lambda: ctx.webhook.count(slow.key or "") >= 1, 20,
                   "the slow delivery to start")
    ctx.step(f"SIGKILL executor-1 while it is delivering outbox#{slow.id} (slow receiver)")
    first.kill()
    with ctx.connect() as conn:
        held = outbox.get(conn, slow.id)
    ctx.check(held["status"] == "processing" and held["locked_by"] == "executor-1",
              f"outbox#{slow.id} is still claimed by the dead executor-1 "
              f"(lease until {held['lease_expires_at']:%H:%M:%S.%f})")
    ctx.step("nobody can take it until the lease lapses (database clock); then an operator "
             "sees it in pgfence.audit_stuck")
    stuck = audit_views.wait_stuck(ctx, "outbox", slow.id, 20)
    ctx.check(stuck is not None and stuck["owner"] == "executor-1" and stuck["fence"] == 1,
              f"audit_stuck lists outbox#{slow.id}: executor-1's attempt 1, lease lapsed")
    second = ctx.start_executor("executor-2", *exec_args)
    ctx.step("executor-2's reaper puts it back and it is delivered again")

    ids = [p.id for p in plan]

    def settled() -> bool:
        return all(m["status"] in ("sent", "failed", "dead") for m in _state(ctx, ids).values())

    ctx.wait_until(settled, 40, "every message to settle")
    final = _state(ctx, ids)
    rows = []
    for p in plan:
        m = final[p.id]
        hits = (ctx.smtp.count(f"<{p.key}@pgfence.local>") if p.channel == "mail"
                else ctx.webhook.count(p.key or ""))
        ok = (m["status"] == p.expect_status and p.expect_min_hits <= hits <= p.expect_max_hits)
        rows.append([f"#{p.id}", p.label, m["status"], m["attempts"], hits,
                     (m["last_error"] or "")[:38], "ok" if ok else "UNEXPECTED"])
        ctx.check(ok, f"outbox#{p.id} {p.label}: {m['status']} after {m['attempts']} attempt(s), "
                      f"receiver saw it {hits}x")
    ctx.table(rows, ["msg", "what", "status", "attempts", "receiver saw", "last error", ""])
    _show_metrics(ctx, second)
    ctx.check(final[plan[3].id]["finished_at"] is not None, "the delayed message went out")
    lost = [p.id for p in plan if final[p.id]["status"] not in ("sent", "failed", "dead")]
    ctx.check(not lost, "no message lost: every one reached a final state")
    ctx.step("at-least-once made visible: the killed delivery reached the receiver twice, "
             "both times with the same Idempotency-Key, so the receiver can deduplicate")
    dups = audit_views.show_duplicates(ctx, "outbox", ids)
    ctx.check([(d["item_id"], d["lost_by"]) for d in dups] == [(slow.id, ["executor-1"])],
              f"audit_duplicates lists outbox#{slow.id} (and only it): attempt 1 lost its lease "
              f"while executor-1 held it, so the receiver may have it twice (key {slow.key})")


def _show_metrics(ctx: DemoContext, proc: ExecutorProcess) -> None:
    """Scrape the executor's /metrics and /readyz (what Prometheus and an orchestrator see)."""
    ctx.wait_until(lambda: proc.metrics_url is not None, 10, "executor-2's metrics URL")
    url = str(proc.metrics_url)
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    with urllib.request.urlopen(url.removesuffix("/metrics") + "/readyz", timeout=10) as resp:
        ready = json.loads(resp.read())
    shown = [line for line in text.splitlines()
             if line.startswith(("pgfence_delivered_total", "pgfence_reclaimed_total",
                                 "pgfence_failed_total", "pgfence_dead_total"))]
    ctx.step(f"executor-2's {url} (Prometheus text format), a few of its samples:")
    for line in shown:
        click.echo("     " + line)
    ctx.check(bool(shown) and ready["ready"] is True,
              "/metrics counts executor-2's deliveries; /readyz says ready")
