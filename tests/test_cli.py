"""The ``pgfence`` CLI against a real database (click's runner, in-process)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import psycopg
import pytest
from click.testing import CliRunner

from pgfence.cli import main


def run(dsn: str, *args: str, code: int = 0) -> str:
    result = CliRunner().invoke(main, ["--dsn", dsn, *args], catch_exceptions=False)
    assert result.exit_code == code, result.output
    return result.output


def test_migrate_twice_via_cli(empty_db: str) -> None:
    assert "applied migrations: 0001_core" in run(empty_db, "migrate")
    assert "no pending migrations" in run(empty_db, "migrate")


def test_enqueue_show_list_requeue_status(db: str) -> None:
    mid = int(run(db, "outbox", "enqueue", "--channel", "hooks", "--recipient",
                  "http://127.0.0.1:9/x", "--key", "cli-1", '{"hello": "world"}').strip())
    assert run(db, "outbox", "enqueue", "--channel", "hooks", "--recipient",
               "http://127.0.0.1:9/x", "--key", "cli-1", '{"hello": "again"}').strip() \
        == f"deduplicated: existing id {mid}"
    shown = json.loads(run(db, "outbox", "show", str(mid), "--json"))
    assert (shown["status"], shown["payload"], shown["idempotency_key"]) == \
        ("pending", {"hello": "world"}, "cli-1")
    listed = json.loads(run(db, "outbox", "list", "--channel", "hooks", "--json"))
    assert [m["id"] for m in listed] == [mid]
    status = json.loads(run(db, "status", "--json", code=1))  # 1: hooks has no executor
    assert status["outbox"][0]["channel"] == "hooks" and status["outbox"][0]["messages"] == 1
    assert "pending" in run(db, "status", code=1)
    # a dead message can be requeued from the CLI
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT * FROM pgfence.outbox_claim('w', 1)")
        conn.execute("SELECT pgfence.outbox_mark_failed(%s, 1, 'boom', false)", (mid,))
    assert "requeued (now pending)" in run(db, "outbox", "requeue", str(mid))
    shown = json.loads(run(db, "outbox", "show", str(mid), "--json"))
    assert (shown["status"], shown["attempts"], shown["max_attempts"]) == ("pending", 1, 11)


def test_enqueue_reads_the_payload_from_a_file_or_stdin(db: str, tmp_path: Path) -> None:
    body = tmp_path / "payload.json"
    body.write_text('{"from": "file"}', encoding="utf-8")
    from_file = int(run(db, "outbox", "enqueue", "--channel", "c", "--recipient", "r",
                        f"@{body}").strip())
    result = CliRunner().invoke(main, ["--dsn", db, "outbox", "enqueue", "--channel", "c",
                                       "--recipient", "r", "--ordering-key", "order-7", "-"],
                                input='{"from": "stdin"}', catch_exceptions=False)
    assert result.exit_code == 0, result.output
    from_stdin = int(result.output.strip())
    assert json.loads(run(db, "outbox", "show", str(from_file), "--json"))["payload"] == {"from": "file"}
    shown = json.loads(run(db, "outbox", "show", str(from_stdin), "--json"))
    assert (shown["payload"], shown["ordering_key"], shown["status"]) == \
        ({"from": "stdin"}, "order-7", "pending")
    out = run(db, "outbox", "enqueue", "--channel", "c", "--recipient", "r",
              f"@{tmp_path / 'missing.json'}", code=2)
    assert "missing.json" in out and "Traceback" not in out


def test_cancel_from_the_cli(db: str) -> None:
    mid = int(run(db, "outbox", "enqueue", "--channel", "c", "--recipient", "r", "{}").strip())
    assert f"outbox#{mid} canceled" in run(db, "outbox", "cancel", str(mid), "--by", "alice",
                                            "--reason", "withdrawn")
    assert json.loads(run(db, "outbox", "show", str(mid), "--json"))["status"] == "canceled"
    out = run(db, "outbox", "cancel", str(mid), "--by", "alice", "--reason", "again", code=1)
    assert "is canceled" in out
    assert "canceled" in run(db, "outbox", "list", "--status", "canceled")


def test_payload_over_the_channel_bound_is_one_clear_line(db: str) -> None:
    run(db, "outbox", "configure", "small", "--max-payload-bytes", "64")
    out = run(db, "outbox", "enqueue", "--channel", "small", "--recipient", "r",
              json.dumps({"blob": "x" * 200}), code=1)
    assert "[PF004]" in out and "Traceback" not in out


def test_requeue_of_a_sent_message_is_refused(db: str) -> None:
    mid = int(run(db, "outbox", "enqueue", "--channel", "c", "--recipient", "r", "{}").strip())
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("SELECT * FROM pgfence.outbox_claim('w', 1)")
        conn.execute("SELECT pgfence.outbox_mark_sent(%s, 1)", (mid,))
    out = run(db, "outbox", "requeue", str(mid), code=1)
    assert "is sent" in out


def test_errors_are_one_clear_line_with_sqlstate(db: str) -> None:
    out = run(db, "outbox", "enqueue", "--channel", "Bad Name", "--recipient", "r", "{}", code=1)
    assert "invalid channel name" in out and "[22023]" in out and "hint:" in out
    out = run(db, "outbox", "show", "999999", code=1)
    assert "[P0002]" in out
    out = run(db, "outbox", "enqueue", "--channel", "c", "--recipient", "r", "not json", code=2)
    assert "not JSON" in out


def test_configure_channel(db: str) -> None:
    row = json.loads(run(db, "outbox", "configure", "hooks", "--max-attempts", "3", "--lease", "30",
                         "--log-events", "--json"))
    assert (row["max_attempts"], row["lease"], row["log_events"]) == (3, 30.0, True)


def test_configure_a_limit_per_host(db: str) -> None:
    row = json.loads(run(db, "outbox", "configure", "hosts", "--limit-key", "host",
                         "--key-max-in-flight", "2", "--json"))
    assert (row["limit_key"], row["key_max_in_flight"]) == ("host", 2)
    mid = int(run(db, "outbox", "enqueue", "--channel", "hosts", "--recipient",
                  "https://Hooks.example.com/in", "{}").strip())
    assert json.loads(run(db, "outbox", "show", str(mid), "--json"))["ordering_key"] == \
        "host:hooks.example.com"
    row = json.loads(run(db, "outbox", "configure", "hosts", "--limit-key", "none", "--json"))
    assert row["limit_key"] is None
    out = run(db, "outbox", "configure", "hosts", "--limit-key", "ip", code=2)
    assert "Traceback" not in out


def test_no_database_is_a_clear_message(tmp_path: object) -> None:
    result = CliRunner().invoke(main, ["status"], env={"DATABASE_URL": None,
                                                      "PGFENCE_STATE_DIR": str(tmp_path)})
    assert result.exit_code == 2  # status: 2 = the database could not be read
    assert "No database: set DATABASE_URL" in result.output


def test_executor_config_is_validated(db: str, tmp_path: object) -> None:
    from pathlib import Path

    bad = Path(str(tmp_path)) / "bad.toml"
    bad.write_text('[executor]\nplans = false\n[routes]\nx = "noop"\n')
    out = run(db, "executor", "--config", str(bad), code=2)
    assert "'false' is not one of 'start', 'external', 'off'" in out
    bad.write_text('[executor]\nconcurency = 4\n[routes]\nx = "noop"\n')
    assert "unknown setting(s) concurency" in run(db, "executor", "--config", str(bad), code=2)
    bad.write_text('[route]\nx = "noop"\n')
    assert "unknown table(s) route" in run(db, "executor", "--config", str(bad), code=2)


def test_executor_shares_are_validated(db: str, tmp_path: object) -> None:
    from pathlib import Path

    out = run(db, "executor", "--route", "x=noop", "--share", "plan=2", code=2)
    assert "no module plan runs here (modules: outbox)" in out
    assert "expected a whole number from 1 to 1000, got '0'" in run(
        db, "executor", "--route", "x=noop", "--share", "outbox=0", code=2)
    bad = Path(str(tmp_path)) / "shares.toml"
    bad.write_text('[routes]\nx = "noop"\n[shares]\noutbox = "two"\n')
    assert "outbox must be a whole number from 1 to 1000, got 'two'" in run(
        db, "executor", "--config", str(bad), code=2)
    out = run(db, "executor", "--route", "x=noop", "--prefetch-wait", "-1", code=2)
    assert "is not in the range 0<=x<=60" in out


def _config(tmp_path: object, executor: str, routes: str = 'x = "bogus-transport"') -> str:
    from pathlib import Path

    path = Path(str(tmp_path)) / "executor.toml"
    path.write_text(f"[executor]\n{executor}\n[routes]\n{routes}\n")
    return str(path)


# Settings that pass get as far as the routes: "bogus-transport" then stops the command.
ACCEPTED = "unknown transport 'bogus-transport'"


@pytest.mark.parametrize(("setting", "message"), [
    ("concurrency = -5", "-5 is not in the range 1<=x<=10000"),
    ("poll_interval = 0", "is not in the range 0.05<=x<=3600"),
    ("concurrency = \"many\"", "'many' is not a valid integer"),
    ("concurrency = 2.5", "'2.5' is not a valid integer"),
    ("concurrency = [1]", "expected a single value"),
    ("grace = true", "'true' is not a valid float"),
    ("log_level = \"loud\"", "'loud' is not one of 'debug', 'info', 'warning', 'error'"),
    ("query_timeout = 0.1", "is not in the range 0.5<=x<=3600"),
])
def test_executor_file_settings_fail_like_options(db: str, tmp_path: object, setting: str,
                                                  message: str) -> None:
    out = run(db, "executor", "--config", _config(tmp_path, setting), code=2)
    key = setting.split(" =")[0]
    assert message in out and f"'[executor] {key}'" in out, out
    assert "Traceback" not in out
    # the same value as an option: the same message
    value = setting.split("= ", 1)[1].strip('"')
    if not value.startswith("["):
        flag = "--" + key.replace("_", "-")
        assert message in run(db, "executor", flag, value.lower(), "--route", "x=noop", code=2)


def test_executor_file_settings_accepted_and_overridden(db: str, tmp_path: object) -> None:
    good = ('concurrency = 4\npoll_interval = 0.5\nlog_level = "debug"\nprepare = false\n'
            'listen_dsn = "host=/tmp"\nprobe_interval = 1\nworker_id = "w-1"')
    assert ACCEPTED in run(db, "executor", "--config", _config(tmp_path, good), code=2)
    # an option wins over the file: the bad file value is never used
    assert ACCEPTED in run(db, "executor", "--config", _config(tmp_path, "concurrency = -5"),
                           "--concurrency", "4", code=2)


def test_executor_config_file_shape_errors_are_one_line(db: str, tmp_path: object) -> None:
    from pathlib import Path

    path = Path(str(tmp_path)) / "executor.toml"
    path.write_text("[executor\nconcurrency = 4\n")
    assert "is not valid TOML" in run(db, "executor", "--config", str(path), code=2)
    path.write_text('executor = 5\n[routes]\nx = "noop"\n')
    assert "[executor] must be a table" in run(db, "executor", "--config", str(path), code=2)
    path.write_text("[routes]\nx = 5\n")
    assert "x must be a string" in run(db, "executor", "--config", str(path), code=2)


@contextmanager
def client_login(db: str, name: str) -> Iterator[str]:
    """A login role in pgfence_client only, dropped afterwards; yields a DSN for it."""
    from psycopg.conninfo import conninfo_to_dict, make_conninfo

    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute(f"DROP ROLE IF EXISTS {name}")
        conn.execute(f"CREATE ROLE {name} LOGIN IN ROLE pgfence_client")
    try:
        params = conninfo_to_dict(db)
        params["user"] = name
        yield make_conninfo("", **params)
    finally:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute(f"DROP ROLE {name}")


@pytest.mark.timeout(60)
def test_executor_without_the_executor_role_stops_at_start_naming_the_grant(db: str) -> None:
    with client_login(db, "pgfence_test_noexec") as dsn:
        out = run(dsn, "executor", "--route", "x=noop", code=1)
    assert "may not execute pgfence.outbox_claim(text, integer, text[], interval)" in out, out
    assert "hint: GRANT pgfence_executor TO pgfence_test_noexec;" in out
    assert "[42501]" in out and "Traceback" not in out


def test_every_function_a_module_needs_exists(conn: psycopg.Connection) -> None:
    from pgfence.executor import OutboxModule
    from pgfence.operation.module import OperationModule
    from pgfence.plan.module import PlanModule

    for module in (OutboxModule, PlanModule, OperationModule):
        for signature in module.functions:
            assert conn.execute("SELECT to_regprocedure(%s)", (signature,)).fetchone() != (None,), \
                f"{module.__name__} names {signature}, which does not exist"


def test_permission_denied_is_one_line_with_a_hint(db: str) -> None:
    with client_login(db, "pgfence_test_client") as dsn:
        out = run(dsn, "outbox", "list", code=1)
    assert "[42501]" in out and "lacks the pgfence role" in out and "Traceback" not in out


def test_migrate_break_lock(db: str) -> None:
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("INSERT INTO pgfence.yoyo_lock (locked, ctime, pid) VALUES (1, now(), 999999)")
    out = run(db, "migrate", "--lock-timeout", "1", code=1)
    assert "has locked this database" in out and "--break-lock" in out
    assert "no pending migrations" in run(db, "migrate", "--break-lock")


def test_out_of_range_input_is_a_usage_error(db: str) -> None:
    assert "not in the range" in run(db, "outbox", "show", "99999999999999999999", code=2)
    assert "not in the range" in run(db, "outbox", "enqueue", "--channel", "c", "--recipient", "r",
                                     "--delay", "1e20", "{}", code=2)


def test_executor_command_imports_only_what_it_runs() -> None:
    """`pgfence executor` loads its own command, not the others' libraries (its first claim
    does not wait for them); `pgfence --help` still lists every command."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from click.testing import CliRunner\n"
        "from pgfence.cli import main\n"
        "r = CliRunner().invoke(main, ['executor', '--help'])\n"
        "assert r.exit_code == 0, r.output\n"
        "heavy = ['yoyo', 'tabulate', 'prometheus_client', 'starlette', 'uvicorn', 'tomllib',\n"
        "         'psycopg_pool', 'pgfence.documents', 'pgfence.plan.module', 'pgfence.migrate',\n"
        "         'pgfence.embedded', 'pgfence.cli.status', 'pgfence.cli.serve']\n"
        "print([m for m in heavy if m in sys.modules])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    assert out.strip() == "[]", out
    listed = CliRunner().invoke(main, ["--help"]).output
    for name in ("db", "demo", "doc", "executor", "inspect", "metrics", "migrate", "op",
                 "outbox", "plan", "purge", "serve", "status", "token"):
        assert f"\n  {name} " in listed, name
