"""Installing pgfence as a user would, each on a new cluster of its own (no pgfence role yet):

- the built wheel in a new virtualenv: it holds the runtime package and nothing else (no demo
  scenes, simulator or fault proxy; ``pgfence demo`` says in one line what to install);
  ``pgfence migrate`` as a login that owns its database and has CREATEROLE (no superuser), then a
  client enqueues and an executor login delivers to a real webhook; ``psql -f`` of the wheel's ``schema/pgfence.sql`` into another database gives the same
  catalog and ``pgfence migrate`` then changes nothing; an install without its SQL files says so
  in one line;
- ``pgfence migrate`` as logins lacking one privilege each: one line naming the statement that
  grants it, which, run as given, lets the next migrate through;
- the sdist carries the SQL, and a wheel built from it too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
from pathlib import Path

import psycopg
import pytest

from catalog import catalog, diff
from pgfence import SCHEMA_VERSION, __version__
from pgfence.db import with_dbname
from pgfence.embedded import ClusterInfo
from pgfence_demo.receivers import WebhookReceiver
from support import psql_file, wait_for, with_user
from test_audit_docs import sql_blocks
from test_docs import BOOTSTRAP, README

ROOT = Path(__file__).resolve().parents[1]
SQL_FOLDERS = ("migrations", "functions", "schema")


def admin(info: ClusterInfo, *statements: str) -> None:
    """Run statements as the cluster's superuser, each in its own transaction."""
    with psycopg.connect(info.url, autocommit=True) as conn:
        for statement in statements:
            conn.execute(statement.encode())


def dsn(info: ClusterInfo, db: str, user: str) -> str:
    """The DSN of database ``db`` on the cluster, as login ``user``."""
    return with_user(with_dbname(info.url, db), user)


def run(exe: list[str], *args: str, env: dict[str, str] | None = None,
        cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    """Run a command (two minutes at most), output captured; never raises on its exit status."""
    return subprocess.run([*exe, *args], capture_output=True, text=True, timeout=120, check=False,
                          env=env, cwd=cwd)


def one_line_error(proc: subprocess.CompletedProcess[str]) -> str:
    """The CLI failed with exactly one line on stderr (no traceback); return it."""
    assert proc.returncode == 1, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


def build(kind: str, out: Path, source: Path = ROOT) -> Path:
    """Build a wheel (pip, from ``source``: the checkout or an sdist) or an sdist (hatchling)."""
    if kind == "sdist":
        proc = run([sys.executable, "-m", "hatchling", "build", "-t", "sdist", "-d", str(out)], cwd=ROOT)
        pattern = "*.tar.gz"
    else:
        proc = run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(out), str(source)])
        pattern = "*.whl"
    assert proc.returncode == 0, proc.stderr
    [built] = out.glob(pattern)
    return built


def wheel_sql(wheel: Path) -> set[str]:
    """The SQL package data a wheel holds."""
    with zipfile.ZipFile(wheel) as z:
        return {n for n in z.namelist() if n.startswith("pgfence/_sql/")}


def expected_sql() -> set[str]:
    """Where every file of the checkout's SQL folders must be in a wheel."""
    return {f"pgfence/_sql/{p.relative_to(ROOT)}" for f in SQL_FOLDERS for p in (ROOT / f).iterdir()
            if p.is_file() and p.suffix in (".sql", ".md")}


