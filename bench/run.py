"""``make bench``: every benchmark module, one JSON file of results, a printed table.

Runs against ``$DATABASE_URL`` (``make bench`` starts a throwaway cluster with fsync on). Each
module ``bench/<name>.py`` exposes ``run(dsn) -> dict`` and prints its own numbers; this driver
gives each its own fresh, migrated database and writes ``bench/results/<UTC time>.json`` and
``bench/results/latest.json``.

Usage: ``python bench/run.py [module ...]`` (default: every module in MODULES that exists).
"""

from __future__ import annotations

import datetime as dt
import importlib
import json
import os
import platform
import sys
from pathlib import Path
from typing import Any

import psycopg

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from pgfence.db import create_database, drop_database, resolve_dsn  # noqa: E402
from pgfence.migrate import migrate  # noqa: E402

MODULES = ["outbox", "outbox_pressure", "executor", "plan", "operation", "claims", "document",
           "web"]


def main(argv: list[str]) -> int:
    wanted = argv or [m for m in MODULES if (HERE / f"{m}.py").exists()]
    admin = resolve_dsn()
    with psycopg.connect(admin) as conn:
        settings = dict(conn.execute(
            "SELECT name, setting FROM pg_settings WHERE name IN ('fsync', 'synchronous_commit',"
            " 'shared_buffers', 'server_version')").fetchall())
    results: dict[str, Any] = {
        "at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                    "platform": platform.platform()},
        "postgres": settings,
    }
    print(f"PostgreSQL {settings.get('server_version')} fsync={settings.get('fsync')} "
          f"synchronous_commit={settings.get('synchronous_commit')}, {os.cpu_count()} CPUs\n")
    for name in wanted:
        db = f"pgfence_bench_{name}"
        drop_database(admin, db)
        dsn = create_database(admin, db)
        try:
            migrate(dsn)
            module = importlib.import_module(name)
            results[name] = module.run(dsn)
        finally:
            drop_database(admin, db)
        print()
    out = HERE / "results"
    out.mkdir(exist_ok=True)
    stamp = dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    for path in (out / f"{stamp}.json", out / "latest.json"):
        path.write_text(json.dumps(results, indent=2, default=str))
    print(f"results written to {out / (stamp + '.json')}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
