"""The executor as a real process against a real PostgreSQL and real local receivers:
delivery, SIGKILL mid-delivery, SIGSTOP past the lease, listener killed, SIGTERM, 8 claimers."""

from __future__ import annotations

import datetime as dt
import re
import signal
import time
from collections import Counter
from pathlib import Path

import psycopg
import pytest

from handlers import read_records
from pgfence import outbox
from pgfence_demo.receivers import SmtpSink, WebhookReceiver
from support import FAST, Proc, scalar, wait_for


def configure(conn: psycopg.Connection, channel: str, lease: float, **kw: object) -> None:
    outbox.configure_channel(conn, channel, lease=dt.timedelta(seconds=lease),
                             backoff_base=dt.timedelta(milliseconds=100),
                             backoff_cap=dt.timedelta(seconds=1), **kw)  # type: ignore[arg-type]


def status(dsn: str, mid: int) -> str:
    return str(scalar(dsn, "SELECT status FROM pgfence.outbox_get(%s)", (mid,)))


@pytest.mark.timeout(60)
def test_delivers_to_real_webhook_and_smtp_receivers(db: str, conn: psycopg.Connection,
                                                     webhook: WebhookReceiver, smtp: SmtpSink,
                                                     tmp_path: Path) -> None:
    hook_id = outbox.enqueue(conn, "hooks", f"{webhook.url}/ok", {"order": 1}, idempotency_key="o-1")
    flaky_id = outbox.enqueue(conn, "hooks", f"{webhook.url}/flaky?fail=1", {"order": 2})
    gone_id = outbox.enqueue(conn, "hooks", f"{webhook.url}/gone", {"order": 3})
    mail_id = outbox.enqueue(conn, "mail", "ada@example.com", {"subject": "Hi", "text": "Hello"})
    configure(conn, "hooks", 10)
    proc = Proc(db, ["--route", "hooks=webhook", "--route", f"mail={smtp.url}", *FAST],
                tmp_path / "exec.log")
    try:
        wait_for(lambda: all(status(db, m) in ("sent", "failed") for m in
                             (hook_id, flaky_id, gone_id, mail_id)), 30, "all messages settled")
    finally:
        assert proc.terminate() == 0, proc.output()
    assert [status(db, m) for m in (hook_id, flaky_id, gone_id, mail_id)] == \
        ["sent", "sent", "failed", "sent"]
    assert webhook.count("o-1") == 1
    assert webhook.count(f"pgfence-outbox-{flaky_id}") == 2, "503 once, then 200"
    assert smtp.count(f"<pgfence-outbox-{mail_id}@pgfence.local>") == 1
    receipt = outbox.get(conn, hook_id)["receipt"]
    assert receipt["http_status"] == 200
    log = proc.output()
    assert re.search(rf"sent +outbox#{hook_id} hooks -> .*attempt 1", log), log
    assert re.search(rf"failed +outbox#{gone_id} .*HTTP 410", log), log


@pytest.mark.timeout(60)
def test_sigkill_mid_delivery_is_redelivered_after_the_lease(db: str, conn: psycopg.Connection,
                                                             webhook: WebhookReceiver,
                                                             tmp_path: Path) -> None:
    configure(conn, "hooks", 3)
    mid = outbox.enqueue(conn, "hooks", f"{webhook.url}/slow-once?s=2", {"n": 1},
                         idempotency_key="kill-me")
    first = Proc(db, ["--route", "hooks=webhook", "--worker-id", "victim", *FAST],
                 tmp_path / "a.log")
    wait_for(lambda: webhook.count("kill-me") == 1, 20, "first delivery to arrive")
    first.kill()
    held = outbox.get(conn, mid)
    assert (held["status"], held["locked_by"], held["attempts"]) == ("processing", "victim", 1)
    second = Proc(db, ["--route", "hooks=webhook", "--worker-id", "rescuer", *FAST],
                  tmp_path / "b.log")
    try:
        wait_for(lambda: status(db, mid) == "sent", 20, "redelivery after the lease lapsed")
    finally:
        second.terminate()
    final = outbox.get(conn, mid)
    assert final["attempts"] == 2
    assert webhook.count("kill-me") == 2, "at least once: the receiver saw the key twice"
    first_hit, second_hit = [h.at for h in webhook.hits if h.key == "kill-me"]
    assert second_hit - first_hit >= 2.5, "redelivered only after the 3 s lease lapsed"


