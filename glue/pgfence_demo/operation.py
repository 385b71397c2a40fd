"""Demo scene: a long external operation (a branch reset) — one in flight per branch, issued
once, and after a SIGKILL only polled by the executor that takes over."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Iterator
from typing import Any

import click

from pgfence import operation

from . import DemoContext, audit_views

TITLE = "Operations: a branch reset issued once, one per branch, taken over after a crash"

KIND = "branch.reset"


@contextlib.contextmanager
def _simulator(ctx: DemoContext) -> Iterator[str]:
    """The slow-operations service, as its own process; yields its URL."""
    proc = subprocess.Popen(
        [sys.executable, "-u", "-m", "pgfence_demo.simulator", "--port", "0",
         "--mode", "idempotent", "--queue-time", "1", "--run-time", "6"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    first = proc.stdout.readline().strip()

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            text = line.rstrip().split("simulator: ", 1)[-1]
            click.echo(click.style("    [simulator] ", fg="magenta") + text)

    threading.Thread(target=pump, daemon=True).start()
    try:
        if "listening on " not in first:
            raise RuntimeError(f"the simulator did not start: {first!r}")
        url = first.rsplit(" ", 1)[-1]
        ctx.step(f"slow-operations simulator (a stand-in for a cloud API) on {url}: "
                 "1 s queued, 6 s running; it honours Idempotency-Key")
        yield url
    finally:
        proc.terminate()
        proc.wait(10)


def _stats(url: str, target: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/stats", timeout=5) as resp:
        data: dict[str, Any] = json.load(resp)
    counts: dict[str, Any] = data["by_target"].get(target, {"start_requests": 0, "starts": 0})
    return counts


def _op(ctx: DemoContext, operation_id: int) -> dict[str, Any]:
    with ctx.connect() as conn:
        return operation.get(conn, operation_id)


def run(ctx: DemoContext) -> None:
    branch = f"dev-{ctx.run_id}"
    with _simulator(ctx) as url:
        exec_args = ["--op-kind", f"{KIND}=simulator:{url}?idempotent=1&poll=0.5",
                     "--op-lease", "4", "--poll-interval", "0.5", "--reap-interval", "0.5",
                     "--grace", "5"]

        ctx.step(f"alice asks for a reset of branch {branch} (idempotency key reset-{branch}-1)")
        with ctx.connect() as conn:
            first = operation.request(conn, KIND, branch, {"from": "main"},
                                      idempotency_key=f"reset-{branch}-1", requested_by="alice")
        ctx.check(first.created and first.status == "queued",
                  f"operation #{first.id} queued for {KIND} {branch}")

        executor1 = ctx.start_executor("executor-1", *exec_args)
        ctx.wait_until(lambda: _op(ctx, first.id)["external_ref"] is not None, 20,
                       "the reset to be issued")
        row = _op(ctx, first.id)
        ctx.check(row["status"] == "running" and row["external_ref"] is not None,
                  f"executor-1 recorded its intent, called the API once and recorded the "
                  f"reference {row['external_ref']} (fence {row['fence']})")

        ctx.step(f"bob asks for another reset of {branch} while the first is in flight")
        try:
            with ctx.connect() as conn:
                operation.request(conn, KIND, branch, {"from": "main"},
                                  idempotency_key=f"reset-{branch}-2", requested_by="bob")
            ctx.check(False, "the second reset was refused")
        except operation.TargetBusy as busy:
            click.echo(f"     refused [{busy.sqlstate}]: {busy}\n     detail: {busy.detail}")
            ctx.check(busy.in_flight_id == first.id,
                      f"the second reset is refused (PF201) and names the one in flight: "
                      f"#{busy.in_flight_id}")
        ctx.step("alice's client retries its own request (same key): it gets the same operation")
        with ctx.connect() as conn:
            again = operation.request(conn, KIND, branch, {"from": "main"},
                                      idempotency_key=f"reset-{branch}-1", requested_by="alice")
        ctx.check(again.id == first.id and not again.created,
                  f"retry -> operation #{again.id}, nothing new started")

        ctx.wait_until(lambda: _op(ctx, first.id)["poll_count"] >= 2, 20, "a few polls")
        ctx.step(f"SIGKILL executor-1 while it polls operation #{first.id}")
        executor1.kill()
        held = _op(ctx, first.id)
        ctx.check(held["status"] == "running" and held["locked_by"] == "executor-1",
                  f"#{first.id} is still owned by the dead executor-1 until its lease lapses "
                  f"({held['lease_expires_at']:%H:%M:%S.%f} database clock)")

        stuck = audit_views.wait_stuck(ctx, "operation", first.id, 20)
        ctx.check(stuck is not None and stuck["owner"] == "executor-1" and stuck["fence"] == 1,
                  f"audit_stuck lists operation #{first.id}: executor-1's lease (fence 1) lapsed; "
                  "the next claim only polls")
        executor2 = ctx.start_executor("executor-2", *exec_args)
        ctx.step("executor-2 takes it over when the lease lapses; it finds the reference and "
                 "only polls")
        ctx.wait_until(lambda: _op(ctx, first.id)["status"] in operation.TERMINAL, 40,
                       "the reset to finish")
        final = _op(ctx, first.id)
        counts = _stats(url, branch)

    ctx.check(final["status"] == "succeeded",
              f"operation #{first.id} {final['status']} (result: "
              f"{json.dumps((final['result'] or {}).get('result'))})")
    ctx.check(final["locked_by"] == "executor-2" and final["fence"] == 2,
              "finished by executor-2 under fence 2; executor-1's fence 1 can no longer write")
    ctx.check(any("only polling" in line for line in executor2.lines),
              "executor-2 resumed by polling the recorded reference")
    ctx.check(final["issue_count"] == 1 and counts["start_requests"] == 1,
              f"the reset API was called {counts['start_requests']} time(s) in all")
    ctx.check(counts["starts"] == 1,
              f"the simulator's start count for {branch}: {counts['starts']}")
    with ctx.connect() as conn:
        trail = conn.execute(
            "SELECT event, coalesce(from_status, ''), to_status, actor, fence,"
            " left(coalesce(detail->'state'->>'status' || ' ' || (detail->'state'->>'progress'),"
            "               detail->>'external_ref', ''), 30)"
            " FROM pgfence.event WHERE module = 'operation' AND item_id = %s ORDER BY id",
            (first.id,)).fetchall()
    dups = audit_views.show_duplicates(ctx, "operation", [first.id])
    ctx.check(not dups, f"audit_duplicates does not list operation #{first.id}: the takeover only "
                        "polled, the reset was issued once")
    ctx.step(f"the event log of operation #{first.id}")
    ctx.table(trail, ["event", "from", "to", "actor", "fence", "detail"])
