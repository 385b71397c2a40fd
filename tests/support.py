"""Helpers for the tests: run executors as real subprocesses, wait boundedly, read real plans."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgfence.db import create_database
from pgfence.executor import Executor, ExecutorConfig, Module
from pgfence.migrate import migrate
from pgfence.operation.handlers import ExternalState, Issued

TESTS = Path(__file__).resolve().parent

#: Executor options for tests: short poll and reaper intervals, a short grace.
FAST = ["--poll-interval", "0.5", "--reap-interval", "0.3", "--grace", "10"]


class Proc:
    """An executor subprocess with its combined output in a log file."""

    def __init__(self, dsn: str, args: Sequence[str], log: Path, env: dict[str, str] | None = None):
        self.log = log
        self._fh = open(log, "w")  # noqa: SIM115 - closed in wait()
        full_env = dict(os.environ, PYTHONUNBUFFERED="1",
                        PYTHONPATH=os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]))
        full_env.update(env or {})
        self.popen = subprocess.Popen(
            [sys.executable, "-m", "pgfence", "--dsn", dsn, "executor", *args],
            stdout=self._fh, stderr=subprocess.STDOUT, env=full_env)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def signal(self, sig: int) -> None:
        self.popen.send_signal(sig)

    def kill(self) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGKILL)
        self.wait(10)

    def terminate(self, timeout: float = 30) -> int:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
        return self.wait(timeout)

    def wait(self, timeout: float) -> int:
        try:
            return self.popen.wait(timeout=timeout)
        finally:
            self._fh.close()

    def output(self) -> str:
        return self.log.read_text()


#: The non-superuser login that installs the test databases (see :func:`install_as_owner`).
OWNER = "fence_test_owner"

#: What a superuser runs once so that a login without CREATEROLE can install pgfence (README,
#: "Installing without a superuser"); ``{owner}`` is that login.
BOOTSTRAP = """
DO $$
DECLARE r text;
BEGIN
  FOREACH r IN ARRAY ARRAY['pgfence_client', 'pgfence_executor', 'pgfence_admin', 'pgfence_definer', '{owner}'] LOOP
    IF NOT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = r) THEN
      EXECUTE format('CREATE ROLE %I %s', r, CASE WHEN r = '{owner}' THEN 'LOGIN' ELSE 'NOLOGIN' END);
    END IF;
  END LOOP;