@pytest.mark.timeout(60)
def test_sigstop_past_the_lease_fences_out_the_resumed_worker(db: str, conn: psycopg.Connection,
                                                             webhook: WebhookReceiver,
                                                             tmp_path: Path) -> None:
    configure(conn, "hooks", 3, log_events=True)
    mid = outbox.enqueue(conn, "hooks", f"{webhook.url}/slow-once?s=1", {"n": 1},
                         idempotency_key="stop-me")
    paused = Proc(db, ["--route", "hooks=webhook", "--worker-id", "paused", *FAST],
                  tmp_path / "paused.log")
    wait_for(lambda: webhook.count("stop-me") == 1, 20, "first delivery to arrive")
    paused.signal(signal.SIGSTOP)
    try:
        other = Proc(db, ["--route", "hooks=webhook", "--worker-id", "other", *FAST],
                     tmp_path / "other.log")
        try:
            wait_for(lambda: status(db, mid) == "sent", 20, "the new owner to deliver")
        finally:
            assert other.terminate() == 0
        assert outbox.get(conn, mid)["attempts"] == 2
    finally:
        paused.signal(signal.SIGCONT)
    # the resumed worker finishes its old attempt; its write must be refused by the fence
    wait_for(lambda: "stale" in paused.output(), 15, "the resumed worker to report its stale claim")
    assert paused.terminate() == 0
    final = outbox.get(conn, mid)
    assert (final["status"], final["attempts"]) == ("sent", 2)
    actors = [r[0] for r in conn.execute(
        "SELECT actor FROM pgfence.event WHERE module = 'outbox' AND item_id = %s AND to_status = 'sent'",
        (mid,)).fetchall()]
    assert actors == ["other"], "exactly one sent transition, made by the new owner"
    assert re.search(rf"stale +outbox#{mid} attempt 1", paused.output()), paused.output()


@pytest.mark.timeout(60)
def test_listener_killed_by_pg_terminate_backend_reconnects(db: str, conn: psycopg.Connection,
                                                            webhook: WebhookReceiver,
                                                            tmp_path: Path) -> None:
    # A long poll interval: only NOTIFY on a re-established LISTEN can deliver quickly.
    proc = Proc(db, ["--route", "hooks=webhook", "--worker-id", "lst", "--poll-interval", "60",
                     "--reap-interval", "60"], tmp_path / "exec.log")
    try:
        listener_pid = wait_for(lambda: scalar(
            db, "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgfence-listener:lst'"),
            20, "the listener connection")
        first = outbox.enqueue(conn, "hooks", f"{webhook.url}/ok", {"n": 0})
        wait_for(lambda: status(db, first) == "sent", 10, "a delivery before the kill")
        assert scalar(db, "SELECT pg_terminate_backend(%s)", (listener_pid,)) is True
        time.sleep(1.0)
        enqueued = time.monotonic()
        mid = outbox.enqueue(conn, "hooks", f"{webhook.url}/ok", {"n": 1})
        wait_for(lambda: status(db, mid) == "sent", 10, "delivery after the listener was killed")
        took = time.monotonic() - enqueued
        new_pid = scalar(
            db, "SELECT pid FROM pg_stat_activity WHERE application_name = 'pgfence-listener:lst'")
    finally:
        assert proc.terminate() == 0
    assert new_pid and new_pid != listener_pid, "a new listener connection exists"
    assert took < 5, f"delivered in {took:.2f}s, far below the 60 s poll interval"
    assert "listener connection lost" in proc.output()