@pytest.mark.timeout(240)
def test_the_wheel_installs_migrates_and_delivers_from_a_fresh_venv(own_cluster: ClusterInfo, tmp_path: Path) -> None:
    wheel = build("wheel", tmp_path / "dist")
    assert wheel_sql(wheel) == expected_sql(), "the wheel carries every migration, function file and schema file"
    with zipfile.ZipFile(wheel) as z:
        shipped = set(z.namelist())
    tracked = subprocess.run(["git", "ls-files", "glue/pgfence"], cwd=ROOT, capture_output=True, text=True,
                             check=True).stdout.split()
    missing = {t.removeprefix("glue/") for t in tracked} - shipped
    assert not missing, f"every file of the package ships, static assets too: {sorted(missing)}"
    # ... and nothing else: the demo scenes, the receivers, the operation simulator and the
    # fault proxy (glue/pgfence_demo) are not production code and stay out of the wheel.
    assert {n.split("/", 1)[0] for n in shipped} == {"pgfence", f"pgfence-{__version__}.dist-info"}
    demo_files = subprocess.run(["git", "ls-files", "glue/pgfence_demo"], cwd=ROOT, capture_output=True,
                                text=True, check=True).stdout.split()
    assert "glue/pgfence_demo/simulator.py" in demo_files and "glue/pgfence_demo/faults.py" in demo_files
    for gone in ("pgfence/demo/", "pgfence/operation/simulator.py", "pgfence/documents/faults.py"):
        assert not any(n.startswith(gone) for n in shipped), f"{gone} is not in the wheel"

    # A new virtualenv with the wheel installed (not editable). Its dependencies come from this
    # test's environment through a .pth line, so the test needs no package index; the editable
    # install of the checkout there is not visible (a .pth line adds a folder, not its .pth files).
    venv = tmp_path / "venv"
    assert run([sys.executable, "-m", "venv", "--without-pip", str(venv)]).returncode == 0
    py = str(venv / "bin" / "python")
    proc = run([sys.executable, "-m", "pip", "--python", py, "install", "-q", "--no-deps", str(wheel)])
    assert proc.returncode == 0, proc.stderr
    site = Path(run([py, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    (site / "_deps_from_test.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PGFENCE_SQL_ROOT", "DATABASE_URL")}
    cli = [str(venv / "bin" / "pgfence")]
    where = run([py, "-c", "import pgfence, pgfence.paths as p; print(pgfence.__file__); print(p.sql_root())"],
                env=env, cwd=tmp_path)
    module, root = where.stdout.split()
    assert module.startswith(str(site)) and root == str(site / "pgfence" / "_sql"), where.stdout

    version = run(cli, "--version", env=env, cwd=tmp_path)
    assert version.stdout.strip() == f"pgfence {__version__} (schema version {SCHEMA_VERSION})"

    # Without the demo package, the commands that run it say in one line what to install.
    assert run([py, "-c", "import pgfence_demo"], env=env, cwd=tmp_path).returncode == 1
    for command in (["demo"], ["op", "simulator", "--port", "0"]):
        line = one_line_error(run(cli, *command, env=env, cwd=tmp_path))
        assert f"pgfence {' '.join(command[:2])} needs the package pgfence_demo" in line, line
        assert "install pgfence from its source checkout" in line and "make demo" in line, line

    # The database's owner, with CREATEROLE and nothing else, installs pgfence and its roles.
    admin(own_cluster, "CREATE ROLE ops LOGIN CREATEROLE", "CREATE DATABASE app OWNER ops",
          "CREATE DATABASE app_file OWNER ops")
    ops = dsn(own_cluster, "app", "ops")
    migrated = run(cli, "--dsn", ops, "migrate", env=env, cwd=tmp_path)
    assert migrated.returncode == 0, migrated.stderr
    assert f"schema version {SCHEMA_VERSION}" in migrated.stdout
    with psycopg.connect(ops, autocommit=True) as conn:
        conn.execute("CREATE ROLE shop LOGIN IN ROLE pgfence_client")
        conn.execute("CREATE ROLE worker LOGIN IN ROLE pgfence_executor")

    receiver = WebhookReceiver()
    executor = None
    try:
        with psycopg.connect(dsn(own_cluster, "app", "shop"), autocommit=True) as conn:
            [[mid]] = conn.execute(
                "SELECT pgfence.outbox_enqueue('orders', %s, '{\"order\": 42}', p_idempotency_key => 'order-42-created')",
                (receiver.url + "/hook",)).fetchall()
        executor = subprocess.Popen(
            [*cli, "--dsn", dsn(own_cluster, "app", "worker"), "executor", "--route", "orders=webhook?allow=127.0.0.1",
             "--poll-interval", "0.2", "--grace", "5"], env=env, cwd=tmp_path,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

        def status() -> str:
            with psycopg.connect(dsn(own_cluster, "app", "shop"), autocommit=True) as conn:
                row = conn.execute("SELECT status FROM pgfence.outbox_get(%s)", (mid,)).fetchone()
            return str(row[0]) if row else ""

        wait_for(lambda: status() == "sent", 30, "the executor to deliver the message")
        assert [h.key for h in receiver.hits] == ["order-42-created"]
    finally:
        if executor is not None:
            executor.terminate()
            output = executor.communicate(timeout=30)[0]
            assert executor.returncode == 0, output
        receiver.close()

    # The wheel's schema/pgfence.sql, into another database by the same login: the same catalog,
    # and migrate then records the migrations it held and applies nothing.
    schema = site / "pgfence" / "_sql" / "schema" / "pgfence.sql"
    installed = psql_file(dsn(own_cluster, "app_file", "ops"), schema)
    assert installed.returncode == 0, installed.stderr
    got, want = catalog(dsn(own_cluster, "app_file", "ops"), data=False), catalog(ops, data=False)
    assert got == want, diff(got, want)  # (app holds the delivered message: compare no rows)
    again = run(cli, "--dsn", dsn(own_cluster, "app_file", "ops"), "migrate", env=env, cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert "recorded as installed by schema/pgfence.sql" in again.stdout and "no pending migrations" in again.stdout
    assert catalog(dsn(own_cluster, "app_file", "ops"), yoyo=True, data=False) == catalog(ops, yoyo=True, data=False)

    # An install whose SQL files are gone says so in one line.
    shutil.rmtree(site / "pgfence" / "_sql")
    line = one_line_error(run(cli, "--dsn", ops, "migrate", env=env, cwd=tmp_path))
    assert "SQL files" in line and "reinstall pgfence" in line


def statement_in(line: str) -> str:
    """The statement(s) an error line tells a superuser to run (after 'runs: ' / 'runs once: ')."""
    match = re.search(r"runs(?: once)?: (.+)$", line)
    assert match, line
    return match.group(1)


@pytest.mark.timeout(180)
def test_each_missing_privilege_is_one_line_naming_the_statement_to_run(own_cluster: ClusterInfo) -> None:
    cli = [sys.executable, "-m", "pgfence"]
    admin(own_cluster, "CREATE ROLE app_owner LOGIN", "CREATE DATABASE app OWNER app_owner")
    owner = dsn(own_cluster, "app", "app_owner")

    # No pgfence role exists and the login may not create roles: a superuser runs what it says.
    line = one_line_error(run(cli, "--dsn", owner, "migrate"))
    assert "may not create roles" in line
    fix = statement_in(line)
    assert fix == ("CREATE ROLE pgfence_client NOLOGIN; CREATE ROLE pgfence_executor NOLOGIN; "
                   "CREATE ROLE pgfence_admin NOLOGIN; CREATE ROLE pgfence_definer NOLOGIN; "
                   "GRANT pgfence_definer TO app_owner;")
    with psycopg.connect(owner) as conn:
        assert conn.execute("SELECT to_regnamespace('pgfence')").fetchone() == (None,), "nothing was changed"
    admin(own_cluster, fix)
    done = run(cli, "--dsn", owner, "migrate")
    assert done.returncode == 0, done.stderr

    # The roles exist; another database owner is not a member of pgfence_definer.
    admin(own_cluster, "CREATE ROLE other LOGIN", "CREATE DATABASE app2 OWNER other")
    line = one_line_error(run(cli, "--dsn", dsn(own_cluster, "app2", "other"), "migrate"))
    assert statement_in(line) == "GRANT pgfence_definer TO other"
    admin(own_cluster, statement_in(line))
    assert run(cli, "--dsn", dsn(own_cluster, "app2", "other"), "migrate").returncode == 0

    # A member of pgfence_definer without CREATE on the database.
    admin(own_cluster, "CREATE ROLE lowly LOGIN IN ROLE pgfence_definer", "CREATE DATABASE app3")
    line = one_line_error(run(cli, "--dsn", dsn(own_cluster, "app3", "lowly"), "migrate"))
    assert statement_in(line) == "GRANT CREATE ON DATABASE app3 TO lowly"
    admin(own_cluster, statement_in(line))
    assert run(cli, "--dsn", dsn(own_cluster, "app3", "lowly"), "migrate").returncode == 0

    # Schema pgfence belongs to another login: migrate says whose it is.
    line = one_line_error(run(cli, "--dsn", dsn(own_cluster, "app", "lowly"), "migrate"))
    assert "schema pgfence belongs to app_owner" in line and "run the install as app_owner" in line

    # Every database so installed has the same catalog, whoever installed it.
    assert catalog(dsn(own_cluster, "app2", "other"), yoyo=True) == catalog(owner, yoyo=True)
    assert catalog(dsn(own_cluster, "app3", "lowly"), yoyo=True) == catalog(owner, yoyo=True)


@pytest.mark.timeout(120)
def test_the_readme_bootstrap_lets_its_login_install(own_cluster: ClusterInfo, tmp_path: Path) -> None:
    """README's "Installing without a superuser" block, run as given by a superuser on a cluster
    without pgfence, is all its login needs: it then installs with no CREATEROLE."""
    [block] = [b for b in sql_blocks(README.read_text(encoding="utf-8")) if BOOTSTRAP in b]
    script = tmp_path / "bootstrap.sql"
    script.write_text(block)
    proc = psql_file(own_cluster.url, script)
    assert proc.returncode == 0, proc.stderr
    migrated = run([sys.executable, "-m", "pgfence", "--dsn", dsn(own_cluster, "app", "app_owner"), "migrate"])
    assert migrated.returncode == 0, migrated.stderr
    with psycopg.connect(dsn(own_cluster, "app", "app_owner")) as conn:
        row = conn.execute("SELECT rolsuper OR rolcreaterole FROM pg_roles WHERE rolname = current_user").fetchone()
        assert row == (False,)
        assert conn.execute("SELECT pgfence.schema_version()").fetchone() == (SCHEMA_VERSION,)


@pytest.mark.timeout(120)
def test_the_sdist_carries_the_sql_and_builds_a_wheel_that_does(tmp_path: Path) -> None:
    sdist = build("sdist", tmp_path / "sdist")
    with tarfile.open(sdist) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    for folder in SQL_FOLDERS:
        for path in (ROOT / folder).iterdir():
            assert f"{folder}/{path.name}" in names, f"the sdist lacks {folder}/{path.name}"
    assert "hatch_build.py" in names
    wheel = build("wheel", tmp_path / "dist", source=sdist)
    assert wheel_sql(wheel) == expected_sql()
