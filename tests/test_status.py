"""``pgfence status`` for alerting, against a real database and real executor processes: exit 0
when healthy, 1 with a stuck item or an unserved queue, 2 when the database cannot be reached;
the JSON fields; the 1/5/15-minute rates; ``--watch`` frames during a real drain, bounded by
``--count``, and Ctrl-C (SIGINT) ending it without a traceback."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from pgfence import outbox
from pgfence.cli import main
from support import FAST, Proc, scalar, wait_for


def status(dsn: str, *args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["--dsn", dsn, "status", *args], catch_exceptions=False)
    return result.exit_code, result.output


def test_healthy_is_0_with_the_json_fields(db: str, conn: psycopg.Connection, tmp_path: Path) -> None:
    code, text = status(db)
    assert code == 0, text
    assert text.startswith("health: ok")
    proc = Proc(db, ["--worker-id", "st-ok", *FAST, "--route", "h=noop"], tmp_path / "ok.log")
    try:
        wait_for(lambda: "started" in proc.output(), 20, "the executor to start")
        for n in range(30):
            outbox.enqueue(conn, "h", "r", {"n": n})
        wait_for(lambda: outbox.get(conn, 30)["status"] == "sent", 20, "the drain")
        code, text = status(db, "--json")
    finally:
        assert proc.terminate() == 0, proc.output()
    assert code == 0, text
    out = json.loads(text)
    assert (out["health"], out["warnings"], out["unserved"]) == ("ok", [], [])
    (q,) = [q for q in out["queues"] if q["queue"] == "h"]
    assert (q["ready"], q["finished"], q["executors"], q["unserved"]) == (0, 30, 1, False)
    # 30 finished just now: the rates are those counts over 60, 300 and 900 seconds.
    assert (q["per_second_1m"], q["per_second_5m"], q["per_second_15m"]) == (0.5, 0.1, 0.03)
    (x,) = [x for x in out["executors"] if x["worker"] == "st-ok"]
    assert (x["status"], x["serves"]) == ("alive", {"outbox": ["h"]})


def test_a_stuck_item_or_an_unserved_queue_is_1(db: str, conn: psycopg.Connection) -> None:
    mid = outbox.enqueue(conn, "lonely", "r", {})
    code, text = status(db, "--json")
    assert code == 1, text
    assert json.loads(text)["warnings"] == [
        {"kind": "unserved", "message": "outbox lonely: 1 ready and no live executor serves it"}]
    outbox.claim(conn, "w-frozen", 1, ["lonely"])
    conn.execute("UPDATE pgfence.outbox SET lease_expires_at = now() - interval '1 minute' "
                 "WHERE id = %s", (mid,))
    code, text = status(db)
    assert code == 1
    assert "warning (stuck): 1 item(s) owned past their lease or heartbeat" in text
    assert "w-frozen" in text


def test_cannot_connect_is_2(tmp_path: Path) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dsn = f"postgresql://nobody@127.0.0.1:{port}/x"
    for args in ([], ["--json"], ["--watch", "--count", "1"]):
        code, text = status(dsn, *args)
        assert code == 2, text
        assert "pgfence: cannot reach the database" in text and "Traceback" not in text


@pytest.mark.timeout(90)
def test_watch_shows_a_drain_and_ctrl_c_ends_it(db: str, conn: psycopg.Connection,
                                                tmp_path: Path) -> None:
    conn.execute("SELECT pgfence.outbox_enqueue_many('w', ARRAY(SELECT 'r' FROM generate_series(1, 3000)),"
                 " ARRAY(SELECT '{}'::jsonb FROM generate_series(1, 3000)))")
    code, text = status(db, "--watch", "--json", "--interval", "0.2", "--count", "2")
    assert code == 1, text  # ready work, no executor
    frames = [json.loads(line) for line in text.splitlines()]
    assert len(frames) == 2 and frames[0]["unserved"] == 1
    assert frames[1]["queues"][0]["ready"] == 3000 and frames[1]["queues"][0]["eta"] is None
    proc = Proc(db, ["--worker-id", "st-w", *FAST, "--route", "w=noop"], tmp_path / "w.log")
    watch = subprocess.Popen([sys.executable, "-m", "pgfence", "--dsn", db, "status", "--watch",
                              "--json", "--interval", "0.2"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM pgfence.outbox WHERE status = 'sent'")
                 == 3000, 60, "the drain")
        time.sleep(0.5)  # a frame after the drain
    finally:
        assert proc.terminate() == 0, proc.output()
        watch.send_signal(signal.SIGINT)
        out, err = watch.communicate(timeout=20)
    assert "Traceback" not in err, err
    assert watch.returncode in (0, 1)
    frames = [json.loads(line) for line in out.splitlines() if line.strip()]
    rates = [f["queues"][0]["per_second"] for f in frames if f["queues"]]
    assert max(rates) > 0, frames
    assert frames[-1]["queues"][0]["ready"] == 0 and frames[-1]["queues"][0]["finished"] == 3000
