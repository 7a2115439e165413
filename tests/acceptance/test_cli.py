"""The ``ledgerbox`` console script, run as a user would, in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys

import sqlalchemy as sa
from sqlalchemy.engine import Engine

LEDGERBOX = [sys.executable, "-m", "ledgerbox"]


def _run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LEDGERBOX, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        check=False,
    )


def test_help_lists_the_daemons_and_operations() -> None:
    result = _run("--help")
    assert result.returncode == 0, result.stderr
    for command in ("migrate", "relay", "consumer"):
        assert command in result.stdout


def test_migrate_creates_the_tables_in_a_chosen_schema(database_url: str, engine: Engine) -> None:
    first = _run("migrate", "--database-url", database_url, "--schema", "cli_app")
    assert first.returncode == 0, first.stderr
    again = _run(
        "migrate", env={"DATABASE_URL": database_url, "LEDGERBOX_MIGRATE_SCHEMA": "cli_app"}
    )
    assert again.returncode == 0, again.stderr  # idempotent, and flags mirrored by env vars
    assert again.stderr == ""
    with engine.connect() as conn:
        tables = set(sa.inspect(conn).get_table_names(schema="cli_app"))
    assert {"outbox", "inbox", "outbox_relay_lease", "outbox_relay_member"} <= tables


def test_migrate_still_reads_the_deprecated_variables_and_says_so_once(
    database_url: str, engine: Engine
) -> None:
    env = {"DATABASE_URL": database_url, "LEDGERBOX_SCHEMA": "cli_old"}
    result = _run("migrate", env=env)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        "ledgerbox: LEDGERBOX_SCHEMA is deprecated, use LEDGERBOX_MIGRATE_SCHEMA"
    ]
    assert "(cli_old)" in result.stdout
    with engine.connect() as conn:
        assert "outbox" in sa.inspect(conn).get_table_names(schema="cli_old")


def test_migrate_without_a_database_url_is_one_line_with_exit_code_2() -> None:
    env = {k: v for k, v in os.environ.items() if k != "DATABASE_URL"}
    result = subprocess.run(
        [*LEDGERBOX, "migrate"], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "ledgerbox migrate: no database URL; "
        "set --database-url, LEDGERBOX_MIGRATE_DATABASE_URL or DATABASE_URL"
    ]


def test_migrate_reports_a_bad_url_with_exit_code_2() -> None:
    result = _run("migrate", "--database-url", "postgresql+psycopg://nobody@127.0.0.1:1/none")
    assert result.returncode == 2
    assert "migrate failed" in result.stderr


def test_bad_table_name_is_a_clear_error(database_url: str) -> None:
    result = _run("migrate", "--database-url", database_url, "--outbox-table", "Bad-Name")
    assert result.returncode == 2
    assert "not a valid SQL identifier" in result.stderr
    assert result.stderr.splitlines() == [
        "ledgerbox migrate: outbox table 'Bad-Name' is not a valid SQL identifier: use "
        "[a-z_][a-z0-9_]*, at most 63 chars; set --outbox-table or LEDGERBOX_MIGRATE_OUTBOX_TABLE"
    ]
