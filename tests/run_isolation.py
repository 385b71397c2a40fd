"""Run the isolation-tester specs (tests/isolation/specs/*.spec) against a fresh migrated database.

Usage: ``python tests/run_isolation.py [--accept] [spec names]`` with ``$DATABASE_URL`` pointing
at a server where the user may create databases (``make test`` starts a throwaway one). Creates
``pgfence_iso_<pid>`` and migrates it as the non-superuser login ``support.OWNER``, exactly as
tests/run_pgtap.py does, then runs PostgreSQL's own ``pg_isolation_regress`` (from
``postgresql-client-<major>``: ``$(pg_config --pkglibdir)/pgxs/src/test/isolation/``) with
``--use-existing`` on it. Each spec's sessions are real backends whose steps the isolation tester
interleaves exactly as its permutations say; a step that blocks is detected from the lock table
(``pg_isolation_test_session_is_blocked``), not by waiting a while, so the output is the same on
every run and is compared with tests/isolation/expected/<spec>.out. On a difference the runner
prints regression.diffs and exits non-zero; the database is dropped in any case.

The specs run as the owner login (made a member of the three group roles), except those in
:data:`AS_ADMIN`, which run as the admin login for the reason given there. When the admin login
is not a superuser itself (the owner did not install), every spec runs as the admin.
``--accept`` copies each spec's actual output over its expected file (to write a new spec's
expected output, or to take a deliberate change: read the diff first).
A step that neither finishes nor blocks is canceled after ``PGISOLATIONTIMEOUT`` seconds
(:data:`STEP_TIMEOUT` unless set), which fails the spec instead of hanging the run.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import psycopg

from pgfence.db import drop_database, resolve_dsn
from run_pgtap import install_test_database, libpq_env
from support import OWNER

HERE = Path(__file__).resolve().parent
ISOLATION = HERE / "isolation"
#: Specs that run as the admin login, and why (the isolation tester opens every session of a
#: spec with the same login).
AS_ADMIN = {
    "plan-concurrency": "proposes and approves plans from one login (four eyes exempts only a superuser)",
}
#: Seconds a step may run without finishing or blocking before the tester cancels it.
STEP_TIMEOUT = 60


def find_isolation_regress(major: int) -> Path:
    """The ``pg_isolation_regress`` of PostgreSQL ``major`` (the server's major version).

    Looks in Debian's /usr/lib/postgresql/<major>/lib/pgxs/src/test/isolation/, then in
    ``$(pg_config --pkglibdir)/pgxs/src/test/isolation/`` if that pg_config is of the same
    major version. Raises SystemExit with what to install when there is none.
    """
    candidates = [Path(f"/usr/lib/postgresql/{major}/lib")]
    try:
        out = subprocess.run(["pg_config", "--version", "--pkglibdir"], capture_output=True,
                             text=True, timeout=30, check=True).stdout.split("\n")
        if out[0].split()[1].split(".")[0] == str(major):
            candidates.append(Path(out[1].strip()))
    except (OSError, subprocess.SubprocessError, IndexError):
        pass
    for libdir in candidates:
        tool = libdir / "pgxs" / "src" / "test" / "isolation" / "pg_isolation_regress"
        if os.access(tool, os.X_OK):
            return tool
    raise SystemExit(
        f"pg_isolation_regress for PostgreSQL {major} not found (looked in "
        f"{', '.join(str(c) for c in candidates)}/pgxs/src/test/isolation/).\n"
        f"  Install it: sudo apt-get install postgresql-client-{major}   "
        "(or run tools/ensure-system-deps.sh --pgtap as root)"
    )


def run_group(tool: Path, env: dict[str, str], dbname: str, specs: list[str], out: Path,
              accept: bool = False) -> int:
    """Run ``specs`` with ``pg_isolation_regress`` on the existing database ``dbname`` (the
    connection from ``env``'s PG* variables); results go to ``out``. Prints regression.diffs
    when a spec's output differs from its expected file; with ``accept``, copies every result
    to tests/isolation/expected/ instead. Returns the tool's exit status (0 after ``accept``)."""
    out.mkdir(parents=True)
    cmd = [str(tool), "--use-existing", f"--dbname={dbname}", f"--inputdir={ISOLATION}",
           f"--outputdir={out}", *specs]
    code = subprocess.run(cmd, env=env, check=False).returncode
    if accept:
        for spec in specs:
            result = out / "results" / f"{spec}.out"
            if result.exists():
                shutil.copyfile(result, ISOLATION / "expected" / f"{spec}.out")
                print(f"# accepted {result.name}", flush=True)
        return 0
    diffs = out / "regression.diffs"
    if code != 0 and diffs.exists():
        print(diffs.read_text(), flush=True)
    return code


def main(argv: list[str]) -> int:
    accept = "--accept" in argv
    argv = [a for a in argv if a != "--accept"]
    admin = resolve_dsn()
    specs = argv or sorted(p.stem for p in (ISOLATION / "specs").glob("*.spec"))
    name = f"pgfence_iso_{os.getpid()}"
    drop_database(admin, name)
    try:
        dsn, as_owner = install_test_database(admin, name)
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute("SELECT current_setting('server_version_num')::int / 10000").fetchone()
        tool = find_isolation_regress(int(row[0]) if row else 0)
        env = libpq_env(dsn)
        env.pop("PGDATABASE", None)
        env.setdefault("PGISOLATIONTIMEOUT", str(STEP_TIMEOUT))
        groups = [
            ("owner", {**env, "PGUSER": OWNER}, [s for s in specs if as_owner and s not in AS_ADMIN]),
            ("admin", env, [s for s in specs if not (as_owner and s not in AS_ADMIN)]),
        ]
        code = 0
        with tempfile.TemporaryDirectory(prefix="pgfence-isolation-") as tmp:
            for label, group_env, group in groups:
                if group:
                    print(f"# isolation specs as {group_env.get('PGUSER')}: {', '.join(group)}",
                          flush=True)
                    code = max(code, run_group(tool, group_env, name, group, Path(tmp) / label,
                                                     accept))
        return code
    finally:
        drop_database(admin, name)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
