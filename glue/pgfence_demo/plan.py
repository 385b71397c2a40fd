"""Demo scene: approved plans — receipts committed with each step, an executor killed mid-plan,
a compensating plan, and a plan whose third step raises."""

from __future__ import annotations

from typing import Any

import psycopg

from pgfence import plan
from pgfence.errors import PgfenceError

from . import DemoContext, audit_views

TITLE = "Plans: proposed, approved, executed step by step with receipts; killed mid-plan; undone"

_SETUP = """
CREATE TABLE IF NOT EXISTS public.demo_inventory (
  sku text PRIMARY KEY,
  qty integer NOT NULL CHECK (qty >= 0)
);
CREATE OR REPLACE FUNCTION public.demo_adjust_stock(p jsonb) RETURNS jsonb
LANGUAGE plpgsql SET search_path = public AS $$
DECLARE v_qty integer;
BEGIN
  UPDATE demo_inventory SET qty = qty + (p ->> 'delta')::int WHERE sku = p ->> 'sku'
  RETURNING qty INTO v_qty;
  IF NOT FOUND THEN
    INSERT INTO demo_inventory (sku, qty) VALUES (p ->> 'sku', (p ->> 'delta')::int)
    RETURNING qty INTO v_qty;
  END IF;
  RETURN jsonb_build_object('sku', p ->> 'sku', 'qty', v_qty);
END $$;
"""


def _adjust(sku: str, delta: int, note: str) -> dict[str, Any]:
    return {"action": "demo.adjust_stock", "args": {"sku": sku, "delta": delta}, "note": note}


def _notify(url: str, event: str) -> dict[str, Any]:
    return {"action": "demo.notify", "args": {"recipient": url, "payload": {"event": event}},
            "note": f"tell the shop: {event}"}


def _stock(ctx: DemoContext, skus: list[str]) -> dict[str, int]:
    with ctx.connect() as conn:
        rows = conn.execute("SELECT sku, qty FROM public.demo_inventory WHERE sku = ANY(%s)",
                            (skus,)).fetchall()
    return {sku: 0 for sku in skus} | {str(r[0]): int(r[1]) for r in rows}


def _show(ctx: DemoContext, pid: int) -> list[dict[str, Any]]:
    with ctx.connect() as conn:
        info = plan.get(conn, pid)
        steps = plan.steps(conn, pid)
    line = f"plan#{pid}: {info['status']}"
    if info["failure"]:
        line += f" ({info['failure']} at step {info['next_step']})"
    who = f"proposed by {info['proposed_by']}"
    if info["approved_by"]:
        who += f", approved by {info['approved_by']}"
    ctx.step(f"{line}; {who}")
    rows = []
    for s in steps:
        result = s["output"] if s["state"] == "ok" else (
            f"{s['sqlstate']}: {s['message']}" if s["sqlstate"] else (s["message"] or ""))
        took = f"{s['duration'].total_seconds() * 1000:.0f} ms" if s["duration"] is not None else ""
        rows.append([s["step_index"], s["action"], s["note"] or "", s["state"],
                     str(result)[:60], s["worker"] or "", took])
    ctx.table(rows, ["step", "action", "note", "state", "result", "worker", "took"])
    return steps


