"""Crash tests for long external operations, with real processes.

The simulator and the executors are separate processes (``python -m
pgfence_demo.simulator`` and ``python -m pgfence executor``). An executor is killed with
SIGKILL (a) after recording its intent but before the reference, (b) after the reference while
it polls, (c) while it finishes; a second executor then takes over. Both simulator modes are
run: ``idempotent`` (the handler passes the idempotency key, the service honours it) and
``plain`` (no key). The assertions are the design's promises: how many times the external
operation was started (counted by the simulator) and the final state.

A last test stops the owner with SIGSTOP past its lease: after the takeover it can no longer
write anything.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psycopg
import pytest

from pgfence import operation as op_api

pytestmark = pytest.mark.slow

KIND = "crash.reset"
LEASE = 3.0  # seconds; a killed owner's operation is taken over about this long after


@contextmanager
def simulator(mode: str, log: Path, *, queue_time: float, run_time: float) -> Iterator[str]:
    """Run the simulator in its own process; yield its base URL."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "pgfence_demo.simulator", "--port", "0", "--mode", mode,
         "--queue-time", str(queue_time), "--run-time", str(run_time)],
        stdout=subprocess.PIPE, stderr=log.open("w"), text=True)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()  # "pgfence simulator (...) listening on http://..."
        assert "listening on " in line, f"simulator did not start: {line!r} {log.read_text()}"
        yield line.strip().rsplit(" ", 1)[-1]
    finally:
        proc.terminate()
        proc.wait(10)


def sim_stats(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"{url}/stats", timeout=5) as resp:
        data: dict[str, Any] = json.load(resp)
    return data


def start_executor(db: str, url: str, idempotent: bool, worker: str,
                   log: Path) -> subprocess.Popen[bytes]:
    """``python -m pgfence executor`` serving KIND with the simulator handler."""
    handler = f"simulator:{url}?idempotent={int(idempotent)}&poll=0.2"
    return subprocess.Popen(
        [sys.executable, "-m", "pgfence", "--dsn", db, "executor",
         "--op-kind", f"{KIND}={handler}", "--op-lease", str(LEASE), "--poll-interval", "0.3",
         "--reap-interval", "0.5", "--worker-id", worker, "--log-level", "info"],
        stdout=log.open("w"), stderr=subprocess.STDOUT)


def row_of(db: str, operation_id: int) -> dict[str, Any]:
    with psycopg.connect(db, autocommit=True) as conn:
        return op_api.get(conn, operation_id)


def wait_for(db: str, operation_id: int, pred: Callable[[dict[str, Any]], bool],
             timeout: float, what: str, logs: list[Path]) -> dict[str, Any]:
    """Poll the operation row until ``pred`` holds (bounded)."""
    deadline = time.monotonic() + timeout
    while True:
        row = row_of(db, operation_id)
        if pred(row):
            return row
        if time.monotonic() > deadline:
            dump = "\n".join(f"--- {p.name}\n{p.read_text()}" for p in logs if p.exists())
            raise AssertionError(f"timed out waiting for {what}; row: {row}\n{dump}")
        time.sleep(0.03)


def sigkill(proc: subprocess.Popen[bytes]) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(10) == -signal.SIGKILL


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)


def events(db: str, operation_id: int) -> list[tuple[str, str, int]]:
    with psycopg.connect(db, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT event, actor, fence FROM pgfence.event WHERE module = 'operation'"
            " AND item_id = %s ORDER BY id", (operation_id,)).fetchall()
    return [(str(e), str(a), int(f)) for e, a, f in rows]


# Per case: simulator timings, per-operation overrides (params.sim), and the kill point as a
# predicate on (operation row, the simulator's counters for the target).
CASES: dict[str, dict[str, Any]] = {
    "a_intent_before_reference": {
        "queue_time": 0.3, "run_time": 0.5, "sim": {"start_delay": 1.5},
        # the call reached the service (it is sleeping before its answer): outcome unknown
        "kill_when": lambda r, sim: r["issue_started_at"] is not None
        and r["external_ref"] is None and sim["start_requests"] >= 1,
    },
    "b_reference_while_polling": {
        "queue_time": 0.5, "run_time": 3.0, "sim": {},
        "kill_when": lambda r, sim: r["external_ref"] is not None and r["poll_count"] >= 2,
    },
    "c_during_finish": {
        "queue_time": 0.2, "run_time": 0.5, "sim": {"result_delay": 1.2},
        "kill_when": lambda r, sim: r["status"] == "running"
        and (r["external_state"] or {}).get("status") == "done",
    },
}


