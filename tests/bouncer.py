"""A real PgBouncer (Debian's ``pgbouncer`` package) in front of the test server, for the tests.

Its configuration lives in a temporary folder: it listens on a free 127.0.0.1 port, forwards
every database name to the test server (over its Unix socket or TCP, as ``$DATABASE_URL`` says),
trusts the test login (listed in its auth file, with its password if the DSN has one), and pools
in the given mode. PgBouncer refuses to run as root: as root it runs as the ``postgres`` user,
like the throwaway cluster. ``tools/ensure-system-deps.sh --pgtap`` (``make test``) installs it.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import psycopg
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from pgfence_demo.receivers import free_port

SERVER_USER = "postgres"


def pgbouncer_binary() -> str:
    """Where the pgbouncer program is; fails with what to install when it is missing."""
    found = shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.path.exists(p)), None)
    assert found, ("pgbouncer is needed for the pooler tests: `apt-get install pgbouncer` "
                   "(tools/ensure-system-deps.sh --pgtap does it as root)")
    return found


class PgBouncer:
    """Start with :meth:`start`, stop with :meth:`stop`; :meth:`dsn` gives a DSN through it."""

    def __init__(self, upstream_dsn: str, *, pool_mode: str = "transaction", pool_size: int = 2) -> None:
        self.upstream = conninfo_to_dict(upstream_dsn)
        self.pool_mode, self.pool_size = pool_mode, pool_size
        self.root = Path(tempfile.mkdtemp(prefix="pgfence-bouncer-"))
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def dsn(self, dbname: str) -> str:
        """A DSN to ``dbname`` through the pooler (same user and password as the upstream)."""
        params = {k: v for k, v in self.upstream.items() if k in ("user", "password") and v}
        return make_conninfo(host="127.0.0.1", port=str(self.port), dbname=dbname,
                             sslmode="disable", gssencmode="disable", **params)

    def _write_config(self) -> Path:
        host = str(self.upstream.get("host") or "/var/run/postgresql")
        port = str(self.upstream.get("port") or 5432)
        user = str(self.upstream.get("user") or os.environ.get("PGUSER") or pwd.getpwuid(os.getuid()).pw_name)
        password = str(self.upstream.get("password") or "")
        (self.root / "users.txt").write_text(f'"{user}" "{password}"\n')
        ini = self.root / "pgbouncer.ini"
        ini.write_text("\n".join([
            "[databases]",
            f"* = host={host} port={port}",
            "[pgbouncer]",
            "listen_addr = 127.0.0.1",
            f"listen_port = {self.port}",
            "unix_socket_dir =",
            "auth_type = trust",
            f"auth_file = {self.root / 'users.txt'}",
            f"pool_mode = {self.pool_mode}",
            f"default_pool_size = {self.pool_size}",
            "max_client_conn = 200",
            "server_login_retry = 1",
            f"logfile = {self.root / 'pgbouncer.log'}",
            f"pidfile = {self.root / 'pgbouncer.pid'}",
            "",
        ]))
        return ini

    def start(self) -> PgBouncer:
        """Start PgBouncer and wait (at most 15 s) until it answers a query."""
        ini = self._write_config()
        argv = [pgbouncer_binary(), str(ini)]
        if os.geteuid() == 0:
            pw = pwd.getpwnam(SERVER_USER)
            for path in (self.root, *self.root.iterdir()):
                os.chown(path, pw.pw_uid, pw.pw_gid)
            argv = ["runuser", "-u", SERVER_USER, "--", *argv]
        self.proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                with psycopg.connect(self.dsn("postgres"), autocommit=True, connect_timeout=2,
                                     prepare_threshold=None) as conn:
                    conn.execute("SELECT 1")
                return self
            except psycopg.OperationalError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise AssertionError(f"pgbouncer did not start:\n{self.log()}") from None
                time.sleep(0.1)

    def log(self) -> str:
        """PgBouncer's log so far."""
        path = self.root / "pgbouncer.log"
        return path.read_text() if path.exists() else ""

    def stop(self) -> None:
        """Stop it (SIGTERM, then SIGKILL after 10 s) and remove its folder."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        shutil.rmtree(self.root, ignore_errors=True)