END $$;
GRANT pgfence_definer TO {owner};
"""


def with_user(dsn: str, user: str) -> str:
    """``dsn`` with another login (same server, database and other parameters)."""
    params = conninfo_to_dict(dsn)
    params["user"] = user
    params.pop("password", None)
    return make_conninfo("", **params)


def owned_database(admin_dsn: str, name: str, owner: str = OWNER) -> str | None:
    """Create database ``name`` owned by the non-superuser login ``owner``; return its admin DSN.

    The admin (a superuser) first runs :data:`BOOTSTRAP`: pgfence's roles and the login, made a
    member of pgfence_definer, as the README tells a DBA to do once; the login has no
    CREATEROLE. Returns None (and creates nothing) when the admin is not a superuser.
    """
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
        if not (row and row[0]):
            return None
        conn.execute(BOOTSTRAP.format(owner=owner).encode())
        conn.execute(sql.SQL("CREATE DATABASE {} OWNER {}").format(sql.Identifier(name), sql.Identifier(owner)))
    return make_conninfo("", **{**conninfo_to_dict(admin_dsn), "dbname": name})


def install_as_owner(admin_dsn: str, name: str, owner: str = OWNER) -> str:
    """Create database ``name`` (:func:`owned_database`) and migrate it as ``owner``; return the
    database's DSN for the admin login. When the admin is not a superuser (``DATABASE_URL`` of a
    role that may only create databases), the admin creates and installs it instead."""
    dsn = owned_database(admin_dsn, name, owner)
    if dsn is None:
        dsn = create_database(admin_dsn, name)
        migrate(dsn)
        return dsn
    migrate(with_user(dsn, owner))
    return dsn


def psql_file(dsn: str, path: Path, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """``psql -X -v ON_ERROR_STOP=1 -f path`` against ``dsn``; output captured, never raises."""
    return subprocess.run(["psql", "-X", "-q", "-v", "ON_ERROR_STOP=1", "-d", dsn, "-f", str(path)],
                          capture_output=True, text=True, timeout=timeout, check=False)


def wait_for(predicate: Callable[[], Any], timeout: float, what: str,
             interval: float = 0.05) -> Any:
    """Poll until ``predicate()`` is truthy; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def scalar(dsn: str, query: str, params: Sequence[Any] = ()) -> Any:
    """Run one query on a fresh autocommit connection and return the first column of row 1."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, params).fetchone()
    return None if row is None else row[0]


class InstantOperation:
    """An operation handler whose external operation has ended by its first poll."""

    idempotent = True
    poll_interval = 0.05
    can_cancel = False

    async def issue(self, op: Any) -> Issued:
        return Issued(f"ext-{op.id}")

    async def poll(self, op: Any, ref: str) -> ExternalState:
        return ExternalState("succeeded", {"ref": ref})

    async def cancel(self, op: Any, ref: str) -> None:
        return None

    async def finish(self, op: Any, ref: str, state: ExternalState) -> dict[str, Any] | None:
        return {"done": ref}

    async def aclose(self) -> None:
        return None


async def executor_until(db: str, module: Module, done: Callable[[], bool], *,
                         reap_interval: float = 0.5, timeout: float = 30.0,
                         config: ExecutorConfig | None = None) -> None:
    """Run an in-process executor serving ``module`` until ``done()`` (checked every 50 ms), then
    stop it and wait for it to finish; fails after ``timeout`` seconds. ``config`` replaces
    the short default settings (poll 0.2 s, grace 5 s)."""
    executor = Executor(db, [module], config or ExecutorConfig(
        poll_interval=0.2, reap_interval=reap_interval, grace=5.0))
    task = asyncio.create_task(executor.run())
    try:
        async with asyncio.timeout(timeout):
            while not done():
                await asyncio.sleep(0.05)
    finally:
        executor.stop()
        await asyncio.wait_for(task, 15)


class PlanScans:
    """The scans in the plans a call really runs, read with auto_explain.

    auto_explain (loaded into this session; needs a superuser connection) logs the plan of every
    statement the call runs, nested ones included: the statements of PL/pgSQL functions and
    triggers, with the plan each one really used (custom or generic). :meth:`scans` runs one
    query and returns its rows and the names of the scans of ``relations`` in those plans: an
    index scan by its index name; with ``walks``, one without an index condition (it reads the
    index in its order until a LIMIT stops it, or all of it) as ``<index> (walk)``; a bitmap
    scan as ``Bitmap(<index>|...)``; a sequential scan as ``Seq Scan``. With ``probes`` (index
    name -> column), a scan of that index whose index condition does not name the column (it
    reads a range of the index for every row of its caller instead of probing one entry: e.g. a
    materialized scan of a whole channel's keys, filtered per key) as ``<index> (without <column>)``.
    """

    def __init__(self, conn: psycopg.Connection[Any], relations: set[str], *,
                 walks: bool = False, probes: dict[str, str] | None = None) -> None:
        self.conn, self.relations, self.walks = conn, relations, walks
        self.probes = probes or {}
        self.notices: list[str] = []
        conn.add_notice_handler(lambda d: self.notices.append(d.message_primary or ""))
        try:
            conn.execute("LOAD 'auto_explain'")
        except psycopg.errors.InsufficientPrivilege:
            # make test connects as a superuser; a plan test that cannot read plans must fail,
            # not pass by skipping
            pytest.fail("LOAD 'auto_explain' needs a superuser connection", pytrace=False)
        for setting in ("auto_explain.log_min_duration = 0", "auto_explain.log_nested_statements = on",
                        "auto_explain.log_level = notice", "auto_explain.log_format = json"):
            conn.execute(f"SET {setting}")

    def _names(self, node: dict[str, Any]) -> Iterator[str]:
        kind = node["Node Type"]
        if node.get("Relation Name") in self.relations and kind.endswith("Scan"):
            if kind == "Bitmap Heap Scan":
                yield "Bitmap({})".format("|".join(sorted(self._indexes(node))))
            elif "Index Name" in node:
                walk = self.walks and "Index Cond" not in node
                column = self.probes.get(node["Index Name"])
                if column is not None and column not in node.get("Index Cond", ""):
                    yield f"{node['Index Name']} (without {column})"
                else:
                    yield node["Index Name"] + (" (walk)" if walk else "")
            else:
                yield kind
        for child in node.get("Plans", []):
            yield from self._names(child)

    def _indexes(self, node: dict[str, Any]) -> Iterator[str]:
        if "Index Name" in node:
            yield node["Index Name"]
        for child in node.get("Plans", []):
            yield from self._indexes(child)

    def scans(self, query: str, params: Sequence[Any] = ()) -> tuple[list[Any], set[str]]:
        self.notices.clear()
        rows = self.conn.execute(query, params).fetchall()
        found: set[str] = set()
        for message in self.notices:
            if "plan:" in message:
                found.update(self._names(json.loads(message.split("plan:", 1)[1])["Plan"]))
        return rows, found