@pytest.mark.timeout(60)
def test_a_new_listener_session_sweeps_on_itself(db: str, conn: psycopg.Connection,
                                                 tmp_path: Path) -> None:
    # After LISTEN (at start and after every reconnect) the listener's own session runs the
    # sweep of its idle modules: what was due while nobody listened is claimed, and the new
    # server session has compiled the claim function before the first wake-up needs it.
    proc = Proc(db, ["--route", "quick=noop", "--worker-id", "lwarm", "--poll-interval", "60",
                     "--reap-interval", "60"], tmp_path / "exec.log")
    listener = ("SELECT pid, query FROM pg_stat_activity"
                " WHERE application_name = 'pgfence-listener:lwarm'")

    def swept(old_pid: int | None) -> tuple[int, str] | None:
        row = conn.execute(listener).fetchone()
        if row is None or row[0] == old_pid or not re.search(r"claim|next_due", row[1]):
            return None
        return row[0], row[1]

    try:
        first_pid, _ = wait_for(lambda: swept(None), 20, "a claim on the listener's session")
        assert scalar(db, "SELECT pg_terminate_backend(%s)", (first_pid,)) is True
        mid = outbox.enqueue(conn, "quick", "r", {"n": 1})  # its NOTIFY may find nobody
        new_pid, _ = wait_for(lambda: swept(first_pid), 20,
                              "a claim on the reconnected listener's session")
        wait_for(lambda: status(db, mid) == "sent", 10, "the message sent")
        attempts = scalar(db, "SELECT attempts FROM pgfence.outbox WHERE id = %s", (mid,))
    finally:
        assert proc.terminate() == 0
    assert new_pid != first_pid
    assert attempts == 1


@pytest.mark.timeout(60)
def test_sigterm_lets_in_flight_work_finish(db: str, conn: psycopg.Connection,
                                            webhook: WebhookReceiver, tmp_path: Path) -> None:
    configure(conn, "hooks", 30)
    mid = outbox.enqueue(conn, "hooks", f"{webhook.url}/slow?s=1.5", {"n": 1},
                         idempotency_key="graceful")
    proc = Proc(db, ["--route", "hooks=webhook", *FAST], tmp_path / "exec.log")
    wait_for(lambda: webhook.count("graceful") == 1, 20, "delivery in flight")
    later = outbox.enqueue(conn, "hooks", f"{webhook.url}/ok", {"n": 2},
                           deliver_at=scalar(db, "SELECT now() + interval '0.3 seconds'"))
    proc.signal(signal.SIGTERM)
    assert proc.wait(20) == 0, proc.output()
    assert status(db, mid) == "sent", "the in-flight delivery was finished and recorded"
    assert status(db, later) == "pending", "no new claims after SIGTERM"
    assert "SIGTERM received" in proc.output()


