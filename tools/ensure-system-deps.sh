#!/usr/bin/env bash
# Make sure the machine has what pgfence's demo and tests need, installing it with apt when we
# are root on Debian/Ubuntu, or saying exactly what to install otherwise.
#   tools/ensure-system-deps.sh            PostgreSQL server binaries (initdb, pg_ctl, postgres)
#   tools/ensure-system-deps.sh --pgtap    ... plus pgTAP, pg_prove, the isolation tester
#                                          (pg_isolation_regress), PgBouncer, and headless Chromium
#                                          with its chromedriver for the browser tests (for `make test`)
# With DATABASE_URL set, the server binaries are not needed (only psql/pg_prove for pgTAP and
# pg_isolation_regress of the server's major version for the isolation specs).
set -euo pipefail

want_pgtap=0
[ "${1:-}" = "--pgtap" ] && want_pgtap=1

is_root() { [ "$(id -u)" = 0 ]; }
can_apt() { is_root && command -v apt-get >/dev/null 2>&1; }
apt_updated=0
apt_install() {
  if [ "$apt_updated" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    apt_updated=1
  fi
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
}

find_bindir() {
  if [ -n "${PGFENCE_PG_BINDIR:-}" ] && [ -x "$PGFENCE_PG_BINDIR/initdb" ]; then echo "$PGFENCE_PG_BINDIR"; return; fi
  if command -v pg_config >/dev/null 2>&1; then
    d=$(pg_config --bindir 2>/dev/null || true)
    if [ -n "$d" ] && [ -x "$d/initdb" ]; then echo "$d"; return; fi
  fi
  for d in $(ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -t/ -k5 -rn); do
    if [ -x "$d/initdb" ]; then echo "$d"; return; fi
  done
  if command -v initdb >/dev/null 2>&1; then dirname "$(readlink -f "$(command -v initdb)")"; return; fi
  return 1
}

if [ -z "${DATABASE_URL:-}" ]; then
  if ! bindir=$(find_bindir); then
    if can_apt; then
      echo "pgfence: installing PostgreSQL server (apt)..." >&2
      # The package would create and start a 'main' cluster; pgfence uses its own throwaway one.
      if [ ! -e /etc/postgresql-common/createcluster.conf ]; then
        mkdir -p /etc/postgresql-common
        echo "create_main_cluster = false" > /etc/postgresql-common/createcluster.conf
      fi
      apt_install postgresql postgresql-contrib
      bindir=$(find_bindir)
    else
      echo "pgfence: PostgreSQL server binaries (initdb, pg_ctl, postgres) not found." >&2
      echo "  Install them: sudo apt-get install postgresql   (Debian/Ubuntu)" >&2
      echo "  or set DATABASE_URL to an existing database you may create databases in." >&2
      exit 1
    fi
  fi
  if is_root && ! id postgres >/dev/null 2>&1; then
    echo "pgfence: running as root needs a 'postgres' system user to run the server;" >&2
    echo "  install the postgresql package (it creates it) or: useradd --system postgres" >&2
    exit 1
  fi
fi

if [ "$want_pgtap" = 1 ]; then
  command -v psql >/dev/null 2>&1 || { can_apt && apt_install postgresql-client; }
  major=""
  if [ -n "${bindir:-}" ]; then major=$("$bindir/postgres" --version | sed -E 's/[^0-9]*([0-9]+).*/\1/'); fi
  [ -z "$major" ] && major=$(psql --version | sed -E 's/[^0-9]*([0-9]+).*/\1/')
  sharedir=/usr/share/postgresql/$major
  if [ -n "${bindir:-}" ] && command -v pg_config >/dev/null 2>&1; then sharedir=$(pg_config --sharedir); fi
  have_ext=0; [ -f "$sharedir/extension/pgtap.control" ] && have_ext=1
  # With DATABASE_URL pointing elsewhere, the extension must exist on that server; we only need pg_prove here.
  [ -n "${DATABASE_URL:-}" ] && have_ext=1
  if [ "$have_ext" = 0 ] || ! command -v pg_prove >/dev/null 2>&1; then
    if can_apt; then
      echo "pgfence: installing pgTAP for PostgreSQL $major (apt)..." >&2
      apt_install "postgresql-$major-pgtap"
    else
      echo "pgfence: pgTAP and pg_prove are needed for 'make test'." >&2
      echo "  Install them: sudo apt-get install postgresql-$major-pgtap   (brings pg_prove)" >&2
      exit 1
    fi
  fi
  # The isolation specs (tests/run_isolation.py) run PostgreSQL's own isolation tester.
  # Debian ships it in postgresql-client-<major>, under the pkglibdir of that major version.
  isolation=/usr/lib/postgresql/$major/lib/pgxs/src/test/isolation/pg_isolation_regress
  if [ ! -x "$isolation" ] && command -v pg_config >/dev/null 2>&1; then
    isolation=$(pg_config --pkglibdir)/pgxs/src/test/isolation/pg_isolation_regress
  fi
  if [ ! -x "$isolation" ]; then
    if can_apt; then
      echo "pgfence: installing the isolation tester for PostgreSQL $major (apt)..." >&2
      apt_install "postgresql-client-$major"
    else
      echo "pgfence: pg_isolation_regress (PostgreSQL's isolation tester) is needed for 'make test'." >&2
      echo "  Install it: sudo apt-get install postgresql-client-$major" >&2
      exit 1
    fi
  fi
  # The pooler tests (tests/test_pgbouncer.py) run a PgBouncer of their own, on a free port.
  if ! command -v pgbouncer >/dev/null 2>&1 && [ ! -x /usr/sbin/pgbouncer ]; then
    if can_apt; then
      echo "pgfence: installing PgBouncer (apt)..." >&2
      apt_install pgbouncer
      # The package may start a pgbouncer on 127.0.0.1:6432 from /etc/pgbouncer; the tests do
      # not use it. Stop the one that the install itself started.
      if command -v service >/dev/null 2>&1; then service pgbouncer stop >/dev/null 2>&1 || true; fi
    else
      echo "pgfence: PgBouncer is needed for 'make test' (the pooler tests)." >&2
      echo "  Install it: sudo apt-get install pgbouncer" >&2
      exit 1
    fi
  fi
fi

if [ "$want_pgtap" = 1 ]; then
  # The browser tests (tests/test_web_browser.py) drive Debian's Chromium through Selenium and
  # the system chromedriver: nothing is downloaded at test time.
  if ! command -v chromium >/dev/null 2>&1 || [ ! -x /usr/bin/chromedriver ]; then
    if can_apt; then
      echo "pgfence: installing headless Chromium and chromedriver for the browser tests (apt)..." >&2
      apt_install chromium chromium-driver
    else
      echo "pgfence: Chromium and chromedriver are needed for the browser tests of 'make test'." >&2
      echo "  Install them: sudo apt-get install chromium chromium-driver   (Debian/Ubuntu)" >&2
      exit 1
    fi
  fi
fi