@pytest.mark.timeout(90)
@pytest.mark.parametrize("mode", ["idempotent", "plain"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_executor_killed(db: str, tmp_path: Path, case: str, mode: str) -> None:
    spec = CASES[case]
    idempotent = mode == "idempotent"
    target = f"branch-{case[0]}-{mode}"
    logs = [tmp_path / "simulator.log", tmp_path / "exec1.log", tmp_path / "exec2.log"]
    with simulator(mode, logs[0], queue_time=spec["queue_time"], run_time=spec["run_time"]) as url:
        with psycopg.connect(db, autocommit=True) as conn:
            req = op_api.request(conn, KIND, target, {"from": "main", "sim": spec["sim"]},
                                 idempotency_key=f"key-{target}")
        exec1 = start_executor(db, url, idempotent, "exec-1", logs[1])
        exec2: subprocess.Popen[bytes] | None = None
        try:
            at_kill = wait_for(
                db, req.id,
                lambda r: spec["kill_when"](r, sim_stats(url)["by_target"].get(
                    target, {"start_requests": 0, "starts": 0})),
                20, f"kill point {case}", logs)
            sigkill(exec1)
            assert at_kill["locked_by"] == "exec-1" and at_kill["fence"] == 1
            exec2 = start_executor(db, url, idempotent, "exec-2", logs[2])
            final = wait_for(db, req.id, lambda r: r["status"] in op_api.TERMINAL,
                             LEASE + 25, "the end", logs)
        finally:
            stop(exec1)
            if exec2 is not None:
                stop(exec2)
        stats = sim_stats(url)["by_target"][target]

    if case.startswith("a") and not idempotent:
        # The start call may have reached the service; without a key, calling again could
        # start a second operation: never re-issued, failed for a person to check.
        assert final["status"] == "failed", final
        assert final["result"]["reason"] == "outcome_unknown"
        assert final["error"].startswith("outcome unknown: exec-1 started the external")
        assert final["issue_count"] == 1
        assert stats == {"start_requests": 1, "starts": 1}
        return
    assert final["status"] == "succeeded", final
    assert stats["starts"] == 1, stats  # the external operation was started exactly once
    if case.startswith("a"):
        # re-issued with the same key; the service recognised it and started nothing new
        assert (final["issue_count"], stats["start_requests"]) == (2, 2)
    else:
        # a new owner that finds a reference only polls
        assert (final["issue_count"], stats["start_requests"]) == (1, 1)
    assert final["fence"] == 2 and final["locked_by"] == "exec-2"
    assert final["external_ref"] == (at_kill["external_ref"] or final["external_ref"])
    assert final["result"]["result"]["params"] == {"from": "main"}
    trail = events(db, req.id)
    assert ("takeover", "exec-2", 2) in trail, trail
    assert [e for e in trail if e[0] in ("issue", "reissue")] == (
        [("issue", "exec-1", 1), ("reissue", "exec-2", 2)] if case.startswith("a")
        else [("issue", "exec-1", 1)])


@pytest.mark.timeout(90)
def test_stalled_owner_cannot_write_after_takeover(db: str, tmp_path: Path) -> None:
    """SIGSTOP the owner while it polls, past its lease: a second executor takes over and
    finishes; the first, resumed, is fenced out and changes nothing."""
    logs = [tmp_path / "simulator.log", tmp_path / "exec1.log", tmp_path / "exec2.log"]
    with simulator("plain", logs[0], queue_time=0.2, run_time=2.5) as url:
        with psycopg.connect(db, autocommit=True) as conn:
            req = op_api.request(conn, KIND, "branch-stalled")
        exec1 = start_executor(db, url, False, "exec-1", logs[1])
        exec2: subprocess.Popen[bytes] | None = None
        try:
            wait_for(db, req.id, lambda r: r["poll_count"] >= 2, 20, "polling", logs)
            os.kill(exec1.pid, signal.SIGSTOP)
            exec2 = start_executor(db, url, False, "exec-2", logs[2])
            done = wait_for(db, req.id, lambda r: r["status"] in op_api.TERMINAL,
                            LEASE + 25, "the takeover's end", logs)
            os.kill(exec1.pid, signal.SIGCONT)
            time.sleep(1.5)  # the resumed owner polls at least once and must be refused
            after = row_of(db, req.id)
        finally:
            os.kill(exec1.pid, signal.SIGCONT)
            stop(exec1)
            if exec2 is not None:
                stop(exec2)
        stats = sim_stats(url)["by_target"]["branch-stalled"]
    assert (done["status"], done["fence"], done["locked_by"]) == ("succeeded", 2, "exec-2")
    assert after == done  # not one column changed after the stalled owner woke up
    assert stats == {"start_requests": 1, "starts": 1}
    trail = events(db, req.id)
    takeover = next(i for i, e in enumerate(trail) if e[0] == "takeover")
    assert all(fence == 2 for _, _, fence in trail[takeover:]), trail
    assert "lease lost" in logs[1].read_text()