@pytest.mark.timeout(240)
@pytest.mark.slow
def test_eight_claimers_two_thousand_messages(db: str, conn: psycopg.Connection,
                                              tmp_path: Path) -> None:
    outbox.configure_channel(conn, "bulk", log_events=True)
    n = 2000
    deadlocks_before = scalar(db, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    record = tmp_path / "deliveries.txt"
    procs = [Proc(db, ["--route", "bulk=python:handlers:record", "--batch", "20",
                       "--concurrency", "20", "--log-level", "warning", *FAST],
                  tmp_path / f"exec{i}.log", env={"PGFENCE_TEST_RECORD": str(record)})
             for i in range(8)]
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity"
                                    " WHERE application_name LIKE 'pgfence-listener:%%'") == 8,
                 60, "all 8 executors listening")
        # enqueued only now, in 20 commits (20 NOTIFYs): every executor is awake to compete;
        # enqueued before they start, the first one up drained the queue alone
        ids = [mid for k in range(0, n, 100)
               for mid in outbox.enqueue_many(conn, "bulk", [f"r{i}" for i in range(k, k + 100)],
                                              [{"i": i} for i in range(k, k + 100)])]
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pgfence.outbox_list('bulk', 'sent', 10000)") == n,
                 180, "all 2,000 messages sent")
    finally:
        codes = [p.terminate() for p in procs]
    assert codes == [0] * 8, [p.output()[-2000:] for p in procs]
    deliveries = read_records(str(record))
    delivered_ids = Counter(mid for _, mid, _ in deliveries)
    assert set(delivered_ids) == set(ids), "every message delivered at least once"
    sent_events = conn.execute(
        "SELECT item_id, count(*) FROM pgfence.event WHERE module = 'outbox' AND to_status = 'sent'"
        " AND event = 'transition' GROUP BY item_id").fetchall()
    assert len(sent_events) == n and all(c == 1 for _, c in sent_events), \
        "exactly one sent transition per message"
    assert len({pid for pid, _, _ in deliveries}) > 1, "the work was shared between processes"
    deadlocks_after = scalar(db, "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()")
    assert deadlocks_after == deadlocks_before, "zero deadlocks"


@pytest.mark.timeout(60)
def test_a_hanging_sync_handler_does_not_block_shutdown(db: str, conn: psycopg.Connection,
                                                        tmp_path: Path) -> None:
    record = tmp_path / "hang.txt"
    outbox.enqueue(conn, "stuck", "r", {"n": 1})
    proc = Proc(db, ["--route", "stuck=python:handlers:hang", "--grace", "1", *FAST[:4]],
                tmp_path / "exec.log", env={"PGFENCE_TEST_RECORD": str(record)})
    wait_for(lambda: record.exists() and record.read_text(), 20, "the handler to start")
    t0 = time.monotonic()
    proc.signal(signal.SIGTERM)
    assert proc.wait(15) == 0, proc.output()
    assert time.monotonic() - t0 < 10, "stopped after the grace period, not after the handler"
    assert "abandoning 1 in-flight job" in proc.output()


@pytest.mark.timeout(60)
def test_an_unserialisable_receipt_costs_no_other_message(db: str, conn: psycopg.Connection,
                                                          tmp_path: Path) -> None:
    record = tmp_path / "odd.txt"
    configure(conn, "odd", 3)
    ids = outbox.enqueue_many(conn, "odd", ["r"] * 5, [{"odd": i == 2} for i in range(5)])
    proc = Proc(db, ["--route", "odd=python:handlers:odd_receipt", "--batch", "5", *FAST],
                tmp_path / "exec.log", env={"PGFENCE_TEST_RECORD": str(record)})
    try:
        wait_for(lambda: all(status(db, m) == "sent" for m in ids), 20, "all five sent")
        time.sleep(4)  # longer than the lease: a lost mark would show up as a redelivery
    finally:
        assert proc.terminate() == 0
    assert sorted(mid for _, mid, _ in read_records(str(record))) == sorted(ids), "each delivered once"
    odd = outbox.get(conn, ids[2])
    assert odd["attempts"] == 1 and "unserialisable_receipt" in odd["receipt"]


@pytest.mark.timeout(60)
def test_one_failing_module_does_not_stop_the_others(db: str, conn: psycopg.Connection,
                                                     tmp_path: Path) -> None:
    from pgfence import plan

    conn.execute("CREATE FUNCTION public.ok(p jsonb) RETURNS jsonb LANGUAGE sql AS 'SELECT p'")
    plan.register_action(conn, "ok", "public.ok(jsonb)", "returns its args")
    pid = plan.propose(conn, [{"action": "ok", "args": {"n": 1}}], "agent")
    assert plan.approve(conn, pid, "alice") == "approved"
    # break the outbox claim: every outbox sweep now fails
    conn.execute("ALTER FUNCTION pgfence.outbox_claim(text, integer, text[], interval) RENAME TO outbox_claim_gone")
    proc = Proc(db, ["--route", "hooks=noop", "--plans", "start", *FAST], tmp_path / "exec.log")
    try:
        wait_for(lambda: scalar(db, "SELECT status FROM pgfence.plan_get(%s)", (pid,)) == "executed",
                 20, "the plan to run although the outbox module fails")
    finally:
        proc.terminate()
    assert "outbox claim failed" in proc.output()


