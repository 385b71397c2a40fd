"""``pgfence demo``: the main job on a real PostgreSQL, scene by scene, with its checks.

This package is not part of the runtime ``pgfence`` package and not in its wheel: it holds what
the demo and the tests run beside pgfence, and ships with the source (an editable install of the
checkout, which ``make demo`` and ``make test`` make, puts ``glue/`` on ``sys.path``):

- the scenes: each module ``pgfence_demo.<name>`` listed in :data:`SCENES` has ``TITLE: str`` and
  ``run(ctx: DemoContext) -> None``. A scene drives real processes (the executor as a subprocess
  it may SIGKILL), real receivers and the SQL functions, prints what happens, and states its
  expectations with :meth:`DemoContext.check`. The demo exits non-zero if any check failed, and
  always stops what it started (executors, receivers, the cluster);
- the stand-ins for the world outside: :mod:`.receivers` (a webhook receiver and an SMTP sink),
  :mod:`.simulator` (a slow-operations HTTP service, ``pgfence op simulator``) and
  :mod:`.faults` (:class:`~pgfence_demo.faults.FaultyLink`, a TCP proxy in front of PostgreSQL
  that drops, holds or black-holes traffic).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import click
import psycopg
from tabulate import tabulate

from .receivers import SmtpSink, WebhookReceiver

#: Scenes in the order they run. A module that is not installed is reported and skipped.
SCENES: list[str] = ["outbox", "plan", "operation", "document", "web"]


class ExecutorProcess:
    """An executor subprocess whose log lines are echoed with a ``[name]`` prefix."""

    def __init__(self, name: str, dsn: str, args: Sequence[str]) -> None:
        self.name = name
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "pgfence", "--dsn", dsn, "executor",
             "--worker-id", name, "--metrics-port", "0", *args],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
        )
        self.lines: list[str] = []
        #: Its /metrics URL once it logged it (every demo executor serves one on a free port).
        self.metrics_url: str | None = None
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            line = line.rstrip()
            self.lines.append(line)
            # drop the timestamp and logger name: the demo reads like a story
            text = line.split(": ", 1)[1] if ": " in line else line
            if text.startswith("metrics on http"):
                self.metrics_url = text.split()[2]
                text = click.style(f"{text}  — try: curl -s {self.metrics_url}", bold=True)
            click.echo(click.style(f"    [{self.name}] ", fg="cyan") + text)

    @property
    def pid(self) -> int:
        """OS process id."""
        return self.proc.pid

    def kill(self) -> None:
        """SIGKILL: no cleanup at all, like a crashed machine or an OOM kill."""
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(timeout=10)
        self._reader.join(timeout=5)

    def terminate(self, timeout: float = 30.0) -> int:
        """SIGTERM and wait: the executor stops claiming and finishes in-flight work."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        code = self.proc.wait(timeout=timeout)
        self._reader.join(timeout=5)
        return code


@dataclass
class DemoContext:
    """What a scene gets: the database, the receivers, output and check helpers."""

    dsn: str
    webhook: WebhookReceiver
    smtp: SmtpSink
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    failures: list[str] = field(default_factory=list)
    checks: int = 0
    _executors: list[ExecutorProcess] = field(default_factory=list)

    # -- output ------------------------------------------------------------------------
    def section(self, title: str) -> None:
        """A scene heading."""
        click.echo("\n" + click.style(f"== {title} ", bold=True).ljust(90, "="))

    def step(self, text: str) -> None:
        """One narrated step."""
        click.echo(click.style("-> ", fg="yellow") + text)

    def table(self, rows: Sequence[Sequence[Any]], headers: Sequence[str]) -> None:
        """Print a table, indented."""
        text = tabulate([list(r) for r in rows], headers=list(headers))
        click.echo("\n".join("   " + line for line in text.splitlines()))

    def check(self, ok: bool, what: str) -> bool:
        """Record one expectation; printed as ✔ / ✘; a ✘ makes the demo exit non-zero."""
        self.checks += 1
        if ok:
            click.echo(click.style("   ✔ ", fg="green") + what)
        else:
            click.echo(click.style("   ✘ ", fg="red", bold=True) + what)
            self.failures.append(what)
        return ok

    # -- resources ---------------------------------------------------------------------
    def connect(self) -> psycopg.Connection[Any]:
        """A new autocommit connection to the demo database."""
        return psycopg.connect(self.dsn, autocommit=True)

    def start_executor(self, name: str, *args: str) -> ExecutorProcess:
        """Start ``pgfence executor --worker-id NAME ARGS…`` as a subprocess (stopped at exit)."""
        proc = ExecutorProcess(name, self.dsn, args)
        self._executors.append(proc)
        self.step(f"started executor {name} (pid {proc.pid})")
        return proc

    def wait_until(self, predicate: Callable[[], bool], timeout: float, what: str,
                   interval: float = 0.05) -> bool:
        """Poll ``predicate`` until true or ``timeout`` seconds pass; returns the last result."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if predicate():
                return True
            time.sleep(interval)
        ok = predicate()
        if not ok:
            self.step(click.style(f"gave up after {timeout:.0f}s waiting for {what}", fg="red"))
        return ok

    def stop_executors(self) -> None:
        """Stop every executor this demo started (SIGTERM, then SIGKILL)."""
        for proc in self._executors:
            if proc.proc.poll() is None:
                try:
                    proc.terminate(timeout=15)
                except subprocess.TimeoutExpired:
                    proc.kill()


@contextlib.contextmanager
def _receivers() -> Iterator[tuple[WebhookReceiver, SmtpSink]]:
    webhook = WebhookReceiver()
    try:
        smtp = SmtpSink()
        try:
            yield webhook, smtp
        finally:
            smtp.close()
    finally:
        webhook.close()


def run_demo(dsn: str, scenes: Sequence[str] | None = None) -> int:
    """Migrate ``dsn``, run the scenes, print the verdict; return the process exit code."""
    from pgfence.migrate import migrate

    result = migrate(dsn)
    click.echo(f"database migrated (schema version {result.schema_version})")
    with _receivers() as (webhook, smtp):
        ctx = DemoContext(dsn=dsn, webhook=webhook, smtp=smtp)
        click.echo(f"webhook receiver on {webhook.url}, SMTP sink on 127.0.0.1:{smtp.port}")
        ran: list[str] = []
        try:
            for name in scenes or SCENES:
                try:
                    scene = importlib.import_module(f"{__name__}.{name}")
                except ModuleNotFoundError as exc:
                    if exc.name != f"{__name__}.{name}":
                        raise
                    ctx.check(False, f"scene {name!r} is not installed")
                    continue
                ctx.section(scene.TITLE)
                scene.run(ctx)
                ctx.stop_executors()
                ran.append(name)
        finally:
            ctx.stop_executors()
    click.echo("")
    if ctx.failures:
        click.echo(click.style(f"DEMO FAILED: {len(ctx.failures)} of {ctx.checks} checks failed:",
                               fg="red", bold=True))
        for failure in ctx.failures:
            click.echo(f"  - {failure}")
        return 1
    click.echo(click.style(f"DEMO OK: {ctx.checks} checks passed in scenes {', '.join(ran)}.",
                           fg="green", bold=True))
    return 0
