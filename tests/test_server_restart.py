"""The executor across a PostgreSQL crash-restart (pg_ctl restart -m immediate).

Uses a cluster of its own (whatever $DATABASE_URL says), because it restarts the server.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import psycopg
import pytest

from pgfence import outbox
from pgfence.embedded import ClusterInfo, restart_cluster
from pgfence.migrate import migrate
from pgfence_demo.receivers import WebhookReceiver
from support import Proc, scalar, wait_for


@pytest.mark.timeout(90)
def test_executor_survives_a_server_crash_restart(own_cluster: ClusterInfo, tmp_path: Path) -> None:
    dsn = own_cluster.url
    migrate(dsn)
    webhook = WebhookReceiver()
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            outbox.configure_channel(conn, "hooks", lease=dt.timedelta(seconds=20),
                                     backoff_base=dt.timedelta(milliseconds=100),
                                     backoff_cap=dt.timedelta(seconds=1))
            inflight = outbox.enqueue(conn, "hooks", f"{webhook.url}/slow?s=2", {"n": 1},
                                      idempotency_key="in-flight")
        proc = Proc(dsn, ["--route", "hooks=webhook", "--poll-interval", "0.5",
                          "--reap-interval", "0.5"], tmp_path / "exec.log")
        try:
            wait_for(lambda: webhook.count("in-flight") == 1, 20, "delivery in flight")
            # crash the server while the delivery is in flight: every connection dies
            restart_cluster(own_cluster, mode="immediate")
            with psycopg.connect(dsn, autocommit=True) as conn:
                after = outbox.enqueue(conn, "hooks", f"{webhook.url}/ok", {"n": 2},
                                       idempotency_key="after-restart")
            wait_for(lambda: scalar(dsn, "SELECT status FROM pgfence.outbox_get(%s)", (after,))
                     == "sent", 30, "a message enqueued after the restart to be delivered")
            wait_for(lambda: scalar(dsn, "SELECT status FROM pgfence.outbox_get(%s)", (inflight,))
                     == "sent", 30, "the in-flight outcome to be recorded after the restart")
        finally:
            assert proc.terminate() == 0, proc.output()
        with psycopg.connect(dsn) as conn:
            m = outbox.get(conn, inflight)
        assert m["attempts"] == 1, "recorded by the original attempt once the server was back"
        assert webhook.count("in-flight") == 1, "no redelivery was needed"
        assert "listener connection lost" in proc.output()
    finally:
        webhook.close()