@pytest.mark.timeout(90)
def test_bursts_of_notifies_are_all_claimed_without_the_sweep(db: str, conn: psycopg.Connection,
                                                              webhook: WebhookReceiver,
                                                              tmp_path: Path) -> None:
    # A long poll interval: every message must go out on a NOTIFY. While the executor is idle a
    # NOTIFY is claimed on the listener's own connection; NOTIFYs that arrive during that claim
    # (or in the same read) must not be lost, or their messages would wait for the 60 s sweep.
    proc = Proc(db, ["--route", "hooks=webhook", "--worker-id", "burst", "--poll-interval", "60",
                     "--reap-interval", "60"], tmp_path / "exec.log")
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pg_stat_activity"
                                " WHERE application_name = 'pgfence-listener:burst'"), 20,
                 "the listener connection")
        started = time.monotonic()
        ids: list[int] = []
        for burst in range(6):
            ids += [outbox.enqueue(conn, "hooks", f"{webhook.url}/ok", {"n": burst * 10 + i})
                    for i in range(1 + burst * 2)]
            time.sleep(0.1 * (burst % 3))  # idle gaps and back-to-back bursts
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'")
                 == len(ids), 30, "every message delivered")
        took = time.monotonic() - started
        attempts = scalar(db, "SELECT max(attempts) FROM pgfence.outbox")
    finally:
        assert proc.terminate() == 0
    assert took < 30, f"delivered in {took:.1f}s: some NOTIFY was lost (the sweep is 60 s away)"
    assert attempts == 1, "each message claimed once"


@pytest.mark.timeout(60)
def test_a_quick_wake_up_is_settled_and_claimed_again_on_the_listeners_session(
        db: str, conn: psycopg.Connection, tmp_path: Path) -> None:
    # A wake-up whose delivery is already done when its claim round ends records the outcome
    # and claims again on the listener's own session (outbox_settle_and_claim), as a plain SQL
    # loop does: no pooled call per wake-up, and the next wake-up finds the module idle.
    proc = Proc(db, ["--route", "quick=noop", "--worker-id", "lsettle", "--poll-interval", "60",
                     "--reap-interval", "60"], tmp_path / "exec.log")
    listener = ("SELECT query FROM pg_stat_activity"
                " WHERE application_name = 'pgfence-listener:lsettle'")
    try:
        wait_for(lambda: scalar(db, listener), 20, "the listener connection")
        time.sleep(0.3)  # the start-up self-check and first sweep done: idle
        ids = []
        for i in range(3):
            mid = outbox.enqueue(conn, "quick", "r", {"n": i})
            ids.append(mid)
            wait_for(lambda mid=mid: status(db, mid) == "sent", 10, "the wake-up's delivery")
            # the listener's last statement: the settle of this wake-up (and an empty claim)
            wait_for(lambda: "outbox_settle_and_claim" in str(scalar(db, listener)), 5,
                     f"the listener's session to record wake-up {i}")
            time.sleep(0.1)
        pooled = scalar(db, "SELECT count(*) FROM pg_stat_activity"
                            " WHERE application_name = 'pgfence-executor:lsettle'"
                            " AND query LIKE '%%outbox_settle_and_claim%%'")
        attempts = scalar(db, "SELECT max(attempts) FROM pgfence.outbox")
    finally:
        assert proc.terminate() == 0
    assert pooled == 0, "no wake-up outcome was recorded on a pooled connection"
    assert attempts == 1, "each message claimed once"
