"""A throwaway PostgreSQL cluster for the demo, the tests and local development.

With no ``DATABASE_URL``, pgfence runs against a private cluster that it creates with the
machine's own PostgreSQL binaries: ``initdb`` into a fresh temporary folder, a server that
listens only on a Unix socket in that folder (no TCP port is opened), trust authentication for
the ``postgres`` superuser, and ``pg_ctl stop`` plus removal of the folder at the end.

Running as root: ``initdb`` and ``postgres`` refuse to run as root, so both are started as the
``postgres`` system user through ``runuser``. The folder lives under the system temp dir because
root's home is usually not readable by ``postgres``.

Binaries are found through ``$PGFENCE_PG_BINDIR``, then ``pg_config --bindir``, then the Debian
layout ``/usr/lib/postgresql/<major>/bin`` (highest major first), then ``$PATH``. When none is
found, :func:`find_bindir` raises :class:`PostgresNotFound` whose message says what to install;
:func:`install_postgres` installs the Debian packages when running as root.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from urllib.parse import quote

logger = logging.getLogger(__name__)

SERVER_USER = "postgres"


class PostgresNotFound(RuntimeError):
    """The PostgreSQL server binaries (initdb, pg_ctl, postgres) are not installed."""


class EmbeddedError(RuntimeError):
    """The throwaway cluster could not be created, started or stopped."""


def _is_root() -> bool:
    return os.geteuid() == 0


def _has_server_binaries(bindir: Path) -> bool:
    return all((bindir / name).is_file() for name in ("initdb", "pg_ctl", "postgres"))


def find_bindir() -> Path:
    """Return the folder holding ``initdb``, ``pg_ctl`` and ``postgres``.

    Looks at ``$PGFENCE_PG_BINDIR``, ``pg_config --bindir``, ``/usr/lib/postgresql/*/bin``
    (highest major first) and ``$PATH``, in that order.

    Raises:
        PostgresNotFound: none of those places has the server binaries; the message names the
            package to install.
    """
    candidates: list[Path] = []
    if env := os.environ.get("PGFENCE_PG_BINDIR"):
        candidates.append(Path(env))
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.CalledProcessError):
            out = subprocess.run(
                [pg_config, "--bindir"], check=True, capture_output=True, text=True
            ).stdout.strip()
            candidates.append(Path(out))
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        majors = sorted(
            (p for p in debian.iterdir() if p.name.isdigit()),
            key=lambda p: int(p.name),
            reverse=True,
        )
        candidates.extend(p / "bin" for p in majors)
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).resolve().parent)
    for bindir in candidates:
        if _has_server_binaries(bindir):
            return bindir
    raise PostgresNotFound(
        "PostgreSQL server binaries (initdb, pg_ctl, postgres) were not found.\n"
        "Install them, e.g. on Debian/Ubuntu: `sudo apt-get install postgresql` "
        "(or run `make deps` as root), or set DATABASE_URL to an existing database, "
        "or PGFENCE_PG_BINDIR to the folder holding initdb."
    )


def install_postgres() -> None:
    """Install the PostgreSQL server with apt when running as root on Debian.

    The Debian post-install step would create and start a ``main`` cluster; pgfence does not
    need one, so ``create_main_cluster = false`` is written first when no setting exists.

    Raises:
        PostgresNotFound: not root, or not a Debian-like system; the message says what to run.
    """
    if not _is_root() or not shutil.which("apt-get"):
        raise PostgresNotFound(
            "PostgreSQL server binaries are missing and cannot be installed automatically "
            "(needs root on Debian/Ubuntu). Run `sudo apt-get install postgresql`, or set "
            "DATABASE_URL to an existing database."
        )
    conf = Path("/etc/postgresql-common/createcluster.conf")
    if not conf.exists():
        conf.parent.mkdir(parents=True, exist_ok=True)
        conf.write_text("create_main_cluster = false\n")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(
        ["apt-get", "install", "-y", "-qq", "postgresql", "postgresql-contrib"],
        check=True,
        env=env,
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class ClusterInfo:
    """Where a running throwaway cluster lives: enough to reconnect to it or stop it."""

    root: str
    datadir: str
    socket_dir: str
    port: int
    bindir: str
    pid: int

    @property
    def url(self) -> str:
        """libpq URI of the ``postgres`` database as superuser ``postgres`` over the socket."""
        return database_url(self.socket_dir, self.port, "postgres")


def database_url(socket_dir: str, port: int, dbname: str) -> str:
    """Build a libpq URI for ``dbname`` on a Unix-socket cluster (user ``postgres``)."""
    return (
        f"postgresql:///{quote(dbname)}?host={quote(socket_dir, safe='')}"
        f"&port={port}&user={SERVER_USER}"
    )


class EmbeddedPostgres:
    """Create, start and stop one throwaway cluster.

    Args:
        durable: keep ``fsync`` on (benchmarks). Tests and the demo turn it off: a commit still
            reaches the operating system before it is acknowledged (``synchronous_commit`` stays
            on), so a killed or crash-restarted server loses nothing; only a machine crash could.
        settings: extra ``postgresql.conf`` settings, name → value.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, *, durable: bool = False, settings: dict[str, str] | None = None):
        self.durable = durable
        self.settings = dict(settings or {})
        self.info: ClusterInfo | None = None

    # -- helpers ---------------------------------------------------------------------------
    def _as_server_user(self, argv: list[str]) -> list[str]:
        if _is_root():
            return ["runuser", "-u", SERVER_USER, "--", *argv]
        return argv

    def _run(self, argv: list[str], what: str) -> None:
        proc = subprocess.run(
            self._as_server_user(argv), capture_output=True, text=True, check=False
        )
        if proc.returncode != 0:
            raise EmbeddedError(f"{what} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}")

    # -- lifecycle -------------------------------------------------------------------------
    def start(self) -> ClusterInfo:
        """Run initdb into a new temp folder and start the server on a Unix socket.

        Returns:
            ClusterInfo: paths, port and postmaster pid; ``info.url`` is the superuser URI.

        Raises:
            PostgresNotFound: no server binaries (see :func:`find_bindir`).
            EmbeddedError: initdb or pg_ctl failed; the message carries their output.
        """
        bindir = find_bindir()
        if _is_root():
            try:
                pw = pwd.getpwnam(SERVER_USER)
            except KeyError as exc:
                raise EmbeddedError(
                    f"running as root needs a '{SERVER_USER}' system user to run the server "
                    "(the Debian postgresql package creates it)"
                ) from exc
        root = Path(tempfile.mkdtemp(prefix="pgfence-pg-"))
        datadir = root / "data"
        sockdir = root / "sock"
        sockdir.mkdir()
        if _is_root():
            for p in (root, sockdir):
                os.chown(p, pw.pw_uid, pw.pw_gid)
        os.chmod(root, 0o700)
        os.chmod(sockdir, 0o700)
        try:
            self._run(
                [
                    str(bindir / "initdb"),
                    "-D", str(datadir),
                    "-U", SERVER_USER,
                    "--auth=trust",
                    "-E", "UTF8",
                    "--locale=C.UTF-8",
                    "--no-sync",
                ],
                "initdb",
            )
            port = _free_port()
            conf = {
                "listen_addresses": "''",
                "unix_socket_directories": f"'{sockdir}'",
                "port": str(port),
                "max_connections": "200",
                "shared_buffers": "'128MB'",
                "fsync": "on" if self.durable else "off",
                "full_page_writes": "on" if self.durable else "off",
                "log_min_messages": "warning",
                "logging_collector": "off",
                "timezone": "'UTC'",
            }
            conf.update(self.settings)
            with open(datadir / "postgresql.auto.conf", "a", encoding="utf-8") as fh:
                for key, value in conf.items():
                    fh.write(f"{key} = {value}\n")
            self._run(
                [
                    str(bindir / "pg_ctl"),
                    "-D", str(datadir),
                    "-l", str(root / "server.log"),
                    "-w", "-t", "60",
                    "start",
                ],
                "pg_ctl start",
            )
            pid = int((datadir / "postmaster.pid").read_text().splitlines()[0])
        except BaseException:
            self._cleanup(root, datadir, bindir)
            raise
        self.info = ClusterInfo(
            root=str(root),
            datadir=str(datadir),
            socket_dir=str(sockdir),
            port=port,
            bindir=str(bindir),
            pid=pid,
        )
        logger.info("embedded PostgreSQL started in %s (port %d)", root, port)
        return self.info

    def _cleanup(self, root: Path, datadir: Path, bindir: Path) -> None:
        if (datadir / "postmaster.pid").exists():
            subprocess.run(
                self._as_server_user(
                    [str(bindir / "pg_ctl"), "-D", str(datadir), "-m", "immediate", "-w", "stop"]
                ),
                capture_output=True,
                check=False,
            )
        shutil.rmtree(root, ignore_errors=True)

    def stop(self) -> None:
        """Stop the server (fast shutdown, then immediate if it hangs) and delete its folder."""
        if self.info is None:
            return
        stop_cluster(self.info)
        self.info = None

    def __enter__(self) -> ClusterInfo:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_cluster(info: ClusterInfo) -> None:
    """Stop a cluster described by ``info`` and remove its folder; safe to call twice."""
    bindir = Path(info.bindir)
    datadir = Path(info.datadir)
    pg_ctl = [str(bindir / "pg_ctl"), "-D", str(datadir), "-w", "-t", "30"]
    runner = EmbeddedPostgres()
    if (datadir / "postmaster.pid").exists():
        proc = subprocess.run(
            runner._as_server_user([*pg_ctl, "-m", "fast", "stop"]),
            capture_output=True,
            text=True,
            check=False,
        )
        if proc.returncode != 0:
            subprocess.run(
                runner._as_server_user([*pg_ctl, "-m", "immediate", "stop"]),
                capture_output=True,
                check=False,
            )
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(info.pid, signal.SIGKILL)
    shutil.rmtree(info.root, ignore_errors=True)
    logger.info("embedded PostgreSQL in %s stopped", info.root)


def restart_cluster(info: ClusterInfo, mode: str = "fast") -> int:
    """Restart the server in place (``mode`` is pg_ctl's: smart, fast or immediate).

    ``immediate`` is a crash: no checkpoint, WAL replay on start. Returns the new postmaster pid.
    """
    runner = EmbeddedPostgres()
    datadir = Path(info.datadir)
    runner._run(
        [
            str(Path(info.bindir) / "pg_ctl"),
            "-D", str(datadir),
            "-l", str(Path(info.root) / "server.log"),
            "-m", mode,
            "-w", "-t", "60",
            "restart",
        ],
        "pg_ctl restart",
    )
    info.pid = int((datadir / "postmaster.pid").read_text().splitlines()[0])
    return info.pid


# -- a dev cluster that outlives one command ------------------------------------------------
def state_file() -> Path:
    """Where ``pgfence db start`` records its cluster: ``.pgfence/devdb.json`` in the current
    directory (one dev cluster per project checkout), or under ``$PGFENCE_STATE_DIR``."""
    base = os.environ.get("PGFENCE_STATE_DIR") or str(Path.cwd() / ".pgfence")
    return Path(base) / "devdb.json"


def save_dev_cluster(info: ClusterInfo) -> None:
    """Record ``info`` as the running dev cluster (see :func:`state_file`)."""
    path = state_file()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(info), indent=2))


def load_dev_cluster() -> ClusterInfo | None:
    """Return the recorded dev cluster if its postmaster is still alive, else None."""
    path = state_file()
    if not path.exists():
        return None
    try:
        info = ClusterInfo(**json.loads(path.read_text()))
    except (ValueError, TypeError):
        return None
    pidfile = Path(info.datadir) / "postmaster.pid"
    if not pidfile.exists():
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        info.pid = int(pidfile.read_text().splitlines()[0])  # the server may have been restarted
    try:
        os.kill(info.pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        pass
    return info


def forget_dev_cluster() -> None:
    """Remove the dev cluster record."""
    with contextlib.suppress(FileNotFoundError):
        state_file().unlink()


@contextlib.contextmanager
def throwaway_cluster(*, durable: bool = False) -> Iterator[ClusterInfo]:
    """Context manager: a started cluster that is stopped and deleted on exit (also on SIGTERM)."""
    pg = EmbeddedPostgres(durable=durable)
    info = pg.start()

    def _on_term(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, _on_term)
    try:
        yield info
    finally:
        signal.signal(signal.SIGTERM, previous)
        pg.stop()


if __name__ == "__main__":  # pragma: no cover - manual check
    logging.basicConfig(level=logging.INFO)
    with throwaway_cluster() as ci:
        print(ci.url)
        sys.stdout.flush()
