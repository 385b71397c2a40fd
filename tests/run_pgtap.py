"""Run the pgTAP suites with pg_prove against a fresh database installed by a non-superuser.

Usage: ``python tests/run_pgtap.py [pg_prove args] [files]`` with ``$DATABASE_URL`` pointing at
a server where the user may create databases (``make test`` starts a throwaway one). Creates
``pgfence_pgtap_<pid>`` owned by the login ``support.OWNER`` — not a superuser, no CREATEROLE —
and migrates it as that login (``support.install_as_owner``), installs pgTAP and dblink, sets
``pgfence.test_peer_dsn`` (the connection the suites' second sessions use), runs pg_prove,
drops the database, and exits non-zero if any suite failed.

The suites in :data:`AS_OWNER` run as that owner login (made a member of the three group roles,
so that they can ``SET ROLE`` to them): they need no superuser. The others run as the admin
login, because they need a superuser by nature: the concurrency suites and 90_audit open second
sessions with dblink (which lets a non-superuser connect only with a password), 20_plan and
30_operation bypass the guard triggers with ``session_replication_role`` and 20_plan creates
roles and checks a superuser's exemption from four eyes, which 90_audit's fixtures use too.
When the admin login is not a superuser itself, every suite runs as the admin.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from pgfence.db import drop_database, resolve_dsn
from support import OWNER, install_as_owner

HERE = Path(__file__).resolve().parent
_PGENV = {
    "host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE",
    "password": "PGPASSWORD", "sslmode": "PGSSLMODE", "hostaddr": "PGHOSTADDR",
}
#: Suites that run as the installing (non-superuser) login.
AS_OWNER = {"00_core.sql", "10_outbox.sql", "40_document.sql", "99_owner.sql"}


def libpq_env(dsn: str) -> dict[str, str]:
    """``os.environ`` plus ``dsn``'s connection parameters as libpq's PG* variables (PGHOST,
    PGPORT, PGUSER, PGDATABASE, ...), for the tools that take a database name, not a DSN."""
    env = dict(os.environ)
    for key, value in conninfo_to_dict(dsn).items():
        if key in _PGENV and value is not None:
            env[_PGENV[key]] = str(value)
    return env


def install_test_database(admin: str, name: str) -> tuple[str, bool]:
    """Create database ``name`` and migrate it as :data:`support.OWNER` (``install_as_owner``).

    Returns its admin DSN and whether the owner login installed it; if so, that login is made a
    member of the three group roles (so that the suites can run as the owner).
    """
    dsn = install_as_owner(admin, name)
    with psycopg.connect(dsn, autocommit=True) as conn:
        owner = conn.execute("SELECT pg_get_userbyid(nspowner) FROM pg_namespace"
                             " WHERE nspname = 'pgfence'").fetchone()
        as_owner = bool(owner and owner[0] == OWNER)
        if as_owner:
            conn.execute(sql.SQL("GRANT pgfence_client, pgfence_executor, pgfence_admin TO {}")
                         .format(sql.Identifier(OWNER)))
    return dsn, as_owner


def main(argv: list[str]) -> int:
    admin = resolve_dsn()
    name = f"pgfence_pgtap_{os.getpid()}"
    drop_database(admin, name)
    try:
        dsn, as_owner = install_test_database(admin, name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("CREATE EXTENSION IF NOT EXISTS pgtap")
            conn.execute("CREATE EXTENSION IF NOT EXISTS dblink")
            conn.execute(
                sql.SQL("ALTER DATABASE {} SET pgfence.test_peer_dsn = {}").format(
                    sql.Identifier(name), sql.Literal(dsn)
                )
            )
        files = [a for a in argv if not a.startswith("-")] or sorted(
            str(p) for p in (HERE / "pgtap").glob("*.sql")
        )
        opts = [a for a in argv if a.startswith("-")]
        # pg_prove hands --dbname to psql as a plain name; pass the connection as PG* variables.
        env = libpq_env(dsn)
        groups = [
            ({**env, "PGUSER": OWNER}, [f for f in files if as_owner and Path(f).name in AS_OWNER]),
            (env, [f for f in files if not (as_owner and Path(f).name in AS_OWNER)]),
        ]
        code = 0
        for group_env, group in groups:
            if group:
                print(f"# pgTAP as {group_env.get('PGUSER')}: {len(group)} suites", flush=True)
                code = max(code, subprocess.run(["pg_prove", *opts, *group], check=False,
                                                env=group_env).returncode)
        return code
    finally:
        drop_database(admin, name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