def run(ctx: DemoContext) -> None:
    r = ctx.run_id
    hook = ctx.webhook.url
    widget, gadget, gizmo = f"widget-{r}", f"gadget-{r}", f"gizmo-{r}"
    skus = [widget, gadget, gizmo]

    ctx.step("an administrator puts two actions on the allow-list: a SQL function and a webhook")
    with ctx.connect() as conn:
        conn.execute(_SETUP)
        plan.register_action(conn, "demo.adjust_stock", "public.demo_adjust_stock(jsonb)",
                             "add delta (may be negative) to a SKU's stock; stock never goes below 0")
        plan.register_action(conn, "demo.notify", None, "POST an event to the shop's webhook")
        conn.execute("INSERT INTO public.demo_inventory VALUES (%s, 5), (%s, 5), (%s, 5)",
                      (widget, gadget, gizmo))
    before = _stock(ctx, skus)

    ctx.step("an agent may only name allowed actions, and cannot approve its own plan")
    with ctx.connect() as conn:
        try:
            plan.propose(conn, [{"action": "demo.drop_everything"}], "agent")
            refused = ""
        except PgfenceError as exc:
            refused = exc.sqlstate or ""
        ctx.check(refused == "PF101", f"a step naming an unregistered action is refused ({refused})")
        pid = plan.propose(conn, [
            _adjust(widget, 50, "receive 50 widgets"),
            _adjust(gadget, 20, "receive 20 gadgets"),
            _notify(f"{hook}/slow?s=3", f"restocked-{r}"),
            _adjust(gizmo, 10, "receive 10 gizmos"),
        ], "agent", idempotency_key=f"restock-{r}")
        try:
            plan.approve(conn, pid, "agent")
            self_ok = ""
        except PgfenceError as exc:
            self_ok = exc.sqlstate or ""
        ctx.check(self_ok == "PF103", f"the proposer approving its own plan is refused ({self_ok})")

    exec_args = ["--plans", "start", "--route", "demo.notify=webhook", "--plan-heartbeat", "2",
                 "--poll-interval", "0.5", "--reap-interval", "0.5", "--grace", "5"]
    first = ctx.start_executor("executor-1", *exec_args)
    with ctx.connect() as conn:
        ctx.check(plan.approve(conn, pid, "dana (ops)") == "approved",
                  f"plan#{pid} approved by a person: the executor wakes on the NOTIFY")
    key = f"pgfence-plan-{pid}-step-3"
    ctx.wait_until(lambda: ctx.webhook.count(key) >= 1, 20, "step 3 (the webhook) to be in flight")
    ctx.step("SIGKILL executor-1 while step 3 (the webhook, a slow receiver) is in flight")
    first.kill()
    with ctx.connect() as conn:
        held = plan.get(conn, pid)
    ctx.check(held["status"] == "executing" and held["worker"] == "executor-1",
              f"plan#{pid} still belongs to the dead executor-1 until its heartbeat lapses "
              f"(database clock, {held['heartbeat_expires_at']:%H:%M:%S.%f})")
    stuck = audit_views.wait_stuck(ctx, "plan", pid, 20)
    ctx.check(stuck is not None and stuck["owner"] == "executor-1",
              f"audit_stuck lists plan#{pid}: executor-1's heartbeat lapsed, external step 3 in flight")
    ctx.start_executor("executor-2", *exec_args)
    ctx.step("executor-2 does not resume it (plans never retry); its reaper marks it interrupted")

    def interrupted() -> bool:
        with ctx.connect() as conn:
            return bool(plan.get(conn, pid)["status"] == "failed")

    ctx.wait_until(interrupted, 20, "the plan to be marked interrupted")
    steps = _show(ctx, pid)
    with ctx.connect() as conn:
        info = plan.get(conn, pid)
        # executor-1's token: its claim was the run's first take
        late = plan.record_step(conn, pid, 3, "executor-1", 1, True, output={"late": True})
    ctx.check(info["failure"] == "interrupted", "the plan is failed, reason interrupted")
    ctx.check([s["state"] for s in steps] == ["ok", "ok", "unknown", "not_run"],
              "steps 1-2 committed with receipts; step 3 was in flight (unknown); step 4 never ran")
    ctx.check(ctx.webhook.count(key) == 1,
              "the receiver did get step 3 (idempotency key " + key + "): at least once, "
              "which is why pgfence calls it unknown rather than not done")
    ctx.check(not late, "a late report under the dead executor's name is refused")
    dups = audit_views.show_duplicates(ctx, "plan", [pid])
    ctx.check([(d["reason"], d["idempotency_key"]) for d in dups] == [("external_step_in_doubt", key)],
              f"audit_duplicates lists plan#{pid}: external step 3 is in doubt (check the receiver "
              f"for {key}, then compensate)")
    now = _stock(ctx, skus)
    ctx.check(now == {widget: 55, gadget: 25, gizmo: 5},
              f"stock shows exactly the committed steps: {now}")

    ctx.step("compensation is a new plan with its own approval and receipts")
    with ctx.connect() as conn:
        undo = plan.compensate(conn, pid, [
            _adjust(widget, -50, "send the 50 widgets back"),
            _adjust(gadget, -20, "send the 20 gadgets back"),
            _notify(f"{hook}/ok", f"restock-cancelled-{r}"),
        ], "agent")
        plan.approve(conn, undo, "dana (ops)")

    def undone() -> bool:
        with ctx.connect() as conn:
            return bool(plan.get(conn, undo)["status"] in ("executed", "failed"))

    ctx.wait_until(undone, 20, "the compensating plan to run")
    _show(ctx, undo)
    with ctx.connect() as conn:
        ctx.check(plan.get(conn, undo)["status"] == "executed", f"compensating plan#{undo} executed")
        ctx.check(plan.get(conn, pid)["compensated_by"] == [undo],
                  f"plan#{pid} records that plan#{undo} compensates it")
    ctx.check(_stock(ctx, skus) == before, f"stock is back to {before}")

    ctx.step("executors stopped; a plan whose third step raises, run from SQL "
             "(CALL pgfence.plan_execute: one committed transaction per step)")
    ctx.stop_executors()
    with ctx.connect() as conn:
        bad = plan.propose(conn, [
            _adjust(widget, 1, "one more widget"),
            _adjust(gadget, 1, "one more gadget"),
            _adjust(gizmo, -1000, "ship 1000 gizmos (there are 5)"),
            _adjust(widget, 1, "never reached"),
        ], "agent")
        plan.approve(conn, bad, "dana (ops)")
        try:
            result = plan.execute(conn, bad, "sql-runner")
        except psycopg.Error as exc:  # the demo must report, not crash
            ctx.check(False, f"CALL plan_execute raised {exc}")
            return
    steps = _show(ctx, bad)
    ctx.check(result.status == "failed", f"plan#{bad} failed")
    ctx.check([s["state"] for s in steps] == ["ok", "ok", "error", "not_run"],
              "steps 1-2 committed; step 3 has an error receipt; step 4 never ran")
    ctx.check(steps[2]["sqlstate"] == "23514",
              f"step 3's receipt carries the SQLSTATE: {steps[2]['sqlstate']} {steps[2]['message']}")
    after = _stock(ctx, skus)
    ctx.check(after == {widget: before[widget] + 1, gadget: before[gadget] + 1, gizmo: before[gizmo]},
              f"the failed step left no trace; steps 1-2 did: {after}")
