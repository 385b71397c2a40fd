"""Run the pgTAP suites with pg_prove against a fresh, migrated database.

Usage: ``python tests/run_pgtap.py [pg_prove args] [files]`` with ``$DATABASE_URL`` pointing at
a server where the user may create databases (``make test`` starts a throwaway one). Creates
``pgfence_pgtap_<pid>``, migrates it, installs pgTAP and dblink, sets
``pgfence.test_peer_dsn`` (the connection the suites' second sessions use), runs pg_prove,
drops the database, and exits with pg_prove's status.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from psycopg.conninfo import conninfo_to_dict

from pgfence.db import create_database, drop_database, resolve_dsn
from pgfence.migrate import migrate

HERE = Path(__file__).resolve().parent
_PGENV = {
    "host": "PGHOST", "port": "PGPORT", "user": "PGUSER", "dbname": "PGDATABASE",
    "password": "PGPASSWORD", "sslmode": "PGSSLMODE", "hostaddr": "PGHOSTADDR",
}


def main(argv: list[str]) -> int:
    admin = resolve_dsn()
    name = f"pgfence_pgtap_{os.getpid()}"
    drop_database(admin, name)
    dsn = create_database(admin, name)
    try:
        migrate(dsn)
        import psycopg
        from psycopg import sql

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
        env = dict(os.environ)
        for key, value in conninfo_to_dict(dsn).items():
            if key in _PGENV and value is not None:
                env[_PGENV[key]] = str(value)
        proc = subprocess.run(["pg_prove", *opts, *files], check=False, env=env)
        return proc.returncode
    finally:
        drop_database(admin, name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
