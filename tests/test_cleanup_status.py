"""``pgfence status`` names what holds back cleanup (issue 14): a real second session holding a
REPEATABLE READ snapshot is the oldest holder named on status's cleanup line, with its pid and age; past
``pgfence.cleanup_warn_after`` the line warns; the JSON carries every holder and the hot tables'
dead rows."""

from __future__ import annotations

import json

import psycopg
from click.testing import CliRunner

from pgfence.cli import main


def run(dsn: str, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, ["--dsn", dsn, *args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def cleanup_lines(output: str) -> list[str]:
    """The cleanup line of ``pgfence status`` (right after the health line) and what follows."""
    lines = output.splitlines()
    assert lines[0].startswith("health: "), lines[0]
    return lines[1:]


def test_status_names_the_oldest_snapshot_holder_and_warns_past_the_threshold(db: str) -> None:
    # (an autovacuum worker may hold an xmin for a moment: only this test's sessions are asserted)
    assert cleanup_lines(run(db, "status"))[0].startswith("cleanup: ")
    with psycopg.connect(db, application_name="report-holder") as holder:
        holder.execute("SET TRANSACTION ISOLATION LEVEL REPEATABLE READ")
        holder.execute("SELECT count(*) FROM pgfence.outbox").fetchone()  # takes the snapshot
        pid = holder.info.backend_pid
        first = cleanup_lines(run(db, "status"))[0]
        assert first.startswith(f"cleanup: oldest holder transaction pid {pid} (report-holder),"
                                " idle in transaction, open "), first
        assert "xmin age" in first and "WARNING" not in run(db, "status")
        out = json.loads(run(db, "status", "--json"))
        [mine] = [b for b in out["cleanup_blockers"] if b["pid"] == pid]
        assert (mine["kind"], mine["warn"]) == ("transaction", False)
        assert {t["table_name"] for t in out["tables"]} >= {"outbox", "plan", "operation"}
        with psycopg.connect(db, autocommit=True) as admin:
            dbname = admin.info.dbname
            admin.execute(f'ALTER DATABASE "{dbname}" SET pgfence.cleanup_warn_after = \'0\'')
        lines = cleanup_lines(run(db, "status", code=1))
        assert lines[0].startswith(f"cleanup: oldest holder transaction pid {pid}"), lines[0]
        assert lines[1].startswith("WARNING: it holds back VACUUM past pgfence.cleanup_warn_after"
                                   " (0:00:00)"), lines[1]
        out = json.loads(run(db, "status", "--json", code=1))
        assert [w["kind"] for w in out["warnings"]] == ["cleanup"], out["warnings"]
        holder.rollback()
        with psycopg.connect(db, autocommit=True) as admin:
            admin.execute(f'ALTER DATABASE "{dbname}" RESET pgfence.cleanup_warn_after')
    assert f"pid {pid} " not in cleanup_lines(run(db, "status"))[0], "once it ends it is not named"
