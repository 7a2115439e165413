"""The ``ledgerbox`` console script, run as a user would, in subprocesses."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy import make_url
from sqlalchemy.engine import Engine

LEDGERBOX = [sys.executable, "-m", "ledgerbox"]


def _run(
    *args: str, env: dict[str, str] | None = None, cwd: Path | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*LEDGERBOX, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **(env or {})},
        cwd=cwd,
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


def _one_line(result: subprocess.CompletedProcess[str]) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.stderr
    return lines[0]


@pytest.mark.parametrize("command", ["run", "check", "purge"])
@pytest.mark.parametrize(
    ("app", "cause"),
    [
        ("nosuch.module:x", "(ModuleNotFoundError: No module named 'nosuch'): check the module"),
        ("json:nosuch", "(AttributeError: json has no attribute 'nosuch')"),
        ("json", "app must be module:attribute (got 'json')"),
        ("json:dumps", "calling it as a no-argument factory raised TypeError: "),
        ("json:__name__", "is not an InboxConsumer nor a no-argument factory of one (got str)"),
        ("buggy_app:consumer", "its module's own code raised NameError: name 'undefined_name'"),
        ("broken_dep:consumer", "its module's own code raised ModuleNotFoundError: No module"),
        ("exits:consumer", "its module's own code raised SystemExit: 3"),
        ("exits_later:build", "calling it as a no-argument factory raised SystemExit: 4"),
    ],
    ids=["no-module", "no-attribute", "no-colon", "factory-fails", "not-a-consumer",
         "module-bug", "module-missing-dependency", "module-exits", "factory-exits"],
)  # fmt: skip
def test_a_consumer_app_that_cannot_be_loaded_is_one_line_naming_the_setting(
    command: str, app: str, cause: str, tmp_path: Path
) -> None:
    # Before: a 40-50 line traceback, exit 1 (load_consumer caught only a missing colon,
    # which was a 5-line usage box).
    (tmp_path / "buggy_app.py").write_text("consumer = undefined_name\n")
    (tmp_path / "broken_dep.py").write_text("import not_installed_anywhere\n")
    # Before: a module (or factory) calling sys.exit(3) ended the command with exit 3, silently.
    (tmp_path / "exits.py").write_text("import sys\nsys.exit(3)\n")
    (tmp_path / "exits_later.py").write_text("import sys\ndef build():\n    sys.exit(4)\n")
    result = _run(
        "consumer", command, "--app", app, env={"PYTHONPATH": str(tmp_path)}, cwd=tmp_path
    )
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith("ledgerbox consumer: app "), line
    assert cause in line, line
    assert line.endswith("; set --app or LEDGERBOX_CONSUMER_APP"), line


def test_a_consumer_config_refused_while_the_app_module_is_imported_is_said_as_it_is(
    tmp_path: Path,
) -> None:
    # The module builds its ConsumerConfig at import: its refusal already names the setting.
    (tmp_path / "bad_config.py").write_text(
        "from ledgerbox.inbox import ConsumerConfig\n"
        "config = ConsumerConfig(group_id='g', topics=['t'], database_url='nonsense',"
        " kafka_bootstrap_servers='127.0.0.1:9092')\n"
    )
    result = _run(
        "consumer", "check", "--app", "bad_config:config", env={"PYTHONPATH": str(tmp_path)}
    )
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith("ledgerbox consumer check: database_url is not a PostgreSQL URL"), line


@pytest.mark.parametrize(
    "url", ["redis://:hunter2@127.0.0.1:70000/0", "http://127.0.0.1:6380/0"], ids=["port", "http"]
)
def test_consumer_check_refuses_a_redis_url_that_can_never_work_with_exit_2(url: str) -> None:
    # Before: a ValueError traceback, exit 1 ("degraded" for `check`).
    result = _run(
        "consumer", "check", "--redis-url", url,
        "--database-url", "postgresql+psycopg://u@127.0.0.1:1/x",
        "--kafka-bootstrap-servers", "127.0.0.1:1",
    )  # fmt: skip
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith("ledgerbox consumer: redis_url "), line
    assert line.endswith("; set --redis-url, LEDGERBOX_CONSUMER_REDIS_URL or REDIS_URL"), line
    assert "hunter2" not in result.stderr + result.stdout


@pytest.mark.parametrize("servers", ["127.0.0.1:70000", "bogus:host:x"], ids=["port", "colons"])
@pytest.mark.parametrize(
    ("args", "command", "prefix"),
    [
        (["relay", "run"], "relay", "RELAY"),
        (["relay", "check"], "relay", "RELAY"),
        (["consumer", "check"], "consumer", "CONSUMER"),
        (["consumer", "lag", "--group", "g"], "consumer lag", "CONSUMER"),
        (["consumer", "dlq", "list", "--dlq-topic", "o.dlq"], "consumer dlq list", "CONSUMER"),
        (["consumer", "dlq", "replay", "o.dlq:0:0"], "consumer dlq replay", "CONSUMER"),
        (["console"], "console", "CONSOLE"),
    ],
    ids=["relay-run", "relay-check", "consumer-check", "lag", "dlq-list", "dlq-replay",
         "console"],
)  # fmt: skip
def test_a_malformed_kafka_address_is_refused_by_every_command_naming_the_setting(
    servers: str, args: list[str], command: str, prefix: str
) -> None:
    # Before: OverflowError / ValueError tracebacks (exit 1) from relay check, consumer check,
    # lag, dlq list; `relay run` stayed up reporting "down".
    env = {
        "KAFKA_BOOTSTRAP_SERVERS": servers,
        "DATABASE_URL": "postgresql+psycopg://u@127.0.0.1:1/x",
    }
    result = _run(*args, env=env)
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith(
        f"ledgerbox {command}: kafka bootstrap_servers has {servers!r}, not host[:port]"
    ), line
    assert line.endswith(
        f"; set --kafka-bootstrap-servers, LEDGERBOX_{prefix}_KAFKA_BOOTSTRAP_SERVERS or "
        "KAFKA_BOOTSTRAP_SERVERS"
    ), line


@pytest.mark.parametrize("port", ["70000", "65536", "-1"])
@pytest.mark.parametrize(
    ("args", "prefix"),
    [
        (["relay", "run", "--kafka-bootstrap-servers", "127.0.0.1:1"], "relay"),
        (["consumer", "run", "--app", "nosuch:app"], "consumer"),
    ],
    ids=["relay", "consumer"],
)
def test_a_metrics_port_outside_the_tcp_range_is_refused_naming_the_flag(
    port: str, args: list[str], prefix: str
) -> None:
    # Before: 70000 raised OverflowError from bind() (a traceback), -1 named --metrics-host.
    env = {"DATABASE_URL": "postgresql+psycopg://u@127.0.0.1:1/x"}
    result = _run(*args, "--metrics-port", port, env=env)
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line == (
        f"ledgerbox {prefix}: metrics_port must be a TCP port in 1..65535 (0: off) (got {port});"
        f" set --metrics-port or LEDGERBOX_{prefix.upper()}_METRICS_PORT"
    ), line


# -- migrate: the daemons' URL checks, the revision, the login --------------------------------

#: A server address nothing listens on: a check that connected would say "unreachable".
NOWHERE = "postgresql+psycopg://ops:hunter2@127.0.0.1:1/orders"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("mysql://ops:hunter2@127.0.0.1/orders", "is not a PostgreSQL URL"),
        ("postgresql+psycopg://ops:hunter2@127.0.0.1:70000/orders", "has a port that is not"),
        ("postgresql+psycopg://ops:hunter2@127.0.0.1/orders?sslmdoe=require", "does not parse"),
    ],
    ids=["mysql", "port", "query"],
)
def test_migrate_refuses_a_url_that_can_never_work_as_the_daemons_do(url: str, why: str) -> None:
    # Before: mysql:// was a ModuleNotFoundError traceback (MySQLdb), exit 1.
    result = _run("migrate", "--database-url", url)
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith(f"ledgerbox migrate: database_url {why}"), line
    assert line.endswith("; set --database-url, LEDGERBOX_MIGRATE_DATABASE_URL or DATABASE_URL")
    assert "hunter2" not in result.stderr + result.stdout


def test_migrate_refuses_an_unknown_revision_in_one_line_listing_the_revisions() -> None:
    # Before: a 260-line traceback (alembic CommandError), exit 1. Refused before connecting.
    result = _run("migrate", "--database-url", NOWHERE, "--revision", "bogus")
    assert result.returncode == 2, result
    assert _one_line(result) == (
        "ledgerbox migrate: revision 'bogus' is not a ledgerbox schema revision: give head or "
        "one of 0001, 0002, 0003, 0004; set --revision or LEDGERBOX_MIGRATE_REVISION"
    )


def test_migrate_says_a_relative_revision_that_does_not_resolve_in_one_line(
    database_url: str,
) -> None:
    result = _run("migrate", "--database-url", database_url, "--revision", "+5")
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith("migrate failed: Relative revision +5 didn't produce 5 migrations: "), (
        line
    )
    assert "give --revision head or one of 0001, 0002, 0003, 0004" in line


def test_migrate_and_consumer_check_take_the_libpq_form_of_the_url(
    database_url: str, kafka_bootstrap: str
) -> None:
    # Before: SQLAlchemy picked psycopg2 for postgresql:// (not installed): a
    # ModuleNotFoundError traceback, exit 1, although docs/security.md promised that form.
    plain = "postgresql://" + database_url.partition("://")[2]
    result = _run("migrate", "--database-url", plain)
    assert result.returncode == 0, result.stderr
    for url in (plain, "postgresql+psycopg2://" + database_url.partition("://")[2]):
        check = _run(
            "consumer", "check", "--database-url", url, "--kafka-bootstrap-servers",
            kafka_bootstrap,
        )  # fmt: skip
        assert check.returncode == 0, check.stderr + check.stdout
        assert check.stdout.splitlines()[0] == "ok"


def test_migrate_names_the_user_and_the_database_of_a_refused_login(database_url: str) -> None:
    # Before: a wrong password or a missing database said "unreachable: start the server".
    url = make_url(database_url)
    wrong = url.set(password="not-the-password").render_as_string(hide_password=False)
    result = _run("migrate", "--database-url", wrong)
    assert result.returncode == 2, result
    line = _one_line(result)
    assert line.startswith(
        f"migrate failed: the database server at {url.host}:{url.port} refused the login of "
        f"user {url.username!r} to database {url.database!r} ("
    ), line
    assert line.endswith(
        "a wrong or missing password, an unknown user, or no database "
        f"{url.database!r} there: fix the user, the password or the database name of "
        "--database-url"
    ), line
    assert "start the server" not in line and "not-the-password" not in result.stderr
    missing = url.set(database="nosuch_db_for_migrate").render_as_string(hide_password=False)
    result = _run("migrate", "--database-url", missing)
    assert result.returncode == 2, result
    line = _one_line(result)
    assert "to database 'nosuch_db_for_migrate'" in line, line
    assert (
        "or no database 'nosuch_db_for_migrate' there: fix the user, the password or the " in line
    )


def test_migrate_prints_the_revision_the_database_is_at_and_says_when_it_is_ahead(
    database_url: str, engine: Engine
) -> None:
    # Before: `--revision 0001` on a database at 0003 printed "ledgerbox tables at 0001 (s)",
    # exit 0, the database still at 0003 (the line echoed the revision asked for).
    db = ["--database-url", database_url, "--schema", "cli_ahead"]
    first = _run("migrate", *db, "--revision", "0002")
    assert first.returncode == 0, first.stderr
    assert first.stdout.splitlines() == ["ledgerbox tables at 0002 (cli_ahead)"]
    head = _run("migrate", *db)
    assert head.stdout.splitlines() == ["ledgerbox tables at 0004 (cli_ahead)"], head
    back = _run("migrate", *db, "--revision", "0001")
    assert back.returncode == 0, back.stderr
    assert back.stdout.splitlines() == [
        "ledgerbox tables at 0004 (cli_ahead), past the requested 0001: nothing done "
        "(`ledgerbox migrate` only upgrades; to go back, stop the relays and run "
        "alembic.command.downgrade(ledgerbox.migrations.alembic_config(url, names), '0001'): "
        "docs/migrations.md)"
    ]
    with engine.connect() as conn:
        version = conn.execute(
            sa.text("SELECT version_num FROM cli_ahead.ledgerbox_alembic_version")
        )
        assert version.scalar_one() == "0004"


_NO_SERVICES = {"DATABASE_URL": "", "KAFKA_BOOTSTRAP_SERVERS": ""}


@pytest.mark.parametrize(
    ("args", "env", "said"),
    [
        (["consumer", "dlq", "list", "--dlq-topic", "o.dlq", "--older-than-s", "inf"], {},
         "ledgerbox consumer dlq list: older_than_s must be a finite number (got 'inf'); set "
         "--older-than-s"),
        (["relay", "dead", "list", "--older-than-s", "inf"], {},
         "ledgerbox relay dead list: older_than_s must be a finite number (got 'inf'); set "
         "--older-than-s"),
        (["consumer", "lag", "--group", "g"], {},
         "ledgerbox consumer lag: no Kafka bootstrap servers; set --kafka-bootstrap-servers, "
         "LEDGERBOX_CONSUMER_KAFKA_BOOTSTRAP_SERVERS or KAFKA_BOOTSTRAP_SERVERS"),
        (["consumer", "dlq", "list", "--dlq-topic", "o.dlq"], {},
         "ledgerbox consumer dlq list: no Kafka bootstrap servers; set --kafka-bootstrap-servers,"
         " LEDGERBOX_CONSUMER_KAFKA_BOOTSTRAP_SERVERS or KAFKA_BOOTSTRAP_SERVERS"),
        (["relay", "dead", "list"], {},
         "ledgerbox relay dead list: no database URL; set --database-url, "
         "LEDGERBOX_RELAY_DATABASE_URL or DATABASE_URL"),
        (["relay", "check", "--kafka-bootstrap-servers", ""],
         {"DATABASE_URL": "postgresql+psycopg://u@127.0.0.1:1/x"},
         "ledgerbox relay: kafka bootstrap_servers must not be empty (got ''); set "
         "--kafka-bootstrap-servers, LEDGERBOX_RELAY_KAFKA_BOOTSTRAP_SERVERS or "
         "KAFKA_BOOTSTRAP_SERVERS"),
    ],
    ids=["dlq-older-than", "dead-older-than", "lag-kafka", "dlq-kafka", "dead-database",
         "relay-empty-kafka"],
)  # fmt: skip
def test_a_refusal_names_the_full_command_and_only_the_ways_it_reads(
    args: list[str], env: dict[str, str], said: str
) -> None:
    # Before: "ledgerbox consumer: ... set --older-than-s or LEDGERBOX_CONSUMER_OLDER_THAN_S"
    # (a variable dlq never reads, and not the command's name); the lag/dlq/dead hints left
    # out the LEDGERBOX_* variable that works; an empty --kafka-bootstrap-servers offered
    # "(or give kafka=KafkaSettings(...))", advice for Python callers.
    result = _run(*args, env={**_NO_SERVICES, **env})
    assert result.returncode == 2, result
    assert _one_line(result) == said


def test_the_help_shows_brackets_and_every_log_level() -> None:
    # Before: console --help showed "one [] table per service" (rich ate "[[service]]" as
    # markup); --log-level listed DEBUG, INFO, WARNING though ERROR is accepted.
    console = _run("console", "--help", env={"COLUMNS": "300"})
    assert "one [[service]] table per service" in console.stdout, console.stdout
    for args in (["console"], ["relay", "run"], ["consumer", "run"]):
        result = _run(*args, "--help", env={"COLUMNS": "300"})
        assert "Logging level (DEBUG, INFO, WARNING or ERROR)" in result.stdout, result.stdout
